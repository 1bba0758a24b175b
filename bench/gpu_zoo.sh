#!/usr/bin/env bash
# The zoo on one GPU in one device call: export every model first, in parallel on the host's cores (ONNX
# export is CPU work), then time them one after another (bench/zoo.py --device cuda), each row appended to
# $OUT/zoo-cuda.jsonl as it is measured so a call cut short keeps what it measured.
#   MODELS="vit_b16,deit_small" BATCH=1 MODES=reduce-overhead bash bench/gpu_zoo.sh
# BATCH/SEQ: empty for each model's own; MODES: the torch.compile modes that run as peers (eager always does).
# Carry [".whl"] to get cuDNN's graph API (nvidia-cudnn-frontend), as the README's rows had it.
set -u
OUT=${OUT:-/tmp/kiln-zoo}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if ls .whl/nvidia_cudnn_frontend-*.whl >/dev/null 2>&1; then
  pip install -q --no-deps --target /tmp/cudnn-fe .whl/nvidia_cudnn_frontend-*.whl 2>/dev/null && export PYTHONPATH=/tmp/cudnn-fe${PYTHONPATH:+:$PYTHONPATH}
fi
BATCH=${BATCH:-}; SEQ=${SEQ:-}; MODES=${MODES:-default,reduce-overhead}
echo "== $(date +%T) export ${MODELS} (batch ${BATCH:-own}, seq ${SEQ:-own})"
echo "$MODELS" | tr ',' '\n' | xargs -P 8 -I{} python3 -c "
import sys; sys.path.insert(0, '.')
from kiln import zoo
zoo.export('{}', batch=${BATCH:-None}, seq=${SEQ:-None})" 2>&1 | grep -v Warning | tail -20
echo "== $(date +%T) time"
python3 bench/zoo.py --device cuda --models "$MODELS" ${BATCH:+--batch $BATCH} ${SEQ:+--seq $SEQ} \
  --torch-modes "$MODES" --jsonl "$OUT/zoo-cuda.jsonl" --no-write 2>&1 | tee -a "$OUT/zoo.log" | grep -v "^  File\|^    "
echo "== $(date +%T) done"
