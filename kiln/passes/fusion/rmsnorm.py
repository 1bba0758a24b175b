"""RMSNorm from its decomposed form -> kiln::RMSNorm.

    y = x / √(mean(x², last axes) + ε) · γ

as exporters write it (Llama): Pow(x, 2) -> ReduceMean -> Add(ε) -> Sqrt -> Reciprocal -> Mul(x, ·)
[-> Mul(γ, ·)]; also Div(x, Sqrt(·)) and Mul(x, x) for x².
"""

from __future__ import annotations

import onnx_ir as ir

from kiln.passes._rewrite import (
    KILN_DOMAIN,
    PassReport,
    const,
    const_scalar,
    is_const_close,
    is_op,
    only_user,
    other_input,
    producer,
    replace_with,
    trailing_axis,
)

RULE = "fuse_rms_norm"


def _square_of(value: ir.Value) -> ir.Value | None:
    node = producer(value)
    if is_op(node, "Pow") and is_const_close(node.inputs[1], 2.0):
        return node.inputs[0]
    if is_op(node, "Mul") and node.inputs[0] is node.inputs[1]:
        return node.inputs[0]
    return None


def fuse_rms_norm(node: ir.Node, report: PassReport) -> bool:
    if not is_op(node, "ReduceMean"):
        return False
    x = _square_of(node.inputs[0])
    if x is None or not only_user(node.inputs[0]) or producer(x, "Sub") is not None:
        return False  # a Sub before the square is LayerNorm's variance
    axis = trailing_axis(node, None if x.shape is None else len(x.shape))
    if axis is None:
        report.refuse(RULE, node, "the mean is not over the trailing axes with keepdims=1")
        return False
    nodes = [producer(node.inputs[0]), node]
    add = only_user(node.outputs[0])
    eps = const_scalar(other_input(add, node.outputs[0])) if is_op(add, "Add") else None
    sqrt = only_user(add.outputs[0]) if eps is not None else None
    if not is_op(sqrt, "Sqrt"):
        report.refuse(RULE, node, "mean(x²) is not followed by + ε and Sqrt")
        return False
    nodes += [add, sqrt]
    after = only_user(sqrt.outputs[0])
    if is_op(after, "Reciprocal"):
        nodes.append(after)
        mul = only_user(after.outputs[0])
        ok = is_op(mul, "Mul") and other_input(mul, after.outputs[0]) is x
    else:
        mul = after
        ok = is_op(mul, "Div") and mul.inputs[0] is x
    if not ok:
        report.refuse(RULE, node, "1/√(mean(x²)+ε) does not multiply x itself")
        return False
    nodes.append(mul)
    out, inputs = mul.outputs[0], [x]
    scale_mul = only_user(out)
    if is_op(scale_mul, "Mul") and const(other_input(scale_mul, out)) is not None \
            and const(other_input(scale_mul, out)).ndim <= -axis:
        nodes.append(scale_mul)
        inputs.append(other_input(scale_mul, out))
        out = scale_mul.outputs[0]
    fused = ir.Node(KILN_DOMAIN, "RMSNorm", inputs, [ir.AttrInt64("axis", axis), ir.AttrFloat32("epsilon", eps)])
    replace_with(nodes, fused, out)
    return True
