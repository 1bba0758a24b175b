"""A BatchNormalization no layer absorbs, its ReLU and the Concat before it, inside one native segment (issue 11).

DenseNet's layers are BN-ReLU-Conv over the Concat of every earlier layer's output: the BatchNormalization cannot
fold into a convolution, and it ran as a torch step of its own, its Relu another, each Concat of more than 8 inputs
a third (DenseNet-121 1.45x onnxruntime at 1 thread). Now the CPU rule batchnorm_as_affine makes the BN a Mul and
an Add by per-channel constants, the elementwise fusion joins its ReLU, cpu.elementwise.nhwc runs the chain on the
segment's NHWC rows, and kiln's C Concat takes up to 64 inputs. Checked against onnxruntime on the unoptimized
model, fresh inputs each time, at several input counts, channel counts, batches and constant forms.
"""

from __future__ import annotations

import collections

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.frontend import onnx as onnx_frontend
from kiln.kernels.cpu import transformer
from kiln.passes import PassOptions, PassReport, optimize
from kiln.runtime.native import Segment

pytestmark = [pytest.mark.skipif(not transformer.available(), reason=f"kiln's C kernels: {transformer.reason()}"),
              pytest.mark.usefixtures("native_tactics_win")]

F = TensorProto.FLOAT
NATIVE = ["cpu.conv.onednn_direct", "cpu.pool.onednn.MaxPool", "cpu.concat.nhwc", "cpu.concat.native",
          "cpu.elementwise.nhwc", "cpu.elementwise.native"]


