#!/usr/bin/env bash
# Device call for issue 15 (helper llm3, 2026-12-03), ~200 s: async scheduling (the host plans step n+1 while the
# GPU runs step n). 1. 128/128 offline throughput, FP8 weights + FP8 KV, batch 256/512/1024, async scheduling off
# and on in one process (same weights, same prompts: the digests must agree); the 131k-token prefill at 1024 also
# re-runs the fused kernels' 64-bit row offsets at the size that broke them. 2. The GPU tests touched: graphs
# (async against the waiting engine, eager against graphed) and the fused kernels on the GPU. 3. The step profile
# in situ at batch 512 (+ the GEMMs alone at 64-1024 rows: rowwise against per-tensor FP8 for o/down) and 256.
# 4. FP8 weights + bf16 KV throughput, async on, with what time is left. No carry needed. Logs in $OUT.
set -u
. "$(dirname "$0")/device_env.sh" kiln-llm3
{
stage "device"
nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm --format=csv,noheader
mkdir -p "$OUT/tp-kv8" "$OUT/tp-fp8"
stage "throughput 128/128, fp8-kv8 at 256/512/1024, async off then on (budget 70 s)"
python3 bench/llm_throughput.py --trees . --batch 256 512 1024 --configs fp8-kv8 --overlap off on \
  --kv-cache-memory 36GiB --budget 70 --per-run 40 --out "$OUT/tp-kv8"
stage "GPU tests: graphs + async (timeout 55 s)"
timeout 55 python3 -m pytest -q -rfE -p no:cacheprovider -m gpu tests/llm/test_gpu_graphs.py \
  -k "async or greedy_decode_equals_eager or sampling_equals or penalties or bf16_decode or batch_invariance"
stage "GPU tests: fused kernels on the GPU (timeout 25 s)"
TRITON_INTERPRET=0 timeout 25 python3 -m pytest -q -rfE -p no:cacheprovider tests/llm/test_fused_kernels.py -k "not 64_bit"
stage "step profile: batch 512 and 256 in situ + GEMMs alone (timeout 55 s)"
timeout 55 python3 bench/llm_step_profile.py --batch 512 --situ-batches 512 256 --parts situ gemm \
  --kv-cache-memory 16GiB --out "$OUT"
left=$((210 - SECONDS))
stage "throughput 128/128, fp8 (bf16 KV) at 256/512/1024, async on (budget $left s; skipped under 30)"
python3 bench/llm_throughput.py --trees . --batch 256 512 1024 --configs fp8 --overlap on \
  --kv-cache-memory 36GiB --budget $left --per-run 30 --out "$OUT/tp-fp8"
stage "done after $SECONDS s"
} 2>&1 | tee "$OUT/llm3.log"
