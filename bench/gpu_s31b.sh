#!/usr/bin/env bash
# Device call (session 31, issue 14): are the served BERT-base engine's batched calls replaying CUDA graphs, and what
# does a call cost the GPU against its bucket's bare replay? bench/results/serve-graphs-2026-12-07.md.
# 1. bench/serve_graphs_probe.py (no server): BERT-base fp16, batch 1..64 x seq 128, one context as an instance makes
#    it: what warm-up captured (each bucket's replay ms at capture), then per batch size the call's wall and stream
#    span (numpy in/out as the spin path, device tensors in/out), graph replays/captures/eager runs/splits per call,
#    span over the bucket's replay; then two contexts on two threads and streams at once (two instances).
# 2. bench/serve.py as bench/gpu_s30b.sh runs it (2 instances, batching on, gRPC, 8 front ends, 8 wire client
#    processes), c = 64, spin then pinned: the phase table with the new columns (graph replays, captures, eager runs
#    per call, split share) and each instance's warm-up captures and graph cache (kiln serve's "cuda_graphs").
#   run's carry: [".whl-serve"] (bash bench/serve_gpu.sh --fetch here first); <= 200 s; serve.md, probe.txt, the log
#   in $OUT.
# Options by environment: PROBE_S (default 65; 0: skip 1), SYNCS (default "spin pinned"), SERVE_CONCURRENCY
# (default 64), SERVE_PROCESSES (default 8), FRONTENDS (default 8), SERVE_BENCH_S (default 120; 0: skip 2).
set -u
START=$(date +%s)
export OUT=${OUT:-/tmp/kiln-s31b}; mkdir -p "$OUT"
export KILN_COMMIT=${KILN_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
echo "== kiln $KILN_COMMIT, $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1), $(nproc) CPUs, load $(cut -d' ' -f1 /proc/loadavg)"

PROBE_S=${PROBE_S:-65}
if [ "$PROBE_S" != "0" ]; then
  echo "== 1. bench/serve_graphs_probe.py (<= $PROBE_S s)"
  timeout "$PROBE_S" python3 bench/serve_graphs_probe.py --calls 20 > "$OUT/probe.txt" 2>&1
  echo "probe exit $?"
  grep -vE "Warning|warn\(|^\s*$" "$OUT/probe.txt" | cut -c1-240 | tail -45
fi

BENCH_S=${SERVE_BENCH_S:-120}
if [ "$BENCH_S" != "0" ]; then
  echo "== 2. bench/serve.py, BERT-base, 2 instances, batching on ($(( $(date +%s) - START )) s in)"
  GPU_TESTS=0 FRONTEND_TESTS=0 FRONTENDS="${FRONTENDS:-8}" STAGING_MIB=64 SERVE_MODELS=bert_base \
    SERVE_CONCURRENCY="${SERVE_CONCURRENCY:-64}" SERVE_PROCESSES="${SERVE_PROCESSES:-8}" SERVE_BENCH_S=$BENCH_S \
    SERVE_ARGS="--batching on --protocols grpc --client wire --window 2.0 --warmup 0.5 --tuning-runs 3 --cuda-sync ${SYNCS:-spin pinned}" \
    timeout $(( BENCH_S + 10 )) bash bench/serve_gpu.sh .whl-serve > /dev/null 2>&1
  grep -E "^== |failed|Error|error|wrong answer" "$OUT/serve_gpu.log" | grep -v "^| " | cut -c1-300 | tail -6
  python3 bench/serve_summary.py "$OUT/serve.md"
fi
echo "== $(( $(date +%s) - START )) s"
