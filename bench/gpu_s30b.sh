#!/usr/bin/env bash
# Device call (session 30, issue 14): what a batched BERT-base call spends on the host. bench/results/serve-batch6-
# 2026-12-07.md: past c = 64 throughput stays at 4,400-6,300 infer/s while each call's time grows with its requests
# (7.2 ms for 19.8, 16.5 ms for 59.9); here each call is cut into its phases (kiln serve's call_phases: gather,
# handoff, merge, engine with its GPU span by CUDA events, split, return, answer; per request queue, respond, send).
# BERT-base fp16 seq 128, max batch 64, 2 instances, batching on, gRPC (kiln's transport), 8 front ends, 8 wire client
# processes, c = 64 and 128, one server per cuda_sync: spin (the default: the runtime's pageable copy of the outputs)
# and pinned (the outputs copied into pinned memory on the stream; kiln/serve/instances.py). Then, if time is left,
# the gpu-marked front-end test for pinned (every answer checked as alone; it prints engine vs GPU span).
#   run's carry: [".whl-serve"] (bash bench/serve_gpu.sh --fetch here first); <= 300 s; serve.md and the log in $OUT.
# Options by environment: SYNCS (default "spin pinned"), SERVE_CONCURRENCY (default "64 128"), SERVE_PROCESSES
# (default 8), FRONTENDS (default 8), SERVE_BENCH_S (default 200), CHECK (1: the pinned test after, default 1).
set -u
START=$(date +%s)
export OUT=${OUT:-/tmp/kiln-s30b}; mkdir -p "$OUT"
export KILN_COMMIT=${KILN_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
BENCH_S=${SERVE_BENCH_S:-200}
GPU_TESTS=0 FRONTEND_TESTS=0 FRONTENDS="${FRONTENDS:-8}" STAGING_MIB=64 SERVE_MODELS=bert_base \
  SERVE_CONCURRENCY="${SERVE_CONCURRENCY:-64 128}" SERVE_PROCESSES="${SERVE_PROCESSES:-8}" SERVE_BENCH_S=$BENCH_S \
  SERVE_ARGS="--batching on --protocols grpc --client wire --window 2.0 --warmup 0.5 --tuning-runs 3 --cuda-sync ${SYNCS:-spin pinned}" \
  timeout $(( BENCH_S + 20 )) bash bench/serve_gpu.sh .whl-serve > /dev/null 2>&1
echo "== kiln $KILN_COMMIT, $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1), $(nproc) CPUs, load $(cut -d' ' -f1 /proc/loadavg)"
grep -E "^== |failed|Error|error|wrong answer" "$OUT/serve_gpu.log" | grep -v "^| " | cut -c1-300 | tail -8

LEFT=$(( 290 - ($(date +%s) - START) ))
if [ "${CHECK:-1}" = "1" ] && [ "$LEFT" -gt 60 ]; then
  echo "== tests/serve/test_cuda.py front ends, pinned ($LEFT s left)"
  PYTHONPATH=/tmp/serve-deps${PYTHONPATH:+:$PYTHONPATH} timeout $(( LEFT - 10 )) python3 -m pytest -q -s -m gpu \
    tests/serve/test_cuda.py -k "front_ends and pinned" 2>&1 | grep -E "answers checked|passed|failed|Error" | cut -c1-300 | tail -4
fi

# the tables last: the bench's rows (the columns that matter here), then the phase table
python3 bench/serve_summary.py "$OUT/serve.md"
echo "== $(( $(date +%s) - START )) s"
