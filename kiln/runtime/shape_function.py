"""A program's shape-only steps (kiln/runtime/shapes.py) as one generated Python function.

A first call at a new input-shape signature computes every shape-only value before the loop may skip
their steps. Step by step that is ~26 trips through the op dispatch for an exported BERT (call_step, the
op's generic argument handling: ints() of constant axes tensors, a torch.tensor per Shape, reshapes of
one-element tensors), ~0.4 ms of Python on a quiet machine and about twice that right after a native
segment's run has cooled the caches. Here the steps become straight-line code, generated once at load:

- dimensions stay Python ints: a Shape is `x.shape[a:b]`, a Squeeze of it `d[0]`, a Concat of dims a
  tuple, a Gather from a shape an index, Add/Sub/Mul of dims integer arithmetic (int64 range checked);
- constant axes, starts and steps are read once, at load; the ops taking them call the op's own code on
  Python ints (kiln/ops/tensor.py reshape_to, slice_ints, squeeze_axes, unsqueeze_axes, expand_to,
  kiln/ops/generators.py arange_int64), so a value is computed as the step computes it;
- a Gather or GatherElements by indices known >= 0 (a constant's position ids, an arange, views of them)
  skips the op's negative-index normalization;
- any other step is a direct call of its implementation, its dims made tensors just before;
- only values a later step reads leave the function (as tensors: what the steps would have stored);
- values that follow from some of the input dims only (an encoder's position embeddings and mask grids from the
  sequence length alone) are kept per those dims (_Memo, bounded): a new batch x sequence whose sequence was seen
  before computes only what needs both. The statements run grouped by the dims they follow (each group after the
  groups of fewer dims it reads; a statement reading an input's data, or a random op, is never kept).
- a group that follows one dim d (an encoder's sequence length) whose tensors are prefixes along an axis of length d
  (a Slice [0, d) of a constant, an arange(0, d), gathers by those, Unsqueezes, elementwise ops with constants) is
  computed once at a larger d (the constant's length, else the largest d seen: _Prefix) and narrowed at a new d: a
  new sequence length costs a few views instead of its gathers and aranges (BERT-base: ~0.3 ms cold).
- an index grid over several dims (an exported mask's [b, 1, 1, s, 2]: a Concat at -1 of Unsqueezes of Expands of
  such prefixes to their broadcast) is a corner of the grid at larger dims: made once at the largest dims seen and
  cut at a new signature (_Grid: one as_strided and one copy instead of five ops, ~0.2 ms cold on BERT-base).
- a stored tensor that follows every input dim and is proved, op by op, to be the top-left corner of its value at
  larger dims (a decoder's causal mask [b, 1, s, s]: kiln/runtime/shape_corners.py) is cut from its value at the
  largest dims met (CornerCut: one slice and one copy) instead of running the ~20 steps that make it; the steps run
  only where no larger value is kept yet, and their value is kept when its dims are the largest.

A kind stands for the tensor a step would make: "int" a 0-D int64 tensor, "ints" a 1-D one, "tensor"
the value itself. Any exception inside the generated function makes the caller run the steps one by
one (Program.run), so a failing layer is named exactly as before, and an unusual value (a dim past
int64) is computed by the op itself.
"""

from __future__ import annotations

import keyword
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kiln.ops._util import MULTIDIRECTIONAL, broadcast_sizes, norm_axis
from kiln.ops.generators import arange_int64
from kiln.ops.indexing import gather, gather_elements
from kiln.ops.tensor import expand_to, reshape_to, slice_ints, squeeze_axes, unsqueeze_axes
from kiln.runtime.shape_corners import CornerCut, corners
from kiln.runtime.step import BoundStep

_INT64 = 7  # ONNX TensorProto.INT64
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
SMALL = 64  # an int64 constant of at most this many elements (0-D or 1-D) is known as Python ints at load
MEMO_ENTRIES = 256  # a group's values kept for at most this many values of its dims ...
MEMO_BYTES = 8 << 20  # ... and this many bytes of tensors (an encoder's position embeddings: seq x hidden floats)
GRID_BYTES = 4 << 20  # the largest index grid a _Grid keeps to cut smaller ones from
GRID_ROWS_BYTES = 8 << 20  # ... and the most bytes of its rows of corners (_GridBase) it keeps
GATHER_GRIDS = True  # a GatherND by a _Grid's grid indexes by the grid's parts (_GatherGrid; False: the A of
# bench/first_shape.py --no-gather-grids)
CORNERS = True  # a stored tensor proved a corner of itself at larger dims is cut from its value there (shape_corners;
# False: the A of bench/first_shape.py --no-corners)
_RANDOM = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli"}


class _Memo:
    """A group's values by the values of the dims it follows, least recently used out (MEMO_ENTRIES, MEMO_BYTES;
    the newest always kept). Contexts of one engine share it: a lock around the dict.

    `held` is the bytes of the distinct storages its entries keep alive, each counted once however many entries
    view it: a _Prefix's values at each d are views of one base (BERT-base's position embeddings at every sequence
    length, which the load's view job fills: first_calls.memo_shapes, are two 1.5 MB bases, where summing each
    view's bytes counted ~200 MB and kept 5 of 256 entries)."""

    def __init__(self) -> None:
        self._kept: OrderedDict[tuple, tuple] = OrderedDict()
        self._storages: dict[tuple, dict[Any, int]] = {}  # each entry's storages: data address -> bytes
        self._counts: dict[Any, int] = {}  # each storage's entries (its bytes counted in `held` while > 0)
        self.held = 0
        self._lock = threading.Lock()

    def get(self, key: tuple) -> tuple | None:
        with self._lock:
            found = self._kept.get(key)
            if found is not None:
                self._kept.move_to_end(key)
            return found

    def put(self, key: tuple, values: tuple) -> None:
        storages = {}
        for v in values:
            if isinstance(v, torch.Tensor):
                try:
                    storage = v.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
                except (RuntimeError, NotImplementedError):  # no storage of its own to share (a sparse tensor)
                    storages[("tensor", id(v))] = v.nbytes
        with self._lock:
            if key in self._kept:
                return
            self._kept[key] = values
            self._storages[key] = storages
            counts = self._counts
            for address, size in storages.items():
                held = counts.get(address, 0)
                counts[address] = held + 1
                if not held:
                    self.held += size
            while len(self._kept) > 1 and (len(self._kept) > MEMO_ENTRIES or self.held > MEMO_BYTES):
                old, _ = self._kept.popitem(last=False)
                for address, size in self._storages.pop(old).items():
                    counts[address] -= 1
                    if not counts[address]:
                        del counts[address]
                        self.held -= size

    def clear(self) -> None:
        with self._lock:
            self._kept.clear()
            self._storages.clear()
            self._counts.clear()
            self.held = 0

    def __len__(self) -> int:
        return len(self._kept)


@dataclass
class ShapeFunction:
    """`fn(env)` computes the shape-only values into `env` (a Program's slot list, its inputs and
    constants set), writing only `slots`; `source` is the generated code (for reading and tests)."""

    fn: Any
    source: str
    slots: list[int]
    memos: list[_Memo] = field(default_factory=list)  # the groups' kept values (tests read them)
    # every input is read only as `tuple(x.shape[a:b])` (its sizes, never its data, never stored): `fn` gives the
    # same values for numpy inputs as for their torch.from_numpy tensors (DirectRuns.bind skips the conversion)
    shapes_only: bool = False

    def __call__(self, env: list[Any]) -> None:
        self.fn(env)


