#!/usr/bin/env bash
# h-int8pool's device call (issue 12: ResNet-50 INT8 at 1.50x of kiln fp16, 1.6x wanted); everything goes to stdout.
#   bash bench/gpu_int8pool.sh            (1) + (2), ~290 s      TESTS=1 ENGINES=0 bash bench/gpu_int8pool.sh  (2) + (3), ~100 s
#                                (1) ResNet-50 batch 256 kiln fp16 and INT8 engines at opt level 3 with --profile
#                                (cap 225 s, 110 s a row): the stem now reads the float image (fold_quantize_into_stem: no
#                                QuantizeLinear step; its space-to-depth fold one Triton pass that quantizes), the
#                                quantization scales float32 in the fp16 engine; the per-layer gap table joins the
#                                int8 MaxPool (node_max_pool2d_quantized) with fp16's node_max_pool2d now;
#                                (2) bench/stem_quantize.py (cap 60 s): the stem's parts at batch 256 (Q step, torch
#                                vs Triton fold, quantizing fold from fp16/fp32, the stem tactic each way, MaxPool
#                                int8 tiles vs fp16), each checked bit for bit first;
#                                (3) GPU tests (cap 55 s): the stem on the float image vs on its QuantizeLinear, the
#                                8-bit MaxPool and Q/DQ at ResNet shapes, the space-to-depth stem vs the reference.
# No carry.
set -u
. "$(dirname "$0")/device_env.sh" kiln-int8pool
{
stage "GPU, commit ${KILN_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
if [ "${ENGINES:-1}" = 1 ]; then
stage "engines: resnet50_b256 kiln_fp16,kiln_int8 --opt-level 3 --profile"
timeout 225 python3 bench/quant_gpu.py --sections engines --engines resnet50_b256 --modes kiln_fp16,kiln_int8 \
  --opt-level 3 --row-timeout 110 --profile --out "$OUT/engines" 2>&1 | grep "^| resnet50\|^| workload\|^resnet50_b256 " \
  | cut -c1-600
python3 bench/quant_gpu.py --show-profiles "$OUT/engines/quant_gpu.log" | cut -c1-700 | head -70
fi
stage "stem parts (bench/stem_quantize.py)"
timeout 60 python3 bench/stem_quantize.py --out "$OUT" 2>&1 | grep "^|\|^#\|Error\|error" | tail -22
if [ "${TESTS:-0}" = 1 ]; then
stage "GPU tests: the folded stem, 8-bit MaxPool and Q/DQ, the space-to-depth stem"
timeout 55 python3 -m pytest -q -p no:cacheprovider --tb=short --maxfail=3 tests/gpu/test_quant_cuda.py \
  -k "float_image or max_pool or (stem and not residual)" 2>&1 | grep -v "DEBUG\|^$" | cut -c1-300 | tail -12
fi
stage done
} 2>&1 | tee "$OUT/int8pool.log"
