#!/usr/bin/env bash
# Device call (issue 15): the decode layer's fused GEMVs (kiln/llm/decode_fusion.py): compiled kernel tests, the
# end-to-end decode with fusions off / auto / on, the fused kernels against their unfused pairs on Llama-3-8B's
# shapes, then the GPU tests. Each stage has its own timeout (all together under 10 minutes).
set -u
. "$(dirname "$0")/device_env.sh" kiln-fusion
{
stage "fused GEMV kernels compiled on the device (tests vs torch)"
TRITON_INTERPRET=0 timeout 100 python3 -m pytest -q -p no:cacheprovider -n 0 -o addopts="" -rfE \
  tests/llm/test_fused_gemv.py 2>&1 | tail -4
stage "end to end: llama3-8b bf16 decode, fusion off / auto / on, batch 1 and 8"
timeout 300 python3 bench/llm_fusion.py --skip-kernels --batch 1 8 --modes off auto on 2>&1 | grep -v Warn
stage "fused kernels vs unfused pairs, llama3-8b shapes"
timeout 130 python3 bench/llm_fusion.py --skip-e2e --rows 1 8 2>&1 | grep -v Warn
stage "GPU tests: fused bf16 logits vs fp32, existing LLM GPU tests under fusion auto"
TRITON_INTERPRET=0 timeout 60 python3 -m pytest -q -p no:cacheprovider -n 0 -m gpu -o addopts="" -rfE \
  tests/llm/test_decode_fusion.py tests/llm/test_gpu.py 2>&1 | tail -4
stage done
} 2>&1 | tee "$OUT/fusion.log"
