#!/usr/bin/env bash
# (A record of what its device call ran: cuda.attention.cudnn_padded was removed after call 2, slower than the
# Triton kernel's length path; bench/results/mask-2026-12-03.md.)
# Second device call for issue 10's full-mask row (branch h-mask), <= 150 s (caps 40 + 35 + 80 s; background jobs
# overlap the first two):   bash bench/gpu_mask2.sh
# Call 1 (1a28ba2, gpu_mask.sh) ran the tests and the attention table; its bench/dynamic.py ran past its cap while
# torch.compile compiled (two modes: ~48 s each even beside a cache-filling process) and printed no per-shape rows.
# 1. GPU tests of the key-length kernel again (its mask branch is now unpipelined, tl.range(num_stages=1): 120
#    registers and 57,344 B of shared memory at 64x64, 4 blocks an SM as without a mask, where call 1's kernel
#    took 140 and 58,368, 3 blocks) and of the cuDNN padding-mode tactic (fixed: it read its attributes as a step's).
# 2. bench/attention.py at BERT-base 32x512: no mask; key lengths full (with the key mask, and without a mask tensor:
#    the length path alone); key lengths half-padded; with cuda.attention.cudnn_padded beside the Triton tiles.
# 3. bench/dynamic.py per shape (32x512 full, 32x512 half, 24x384): kiln vs torch eager and
#    torch.compile(mode="reduce-overhead", dynamic=True) (its cache filled in the background during 1-2; no
#    torch.compile(dynamic=True): its rows are call 1 of stream-2026-12-03.md), the full-mask ceiling.
set -u
. "$(dirname "$0")/device_env.sh" kiln-mask2
export KILN_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
FILTER="Warning\|warn(\|^| top kernels\|^| void\|^| nvjet\|^| Memset\|^| memcpy\|^| _"
{
stage "background: BERT-base export; reduce-overhead's compile cache"
timeout 60 python3 -c "import sys; sys.path.insert(0, '.'); from kiln import zoo; \
print(zoo.export('bert_base', batch=2, seq=16, dynamic=True).path)" > "$OUT/export.log" 2>&1 &
EXPORT=$!
timeout 75 python3 bench/dynamic.py --device cuda --warm-compile-cache reduce-overhead > "$OUT/warm-ro.log" 2>&1 &
WARM_RO=$!
stage "GPU tests: key lengths (every tile, the default-build tactics at BERT 32x512, cuda.attention.cudnn_padded)"
timeout 40 python3 -m pytest tests/gpu/test_triton_attention.py -k key_lengths -q -p no:cacheprovider -rfE \
  --tb=short 2>&1 | tail -15
stage "attention per layer, BERT-base 32x512"
timeout 35 python3 bench/attention.py --configs default \
  --cases bert512,bert512_full_lengths,bert512_full_lengths_only,bert512_lengths,bert512_key,bert512_left_lengths \
  2>&1 \
  | grep -v "$FILTER" | tail -14
wait $EXPORT $WARM_RO
for f in export warm-ro; do echo "[$f]"; grep -v "Warning\|warn(" "$OUT/$f.log" | tail -2; done
stage "per shape: kiln vs torch eager / reduce-overhead"
timeout 80 python3 bench/dynamic.py --device cuda --no-compile --reduce-overhead --no-warm-up --requests 4 \
  --calls 6 --out "$OUT" --shapes 32x512:full,32x512,24x384 2>&1 | grep -v "$FILTER" | tail -45
stage done
} 2>&1 | tee "$OUT/mask2.log"
