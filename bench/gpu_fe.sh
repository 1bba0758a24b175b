#!/usr/bin/env bash
# Device call of 2026-12-03 (issue 14, the front ends' cost per request): kiln serve --frontends 4 and 8 on the H200,
# MobileNetV2 fp16 (301 KB a request), 2 instances, batching on / off, gRPC and HTTP binary, concurrency 64, 4 client
# processes; input tensors over the engine's socket (--staging-mib 0: before) and through the front ends' staging
# arenas (64: after); each row says how busy each process was (% of one core: the engine's event loop thread, the
# engine process, the mean front end, the mean client process), so the table says which one held throughput.
#   (here, once)  bash bench/serve_gpu.sh --fetch      # wheels into .whl-serve/ (git-ignored)
#   (device)      bash bench/gpu_fe.sh                 # run's carry: [".whl-serve"]; ~4 min; logs and serve.md in $OUT
# Servers in order (4, 0) (4, 64) (8, 0) (8, 64): a run cut short by SERVE_BENCH_S keeps the rows it finished.
set -u
. "$(dirname "$0")/device_env.sh" kiln-fe
export KILN_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
FRONTEND_TESTS=0 FRONTENDS=${FRONTENDS:-4 8} STAGING_MIB=${STAGING_MIB:-0 64} SERVE_MODELS=mobilenet_v2 \
  SERVE_CONCURRENCY=${SERVE_CONCURRENCY:-64} SERVE_BENCH_S=${SERVE_BENCH_S:-165} \
  bash bench/serve_gpu.sh .whl-serve 2>&1 | grep -v "^$" | tail -60
