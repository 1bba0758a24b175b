"""kiln's quantized Triton kernels under the interpreter (kiln/kernels/cuda/triton/q*.py): the rounding of
the requantizing epilogue bit for bit against torch (round half to even, saturation, the E4M3 grid with
its ties, subnormals and signed zero), exact ties through a whole GEMM, the elementwise kernels'
layouts, and the errors each kernel raises for a wrong call. The tactics built on them are judged
against the ops' reference in test_qtactics.py.
"""

from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kiln.kernels.cuda.triton import qmath  # noqa: E402
from kiln.kernels.cuda.triton.qconv import QConvConfig, pack_weight, qconv2d  # noqa: E402
from kiln.kernels.cuda.triton.qelementwise import dequantize, qadd, requantize  # noqa: E402
from kiln.kernels.cuda.triton.qgemm import Epilogue, QGemmConfig, fold_zero_point, qgemm  # noqa: E402
from kiln.kernels.cuda.triton.qresidual import ResidualAdd  # noqa: E402
from kiln.tactics.cuda.quant_residual_check import residual_steps  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter evaluates masked-off lanes

FP8 = torch.float8_e4m3fn
SMALL = QGemmConfig(16, 16, 32, group_m=2)  # several row, column and K tiles at interpreter sizes


@triton.jit
def _round_kernel(x_ptr, fp8_ptr, int_ptr, u8_ptr, n, y_scale, y_zero, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    tl.store(fp8_ptr + offs, qmath.requantize(x, y_scale, 0.0, 0.0, 0.0, "", 2, 0, 0).to(tl.float8e4nv), mask=mask)
    tl.store(int_ptr + offs, qmath.requantize(x, y_scale, y_zero, 0.0, 0.0, "", 1, -128, 127).to(tl.int8), mask=mask)
    tl.store(u8_ptr + offs, qmath.requantize(x, y_scale, 128.0 + y_zero, 0.0, 0.0, "Relu", 1, 0, 255).to(tl.uint8),
             mask=mask)


def _rounded(x: torch.Tensor, y_scale: float, y_zero: float):
    out = [torch.empty(x.numel(), dtype=d) for d in (FP8, torch.int8, torch.uint8)]
    _round_kernel[(triton.cdiv(x.numel(), 256),)](x, *out, x.numel(), y_scale, y_zero, BLOCK=256)
    return out


def _fp8_values() -> torch.Tensor:
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8).float()
    return codes[~torch.isnan(codes)].unique()


def test_fp8_rounding_is_torchs_bit_for_bit():
    """Every E4M3 value, every midpoint between neighbours (ties to even), just beside them, past ±448
    (saturated), subnormals and -0.0: the same code as torch's float32 -> float8e4m3fn conversion."""
    grid = _fp8_values()
    mids = (grid[1:] + grid[:-1]) / 2
    nudged = torch.cat([mids * (1 + 2.0**-20), mids * (1 - 2.0**-20)])
    x = torch.cat([grid, mids, nudged, torch.tensor([-0.0, 449.0, 464.0, 1e6, -1e6, 2.0**-10, -(2.0**-11), 1e-30])])
    fp8, _, _ = _rounded(x, 1.0, 0.0)
    want = x.clamp(-448.0, 448.0).to(FP8)
    assert torch.equal(fp8.view(torch.uint8), want.view(torch.uint8))
    scaled, _, _ = _rounded(x * 0.375, 0.375, 0.0)  # r / y_scale: an IEEE division, as the reference's
    assert torch.equal(scaled.view(torch.uint8), (x * 0.375 / 0.375).clamp(-448.0, 448.0).to(FP8).view(torch.uint8))


def test_integer_rounding_is_half_to_even_and_saturates():
    x = torch.cat([torch.arange(-140, 140) + 0.5, torch.arange(-140, 140) + 0.49999997, torch.randn(1000) * 90,
                   torch.tensor([1e9, -1e9, -0.5, 0.5, 1.5, 2.5])])
    _, q, u = _rounded(x, 1.0, -3.0)
    assert torch.equal(q, (torch.round(x) - 3).clamp(-128, 127).to(torch.int8))
    assert torch.equal(u, (torch.round(x.relu()) + 125).clamp(0, 255).to(torch.uint8))  # Relu before rounding


