#!/usr/bin/env bash
# Second device call for issue 15 (helper llm2, 2026-12-03): the paged decode kernel with 256-key splits (one split,
# no merge, for requests up to 256 keys) in the engine. The step profile again (in situ at 256 and 64, FP8 weights,
# bf16 KV; then FP8 KV), GEMM variants at 64-1024 rows, attention variants; 128/128 offline throughput at batch
# 256/512/1024 (FP8) and 256/512/1024, then 2048 (FP8 + FP8 KV). The baseline's numbers are in the first call's log
# (bench/results/llm-throughput-2026-12-03.md). carry [".cache/llm2-base"] as before. < 240 s; logs in $OUT.
set -u
. "$(dirname "$0")/device_env.sh" kiln-llmstep2
{
stage "device"
nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm --format=csv,noheader
stage "step profile: batch 256, FP8 weights (timeout 90 s)"
timeout 90 python3 bench/llm_step_profile.py --batch 256 --baseline .cache/llm2-base --out "$OUT"
mkdir -p "$OUT/tp" "$OUT/tp-kv8" "$OUT/kv8"
stage "throughput 128/128, fp8 at 256/512/1024"
python3 bench/llm_throughput.py --trees . --batch 256 512 1024 --configs fp8 --kv-cache-memory 36GiB \
  --budget 45 --per-run 30 --out "$OUT/tp"
stage "throughput 128/128, fp8-kv8 at 256/512/1024"
python3 bench/llm_throughput.py --trees . --batch 256 512 1024 --configs fp8-kv8 --kv-cache-memory 36GiB \
  --budget 45 --per-run 30 --out "$OUT/tp-kv8"
left=$((232 - SECONDS))
stage "throughput 128/128, fp8-kv8 at 2048 alone (its own process: an out-of-memory loses only it; budget $left s)"
mkdir -p "$OUT/tp-kv8-2048"
python3 bench/llm_throughput.py --trees . --batch 2048 --configs fp8-kv8 --kv-cache-memory 36GiB \
  --budget $left --per-run 30 --out "$OUT/tp-kv8-2048"
left=$((232 - SECONDS))
if [ $left -gt 30 ]; then
  stage "step profile in situ, FP8 KV (timeout $left s)"
  timeout $left python3 bench/llm_step_profile.py --batch 256 --kv-cache-dtype fp8 --parts situ --out "$OUT/kv8"
fi
stage "done after $SECONDS s"
} 2>&1 | tee "$OUT/llmstep2.log"
