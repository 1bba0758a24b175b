"""1-D convolutions as 2-D ones of height 1 (kiln/passes/fusion/conv1d.py): the rules fire where they
should (golden op counts), refuse what they cannot express, and the engine matches onnxruntime on
the unoptimized model."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import kiln
from kiln import zoo
from kiln.frontend import onnx as onnx_frontend
from kiln.passes import PassOptions, optimize
from kiln.passes._rewrite import PassReport
from kiln.runtime.native import Segment
from tests.unit.test_passes_cleanup import assert_same_as_onnxruntime, make_model

F = TensorProto.FLOAT
rng = np.random.default_rng(7)


def randn(*shape):
    return rng.standard_normal(shape).astype(np.float32)


def optimized_for_cpu(proto: onnx.ModelProto):
    report = PassReport()
    model = optimize(onnx_frontend.load(proto), PassOptions(cpu_rules=True), report)
    ops = collections.Counter(f"{n.domain}::{n.op_type}" if n.domain else n.op_type for n in model.graph)
    return model, report, ops


def temporal_block(auto_pad: str | None = None, keepdims: int = 0) -> onnx.ModelProto:
    """x [2, 20, 6] (batch, steps, features) -> Transpose -> Conv1d k5 s2 (asymmetric pads) + BN + Relu ->
    grouped dilated Conv1d + residual Add -> mean over time -> Gemm: a sensor classifier in small."""
    x = helper.make_tensor_value_info("x", F, [2, 20, 6])
    y = helper.make_tensor_value_info("y", F, [2, 3] if not keepdims else [2, 8, 1])
    first = {"auto_pad": auto_pad} if auto_pad else {"pads": [2, 1]}
    nodes = [
        helper.make_node("Transpose", ["x"], ["t"], perm=[0, 2, 1]),
        helper.make_node("Conv", ["t", "w1"], ["c1"], kernel_shape=[5], strides=[2], name="conv1", **first),
        helper.make_node("BatchNormalization", ["c1", "gamma", "beta", "mean", "var"], ["bn"], epsilon=1e-3),
        helper.make_node("Relu", ["bn"], ["h"]),
        helper.make_node("Conv", ["h", "w2", "b2"], ["c2"], pads=[2, 2], dilations=[2], group=2, name="conv2"),
        helper.make_node("Add", ["c2", "h"], ["s"]),
        helper.make_node("ReduceMean", ["s", "axes"], ["m"], keepdims=keepdims),
    ]
    inits = [("w1", randn(8, 6, 5)), ("gamma", rng.uniform(0.5, 2, 8).astype(np.float32)), ("beta", randn(8)),
             ("mean", randn(8)), ("var", rng.uniform(0.5, 2, 8).astype(np.float32)), ("w2", randn(8, 4, 3)),
             ("b2", randn(8)), ("axes", np.array([-1], np.int64))]
    if keepdims:
        nodes[-1].output[0] = "y"
    else:
        nodes.append(helper.make_node("Gemm", ["m", "wh", "bh"], ["y"], transB=1))
        inits += [("wh", randn(3, 8)), ("bh", randn(3))]
    return make_model(nodes, [x], [y], inits)


def test_conv1d_stack_becomes_2d_layers_with_nothing_between():
    _, report, ops = optimized_for_cpu(temporal_block())
    assert report.fired["conv1d_as_conv2d"] == 2 and report.fired["conv1d_mean_as_global_pool"] == 1
    # the head's Transpose and Unsqueeze are one Relayout (fuse_relayout: [B, T, C] -> [B, C, 1, T], whose NHWC
    # memory is the input's own rows); the Squeeze between the layers and before the mean are gone
    assert ops == {"kiln::Relayout": 1, "kiln::FusedConv": 2, "ReduceMean": 1, "Reshape": 1,
                   "kiln::FusedGemm": 1}, ops


def test_conv1d_rules_are_cpu_only():
    report = PassReport()
    optimize(onnx_frontend.load(temporal_block()), PassOptions(cpu_rules=False), report)
    assert "conv1d_as_conv2d" not in report.fired


@pytest.mark.parametrize("keepdims", [0, 1])
def test_conv1d_as_conv2d_matches_onnxruntime(keepdims):
    proto = temporal_block(keepdims=keepdims)
    for _ in range(2):  # fresh inputs each time
        assert_same_as_onnxruntime(proto, {"x": randn(2, 20, 6)}, rtol=1e-4, atol=1e-4)


def test_auto_pad_same_is_refused_and_left_as_it_was():
    proto = temporal_block(auto_pad="SAME_UPPER")
    model, report, ops = optimized_for_cpu(proto)
    assert report.fired["conv1d_as_conv2d"] == 1  # conv2 alone
    assert any("auto_pad=SAME_UPPER" in line for line in report.refused), report.refused
    conv = next(n for n in model.graph if n.name == "conv1")
    assert len(conv.inputs[0].shape) == 3  # still a 1-D layer
    assert_same_as_onnxruntime(proto, {"x": randn(2, 20, 6)}, rtol=1e-4, atol=1e-4)


@pytest.mark.usefixtures("native_tactics_win")  # the structure, whatever a loaded machine times
def test_zoo_cnn1d_runs_as_one_native_segment_and_matches_onnxruntime():
    from tests.models.test_zoo import assert_fp32_close, onnxruntime_session

    exported = zoo.export("cnn1d")
    engine = kiln.build(str(exported.path))
    segments = [s.fn for s in engine.program.run_steps if isinstance(s.fn, Segment)]
    steps = engine.plan.program.steps
    assert len(segments) == 1 and len(segments[0].members) == len(steps), \
        [(s.op_type, s.tactic) for s in steps]  # every step, the head's Relayout (Transpose + Unsqueeze) too
    session = onnxruntime_session(exported.path)
    for seed in (1, 2):
        feeds = zoo.random_inputs("cnn1d", exported, seed=seed)
        got = engine.run(feeds)
        for out, want in zip(session.get_outputs(), session.run(None, feeds)):
            assert_fp32_close(got[out.name], want, f"cnn1d {out.name} (seed {seed})")
