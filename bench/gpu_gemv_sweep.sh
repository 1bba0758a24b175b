#!/usr/bin/env bash
# Device call (issue 15): bench/gemv_sweep.py — the bf16 decode GEMV variants (prefetch, cache hints, PDL, split-K,
# rows per program, warps) at Llama-3-8B's shapes with the copy ceiling, then the decode step with the engine
# choosing among the sweep's shortlist (and today's, A/B). Under 240 s.
set -u
. "$(dirname "$0")/device_env.sh" kiln-gemv-sweep
{
stage "gemv sweep + end to end"
timeout 235 python3 bench/gemv_sweep.py "$@" 2>&1 | grep -v -i "warn"
stage done
} 2>&1 | tee "$OUT/sweep_stdout.log"
