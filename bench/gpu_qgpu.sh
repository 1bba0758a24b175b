#!/usr/bin/env bash
# h-qgpu's device call (issue 12: ResNet-50 INT8/FP8 on the H200). (0) GPU tests of the QAdd kernel and the residual
# QConv tactics; (1) where a residual QAdd's time goes (bench/qadd_parts.py: the floor, kiln's kernel, the kernel
# before, each checked against kiln's reference op); whether an FP8 conv's c, rounded from fp32 sums, lets a fused
# residual pass the builder's check (bench/fp8_residual_rounding.py); the stem's parts (bench/stem_parts.py: cuDNN's
# fp16 conv by layout and algorithm search, the dequantize/requantize passes); (2) ResNet-50 batch 256 engines with
# per-layer profiles: which QConvs fall back to the dequantized tactic (every candidate's time or why it was
# dropped) and the per-layer gaps vs fp16 when it runs (bench/quant_gpu.py --profile). MODES (default kiln_int8:
# ~170 s in all); MODES=kiln_fp16,kiln_int8,kiln_fp8 for the comparison: ~320 s. No carry.
set -u
. "$(dirname "$0")/device_env.sh" kiln-qgpu
{
stage "GPU"; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
stage "GPU tests: QAdd and the residual QConv tactics (every one against the reference), CUDA-graph replays, the store's E4M3 rounding"
timeout 40 python3 -m pytest -q -p no:cacheprovider --tb=short tests/gpu/test_quant_cuda.py \
  -k "qadd or residual or hardware_rounding" 2>&1 | grep -v "DEBUG\|^$" | tail -8
stage "QAdd parts"
timeout 35 python3 bench/qadd_parts.py --out "$OUT" 2>&1 | grep "^|" | tail -26
stage "FP8 residual: the kernels' c against the exact reference, and the sum made of it by the builder's check"
timeout 30 python3 bench/fp8_residual_rounding.py 2>&1 | grep "^cuda" | cut -c1-400
stage "stem parts"
timeout 25 python3 bench/stem_parts.py --out "$OUT" 2>&1 | grep "^|" | tail -14
stage "engines: resnet50_b256 ${MODES:=kiln_int8} (--profile)"
timeout 280 python3 bench/quant_gpu.py --sections engines --engines resnet50_b256 --modes "$MODES" \
  --row-timeout 90 --profile --out "$OUT/engines" 2>&1 | grep -v "^resnet50_b256 kiln" | tail -40
python3 bench/quant_gpu.py --show-profiles "$OUT/engines/quant_gpu.log" | cut -c1-700 | head -90
stage done
} 2>&1 | tee "$OUT/qgpu.log"
