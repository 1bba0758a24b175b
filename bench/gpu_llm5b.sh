#!/usr/bin/env bash
# Second device call for issue 15 (helper llm5, 2026-12-03), <= 150 s: where the wall time of a batch-512 decode
# step goes beyond its graph replay (llm4: 1.3-1.7 ms a step, read as host time not hidden). bench/llm_step_timeline.py
# times every replay in place (CUDA events on the engine's own launch path) and the GPU's idle time between replays,
# FP8 weights + bf16 KV, 128/128, async on; nvidia-smi logs the SM clock and power every 100 ms meanwhile (a step
# slower in place than alone could be the clock under a sustained FP8 load). Then the same for FP8 KV. No carry.
set -u
. "$(dirname "$0")/device_env.sh" kiln-llm5b
{
stage "device"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader -lms 100 > "$OUT/smi.csv" 2>&1 &
smi=$!
stage "decode timeline, batch 512, FP8 weights + bf16 KV (timeout 60 s)"
timeout 60 python3 bench/llm_step_timeline.py --batch 512 --config fp8
stage "decode timeline, batch 512, FP8 weights + FP8 KV (timeout 55 s)"
timeout 55 python3 bench/llm_step_timeline.py --batch 512 --config fp8-kv8
kill $smi
stage "SM clock and power while loaded (samples over 300 W), and the range of clocks"
awk -F', ' '$3+0 > 300 {n++; c+=$2; p+=$3} END {if (n) printf "%d samples: mean SM clock %.0f MHz, mean power %.0f W\n", n, c/n, p/n}' "$OUT/smi.csv"
awk -F', ' '{print $2}' "$OUT/smi.csv" | sort | uniq -c | sort -rn | head -6
stage "done after $SECONDS s"
} 2>&1 | tee "$OUT/llm5b.log"