@dataclass
class _Value:
    var: str  # the expression holding it: a variable, or a literal for a constant's ints
    kind: str  # "tensor" | "ints" (a tuple standing for a 1-D int64 tensor) | "int" (for a 0-D one) | "shape" (a
    # tuple of ints: the sizes alone of a tensor only Shape steps read, _shape_of_broadcast)
    tensor: str | None = None  # a variable holding its tensor form, once made
    constant: Any = None  # a constant's dims, read at load (its axes, starts...)
    length: int | None = None  # of "ints": its length when the graph says it (a Shape's start:end), else None
    nonneg: bool = False  # of "tensor": every element an integer >= 0 (a constant's position ids, an arange)
    expanded: tuple[_Value, str] | None = None  # of an Expand's "tensor": (its input, the shape's expression)
    dim: str | None = None  # of "int" or a 1-element "ints": the 1-element dims line whose one value it is
    along: _Along | None = None  # of "tensor": the prefix it is along that dim
    stacked: tuple[_Value, str] | None = None  # of an Unsqueeze(-1) of an Expand's "tensor": `expanded` (_Grid)
    grid: tuple[str, tuple[tuple[str, str], ...]] | None = None  # of a _Grid's "tensor": (its _Grid's global, its
    # parts' (P_i, S_i) expressions): a GatherND by it indexes by the parts (_GatherGrid)


@dataclass(frozen=True)
class _Along:
    """A tensor V(d) of a group that follows one dim d, known at load to be a prefix: V(d) = V(D)[..., :d, ...]
    along `axis` for any d <= D where V(D)'s axis is D long (no Slice clamped it), by the ops that make it."""

    dim: str  # the dims line (a 1-element Shape of an input) holding d
    axis: int
    rank: int
    fresh: bool  # a new contiguous tensor (an op's result); False: a view of a constant (a Slice's), its strides


def _narrow(base: _NarrowBase, axis: int, d: int, fresh: bool) -> torch.Tensor:
    """The first d >= 1 of `base` along `axis` (every axis before it of size 1: _Prefix checks), laid out as the op
    lays out V(d): a fresh value contiguous (the size-1 axes' strides d times the axis'), a constant's Slice with the
    constant's strides. One view (as_strided): a narrow and a reshape cost ~15 µs each right after a run; the base's
    size and strides are read once, when it is made (two torch calls fewer a narrow)."""
    strides = base.strides
    if fresh:
        strides = (d * strides[axis],) * axis + strides[axis:]
    shape = base.shape
    return base.tensor.as_strided((*shape[:axis], d, *shape[axis + 1:]), strides)


@dataclass(frozen=True)
class _NarrowBase:
    """A value _Prefix narrows at smaller d, with its size and strides."""

    tensor: torch.Tensor
    shape: tuple[int, ...]
    strides: tuple[int, ...]


class _Prefix:
    """A group's values at a new d from its values at a larger d (_Along): the group's function `group(base, dims,
    *free)` computes every value (base None), or narrows the values `narrowed` names ((index, axis, fresh) each) from
    `base`, theirs at a larger d, and computes the rest (ints, and tensors not known as prefixes, from the narrowed
    ones). The base is made at the first d at `bound` (the length of the constants the group slices: BERT's 512
    positions) and grows to a larger d seen; it is replaced whole, so contexts of one engine may share it unlocked."""

    def __init__(self, group: Any, narrowed: list[tuple[int, int, bool]], bound: int | None):
        self._group, self._narrowed, self._bound = group, narrowed, bound
        self._base: tuple[int, list[_NarrowBase]] | None = None  # (its d, the narrowed values there)

    def __call__(self, dims: tuple, *free: Any) -> tuple:
        d = dims[0]
        base = self._base
        if base is not None and 0 < d <= base[0]:
            return self._group(base[1], dims, *free)
        if base is None and self._bound is not None and 0 < d < self._bound:
            base = self._base_at(self._bound, free)
            if base is not None:
                self._base = base
                return self._group(base[1], dims, *free)
        values = self._group(None, dims, *free)
        found = self._narrowable(values, d)
        if found is not None:
            self._base = (d, found)
        return values

    def _base_at(self, at: int, free: tuple) -> tuple[int, list[_NarrowBase]] | None:
        try:
            values = self._group(None, (at,), *free)
        except Exception:  # noqa: BLE001  any op's error at the larger d (an index past a table): no base there
            return None
        found = self._narrowable(values, at)
        return None if found is None else (at, found)

    def _narrowable(self, values: tuple, at: int) -> list[_NarrowBase] | None:
        """The values to narrow at smaller d, or None where one is not `at` long on its axis (a Slice clamped at
        its constant's end) or not laid out as _narrow needs."""
        found = []
        for i, axis, fresh in self._narrowed:
            v = values[i]
            if not isinstance(v, torch.Tensor) or v.dim() <= axis or v.shape[axis] != at \
                    or any(n != 1 for n in v.shape[:axis]) or (fresh and not v.is_contiguous()):
                return None
            found.append(_NarrowBase(v, tuple(v.shape), v.stride()))
        return found


class _Grid:
    """Concat(Unsqueeze(Expand(P_i, S), -1)..., axis=-1) where each P_i is a prefix along its own dim (_Along) and S
    is their broadcast: an exported mask's index grid G[b, 1, 1, s] = (i, j), five ops at each new b x s (~0.2 ms
    right after a run). Each P_i at a smaller dim is a corner of P_i at a larger one, and where every axis of S is
    longer than 1 in at most one P_i, G at smaller dims is a corner of G at larger ones: G is made once at the largest
    dims seen (each P_i the larger of the kept one and the new one) and a new signature's is its corner, a slice
    and a copy (_GridBase). Any other case (S not the parts' broadcast, a 0 dim, a base past GRID_BYTES) is computed
    by the ops. The base is replaced whole, so contexts of one engine may share it unlocked."""

    def __init__(self, fn: Any, ctx: Any, attributes: dict[str, Any]):
        self._fn, self._ctx, self._attributes = fn, ctx, attributes
        self._base: _GridBase | None = None

    def __call__(self, parts: tuple[tuple[Any, tuple], ...]) -> Any:
        shape = parts[0][1]
        try:
            if any(s != shape for _, s in parts) or broadcast_sizes(*(p.shape for p, _ in parts)) != shape \
                    or 0 in shape:
                return self._made(parts)
        except (AttributeError, ValueError):  # not tensors, or not broadcastable: the ops say what is wrong
            return self._made(parts)
        base = self._base
        if base is not None and len(shape) + 1 == len(base.sizes) and all(n <= m for n, m in zip(shape, base.sizes)):
            return base.corner(shape)
        values = tuple(p for p, _ in parts)
        if base is not None:  # grow: each part the larger of the two (one is a corner of the other)
            values = tuple(_larger(old, new) for old, new in zip(base.parts, values))
        if any(v is None for v in values) or len({v.dim() for v in values}) != 1:
            return self._made(parts)
        larger = broadcast_sizes(*(v.shape for v in values))
        if any(sum(n > 1 for n in sizes) > 1 for sizes in zip(*(v.shape for v in values))) \
                or values[0].element_size() * len(values) * _count(larger) > GRID_BYTES:
            return self._made(parts)
        base = _GridBase(values, self._made(tuple((v, larger) for v in values)))
        self._base = base
        return base.corner(shape)

    def _made(self, parts: tuple) -> Any:
        """The ops' own computation: each part expanded and unsqueezed, the Concat's kernel."""
        return _one(self._fn(self._ctx, *(unsqueeze_axes(expand_to(p, s), [-1]) for p, s in parts),
                             **self._attributes))


