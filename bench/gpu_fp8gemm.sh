#!/usr/bin/env bash
# Device check for h-fp8gemm (issue 12, <= 4 min, no carry): onnxruntime's FP8 QDQ BERT-base (bert_b64, 64 x 384,
# --opt-level 3) with each quantized linear ONE kernel: the chain after every FP8 QGemm (DQ, bias, Gelu / the
# attention's Mul, Q) in the GEMM's epilogue (kiln/passes/fusion/qgemm_epilogue.py) and the LayerNormQuantizes
# reading the previous norm's E4M3 output as their residual (fuse_dequantize_into_layer_norm_quantize).
# kiln_fp8 is the engine with both rules, kiln_fp8_chains the one before them (session 21's opt-3 engine: h-qadd's
# chains), kiln_fp16 the float engine, all in this run. Section 5 of bench/results/gpu-s21-2026-12-06.md (H100,
# opt 2): kiln_fp8 17.57 ms vs kiln fp16 10.17. First: the sm_90 compile of the new kernels and the kernel tests on
# the GPU. Prints the engines table (ms, layer counts in "8-bit layers") and the eager profile's top kinds.
set -u
. "$(dirname "$0")/device_env.sh" kiln-fp8gemm
START=$(date +%s)
left() { echo $((232 - $(date +%s) + START)); }
{
stage "GPU"; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
# MODES="..." picks the engine rows (default all three); TESTS=0 / LAYERS=0 skip the kernel tests / the layer A/B
# (their time goes to the rows)
stage "kernel tests on the GPU (the QGemm with its product quantized; the norm reading an E4M3 residual)"
[ "${TESTS:-1}" != 0 ] && TRITON_INTERPRET=0 timeout 50 python3 -m pytest -q -p no:cacheprovider --tb=line \
  tests/kernels/test_qgemm_epilogue.py -k "tactics_take and (triton or half) or persistent or norm_kernel" 2>&1 | tail -4
stage "one linear as two kernels (before) vs one (after), BERT-base shapes (bench/fp8_gemm_epilogue.py)"
[ "${LAYERS:-1}" != 0 ] && timeout 40 python3 bench/fp8_gemm_epilogue.py --rounds 3 2>&1 | tail -9
ROWS="${MODES:-kiln_fp8 kiln_fp8_chains kiln_fp16}"
for MODE in $ROWS; do
  T=$(( $(left) - 5 ))
  [ "$MODE" = kiln_fp8 ] && [ "$ROWS" != kiln_fp8 ] && T=$(( T * 5 / 9 ))  # the new engine first, most of the time
  [ "$T" -lt 30 ] && { echo "(no time left for $MODE)"; continue; }
  PROFILE=""; [ "$MODE" = kiln_fp8 ] && PROFILE="--profile"
  stage "engine: bert_b64 $MODE $PROFILE, ${T} s"
  timeout "$T" python3 bench/quant_gpu.py --sections engines --engines bert_b64 --modes "$MODE" --opt-level 3 \
    --row-timeout "$T" $PROFILE --out "$OUT/engines_$MODE" 2>&1 | grep "^| bert"
done
python3 bench/quant_gpu.py --show-profiles "$OUT/engines_kiln_fp8/quant_gpu.log" 2>/dev/null \
  | grep "^--\|eager total\|^      *[0-9]" | cut -c1-400 | head -24
stage done
} 2>&1 | tee "$OUT/fp8gemm.log"
