#!/usr/bin/env bash
# One device call for issue 11's lost H200 rows (DCN at batch 256, Phi-3 at 1 x 128 and 8 x 512): the zoo models
# exported (CPU work, in parallel) while the new tactics' GPU tests run, then bench/zoo_gpu_ab.py: kiln as main
# builds it vs this branch, interleaved, beside the fastest PyTorch mode, with per-layer profiles and kernel
# traces. Logs and zoo-ab.jsonl in $OUT. Run from the repo root with carry [".whl"] (cuDNN's frontend, as 12-02).
set -u
. "$(dirname "$0")/device_env.sh" kiln-zoo-ab
CASES=${CASES:-dcn:256,phi3_small:1x128,phi3_small:8x512}
{
stage "gpu tests (background) + exports"
( timeout 80 python3 -m pytest tests/gpu/test_cuda_tactics.py -q -s -p no:cacheprovider \
    -k "SwiGLU or DCN or output_float32" > "$OUT/gpu-tests.log" 2>&1; echo "gpu tests rc $?" >> "$OUT/gpu-tests.log" ) &
TESTS=$!
echo "$CASES" | tr ',' '\n' | xargs -P 4 -I{} timeout 70 python3 -c "
import sys; sys.path.insert(0, '.')
from kiln import zoo
name, _, shape = '{}'.partition(':'); dims = [int(d) for d in shape.split('x')] if shape else []
zoo.export(name, batch=dims[0] if dims else None, seq=dims[1] if len(dims) > 1 else None)
print('exported', '{}')" 2>&1 | grep -v Warning | tail -8
wait $TESTS  # before the A/B: nothing else on the GPU while it times
stage "gpu tests"
grep -v "^$" "$OUT/gpu-tests.log" | tail -45
stage "A/B"
timeout 120 python3 bench/zoo_gpu_ab.py --cases "$CASES" --out "$OUT" 2>&1 | grep -v "Warning\|warn(" | tee "$OUT/ab.log"
stage done
} 2>&1 | tee "$OUT/run.log"
