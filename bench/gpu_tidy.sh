#!/usr/bin/env bash
# The tidy branch's device check (2026-12-05b): kiln/tactics/cuda/library.py's memory-bound Triton tactics moved
# as they were to memory_bound.py. Every tactic of both against the op's registered implementation on the H200, in
# a CUDA graph (tests/gpu/test_cuda_tactics.py), and each CUDA op's candidates listed in registration order. One
# call, under 300 s; logs in $OUT.
set -u
. "$(dirname "$0")/device_env.sh" kiln-tidy
{
stage "CUDA tactics (library.py, memory_bound.py) against the ops' implementations"
timeout 200 python3 -m pytest tests/gpu/test_cuda_tactics.py -q -p no:cacheprovider -rf 2>&1 | tail -6
stage "candidates per CUDA op, in registration order"
timeout 60 python3 - <<'PY'
from kiln.tactics import registry
ops = {}
for name, t in registry.all_tactics("cuda").items():
    ops.setdefault((t.domain, t.op_type), []).append(name)
for (domain, op), names in sorted(ops.items()):
    print(f"| {domain or 'ai.onnx'}::{op} | {len(names)} | {names[0]} ... |")
PY
stage done
} 2>&1 | tee "$OUT/tidy.log"
