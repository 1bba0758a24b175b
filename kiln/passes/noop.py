"""Removal of nodes that compute nothing at inference time, of chains that cancel, and of work a pick makes
unnecessary (a Transpose whose one reader selects a single index of it).

Each rule returns True when it rewrote the graph; the comment on each gives the algebra.
"""

from __future__ import annotations

import onnx_ir as ir

from kiln.passes._rewrite import PassReport, attr, bypass, const, is_op, producer, run_rule, static_shape

# Casts through these types keep every value of the source type exactly (src -> wider -> src).
_LOSSLESS_WIDENING = {
    ir.DataType.FLOAT16: {ir.DataType.FLOAT, ir.DataType.DOUBLE},
    ir.DataType.BFLOAT16: {ir.DataType.FLOAT, ir.DataType.DOUBLE},
    ir.DataType.FLOAT: {ir.DataType.DOUBLE},
    ir.DataType.INT8: {ir.DataType.INT16, ir.DataType.INT32, ir.DataType.INT64},
    ir.DataType.INT16: {ir.DataType.INT32, ir.DataType.INT64},
    ir.DataType.INT32: {ir.DataType.INT64},
    ir.DataType.UINT8: {ir.DataType.INT16, ir.DataType.INT32, ir.DataType.INT64, ir.DataType.UINT16,
                        ir.DataType.UINT32, ir.DataType.UINT64},
    ir.DataType.BOOL: {ir.DataType.INT8, ir.DataType.INT32, ir.DataType.INT64, ir.DataType.UINT8},
}


def remove_identity(node: ir.Node, report: PassReport) -> bool:
    # Identity(x) -> x
    return is_op(node, "Identity") and node.inputs[0] is not None and bypass(node, node.inputs[0])


def remove_single_concat(node: ir.Node, report: PassReport) -> bool:
    # Concat(x) -> x (torch.cat of a one-tensor list: each DenseNet block's first layer)
    return is_op(node, "Concat") and len(node.inputs) == 1 and node.inputs[0] is not None and \
        bypass(node, node.inputs[0])


def remove_dropout(node: ir.Node, report: PassReport) -> bool:
    # Dropout(x) -> x at inference (training_mode absent or false; the mask unused)
    if not is_op(node, "Dropout"):
        return False
    training = node.inputs[2] if len(node.inputs) > 2 else None
    if training is not None and (const(training) is None or bool(const(training).reshape(-1)[0])):
        return False
    return bypass(node, node.inputs[0])


def remove_same_shape_reshape(node: ir.Node, report: PassReport) -> bool:
    # Reshape(x, shape(x)) -> x, also Expand to x's own static shape; Squeeze/Unsqueeze/Flatten alike
    if not is_op(node, "Reshape", "Expand", "Flatten", "Squeeze", "Unsqueeze"):
        return False
    before, after = static_shape(node.inputs[0]), static_shape(node.outputs[0])
    return before is not None and before == after and bypass(node, node.inputs[0])


def remove_zero_pad(node: ir.Node, report: PassReport) -> bool:
    # Pad(x, pads = 0) -> x, whatever the mode (Swin's pad to a whole number of windows when there is none)
    if not is_op(node, "Pad"):
        return False
    pads = const(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] is not None else None
    if pads is None:
        pads = attr(node, "pads")
    if pads is None or any(int(p) != 0 for p in list(pads.reshape(-1) if hasattr(pads, "reshape") else pads)):
        return False
    return bypass(node, node.inputs[0])


def collapse_reshape_chain(node: ir.Node, report: PassReport) -> bool:
    # Reshape(Reshape(x, s1), s2) -> Reshape(x, s2) when s2 copies no dim (no 0 entries)
    if not is_op(node, "Reshape"):
        return False
    inner = producer(node.inputs[0], "Reshape")
    shape = const(node.inputs[1])
    if inner is None or shape is None or (attr(node, "allowzero", 0) == 0 and (shape == 0).any()):
        return False
    node.replace_input_with(0, inner.inputs[0])
    return True


def collapse_transpose_chain(node: ir.Node, report: PassReport) -> bool:
    # Transpose(Transpose(x, p1), p2) -> Transpose(x, p1[p2]); Transpose(x, identity) -> x
    if not is_op(node, "Transpose"):
        return False
    perm = attr(node, "perm")
    inner = producer(node.inputs[0], "Transpose")
    if perm is not None and perm == sorted(perm):
        return bypass(node, node.inputs[0])
    if inner is None or perm is None or attr(inner, "perm") is None:
        return False
    combined = [attr(inner, "perm")[p] for p in perm]
    node.replace_input_with(0, inner.inputs[0])
    node.attributes["perm"] = ir.AttrInt64s("perm", combined)
    return True


def gather_through_transpose(node: ir.Node, report: PassReport) -> bool:
    # Gather(Transpose(x, p), i, axis=a), i a scalar -> Gather(x, i, axis=p[a]) when the axes left keep their order
    # (a batch-first RNN's last step, out[:, -1] of Transpose(Y, [1, 0, 2]): one row picked, not [S, N, H] moved)
    if not is_op(node, "Gather") or static_shape(node.inputs[1]) != []:
        return False
    transpose = producer(node.inputs[0], "Transpose")
    perm = None if transpose is None else attr(transpose, "perm")
    if perm is None:
        return False
    rank = len(perm)
    axis = int(attr(node, "axis", 0))
    axis = axis + rank if axis < 0 else axis
    if not 0 <= axis < rank:
        return False
    left = [p for i, p in enumerate(perm) if i != axis]
    if left != sorted(left):
        report.refuse("gather_through_transpose", node, f"the axes left by the pick, {left}, change order")
        return False
    node.replace_input_with(0, transpose.inputs[0])
    node.attributes["axis"] = ir.AttrInt64("axis", int(perm[axis]))
    return True


def remove_cast_round_trip(node: ir.Node, report: PassReport) -> bool:
    # Cast(x, to=type(x)) -> x;  Cast(Cast(x, wider), type(x)) -> x
    if not is_op(node, "Cast"):
        return False
    source = node.inputs[0]
    target = ir.DataType(attr(node, "to"))
    if source.dtype == target:
        return bypass(node, source)
    inner = producer(source, "Cast")
    if inner is None or inner.inputs[0].dtype != target:
        return False
    if source.dtype not in _LOSSLESS_WIDENING.get(target, set()):
        return False
    return bypass(node, inner.inputs[0])


NOOP_RULES = {
    "remove_identity": remove_identity,
    "remove_single_concat": remove_single_concat,
    "remove_dropout": remove_dropout,
    "remove_same_shape_reshape": remove_same_shape_reshape,
    "remove_zero_pad": remove_zero_pad,
    "collapse_reshape_chain": collapse_reshape_chain,
    "collapse_transpose_chain": collapse_transpose_chain,
    "gather_through_transpose": gather_through_transpose,
    "remove_cast_round_trip": remove_cast_round_trip,
}


def remove_noops(model: ir.Model, report: PassReport) -> int:
    return sum(run_rule(model, name, rule, report, main_only=False) for name, rule in NOOP_RULES.items())

