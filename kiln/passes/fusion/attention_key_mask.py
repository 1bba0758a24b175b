"""A computed attention mask that is the same for every query becomes the key mask it broadcasts: [B, 1, 1, T].

transformers' sdpa_mask (masking_utils) builds a bidirectional encoder's mask from index functions broadcast over
(batch, head, query, key) grids; the dynamo export of BERT with `attention_mask` [B, S] is

    ones = And(True, GreaterOrEqual(Range(0, S, 1)[None, None, :, None], 0))  # q_idx >= 0: [1, 1, S, 1]
    keys = GatherND(Cast(attention_mask, bool), Concat(b_idx, kv_idx))       # padding_mask[b, kv]: [B, 1, 1, S]
    mask = Where(And(ones, keys), 0, -inf)                                   # [B, 1, S, S]

so every layer's attention reads an [B, 1, S, S] mask whose rows are all alike, the CPU kernel cannot stop at a
row's last real key (it does so only for a mask with stride 0 along the queries), and each new shape computes the
index grids (Range, Max, Expand, Concat, GatherND). This rule proves, from the graph alone, that the mask is
constant along the query axis and rewrites it to its [B, 1, 1, T] form, the same values once broadcast:

- an elementwise op (Where, And, Cast, Add, the comparisons...) commutes with broadcasting its inputs, so
  f(broadcast(a), broadcast(b)) = broadcast(f(a, b)): the op is rebuilt on its inputs' query-free forms;
- Expand is a broadcast, which the attention does itself: Expand(x, shape) -> x's query-free form;
- a value whose query dim is 1 (or that has none, rank < 2) is its own query-free form;
- a value whose every element is one number (proved by interval arithmetic on integers: Range(0, n, 1) >= 0,
  so q_idx >= 0 is all True) is that scalar, and And(x, True) = x, Or(x, False) = x, Where(True, x, y) = x;
- GatherND(data, grid) whose grid is an iota on axis a_j for each data axis j (grid[..., j] = i[a_j], the axis'
  length data's dim j: the broadcast aranges of padding_mask[b_idx, kv_idx]) is data itself, laid on the a_j:
  Unsqueeze(data, the other axes), constant along them; elementwise ops of it with scalars run before the
  Unsqueeze (f(Unsqueeze(x), c) = Unsqueeze(f(x, c))), which for float32 is a Reshape.

BERT's mask becomes Reshape(Where(Cast(attention_mask, bool), 0, -inf), [0, 1, 1, -1]): on the CPU three members
of the native segment (the Reshape an alias), added right after what they read, ahead of the layers. (An
Unsqueeze there, no native kernel, cut BERT's one segment in two and cost its direct run: slower than before.)

Anything else (a causal or sliding-window term, kv_idx <= q_idx, a mask input of the graph that is [B, 1, S, S])
varies or may vary along the queries, and the mask is left as it was, with the reason. Dims are compared as the
graph declares them (symbols by name), as the rest of the passes do.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from kiln.ops._util import MULTIDIRECTIONAL
from kiln.passes._rewrite import PassReport, attr, const, consumers, dims_equal, dtype_of, is_op, new_initializer
from kiln.passes.fold import evaluate
from kiln.passes.fusion.attention_mask import broadcast_constant

RULE = "attention_key_mask"

_MAX_DEPTH = 24
# Ops applied element by element: each commutes with broadcasting its inputs
_ELEMENTWISE = MULTIDIRECTIONAL | {"Not", "Neg", "Abs", "Cast", "Identity"}  # (_UNARY below)
_UNARY = frozenset({"Not", "Neg", "Abs", "Cast", "Identity"})
_COMPARISONS = frozenset({"Less", "LessOrEqual", "Greater", "GreaterOrEqual"})
# Ops whose output holds only values of their first input (bounds carry over)
_MOVES = frozenset({"Identity", "Squeeze", "Unsqueeze", "Reshape", "Expand", "Flatten", "Transpose", "Slice",
                    "Gather", "GatherElements", "GatherND", "Tile"})
# A tensor dim is below this: 2^62 elements of any tensor (a Shape's values) exceed every machine's memory
_MAX_DIM = 2 ** 62

Bounds = tuple[int | None, int | None]  # the least and greatest element, None: unknown


@dataclass
class _Iota:
    """value[i] = i[axis]: an arange of `length` (a dim) laid on `axis`."""

    axis: int
    length: int | ir.SymbolicDim


class _Varies(Exception):
    """The value may vary along the query axis (the message says which node, and why)."""


def _rank(value: ir.Value) -> int | None:
    return None if value is None or value.shape is None else len(value.shape)


def _is_one(dim) -> bool:
    return isinstance(dim, int) and dim == 1


def _same_dim(a, b) -> bool:
    return dims_equal([a], [b])


def _integer(dtype: ir.DataType | None) -> bool:
    return dtype is not None and dtype.is_integer()


def _ints(value: ir.Value | None) -> list[int] | None:
    array = const(value)
    return None if array is None else [int(a) for a in array.reshape(-1)]


def _unsqueeze_axes(node: ir.Node, rank: int) -> list[int] | None:
    axes = _ints(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] is not None else attr(node, "axes")
    return None if axes is None else sorted(a + rank if a < 0 else a for a in axes)


def _dim_of(value: ir.Value | None) -> int | ir.SymbolicDim | None:
    """The dim a scalar holds when it is read off a tensor's shape (Squeeze(Shape(x, start=d, end=d+1)),
    Gather(Shape(x), d)) or a constant; None otherwise."""
    if (ints := _ints(value)) is not None:
        return ints[0] if len(ints) == 1 else None
    node = value.producer() if value is not None else None
    if is_op(node, "Squeeze") or is_op(node, "Gather"):
        shape, index = node.inputs[0].producer() if node.inputs[0] is not None else None, 0
        if is_op(node, "Gather"):
            picked = _ints(node.inputs[1])
            if picked is None or len(picked) != 1 or const(node.inputs[1]).ndim != 0:
                return None
            index = picked[0]
        if not is_op(shape, "Shape") or (x := shape.inputs[0]) is None or x.shape is None:
            return None
        rank = len(x.shape)
        start, end = attr(shape, "start", 0), attr(shape, "end", rank)
        start, end = (max(0, min(rank, a + rank if a < 0 else a)) for a in (start, end))
        dims = list(x.shape)[start:end]
        if is_op(node, "Squeeze") and len(dims) != 1:
            return None
        return dims[index] if -len(dims) <= index < len(dims) else None
    return None


def _sum_bounds(a: Bounds, b: Bounds, info: np.iinfo) -> Bounds:
    """Bounds of a + b in a dtype of range `info`, or none at all where the sum might wrap around."""
    (a_lo, a_hi), (b_lo, b_hi) = a, b
    add = lambda x, y: None if x is None or y is None else x + y  # noqa: E731
    lo, hi = add(a_lo, b_lo), add(a_hi, b_hi)
    no_wrap_up = (hi is not None and hi <= info.max) or (a_hi is not None and a_hi <= 0) or \
        (b_hi is not None and b_hi <= 0)  # adding a non-positive number never passes the maximum
    no_wrap_down = (lo is not None and lo >= info.min) or (a_lo is not None and a_lo >= 0) or \
        (b_lo is not None and b_lo >= 0)
    return (lo, hi) if no_wrap_up and no_wrap_down else (None, None)


def _broadcast(shapes: list[list]) -> list | None:
    """The multidirectional broadcast of declared shapes; None where two symbols are not known to be equal."""
    rank = max((len(s) for s in shapes), default=0)
    out = []
    for i in range(rank):
        dims = [s[i - rank + len(s)] for s in shapes if i - rank + len(s) >= 0]
        real = [d for d in dims if not _is_one(d)]
        if real and not all(_same_dim(real[0], d) for d in real[1:]):
            return None
        out.append(real[0] if real else 1)
    return out


# ---------------------------------------------------------------- what the query-free mask is made of


@dataclass
class _Keep:
    """The value itself: its query dim is 1, or it has none."""

    value: ir.Value

    @property
    def shape(self) -> list:
        return list(self.value.shape)

    def build(self, builder: _Builder) -> ir.Value:
        return self.value


@dataclass
class _Uniform:
    """Every element of the value is `scalar` (0-d, the value's dtype); `value`: a 0-d constant holding it."""

    scalar: np.ndarray
    value: ir.Value | None = None

    @property
    def shape(self) -> list:
        return []

    def build(self, builder: _Builder) -> ir.Value:
        return self.value or new_initializer(builder.graph, f"{builder.prefix}_scalar", self.scalar)


@dataclass
class _Constant:
    """A constant's first row along the queries (every row equal)."""

    array: np.ndarray

    @property
    def shape(self) -> list:
        return list(self.array.shape)

    def build(self, builder: _Builder) -> ir.Value:
        return new_initializer(builder.graph, f"{builder.prefix}_rows", self.array)


@dataclass
class _Unsqueezed:
    """Unsqueeze(inner, axes): a GatherND over an iota grid (its data on the grid's axes), and elementwise ops of
    that with scalars, done on the data before it is unsqueezed (f(Unsqueeze(x), c) = Unsqueeze(f(x, c)))."""

    inner: _Plan
    axes: list[int]  # of the result: the axes the inner value does not have (each of size 1)
    shape_: list

    @property
    def shape(self) -> list:
        return self.shape_

    def _reshape_target(self) -> np.ndarray | None:
        """A constant Reshape target giving `shape` from the inner value: 1 on the new axes, 0 (the input's dim
        at the same index) or the static dim on the others, -1 for one that is neither; None if none fits."""
        target, kept = [], 0
        for i, dim in enumerate(self.shape_):
            if i in self.axes:
                target.append(1)
                continue
            target.append(0 if kept == i else dim if isinstance(dim, int) else -1)
            kept += 1
        return np.array(target, np.int64) if target.count(-1) <= 1 else None

    def build(self, builder: _Builder) -> ir.Value:
        value = self.inner.build(builder)
        target = self._reshape_target()
        if dtype_of(value) == ir.DataType.FLOAT and target is not None:
            # a float32 Reshape is an alias inside the CPU's native segments (cpu.alias.Reshape): the mask's steps
            # and the layers stay one segment, which a one-segment program runs directly (kiln/runtime/direct_run.py)
            shape = new_initializer(builder.graph, f"{builder.prefix}_rows_shape", target)
            return builder.add(ir.Node("", "Reshape", [value, shape], name=f"{builder.prefix}_rows"),
                               dtype_of(value), self.shape_)
        # else Unsqueeze(f(x)) = f(Unsqueeze(x)) for a unary elementwise f: the Unsqueeze (a step of its own on the
        # CPU) reads the graph's input where it can, ahead of every layer, and splits no native segment
        unary = []
        while (inner := value.producer()) is not None and inner.domain in ("", "ai.onnx") and len(inner.inputs) == 1 \
                and inner.op_type in _UNARY and _rank(inner.inputs[0]) == _rank(value):
            unary.append(inner)
            value = inner.inputs[0]
        axes = new_initializer(builder.graph, f"{builder.prefix}_axes", np.array(self.axes, np.int64))
        value = builder.add(ir.Node("", "Unsqueeze", [value, axes], name=f"{builder.prefix}_rows"),
                            dtype_of(value), self.shape_)
        for op in reversed(unary):
            attributes = [ir.Attr(a.name, a.type, a.value) for a in op.attributes.values()]
            value = builder.add(ir.Node("", op.op_type, [value], attributes, name=f"{op.name}_rows"),
                                dtype_of(op.outputs[0]), self.shape_)
        return value


@dataclass
class _Rebuilt:
    """The elementwise `node` on its inputs' query-free forms."""

    node: ir.Node
    inputs: list[_Keep | _Uniform | _Constant | _Unsqueezed | _Rebuilt | None]
    shape_: list

    @property
    def shape(self) -> list:
        return self.shape_

    def build(self, builder: _Builder) -> ir.Value:
        inputs = [None if p is None else p.build(builder) for p in self.inputs]
        attributes = [ir.Attr(a.name, a.type, a.value) for a in self.node.attributes.values()]
        node = ir.Node(self.node.domain, self.node.op_type, inputs, attributes, name=f"{self.node.name}_keys")
        return builder.add(node, dtype_of(self.node.outputs[0]), self.shape_)


_Plan = _Keep | _Uniform | _Constant | _Unsqueezed | _Rebuilt


@dataclass
class _Builder:
    """Adds the new nodes, each right after the last node it reads from (first in the graph where it reads only
    inputs and constants): a mask made from the graph's inputs is computed ahead of the layers, not between two of
    them, where on the CPU a step that is no native kernel (an Unsqueeze) would cut a native segment in two."""

    graph: ir.Graph
    prefix: str
    order: dict[int, float] = field(default_factory=dict)  # id(node) -> position in the graph

    def __post_init__(self) -> None:
        self.order = {id(n): float(i) for i, n in enumerate(self.graph)}

    def add(self, node: ir.Node, dtype: ir.DataType, shape: list) -> ir.Value:
        node.outputs[0].type, node.outputs[0].shape = ir.TensorType(dtype), ir.Shape(shape)
        producers = [v.producer() for v in node.inputs if v is not None and v.producer() is not None]
        anchor = max(producers, key=lambda n: self.order[id(n)], default=None)
        if anchor is None:
            first = next(iter(self.graph))
            self.graph.insert_before(first, node)
            self.order[id(node)] = self.order[id(first)] - 0.5
        else:
            self.graph.insert_after(anchor, node)
            later = [p for p in self.order.values() if p > self.order[id(anchor)]]
            self.order[id(node)] = (self.order[id(anchor)] + min(later, default=self.order[id(anchor)] + 1)) / 2
        return node.outputs[0]


# ---------------------------------------------------------------- the proof


class QueryFree:
    """Decides, off the graph, how a mask value is computed with one row for every query (`plan`), and which
    values are one number throughout (`uniform`) or lie between bounds (`bounds`)."""

    def __init__(self, opset: int):
        self.opset = opset
        self._uniform: dict[int, np.ndarray | None] = {}
        self._bounds: dict[int, Bounds] = {}

    def plan(self, value: ir.Value, depth: int = 0) -> _Plan:
        if depth > _MAX_DEPTH:
            raise _Varies(f"{value.name!r} lies more than {_MAX_DEPTH} ops above the attention")
        if (scalar := self.uniform(value)) is not None:
            return _Uniform(scalar, value if const(value) is not None and const(value).ndim == 0 else None)
        node = value.producer()
        if is_op(node, "GatherND") and (rows := self._rows(node)) is not None:
            if len(rows.shape) >= 2 and not _is_one(rows.shape[-2]):  # gathered by the query index
                raise _Varies(f"GatherND {node.name!r} reads its data along the query axis")
            return rows
        if value.shape is not None and (len(value.shape) < 2 or _is_one(value.shape[-2])):
            return _Keep(value)
        if (array := const(value)) is not None:
            rows = np.ascontiguousarray(array[..., :1, :])  # a constant alike along the queries: one row of it
            if array.ndim >= 2 and np.ascontiguousarray(array).tobytes() == \
                    np.ascontiguousarray(np.broadcast_to(rows, array.shape)).tobytes():  # bit for bit
                return _Constant(rows)
            raise _Varies(f"the constant {value.name!r} {value.shape} differs between queries")
        if node is None:
            raise _Varies(f"{value.name!r} {value.shape} is a graph input with a query axis")
        if value.shape is None:
            raise _Varies(f"{value.name!r} (from {node.op_type} {node.name!r}) has no declared shape")
        if is_op(node, "Expand"):
            return self.plan(node.inputs[0], depth + 1)  # a broadcast: the attention broadcasts the mask itself
        if node.domain not in ("", "ai.onnx") or node.op_type not in _ELEMENTWISE or len(node.outputs) != 1:
            raise _Varies(f"{node.op_type} {node.name!r} gives {value.name!r} {value.shape}, which may vary along "
                          "the query axis")
        inputs = [None if v is None else self.plan(v, depth + 1) for v in node.inputs]
        return self._rebuilt(node, inputs)

    def _rebuilt(self, node: ir.Node, inputs: list[_Plan | None]) -> _Plan:
        uniform = [p.scalar if isinstance(p, _Uniform) else None for p in inputs]
        op = node.op_type
        if op == "Where" and uniform[0] is not None:
            return inputs[1] if bool(uniform[0]) else inputs[2]  # Where(True, x, y) = x, Where(False, x, y) = y
        if op in ("And", "Or"):
            neutral = op == "And"  # And(x, True) = x, Or(x, False) = x
            rest = [p for p, u in zip(inputs, uniform) if u is None or bool(u) != neutral]
            if len(rest) == 1 and not isinstance(rest[0], _Uniform):
                return rest[0]
        unsqueezed = [p for p in inputs if isinstance(p, _Unsqueezed)]
        if len(unsqueezed) == 1 and all(p is None or p is unsqueezed[0] or isinstance(p, _Uniform) for p in inputs):
            inner = unsqueezed[0]  # f(Unsqueeze(x), c) = Unsqueeze(f(x, c)): on the smaller tensor, unsqueezed last
            rebuilt = _Rebuilt(node, [inner.inner if p is inner else p for p in inputs], inner.inner.shape)
            return _Unsqueezed(rebuilt, inner.axes, inner.shape)
        shape = _broadcast([p.shape for p in inputs if p is not None])
        if shape is None:
            raise _Varies(f"{node.op_type} {node.name!r}: its inputs' dims are not known to broadcast")
        return _Rebuilt(node, inputs, shape)

    # -- values that are one number

    def uniform(self, value: ir.Value | None) -> np.ndarray | None:
        """The one value every element of `value` holds (0-d array), or None if that is not proved."""
        if value is None:
            return None
        if id(value) not in self._uniform:
            self._uniform[id(value)] = self._find_uniform(value)
        return self._uniform[id(value)]

    def _find_uniform(self, value: ir.Value) -> np.ndarray | None:
        array = broadcast_constant(value)
        if array is not None:
            flat = np.asarray(array).reshape(-1)
            same = flat.size > 0 and np.array_equal(flat, np.full_like(flat, flat[0]))
            return flat[:1].reshape(()) if same else None
        node = value.producer()
        if node is None or node.domain not in ("", "ai.onnx") or len(node.outputs) != 1:
            return None
        dtype = dtype_of(value)
        if node.op_type in _COMPARISONS and all(_integer(dtype_of(v)) for v in node.inputs):
            decided = self._compare(node.op_type, self.bounds(node.inputs[0]), self.bounds(node.inputs[1]))
            return None if decided is None else np.array(decided)
        if node.op_type not in _ELEMENTWISE or any(v is None for v in node.inputs):
            return None
        scalars = [self.uniform(v) for v in node.inputs]
        if node.op_type in ("And", "Or") and dtype == ir.DataType.BOOL:
            absorbing = node.op_type == "Or"  # And(x, False) = False, Or(x, True) = True
            if any(s is not None and bool(s) == absorbing for s in scalars):
                return np.array(absorbing)
        if any(s is None for s in scalars):
            return None
        results = evaluate(node, self.opset, [ir.tensor(np.ascontiguousarray(s).reshape(())) for s in scalars])
        if not results or dtype is None or results[0].dtype != dtype.numpy() or results[0].size != 1:
            return None
        return results[0].reshape(())

    @staticmethod
    def _compare(op: str, a: Bounds, b: Bounds) -> bool | None:
        """a OP b for every element pair, from the bounds: True, False, or None (undecided)."""
        if op in ("Greater", "GreaterOrEqual"):  # a > b is b < a
            a, b, op = b, a, op.replace("Greater", "Less")
        (a_lo, a_hi), (b_lo, b_hi) = a, b
        strict = op == "Less"
        if a_hi is not None and b_lo is not None and (a_hi < b_lo if strict else a_hi <= b_lo):
            return True
        if a_lo is not None and b_hi is not None and (a_lo >= b_hi if strict else a_lo > b_hi):
            return False
        return None

    # -- integer bounds

    def bounds(self, value: ir.Value | None, depth: int = 0) -> Bounds:
        """Least and greatest element of an integer value (None: unknown)."""
        if value is None or not _integer(dtype_of(value)) or depth > _MAX_DEPTH:
            return None, None
        if id(value) not in self._bounds:
            self._bounds[id(value)] = self._find_bounds(value, depth)
        return self._bounds[id(value)]

    def _find_bounds(self, value: ir.Value, depth: int) -> Bounds:
        array = broadcast_constant(value)
        if array is not None:
            return (int(array.min()), int(array.max())) if array.size else (None, None)
        node = value.producer()
        if node is None or node.domain not in ("", "ai.onnx"):
            return None, None
        op, inputs = node.op_type, node.inputs
        of = lambda v: self.bounds(v, depth + 1)  # noqa: E731
        info = np.iinfo(dtype_of(value).numpy())
        if op in ("Shape", "Size"):
            found: Bounds = (0, _MAX_DIM)
        elif op in _MOVES:
            found = of(inputs[0])
        elif op == "Concat":
            parts = [of(v) for v in inputs]
            found = (None if any(lo is None for lo, _ in parts) else min(lo for lo, _ in parts),
                     None if any(hi is None for _, hi in parts) else max(hi for _, hi in parts))
        elif op == "Cast" and (_integer(dtype_of(inputs[0])) or dtype_of(inputs[0]) == ir.DataType.BOOL):
            found = (0, 1) if dtype_of(inputs[0]) == ir.DataType.BOOL else of(inputs[0])
        elif op == "Range":
            found = self._range_bounds(node, of)
        elif op in ("Add", "Sub"):
            b = of(inputs[1])
            if op == "Sub":  # a - b = a + (-b); -min wraps
                b = (None if b[1] is None or b[1] == info.min else -b[1], None if b[0] is None else -b[0])
            found = _sum_bounds(of(inputs[0]), b, info)
        elif op in ("Max", "Min"):
            parts = [of(v) for v in inputs]
            lows, highs = [lo for lo, _ in parts if lo is not None], [hi for _, hi in parts if hi is not None]
            if op == "Max":  # max(a, b) >= a's least and b's least; <= the greater greatest, when both are known
                found = (max(lows, default=None), max(highs) if len(highs) == len(parts) else None)
            else:
                found = (min(lows) if len(lows) == len(parts) else None, min(highs, default=None))
        else:
            return None, None
        lo, hi = found
        # a bound outside the dtype's range says nothing (Cast to a narrower type wraps)
        if (lo is not None and lo < info.min) or (hi is not None and hi > info.max):
            return None, None
        return lo, hi

    @staticmethod
    def _range_bounds(node: ir.Node, of) -> Bounds:
        """Range(start, limit, delta): start + k·delta for 0 <= k < ceil((limit - start) / delta)."""
        delta = _ints(node.inputs[2]) if len(node.inputs) > 2 else None
        if delta is None or len(delta) != 1 or delta[0] == 0:
            return None, None
        (s_lo, s_hi), (l_lo, l_hi) = of(node.inputs[0]), of(node.inputs[1])
        if delta[0] > 0:  # start <= x < limit
            return s_lo, None if l_hi is None else l_hi - 1
        return None if l_lo is None else l_lo + 1, s_hi  # limit < x <= start

    # -- index grids

    def iota(self, value: ir.Value, depth: int = 0) -> _Iota | None:
        """value[i] = i[axis] for every index i of value (an arange laid on `axis`), or None."""
        node = value.producer() if value is not None else None
        if node is None or depth > _MAX_DEPTH or node.domain not in ("", "ai.onnx") or _rank(value) is None:
            return None
        op, source = node.op_type, node.inputs[0]
        if op == "Range":
            if _ints(node.inputs[0]) != [0] or _ints(node.inputs[2]) != [1] or _rank(value) != 1:
                return None
            return _Iota(0, _dim_of(node.inputs[1]) or value.shape[0])  # Range(0, n, 1): n long
        if op == "Identity" or (op == "Cast" and _integer(dtype_of(source))
                                and dtype_of(value) in (ir.DataType.INT64, dtype_of(source))):
            return self.iota(source, depth + 1)
        if op == "Add" and (zero := next((v for v in node.inputs if self.uniform(v) is not None
                                          and int(self.uniform(v)) == 0), None)) is not None:
            other = node.inputs[1] if zero is node.inputs[0] else node.inputs[0]  # x + 0 (a zero offset)
            return self.iota(other, depth + 1) if _rank(other) == _rank(value) else None
        if op == "Unsqueeze":
            inner, axes = self.iota(source, depth + 1), _unsqueeze_axes(node, _rank(value))
            if inner is None or axes is None:
                return None
            kept = [i for i in range(_rank(value)) if i not in axes]
            return _Iota(kept[inner.axis], inner.length) if inner.axis < len(kept) else None
        if op == "Expand":
            inner = self.iota(source, depth + 1)
            if inner is None or _rank(source) is None or _rank(value) < _rank(source):
                return None
            axis = inner.axis + _rank(value) - _rank(source)
            # not broadcast along the arange's own axis (it keeps its length): the same arange there
            return _Iota(axis, inner.length) if _same_dim(source.shape[inner.axis], value.shape[axis]) else None
        return None

    def _rows(self, gather: ir.Node) -> _Unsqueezed | None:
        """GatherND(data, grid) with grid[..., j] an arange over data's axis j laid on the grid's axis a_j
        (a_0 < a_1 < ...) and every other grid axis of size 1: out[i] = data[i[a_0], i[a_1], ...], which is
        Unsqueeze(data, the other axes)."""
        data, grid = gather.inputs[0], gather.inputs[1]
        out = gather.outputs[0]
        if attr(gather, "batch_dims", 0) != 0 or _rank(data) is None or _rank(grid) is None or out.shape is None:
            return None
        rank, q = _rank(grid) - 1, _rank(data)
        concat = grid.producer()
        if not is_op(concat, "Concat") or attr(concat, "axis") not in (-1, rank) or len(concat.inputs) != q:
            return None
        axes = []
        for j, piece in enumerate(concat.inputs):
            unsqueeze = piece.producer() if piece is not None else None
            if not is_op(unsqueeze, "Unsqueeze") or _unsqueeze_axes(unsqueeze, rank + 1) != [rank]:
                return None
            component = unsqueeze.inputs[0]
            found = self.iota(component)
            if found is None or not _same_dim(found.length, data.shape[j]):
                return None  # not an arange over all of data's axis j
            axes.append(found.axis)
        if axes != sorted(set(axes)):
            return None  # a transposed gather
        others = [i for i in range(rank) if i not in axes]
        if not all(_is_one(out.shape[i]) for i in others):
            return None
        shape = [data.shape[axes.index(i)] if i in axes else 1 for i in range(rank)]
        return _Unsqueezed(_Keep(data), others, shape)


# ---------------------------------------------------------------- the rule


def use_key_mask(node: ir.Node, report: PassReport) -> bool:
    # Attention(q, k, v, M [B, 1, S, T]) -> Attention(q, k, v, M' [B, 1, 1, T]), M = broadcast(M')
    if not is_op(node, "Attention", domain="kiln") or len(node.inputs) < 4 or node.inputs[3] is None:
        return False
    mask, graph = node.inputs[3], node.graph
    rank = _rank(mask)
    if rank is None or rank < 2 or _is_one(mask.shape[-2]) or mask.producer() is None or graph is None:
        return False  # a key mask already, or an input of the graph (nothing computed here)
    if broadcast_constant(mask) is not None:
        return False  # constants: drop_empty_attention_mask / attention_mask_broadcast
    try:
        plan = QueryFree(graph.opset_imports.get("", 21)).plan(mask)
    except _Varies as e:
        report.refuse(RULE, node, f"the mask may vary along the query axis: {e}")
        return False
    # Decided: from here on the graph changes.
    builder = _Builder(graph, f"{mask.name or node.name}_keys")
    if isinstance(plan, _Uniform):
        keys = new_initializer(graph, builder.prefix, plan.scalar.reshape((1,) * rank))
    else:
        keys = plan.build(builder)
        if len(plan.shape) < rank:  # the same rank as the mask it stands for: [1, ..] in front
            axes = new_initializer(graph, f"{builder.prefix}_lead", np.arange(rank - len(plan.shape), dtype=np.int64))
            keys = builder.add(ir.Node("", "Unsqueeze", [keys, axes], name=f"{builder.prefix}_rank"),
                               dtype_of(mask), [1] * (rank - len(plan.shape)) + plan.shape)
    for user in consumers(mask):  # every attention reading this mask (a model's layers share one)
        if is_op(user, "Attention", domain="kiln") and user.inputs[3] is mask:
            user.replace_input_with(3, keys)
    return True
