"""Rotary position embeddings (Llama's rotate-half form) -> kiln::Rotary.

    y = x·cos + rotate_half(x)·sin,   rotate_half(x) = concat(-x[..., D/2:], x[..., :D/2])

as exporters write it: Concat(Neg(Slice(x, D/2:)), Slice(x, :D/2)) -> Mul(·, sin), Mul(x, cos) -> Add.
Five to six steps become one. The layout around it is taken in too, when cos and sin are
constants (they are, for static shapes):

- x = Transpose(x', p) with the last axis fixed: rotate x' with cos/sin transposed by p⁻¹ and
  transpose after, so the Transpose reaches the attention that absorbs it as a permutation;
- x' = Reshape(x'', [B, S, H, D]) of a 3-D x'': the op unflattens the heads itself (num_heads=H).

cos and sin computed at run time (a dynamic export's, from the positions: [B, 1, S, D]) are laid out the same
way by a Transpose node each, [B, S, 1, D], one per table shared by every layer: a view, made once per call before
the layers (it reads nothing they write), so the head split and the rotary stay inside the CPU's native segment.
"""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir

from kiln.passes._rewrite import (
    FUSED_FROM,
    KILN_DOMAIN,
    PassReport,
    attr,
    const,
    consumers,
    fused_from,
    is_op,
    new_initializer,
    only_user,
    other_input,
    producer,
    replace_with,
)
from kiln.passes.fusion.attention_layout import _split_heads

RULE = "fuse_rotary"
INT64_MAX = np.iinfo(np.int64).max


def _last_axis_slice(value: ir.Value) -> tuple[ir.Value, int, int] | None:
    """(x, start, end) when value = Slice(x, [start], [end], [-1]) with step 1, read only once."""
    node = producer(value, "Slice")
    if node is None or not only_user(value) or node.inputs[0].shape is None or len(node.inputs) < 4:
        return None
    rank = len(node.inputs[0].shape)
    starts, ends, axes = (const(v) for v in node.inputs[1:4])
    steps = const(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] is not None else np.ones(1, np.int64)
    if any(a is None or a.size != 1 for a in (starts, ends, axes, steps)) or int(steps[0]) != 1:
        return None
    if int(axes.reshape(-1)[0]) not in (-1, rank - 1):
        return None
    return node.inputs[0], int(starts.reshape(-1)[0]), int(ends.reshape(-1)[0])


