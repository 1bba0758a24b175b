#!/usr/bin/env bash
# Session 19's second device call (<= 590 s; carry .whl-serve): h-blocking's race check (bench/gpu_blocking.sh, <= 5 min)
# then h-fp8att's FP8 QDQ BERT row with the quantized attention kernel (<= 270 s).
set -u
export OUT=${OUT:-/tmp/kiln-s19b}
mkdir -p "$OUT"
timeout 300 bash bench/gpu_blocking.sh 2>&1 | tail -30
echo "== fp8att"
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_quantized_attention_cuda.py -k 64x64 2>&1 | tail -2
timeout 50 python3 bench/quantized_attention.py --iters 10 2>&1 | grep -v Warn | tail -12
timeout 150 python3 bench/quant_gpu.py --sections engines --engines bert_b64 --modes kiln_fp16,kiln_fp8 \
  --opt-level 2 --profile --row-timeout 70 --out $OUT/q 2>&1 | grep "^| "
python3 bench/quant_gpu.py --show-profiles $OUT/q/quant_gpu.log 2>/dev/null \
  | grep -v "^   note\|^   tuner FusedGemm\|^   tuner QGemm\|^   tuner LayerNorm" | cut -c1-400 | head -24
