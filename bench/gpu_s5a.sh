#!/usr/bin/env bash
# Device call of 2026-12-02 (fifth session): why the H200 host's Xeon runs BERT-base's attention/LayerNorm layers on
# default code with kiln's oneDNN library loaded (issue 11). cpu_layers.py --wins builds BERT-base at 2 threads with
# every tactic and no timing cache, and keeps the autotuner's record per layer: each candidate's time or why it was not
# run. Carry [".whl/onednn_cpu_gomp-2023.2.0-py2.py3-none-manylinux1_x86_64.whl"]. Logs in $OUT.
set -u
. "$(dirname "$0")/device_env.sh" kiln-s5a
python3 -c "import glob, zipfile; z = zipfile.ZipFile(glob.glob('.whl/onednn_cpu_gomp-*.whl')[0]); [z.extract(n, '/tmp/dnnl') for n in z.namelist() if 'libdnnl.so.3' in n]"
export KILN_DNNL_LIBRARY=$(find /tmp/dnnl -name 'libdnnl.so.3' | head -1) KILN_CACHE=/tmp/kiln-cache
{
stage "CPU libraries"
python3 bench/cpu_native_diag.py 2>&1 | tail -8
lscpu | grep -i "model name\|^CPU(s)\|flags" | cut -c1-400
stage "BERT-base 1x128, every tactic, 2 threads"
timeout ${WINS_TIMEOUT:-300} python3 bench/cpu_layers.py --wins ${MODELS:-bert_base} --threads 2 --wins-json "$OUT/wins.json" 2>&1 | tail -40
stage "layers on default code, with each candidate's time or reason"
python3 - "$OUT/wins.json" <<'PY'
import json, sys
records = json.load(open(sys.argv[1]))
for model, layers in records.items():
    for layer, r in layers.items():
        if not str(r.get("tactic", "")).startswith("cpu.") or "attention" in layer or "norm" in layer:
            print(model, layer, r.get("tactic"), r.get("time_ms"), json.dumps(r.get("candidates"))[:600])
PY
if [ -n "${ZOO_MODELS:-}" ]; then
  stage "zoo at 2 threads: $ZOO_MODELS"
  timeout ${ZOO_TIMEOUT:-150} python3 bench/zoo.py --models $ZOO_MODELS --threads 2 --rounds 3 --budget 8 --timing-cache "" \
    --no-write 2>&1 | grep "^| \|tactics\|rror\|geometric" | tail -8
fi
stage done
} 2>&1 | tee "$OUT/s5a.log"
