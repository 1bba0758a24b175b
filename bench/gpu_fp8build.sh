#!/usr/bin/env bash
# fp8build (issue 12, session 15): ResNet-50 batch 256 FP8 and INT8 engines at opt level 3, whose FP8 build ran past
# its 125 s cap on 2026-12-04 (bench/results/gpu-checks-2026-12-04d.md), now with the candidates' Triton kernels
# compiled in worker processes while the search runs (kiln/builder/precompile.py) and FP8's 64-wide K tiles left out
# of layers of >= 256 input channels (bench/results/fp8-build-2026-12-05.md).
#   bash bench/gpu_fp8build.sh      (1) kiln FP8 and INT8 at opt 3 (onnxruntime QDQ models, as bench/quant_gpu.py
#                                   makes them), each build in a fresh Triton cache (every kernel compiled);
#                                   (2) kiln fp16 at opt 2 (the engine the 8-bit ones are judged against);
#                                   prints per row: build s (kiln.build alone, in parentheses), the kernels compiled in
#                                   workers, ms per batch, top-1 vs fp32 and vs onnxruntime; then ms vs fp16.
# WORKERS=0 repeats (1) as before this change (each kernel compiled on its first launch). No carry. <= ~295 s (row caps 110 + 110 + 55 s).
set -u
. "$(dirname "$0")/device_env.sh" kiln-fp8build
{
stage "GPU, commit ${KILN_COMMIT:-?}, $(nproc) CPUs"; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
stage "resnet50_b256 kiln_fp8, kiln_int8 at opt 3 (fresh Triton cache, compile workers: ${WORKERS:-default})"
TRITON_CACHE_DIR="$OUT/triton-opt3" KILN_COMPILE_WORKERS="${WORKERS:-}" timeout 225 python3 bench/quant_gpu.py \
  --sections engines --engines resnet50_b256 --modes kiln_fp8,kiln_int8 --opt-level 3 --row-timeout 110 \
  --out "$OUT/opt3" 2>&1 | grep "^| resnet50\|^| workload\|^resnet50_b256 " | cut -c1-400
stage "resnet50_b256 kiln_fp16 at opt 2"
timeout 60 python3 bench/quant_gpu.py --sections engines --engines resnet50_b256 --modes kiln_fp16 --opt-level 2 \
  --row-timeout 55 --out "$OUT/fp16" 2>&1 | grep "^| resnet50\|^| workload" | cut -c1-300
stage "summary"
python3 - "$OUT" <<'EOF'
import ast, sys
rows = [ast.literal_eval(line.split(": ", 1)[1].rsplit(" (", 1)[0])  # "key mode: {row} (N s)"
        for part in ("opt3", "fp16") for line in open(f"{sys.argv[1]}/{part}/quant_gpu.log")
        if line.startswith("resnet50_b256 ")]
fp16 = next((r["ms"] for r in rows if r["mode"] == "kiln_fp16" and "ms" in r), None)
print("| mode | build s (kiln.build) | kernels in workers | ms / batch | vs kiln fp16 | top-1 |")
print("|---|---|---|---|---|---|")
for r in rows:
    if "ms" not in r:
        print(f"| {r['mode']} | failed: {r.get('error', '?')} |||||")
        continue
    ratio = f"{fp16 / r['ms']:.2f}x" if fp16 else "-"
    print(f"| {r['mode']} | {r['build_s']:.0f} ({r.get('kiln_build_s', 0):.0f}) | {r.get('compile')} | {r['ms']:.2f} "
          f"| {ratio} | {r['accuracy']}; {r.get('vs_onnxruntime', '')} |")
EOF
stage done
} 2>&1 | tee "$OUT/fp8build.log"
