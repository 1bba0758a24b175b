"""LayerNorm from its decomposed form -> kiln::LayerNorm.

    d = x - mean(x);   y = d / √(mean(d²) + ε) · γ + β      (over the trailing axes)

as written by hand-rolled modules and older exporters: ReduceMean -> Sub -> Pow(2)/Mul(d, d)
-> ReduceMean -> Add(ε) -> Sqrt -> Div (or Reciprocal -> Mul) [-> Mul(γ)] [-> Add(β)].
(The dynamo exporter emits LayerNormalization directly; that op runs as is.)
"""

from __future__ import annotations

import onnx_ir as ir

from kiln.passes._rewrite import (
    KILN_DOMAIN,
    PassReport,
    const,
    const_scalar,
    consumers,
    is_op,
    only_user,
    other_input,
    producer,
    replace_with,
    trailing_axis,
)

RULE = "fuse_layer_norm"


def fuse_layer_norm(node: ir.Node, report: PassReport) -> bool:
    if not is_op(node, "Sub"):
        return False
    x, d = node.inputs[0], node.outputs[0]
    mean = producer(node.inputs[1], "ReduceMean")
    if mean is None or mean.inputs[0] is not x or not only_user(node.inputs[1]):
        return False
    rank = None if x.shape is None else len(x.shape)
    axis = trailing_axis(mean, rank)
    users = consumers(d)
    square = next((n for n in users if (is_op(n, "Pow") and const_scalar(n.inputs[1]) == 2.0)
                   or (is_op(n, "Mul") and n.inputs[0] is d and n.inputs[1] is d)), None)
    divide = next((n for n in users if n is not square), None)
    if axis is None or square is None or len(users) != 2 or d.is_graph_output():
        report.refuse(RULE, node, "x - mean(x) is not squared and divided as in a LayerNorm over trailing axes")
        return False
    var = only_user(square.outputs[0])
    add = only_user(var.outputs[0]) if is_op(var, "ReduceMean") and trailing_axis(var, rank) == axis else None
    eps = const_scalar(other_input(add, var.outputs[0])) if is_op(add, "Add") else None
    sqrt = only_user(add.outputs[0]) if eps is not None else None
    if not is_op(sqrt, "Sqrt"):
        report.refuse(RULE, node, "the variance is not followed by + ε and Sqrt")
        return False
    nodes = [mean, node, square, var, add, sqrt]
    if is_op(divide, "Div") and divide.inputs[0] is d and divide.inputs[1] is sqrt.outputs[0]:
        nodes.append(divide)
    else:
        recip = only_user(sqrt.outputs[0])
        if not (is_op(recip, "Reciprocal") and is_op(divide, "Mul") and recip.outputs[0] in divide.inputs):
            report.refuse(RULE, node, "x - mean(x) is not divided by the standard deviation")
            return False
        nodes += [recip, divide]
    out, inputs = divide.outputs[0], [x]
    for op in ("Mul", "Add"):
        nxt = only_user(out)
        if is_op(nxt, op) and const(other_input(nxt, out)) is not None:
            nodes.append(nxt)
            inputs.append(other_input(nxt, out))
            out = nxt.outputs[0]
        elif op == "Mul":
            inputs.append(None)
    while inputs[-1] is None:
        inputs.pop()
    fused = ir.Node(KILN_DOMAIN, "LayerNorm", inputs, [ir.AttrInt64("axis", axis), ir.AttrFloat32("epsilon", eps)])
    replace_with(nodes, fused, out)
    return True
