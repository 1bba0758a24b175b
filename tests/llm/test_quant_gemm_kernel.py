"""The Triton weight-only GEMMs against kiln's reference modules (dequantize, then torch GEMM) under
TRITON_INTERPRET=1 at small shapes: decode rows and prefill rows, ragged N and K, int4 groups."""

import os

import pytest
import torch

pytest.importorskip("triton")

from kiln.llm.kernels.quant_gemm import int4_gemm, int8_gemm, uint8_group_gemm  # noqa: E402
from kiln.llm.prequantized import AWQ, GPTQ  # noqa: E402
from kiln.llm.quantization import Int4Weight, Int8GroupWeight, Int8Weight  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter fixes tests/kernels applies (bf16 tl.dot)
    from tests.kernels.conftest import _fix_interpreter_bf16_dot, _fix_interpreter_scalar_index

    _fix_interpreter_bf16_dot()
    _fix_interpreter_scalar_index()

DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") == "0" and torch.cuda.is_available() else "cpu"


def data(m, n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn((m, k), generator=g).to(DEVICE), (torch.randn((n, k), generator=g) * 0.1).to(DEVICE)


@pytest.mark.parametrize("m,n,k", [(1, 48, 64), (5, 130, 96), (33, 64, 160)])
def test_int8_kernel_matches_the_reference(m, n, k):
    x, w = data(m, n, k)
    module = Int8Weight.quantize(w)
    got = int8_gemm(x, module.q, module.scale)
    torch.testing.assert_close(got, module(x), atol=1e-4, rtol=1e-4)  # fp32 sums in another order


@pytest.mark.parametrize("m,n,k,group", [(1, 48, 64, 16), (5, 130, 96, 32), (17, 64, 256, 128), (2, 40, 64, 64)])
def test_int4_kernel_matches_the_reference(m, n, k, group):
    x, w = data(m, n, k, seed=1)
    module = Int4Weight.quantize(w, group_size=group)
    got = int4_gemm(x, module.packed, module.scale, module.zero, module.group_size)
    torch.testing.assert_close(got, module(x), atol=1e-4, rtol=1e-4)


def test_half_precision_activations():
    x, w = data(3, 64, 128, seed=2)
    module = Int4Weight.quantize(w, group_size=32)
    got = int4_gemm(x.bfloat16(), module.packed, module.scale, module.zero, 32)
    assert got.dtype == torch.bfloat16
    # the dequantized tile is rounded to bf16 before the dot (8-bit mantissa)
    torch.testing.assert_close(got.float(), module(x), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("layout,bits,group", [("awq", 4, 32), ("gptq", 4, -1), ("gptq", 8, 32), ("gptq", 8, -1)])
def test_grouped_kernels_on_checkpoint_layouts(layout, bits, group):
    """Random int32 words are valid packed checkpoints: AWQ's interleaved nibbles, GPTQ's stored zero + 1
    (a stored 15 reads as 16, 255 as 256), fp16 scales, one group over the whole input (group_size -1)."""
    g = torch.Generator().manual_seed(3)
    n, k, per_word = 64, 128, 32 // bits
    groups = k // group if group > 0 else 1

    def words(*shape):
        return torch.randint(-2**31, 2**31 - 1, shape, generator=g, dtype=torch.int32)

    scales = (torch.rand((groups, n), generator=g) * 0.02 / 2 ** (bits - 4) + 0.001).half()
    if layout == "awq":
        tensor = AWQ(group).unpack({"qweight": words(k, n // 8), "qzeros": words(groups, n // 8), "scales": scales},
                                   "l")
    else:
        packed = {"qweight": words(k // per_word, n), "qzeros": words(groups, n // per_word), "scales": scales}
        tensor = GPTQ(group, 1, bits).unpack(packed, "l")
        assert 1 <= tensor.zero.min() and tensor.zero.max() <= 2**bits  # stored + 1
    values, scale, zero = tensor.values.to(DEVICE), tensor.scale.to(DEVICE), tensor.zero.to(DEVICE)
    x = torch.randn((5, k), generator=g).to(DEVICE)
    if bits == 4:
        got = int4_gemm(x, Int4Weight(values, scale, zero, tensor.group_size).packed, scale, zero, tensor.group_size)
    else:
        got = uint8_group_gemm(x, Int8GroupWeight(values, scale, zero, tensor.group_size).q, scale, zero,
                               tensor.group_size)
    torch.testing.assert_close(got, x @ tensor.dequantize().to(DEVICE).T, atol=1e-4, rtol=1e-4)
