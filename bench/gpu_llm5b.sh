#!/usr/bin/env bash
# Second device call for issue 15 (helper llm5, 2026-12-03), <= 150 s. 1. GPU tests added after run 1: the fused
# FP8 norm against the two kernels at 65,536 rows, bf16 and fp32 rows (the E4M3 store's vector now follows the row's
# dtype); the sum-of-squares layout check over bf16/fp16/fp32 under the device's Triton; the fused-vs-unfused prefill
# logits of a 4096-wide model over 4,096 rows. 2. Where the wall time of a batch-512 decode step goes beyond its
# graph replay (llm4: 1.3-1.7 ms a step, read as host time not hidden): bench/llm_step_timeline.py times every replay
# in place (CUDA events on the engine's own launch path) and the GPU's idle time between replays, FP8 weights + bf16
# KV, 128/128, async on; nvidia-smi logs the SM clock and power every 100 ms meanwhile. 3. 128/128 at batch 512,
# fused / unfused / fused / unfused with the time left (the same tokens; the fusion's speed). No carry.
set -u
. "$(dirname "$0")/device_env.sh" kiln-llm5b
{
stage "device"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader
stage "GPU tests (timeout 45 s)"
TRITON_INTERPRET=0 timeout 45 python3 -m pytest -v -rfE -p no:cacheprovider tests/llm/test_fused_kernels.py \
  tests/llm/test_gpu.py -k "norm_quantized_in_one_pass or one_layout or change_no_bit_at_llama3"
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader -lms 100 \
  > "$OUT/smi.csv" 2>&1 &
smi=$!
stage "decode timeline, batch 512, FP8 weights + bf16 KV (timeout 40 s)"
timeout 40 python3 bench/llm_step_timeline.py --batch 512 --config fp8
kill $smi
stage "SM clock and power during the timeline (samples over 300 W), and the clocks seen"
awk -F', ' '$3+0 > 300 {n++; c+=$2; p+=$3} END {if (n) printf "%d samples: mean SM clock %.0f MHz, mean power %.0f W\n", n, c/n, p/n}' "$OUT/smi.csv"
awk -F', ' '{print $2}' "$OUT/smi.csv" | sort | uniq -c | sort -rn | head -6
left=$((146 - SECONDS))
stage "128/128 batch 512 FP8 + bf16 KV: fused / unfused / fused / unfused (budget $left s)"
mkdir -p "$OUT/tp"
python3 bench/llm_throughput.py --trees . --batch 512 --configs fp8 --variants default unfused-fp8 default \
  unfused-fp8 --kv-cache-memory 36GiB --budget $left --per-run 20 --out "$OUT/tp"
stage "done after $SECONDS s"
} 2>&1 | tee "$OUT/llm5b.log"
