"""kiln's flash-attention kernel with E4M3 products (Float8Scales) against float64 torch (interpreter, small shapes).

Two references. `exact`: softmax(q·kᵀ·scale + mask)·v on the dequantized inputs (x8·s), nothing else rounded.
`rounded_like_the_kernel`: the same with the probabilities rounded as the kernel rounds them when it sees every
key in one block (its running maximum is then the row's maximum): p' = 448·exp(s - max) on the E4M3 grid,
divided by the sum of the unrounded p'.

Tolerances. Against `rounded_like_the_kernel` (one key block) only fp32 arithmetic and the output's own rounding
differ: 2e-3 of max |v| (fp16 output), one E4M3 step (E4M3 output). Against `exact`, each p carries a relative
rounding error of at most 2^-4 (half an E4M3 spacing, 3 mantissa bits), so |out - exact| <= 2^-4·max|v|: the
bound, not an estimate (what a flash kernel's running maximum changes is where each p rounds, not how far).
A kernel that skips the 448 (p <= 1 on the grid) passes neither tight check: its p below 2^-6 lose bits.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kiln.builder.accuracy import float8_ordinal  # noqa: E402
from kiln.kernels.cuda.triton.attention import (  # noqa: E402
    FP8_DTYPE,
    P_SCALE,
    AttentionConfig,
    Float8Scales,
    flash_attention,
)

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter evaluates masked-off lanes

SMALL = AttentionConfig(32, 16)  # several query and key blocks at interpreter sizes
ONE_KEY_BLOCK = AttentionConfig(16, 64)  # every key of T <= 64 in one block: the running maximum is the final one
P_ROUNDING = 2.0 ** -4  # half an E4M3 spacing, relative


def quantized(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale on the E4M3 grid, saturating (torch's conversion makes NaN of what lies beyond ±448)."""
    return (x / scale).clamp(-448, 448).to(FP8_DTYPE)


def inputs(b, h, s, t, d, *, seed, scales=(0.02, 0.03, 0.015)):
    """E4M3 q, k, v drawn around what a calibrated BERT layer holds (|x|/s up to ~200) and their scales."""
    torch.manual_seed(seed)
    fp8 = Float8Scales(*scales)
    q, k, v = (quantized(torch.randn(b, h, n, d) * 1.5, sc) for n, sc in ((s, fp8.q), (t, fp8.k), (t, fp8.v)))
    return q, k, v, fp8


def scores(q, k, fp8, scale, mask=None):
    s = (q.double() * fp8.q) @ (k.double() * fp8.k).transpose(-1, -2) * scale  # s: [B, H, S, T]
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.double()
    return s


def exact(q, k, v, fp8, scale, mask=None):
    return torch.softmax(scores(q, k, fp8, scale, mask), -1).nan_to_num(0.0) @ (v.double() * fp8.v)


def rounded_like_the_kernel(q, k, v, fp8, scale, mask=None):
    s = scores(q, k, fp8, scale, mask)
    p = torch.exp(s - s.amax(-1, keepdim=True)) / P_SCALE  # p' <= 448
    p8 = p.float().to(FP8_DTYPE).double()
    return (p8 @ (v.double() * fp8.v)) / p.sum(-1, keepdim=True)


def close(out, expected, atol):
    error = (out.double() - expected).abs().max().item()
    assert error <= atol, f"max error {error:.3g} > {atol:.3g}"


# Near-ties: where a p' lies within fp32's noise (the GPU's exp2.approx, ~1e-6 relative) of an E4M3 rounding
# midpoint, the kernel and the float64 reference round it to neighbouring grid values, which moves that row's
# outputs by one step of one p (at most 2^-3·p'·|v| / l: ~0.1 at these scales). They stay rare, where a kernel that
# rounds p another way is off almost everywhere. On the GPU the E4M3 q·kᵀ itself is not fp32 (Hopper's wgmma
# accumulates with ~13 mantissa bits), which moves far more p' across midpoints: tests/gpu/test_fp8_attention.py
# compares the rounding on scores that any accumulation gets exact.
TIE_SHARE = 2e-3


def close_but_for_ties(out, expected, atol, v_max):
    """Within atol but for at most TIE_SHARE of the outputs, those within one p step (2^-3·v_max)."""
    error = (out.double() - expected).abs()
    off = error > atol
    assert off.double().mean().item() <= TIE_SHARE, f"{off.double().mean().item():.2%} of outputs off by > {atol:.3g}"
    assert error.max().item() <= 2.0 ** -3 * v_max, f"max error {error.max().item():.3g} > one p step"


@pytest.mark.parametrize("d", [32, 64])
def test_one_key_block_matches_the_kernels_rounding(d):
    q, k, v, fp8 = inputs(2, 2, 37, 45, d, seed=0)
    out = flash_attention(q, k, v, scale=d ** -0.5, config=ONE_KEY_BLOCK, fp8=fp8)
    assert out.dtype == torch.float16 and out.shape == (2, 2, 37, d)
    v_max = (v.float() * fp8.v).abs().max().item()
    close_but_for_ties(out, rounded_like_the_kernel(q, k, v, fp8, d ** -0.5), 2e-3 * v_max, v_max)
    assert (out.double() - exact(q, k, v, fp8, d ** -0.5)).abs().max() > 1e-3 * v_max  # P really is rounded


