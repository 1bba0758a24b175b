#!/usr/bin/env bash
# Device call for issue 10 on the H200 (branch h-stream2), ~270 s (hard caps 60 + 25 + 205 s):
#   bash bench/gpu_stream2.sh
# 1. tests/gpu/test_stream_packing.py: a padding-free bert_tiny warmed up at load, then a random stream of shapes with
#    padding masks: no capture in the stream, <= 64 graphs, none evicted, matches torch fp32 at real tokens.
# 2. bench/attention.py: one BERT-base attention layer at the stream's largest shape (32x512) and its opt shape
#    (8x128), the mask as the exported BERT builds it ([B,1,S,S]) and as a key vector ([B,1,1,S]): kiln's Triton
#    configs vs SDPA with each backend forced (cuda.attention.cudnn is a build candidate), every one checked against
#    the op in fp32 (SDPA math), then timed in CUDA graphs.
# 3. bench/dynamic.py on CUDA: BERT-base fp16 padding-free engine (profile 1x1,8x128,32x512; its plain program now
#    tuned at the opt shape and the max), warmed up at load (64 graphs), the attention tactic chosen and its
#    candidates' times, the issue's 200-request stream (batch 1-32 x seq 1-512, padding masks) beside torch eager and
#    torch.compile(dynamic=True), then the per-shape table (8x128 plain at its bucket now; 16x128 the smallest packed
#    run, with its GPU kernels tabled beside its wall time) and the full-mask ceiling's kernel tables.
# Logs in $OUT (stream2.log, dynamic-cuda.md).
set -u
. "$(dirname "$0")/device_env.sh" kiln-stream2
export KILN_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
{
stage "GPU test: a warmed-up stream on a padding-free engine (commit $KILN_COMMIT)"
timeout 60 python3 -m pytest tests/gpu/test_stream_packing.py -q -p no:cacheprovider -rfE --tb=short 2>&1 | tail -25
stage "attention layers: Triton vs SDPA backends at BERT-base's stream shapes"
timeout 25 python3 bench/attention.py --configs default --cases bert512_qk,bert512_key,bert128_qk 2>&1 \
  | grep -v "Warning\|warn(" | tail -60
stage "stream: bench/dynamic.py (BERT-base fp16, padding-free)"
timeout 205 python3 bench/dynamic.py --device cuda --calls 8 --stream-deadline-s 170 --out "$OUT" \
  --shapes 32x512:full,32x512,24x384,17x300,16x128,8x128 --kernels-at 16x128 2>&1 \
  | grep -v "Warning\|warn(" | tail -150
stage done
} 2>&1 | tee "$OUT/stream2.log"
