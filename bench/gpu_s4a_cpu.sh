#!/usr/bin/env bash
# Device call part (2026-12-02, fourth session): the H200 host's Xeon CPU, whose torch is a CUDA build (a renamed
# libgomp): which kiln CPU libraries load (bench/cpu_native_diag.py), and the CPU zoo with libdnnl refused (today's
# default there) vs loaded beside a second OpenMP runtime (KILN_DNNL_SECOND_OPENMP=1). Carry [".whl"]. Logs in $OUT.
set -u
. "$(dirname "$0")/device_env.sh" kiln-s4a
mkdir -p /tmp/dnnl && unzip -o -q .whl/onednn_cpu_gomp-*.whl '*/libdnnl.so.3*' -d /tmp/dnnl
export KILN_DNNL_LIBRARY=$(find /tmp/dnnl -name 'libdnnl.so.3' | head -1)
export KILN_CACHE=/tmp/kiln-cache
{
stage "CPU libraries: default, then with the second OpenMP runtime allowed"
python3 bench/cpu_native_diag.py 2>&1 | tail -8
KILN_DNNL_SECOND_OPENMP=1 python3 bench/cpu_native_diag.py 2>&1 | tail -8
for allow in 0 1; do
  stage "CPU zoo, 2 threads, KILN_DNNL_SECOND_OPENMP=$allow"
  KILN_DNNL_SECOND_OPENMP=$allow timeout ${ZOO_TIMEOUT:-200} python3 bench/zoo.py --models ${ZOO_MODELS:-bert_base,resnet50,distilbert_base,lstm_forecaster} \
    --threads 2 --rounds 3 --budget 12 --timing-cache "" --no-write 2>&1 | grep "^| \|tactics\|rror\|geometric" | tail -14
done
stage done
} 2>&1 | tee "$OUT/s4a-cpu.log"
