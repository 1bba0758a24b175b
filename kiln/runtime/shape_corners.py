"""Which of a shape function's tensors are corners of themselves at larger input dims (kiln/runtime/shape_function.py).

A decoder's causal mask is a function of the input dims alone (batch b, sequence s): ~20 small torch steps at each new
b x s past the shapes planned at load (a Concat/Slice/Sub/CumSum chain of positions, GatherNDs by index grids, the
comparisons, a Where: ~0.3-0.5 ms right after a run, bench/results/first-shape-2026-12-06.md). Its value at (b, s) is
the top-left corner of its value at any (B, S) >= (b, s): M(b, s) = M(B, S)[:b, :, :s, :s]. This module proves that
from the graph's ops, by an abstract interpretation of the shape-only steps over two facts:

- `_Ints`: a shape value (a 0-D or 1-D int64 tensor) element by element, each an `Affine` of one input dim
  (dim + offset) or a constant, or unknown;
- `Corner`: a tensor V whose every axis has an extent that is an Affine of the input dims, non-decreasing in them,
  and whose elements do not depend on the dims: for dims d <= D (every input dim >= 1), V(d) = V(D)[:e_0(d), ...,
  :e_k(d)]. `bound`: every element is an integer in [0, bound(d)) (an arange's positions: an index that stays in
  range); `columns`: of an index grid (a Concat on its last axis of such tensors), each column's bound.

The rules, each from the op's definition (ONNX), each refusing anything it does not prove:
- a constant: a corner (its sizes constant); Range(c, L, 1) with c >= 0 constant: extent L - c, bound L;
- Unsqueeze, Squeeze of size-1 axes: axes of extent 1 added or removed;
- Expand(V, shape): per axis the broadcast of V's extent and the shape's element, where one of them is 1 or both are
  the same Affine (an element that could differ from V's extent at some dims refuses);
- an elementwise op (Add, Equal, And, Where, Cast, ...): out[k] is a function of the operands at k; per axis the
  operands' extents other than 1 must be one Affine (so they broadcast alike at every dims);
- Slice on axes with constant start c >= 0, step 1 and an end e (a constant, negative from the end, or an Affine)
  provably within [c, extent]: out[k] = V[c + k], extent e - c;
- Concat on an axis where every operand but the last has a constant extent there (each operand's offset constant)
  and the other axes agree;
- CumSum along an axis, not reversed: a prefix's sums are the sums' prefix;
- Gather(T, I) where I's bound is provably <= T's extent on the axis: out[..k..] = T[..I[k]..] reads T's corner;
- GatherND(T, G), batch_dims 0, G an index grid whose column i's bound is provably <= T's extent on axis i: every
  index is within T(d) (so the same element of T(D)), none negative (counted from the end otherwise).

Provably a <= b: both constant, or of the same dim, or a constant c with b = dim + o and c <= 1 + o (dims >= 1: at a 0
dim the caller computes the ops). Anything else has no fact, and a tensor reading it is no corner.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kiln.ops._util import norm_axis
from kiln.runtime.step import BoundStep

_INT64 = 7  # ONNX TensorProto.INT64
_SMALL = 64  # a constant int64 tensor of at most this many elements is known element by element
_ELEMENTWISE = frozenset({"Add", "Sub", "Mul", "Div", "Mod", "Max", "Min", "Equal", "Less", "LessOrEqual", "Greater",
                          "GreaterOrEqual", "And", "Or", "Xor", "Not", "Neg", "Abs", "Where", "Cast", "Sign",
                          "BitwiseAnd", "BitwiseOr", "BitwiseXor", "BitwiseNot", "IsNaN", "IsInf"})


@dataclass(frozen=True)
class Affine:
    """dim + offset, where dim is an input's axis (slot, axis) >= 1, or the constant offset where dim is None."""

    dim: tuple[int, int] | None
    offset: int

    def plus(self, n: int) -> Affine:
        return Affine(self.dim, self.offset + n)

    def at_most(self, other: Affine) -> bool:
        """Provably self <= other at every dims >= 1."""
        if self.dim == other.dim:
            return self.offset <= other.offset
        return self.dim is None and other.dim is not None and self.offset <= 1 + other.offset

    def code(self) -> str:
        """A Python expression of it in the generated function (an input x{slot} holds the dims)."""
        if self.dim is None:
            return str(self.offset)
        slot, axis = self.dim
        return f"x{slot}.shape[{axis}]" + (f" + {self.offset}" if self.offset else "")


