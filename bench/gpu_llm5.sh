#!/usr/bin/env bash
# Device call for issue 15 (helper llm5, 2026-12-03), <= 150 s. 1. GPU tests: the fused FP8 norm and SwiGLU
# quantizers bit-equal to the two kernels at 16,384 rows, the norm's sum-of-squares layout under the device's Triton,
# a small FP8 engine with and without the fusion, the per-(request, K/V head) merge kernel (225d488: never run on a
# GPU) against the reference, batch invariance with graphs. 2. 128/128 at batch 512, FP8 weights + bf16 KV: the
# fused path ("default") and the unfused one (FP8 GEMMs quantizing their own input): the token digests must be
# equal (llm4 runs 1-2: they were not), and the throughput row. 3. The layer-by-layer compare of the two modes at
# the 8B shape (prefill of 512 x 128 + 2 decode steps), first with the E4M3 store at its own 16-wide vectors (the
# kernel before 580d136: a copy of kiln/ with that one line undone), then this tree. No carry. Logs in $OUT.
set -u
. "$(dirname "$0")/device_env.sh" kiln-llm5
{
stage "device"
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
stage "GPU tests (timeout 70 s)"
TRITON_INTERPRET=0 timeout 70 python3 -m pytest -v -rfE -p no:cacheprovider tests/llm/test_fused_kernels.py \
  tests/llm/test_paged_decode_kernel.py tests/llm/test_gpu.py tests/llm/test_gpu_graphs.py -k "one_pass or \
  one_layout or change_no_bit or default_splits or past_a_request or does_not_depend or longer_splits or \
  batch_invariance_with"
left=$((122 - SECONDS))
stage "128/128 batch 512 FP8 + bf16 KV: fused / unfused tokens and throughput (budget $left s)"
mkdir -p "$OUT/tp"
python3 bench/llm_throughput.py --trees . --batch 512 --configs fp8 --variants default unfused-fp8 \
  --kv-cache-memory 36GiB --budget $left --per-run 21 --out "$OUT/tp"
stage "layer by layer, fused vs unfused, the E4M3 store at its own width (timeout 25 s)"
mkdir -p /tmp/before && cp -r kiln /tmp/before/
sed -i 's/fp8_cols = tl.max_contiguous(.*)$/fp8_cols = cols/' /tmp/before/kiln/llm/kernels/fused.py
grep -c "fp8_cols = cols$" /tmp/before/kiln/llm/kernels/fused.py
timeout 25 python3 bench/llm_fp8_fusion_compare.py --tree /tmp/before
left=$((147 - SECONDS))
stage "layer by layer, this tree (timeout $left s)"
[ "$left" -gt 5 ] && timeout $left python3 bench/llm_fp8_fusion_compare.py
stage "done after $SECONDS s"
} 2>&1 | tee "$OUT/llm5.log"
