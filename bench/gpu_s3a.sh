#!/usr/bin/env bash
# Device call 1 of 2026-12-02 (third session): where kiln's time goes at the stream's large shapes beside
# torch.compile (bench/large_shapes.py), and batch-1 jitter (bench/jitter.py). Carry [".whl"]. Logs in $OUT.
set -u
OUT=${OUT:-/tmp/kiln-s3a}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 KILN_COMMIT=${KILN_COMMIT:-$(git rev-parse --short HEAD)}
for w in .whl/*.whl; do [ -e "$w" ] && pip install -q --no-deps --target /tmp/carried "$w" 2>/dev/null; done
[ -d /tmp/carried ] && export PYTHONPATH=/tmp/carried
stage() { echo "== $(date +%T) $*"; }
{
stage "large shapes: kiln vs torch eager / torch.compile dynamic, kernel tables"
timeout 300 python3 bench/large_shapes.py --shapes 32x512,24x384,17x300,16x256,8x128 --out "$OUT" 2>&1 \
  | grep -v "Warn\|warn" | tail -120
stage "batch-1 jitter"
timeout 150 python3 bench/jitter.py --calls 2000 --out "$OUT" 2>&1 | tail -14
stage done
} 2>&1 | tee "$OUT/s3a.log"
