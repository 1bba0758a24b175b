#!/usr/bin/env bash
# Device call 4 of 2026-12-02 (third session), on main after the helpers' merges: CUDA engine and dynamic-shape
# tests, the LLM's GPU tests with the decode GEMV choice, and Llama-3-8B decode bf16 / fp8 / int8 weights at
# batch 1 and 8. Carry [".whl"]. Logs in $OUT.
set -u
. "$(dirname "$0")/device_env.sh" kiln-s3c
{
stage "CUDA engines, bound tensors, dynamic shapes"
timeout 110 python3 -m pytest tests/gpu/test_cuda_engine.py tests/gpu/test_dynamic.py -q -p no:cacheprovider -rf 2>&1 | tail -4
stage "LLM: GEMV kernels and GPU tests"
TRITON_INTERPRET=0 timeout 60 python3 -m pytest -q -p no:cacheprovider -n 0 -o addopts="" -rf tests/llm/test_gemv_kernel.py \
  tests/llm/test_decode_gemv.py -k "not benchmark" 2>&1 | tail -3
TRITON_INTERPRET=0 timeout 80 python3 -m pytest -q -p no:cacheprovider -n 0 -m gpu -o addopts="" -rf \
  tests/llm/test_gpu.py tests/llm/test_gpu_graphs.py 2>&1 | tail -3
stage "LLM decode llama3-8b, batch 1 8: bf16, fp8, int8 weights (gemv auto)"
timeout 200 python3 bench/llm.py --preset llama3-8b --dtype bfloat16 --batch 1 8 --input-len 128 --output-len 128 \
  --no-transformers --eager-batch --quantization fp8 int8 --no-write 2>&1 | grep "^| \|rror" | tail -12
stage done
} 2>&1 | tee "$OUT/s3c.log"
