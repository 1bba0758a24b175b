#!/usr/bin/env bash
# Device call 1 of 2026-12-02 (third session): where kiln's time goes at the stream's large shapes beside
# torch.compile (bench/large_shapes.py), and batch-1 jitter (bench/jitter.py). Carry [".whl"]. Logs in $OUT.
set -u
. "$(dirname "$0")/device_env.sh" kiln-s3a
export KILN_COMMIT=${KILN_COMMIT:-$(git rev-parse --short HEAD)}
{
stage "large shapes: kiln vs torch eager / torch.compile dynamic, kernel tables"
timeout 300 python3 bench/large_shapes.py --shapes 32x512,24x384,17x300,16x256,8x128 --out "$OUT" 2>&1 \
  | grep -v "Warn\|warn" | tail -120
stage "batch-1 jitter"
timeout 150 python3 bench/jitter.py --calls 2000 --out "$OUT" 2>&1 | tail -14
stage done
} 2>&1 | tee "$OUT/s3a.log"
