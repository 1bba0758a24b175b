#!/usr/bin/env bash
# The session's closing device call (2026-12-02, second session): main after the helpers' merges on CUDA
# (engines, dynamic shapes, tactics), the LLM decode at batch 1/8/64 and its kernel table, and the GPU INT8
# engine row that earlier calls could not finish. Carry [".whl"]. Logs in $OUT.
set -u
. "$(dirname "$0")/device_env.sh" kiln-close
{
stage "CUDA engines and dynamic shapes on this tree"
timeout 130 python3 -m pytest tests/gpu/test_cuda_engine.py tests/gpu/test_dynamic.py -q -p no:cacheprovider -rf \
  2>&1 | tail -4
stage "LLM kernels on the device (FP8 KV, draft model on CPU)"
TRITON_INTERPRET=0 timeout 90 python3 -m pytest -q -p no:cacheprovider -n 0 -o addopts="" -rf tests/llm/test_fp8_kv.py \
  tests/llm/test_paged_decode_kernel.py tests/llm/test_fused_kernels.py 2>&1 | tail -3
TRITON_INTERPRET=0 timeout 80 python3 -m pytest -q -p no:cacheprovider -n 0 -m gpu -o addopts="" -rf \
  tests/llm/test_gpu.py tests/llm/test_gpu_graphs.py 2>&1 | tail -3
stage "LLM decode, batch 1 8 64"
timeout 110 python3 bench/llm.py --preset llama3-8b --dtype bfloat16 --batch 1 8 64 --input-len 128 --output-len 128 \
  --no-transformers --eager-batch --no-write 2>&1 | grep "^| kiln" | tail -4
timeout 70 python3 bench/llm.py --preset llama3-8b --dtype bfloat16 --batch 1 64 --input-len 128 --output-len 128 \
  --no-transformers --eager-batch --kv-cache-dtype fp8 --no-write 2>&1 | grep "^| kiln" | tail -2
timeout 60 python3 bench/llm_profile.py --top 20 2>&1 | grep -i "replay\|argmax\|decode_split\|merge" | head -5
stage "ResNet-50 batch 256: kiln fp16 vs int8 (ORT QDQ)"
timeout 100 python3 bench/quant_gpu.py --sections engines --engines resnet50_b256 --modes kiln_fp16,kiln_int8 \
  --row-timeout 90 --out "$OUT" 2>&1 | grep -v Warn | tail -8
stage done
} 2>&1 | tee "$OUT/close.log"
