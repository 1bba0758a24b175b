#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the test suite CI runs: everything but the slow model-zoo cases and GPU tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec python -m pytest -m "not slow and not gpu" -n 2 -q "$@"
