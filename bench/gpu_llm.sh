#!/usr/bin/env bash
# Device call for issue 15 (helper llm, session 13, 2026-12-04), <= 180 s: where an FP8 KV cache loses end to end at
# batch 512, and the fixes: FP8-KV decode attention one warp a program (llm7's 81 us config), the paged prefill
# kernel's fp16 products on an FP8 cache, and prefill_attention="flash" (opt-in: whole prompts through flash).
# 1. GPU tests of what changed (-x): flash prefill vs the reference (bf16 / FP8 caches) and in an engine, the
#    kernels on an FP8 cache, the decode kernel's default launch.
# 2. Kernels alone: prefill attention of 512 x 128-token prompts (paged kernel launches, flash), decode attention
#    at batch 512, 192 keys (4 / 2 / 1 warps).
# 3. 128/128 at batch 512, one process each, in this order while the budget lasts: fp8-kv8 main-attn (main's FP8-KV
#    attention) / fp8 (bf16 KV: main's path) / fp8-kv8 default (this branch) / fp8-kv8 flash / fp8 flash; the first
#    two also profile one prefill step and one decode replay kernel by kernel (--profile: FP8 KV against bf16 KV).
# No carry. Logs in $OUT.
set -u
. "$(dirname "$0")/device_env.sh" kiln-llm
{
stage "device, commit ${KILN_COMMIT:-?}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader
stage "GPU tests (timeout 45 s)"
TRITON_INTERPRET=0 timeout 45 python3 -m pytest -x -q -rfE --tb=short -p no:cacheprovider tests/llm/test_fp8_kv.py \
  tests/llm/test_paged_decode_kernel.py tests/llm/test_flash_prefill.py \
  -k "flash or reads_an_fp8_cache or default_splits" 2>&1 | tail -25
stage "kernels alone: decode attention b512 x 192 keys, prefill attention 512 x 128 (timeout 38 s)"
timeout 38 python3 bench/llm_step_profile.py --batch 512 --parts prefill-attention attention --attention-batches 512 1 \
  --decoded 64 --bf16-variants "n32 w4 s5" "n32 w2 s5" "n32 w1 s5" \
  --fp8-variants "n32 w4 s5 f16" "n32 w1 s5 f16" "n32 w1 s4 f16" "n32 w1 s3 f16" "n64 w1 s4 f16" "n16 w1 s6 f16" \
  --out "$OUT" 2>&1 | grep -v -E "UserWarning|_warn_once"
left=$((172 - SECONDS))
stage "128/128 b512: fp8-kv8 main-attn, fp8 (profiled), fp8-kv8 default, fp8-kv8 flash, fp8 flash (budget $left s)"
mkdir -p "$OUT/tp"
python3 bench/llm_throughput.py --trees . --batch 512 --runs fp8-kv8:main-attn fp8:default fp8-kv8:default \
  fp8-kv8:flash fp8:flash --profile fp8-kv8:main-attn fp8:default --kv-cache-memory 36GiB \
  --budget $left --per-run 18 --out "$OUT/tp" 2>&1 | grep -v -E "UserWarning|_warn_once"
stage "done after $SECONDS s"
} 2>&1 | tee "$OUT/llm.log"
