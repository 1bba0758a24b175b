#!/usr/bin/env bash
# Device call of 2026-12-03 (issue 11, h-lstm): the H200 host's own CPU (an AVX-512/AMX Xeon, quieter than the dev VM)
# measures cpu.lstm.fused (kiln/kernels/cpu/lstm_fused.c) against kiln's other LSTM loops, onnxruntime and torch:
# one layer at 1 thread (CPU time) and 2 threads (wall), the 2-layer forecaster at 1 thread (CPU time), and the zoo
# row lstm_forecaster at 2 threads (wall; ZOO_MODELS=lstm_forecaster,resnet50 ZOO_TIMEOUT=100 adds ResNet-50). CPU only, no GPU used. Carry [".whl"] (the onednn-cpu-gomp
# wheel). About 120-210 s (the first stage compiles kiln's C libraries into a fresh cache). Logs in $OUT.
set -u
. "$(dirname "$0")/device_env.sh" kiln-s7-lstm
python3 -c "import glob, zipfile; z = zipfile.ZipFile(glob.glob('.whl/onednn_cpu_gomp-*.whl')[0]); [z.extract(n, '/tmp/dnnl') for n in z.namelist() if 'libdnnl.so.3' in n]"
export KILN_DNNL_LIBRARY=$(find /tmp/dnnl -name 'libdnnl.so.3' | head -1) KILN_CACHE=/tmp/kiln-cache
{
stage "CPU"
lscpu | grep -i "model name\|^CPU(s)\|L2\|flags" | cut -c1-300; uptime
stage "compile kiln's C libraries (GEMM, recurrent loops, relayout, segment loop)"
timeout 60 python3 -c "
from kiln.kernels.cpu import gemm_native, native_loop, recurrent, relayout, onednn
print('onednn', onednn.available(), 'gemm', gemm_native.load() is not None, 'recurrent', recurrent.available(),
      recurrent.reason(), 'relayout', relayout.available(), 'segment loop', native_loop.load() is not None)
print([k.name for k in recurrent.fused_kernels() if k.supported])"
stage "one LSTM layer, 1 thread, CPU time"
timeout 35 python3 bench/lstm_layers.py --rounds 5 --runs 10 2>&1 | tail -20
stage "one LSTM layer, 2 threads, wall"
timeout 30 python3 bench/lstm_layers.py --threads 2 --rounds 5 --runs 10 2>&1 | grep -v "generic" | tail -14
stage "2-layer LSTM forecaster, 1 thread, CPU time"
timeout 35 python3 bench/recurrent.py --models lstm --threads 1 --clock cpu --rounds 5 --budget 6 --no-write 2>&1 | grep "^| \|tactics\|by round\|rror" | tail -5
stage "zoo at 2 threads: ${ZOO_MODELS:-lstm_forecaster}"
timeout ${ZOO_TIMEOUT:-50} python3 bench/zoo.py --models ${ZOO_MODELS:-lstm_forecaster} --threads 2 --rounds 3 --budget 8 --timing-cache "" \
  --no-write 2>&1 | grep "^| \|tactics\|rror\|geometric" | tail -8
stage done; uptime
} 2>&1 | tee "$OUT/s7-lstm.log"