def dense_model(channels: list[int], batch: int | str = 2, h: int = 6, w: int = 5, seed: int = 0,
                scale_shape: str = "channel"):
    """x [N, 3, H, W] -> one 3x3 convolution per entry of `channels` -> Concat (a 3x3 MaxPool of one) ->
    BatchNormalization -> Relu -> 1x1 convolution to 7 channels (a DenseNet layer's BN-ReLU-Conv). scale_shape
    "scalar": a Mul by one value after the Relu too; "width": a Mul by a [1, 1, 1, W] row instead (not per channel)."""
    rng = np.random.default_rng(seed)
    inits, nodes, parts = {}, [], []
    for k, c in enumerate(channels):
        inits[f"w{k}"] = rng.standard_normal((c, 3, 3, 3)).astype(np.float32) * 0.3
        nodes.append(helper.make_node("Conv", ["x", f"w{k}"], [f"c{k}"], pads=[1, 1, 1, 1], name=f"conv{k}"))
        parts.append(f"c{k}")
    total = sum(channels)
    inits.update(gamma=rng.uniform(0.5, 1.5, total).astype(np.float32),
                 beta=rng.uniform(-0.5, 0.5, total).astype(np.float32),
                 mean=rng.uniform(-0.5, 0.5, total).astype(np.float32),
                 var=rng.uniform(0.5, 2.0, total).astype(np.float32),
                 wo=rng.standard_normal((7, total, 1, 1)).astype(np.float32) * 0.2)
    nodes += [helper.make_node("Concat", parts, ["cat"], axis=1, name="cat") if len(parts) > 1 else
              helper.make_node("MaxPool", parts, ["cat"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], name="pool"),
              helper.make_node("BatchNormalization", ["cat", "gamma", "beta", "mean", "var"], ["bn"], epsilon=1e-3,
                               name="bn"),
              helper.make_node("Relu", ["bn"], ["act"], name="relu")]
    last = "act"
    if scale_shape != "channel":
        inits["s"] = (np.full((1,), 0.7, np.float32) if scale_shape == "scalar" else
                      rng.uniform(0.5, 1.5, (1, 1, 1, w)).astype(np.float32))
        nodes.append(helper.make_node("Mul", ["act", "s"], ["scaled"], name="scale"))
        last = "scaled"
    nodes.append(helper.make_node("Conv", [last, "wo"], ["y"], name="conv_out"))
    graph = helper.make_graph(nodes, "dense", [helper.make_tensor_value_info("x", F, [batch, 3, h, w])],
                              [helper.make_tensor_value_info("y", F, [batch, 7, h, w])],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def onnxruntime_run(proto, feeds: dict) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # the model as written
    return ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(None, feeds)


def assert_matches_onnxruntime(engine, proto, shape: tuple[int, ...], seeds=(1, 2)) -> None:
    for seed in seeds:
        x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
        # fp32: oneDNN's convolutions sum in another order than onnxruntime's, and BN's (x - mean) * scale + beta
        # rounds in other places than x * scale + shift
        np.testing.assert_allclose(engine.run({"x": x})["y"], onnxruntime_run(proto, {"x": x})[0],
                                   rtol=1e-4, atol=1e-4)


def test_the_rule_turns_the_batchnorm_into_one_chain_with_its_relu_on_cpu_builds_only():
    proto = dense_model([5, 11])
    cpu = optimize(onnx_frontend.load(proto), PassOptions(cpu_rules=True), report := PassReport())
    assert report.fired.get("batchnorm_as_affine") == 1, report.fired
    ops = collections.Counter(n.op_type for n in cpu.graph)
    assert ops["BatchNormalization"] == 0 and ops["Relu"] == 0 and ops["Elementwise"] == 1, ops
    chain = next(n for n in cpu.graph if n.op_type == "Elementwise")
    assert list(chain.attributes["code"].value) == ["Mul i0 i1", "Add t0 i2", "Relu t1"]
    assert [tuple(v.const_value.numpy().shape) for v in chain.inputs[1:]] == [(16, 1, 1), (16, 1, 1)]
    other = optimize(onnx_frontend.load(proto), PassOptions(cpu_rules=False), report := PassReport())
    assert "batchnorm_as_affine" not in report.fired
    assert collections.Counter(n.op_type for n in other.graph)["BatchNormalization"] == 1


@pytest.mark.parametrize("channels", [[5, 11], [4, 9, 13], [3] * 11, [2] * 25])
def test_concat_batchnorm_relu_run_inside_one_segment_and_match_onnxruntime(channels):
    """2 to 25 inputs to the Concat: past 8 it used to be torch's cat outside the segment."""
    proto = dense_model(channels)
    engine = kiln.build(proto.SerializeToString(), tactics=NATIVE)
    chosen = {s.op_type: s.tactic for s in engine.plan.program.steps}
    assert chosen["Elementwise"] == "cpu.elementwise.nhwc" and chosen["Concat"] == "cpu.concat.nhwc", chosen
    segments = engine.program.segments
    assert len(segments) == 1 and len(segments[0].members) == len(channels) + 3, [len(s.members) for s in segments]
    assert isinstance(engine.program.run_steps[-1].fn, Segment)
    assert_matches_onnxruntime(engine, proto, (2, 3, 6, 5))


def test_a_batchnorm_of_one_input_and_a_scalar_scale_run_natively():
    """A block's first layer normalises the block input itself (here a pool's output, no Concat); a Mul by one value
    joins the chain."""
    proto = dense_model([6], scale_shape="scalar")
    engine = kiln.build(proto.SerializeToString(), tactics=NATIVE)
    chain = next(s for s in engine.plan.program.steps if s.op_type == "Elementwise")
    assert chain.tactic == "cpu.elementwise.nhwc" and len(chain.attributes["code"]) == 4, chain
    assert_matches_onnxruntime(engine, proto, (2, 3, 6, 5))


def test_a_constant_not_per_channel_is_left_to_the_other_tactics():
    """A Mul by a row along the width is not a per-channel constant: the NHWC rows cannot read it as a row of C."""
    proto = dense_model([5, 4], scale_shape="width")
    engine = kiln.build(proto.SerializeToString(), tactics=NATIVE)
    chain = next(s for s in engine.plan.program.steps if s.op_type == "Elementwise")
    assert chain.tactic != "cpu.elementwise.nhwc", chain.tactic
    tuning = engine.plan.header["tactics"]["layers"][chain.name]
    assert "not one value per channel" in str(tuning["candidates"].get("cpu.elementwise.nhwc")), tuning
    assert_matches_onnxruntime(engine, proto, (2, 3, 6, 5))


def test_other_batch_sizes_than_tuned_give_onnxruntime_results():
    proto = dense_model([5, 8, 3], batch="N")
    engine = kiln.build(proto.SerializeToString(), tactics=NATIVE, shapes={"x": [2, 3, 6, 5]})
    assert {s.op_type: s.tactic for s in engine.plan.program.steps}["Elementwise"] == "cpu.elementwise.nhwc"
    for batch in (2, 3, 1):
        assert_matches_onnxruntime(engine, proto, (batch, 3, 6, 5), seeds=(batch,))


def test_a_concat_of_many_rows_matches_onnxruntime():
    """kiln's C Concat of rank-3 tensors (cpu.concat.native) past the elementwise programs' 8 inputs."""
    count = 19
    rng = np.random.default_rng(3)
    widths = [int(c) for c in rng.integers(1, 6, count)]
    inputs = [helper.make_tensor_value_info(f"x{k}", F, [2, c, 3]) for k, c in enumerate(widths)]
    nodes = [helper.make_node("Concat", [f"x{k}" for k in range(count)], ["cat"], axis=1),
             helper.make_node("Relu", ["cat"], ["y"])]
    graph = helper.make_graph(nodes, "concat", inputs, [helper.make_tensor_value_info("y", F, [2, sum(widths), 3])])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    engine = kiln.build(proto.SerializeToString(), tactics=NATIVE + ["cpu.relu.native"])
    assert {s.op_type: s.tactic for s in engine.plan.program.steps}["Concat"] == "cpu.concat.native"
    for seed in (1, 2):
        feeds = {f"x{k}": np.random.default_rng(seed + k).standard_normal((2, c, 3)).astype(np.float32)
                 for k, c in enumerate(widths)}
        np.testing.assert_array_equal(engine.run(feeds)["y"], onnxruntime_run(proto, feeds)[0])  # copies, a max


def test_a_concat_of_one_input_is_removed():
    nodes = [helper.make_node("Concat", ["x"], ["c"], axis=1), helper.make_node("Relu", ["c"], ["y"])]
    graph = helper.make_graph(nodes, "one", [helper.make_tensor_value_info("x", F, [2, 4])],
                              [helper.make_tensor_value_info("y", F, [2, 4])])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model = optimize(onnx_frontend.load(proto), PassOptions(), report := PassReport())
    assert report.fired.get("remove_single_concat") == 1 and [n.op_type for n in model.graph] == ["Relu"]
    x = np.random.default_rng(5).standard_normal((2, 4)).astype(np.float32)
    np.testing.assert_array_equal(kiln.build(proto.SerializeToString()).run({"x": x})["y"], np.maximum(x, 0))
