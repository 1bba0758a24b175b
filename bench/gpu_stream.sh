#!/usr/bin/env bash
# Device call for issue 10 (the dynamic stream on the H200, branch h-stream), <= 235 s (tests <= 35, bench <= 195):
#   bash bench/gpu_stream.sh
# 1. tests/gpu/test_stream_packing.py: a padding-free bert_tiny warmed up at load, then a random stream of shapes with
#    padding masks: no capture in the stream, <= 64 graphs, none evicted, matches torch fp32 at real tokens.
#    (tests/gpu/test_remove_padding.py passed 11 of 11 at this code in the first call, 12:02 UTC: not repeated.)
# 2. bench/dynamic.py on CUDA: BERT-base fp16 padding-free engine (profile 1x1,8x128,32x512), warmed up at load
#    (graph_rows: every graph captured before the stream), the issue's stream of 200 requests (batch 1-32 x seq
#    1-512, padding masks) beside torch eager and torch.compile(dynamic=True), stopped at 165 s after its start if
#    not done (the first call's export 35 s + build 20 s + torch.compile warm-up 46 s left too little); then the
#    GEMM ceiling at 32x512 with a full mask (kernel tables) and a per-shape table (runtimes timed in turn).
# Logs in $OUT (stream.log, dynamic-cuda.md).
set -u
. "$(dirname "$0")/device_env.sh" kiln-stream
export KILN_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
{
stage "GPU test: a warmed-up stream on a padding-free engine"
timeout 35 python3 -m pytest tests/gpu/test_stream_packing.py -q -p no:cacheprovider -rfE --tb=short \
  --show-capture=no 2>&1 | tail -25
stage "stream: bench/dynamic.py (BERT-base fp16, padding-free)"
timeout 195 python3 bench/dynamic.py --device cuda --calls 8 --stream-deadline-s 165 --out "$OUT" \
  --shapes 32x512:full,32x512,24x384,17x300,8x128 2>&1 | grep -v "Warning\|warn(" | tail -120
stage done
} 2>&1 | tee "$OUT/stream.log"
