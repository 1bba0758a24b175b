#!/usr/bin/env bash
# h-qgpu's device calls (issue 12: ResNet-50 INT8/FP8 on the H200); everything it finds goes to stdout.
#   bash bench/gpu_qgpu.sh          (0) GPU tests: the QAdd kernel, the residual QConv tactics, the tuner's CUDA-graph
#                                   timing beside a candidate that syncs; (2) ResNet-50 batch 256 kiln fp16 / INT8 /
#                                   FP8 in one run with per-layer profiles, the 8-bit layers left on a float tactic
#                                   (every candidate's time or why it was dropped) and the per-layer gaps vs fp16
#                                   (bench/quant_gpu.py --profile): ~360 s
#   PARTS=1 bash bench/gpu_qgpu.sh  (1) first: where a residual QAdd's time goes (bench/qadd_parts.py), whether an FP8
#                                   conv's c lets a fused residual pass the builder's check (bench/fp8_residual_rounding
#                                   .py), the stem's parts (bench/stem_parts.py): +90 s
# MODES picks the engines (default kiln_fp16,kiln_int8,kiln_fp8); TESTS=0 skips the tests. No carry.
set -u
. "$(dirname "$0")/device_env.sh" kiln-qgpu
{
stage "GPU"; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
if [ "${TESTS:-1}" = 1 ]; then
stage "GPU tests: QAdd and the residual QConv tactics against the reference, CUDA-graph replays, the tuner's timing"
timeout 100 python3 -m pytest -q -p no:cacheprovider --tb=short tests/gpu/test_quant_cuda.py tests/gpu/test_cuda_tactics.py \
  -k "qadd_tactics_on_a_resnet_residual or (replays and qadd) or hardware_rounding or qconv_with_a_residual or measure_times" \
  2>&1 | grep -v "DEBUG\|^$" | tail -12
fi
if [ "${PARTS:-0}" = 1 ]; then
  stage "QAdd parts"
  timeout 35 python3 bench/qadd_parts.py --out "$OUT" 2>&1 | grep "^|"
  stage "FP8 residual: the kernels' c against the exact reference, and the sum made of it by the builder's check"
  timeout 30 python3 bench/fp8_residual_rounding.py 2>&1 | grep "^cuda"
  stage "stem parts"
  timeout 25 python3 bench/stem_parts.py --out "$OUT" 2>&1 | grep "^|"
fi
stage "engines: resnet50_b256 ${MODES:=kiln_fp16,kiln_int8,kiln_fp8} (--profile)"
timeout 340 python3 bench/quant_gpu.py --sections engines --engines resnet50_b256 --modes "$MODES" \
  --row-timeout 110 --profile --out "$OUT/engines" 2>&1 | grep "^| resnet50\|^| workload"
python3 bench/quant_gpu.py --show-profiles "$OUT/engines/quant_gpu.log" | cut -c1-2500
stage done
} 2>&1 | tee "$OUT/qgpu.log"
