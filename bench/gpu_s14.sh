#!/usr/bin/env bash
# Device call of session 14 (2026-12-04, the lead): what the first call of the day (bench/gpu_s12.sh 230 +
# bench/gpu_qgpu.sh on 0234adb) left unrun — the tests/gpu files after test_quant_cuda's conv shapes (its 230 s cap
# stopped at 41%), then ResNet-50 batch 256 kiln fp16 and FP8 engines in one call (the FP8 row timed out at 55 s
# there; INT8 gave 5.84 ms). Budget: ~$1 s of tests (default 170) + 2 engine rows of 125 s.
set -u
. "$(dirname "$0")/device_env.sh" kiln-s14
CAP=${1:-170}
{
stage "GPU, commit ${KILN_COMMIT:-?}"; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
stage "tests/gpu: the rest (cap ${CAP} s)"
timeout "$CAP" python3 -m pytest -v -p no:cacheprovider --tb=line -rf \
  tests/gpu/test_quant_cuda.py -k "not test_qconv_tactics_at_resnet50_shapes and not stem and not residual" \
  tests/gpu/test_remove_padding.py tests/gpu/test_stream_packing.py tests/gpu/test_triton_attention.py \
  tests/gpu/test_triton_conv.py tests/gpu/test_triton_kernels.py tests/gpu/test_triton_pool.py 2>&1 \
  | grep -E "PASSED|FAILED|ERROR|passed|failed|^/|Error" | cut -c1-240 > "$OUT/gpu_tests.txt"
grep -c PASSED "$OUT/gpu_tests.txt" | sed 's/^/passed: /'; grep -c -E "FAILED|ERROR" "$OUT/gpu_tests.txt" | sed 's/^/failed or error: /'
grep -E "FAILED|ERROR|Error" "$OUT/gpu_tests.txt" | head -20; tail -2 "$OUT/gpu_tests.txt"
stage "engines: resnet50_b256 kiln_fp16,kiln_fp8 (--profile)"
timeout 265 python3 bench/quant_gpu.py --sections engines --engines resnet50_b256 --modes kiln_fp16,kiln_fp8 \
  --row-timeout 125 --profile --out "$OUT/engines" 2>&1 | grep "^| resnet50\|^| workload\|^resnet50_b256 " | cut -c1-400
python3 bench/quant_gpu.py --show-profiles "$OUT/engines/quant_gpu.log" | cut -c1-300 | grep -v "^   note\|^   residual node" | head -40
stage done
} 2>&1 | tee "$OUT/s14.log"
