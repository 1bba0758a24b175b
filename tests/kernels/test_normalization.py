"""LayerNorm / RMSNorm / Softmax kernels against torch in fp32, for rows that fit in registers
and (with MAX_ROW_BLOCK lowered) rows walked in chunks."""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from kiln.kernels.cuda.triton import layer_norm, normalization, rms_norm, softmax  # noqa: E402
from tests.kernels.tolerances import DTYPES, assert_close  # noqa: E402


@pytest.fixture(params=["one_pass", "chunked"])
def row_mode(request, monkeypatch):
    if request.param == "chunked":  # rows longer than one block: 37 elements in chunks of 16
        monkeypatch.setattr(normalization, "MAX_ROW_BLOCK", 16)
    return request.param


def rms_reference(x, weight, eps):
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layer_norm(dtype, row_mode):
    x = (torch.randn(5, 3, 37) * 2 + 0.5).to(dtype)
    weight, bias = torch.randn(37).to(dtype), torch.randn(37).to(dtype)
    expected = F.layer_norm(x.float(), (37,), weight.float(), bias.float(), 1e-5)
    assert_close(layer_norm(x, weight, bias, 1e-5), expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_skip_layer_norm_forms_the_sum_in_the_kernel(dtype, row_mode):
    x, r = (torch.randn(5, 3, 37) * 2).to(dtype), torch.randn(5, 3, 37).to(dtype)
    weight, bias = torch.randn(37).to(dtype), torch.randn(37).to(dtype)
    s_expected = x + r  # the unfused Add, rounded to dtype
    y, s = layer_norm(x, weight, bias, 1e-5, residual=r, return_sum=True)
    if dtype == torch.bfloat16:  # the interpreter's bf16 casts do not round as the GPU's do (to nearest even)
        assert_close(s, s_expected.float(), dtype)
        # ... so normalise the sum the kernel formed: an ulp of difference in s, times weights ~N(0, 1)
        # after division by a small std, can pass bf16's tolerance on its own (seen on 1 draw in ~20)
        normalised = s.float()
    else:
        torch.testing.assert_close(s, s_expected, rtol=0, atol=0)  # the same rounding as the unfused Add
        normalised = s_expected.float()
    assert_close(y, F.layer_norm(normalised, (37,), weight.float(), bias.float(), 1e-5), dtype)
    assert_close(layer_norm(x, weight, bias, 1e-5, residual=r), y.float(), dtype)  # without the sum output
    positions = torch.randn(3, 37).to(dtype)  # a broadcast residual: added before the kernel
    assert_close(layer_norm(x, weight, bias, 1e-5, residual=positions),
                 F.layer_norm((x + positions).float(), (37,), weight.float(), bias.float(), 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm(dtype, row_mode):
    x, weight = torch.randn(4, 37).to(dtype), torch.randn(37).to(dtype)
    assert_close(rms_norm(x, weight, 1e-6), rms_reference(x, weight, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_softmax(dtype, row_mode):
    x = (torch.randn(6, 37) * 4).to(dtype)
    assert_close(softmax(x), torch.softmax(x.float(), -1), dtype)
    assert_close(softmax(x, log=True), torch.log_softmax(x.float(), -1), dtype, scale=4.0)  # values up to ~20


def test_layer_norm_without_affine_fp32_params_and_leading_axis():
    x = torch.randn(3, 4, 5, dtype=torch.float16)
    assert_close(layer_norm(x), F.layer_norm(x.float(), (5,)), torch.float16)
    weight, bias = torch.randn(4, 5), torch.randn(4, 5)  # fp32 parameters on fp16 activations
    assert_close(layer_norm(x, weight, bias, 1e-3, axis=1),
                 F.layer_norm(x.float(), (4, 5), weight, bias, 1e-3), torch.float16)
    assert_close(layer_norm(x, None, bias[0], axis=-1),  # bias only
                 F.layer_norm(x.float(), (5,), None, bias[0]), torch.float16)


def test_rms_norm_without_weight_and_non_contiguous_input():
    x = torch.randn(6, 40)[:, ::2]  # row stride 40, column stride 2: copied to unit stride
    assert_close(rms_norm(x), rms_reference(x, torch.ones(20), 1e-6), torch.float32)


def test_layer_norm_constant_row_is_zero_not_nan():
    x = torch.full((2, 19), 3.25)
    assert torch.equal(layer_norm(x), torch.zeros(2, 19))


def test_softmax_masked_rows(row_mode):
    x = torch.randn(3, 37)
    x[0, 5:] = -float("inf")   # attention mask: only 5 keys visible
    x[1, :] = -float("inf")    # everything masked: NaN, as torch
    torch.testing.assert_close(softmax(x), torch.softmax(x, -1), equal_nan=True)


def test_softmax_other_axis_and_strided_rows():
    x = torch.randn(7, 4, 9)
    assert_close(softmax(x, axis=0), torch.softmax(x, 0), torch.float32)
    assert softmax(x, axis=1).is_contiguous()
    rows = torch.randn(5, 64)[:, :33]  # unit stride, row stride 64: no copy needed
    assert_close(softmax(rows), torch.softmax(rows, -1), torch.float32)


def test_empty_and_integer_inputs():
    assert layer_norm(torch.randn(0, 8)).shape == (0, 8)
    assert softmax(torch.randn(3, 0)).shape == (3, 0)
    with pytest.raises(TypeError, match="int64"):
        softmax(torch.arange(6).reshape(2, 3))
