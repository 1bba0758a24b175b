#!/usr/bin/env bash
# Device call of 2026-12-03 (issue 12, h-fp8): BERT-base batch 64 x 384 on one H200, kiln fp16 against kiln's own FP8
# engine (kiln.build(precision="fp8", calibration=...)): per-tensor E4M3 weights, LayerNorms writing fp8 themselves
# (kiln::LayerNormQuantize), the FFN up projection's Gelu before its fp8 output (cuda.qgemm.scaled_mm_half / Triton),
# float-output GEMMs on cuBLASLt's FP8 GEMM with scales and bias in its epilogue. Per engine: ms per batch (CUDA
# graphs), cosine vs torch fp32, the eager per-(op, tactic) profile and the tuner's times of the first block's
# candidates; then the new GPU tests. No carry. About 150-200 s (at most 240: stage timeouts). Logs in $OUT.
set -u
. "$(dirname "$0")/device_env.sh" kiln-fp8bert
{
stage "GPU"; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
stage "engines: bert_b64 kiln_fp16, kiln_fp8_ptq (--profile)"
timeout 190 python3 bench/quant_gpu.py --sections engines --engines bert_b64 --modes kiln_fp16,kiln_fp8_ptq \
  --row-timeout 140 --profile --out "$OUT/engines" 2>&1 | grep -v "^bert_b64 kiln" | tail -8
python3 bench/quant_gpu.py --show-profiles "$OUT/engines/quant_gpu.log"
stage "GPU tests (new)"
timeout 50 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_quant_cuda.py \
  -k "fp8_layer_norm_quantize or fp8_ffn_up or fp8_encoder_engine" 2>&1 | tail -12
stage done
} 2>&1 | tee "$OUT/fp8bert.log"
