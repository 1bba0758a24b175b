#!/usr/bin/env bash
# Device call (session 31, issue 14): why two served CUDA instances do not overlap, and what the numpy outputs cost;
# the runtime's host staging (kiln/runtime/host_staging.py) against today's pageable copies.
# bench/results/serve-overlap-2026-12-07.md.
# 1. bench/serve_graphs_probe.py (no server): BERT-base fp16, batch 1..64 x seq 128, one context as an instance makes
#    it; per batch size numpy in/out today (pageable), device tensors, staged (pinned buffers of the context, fresh
#    arrays out) and staged-pinned (arrays over pinned blocks): wall, span, thread CPU ms, staged outputs checked
#    bitwise against today's; then two contexts on two threads and two streams at once at 12 and 64 rows, for device
#    in/out, numpy today, numpy in / device out, device in / numpy out (one pageable direction each), staged,
#    staged-pinned: calls/s together over one alone (2.00 full overlap, 1.00 none).
# 2. if time is left (<= 150 s in all): bench/serve.py as bench/gpu_s31b.sh runs it (BERT-base, 2 instances, batching
#    on, gRPC, 8 front ends, 8 wire client processes, c = 64), kiln serve --cuda-sync spin vs staged.
#   run's carry: [".whl-serve"] (bash bench/serve_gpu.sh --fetch here first; part 2 is skipped without it);
#   probe.txt, serve.md and the log in $OUT.
# Runs on the device's python3 (torch 2.11, no pip install but part 2's wheels into /tmp/serve-deps) from the repo
# root. Without CUDA it stops at once, saying so.
# Estimate (from gpu_s31b.sh's run: export + build 37 s, serve.py 74 s for two servers, wheels 10 s): the probe ~55 s at
# --rounds 1, ~70 s at 2; part 2 ~85 s, so 150 s holds both only just: part 2's bench gets what is left (its table is
# rewritten after every row: a cut run keeps the rows done).
# Options by environment: BUDGET_S (default 150), PROBE_S (default 95; 0: skip 1), PROBE_ARGS (the probe's flags after
# --calls 20; default "--rounds 1"; e.g. "--rounds 2" with SERVE_MIN_S=999 for the probe alone), SYNCS (default
# "spin staged"), SERVE_CONCURRENCY (default 64), SERVE_PROCESSES (default 8), FRONTENDS (default 8), SERVE_MIN_S
# (part 2 runs only with this much of the budget left; default 60), STAGING_TESTS_S (default 0: off; e.g. 60 runs
# tests/gpu/test_host_staging.py after the probe, on the device's pytest).
set -u
START=$(date +%s)
BUDGET_S=${BUDGET_S:-150}
export OUT=${OUT:-/tmp/kiln-s31d}; mkdir -p "$OUT"
export KILN_COMMIT=${KILN_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
echo "== kiln $KILN_COMMIT, $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1), $(nproc) CPUs, load $(cut -d' ' -f1 /proc/loadavg)"
if ! python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_s31d.sh: python3 has no torch with a CUDA device here; this script measures the GPU paths only: stopping"
  exit 2
fi

PROBE_S=${PROBE_S:-95}
if [ "$PROBE_S" != "0" ]; then
  echo "== 1. bench/serve_graphs_probe.py (<= $PROBE_S s)"
  # shellcheck disable=SC2086
  timeout "$PROBE_S" python3 bench/serve_graphs_probe.py --calls 20 ${PROBE_ARGS:---rounds 1} > "$OUT/probe.txt" 2>&1
  echo "probe exit $?"
  grep -vE "Warning|warn\(|^\s*$" "$OUT/probe.txt" | cut -c1-260 | tail -70
fi

if [ "${STAGING_TESTS_S:-0}" != "0" ]; then  # opt-in: the GPU tests of host staging (~30 s: a deep fp16 MLP's build)
  echo "== 1b. tests/gpu/test_host_staging.py (<= $STAGING_TESTS_S s)"
  timeout "$STAGING_TESTS_S" python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/gpu/test_host_staging.py 2>&1 \
    | grep -vE "Warning|warn\(" | tail -8
fi

LEFT=$(( BUDGET_S - ($(date +%s) - START) - 10 ))
if [ ! -d .whl-serve ]; then
  echo "== 2. skipped: no .whl-serve (bash bench/serve_gpu.sh --fetch on the CPU machine, then carry it)"
elif [ "$LEFT" -lt "${SERVE_MIN_S:-60}" ]; then
  echo "== 2. skipped: $LEFT s of the ${BUDGET_S} s budget left (SERVE_MIN_S ${SERVE_MIN_S:-60})"
else
  echo "== 2. bench/serve.py, BERT-base, 2 instances, batching on, --cuda-sync ${SYNCS:-spin staged} ($(( $(date +%s) - START )) s in, $LEFT s left)"
  GPU_TESTS=0 FRONTEND_TESTS=0 FRONTENDS="${FRONTENDS:-8}" STAGING_MIB=64 SERVE_MODELS=bert_base \
    SERVE_CONCURRENCY="${SERVE_CONCURRENCY:-64}" SERVE_PROCESSES="${SERVE_PROCESSES:-8}" SERVE_BENCH_S=$(( LEFT - 15 )) \
    SERVE_ARGS="--batching on --protocols grpc --client wire --window 2.0 --warmup 0.5 --tuning-runs 3 --cuda-sync ${SYNCS:-spin staged}" \
    timeout "$LEFT" bash bench/serve_gpu.sh .whl-serve > /dev/null 2>&1
  grep -E "^== |failed|Error|error|wrong answer" "$OUT/serve_gpu.log" | grep -v "^| " | cut -c1-300 | tail -6
  python3 bench/serve_summary.py "$OUT/serve.md"
fi
echo "== $(( $(date +%s) - START )) s"
