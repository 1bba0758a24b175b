#!/usr/bin/env bash
# Device calls 3-4 of 2026-12-02 (fourth session), on main after the helpers' merges.
#   bash bench/gpu_s4b.sh a   # padding-free encoders (GPU tests + bench/remove_padding.py), fused decode layers
#                             # (compiled kernel tests + Llama-3-8B decode with fusion off / auto)        ~9 min
#   bash bench/gpu_s4b.sh b   # kiln serve --frontends 0 / 4 on the H200, MobileNetV2 fp16 (carry [".whl-serve"]) ~4 min
# Logs in $OUT.
set -u
. "$(dirname "$0")/device_env.sh" kiln-s4b
export KILN_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
if [ "${1:-a}" = "a" ]; then
{
stage "padding-free encoders: GPU tests"
timeout 100 python3 -m pytest tests/gpu/test_remove_padding.py -q -p no:cacheprovider 2>&1 | tail -6
stage "padding-free encoders: bench/remove_padding.py (BERT-base fp16)"
timeout 220 python3 bench/remove_padding.py --out "$OUT" --calls 15 2>&1 | grep "^| \|^#\|built\|graphs\|rror" | head -60
stage "fused decode layers: compiled kernel tests"
TRITON_INTERPRET=0 timeout 60 python3 -m pytest -q -p no:cacheprovider -n 0 -o addopts="" -rfE \
  tests/llm/test_fused_gemv.py 2>&1 | tail -3
TRITON_INTERPRET=0 timeout 45 python3 -m pytest -q -p no:cacheprovider -n 0 -m gpu -o addopts="" -rfE \
  tests/llm/test_decode_fusion.py 2>&1 | tail -3
stage "fused decode layers: llama3-8b bf16 decode, fusion off / auto, batch 1 and 8"
timeout 170 python3 bench/llm_fusion.py --skip-kernels --batch 1 8 --modes off auto 2>&1 | grep -v Warn | tail -24
stage done
} 2>&1 | tee "$OUT/s4b-a.log"
else
FRONTEND_TESTS=0 FRONTENDS=${FRONTENDS:-0 4} SERVE_MODELS=mobilenet_v2 SERVE_CONCURRENCY=${SERVE_CONCURRENCY:-64} SERVE_BENCH_S=${SERVE_BENCH_S:-200} \
  bash bench/serve_gpu.sh .whl-serve 2>&1 | grep -v "^$" | tail -50
fi
