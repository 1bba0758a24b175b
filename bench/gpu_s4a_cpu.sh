#!/usr/bin/env bash
# Device call part (2026-12-02, fourth session): the H200 host's Xeon CPU. The device image lacks kiln's declared
# dependency onednn-cpu-gomp (libdnnl.so.3), so there kiln's oneDNN primitives and its C transformer kernels (whose
# operands are oneDNN memory objects) are unavailable and those layers run default code: the CPU zoo without it (as
# the image is) and with the wheel's library loaded (KILN_DNNL_LIBRARY), as a user's `pip install kiln` has it.
# Carry [".whl/onednn_cpu_gomp-2023.2.0-py2.py3-none-manylinux1_x86_64.whl"]. Logs in $OUT.
set -u
. "$(dirname "$0")/device_env.sh" kiln-s4a
python3 -c "import glob, zipfile; z = zipfile.ZipFile(glob.glob('.whl/onednn_cpu_gomp-*.whl')[0]); [z.extract(n, '/tmp/dnnl') for n in z.namelist() if 'libdnnl.so.3' in n]"
DNNL=$(find /tmp/dnnl -name 'libdnnl.so.3' | head -1)
export KILN_CACHE=/tmp/kiln-cache
{
for library in "" "$DNNL"; do
  stage "KILN_DNNL_LIBRARY='$library': CPU libraries, then the CPU zoo at 2 threads"
  KILN_DNNL_LIBRARY=$library python3 bench/cpu_native_diag.py 2>&1 | tail -7
  KILN_DNNL_LIBRARY=$library timeout ${ZOO_TIMEOUT:-200} python3 bench/zoo.py --models ${ZOO_MODELS:-bert_base,resnet50} \
    --threads 2 --rounds 3 --budget 12 --timing-cache "" --no-write 2>&1 | grep "^| \|tactics\|rror\|geometric" | tail -14
done
stage done
} 2>&1 | tee "$OUT/s4a-cpu.log"
