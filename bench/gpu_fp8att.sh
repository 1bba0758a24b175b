#!/usr/bin/env bash
# Device call of 2026-12-04 (issue 12, h-fp8att, run 1, <= 150 s): FP8 attention for the FP8 BERT engine (kiln
# FP8 8.18 ms vs fp16 10.15 in h-fp8c: 1.24x; attention ~0.13 ms a block, fp16). kiln's flash-attention kernel with
# E4M3 products (Float8Scales: E4M3 q/k/v at per-tensor scales or fp16 ones quantized on load, p' = 448·p in
# E4M3, fp16 or E4M3 out) and, in the FP8 engine, the tactics cuda.attention.triton_fp8.* at the scale kiln's
# calibration measures (fp8_scale), judged against the op on E4M3-rounded inputs and timed against the fp16 ones.
# Stages: the attention layer at 64 x 384 (bench/fp8_attention.py, one tile per form: fp16 kiln, torch SDPA, kiln
# FP8 forms, cuDNN's FP8 SDPA; accuracy vs fp32), BERT-base 64 x 384 kiln fp16 vs kiln FP8 with profiles (the
# tuner's attention candidates), then the GPU tests in the time left. Carry: .whl (cuDNN FP8 SDPA row). Logs in $OUT.
set -u
. "$(dirname "$0")/device_env.sh" kiln-fp8att
START=$(date +%s)
left() { echo $((150 - $(date +%s) + START)); }
{
stage "GPU"; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
stage "attention at BERT-base 64 x 384: kiln fp16 vs kiln FP8 forms vs torch SDPA vs cuDNN FP8 SDPA"
timeout 38 python3 bench/fp8_attention.py --configs one 2>&1 | grep -v Warning > "$OUT/fp8_attention.log"
grep "^BERT\|^| " "$OUT/fp8_attention.log" | tail -12
T=$(( $(left) - 25 )); [ "$T" -gt 100 ] && T=100
stage "engines: bert_b64 kiln_fp16, kiln_fp8_ptq (--profile), ${T} s"
timeout "$T" python3 bench/quant_gpu.py --sections engines --engines bert_b64 --modes kiln_fp16,kiln_fp8_ptq \
  --row-timeout $(( T / 2 + 4 )) --profile --out "$OUT/engines" 2>&1 | grep "^| bert"
python3 bench/quant_gpu.py --show-profiles "$OUT/engines/quant_gpu.log" 2>/dev/null | grep -v "^   note" \
  | cut -c1-700 | head -40
T=$(( $(left) - 2 ))
if [ "$T" -gt 10 ]; then
  stage "GPU tests (${T} s): tests/gpu/test_fp8_attention.py, the default build's tiles"
  timeout "$T" python3 -m pytest -v -p no:cacheprovider --tb=line tests/gpu/test_fp8_attention.py \
    -k "128x64.w4s3 or 128x128.w8s3 or 64x64.w4s3" 2>&1 | grep "PASS\|FAIL\|Error\|passed\|failed" | cut -c1-300 | tail -12
fi
stage done
} 2>&1 | tee "$OUT/fp8att.log"