class _GridBase:
    """A _Grid's grid at the sizes of `parts`, and its numpy view: a corner is cut by numpy (a slice and a copy, then
    torch.from_numpy: ~3x cheaper than as_strided and clone through torch's dispatch), laid out as the Concat lays
    it out (a fresh C-ordered array: canonical strides, axes of size 1 included).

    The corners of one rest of shape (every axis but the first: an exported mask's [1, 1, s]) at each first axis b
    are the first b rows of one C-ordered array, the corner at the base's whole first axis: a "row" made once per
    rest (its first use: the load's view job meets every sequence, first_calls.memo_shapes), and each b's corner a
    view of it kept beside it, so a new b x s signature's grid is a dict look-up, not a slice, a copy and a
    from_numpy (each ~20-30 µs right after a run has cooled the caches; BERT-base: the rows of every sequence 1-256
    4.2 MB, GRID_ROWS_BYTES at most). The views are read only, as the copies were (shape plans' values are inputs of
    the loop, never written)."""

    def __init__(self, parts: tuple[torch.Tensor, ...], grid: torch.Tensor):
        self.parts, self.grid, self.sizes = parts, grid, tuple(grid.shape)
        try:
            self.array = grid.numpy() if grid.is_contiguous() else None
        except (TypeError, RuntimeError):  # a dtype numpy lacks (bfloat16)
            self.array = None
        self._corners: dict[tuple, torch.Tensor] = {}  # shape -> its corner, a view of its rest's row
        self._row_bytes = 0  # the rows' bytes (the views hold none of their own)

    def corner(self, shape: tuple) -> torch.Tensor:
        """The grid's corner at `shape` (its last axis whole), a contiguous tensor."""
        found = self._corners.get(shape)
        if found is not None:
            return found
        if self.array is not None:
            if shape and self._row_bytes < GRID_ROWS_BYTES:
                made = self._row(shape)
                if made is not None:
                    return made
            return torch.from_numpy(self.array[tuple(map(slice, shape))].copy())
        grid = self.grid
        return grid.as_strided((*shape, grid.shape[-1]), grid.stride()).clone(memory_format=torch.contiguous_format)

    def _row(self, shape: tuple) -> torch.Tensor | None:
        """The row of `shape`'s rest made, its corners at every first axis kept (views); `shape`'s, or None where
        the row would pass GRID_ROWS_BYTES."""
        rest = tuple(shape[1:])
        row = torch.from_numpy(self.array[(slice(None), *map(slice, rest))].copy())
        if self._row_bytes + row.nbytes > GRID_ROWS_BYTES:
            return None
        self._row_bytes += row.nbytes
        corners = {(b, *rest): row[:b] for b in range(1, row.shape[0])}
        corners[(row.shape[0], *rest)] = row
        self._corners.update(corners)  # one C call: a reader on another thread sees none or all of them
        return corners.get(tuple(shape))


class _GatherGrid:
    """GatherND(data, G) with batch_dims 0 where G is a _Grid's index grid Concat(Unsqueeze(Expand(P_i, S), -1)...,
    axis=-1) (an exported mask's four GatherNDs of positions by [b, 1, s, s, 2] grids: ~55-95 µs each right after a
    run, ~40% of the mask's shape values past the shapes planned at load): data[P_0, P_1, ...], one advanced index
    of the parts, neither the grid nor the flat indices made. The same values by the ops' definitions: G[..., i] is
    P_i broadcast to S, GatherND's out[k] = data[G[k, 0], ..., G[k, m - 1]] (a negative index counted from the end,
    as torch counts it), and torch's advanced indexing by tensors that broadcast to S is that, of shape S ++
    data.shape[m:]. Taken only where every S is one shape, the parts broadcast to exactly S, every part is int64 (a
    Concat's operands share one dtype; a bool part would be a mask to torch) and m <= data's rank; anything else is
    the ops' own computation (the grid, then GatherND's kernel). An index past its axis raises (torch's IndexError),
    so the function falls back to the steps, which compute what the graph computes. CPU data only: on a GPU such an
    index would be a device-side assert, not an exception (not measured there)."""

    def __init__(self, grid: _Grid, fn: Any, ctx: Any, attributes: dict[str, Any]):
        self._grid, self._fn, self._ctx, self._attributes = grid, fn, ctx, attributes

    def __call__(self, data: Any, parts: tuple[tuple[Any, tuple], ...]) -> Any:
        shape = parts[0][1]
        try:
            if isinstance(data, torch.Tensor) and data.device.type == "cpu" and len(parts) <= data.dim() \
                    and all(s == shape for _, s in parts) \
                    and all(isinstance(p, torch.Tensor) and p.dtype == torch.int64 for p, _ in parts) \
                    and broadcast_sizes(*(tuple(p.shape) for p, _ in parts)) == tuple(shape):
                return data[tuple(p for p, _ in parts)]
        except ValueError:  # parts that do not broadcast: the ops say what is wrong
            pass
        return _one(self._fn(self._ctx, data, self._grid(parts), **self._attributes))


