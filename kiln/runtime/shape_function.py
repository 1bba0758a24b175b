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

A kind stands for the tensor a step would make: "int" a 0-D int64 tensor, "ints" a 1-D one, "tensor"
the value itself. Any exception inside the generated function makes the caller run the steps one by
one (Program.run), so a failing layer is named exactly as before, and an unusual value (a dim past
int64) is computed by the op itself.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from kiln.ops._util import broadcast_sizes, norm_axis
from kiln.ops.generators import arange_int64
from kiln.ops.indexing import gather, gather_elements
from kiln.ops.tensor import expand_to, reshape_to, slice_ints, squeeze_axes, unsqueeze_axes
from kiln.runtime.step import BoundStep

_INT64 = 7  # ONNX TensorProto.INT64
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
SMALL = 64  # an int64 constant of at most this many elements (0-D or 1-D) is known as Python ints at load
MEMO_ENTRIES = 256  # a group's values kept for at most this many values of its dims ...
MEMO_BYTES = 8 << 20  # ... and this many bytes of tensors (an encoder's position embeddings: seq x hidden floats)
_RANDOM = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli"}


class _Memo:
    """A group's values by the values of the dims it follows, least recently used out (MEMO_ENTRIES, MEMO_BYTES;
    the newest always kept). Contexts of one engine share it: a lock around the dict."""

    def __init__(self) -> None:
        self._kept: OrderedDict[tuple, tuple] = OrderedDict()
        self._bytes: dict[tuple, int] = {}
        self.held = 0
        self._lock = threading.Lock()

    def get(self, key: tuple) -> tuple | None:
        with self._lock:
            found = self._kept.get(key)
            if found is not None:
                self._kept.move_to_end(key)
            return found

    def put(self, key: tuple, values: tuple) -> None:
        size = sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor))
        with self._lock:
            if key in self._kept:
                return
            self._kept[key] = values
            self._bytes[key] = size
            self.held += size
            while len(self._kept) > 1 and (len(self._kept) > MEMO_ENTRIES or self.held > MEMO_BYTES):
                old, _ = self._kept.popitem(last=False)
                self.held -= self._bytes.pop(old)

    def clear(self) -> None:
        with self._lock:
            self._kept.clear()
            self._bytes.clear()
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
    return torch.tensor(dims, dtype=torch.int64)


def _one(result: Any) -> Any:
    return result[0] if isinstance(result, tuple) else result


_HELPERS = {"_only": _only, "_at": _at, "_arith": _arith, "_tensor": _tensor, "_one": _one,
            "_gather_nonneg": _gather_nonneg, "_gather_elements_nonneg": _gather_elements_nonneg,
            "_reshape_to": reshape_to, "_slice_ints": slice_ints, "_squeeze_axes": squeeze_axes,
            "_unsqueeze_axes": unsqueeze_axes, "_expand_to": expand_to, "_arange_int64": arange_int64,
            "_broadcast_sizes": broadcast_sizes}


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
        return _Out(x.var, x.kind, x.length, x.nonneg)
    if op == "Cast" and x.kind != "tensor" and attrs.get("to") == _INT64:
        return _Out(x.var, x.kind, x.length)
    if op == "Squeeze" and len(ins) == 1 and "axes" not in attrs and x.kind == "ints" and x.length == 1:
        return _Out(f"_only({x.var})", "int")  # every axis of size 1: a shape's one dim (else _only raises)
    if op in ("Squeeze", "Unsqueeze") and "axes" not in attrs:
        axes = _host_ints(w, ins, 1)
        if axes is None or len(ins) != 2 or ins[1] is None:
            return None
        first_axis = ins[1].constant in ((0,), (-1,))  # a constant's axes, read at load
        if op == "Squeeze" and x.kind == "ints" and first_axis:
            return _Out(f"_only({x.var})", "int")
        if op == "Unsqueeze" and x.kind == "int" and first_axis:
            return _Out(f"({x.var},)", "ints", 1)
        if x.kind == "tensor":
            fn = "_squeeze_axes" if op == "Squeeze" else "_unsqueeze_axes"
            return _Out(f"{fn}({x.var}, {axes[0]})", "tensor", nonneg=x.nonneg)
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
    if op == "Range" and len(ins) == 3 and all(v is not None and v.kind == "int" for v in ins):
        start, delta = x.constant, ins[2].constant
        counts_up = start is not None and delta is not None and start >= 0 and delta > 0  # start, start + delta...
        return _Out(f"_arange_int64({x.var}, {ins[1].var}, {ins[2].var})", "tensor", nonneg=counts_up)
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
        return _Out(f"_slice_ints({x.var}, {', '.join(host)}, {step.ctx.name!r})", "tensor", nonneg=x.nonneg)
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
            trailing = "".join(f"{d}, " for d in w.globals[x.var].shape[1:])
            return _Out(f"_expand_to({rows}, (*{shape}, {trailing})).contiguous()", "tensor", nonneg=x.nonneg,
                        reads=(rows, shape))
        return _Out(f"{fn}({ctx}, {x.var}, {i.var}, {int(attrs.get('axis', 0))})", "tensor", nonneg=x.nonneg)
    return None


