#!/usr/bin/env bash
# Device call of 2026-12-04 (session 12, the lead): the GPU tests of the merged main (h-grpc, h-bind4, h-stream,
# h-qgpu, h-fp8att merged at 56572f6), every file of tests/gpu under one cap, one line a test; failures listed last.
# Budget: $1 seconds (default 200).
set -u
. "$(dirname "$0")/device_env.sh" kiln-s12
CAP=${1:-200}
{
stage "GPU"; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
stage "tests/gpu (cap ${CAP} s), commit ${KILN_COMMIT:-?}"
timeout "$CAP" python3 -m pytest -v -p no:cacheprovider --tb=line -rf tests/gpu 2>&1 \
  | grep -E "PASSED|FAILED|ERROR|passed|failed|^/|Error" | cut -c1-240 > "$OUT/gpu_tests.txt"
grep -c PASSED "$OUT/gpu_tests.txt" | sed 's/^/passed: /'; grep -c -E "FAILED|ERROR" "$OUT/gpu_tests.txt" | sed 's/^/failed or error: /'
grep -E "FAILED|ERROR|Error" "$OUT/gpu_tests.txt" | head -30
tail -3 "$OUT/gpu_tests.txt"
stage done
} 2>&1 | tee "$OUT/s12.log"
