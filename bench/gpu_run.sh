#!/usr/bin/env bash
# Device calls of 2026-12-04 for task `run` (session 13, issue 10's batch-1 jitter through context.run):
#   bash bench/gpu_run.sh 1     # call 1 (2ca38d2, 16:57 UTC), <= 150 s
#   bash bench/gpu_run.sh 2     # call 2, <= 170 s (was bench/gpu_run2.sh)
# 1. correctness, the direct path on (KILN_DIRECT_REPLAY=1): tests/gpu/test_direct_replay.py (direct vs old path vs
#    torch fp32 / onnxruntime). Call 1: -q, capped at 32 s, then test_dynamic.py and test_stream_packing.py with it on
#    for every context. Call 2: the file whole (call 1's cap cut its bucketed and padding-free tests), with the opt-in
#    KILN_REPLAY_CAPTURES_INPUTS test, then test_stream_packing.py alone with KILN_DIRECT_REPLAY=1 (a padding-free
#    engine's stream: its direct fills are off by default until this passes); -v, the verdict lines kept.
# 2. bench/jitter.py --ways direct: BERT-base 1x128 with its mask, then ResNet-50 batch 1; 2,000 calls a way in
#    interleaved blocks: replay alone, run (old path), run (direct), run (direct) gc off, execute (bound), and in call 2
#    "run (direct, inputs in graph)" (the input copies captured at the feeds' addresses: one launch a call); CUDA events
#    and the host clock until synchronized (run + synchronize). Results: bench/results/stream-2026-12-04c.md.
set -u
CALL=${1:-1}
case "$CALL" in 1) SUFFIX="" ;; 2) SUFFIX=2 ;; *) echo "usage: bash bench/gpu_run.sh [1|2]: which call" >&2; exit 2 ;; esac
. "$(dirname "$0")/device_env.sh" "kiln-run$SUFFIX"
export OUT
export KILN_COMMIT=${KILN_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
FILTER="Warning\|warn(\|torch.onnx\|return cls\|Evaluation failed\|^  warnings\|UserWarning\|DeprecationWarning"
VERDICTS="PASSED|FAILED|ERROR|Error|assert|passed|failed|^E |\.py:[0-9]+"
{
stage "GPU (commit $KILN_COMMIT)"; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
if [ "$CALL" = 1 ]; then
  stage "tests/gpu/test_direct_replay.py (cap 32 s)"
  timeout 32 python3 -m pytest -x -q -p no:cacheprovider --tb=short tests/gpu/test_direct_replay.py 2>&1 \
    | grep -v "$FILTER" | tail -25
  stage "static/bucket/stream GPU tests with KILN_DIRECT_REPLAY=1 (cap 32 s)"
  KILN_DIRECT_REPLAY=1 timeout 32 python3 -m pytest -x -q -p no:cacheprovider --tb=short tests/gpu/test_dynamic.py \
    tests/gpu/test_stream_packing.py 2>&1 | grep -v "$FILTER" | tail -25
  JITTER_S=80
else
  stage "tests/gpu/test_direct_replay.py (cap 70 s)"
  timeout 70 python3 -m pytest -x -v -p no:cacheprovider --tb=short tests/gpu/test_direct_replay.py 2>&1 \
    | grep -v "$FILTER" | grep -E "$VERDICTS" | tail -30
  stage "tests/gpu/test_stream_packing.py with KILN_DIRECT_REPLAY=1 (cap 25 s)"
  KILN_DIRECT_REPLAY=1 timeout 25 python3 -m pytest -x -v -p no:cacheprovider --tb=short \
    tests/gpu/test_stream_packing.py 2>&1 | grep -v "$FILTER" | grep -E "$VERDICTS" | tail -20
  JITTER_S=65
fi
stage "jitter: BERT-base 1x128 + mask, then ResNet-50 b1 (cap $JITTER_S s; each model's table written as it finishes)"
timeout "$JITTER_S" python3 bench/jitter.py --models bert_b1,resnet50_b1 --ways direct --calls 2000 2>&1 \
  | grep -v "$FILTER" | grep -v "^| .* | .* | .* |$" ; cat "$OUT/jitter.md" 2>/dev/null
stage done
} 2>&1 | tee "$OUT/run$SUFFIX.log"
