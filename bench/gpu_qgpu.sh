#!/usr/bin/env bash
# h-qgpu's device call (issue 12: ResNet-50 INT8/FP8 on the H200 faster than fp16); everything it finds goes to stdout.
#   bash bench/gpu_qgpu.sh     (0) GPU tests (-k "stem or residual", cap 30 s): the space-to-depth stem tactic at
#                              224x224 against the reference, every residual QConv tactic judged by its checker (the
#                              unfused pair's tolerance; INT8, FP8, the sum finer than c, near-ties), CUDA-graph
#                              replays with a new residual, the QAdd tactics;
#                              (1) ResNet-50 batch 256 kiln INT8 / FP8 / fp16 engines in one run (cap 115 s, INT8 first:
#                              fp16 has a 12-03 number if its row runs out of time), accuracy vs fp32 and onnxruntime,
#                              per-layer profiles, the stem's candidates (space-to-depth vs the dequantized cuDNN form)
#                              and each residual layer's fused epilogue vs its .then_qadd pair (the unfused conv + QAdd)
# MODES picks the engines (default kiln_int8,kiln_fp8,kiln_fp16); TESTS=0 skips the tests. No carry. ~160 s (the
# call of 2026-12-04c at 40 + 128 s caps was cut by the 180 s limit during the engines: setup counts too).
set -u
. "$(dirname "$0")/device_env.sh" kiln-qgpu
{
stage "GPU, commit ${KILN_COMMIT:-?}"; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
if [ "${TESTS:-1}" = 1 ]; then
stage "GPU tests: the stem by space-to-depth, residual QConv tactics by their checker, replays, QAdd"
timeout 30 python3 -m pytest -q -p no:cacheprovider --tb=short --maxfail=3 tests/gpu/test_quant_cuda.py \
  -k "stem or residual" 2>&1 | grep -v "DEBUG\|^$" | cut -c1-300 | tail -15
fi
stage "engines: resnet50_b256 ${MODES:=kiln_int8,kiln_fp8,kiln_fp16} (--profile)"
timeout 115 python3 bench/quant_gpu.py --sections engines --engines resnet50_b256 --modes "$MODES" \
  --row-timeout 55 --profile --out "$OUT/engines" 2>&1 | grep "^| resnet50\|^| workload\|^resnet50_b256 " | cut -c1-600
python3 bench/quant_gpu.py --show-profiles "$OUT/engines/quant_gpu.log" | cut -c1-700 | head -60
stage done
} 2>&1 | tee "$OUT/qgpu.log"
