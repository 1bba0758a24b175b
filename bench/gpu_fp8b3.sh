#!/usr/bin/env bash
# Device call of 2026-12-03 (issue 12, h-fp8b, run 3): ResNet-50 batch 256 on one H200, kiln fp16 vs kiln on
# onnxruntime's QDQ models (int8 S8S8 per-channel MinMax; FP8 E4M3), with the eager profile and the tuner's notes.
# No carry. At most ~230 s (stage timeout 225 s, rows up to 110 s; run 2 of qadd: fp16 ~35 s, int8 ~50 s). Logs in $OUT.
set -u
. "$(dirname "$0")/device_env.sh" kiln-fp8b3
{
stage "GPU"; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
stage "engines: resnet50_b256 kiln_fp16, kiln_int8, kiln_fp8 (--profile)"
timeout 225 python3 bench/quant_gpu.py --sections engines --engines resnet50_b256 --modes kiln_fp16,kiln_int8,kiln_fp8 \
  --row-timeout 110 --profile --out "$OUT/engines" 2>&1 | grep -v "^resnet50_b256 kiln" | tail -8
python3 bench/quant_gpu.py --show-profiles "$OUT/engines/quant_gpu.log"
stage done
} 2>&1 | tee "$OUT/fp8b3.log"
