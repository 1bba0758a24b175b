#!/usr/bin/env bash
# Device call for issue 15 (helper llm2, 2026-12-03): where a batch-256 FP8 decode step's ~11 ms go (kernel by kernel,
# GEMM and attention variants alone), then 128/128 offline throughput at batch 256/512/1024, FP8 and FP8 + FP8 KV, this
# tree, then the baseline f3d6f5d (FP8) with the time left. The baseline's kiln/ is carried in .cache/llm2-base:
#   mkdir -p .cache/llm2-base && git archive f3d6f5d kiln | tar -x -C .cache/llm2-base      carry [".cache/llm2-base"]
# Must finish in < 240 s; logs and tables in $OUT.
set -u
. "$(dirname "$0")/device_env.sh" kiln-llmstep
{
stage "device"
nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm --format=csv,noheader
stage "step profile: batch 256, FP8 weights (timeout 105 s)"
timeout 105 python3 bench/llm_step_profile.py --batch 256 --baseline .cache/llm2-base --out "$OUT"
left=$((232 - SECONDS))
stage "throughput 128/128, this tree, fp8 and fp8-kv8 at 256/512/1024 (budget $((left - 42)) s)"
mkdir -p "$OUT/tp" "$OUT/tp-base"
python3 bench/llm_throughput.py --trees . --batch 256 512 1024 --configs fp8 fp8-kv8 --kv-cache-memory 36GiB \
  --budget $((left - 42)) --per-run 40 --out "$OUT/tp"
left=$((232 - SECONDS))
stage "throughput 128/128, baseline f3d6f5d, fp8 (budget $left s)"
python3 bench/llm_throughput.py --trees .cache/llm2-base --batch 256 512 1024 --configs fp8 --kv-cache-memory 36GiB \
  --budget $left --per-run 35 --out "$OUT/tp-base"
stage "done after $SECONDS s"
} 2>&1 | tee "$OUT/llmstep.log"
