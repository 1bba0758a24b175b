#!/usr/bin/env bash
# Second device call for task `run` (session 13; call 1 = bench/gpu_run.sh at 2ca38d2, 16:57 UTC): <= 170 s.
#   bash bench/gpu_run2.sh
# 1. tests/gpu/test_direct_replay.py whole (call 1's cap cut its bucketed and padding-free tests), with the new
#    opt-in KILN_REPLAY_CAPTURES_INPUTS test; then test_stream_packing.py with KILN_DIRECT_REPLAY=1 (a padding-free
#    engine's stream: its direct fills are off by default until this passes).
# 2. bench/jitter.py --ways direct on BERT-base 1x128 + mask and ResNet-50 b1, 2,000 calls a way, now with
#    "run (direct, inputs in graph)" (the input copies captured at the feeds' addresses: one launch a call).
set -u
. "$(dirname "$0")/device_env.sh" kiln-run2
export OUT
export KILN_COMMIT=${KILN_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
FILTER="Warning\|warn(\|torch.onnx\|return cls\|Evaluation failed\|^  warnings\|UserWarning\|DeprecationWarning"
{
stage "GPU (commit $KILN_COMMIT)"; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
stage "tests/gpu/test_direct_replay.py (cap 70 s)"
timeout 70 python3 -m pytest -x -v -p no:cacheprovider --tb=short tests/gpu/test_direct_replay.py 2>&1 \
  | grep -v "$FILTER" | grep -E "PASSED|FAILED|ERROR|Error|assert|passed|failed|^E |\.py:[0-9]+" | tail -30
stage "tests/gpu/test_stream_packing.py with KILN_DIRECT_REPLAY=1 (cap 25 s)"
KILN_DIRECT_REPLAY=1 timeout 25 python3 -m pytest -x -v -p no:cacheprovider --tb=short tests/gpu/test_stream_packing.py \
  2>&1 | grep -v "$FILTER" | grep -E "PASSED|FAILED|ERROR|Error|assert|passed|failed|^E |\.py:[0-9]+" | tail -20
stage "jitter: BERT-base 1x128 + mask, then ResNet-50 b1 (cap 65 s; each model's table written as it finishes)"
timeout 65 python3 bench/jitter.py --models bert_b1,resnet50_b1 --ways direct --calls 2000 2>&1 | grep -v "$FILTER" \
  | grep -v "^| .* | .* | .* |$" ; cat "$OUT/jitter.md" 2>/dev/null
stage done
} 2>&1 | tee "$OUT/run2.log"
