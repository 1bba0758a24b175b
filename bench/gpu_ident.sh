#!/usr/bin/env bash
# Device call for issue 10 (padding-free engines carry the plain program, branch h-ident), < 240 s:
#   bash bench/gpu_ident.sh
# 1. tests/gpu/test_remove_padding.py: the varlen tactics, a padding-free engine against torch (packing always /
#    never / auto), where it does not pack equal to the plain engine to the bit (and the packed program not run),
#    where it packs the packed program runs and matches torch;
# 2. bench/remove_padding.py, BERT-base fp16: plain vs padding-free (auto / always / never packed, timed call by call
#    in turn) vs torch eager / torch.compile at 1x128, 8x128, 32x128, 8x512, 32x512 right/half/full/left (both
#    engines built with one timing cache), and kernel tables plain vs padding-free at 8x128 right, 32x512 full/right.
# Logs in $OUT (ident.log, remove-padding.md).
set -u
. "$(dirname "$0")/device_env.sh" kiln-ident
export KILN_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
{
stage "padding-free encoders: GPU tests"
timeout 75 python3 -m pytest tests/gpu/test_remove_padding.py -q -p no:cacheprovider -rfE 2>&1 | tail -15
stage "padding-free encoders: bench/remove_padding.py (BERT-base fp16)"
timeout 155 python3 bench/remove_padding.py --out "$OUT" --calls 15 2>&1 \
  | grep "^| \|^#\|built\|graphs\|rror\|eager\|kernel ms" | head -100
stage done
} 2>&1 | tee "$OUT/ident.log"
