"""GatherElements from data of one value throughout, as a fill of the indices' shape at run time.

Whatever the indices pick, each element they pick holds the one value v, so the result is v at the indices' shape:

    GatherElements(data, indices) -> Expand(v, Shape(indices))    where every element of data is v

RoBERTa's token-type ids are transformers' zero buffer [1, P] expanded to [batch, P] and gathered at the computed
position ids. fold.py folds that to a constant where the indices' shape is static; exported with symbolic
batch x sequence it stays, a torch GatherElements step that splits the CPU's native segment. As an Expand of a
[1, 1] constant the token types' lookup reads the constant through an Expand that drop_broadcast_expand removes (the
residual Add broadcasts the row), and folding then leaves one [1, 1, H] row. The data counts as one-valued when it is
a constant of one value or an Expand/Slice/Reshape/Unsqueeze/Squeeze of one (each output element is one of its
input's). In-range indices are the op's contract; an out-of-range one is an error onnxruntime raises and this
result hides (as fold.py's static fold does).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from kiln.passes._rewrite import PassReport, const, is_op, new_initializer, replace_with, run_rule

RULE = "fill_uniform_gather"
VALUE_VIEWS = ("Expand", "Slice", "Reshape", "Unsqueeze", "Squeeze")  # every output element is an input element


def _source_constant(data: ir.Value) -> np.ndarray | None:
    """The constant `data` takes its elements from, through ops that only pick or repeat elements; None if computed."""
    while (array := const(data)) is None:
        node = data.producer()
        if not is_op(node, *VALUE_VIEWS):
            return None
        data = node.inputs[0]
    return array


def _refusal(node: ir.Node, source: np.ndarray) -> str | None:
    """Why the GatherElements cannot be a fill, or None when it can."""
    indices, out = node.inputs[1], node.outputs[0]
    if source.size == 0:
        return "its data is empty"
    if (values := np.unique(source)).size != 1:
        return f"its data holds {values.size} values ({values[:4].tolist()}{', ...' if values.size > 4 else ''})"
    if indices.shape is None or out.type is None:
        return f"the indices {indices.name!r} have an unknown rank or its output an unknown type"
    return None


def fill_uniform_gather(node: ir.Node, report: PassReport) -> bool:
    # GatherElements(data, indices) -> Expand(v, Shape(indices)) where every element of data is v
    if not is_op(node, "GatherElements") or const(node.inputs[1]) is not None:
        return False  # constant indices: fold.py runs it once
    source = _source_constant(node.inputs[0])
    if source is None:
        return False  # not a candidate: computed data
    if (reason := _refusal(node, source)) is not None:
        report.refuse(RULE, node, reason)
        return False
    indices, out, graph = node.inputs[1], node.outputs[0], node.graph
    value = new_initializer(graph, f"{out.name}_value", source.reshape(-1)[:1].reshape((1,) * len(indices.shape)))
    shape = ir.node("Shape", [indices], name=f"{node.name}_indices_shape")
    shape.outputs[0].name = f"{out.name}_shape"
    shape.outputs[0].type, shape.outputs[0].shape = ir.TensorType(ir.DataType.INT64), ir.Shape([len(indices.shape)])
    graph.insert_before(node, shape)
    replace_with([node], ir.node("Expand", [value, shape.outputs[0]], name=node.name), out)
    return True


def fill_uniform_gathers(model: ir.Model, report: PassReport) -> int:
    return run_rule(model, RULE, fill_uniform_gather, report, main_only=False)
