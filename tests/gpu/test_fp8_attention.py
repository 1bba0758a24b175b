"""kiln's flash attention with E4M3 products on the GPU (`pytest tests/gpu/test_fp8_attention.py -q`), where the fp8
conversions are the hardware's (cvt.rn.satfinite) rather than the interpreter tests' arithmetic rounding: the
references and tolerances of tests/kernels/test_attention_fp8.py, at BERT-base's layer (12 heads, d 64, q/k/v
column slices of one QKV output, key lengths) on every tile config. Skipped without CUDA; run alone (not with
tests/kernels, whose conftest sets TRITON_INTERPRET=1).
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") != "0",
                       reason="TRITON_INTERPRET is set (tests/kernels ran in this session): run tests/gpu alone"),
]
attention_kernels = pytest.importorskip("kiln.kernels.cuda.triton.attention", exc_type=ImportError)

from kiln.builder.accuracy import float8_ordinal  # noqa: E402
from kiln.kernels.cuda.triton.attention import ATTENTION_CONFIGS, FP8_DTYPE, Float8Scales, flash_attention  # noqa: E402
from tests.kernels.test_attention_fp8 import (  # noqa: E402
    P_ROUNDING,
    TIE_SHARE,
    close,
    close_but_for_ties,
    exact,
    quantized,
    rounded_like_the_kernel,
    scores,
)

DEVICE = torch.device("cuda")
HEADS, HEAD_DIM = 12, 64


def bert_layer(batch: int, seq: int, seed: int):
    """E4M3 q/k/v as [B, H, S, D] views of one [B, S, 3·768] E4M3 QKV output, their scales, key lengths."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    fp8 = Float8Scales(0.02, 0.02, 0.01)
    width = HEADS * HEAD_DIM
    qkv = torch.cat([quantized(torch.randn(batch, seq, width, device=DEVICE, generator=g) * 1.6, s)
                     for s in (fp8.q, fp8.k, fp8.v)], -1)
    q, k, v = (t.unflatten(-1, (HEADS, HEAD_DIM)).permute(0, 2, 1, 3) for t in qkv.split(width, -1))
    lengths = torch.randint(seq // 2, seq + 1, (batch,), device=DEVICE, generator=g, dtype=torch.int32)
    return q, k, v, fp8, lengths


@pytest.mark.parametrize("config", ATTENTION_CONFIGS, ids=lambda c: c.name)
def test_bert_layer_within_the_rounding_bound(config):
    q, k, v, fp8, lengths = bert_layer(8, 384, seed=0)
    keep = torch.arange(384, device=DEVICE) < lengths.view(-1, 1, 1, 1)  # [B, 1, 1, T]
    mask = torch.where(keep, 0.0, -10000.0).half()
    out = torch.empty(8, 384, HEADS, HEAD_DIM, dtype=torch.float16, device=DEVICE)
    flash_attention(q, k, v, mask, lengths, scale=0.125, out=out.permute(0, 2, 1, 3), config=config, fp8=fp8)
    v_max = (v.float() * fp8.v).abs().max().item()
    close(out.permute(0, 2, 1, 3), exact(q, k, v, fp8, 0.125, keep), (P_ROUNDING + 2e-3) * v_max)
    # fp16 q/k/v quantized as loaded: the same bytes in, the same result out
    half = [t.float() * s for t, s in zip((q, k, v), (fp8.q, fp8.k, fp8.v))]
    again = flash_attention(*(t.half() for t in half), mask, lengths, scale=0.125, config=config, fp8=fp8)
    assert torch.equal(again, out.permute(0, 2, 1, 3))


@pytest.mark.parametrize("config", ATTENTION_CONFIGS, ids=lambda c: c.name)
def test_qk_alone_in_e4m3_on_bert_layer(config):
    """fp16 q/k/v, q·kᵀ in E4M3, p·v in fp16 (cuda.attention.triton_fp8qk): the exact attention of the rounded q and
    k within the fp16 kernel's tolerance."""
    q8, k8, _, fp8, lengths = bert_layer(8, 384, seed=2)
    q, k = (t.float() * s for t, s in ((q8, fp8.q), (k8, fp8.k)))
    v = torch.randn(8, HEADS, 384, HEAD_DIM, device=DEVICE).half()
    keep = torch.arange(384, device=DEVICE) < lengths.view(-1, 1, 1, 1)
    out = flash_attention(q.half(), k.half(), v, None, lengths, scale=0.125, config=config,
                          fp8=Float8Scales(fp8.q, fp8.k, 1.0, pv=False))
    expected = exact(q8, k8, v, Float8Scales(fp8.q, fp8.k, 1.0), 0.125, keep)
    close(out, expected, 2e-3 * (1 + expected.abs().max().item()))


# Hopper's E4M3 q·kᵀ is not fp32 arithmetic: its wgmma accumulates with about 13 mantissa bits (DeepSeek-V3's report
# of the H800; cuBLASLt's FP8 GEMM with and without fast accumulation alike). Measured on the H200, 2026-12-04
# (bench/results/fp8-bert-2026-12-04c.md): on bert_layer's one head |q·k - exact| reached 1.7e-4 of Σ|q_i·k_i|
# (33.5 in x8 units, scores to 1.9e5), so a p' near an E4M3 midpoint rounds to the neighbouring grid value: 1.9% of
# the rows of bert_layer(4, 64) moved by one p step on every tile (0.49% of the outputs), where the fp32 noise of
# exp2 alone explains ~0.1%. The kernel is right; the old test's claim (near ties at fp32's noise only) was not. The
# exact claim is tested on scores that any accumulation gets exact; bert_layer's rows within a share (below).
ACCUMULATED_ROW_SHARE = 0.05  # 1.9% measured; a kernel rounding p another way (no 448, p <= 1) is off in most rows


def integer_scores_layer(batch: int, seq: int, seed: int):
    """bert_layer's v with q and k small integers (|x8| <= 8, E4M3 exactly) at scale 1/4: every partial sum of q·k is
    an integer below 2^12 in magnitude, exact with 13 mantissa bits, so the scores are the reference's (up to fp32's
    rounding of the scale) and only the probabilities' rounding is left to compare. Scores ~N(0, 1.5²)."""
    q, k, v, fp8, _ = bert_layer(batch, seq, seed)
    g = torch.Generator(device=DEVICE).manual_seed(seed + 100)
    qi, ki = (torch.randint(-8, 9, t.shape, device=DEVICE, generator=g).float().to(FP8_DTYPE) for t in (q, k))
    return qi, ki, v, Float8Scales(0.25, 0.25, fp8.v)


def rows_off(out: torch.Tensor, expected: torch.Tensor, atol: float) -> float:
    return ((out.double() - expected).abs() > atol).any(-1).double().mean().item()


@pytest.mark.parametrize("config", [c for c in ATTENTION_CONFIGS if c.block_n >= 64], ids=lambda c: c.name)
def test_one_key_block_rounds_p_as_the_reference_on_the_hardware(config):
    """64 keys, one block, exact scores: the hardware's E4M3 rounding of p' against torch's (but for fp32 near-ties:
    TIE_SHARE); E4M3 outputs within one step but for those."""
    q, k, v, fp8 = integer_scores_layer(4, 64, seed=1)
    out = flash_attention(q, k, v, scale=0.125, config=config, fp8=fp8)
    v_max = (v.float() * fp8.v).abs().max().item()
    expected = rounded_like_the_kernel(q, k, v, fp8, 0.125)
    close_but_for_ties(out, expected, 2e-3 * v_max, v_max)
    fp8_out = Float8Scales(fp8.q, fp8.k, fp8.v, out=v_max / 448)
    out8 = flash_attention(q, k, v, scale=0.125, config=config, fp8=fp8_out)
    want = (expected / fp8_out.out).float().to(FP8_DTYPE)
    steps = (float8_ordinal(out8) - float8_ordinal(want)).abs()
    assert (steps > 1).double().mean().item() <= TIE_SHARE, f"{(steps > 1).double().mean().item():.2%} > 1 step"
    # the test can fail: probabilities rounded without the 448 (p <= 1 on the grid) are off in most rows
    unscaled = torch.softmax(scores(q, k, fp8, 0.125), -1).float().to(FP8_DTYPE).double() @ (v.double() * fp8.v)
    assert rows_off(unscaled, expected, 2e-3 * v_max) > 0.5


@pytest.mark.parametrize("config", [c for c in ATTENTION_CONFIGS if c.block_n >= 64], ids=lambda c: c.name)
def test_one_key_block_on_bert_scores_off_in_few_rows(config):
    """bert_layer's E4M3 q and k (scores to ~1.9e5 in x8 units): the rows whose p' the hardware's accumulation moved
    across an E4M3 midpoint stay few (ACCUMULATED_ROW_SHARE), each within one p step."""
    q, k, v, fp8, _ = bert_layer(4, 64, seed=1)
    out = flash_attention(q, k, v, scale=0.125, config=config, fp8=fp8)
    v_max = (v.float() * fp8.v).abs().max().item()
    expected = rounded_like_the_kernel(q, k, v, fp8, 0.125)
    share = rows_off(out, expected, 2e-3 * v_max)
    assert share <= ACCUMULATED_ROW_SHARE, f"{share:.2%} of rows off by > {2e-3 * v_max:.3g}"
    error = (out.double() - expected).abs().max().item()
    assert error <= 2.0 ** -3 * v_max, f"max error {error:.3g} > one p step"
