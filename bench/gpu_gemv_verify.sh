#!/usr/bin/env bash
# Device call (issue 15), optional: the GPU checks the H200 sweep run (bench/gpu_gemv_sweep.sh) did not cover —
# a chain of dependent PDL GEMVs in a CUDA graph bit-equal to the chain without PDL, the gemv knobs compiled on
# the device against torch, and the LLM GPU tests with the new ENGINE_CONFIGS (pdl variants). Under 240 s.
set -u
. "$(dirname "$0")/device_env.sh" kiln-gemv-verify
{
stage "gemv knobs compiled on the device (PDL chain, prefetch, cache hints, persistent) vs torch"
TRITON_INTERPRET=0 timeout 110 python3 -m pytest -q -p no:cacheprovider -n 0 -o addopts="" -rfE \
  tests/llm/test_gemv_kernel.py -k "pdl or knobs or pf or p1 or p2 or evict" 2>&1 | tail -4
stage "fused GEMVs with the knobs (compiled)"
TRITON_INTERPRET=0 timeout 50 python3 -m pytest -q -p no:cacheprovider -n 0 -o addopts="" -rfE \
  tests/llm/test_fused_gemv.py -k "pf" 2>&1 | tail -4
stage "LLM GPU tests under the new shortlist (decode fusion auto)"
TRITON_INTERPRET=0 timeout 70 python3 -m pytest -q -p no:cacheprovider -n 0 -m gpu -o addopts="" -rfE \
  tests/llm/test_decode_fusion.py tests/llm/test_gpu.py 2>&1 | tail -4
stage done
} 2>&1 | tee "$OUT/verify.log"
