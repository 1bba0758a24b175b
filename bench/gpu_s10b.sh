#!/usr/bin/env bash
# Device call of 2026-12-03 evening (tenth session, the lead's last, <= 260 s): the merged main's GPU tests for what
# this session's branches changed, after their last commits (h-mask's 927d037 removed a kernel branch after its last
# device call): key-length attention tiles, padding-free engines, the FP8 stores and LayerNormQuantize tactics, the
# fused FP8 norm. No carry. Logs in $OUT.
set -u
. "$(dirname "$0")/device_env.sh" kiln-s10b
t() { local s=$1; shift; stage "$*"; timeout "$s" python3 -m pytest -q -p no:cacheprovider --tb=short -rfE "$@" 2>&1 \
  | grep -v "DEBUG\|^$\|Warning\|warn(" | tail -8; }
{
t 60 tests/gpu/test_triton_attention.py -k key_lengths
t 70 tests/gpu/test_remove_padding.py
t 60 tests/gpu/test_quant_cuda.py -k "hardware_rounding or layer_norm_quantize or ffn_up"
TRITON_INTERPRET=0 t 60 tests/llm/test_fused_kernels.py tests/llm/test_gpu.py -k "fp8 or norm"
stage done
} 2>&1 | tee "$OUT/s10b.log"
