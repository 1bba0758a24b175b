#!/usr/bin/env bash
# Device call (session 24): where BERT-base's batching gain stops at c = 64 (3.21x gRPC on an H100 at ab05db5,
# bench/results/serve-gain-2026-12-06.md): batching on, gRPC, concurrency 64/128/256, front ends 0/8, client
# processes 4/8, 2 instances — does throughput follow concurrency (requests wait outside the engine) or stop (the
# engine's calls)? serve.md and the log in $OUT.  run's carry: [".whl-serve"]; <= 360 s (then ConvNeXt-T b32 per-layer profile, <= 100 s).
set -u
export OUT=${OUT:-/tmp/kiln-batch6}; mkdir -p "$OUT"
export KILN_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
GPU_TESTS=0 FRONTEND_TESTS=0 FRONTENDS="${FRONTENDS:-0 8}" STAGING_MIB=64 SERVE_MODELS=bert_base \
  SERVE_CONCURRENCY="${SERVE_CONCURRENCY:-64 128 256}" SERVE_PROCESSES="${SERVE_PROCESSES:-4 8}" SERVE_BENCH_S=${SERVE_BENCH_S:-240} \
  SERVE_ARGS="--batching on --protocols grpc --client wire --window 2.0 --warmup 0.5 --tuning-runs 3" \
  timeout $(( ${SERVE_BENCH_S:-240} + 15 )) bash bench/serve_gpu.sh .whl-serve > /dev/null 2>&1
grep -E "^== |failed|Error|error|wrong answer" "$OUT/serve_gpu.log" | grep -v "^| " | cut -c1-300 | tail -8
python3 - "$OUT/serve.md" <<'PY'
import sys
try:
    lines = open(sys.argv[1]).read().splitlines()
except OSError:
    sys.exit("no serve.md")
for line in lines:
    if line.startswith("| bert"):
        c = [x.strip() for x in line.split("|")[1:-1]]
        if len(c) > 20:  # front ends, client processes, concurrency, infer/s, p50, p99, server us, queue us, engine us, req/call, call ms, loop %, per FE %, client us
            print(" ".join(f"{c[i][:9]:>9}" for i in (3, 6, 7, 8, 9, 11, 12, 13, 15, 16, 17, 19, 21, 23)))
PY
[ "${CONVNEXT:-1}" = "1" ] || exit 0
echo "== ConvNeXt-T batch 32 fp16: kiln's layers (eager per-layer medians; issue 11: 1.19x torch.compile on the H100)"
timeout 100 python3 -c "
import sys; sys.path.insert(0, '.')
from kiln import zoo; print(zoo.export('convnext_t', batch=32).path)" > /tmp/cnx.txt 2>/dev/null
M=$(tail -1 /tmp/cnx.txt); [ -f "$M" ] && timeout 90 python3 -m kiln build "$M" --device cuda --fp16 -o /tmp/cnx.kiln > "$OUT/convnext_build.log" 2>&1 \
  && timeout 60 python3 -m kiln bench /tmp/cnx.kiln --dump-profile --iterations 30 > "$OUT/convnext_profile.txt" 2>&1
head -60 "$OUT/convnext_profile.txt" | cut -c1-160; tail -3 "$OUT/convnext_build.log"
