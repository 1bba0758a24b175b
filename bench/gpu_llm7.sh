#!/usr/bin/env bash
# Device call for issue 15 (helper llm7, session 14, 2026-12-04), <= 420 s, one call, no carry:
# FP8-KV decode attention toward the KV bandwidth (81 us a layer at batch 512 = 2.49 TB/s before).
# 1. GPU tests (~65 s cap): the packed decode kernel (kv_heads_per_program) at Llama-3-8B heads on an FP8 cache
#    against the reference + batch invariance, the default launch's splits; then the flash prefill tests, with the
#    flash engine test whose rewritten bound (session 13) never ran on a GPU.
# 2. bench/llm7_decode_sweep.py (~130 s cap): FP8-KV decode attention alone at batch 512 and 1, 192 keys, the
#    engine's launch against 28 KILN_LLM_DECODE_FP8 launches (packed kernel hN nN wN sN; split kernel with fewer
#    stages / heads-first grid / shorter splits), each checked against the reference and for batch invariance; a
#    read-only kernel of the same access pattern (the bandwidth bound); the fastest at b512 -> $OUT/llm7_best.txt.
# 3. 128/128 at batch 512, FP8 weights + FP8 KV: default / decode-fp8 (KILN_LLM_DECODE_FP8 = the pick) /
#    decode-fp8+flash (and KILN_LLM_PREFILL=flash), then again, one process each, while the budget lasts (27 s a
#    run: ~5-6 runs); then a short table.
# Every stage under timeout; a failing stage does not stop the later ones. Logs in $OUT.
set -u
. "$(dirname "$0")/device_env.sh" kiln-llm7
LIMIT=${LIMIT:-415}
# DRY=1 (PYTHON=...): a dry run of the plumbing on a CPU machine (interpreter, tiny shapes); never on the device
PY=${PYTHON:-python3}; INTERP=0; SWEEP=(--batches 512 1 --keys 192); TP=(--batch 512 --kv-cache-memory 36GiB)
if [ "${DRY:-0}" = 1 ]; then
  INTERP=1; SWEEP=(--batches 2 1 --keys 40 --launches "" "h4 n16 w1 s4");
  TP=(--batch 4 --preset tiny --device cpu --dtype float32 --input-len 8 --output-len 4 --kv-cache-memory 64MiB)
fi
{
stage "device, commit ${KILN_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo ?)}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
stage "1a. GPU tests: packed decode kernel, FP8-cache decode (timeout 30 s)"
TRITON_INTERPRET=$INTERP timeout 30 "$PY" -m pytest -v -rfE --tb=short \
  -p no:cacheprovider tests/llm/test_paged_decode_packed.py tests/llm/test_paged_decode_kernel.py \
  -k "gpu or fp8_cache_with_fp16 or does_not_depend or default_splits" 2>&1 \
  | grep -E "PASSED|FAILED|ERROR|passed|failed|^E |Error" | sed 's/^tests\/llm\///' | tail -30
echo "(exit ${PIPESTATUS[0]}; 124 = timed out)"
stage "1b. GPU tests: flash prefill, incl. the flash engine test (timeout 35 s)"
TRITON_INTERPRET=$INTERP timeout 35 "$PY" -m pytest -v -rfE --tb=short \
  -p no:cacheprovider tests/llm/test_flash_prefill.py \
  2>&1 | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|^E |Error" | sed 's/^tests\/llm\///' | tail -25
echo "(exit ${PIPESTATUS[0]}; 124 = timed out)"
stage "2. FP8-KV decode attention sweep, batch 512 and 1, 192 keys (timeout 130 s)"
rm -f "$OUT/llm7_best.txt"
TRITON_INTERPRET=$INTERP timeout 130 "$PY" bench/llm7_decode_sweep.py "${SWEEP[@]}" --budget 105 --out "$OUT" 2>&1 \
  | grep -v -E "UserWarning|_warn_once"
echo "(exit ${PIPESTATUS[0]})"
[ -f "$OUT/llm7_best.txt" ] || { echo "no pick: decode-fp8 runs the engine default"; : > "$OUT/llm7_best.txt"; }
PICK=$(cat "$OUT/llm7_best.txt")
left=$((LIMIT - 28 - SECONDS))  # the parent prints its table after the budget (a torch import: ~5 s)
stage "3. 128/128 b512 FP8+FP8-KV: default / decode-fp8 ('$PICK') / decode-fp8+flash, x3 (budget $left s)"
mkdir -p "$OUT/tp"
timeout $((left + 18)) "$PY" bench/llm_throughput.py --trees . "${TP[@]}" \
  --runs fp8-kv8:default fp8-kv8:decode-fp8 fp8-kv8:decode-fp8+flash fp8-kv8:default fp8-kv8:decode-fp8 \
  fp8-kv8:decode-fp8+flash fp8-kv8:default fp8-kv8:decode-fp8 \
  --decode-fp8 "@$OUT/llm7_best.txt" \
  --budget $left --per-run 27 --out "$OUT/tp" 2>&1 | grep -v -E "UserWarning|_warn_once"
echo "(exit ${PIPESTATUS[0]})"
stage "summary after $SECONDS s"
"$PY" - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
try:
    sweep = json.loads((out / "llm7_sweep.json").read_text())
    res = sweep["results"]
    def cell(t, b):
        c = res.get(t, {}).get(str(b), res.get(t, {}).get(b))
        return f"{c:.1f}" if isinstance(c, float) else str(c)
    best, batches = sweep["best"], list(res[""])
    print("decode attention alone, us a layer: engine default " + ", ".join(f"b{b} {cell('', b)}" for b in batches)
          + f"; pick {best or '(default)'!r} " + ", ".join(f"b{b} {cell(best, b)}" for b in batches))
except Exception as e:
    print("no sweep result:", e)
try:
    rows = json.loads((out / "tp" / "throughput.json").read_text())
    print("| run | output tok/s | x TRT-LLM 27,911 | TTFT ms | step ms | replay ms | digest |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tree']} | {r['output_tok_s']:,.0f} | {r['output_tok_s'] / 27911:.3f} | {r['ttft_ms']:.0f} | "
              f"{r['decode_step_ms']:.2f} | {r['replay_ms']:.2f} | {r['digest'][:8]} |")
except Exception as e:
    print("no end-to-end result:", e)
PY
stage "done after $SECONDS s"
} 2>&1 | tee "$OUT/llm7.log"
