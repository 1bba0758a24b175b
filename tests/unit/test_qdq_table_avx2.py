"""A QDQ transformer's 8-bit Elementwise chains on AVX2 (issue 12; kiln/kernels/cpu/elementwise.c): the lookup
tables read in 64-column blocks by gathers (table_columns) against the byte loop before them and against numpy's
indexing of the table; the evaluated chains' 8-lane Dequantize and 32-byte Quantize against numpy float32 doing the
same IEEE operations (exact: DQ -> bias [-> scale] -> Q is float32 arithmetic in one order, round half to even); a
Gelu chain of 1536 columns (MiniLM's FFN) now a table, the same bits as its evaluation and within one step of float64.

Fresh random bytes (every value, and a GEMM-like spread), widths with every kind of tail (past 32, 8 and the
64-column block), rows not a multiple of the 16-row item, uint8 and int8, two columns' biases that saturate."""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest
import torch

from kiln.kernels.cpu import elementwise as kernels
from kiln.kernels.cpu import transformer

needs_kernels = pytest.mark.skipif(not transformer.available(), reason="kiln's C kernels are not built")

DQ_BIAS_Q = ["Dequantize i1 i2 i3", "Add t0 i0", "Quantize t1 i4 i5"]
DQ_BIAS_SCALE_Q = ["Dequantize i2 i3 i4", "Add t0 i0", "Mul t1 i1", "Quantize t2 i5 i6"]
DQ_BIAS_GELU_Q = ["Dequantize i1 i2 i3", "Add t0 i0", "Gelu t1", "Quantize t2 i4 i5"]
WIDTHS = [8, 24, 31, 40, 64, 72, 100, 128, 200, 384, 1000]


def _chain(code: list[str], rows: int, n: int, dtype: torch.dtype, seed: str, spread: str = "uniform"):
    """(constants by input, the 8-bit activation's index, x [rows, n], the scales and zero points as floats)."""
    g = torch.Generator().manual_seed(zlib.crc32(seed.encode()))
    info = torch.iinfo(dtype)
    step = int(code[0].split()[1][1:])
    if spread == "uniform":
        x = torch.randint(info.min, info.max + 1, (rows, n), dtype=dtype, generator=g)
    else:  # a GEMM's quantized output: bunched around its zero point
        x = (torch.randn(rows, n, generator=g) * 20).round().clamp(info.min, info.max).to(dtype)
    s_in, s_out = float(torch.rand((), generator=g)) * 0.05 + 0.01, float(torch.rand((), generator=g)) * 0.05 + 0.01
    z_in, z_out = (int(torch.randint(info.min // 4, info.max // 4 + 1, (), generator=g)) for _ in range(2))
    bias = torch.randn(n, generator=g) * 3
    bias[:2] = torch.tensor([1e3, -1e3])  # columns 0 and 1 saturate high and low
    constants = {0: bias, step + 1: torch.tensor(s_in), step + 2: torch.tensor(z_in, dtype=dtype),
                 step + 3: torch.tensor(s_out), step + 4: torch.tensor(z_out, dtype=dtype)}
    if step == 2:
        constants[1] = torch.tensor(float(torch.rand((), generator=g)) + 0.5)
    return constants, step, x, (s_in, z_in, s_out, z_out)


def _numpy_chain(code: list[str], constants, x: torch.Tensor, q) -> np.ndarray:
    """DQ -> bias [-> scale] -> Q in numpy float32, operation by operation as the C loop does them."""
    s_in, z_in, s_out, z_out = (np.float32(v) for v in q)
    r = (x.numpy().astype(np.float32) - z_in) * s_in
    r = r + constants[0].numpy()
    if any(line.startswith("Mul") for line in code):
        r = r * np.float32(constants[1])
    info = np.iinfo(x.numpy().dtype)
    y = np.clip(np.rint(r / s_out) + z_out, info.min, info.max)
    return y.astype(x.numpy().dtype)


def _kernel(code, constants, step, x, lookup=True):
    return kernels.Elementwise(code, {step: tuple(x.shape)}, constants, {step: x.dtype}, lookup=lookup)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8], ids=["uint8", "int8"])
@pytest.mark.parametrize("n", WIDTHS)
def test_the_gathered_table_is_the_byte_loop_and_numpys_indexing(n, dtype):
    rows = 77  # 4 items of 16 rows and a ragged one
    code = DQ_BIAS_SCALE_Q
    constants, step, x, _ = _chain(code, rows, n, dtype, f"gathered {n} {dtype}")
    kernel = _kernel(code, constants, step, x)
    assert kernel._table is not None
    before = transformer.set_table_lookup(0)
    try:
        byte_loop = kernel({step: x})
        transformer.set_table_lookup(1)
        gathered = kernel({step: x})
    finally:
        transformer.set_table_lookup(before)
    table = kernel._table[:-3].view(n, 256)
    want = table[torch.arange(n)[None, :].expand(rows, n), x.view(torch.uint8).long()].view(dtype)
    assert torch.equal(gathered, want)
    assert torch.equal(byte_loop, want)


@needs_kernels
@pytest.mark.parametrize("spread", ["uniform", "gemm"])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8], ids=["uint8", "int8"])
@pytest.mark.parametrize("code", [DQ_BIAS_Q, DQ_BIAS_SCALE_Q], ids=["dq_bias_q", "dq_bias_scale_q"])
@pytest.mark.parametrize("n", [37, 64, 128, 200, 384, 1536])
def test_evaluated_and_tabled_chains_are_numpys_float32_bits(n, code, dtype, spread):
    rows = 70
    constants, step, x, q = _chain(code, rows, n, dtype, f"numpy {n} {code} {dtype} {spread}", spread)
    want = _numpy_chain(code, constants, x, q)
    evaluated = _kernel(code, constants, step, x, lookup=False)
    np.testing.assert_array_equal(evaluated({step: x}).numpy(), want)
    tabled = _kernel(code, constants, step, x)
    np.testing.assert_array_equal(tabled({step: x}).numpy(), want)
    info = np.iinfo(want.dtype)
    assert (want[:, 0] == info.max).all() and (want[:, 1] == info.min).all()  # the saturating columns did


