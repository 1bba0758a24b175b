#!/usr/bin/env bash
# Device call for issue 10 (the dynamic stream on the H200, branch h-stream), < 200 s (bench <= 150, tests <= 45):
#   bash bench/gpu_stream.sh
# 1. bench/dynamic.py on CUDA: BERT-base fp16 padding-free engine (profile 1x1,8x128,32x512), warmed up at load
#    (graph_rows: every graph captured before the stream), the issue's stream of 200 requests (batch 1-32 x seq
#    1-512, padding masks) beside torch eager and torch.compile(dynamic=True); then a per-shape table (runtimes timed
#    in turn) and the GEMM ceiling at 32x512 with a full mask (kernel tables kiln vs the fastest torch mode).
# 2. tests/gpu/test_stream_packing.py (warmed-up stream: no capture, <= 64 graphs, matches torch) and
#    tests/gpu/test_remove_padding.py (padding-free engines on CUDA; their "auto" contexts now pack by graph_rows).
# Logs in $OUT (stream.log, dynamic-cuda.md).
set -u
. "$(dirname "$0")/device_env.sh" kiln-stream
export KILN_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
{
stage "stream: bench/dynamic.py (BERT-base fp16, padding-free)"
timeout 150 python3 bench/dynamic.py --device cuda --calls 8 --out "$OUT" \
  --shapes 1x128,8x128,17x300,24x384,32x512,32x512:full 2>&1 | grep -v "Warning\|warn(" | tail -100
stage "GPU tests"
timeout 45 python3 -m pytest tests/gpu/test_stream_packing.py tests/gpu/test_remove_padding.py -q -p no:cacheprovider \
  -rfE 2>&1 | tail -15
stage done
} 2>&1 | tee "$OUT/stream.log"