def test_gemm_epilogue_rounds_exact_ties_to_even():
    """Power-of-two scales make r / y_scale land exactly on .5 for every odd sum: all must go to even."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(-128, 128, (40, 96), generator=gen, dtype=torch.int8)
    w = torch.randint(-127, 128, (24, 96), generator=gen, dtype=torch.int8)
    acc = x.int() @ w.int().t()
    scale = torch.full((24,), 0.5)
    y = qgemm(x, w, Epilogue(scale, None, torch.int8, y_scale=64.0, y_zero=1.0), SMALL)
    want = (torch.round(acc.double() * 0.5 / 64.0) + 1).clamp(-128, 127).to(torch.int8)
    assert bool(((acc * 0.5 / 64.0) % 1 == 0.5).any())  # the ties are there
    assert torch.equal(y, want)
    fp8 = qgemm(x, w, Epilogue(scale, None, FP8, y_scale=8.0), SMALL)
    assert torch.equal(fp8.view(torch.uint8), (acc.double() * 0.5 / 8.0).clamp(-448, 448).float().to(FP8)
                       .view(torch.uint8))


def test_uint8_zero_point_is_folded_exactly():
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (2, 19, 70), generator=gen, dtype=torch.uint8)
    w = torch.randint(-127, 128, (33, 70), generator=gen, dtype=torch.int8)
    bias = torch.randint(-500, 500, (33,), generator=gen, dtype=torch.int32)
    acc = (x.int() - 141) @ w.int().t() + bias  # [2, 19, 33], exact
    y = qgemm(x, w, Epilogue(torch.ones(33), fold_zero_point(w, bias, 141, torch.uint8), torch.float32), SMALL)
    assert torch.equal(y, acc.float())  # every |acc| < 2^24: exact in fp32


def test_fp8_conv_pads_with_real_zero_and_int8_with_the_zero_point():
    gen = torch.Generator().manual_seed(2)
    w = torch.randint(-127, 128, (16, 8, 3, 3), generator=gen, dtype=torch.int8)
    x = torch.randint(-128, 128, (1, 8, 5, 5), generator=gen, dtype=torch.int8)
    config = QConvConfig(16, 16, 16, group_m=2)
    ep = Epilogue(torch.ones(16), fold_zero_point(w, None, -7, torch.int8), torch.float32)
    y = qconv2d(x.contiguous(memory_format=torch.channels_last), pack_weight(w), (3, 3), ep, x_zero=-7,
                pads=(1, 1, 1, 1), config=config)
    want = torch.nn.functional.conv2d(x.double() + 7, w.double(), padding=1)  # zero padding of x − z
    assert torch.equal(y.double(), want)
    xf = (torch.randn(1, 8, 5, 5, generator=gen) * 4).to(FP8)
    wf = torch.randn(16, 8, 3, 3, generator=gen).to(FP8)
    y = qconv2d(xf, pack_weight(wf), (3, 3), Epilogue(torch.ones(16), None, torch.float32), pads=(1, 1, 1, 1),
                config=config)
    torch.testing.assert_close(y.double(), torch.nn.functional.conv2d(xf.double(), wf.double(), padding=1),
                               rtol=1e-6, atol=1e-5)


# ---- the elementwise kernels -------------------------------------------------------------------------

def test_requantize_keeps_the_layout_and_runs_along_the_axis():
    gen = torch.Generator().manual_seed(3)
    acc = torch.randint(-20000, 20000, (2, 8, 5, 6), generator=gen, dtype=torch.int32)
    acc = acc.contiguous(memory_format=torch.channels_last)
    scale = torch.rand(8, generator=gen) * 0.01
    bias = torch.randint(-300, 300, (8,), generator=gen, dtype=torch.int32)
    y = requantize(acc, Epilogue(scale, bias, torch.uint8, y_scale=0.5, y_zero=100.0, activation="Relu"), axis=1)
    assert y.stride() == acc.stride()
    r = ((acc + bias.reshape(1, 8, 1, 1)).float() * scale.reshape(1, 8, 1, 1)).relu()
    assert torch.equal(y, (torch.round(r / 0.5) + 100).clamp(0, 255).to(torch.uint8))
    half = torch.randn(3, 7, 10, generator=gen).to(torch.float16)
    out = requantize(half, Epilogue(torch.ones(10), torch.linspace(-1, 1, 10), torch.float32, activation="Clip",
                                    alpha=-0.5, beta=0.5))
    torch.testing.assert_close(out, (half.float() + torch.linspace(-1, 1, 10)).clamp(-0.5, 0.5))


@pytest.mark.parametrize("activation", ["Gelu", "Relu"])
def test_requantize_rows_equal_the_flat_kernel(activation):
    """The channel innermost (a GEMM's [M, N]) takes the tiled rows kernel, another layout the flat one (the channel
    found per element): the same arithmetic, so the same bits, across several column tiles and a ragged last row
    tile (N = 600 > 256, M = 37)."""
    gen = torch.Generator().manual_seed(4)
    product = (torch.randn(37, 600, generator=gen) * 3).to(torch.float16)
    epilogue = Epilogue(torch.rand(600, generator=gen) + 0.5, torch.randn(600, generator=gen), FP8, y_scale=0.02,
                        activation=activation)
    rows = requantize(product, epilogue, -1)
    column_major = product.t().contiguous().t()  # [M, N] with the channel outermost in memory
    flat = requantize(column_major, epilogue, -1)
    assert flat.stride() == column_major.stride() and rows.stride() == product.stride()
    assert torch.equal(rows.view(torch.uint8), flat.contiguous().view(torch.uint8))


def test_dequantize_is_exact_in_fp32_and_keeps_the_layout():
    x = torch.randint(0, 256, (2, 5, 4, 3), dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
    y = dequantize(x, 0.037, 129, torch.float32)
    assert y.stride() == x.stride() and torch.equal(y, (x.float() - 129) * 0.037)
    view = x[:, :, 1:3]  # not dense: compacted first
    assert torch.equal(dequantize(view, 0.037, 129, torch.float32), (view.float() - 129) * 0.037)
    f = torch.randn(6, 7).to(FP8)
    assert torch.equal(dequantize(f, 0.5, 0, torch.float16), (f.float() * 0.5).half())


def test_qadd_broadcasts_in_any_layout():
    a = torch.randint(-128, 128, (2, 6, 3, 4), dtype=torch.int8)
    b = torch.randint(-128, 128, (6, 1, 1), dtype=torch.int8)
    for layout in (torch.contiguous_format, torch.channels_last):
        y = qadd(a.contiguous(memory_format=layout), 0.02, 3, b, 0.05, -4, out_dtype=torch.float32)
        torch.testing.assert_close(y, (a.float() - 3) * 0.02 + (b.float() + 4) * 0.05, rtol=1e-6, atol=1e-6)
        assert y.stride() == a.contiguous(memory_format=layout).stride()


# ---- wrong calls -------------------------------------------------------------------------------------

def test_qadd_rounds_ties_to_even_and_saturates_by_the_bits():
    """qmath.to_float / to_integer (the QAdd pass's conversions by the bits, no cvt): every 8-bit input, sums at
    exact half-integers in y's units (ties to even, with an odd zero point added after the rounding, as the
    reference), and sums far beyond the range on both sides: bit for bit the reference's."""
    from kiln.ops.quantized import qadd as reference

    for dtype, zero in ((torch.int8, 3), (torch.uint8, 131)):
        a = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).reshape(1, 4, 8, 8)
        b = torch.flip(a, (3,))
        for a_scale, b_scale in ((0.5, 0.0), (0.5, 1.0), (1000.0, 0.25), (-1000.0, 0.5)):
            want = reference(None, a, torch.tensor(a_scale), torch.tensor(7, dtype=dtype), b, torch.tensor(b_scale),
                             torch.tensor(-2 if dtype == torch.int8 else 2, dtype=dtype), torch.tensor(1.0),
                             torch.tensor(zero, dtype=dtype))
            got = qadd(a, a_scale, 7, b, b_scale, -2 if dtype == torch.int8 else 2, out_dtype=dtype, y_scale=1.0,
                       y_zero=zero)
            assert torch.equal(got, want), (dtype, a_scale, b_scale, int((got != want).sum()))


