#!/usr/bin/env bash
# Device call of 2026-12-03 (issue 12, h-fp8b, run 1): the FP8 encoder path's GPU tests (LayerNormQuantize, the FFN
# up + Gelu -> fp8 QGemm tactics, the bert_tiny FP8 engine on CUDA), then BERT-base batch 64 x 384, kiln fp16 vs
# kiln's own FP8 engine (bench/quant_gpu.py kiln_fp8_ptq) with the eager profile and, per engine, the tuner's
# candidates of the first block's GEMMs (why the fp16 FFN up + Gelu ran its default in h-fp8's run 1) and the
# whole-engine check's reverts. No carry. At most ~235 s (stage timeouts 45 + 190). Logs in $OUT.
set -u
. "$(dirname "$0")/device_env.sh" kiln-fp8b
{
stage "GPU"; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
stage "GPU tests: FP8 encoder"
timeout 45 python3 -m pytest -q -p no:cacheprovider --tb=short -rfE tests/gpu/test_quant_cuda.py \
  -k "fp8_layer_norm_quantize or fp8_ffn_up or fp8_encoder_engine" > "$OUT/tests.log" 2>&1
echo "pytest rc $?"; grep -v "DEBUG\|^$" "$OUT/tests.log" | tail -30
stage "engines: bert_b64 kiln_fp16, kiln_fp8_ptq (--profile)"
timeout 190 python3 bench/quant_gpu.py --sections engines --engines bert_b64 --modes kiln_fp16,kiln_fp8_ptq \
  --row-timeout 150 --profile --out "$OUT/engines" 2>&1 | grep -v "^bert_b64 kiln" | tail -8
python3 bench/quant_gpu.py --show-profiles "$OUT/engines/quant_gpu.log"
stage done
} 2>&1 | tee "$OUT/fp8b.log"
