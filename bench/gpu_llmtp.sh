#!/usr/bin/env bash
# Device call for issue 15's throughput (helper llmtp, 2026-12-03): 128/128 offline throughput at batch 64/128/256,
# bf16, fp8 weights, fp8 weights + fp8 KV, this tree against the baseline 4e20baf (carried in .cache/llmtp-base:
# `mkdir -p .cache/llmtp-base && git archive 4e20baf kiln | tar -x -C .cache/llmtp-base`; carry [".cache/llmtp-base"]),
# then the CUDA-graph tests with the time left. Must finish in < 240 s; logs in $OUT.
set -u
. "$(dirname "$0")/device_env.sh" kiln-llmtp
{
stage "device"
nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm --format=csv,noheader
stage "throughput 128/128 (budget ${BUDGET:-185} s)"
python3 bench/llm_throughput.py --trees .cache/llmtp-base . --batch 64 128 256 --configs bf16 fp8 fp8-kv8 \
  --budget ${BUDGET:-185} --out "$OUT"
left=$((232 - SECONDS))
if [ $left -gt 25 ]; then
  stage "tests/llm/test_gpu_graphs.py -m gpu (timeout $left s)"
  timeout $left python3 -m pytest -q -x -p no:cacheprovider -m gpu tests/llm/test_gpu_graphs.py 2>&1 | tail -5
fi
stage "done after $SECONDS s"
} 2>&1 | tee "$OUT/llmtp.log"
