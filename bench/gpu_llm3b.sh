#!/usr/bin/env bash
# Second device call for issue 15 (helper llm3, 2026-12-03), ~140 s. Run 1 (bench/results/llm3-run1-2026-12-03.log)
# measured async scheduling (same tokens; host not hidden per step at 1024 from 11.2 to 3.7 ms) but its pytest stage
# timed out before the async GPU tests. 1. Those tests (async against the waiting engine, fp32 and bf16; graphed
# sampling against eager, now launched ahead). 2. 128/128 throughput with the startup heap out of GC scans
# (engine.static_heap: gen-2 collections stalled the host ~0.3 s each at 1024 on the CPU stub): FP8 weights,
# bf16 KV at 512/1024, async off then on; FP8 + FP8 KV at 512/1024, async on. No carry. Logs in $OUT.
set -u
. "$(dirname "$0")/device_env.sh" kiln-llm3b
{
stage "device"
nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm --format=csv,noheader
stage "GPU tests: async scheduling + graphed sampling (timeout 60 s)"
timeout 60 python3 -m pytest -q -rfE -p no:cacheprovider -m gpu tests/llm/test_gpu_graphs.py -k "async or sampling_equals"
mkdir -p "$OUT/tp-fp8" "$OUT/tp-kv8"
stage "throughput 128/128, fp8 at 512/1024, async off then on (budget 50 s)"
python3 bench/llm_throughput.py --trees . --batch 512 1024 --configs fp8 --overlap off on \
  --kv-cache-memory 36GiB --budget 50 --per-run 35 --out "$OUT/tp-fp8"
left=$((150 - SECONDS))
stage "throughput 128/128, fp8-kv8 at 512/1024, async on (budget $left s; skipped under 30)"
python3 bench/llm_throughput.py --trees . --batch 512 1024 --configs fp8-kv8 --overlap on \
  --kv-cache-memory 36GiB --budget $left --per-run 30 --out "$OUT/tp-kv8"
stage "done after $SECONDS s"
} 2>&1 | tee "$OUT/llm3b.log"
