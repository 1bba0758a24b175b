#!/usr/bin/env bash
# Session 19's last device call (<= 240 s, no carry): h-keymask's CUDA check (the [B,1,1,T] key mask through every
# Triton attention tactic, the fp16 bert_tiny engine with and without the rule), h-fp8att2's E4M3 tie tolerance
# (bench/gpu_fp8att_ties.sh), and why the device host's CPU engines bound no native segments (a C compiler?).
set -u
echo "== kiln $(git rev-parse --short HEAD 2>/dev/null), $(nvidia-smi --query-gpu=name --format=csv,noheader)"
echo "== key mask"
PYTHONPATH=$PWD timeout 120 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_attention_key_mask.py 2>&1 \
  | grep -vE "^\s*$|Warn" | tail -12
echo "== fp8 ties"
timeout 95 bash bench/gpu_fp8att_ties.sh 2>&1 | tail -20
echo "== C compiler: cc=$(command -v cc) gcc=$(command -v gcc) clang=$(command -v clang)"
PYTHONPATH=$PWD timeout 20 python3 -c "from kiln.kernels.cpu import native_loop as n; print([f for f in dir(n) if 'reason' in f.lower() or 'available' in f.lower()])" 2>&1 | tail -2
