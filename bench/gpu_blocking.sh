#!/usr/bin/env bash
# Device call for issue 14's wrong answers under `kiln serve --cuda-sync blocking` (h-blocking, 2026-12-05). The race:
# two instances' CUDA graphs, all captured by the loading thread on torch.cuda.graph's one default stream, shared
# torch's cuBLAS workspace (cached per cuBLAS handle and stream) and corrupted each other's split-K GEMMs when
# replayed at once on their own streams; fixed by a capture stream per GraphRunner (kiln/runtime/capture_streams.py).
# One run, <= 5 min (argument: "runtime" or "serve" runs that part alone, for a shorter call):
# 1. the serving wheels (bench/serve_gpu.sh's stage 1 only)
# 2. tests/gpu/test_concurrent_contexts.py: two contexts of a GEMM-heavy fp16 engine replaying at once for 3 s, every
#    answer against its context's answer alone. Expect: passed, "[n, n] calls checked, [0, 0] wrong". Then the same
#    under KILN_CAPTURE_STREAMS=0 (the old shared capture stream). Expect: failed, wrong > 0 (the test can fail; the
#    mechanism reproduced without serving).
# 3. tests/serve/test_cuda.py -m gpu: two instances on their own streams (as before) and, new, 2 front ends staging
#    every input, gRPC, 2 instances of that model, 64 calls in flight for 3 s, every answer checked in full against
#    its request's answer alone, under spin and blocking. Expect: all passed, each front_ends row "0 wrong".
#   (here, once)  PIP=/tmp/ci19/.venv/bin/pip bash bench/serve_gpu.sh --fetch   # wheels into .whl-serve/ (git-ignored)
#   (device)      bash bench/gpu_blocking.sh   # run's carry: [".whl-serve"]; the end-to-end rows: bench/gpu_serve5c.sh
set -u
export OUT=${OUT:-/tmp/kiln-blocking}
mkdir -p "$OUT"
GPU_TESTS=0 SERVE_BENCH_S=0 timeout 150 bash bench/serve_gpu.sh .whl-serve > "$OUT/wheels.log" 2>&1
echo "== kiln $(git rev-parse --short HEAD 2>/dev/null || echo unknown), $(nvidia-smi --query-gpu=name --format=csv,noheader), $(tail -2 "$OUT/wheels.log" | head -1)"
export PYTHONPATH=/tmp/serve-deps${PYTHONPATH:+:$PYTHONPATH}
show() { grep -E "calls checked|answers checked|passed|failed|Error|assert wrong|wrong ==" | cut -c1-300 | tail -${1:-4}; }
PART=${1:-all}
if [ "$PART" != "serve" ]; then
echo "== runtime, fixed"
timeout 80 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_concurrent_contexts.py 2>&1 | tee "$OUT/runtime.log" | show
echo "== runtime, KILN_CAPTURE_STREAMS=0 (the old shared capture stream: expect wrong > 0)"
KILN_CAPTURE_STREAMS=0 timeout 80 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_concurrent_contexts.py 2>&1 \
  | tee "$OUT/runtime-old.log" | show
fi
if [ "$PART" != "runtime" ]; then
echo "== serve: tests/serve/test_cuda.py -m gpu"
timeout 150 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/serve/test_cuda.py 2>&1 | tee "$OUT/serve.log" | show 6
fi
