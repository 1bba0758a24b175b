#!/usr/bin/env bash
# One device call for what changed in a session without GPU time of its own: the CUDA INT8/FP8 tactics
# (issue 12), kiln serve's CUDA instances (issue 14), the front doors' CUDA tests (issue 13) and the
# dynamic-shape GPU tests (issue 10) as a regression check. Most important first; each stage under its
# own timeout; logs and tables in $OUT.   Run with carry [".whl", ".whl-serve"] and KILN_COMMIT set.
set -u
OUT=${OUT:-/tmp/kiln-final}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
stage() { echo "== $(date +%T) $*"; }
if ls .whl/nvidia_cudnn_frontend-*.whl >/dev/null 2>&1; then
  pip install -q --no-deps --target /tmp/cudnn-fe .whl/nvidia_cudnn_frontend-*.whl 2>/dev/null && export PYTHONPATH=/tmp/cudnn-fe
fi
{
stage "quant tests"; timeout 150 python3 -m pytest tests/gpu/test_quant_cuda.py -q -rs -p no:cacheprovider 2>&1 | tail -25
stage "quant layers"; timeout 110 python3 bench/quant_gpu.py --sections layers --quick --out "$OUT" 2>&1 | tail -30
stage "quant engines"; timeout 130 python3 bench/quant_gpu.py --sections engines --engines resnet50_b256 \
  --modes torch_fp16,kiln_fp16,kiln_int8,kiln_fp8 --row-timeout 60 --out "$OUT" 2>&1 | tail -20
stage "dynamic"; timeout 50 python3 -m pytest tests/gpu/test_dynamic.py -q -x -p no:cacheprovider 2>&1 | tail -3
stage "front doors"; timeout 90 python3 -m pytest tests/frontdoor/test_cuda.py -q -rs -p no:cacheprovider --durations=5 2>&1 | tail -15
stage "serve"
timeout 60 pip install -q --no-index --no-deps --target /tmp/serve-deps .whl-serve/*.whl 2>&1 | grep -v WARN | tail -2
PYTHONPATH=/tmp/serve-deps:${PYTHONPATH:-} timeout 60 python3 -m pytest -q -m gpu tests/serve/test_cuda.py -p no:cacheprovider 2>&1 | tail -8
stage done
} 2>&1 | tee "$OUT/final.log"
