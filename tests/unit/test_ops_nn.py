"""Convolution, pooling, resize/sampling and quantization ops against an independent oracle.

Each case builds a one-node ONNX model, feeds fresh random inputs (seeded per case) through
`kiln.build(model).run(feeds)` and through onnxruntime (CPU), or `onnx.reference.ReferenceEvaluator`
where the case asks for it (onnxruntime has no kernel for the op/opset/type, or rounds its own way).
Integers compare exactly; floats with the per-dtype tolerances below.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest

from tests.unit.oracle import Case, case_node, case_rng, check, const, feeds, infer_outputs, one_node_model

# (rtol, atol) per output dtype; integers compare exactly.
TOLERANCE = {
    np.dtype(np.float64): (1e-12, 1e-12),
    np.dtype(np.float32): (1e-5, 1e-5),
    np.dtype(np.float16): (1e-3, 1e-3),
}


def f32(*shape, lo=-3.0, hi=3.0):
    return lambda rng: rng.uniform(lo, hi, shape).astype(np.float32)


def f16(*shape, lo=-3.0, hi=3.0):
    return lambda rng: rng.uniform(lo, hi, shape).astype(np.float16)


def ints_of(dtype, *shape, lo=None, hi=None):
    if lo is None or hi is None:
        info = np.iinfo(dtype)
        lo = info.min if lo is None else lo
        hi = info.max if hi is None else hi
    return lambda rng: rng.integers(lo, hi + 1, shape).astype(dtype)


def conv(id, x, w, b=None, **attrs):
    return Case(f"Conv-{id}", "Conv", feeds(f32(*x), f32(*w), f32(b) if b else None), attrs)


def conv_t(id, x, w, b=None, **attrs):
    return Case(f"ConvTranspose-{id}", "ConvTranspose",
                feeds(f32(*x), f32(*w), f32(b) if b else None), attrs)


def pool(op, id, x=(2, 3, 9, 8), opset=19, outputs=1, make=f32, **attrs):
    return Case(f"{op}-{id}", op, feeds(make(*x)), attrs, opset=opset, outputs=outputs)


def resize(id, x=(1, 2, 5, 6), scales=None, sizes=None, roi=None, opset=19, **attrs):
    makers = [f32(*x), const(roi) if roi is not None else None,
              const(scales) if scales is not None else None,
              const(sizes, np.int64) if sizes is not None else None]
    return Case(f"Resize-{id}", "Resize", feeds(*makers), attrs, opset=opset)


def grid(id, x=(2, 3, 5, 6), g=(2, 4, 7, 2), opset=16, **attrs):
    return Case(f"GridSample-{id}", "GridSample", feeds(f32(*x), f32(*g, lo=-1.2, hi=1.2)), attrs,
                opset=opset)


def _unpool_feeds(rng):
    # kernel 2, stride 2 on a 4x6 plane: one distinct index per window, global N*C*H*W layout.
    x = rng.standard_normal((2, 3, 2, 3)).astype(np.float32)
    oh, ow = np.meshgrid(np.arange(2), np.arange(3), indexing="ij")
    dy, dx = rng.integers(0, 2, (2, 3, 2, 3)), rng.integers(0, 2, (2, 3, 2, 3))
    plane = (oh * 2 + dy) * 6 + ow * 2 + dx
    nc = np.arange(6).reshape(2, 3, 1, 1) * 24
    return [x, (plane + nc).astype(np.int64)]


def _deform_feeds(rng, mask=False):
    # 6x5 input, 3x3 kernel, pads [1, 0, 1, 1], stride 2 -> 3x2 output positions
    out = [f32(2, 4, 6, 5)(rng), f32(6, 2, 3, 3)(rng), f32(2, 2 * 2 * 9, 3, 2, lo=-1.5, hi=1.5)(rng),
           f32(6)(rng)]
    if mask:
        out.append(f32(2, 2 * 9, 3, 2, lo=0.0, hi=1.0)(rng))
    return out


U8, I8 = np.uint8, np.int8

CASES = [
    # Conv
    conv("2d", (2, 3, 9, 8), (4, 3, 3, 3), 4),
    conv("2d-asym-pads-strides", (1, 3, 10, 9), (5, 3, 3, 2), pads=[1, 0, 2, 1], strides=[2, 3]),
    conv("2d-dilations-group", (2, 4, 11, 10), (6, 2, 3, 3), 6, dilations=[2, 3], group=2),
    conv("2d-depthwise", (1, 4, 7, 7), (4, 1, 3, 3), group=4, pads=[1, 1, 1, 1]),
    conv("2d-same-upper", (1, 2, 7, 8), (3, 2, 4, 3), auto_pad="SAME_UPPER", strides=[2, 2]),
    conv("2d-same-lower", (1, 2, 7, 8), (3, 2, 4, 3), auto_pad="SAME_LOWER", strides=[2, 3]),
    conv("2d-valid", (1, 2, 7, 8), (3, 2, 3, 3), auto_pad="VALID", strides=[2, 2]),
    conv("1d", (2, 3, 12), (4, 3, 5), 4, pads=[2, 1], strides=[2]),
    conv("3d", (1, 2, 5, 6, 7), (3, 2, 3, 2, 3), 3, pads=[1, 0, 1, 0, 1, 1], dilations=[1, 2, 1]),
    # ConvTranspose
    conv_t("2d", (2, 3, 5, 4), (3, 4, 3, 3), 4),
    conv_t("2d-strides-output-padding", (1, 2, 4, 5), (2, 3, 3, 2), strides=[3, 2],
           output_padding=[1, 1], pads=[1, 0, 0, 1]),
    conv_t("2d-output-shape", (1, 2, 4, 5), (2, 3, 3, 3), strides=[2, 2], output_shape=[9, 11]),
    conv_t("2d-same-upper", (1, 2, 4, 5), (2, 3, 3, 3), strides=[2, 2], auto_pad="SAME_UPPER"),
    conv_t("2d-group-dilations", (1, 4, 5, 5), (4, 3, 3, 2), 6, group=2, dilations=[2, 1]),
    conv_t("1d", (2, 3, 6), (3, 2, 4), strides=[2], pads=[1, 2]),
    conv_t("3d", (1, 2, 3, 4, 3), (2, 2, 2, 3, 2), strides=[2, 1, 2]),
    Case("ConvInteger-zero-points", "ConvInteger",
         feeds(ints_of(U8, 1, 3, 7, 6), ints_of(U8, 4, 3, 3, 3), const(120, U8), const(7, U8)),
         {"pads": [1, 1, 0, 1]}),
    Case("DeformConv-groups-bias", "DeformConv", _deform_feeds,
         {"group": 2, "offset_group": 2, "pads": [1, 0, 1, 1], "strides": [2, 2]}, opset=19,
         oracle="ref"),
    Case("DeformConv-mask", "DeformConv", lambda rng: _deform_feeds(rng, mask=True),
         {"group": 2, "offset_group": 2, "pads": [1, 0, 1, 1], "strides": [2, 2]}, opset=19,
         oracle="ref"),
    # Pools
    pool("MaxPool", "2d-ceil-pads", kernel_shape=[3, 3], strides=[2, 2], pads=[1, 0, 1, 1], ceil_mode=1),
    pool("MaxPool", "2d-dilations", kernel_shape=[2, 3], dilations=[2, 2], strides=[1, 2]),
    pool("MaxPool", "2d-same-upper", kernel_shape=[3, 2], strides=[2, 2], auto_pad="SAME_UPPER"),
    pool("MaxPool", "2d-indices", kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], outputs=2),
    pool("MaxPool", "2d-indices-col-major", kernel_shape=[2, 3], strides=[2, 1], storage_order=1,
         outputs=2),
    pool("MaxPool", "3d", x=(1, 2, 5, 6, 7), kernel_shape=[2, 3, 2], strides=[2, 2, 1], ceil_mode=1),
    pool("MaxPool", "2d-uint8", kernel_shape=[3, 3], pads=[1, 1, 1, 1], make=lambda *s: ints_of(U8, *s)),
    pool("AveragePool", "2d-exclude-pad", kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 0]),
    pool("AveragePool", "2d-include-pad", kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 0],
         count_include_pad=1),
    pool("AveragePool", "2d-ceil", kernel_shape=[3, 2], strides=[2, 3], ceil_mode=1),
    pool("AveragePool", "2d-ceil-include-pad", kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1],
         ceil_mode=1, count_include_pad=1),
    pool("AveragePool", "2d-dilations", kernel_shape=[2, 2], dilations=[2, 3], strides=[1, 1]),
    pool("AveragePool", "2d-same-lower", kernel_shape=[3, 3], strides=[2, 2], auto_pad="SAME_LOWER"),
    pool("AveragePool", "2d-float16", kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], make=f16),
    pool("MaxPool", "2d-float16", kernel_shape=[3, 2], strides=[2, 1], ceil_mode=1, make=f16),
    Case("Conv-2d-float16", "Conv", feeds(f16(1, 3, 8, 7, lo=-1, hi=1), f16(4, 3, 3, 3, lo=-1, hi=1)),
         {"pads": [1, 1, 1, 1]}),
    pool("AveragePool", "1d", x=(2, 3, 11), kernel_shape=[4], strides=[3], pads=[1, 2]),
    pool("LpPool", "2d-p2", kernel_shape=[3, 2], strides=[2, 1], pads=[1, 0, 0, 1]),
    pool("LpPool", "2d-p3", kernel_shape=[2, 2], p=3, strides=[2, 2]),
    pool("GlobalAveragePool", "2d"),
    pool("GlobalMaxPool", "3d", x=(2, 3, 4, 5, 3)),
    pool("GlobalLpPool", "2d-p3", p=3),
    Case("MaxUnpool-2d", "MaxUnpool", _unpool_feeds, {"kernel_shape": [2, 2], "strides": [2, 2]}),
    Case("Col2Im-2d", "Col2Im",
         feeds(f32(2, 3 * 4, 9), const([6, 7], np.int64), const([2, 2], np.int64)),
         {"strides": [2, 2], "pads": [1, 0, 0, 1], "dilations": [1, 2]}, opset=18, oracle="ref"),
    # Resize
    *[resize(f"nearest-{nm}-{cm}", scales=[1, 1, 2.0, 3.0], mode="nearest", nearest_mode=nm,
             coordinate_transformation_mode=cm)
      for nm in ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")
      for cm in ("half_pixel", "asymmetric", "align_corners")],
    # Where scale * size is not an integer, onnxruntime measures align_corners on the rounded
    # output length and rounds float32 ties its own way; the ONNX reference (the spec) uses the
    # unrounded length in float64, as the conformance data does.
    *[Case(c.id + "-fractional-scale", "Resize", c.feeds, c.attrs, opset=19, oracle="ref") for c in [
        resize(f"nearest-{nm}-{cm}", scales=[1, 1, 2.5, 1.7], mode="nearest", nearest_mode=nm,
               coordinate_transformation_mode=cm)
        for nm in ("round_prefer_floor", "round_prefer_ceil")
        for cm in ("half_pixel", "align_corners")]],
    resize("nearest-down-sizes", sizes=[1, 2, 3, 4], mode="nearest"),
    resize("linear-half-pixel-up", scales=[1, 1, 2.0, 1.5], mode="linear"),
    resize("linear-align-corners", sizes=[1, 2, 9, 4], mode="linear",
           coordinate_transformation_mode="align_corners"),
    resize("linear-pytorch-half-pixel", sizes=[1, 2, 3, 1], mode="linear",
           coordinate_transformation_mode="pytorch_half_pixel"),
    resize("linear-antialias-down", x=(1, 2, 12, 13), scales=[1, 1, 0.4, 0.6], mode="linear",
           antialias=1),
    resize("cubic-up", scales=[1, 1, 1.6, 2.2], mode="cubic"),
    resize("cubic-down-antialias", x=(1, 2, 12, 11), sizes=[1, 2, 5, 4], mode="cubic", antialias=1),
    resize("cubic-exclude-outside", scales=[1, 1, 0.8, 1.4], mode="cubic", exclude_outside=1,
           cubic_coeff_a=-0.5),
    resize("sizes-not-larger", sizes=[7, 9], axes=[2, 3], mode="linear",
           keep_aspect_ratio_policy="not_larger"),
    resize("sizes-not-smaller", sizes=[7, 9], axes=[2, 3], mode="nearest",
           keep_aspect_ratio_policy="not_smaller"),
    resize("axes-3-2", scales=[1.5, 0.8], axes=[3, 2], mode="linear"),
    resize("tf-crop-and-resize", sizes=[1, 2, 4, 5], roi=[0, 0, 0.2, -0.1, 1, 1, 0.9, 1.3],
           mode="linear", coordinate_transformation_mode="tf_crop_and_resize",
           extrapolation_value=7.5),
    # Sampling
    *[grid(f"{m}-{p}-ac{a}", mode=m, padding_mode=p, align_corners=a)
      for m in ("bilinear", "nearest", "bicubic") for p in ("zeros", "border", "reflection")
      for a in (0, 1)],
    grid("3d-linear-opset20", x=(1, 2, 4, 5, 3), g=(1, 3, 2, 4, 3), opset=20, mode="linear",
         padding_mode="border"),
    Case("AffineGrid-2d", "AffineGrid", feeds(f32(2, 2, 3), const([2, 3, 5, 6], np.int64)),
         {"align_corners": 0}, opset=20, oracle="ref"),
    Case("AffineGrid-3d-ac", "AffineGrid", feeds(f32(2, 3, 4), const([2, 1, 3, 4, 5], np.int64)),
         {"align_corners": 1}, opset=20, oracle="ref"),
    # Quantization
    Case("QuantizeLinear-uint8", "QuantizeLinear", feeds(f32(3, 4, 5, lo=-40, hi=40), const(0.13),
                                                        const(128, U8))),
    Case("QuantizeLinear-int8-per-axis", "QuantizeLinear",
         feeds(f32(3, 4, 5, lo=-40, hi=40), f32(4, lo=0.05, hi=0.5), ints_of(I8, 4, lo=-5, hi=5)),
         {"axis": 1}),
    Case("QuantizeLinear-int8-blocked", "QuantizeLinear",
         feeds(f32(3, 8, lo=-40, hi=40), f32(3, 3, lo=0.05, hi=0.5), ints_of(I8, 3, 3, lo=-5, hi=5)),
         {"axis": 1, "block_size": 3}, oracle="ref"),
    Case("QuantizeLinear-int16-output-dtype", "QuantizeLinear",
         feeds(f32(3, 4, lo=-400, hi=400), const(0.01)), {"output_dtype": onnx.TensorProto.INT16},
         oracle="ref"),
    Case("QuantizeLinear-int4", "QuantizeLinear",
         feeds(f32(3, 4, lo=-3, hi=3), const(0.3), const(1, ml_dtypes.int4)), oracle="ref"),
    Case("QuantizeLinear-float8e4m3fn", "QuantizeLinear",
         feeds(f32(3, 4, lo=-900, hi=900), const(1.5), const(0, ml_dtypes.float8_e4m3fn)),
         oracle="ref"),
    Case("DequantizeLinear-uint8", "DequantizeLinear",
         feeds(ints_of(U8, 3, 4, 5), const(0.13), const(128, U8))),
    Case("DequantizeLinear-int8-per-axis", "DequantizeLinear",
         feeds(ints_of(I8, 3, 4, 5), f32(5, lo=0.05, hi=0.5), ints_of(I8, 5, lo=-5, hi=5)), {"axis": -1}),
    Case("DequantizeLinear-int8-blocked", "DequantizeLinear",
         feeds(ints_of(I8, 4, 6), f32(2, 6, lo=0.05, hi=0.5), ints_of(I8, 2, 6, lo=-5, hi=5)),
         {"axis": 0, "block_size": 2}, oracle="ref"),
    Case("DequantizeLinear-int4", "DequantizeLinear",
         feeds(ints_of(ml_dtypes.int4, 3, 4, lo=-8, hi=7), const(0.3), const(-2, ml_dtypes.int4)),
         oracle="ref"),
    Case("DequantizeLinear-float8e5m2", "DequantizeLinear",
         lambda rng: [rng.uniform(-100, 100, (3, 4)).astype(ml_dtypes.float8_e5m2),
                      np.asarray(0.5, np.float32)], oracle="ref"),
    Case("DynamicQuantizeLinear", "DynamicQuantizeLinear", feeds(f32(3, 4, 5, lo=-2, hi=7)),
         outputs=3),
    Case("MatMulInteger-zero-points", "MatMulInteger",
         feeds(ints_of(U8, 2, 5, 7), ints_of(I8, 7, 3), const(3, U8), ints_of(I8, 3, lo=-4, hi=4))),
    Case("QLinearMatMul-uint8", "QLinearMatMul",
         feeds(ints_of(U8, 4, 6), const(0.05), const(120, U8), ints_of(U8, 6, 3), const(0.03),
               const(110, U8), const(0.2), const(128, U8)), opset=10, oracle="ref"),
    Case("QLinearMatMul-int8-3d", "QLinearMatMul",
         feeds(ints_of(I8, 2, 4, 6), const(0.05), const(3, I8), ints_of(I8, 6, 3), const(0.03),
               const(-2, I8), const(0.4), const(5, I8)), opset=21, oracle="ref"),
    Case("QLinearConv-per-channel", "QLinearConv",
         feeds(ints_of(U8, 1, 3, 7, 6), const(0.02), const(128, U8), ints_of(I8, 4, 3, 3, 3, lo=-60, hi=60),
               f32(4, lo=0.01, hi=0.05), const([0, 0, 0, 0], I8), const(0.15), const(100, U8),
               ints_of(np.int32, 4, lo=-500, hi=500)),
         {"pads": [1, 1, 1, 1], "strides": [2, 1]}, opset=10, oracle="ref"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_op_matches_oracle(case: Case) -> None:
    node, values = case_node(case, case.feeds(case_rng(case.id)))
    # ONNX shape inference gives the output types the graph must declare.
    model = infer_outputs(one_node_model(node, values, opset=case.opset))
    check(model, values, TOLERANCE, case.oracle, case.id)
