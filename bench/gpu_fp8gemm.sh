#!/usr/bin/env bash
# Device check for h-fp8gemm (issue 12, <= 4 min, no carry): onnxruntime's FP8 QDQ BERT-base (bert_b64, 64 x 384,
# OPT, default 2) with each quantized linear ONE kernel: the chain after every FP8 QGemm (DQ, bias, Gelu / the
# attention's Mul, Q) in the GEMM's epilogue (kiln/passes/fusion/qgemm_epilogue.py), the key's Mul/Q moved through
# its head transpose into its GEMM, and the LayerNormQuantizes reading the previous norm's E4M3 output as their
# residual (fuse_dequantize_into_layer_norm_quantize). Section 5 of bench/results/gpu-s21-2026-12-06.md (H100,
# opt 2): kiln_fp8 17.57 ms vs kiln fp16 10.17 (opt 3, section 4: 17.41).
#   1. the engine (kiln_fp8, --profile): ms, layer counts ("8-bit layers"), cosine vs onnxruntime, eager profile
#   2. one linear as the two kernels before vs the fused one, BERT-base shapes (bench/fp8_gemm_epilogue.py)
#   3. the kernel tests on the GPU (tests/kernels/test_qgemm_epilogue.py), if time is left
#   4. the engine before (kiln_fp8_chains: session 21's opt-3 engine, h-qadd's chains), if time is left
# MODES="kiln_fp8_chains kiln_fp16" (say) picks other engine rows; TESTS=0 / LAYERS=0 skip stages 3 / 2; OPT=3 the
# opt level (default 2); BUDGET=560
# (seconds, default 232) for a cold machine with several rows.
set -u
. "$(dirname "$0")/device_env.sh" kiln-fp8gemm
START=$(date +%s)
left() { echo $((${BUDGET:-232} - $(date +%s) + START)); }
row() {  # row MODE SECONDS [--profile]
  stage "engine: bert_b64 $1 ${3:-}, $2 s"
  timeout "$2" python3 bench/quant_gpu.py --sections engines --engines bert_b64 --modes "$1" --opt-level "${OPT:-2}" \
    --row-timeout "$2" ${3:-} --out "$OUT/engines_$1" 2>&1 | grep "^| bert"
}
{
stage "GPU"; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
ROWS="${MODES:-kiln_fp8}"
FIRST=${ROWS%% *}
row "$FIRST" $(( $(left) - 70 )) $([ "$FIRST" = kiln_fp8 ] && echo --profile)
if [ "${LAYERS:-1}" != 0 ] && [ "$(left)" -gt 30 ]; then
  stage "one linear as two kernels (before) vs one (after), BERT-base shapes (bench/fp8_gemm_epilogue.py)"
  timeout $(( $(left) > 45 ? 40 : $(left) - 5 )) python3 bench/fp8_gemm_epilogue.py --rounds 3 2>&1 | tail -9
fi
if [ "${TESTS:-1}" != 0 ] && [ "$(left)" -gt 25 ]; then
  stage "kernel tests on the GPU (the QGemm with its product quantized; the norm reading an E4M3 residual)"
  TRITON_INTERPRET=0 timeout $(( $(left) - 5 )) python3 -m pytest -q -p no:cacheprovider --tb=line \
    tests/kernels/test_qgemm_epilogue.py -k "tactics_take and (triton or half) or persistent or norm_kernel" \
    2>&1 | tail -4
fi
for MODE in ${ROWS#"$FIRST"} $([ -z "${MODES:-}" ] && echo kiln_fp8_chains); do
  T=$(( $(left) - 5 )); [ "$T" -lt 60 ] && { echo "(no time left for $MODE: MODES=$MODE TESTS=0 LAYERS=0)"; continue; }
  row "$MODE" "$T"
done
python3 bench/quant_gpu.py --show-profiles "$OUT/engines_kiln_fp8/quant_gpu.log" 2>/dev/null \
  | grep "^--\|eager total\|^      *[0-9]" | cut -c1-400 | head -24
stage done
} 2>&1 | tee "$OUT/fp8gemm.log"
