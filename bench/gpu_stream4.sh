#!/usr/bin/env bash
# Device calls for issue 10 on the H200 (branch h-stream), <= 150 s:   bash bench/gpu_stream4.sh
# Call 1 (9f0c340, 22:50 UTC) ran the stream timeline with --ceiling and bench/jitter.py on ResNet-50 and BERT-base
# (bench/results/stream-2026-12-04.md). Call 2 (caps 38 + 68 + 44 s):
# 1. GPU test: tests/gpu/test_stream_packing.py (a warmed-up padding-free bert_tiny, a random stream of shapes with
#    padding masks as CUDA tensors: no capture, <= 64 graphs, matches torch fp32): the runs of known shapes now take
#    the remembered decision (kiln/runtime/engine.py _BucketedRun), the inputs padded by F.pad.
# 2. bench/stream_timeline.py --ceiling: BERT-base fp16 padding-free, 7 requests against torch fp32, the 200-request
#    stream 3 times in each of three modes, each request's wall / host / device / graph GPU time; 32x512 full mask
#    and 24x384 against torch eager with kiln's kernels (the host's share with the change).
# 3. bench/jitter.py --models bert_b1 --calls 2000: seven ways (call 1's six and run after a full collection).
set -u
. "$(dirname "$0")/device_env.sh" kiln-stream4
export KILN_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
FILTER="Warning\|warn(\|^| void\|^| Memset\|^| memcpy\|^| Memcpy\|torch.onnx\|return cls\|Evaluation failed"
{
stage "GPU test: a warmed-up stream of CUDA tensors on a padding-free engine"
timeout 38 python3 -m pytest tests/gpu/test_stream_packing.py -q -p no:cacheprovider -rfE --tb=short 2>&1 | tail -15
stage "stream timeline"
timeout 68 python3 bench/stream_timeline.py --passes 3 --ceiling --out "$OUT" 2>&1 | grep -v "$FILTER" | tail -110
stage "batch-1 jitter, BERT-base 1x128"
timeout 44 python3 bench/jitter.py --models bert_b1 --calls 2000 --out "$OUT" 2>&1 | grep -v "$FILTER" | tail -30
stage done
} 2>&1 | tee "$OUT/stream4.log"
