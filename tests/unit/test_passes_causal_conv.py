"""A convolution's last steps cut by a Slice become less end padding (kiln/passes/fusion/causal_conv.py): the rule
fires where it should (golden op counts and pads), refuses what it cannot express, and the engine matches onnxruntime
on the unoptimized model, fresh inputs each time."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from kiln.frontend import onnx as onnx_frontend
from kiln.passes import PassOptions, optimize
from kiln.passes._rewrite import PassReport
from tests.unit.test_passes_cleanup import assert_same_as_onnxruntime, make_model

F = TensorProto.FLOAT
STEPS = 20
rng = np.random.default_rng(11)


def randn(*shape):
    return rng.standard_normal(shape).astype(np.float32)


def causal_block(kernel: int = 3, dilation: int = 2, cut: int | None = None, end: str = "negative",
                 stride: int = 1, start: int = 0) -> onnx.ModelProto:
    """x [2, 4, STEPS] -> Conv (pads (k-1)·d both sides) -> Slice of the last axis [start, -cut) -> Relu -> Conv (the
    same) -> Slice: a TCN block's convolutions. `end`: the Slice's end as -cut ("negative") or as length - cut."""
    pad = (kernel - 1) * dilation
    cut = pad if cut is None else cut
    out_len = (STEPS + 2 * pad - pad - 1) // stride + 1
    x = helper.make_tensor_value_info("x", F, [2, 4, STEPS])
    y = helper.make_tensor_value_info("y", F, None)
    conv = dict(kernel_shape=[kernel], pads=[pad, pad], dilations=[dilation], strides=[stride])
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", **conv),
             helper.make_node("Slice", ["c1", "starts", "ends", "axes", "steps"], ["s1"], name="chomp1"),
             helper.make_node("Relu", ["s1"], ["h"]),
             helper.make_node("Conv", ["h", "w2", "b2"], ["c2"], name="conv2", **{**conv, "strides": [1]}),
             helper.make_node("Slice", ["c2", "starts", "ends2", "axes", "steps"], ["y"], name="chomp2")]
    ends = -cut if end == "negative" else out_len - cut
    h_len = out_len - cut - start
    ends2 = -cut if end == "negative" else h_len + 2 * pad - pad - cut
    inits = [("w1", randn(4, 4, kernel)), ("b1", randn(4)), ("w2", randn(4, 4, kernel)), ("b2", randn(4)),
             ("starts", np.array([start], np.int64)), ("ends", np.array([ends], np.int64)),
             ("ends2", np.array([ends2], np.int64)), ("axes", np.array([2], np.int64)),
             ("steps", np.array([1], np.int64))]
    return make_model(nodes, [x], [y], inits)


def optimized(proto: onnx.ModelProto):
    report = PassReport()
    model = optimize(onnx_frontend.load(proto), PassOptions(), report)
    ops = collections.Counter(f"{n.domain}::{n.op_type}" if n.domain else n.op_type for n in model.graph)
    return model, report, ops


@pytest.mark.parametrize("end", ["negative", "positive"])
def test_chomps_become_end_padding(end):
    model, report, ops = optimized(causal_block(end=end))
    assert report.fired["causal_conv_pads"] == 2
    assert "Slice" not in ops, ops
    convs = [n for n in model.graph if n.op_type in ("Conv", "FusedConv")]
    assert [list(n.attributes["pads"].value) for n in convs] == [[4, 0], [4, 0]]


@pytest.mark.parametrize("kernel, dilation, cut, end", [(3, 1, None, "negative"), (3, 2, None, "positive"),
                                                      (2, 4, None, "negative"), (5, 1, 2, "negative")])
def test_trimmed_convolutions_match_onnxruntime(kernel, dilation, cut, end):
    proto = causal_block(kernel, dilation, cut, end)
    for _ in range(2):
        assert_same_as_onnxruntime(proto, {"x": randn(2, 4, STEPS)}, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case, expected", [({"stride": 2}, "stride 2"), ({"cut": 5}, "past the end padding 4"),
                                            ({"start": 1}, None)])
def test_what_less_padding_cannot_express_is_left_and_still_right(case, expected):
    """Stride 2 (a cut output is not a pad's worth of input), a cut past the padding, a Slice that also cuts the
    start: the Slice stays, the answers are onnxruntime's."""
    proto = causal_block(**case)
    _, report, ops = optimized(proto)
    assert ops["Slice"] >= 1, ops
    if expected:
        assert any(expected in line for line in report.refused), report.refused
    assert_same_as_onnxruntime(proto, {"x": randn(2, 4, STEPS)}, rtol=1e-4, atol=1e-4)
