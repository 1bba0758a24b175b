#!/usr/bin/env bash
# Device calls for issue 10 on the H200 (branch h-stream), <= 150 s:   bash bench/gpu_stream4.sh
# Call 1 (9f0c340, 22:50 UTC) ran the stream timeline with --ceiling and bench/jitter.py on ResNet-50 and BERT-base;
# call 2 (6d2c037, 23:26 UTC) tests/gpu/test_stream_packing.py, the timeline again and jitter.py on BERT-base, which
# its 44 s cap cut before it printed (bench/results/stream-2026-12-04.md). Call 3 (cap 80 s): bench/jitter.py on
# BERT-base 1x128 alone, seven ways (call 1's six and run after a full collection), 2,000 calls each.
set -u
. "$(dirname "$0")/device_env.sh" kiln-stream4
export KILN_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
FILTER="Warning\|warn(\|^| void\|^| Memset\|^| memcpy\|^| Memcpy\|torch.onnx\|return cls\|Evaluation failed"
{
stage "batch-1 jitter, BERT-base 1x128 (commit $KILN_COMMIT)"
timeout 80 python3 bench/jitter.py --models bert_b1 --calls 2000 --out "$OUT" 2>&1 | grep -v "$FILTER" | tail -30
stage done
} 2>&1 | tee "$OUT/stream4.log"