_ONE = Affine(None, 1)


@dataclass(frozen=True)
class _Ints:
    """A shape value's elements (None: unknown), `scalar`: a 0-D tensor (one element)."""

    elements: tuple[Affine | None, ...]
    scalar: bool


@dataclass(frozen=True)
class Corner:
    """V(d) = V(D)[:e_0(d), ..., :e_k(d)] for d <= D (the module's doc)."""

    extents: tuple[Affine, ...]
    bound: Affine | None = None  # every element an integer in [0, bound)
    columns: tuple[Affine | None, ...] | None = None  # of an index grid: each column's bound

    def dims(self) -> tuple[tuple[int, int], ...]:
        """The input dims its extents follow, in a fixed order."""
        return tuple(sorted({e.dim for e in self.extents if e.dim is not None}))


@dataclass
class Facts:
    """corners' answer: the corners by slot, and the rank each input must have at least for them to hold (a Shape of
    an input with start:end is end - start dims only where the input has `end` axes; the caller checks at the call)."""

    corners: dict[int, Corner]
    ranks: dict[int, int]
    dims: set[tuple[int, int]] = field(default_factory=set)  # every input dim a Shape reads (slot, axis): a cut's
    # key, each >= 1 and at most the base's at a call (a corner's elements may follow a dim its extents do not name)


def corners(steps: list[BoundStep], order: list[int], template: list[Any], input_slots: list[int],
            calls: set[int] = frozenset()) -> Facts:
    """The slots of `order`'s outputs that are corners (the module's doc), by the steps' ops on the inputs' sizes
    and the constants alone (an input's data is no corner: a value reading it has no fact)."""
    ints: dict[int, _Ints] = {}
    found: dict[int, Corner] = {}
    ranks: dict[int, int] = {}
    dims: set[tuple[int, int]] = set()
    for s, value in enumerate(template):
        if isinstance(value, torch.Tensor) and s not in input_slots:
            found[s] = Corner(tuple(Affine(None, n) for n in value.shape))
            if value.dtype == torch.int64 and value.dim() <= 1 and value.numel() <= _SMALL:
                values = [int(v) for v in value.reshape(-1).tolist()]
                ints[s] = _Ints(tuple(Affine(None, v) for v in values), value.dim() == 0)
    for i in order:
        step = steps[i]
        if i in calls or step.ctx.domain not in ("", "ai.onnx") or len(step.outputs) != 1 or step.outputs[0] < 0:
            continue
        op, attrs, out = step.ctx.op_type, step.attributes, step.outputs[0]
        args = list(step.inputs)
        try:
            made = _ints(op, args, attrs, ints, found, input_slots, ranks, dims)
            if made is not None:
                ints[out] = made
            corner = _corner(op, args, attrs, ints, found)
        except (KeyError, IndexError, TypeError, ValueError):  # an input without a fact, an odd attribute: no fact
            corner = None
        if corner is not None:
            found[out] = corner
    return Facts({s: c for s, c in found.items() if template[s] is None}, ranks, dims)


