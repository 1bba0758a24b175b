#!/usr/bin/env bash
# Device call for issue 14's BERT-base rows (h-servewrong, 2026-12-05): the H200 run of bench/gpu_servegain.sh at
# 23d787d read "0 infer/s, wrong 5" over gRPC and then "request '0' alone: no answer in 60 s" over HTTP. kiln perf's
# wire client now narrows each output's tolerance to the server's batched-vs-alone spread (the requests sent together
# 3x before the load: a mix-up there stops the row with "answered together (batched): ... answers mixed up"), names
# whose answer a wrong one is, counts calls unanswered after the drain as errors, and bench/serve.py prints each
# row's first error or wrong answer. BERT-base only (seq 128, fp16, profile batch 1..64, 2 instances), batching on,
# gRPC then HTTP, kiln serve --frontends 8, 4 wire client processes, c = 64, 2 s windows, 3 tuning rounds a layer.
#   (here, once)  PIP=/tmp/ci1/.venv/bin/pip bash bench/serve_gpu.sh --fetch   # wheels into .whl-serve/ (git-ignored)
#   (device)      bash bench/gpu_servewrong.sh   # run's carry: [".whl-serve"]; <= 290 s; serve.md and the log in $OUT
set -u
export OUT=${OUT:-/tmp/kiln-servewrong}
mkdir -p "$OUT"
export KILN_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
GPU_TESTS=0 FRONTEND_TESTS=0 FRONTENDS=8 STAGING_MIB=64 SERVE_MODELS=bert_base SERVE_CONCURRENCY=64 SERVE_PROCESSES=4 \
  SERVE_BENCH_S=230 SERVE_ARGS="--client wire --window 2.0 --warmup 0.5 --tuning-runs 3 --batching on" \
  timeout 285 bash bench/serve_gpu.sh .whl-serve > /dev/null 2>&1
echo "== kiln $KILN_COMMIT, $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null), $(nproc) CPUs"
# the rows (model, batching, protocol, infer/s, p50 ms, p99 ms, requests/call, call ms, errors, wrong), then what
# the first error or wrong answer of each row was, and kiln perf's warnings (alike answers)
grep -E "^\| bert" "$OUT/serve_gpu.log" | head -4 | awk -F'|' '{print $2,$3,$4,$10,$11,$13,$17,$18,$26,$27}'
grep -E "failed|Error|error|wrong answer|kiln perf:" "$OUT/serve_gpu.log" | grep -v "^| " | cut -c1-400 | tail -12
