"""Removal of an Expand whose readers broadcast anyway.

An op with ONNX's multidirectional (numpy) broadcasting expands its operands itself: when another operand of
each reader already has a shape the Expand's output broadcasts into, the Expand copies for nothing:

    Add(Expand(x, s), y) -> Add(x, y)    when broadcast(shape(x), s) broadcasts into shape(y)

because broadcast(shape(x), s) is itself a broadcast of x, so both sides are broadcast(x, y) element by element.
The same holds through an embedding lookup of the expanded indices, whose rows broadcast as the indices do:

    Add(Gather(W, Expand(i, s)), y) -> Add(Gather(W, i), y)

BERT's token-type ids are a [1, S] buffer expanded to [B, S] before their lookup: a [B, S, H] copy of the same rows
at every batch > 1 (at a new shape computed on the host), where the residual Add broadcasts the [1, S, H] rows.
Dims of other names count where the reader's declared output has the other operand's shape: the broadcast of all
operands equal to that operand's shape means each of them broadcasts into it (fill_uniform_gather's token types of a
[1, Min(P, seq)] position slice, added to [batch, seq, H] rows).
"""

from __future__ import annotations

import onnx_ir as ir

from kiln.ops._util import MULTIDIRECTIONAL
from kiln.passes._rewrite import PassReport, bypass, consumers, dims_equal, is_op, run_rule

RULE = "drop_broadcast_expand"

def broadcasts_into(dims: list, full: list) -> bool:
    """Whether a tensor of shape `dims` broadcast against one of shape `full` gives shape `full`: no more axes,
    and each axis, aligned from the right, of size 1 or equal to full's (symbols by name)."""
    if len(dims) > len(full):
        return False
    return all((isinstance(d, int) and d == 1) or dims_equal([d], [f]) for d, f in zip(reversed(dims), reversed(full)))


def _lookup_dims(gather: ir.Node, indices: list) -> list:
    """The shape of `gather` reading indices of shape `indices`: data[:axis] + indices + data[axis + 1:]."""
    data = list(gather.inputs[0].shape)
    axis = gather.attributes.get_int("axis", 0)
    axis = axis + len(data) if axis < 0 else axis
    return [*data[:axis], *indices, *data[axis + 1:]]


def _reader_refusal(reader: ir.Node, value: ir.Value) -> str | None:
    """Why `reader` needs `value` at its full shape, or None when one of its other operands already has a shape
    `value`'s broadcasts into: by its dims, or by the reader's output having that operand's shape (BERT's
    [1, Min(128, seq), H] token-type rows added to [batch, seq, H] give [batch, seq, H])."""
    full = list(value.shape)
    others = [v for v in reader.inputs if v is not None and v is not value]
    if len(others) != len(reader.inputs) - 1:
        return f"{reader.op_type} {reader.name!r} reads {value.name!r} more than once"
    if any(v.shape is not None and broadcasts_into(full, list(v.shape)) for v in others):
        return None
    out = reader.outputs[0].shape
    if out is not None and any(v.shape is not None and dims_equal(list(v.shape), list(out)) for v in others):
        return None  # the reader's output, the broadcast of all its operands, has that operand's shape: so does `value`
    shape = "[" + ", ".join(str(d) for d in full) + "]"  # symbols by name: [batch, 1, seq, seq]
    return f"no other operand of {reader.op_type} {reader.name!r} has the shape {shape} or one it broadcasts into"


def _lookup_refusal(gather: ir.Node, source: ir.Value, expanded: ir.Value) -> str | None:
    """Why the Gather reading `expanded` as indices cannot read `source` (the Expand's input) instead."""
    out = gather.outputs[0]
    if out.is_graph_output():
        return f"the lookup {gather.name!r} gives the graph output {out.name!r} (its shape would change)"
    if out.shape is None or gather.inputs[0].shape is None:
        return f"the lookup {gather.name!r} or its table has an unknown shape"
    axis = gather.attributes.get_int("axis", 0)
    if axis != 0 and len(source.shape) != len(expanded.shape):
        # [..., indices, ...] broadcasts as the indices do only where the axes before them stay aligned
        return f"the lookup {gather.name!r} on axis {axis} would read indices of rank {len(source.shape)}, " \
               f"not {len(expanded.shape)}"
    for reader in consumers(out):
        if not is_op(reader, *MULTIDIRECTIONAL):
            return f"{reader.op_type} {reader.name!r} reads the lookup {gather.name!r} and does not broadcast"
        if (reason := _reader_refusal(reader, out)) is not None:
            return reason
    return None


def _is_lookup(node: ir.Node, indices: ir.Value) -> bool:
    return is_op(node, "Gather") and node.inputs[1] is indices and node.inputs[0] is not indices


def _refusal(expand: ir.Node) -> str | None:
    """Why the Expand's readers need its copy, or None when each broadcasts its input as it would its output."""
    out, source = expand.outputs[0], expand.inputs[0]
    if out.is_graph_output():
        return f"its output {out.name!r} is a graph output (its shape would change)"
    if out.shape is None or source.shape is None:
        return f"its input {source.name!r} or output {out.name!r} has an unknown shape"
    for reader in consumers(out):
        if _is_lookup(reader, out):
            reason = _lookup_refusal(reader, source, out)
        elif is_op(reader, *MULTIDIRECTIONAL):
            reason = _reader_refusal(reader, out)
        else:
            reason = f"{reader.op_type} {reader.name!r} reads it and does not broadcast"
        if reason is not None:
            return reason
    return None


def drop_broadcast_expand(node: ir.Node, report: PassReport) -> bool:
    # Add(Expand(x, s), y) -> Add(x, y) where shape(Expand(x, s)) broadcasts into shape(y); alike through Gather(W, ·)
    if not is_op(node, "Expand"):
        return False
    out, source = node.outputs[0], node.inputs[0]
    readers = consumers(out)
    if not any(is_op(r, *MULTIDIRECTIONAL) or _is_lookup(r, out) for r in readers):
        return False  # not a candidate: no reader broadcasts
    if (reason := _refusal(node)) is not None:
        report.refuse(RULE, node, reason)
        return False
    for gather in [r for r in readers if _is_lookup(r, out)]:
        gather.outputs[0].shape = ir.Shape(_lookup_dims(gather, list(source.shape)))
    return bypass(node, source)


def drop_broadcast_expands(model: ir.Model, report: PassReport) -> int:
    return run_rule(model, RULE, drop_broadcast_expand, report, main_only=False)