def _ints(op: str, args: list[int], attrs: dict, ints: dict[int, _Ints], found: dict[int, Corner],
          input_slots: list[int], ranks: dict[int, int], dims: set[tuple[int, int]]) -> _Ints | None:
    x = args[0] if args else -1
    if op == "Shape" and len(args) == 1:
        start, end = int(attrs.get("start", 0)), attrs.get("end")
        if x in input_slots and end is not None and 0 <= start <= int(end):
            ranks[x] = max(ranks.get(x, 0), int(end))
            dims.update((x, a) for a in range(start, int(end)))
            return _Ints(tuple(Affine((x, a), 0) for a in range(start, int(end))), False)
        if x in found:
            extents = found[x].extents
            return _Ints(extents[start:None if end is None else int(end)], False)
        return None
    if x not in ints:
        return None
    v = ints[x]
    if op == "Identity" or (op == "Cast" and attrs.get("to") == _INT64):
        return v
    if op == "Squeeze" and len(v.elements) == 1 and not v.scalar:
        return _Ints(v.elements, True)
    if op in ("Unsqueeze", "Reshape") and len(v.elements) == 1 and v.scalar:
        if op == "Unsqueeze" and len(args) == 2 and (args[1] not in ints or len(ints[args[1]].elements) != 1):
            return None  # (two axes: a [1, 1] tensor)
        if op == "Unsqueeze" and len(args) == 1 and len(attrs.get("axes", ())) != 1:
            return None
        if op == "Reshape" and (len(args) != 2 or args[1] not in ints
                                or ints[args[1]].elements not in ((Affine(None, -1),), (_ONE,))):
            return None
        return _Ints(v.elements, False)
    if op == "Concat" and all(a in ints and not ints[a].scalar for a in args):
        return _Ints(tuple(e for a in args for e in ints[a].elements), False)
    if op == "Gather" and len(args) == 2 and args[1] in ints and not v.scalar and int(attrs.get("axis", 0)) in (0, -1):
        index = ints[args[1]]
        picked = []
        for e in index.elements:
            if e is None or e.dim is not None or not -len(v.elements) <= e.offset < len(v.elements):
                return None
            picked.append(v.elements[e.offset])
        return _Ints(tuple(picked), index.scalar)
    if op in ("Add", "Sub") and len(args) == 2 and args[1] in ints:
        a, b = v, ints[args[1]]
        if len(a.elements) != len(b.elements) and 1 not in (len(a.elements), len(b.elements)):
            return None
        n = max(len(a.elements), len(b.elements))
        made = []
        for k in range(n):
            p = a.elements[k if len(a.elements) > 1 else 0]
            q = b.elements[k if len(b.elements) > 1 else 0]
            if p is None or q is None or (p.dim is not None and q.dim is not None) or (op == "Sub" and q.dim):
                made.append(None)
            elif op == "Add":
                made.append(p.plus(q.offset) if q.dim is None else q.plus(p.offset))
            else:
                made.append(p.plus(-q.offset))
        return _Ints(tuple(made), a.scalar and b.scalar)
    return None


