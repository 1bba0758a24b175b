#!/usr/bin/env bash
# Device call of 2026-12-03 (issue 12, h-fp8b, run 2), after run 1 found every FP8 GEMM with a float output rejected
# by the tuner's check (fixed at 0cf52a4): BERT-base batch 64 x 384, kiln fp16 vs kiln's own FP8 engine with the
# profile and the tuner's candidates of the first block (now with the .fast_accum cuBLASLt and Triton variants and
# the tiled requantize pass); BERT-base's GEMMs in parts (bench/fp8_gemm_parts.py: cuBLAS fp16, cuBLASLt FP8 to each output dtype with and without fast
# accumulation, the requantize pass, kiln's Triton FP8 tiles for the FFN up); then the FP8 GPU tests. No carry.
# At most ~235 s (stage timeouts 140 + 45 + 50). Logs in $OUT.
set -u
. "$(dirname "$0")/device_env.sh" kiln-fp8b2
{
stage "GPU"; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
stage "engines: bert_b64 kiln_fp16, kiln_fp8_ptq (--profile)"
timeout 140 python3 bench/quant_gpu.py --sections engines --engines bert_b64 --modes kiln_fp16,kiln_fp8_ptq \
  --row-timeout 100 --profile --out "$OUT/engines" 2>&1 | grep -v "^bert_b64 kiln" | tail -8
python3 bench/quant_gpu.py --show-profiles "$OUT/engines/quant_gpu.log"
stage "BERT-base GEMMs in parts"
timeout 45 python3 bench/fp8_gemm_parts.py --triton 2>&1 | tee "$OUT/parts.md" | grep "^|\|Error"
stage "GPU tests: FP8 encoder, FP8 QGemm tactics at BERT shapes"
timeout 50 python3 -m pytest -q -p no:cacheprovider --tb=short -rfE tests/gpu/test_quant_cuda.py \
  -k "fp8_layer_norm_quantize or fp8_ffn_up or fp8_encoder_engine or (qgemm_tactics_at_bert_shapes and fp8)" \
  > "$OUT/tests.log" 2>&1
echo "pytest rc $?"; grep -v "DEBUG\|^$" "$OUT/tests.log" | tail -30
stage done
} 2>&1 | tee "$OUT/fp8b2.log"
