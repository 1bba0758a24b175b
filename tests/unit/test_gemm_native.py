"""kiln's packed GEMM (kiln/kernels/cpu/gemm.c, gemm_native.py) and its tactic cpu.gemm.kiln_packed,
against independent oracles.

Kernel: y = epilogue(x @ Wᵀ) in float64 torch, the epilogue written out here from the ONNX
definitions (not kiln's op), on random inputs at odd shapes (every M, N, K edge of the 6x16, 14x32 and
8x48 tiles, the K blocks of 256, 192 and 128, the M blocks), every activation, a residual before or after it,
[B, S, K] inputs, both paths (x read in place for a small M, x packed otherwise) and every kernel this
CPU runs. The AVX-512 kernels cannot run on an AVX2 machine: their tile shapes run here through the
tests' build (the same template at 16 lanes, AVX2 instructions), and kiln must pick it exactly where
the CPU reports avx512f. Tactic: the autotuner's check against the registered op, native segments at
the tuned and other row counts, and an engine against onnxruntime.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from kiln.kernels.cpu import cpu_features, gemm_native, onednn
from kiln.plan.spec import ProgramSpec, StepSpec
from kiln.runtime import native
from kiln.runtime.program import Program
from tests.unit.oracle import ACTIVATION_ORACLE
from tests.unit.test_native_binding import _calls
from tests.unit.tactic_check import make_step, reason, run_against_reference

NAME = "cpu.gemm.kiln_packed"
pytestmark = pytest.mark.skipif(not gemm_native.available(), reason=f"kiln's GEMM not built: {gemm_native.reason()}")

# fp32 kernel vs float64 oracle: |error| <= ATOL + RTOL * max|z|, z the pre-activation (x Wᵀ + b [+ r]).
# A K-long fp32 dot product rounds to ~sqrt(K)·6e-8 of its scale (K <= 800 here); every activation's
# slope is <= 1.5 and its rational approximation (erf, tanh) is within 1e-6: 2e-5 leaves room, while
# an index or epilogue mistake fails by orders of magnitude.
RTOL, ATOL = 2e-5, 2e-6

PARAMS = {"LeakyRelu": (0.1, 0.0), "Clip": (-0.5, 0.7), "HardSigmoid": (0.2, 0.5)}


def oracle(x, w, b, r, activation, after):
    """(y, max|z|) in float64."""
    z = x.double() @ w.double().T
    if b is not None:
        z = z + b.double()
    if r is not None and not after:
        z = z + r.double()
    alpha, beta = PARAMS.get(activation, (0.0, 0.0))
    y = ACTIVATION_ORACLE[activation](z, alpha, beta)
    if r is not None and after:
        y = y + r.double()
    return y, max(z.abs().max().item(), 1.0)


def assert_close(got, want64, scale):
    assert got.dtype == torch.float32 and got.shape == want64.shape
    error = (got.double() - want64).abs().max().item()
    assert error <= ATOL + RTOL * scale, f"max abs error {error:.3g} at scale {scale:.3g}"


def data(g, lead, k, n, bias=True, residual=False):
    x = torch.randn(*lead, k, generator=g)
    w = torch.randn(n, k, generator=g) / k ** 0.5  # z = x Wᵀ of order 1: the activations are not saturated
    b = torch.randn(n, generator=g) if bias else None
    r = torch.randn(*lead, n, generator=g) if residual else None
    return x, w, b, r


def runnable(test_kernels=False):
    return [k for k in gemm_native.kernels(test_kernels) if k.supported and (k.test_only or not test_kernels)]


SHAPES = [  # M, K, N: every edge of the 6x16 / 14x32 / 8x48 tiles, K past one block (256 / 192 / 128), M past one
    # block, the narrow tiles (7-8 rows on AVX2, 15-16 on AVX-512's 14x32)
    (1, 1, 1), (1, 7, 5), (7, 17, 33), (8, 40, 24), (13, 63, 129), (16, 50, 40), (17, 129, 16), (63, 257, 31),
    (129, 300, 70), (6, 256, 16), (14, 192, 32), (300, 513, 47), (2, 800, 100), (8, 128, 48), (9, 129, 49),
    (65, 385, 97),
    # small K and the 8x48 tile's edge panels of 16 and 32 columns (ConvNeXt-tiny's pointwise GEMMs: 512 x 16 x 64,
    # 512 x 64 x 16, 128 x 128 x 32), alone (N = 16, 32) or after full panels (N = 80, 112), and an edge of 10
    (512, 16, 64), (512, 64, 16), (128, 128, 32), (70, 33, 80), (65, 16, 112), (9, 20, 10), (3, 5, 32),
]


@pytest.mark.parametrize("kernel", runnable(), ids=lambda k: k.name.replace(" ", "-"))
@pytest.mark.parametrize("path", ["whole K in place", "K blocks in place", "K blocks packed"])
@pytest.mark.parametrize("m,k,n", SHAPES, ids=lambda v: str(v))
def test_gemm_matches_float64_at_odd_shapes(kernel, path, m, k, n):
    g = torch.Generator().manual_seed(m * 1000 + k * 10 + n)
    x, w, b, _ = data(g, (m,), k, n)
    # small_m and pack_m pick the path: x read in place over the whole K up to small_m rows, else
    # K-blocked, x packed past pack_m rows
    small, pack = {"whole K in place": (1 << 30, 0), "K blocks in place": (0, 1 << 30), "K blocks packed": (0, 0)}[path]
    layer = gemm_native.PackedLinear(w, b, kernel=kernel, small_m=small, pack_m=pack)
    want, scale = oracle(x, w, b, None, "", 1)
    assert_close(layer(x), want, scale)


@pytest.mark.parametrize("activation", sorted(ACTIVATION_ORACLE))
@pytest.mark.parametrize("residual,after", [(False, 1), (True, 1), (True, 0)])
def test_every_epilogue_matches_float64(activation, residual, after):
    g = torch.Generator().manual_seed(7)
    for lead, small, pack in (((2, 37), None, None), ((3,), None, None), ((8,), None, None), ((50,), 0, 0),
                              ((50,), 0, 1 << 30)):
        # [B, S, K] rows; a small M (wide tiles, then narrow ones); K blocks packed, in place
        x, w, b, r = data(g, lead, 72, 45, residual=residual)
        alpha, beta = PARAMS.get(activation, (0.0, 0.0))
        layer = gemm_native.PackedLinear(w, b, activation, alpha, beta, residual=residual,
                                         residual_after_activation=bool(after), small_m=small, pack_m=pack)
        want, scale = oracle(x, w, b, r, activation, after)
        assert_close(layer(x, r), want, scale)


def swiglu_oracle(x, w, b, r):
    """(y, max|z|) in float64: y = silu(z[..., :H]) · z[..., H:] (+ r), z = x Wᵀ + b (kiln::FusedGemm's SwiGLU,
    written out here, not kiln's op)."""
    z = x.double() @ w.double().T
    if b is not None:
        z = z + b.double()
    gate, up = z.chunk(2, dim=-1)
    y = gate / (1 + torch.exp(-gate)) * up
    if r is not None:
        y = y + r.double()
    return y, max(z.abs().max().item() ** 2, 1.0)  # the product of two operands of order |z|


@pytest.mark.parametrize("kernel", runnable() + runnable(test_kernels=True), ids=lambda k: k.name.replace(" ", "-"))
@pytest.mark.parametrize("path", ["whole K in place", "K blocks in place", "K blocks packed"])
@pytest.mark.parametrize("m,k,h", [(1, 5, 3), (5, 40, 8), (7, 33, 21), (13, 300, 16), (16, 64, 70), (50, 72, 45),
                                   (129, 260, 33)], ids=lambda v: str(v))
def test_swiglu_matches_float64(kernel, path, m, k, h):
    """W = [W_gate; W_up], H output columns (a panel's half and edges past it), every path and kernel, a
    residual and a bias on some shapes."""
    g = torch.Generator().manual_seed(m * 1000 + k * 10 + h)
    with_bias, residual = m % 2 == 1, h % 3 == 0
    x, w, b, _ = data(g, (m,), k, 2 * h, bias=with_bias)
    r = torch.randn(m, h, generator=g) if residual else None
    small, pack = {"whole K in place": (1 << 30, 0), "K blocks in place": (0, 1 << 30), "K blocks packed": (0, 0)}[path]
    layer = gemm_native.PackedLinear(w, b, "SwiGLU", residual=residual, kernel=kernel, small_m=small, pack_m=pack)
    want, scale = swiglu_oracle(x, w, b, r)
    assert_close(layer(x, r), want, scale)


def test_swiglu_with_an_empty_k_is_the_gated_bias():
    b = torch.randn(10)
    layer = gemm_native.PackedLinear(torch.empty(10, 0), b, "SwiGLU")
    want, scale = swiglu_oracle(torch.empty(3, 0), torch.empty(10, 0), b, None)
    assert_close(layer(torch.empty(3, 0)), want, scale)


@pytest.mark.parametrize("activation", ["Gelu", "GeluTanh", "Tanh", "Sigmoid", "SiLU"])
def test_rational_activations_are_within_1e6_of_float64(activation):
    """y = act(x · 1) over a dense grid of x: the epilogue's erf/tanh approximations alone. Rows of 1 (every value
    in a vector's masked or scalar tail) and rows of 40 through W = I (x Iᵀ is exact: two full AVX-512 vectors and
    a tail of 8, five AVX2 vectors)."""
    grid = torch.linspace(-12, 12, 24000)
    want = ACTIVATION_ORACLE[activation](grid.double(), 0.0, 0.0)
    for width in (1, 40):
        layer = gemm_native.PackedLinear(torch.eye(width), None, activation)
        got = layer(grid.reshape(-1, width)).reshape(-1)
        error = (got.double() - want).abs() / want.abs().clamp_min(1.0)  # absolute below 1, relative above
        assert error.max().item() <= 1e-6, \
            f"{activation}, rows of {width}: {error.max().item():.3g} at x = {grid[error.argmax()].item()}"


# SiLU's values past its float range and its specials, as kiln/kernels/cpu/exp_poly.h's KILN_VSILU and silu_scalar
# state them (gemm.c's SiLU and SwiGLU epilogues): x·σ(x) within 1e-6 (absolute below 1, relative above) down to
# -88; below it, -inf included, under 1e-35 in magnitude (the true value underflows; x / (1 + e^-x) with e^-x
# clamped gave -6e-9 at -1e30 and -inf at -inf); +inf -> +inf; NaN -> NaN.
SILU_SPECIALS = [-float("inf"), -1e30, -1e5, -100.0, -88.5, -88.0, -87.5, -30.0, -9.0, -0.5, 0.0, 0.25, 3.0, 20.0,
                 87.5, 88.5, 100.0, 1e5, 1e30, float("inf"), float("nan")]


def silu_special_errors(got: torch.Tensor, z: torch.Tensor, up: torch.Tensor | None = None) -> list[str]:
    """Where got (fp32) is not SiLU(z) (· up, SwiGLU's gating; up finite and nonzero) as SILU_SPECIALS' comment
    states it."""
    got, z = got.double(), z.double()
    up = torch.ones_like(z) if up is None else up.double().expand_as(z)
    want = torch.where(z < -88, 0.0, z / (1 + torch.exp(-z.clamp_min(-88))) * up)  # below -88: ~0, checked apart
    bad = torch.zeros_like(z, dtype=torch.bool)
    normal = z.isfinite() & (z >= -88)
    bad |= normal & ((got - want).abs() > 1e-6 * want.abs().clamp_min(1.0))
    bad |= (z < -88) & ~(got.abs() <= 1e-35 * up.abs())  # -inf included; NaN fails the comparison
    bad |= (z == float("inf")) & ~(got == float("inf") * up.sign())
    bad |= z.isnan() & ~got.isnan()
    return [f"at {tuple(i)}: z {z[tuple(i)].item():.6g} -> {got[tuple(i)].item():.6g}, "
            f"want ~{want[tuple(i)].item():.6g}" for i in bad.nonzero().tolist()[:5]]


def silu_special_cases(kernel=None) -> list[str]:
    """Both epilogues at SILU_SPECIALS on every path, each value at every lane of a vector and in the tails: through
    the bias (W = 0: y = b exactly, inf and NaN included) and, for the finite ones, through x Iᵀ (exact) in random
    places. SwiGLU: gate = the value, up finite (W = [I; 0] or 0, the bias [0 or the values; up])."""
    errors = []
    specials = torch.tensor(SILU_SPECIALS)
    finite = specials[specials.isfinite()]
    paths = {"whole K": (1 << 30, 0), "K blocks": (0, 1 << 30), "K blocks packed": (0, 0)}
    for path, (small, pack) in paths.items():
        for m, n in ((3, 53), (50, 70), (9, 24)):
            g = torch.Generator().manual_seed(zlib.crc32(f"silu specials {path} {m} {n}".encode()))
            # the bias: the specials cycled with a shift per width, so each lands on many lanes and tails
            b = specials[(torch.arange(n) * 5 + n) % len(specials)]
            x = torch.randn(m, n, generator=g)
            layer = gemm_native.PackedLinear(torch.zeros(n, n), b, "SiLU", kernel=kernel, small_m=small, pack_m=pack)
            errors += [f"SiLU bias {path} {m}x{n} {e}" for e in silu_special_errors(layer(x), b.expand(m, n))]
            x = torch.where(torch.rand(m, n, generator=g) < 0.3,
                            finite[torch.randint(len(finite), (m, n), generator=g)], 5 * x)
            layer = gemm_native.PackedLinear(torch.eye(n), None, "SiLU", kernel=kernel, small_m=small, pack_m=pack)
            errors += [f"SiLU x {path} {m}x{n} {e}" for e in silu_special_errors(layer(x), x)]
            up = 0.5 + torch.rand(n, generator=g)
            layer = gemm_native.PackedLinear(torch.zeros(2 * n, n), torch.cat([b, up]), "SwiGLU", kernel=kernel,
                                             small_m=small, pack_m=pack)
            errors += [f"SwiGLU bias {path} {m}x{n} {e}" for e in silu_special_errors(layer(x), b.expand(m, n), up)]
            w = torch.cat([torch.eye(n), torch.zeros(n, n)])
            layer = gemm_native.PackedLinear(w, torch.cat([torch.zeros(n), up]), "SwiGLU", kernel=kernel,
                                             small_m=small, pack_m=pack)
            errors += [f"SwiGLU x {path} {m}x{n} {e}" for e in silu_special_errors(layer(x), x, up)]
    return errors


@pytest.mark.parametrize("kernel", runnable() + runnable(test_kernels=True), ids=lambda k: k.name.replace(" ", "-"))
def test_silu_and_swiglu_epilogues_at_large_values_and_specials(kernel):
    errors = silu_special_cases(kernel)
    assert not errors, f"{len(errors)} cases off, e.g. {errors[:6]}"


# GELU over a dense sweep against torch's gelu in float64: |error| <= GELU_SWEEP_BOUND·max(1, |v|). The bound is what
# gemm.c's former form (Eigen's rational erf) measured on this sweep, 1.79e-7 (bench/gelu_table_fit.py); its tables
# measure 1.56e-7 (AVX-512, degree 4) and 9.1e-8 (AVX2, degree 6), the `any` ISA's tiles keep the rational form.
GELU_SWEEP_BOUND = 1.8e-7
GELU_EXTREMES = [-1e30, 1e30, -1e5, 1e5, -20.0, 20.0, -5.6, 5.6, 3.95 * 2**0.5, -1e-30, 1e-30, 1e-40, -1e-40]


def gelu_sweep_errors(kernel=None) -> list[str]:
    """The GELU epilogue of `kernel` (None: kiln's pick) over v = -10..10 step 1e-4 and GELU_EXTREMES (past the
    tables' clamp: exactly 0 and v), through x Iᵀ (exact) on the tiles' path (KILN_TILE_GELU) and, with a zero
    residual, the epilogue pass (gelu_avx512 / gelu_avx2, a masked tail: rows of 40); and +inf -> +inf, NaN -> NaN,
    -inf -> NaN (as torch's erf form) through the bias at every lane of a 16-wide row."""
    errors = []
    sweep = (torch.arange(-100000, 100000, dtype=torch.float64) * 1e-4).float()
    v = torch.cat([torch.tensor(GELU_EXTREMES), sweep])
    v = v[: v.numel() // 40 * 40]
    want = torch.nn.functional.gelu(v.double())
    for residual in (False, True):
        layer = gemm_native.PackedLinear(torch.eye(40), None, "Gelu", kernel=kernel, residual=residual)
        got = layer(v.reshape(-1, 40), torch.zeros(v.numel() // 40, 40) if residual else None).reshape(-1).double()
        error = (got - want).abs() / v.double().abs().clamp_min(1.0)
        if not error.max().item() <= GELU_SWEEP_BOUND:
            at = int(error.argmax())
            errors.append(f"residual {residual}: v = {v[at].item()!r}: {got[at].item()!r}, want {want[at].item()!r}")
        extremes = got[: len(GELU_EXTREMES)]
        exact = torch.where(v[: len(GELU_EXTREMES)].abs() > 5.59, v[: len(GELU_EXTREMES)].clamp_min(0.0), extremes)
        if not torch.equal(extremes, exact.double()):
            errors.append(f"residual {residual}: extremes {extremes.tolist()}, want {exact.tolist()}")
    specials = torch.tensor([float("inf"), float("-inf"), float("nan"), 1.0])
    for shift in range(4):
        b = specials[(torch.arange(16) + shift) % 4]
        for residual in (False, True):
            layer = gemm_native.PackedLinear(torch.zeros(16, 3), b, "Gelu", kernel=kernel, residual=residual)
            y = layer(torch.ones(5, 3), torch.zeros(5, 16) if residual else None)[2]
            want = torch.where(b == float("inf"), b, torch.nn.functional.gelu(b))  # torch: gelu(inf) is NaN
            if not torch.allclose(y, want, rtol=1e-6, atol=0.0, equal_nan=True):
                errors.append(f"specials residual {residual}: {y.tolist()}, want {want.tolist()}")
    return errors


@pytest.mark.parametrize("kernel", runnable() + runnable(test_kernels=True), ids=lambda k: k.name.replace(" ", "-"))
def test_gelu_over_a_dense_sweep_and_its_specials(kernel):
    errors = gelu_sweep_errors(kernel)
    assert not errors, errors


@pytest.mark.parametrize("kernel", runnable() + runnable(test_kernels=True), ids=lambda k: k.name.replace(" ", "-"))
@pytest.mark.parametrize("path", ["whole K in place", "K blocks in place", "K blocks packed"])
def test_gelu_in_the_tiles_matches_float64(kernel, path):
    """GELU without a residual is applied by the tiles to their sums before the store (gemm.c's KILN_TILE_GELU; at
    the last K block on the K-blocked paths): every kernel and path, full panels, the 8x48 tile's 16- and 32-column
    edges and a partial panel (through the tile's buffer), M off the tile's rows, K over several blocks with a short
    last one, with and without a bias, z spread over GELU's curve and past erf's clamp at |z / √2| = 4."""
    g = torch.Generator().manual_seed(21)
    small, pack = {"whole K in place": (1 << 30, 0), "K blocks in place": (0, 1 << 30), "K blocks packed": (0, 0)}[path]
    # (8, ...) and (15, ...): the narrow tiles of the AVX2 6x16 and the 14x32 (7-8 and 15-16 rows, whole K)
    for m, k, n in ((9, 300, 100), (17, 129, 80), (8, 130, 64), (15, 70, 40), (3, 64, 7), (70, 257, 96), (1, 1, 1)):
        x, w, b, _ = data(g, (m,), k, n, bias=n % 2 == 0)
        w = w * 3  # z of order 3: past the clamp (|z| > 5.7) at a few outputs
        layer = gemm_native.PackedLinear(w, b, "Gelu", kernel=kernel, small_m=small, pack_m=pack)
        want, scale = oracle(x, w, b, None, "Gelu", 1)
        assert_close(layer(x), want, scale)


def test_whole_k_rows_follow_the_tile():
    """x is read in place over the whole K up to 64 row blocks of the 8x48 tile (512 rows) while x fits
    IN_PLACE_BYTES, up to 8 row blocks of the other tiles (gemm_native.WHOLE_K_ROW_BLOCKS_OF)."""
    for kernel in gemm_native.kernels(test_kernels=True):
        blocks = 64 if kernel.name == "avx512 8x48" else 8
        assert gemm_native.small_rows(kernel, 768) == blocks * kernel.mr
        assert gemm_native.small_rows(kernel, 3072) == min(blocks * kernel.mr, gemm_native.IN_PLACE_BYTES // (4 * 3072))


def test_no_bias_and_an_empty_k():
    g = torch.Generator().manual_seed(1)
    x, w, _, _ = data(g, (9,), 31, 18, bias=False)
    want, scale = oracle(x, w, None, None, "Relu", 1)
    assert_close(gemm_native.PackedLinear(w, None, "Relu")(x), want, scale)
    b = torch.randn(5, generator=g)
    y = gemm_native.PackedLinear(torch.empty(5, 0), b, "Relu")(torch.empty(4, 0))  # K = 0: act(b)
    assert torch.equal(y, b.relu().expand(4, 5))


@pytest.mark.parametrize("m,k,n", [(200, 300, 130), (50, 70, 20)])  # N of 2 panels: rows split among threads too
@pytest.mark.parametrize("small,pack", [(None, None), (0, None), (0, 0)])  # whole K; K blocks in place; packed
def test_threads_follow_torch_and_agree(m, k, n, small, pack):
    g = torch.Generator().manual_seed(2)
    x, w, b, _ = data(g, (m,), k, n)
    layer = gemm_native.PackedLinear(w, b, "Gelu", small_m=small, pack_m=pack)
    before = torch.get_num_threads()
    try:
        outputs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outputs.append(layer(x))
    finally:
        torch.set_num_threads(before)
    want, scale = oracle(x, w, b, None, "Gelu", 1)
    for y in outputs:
        assert_close(y, want, scale)


def _random_shapes(seed: int, count: int) -> list[tuple[int, int, int]]:
    """M x K x N drawn at random: M around the tile's whole-K / K-blocked switch (WHOLE_K_ROW_BLOCKS) and up
    to past one M block, K and N off the tile and block multiples (edge rows, a partial panel, a short last K block)."""
    rng = np.random.default_rng(seed)
    switch = gemm_native.whole_k_row_blocks(gemm_native.linear_kernel()) * gemm_native.linear_kernel().mr
    rows = [switch - 1, switch, switch + 1, int(rng.integers(60, 300)), int(rng.integers(240, 700))]
    return [(rows[i % len(rows)], int(rng.integers(200, 900)), int(rng.integers(17, 400))) for i in range(count)]


@pytest.mark.parametrize("m,k,n", _random_shapes(11, 6), ids=lambda v: str(v))
def test_default_paths_on_two_threads_match_numpy_at_random_shapes(m, k, n):
    """The path and blocking kiln picks by itself (no small_m / pack_m given), two threads sharing the panels:
    fresh random x, W, b and residual against numpy in float64."""
    rng = np.random.default_rng(m * 7919 + k * 31 + n)
    x = rng.standard_normal((m, k), dtype=np.float32)
    w = (rng.standard_normal((n, k)) / k ** 0.5).astype(np.float32)
    b = rng.standard_normal(n, dtype=np.float32)
    r = rng.standard_normal((m, n), dtype=np.float32)
    layer = gemm_native.PackedLinear(torch.from_numpy(w), torch.from_numpy(b), residual=True)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        got = layer(torch.from_numpy(x), torch.from_numpy(r)).numpy()
    finally:
        torch.set_num_threads(before)
    z = x.astype(np.float64) @ w.astype(np.float64).T + b
    error = np.abs(got - (z + r)).max()
    assert error <= ATOL + RTOL * max(np.abs(z).max(), 1.0), f"max abs error {error:.3g}"


def _cpu_flags() -> set[str]:
    """/proc/cpuinfo's flags, less those above a KILN_CPU_ISA cap (the kernels are built for the cap)."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            found = set(line.partition(":")[2].split())
            return {f for f in found if not f.startswith(("avx512", "amx", "avx_"))} if cpu_features.isa_cap() else found
    return set()


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="reads the CPU's flags from /proc/cpuinfo")
def test_the_kernel_is_the_widest_the_cpu_reports():
    """AVX-512 exactly where the kernel sees avx512f (cpuid, as the OS reports it), else AVX2 + FMA."""
    flags = _cpu_flags()
    best = gemm_native.best_kernel()
    names = [k.name for k in gemm_native.kernels()]
    assert any(n.startswith("avx512") for n in names) and any(n.startswith("avx2") for n in names), names  # built
    if "avx512f" in flags:
        assert best.name.startswith("avx512") and best.nr == 32  # the recurrent kernels' tile
        assert gemm_native.linear_kernel().name == gemm_native.LINEAR_TILE == "avx512 8x48"
        assert gemm_native.PackedLinear(torch.ones(2, 2), None).kernel == gemm_native.linear_kernel()
    elif {"avx2", "fma"} <= flags:
        assert best.name.startswith("avx2") and best.nr == 16
        assert not next(k for k in gemm_native.kernels() if k.name.startswith("avx512")).supported
    else:
        assert best.name.startswith("generic")
    if "avx512f" not in flags:
        assert gemm_native.linear_kernel() == best
    for unsupported in [k for k in gemm_native.kernels() if not k.supported]:
        with pytest.raises(ValueError, match="does not run on this CPU"):
            gemm_native.PackedLinear(torch.ones(2, 2), None, kernel=unsupported)


@pytest.mark.slow  # the tests' build compiles the 14x32 and 8x48 templates for AVX2 (~1 minute, then cached)
@pytest.mark.parametrize("index", [0, 1])
def test_the_avx512_tile_shapes_run_right_on_this_cpu(index):
    kernels = runnable(test_kernels=True)
    if len(kernels) <= index:
        pytest.skip("the tests' build has no such test kernel for this CPU")
    g = torch.Generator().manual_seed(5)
    for m, k, n in [(1, 7, 5), (15, 193, 33), (16, 64, 48), (29, 385, 64), (170, 200, 31), (9, 129, 97)]:
        for small, pack in ((1 << 30, 0), (0, 0), (0, 1 << 30)):
            x, w, b, r = data(g, (m,), k, n, residual=True)
            layer = gemm_native.PackedLinear(w, b, "Gelu", residual=True, kernel=kernels[index], small_m=small,
                                             pack_m=pack)
            want, scale = oracle(x, w, b, r, "Gelu", 1)
            assert_close(layer(x, r), want, scale)


# ---- the tactic ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("lead", [(5,), (2, 9), (1, 3, 4)])  # (1, 3, 4): ConvNeXt's [N, H, W, C] rows
@pytest.mark.parametrize("activation,residual", [("", False), ("Gelu", True), ("Relu", False), ("SwiGLU", False),
                                                 ("SwiGLU", True)])
def test_tactic_matches_the_registered_op(lead, activation, residual):
    g = torch.Generator().manual_seed(11)
    x, w, b, r = data(g, lead, 40, 24, residual=residual)
    if activation == "SwiGLU":  # the residual is as wide as the gated output
        r = None if r is None else r[..., :12].contiguous()
    step = make_step("FusedGemm", "kiln", 4 if residual else 3, activation=activation, residual_after_activation=1)
    step = dataclasses.replace(step, tactic_config={"input_size": list(x.shape), "residual": residual})
    args = [x, w, b] + ([r] if residual else [])
    run_against_reference(NAME, step, args, constant={1, 2})


def test_tactic_refuses_what_it_cannot_run():
    g = torch.Generator().manual_seed(12)
    x, w, b, _ = data(g, (4,), 8, 7)
    swiglu = make_step("FusedGemm", "kiln", 3, activation="SwiGLU")
    assert "even number" in reason(NAME, swiglu, [x, w, b], constant={1, 2})  # 7 rows: no gate/up halves
    x, w, b, _ = data(g, (4,), 8, 6)
    swiglu_residual = make_step("FusedGemm", "kiln", 4, activation="SwiGLU")
    assert "residual" in reason(NAME, swiglu_residual, [x, w, b, torch.randn(4, 6)], constant={1, 2})  # not [4, 3]
    plain = make_step("FusedGemm", "kiln", 3)
    assert "rank 2 or more" in reason(NAME, plain, [x.reshape(32), w, b], constant={1, 2})
    assert "constant" in reason(NAME, plain, [x, w, b], constant={2})
    residual = make_step("FusedGemm", "kiln", 4)
    assert "residual" in reason(NAME, residual, [x, w, b, torch.randn(1, 6)], constant={1, 2})


def test_rows_of_rank_4_run_outside_native_segments():
    """A segment's 4-D values are NHWC in memory: [N, H, W, C] rows must not join one."""
    from kiln.tactics import registry

    g = torch.Generator().manual_seed(15)
    x, w, b, _ = data(g, (1, 3, 4), 8, 6)
    tactic = next(t for t in registry.candidates("FusedGemm", "kiln", "cpu", 5) if t.name == NAME)
    for lead, native in (((1, 3, 4), False), ((3, 4), True)):
        step = dataclasses.replace(make_step("FusedGemm", "kiln", 3), tactic=NAME,
                                   tactic_config={"input_size": [*lead, 8], "residual": False})
        launch = tactic.prepare(step, [None, w, b], torch.device("cpu"))
        assert hasattr(launch, "native") == (native and onednn.available()), lead


def test_the_launch_writes_a_given_output_of_its_form_and_a_fresh_one_otherwise():
    """Program.run's `into` (execute()'s bound outputs, kiln/runtime/context.py): the launch outside a segment (GPT-2's
    logits) writes a contiguous float32 tensor of its output's shape; another (shape, dtype, layout) it leaves, and
    returns a fresh output. Oracle: float64."""
    from kiln.tactics import registry

    g = torch.Generator().manual_seed(16)
    x, w, b, _ = data(g, (2, 3, 5), 40, 24)
    tactic = next(t for t in registry.candidates("FusedGemm", "kiln", "cpu", 5) if t.name == NAME)
    step = dataclasses.replace(make_step("FusedGemm", "kiln", 3), tactic=NAME,
                               tactic_config={"input_size": [2, 3, 5, 40], "residual": False})
    launch = tactic.prepare(step, [None, w, b], torch.device("cpu"))
    assert launch.writes_into
    want, scale = oracle(x, w, b, None, "", 1)
    given = torch.full((2, 3, 5, 24), float("nan"))
    got = launch(None, x, w, b, into=[given])
    assert got.data_ptr() == given.data_ptr() and got.shape == given.shape
    assert_close(given, want, scale)
    for other in (torch.zeros(2, 3, 5, 25), torch.zeros(2, 3, 5, 24, dtype=torch.float64),
                  torch.zeros(24, 5, 3, 2).permute(3, 2, 1, 0)):
        got = launch(None, x, w, b, into=[other])
        assert got.data_ptr() != other.data_ptr() and not other.any()
        assert_close(got, want, scale)


def _ffn(k: int, hidden: int, activation: str, residual: bool, lead: tuple[int, int] = (2, 7)
         ) -> tuple[ProgramSpec, dict]:
    """x [.., k] -> FusedGemm(activation) [.., hidden] (SwiGLU: [.., hidden / 2]) -> FusedGemm (+ x) [.., k], both
    on the tactic, tuned at rows `lead`."""
    g = torch.Generator().manual_seed(13)
    inner = hidden // 2 if activation == "SwiGLU" else hidden
    weights = {"w1": torch.randn(hidden, k, generator=g) / k ** 0.5, "b1": torch.randn(hidden, generator=g),
               "w2": torch.randn(k, inner, generator=g) / inner ** 0.5, "b2": torch.randn(k, generator=g)}
    up = StepSpec("FusedGemm", "up", ["x", "w1", "b1"], ["h"], {"activation": activation}, domain="kiln",
                  tactic=NAME, tactic_config={"input_size": [*lead, k], "residual": False})
    down = StepSpec("FusedGemm", "down", ["h", "w2", "b2"] + (["x"] if residual else []), ["y"],
                    {"residual_after_activation": 1}, domain="kiln", tactic=NAME,
                    tactic_config={"input_size": [*lead, inner], "residual": residual})
    return ProgramSpec(["x"], ["y"], [up, down], {s: s for s in weights}), weights


@pytest.mark.skipif(not onednn.available(), reason="a native segment binds oneDNN memory objects")
@pytest.mark.parametrize("activation,residual", [("Gelu", True), ("Relu", False), ("SwiGLU", True)])
def test_a_transformer_ffn_runs_as_one_native_segment_at_every_row_count(activation, residual):
    spec, weights = _ffn(48, 100, activation, residual)
    program = Program(spec, weights)
    assert [len(s.members) for s in program.segments] == [2]
    g = torch.Generator().manual_seed(14)
    for shape in ((2, 7, 48), (3, 11, 48), (1, 1, 48)):  # the tuned size, then others (bound on first sight)
        x = torch.randn(*shape, generator=g)
        with torch.inference_mode():
            got = program.run([x])[0]
        if activation == "SwiGLU":
            h, _ = swiglu_oracle(x, weights["w1"], weights["b1"], None)
        else:
            h, _ = oracle(x, weights["w1"], weights["b1"], None, activation, 1)
        want, scale = oracle(h, weights["w2"], weights["b2"], x if residual else None, "", 1)
        assert_close(got, want, scale)


@pytest.mark.skipif(not onednn.available(), reason="a native segment binds oneDNN memory objects")
def test_a_swiglu_segment_tuned_past_the_rows_read_in_place_rewrites_its_views_up_to_its_rows():
    """A SwiGLU layer bound past small_m rows stages C in its call's scratch (gemm.c's K-blocked path; AVX2's
    small_m at a small K is 48 rows, the profile's largest of llama_tiny's MLP segments more). Its size rule keeps
    that place (PackedLinear.c_rows): views at other rows up to the template's have every plan rewritten (the walk
    traceable), each plan byte for byte the template call replanned there, and run as the float64 oracle says.
    Before, the rule refused the template's own rows: every view of the segment walked and bound that layer
    (~0.5 ms of each first call of llama_tiny on an AVX2 EPYC, bench/results/first-shape-2026-12-07.md)."""
    small = gemm_native.small_rows(gemm_native.linear_kernel(), 48)
    seq = small // 2 + 5  # the template: 2 x seq rows, past small_m
    spec, weights = _ffn(48, 100, "SwiGLU", True, lead=(2, seq))
    program = Program(spec, weights)
    [segment] = program.segments
    g = torch.Generator().manual_seed(15)
    compared = 0
    for shape in ((2, seq, 48), (1, 3, 48), (1, small, 48), (1, small + 7, 48), (2, seq - 2, 48), (3, 5, 48)):
        x = torch.randn(*shape, generator=g)
        with torch.inference_mode():
            got = program.run([x])[0]
        h, _ = swiglu_oracle(x, weights["w1"], weights["b1"], None)
        want, scale = oracle(h, weights["w2"], weights["b2"], x, "", 1)
        assert_close(got, want, scale)
        key = (tuple(shape),)
        if key == (tuple(segment.entry_sizes[0]),):
            continue  # the template itself
        rewritten = segment._rewritten(key)
        assert rewritten is not None, shape
        replanned = native._Resized.bound_at(segment, segment._natives_at(key).natives)
        for a, b, owner in zip(_calls(rewritten), _calls(replanned), replanned._owned):
            size = ctypes.sizeof(owner._plan)
            assert a[0] == b[0] and ctypes.string_at(a[1], size) == ctypes.string_at(b[1], size), (shape, owner)
            compared += 1
    rewrite = segment._rewrite
    assert all(member[0] is not None for member in rewrite._members)  # a rule for the SwiGLU layer too
    assert rewrite._calls is not None and rewrite._whole.traceable
    assert compared == 2 * 5
    with pytest.raises(ValueError, match="needs scratch"):  # past the template's C place: the segment grows
        segment._natives[0].plan_at((2, seq + 1, 48))


def test_engine_on_kiln_gemm_matches_onnxruntime(monkeypatch):
    """A BERT-style FFN block exported as ONNX (MatMul, Add, erf GELU, MatMul, Add, residual Add), built
    with this tactic winning every layer (timings made up: the shared CPU decides nothing here; the
    autotuner still checks each layer and the engine against the reference), against onnxruntime at the
    tuned shape and another sequence length."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    import kiln
    from kiln.builder import autotune

    monkeypatch.setattr(autotune, "measure", lambda fns, device, runs=10, **_: {
        key: 1e-6 if key.startswith(NAME) else 1.0 for key in fns})
    rng = np.random.default_rng()
    k, hidden = 64, 160
    inits = [numpy_helper.from_array((rng.standard_normal((k, hidden)) / k ** 0.5).astype(np.float32), "w1"),
             numpy_helper.from_array(rng.standard_normal(hidden).astype(np.float32), "b1"),
             numpy_helper.from_array((rng.standard_normal((hidden, k)) / hidden ** 0.5).astype(np.float32), "w2"),
             numpy_helper.from_array(rng.standard_normal(k).astype(np.float32), "b2"),
             numpy_helper.from_array(np.array(2 ** -0.5, np.float32), "s"),
             numpy_helper.from_array(np.array(1.0, np.float32), "one"),
             numpy_helper.from_array(np.array(0.5, np.float32), "half")]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h0"]), helper.make_node("Add", ["h0", "b1"], ["h"]),
             helper.make_node("Mul", ["h", "s"], ["hs"]), helper.make_node("Erf", ["hs"], ["e"]),
             helper.make_node("Add", ["e", "one"], ["e1"]), helper.make_node("Mul", ["h", "e1"], ["he"]),
             helper.make_node("Mul", ["he", "half"], ["a"]),
             helper.make_node("MatMul", ["a", "w2"], ["y0"]), helper.make_node("Add", ["y0", "b2"], ["y1"]),
             helper.make_node("Add", ["y1", "x"], ["y"])]
    graph = helper.make_graph(nodes, "ffn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "s", k])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    model = model.SerializeToString()
    engine = kiln.build(model, profiles=[{"x": "1x1x64,2x16x64,4x40x64"}], tactics=[NAME])
    gemms = [s for s in engine.plan.program.steps if s.op_type == "FusedGemm"]
    assert len(gemms) == 2 and all(s.tactic == NAME for s in gemms), [(s.name, s.tactic) for s in gemms]
    assert gemms[0].attributes.get("activation") == "Gelu"  # the GELU and the residual are the GEMMs' epilogue
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    for shape in ((2, 16, k), (3, 29, k), (1, 1, k)):
        x = rng.standard_normal(shape, dtype=np.float32)
        np.testing.assert_allclose(engine.run({"x": x})["y"], session.run(None, {"x": x})[0], rtol=1e-4, atol=1e-4)


# Run in a process under KILN_CPU_ISA=avx2 (gemm.c built for x86-64-v3, the 6x16 tile and its 8-lane GELU: the
# table of 8 intervals of degree 6), one and two threads, every path: M, N, K off the tile and
# the K block (6 rows, 16 columns, 256), each epilogue and a residual before or after it (GELU at every shape and
# path), and the GELU grid of
# test_rational_activations_are_within_1e6_of_float64 through W = I, gelu_sweep_errors, SiLU and SwiGLU at
# silu_special_cases. Prints
# one JSON line of (case, error, bound).
_AVX2_TILE_CASES = r"""
import json, sys, zlib
import numpy as np, torch
from kiln.kernels.cpu import gemm_native
from tests.unit.oracle import ACTIVATION_ORACLE

ATOL, RTOL = float(sys.argv[1]), float(sys.argv[2])
PARAMS = {"LeakyRelu": (0.1, 0.0), "Clip": (-0.5, 0.7), "HardSigmoid": (0.2, 0.5)}
assert gemm_native.linear_kernel().name == "avx2 6x16", gemm_native.linear_kernel().name
rows = []
paths = {"whole K": (1 << 30, None), "K blocks": (0, None), "K blocks packed": (0, 0)}
shapes = [(1, 1, 1), (5, 257, 17), (7, 300, 33), (13, 513, 47), (64, 255, 100), (129, 300, 70)]
acts, modes = sorted(ACTIVATION_ORACLE), ((False, 1), (True, 1), (True, 0))
cases = [(s, p, t, acts[i % len(acts)], modes[i % 3])  # each shape, path and thread count: one epilogue of the list
         for i, (s, p, t) in enumerate((s, p, t) for s in shapes for p in paths for t in (1, 2))]
cases += [(s, p, 1, "Gelu", (False, 1)) for s in shapes for p in paths]  # the tiles' GELU on every edge and path
cases += [((129, 300, 70), "K blocks", 2, a, mode) for a in acts for mode in modes]  # every epilogue
for (m, k, n), path, threads, activation, (residual, after) in cases:
    case = f"{m}x{k}x{n} {path} t{threads} {activation or 'none'} r{int(residual)}{after}"
    rng = np.random.default_rng(zlib.crc32(case.encode()))
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = (3 * rng.standard_normal((n, k)) / k ** 0.5).astype(np.float32)  # |z| to ~10: past erf's clamp
    b = rng.standard_normal(n).astype(np.float32)
    r = rng.standard_normal((m, n)).astype(np.float32) if residual else None
    alpha, beta = PARAMS.get(activation, (0.0, 0.0))
    small, pack = paths[path]
    layer = gemm_native.PackedLinear(torch.from_numpy(w), torch.from_numpy(b), activation, alpha, beta,
                                     residual=residual, residual_after_activation=bool(after),
                                     small_m=small, pack_m=pack)
    torch.set_num_threads(threads)
    got = layer(torch.from_numpy(x), None if r is None else torch.from_numpy(r)).numpy().astype(np.float64)
    z = x.astype(np.float64) @ w.astype(np.float64).T + b
    if residual and not after:
        z = z + r
    want = ACTIVATION_ORACLE[activation](torch.from_numpy(z), alpha, beta).numpy()
    if residual and after:
        want = want + r
    rows.append((case, float(np.abs(got - want).max()), ATOL + RTOL * max(float(np.abs(z).max()), 1.0)))
grid = torch.linspace(-12, 12, 24000)
want = ACTIVATION_ORACLE["Gelu"](grid.double(), 0.0, 0.0)
got = gemm_native.PackedLinear(torch.eye(40), None, "Gelu")(grid.reshape(-1, 40)).reshape(-1).double()
rows.append(("Gelu grid, rows of 40", float(((got - want).abs() / want.abs().clamp_min(1.0)).max()), 1e-6))
x = torch.ones(7, 32)
x[3, 5] = float("nan")  # NaN passes through the tiles' GELU clamps (row 3 only), as through the other ISAs' masks
y = gemm_native.PackedLinear(torch.eye(32)[:20], None, "Gelu")(x)
rows.append(("Gelu of NaN", float(not (y[3].isnan().all() and y[torch.arange(7) != 3].isfinite().all())), 0.0))
from tests.unit.test_gemm_native import gelu_sweep_errors, silu_special_cases
errors = gelu_sweep_errors()  # the 8-lane tables over the dense sweep, the extremes and the specials
rows.append(("Gelu sweep: " + "; ".join(errors[:3]), float(len(errors)), 0.0))
# SiLU and SwiGLU at large values and specials
errors = silu_special_cases()
rows.append(("SiLU / SwiGLU specials: " + "; ".join(errors[:3]), float(len(errors)), 0.0))
print(json.dumps(rows))
"""


def test_the_avx2_tile_under_the_cap_matches_float64():
    """kiln's GEMM as an AVX2-only CPU runs it (a process under KILN_CPU_ISA=avx2: the x86-64-v3 build, not the
    AVX2 tile of this process's -march=native build): _AVX2_TILE_CASES against float64, with this file's bounds."""
    if cpu_features.isa() not in ("avx2", "avx512"):
        pytest.skip("needs an x86 CPU with AVX2")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "KILN_CPU_ISA": "avx2", "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-c", _AVX2_TILE_CASES, str(ATOL), str(RTOL)], env=env,
                          capture_output=True, text=True, timeout=600, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(rows) == 6 * 3 * 2 + 6 * 3 + len(ACTIVATION_ORACLE) * 3 + 4
    bad = [row for row in rows if not row[1] <= row[2]]
    assert not bad, f"{len(bad)} of {len(rows)} cases off, e.g. {bad[:3]}"
