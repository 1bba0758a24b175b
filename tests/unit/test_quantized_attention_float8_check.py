"""The builder's check of an E4M3 quantized attention (kiln/builder/accuracy.py QUANTIZED_ATTENTION_FLOAT8_SLACK,
issue 12) against what cuda.attention.quantized's arithmetic really does, without a GPU: the kernel's float32 steps
(kiln/kernels/cuda/triton/quantized_attention.py: exact q·k products summed, ·qk_scale, ·(1/s) rounded to E4M3,
online max and sum over 64-key blocks with exp2(x·log2 e), p = exp2(·)·(1/l), rounded, exact p·v sums) written in
torch, on the GPU test's BERT-base layer (tests/gpu/test_quantized_attention_cuda.py: 8 x 384, 12 heads).

On the H100 (2026-12-05) the kernel was 116 E4M3 steps off the op on 0.003% of outputs; this emulation, on the same
inputs' distribution, 121 steps on 0.0036%: the near-ties of the probabilities' rounding are the arithmetic's, not a
GPU conversion's. The interpreter's tests (tests/kernels, 120 rows) rarely meet one; this layer has 36,864 rows.
"""

from __future__ import annotations

import pytest
import torch

from kiln.builder.accuracy import (QUANTIZED_ATTENTION_FLOAT8_SHARE, QUANTIZED_ATTENTION_FLOAT8_SLACK,
                                   QUANTIZED_ATTENTION_STEPS, float8_ordinal, mismatch)
from kiln.ops.fused import attention
from kiln.ops.registry import OpContext

pytestmark = pytest.mark.slow

B, H, S, D = 8, 12, 384, 64
QUANT = {"q_quant": [0.0113, 0.0], "k_quant": [0.0121, 0.0], "v_quant": [0.0207, 0.0],
         "score_quant": [0.00817, 0.0, -448.0, 448.0], "prob_quant": [1 / 448 / 1.3, 0.0, -448.0, 448.0],
         "out_quant": [0.00163, 0.0, -448.0, 448.0], "float8_quant": 1}
LAYOUT = {"scale": 1.0, "nan_to_zero": 1, "q_num_heads": H, "kv_num_heads": H, "q_perm": [0, 2, 1, 3],
          "k_perm": [0, 2, 1, 3], "v_perm": [0, 2, 1, 3], "out_perm": [0, 2, 1, 3], "out_merge_heads": 1}
F32 = torch.float32


def _e4m3(x: torch.Tensor) -> torch.Tensor:
    """Saturated, nearest-even onto the E4M3 grid (torch's conversion: what qmath.round_to_e4m3 computes)."""
    return torch.clamp(x, -448, 448).to(torch.float8_e4m3fn).float()


def _kernel_arithmetic(q, k, v, mask, prob_rounding: bool = True, one_pass: bool = False) -> torch.Tensor:
    """The kernel's float32 steps in torch: [B, S, H·D] E4M3. one_pass: the one-pass kernel's (the scale over the
    score scale one multiplier, the row's max and sum at once, (1/l) times the probability scale's inverse)."""
    q8, k8, v8 = (x.float().unflatten(-1, (H, D)).permute(0, 2, 1, 3) for x in (q, k, v))
    f = lambda value: torch.tensor(value, dtype=F32)  # noqa: E731  a Python float as the kernel's fp32 argument
    log2e = f(1.4426950408889634)
    if one_pass:
        s = (q8.double() @ k8.double().transpose(-1, -2)).float() * f(1.0 * 0.0113 * 0.0121 / 0.00817)
        s = _e4m3(s) * f(0.00817) + mask.float()
        e = torch.exp2(s * log2e - (s.amax(-1) * log2e)[..., None])
        p = e * ((1.0 / e.sum(-1)) * f(448 * 1.3))[..., None]
        p = _e4m3(p) if prob_rounding else p
        o = (p.double() @ v8.double()).float() * f((1 / 448 / 1.3) * 0.0207)
        return _e4m3(o.permute(0, 2, 1, 3).flatten(-2) * f(1 / 0.00163)).to(torch.float8_e4m3fn)
    s = (q8.double() @ k8.double().transpose(-1, -2)).float() * f(1.0 * 0.0113 * 0.0121)  # exact products
    s = _e4m3(s * f(1 / 0.00817)) * f(0.00817) + mask.float()
    m = torch.full(s.shape[:-1], float("-inf"))
    l = torch.zeros(s.shape[:-1])  # noqa: E741
    for start in range(0, S, 64):  # pass 1: online max and sum
        block = s[..., start:start + 64]
        m_new = torch.maximum(m, block.amax(-1))
        l = l * torch.exp2((m - m_new) * log2e) + torch.exp2((block - m_new[..., None]) * log2e).sum(-1)  # noqa: E741
        m = m_new
    p = torch.exp2((s - m[..., None]) * log2e) * (1.0 / l)[..., None]  # pass 2
    p = _e4m3(p * f(448 * 1.3)) if prob_rounding else p * f(448 * 1.3)
    o = (p.double() @ v8.double()).float() * f((1 / 448 / 1.3) * 0.0207)
    return _e4m3(o.permute(0, 2, 1, 3).flatten(-2) * f(1 / 0.00163)).to(torch.float8_e4m3fn)


@pytest.mark.parametrize("one_pass", [False, True], ids=["two-pass", "one-pass"])
def test_probability_near_ties_need_the_float8_slack(one_pass):
    g = torch.Generator().manual_seed(0)  # the GPU test's inputs, drawn on the CPU
    q, k, v = ((torch.randn(B, S, H * D, generator=g) * 60).clamp(-448, 448).to(torch.float8_e4m3fn)
               for _ in range(3))
    lengths = torch.randint(S // 2, S + 1, (B, 1, 1, 1), generator=g)
    mask = torch.where(torch.arange(S) < lengths, 0.0, torch.finfo(torch.float16).min).half()
    with torch.inference_mode():
        want = attention(OpContext("attention", "Attention", domain="kiln"), q, k, v, mask, **LAYOUT, **QUANT)
        got = _kernel_arithmetic(q, k, v, mask, one_pass=one_pass)
        unrounded = _kernel_arithmetic(q, k, v, mask, prob_rounding=False, one_pass=one_pass)
    apart = (float8_ordinal(got) - float8_ordinal(want)).abs()
    # the old claim, QUANTIZED_ATTENTION_STEPS alone, fails here: a near-tie crosses zero or the small binades
    assert apart.max() > 10 * QUANTIZED_ATTENTION_STEPS
    assert mismatch(got, want, integer_steps=QUANTIZED_ATTENTION_STEPS, float8_slack=2.0**-10) is not None
    # the check the builder makes: within the slack, and rare
    allowance = {"integer_steps": QUANTIZED_ATTENTION_STEPS, "float8_slack": QUANTIZED_ATTENTION_FLOAT8_SLACK,
                 "float8_slack_share": QUANTIZED_ATTENTION_FLOAT8_SHARE}
    assert mismatch(got, want, **allowance) is None
    assert (apart > 0).float().mean() < 1e-4
    # it can fail: a kernel that forgets the probabilities' rounding stays within the slack (an average of the same
    # values) but is beyond two steps on 3.9% of the outputs, not on a few near-ties
    assert mismatch(unrounded, want, **allowance) is not None
    assert mismatch(unrounded, want, integer_steps=QUANTIZED_ATTENTION_STEPS,
                    float8_slack=QUANTIZED_ATTENTION_FLOAT8_SLACK) is None
