#!/usr/bin/env bash
# Device call (session 32, issue 14): batch buckets with a 1.5x step between powers of two (kiln/runtime/buckets.py
# batch_steps "half": 12, 24, 48) against powers of two, for served BERT-base. bench/results/serve-buckets-2026-12-07.md.
# 1. bench/serve_graphs_probe.py --bucket-steps (no server): BERT-base fp16, batch 1..64 x seq 128, one context per
#    setting as an instance makes it (warm-up twice): each context's graphs, their MiB and warm-up seconds; each batch
#    bucket's replay ms at capture (pow2: 1 2 4 8 16 32 64; half adds 12 24 48); per batch size (9..16, 20, 24, 28,
#    40, 48) what each runs (its bucket, or a split's chunks, buckets.split on the measured replays) and the call's
#    wall and span, device tensors in/out and numpy in/out, pow2 and half interleaved, medians over --rounds.
# 2. if time is left (<= 150 s in all): bench/serve.py as gpu_s31d.sh's part 2 runs it (BERT-base, 2 instances,
#    batching on, gRPC, 8 front ends, 8 wire client processes, c = 64, --cuda-sync spin), kiln serve --batch-buckets
#    pow2 vs half: a server each (requests/call, call ms, GPU span, graph replays/captures per call, infer/s).
#   run's carry: [".whl-serve"] (bash bench/serve_gpu.sh --fetch here first; part 2 is skipped without it);
#   probe.txt, serve.md and the log in $OUT.
# Runs on the device's python3 (torch 2.11, no pip install but part 2's wheels into /tmp/serve-deps) from the repo
# root. Without CUDA it stops at once, saying so.
# Estimate (gpu_s31d.sh: export + build 37 s; serve.py ~85 s for two servers with their builds): the probe ~50 s at
# --rounds 2 (17 graphs to capture, 12 x 2 x 2 x 2 x 23 calls of 1-4 ms); part 2 gets what is left (its table is
# rewritten after every row: a cut run keeps the rows done).
# Options by environment: BUDGET_S (default 150), PROBE_S (default 65; 0: skip 1), PROBE_ARGS (the probe's flags after
# --bucket-steps; default "--calls 20 --rounds 2"), STEPS (default "pow2 half"), SERVE_CONCURRENCY (default 64),
# SERVE_PROCESSES (default 8), FRONTENDS (default 8), SERVE_MIN_S (part 2 runs only with this much of the budget left;
# default 60).
set -u
START=$(date +%s)
BUDGET_S=${BUDGET_S:-150}
export OUT=${OUT:-/tmp/kiln-s32a}; mkdir -p "$OUT"
export KILN_COMMIT=${KILN_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
echo "== kiln $KILN_COMMIT, $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1), $(nproc) CPUs, load $(cut -d' ' -f1 /proc/loadavg)"
if ! python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_s32a.sh: python3 has no torch with a CUDA device here; this script measures the GPU paths only: stopping"
  exit 2
fi

PROBE_S=${PROBE_S:-65}
if [ "$PROBE_S" != "0" ]; then
  echo "== 1. bench/serve_graphs_probe.py --bucket-steps (<= $PROBE_S s)"
  # shellcheck disable=SC2086
  timeout "$PROBE_S" python3 bench/serve_graphs_probe.py --bucket-steps ${PROBE_ARGS:---calls 20 --rounds 2} \
    > "$OUT/probe.txt" 2>&1
  echo "probe exit $?"
  # the per-round rows are in probe.txt; here the contexts, the replay table and the medians
  grep -vE "Warning|warn\(|^\s*$|^\| [0-9]+ \| (device|numpy) \| [0-9]+ \|" "$OUT/probe.txt" | cut -c1-260 | tail -60
fi

LEFT=$(( BUDGET_S - ($(date +%s) - START) - 10 ))
if [ ! -d .whl-serve ]; then
  echo "== 2. skipped: no .whl-serve (bash bench/serve_gpu.sh --fetch on the CPU machine, then carry it)"
elif [ "$LEFT" -lt "${SERVE_MIN_S:-60}" ]; then
  echo "== 2. skipped: $LEFT s of the ${BUDGET_S} s budget left (SERVE_MIN_S ${SERVE_MIN_S:-60})"
else
  echo "== 2. bench/serve.py, BERT-base, 2 instances, batching on, --batch-buckets ${STEPS:-pow2 half} ($(( $(date +%s) - START )) s in, $LEFT s left)"
  GPU_TESTS=0 FRONTEND_TESTS=0 FRONTENDS="${FRONTENDS:-8}" STAGING_MIB=64 SERVE_MODELS=bert_base \
    SERVE_CONCURRENCY="${SERVE_CONCURRENCY:-64}" SERVE_PROCESSES="${SERVE_PROCESSES:-8}" SERVE_BENCH_S=$(( LEFT - 15 )) \
    SERVE_ARGS="--batching on --protocols grpc --client wire --window 2.0 --warmup 0.5 --tuning-runs 3 --batch-buckets ${STEPS:-pow2 half}" \
    timeout "$LEFT" bash bench/serve_gpu.sh .whl-serve > /dev/null 2>&1
  grep -E "^== |failed|Error|error|wrong answer" "$OUT/serve_gpu.log" | grep -v "^| " | cut -c1-300 | tail -6
  python3 bench/serve_summary.py "$OUT/serve.md"
fi
echo "== $(( $(date +%s) - START )) s"