def _larger(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor | None:
    """Of two values of one prefix, the one no smaller on any axis (None: neither, or their ranks differ)."""
    if old.dim() != new.dim():
        return None
    if all(a >= b for a, b in zip(old.shape, new.shape)):
        return old
    return new if all(a <= b for a, b in zip(old.shape, new.shape)) else None


def _count(shape: tuple) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _only(dims: tuple) -> int:
    """Squeeze of a one-element 1-D shape value to 0-D."""
    if len(dims) != 1:
        raise ValueError(f"cannot squeeze axis 0 of {len(dims)} elements")
    return dims[0]


def _at(dims: tuple, i: int) -> int:
    """Gather of element i (negative: from the end) of a 1-D shape value."""
    if not -len(dims) <= i < len(dims):
        raise IndexError(f"Gather index {i} is out of range for {len(dims)} elements")
    return dims[i]


def _reshaped_sizes(target: Any, allowzero: int) -> tuple[int, ...]:
    """The sizes of a Reshape's output from its target alone (_reshaped_by's Reshapes: no -1, no 0 copied from the
    data): the target's values. ValueError where they are not (the function then fails, and the steps run)."""
    sizes = tuple(int(v) for v in (target.tolist() if isinstance(target, torch.Tensor) else target))
    if any(v < 0 or (v == 0 and not allowzero) for v in sizes):
        raise ValueError(f"Reshape target {list(sizes)}: its output's sizes follow from its data")
    return sizes


def _slice_dims(dims: tuple, start: int, end: int) -> tuple:
    """ONNX Slice with step 1 of a 1-D shape value: a negative start or end counted from the end, both clamped to
    [0, len]."""
    n = len(dims)
    start = min(max(start + n if start < 0 else start, 0), n)
    end = min(max(end + n if end < 0 else end, 0), n)
    return tuple(dims[start:end])


def _int64(v: int) -> int:
    if not _INT64_MIN <= v <= _INT64_MAX:
        raise OverflowError(f"{v} is past int64: the step computes it")
    return v


def _arith(op: str, a: Any, b: Any) -> Any:
    """Add/Sub/Mul of int64 shape values (0-D ints or 1-D tuples), broadcast as numpy does."""
    f = {"Add": int.__add__, "Sub": int.__sub__, "Mul": int.__mul__}[op]
    if isinstance(a, int) and isinstance(b, int):
        return _int64(f(a, b))
    a = (a,) if isinstance(a, int) else a
    b = (b,) if isinstance(b, int) else b
    if len(a) != len(b) and 1 not in (len(a), len(b)):
        raise ValueError(f"{len(a)} and {len(b)} elements do not broadcast")
    n = max(len(a), len(b)) if min(len(a), len(b)) else 0
    return tuple(_int64(f(a[i if len(a) > 1 else 0], b[i if len(b) > 1 else 0])) for i in range(n))


def _gather_nonneg(ctx: Any, data: Any, indices: Any, axis: int) -> Any:
    """ONNX Gather by int64 indices known >= 0 (a constant's, an arange's, views of them): the op's tensor path
    (kiln/ops/indexing.py) without its negative-index normalization (three ops that change nothing here); any
    other case through the op itself. An index past the axis fails in index_select, as in the op."""
    if not isinstance(data, torch.Tensor) or not isinstance(indices, torch.Tensor) or indices.dim() == 0 \
            or indices.dtype != torch.int64:
        return gather(ctx, data, indices, axis=axis)
    axis = norm_axis(axis, data.ndim)
    out = data.index_select(axis, indices.reshape(-1))
    return out.reshape(data.shape[:axis] + indices.shape + data.shape[axis + 1:])


def _gather_elements_nonneg(ctx: Any, data: Any, indices: Any, axis: int) -> Any:
    """ONNX GatherElements by int64 indices known >= 0, as _gather_nonneg."""
    if not isinstance(data, torch.Tensor) or not isinstance(indices, torch.Tensor) or indices.dtype != torch.int64:
        return gather_elements(ctx, data, indices, axis=axis)
    return torch.gather(data, norm_axis(axis, data.ndim), indices)


def _nonnegative(value: Any) -> bool:
    """Every element of an integer CPU tensor >= 0 (checked once, at load)."""
    return (isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.dtype in _INTEGERS
            and value.numel() > 0 and bool((value >= 0).all()))


_INTEGERS = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def _tensor(dims: Any) -> torch.Tensor:
    """The int64 tensor of a shape value (0-D for an int): through numpy, ~2.5x cheaper than torch.tensor's
    sequence parsing (a first call past the planned shapes stores ~8 of them: llama_tiny's repeat_kv shapes)."""
    return torch.from_numpy(np.array(dims, dtype=np.int64))


def _one(result: Any) -> Any:
    return result[0] if isinstance(result, tuple) else result


_HELPERS = {"_only": _only, "_at": _at, "_arith": _arith, "_tensor": _tensor, "_one": _one,
            "_gather_nonneg": _gather_nonneg, "_gather_elements_nonneg": _gather_elements_nonneg,
            "_reshape_to": reshape_to, "_slice_ints": slice_ints, "_squeeze_axes": squeeze_axes,
            "_unsqueeze_axes": unsqueeze_axes, "_expand_to": expand_to, "_arange_int64": arange_int64,
            "_broadcast_sizes": broadcast_sizes, "_narrow": _narrow, "_reshaped_sizes": _reshaped_sizes,
            "_slice_dims": _slice_dims}


def _constant_dims(value: Any) -> tuple[str, Any] | None:
    """("int", n) or ("ints", (n, ...)) for a small int64 CPU tensor; else None."""
    if (isinstance(value, torch.Tensor) and value.dtype == torch.int64 and value.device.type == "cpu"
            and value.dim() <= 1 and value.numel() <= SMALL):
        dims = [int(v) for v in value.tolist()] if value.dim() else int(value)
        return ("ints", tuple(dims)) if value.dim() else ("int", dims)
    return None


class _Writer:
    """Builds the function's source: one line per value, a global per object it calls or reads."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.globals: dict[str, Any] = dict(_HELPERS)
        self.values: dict[int, _Value] = {}  # slot -> what holds it
        self.along: dict[str, _Along] = {}  # variable -> the prefix it is (_Prefix)
        self.bounds: dict[str, int] = {}  # dims line -> the shortest constant a Slice [0, d) of it takes
        self._count = 0
        # per line after the header: (the variables it defines, those of other lines it reads, its kind:
        # "input" (x = env[s]), "dims" (a Shape or Size of an input: a group's key), "data" (never kept) or "")
        self.meta: list[tuple[tuple[str, ...], tuple[str, ...], str]] = []

    def line(self, text: str, defines: tuple[str, ...], reads: tuple[str, ...], kind: str = "") -> None:
        self.lines.append(text)
        self.meta.append((defines, reads, kind))

    def name(self, prefix: str) -> str:
        self._count += 1
        return f"{prefix}{self._count}"

    def object(self, prefix: str, value: Any) -> str:
        name = self.name(prefix)
        self.globals[name] = value
        return name

    def tensor(self, value: _Value) -> str:
        """An expression for the value as the step would have stored it (its dims made a tensor once)."""
        if value.tensor is None:
            value.tensor = self.name("t")
            self.line(f"{value.tensor} = _tensor({value.var})", (value.tensor,), (value.var,))
        return value.tensor


def _host_ints(w: _Writer, values: list[_Value | None], first: int) -> list[str] | None:
    """Expressions for inputs first.. as Python int lists (None: absent), or None when one is not dims."""
    found = []
    for v in values[first:]:
        if v is None:
            found.append("None")
        elif v.constant is not None:
            found.append(repr(list(v.constant) if v.kind == "ints" else [v.constant]))
        elif v.kind == "ints":
            found.append(f"list({v.var})")
        elif v.kind == "int":
            found.append(f"[{v.var}]")
        else:
            return None
    return found


@dataclass
class _Out:
    """What an emitter computes: the expression and the value's kind, its length when known ("ints"), and
    whether every element is known >= 0 (an index that needs no negative-index normalization)."""

    expr: str
    kind: str
    length: int | None = None
    nonneg: bool = False
    expanded: tuple[_Value, str] | None = None  # an Expand's: (its input, the shape's expression)
    reads: tuple[str, ...] | None = None  # the variables the expression reads (None: its inputs')
    dim: str | None = None  # as _Value's
    along: _Along | None = None
    stacked: tuple[_Value, str] | None = None  # as _Value's


def _emit(w: _Writer, step: BoundStep, ins: list[_Value | None], attrs: dict[str, Any]) -> _Out | None:
    """The step's one output without the op dispatch, or None: a direct call of its implementation."""
    op = step.ctx.op_type if step.ctx.domain in ("", "ai.onnx") else None
    x = ins[0] if ins else None
    if x is None:
        return None
    if op == "Shape" and len(ins) == 1:
        start, end = attrs.get("start", 0), attrs.get("end")
        index = f"{int(start)}:{'' if end is None else int(end)}"
        dims = {"tensor": f"{x.var}.shape", "ints": f"(len({x.var}),)", "int": "()", "shape": x.var}[x.kind]
        length = int(end) - int(start) if end is not None and 0 <= int(start) < int(end) else None
        return _Out(f"tuple({dims}[{index}])", "ints", length)  # length: at most, when the rank is short
    if op == "Size" and len(ins) == 1:
        return _Out({"tensor": f"{x.var}.numel()", "ints": f"len({x.var})", "int": "1"}[x.kind], "int")
    if op == "Identity":
        return _Out(x.var, x.kind, x.length, x.nonneg, dim=x.dim, along=x.along)
    if op == "Cast" and x.kind != "tensor" and attrs.get("to") == _INT64:
        return _Out(x.var, x.kind, x.length, dim=x.dim)
    if op == "Squeeze" and len(ins) == 1 and "axes" not in attrs and x.kind == "ints" and x.length == 1:
        return _Out(f"_only({x.var})", "int", dim=x.dim)  # every axis of size 1: a shape's one dim (else _only raises)
    if op in ("Squeeze", "Unsqueeze") and "axes" not in attrs:
        axes = _host_ints(w, ins, 1)
        if axes is None or len(ins) != 2 or ins[1] is None:
            return None
        first_axis = ins[1].constant in ((0,), (-1,))  # a constant's axes, read at load
        if op == "Squeeze" and x.kind == "ints" and first_axis:
            return _Out(f"_only({x.var})", "int", dim=x.dim)
        if op == "Unsqueeze" and x.kind == "int" and first_axis:
            return _Out(f"({x.var},)", "ints", 1, dim=x.dim)
        if x.kind == "tensor":
            fn = "_squeeze_axes" if op == "Squeeze" else "_unsqueeze_axes"
            along = _unsqueezed(x.along, ins[1].constant) if op == "Unsqueeze" else None
            stacked = x.expanded if op == "Unsqueeze" and ins[1].constant == (-1,) else None
            return _Out(f"{fn}({x.var}, {axes[0]})", "tensor", nonneg=x.nonneg, along=along, stacked=stacked)
        return None
    if op == "Concat" and ins and all(v is not None and v.kind == "ints" for v in ins) and \
            attrs.get("axis") in (0, -1):
        lengths = [v.length for v in ins]
        return _Out("(" + "".join(f"*{v.var}, " for v in ins) + ")", "ints", None if None in lengths else sum(lengths))
    i = ins[1] if len(ins) == 2 else None
    if op == "Gather" and x.kind == "ints" and i is not None and attrs.get("axis", 0) in (0, -1):
        if i.kind == "int":
            return _Out(f"_at({x.var}, {i.var})", "int")
        if i.kind == "ints":
            return _Out(f"tuple(_at({x.var}, i) for i in {i.var})", "ints", i.length)
        return None
    if op in ("Add", "Sub", "Mul") and i is not None and x.kind != "tensor" and i.kind != "tensor":
        return _Out(f"_arith({op!r}, {x.var}, {i.var})", "int" if x.kind == i.kind == "int" else "ints")
    if op == "Slice" and x.kind == "ints" and 3 <= len(ins) <= 5 and "starts" not in attrs:
        bounds = _slice_dims_bounds(ins + [None] * (5 - len(ins)))
        if bounds is None:
            return None
        return _Out(f"_slice_dims({x.var}, {bounds[0]}, {bounds[1]})", "ints")
    if op == "Range" and len(ins) == 3 and all(v is not None and v.kind == "int" for v in ins):
        start, delta = x.constant, ins[2].constant
        counts_up = start is not None and delta is not None and start >= 0 and delta > 0  # start, start + delta...
        along = _Along(ins[1].dim, 0, 1, True) if start == 0 and delta == 1 and ins[1].dim else None  # 0 .. d - 1
        return _Out(f"_arange_int64({x.var}, {ins[1].var}, {ins[2].var})", "tensor", nonneg=counts_up, along=along)
    if x.kind != "tensor":
        return None
    if op == "Expand" and i is not None and i.kind == "ints":
        return _Out(f"_expand_to({x.var}, {i.var})", "tensor", nonneg=x.nonneg, expanded=(x, i.var))
    if op == "Reshape" and i is not None and i.kind == "ints" and "shape" not in attrs:
        return _Out(f"_reshape_to({x.var}, list({i.var}), {int(attrs.get('allowzero', 0))})", "tensor",
                    nonneg=x.nonneg)
    if op == "Slice" and 3 <= len(ins) <= 5 and "starts" not in attrs:
        host = _host_ints(w, ins + [None] * (5 - len(ins)), 1)
        if host is None or "None" in host[:2]:
            return None
        return _Out(f"_slice_ints({x.var}, {', '.join(host)}, {step.ctx.name!r})", "tensor", nonneg=x.nonneg,
                    along=_sliced(w, ins + [None] * (5 - len(ins))))
    if op in ("Gather", "GatherElements") and i is not None and i.kind == "tensor" and i.nonneg:
        fn = "_gather_nonneg" if op == "Gather" else "_gather_elements_nonneg"
        ctx = w.object("ctx", step.ctx)
        if op == "Gather" and i.expanded is not None and attrs.get("axis", 0) == 0 \
                and isinstance(w.globals.get(x.var), torch.Tensor):
            # Gather(T, Expand(I, S)) = Expand(Gather(T, I), S ++ T.shape[1:]): the table's rows gathered at I's
            # sizes (kept with I's group: a token-type embedding's [1, seq, hidden] per sequence length), then
            # broadcast (laid out row-major, as a segment reads it: a copy where the batch is > 1, none at 1)
            source, shape = i.expanded
            rows = w.name("g")
            w.line(f"{rows} = {fn}({ctx}, {x.var}, {source.var}, 0)", (rows,), (x.var, source.var))
            along = _gathered(w, x, source.along, 0)
            if along is not None:
                w.along[rows] = along
            trailing = "".join(f"{d}, " for d in w.globals[x.var].shape[1:])
            return _Out(f"_expand_to({rows}, (*{shape}, {trailing})).contiguous()", "tensor", nonneg=x.nonneg,
                        reads=(rows, shape))
        axis = int(attrs.get('axis', 0))
        along = _gathered(w, x, i.along, axis) if op == "Gather" else _gathered_elements(w, x, i.along)
        return _Out(f"{fn}({ctx}, {x.var}, {i.var}, {axis})", "tensor", nonneg=x.nonneg, along=along)
    return None


def _slice_dims_bounds(ins: list[_Value | None]) -> tuple[str, str] | None:
    """A Slice of a 1-D shape value (an exported Llama's [batch, heads, seq, dim] cut into its parts to make the
    repeat_kv's shapes): the expressions of its one start and end, where its axes are absent or [0] / [-1] and its
    steps absent or [1]; None otherwise."""
    _x, starts, ends, axes, steps = ins
    if (axes is not None and axes.constant not in ((0,), (-1,))) or (steps is not None and steps.constant != (1,)):
        return None
    found = []
    for v in (starts, ends):
        if v is None or v.kind not in ("int", "ints"):
            return None
        if v.constant is not None:
            if v.kind == "ints" and len(v.constant) != 1:
                return None
            found.append(str(v.constant[0] if v.kind == "ints" else v.constant))
        elif v.kind == "ints" and v.length == 1:
            found.append(f"{v.var}[0]")
        else:
            return None
    return found[0], found[1]


def _sliced(w: _Writer, ins: list[_Value | None]) -> _Along | None:
    """A Slice [0, d) with step 1 of a constant on one axis (d a dims line's one value): a prefix, a view."""
    x, starts, ends, axes, steps = ins
    table = w.globals.get(x.var)
    if not isinstance(table, torch.Tensor) or starts.constant != (0,) or ends.kind != "ints" or ends.dim is None \
            or (axes is not None and (axes.constant is None or len(axes.constant) != 1)) \
            or (steps is not None and steps.constant != (1,)):
        return None
    axis = axes.constant[0] if axes is not None else 0
    if not -table.dim() <= axis < table.dim():
        return None
    axis = norm_axis(axis, table.dim())
    w.bounds[ends.dim] = min(w.bounds.get(ends.dim, table.shape[axis]), table.shape[axis])
    return _Along(ends.dim, axis, table.dim(), False)


def _gathered(w: _Writer, table: _Value, indices: _Along | None, axis: int) -> _Along | None:
    """Gather of a constant by indices that are a prefix: the output's axis of theirs (axis + theirs)."""
    data = w.globals.get(table.var)
    if indices is None or not isinstance(data, torch.Tensor) or not -data.dim() <= axis < data.dim():
        return None
    return _Along(indices.dim, norm_axis(axis, data.dim()) + indices.axis, data.dim() - 1 + indices.rank, True)


def _gathered_elements(w: _Writer, table: _Value, indices: _Along | None) -> _Along | None:
    """GatherElements of a constant by indices that are a prefix: the output (the indices' shape) on their axis."""
    data = w.globals.get(table.var)
    if indices is None or not isinstance(data, torch.Tensor) or data.dim() != indices.rank:
        return None
    return _Along(indices.dim, indices.axis, indices.rank, True)


def _unsqueezed(x: _Along | None, axes: tuple[int, ...] | None) -> _Along | None:
    """Unsqueeze of a fresh prefix: its axis among the output's (the inserted axes skipped)."""
    if x is None or not x.fresh or axes is None:
        return None
    rank = x.rank + len(axes)
    inserted = {a + rank if a < 0 else a for a in axes}
    if len(inserted) != len(axes) or not all(0 <= a < rank for a in inserted):
        return None
    kept = [p for p in range(rank) if p not in inserted]
    return _Along(x.dim, kept[x.axis], rank, True)


_ELEMENTWISE = frozenset({"Add", "Sub", "Mul", "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "And",
                          "Or", "Xor", "Not", "Where", "Neg", "Abs", "Cast"})


def _elementwise(w: _Writer, op: str | None, ins: list[_Value | None]) -> _Along | None:
    """An elementwise op (a direct call) of fresh prefixes along one dim and constants of size 1 on that axis: a
    fresh prefix on the broadcast axis."""
    if op not in _ELEMENTWISE or not ins or None in ins:
        return None
    alongs = [v.along for v in ins if v.along is not None]
    constants = [w.globals.get(v.tensor) for v in ins if v.along is None]
    if not alongs or len({a.dim for a in alongs}) != 1 or not all(a.fresh for a in alongs) \
            or not all(isinstance(c, torch.Tensor) and c.is_contiguous() for c in constants):
        return None
    rank = max([a.rank for a in alongs] + [c.dim() for c in constants])
    axes = {a.axis + rank - a.rank for a in alongs}
    if len(axes) != 1:
        return None
    axis = axes.pop()
    for c in constants:
        j = axis - (rank - c.dim())
        if j >= 0 and c.shape[j] != 1:
            return None
    return _Along(alongs[0].dim, axis, rank, True)


def _shape_of_broadcast(op: str | None, ins: list[_Value | None], readers: tuple[str, ...]) -> _Out | None:
    """The output shape alone of a broadcasting elementwise op whose result only Shape steps read (an exported
    mask's Expand to Shape(Max(a, b))): the inputs' sizes broadcast (kind "shape": a tuple of ints), no op run."""
    if op not in MULTIDIRECTIONAL or not readers or any(r != "Shape" for r in readers) or not ins or None in ins:
        return None
    shapes = {"tensor": "tuple({}.shape)", "ints": "(len({}),)", "int": "()", "shape": "{}"}
    return _Out("_broadcast_sizes(" + ", ".join(shapes[v.kind].format(v.var) for v in ins) + ")", "shape")


def computable_ahead(steps: list[BoundStep], order: list[int], template: list[Any],
                     input_slots: list[int]) -> list[int]:
    """Those of the shape-only steps `order` whose values follow from the inputs' shapes and constants alone.
    The others read a layer's output (a Shape of a Reshape's result in an exported Llama, and what follows
    from it): the loop computes them where they stand, once per signature, as before."""
    known = set(input_slots) | {s for s, v in enumerate(template) if v is not None}
    producers = _producers(steps)
    ahead = []
    for i in order:
        step = steps[i]
        reshape = _reshaped_by(steps, producers, step, template, input_slots)
        if all(s < 0 or s in known for s in step.inputs) or (reshape is not None and reshape.inputs[1] in known):
            ahead.append(i)
            known.update(s for s in step.outputs if s >= 0)
    return ahead


def _producers(steps: list[BoundStep]) -> dict[int, BoundStep]:
    return {s: step for step in steps for s in step.outputs if s >= 0}


def _reshaped_by(steps: list[BoundStep], producers: dict[int, BoundStep], step: BoundStep, template: list[Any],
                 input_slots: list[int]) -> BoundStep | None:
    """The Reshape whose output `step`, an ONNX Shape, reads, where that output's sizes are its target's values
    whatever its data: the target a Concat of Shapes of program inputs and constants with no -1 (and no 0 unless
    allowzero). An exported Llama's repeat_kv reshapes a layer's output to [batch, heads, seq, dim] and takes its
    Shape: computed here from the target, that Shape and what follows from it leave the loop, so the shape function
    computes every shape value the loop reads (plans_ahead: the load's views job and DirectRuns then apply). None
    otherwise."""
    if step.ctx.op_type != "Shape" or step.ctx.domain not in ("", "ai.onnx") or len(step.inputs) != 1 \
            or len(step.outputs) != 1 or step.inputs[0] < 0 or template[step.inputs[0]] is not None:
        return None
    reshape = producers.get(step.inputs[0])
    if reshape is None or reshape.ctx.op_type != "Reshape" or reshape.ctx.domain not in ("", "ai.onnx") \
            or len(reshape.inputs) != 2 or reshape.inputs[1] < 0 or len(reshape.outputs) != 1:
        return None
    allowzero = bool(reshape.attributes.get("allowzero", 0))
    concat = producers.get(reshape.inputs[1])
    if concat is None or concat.ctx.op_type != "Concat" or concat.ctx.domain not in ("", "ai.onnx"):
        return None
    for s in concat.inputs:
        if s < 0:
            return None
        if template[s] is not None:
            dims = _constant_dims(template[s])
            if dims is None or dims[0] != "ints" or any(v < 0 or (v == 0 and not allowzero) for v in dims[1]):
                return None
            continue
        shape = producers.get(s)
        if shape is None or shape.ctx.op_type != "Shape" or shape.ctx.domain not in ("", "ai.onnx") \
                or len(shape.inputs) != 1 or shape.inputs[0] not in input_slots or not allowzero:
            return None  # (an input's dim of 0 copies the data's dim unless allowzero)
    return reshape


def compile_shape_steps(steps: list[BoundStep], order: list[int], template: list[Any], input_slots: list[int],
                        slots: list[int], calls: set[int] = frozenset()) -> ShapeFunction | None:
    """The steps `order` (indices into `steps`, in order; computable_ahead's) as one function of the inputs'
    shapes, writing the values of `slots`; None when a step reads a value none of them computes. `calls`:
    steps made direct calls of their kernel whatever their op (a layer pinned to fp32 in a half-precision
    engine: its kernel casts around the op)."""
    w = _Writer()
    inputs = set()
    wanted = set(slots)
    producers = _producers(steps)
    shape_read: dict[int, tuple[str, ...]] = {}  # slot -> what each of `order`'s steps reading it is ("Shape": an
    for i in order:  # ONNX Shape that _emit computes)
        step = steps[i]
        shape = step.ctx.op_type == "Shape" and step.ctx.domain in ("", "ai.onnx") and len(step.inputs) == 1 \
            and len(step.outputs) == 1 and i not in calls
        for s in step.inputs:
            if s >= 0:
                shape_read[s] = (*shape_read.get(s, ()), "Shape" if shape else "other")
    for s in input_slots:
        w.values[s] = _Value(f"x{s}", "tensor", f"x{s}")
        w.line(f"x{s} = env[{s}]", (f"x{s}",), (), "input")
        inputs.add(f"x{s}")
    for i in order:
        step = steps[i]
        ins: list[_Value | None] = []
        for s in step.inputs:
            if s < 0:
                ins.append(None)
                continue
            if s not in w.values:
                reshape = _reshaped_by(steps, producers, step, template, input_slots) if template[s] is None \
                    else None
                if reshape is not None and reshape.inputs[1] in w.values:  # its sizes from its target alone
                    target, var = w.values[reshape.inputs[1]], w.name("v")
                    allowzero = int(bool(reshape.attributes.get("allowzero", 0)))
                    w.line(f"{var} = _reshaped_sizes({target.var}, {allowzero})", (var,), (target.var,))
                    w.values[s] = _Value(var, "shape")
                    ins.append(w.values[s])
                    continue
                if template[s] is None:
                    return None  # computed by a step outside `order`
                value = template[s]
                dims = _constant_dims(value)
                tensor = w.object("c", value)
                w.values[s] = _Value(repr(dims[1]), dims[0], tensor, dims[1],
                                     len(dims[1]) if dims[0] == "ints" else None) if dims else \
                    _Value(tensor, "tensor", tensor, nonneg=_nonnegative(value))
            ins.append(w.values[s])
        reads = tuple(dict.fromkeys(name for v in ins if v is not None for name in (v.var, v.tensor) if name))
        op = step.ctx.op_type if step.ctx.domain in ("", "ai.onnx") else None
        emitted = _emit(w, step, ins, step.attributes) if len(step.outputs) == 1 and i not in calls else None
        if emitted is None and len(step.outputs) == 1 and step.outputs[0] not in wanted and i not in calls:
            emitted = _shape_of_broadcast(op, ins, shape_read.get(step.outputs[0], ()))
        if emitted is not None:
            var = w.name("v")
            dims = op in ("Shape", "Size") and len(ins) == 1 and ins[0] is not None and ins[0].var in inputs
            w.line(f"{var} = {emitted.expr}", (var,), reads if emitted.reads is None else emitted.reads,
                   "dims" if dims else "")
            if emitted.along is not None:
                w.along[var] = emitted.along
            out = step.outputs[0]
            if out >= 0:
                w.values[out] = _Value(var, emitted.kind, var if emitted.kind == "tensor" else None,
                                       length=emitted.length, nonneg=emitted.nonneg, expanded=emitted.expanded,
                                       dim=var if dims and emitted.kind == "ints" and emitted.length == 1
                                       else emitted.dim, along=emitted.along, stacked=emitted.stacked)
            continue
        fn, ctx = w.object("f", step.fn), w.object("ctx", step.ctx)
        if op == "Concat" and i not in calls and len(step.outputs) == 1 and len(ins) >= 2 \
                and step.attributes.get("axis") == -1 \
                and all(v is not None and v.stacked is not None and v.stacked[0].along is not None for v in ins):
            # an index grid (an exported mask's [b, 1, 1, s, 2]): a corner of the grid at larger dims (_Grid)
            grid = w.object("_grid", _Grid(step.fn, step.ctx, dict(step.attributes)))
            parts = "".join(f"({v.stacked[0].var}, {v.stacked[1]}), " for v in ins)
            var = w.name("v")
            w.line(f"{var} = {grid}(({parts}))", (var,),
                   tuple(dict.fromkeys(name for v in ins for name in (v.stacked[0].var, v.stacked[1]))))
            if step.outputs[0] >= 0:
                w.values[step.outputs[0]] = _Value(var, "tensor", var, grid=(
                    grid, tuple((v.stacked[0].var, v.stacked[1]) for v in ins)))
            continue
        if GATHER_GRIDS and op == "GatherND" and i not in calls and len(step.outputs) == 1 and len(ins) == 2 \
                and ins[0] is not None and ins[1] is not None and ins[1].grid is not None \
                and int(step.attributes.get("batch_dims", 0)) == 0:
            # gathered by an index grid's parts, the grid not made (_GatherGrid)
            grid, grid_parts = ins[1].grid
            gathered = w.object("_gather_grid", _GatherGrid(w.globals[grid], step.fn, step.ctx,
                                                            dict(step.attributes)))
            data = w.tensor(ins[0])
            parts = "".join(f"({p}, {s}), " for p, s in grid_parts)
            var = w.name("v")
            w.line(f"{var} = {gathered}({data}, ({parts}))", (var,),
                   tuple(dict.fromkeys((data, *(name for part in grid_parts for name in part)))))
            if step.outputs[0] >= 0:
                w.values[step.outputs[0]] = _Value(var, "tensor", var)
            continue
        # a direct call of the step's implementation on tensors
        args = ", ".join("None" if v is None else w.tensor(v) for v in ins)
        call = f"{fn}({ctx}{', ' if args else ''}{args}"
        if step.attributes:
            call += f", **{w.object('a', step.attributes)}"
        call += ")"
        reads = tuple(dict.fromkeys((*reads, *(v.tensor for v in ins if v is not None))))
        kind = "data" if op in _RANDOM else ""
        if len(step.outputs) == 1:
            var = w.name("v")
            w.line(f"{var} = _one({call})", (var,), reads, kind)
            along = _elementwise(w, op, ins) if i not in calls else None
            if along is not None:
                w.along[var] = along
            if step.outputs[0] >= 0:
                w.values[step.outputs[0]] = _Value(var, "tensor", var, along=along)
        else:
            names = [w.name("v") for _ in step.outputs]
            w.line(f"{', '.join(names)}, = {call}", tuple(names), reads, kind)
            for s, var in zip(step.outputs, names):
                if s >= 0:
                    w.values[s] = _Value(var, "tensor", var)
    for s in slots:
        if s not in w.values:
            return None
    stores = [f"env[{s}] = {w.tensor(w.values[s])}" for s in slots]
    _drop_unread(w, {w.values[s].tensor for s in slots})
    shapes_only = _reads_shapes_only(w, inputs, stores)
    cut = _corners_cut(w, steps, order, template, input_slots, slots, calls) if CORNERS else {}
    grouped = _grouped(w, {w.values[s].tensor for s in slots}, cut)
    source = "".join(grouped.functions) + "def shape_values(env):\n" + \
        "\n".join("    " + line for line in grouped.body + stores) + "\n"
    namespace = dict(w.globals)
    exec(compile(source, "<kiln shape function>", "exec"), namespace)  # noqa: S102  code generated above
    for name, function, narrowed, bound in grouped.prefixes:
        namespace[name] = _Prefix(namespace[function], narrowed, bound)
    return ShapeFunction(namespace["shape_values"], source, list(slots), grouped.memos, shapes_only)


@dataclass
class _Cut:
    """A stored tensor served by a CornerCut: the CornerCut's global, the key's and the sizes' expressions (the dims
    it follows, its extents there), and the variables only it needs (their lines run where the cut gives None)."""

    cut: str
    key: str
    extents: str
    only: set[str]
    ranks: str  # an expression true where each input has the rank the proof needs (Facts.ranks)


def _corners_cut(w: _Writer, steps: list[BoundStep], order: list[int], template: list[Any], input_slots: list[int],
                 slots: list[int], calls: set[int]) -> dict[str, _Cut]:
    """The stored tensors proved corners (shape_corners.corners) that follow at least one input dim and are made by
    lines no other stored value reads, by their variable."""
    facts = corners(steps, order, template, input_slots, calls)
    ranks = " and ".join(f"len(x{slot}.shape) >= {rank}" for slot, rank in sorted(facts.ranks.items())) or "True"
    stored = {w.values[s].tensor: s for s in slots}
    found: dict[str, _Cut] = {}
    for var, s in stored.items():
        fact = facts.corners.get(s)
        if fact is None or not fact.dims() or w.values[s].kind != "tensor" or var in w.globals \
                or w.values[s].grid is not None:  # (an index grid: its _Grid cuts it from a larger one already)
            continue
        others = _needed(w, {v for v in stored if v != var} | {d for (d_, _, kind) in w.meta if kind for d in d_})
        only = _needed(w, {var}) - others
        if var not in only:
            continue
        key = "(" + "".join(f"x{slot}.shape[{axis}], " for slot, axis in sorted(facts.dims)) + ")"
        extents = "(" + "".join(f"{e.code()}, " for e in fact.extents) + ")"
        found[var] = _Cut(w.object("_corner", CornerCut()), key, extents, only, ranks)
    return found


def _needed(w: _Writer, roots: set[str]) -> set[str]:
    """The variables `roots` read, transitively (the lines are in order: one pass from the last)."""
    needed = set(roots)
    for defines, reads, _kind in reversed(w.meta):
        if needed.intersection(defines):
            needed.update(reads)
    return needed


def _reads_shapes_only(w: _Writer, inputs: set[str], stores: list[str]) -> bool:
    """Whether every line reading an input is a Shape of it, `v = tuple(x.shape[a:b])` (a tuple of Python ints for
    a numpy array as for a tensor), and no store names an input."""
    for line, (_defines, reads, kind) in zip(w.lines, w.meta):
        read = inputs.intersection(reads) | {x for x in inputs if re.search(rf"\b{x}\b", line)}
        if kind == "input" or not read:
            continue
        if len(read) != 1 or not re.fullmatch(rf"v\d+ = tuple\({next(iter(read))}\.shape\[\d*:\d*\]\)", line):
            return False
    return not any(re.search(rf"\b{x}\b", store) for store in stores for x in inputs)


def _drop_unread(w: _Writer, stored: set[str]) -> None:
    """Remove the lines whose values no stored value needs (an Expand whose Gather was hoisted above it); the
    inputs, the dims lines (the groups' keys) and lines reading an input's data or drawing random numbers stay."""
    needed = set(stored)
    kept = []
    for line, meta in zip(reversed(w.lines), reversed(w.meta)):
        defines, reads, kind = meta
        if kind or needed.intersection(defines):
            needed.update(reads)
            kept.append((line, meta))
    w.lines = [line for line, _ in reversed(kept)]
    w.meta = [meta for _, meta in reversed(kept)]


@dataclass
class _Grouped:
    """_grouped's answer: shape_values' body, the groups' memos, and each prefix group's function (its source, and
    the global its _Prefix is made as once the source is run: (name, function's name, narrowed, bound))."""

    body: list[str]
    memos: list[_Memo]
    functions: list[str]
    prefixes: list[tuple[str, str, list[tuple[int, int, bool]], int | None]]


def _grouped(w: _Writer, stored: set[str], cut: dict[str, _Cut] | None = None) -> _Grouped:
    """The lines in groups by the input dims they follow (the "dims" lines they read, transitively), each group
    that follows some but not all of them kept per their values in a _Memo: the inputs and the dims lines first,
    then the groups by how many dims they follow (a group reads only lines of groups of fewer dims, or its own,
    earlier), then the lines never kept (reading an input's data, a random op, or what such a line made) in
    their order. Every variable a group defines is kept (what later lines read of it is among them). A group of one
    dim whose tensors include prefixes (_Along) is a function of its own, called through a _Prefix; `stored`: the
    variables the function stores. `cut`: stored tensors a CornerCut serves (_corners_cut): the lines of every dim
    that only such a tensor needs run last, where its CornerCut has no value (nothing else reads them)."""
    follows: dict[str, frozenset | None] = {}  # variable -> the dims lines it follows; None: never kept
    head, groups, rest = [], {}, []
    for k, (line, (defines, reads, kind)) in enumerate(zip(w.lines, w.meta)):
        if kind == "input":
            deps = None
        elif kind == "dims":
            deps = frozenset(defines)
        elif kind == "data" or any(follows.get(r, frozenset()) is None for r in reads):
            deps = None
        else:
            deps = frozenset().union(*(follows.get(r, frozenset()) for r in reads))
        for d in defines:
            follows[d] = deps
        if kind in ("input", "dims"):
            head.append(line)
        elif deps is None:
            rest.append(line)
        else:
            groups.setdefault(deps, []).append((line, defines, reads))
    every = frozenset(name for line, (defines, _, kind) in zip(w.lines, w.meta) if kind == "dims"
                      for name in defines)
    # a cut only of a value the signature's own lines make (not one a memo keeps per fewer dims: it is kept already)
    plain = {d for deps, lines in groups.items() if (deps == every or not every) and not _has_prefix(w, deps, lines)
             for _, defines, _ in lines for d in defines}
    cut = {var: c for var, c in (cut or {}).items() if var in plain}
    moved = {var for c in cut.values() for var in c.only}
    held: list[tuple[str, tuple[str, ...]]] = []  # the lines moved, in order
    found = _Grouped(list(head), [], [], [])
    for deps in sorted(groups, key=lambda d: (len(d), sorted(d))):
        lines = groups[deps]
        if (deps == every or not every) and not _has_prefix(w, deps, lines):
            # what follows every dim read is one signature's, which the Program keeps. A group of prefixes is kept
            # even so: an input dim no line reads (an encoder's batch, where only the sequence is read) makes other
            # signatures at the same dim, and at a new dim its _Prefix narrows a base (BERT-base's two embedding
            # rows, which were two gathers of [s, 768] at each new signature: its shape values ~250 -> ~80 µs at a new
            # s, ~13 at a known s and new b, bench/results/first-call-2026-12-06.md)
            found.body += [line for line, defines, _ in lines if not moved.issuperset(defines)]
            held += [(line, defines) for line, defines, _ in lines if moved.issuperset(defines)]
            continue
        memo = _Memo()
        name = w.object("_memo", memo)
        found.memos.append(memo)
        names = [d for _, defines, _ in lines for d in defines]
        kept = ", ".join(names) + ("," if len(names) == 1 else "")
        key = "(" + "".join(f"{d}, " for d in sorted(deps)) + ")"
        found.body.append(f"_m = {name}.get({key})")
        found.body.append("if _m is None:")
        call = _prefix_group(w, deps, lines, names, stored, found)
        if call is None:
            found.body += ["    " + line for line, _, _ in lines]
            found.body.append(f"    {name}.put({key}, ({kept}))")
            found.body.append("else:")
            found.body.append(f"    {kept} = _m")
        else:
            found.body += [f"    _m = {call}", f"    {name}.put({key}, _m)", f"{kept} = _m"]
    found.body += rest
    for var, c in cut.items():  # last: only `var` reads these lines, and they read nothing defined after them
        found.body.append(f"{var} = {c.cut}({c.key}, {c.extents}) if {c.ranks} else None")
        found.body.append(f"if {var} is None:")
        found.body += ["    " + line for line, defines in held if c.only.issuperset(defines)]
        found.body.append(f"    {c.cut}.keep({c.key}, {var})")
    return found


def _has_prefix(w: _Writer, deps: frozenset, lines: list[tuple[str, tuple, tuple]]) -> bool:
    """Whether the group of `deps` (one dim) defines a prefix along it (_prefix_group would make it a _Prefix)."""
    if len(deps) != 1:
        return False
    (dim,) = deps
    return any(var in w.along and w.along[var].dim == dim for _, defines, _ in lines for var in defines)


def _prefix_group(w: _Writer, deps: frozenset, lines: list[tuple[str, tuple, tuple]], names: list[str],
                  stored: set[str], found: _Grouped) -> str | None:
    """A group of one dim with prefixes as a function `(_b, dim, *free) -> its values` (each prefix narrowed from
    _b where it is given, else computed), added to `found`; the expression calling its _Prefix, or None (no
    prefix)."""
    if len(deps) != 1:
        return None
    (dim,) = deps
    defined = set(names)
    prefixes = {var for var in names if var in w.along and w.along[var].dim == dim}
    if not prefixes:
        return None
    # what a narrowed call needs: the values read after the group, and by its lines computed from the narrowed ones
    needed = set(stored).union(*(reads for defines, reads, _ in w.meta if not defined.issuperset(defines)),
                               *(reads for _, defines, reads in lines if not prefixes.issuperset(defines)))
    narrowed: list[tuple[int, int, bool]] = []
    text = []
    for line, defines, _ in lines:
        if defines[0] in prefixes:
            var, expr = line.split(" = ", 1)
            along = w.along[var]
            given = f"_narrow(_b[{len(narrowed)}], {along.axis}, {dim}[0], {along.fresh})" if var in needed \
                else "None"  # read only by lines that are narrowed too
            line = f"{var} = {given} if _b is not None else ({expr})"
            narrowed.append((names.index(var), along.axis, along.fresh))
        text.append(line)
    free = sorted({r for _, _, reads in lines for r in reads if r.isidentifier() and not keyword.iskeyword(r)
                   and r not in defined and r not in w.globals and r != dim})
    function, prefix = w.name("_group"), w.name("_prefix")
    arguments = "".join(f", {r}" for r in free)
    kept = ", ".join(names) + ("," if len(names) == 1 else "")
    found.functions.append(f"def {function}(_b, {dim}{arguments}):\n" + "".join(f"    {line}\n" for line in text)
                           + f"    return ({kept})\n")
    found.prefixes.append((prefix, function, narrowed, w.bounds.get(dim)))
    return f"{prefix}({dim}{arguments})"
