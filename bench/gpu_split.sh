#!/usr/bin/env bash
# One device call for the batch-splitting shape buckets (issue 10) and the zoo's slow Phi-3 row (issue 11):
# the dynamic-shape GPU tests, the BERT-base stream with and without splitting beside torch.compile, and a
# per-layer profile of Phi-3 prefill 8 x 512. Logs in $OUT.  Run with carry [".whl"].
set -u
OUT=${OUT:-/tmp/kiln-split}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if ls .whl/nvidia_cudnn_frontend-*.whl >/dev/null 2>&1; then
  pip install -q --no-deps --target /tmp/cudnn-fe .whl/nvidia_cudnn_frontend-*.whl 2>/dev/null && export PYTHONPATH=/tmp/cudnn-fe
fi
stage() { echo "== $(date +%T) $*"; }
{
stage "dynamic tests"; timeout 150 python3 -m pytest tests/gpu/test_dynamic.py -q -p no:cacheprovider 2>&1 | tail -6
stage "stream, split"; timeout 200 python3 bench/dynamic.py --device cuda --out "$OUT" 2>&1 | grep -v "^#\|^$" | tail -22
cp "$OUT/dynamic-cuda.md" "$OUT/dynamic-split.md" 2>/dev/null
stage "stream, no split"; timeout 100 python3 bench/dynamic.py --device cuda --no-compile --no-split --out "$OUT" 2>&1 | grep -v "^$" | tail -14
stage "phi3 profile"
P=$(python3 -c "import sys; sys.path.insert(0,'.'); from kiln import zoo; print(zoo.export('phi3_small', batch=8, seq=512).path)" 2>/dev/null | tail -1)
timeout 120 python3 -m kiln.cli build "$P" --device cuda --fp16 -o /tmp/phi3.kiln 2>&1 | tail -3
timeout 90 python3 -m kiln.cli bench /tmp/phi3.kiln --dump-profile 2>&1 | tail -60 > "$OUT/phi3-profile.txt"
head -c 4000 "$OUT/phi3-profile.txt"
stage done
} 2>&1 | tee "$OUT/split.log"
