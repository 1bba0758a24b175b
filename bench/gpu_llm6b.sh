#!/usr/bin/env bash
# Second device call for issue 15 (helper llm6, 2026-12-04), <= 150 s: the fix of the 286 ms host stall measured.
# Call 1 (gpu_llm6.sh) found it: one full garbage collection over 468,000 objects in the decode steps, because
# LLM.generate's static_heap froze nothing on CPython 3.12 (its collector freezes 375 immortal tuples itself, which
# the block took for a caller's freeze). 1. tests/unit/test_heap.py under the device's Python 3.12 (the block freezes
# after a full collection there). 2. bench/llm_step_timeline.py at batch 512, FP8 weights + bf16 KV, the fix in: no
# full pass, no GPU gap expected. 3. 128/128 at batch 512: default (the fix) / heap-unfrozen (the block freezing
# nothing, as before) / default / heap-unfrozen / gc-off (no automatic collection: the ceiling), the time left.
# No carry. Logs in $OUT.
set -u
. "$(dirname "$0")/device_env.sh" kiln-llm6b
{
stage "device"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader
python3 -c "import gc, sys; print(sys.version.split()[0], 'frozen at start', gc.get_freeze_count())"
stage "static_heap tests under the device's Python (timeout 30 s)"
timeout 30 python3 -m pytest -q -rfE -p no:cacheprovider tests/unit/test_heap.py
stage "decode timeline, batch 512, FP8 weights + bf16 KV, the fix in (timeout 40 s)"
timeout 40 python3 bench/llm_step_timeline.py --batch 512 --config fp8 --watchdog-ms 60 --stacks "$OUT/stacks.txt"
left=$((146 - SECONDS))
stage "128/128 batch 512 FP8 + bf16 KV: default / heap-unfrozen / default / heap-unfrozen / gc-off (budget $left s)"
mkdir -p "$OUT/tp"
python3 bench/llm_throughput.py --trees . --batch 512 --configs fp8 --variants default heap-unfrozen default \
  heap-unfrozen gc-off --kv-cache-memory 36GiB --budget $left --per-run 18 --out "$OUT/tp"
stage "done after $SECONDS s"
} 2>&1 | tee "$OUT/llm6b.log"
