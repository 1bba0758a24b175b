#!/usr/bin/env bash
# The session's last device call for issue 10 (branch h-stream2), <= 120 s (hard caps 55 + 63 s):
#   bash bench/gpu_stream3.sh
# New since run 1 (146b23f), CPU-tested only: the plain program's [B,1,1,S] key mask; the packed region from the
# embeddings on; TokenIndex without colliding writes; a mask past the last token bucket packs to B·S + 1 rows
# (varlen flash, no mask) instead of the plain program at 32x512.
# 1. GPU tests first: tests/gpu/test_remove_padding.py (padding-free engines vs torch fp32, plain vs packed runs,
#    nearly full and full masks packed) and tests/gpu/test_stream_packing.py (a warmed-up stream: no capture, <= 64
#    graphs, matches torch fp32).
# 2. bench/dynamic.py, BERT-base fp16 padding-free, without torch.compile (its warm-up alone took 49 s in run 1; its
#    times are in run 1): a 20-request stream, the per-shape table beside torch eager with the full-mask kernel
#    tables, and at 32x512 full the stream context (packed past the last bucket) beside one that never packs (the
#    plain program, kiln's Triton attention with the key mask).
set -u
. "$(dirname "$0")/device_env.sh" kiln-stream3
export KILN_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
{
stage "GPU tests (commit $KILN_COMMIT)"
timeout 55 python3 -m pytest tests/gpu/test_remove_padding.py tests/gpu/test_stream_packing.py -q \
  -p no:cacheprovider -rfE --tb=short 2>&1 | tail -25
stage "BERT-base padding-free: stream, per shape, packing A/B"
timeout 63 python3 bench/dynamic.py --device cuda --no-compile --requests 20 --calls 6 --out "$OUT" \
  --shapes 32x512:full,32x512,24x384,8x128 --packing-ab 32x512:full 2>&1 \
  | grep -v "Warning\|warn(\|^| top kernels\|^| void\|^| nvjet\|^| Memset\|^| memcpy\|^| _" | tail -70
stage done
} 2>&1 | tee "$OUT/stream3.log"
