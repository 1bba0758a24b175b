#!/usr/bin/env bash
# A diagnostic device call (2026-12-02, second session): the pre-quantized LLM tests with tracebacks, batch-1
# jitter, where Wav2Vec2's 2.2 ms go (per layer, kiln fp16), and the Llama-3-8B decode step kernel by kernel.
# Carry [".whl"]. Logs in $OUT.
set -u
. "$(dirname "$0")/device_env.sh" kiln-diag
{
stage "pre-quantized LLM checkpoints (CPU tests pinned to the CPU; CUDA kernels on CUDA)"
TRITON_INTERPRET=0 timeout 150 python3 -m pytest tests/llm/test_prequantized.py tests/llm/test_quant_gemm_kernel.py \
  -q -p no:cacheprovider --tb=short -rf > "$OUT/prequant.log" 2>&1
grep -E "^E  |^FAILED" "$OUT/prequant.log" | sort | uniq -c | sort -rn | head -12; tail -1 "$OUT/prequant.log"
stage "Llama-3-8B decode step, kernel by kernel (bf16, then fp8)"
timeout 120 python3 bench/llm_profile.py --top 18 2>&1 | grep -v Warning | tail -22
timeout 90 python3 bench/llm_profile.py --quantization fp8 --top 10 2>&1 | grep -v Warning | tail -13
stage "Wav2Vec2 per layer (kiln fp16, CUDA)"
timeout 150 python3 - <<'PY' 2>&1 | grep -v Warning | tail -30
import sys; sys.path.insert(0, ".")
import torch, kiln
from kiln import zoo
from kiln.runtime import profiler
e = zoo.export("wav2vec2_base")
engine = kiln.build(str(e.path), device="cuda", precision="fp16")
feeds = {k: v for k, v in e.inputs().items()}
layers = profiler.profile_layers(engine.program, engine.program_inputs(feeds))
total = sum(l["ms"] for l in layers)
print(f"wav2vec2_base eager per-layer sum {total:.3f} ms over {len(layers)} steps")
for l in sorted(layers, key=lambda l: -l["ms"])[:22]:
    print(f"  {l['ms']:.3f} ms {100 * l['ms'] / total:4.1f}%  {l['op_type']:<22} {l['tactic']:<34} {l['name'][:60]}")
PY
stage "batch-1 jitter"
timeout 100 python3 bench/jitter.py --calls 2000 --out "$OUT" 2>&1 | tail -14
stage done
} 2>&1 | tee "$OUT/diag.log"
