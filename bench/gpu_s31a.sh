#!/usr/bin/env bash
# Device call (session 31, issue 11): GPT-2's LM head through cuBLAS storing fp32 (cuda.gemm.cublas_float32_out,
# kiln/tactics/cuda/gemm_float32_out.py, built on 2026-12-07 without a GPU: bench/results/gemm-fp32-out-2026-12-07.md).
# 1. The tactic against float64 torch at GPT-2's 8x512x768 -> 50257 and a small bf16 layer, through an fp16
#    engine; its time printed beside cuda.gemm.cublas_addmm_act's fp32 path (contiguous output) and the Triton
#    GEMMs (<= 150 s).
# 2. GPT-2 8 x 512 kernels: kiln vs torch.compile vs eager, and the LM head's tactic with every candidate's time or
#    refusal (bench/zoo_kernels.py; 1.09x torch.compile on the H100 at a28f3ee, the LM head 1.071 ms in Triton)
#    (<= 300 s).
# run's carry: [".whl"] (cuDNN's frontend wheel) if present; logs in $OUT.
set -u
. "$(dirname "$0")/device_env.sh" kiln-s31a
export KILN_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'mm.dtype:', 'dtype' in torch.ops.aten.mm.overloads())"
{
stage "cuda.gemm.cublas_float32_out vs float64 torch, and through an fp16 engine (commit $KILN_COMMIT)"
timeout 150 python3 -m pytest tests/gpu/test_gemm_float32_out.py -q -s -p no:cacheprovider 2>&1 | tail -25
stage "GPT-2 8x512 kernels"
timeout 300 python3 bench/zoo_kernels.py --model gpt2 --batch 8 --seq 512 --out "$OUT" 2>&1 | grep -v Warning | head -80
stage done
} 2>&1 | tee "$OUT/s31a.log"
