#!/usr/bin/env bash
# kiln serve on the GPU (issue 14), the whole device run in one script, from a kiln checkout's root:
#
#   KILN_COMMIT=$(git rev-parse --short HEAD) OUT=/some/dir bash bench/serve_gpu.sh [WHEELS]
#
# 1. wheels: the serving stack the device image lacks (fastapi, uvicorn, tritonclient and their needs),
#    carried as wheels in WHEELS (default .whl-serve); each is installed into /tmp/serve-deps, first on
#    PYTHONPATH, unless python3 already has that distribution at the same major version and not older
# 2. tests/serve's gpu-marked tests (test_cuda.py: two instances on their own streams, concurrent requests)
# 3. bench/serve.py on cuda: MobileNetV2 (random weights: the ImageNet ones come from a package) and
#    BERT-base (seq 128), fp16 engines, 2 instances, batching on/off, concurrency 1 8 32 64, gRPC and
#    HTTP binary, 4 client processes; its tables in $OUT/serve.md (rewritten after every row)
# Each stage runs under its own timeout; the log is $OUT/serve_gpu.log.
set -u
OUT=${OUT:-/tmp/serve-gpu}
WHEELS=${1:-.whl-serve}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 KILN_COMMIT=${KILN_COMMIT:-unknown}
stage() { echo "== $(date +%T) $*"; }

{
stage "machine (kiln $KILN_COMMIT)"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
echo "$(nproc) CPUs: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"; python3 --version

stage "wheels from $WHEELS"
timeout 60 python3 - "$WHEELS" > /tmp/serve-wheels.txt <<'PY'
import importlib.metadata as metadata, pathlib, sys
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version
for wheel in sorted(pathlib.Path(sys.argv[1]).glob("*.whl")):
    name, version, _, _ = parse_wheel_filename(wheel.name)
    try:
        have = Version(metadata.version(canonicalize_name(name)))
    except metadata.PackageNotFoundError:
        have = None
    keep = have is not None and have.major == version.major and have >= version
    print(f"{name} {version}: {'have ' + str(have) if keep else 'install (have ' + str(have) + ')'}", file=sys.stderr)
    if not keep:
        print(wheel)
PY
if [ -s /tmp/serve-wheels.txt ]; then
  timeout 120 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/serve-deps \
    $(cat /tmp/serve-wheels.txt) || echo "wheel install failed"
fi
export PYTHONPATH=/tmp/serve-deps${PYTHONPATH:+:$PYTHONPATH}
python3 -c "
import fastapi, uvicorn, grpc, google.protobuf, tritonclient.grpc.aio, tritonclient.http.aio, torch
try:
    import uvloop; loop = 'uvloop ' + uvloop.__version__
except ImportError:
    loop = 'asyncio'
print('fastapi', fastapi.__version__, 'uvicorn', uvicorn.__version__, 'grpcio', grpc.__version__,
      'protobuf', google.protobuf.__version__, loop, 'torch', torch.__version__, torch.cuda.get_device_name())"

stage "tests/serve gpu-marked"
timeout 90 python3 -m pytest -q -m gpu tests/serve/test_cuda.py 2>&1
echo "pytest exit $?"

stage "bench/serve.py on cuda"
timeout 200 python3 bench/serve.py --models mobilenet_v2 bert_base --device cuda --precision fp16 --instances 2 \
  --processes 4 --random-weights --concurrency 1 8 32 64 --window 1.0 --warmup 0.5 --out "$OUT" 2>&1
echo "bench exit $?"
stage "done"
} 2>&1 | tee "$OUT/serve_gpu.log"
