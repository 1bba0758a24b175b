#!/usr/bin/env bash
# Device call (2026-12-02, second session): the LLM decode changes (per-request split length, argmax kernel)
# and the Wav2Vec2 tactics (cuda.conv1d.unfold_bmm, cuda.instance_norm.group_norm), checked then timed.
set -u
. "$(dirname "$0")/device_env.sh" kiln-llm2
{
stage "LLM kernels compiled on the device"
TRITON_INTERPRET=0 timeout 100 python3 -m pytest -q -p no:cacheprovider -n 0 -o addopts="" -rfE \
  tests/llm/test_fused_kernels.py tests/llm/test_paged_decode_kernel.py 2>&1 | tail -4
TRITON_INTERPRET=0 timeout 100 python3 -m pytest -q -p no:cacheprovider -n 0 -m gpu -o addopts="" -rfE \
  tests/llm/test_gpu.py tests/llm/test_gpu_graphs.py 2>&1 | tail -4
stage "decode step kernel by kernel"
timeout 100 python3 bench/llm_profile.py --top 12 2>&1 | grep -v Warn | tail -15
stage "Wav2Vec2 tactics, then the zoo row"
timeout 100 python3 -m pytest tests/gpu/test_cuda_tactics.py -q -s -p no:cacheprovider -k "Wav2Vec2" 2>&1 \
  | grep -E "^\[tactics\]|^  (cuda|default)|passed|failed" | head -20
MODELS=wav2vec2_base MODES=reduce-overhead timeout 150 bash bench/gpu_zoo.sh 2>&1 | grep "x the fastest\|FAILED"
stage "llm bench batch 1, 8"
timeout 120 python3 bench/llm.py --preset llama3-8b --dtype bfloat16 --batch 1 8 --input-len 128 --output-len 128 \
  --no-transformers --eager-batch --no-write 2>&1 | grep "^|" | tail -4
stage done
} 2>&1 | tee "$OUT/llm2.log"
