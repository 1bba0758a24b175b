"""The Triton GEMM template with its fused epilogue against torch (F.linear + kiln's torch epilogue)."""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from kiln.kernels.cuda.triton import GEMM_CONFIGS, GemmConfig, gemm  # noqa: E402
from kiln.ops.fused import _epilogue  # noqa: E402
from tests.kernels.tolerances import DTYPES, assert_close  # noqa: E402


def reference(x, w, bias, residual, activation, after):
    y = F.linear(x.float(), w.float(), None if bias is None else bias.float())
    return _epilogue(y, None if residual is None else residual.float(), activation, 0.0, 0.0, after)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_square_with_bias_gelu_residual(dtype):
    x, w = torch.randn(64, 64).to(dtype), (torch.randn(64, 64) / 8).to(dtype)
    bias, residual = torch.randn(64).to(dtype), torch.randn(64, 64).to(dtype)
    out = gemm(x, w, bias, residual, activation="Gelu", config=GemmConfig(32, 32, 32, group_m=2))
    # fp32 sums of 64 products in another order than torch's: a few fp32 ulps of the row norm
    assert_close(out, reference(x, w, bias, residual, "Gelu", True), dtype, scale=4.0)


@pytest.mark.parametrize("after", [True, False])
def test_tails_batch_dims_and_transposed_weight(after):
    """M, N, K none a multiple of the tile (70, 50, 40); x [2, 35, K]; w a transposed view."""
    x = torch.randn(2, 35, 40)
    w = torch.randn(40, 50).t()  # [N, K] with strides (1, 50)
    bias, residual = torch.randn(50), torch.randn(50)  # residual broadcast over rows
    out = gemm(x, w, bias, residual, activation="Relu", residual_after_activation=after,
               config=GemmConfig(32, 32, 16, group_m=4))
    assert out.shape == (2, 35, 50)
    assert_close(out, reference(x, w, bias, residual, "Relu", after), torch.float32, scale=4.0)


def test_default_config_and_plain_product():
    x, w = torch.randn(3, 24, dtype=torch.float16), torch.randn(20, 24, dtype=torch.float16)
    assert_close(gemm(x, w), reference(x, w, None, None, "", True), torch.float16, scale=2.0)
    assert all(c.block_m * c.block_n <= 128 * 256 for c in GEMM_CONFIGS)


def test_empty_k_is_the_epilogue_of_zeros():
    x, w, bias = torch.randn(4, 0), torch.randn(6, 0), torch.randn(6)
    assert_close(gemm(x, w, bias, activation="Sigmoid"), torch.sigmoid(bias).expand(4, 6), torch.float32)


def test_refusals():
    with pytest.raises(ValueError, match=r"needs w as \[N, 8\]"):
        gemm(torch.randn(2, 8), torch.randn(3, 7))
    with pytest.raises(TypeError, match="share"):
        gemm(torch.randn(2, 8), torch.randn(3, 8, dtype=torch.float16))
