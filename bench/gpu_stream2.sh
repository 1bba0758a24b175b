#!/usr/bin/env bash
# Device call for issue 10 on the H200 (branch h-stream2), ~270 s (hard caps 90 + 205 s):
#   bash bench/gpu_stream2.sh
# 1. tests/gpu/test_stream_packing.py: a padding-free bert_tiny warmed up at load, then a random stream of shapes with
#    padding masks: no capture in the stream, <= 64 graphs, none evicted, matches torch fp32 at real tokens;
#    tests/gpu/test_remove_padding.py: varlen tactics, padding-free engines vs torch fp32, plain vs packed runs (its
#    plain program's attentions now read a [B,1,1,S] key mask).
# 2. bench/dynamic.py on CUDA: BERT-base fp16 padding-free engine (profile 1x1,8x128,32x512; its plain program tuned
#    at the opt shape and at the max, its attentions on the key mask), warmed up at load (64 graphs); the attention
#    tactic chosen for each program and every candidate's time (Triton configs, SDPA cuDNN/efficient, default) at
#    8x128 and 32x512; the issue's 200-request stream (batch 1-32 x seq 1-512, padding masks) beside torch eager and
#    torch.compile(dynamic=True); the per-shape table (8x128 runs plain at its bucket now; 16x128 is the smallest
#    packed run; both with their GPU kernels tabled beside their wall time) and the full-mask ceiling's kernel tables.
#    Run 2 (after run 1 at 146b23f): the plain program's key mask, the packed region from the embeddings on; and
#    bench/attention.py at 32x512 without a mask and with a key mask, with the varlen flash kernel on the real tokens
#    (what a full mask would cost packed instead of plain).
# Logs in $OUT (stream2.log, dynamic-cuda.md).
set -u
. "$(dirname "$0")/device_env.sh" kiln-stream2
export KILN_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
{
stage "GPU tests: a warmed-up stream on a padding-free engine; padding-free engines (commit $KILN_COMMIT)"
timeout 90 python3 -m pytest tests/gpu/test_stream_packing.py tests/gpu/test_remove_padding.py -q \
  -p no:cacheprovider -rfE --tb=short 2>&1 | tail -30
stage "attention at BERT-base 32x512: Triton / SDPA backends / varlen flash on the real tokens"
timeout 20 python3 bench/attention.py --configs default --cases bert512,bert512_key 2>&1 \
  | grep -v "Warning\|warn(" | tail -30
stage "stream: bench/dynamic.py (BERT-base fp16, padding-free)"
timeout 205 python3 bench/dynamic.py --device cuda --calls 8 --stream-deadline-s 170 --out "$OUT" \
  --shapes 32x512:full,32x512,24x384,17x300,16x128,8x128 --kernels-at 8x128,16x128 2>&1 \
  | grep -v "Warning\|warn(" | tail -150
stage done
} 2>&1 | tee "$OUT/stream2.log"
