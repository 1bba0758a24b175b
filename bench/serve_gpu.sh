#!/usr/bin/env bash
# kiln serve on the GPU (issue 14), the whole device run in one script.
#
# Here, first (the registries are reachable from this machine, not from the device):
#   bash bench/serve_gpu.sh --fetch      # wheels into .whl-serve/ (git-ignored), and HEAD as .whl-serve/kiln-src.tar
# then on the device, with .whl-serve carried (run's carry: [".whl-serve"]):
#   mkdir -p /tmp/k && tar -xf .whl-serve/kiln-src.tar -C /tmp/k && cp -r .whl-serve /tmp/k/ && cd /tmp/k &&
#   KILN_COMMIT=<HEAD> OUT=$OUT bash bench/serve_gpu.sh .whl-serve
# (HEAD's snapshot, not the working tree: the device copy holds whatever else is uncommitted here.)
#
# 1. wheels: the serving stack the device image lacks (fastapi, uvicorn, tritonclient and their needs),
#    carried as wheels in WHEELS (default .whl-serve); each is installed into /tmp/serve-deps, first on
#    PYTHONPATH, unless python3 already has that distribution at the same major version and not older.
#    Seen on the device on 2026-12-01 (python 3.12.3): no fastapi, starlette, pydantic, uvicorn,
#    tritonclient, gevent, opentelemetry; grpcio 1.84.0, protobuf 7.36.2 (tritonclient's stubs are
#    protobuf 6 code: 6.33.6 is put first), anyio 4.15.1, h11 0.16.0, typing-extensions 4.16.0; httptools is
#    carried since 2026-12-01 evening: without it uvicorn parses HTTP with h11, in pure Python; hpack since
#    2026-12-05 (kiln's own gRPC transport, kiln/serve/grpc_h2.py, the default since 2026-12-04, and kiln perf's
#    wire client decode HTTP/2 header blocks with it)
# 2. tests/serve's gpu-marked tests (test_cuda.py: two instances on their own streams, concurrent requests)
# 3. bench/serve.py on cuda: MobileNetV2 (random weights: the ImageNet ones come from a package) and
#    BERT-base (seq 128), fp16 engines, 2 instances, batching on/off, concurrency 1 8 32 64, gRPC and
#    HTTP binary, 4 client processes; its tables in $OUT/serve.md (rewritten after every row)
#    Options by environment: SERVE_MODELS (default "mobilenet_v2 bert_base"), SERVE_CONCURRENCY (default
#    "1 8 32 64"), SERVE_PROCESSES (client processes, default 4; several values: every row with each),
#    SERVE_BENCH_S (the bench's timeout, default 450; 0: no bench), GPU_TESTS (0: skip stage 2; GPU_TESTS_S its
#    timeout, default 240: test_cuda.py builds a GEMM-heavy engine and serves it twice with front ends), SERVE_TREES (checkouts
#    serving, a server each: an A/B in one run; default .), FRONTENDS (kiln serve --frontends values,
#    one server each, e.g. "0 2 4"; default 0), STAGING_MIB (kiln serve --staging-mib values for servers with front
#    ends, a server each; default 64; 0: tensors over the engine's socket), SERVE_ARGS (more bench/serve.py flags,
#    e.g. "--client tritonclient"). With FRONTENDS other than 0, stage 2 also runs tests/serve/test_frontends.py
#    (front-end processes on this host's grpcio and Python).
# Each stage runs under its own timeout; the log is $OUT/serve_gpu.log.
set -u
if [ "${1:-}" = "--fetch" ]; then  # here: pinned wheels for the device's CPython 3.12, --no-deps (each need listed)
  mkdir -p .whl-serve
  ${PIP:-.venv/bin/pip} download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d .whl-serve \
    fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
    typing-inspection==0.4.5 annotated-doc==0.0.7 opentelemetry-api==1.45.2 uvicorn==0.54.0 h11==0.16.0 \
    tritonclient==2.73.0 python-rapidjson==1.25 gevent==26.9.0 geventhttpclient==2.6.1 greenlet==3.3.2 \
    zope.event==6.2 zope.interface==8.7 brotli==1.2.1 grpcio==1.85.3 protobuf==6.33.6 typing-extensions==4.16.0 \
    anyio==4.16.0 click==8.5.1 prometheus-client==0.26.0 urllib3==2.8.0 httptools==0.9.0 uvloop==0.23.0 hpack==4.2.0
  git archive HEAD -o .whl-serve/kiln-src.tar
  du -sh .whl-serve; echo "kiln-src.tar: $(git rev-parse --short HEAD)"
  exit 0
fi
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
import fastapi, uvicorn, grpc, google.protobuf, tritonclient.grpc.aio, tritonclient.http.aio, torch, kiln.serve, hpack
try:
    import httptools; parser = 'httptools ' + httptools.__version__
except ImportError:
    parser = 'h11'
try:
    import uvloop; loop = 'uvloop ' + uvloop.__version__
except ImportError:
    loop = 'asyncio'
print('fastapi', fastapi.__version__, 'uvicorn', uvicorn.__version__, 'grpcio', grpc.__version__,
      'protobuf', google.protobuf.__version__, loop, parser, 'torch', torch.__version__, torch.cuda.get_device_name())"

if [ "${GPU_TESTS:-1}" = "1" ]; then
  stage "tests/serve gpu-marked"
  timeout "${GPU_TESTS_S:-240}" python3 -m pytest -q -s -m gpu tests/serve/test_cuda.py 2>&1
  echo "pytest exit $?"
fi
if [ "${FRONTENDS:-0}" != "0" ] && [ "${FRONTEND_TESTS:-1}" = "1" ]; then
  stage "tests/serve/test_frontends.py"
  timeout 150 python3 -m pytest -q -x tests/serve/test_frontends.py 2>&1
  echo "pytest exit $?"
fi

if [ "${SERVE_BENCH_S:-450}" != "0" ]; then
stage "bench/serve.py on cuda"
timeout "${SERVE_BENCH_S:-450}" python3 bench/serve.py --models ${SERVE_MODELS:-mobilenet_v2 bert_base} --device cuda \
  --precision fp16 --instances 2 --processes ${SERVE_PROCESSES:-4} --random-weights --concurrency ${SERVE_CONCURRENCY:-1 8 32 64} \
  --frontends ${FRONTENDS:-0} --staging-mib ${STAGING_MIB:-64} --trees ${SERVE_TREES:-.} --window 1.0 --warmup 0.5 ${SERVE_ARGS:-} --out "$OUT" 2>&1
echo "bench exit $?"
fi
stage "done"
} 2>&1 | tee "$OUT/serve_gpu.log"
