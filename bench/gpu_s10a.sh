#!/usr/bin/env bash
# Device call of 2026-12-03 evening (tenth session, the lead's first call, <= 400 s): what the ninth session merged
# without a GPU run. (1) ResNet-50 batch 256: kiln fp16 vs kiln on onnxruntime's QDQ models (int8 S8S8 per-channel
# MinMax; FP8 E4M3), with profiles (gpu_fp8b3.sh's rows); (2) the FP8 store's hardware E4M3 rounding test (ebdedbe,
# f2be0fe); (3) tests/gpu/test_remove_padding.py at HEAD (the restored max-tuning after h-stream2's revert). No carry.
set -u
. "$(dirname "$0")/device_env.sh" kiln-s10a
{
stage "GPU"; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
stage "GPU test: the store's hardware E4M3 rounding is qmath's"
timeout 30 python3 -m pytest -q -p no:cacheprovider --tb=short tests/gpu/test_quant_cuda.py -k hardware_rounding 2>&1 \
  | grep -v "DEBUG\|^$" | tail -6
stage "GPU test: remove_padding"
timeout 120 python3 -m pytest -q -p no:cacheprovider --tb=short tests/gpu/test_remove_padding.py 2>&1 \
  | grep -v "DEBUG\|^$" | tail -8
stage "engines: resnet50_b256 kiln_fp16, kiln_int8, kiln_fp8 (--profile)"
timeout 225 python3 bench/quant_gpu.py --sections engines --engines resnet50_b256 --modes kiln_fp16,kiln_int8,kiln_fp8 \
  --row-timeout 110 --profile --out "$OUT/engines" 2>&1 | grep -v "^resnet50_b256 kiln" | tail -8
python3 bench/quant_gpu.py --show-profiles "$OUT/engines/quant_gpu.log" | cut -c1-400 | head -60
stage done
} 2>&1 | tee "$OUT/s10a.log"