_BROADCASTING = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Mod", "Max", "Min", "Sum", "Mean", "Equal", "Less",
                           "LessOrEqual", "Greater", "GreaterOrEqual", "And", "Or", "Xor", "Where", "BitShift",
                           "BitwiseAnd", "BitwiseOr", "BitwiseXor"})


def _shape_of_broadcast(op: str | None, ins: list[_Value | None], readers: tuple[str, ...]) -> _Out | None:
    """The output shape alone of a broadcasting elementwise op whose result only Shape steps read (an exported
    mask's Expand to Shape(Max(a, b))): the inputs' sizes broadcast (kind "shape": a tuple of ints), no op run."""
    if op not in _BROADCASTING or not readers or any(r != "Shape" for r in readers) or not ins or None in ins:
        return None
    shapes = {"tensor": "tuple({}.shape)", "ints": "(len({}),)", "int": "()", "shape": "{}"}
    return _Out("_broadcast_sizes(" + ", ".join(shapes[v.kind].format(v.var) for v in ins) + ")", "shape")


def computable_ahead(steps: list[BoundStep], order: list[int], template: list[Any],
                     input_slots: list[int]) -> list[int]:
    """Those of the shape-only steps `order` whose values follow from the inputs' shapes and constants alone.
    The others read a layer's output (a Shape of a Reshape's result in an exported Llama, and what follows
    from it): the loop computes them where they stand, once per signature, as before."""
    known = set(input_slots) | {s for s, v in enumerate(template) if v is not None}
    ahead = []
    for i in order:
        step = steps[i]
        if all(s < 0 or s in known for s in step.inputs):
            ahead.append(i)
            known.update(s for s in step.outputs if s >= 0)
    return ahead


def compile_shape_steps(steps: list[BoundStep], order: list[int], template: list[Any], input_slots: list[int],
                        slots: list[int], calls: set[int] = frozenset()) -> ShapeFunction | None:
    """The steps `order` (indices into `steps`, in order; computable_ahead's) as one function of the inputs'
    shapes, writing the values of `slots`; None when a step reads a value none of them computes. `calls`:
    steps made direct calls of their kernel whatever their op (a layer pinned to fp32 in a half-precision
    engine: its kernel casts around the op)."""
    w = _Writer()
    inputs = set()
    wanted = set(slots)
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
            out = step.outputs[0]
            if out >= 0:
                w.values[out] = _Value(var, emitted.kind, var if emitted.kind == "tensor" else None,
                                       length=emitted.length, nonneg=emitted.nonneg, expanded=emitted.expanded)
            continue
        # a direct call of the step's implementation on tensors
        fn, ctx = w.object("f", step.fn), w.object("ctx", step.ctx)
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
            if step.outputs[0] >= 0:
                w.values[step.outputs[0]] = _Value(var, "tensor", var)
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
    body, memos = _grouped(w)
    source = "def shape_values(env):\n" + "\n".join("    " + line for line in body + stores) + "\n"
    namespace = dict(w.globals)
    exec(compile(source, "<kiln shape function>", "exec"), namespace)  # noqa: S102  code generated above
    return ShapeFunction(namespace["shape_values"], source, list(slots), memos)


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


def _grouped(w: _Writer) -> tuple[list[str], list[_Memo]]:
    """The lines in groups by the input dims they follow (the "dims" lines they read, transitively), each group
    that follows some but not all of them kept per their values in a _Memo: the inputs and the dims lines first,
    then the groups by how many dims they follow (a group reads only lines of groups of fewer dims, or its own,
    earlier), then the lines never kept (reading an input's data, a random op, or what such a line made) in
    their order. Every variable a group defines is kept (what later lines read of it is among them)."""
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
            groups.setdefault(deps, []).append((line, defines))
    every = frozenset(name for line, (defines, _, kind) in zip(w.lines, w.meta) if kind == "dims"
                      for name in defines)
    body, memos = list(head), []
    for deps in sorted(groups, key=lambda d: (len(d), sorted(d))):
        lines = groups[deps]
        if deps == every or not every:  # what follows every dim: one signature's, which the Program keeps
            body += [line for line, _ in lines]
            continue
        memo = _Memo()
        name = w.object("_memo", memo)
        memos.append(memo)
        names = [d for _, defines in lines for d in defines]
        kept = ", ".join(names) + ("," if len(names) == 1 else "")
        key = "(" + "".join(f"{d}, " for d in sorted(deps)) + ")"
        body.append(f"_m = {name}.get({key})")
        body.append("if _m is None:")
        body += ["    " + line for line, _ in lines]
        body.append(f"    {name}.put({key}, ({kept}))")
        body.append("else:")
        body.append(f"    {kept} = _m")
    return body + rest, memos
