"""Softmax from its decomposed form -> kiln::Softmax.

    e = exp(x - max(x));   y = e / sum(e)          (one axis; the max is optional)
"""

from __future__ import annotations

import onnx_ir as ir

from kiln.passes._rewrite import (
    KILN_DOMAIN,
    PassReport,
    consumers,
    is_op,
    only_user,
    producer,
    reduce_axes,
    replace_with,
)

RULE = "fuse_softmax"


def fuse_softmax(node: ir.Node, report: PassReport) -> bool:
    if not is_op(node, "Exp"):
        return False
    e = node.outputs[0]
    users = consumers(e)
    total = next((n for n in users if is_op(n, "ReduceSum")), None)
    div = next((n for n in users if is_op(n, "Div")), None)
    if total is None or div is None or len(users) != 2 or e.is_graph_output():
        return False
    axes = reduce_axes(total)
    if axes is None or len(axes) != 1 or div.inputs[0] is not e or div.inputs[1] is not total.outputs[0] \
            or not only_user(total.outputs[0]):
        report.refuse(RULE, node, "exp(x) / sum(exp(x)) is not over exactly one axis with keepdims")
        return False
    nodes, x = [node, total, div], node.inputs[0]
    sub = producer(x, "Sub")
    if sub is not None and only_user(x):
        peak = producer(sub.inputs[1], "ReduceMax")
        if peak is not None and peak.inputs[0] is sub.inputs[0] and reduce_axes(peak) == axes \
                and only_user(sub.inputs[1]):
            nodes += [sub, peak]
            x = sub.inputs[0]
    fused = ir.Node(KILN_DOMAIN, "Softmax", [x], [ir.AttrInt64("axis", axes[0])])
    replace_with(nodes, fused, div.outputs[0])
    return True