def test_kernels_name_what_is_wrong():
    x, w = torch.zeros(4, 16, dtype=torch.int8), torch.zeros(8, 16, dtype=torch.int8)
    ep = Epilogue(torch.ones(8), None, torch.int8)
    with pytest.raises(TypeError, match="both float8e4m3fn"):
        qgemm(x, w.to(torch.float32).to(FP8), ep)
    with pytest.raises(ValueError, match="K-contiguous"):
        qgemm(x, torch.zeros(16, 8, dtype=torch.int8).t(), ep)
    with pytest.raises(ValueError, match="8 fp32 values"):
        qgemm(x, w, Epilogue(torch.ones(4), None, torch.int8))
    with pytest.raises(TypeError, match="int32"):
        qgemm(x, w, Epilogue(torch.ones(8), torch.ones(8), torch.int8))
    with pytest.raises(ValueError, match="activation 'Softplus'"):  # Gelu and GeluTanh it has (qmath.requantize)
        qgemm(x, w, Epilogue(torch.ones(8), None, torch.int8, activation="Softplus"))
    with pytest.raises(ValueError, match="does not fit int32"):
        fold_zero_point(torch.full((2, 2**18), 127, dtype=torch.int8), None, -128, torch.int8)
    with pytest.raises(ValueError, match="packed weight"):
        qconv2d(torch.zeros(1, 4, 5, 5, dtype=torch.int8), torch.zeros(8, 9, dtype=torch.int8), (3, 3),
                Epilogue(torch.ones(8), None, torch.int8))
    with pytest.raises(ValueError, match="rank 5"):
        qadd(torch.zeros(1, 1, 1, 1, 2, dtype=torch.int8), 1.0, 0, torch.zeros(2, dtype=torch.int8), 1.0, 0,
             out_dtype=torch.int8)


