#!/usr/bin/env bash
# Device call (session 31, issue 11): GPT-2's LM head with the weight padded to N_pad so cuBLAS stores a contiguous
# aligned fp32 buffer (cuda.gemm.cublas_float32_out; session 30's view form ran 3.05 ms on the H100, gpu_s31a.sh).
# 1. bench/lm_head_variants.py: the LM head five ways (<= 60 s).
# 2. The tactic's GPU tests (float64 torch, an fp16 engine vs onnxruntime) (<= 150 s).
# 3. GPT-2 8 x 512 kernels: kiln vs torch.compile vs eager, the LM head's candidates (bench/zoo_kernels.py, <= 300 s).
# run's carry: [".whl-serve"]; logs in $OUT.
set -u
. "$(dirname "$0")/device_env.sh" kiln-s31c
export KILN_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
{
stage "LM head variants (commit $KILN_COMMIT)"
timeout 60 python3 bench/lm_head_variants.py 2>&1 | grep -v Warning
stage "cuda.gemm.cublas_float32_out GPU tests"
timeout 150 python3 -m pytest tests/gpu/test_gemm_float32_out.py -q -s -p no:cacheprovider 2>&1 | grep -E "^\[|^  cuda|passed|failed|Error" | head -20
stage "GPT-2 8x512 kernels"
timeout 300 python3 bench/zoo_kernels.py --model gpt2 --batch 8 --seq 512 --out "$OUT" 2>&1 | grep -v Warning | head -40
stage done
} 2>&1 | tee "$OUT/s31c.log"
