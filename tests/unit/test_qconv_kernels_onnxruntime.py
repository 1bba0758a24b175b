"""kiln's 8-bit convolution kernels against onnxruntime's QLinearConv, one layer at a time.

The oracle is onnxruntime (MLAS's integer convolutions) on a one-node QLinearConv model with the same quantized
tensors: per-channel int8 weights, an int32 bias, uint8 (or int8) activations with zero points. kiln's kernels:

- qdepthwise.c (cpu.qconv.kiln_dw): 3x3 depthwise at strides 1 and 2 (MobileNetV2's), channel counts on and off the
  16-channel pair of vectors, the 8-channel vector and the scalar tail, uneven padding, a 5x5 and a stride-3 layer
  (the run-time geometry), weights over the whole int8 range;
- i8gemm.c on NHWC rows (cpu.qconv.kiln_i8): the 1x1 layers of MobileNetV2's widths, the 16- and 24-channel
  projections (panels of 2 and 3 vectors on 6- and 4-row tiles) with row counts off those tiles, 7-bit weights
  (reduce_range, what the kernel is offered);
- ReLU6 fused (Clip(0, 6)): onnxruntime's output clamped in the quantized domain to [q(0), q(6)], what the Q/DQ
  model's Clip folded into the output range means.

Outputs are equal except where the requantization's product lands within float32 rounding of a tie: both round
half to even after one float multiply, but onnxruntime forms x_scale·w_scale / y_scale in float32 steps and kiln
rounds the float64 value once, so a product at k + 0.5 ± 1 ulp may go either way: one step, on at most 1% of the
values (+2). Run natively (AVX-512 builds) and under KILN_CPU_ISA=avx2 (the AVX2 builds).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from kiln.kernels.cpu import i8gemm, qdepthwise
from tests.unit.oracle import case_rng

ort = pytest.importorskip("onnxruntime")

X_SCALE, Y_SCALE = 0.02, 0.037  # 6 / 0.037 = 162.16: the ReLU6 bound is no tie


def _qlinearconv(x: np.ndarray, x_zero: int, w: np.ndarray, w_scale: np.ndarray, bias: np.ndarray, y_zero: int,
                 strides: list[int], pads: list[int], group: int) -> np.ndarray:
    """onnxruntime's QLinearConv of NCHW x (uint8/int8), w [O, C/group, KH, KW] int8 per channel -> NCHW y, the x's
    dtype. pads [top, left, bottom, right] (ONNX's order: begins, then ends)."""
    x_type = TensorProto.UINT8 if x.dtype == np.uint8 else TensorProto.INT8
    initializers = [numpy_helper.from_array(np.array(X_SCALE, np.float32), "x_scale"),
                    numpy_helper.from_array(np.array(x_zero, x.dtype), "x_zero"),
                    numpy_helper.from_array(w, "w"), numpy_helper.from_array(w_scale.astype(np.float32), "w_scale"),
                    numpy_helper.from_array(np.zeros(w.shape[0], np.int8), "w_zero"),
                    numpy_helper.from_array(np.array(Y_SCALE, np.float32), "y_scale"),
                    numpy_helper.from_array(np.array(y_zero, x.dtype), "y_zero"),
                    numpy_helper.from_array(bias.astype(np.int32), "bias")]
    node = helper.make_node("QLinearConv", ["x", "x_scale", "x_zero", "w", "w_scale", "w_zero", "y_scale", "y_zero",
                                            "bias"], ["y"], group=group, strides=strides,
                            pads=[pads[0], pads[1], pads[2], pads[3]], kernel_shape=list(w.shape[2:]))
    graph = helper.make_graph([node], "qlinearconv", [helper.make_tensor_value_info("x", x_type, list(x.shape))],
                              [helper.make_tensor_value_info("y", x_type, None)], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def _relu6(y: np.ndarray, y_zero: int) -> np.ndarray:
    """Clip(0, 6) on a quantized tensor: the values of 0 and 6 quantized, the bounds."""
    return np.clip(y.astype(np.int32), y_zero, y_zero + round(6.0 / Y_SCALE))


def _assert_equal_but_ties(got: np.ndarray, want: np.ndarray) -> None:
    diff = np.abs(got.astype(np.int32) - want.astype(np.int32))
    assert diff.max() <= 1, f"{int(diff.max())} steps apart at {np.unravel_index(diff.argmax(), diff.shape)}"
    assert (diff > 0).sum() <= diff.size // 100 + 2, f"{int((diff > 0).sum())} of {diff.size} values a step apart"


def _inputs(rng, shape, w_shape, w_range, dtype):
    lo, hi = (0, 256) if dtype == np.uint8 else (-128, 128)
    x = rng.integers(lo, hi, shape).astype(dtype)
    x.reshape(-1)[:2] = [lo, hi - 1]
    x_zero = int(rng.integers(lo, hi))
    w = rng.integers(-w_range, w_range, w_shape).astype(np.int8)
    w.reshape(-1)[:2] = [-w_range, w_range - 1]
    w_scale = rng.uniform(2e-3, 2e-2, w_shape[0]).astype(np.float32)
    bias = rng.integers(-3000, 3000, w_shape[0]).astype(np.int32)
    y_zero = int(rng.integers(0, 30)) if dtype == np.uint8 else int(rng.integers(-20, 20))
    return x, x_zero, w, w_scale, bias, y_zero


DEPTHWISE = [  # (input [N, C, H, W], kernel, stride, pads [t, l, b, r], source)
    ((1, 32, 17, 15), 3, 1, [1, 1, 1, 1], np.uint8),  # two vectors a block; 15 = 3 blocks of 4 + 3
    ((1, 96, 14, 13), 3, 2, [1, 1, 1, 1], np.uint8),  # stride 2: the even-column pairs
    ((2, 40, 9, 11), 3, 2, [0, 1, 1, 0], np.uint8),  # 40 = 2 vectors + 1, batch 2, uneven padding
    ((1, 37, 8, 8), 3, 1, [1, 1, 1, 1], np.uint8),  # the scalar tail (37 = 4 vectors + 5)
    ((1, 24, 10, 10), 3, 1, [1, 1, 1, 1], np.int8),  # an int8 source
    ((1, 16, 11, 11), 5, 2, [2, 2, 2, 2], np.uint8),  # 5x5: 3 tap pairs a row, the last half empty
    ((1, 16, 12, 10), 3, 3, [0, 0, 0, 0], np.uint8),  # stride 3: pairs at every column, the run-time geometry
]


@pytest.mark.parametrize("relu6", [False, True])
@pytest.mark.parametrize("shape, k, stride, pads, dtype", DEPTHWISE)
def test_the_int8_depthwise_kernel_is_onnxruntimes_qlinearconv(shape, k, stride, pads, dtype, relu6):
    rng = case_rng(f"dw ort {shape} {k} {stride} {pads} {dtype} {relu6}")
    n, c, h, w_ = shape
    x, x_zero, w, w_scale, bias, y_zero = _inputs(rng, shape, (c, 1, k, k), 128, dtype)
    want = _qlinearconv(x, x_zero, w, w_scale, bias, y_zero, [stride, stride], pads, c)
    if relu6:
        want = _relu6(want, y_zero)
    t_dtype = torch.uint8 if dtype == np.uint8 else torch.int8
    layer = qdepthwise.QDepthwiseConv(torch.from_numpy(w), torch.from_numpy(w_scale), torch.from_numpy(bias), shape,
                                      [stride, stride], pads, t_dtype, X_SCALE, x_zero, (t_dtype, Y_SCALE, y_zero),
                                      *(("Clip", 0.0, 6.0) if relu6 else ("", 0.0, 0.0)))
    got = layer(torch.from_numpy(x).contiguous(memory_format=torch.channels_last))
    _assert_equal_but_ties(got.contiguous().numpy(), want)


POINTWISE = [  # (input [N, C, H, W], output channels, ReLU6, source)
    ((1, 32, 11, 13), 16, False, np.uint8),  # 143 rows: 23 tiles of 6 + 5, a 2-vector panel
    ((2, 96, 7, 7), 24, False, np.uint8),  # a 3-vector panel on 4-row tiles, 98 rows
    ((1, 144, 9, 9), 24, False, np.uint8),
    ((1, 16, 13, 13), 96, True, np.uint8),  # K = 16, 3 whole panels
    ((1, 24, 9, 10), 144, True, np.uint8),  # 144 = 4 panels + 2 vectors
    ((1, 40, 5, 7), 40, True, np.int8),  # K off 32, a 1-vector panel; an int8 source (flipped to uint8)
]


@pytest.mark.parametrize("shape, o, relu6, dtype", POINTWISE)
def test_the_1x1_kernel_on_nhwc_rows_is_onnxruntimes_qlinearconv(shape, o, relu6, dtype):
    rng = case_rng(f"1x1 ort {shape} {o} {relu6} {dtype}")
    n, c, h, w_ = shape
    x, x_zero, w, w_scale, bias, y_zero = _inputs(rng, shape, (o, c, 1, 1), 64, dtype)  # 7-bit: reduce_range
    want = _qlinearconv(x, x_zero, w, w_scale, bias, y_zero, [1, 1], [0, 0, 0, 0], 1)
    if relu6:
        want = _relu6(want, y_zero)
    t_dtype = torch.uint8 if dtype == np.uint8 else torch.int8
    rows = n * h * w_
    gemm = i8gemm.I8Gemm(torch.from_numpy(w.reshape(o, c)), torch.from_numpy(w_scale), torch.from_numpy(bias), rows,
                         t_dtype, X_SCALE, x_zero, (t_dtype, Y_SCALE, y_zero),
                         *(("Clip", 0.0, 6.0) if relu6 else ("", 0.0, 0.0)))
    got = gemm(torch.from_numpy(x).permute(0, 2, 3, 1).reshape(rows, c))  # [N·H·W, O]
    _assert_equal_but_ties(got.numpy(), want.transpose(0, 2, 3, 1).reshape(rows, o))


@pytest.mark.parametrize("y_dtype, y_zero", [(torch.uint8, 0), (torch.uint8, 11), (torch.int8, -7)])
@pytest.mark.parametrize("activation, alpha, beta, y_scale", [
    ("Clip", 0.0, 6.0, 6.0 / 255),  # ReLU6 into [0, 6]: the saturation is the clamp (ON_WORDS)
    ("Clip", -0.5, 2.0, 0.03),  # bounds inside the range: the words clamped (ON_WORDS_CLAMPED)
    ("Relu", 0.0, 0.0, 0.05),
    ("", 0.0, 0.0, 0.05),
])
@pytest.mark.parametrize("stride", [1, 2])
def test_the_depthwise_activation_on_packed_words_is_the_float_one(stride, activation, alpha, beta, y_scale, y_dtype,
                                                                   y_zero):
    """qdepthwise.c's AVX2 epilogue with Relu/Clip on the rounded int16 words (the plan bounded: the default here)
    against the same layer with them on the floats (bounded cleared): equal on every value (requantize.py: a
    monotone map commutes with a clamp). Natively (AVX-512) both take the floats."""
    rng = case_rng(f"dw words {stride} {activation} {alpha} {beta} {y_scale} {y_dtype} {y_zero}")
    shape = (1, 48, 11, 10)
    x, x_zero, w, w_scale, bias, _ = _inputs(rng, shape, (48, 1, 3, 3), 128, np.uint8)
    layers = [qdepthwise.QDepthwiseConv(torch.from_numpy(w), torch.from_numpy(w_scale), torch.from_numpy(bias), shape,
                                        [stride, stride], [1, 1, 1, 1], torch.uint8, X_SCALE, x_zero,
                                        (y_dtype, y_scale, y_zero), activation, alpha, beta) for _ in range(2)]
    assert layers[0].fields["bounded"] == 1
    layers[1].fields["bounded"] = 0  # read when its plan is made, on the first call
    xt = torch.from_numpy(x).contiguous(memory_format=torch.channels_last)
    words, floats = (layer(xt) for layer in layers)
    assert torch.equal(words, floats)
    assert int(words.max()) > int(words.min())
