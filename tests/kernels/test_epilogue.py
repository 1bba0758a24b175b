"""The bias + activation (+ residual) epilogue kernel against kiln's torch epilogue (kiln/ops/fused.py)."""

import pytest
import torch

pytest.importorskip("triton")

from kiln.kernels.cuda.triton import bias_activation  # noqa: E402
from kiln.kernels.cuda.triton.device_math import ACTIVATIONS  # noqa: E402
from kiln.ops.fused import _epilogue  # noqa: E402
from tests.kernels.tolerances import DTYPES, assert_close  # noqa: E402

PARAMS = {"Clip": (-0.5, 1.5), "LeakyRelu": (0.1, 0.0), "HardSigmoid": (0.2, 0.5)}  # activation -> (alpha, beta)


def reference(y, bias, residual, activation, after, axis=-1):
    y = y.float().clone()
    if bias is not None:
        shape = [1] * y.dim()
        shape[axis] = -1
        y = y + bias.float().reshape(shape)
    alpha, beta = PARAMS.get(activation, (0.0, 0.0))
    return _epilogue(y, None if residual is None else residual.float(), activation, alpha, beta, after)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("after", [True, False], ids=["residual_after", "residual_before"])
def test_every_activation_gemm_layout(activation, after):
    y, bias, residual = torch.randn(7, 45) * 3, torch.randn(45), torch.randn(7, 45)
    alpha, beta = PARAMS.get(activation, (0.0, 0.0))
    out = bias_activation(y, bias, residual, activation=activation, alpha=alpha, beta=beta,
                          residual_after_activation=after)
    assert_close(out, reference(y, bias, residual, activation, after), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_conv_layouts(dtype):
    """NCHW and channels-last convolution outputs, bias on the channel axis, a residual of either layout."""
    y = (torch.randn(2, 6, 5, 7) * 2).to(dtype)
    bias, residual = torch.randn(1, 6, 1, 1).to(dtype), torch.randn(2, 6, 5, 7).to(dtype)
    expected = reference(y, bias.reshape(-1), residual, "Relu", False, axis=1)
    out = bias_activation(y, bias, residual, activation="Relu", residual_after_activation=False, axis=1)
    assert_close(out, expected, dtype)
    y_nhwc = y.to(memory_format=torch.channels_last)
    out = bias_activation(y_nhwc, bias, residual, activation="Relu", residual_after_activation=False, axis=1)
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert_close(out, expected, dtype)


def test_inplace_broadcast_residual_and_no_bias():
    y, residual = torch.randn(3, 4, 10), torch.randn(10)
    expected = reference(y, None, residual, "SiLU", True)
    assert bias_activation(y, None, residual, activation="SiLU", inplace=True) is y
    assert_close(y, expected, torch.float32)


def test_strided_input_and_fp32_bias_on_fp16():
    y = torch.randn(6, 32, dtype=torch.float16)[:, ::2]  # not dense: computed on a copy
    bias = torch.randn(16)
    assert_close(bias_activation(y, bias, activation="GeluTanh"), reference(y, bias, None, "GeluTanh", True),
                 torch.float16)


def test_refusals():
    with pytest.raises(ValueError, match="unknown activation"):
        bias_activation(torch.randn(2, 3), activation="Swish")
    with pytest.raises(ValueError, match="bias has 4 elements"):
        bias_activation(torch.randn(2, 3), torch.randn(4))
