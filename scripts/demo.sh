#!/usr/bin/env bash
# Set up (scripts/setup.sh), then build an engine for the real MobileNetV2, classify photographs and bench it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec python -m kiln.demo "$@"
