"""Chains of elementwise ops -> one kiln::Elementwise step.

Grown backwards from a root node: a producer joins the group when it is elementwise and
every reader of its output is already in the group (so no intermediate is needed outside).
The group becomes a small program, one line per op (`Mul i0 t1`: inputs `i<k>`, earlier
results `t<k>`), that kiln::Elementwise evaluates with torch on CPU; on GPU it is what a
generated Triton kernel computes in one pass over memory.

Only floating-point values of one dtype are fused: integer Div/Pow follow ONNX rules that
differ from torch's type promotion.
"""

from __future__ import annotations

import onnx_ir as ir

from kiln.passes._rewrite import KILN_DOMAIN, PassReport, attr, consumers, dtype_of, replace_with

RULE = "fuse_elementwise"
UNARY = {"Neg", "Abs", "Exp", "Log", "Sqrt", "Reciprocal", "Relu", "Sigmoid", "Tanh", "Erf", "Sin", "Cos",
         "Floor", "Ceil"}
BINARY = {"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min"}
FLOATS = {ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE}


def _op_name(node: ir.Node) -> str | None:
    """The Elementwise program's name for this node, or None if it cannot join a chain."""
    if node.domain == "" and (node.op_type in UNARY or (node.op_type in BINARY and len(node.inputs) == 2)):
        name = node.op_type
    elif node.op_type == "Gelu" and node.domain in ("", KILN_DOMAIN):
        name = "GeluTanh" if attr(node, "approximate", "none") == "tanh" else "Gelu"
    else:
        return None
    dtypes = {dtype_of(v) for v in [*node.inputs, *node.outputs]}
    return name if len(dtypes) == 1 and dtypes <= FLOATS else None


def fuse_elementwise(root: ir.Node, report: PassReport) -> bool:
    if _op_name(root) is None:
        return False
    readers = consumers(root.outputs[0])
    if len(readers) == 1 and _op_name(readers[0]) is not None and not root.outputs[0].is_graph_output():
        return False  # not the end of its chain: the reader will take it in
    group = [root]
    changed = True
    while changed:
        changed = False
        for node in list(group):
            for value in node.inputs:
                p = value.producer() if value is not None else None
                if p is None or p in group or _op_name(p) is None or value.is_graph_output():
                    continue
                if all(user in group for user in consumers(value)):
                    group.append(p)
                    changed = True
    if len(group) < 2:
        return False
    order = {id(n): i for i, n in enumerate(root.graph)}
    group.sort(key=lambda n: order[id(n)])
    inputs: list[ir.Value] = []
    results: dict[int, str] = {}
    code = []
    for node in group:
        args = []
        for v in node.inputs:
            if id(v) in results:
                args.append(results[id(v)])
            else:
                if v not in inputs:
                    inputs.append(v)
                args.append(f"i{inputs.index(v)}")
        results[id(node.outputs[0])] = f"t{len(code)}"
        code.append(" ".join([_op_name(node), *args]))
    fused = ir.Node(KILN_DOMAIN, "Elementwise", inputs, [ir.AttrStrings("code", code)], name=root.name)
    replace_with(group, fused, root.outputs[0])
    return True
