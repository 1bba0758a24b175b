#!/usr/bin/env bash
# Device call for issue 14's BERT-base serving rows (2026-12-05): BERT-base fp16 (seq 128, profile batch 1..64,
# 2 instances, batching on, kiln serve --frontends 8, 4 wire client processes, c = 64, 2 s windows, 3 tuning rounds a
# layer), gRPC then HTTP, served twice: kiln serve --cuda-sync spin (the default), then blocking (h-fold2).
# - Wrong answers (h-servewrong, h-serve5): at main c8acb52 both rows stopped before their load, "answered together
#   (batched): output 'layer_norm_24' differs from its answer alone by 0.009766 (tolerance 0.004441)": FP32 outputs
#   computed in FP16 (2.5 FP16 ulps at the largest value 4.44) judged at FP32's 1e-3. kiln perf now judges an output
#   on FP16's grid as FP16 (kiln/serve/perf_check.py), names whose answer a wrong one is and counts calls unanswered
#   after the drain as errors; bench/serve.py prints each row's first error or wrong answer. Expect: every row
#   measured, wrong 0.
# - Where the host's CPU per request goes: server CPU us/req; engine loop, engine process, per front end %core. The
#   engine process less its loop is the 2 instance threads: spinning on their CUDA streams under "spin"
#   (bench/results/serve5-2026-12-05c.md, section 3), asleep on a blocking event under "blocking"
#   (kiln/serve/instances.py). The A/B: server CPU us/req, infer/s and p99 of the "@sync blocking" rows against the
#   "@sync spin" ones. The HTTP rows read 301 KB-class bodies unpaused (uvicorn's pause at 4 MiB, frontdoors.py).
#   (here, once)  PIP=/tmp/ci1/.venv/bin/pip bash bench/serve_gpu.sh --fetch   # wheels into .whl-serve/ (git-ignored)
#   (device)      bash bench/gpu_serve5c.sh   # run's carry: [".whl-serve"]; <= 285 s; serve.md and the log in $OUT
set -u
export OUT=${OUT:-/tmp/kiln-serve5c}
mkdir -p "$OUT"
export KILN_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
GPU_TESTS=0 FRONTEND_TESTS=0 FRONTENDS=8 STAGING_MIB=64 SERVE_MODELS=bert_base SERVE_CONCURRENCY=64 SERVE_PROCESSES=4 \
  SERVE_BENCH_S=195 \
  SERVE_ARGS="--client wire --window 2.0 --warmup 0.5 --tuning-runs 3 --batching on --cuda-sync spin blocking" \
  timeout 220 bash bench/serve_gpu.sh .whl-serve > /dev/null 2>&1
echo "== kiln $KILN_COMMIT, $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null), $(nproc) CPUs"
# the blocking wait's GPU test (two instances, 128 concurrent requests, each answered with its own rows), on the
# serving wheels serve_gpu.sh installed
PYTHONPATH=/tmp/serve-deps timeout 60 python3 -m pytest -q -m gpu tests/serve/test_cuda.py -k "blocking and not front_ends" 2>&1 | tail -3
# model @sync, batching, protocol, infer/s, p50 ms, p99 ms, requests/call, call ms, server CPU us/req, engine loop
# %core, engine process %core, per front end %core, client CPU us/req, errors, wrong
grep -E "^\| bert" "$OUT/serve_gpu.log" | head -8 | awk -F'|' '{print $2,$3,$4,$10,$11,$13,$18,$19,$20,$21,$22,$23,$25,$26,$27}'
grep -E "failed|Error|error|wrong answer|kiln perf:" "$OUT/serve_gpu.log" | grep -v "^| " | cut -c1-400 | tail -12
