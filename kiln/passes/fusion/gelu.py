"""GELU from its decomposed forms -> kiln::Gelu.

    erf:   ½·x·(1 + erf(x/√2))                           (exact, x·Φ(x))
    tanh:  ½·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))      (the GPT-2 approximation)

The product ½·x·(1 + ·) is matched in every association exporters write:
(x·½)·a, x·(½·a), (x·a)·½, ½·(x·a).
"""

from __future__ import annotations

import math

import onnx_ir as ir

from kiln.passes._rewrite import (
    KILN_DOMAIN,
    PassReport,
    is_const_close,
    is_op,
    only_user,
    other_input,
    producer,
    replace_with,
)

RULE = "fuse_gelu"


def _is_half_x(value: ir.Value, x: ir.Value) -> ir.Node | None:
    node = producer(value, "Mul")
    if node is not None and only_user(value) and x in node.inputs and is_const_close(other_input(node, x), 0.5):
        return node
    return None


def _half_x_times(a: ir.Value, x: ir.Value) -> tuple[list[ir.Node], ir.Value] | None:
    """Nodes computing ½·x·a (a = 1 + erf/tanh term) and the result value."""
    m1 = only_user(a)
    if not is_op(m1, "Mul"):
        return None
    o1 = other_input(m1, a)
    if (half := _is_half_x(o1, x)) is not None:  # (x·½)·a
        return [m1, half], m1.outputs[0]
    m2 = only_user(m1.outputs[0])
    if not is_op(m2, "Mul"):
        return None
    o2 = other_input(m2, m1.outputs[0])
    if (o1 is x and is_const_close(o2, 0.5)) or (is_const_close(o1, 0.5) and o2 is x):
        return [m1, m2], m2.outputs[0]
    return None


def _one_plus(value: ir.Value) -> ir.Node | None:
    node = only_user(value)
    return node if is_op(node, "Add") and is_const_close(other_input(node, value), 1.0) else None


def _erf_input(erf: ir.Node) -> tuple[ir.Value, ir.Node] | None:
    node = producer(erf.inputs[0])
    if node is None or not only_user(erf.inputs[0]):
        return None
    if is_op(node, "Div") and is_const_close(node.inputs[1], math.sqrt(2)):
        return node.inputs[0], node
    if is_op(node, "Mul"):
        for x in node.inputs:
            if is_const_close(other_input(node, x), 1 / math.sqrt(2)):
                return x, node
    return None


def _tanh_input(tanh: ir.Node) -> tuple[ir.Value, list[ir.Node]] | None:
    scaled = producer(tanh.inputs[0], "Mul")  # √(2/π)·(x + 0.044715·x³)
    if scaled is None or not only_user(tanh.inputs[0]):
        return None
    inner = next((v for v in scaled.inputs if is_const_close(other_input(scaled, v), math.sqrt(2 / math.pi))), None)
    add = producer(inner, "Add")
    if add is None or not only_user(inner):
        return None
    for x in add.inputs:
        cubic = producer(other_input(add, x), "Mul")  # 0.044715·x³
        if cubic is None or not only_user(other_input(add, x)):
            continue
        for p in cubic.inputs:
            power = producer(p, "Pow")
            if power is not None and power.inputs[0] is x and is_const_close(power.inputs[1], 3.0) \
                    and is_const_close(other_input(cubic, p), 0.044715) and only_user(p):
                return x, [scaled, add, cubic, power]
    return None


def fuse_gelu(node: ir.Node, report: PassReport) -> bool:
    if is_op(node, "Erf"):
        found = _erf_input(node)
        approximate, inner_nodes = "none", [found[1]] if found else []
    elif is_op(node, "Tanh"):
        found = _tanh_input(node)
        approximate, inner_nodes = "tanh", found[1] if found else []
    else:
        return False
    if found is None:
        return False
    x = found[0]
    plus = _one_plus(node.outputs[0])
    product = _half_x_times(plus.outputs[0], x) if plus is not None else None
    if product is None:
        report.refuse(RULE, node, f"{node.op_type} of a GELU-like input, but not followed by ½·x·(1 + ·)")
        return False
    nodes, out = product
    fused = ir.Node(KILN_DOMAIN, "Gelu", [x], [ir.AttrString("approximate", approximate)])
    replace_with([*inner_nodes, node, plus, *nodes], fused, out)
    return True
