#!/usr/bin/env bash
# (A record of what its device call ran: cuda.attention.cudnn_padded was removed after call 2, slower than the
# Triton kernel's length path; bench/results/mask-2026-12-03.md.)
# Device call for issue 10's full-mask row (branch h-mask), <= 150 s (caps 50 + 35 + 63 s; the background jobs overlap):
#   bash bench/gpu_mask.sh
# New: the padding-free plain program's attentions read the mask's key lengths (kiln::KeyLengths, on the device):
# kiln's Triton kernel visits each row's first n keys and reads no mask (-1, a mask that is not a prefix: the mask);
# a second candidate, cuda.attention.cudnn_padded, runs cuDNN's fused attention in its padding mode on those lengths
# (nvidia-cudnn-frontend's torch op) and the Triton kernel on the rows of length -1 / 0. The tuner times both.
# 0. In the background: BERT-base's ONNX export and torch.compile's caches (dynamic and reduce-overhead, each in its
#    own process), so the bench's own export and compiles hit them.
# 1. GPU tests: the key-length kernel at every tile (lengths 1, S, 0, -1, random; a graph replayed with other
#    lengths), every default-build tactic at BERT 32x512 with key lengths, the cuDNN padding-mode tactic there (with a
#    CUDA graph replay), and tests/gpu/test_remove_padding.py
#    (padding-free engines vs torch fp32; the plain program with key lengths against the plain engine).
# 2. bench/attention.py at BERT-base 32x512: no mask, the full key mask (today), full with key lengths, half-padded
#    with key lengths; beside SDPA's backends and cuDNN's padding mode on the same lengths (cudnn frontend).
# 3. bench/dynamic.py: the per-shape table at 32x512 full, 32x512 half, 24x384: kiln vs torch eager,
#    torch.compile(dynamic=True) and torch.compile(mode="reduce-overhead"), and the full-mask ceiling.
# Logs in $OUT (mask.log, dynamic-cuda.md, the background jobs' logs).
set -u
. "$(dirname "$0")/device_env.sh" kiln-mask
export KILN_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
FILTER="Warning\|warn(\|^| top kernels\|^| void\|^| nvjet\|^| Memset\|^| memcpy\|^| _"
{
stage "background: BERT-base export; torch.compile caches (commit $KILN_COMMIT)"
timeout 60 python3 -c "import sys; sys.path.insert(0, '.'); from kiln import zoo; \
print(zoo.export('bert_base', batch=2, seq=16, dynamic=True).path)" > "$OUT/export.log" 2>&1 &
EXPORT=$!
timeout 80 python3 bench/dynamic.py --device cuda --warm-compile-cache dynamic > "$OUT/warm-dynamic.log" 2>&1 &
WARM_DYNAMIC=$!
timeout 80 python3 bench/dynamic.py --device cuda --warm-compile-cache reduce-overhead > "$OUT/warm-ro.log" 2>&1 &
WARM_RO=$!
stage "GPU tests"
TRITON_INTERPRET=0 timeout 50 python3 -m pytest tests/gpu/test_triton_attention.py tests/gpu/test_remove_padding.py \
  -k "key_lengths or padding_free or plain_engine or packed_program" -q -p no:cacheprovider -rfE --tb=short \
  2>&1 | tail -25
stage "attention per layer, BERT-base 32x512"
timeout 35 python3 bench/attention.py --configs default \
  --cases bert512,bert512_full_key,bert512_full_lengths,bert512_lengths 2>&1 | grep -v "$FILTER" | tail -45
wait $EXPORT $WARM_DYNAMIC $WARM_RO
for f in export warm-dynamic warm-ro; do echo "[$f]"; grep -v "Warning\|warn(" "$OUT/$f.log" | tail -4; done
stage "per shape: kiln vs torch eager / compile / reduce-overhead"
timeout 63 python3 bench/dynamic.py --device cuda --reduce-overhead --requests 4 --calls 6 --out "$OUT" \
  --shapes 32x512:full,32x512,24x384 2>&1 | grep -v "$FILTER" | tail -60
stage done
} 2>&1 | tee "$OUT/mask.log"
