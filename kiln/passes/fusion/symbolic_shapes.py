"""What an exporter's shape arithmetic means at a symbolic batch, so the moves around a recurrent layer fuse.

torch.onnx.export with a dynamic batch writes a bidirectional layer's output merge as

    t = Transpose(Y [S, 2, batch, H], (0, 2, 1, 3))
    y = Reshape(t, Concat(Shape(t)[0], Shape(t)[1], Shape(t)[2] * Shape(t)[3]))

and its zero initial states as Slice(Expand(0, Concat(.., Shape(x)[0], ..))). At static shapes constant folding
removes both; at a symbolic batch they stay, Shape(t) keeps t read twice and the Reshape's output shape is
unknown, so kiln's relayout pass (kiln/passes/fusion/relayout.py) cannot fuse the move into a Relayout and the
native segment splits around the layer. Two rules:

    LSTM(.., initial_h = zeros, ..)           ->  LSTM(.., initial_h absent, ..)      the spec: absent = zeros
    Reshape(t, <shape arithmetic over t>)     ->  Reshape(t, [96, 0, 256])           0: t's dim (allowzero=0)

A third removes a Reshape that keeps its input's shape, which a static export folds away and a symbolic one
cannot: Phi-3 exported with symbolic batch x sequence reshapes its attention output o [B, H, S, D] to
Concat(Shape(ids)[0], -1, Shape(ids)[1], D) before the head merge. The Reshape hid the Transpose behind it from
fuse_attention, and the merge (Reshape, Transpose, Reshape) ran as three torch steps between native segments:

    Reshape(x, [d0, .., -1, .., dn])          ->  x       every dk x's own dim, by size or symbol; -1 at most once

Only CPU builds ask for them (fusion.CPU_RULES), next to fuse_relayout.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from kiln.passes._rewrite import PassReport, attr, bypass, const, is_op, new_initializer, producer

RULE_STATES = "drop_zero_initial_states"
RULE_RESHAPE = "constant_reshape_target"

RECURRENT = ("LSTM", "GRU", "RNN")
_INITIAL_H = 5  # initial_h; LSTM's initial_c is 6
# ops through which a zero tensor stays zeros (input 0 the data, the others shapes or bounds)
_KEEPS_ZEROS = ("Expand", "Slice", "Reshape", "Unsqueeze", "Squeeze", "Transpose", "Identity", "Cast")

Dim = int | str | None  # a static size, a named symbolic one, or unknown


def _is_zeros(value: ir.Value | None) -> bool:
    for _ in range(16):
        if value is None:
            return False
        array = const(value)
        if array is not None:
            return array.size > 0 and not np.any(array)
        node = producer(value)
        if not is_op(node, *_KEEPS_ZEROS):
            return False
        value = node.inputs[0]
    return False


def drop_zero_initial_states(node: ir.Node, report: PassReport) -> bool:
    # LSTM/GRU/RNN(.., initial_h = Expand(0, ..), initial_c = Slice(Expand(0, ..))) -> the same with them absent
    if not is_op(node, *RECURRENT):
        return False
    states = range(_INITIAL_H, min(len(node.inputs), _INITIAL_H + (2 if node.op_type == "LSTM" else 1)))
    zeros = [k for k in states if node.inputs[k] is not None and const(node.inputs[k]) is None
             and _is_zeros(node.inputs[k])]
    for k in zeros:
        node.replace_input_with(k, None)
    return bool(zeros)


def _dim(d) -> Dim:
    if isinstance(d, int):
        return d
    return d.value if isinstance(d, ir.SymbolicDim) and d.value else None


def _recurrent_y(node: ir.Node, depth: int) -> list[Dim] | None:
    """Y's dims from X's: [S, D, N, H] (layout 1: [N, S, D, H])."""
    x = symbolic_shape(node.inputs[0], depth + 1)
    hidden = attr(node, "hidden_size")
    if x is None or len(x) != 3 or hidden is None:
        return None
    directions = 2 if attr(node, "direction", "forward") == "bidirectional" else 1
    if attr(node, "layout", 0):
        return [x[0], x[1], directions, int(hidden)]
    return [x[0], directions, x[1], int(hidden)]


def symbolic_shape(value: ir.Value | None, depth: int = 0) -> list[Dim] | None:
    """value's dims (ints, symbol names, None unknown), or None for an unknown rank. A recurrent layer's Y whose
    shape import left unknown (its X came from a Reshape of computed shape) is read off X's."""
    if value is None or depth > 8:
        return None
    dims = None if value.shape is None else [_dim(d) for d in value.shape]
    node = producer(value)
    if dims is not None and None not in dims:
        return dims
    if is_op(node, *RECURRENT) and value is node.outputs[0]:
        return _recurrent_y(node, depth) or dims
    if is_op(node, "Transpose"):  # the input's dims permuted
        x = symbolic_shape(node.inputs[0], depth + 1)
        perm = attr(node, "perm")
        if x is not None:
            return [x[p] for p in (perm if perm is not None else range(len(x))[::-1])]
    return dims


