#!/usr/bin/env bash
# Device call of 2026-12-03 (issue 12, h-fp8b, run 4, the lead's last combined call: <= 120 s): BERT-base batch
# 64 x 384, kiln fp16 vs kiln's FP8 engine after run 2 (1.04x; its FFN up's Gelu -> fp8 pass, already the tiled
# one, compute-bound at 0.195 ms): the cheaper Gelu before 8-bit outputs (1b44759) and the store rounding to E4M3
# in hardware (38cf556, ebdedbe); then the GPU test of that rounding (bit for bit the arithmetic one). No carry.
# Hard timeouts 100 + 14 s (run 2: both engine rows 86 s). Logs in $OUT.
set -u
. "$(dirname "$0")/device_env.sh" kiln-fp8b4
{
stage "engines: bert_b64 kiln_fp16, kiln_fp8_ptq (--profile)"
timeout 100 python3 bench/quant_gpu.py --sections engines --engines bert_b64 --modes kiln_fp16,kiln_fp8_ptq \
  --row-timeout 60 --profile --out "$OUT/engines" 2>&1 | grep "^| bert"
python3 bench/quant_gpu.py --show-profiles "$OUT/engines/quant_gpu.log" | grep -v "^   tuner FusedGemm" | cut -c1-700
stage "GPU test: the store's hardware E4M3 rounding is qmath's"
timeout 14 python3 -m pytest -q -p no:cacheprovider --tb=short tests/gpu/test_quant_cuda.py -k hardware_rounding 2>&1 \
  | grep -v "DEBUG\|^$" | tail -6
stage done
} 2>&1 | tee "$OUT/fp8b4.log"
