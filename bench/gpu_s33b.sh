#!/usr/bin/env bash
# Device call (session 33): the mended padding-removal test, then bench/gpu_s31d.sh (host staging of numpy feeds and
# outputs against the pageable copies; two contexts at once; served spin vs staged) with its GPU tests.
# run's carry: [".whl-serve"]; logs in $OUT.
set -u
. "$(dirname "$0")/device_env.sh" kiln-s33b
{
stage "padding removal: the plain-engine test"
timeout 120 python3 -m pytest tests/gpu/test_remove_padding.py -q -s -p no:cacheprovider -m gpu -k "does_not_pack" 2>&1 \
  | grep -E "passed|failed|Error|assert" | grep -v Warning | head -20
stage "gpu_s31d.sh"
STAGING_TESTS_S=${STAGING_TESTS_S:-60} BUDGET_S=${BUDGET_S:-230} PROBE_ARGS=${PROBE_ARGS:---rounds 2} OUT=$OUT \
  bash bench/gpu_s31d.sh 2>&1 | tail -90
stage done
} 2>&1 | tee "$OUT/s33b.log"
