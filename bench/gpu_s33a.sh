#!/usr/bin/env bash
# Device call (session 33): the CUDA paths changed in session 31 and never run on a GPU, then gpu_s32a.sh.
# 1. tests/gpu/test_decoder_dynamic_cuda.py: dynamic Llama/Qwen2/Mistral/Phi-3 (fused GQA attention + rotary) and
#    GPT-2 (fuse_gemm's flatten) built for CUDA fp16 inside a profile, vs onnxruntime fp32 (<= 200 s).
# 2. tests/gpu/test_remove_padding.py: the padding-removal region (<= 150 s).
# 3. bench/gpu_s32a.sh: pow2 vs half batch buckets for served BERT-base (BUDGET_S 200).
# run's carry: [".whl-serve"] (bash bench/serve_gpu.sh --fetch first); logs in $OUT.
set -u
. "$(dirname "$0")/device_env.sh" kiln-s33a
export KILN_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
{
stage "dynamic decoders on CUDA (commit $KILN_COMMIT)"
timeout 200 python3 -m pytest tests/gpu/test_decoder_dynamic_cuda.py -q -s -p no:cacheprovider -m gpu 2>&1 \
  | grep -E "error|passed|failed|Error|assert" | grep -v Warning | head -40
stage "padding removal on CUDA"
timeout 150 python3 -m pytest tests/gpu/test_remove_padding.py -q -s -p no:cacheprovider -m gpu 2>&1 \
  | grep -E "passed|failed|Error|assert" | grep -v Warning | head -30
stage "batch buckets"
BUDGET_S=${BUDGET_S:-200} OUT=$OUT bash bench/gpu_s32a.sh 2>&1 | tail -60
stage done
} 2>&1 | tee "$OUT/s33a.log"
