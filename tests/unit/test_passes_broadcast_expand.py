"""drop_broadcast_expand (kiln/passes/broadcast_expand.py): an Expand whose every reader broadcasts anyway is
removed, also through an embedding Gather of the expanded ids; refused (graph byte for byte unchanged, the reason
reported) where a reader needs the copy. Outputs against onnxruntime; BERT's token-type Expand at fresh shapes."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import kiln
from kiln.frontend import onnx as onnx_frontend
from kiln.passes import PassReport
from kiln.passes.broadcast_expand import RULE, drop_broadcast_expands
from tests.unit.test_passes_cleanup import assert_same_as_onnxruntime, make_model, optimized

F, I64 = TensorProto.FLOAT, TensorProto.INT64


def _expand_then(reader: str, x_dims, target, y_dims, out_dims=None, extra_outputs=()):
    """x -> Expand(x, target) -> reader(·, y) -> z."""
    nodes = [helper.make_node("Expand", ["x", "target"], ["e"], name="expand"),
             helper.make_node(reader, ["e", "y"], ["z"], name="reader")]
    inputs = [helper.make_tensor_value_info("x", F, x_dims), helper.make_tensor_value_info("y", F, y_dims)]
    outputs = [helper.make_tensor_value_info("z", F, out_dims), *extra_outputs]
    return make_model(nodes, inputs, outputs, [("target", np.array(target, np.int64))])


def _feeds(proto, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    dims = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in proto.graph.input}
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in dims.items()}


def _refused(proto) -> list[str]:
    """The rule alone on the imported graph: asserts it left the graph byte for byte; its refusals."""
    model = onnx_frontend.load(proto)
    before = ir.to_proto(model).SerializeToString()
    report = PassReport()
    assert drop_broadcast_expands(model, report) == 0
    assert ir.to_proto(model).SerializeToString() == before
    return [line for line in report.refused if line.startswith(RULE)]


@pytest.mark.parametrize("reader", ["Add", "Mul", "Sub", "Max"])
def test_an_expand_read_by_a_broadcasting_op_is_removed(reader):
    proto = _expand_then(reader, [1, 4], [3, 4], [2, 3, 4])  # [1, 4] -> [3, 4], broadcast into [2, 3, 4] anyway
    model, report, ops = optimized(proto, level=1)
    assert report.fired[RULE] == 1
    assert "Expand" not in ops
    assert model.graph.node(0).inputs[0].name == "x"
    assert_same_as_onnxruntime(proto, _feeds(proto, seed=1), level=1, rtol=0, atol=0)


def test_where_reads_the_unexpanded_condition():
    # Where(Expand(c, [2, 3]), a, b): the condition broadcasts as a and b do
    nodes = [helper.make_node("Expand", ["c", "target"], ["e"]), helper.make_node("Where", ["e", "a", "b"], ["z"])]
    inputs = [helper.make_tensor_value_info("c", TensorProto.BOOL, [1, 3]),
              helper.make_tensor_value_info("a", F, [2, 3]), helper.make_tensor_value_info("b", F, [1])]
    proto = make_model(nodes, inputs, [helper.make_tensor_value_info("z", F, [2, 3])],
                       [("target", np.array([2, 3], np.int64))])
    _, report, ops = optimized(proto, level=1)
    assert report.fired[RULE] == 1 and "Expand" not in ops
    rng = np.random.default_rng(2)
    feeds = {"c": rng.random((1, 3)) < 0.5, "a": rng.standard_normal((2, 3)).astype(np.float32),
             "b": rng.standard_normal(1).astype(np.float32)}
    assert_same_as_onnxruntime(proto, feeds, level=1, rtol=0, atol=0)


def _token_type_model(batch, seq, hidden=6):
    """BERT's embeddings at symbolic [batch, seq]: Add(Gather(W, ids), Gather(T, Expand(types, Shape(ids))))."""
    nodes = [helper.make_node("Shape", ["ids"], ["ids_shape"]),
             helper.make_node("Expand", ["types", "ids_shape"], ["types_full"], name="expand"),
             helper.make_node("Gather", ["words", "ids"], ["word_rows"]),
             helper.make_node("Gather", ["type_table", "types_full"], ["type_rows"], name="lookup"),
             helper.make_node("Add", ["word_rows", "type_rows"], ["z"])]
    inputs = [helper.make_tensor_value_info("ids", I64, [batch, seq]), helper.make_tensor_value_info("types", I64, [1, seq])]
    rng = np.random.default_rng(3)
    inits = [("words", rng.standard_normal((11, hidden)).astype(np.float32)),
             ("type_table", rng.standard_normal((2, hidden)).astype(np.float32))]
    return make_model(nodes, inputs, [helper.make_tensor_value_info("z", F, [batch, seq, hidden])], inits)


def test_an_expand_of_ids_read_by_a_lookup_whose_rows_broadcast_is_removed():
    proto = _token_type_model("batch", "seq")
    model, report, ops = optimized(proto, level=1)
    assert report.fired[RULE] == 1 and "Expand" not in ops
    lookup = next(n for n in model.graph if n.name == "lookup")
    assert lookup.inputs[1].name == "types"
    assert [str(d) for d in lookup.outputs[0].shape] == ["1", "seq", "6"]  # the rows of one batch row, broadcast
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    engine = kiln.build(proto, opt_level=1)
    rng = np.random.default_rng(4)
    for batch, seq in [(1, 5), (3, 7), (2, 1)]:  # fresh shapes of one engine
        feeds = {"ids": rng.integers(0, 11, (batch, seq)), "types": rng.integers(0, 2, (1, seq))}
        np.testing.assert_array_equal(np.asarray(engine.run(feeds)["z"]), session.run(None, feeds)[0])


