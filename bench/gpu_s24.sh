#!/usr/bin/env bash
# Session 24's device call (one machine start for two measurements): issue 14's dynamic-batching gain
# (bench/gpu_batch5.sh, <= 280 s), then part of the zoo at batch 1 against torch eager and reduce-overhead (issue 11,
# bench/gpu_zoo.sh) for what is left of the call. Each part keeps what it measured if cut short.
#   (here, once)  PIP=/tmp/ci22/.venv/bin/pip bash bench/serve_gpu.sh --fetch; the cudnn-frontend wheel into .whl/
#   (device)      bash bench/gpu_s24.sh      # run's carry: [".whl-serve", ".whl"]; timeout 590
set -u
export OUT=${OUT:-/tmp/kiln-s24}; mkdir -p "$OUT"
start=$(date +%s)
bash bench/gpu_batch5.sh > "$OUT/batch5.txt" 2>&1
left=$(( 570 - ($(date +%s) - start) ))
MODELS=${MODELS:-wav2vec2_base,distilbert_base,phi3_small,qwen2_small,efficientnet_b0,swin_t}
MODELS=$MODELS MODES=reduce-overhead timeout $left bash bench/gpu_zoo.sh > "$OUT/zoo.txt" 2>&1
echo "== batching gain (bench/gpu_batch5.sh)"; tail -25 "$OUT/batch5.txt"
echo "== zoo, batch 1 ($left s)"; python3 - "$OUT/zoo-cuda.jsonl" <<'PY'
import json, sys
try:
    rows = [json.loads(line) for line in open(sys.argv[1])]
except OSError:
    sys.exit("no zoo rows")
for row in rows:
    print({k: row[k] for k in row if not isinstance(row[k], (list, dict))})
PY
tail -5 "$OUT/zoo.txt"
