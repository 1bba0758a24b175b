#!/usr/bin/env bash
# Device call for issue 15 (helper llm6, 2026-12-04), <= 150 s: where the one 176 ms host stall of a batch-512
# 128/128 run (llm5 run 2, before replay 28: the GPU waited for the host) comes from, and what it costs.
# 1. bench/llm_step_timeline.py at batch 512, FP8 weights + bf16 KV, twice: the collector on (as the engine runs)
#    and off (gc.disable for the timed generate). Each decode engine.step's wall time against its thread CPU time,
#    page faults, context switches and collector time; the container's CPU throttling; a faulthandler watchdog
#    dumping every thread's stack while a decode step runs past 60 ms (the stall's line). No nvidia-smi running
#    (llm5 polled it through the run: one suspect fewer).
# 2. 128/128 at batch 512: default / gc-off (one process each).
# 3. With the time left: paged decode attention alone at batch 512 (and 1: bigger tiles must not lose there), 192
#    keys, FP8 then bf16 caches: the engine's launch (32-key tiles, 4 warps, 5 stages) against a split's keys in one
#    or two tiles of 128-256 with 8 warps (more of a request's K/V in flight per program; llm4 found the kernel
#    latency-bound at 3-4 programs an SM).
# No carry. Logs in $OUT.
set -u
. "$(dirname "$0")/device_env.sh" kiln-llm6
{
stage "device"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader
python3 -c "import sys, torch, triton; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)"
lscpu | grep -E "Model name|^CPU\(s\)" | tr -s ' '
for gc in on off; do
  stage "decode timeline, batch 512, FP8 weights + bf16 KV, collector $gc (timeout 40 s)"
  timeout 40 python3 bench/llm_step_timeline.py --batch 512 --config fp8 --gc $gc --watchdog-ms 60 \
    --stacks "$OUT/stacks-gc-$gc.txt"
done
stage "128/128 batch 512 FP8 + bf16 KV: default / gc-off (budget 40 s)"
mkdir -p "$OUT/tp"
python3 bench/llm_throughput.py --trees . --batch 512 --configs fp8 --variants default gc-off \
  --kv-cache-memory 36GiB --budget 40 --per-run 18 --out "$OUT/tp"
left=$((146 - SECONDS))
stage "decode attention alone, batch 512 then 1, 192 keys: bigger tiles, 8 warps (timeout $left s)"
timeout $left python3 bench/llm_step_profile.py --parts attention --attention-batches 512 1 --out "$OUT" \
  --fp8-variants "n32 w4 s5 f16" "n128 w8 s2 f16" "n256 w8 s1 f16" "n128 w8 s3 f16" "n64 w8 s4 f16" "n256 w8 s2 f16" \
  --bf16-variants "n32 w4 s5" "n128 w8 s2" "n256 w8 s1" "n128 w8 s3"
stage "done after $SECONDS s"
} 2>&1 | tee "$OUT/llm6.log"
