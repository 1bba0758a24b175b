#!/usr/bin/env bash
# Device call for issue 14's batching gain (h-batch5, 2026-12-06): dynamic batching's requests/s over batch-1 serving
# at concurrency 64 on the GPU (target >= 5x; 2.45x MobileNetV2 gRPC / 2.06x HTTP at main 23d787d,
# bench/results/serve-gain-2026-12-05b.md; BERT-base's off rows never measured: its on rows then answered wrongly).
# Since then: kiln perf's FP16-grid check (BERT's rows run), uvicorn's unpaused bodies, the capture-stream fix,
# and h-batch5's copies: an answer of 64 KiB+ of tensors (BERT-base's 393 KB hidden state) leaves as views of the
# engine's arrays framed into one writelines (gRPC, kiln's transport) or as held ASGI pieces (HTTP), every HTTP
# answer in one write instead of two (bench/results/serve-cpu-2026-12-06.md).
# BERT-base (seq 128) first, then MobileNetV2 (random weights), fp16, profile batch 1..64, 2 instances, kiln serve
# --frontends 8 --staging-mib 64, batching on / off, gRPC and HTTP binary, c = 64, 4 wire client processes (every
# answer checked), 2 s windows, engines timed 3 rounds a layer. serve.md is rewritten after every row: a run cut short
# keeps BERT-base's rows. No tests (the paths changed are tested on the CPU).
#   (here, once)  PIP=/tmp/ci22/.venv/bin/pip bash bench/serve_gpu.sh --fetch   # wheels into .whl-serve/ (git-ignored)
#   (device)      bash bench/gpu_batch5.sh     # run's carry: [".whl-serve"]; <= 290 s; serve.md and the log in $OUT
# Options by environment: SERVE_MODELS (default "bert_base mobilenet_v2"), FRONTENDS (default 8), SERVE_PROCESSES
# (default 4), CUDA_SYNC (unset: kiln serve's default, spin; "blocking", or "spin blocking": a server each), BASE (a commit: served
# beside HEAD, an A/B in one run: SERVE_TREES "/tmp/kiln-base .", twice the rows; then SERVE_MODELS one model).
set -u
export OUT=${OUT:-/tmp/kiln-batch5}
mkdir -p "$OUT"
export KILN_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
TREES=.
if [ -n "${BASE:-}" ]; then
  rm -rf /tmp/kiln-base && mkdir -p /tmp/kiln-base && git archive "$BASE" | tar -x -C /tmp/kiln-base && TREES="/tmp/kiln-base ."
fi
GPU_TESTS=0 FRONTEND_TESTS=0 FRONTENDS=${FRONTENDS:-8} STAGING_MIB=64 SERVE_MODELS=${SERVE_MODELS:-bert_base mobilenet_v2} \
  SERVE_CONCURRENCY=64 SERVE_PROCESSES=${SERVE_PROCESSES:-4} SERVE_BENCH_S=${SERVE_BENCH_S:-255} SERVE_TREES="$TREES" \
  SERVE_ARGS="--client wire --window 2.0 --warmup 0.5 --tuning-runs 3${CUDA_SYNC:+ --cuda-sync $CUDA_SYNC}" \
  timeout 280 bash bench/serve_gpu.sh .whl-serve > /dev/null 2>&1
echo "== kiln $KILN_COMMIT${BASE:+ (A/B against $BASE)}, $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null), $(nproc) CPUs"
grep -E "^== |failed|Error|error|wrong answer|kiln perf:" "$OUT/serve_gpu.log" | grep -v "^| " | cut -c1-300 | tail -10
# per row: model, batching, protocol, infer/s, p50 ms, p99 ms, requests/call, call ms, server CPU us/req, engine loop
# %core, engine process %core, per front end %core, client CPU us/req, errors, wrong; then the summary (the gain,
# p99 against max queue delay + 2 calls)
python3 - "$OUT/serve.md" <<'PY'
import sys
try:
    lines = open(sys.argv[1]).read().splitlines()
except OSError:
    sys.exit("no serve.md: see the log above")
for line in lines:
    if not line.startswith("| ") or line.startswith("| model"):
        continue
    cells = [c.strip() for c in line.split("|")[1:-1]]
    if len(cells) > 20:  # a measured row
        picked = [cells[i] for i in (0, 1, 2, 8, 9, 11, 16, 17, 18, 19, 20, 21, 23, 24, 25)]
        print(" ".join(f"{c[:16]:>8}" for c in picked))
    else:  # the summary
        print("gain:", " | ".join(cells))
PY
