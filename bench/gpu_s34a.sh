#!/usr/bin/env bash
# Device call (session 34): what sessions 33's review changed and never ran on a GPU, then gpu_s33b.sh.
# 1. tests/gpu/test_decoder_dynamic_cuda.py after its shared build-and-compare helper (<= 150 s).
# 2. tests/serve/test_cuda.py's gpu tests with kiln serve's new default batch buckets (half) (<= 90 s).
# 3. bench/gpu_s33b.sh: the mended padding-removal test; host staging of numpy feeds and outputs (gpu_s31d.sh).
# run's carry: [".whl-serve"] (bash bench/serve_gpu.sh --fetch first); logs in $OUT.
set -u
. "$(dirname "$0")/device_env.sh" kiln-s34a
export KILN_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
[ -d .whl-serve ] && for w in .whl-serve/*.whl; do pip install -q --no-deps --target /tmp/serve-deps "$w" 2>/dev/null; done
{
stage "dynamic decoders on CUDA (commit $KILN_COMMIT)"
timeout 150 python3 -m pytest tests/gpu/test_decoder_dynamic_cuda.py -q -s -p no:cacheprovider -m gpu 2>&1 \
  | grep -E "error|passed|failed|Error|assert" | grep -v Warning | head -30
stage "kiln serve on CUDA (half buckets)"
PYTHONPATH=/tmp/serve-deps${PYTHONPATH:+:$PYTHONPATH} timeout 90 python3 -m pytest tests/serve/test_cuda.py -q -s \
  -p no:cacheprovider -m gpu 2>&1 | grep -E "error|passed|failed|Error|assert|skipped" | grep -v Warning | head -30
stage "gpu_s33b.sh"
OUT=$OUT bash bench/gpu_s33b.sh 2>&1 | tail -110
stage done
} 2>&1 | tee "$OUT/s34a.log"