@needs_kernels
def test_which_chains_take_a_table():
    """Gelu's chain of MiniLM's 1536 columns (and BERT-base's 3072) is a table now; DQ -> bias -> Q (one cheap line)
    is evaluated from TABLE_CHEAP_COLUMNS on, tabled below; nothing past TABLE_MAX_COLUMNS or below TABLE_MIN_ROWS."""
    def tabled(code, rows, n):
        constants, step, x, _ = _chain(code, rows, n, torch.uint8, f"which {code} {rows} {n}")
        return _kernel(code, constants, step, x)._table is not None

    assert tabled(DQ_BIAS_GELU_Q, 128, 1536) and tabled(DQ_BIAS_GELU_Q, 128, 3072)
    assert tabled(DQ_BIAS_SCALE_Q, 128, 1536)
    assert tabled(DQ_BIAS_Q, 128, 128) and not tabled(DQ_BIAS_Q, 128, kernels.TABLE_CHEAP_COLUMNS)
    assert not tabled(DQ_BIAS_GELU_Q, 128, kernels.TABLE_MAX_COLUMNS + 8)
    assert not tabled(DQ_BIAS_GELU_Q, kernels.TABLE_MIN_ROWS - 1, 512)


@needs_kernels
@pytest.mark.parametrize("spread", ["uniform", "gemm"])
def test_a_wide_gelu_table_is_its_evaluation_and_within_a_step_of_float64(spread):
    rows, n = 96, 1536
    constants, step, x, (s_in, z_in, s_out, z_out) = _chain(DQ_BIAS_GELU_Q, rows, n, torch.uint8,
                                                            f"wide gelu {spread}", spread)
    tabled, evaluated = _kernel(DQ_BIAS_GELU_Q, constants, step, x), _kernel(DQ_BIAS_GELU_Q, constants, step, x, False)
    assert tabled._table is not None and evaluated._table is None
    got = tabled({step: x})
    assert torch.equal(got, evaluated({step: x}))
    r = (x.numpy().astype(np.float64) - z_in) * np.float32(s_in) + constants[0].numpy().astype(np.float64)
    gelu = 0.5 * r * (1.0 + np.vectorize(math.erf)(r / math.sqrt(2.0)))
    want = np.clip(np.rint(gelu / np.float32(s_out)) + z_out, 0, 255)
    # one step: the C Gelu's erfc approximation (relative error < 1.2e-7) may flip a rounding tie's neighbour
    assert np.abs(got.numpy().astype(np.float64) - want).max() <= 1


@needs_kernels
def test_a_layers_kernels_at_other_row_counts_share_its_table():
    """The tactic's kernels at each bound size pass one `tables` dict: a new batch or sequence length reuses the
    width's table (no 256-row evaluation at bind), and still runs exactly what evaluating gives."""
    code = DQ_BIAS_GELU_Q
    constants, step, x, _ = _chain(code, 96, 512, torch.uint8, "shared table")
    tables: dict = {}
    first = kernels.Elementwise(code, {step: (1, 96, 512)}, constants, {step: torch.uint8}, tables=tables)
    second = kernels.Elementwise(code, {step: (2, 80, 512)}, constants, {step: torch.uint8}, tables=tables)
    assert first._table is not None and second._table is first._table and len(tables) == 1
    x2 = torch.randint(0, 256, (2, 80, 512), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    evaluated = kernels.Elementwise(code, {step: (2, 80, 512)}, constants, {step: torch.uint8}, lookup=False)
    assert torch.equal(second({step: x2}), evaluated({step: x2}))
    few = kernels.Elementwise(code, {step: (1, 8, 512)}, constants, {step: torch.uint8}, tables=tables)
    assert few._table is None  # below TABLE_MIN_ROWS: evaluated, as without the shared tables
