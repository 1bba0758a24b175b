"""The IR verifier names what is broken (node index, name, op, inputs); the printer is readable."""

import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from kiln.frontend import onnx as onnx_frontend
from kiln.ir.printer import print_model
from kiln.ir.verify import VerifyError, verify
from kiln.ops.registry import lookup


def _model():
    nodes = [helper.make_node("Add", ["x", "w"], ["t"], name="add"),
             helper.make_node("Relu", ["t"], ["y"], name="relu")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])],
                              [helper.make_tensor("w", TensorProto.FLOAT, [3], [1.0, 2.0, 3.0])])
    return onnx_frontend.load(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


def test_a_well_formed_model_verifies():
    verify(_model(), lookup)


def test_out_of_order_nodes_are_named():
    model = _model()
    relu = [n for n in model.graph if n.op_type == "Relu"][0]
    model.graph.remove(relu)
    model.graph.insert_before([n for n in model.graph][0], relu)
    with pytest.raises(VerifyError, match=r"node #0 'relu' \(Relu; inputs t\): input 't' is produced later, by node #1"):
        verify(model, lookup, "after a test")
    verify(model, lookup, require_order=False)  # mid-pipeline, order is restored by the final sort


def test_an_undefined_input_and_an_unknown_op_are_listed_together():
    model = _model()
    add = [n for n in model.graph if n.op_type == "Add"][0]
    stray = ir.Value(name="nowhere")
    add.replace_input_with(1, stray)
    relu = [n for n in model.graph if n.op_type == "Relu"][0]
    relu.op_type = "NoSuchOp"
    with pytest.raises(VerifyError) as err:
        verify(model, lookup, "after a test")
    assert len(err.value.problems) == 2
    text = str(err.value)
    assert "'add' (Add; inputs x, nowhere): input 'nowhere' is defined by no graph input" in text
    assert "'relu' (NoSuchOp; inputs t): no kiln implementation of this op" in text


def test_printer_shows_types_ops_and_names():
    text = print_model(_model())
    assert "graph main(x: float[N,3]) -> (y)" in text
    assert "initializers: w: float[3]" in text
    assert "t: float[N,3] = Add(x, w)    'add'" in text
