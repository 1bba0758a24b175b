#!/usr/bin/env bash
# Device call of 2026-12-04 (issue 12, h-fp8att, run 1, <= 150 s): FP8 attention for the FP8 BERT engine. kiln's
# flash-attention kernel with E4M3 products (Float8Scales: E4M3 q/k/v at per-tensor scales, p' = 448·p in E4M3,
# fp16 or E4M3 output) against the fp16 engine's kernel, torch SDPA and cuDNN's FP8 SDPA at BERT-base 64 x 384
# (bench/fp8_attention.py: tiles, the inputs' forms, accuracy vs fp32), then its GPU tests (hardware fp8
# rounding; every tile at BERT's layer). Carry: .whl (nvidia-cudnn-frontend, for cuDNN's FP8 SDPA row). Logs in $OUT.
set -u
. "$(dirname "$0")/device_env.sh" kiln-fp8att
START=$(date +%s)
left() { echo $((150 - $(date +%s) + START)); }
{
stage "GPU"; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cudnn', torch.backends.cudnn.version())"
stage "attention at BERT-base 64 x 384: kiln fp16 vs kiln FP8 forms vs torch SDPA vs cuDNN FP8 SDPA"
timeout 70 python3 bench/fp8_attention.py --configs default 2>&1 | grep -v Warning | tee "$OUT/fp8_attention.log" | tail -22
T=$(( $(left) - 3 ))
if [ "$T" -gt 10 ]; then
  stage "GPU tests (${T} s): tests/gpu/test_fp8_attention.py"
  timeout "$T" python3 -m pytest -v -p no:cacheprovider --tb=short tests/gpu/test_fp8_attention.py 2>&1 \
    | grep "PASS\|FAIL\|Error\|error\|assert\|passed\|failed" | cut -c1-300 | tail -24
fi
stage done
} 2>&1 | tee "$OUT/fp8att.log"
