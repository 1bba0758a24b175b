#!/usr/bin/env bash
# Device call for task `tidy` (session 14, 2026-12-04): the folds whose code only runs on a GPU, <= 240 s.
#   bash bench/gpu_tidy.sh
# 1. bench/fp8_attention.py and bench/fp8_attention_chain.py at a small shape: both tables still print through
#    fp8_attention.print_table (every row a number or a reason, no "failed:" from the fold itself).
# 2. tests/gpu/test_quant_cuda.py's ResNet QDQ engine test, int8 minmax (its calibration now tests/calibration.py's
#    FeedsReader) and tests/llm/test_fp8_kv.py on the GPU (TRITON_INTERPRET=0: the prefill cases share one helper).
set -u
. "$(dirname "$0")/device_env.sh" kiln-tidy
export OUT
FILTER="Warning\|warn(\|torch.onnx\|return cls\|Evaluation failed\|^  warnings\|UserWarning\|DeprecationWarning"
{
stage "GPU (commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown))"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
stage "bench/fp8_attention.py --batch 8 --seq 128 --configs one (cap 60 s)"
timeout 60 python3 bench/fp8_attention.py --batch 8 --seq 128 --configs one 2>&1 | grep -v "$FILTER" | tail -14
stage "bench/fp8_attention_chain.py --batch 8 --seq 128 (cap 60 s)"
timeout 60 python3 bench/fp8_attention_chain.py --batch 8 --seq 128 2>&1 | grep -v "$FILTER" | tail -19
stage "tests/gpu/test_quant_cuda.py -k 'resnet_qdq_engine and minmax' (cap 60 s)"
timeout 60 python3 -m pytest -q -p no:cacheprovider --tb=short -rs tests/gpu/test_quant_cuda.py \
  -k "resnet_qdq_engine and minmax" 2>&1 | grep -v "$FILTER" | tail -8
stage "tests/llm/test_fp8_kv.py with TRITON_INTERPRET=0 (cap 50 s)"
TRITON_INTERPRET=0 timeout 50 python3 -m pytest -q -p no:cacheprovider --tb=short -rs tests/llm/test_fp8_kv.py 2>&1 \
  | grep -v "$FILTER" | tail -8
stage done
} 2>&1 | tee "$OUT/tidy.log"
