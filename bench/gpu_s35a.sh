#!/usr/bin/env bash
# Device call (written in session 34 for the next): host staging "pinned" is the default for a CUDA context's numpy
# calls since session 34 (bench/results/host-staging-2026-12-07d.md) and has run only through test_host_staging and
# the served tests: run every GPU test with it, then the GPU tests of what else changed without a GPU.
# 1. tests/gpu (-m gpu), default environment (pinned staging), in two halves of <= 240 s each; the failures listed.
# 2. any failing file again with KILN_HOST_STAGING=off: a failure in both is not staging's.
#    (Part 1 also runs the CUDA attention tactics' GPU tests: their mask check became one helper, _expanded_mask, in
#    session 34's review, run on the CPU only so far.)
# Logs in $OUT (gpu_tests.log).
set -u
. "$(dirname "$0")/device_env.sh" kiln-s35a
files=(tests/gpu/test_*.py)
half=$(( ${#files[@]} / 2 ))
{
for part in 0 1; do
  if [ $part = 0 ]; then set -- "${files[@]:0:$half}"; else set -- "${files[@]:$half}"; fi
  stage "tests/gpu part $part: $*"
  timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu -rf "$@" 2>&1 | grep -E "^FAILED|passed|failed|error" \
    | grep -v Warning | tail -25
done
failing=$(grep -oE "^FAILED tests/gpu/[a-z_0-9]+\.py" "$OUT/gpu_tests.log" 2>/dev/null | sort -u | cut -d' ' -f2)
if [ -n "$failing" ]; then
  stage "the failing files with KILN_HOST_STAGING=off"
  KILN_HOST_STAGING=off timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu -rf $failing 2>&1 \
    | grep -E "^FAILED|passed|failed" | tail -15
fi
stage done
} 2>&1 | tee "$OUT/gpu_tests.log"