def _corner(op: str, args: list[int], attrs: dict, ints: dict[int, _Ints], found: dict[int, Corner]
            ) -> Corner | None:
    if op == "Range" and len(args) == 3:
        start, limit, delta = (_scalar(ints, a) for a in args)
        if start is None or limit is None or delta is None or start.dim is not None or start.offset < 0 \
                or delta != _ONE or not start.at_most(limit):
            return None
        return Corner((limit.plus(-start.offset),), bound=limit)  # start, start + 1, ..., limit - 1
    if any(a < 0 for a in args):
        return None
    if op in ("Unsqueeze", "Squeeze"):
        x = found[args[0]]
        axes = _constant_list(ints, args[1]) if len(args) == 2 else attrs.get("axes")
        if axes is None:
            return None
        if op == "Unsqueeze":
            rank = len(x.extents) + len(axes)
            inserted = sorted(_axis(a, rank) for a in axes)
            extents = list(x.extents)
            for a in inserted:
                extents.insert(a, _ONE)
            return Corner(tuple(extents), x.bound)
        rank = len(x.extents)
        removed = {_axis(a, rank) for a in axes}
        if any(x.extents[a] != _ONE for a in removed):
            return None
        return Corner(tuple(e for a, e in enumerate(x.extents) if a not in removed), x.bound)
    if op == "Identity":
        return found[args[0]]
    if op == "Expand" and len(args) == 2:
        x, shape = found[args[0]], ints[args[1]].elements
        if None in shape:
            return None
        rank = max(len(x.extents), len(shape))
        ours = (_ONE,) * (rank - len(x.extents)) + x.extents
        theirs = (_ONE,) * (rank - len(shape)) + tuple(shape)
        extents = []
        for e, s in zip(ours, theirs):
            if e == _ONE:
                if not Affine(None, 0).at_most(s):
                    return None
                extents.append(s)
            elif s == _ONE or s == e:
                extents.append(e)
            else:
                return None
        return Corner(tuple(extents), x.bound)
    if op in _ELEMENTWISE:
        operands = [found[a] for a in args]
        rank = max(len(c.extents) for c in operands)
        extents = []
        for k in range(rank):
            sizes = {c.extents[k - rank + len(c.extents)] for c in operands if k - rank + len(c.extents) >= 0}
            sizes.discard(_ONE)
            if len(sizes) > 1:
                return None
            extents.append(sizes.pop() if sizes else _ONE)
        return Corner(tuple(extents))
    if op == "Slice" and 3 <= len(args) <= 5:
        return _sliced(found[args[0]], *(ints[a].elements for a in args[1:]))  # (one unknown: KeyError, no fact)
    if op == "Concat":
        operands = [found[a] for a in args]
        rank = len(operands[0].extents)
        if any(len(c.extents) != rank for c in operands):
            return None
        axis = _axis(int(attrs["axis"]), rank)
        if any(c.extents[k] != operands[0].extents[k] for c in operands for k in range(rank) if k != axis) \
                or any(c.extents[axis].dim is not None for c in operands[:-1]):
            return None
        extent = operands[-1].extents[axis].plus(sum(c.extents[axis].offset for c in operands[:-1]))
        extents = operands[0].extents[:axis] + (extent,) + operands[0].extents[axis + 1:]
        columns = None
        if axis == rank - 1 and all(c.extents[axis] == _ONE for c in operands):  # an index grid's columns
            columns = tuple(c.bound for c in operands)
        return Corner(extents, columns=columns)
    if op == "CumSum" and len(args) == 2 and not int(attrs.get("reverse", 0)):
        x, axis = found[args[0]], _scalar(ints, args[1])
        if axis is None or axis.dim is not None or not -len(x.extents) <= axis.offset < len(x.extents):
            return None
        return Corner(x.extents)
    if op == "Gather" and len(args) == 2:
        data, index = found[args[0]], found[args[1]]
        axis = _axis(int(attrs.get("axis", 0)), len(data.extents))
        if index.bound is None or not index.bound.at_most(data.extents[axis]):
            return None
        return Corner(data.extents[:axis] + index.extents + data.extents[axis + 1:], data.bound)
    if op == "GatherND" and len(args) == 2 and not int(attrs.get("batch_dims", 0)):
        data, grid = found[args[0]], found[args[1]]
        columns = grid.columns
        if columns is None or not grid.extents or grid.extents[-1] != Affine(None, len(columns)) \
                or len(columns) > len(data.extents) \
                or not all(c is not None and c.at_most(e) for c, e in zip(columns, data.extents)):
            return None
        return Corner(grid.extents[:-1] + data.extents[len(columns):], data.bound)
    return None


