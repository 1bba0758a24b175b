#!/usr/bin/env bash
# Device call of session 30 (issues 14 and 11), <= 260 s; run's carry: [".whl-serve"] (bash bench/serve_gpu.sh --fetch):
# 1. bench/gpu_s30b.sh at SERVE_BENCH_S=110 without its test: BERT-base's batched calls cut into phases (spin, pinned).
# 2. bench/zoo_kernels.py: GPT-2 8 x 512 (1.09x torch.compile on the H100 at ad0042e2), kiln's kernels beside torch's.
set -u
export OUT=${OUT:-/tmp/kiln-s30c}; mkdir -p "$OUT"
SERVE_BENCH_S=${SERVE_BENCH_S:-110} CHECK=0 bash bench/gpu_s30b.sh > "$OUT/s30b.txt" 2>&1
echo "== GPT-2 8x512 kernels"
( . bench/device_env.sh kiln-s30c > /dev/null; pip install -q --no-deps --target /tmp/cudnn-fe .whl-serve/nvidia_cudnn_frontend-*.whl 2>/dev/null
  PYTHONPATH=/tmp/cudnn-fe${PYTHONPATH:+:$PYTHONPATH} timeout 110 python3 bench/zoo_kernels.py --model gpt2 --batch 8 --seq 512 --out "$OUT" > "$OUT/gpt2.log" 2>&1 )
grep -v "Warning\|warn(" "$OUT/gpt2.log" | grep -E "^#|^engine|^\| (kiln|torch)|^###|^\| [a-z/]+ \| [0-9]" | cut -c1-160 | head -40
grep -A16 "^### kiln" "$OUT/gpt2.log" | grep "^| [^a-z]*[a-zA-Z_]" | sed -n 9,22p | cut -c1-170
tail -3 "$OUT/gpt2.log" | grep -i error | cut -c1-300
echo "== serve phases"
tail -45 "$OUT/s30b.txt" | cut -c1-250