def _shape_values(value: ir.Value | None, depth: int = 0) -> list[Dim] | None:
    """The 1-D int64 value as dims, where it is shape arithmetic over known dims: Shape, Slice, Concat, Mul
    of single dims, constants."""
    if value is None or depth > 12:
        return None
    array = const(value)
    if array is not None:
        return [int(v) for v in np.asarray(array).reshape(-1)] if array.ndim <= 1 else None
    node = producer(value)
    if is_op(node, "Shape"):
        dims = symbolic_shape(node.inputs[0])
        if dims is None:
            return None
        start, end = attr(node, "start", 0), attr(node, "end", None)
        return dims[start:end]
    if is_op(node, "Concat"):
        parts = [_shape_values(v, depth + 1) for v in node.inputs]
        return None if any(p is None for p in parts) else [d for p in parts for d in p]
    if is_op(node, "Slice"):
        data = _shape_values(node.inputs[0], depth + 1)
        bounds = [const(v) if v is not None else None for v in node.inputs[1:]]
        if data is None or len(bounds) < 2 or any(b is None for b in bounds[:2]) \
                or any(v is not None and b is None for v, b in zip(node.inputs[3:], bounds[2:])):
            return None
        steps = bounds[3] if len(bounds) > 3 and bounds[3] is not None else [1]
        if int(np.asarray(steps).reshape(-1)[0]) != 1:
            return None
        return data[int(bounds[0].reshape(-1)[0]):int(bounds[1].reshape(-1)[0])]
    if is_op(node, "Mul"):
        a, b = (_shape_values(v, depth + 1) for v in node.inputs)
        if a is None or b is None or len(a) != 1 or len(b) != 1:
            return None
        return [a[0] * b[0] if isinstance(a[0], int) and isinstance(b[0], int) else None]
    if is_op(node, "Cast", "Identity"):
        return _shape_values(node.inputs[0], depth + 1)
    return None


def constant_reshape_target(node: ir.Node, report: PassReport) -> bool:
    # Reshape(t, Concat(Shape(t)[0], Shape(t)[1], Shape(t)[2] * Shape(t)[3])) -> Reshape(t, [S, 0, 2H])
    if not is_op(node, "Reshape") or const(node.inputs[1]) is not None or attr(node, "allowzero", 0):
        return False
    target = _shape_values(node.inputs[1])
    dims = symbolic_shape(node.inputs[0])
    if target is None or dims is None:
        return False
    constant: list[int] = []
    inferred = 0
    for k, d in enumerate(target):
        if isinstance(d, int) and d > 0:
            constant.append(d)
        elif isinstance(d, str) and k < len(dims) and dims[k] == d:
            constant.append(0)  # ONNX Reshape: 0 copies the input's dim at this place
        else:
            constant.append(-1)
            inferred += 1
    if inferred > 1:
        report.refuse(RULE_RESHAPE, node, f"the target {target} has more than one dim of unknown size")
        return False
    graph = node.graph
    shape = new_initializer(graph, f"{node.name}_shape", np.array(constant, dtype=np.int64))
    node.replace_input_with(1, shape)
    out = node.outputs[0]
    out.shape = ir.Shape([d if isinstance(d, int) and d > 0 else (d if isinstance(d, str) else None)
                          for d in target])
    return True


def remove_symbolic_same_shape_reshape(node: ir.Node, report: PassReport) -> bool:
    # Reshape(x [B, H, S, D], Concat(Shape(ids)[0], -1, Shape(ids)[1], D)) -> x: every target dim is x's own
    if not is_op(node, "Reshape"):
        return False
    target = _shape_values(node.inputs[1])
    dims = symbolic_shape(node.inputs[0])
    if target is None or dims is None or len(target) != len(dims):
        return False
    copy = None if attr(node, "allowzero", 0) else 0  # allowzero=0: a 0 copies x's dim
    other = [t for t, d in zip(target, dims) if t != copy and not (t is not None and t != -1 and t == d)]
    if other not in ([], [-1]):  # one -1 among x's own dims is x's dim there: its size over the others' product
        return False
    return bypass(node, node.inputs[0])
