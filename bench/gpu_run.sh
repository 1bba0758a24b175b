#!/usr/bin/env bash
# Device call of 2026-12-04 (session 13, task `run`, issue 10's batch-1 jitter through context.run): <= 150 s.
#   bash bench/gpu_run.sh
# 1. correctness, the direct path on (KILN_DIRECT_REPLAY=1): tests/gpu/test_direct_replay.py (direct vs old path vs
#    torch fp32 / onnxruntime), then the static/bucket/stream files with it on for every context: test_dynamic.py,
#    test_stream_packing.py (-x, failures printed).
# 2. bench/jitter.py --ways direct: BERT-base 1x128 with its mask, then ResNet-50 batch 1; 2,000 calls a way in
#    interleaved blocks: replay alone, run (old path), run (direct), run (direct) gc off, execute (bound); CUDA events
#    and the host clock until synchronized (run + synchronize). Results: bench/results/stream-2026-12-04c.md.
set -u
. "$(dirname "$0")/device_env.sh" kiln-run
export OUT
export KILN_COMMIT=${KILN_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
FILTER="Warning\|warn(\|torch.onnx\|return cls\|Evaluation failed\|^  warnings\|UserWarning\|DeprecationWarning"
{
stage "GPU (commit $KILN_COMMIT)"; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
stage "tests/gpu/test_direct_replay.py (cap 32 s)"
timeout 32 python3 -m pytest -x -q -p no:cacheprovider --tb=short tests/gpu/test_direct_replay.py 2>&1 \
  | grep -v "$FILTER" | tail -25
stage "static/bucket/stream GPU tests with KILN_DIRECT_REPLAY=1 (cap 32 s)"
KILN_DIRECT_REPLAY=1 timeout 32 python3 -m pytest -x -q -p no:cacheprovider --tb=short tests/gpu/test_dynamic.py \
  tests/gpu/test_stream_packing.py 2>&1 | grep -v "$FILTER" | tail -25
stage "jitter: BERT-base 1x128 + mask, then ResNet-50 b1 (cap 80 s; each model's table printed as it finishes)"
timeout 80 python3 bench/jitter.py --models bert_b1,resnet50_b1 --ways direct --calls 2000 2>&1 | grep -v "$FILTER" \
  | grep -v "^| .* | .* | .* |$" ; cat "$OUT/jitter.md" 2>/dev/null
stage done
} 2>&1 | tee "$OUT/run.log"