# ---- the convolution's loops and options (kiln/kernels/cuda/triton/qconv.py) --------------------------

CONV_LOOPS = {  # (cin, cout, size, kernel, stride, pad): which loop qconv2d takes with 16-wide K steps
    "gemm 1x1": (32, 24, 5, 1, 1, 0),                 # x as [N·H·W, Cin]; 24 columns: a column tail
    "gemm channel tail": (40, 16, 4, 1, 1, 0),        # Cin 40 = 2·16 + 8: masked K step
    "taps 3x3 pad 1": (32, 16, 6, 3, 1, 1),           # padded taps read the zero-point row
    "taps 3x3 stride 2 tail": (24, 16, 7, 3, 2, 1),   # Cin 24: masked K steps; 16 rows, 2 tiles of 16 + tail
    "taps 1x1 stride 2": (16, 32, 7, 1, 2, 0),
    "flat 7x7 stride 2": (3, 16, 9, 7, 2, 3),
}
CONV_OPTIONS = {"plain": {}, "prescaled": dict(prescaled=True), "fp16 tensor cores": dict(mma_f16=True),
                "fp8 fast accumulation": dict(fp8_precise=False),
                "persistent": dict(persistent=1, prescaled=True)}  # the 1x1 GEMM: 4 programs over the tiles


