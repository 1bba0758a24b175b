#!/usr/bin/env bash
# The runtime splits on the H200, one call (~220 s): engine.py -> context.py (branch h-split), then context.py ->
# context.py + graph_paths.py + cpu_paths.py + warm_up.py, ExecutionContext's mixins (branch h-split2; native.py's
# split is CPU-only). The CUDA paths moved as is and never ran after either move: execute()'s whole-call graph over
# bound tensors, run()'s static replay and its inputs' graph, a bucketed run written into its graph
# (graph_paths.py); warm_up()'s captures and a padding-free context's graph-packing warm-up (warm_up.py). The GPU
# tests below cover each (they assert the path was taken, e.g. _io_graph, _static_replay, replay_padded calls, and
# compare with the general path or onnxruntime): all passing is the check. Carry [".whl"]. Log in $OUT/split.log.
set -u
. "$(dirname "$0")/device_env.sh" kiln-split
{
stage "imports: where each CUDA path lives now"
timeout 60 python3 -c "
from kiln.runtime.context import ExecutionContext
for name in ('execute', '_capture_io_graph', '_capture_inputs', '_replay_static', '_replay_padded', 'warm_up',
             '_warm_up_graph_packing', '_run_static', '_run_checked'):
    print(f'{name:<24}', getattr(ExecutionContext, name).__module__)
" 2>&1 | tail -12
stage "CUDA engines, bound tensors, dynamic shapes, direct replay"
timeout 150 python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_cuda_engine.py tests/gpu/test_dynamic.py \
  tests/gpu/test_direct_replay.py 2>&1 | tail -4
stage "padding-free engines, packed streams (warm-up with graph packing)"
timeout 120 python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_remove_padding.py \
  tests/gpu/test_stream_packing.py 2>&1 | tail -4
stage done
} 2>&1 | tee "$OUT/split.log"
