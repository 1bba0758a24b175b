#!/usr/bin/env bash
# Device call of session 30 (issue 11), <= 560 s; run's carry: [".whl-serve"] (cuDNN's frontend wheel):
# 1. ConvNeXt-T batch 32 fp16, kiln's per-layer profile (1.19x the fastest torch on the H100 at ab05db5, the one
#    large-batch row under the 1.2x target), <= 100 s.
# 2. The zoo rows not re-run since 12-02 (other card, older kiln), against torch eager and torch.compile default
#    (the fastest at large batch): text 8 x 512 (<= 240 s), then images at batch 32 (<= 200 s).
set -u
. "$(dirname "$0")/device_env.sh" kiln-s30a
pip install -q --no-deps --target /tmp/cudnn-fe .whl-serve/nvidia_cudnn_frontend-*.whl 2>/dev/null && export PYTHONPATH=/tmp/cudnn-fe${PYTHONPATH:+:$PYTHONPATH}
export KILN_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
stage "ConvNeXt-T batch 32 fp16 profile (commit $KILN_COMMIT)"
timeout 100 bash -c '
python3 -c "
import sys; sys.path.insert(0, \".\")
from kiln import zoo; print(zoo.export(\"convnext_t\", batch=32).path)" > /tmp/cnx.txt 2>/dev/null
M=$(tail -1 /tmp/cnx.txt); [ -f "$M" ] && python3 -m kiln build "$M" --device cuda --fp16 -o /tmp/cnx.kiln > "$OUT/convnext_build.log" 2>&1 \
  && python3 -m kiln bench /tmp/cnx.kiln --dump-profile --iterations 30 > "$OUT/convnext_profile.txt" 2>&1'
head -70 "$OUT/convnext_profile.txt" | cut -c1-150; tail -3 "$OUT/convnext_build.log" | cut -c1-200
stage "zoo text 8x512"
OUT=$OUT/text BATCH=8 SEQ=512 MODES=default MODELS=gpt2,roberta_base,t5_small_encoder,llama_small,mistral_small \
  timeout 240 bash bench/gpu_zoo.sh > "$OUT/zoo_text.log" 2>&1
stage "zoo images 32"
OUT=$OUT/img BATCH=32 MODES=default MODELS=vit_b16,deit_small,regnet_y_040,mobilevit_s \
  timeout 200 bash bench/gpu_zoo.sh > "$OUT/zoo_img.log" 2>&1
cat "$OUT"/text/zoo-cuda.jsonl "$OUT"/img/zoo-cuda.jsonl > "$OUT/zoo-cuda.jsonl" 2>/dev/null
python3 - "$OUT/zoo-cuda.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print({k: r[k] for k in r if not isinstance(r[k], (dict, list))})
PY
grep -h -iE "error|failed|Traceback" "$OUT"/zoo_*.log | head -8 | cut -c1-200
