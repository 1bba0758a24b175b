#!/usr/bin/env bash
# Device call 1 of 2026-12-02 (fourth session): the Xeon host's CPU libraries and zoo both ways
# (bench/gpu_s4a_cpu.sh), then kiln serve on the H200 (bench/serve_gpu.sh: gpu-marked serve tests, MobileNetV2 and
# BERT-base fp16, 2 instances, batching on/off at concurrency 1 and 64, gRPC and HTTP binary).
# Carry [".whl-serve", ".whl/onednn_cpu_gomp-2023.2.0-py2.py3-none-manylinux1_x86_64.whl"]. Logs in $OUT.
set -u
ZOO_MODELS=${ZOO_MODELS:-bert_base,resnet50} ZOO_TIMEOUT=${ZOO_TIMEOUT:-130} bash bench/gpu_s4a_cpu.sh 2>&1 | tail -40
KILN_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown) SERVE_BENCH_S=${SERVE_BENCH_S:-300} \
  SERVE_CONCURRENCY=${SERVE_CONCURRENCY:-1 64} bash bench/serve_gpu.sh .whl-serve 2>&1 | grep -v "^$" | tail -60