def test_an_expand_to_dims_of_another_name_is_removed_where_the_output_has_the_other_operands_shape():
    # Add(Expand(x [1, 1], Shape(w) = [1, m]), y [2, seq]) -> [2, seq] (declared): m is seq or 1 at run time, so
    # [1, m] broadcasts into y's shape though the names differ (BERT's token-type rows [1, Min(128, seq), H]);
    # refused before the reader's output was consulted
    nodes = [helper.make_node("Shape", ["w"], ["target"]), helper.make_node("Expand", ["x", "target"], ["e"]),
             helper.make_node("Add", ["e", "y"], ["z"])]
    inputs = [helper.make_tensor_value_info("x", F, [1, 1]), helper.make_tensor_value_info("w", F, [1, "m"]),
              helper.make_tensor_value_info("y", F, [2, "seq"])]
    proto = make_model(nodes, inputs, [helper.make_tensor_value_info("z", F, [2, "seq"])])
    _, report, ops = optimized(proto, level=1)
    assert report.fired[RULE] == 1 and "Expand" not in ops, ops
    rng = np.random.default_rng(8)
    for m, seq in [(5, 5), (1, 5), (1, 1)]:
        feeds = {"x": rng.standard_normal((1, 1)).astype(np.float32), "w": np.zeros((1, m), np.float32),
                 "y": rng.standard_normal((2, seq)).astype(np.float32)}
        assert_same_as_onnxruntime(proto, feeds, level=1, rtol=0, atol=0)


@pytest.mark.parametrize("y_dims", [[4], [1, 4], [2, 1, 4], ["n", 4]])
def test_refused_where_no_other_operand_has_the_expanded_shape(y_dims):
    # [1, 4] -> [3, 4] read by Add with y: the Add's output has the 3 rows only because of the Expand
    refused = _refused(_expand_then("Add", [1, 4], [3, 4], y_dims))
    assert refused == [f"{RULE} at node 'expand' (Expand): no other operand of Add 'reader' has the shape [3, 4] "
                       "or one it broadcasts into"]


def test_refused_where_the_target_has_more_axes_than_the_other_operand():
    # [4] -> [2, 3, 4] read with a [3, 4]: the Expand adds the leading axis
    assert "has the shape [2, 3, 4]" in _refused(_expand_then("Mul", [4], [2, 3, 4], [3, 4]))[0]


def test_refused_where_a_reader_does_not_broadcast_or_the_copy_is_a_graph_output():
    proto = _expand_then("Add", [1, 4], [3, 4], [3, 4])
    proto.graph.node.append(helper.make_node("Relu", ["e"], ["r"], name="relu"))
    proto.graph.output.append(helper.make_tensor_value_info("r", F, [3, 4]))
    assert "Relu 'relu' reads it and does not broadcast" in _refused(proto)[0]
    output = _expand_then("Add", [1, 4], [3, 4], [3, 4], extra_outputs=[helper.make_tensor_value_info("e", F, [3, 4])])
    assert "is a graph output" in _refused(output)[0]


def test_refused_where_a_lookup_reads_the_ids_on_another_axis_at_another_rank():
    # Gather(W [6, 2], Expand(i [3], [2, 3]), axis=1): [6, 3] does not broadcast into [6, 2, 3] as [2, 3] did
    nodes = [helper.make_node("Expand", ["i", "target"], ["e"]),
             helper.make_node("Gather", ["w", "e"], ["g"], axis=1), helper.make_node("Add", ["g", "y"], ["z"])]
    inputs = [helper.make_tensor_value_info("i", I64, [3]), helper.make_tensor_value_info("y", F, [6, 2, 3])]
    proto = make_model(nodes, inputs, [helper.make_tensor_value_info("z", F, [6, 2, 3])],
                       [("target", np.array([2, 3], np.int64)), ("w", np.ones((6, 2), np.float32))])
    assert "would read indices of rank 1, not 2" in _refused(proto)[0]


@pytest.mark.slow
def test_bert_base_drops_its_token_type_expand_and_matches_onnxruntime_at_fresh_shapes():
    from kiln import zoo
    from kiln.passes import optimize

    exported = zoo.export("bert_base", dynamic=True)
    report = PassReport()
    optimize(onnx_frontend.load(str(exported.path)), report=report)
    # the token-type ids' Expand, then fill_uniform_gather's of the types it gathers (their lookup's [1, Min(512, seq),
    # H] added to [batch, seq, H]); the mask's index grid Expands feed Unsqueezes
    assert report.fired[RULE] == 2
    engine = kiln.build(str(exported.path), profiles=[{"input_ids": "1x1,2x32,4x64"}])
    session = ort.InferenceSession(str(exported.path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(5)
    for batch, seq in [(1, 9), (2, 32), (3, 17), (4, 64)]:
        mask = np.ones((batch, seq), np.int64)
        mask[0, rng.integers(1, seq + 1):] = 0
        feeds = {"input_ids": rng.integers(0, 30000, (batch, seq)), "attention_mask": mask}
        got = engine.run(feeds)
        for output, want in zip(session.get_outputs(), session.run(None, feeds)):
            # fp32 over 12 layers, two implementations' rounding (test_passes_models.py's BERT tolerance)
            np.testing.assert_allclose(np.asarray(got[output.name]), want, rtol=1e-3, atol=1e-3, err_msg=output.name)