@pytest.mark.parametrize("option", list(CONV_OPTIONS))
@pytest.mark.parametrize("loop", list(CONV_LOOPS))
def test_qconv_loops_match_torch_within_one_step(loop, option):
    """Every loop with every option, int8 / uint8 (zero points far from 0, so a padded tap that read 0
    instead of z would be off by z·Σw) and FP8, against a float64 torch convolution: at most one
    quantization step apart, on at most 1% of the outputs (near-ties of the prescaled multiply)."""
    from kiln.kernels.cuda.triton.qconv import loop_of

    cin, cout, size, k, stride, pad = CONV_LOOPS[loop]
    config = QConvConfig(16, 16, 16, group_m=2, **CONV_OPTIONS[option])
    assert loop_of((k, k), (stride, stride), (pad,) * 4, cin, 16) == loop.split()[0]
    gen = torch.Generator().manual_seed(zlib.crc32(repr((loop, option)).encode()))
    for x_dtype, x_zero in ((torch.int8, -100), (torch.uint8, 200), (FP8, 0)):
        if x_dtype == FP8:
            x = (torch.randn(2, cin, size, size, generator=gen) * 2).to(FP8)
            w = (torch.randn(cout, cin, k, k, generator=gen) * 0.5).to(FP8)
            bias, out, y_scale = torch.randn(cout, generator=gen) * 4, FP8, 0.25
            kernel_bias = bias
        else:
            lo, hi = (-128, 128) if x_dtype == torch.int8 else (0, 256)
            x = torch.randint(lo, hi, (2, cin, size, size), generator=gen).to(x_dtype)
            w = torch.randint(-127, 128, (cout, cin, k, k), generator=gen, dtype=torch.int8)
            bias = torch.randint(-900, 900, (cout,), generator=gen, dtype=torch.int32)
            out, y_scale = torch.int8, 0.37 * (cin * k * k) ** 0.5
            kernel_bias = fold_zero_point(w, bias, x_zero, x_dtype)
        scale = torch.rand(cout, generator=gen) * 0.02 + 0.01
        ep = Epilogue(scale, kernel_bias, out, y_scale=y_scale, y_zero=0.0 if out == FP8 else -3.0, activation="Relu")
        acc = torch.nn.functional.conv2d(x.double() - x_zero, w.double(), stride=stride, padding=pad)
        v = ((acc + bias.double().view(1, -1, 1, 1)) * scale.double().view(1, -1, 1, 1)).relu() / y_scale
        if out == FP8:
            want = v.clamp(-448, 448).float().to(FP8)
        else:
            want = (torch.round(v) - 3).clamp(-128, 127).to(torch.int8)
        fp16_weight = config.mma_f16 and x_dtype != FP8
        y = qconv2d(x.contiguous(memory_format=torch.channels_last), pack_weight(w, fp16=fp16_weight), (k, k),
                    ep.prescale() if config.prescaled else ep, x_zero=x_zero, strides=(stride, stride),
                    pads=(pad,) * 4, config=config)
        assert y.is_contiguous(memory_format=torch.channels_last)
        got, ref = (y.view(torch.uint8).int(), want.view(torch.uint8).int()) if out == FP8 else (y.int(), want.int())
        if out == FP8:  # E4M3 codes in value order: adjacent values one apart
            got, ref = (torch.where(t >= 128, -(t & 0x7F), t & 0x7F) for t in (got, ref))
        off = (got - ref).abs()
        assert int(off.max()) <= 1 and float((off > 0).float().mean()) <= 0.01, (x_dtype, int(off.max()),
                                                                                 float((off > 0).float().mean()))


RESIDUAL_OPTIONS = {"plain": {}, "prescaled": dict(prescaled=True), "fp16 tensor cores": dict(mma_f16=True),
                    "persistent": dict(persistent=1, prescaled=True)}


def _f32(value: float) -> float:
    return float(torch.tensor(value, dtype=torch.float32))


def _channel_scales(cout: int, c_scale: float, ties: bool, gen: torch.Generator) -> torch.Tensor:
    """x_scale·w_scale per channel in float64 (exact: a product of two fp32 numbers, not itself an fp32 one,
    as in a real layer). With `ties`, w_scale puts the product at c_scale·2^-3·(1 + ε), |ε| <= 2^-23: every
    8th integer sum lies within a few fp32 ulps of a rounding tie of c, where a float32 epilogue and the
    reference (float64 product, float32 division) disagree a good part of the time."""
    x_scale = _f32(0.0213)
    if ties:
        eps = (torch.rand(cout, generator=gen, dtype=torch.float64) - 0.5) * 2.0**-22
        w_scale = (c_scale / 8 / x_scale * (1 + eps)).float()
    else:
        w_scale = (torch.rand(cout, generator=gen) * 0.02 + 0.01) / x_scale
    return w_scale.double() * x_scale


