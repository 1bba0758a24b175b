"""W8A16Conv2d (kiln/kernels/cpu/onednn_int8.py): a 16-bit activation's convolution with int8 weights as two oneDNN
int8 convolutions of its bytes, against onnx.reference running the same quantization as ONNX ops:
QuantizeLinear(x; s, uint16 / int16) -> DequantizeLinear -> Conv(x, DequantizeLinear(w_int8; s_w per channel), b)
[-> Relu | Clip]. The split's 16-bit values must be QuantizeLinear's exactly; the output its float result to float32
rounding: 1e-6 of the output's largest magnitude from a float64 convolution of the same 16-bit values (1e-4 from
onnx.reference's, which sums in float32)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from kiln.kernels.cpu import onednn, onednn_int8
from kiln.kernels.cpu.cpu_features import has_int8_dot_product

pytestmark = pytest.mark.skipif(not onednn.available(), reason="needs oneDNN")
# Both bytes are u8 sources: without VNNI their pair sums saturate past 7-bit weights (pair_overflow_possible), the
# rule kiln keeps there (its weights 7-bit); with VNNI full-range weights
W_MAX = 127 if has_int8_dot_product() else 64


def _reference(x: np.ndarray, s: float, signed: bool, w_q: np.ndarray, w_scale: np.ndarray, bias: np.ndarray,
               stride: list[int], pads: list[int], group: int, activation: str) -> tuple[np.ndarray, np.ndarray]:
    """(QuantizeLinear's 16-bit q, the float output) by onnx.reference."""
    zero = np.array(0, np.int16 if signed else np.uint16)
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["xd"]),
             helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["w"], axis=0),
             helper.make_node("Conv", ["xd", "w", "b"], ["c"], strides=stride, pads=pads, group=group)]
    out = "c"
    if activation == "Relu":
        nodes.append(helper.make_node("Relu", ["c"], ["y"]))
        out = "y"
    elif activation == "Clip":
        nodes.append(helper.make_node("Clip", ["c", "lo", "hi"], ["y"]))
        out = "y"
    inits = [numpy_helper.from_array(np.array(s, np.float32), "s"), numpy_helper.from_array(zero, "z"),
             numpy_helper.from_array(w_q, "wq"), numpy_helper.from_array(w_scale, "ws"),
             numpy_helper.from_array(np.zeros(w_scale.shape, np.int8), "wz"), numpy_helper.from_array(bias, "b"),
             numpy_helper.from_array(np.array(0.0, np.float32), "lo"),
             numpy_helper.from_array(np.array(6.0, np.float32), "hi")]
    graph = helper.make_graph(nodes, "w8a16", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
                              [helper.make_tensor_value_info("q", TensorProto.INT16 if signed else TensorProto.UINT16,
                                                             x.shape),
                               helper.make_tensor_value_info(out, TensorProto.FLOAT, None)], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    q, y = ReferenceEvaluator(model).run(None, {"x": x})
    return q, y


CASES = [  # (input NCHW, out channels, kernel, stride, pads, group, signed, activation)
    ((1, 16, 9, 11), 24, 1, [1, 1], [0, 0, 0, 0], 1, False, "Clip"),  # a projection of a ReLU6 output
    ((2, 24, 8, 8), 144, 1, [1, 1], [0, 0, 0, 0], 1, True, "Clip"),  # an expansion of the (signed) residual stream
    ((1, 32, 10, 10), 32, 3, [2, 2], [1, 1, 1, 1], 32, False, "Clip"),  # depthwise, stride 2
    ((1, 3, 17, 17), 8, 3, [2, 2], [1, 1, 1, 1], 1, True, "Relu"),  # a stem on a normalised image
    ((1, 960, 3, 3), 40, 1, [1, 1], [0, 0, 0, 0], 1, False, ""),  # K = 960: the 16-bit sum passes 2^31
]


@pytest.mark.parametrize("shape, out, kernel, stride, pads, group, signed, activation", CASES)
def test_w8a16_conv_equals_onnx_reference(shape, out, kernel, stride, pads, group, signed, activation):
    rng = np.random.default_rng(sum(shape) + out)
    x = rng.standard_normal(shape).astype(np.float32) * 2
    if not signed:
        x = np.clip(x, 0, 6)
    w = rng.standard_normal((out, shape[1] // group, kernel, kernel)).astype(np.float32)
    w_scale = (np.abs(w).max(axis=(1, 2, 3)) / W_MAX).astype(np.float32)
    w_q = np.clip(np.round(w / w_scale[:, None, None, None]), -W_MAX, W_MAX).astype(np.int8)
    bias = rng.standard_normal(out).astype(np.float32)
    amax = float(np.abs(x).max())
    s = np.float32(amax / (32767 if signed else 65535))
    if shape[1] == 960:  # every activation at its largest step: the accumulator's worst case
        x = np.full(shape, 65535 * s, np.float32)
        w_q[:] = W_MAX
    want_q, want = _reference(x, float(s), signed, w_q, w_scale, bias, stride, pads, group, activation)
    conv = onednn_int8.W8A16Conv2d(torch.from_numpy(w_q), torch.from_numpy(w_scale), torch.from_numpy(bias),
                                   list(shape), stride, pads, [1, 1], group, float(s), signed,
                                   activation=activation, alpha=0.0, beta=6.0)
    hi, lo = conv.split(torch.from_numpy(x))
    q = 256 * hi.to(torch.int64) + lo.to(torch.int64) - (32768 if signed else 0)
    np.testing.assert_array_equal(q.numpy(), want_q.astype(np.int64))
    got = conv(hi, lo)
    assert got.is_contiguous(memory_format=torch.channels_last) and got.dtype == torch.float32
    assert list(got.shape) == list(want.shape)
    scale = max(float(np.abs(want).max()), 1e-30)
    # onnx.reference's Conv sums in float32 (960 equal terms: 1.3e-5 off); float64 on the same 16-bit values: tight
    err = float(np.abs(got.numpy().astype(np.float64) - want.astype(np.float64)).max()) / scale
    assert err <= 1e-4, err
    exact = torch.nn.functional.conv2d(q.double() * float(s), torch.from_numpy(w_q).double() *
                                       torch.from_numpy(w_scale).double().reshape(-1, 1, 1, 1),
                                       torch.from_numpy(bias).double(), stride, pads[:2], 1, group)
    exact = exact.clamp(0, 6) if activation == "Clip" else exact.clamp_min(0) if activation == "Relu" else exact
    err64 = float((got.double() - exact).abs().max() / exact.abs().max().clamp_min(1e-30))
    assert err64 <= 1e-6, err64
    # and far closer to the float layer than the int8 input would be
    int8_step = amax / (127 if signed else 255)
    assert np.abs(q.numpy() * float(s) - x).max() <= 0.51 * float(s) < int8_step / 100


def test_w8a16_conv_accumulates_past_int32_where_one_convolution_could_not():
    """K = 960 at q = 65535 and w = 127: Σ q·w = 7.99e9 > 2^31; each byte's convolution stays within int32."""
    terms = 960 * 65535 * 127
    assert terms > 2**31 - 1 and 960 * 255 * 127 * 256 > 2**31 - 1 > 960 * 255 * 127
