#!/usr/bin/env bash
# h-qatt2 (issue 12, session 21) device check, <= 240 s, no carry: the lean one-pass quantized attention
# (cuda.attention.quantized_one_pass.*l / *h / *k: loads ahead, one row reduction, E4M3 rounded by the saturating
# conversion, scores held as bytes on 64/128-row wgmma tiles, k/v converted to fp16 once) against the op on BERT-base's
# layer (tests/gpu, E4M3 and int8: steps / share off printed; session 20's best tile beside), then the timing table at
# 64 x 384, padding mask (each row checked against the op first): session 20's 32x128.w8r128 (0.475 ms on the H100),
# the lean tiles, the fp16 flash tiles (0.222 ms) beside, "x the fastest fp16 tile" a column. A tile that fails to
# compile or run prints a row (bench) or a failed test line and the rest go on. Most of the time is Triton compiling
# (~16 one-pass kernels; the test and the bench share its cache).
set -u
. "$(dirname "$0")/device_env.sh" kiln-qatt2
NEW="w8r128l or w8r128lk or 16x128.w4l or w4h or w4hk or w8h"
{
stage "GPU"; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
stage "GPU test: the lean one-pass tactics vs the op (BERT-base layer, 8 x 384), fp8 and int8"
timeout 150 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_quantized_attention_cuda.py \
  -k "$NEW or 32x128.w8r128-" 2>&1 | grep -E "quantized_one_pass\.|passed|failed|Error|error" | cut -c1-240 | tail -24
stage "bench: BERT-base attention 64 x 384 (session 20's best, the lean tiles, fp16 flash)"
timeout 75 python3 bench/quantized_attention.py --iters 20 --two-pass 0 \
  --only w8r128,w8r128l,w8r128lk,16x128.w4l,64x64.w4h,64x64.w4hk,128x64.w8h,64x128.w4h 2>&1 | grep -v Warn \
  | grep "^device\|^| \|FAILED\|Error" | cut -c1-300 | tail -26
stage done
} 2>&1 | tee "$OUT/qatt2.log"
