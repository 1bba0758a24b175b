#!/usr/bin/env bash
# Device check for h-qadd (issue 12, <= 8 min cold, no carry): onnxruntime's FP8 QDQ BERT-base (bert_b64, 64 x 384,
# --opt-level 2) before and after the E4M3 DequantizeLinear / QuantizeLinear joined the elementwise chains around
# them (kiln/passes/fusion/elementwise_dequantize.py): kiln_fp8_dq_unfused is the engine with those rules dropped,
# kiln_fp8 the default. Section 5 of bench/results/gpu-s21-2026-12-06.md (H100): kiln_fp8 17.57 ms, kiln fp16
# 10.17, 96 standalone DequantizeLinear (7.42 ms eager), 48 QuantizeLinear (3.87), 49 torch Adds (3.67). Prints the engines table (ms, the
# layer counts in "8-bit layers") and the eager profile's top kinds per engine. Logs in $OUT.
set -u
. "$(dirname "$0")/device_env.sh" kiln-qadd
START=$(date +%s)
left() { echo $((450 - $(date +%s) + START)); }
{
stage "GPU"; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
stage "kernel tests (the Triton Elementwise reading E4M3 on the GPU)"
TRITON_INTERPRET=0 timeout 40 python3 -m pytest -q -p no:cacheprovider --tb=line \
  -m "not slow" tests/kernels/test_elementwise_dequantize.py 2>&1 | tail -3
for MODE in kiln_fp8_dq_unfused kiln_fp8; do
  T=$(( $(left) - 5 )); [ "$MODE" = kiln_fp8_dq_unfused ] && T=$(( T / 2 ))  # half for the first row
  stage "engine: bert_b64 $MODE (--profile), ${T} s"
  timeout "$T" python3 bench/quant_gpu.py --sections engines --engines bert_b64 --modes "$MODE" --opt-level 2 \
    --row-timeout "$T" --profile --out "$OUT/engines" 2>&1 | grep "^| bert"
done
python3 bench/quant_gpu.py --show-profiles "$OUT/engines/quant_gpu.log" 2>/dev/null \
  | grep "^--\|eager total\|^      *[0-9]" | cut -c1-400 | head -24
stage done
} 2>&1 | tee "$OUT/qadd.log"
