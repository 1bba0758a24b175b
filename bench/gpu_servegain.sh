#!/usr/bin/env bash
# Device call for issue 14's target (h-servegain, 2026-12-05): on the H200, dynamic batching >= 5x the requests/s of
# batch-1 serving at concurrency 64, p99 <= max queue delay + 2 batch computes — measured with kiln perf's wire client
# (kiln/serve/perf_wire.py: requests encoded once on raw sockets, every answer checked against its own request, tens
# of us of client CPU a request where tritonclient's 4 processes sat at 89-95% of a core: the 2.90x of
# bench/results/serve-2026-12-03b.md was bounded by the load generator and the host's CPU per request).
# MobileNetV2 (random weights) then BERT-base (seq 128), fp16, profile batch 1..64, 2 instances, kiln serve
# --frontends 8 --staging-mib 64, batching on / off, gRPC and HTTP binary, concurrency 64 only, 4 wire client
# processes, 2 s windows; engines timed 3 rounds a layer (not 10) so that four builds fit the call. serve.py's table
# and its summary (gain, p99 against max queue delay + 2 calls) are rewritten after every row: a run cut short keeps
# what it measured (MobileNetV2 first). No tests (the front-end and wire-client paths are tested on the CPU).
#   (here, once)  PIP=/tmp/ci1/.venv/bin/pip bash bench/serve_gpu.sh --fetch   # wheels into .whl-serve/ (git-ignored)
#   (device)      bash bench/gpu_servegain.sh    # run's carry: [".whl-serve"]; <= 290 s; serve.md and the log in $OUT
# Options by environment: FRONTENDS (default 8), SERVE_PROCESSES (default 4), SERVE_MODELS (default
# "mobilenet_v2 bert_base"), SERVE_BENCH_S (default 230).
set -u
export OUT=${OUT:-/tmp/kiln-servegain}
mkdir -p "$OUT"
export KILN_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
GPU_TESTS=0 FRONTEND_TESTS=0 FRONTENDS=${FRONTENDS:-8} STAGING_MIB=64 SERVE_MODELS=${SERVE_MODELS:-mobilenet_v2 bert_base} \
  SERVE_CONCURRENCY=64 SERVE_PROCESSES=${SERVE_PROCESSES:-4} SERVE_BENCH_S=${SERVE_BENCH_S:-230} \
  SERVE_ARGS="--client wire --window 2.0 --warmup 0.5 --tuning-runs 3" \
  timeout 285 bash bench/serve_gpu.sh .whl-serve > /dev/null 2>&1
echo "== kiln $KILN_COMMIT, $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null), $(nproc) CPUs"
grep -E "^== |failed|Error|error" "$OUT/serve_gpu.log" | grep -v "^| " | tail -12
# the rows (model, batching, protocol, infer/s, p50, p99, requests/call, call ms, client CPU us/req, errors, wrong)
# and the summary: the gain and p99 against max queue delay + 2 calls
python3 - "$OUT/serve.md" <<'PY'
import sys
try:
    lines = open(sys.argv[1]).read().splitlines()
except OSError:
    sys.exit("no serve.md: see the log above")
rows = [l.split("|")[1:-1] for l in lines if l.startswith("| ") and not l.startswith("| model")]
for cells in rows:
    cells = [c.strip() for c in cells]
    if len(cells) > 20:  # a measured row
        print(" ".join(f"{c:>9}" for c in (cells[0][:12], cells[1], cells[2], cells[8], cells[9], cells[11],
                                            cells[16], cells[17], cells[-3], cells[-2], cells[-1])))
    else:  # the summary
        print("gain:", " | ".join(cells))
PY