def _rotate_half_of(concat: ir.Node) -> tuple[ir.Value, list[ir.Node]] | None:
    """(x, nodes) when concat = Concat(Neg(x[..., D/2:]), x[..., :D/2]) on the last axis."""
    if len(concat.inputs) != 2 or concat.inputs[0] is None:
        return None
    rank = None if concat.outputs[0].shape is None else len(concat.outputs[0].shape)
    if attr(concat, "axis") not in (-1, None if rank is None else rank - 1):
        return None
    neg = producer(concat.inputs[0], "Neg")
    if neg is None or not only_user(concat.inputs[0]):
        return None
    second, first = _last_axis_slice(neg.inputs[0]), _last_axis_slice(concat.inputs[1])
    if second is None or first is None or second[0] is not first[0]:
        return None
    x = first[0]
    depth = None if x.shape is None else x.shape[-1]
    if not isinstance(depth, int) or depth % 2 or first[1:] != (0, depth // 2):
        return None
    if second[1] != depth // 2 or second[2] < depth:
        return None  # partial rotary (only the first dims rotate) is not this op
    return x, [producer(neg.inputs[0]), neg, producer(concat.inputs[1]), concat]


def _padded(array: np.ndarray, rank: int) -> np.ndarray:
    return array.reshape((1,) * (rank - array.ndim) + array.shape)


def _transposed(graph: ir.Graph, value: ir.Value, array: np.ndarray, inverse: list[int]) -> ir.Value:
    """The cos/sin table laid out for the un-transposed x; one copy per table and layout, shared by layers."""
    name = f"{value.name}_perm{''.join(map(str, inverse))}"
    if name in graph.initializers:
        return graph.initializers[name]
    return new_initializer(graph, name, np.ascontiguousarray(_padded(array, len(inverse)).transpose(inverse)))


def _computed_table(table: ir.Value, rank: int) -> bool:
    """A cos/sin table computed at run time (a dynamic export's, from the positions) of x's rank: one the rule can
    lay out for the un-transposed x with a Transpose node (a view) instead of a new constant."""
    return const(table) is None and table.shape is not None and len(table.shape) == rank and table.type is not None


def _transposed_at_run(table: ir.Value, inverse: list[int], before: ir.Node) -> ir.Value:
    """Transpose(table, inverse), the one an earlier layer's rotary made when there is one (layers share the tables)."""
    for user in consumers(table):
        if is_op(user, "Transpose") and attr(user, "perm") == inverse and user.graph is before.graph:
            return user.outputs[0]
    node = ir.Node("", "Transpose", [table], [ir.AttrInt64s("perm", inverse)],
                   name=f"{table.name}_perm{''.join(map(str, inverse))}")
    node.outputs[0].type = table.type
    node.outputs[0].shape = ir.Shape([table.shape[i] for i in inverse])
    node.outputs[0].name = node.name
    before.graph.insert_before(before, node)
    return node.outputs[0]


def fuse_rotary(node: ir.Node, report: PassReport) -> bool:
    if not is_op(node, "Concat"):
        return False
    found = _rotate_half_of(node)
    if found is None:
        return False
    x, nodes = found
    mul_sin = only_user(node.outputs[0])
    add = only_user(mul_sin.outputs[0]) if is_op(mul_sin, "Mul") else None
    if not is_op(add, "Add"):
        report.refuse(RULE, node, "rotate_half(x) is not multiplied by sin and added to x·cos")
        return False
    sin = other_input(mul_sin, node.outputs[0])
    mul_cos = producer(other_input(add, mul_sin.outputs[0]), "Mul")
    if mul_cos is None or x not in mul_cos.inputs or not only_user(mul_cos.outputs[0]):
        report.refuse(RULE, node, "rotate_half(x)·sin is not added to x·cos of the same x")
        return False
    cos = other_input(mul_cos, x)
    nodes += [mul_sin, mul_cos, add]
    out, graph = add.outputs[0], node.graph
    # Layout: rotate before the head Transpose (cos/sin follow it), unflatten heads in the op.
    perm, attrs = None, []
    transpose = producer(x, "Transpose")
    c, s = const(cos), const(sin)
    rank = None if x.shape is None else len(x.shape)
    tables = (c is not None and s is not None and c.ndim <= rank and s.ndim <= rank) if rank is not None else False
    computed = rank is not None and not tables and _computed_table(cos, rank) and _computed_table(sin, rank)
    if transpose is not None and (tables or computed) \
            and set(consumers(x)) <= set(nodes) and not x.is_graph_output() \
            and attr(transpose, "perm") is not None and attr(transpose, "perm")[-1] == rank - 1:
        perm = attr(transpose, "perm")
        nodes.append(transpose)
        x = transpose.inputs[0]
        if (heads := _split_heads(x, transpose)) is not None:
            nodes.append(heads[0])
            x = heads[0].inputs[0]
            attrs.append(ir.AttrInt64("num_heads", heads[1]))
    # Decided: from here on the graph changes.
    if perm is not None and computed:
        inverse = [int(i) for i in np.argsort(perm)]
        cos, sin = _transposed_at_run(cos, inverse, add), _transposed_at_run(sin, inverse, add)
    elif perm is not None:
        inverse = [int(i) for i in np.argsort(perm)]
        cos, sin = _transposed(graph, cos, c, inverse), _transposed(graph, sin, s, inverse)
    rotary = ir.Node(KILN_DOMAIN, "Rotary", [x, cos, sin], attrs, name=add.name)
    if perm is None:
        replace_with(nodes, rotary, out)
        return True
    rotary.metadata_props[FUSED_FROM] = json.dumps(fused_from(nodes))
    graph.insert_before(add, rotary)
    transposed = ir.Node("", "Transpose", rotary.outputs, [ir.AttrInt64s("perm", perm)], name=f"{add.name}_transpose")
    rotary.outputs[0].type = out.type
    if out.shape is not None:
        rotary.outputs[0].shape = ir.Shape([out.shape[i] for i in np.argsort(perm)])
    replace_with(nodes, transposed, out)
    transposed.metadata_props[FUSED_FROM] = json.dumps(fused_from([transpose]))
    return True
