"""Residual Add + LayerNormalization -> one kiln::LayerNorm with a residual input.

    s = x + r;   y = LayerNorm(s)·γ + β          (s also returned when something else reads it)

The Add that a GEMM's epilogue could not take (embeddings + positions, a residual between two
norms) runs inside the normalisation's pass over the row: one step, and s is written once.
A constant Add (a bias) joins the same way: r is then that constant.
"""

from __future__ import annotations

import onnx_ir as ir

from kiln.passes._rewrite import (
    KILN_DOMAIN,
    PassReport,
    attr,
    consumers,
    is_op,
    producer,
    replace_with,
    same_shape,
)

RULE = "fuse_skip_layer_norm"


def fuse_skip_layer_norm(node: ir.Node, report: PassReport) -> bool:
    if not is_op(node, "LayerNormalization") or any(v.uses() or v.is_graph_output() for v in node.outputs[1:]):
        return False
    total = node.inputs[0]
    add = producer(total, "Add")
    if add is None:
        return False
    x, r = add.inputs
    if not same_shape(x, total):
        x, r = r, x  # the full-shape operand is x; r may broadcast (a bias, positions)
    if not same_shape(x, total):
        report.refuse(RULE, node, "neither operand of the Add has the Add's full shape")
        return False
    keep_sum = total.is_graph_output() or consumers(total) != [node]
    inputs = [x, node.inputs[1], node.inputs[2] if len(node.inputs) > 2 else None, r]
    attrs = [ir.AttrInt64("axis", attr(node, "axis", -1)), ir.AttrFloat32("epsilon", attr(node, "epsilon", 1e-5))]
    fused = ir.Node(KILN_DOMAIN, "LayerNorm", inputs, attrs, num_outputs=2 if keep_sum else 1, name=node.name)
    if not keep_sum:
        replace_with([add, node], fused, node.outputs[0])
        return True
    summed = fused.outputs[1]
    summed.type, summed.shape = total.type, total.shape
    replace_with([node], fused, node.outputs[0])
    name = total.name
    ir.convenience.replace_all_uses_with(total, summed, replace_graph_outputs=True)
    fused.graph.remove(add, safe=True)
    total.name = f"{name}__fused"
    summed.name = name
    return True