def _residual_reference(x, w, bias, x_zero, stride, pad, scale64, c, res, add, act: bool = True) -> torch.Tensor:
    """kiln::QConv with a residual as its contract writes it (kiln/ops/quantized.py), in torch: float64
    sums and products, each result rounded to float32 and divided in float32, round half to even."""
    acc = torch.nn.functional.conv2d(x.double() - x_zero, w.double(), stride=stride, padding=pad)
    r_c = (acc + bias.double().view(1, -1, 1, 1)) * scale64.view(1, -1, 1, 1)
    c_dtype, c_scale, c_zero = c
    clo, chi = (-128, 127) if c_dtype == torch.int8 else (0, 255)
    c = (torch.round(r_c.float() / torch.tensor(c_scale)) + c_zero).clamp(clo, chi).double()
    r = (c - c_zero) * c_scale + (res.double() - add.b_zero) * add.b_scale
    r = r.relu() if act else r
    olo, ohi = (-128, 127) if add.out_dtype == torch.int8 else (0, 255)
    return (torch.round(r.float() / torch.tensor(add.y_scale)) + add.y_zero).clamp(olo, ohi).int()


# (x, x_zero, c, residual, sum, regime): "random": random scales, s_c < s_y; "amplified": c on near-ties and
# s_y = 0.45·s_c, so a step of c is two or three of the sum; "c itself": c on near-ties, the sum at c's own
# scale and zero point, the residual at its zero point and no activation, so the output is c
RESIDUAL_REGIMES = ((torch.int8, -100, torch.int8, torch.uint8, torch.uint8, "random"),
                    (torch.uint8, 200, torch.uint8, torch.int8, torch.int8, "random"),
                    (torch.uint8, 130, torch.int8, torch.uint8, torch.uint8, "amplified"),
                    (torch.int8, -7, torch.uint8, torch.int8, torch.uint8, "c itself"))


@pytest.mark.parametrize("option", list(RESIDUAL_OPTIONS))
@pytest.mark.parametrize("loop", ["gemm 1x1", "taps 3x3 stride 2 tail", "flat 7x7 stride 2"])
def test_qconv_residual_epilogue_within_the_unfused_pair_s_tolerance(loop, option):
    """kiln::QConv with a residual: the layer's own 8-bit result c, plus the residual tile, Relu, requantized
    to the sum's dtype, against the contract's arithmetic written in torch: within the unfused pair's tolerance
    (kiln/tactics/cuda/quant_residual_check.py: ceil(s_c / s_y) + 1 steps), "c itself" within c's one step;
    off by a step only at near-ties (rare on random scales)."""
    cin, cout, size, k, stride, pad = CONV_LOOPS[loop]
    config = QConvConfig(16, 16, 16, group_m=2, **RESIDUAL_OPTIONS[option])
    gen = torch.Generator().manual_seed(zlib.crc32(repr(("residual", loop, option)).encode()))
    for x_dtype, x_zero, conv_dtype, res_dtype, out_dtype, regime in RESIDUAL_REGIMES:
        ties = regime != "random"
        lo, hi = (-128, 128) if x_dtype == torch.int8 else (0, 256)
        x = torch.randint(lo, hi, (2, cin, size, size), generator=gen).to(x_dtype)
        w = torch.randint(-1 if ties else -127, 2 if ties else 128, (cout, cin, k, k), generator=gen,
                          dtype=torch.int8)  # near-ties: small sums, so that c = sum / 8 spans the 8-bit range
        bias = torch.randint(-300 if ties else -900, 300 if ties else 900, (cout,), generator=gen, dtype=torch.int32)
        c_scale = _f32(0.37 * (cin * k * k) ** 0.5)
        c_zero = -3.0 if conv_dtype == torch.int8 else 120.0
        scale64 = _channel_scales(cout, c_scale, ties, gen)
        r_scale, r_zero = _f32(c_scale * 0.8), (10.0 if res_dtype == torch.uint8 else -5.0)
        y_scale = {"random": _f32(c_scale * 1.3), "amplified": _f32(c_scale * 0.45), "c itself": c_scale}[regime]
        y_zero = c_zero if regime == "c itself" else 0.0 if out_dtype == torch.uint8 else -20.0
        ho = (size + 2 * pad - k) // stride + 1
        rlo, rhi = (0, 256) if res_dtype == torch.uint8 else (-128, 128)
        res = torch.randint(rlo, rhi, (2, cout, ho, ho), generator=gen).to(res_dtype)
        if regime == "c itself":
            res = torch.full_like(res, int(r_zero))
        activation = "" if regime == "c itself" else "Relu"
        add = ResidualAdd(c_scale, c_zero, r_scale, r_zero, out_dtype, y_scale, y_zero, activation=activation)
        want = _residual_reference(x, w, bias, x_zero, stride, pad, scale64, (conv_dtype, c_scale, c_zero), res, add,
                                   act=activation == "Relu")
        ep = Epilogue(scale64.float(), fold_zero_point(w, bias, x_zero, x_dtype), conv_dtype, y_scale=c_scale,
                      y_zero=c_zero)
        y = qconv2d(x.contiguous(memory_format=torch.channels_last), pack_weight(w, fp16=config.mma_f16), (k, k),
                    ep.prescale() if config.prescaled else ep, x_zero=x_zero, strides=(stride, stride),
                    pads=(pad,) * 4, config=config, residual=res.contiguous(memory_format=torch.channels_last),
                    residual_add=add)
        assert y.dtype == out_dtype and y.is_contiguous(memory_format=torch.channels_last)
        olo = -128 if out_dtype == torch.int8 else 0
        assert float((want > olo).float().mean()) > 0.3  # the Relu and the saturation do not decide everything
        off = (y.int() - want).abs()
        allowed = 1 if regime == "c itself" else residual_steps(c_scale, y_scale)
        rare = 0.02 if regime == "random" else 0.5  # near-ties by construction: c a step off on many of them
        assert int(off.max()) <= allowed and float((off > 0).float().mean()) <= rare, \
            (regime, int(off.max()), float((off > 0).float().mean()))


