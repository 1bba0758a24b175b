#!/usr/bin/env bash
# Device call for issue 15 (helper llm7b, session 14, 2026-12-04), <= 100 s, one call, no carry: the GPU tests that
# did not pass or did not run in llm7's call (main 0db8933, /work/.device/4/llm7.log), nothing else.
# 1. (timeout 50 s) the paged decode kernels' batch invariance on the GPU, TRITON_INTERPRET=0: the packed kernel's
#    test that FAILED (request 1: 70 keys, 5 splits merged; alone = in the batch = in a grid for 4096 keys; fp32), the
#    split kernel's (rows of one split and of 5 merged), and the packed kernel at Llama-3-8B heads on an FP8 cache
#    at 6 launches (against the reference; a row alone = in the batch; rows of 257 / 700 keys merged in a grid for
#    4096 keys = in 1024's). The merge now adds splits one at a time in split order (its tl.sum's layout had
#    followed the grid's split count).
# 2. (timeout 38 s) the flash engine test (bf16 and FP8 caches, the session-13 bound), which has not run yet.
# -x off, failures with --tb=short. Each stage under its own timeout; the second runs whatever the first did.
set -u
. "$(dirname "$0")/device_env.sh" kiln-llm7b
# DRY=1 (PYTHON=...): the plumbing on a CPU machine (interpreter; the GPU-only tests skip); never on the device
PY=${PYTHON:-python3}; INTERP=0; [ "${DRY:-0}" = 1 ] && INTERP=1
{
stage "device, commit ${KILN_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo ?)}"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null
stage "1. decode kernels: batch / grid invariance (packed + split), packed at Llama-3-8B heads (timeout 50 s)"
TRITON_INTERPRET=$INTERP timeout 50 "$PY" -m pytest -v -rfE --tb=short -p no:cacheprovider -o addopts="" \
  tests/llm/test_paged_decode_packed.py tests/llm/test_paged_decode_kernel.py \
  -k "does_not_depend or llama3_8b_heads" 2>&1 \
  | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|skipped|^E |Error|\.py:[0-9]+" | sed 's/^tests\/llm\///' | tail -30
echo "(exit ${PIPESTATUS[0]}; 124 = timed out)"
stage "2. the flash engine test, bf16 and FP8 caches (timeout 38 s)"
TRITON_INTERPRET=$INTERP timeout 38 "$PY" -m pytest -v -rfE --tb=short -p no:cacheprovider -o addopts="" \
  tests/llm/test_flash_prefill.py -k "an_engine_with_flash_prefill" 2>&1 \
  | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|skipped|^E |Error|\.py:[0-9]+" | sed 's/^tests\/llm\///' | tail -20
echo "(exit ${PIPESTATUS[0]}; 124 = timed out)"
stage "done after $SECONDS s"
} 2>&1 | tee "$OUT/llm7b.log"
