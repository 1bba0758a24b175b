#!/usr/bin/env bash
# One device call for kiln.llm on a GPU: the CUDA tests of tests/llm (Triton kernels compiled, not
# interpreted), then bench/llm.py. Usage: bench/llm_gpu.sh TEST_TIMEOUT BENCH_TIMEOUT [bench args...]
# Logs go to $OUT (tests.log, bench.log, results.md); KILN_COMMIT names the commit measured.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
test_timeout=$1; bench_timeout=$2; shift 2
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv | tee "$OUT/device.txt"
python3 -c 'import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)' \
  | tee -a "$OUT/device.txt"
if [ "$test_timeout" -gt 0 ]; then
  # the fused kernels first: if they fail on the device, the rest runs on the torch code (KILN_LLM_FUSED=0)
  timeout 120 python3 -m pytest -q -p no:cacheprovider -n 0 -o addopts="" -rfE tests/llm/test_fused_kernels.py \
    2>&1 | tee "$OUT/fused.log" | tail -15
  grep -q " passed" "$OUT/fused.log" && ! grep -q "failed\|error" "$OUT/fused.log" || export KILN_LLM_FUSED=0
  echo "KILN_LLM_FUSED=${KILN_LLM_FUSED:-1}"
  timeout "$test_timeout" python3 -m pytest -q -p no:cacheprovider -n 0 -m gpu -o addopts="" -rfE \
    tests/llm/test_gpu.py tests/llm/test_gpu_graphs.py 2>&1 | tee "$OUT/tests.log" | tail -40
  timeout "$test_timeout" python3 -m pytest -q -p no:cacheprovider -n 0 -o addopts="" -rfE \
    tests/llm/test_paged_decode_kernel.py tests/llm/test_paged_prefill_kernel.py tests/llm/test_quant_gemm_kernel.py \
    2>&1 | tee "$OUT/kernels.log" | tail -25
fi
if [ "$bench_timeout" -gt 0 ]; then
  timeout "$bench_timeout" python3 bench/llm.py "$@" 2>&1 | tee "$OUT/bench.log" | grep -v "^(" | tail -30
  cp bench/results/llm-*.md "$OUT/" 2>/dev/null
fi
echo "== tests"; echo "KILN_LLM_FUSED=${KILN_LLM_FUSED:-1}"; grep -E "passed|failed|error" "$OUT/fused.log" "$OUT/tests.log" "$OUT/kernels.log" 2>/dev/null | tail -4
