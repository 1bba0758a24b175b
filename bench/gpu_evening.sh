#!/usr/bin/env bash
# The evening session's one device call (2026-12-01): (1) the cost of kiln's short OpenMP spin on an idle
# CPU (the H200 host's, 2 threads: GOMP_SPINCOUNT 300000 = libgomp's default, 10000 = kiln's, 0),
# (2) kiln serve on the H200 after the serving changes (bench/serve_gpu.sh, concurrency 1 and 64),
# (3) the int8 engine after its MaxPool/QAdd/Q-DQ kernels. Run with carry [".whl", ".whl-serve"].
set -u
OUT=${OUT:-/tmp/kiln-evening}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
stage() { echo "== $(date +%T) $*"; }
{
stage "CPU spin, idle host: $(nproc) CPUs,$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2), load $(cut -d' ' -f1 /proc/loadavg)"
for sc in 300000 10000 0 300000 10000 0; do
  echo "GOMP_SPINCOUNT=$sc"
  GOMP_SPINCOUNT=$sc CUDA_VISIBLE_DEVICES= timeout 45 python3 bench/cpu.py --models resnet50,mobilenet_v2 --threads 2 \
    --rounds 3 --budget 4 --no-write 2>&1 | grep "^| ResNet\|^| MobileNet\|Error"
done
stage "serve"
SERVE_BENCH_S=230 SERVE_CONCURRENCY="1 64" OUT=$OUT bash bench/serve_gpu.sh .whl-serve 2>&1 | grep -v "^[a-z-]* [0-9.]*: \(have\|install\)"
stage "int8 engine"
if ls .whl/nvidia_cudnn_frontend-*.whl >/dev/null 2>&1; then
  pip install -q --no-deps --target /tmp/cudnn-fe .whl/nvidia_cudnn_frontend-*.whl 2>/dev/null && export PYTHONPATH=/tmp/cudnn-fe
fi
timeout 120 python3 bench/quant_gpu.py --sections engines --engines resnet50_b256 --modes kiln_fp16,kiln_int8 \
  --row-timeout 55 --out "$OUT" 2>&1 | tail -8
stage done
} 2>&1 | tee "$OUT/evening.log"
