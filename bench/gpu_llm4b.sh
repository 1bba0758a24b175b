#!/usr/bin/env bash
# Second device call for issue 15 (helper llm4, 2026-12-03), <= 240 s: the branch with its new defaults against
# main's behaviour, and where the time goes now. 1. GPU tests: the fused FP8 quantizers' bits, launch settings'
# bits, the FP8 engine's bits with and without the fusion (run 1: a 128/128 run's tokens differed), FP8-cache
# kernel and engine, graphed greedy = eager, batch invariance. 2. The step profile at batch 512 (FP8 weights, bf16
# KV): the decode graph in situ and one prefill step, kernel by kernel. 3. 128/128 offline throughput at batch 512,
# async on, interleaved A/B/A/B at FP8 weights + bf16 KV: "main" = the FP8 GEMMs quantizing their own input and
# main's decode launch (n64 w4 s3, bf16 products), "branch" = this tree's defaults (32-key tiles at 5 stages,
# fp16 products for an FP8 cache, fused quantization); then FP8 + FP8 KV A/B/A/B with the time left.
# No carry. Logs in $OUT.
set -u
. "$(dirname "$0")/device_env.sh" kiln-llm4b
{
stage "device"
nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm --format=csv,noheader
stage "GPU tests (timeout 70 s)"
TRITON_INTERPRET=0 timeout 70 python3 -m pytest -q -rfE -p no:cacheprovider tests/llm/test_gpu.py \
  tests/llm/test_fused_kernels.py tests/llm/test_paged_decode_kernel.py tests/llm/test_fp8_kv.py \
  tests/llm/test_gpu_graphs.py -k "change_no_bit or one_pass or launch_settings or reads_an_fp8_cache or \
  engine_with_an_fp8 or greedy_decode_equals_eager or batch_invariance_with"
stage "step profile, batch 512, FP8 weights + bf16 KV: in situ and prefill (timeout 50 s)"
timeout 50 python3 bench/llm_step_profile.py --batch 512 --parts situ prefill --situ-batches 512 \
  --kv-cache-memory 16GiB --out "$OUT"
echo '{"bf16": {"name": "main", "block_n": 64, "num_warps": 4, "num_stages": 3, "fp8_f16_dot": false, "heads_first": false}, "fp8": {"name": "main", "block_n": 64, "num_warps": 4, "num_stages": 3, "fp8_f16_dot": false, "heads_first": false}}' > "$OUT/main_launch.json"
mkdir -p "$OUT/tp"
left=$((234 - SECONDS))
stage "throughput 128/128 batch 512: fp8 main / branch / main / branch, then fp8-kv8 branch (budget $left s)"
python3 bench/llm_throughput.py --trees . --batch 512 --configs fp8 fp8-kv8 \
  --variants unfused-fp8+attn default unfused-fp8+attn default --attention-json "$OUT/main_launch.json" \
  --kv-cache-memory 36GiB --budget $left --per-run 21 --out "$OUT/tp"
stage "done after $SECONDS s"
} 2>&1 | tee "$OUT/llm4b.log"
