#!/usr/bin/env bash
# One device call: GPU tests, then the side-by-side benchmark. Logs go to $OUT.
#   bash bench/gpu_session.sh [tests|bench|all] [bench args...]
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
OUT=${OUT:-/tmp/kiln-out}; mkdir -p "$OUT"
what=${1:-all}; shift || true
# cuDNN's graph API (optional): the GPU machine has no nvidia-cudnn-frontend; carry its wheel in .whl/
# (`pip download --no-deps --only-binary=:all: --python-version 3.12 nvidia-cudnn-frontend -d .whl`).
if ls .whl/nvidia_cudnn_frontend-*.whl >/dev/null 2>&1; then
  pip install -q --no-deps --target /tmp/cudnn-fe .whl/nvidia_cudnn_frontend-*.whl && export PYTHONPATH=/tmp/cudnn-fe${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, triton, onnx, onnxruntime, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'onnx', onnx.__version__, 'ort', onnxruntime.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/device.txt"
if [ "$what" = tests ] || [ "$what" = all ]; then
  # The Triton kernel tests set TRITON_INTERPRET for tests/kernels only; run the GPU files on their own.
  python3 -m pytest tests/gpu -q -p no:cacheprovider -rs 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  python3 bench/gpu.py --out "$OUT" "$@" 2>&1 | grep -v -i "warning\|warn(\|torch.onnx.export\|return cls" | tail -40
fi
