#!/usr/bin/env bash
# Session 17's first device call (2026-12-05): (1) issue 14's BERT-base serving rows over 2 CUDA instances
# (bench/gpu_serve5c.sh, gpu_servewrong.sh then: wrong answers / no answer at 23d787d) and (2) issue 12's open
# question, why FP8 ResNet-50 b256 at opt 3 ran 0.91x kiln fp16 where opt 2 ran ~1.0x: both opt levels with
# --profile, the per-layer tables printed side by side. run's carry: [".whl-serve"]. <= 590 s.
set -u
export OUT=${OUT:-/tmp/kiln-s17a}
mkdir -p "$OUT"
echo "== kiln $(git rev-parse --short HEAD), $(nvidia-smi --query-gpu=name --format=csv,noheader), $(nproc) CPUs"
timeout 295 bash bench/gpu_serve5c.sh 2>&1 | tail -20
for lvl in 3 2; do
  mkdir -p "$OUT/fp8_o$lvl"
  timeout 145 python3 bench/quant_gpu.py --sections engines --engines resnet50_b256 --modes kiln_fp16,kiln_fp8 \
    --opt-level $lvl --profile --row-timeout 100 --out "$OUT/fp8_o$lvl" > "$OUT/fp8_o$lvl/stdout.txt" 2>&1
  echo "== FP8 R50 b256 opt $lvl"; tail -8 "$OUT/fp8_o$lvl/stdout.txt"
  python3 bench/quant_gpu.py --show-profiles "$OUT/fp8_o$lvl/quant_gpu.log" > "$OUT/fp8_o$lvl/profiles.txt" 2>&1
  head -c 3000 "$OUT/fp8_o$lvl/profiles.txt"
done
