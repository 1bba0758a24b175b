"""Decoders exported with symbolic batch x sequence on CUDA (issue 10): since session 31 their grouped-query attention
and rotary fuse (kiln::Attention with gqa on the packed q|k|v, one packed kiln::Rotary per layer:
tests/unit/test_decoder_attention_dynamic.py checks it on the CPU). Here the same engines built for CUDA in fp16, run at
fresh random shapes inside the profile, against onnxruntime's fp32 logits on the same file."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kiln
from kiln import zoo

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
ort = pytest.importorskip("onnxruntime")


def assert_fp16_matches_onnxruntime(name: str, shapes: list[tuple[int, int]], seed: int) -> kiln.Engine:
    """`name` exported with symbolic batch x sequence, built for CUDA fp16 in the profile 1x1,2x8,4x16, run at
    `shapes` (fresh random ids; a mask of ones and positions 0.. where the export has them) against onnxruntime's
    fp32 logits on the same file: the engine."""
    exported = zoo.export(name, batch=2, seq=8, dynamic=True)
    engine = kiln.build(str(exported.path), device="cuda", precision="fp16",
                        profiles=[{"input_ids": "1x1,2x8,4x16"}])
    session = ort.InferenceSession(str(exported.path), providers=["CPUExecutionProvider"])
    context = engine.create_execution_context()
    rng = np.random.default_rng(seed)
    for batch, seq in shapes:
        feeds = {"input_ids": rng.integers(0, 1000, (batch, seq), dtype=np.int64)}
        for extra in session.get_inputs()[1:]:  # an attention mask or positions, where the export has them
            feeds[extra.name] = (np.ones((batch, seq), dtype=np.int64) if "mask" in extra.name
                                 else np.arange(seq, dtype=np.int64)[None].repeat(batch, 0))
        want = session.run(None, feeds)[0]
        got = context.run(feeds)
        got = got[next(iter(got))]
        assert got.shape == want.shape
        scale = float(np.abs(want).max())  # random weights: small logits, so relative to their largest
        err = float(np.abs(got.astype(np.float64) - want).max()) / scale
        print(f"{name} {batch}x{seq}: fp16 error {err:.1e}")
        assert err < 3e-2, (name, batch, seq, err)  # fp16 weights and activations against fp32
    return engine


@pytest.mark.parametrize("name", ["llama_tiny", "qwen2_tiny", "mistral_tiny", "phi3_tiny"])
def test_dynamic_decoder_fp16_against_onnxruntime(name):
    engine = assert_fp16_matches_onnxruntime(name, [(1, 1), (2, 8), (4, 16), (3, 5), (1, 13), (4, 2)], seed=31)
    steps = engine.plan.program.steps
    attentions = [s.tactic for s in steps if s.op_type == "Attention"]
    assert len(attentions) == 2, [s.op_type for s in steps]
    print(f"{name}: attention {attentions[0]}")


def test_dynamic_gpt2_fp16_against_onnxruntime():
    """GPT-2 exported with symbolic batch x sequence (session 31's fuse_gemm flatten of its Conv1D GEMMs) built for
    CUDA fp16 inside a profile, at fresh shapes, against onnxruntime's fp32 logits."""
    assert_fp16_matches_onnxruntime("gpt2_tiny", [(1, 1), (2, 8), (4, 16), (3, 5), (1, 13)], seed=33)
