#!/usr/bin/env bash
# h-qatt (issue 12) device check, <= 180 s, no carry: the one-pass quantized attention
# (cuda.attention.quantized_one_pass, five tiles at 384 keys) against the op on BERT-base's layer (tests/gpu, E4M3
# and int8: steps / share off printed), then the timing table at 64 x 384 (each row checked against the op first): the op's torch reference, session 19's
# two-pass kernel (its 64x64 tile: 0.53-0.61 ms on the H100), the one-pass tiles, two fp16 flash tiles beside. Most of
# the time is Triton compiling ~14 kernels (the test and the bench share its cache).
set -u
. "$(dirname "$0")/device_env.sh" kiln-qatt
{
stage "GPU"; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
stage "GPU test: one-pass tactics vs the op (BERT-base layer, 8 x 384)"
timeout 115 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_quantized_attention_cuda.py -k one_pass 2>&1 \
  | grep -E "quantized_one_pass\.|passed|failed|Error" | cut -c1-240 | tail -14
stage "bench: BERT-base attention 64 x 384"
timeout 55 python3 bench/quantized_attention.py --iters 20 --two-pass 1 2>&1 | grep -v Warn \
  | grep "^device\|^| " | tail -20
stage done
} 2>&1 | tee "$OUT/qatt.log"
