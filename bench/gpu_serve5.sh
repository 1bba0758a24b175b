#!/usr/bin/env bash
# Device call of 2026-12-03 (issue 14, h-serve5: what bounds dynamic batching's gain): kiln serve --frontends 8
# --staging-mib 64 on the H200, MobileNetV2 fp16 (301 KB a request), 2 instances, batching on / off, gRPC and HTTP
# binary, concurrency 64, as bench/gpu_fe.sh's second call (3,745 / 4,555 req/s batched, 2.84x / 2.96x). Rows:
#   - this tree: the engine reads staged tensors in place (no 301 KB copy per request on its event loop);
#   - kiln-before: the same kiln with StagingView.take copying again (the one-line change, made here with python),
#     an A/B on the same machine in the same call;
# each with 4 and with 8 client processes (tritonclient costs ~700-800 us of CPU a request: is the load generator the
# limit?), and per request its queue and merge times (where a request waits in the engine process). test_cuda.py is
# skipped (no CUDA path changed; the front-end path is tested on the CPU): the bench's rows need the time. Rows in order
# of need: this tree 4 then 8 client processes, then kiln-before; a run cut short by SERVE_BENCH_S keeps those done.
# Run at 52f95cc (bench/results/serve-2026-12-03b.md): 200 s held the two builds, the first server and its first 4
# rows only; the 8-process and kiln-before rows need a call of their own (SERVE_PROCESSES=8, or SERVE_TREES).
#   (here, once)  bash bench/serve_gpu.sh --fetch      # wheels into .whl-serve/ (git-ignored)
#   (device)      bash bench/gpu_serve5.sh             # run's carry: [".whl-serve"]; ~4 min; logs and serve.md in $OUT
set -u
. "$(dirname "$0")/device_env.sh" kiln-serve5
export KILN_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
BEFORE=/tmp/kiln-before
rm -rf "$BEFORE" && mkdir -p "$BEFORE" && cp -r kiln "$BEFORE/"
python3 - "$BEFORE/kiln/serve/staging.py" <<'PY' || exit 1
import pathlib, sys
path = pathlib.Path(sys.argv[1])
text = path.read_text()
line = "        tensor.flags.writeable = False  # an engine that writes its inputs gets a copy (the batcher's rule)\n"
assert text.count(line) == 1, "StagingView.take changed: update bench/gpu_serve5.sh"
path.write_text(text.replace(line, "        tensor = tensor.copy()  # kiln-before: copied out as the frame is decoded\n"))
print("kiln-before: StagingView.take copies")
PY
GPU_TESTS=0 FRONTEND_TESTS=0 FRONTENDS=8 STAGING_MIB=64 SERVE_MODELS=mobilenet_v2 SERVE_CONCURRENCY=64 \
  SERVE_PROCESSES="${SERVE_PROCESSES:-4 8}" SERVE_TREES=". $BEFORE" SERVE_BENCH_S=${SERVE_BENCH_S:-200} \
  bash bench/serve_gpu.sh .whl-serve 2>&1 | grep -v "^$" | tail -60
