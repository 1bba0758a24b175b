#!/usr/bin/env bash
# First device call for issue 15 (helper llm4, 2026-12-03), <= 240 s. 1. GPU tests: the norm/SwiGLU + FP8 quantize
# kernels bit-equal to the two-kernel path (kernels alone, then an FP8 engine's prefill logits and graphed greedy
# tokens), the FP8 perplexity test, the FP8-cache engine test. 2. Paged decode attention alone at batch 512/1024 and
# 192 keys: launch variants (tile, warps, num_stages: Triton keeps a K/V tile in flight only from 5 on sm_90; fp16
# products for an FP8 cache; heads-first grid order); the fastest per KV dtype goes to $OUT/decode_attention_best.json. 3. 128/128 offline
# throughput at batch 512, async on: FP8 + FP8 KV and FP8 (bf16 KV), each as unfused-fp8 (the baseline: main's
# kernels), default (this branch: fused quantization) and attn (+ the fastest decode launch), one process each.
# No carry. Logs in $OUT.
set -u
. "$(dirname "$0")/device_env.sh" kiln-llm4
{
stage "device"
nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm --format=csv,noheader
stage "GPU tests (timeout 50 s)"
TRITON_INTERPRET=0 timeout 50 python3 -m pytest -q -rfE -p no:cacheprovider tests/llm/test_fused_kernels.py \
  tests/llm/test_paged_decode_kernel.py tests/llm/test_gpu.py -k "one_pass or fp8 or launch_settings"
stage "decode attention variants, batch 512 and 1024, 192 keys (timeout 55 s)"
timeout 55 python3 bench/llm_step_profile.py --parts attention --attention-batches 512 1024 --out "$OUT"
best="$OUT/decode_attention_best.json"
[ -s "$best" ] || echo '{"bf16": {"name": "default", "block_n": 64, "num_warps": 4, "num_stages": 3, "fp8_f16_dot": false}, "fp8": {"name": "default", "block_n": 64, "num_warps": 4, "num_stages": 3, "fp8_f16_dot": false}}' > "$best"
cat "$best"; echo
mkdir -p "$OUT/tp-kv8" "$OUT/tp-fp8"
left=$((228 - SECONDS))
stage "throughput 128/128 batch 512, fp8-kv8 then fp8: unfused-fp8 / default / attn (budget $left s)"
python3 bench/llm_throughput.py --trees . --batch 512 --configs fp8-kv8 fp8 --variants unfused-fp8 default attn \
  --attention-json "$best" --kv-cache-memory 36GiB --budget $left --per-run 20 --out "$OUT/tp-kv8"
stage "done after $SECONDS s"
} 2>&1 | tee "$OUT/llm4.log"
