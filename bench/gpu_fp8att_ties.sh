#!/usr/bin/env bash
# h-fp8att2 (issue 12) device check, <= 90 s: the quantized attention's GPU test with the E4M3 check the builder now
# makes (QUANTIZED_ATTENTION_FLOAT8_SLACK/_SHARE: a probability's near-tie, not a conversion bug), each case's
# steps/share/|diff| printed, then the kernel table (fp8 rows should no longer say "FAILS the builder's check").
set -u
timeout 52 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_quantized_attention_cuda.py 2>&1 \
  | grep -E "quantized\.|passed|failed|Error" | tail -10
timeout 36 python3 bench/quantized_attention.py --iters 5 2>&1 | grep -v Warn | tail -12
