#!/usr/bin/env bash
# Device call for issue 10 on the H200 (branch h-stream), <= 150 s (caps 75 + 70 s):
#   bash bench/gpu_stream4.sh
# 1. bench/stream_timeline.py --ceiling: BERT-base fp16 padding-free (profile 1x1,8x128,32x512, warmed up at load;
#    7 requests checked against torch fp32 at real tokens: the runs padded by F.pad now, plain and packed),
#    bench/dynamic.py's 200-request stream 3 times in each of three modes (as is, kiln.static_heap(), gc off),
#    each request's wall / host / device (CUDA events) / its graph's own GPU time, collector passes, captures and
#    evictions; each request's steady cost (the least of its 9 runs): the shapes' own p99/p50 beside the jitter's.
#    Then 32x512 full mask: kiln vs torch eager, both sides' kernels, the GEMM bound; the four BERT-base GEMMs at
#    16,384 rows the ways torch eager and kiln call cuBLAS.
# 2. bench/jitter.py --calls 2000: ResNet-50 batch 1 and BERT-base 1x128 + mask, six ways (graph replay; run;
#    run in static_heap; run with gc off; run with the thread pinned; bound execute) in interleaved blocks, on the
#    device and host clocks, the slow calls set beside the host's enqueue time; SM clocks sampled (nvidia-smi).
# Logs in $OUT (stream4.log, stream-timeline.md, jitter.md, clocks.csv).
set -u
. "$(dirname "$0")/device_env.sh" kiln-stream4
export KILN_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
FILTER="Warning\|warn(\|^| void\|^| Memset\|^| memcpy\|^| Memcpy"
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv,noheader -lms 200 > "$OUT/clocks.csv" 2>/dev/null &
SMI=$!
{
stage "stream timeline (commit $KILN_COMMIT)"
timeout 75 python3 bench/stream_timeline.py --passes 3 --ceiling --out "$OUT" 2>&1 | grep -v "$FILTER" | tail -120
stage "batch-1 jitter"
timeout 70 python3 bench/jitter.py --calls 2000 --out "$OUT" 2>&1 | grep -v "Warning\|warn(" | tail -70
kill $SMI 2>/dev/null
stage "SM clock (MHz) over the call: min / median / max; throttle reasons seen"
python3 - "$OUT/clocks.csv" <<'PY'
import statistics, sys
rows = [line.split(", ") for line in open(sys.argv[1]) if line.count(",") >= 5]
sm = [int(r[1].split()[0]) for r in rows if r[1].split()[0].isdigit()]
if sm:
    print(f"{len(sm)} samples: {min(sm)} / {statistics.median(sm)} / {max(sm)}; reasons {sorted({r[5].strip() for r in rows})}")
PY
stage done
} 2>&1 | tee "$OUT/stream4.log"
