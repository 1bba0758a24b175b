#!/usr/bin/env bash
# Session 21, device call A (issue 11): the GPU zoo's large-batch rows re-run on the current main — image models at
# batch 32, text models at 8 x 512 — against torch eager and torch.compile (default; the fastest at large batch).
set -u
OUT=${OUT:-/tmp/kiln-s21a}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
OUT=$OUT MODELS=convnext_tiny,swin_t,efficientnet_b0,resnet50 BATCH=32 MODES=default bash bench/gpu_zoo.sh
OUT=$OUT MODELS=qwen2_small,t5_small_encoder,distilbert_base BATCH=8 SEQ=512 MODES=default bash bench/gpu_zoo.sh