def test_qconv_residual_is_checked():
    x = torch.zeros(1, 16, 4, 4, dtype=torch.int8)
    w = pack_weight(torch.zeros(16, 16, 1, 1, dtype=torch.int8))
    ep = Epilogue(torch.ones(16), None, torch.int8)
    add = ResidualAdd(1.0, 0.0, 1.0, 0.0, torch.int8, 1.0, 0.0)
    res = torch.zeros(1, 16, 4, 4, dtype=torch.int8)
    with pytest.raises(ValueError, match="come together"):
        qconv2d(x, w, (1, 1), ep, residual=res)
    with pytest.raises(ValueError, match="the output's"):
        qconv2d(x, w, (1, 1), ep, residual=torch.zeros(1, 16, 4, 2, dtype=torch.int8), residual_add=add)
    with pytest.raises(TypeError, match="all int8/uint8 or all float8e4m3fn"):
        qconv2d(x, w, (1, 1), Epilogue(torch.ones(16), None, torch.float32), residual=res, residual_add=add)
    with pytest.raises(TypeError, match="all int8/uint8 or all float8e4m3fn"):
        qconv2d(x, w, (1, 1), ep, residual=res.to(torch.float8_e4m3fn), residual_add=add)
    with pytest.raises(ValueError, match="no activation of its own"):
        qconv2d(x, w, (1, 1), dataclasses.replace(ep, activation="Relu"), residual=res, residual_add=add)


def test_qconv_refuses_a_wrong_padding_row_and_weight_dtype():
    x = torch.zeros(1, 16, 4, 4, dtype=torch.int8)
    ep = Epilogue(torch.ones(16), None, torch.int8)
    with pytest.raises(ValueError, match="padding must be padding_row"):
        qconv2d(x, pack_weight(torch.zeros(16, 16, 3, 3, dtype=torch.int8)), (3, 3), ep,
                padding=torch.zeros(8, dtype=torch.int8))
    with pytest.raises(TypeError, match="fp16 with config.mma_f16"):
        qconv2d(x, pack_weight(torch.zeros(16, 16, 1, 1, dtype=torch.int8)), (1, 1), ep,
                config=QConvConfig(16, 16, 16, mma_f16=True))