def test_many_key_blocks_within_the_rounding_bound():
    q, k, v, fp8 = inputs(2, 3, 50, 61, 32, seed=1)
    out = flash_attention(q, k, v, scale=0.2, config=SMALL, fp8=fp8)
    v_max = (v.float() * fp8.v).abs().max().item()
    close(out, exact(q, k, v, fp8, 0.2), (P_ROUNDING + 2e-3) * v_max)


def test_half_inputs_are_quantized_as_they_are_loaded():
    """fp16 q, k, v with scales give what their E4M3 values give (the kernel rounds x·(1/s), torch x/s: equal here,
    the scales being powers of two)."""
    torch.manual_seed(2)
    fp8 = Float8Scales(2.0 ** -6, 2.0 ** -5, 2.0 ** -7)
    q, k, v = (torch.randn(2, 2, 33, 32).half() for _ in range(3))
    out = flash_attention(q, k, v, scale=0.25, config=SMALL, fp8=fp8)
    q8, k8, v8 = quantized(q.float(), fp8.q), quantized(k.float(), fp8.k), quantized(v.float(), fp8.v)
    assert torch.equal(out, flash_attention(q8, k8, v8, scale=0.25, config=SMALL, fp8=fp8))


def test_qk_alone_in_e4m3_keeps_p_v_in_fp16():
    """Float8Scales.pv False: q and k on the E4M3 grid, v as given (fp16), the probabilities fp16: the exact attention
    of the rounded q and k within the fp16 kernel's tolerance (tests/kernels/test_attention.py: 2e-3)."""
    q, k, _, fp8 = inputs(2, 2, 37, 45, 32, seed=7)
    v = (torch.randn(2, 2, 45, 32) * 2).half()
    out = flash_attention(q, k, v, scale=0.2, config=SMALL, fp8=Float8Scales(fp8.q, fp8.k, 1.0, pv=False))
    assert out.dtype == torch.float16
    unit_v = Float8Scales(fp8.q, fp8.k, 1.0)
    expected = exact(q, k, v, unit_v, 0.2)
    close(out, expected, 2e-3 * (1 + expected.abs().max().item()))
    with pytest.raises(TypeError, match="float16 or bfloat16 v"):
        flash_attention(q, k, quantized(v.float(), 0.02), fp8=Float8Scales(fp8.q, fp8.k, 0.02, pv=False))


def test_key_lengths_and_a_padding_mask():
    """Rows with a length read keys 0..n-1 only (their mask is NaN on purpose); -1 takes the additive mask."""
    q, k, v, fp8 = inputs(4, 2, 29, 40, 32, seed=3)
    lengths = torch.tensor([0, 17, 40, -1], dtype=torch.int32)
    mask = torch.full((4, 1, 1, 40), float("nan"))
    mask[3] = torch.where(torch.rand(1, 1, 40) < 0.4, -10000.0, 0.0)
    out = flash_attention(q, k, v, mask, lengths, scale=0.2, config=SMALL, fp8=fp8)
    keep = torch.arange(40) < lengths.clamp(min=0).reshape(-1, 1, 1, 1)  # [B, 1, 1, T]
    expected = exact(q, k, v, fp8, 0.2, keep)
    expected[3] = exact(q[3:], k[3:], v[3:], fp8, 0.2, mask[3:])[0]
    v_max = (v.float() * fp8.v).abs().max().item()
    close(out, expected, (P_ROUNDING + 2e-3) * v_max)
    assert torch.equal(out[0], torch.zeros_like(out[0]))  # length 0: every key hidden


def test_e4m3_output_at_its_scale():
    q, k, v, fp8 = inputs(2, 2, 37, 45, 32, seed=4)
    fp8_out = Float8Scales(fp8.q, fp8.k, fp8.v, out=0.004)
    out = flash_attention(q, k, v, scale=0.2, config=ONE_KEY_BLOCK, fp8=fp8_out)
    assert out.dtype == FP8_DTYPE
    expected = (rounded_like_the_kernel(q, k, v, fp8, 0.2) / fp8_out.out).float().to(FP8_DTYPE)
    assert int((float8_ordinal(out) - float8_ordinal(expected)).abs().max()) <= 1  # fp32 row scaling vs float64


def test_strided_qkv_slices_and_output_view():
    """q, k, v as column slices of one E4M3 [B, S, 3·H·D] QKV output; out written into a [B, S, H, D] buffer."""
    torch.manual_seed(5)
    b, s, h, d = 2, 27, 3, 32
    fp8 = Float8Scales(0.02, 0.02, 0.02)
    qkv = quantized(torch.randn(b, s, 3 * h * d), 0.02)
    q, k, v = (t.unflatten(-1, (h, d)).permute(0, 2, 1, 3) for t in qkv.split(h * d, dim=-1))
    buffer = torch.empty(b, s, h, d, dtype=torch.float16)
    flash_attention(q, k, v, scale=0.2, out=buffer.permute(0, 2, 1, 3), config=ONE_KEY_BLOCK, fp8=fp8)
    close(buffer.permute(0, 2, 1, 3), rounded_like_the_kernel(q, k, v, fp8, 0.2), 2e-3 * 0.02 * 448)


def test_bad_inputs_name_what_is_wrong():
    q, k, v, fp8 = inputs(1, 1, 8, 8, 16, seed=6)
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        flash_attention(q, k, v)  # E4M3 without scales
    with pytest.raises(ValueError, match="positive and finite"):
        Float8Scales(0.1, 0.0, 0.1)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        flash_attention(q, k, v, fp8=Float8Scales(0.1, 0.1, 0.1, out=0.1), out=torch.empty(1, 1, 8, 16).half())
