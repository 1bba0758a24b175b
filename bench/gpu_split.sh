#!/usr/bin/env bash
# The engine.py split (branch h-split) on the H200: the CUDA paths ExecutionContext took to kiln/runtime/context.py
# (CUDA graphs, bucketed and padding-free runs, direct/static replays, execute() on bound tensors) run by the GPU
# tests that cover them. Code moved as is: the same pass counts as main's are the check. One call, ~200 s.
# Carry [".whl"]. Log in $OUT/split.log.
set -u
. "$(dirname "$0")/device_env.sh" kiln-split
{
stage "CUDA engines, bound tensors, dynamic shapes, direct replay"
timeout 150 python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_cuda_engine.py tests/gpu/test_dynamic.py \
  tests/gpu/test_direct_replay.py 2>&1 | tail -4
stage "padding-free engines, packed streams"
timeout 120 python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_remove_padding.py \
  tests/gpu/test_stream_packing.py 2>&1 | tail -4
stage done
} 2>&1 | tee "$OUT/split.log"
