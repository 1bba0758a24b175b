"""Constant folding, no-op removal and DCE: structural (rule fired N times, nodes left) and
numerical (same outputs as onnxruntime on the unoptimized model)."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.frontend import onnx as onnx_frontend
from kiln.passes import PassOptions, PassReport, optimize


def make_model(nodes, inputs, outputs, initializers=(), opset=18) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, [numpy_helper.from_array(a, n) for n, a in initializers])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def optimized(proto: onnx.ModelProto, level: int = 2):
    report = PassReport()
    model = optimize(onnx_frontend.load(proto), PassOptions(opt_level=level), report)
    ops = collections.Counter(f"{n.domain}::{n.op_type}" if n.domain else n.op_type for n in model.graph)
    return model, report, ops


def assert_same_as_onnxruntime(proto: onnx.ModelProto, feeds: dict, level: int = 2, rtol=1e-5, atol=1e-5):
    expected = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    got = kiln.build(proto, opt_level=level).run(feeds)
    for out, want in zip(proto.graph.output, expected):
        np.testing.assert_allclose(np.asarray(got[out.name]), want, rtol=rtol, atol=atol, err_msg=out.name)


F = TensorProto.FLOAT


def test_shape_gather_concat_reshape_chain_folds_away():
    # Shape(x) -> Gather(0) -> Concat([that, -1]) -> Reshape(x, ·): static x makes it all constant
    x = helper.make_tensor_value_info("x", F, [2, 3, 4])
    y = helper.make_tensor_value_info("y", F, None)
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "zero"], ["b"], axis=0),
        helper.make_node("Concat", ["b", "minus_one"], ["shape"], axis=0),
        helper.make_node("Reshape", ["x", "shape"], ["r"]),
        helper.make_node("Relu", ["r"], ["y"]),
    ]
    proto = make_model(nodes, [x], [y], [("zero", np.array([0], np.int64)), ("minus_one", np.array([-1], np.int64))])
    model, report, ops = optimized(proto, level=1)
    assert report.fired["fold_constants"] == 3
    assert ops == {"Reshape": 1, "Relu": 1}
    assert model.graph.node(0).inputs[1].const_value.numpy().tolist() == [2, -1]
    assert_same_as_onnxruntime(proto, {"x": np.random.default_rng(0).standard_normal((2, 3, 4), np.float32)}, level=1)


def test_constant_subgraph_folds_with_kiln_ops_but_not_dequantize():
    x = helper.make_tensor_value_info("x", F, [4])
    y = helper.make_tensor_value_info("y", F, [4])
    nodes = [
        helper.make_node("Mul", ["a", "b"], ["ab"]),  # constant: folds
        helper.make_node("Sqrt", ["ab"], ["root"]),  # constant after the fold: folds
        helper.make_node("DequantizeLinear", ["q", "scale"], ["dq"]),  # carries calibration: stays
        helper.make_node("Add", ["x", "root"], ["t"]),
        helper.make_node("Add", ["t", "dq"], ["y"]),
    ]
    inits = [("a", np.array([1, 4, 9, 16], np.float32)), ("b", np.array([4, 1, 1, 1], np.float32)),
             ("q", np.array([1, 2, 3, 4], np.int8)), ("scale", np.array(0.5, np.float32))]
    proto = make_model(nodes, [x], [y], inits)
    _, report, ops = optimized(proto, level=1)
    assert report.fired["fold_constants"] == 2
    assert ops == {"DequantizeLinear": 1, "Add": 2}
    assert_same_as_onnxruntime(proto, {"x": np.random.default_rng(1).standard_normal(4).astype(np.float32)}, level=1)


def test_noops_identity_dropout_transpose_and_cast_chains_removed():
    x = helper.make_tensor_value_info("x", F, [2, 3, 4])
    y = helper.make_tensor_value_info("y", F, [2, 3, 4])
    nodes = [
        helper.make_node("Identity", ["x"], ["i"]),
        helper.make_node("Dropout", ["i"], ["d"]),
        helper.make_node("Transpose", ["d"], ["t1"], perm=[1, 0, 2]),
        helper.make_node("Transpose", ["t1"], ["t2"], perm=[1, 0, 2]),  # cancels the one before
        helper.make_node("Cast", ["t2"], ["c1"], to=TensorProto.DOUBLE),
        helper.make_node("Cast", ["c1"], ["c2"], to=F),  # float -> double -> float is lossless
        helper.make_node("Reshape", ["c2", "same"], ["r"]),  # to its own static shape
        helper.make_node("Relu", ["r"], ["y"]),
    ]
    proto = make_model(nodes, [x], [y], [("same", np.array([2, 3, 4], np.int64))])
    _, report, ops = optimized(proto, level=1)
    assert ops == {"Relu": 1}
    for rule in ("remove_identity", "remove_dropout", "collapse_transpose_chain", "remove_cast_round_trip",
                 "remove_same_shape_reshape"):
        assert report.fired[rule] >= 1, rule
    assert_same_as_onnxruntime(proto, {"x": np.random.default_rng(2).standard_normal((2, 3, 4), np.float32)}, level=1)


def test_a_pick_after_a_transpose_reads_the_untransposed_tensor():
    """A batch-first RNN's last step, out[:, -1] of Transpose(Y, [1, 0, 2]), and a negative axis: the Gather
    reads Y (axis 0) and the Transpose goes; a pick that leaves the other axes out of order is left alone."""
    x = helper.make_tensor_value_info("x", F, [5, 3, 4])
    outputs = [helper.make_tensor_value_info(n, F, None) for n in ("last", "middle", "kept")]
    nodes = [
        helper.make_node("Relu", ["x"], ["y"]),
        helper.make_node("Transpose", ["y"], ["t"], perm=[1, 0, 2]),
        helper.make_node("Gather", ["t", "minus_one"], ["g"], axis=1),  # [3, 5, 4] -> [3, 4]: step -1
        helper.make_node("Relu", ["g"], ["last"]),
        helper.make_node("Transpose", ["y"], ["u"], perm=[1, 0, 2]),
        helper.make_node("Gather", ["u", "two"], ["middle"], axis=-3),  # [3, 5, 4] -> [5, 4]: row 2
        helper.make_node("Transpose", ["y"], ["v"], perm=[2, 1, 0]),
        helper.make_node("Gather", ["v", "two"], ["kept"], axis=1),  # [4, 5, 3] -> [4, 3]: x's axes 2, 0
    ]
    proto = make_model(nodes, [x], outputs, [("minus_one", np.array(-1, np.int64)), ("two", np.array(2, np.int64))])
    model, report, ops = optimized(proto, level=1)
    assert report.fired["gather_through_transpose"] == 2
    assert ops == {"Relu": 2, "Gather": 3, "Transpose": 1}
    axes = sorted(int(n.attributes["axis"].value) for n in model.graph if n.op_type == "Gather")
    assert axes == [0, 1, 1]  # the two picks now on x's axes 0 and 1; the refused one unchanged
    assert any("change order" in line for line in report.refused)
    assert_same_as_onnxruntime(proto, {"x": np.random.default_rng(3).standard_normal((5, 3, 4), np.float32)}, level=1)


def test_a_pad_of_zeros_is_removed_and_a_real_one_kept():
    """Swin pads its token grid to whole windows; at 224 px there is nothing to pad."""
    x = helper.make_tensor_value_info("x", F, [1, 4, 4, 3])
    y = helper.make_tensor_value_info("y", F, None)
    nodes = [helper.make_node("Pad", ["x", "zeros"], ["p"], mode="constant"),
             helper.make_node("Relu", ["p"], ["r"]),
             helper.make_node("Pad", ["r", "ones"], ["y"], mode="constant")]
    proto = make_model(nodes, [x], [y], [("zeros", np.zeros(8, np.int64)),
                                         ("ones", np.array([0, 1, 0, 0, 0, 1, 0, 0], np.int64))])
    _, report, ops = optimized(proto, level=1)
    assert report.fired["remove_zero_pad"] == 1 and ops == {"Relu": 1, "Pad": 1}
    assert_same_as_onnxruntime(proto, {"x": np.random.default_rng(3).standard_normal((1, 4, 4, 3), np.float32)},
                               level=1)


def test_lossy_cast_chain_is_kept():
    x = helper.make_tensor_value_info("x", F, [5])
    y = helper.make_tensor_value_info("y", F, [5])
    nodes = [helper.make_node("Cast", ["x"], ["h"], to=TensorProto.FLOAT16),  # rounds: not a no-op
             helper.make_node("Cast", ["h"], ["y"], to=F)]
    _, _, ops = optimized(make_model(nodes, [x], [y]), level=1)
    assert ops == {"Cast": 2}


def test_graph_output_keeps_its_name_when_identity_removed():
    x = helper.make_tensor_value_info("x", F, [3])
    y = helper.make_tensor_value_info("y", F, [3])
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Identity", ["r"], ["y"])]
    model, _, ops = optimized(make_model(nodes, [x], [y]), level=1)
    assert ops == {"Relu": 1} and model.graph.outputs[0].name == "y"


def test_dead_nodes_and_weights_removed():
    x = helper.make_tensor_value_info("x", F, [3])
    y = helper.make_tensor_value_info("y", F, [3])
    nodes = [helper.make_node("Relu", ["x"], ["y"]), helper.make_node("Mul", ["x", "w"], ["unused"])]
    model, report, ops = optimized(make_model(nodes, [x], [y], [("w", np.ones(3, np.float32))]), level=1)
    assert ops == {"Relu": 1} and "w" not in model.graph.initializers
    assert report.fired["eliminate_dead_code"] >= 1


def test_opt_level_0_runs_the_graph_as_is():
    x = helper.make_tensor_value_info("x", F, [3])
    y = helper.make_tensor_value_info("y", F, [3])
    proto = make_model([helper.make_node("Identity", ["x"], ["i"]), helper.make_node("Relu", ["i"], ["y"])], [x], [y])
    _, report, ops = optimized(proto, level=0)
    assert ops == {"Identity": 1, "Relu": 1} and report.fired == {}


def test_identical_weights_are_stored_once():
    """Two initializers with the same contents become one weight; outputs unchanged."""
    import numpy as np
    from onnx import TensorProto, helper

    import kiln

    data = np.arange(12, dtype=np.float32).reshape(3, 4)
    inits = [helper.make_tensor(n, TensorProto.FLOAT, [3, 4], data.ravel()) for n in ("a", "b")]
    nodes = [helper.make_node("Add", ["x", "a"], ["s"], name="add1"),
             helper.make_node("Mul", ["s", "b"], ["y"], name="mul")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 4])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    optimized = kiln.build(model, opt_level=1)
    assert len(optimized.plan.weights) == 1
    np.testing.assert_array_equal(optimized.run({"x": x})["y"], kiln.build(model, opt_level=0).run({"x": x})["y"])
