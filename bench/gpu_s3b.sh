#!/usr/bin/env bash
# Device call 2 of 2026-12-02 (third session): the helper's decode GEMV sweep (snap-gemv/, branch h-gemv's
# HEAD, untracked here), the LLM decode with the GEMV choice on (auto) vs cuBLAS, and the host share of a
# profiled CUDA engine's call (bench/dynamic_overhead.py, main). Carry [".whl"]. Logs in $OUT.
set -u
. "$(dirname "$0")/device_env.sh" kiln-s3b
ROOT=$PWD
{
stage "decode GEMV sweep (h-gemv $(cat snap-gemv/COMMIT))"
( cd snap-gemv && KILN_COMMIT=$(cat COMMIT) OUT=$OUT timeout 260 python3 bench/gemv.py --budget 170 2>&1 | tail -70 )
stage "LLM decode llama3-8b bf16 batch 1 8: gemv auto vs cublas (h-gemv)"
for mode in auto cublas; do
  ( cd snap-gemv && KILN_LLM_GEMV=$mode timeout 100 python3 bench/llm.py --preset llama3-8b --dtype bfloat16 --batch 1 8 \
      --input-len 128 --output-len 128 --no-transformers --eager-batch --no-write 2>&1 | grep "^| kiln\|rror" | tail -3 | sed "s/^/$mode /" )
done
( cd snap-gemv && KILN_LLM_GEMV=auto timeout 80 python3 bench/llm.py --preset llama3-8b --dtype bfloat16 --batch 1 \
    --input-len 128 --output-len 128 --no-transformers --eager-batch --quantization fp8 --no-write 2>&1 | grep "^| kiln\|rror" | tail -3 | sed "s/^/fp8 auto /" )
stage "host share of a profiled engine's call (main)"
KILN_COMMIT=$(git rev-parse --short HEAD) timeout 120 python3 bench/dynamic_overhead.py --out "$OUT" 2>&1 | tail -60
stage done
} 2>&1 | tee "$OUT/s3b.log"
