#!/usr/bin/env bash
# Second device call for issue 15 (helper llm2, 2026-12-03), at most ~165 s (the lead's limit: 170): the paged decode
# kernel with 256-key splits (one split, no merge, for requests up to 256 keys) in the engine. The step profile in situ
# at batch 256 and 64 (FP8 weights, bf16 KV) and the attention variants at batch 1/256/1024; 128/128 offline throughput
# at batch 256/512/1024 (FP8), then FP8 + FP8 KV at 1024/2048 with the time left. The baseline's numbers are in the
# first call's log (bench/results/llmstep-run1-2026-12-03.log). carry [".cache/llm2-base"] as before. Logs in $OUT.
set -u
. "$(dirname "$0")/device_env.sh" kiln-llmstep2
{
stage "device"
nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm --format=csv,noheader
stage "step profile: batch 256, FP8 weights, in situ + attention (timeout 65 s)"
timeout 65 python3 bench/llm_step_profile.py --batch 256 --parts situ attention --attention-batches 1 256 1024 \
  --baseline .cache/llm2-base --out "$OUT"
mkdir -p "$OUT/tp" "$OUT/tp-kv8"
stage "throughput 128/128, fp8 at 256/512/1024 (budget 45 s)"
python3 bench/llm_throughput.py --trees . --batch 256 512 1024 --configs fp8 --kv-cache-memory 36GiB \
  --budget 45 --per-run 30 --out "$OUT/tp"
left=$((163 - SECONDS))
stage "throughput 128/128, fp8-kv8 at 1024/2048 (budget $left s; skipped under 30)"
python3 bench/llm_throughput.py --trees . --batch 1024 2048 --configs fp8-kv8 --kv-cache-memory 36GiB \
  --budget $left --per-run 30 --out "$OUT/tp-kv8"
stage "done after $SECONDS s"
} 2>&1 | tee "$OUT/llmstep2.log"