def _sliced(x: Corner, starts, ends, axes=None, steps=None) -> Corner | None:
    """Slice of a corner (the module's doc): constant starts >= 0, steps 1, ends provably within [start, extent]."""
    rank = len(x.extents)
    if starts is None or ends is None or len(starts) != len(ends):
        return None
    axes = axes if axes is not None else tuple(Affine(None, a) for a in range(len(starts)))
    steps = steps if steps is not None else (_ONE,) * len(starts)
    if len(axes) != len(starts) or len(steps) != len(starts) or None in axes or any(a.dim is not None for a in axes):
        return None
    extents = list(x.extents)
    seen = set()
    for start, end, axis, step in zip(starts, ends, axes, steps):
        a = _axis(axis.offset, rank)
        if a in seen or step != _ONE or start is None or start.dim is not None or start.offset < 0 or end is None:
            return None
        seen.add(a)
        extent = x.extents[a]
        if end.dim is None and end.offset < 0:
            end = extent.plus(end.offset)  # counted from the end
        if end.dim is None and end.offset >= (1 << 62):
            end = extent  # "to the end" (INT64_MAX)
        if not end.at_most(extent):
            if not extent.at_most(end):
                return None
            end = extent  # clamped
        if not start.at_most(end):
            return None
        extents[a] = end.plus(-start.offset)
    return Corner(tuple(extents), x.bound)  # (its elements are some of x's)


def _axis(axis: int, rank: int) -> int:
    """An axis in [-rank, rank) counted from 0 (ValueError otherwise: the op itself refuses it, and no fact holds)."""
    if not -rank <= axis < rank:
        raise ValueError(f"axis {axis} of a rank-{rank} tensor")
    return norm_axis(axis, rank)


def _scalar(ints: dict[int, _Ints], slot: int) -> Affine | None:
    v = ints.get(slot)
    return v.elements[0] if v is not None and len(v.elements) == 1 else None


def _constant_list(ints: dict[int, _Ints], slot: int) -> list[int] | None:
    v = ints.get(slot)
    if v is None or any(e is None or e.dim is not None for e in v.elements):
        return None
    return [e.offset for e in v.elements]


CORNER_BYTES = 4 << 20  # the largest value a CornerCut keeps to cut smaller ones from


class CornerCut:
    """A corner tensor's value at the largest dims met (every input dim it follows at least as large as at any call
    before, and every dim >= 1), and its corner at smaller dims: one slice and one copy instead of the steps that make
    it. The base is replaced whole, so contexts of one engine may share it unlocked. A value of more than CORNER_BYTES
    is not kept (the steps run)."""

    def __init__(self) -> None:
        self._base: tuple[tuple[int, ...], torch.Tensor, Any] | None = None  # (dims, value, its numpy view)

    def __call__(self, dims: tuple[int, ...], extents: tuple[int, ...]) -> torch.Tensor | None:
        """The value at `dims` (its sizes `extents`), contiguous as the op made it; None where no base covers them."""
        base = self._base
        if base is None or any(d < 1 or d > m for d, m in zip(dims, base[0])):
            return None
        held, value, array = base
        if len(extents) != value.dim() or any(not 0 <= e <= n for e, n in zip(extents, value.shape)):
            return None  # (not met where the proof holds: the steps then say what is wrong)
        if array is not None:
            return torch.from_numpy(array[tuple(slice(0, e) for e in extents)].copy())
        return value[tuple(slice(0, e) for e in extents)].clone(memory_format=torch.contiguous_format)

    def keep(self, dims: tuple[int, ...], value: Any) -> None:
        """`value`, the steps' at `dims`, kept as the base where its dims are at least the base's."""
        base = self._base
        if not isinstance(value, torch.Tensor) or value.device.type != "cpu" or not value.is_contiguous() \
                or value.nbytes > CORNER_BYTES or any(d < 1 for d in dims) \
                or (base is not None and any(d < m for d, m in zip(dims, base[0]))):
            return
        try:
            array = value.numpy()
        except (TypeError, RuntimeError):  # a dtype numpy lacks (bfloat16): torch cuts it
            array = None
        self._base = (tuple(dims), value, array)

    @property
    def dims(self) -> tuple[int, ...] | None:
        base = self._base
        return None if base is None else base[0]
