"""A program's view layers at an input-shape signature already run: each one torch call with the geometry its op
gave there (issue 10). With program.LEAN_VIEWS on (the default) a layer's launch is a lean one (view_launches.py)
that keeps what it gave per input geometry: the list is made from those entries after the signature's second run
(_kept_view), no layer wrapped; off, each layer's launch is wrapped for that run (_Recorder), as below.

Between a decoder's native segments the loop runs layers that only view an activation: its heads split (Reshape,
Transpose), grouped-query attention's k and v repeated (Unsqueeze, Expand, then a Reshape that copies), kᵀ, the heads
merged. Their other inputs are constants or shape values (Program.shape_plans), the same at every call of one
signature, so what each gives is a function of its data input's sizes and strides alone. Through the op dispatch
(call_step, ints() of a target tensor, the op's own checks) each cost 4-30 µs: llama_tiny's 34 such layers ~0.5 ms
of a call on a loaded Zen 3, against ~1.2 µs for one as_strided (bench/results/first-shape-views-2026-12-07.md).

So a signature's second run (its first runs plainly: a signature met once never pays a recording; a plan made
ahead at load is no run) records, per such layer, what it gave: the output's sizes, strides and storage offset from
its input's where the output is a view of the input, or its sizes where a Reshape (Flatten) copied. Its later runs
take a step list (~10 KB for llama_tiny's 34 layers) in which each recorded layer is one `as_strided` (one `reshape`)
of its input, where the input has the sizes and strides it had when recorded; else (a value of a data-dependent size upstream) the layer's own op runs, on the same other inputs.
The same torch views and copies as the ops make: equal results, bit for bit. Step lists are kept per signature,
least recently used out past SIGNATURES (as the shape plans are: program.SHAPE_PLANS).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import torch

from kiln.runtime.step import BoundStep

VIEW_OPS = frozenset({"Reshape", "Flatten", "Transpose", "Unsqueeze", "Squeeze", "Expand"})  # (Identity: its input
# itself, already)
COPYING = frozenset({"Reshape", "Flatten"})  # ... of which these copy where the input's strides forbid a view
SIGNATURES = 256  # signatures whose step lists a program keeps (program.SHAPE_PLANS: as many as its shape plans)


class _Strided:
    """A view layer as the view its op gave at a signature: `as_strided` of the input (offset from the input's)."""

    __slots__ = ("in_size", "in_strides", "size", "strides", "offset", "fn", "rest", "attributes")

    def __init__(self, x: torch.Tensor, y: torch.Tensor, fn: Any, rest: tuple, attributes: dict[str, Any]):
        self.in_size, self.in_strides = x.shape, x.stride()
        self.size, self.strides, self.offset = y.shape, y.stride(), y.storage_offset() - x.storage_offset()
        self.fn, self.rest, self.attributes = fn, rest, attributes  # the layer's own launch, for other inputs

    @classmethod
    def of_kept(cls, in_size: tuple, in_strides: tuple, size: Any, strides: Any, fn: Any, rest: tuple,
                attributes: dict[str, Any]) -> _Strided:
        """The layer as a lean launch (view_launches.py) kept it for an input of `in_size` and `in_strides`: `size`
        and `strides` at the input's own offset (for _Reshaped: `size` the argument of its reshape)."""
        made = object.__new__(cls)
        made.in_size, made.in_strides, made.size, made.strides, made.offset = in_size, in_strides, size, strides, 0
        made.fn, made.rest, made.attributes = fn, rest, attributes
        return made

    def __call__(self, ctx, x):
        if type(x) is torch.Tensor and x.stride() == self.in_strides and x.shape == self.in_size:
            return x.as_strided(self.size, self.strides, x.storage_offset() + self.offset)
        return self.fn(ctx, x, *self.rest, **self.attributes)


class _Reshaped(_Strided):
    """A Reshape (Flatten) that copied at a signature: its input reshaped to the sizes it gave (torch copies, as the
    op's own reshape did)."""

    __slots__ = ()

    def __call__(self, ctx, x):
        if type(x) is torch.Tensor and x.stride() == self.in_strides and x.shape == self.in_size:
            return x.reshape(self.size)
        return self.fn(ctx, x, *self.rest, **self.attributes)


class _Recorder:
    """A view layer's launch that keeps what it gave (`made`: a _Strided or _Reshaped, None where neither holds)."""

    __slots__ = ("fn", "op_type", "made")

    def __init__(self, fn: Any, op_type: str):
        self.fn, self.op_type, self.made = fn, op_type, None

    def __call__(self, ctx, x, *rest, **attributes):
        y = self.fn(ctx, x, *rest, **attributes)
        if type(x) is torch.Tensor and type(y) is torch.Tensor:  # (a CPU program's: SignatureViews.of)
            if y.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
                self.made = _Strided(x, y, self.fn, rest, attributes)
            elif self.op_type in COPYING and y.is_contiguous():
                self.made = _Reshaped(x, y, self.fn, rest, attributes)
        return y


def _kept_view(step: BoundStep, env: list[Any]) -> _Strided | None:
    """What a lean launch (view_launches.py) kept at the input geometry it last met, as a _Strided (a _Reshaped: a
    Reshape that copied), where that entry is for the other input `step` read in this run (`env` after it: its other
    inputs are constants or shape values, never freed): the same tensor, or the same perm. None otherwise (another
    thread's run at another signature since, or the entry let go): the layer keeps its launch."""
    kept = step.fn.kept
    key = kept.last
    found = kept.get(key) if key is not None else None
    rest = tuple(env[s] if s >= 0 else None for s in step.inputs[1:])
    if found is None or found[0] is not (rest[0] if rest else step.attributes.get("perm")):
        return None
    if found[2] is not None:
        return _Strided.of_kept(key[0], key[1], found[2], found[3], step.fn, rest, step.attributes)
    if found[1] is not None and step.ctx.op_type in COPYING:
        return _Reshaped.of_kept(key[0], key[1], found[1], None, step.fn, rest, step.attributes)
    return None


class SignatureViews:
    """One program's (one copy's: Program.with_own_arena) step lists per signature with its view layers recorded."""

    def __init__(self, positions: list[int]):
        """`positions`: the view layers' indices in the program's lean steps (SignatureViews.of)."""
        self._positions = positions
        self._lists: OrderedDict[tuple, list[BoundStep]] = OrderedDict()
        self._seen: OrderedDict[tuple, None] = OrderedDict()  # signatures run once (plainly), the newest SIGNATURES
        self._lock = threading.Lock()

    @classmethod
    def of(cls, lean_steps: list[BoundStep], fixed: set[int]) -> SignatureViews | None:
        """The views of a program whose lean steps (the loop at a known signature) are `lean_steps`, `fixed` the
        slots whose values are the same at every call of a signature (constants and shape values); None where no
        layer is a view layer: one of VIEW_OPS on an activation (its first input), its other inputs fixed."""
        positions = [i for i, step in enumerate(lean_steps)
                     if step.ctx.op_type in VIEW_OPS and step.ctx.domain in ("", "ai.onnx") and len(step.outputs) == 1
                     and step.inputs and step.inputs[0] >= 0 and step.inputs[0] not in fixed
                     and all(s < 0 or s in fixed for s in step.inputs[1:])]
        return cls(positions) if positions else None

    def fresh(self) -> SignatureViews:
        """The same layers for another copy of the program (its own lean steps: its segments are its own)."""
        return type(self)(self._positions)

    def __len__(self) -> int:
        return len(self._lists)

    def ran(self, signature: tuple) -> None:
        """`signature` ran once, plainly (Program.run's first run there, which computed its shape plan)."""
        with self._lock:
            self._seen[signature] = None
            if len(self._seen) > SIGNATURES:
                self._seen.popitem(last=False)

    def steps(self, signature: tuple, lean_steps: list[BoundStep]) -> tuple[list[BoundStep], list[_Recorder] | None]:
        """(the steps a run at `signature` (its shape plan known) takes, the recorders to hand to `keep` after it or
        None): the signature's recorded list; else, where it ran before, `lean_steps` with each view layer recording;
        else `lean_steps` (its run counted: ran)."""
        found = self._lists.get(signature)
        if found is not None:
            with self._lock:
                if signature in self._lists:
                    self._lists.move_to_end(signature)
            return found, None
        if signature not in self._seen:
            self.ran(signature)
            return lean_steps, None
        steps = list(lean_steps)
        recorders: list[_Recorder | None] = []
        for i in self._positions:
            step = steps[i]
            if hasattr(step.fn, "kept"):  # a lean launch: read back at keep, nothing wrapped
                recorders.append(None)
                continue
            recorder = _Recorder(step.fn, step.ctx.op_type)
            recorders.append(recorder)
            steps[i] = BoundStep(recorder, step.ctx, step.inputs, step.outputs, step.attributes, step.free)
        return steps, recorders

    def keep(self, signature: tuple, steps: list[BoundStep], recorders: list[_Recorder | None], env: list[Any]
             ) -> None:
        """The signature's list: the recording run's `steps` (from `steps`, this signature's alone), each view layer
        taking what its recorder made, or (a lean launch's) what its launch kept (_kept_view, `env` the run's
        values); its own launch where none holds."""
        for i, recorder in zip(self._positions, recorders):
            step = steps[i]
            if recorder is None:
                made = _kept_view(step, env)
                if made is not None:
                    steps[i] = BoundStep(made, step.ctx, step.inputs[:1], step.outputs, {}, step.free)
            elif recorder.made is not None:
                step.fn, step.inputs, step.attributes = recorder.made, step.inputs[:1], {}
            else:
                step.fn = recorder.fn
        with self._lock:
            self._seen.pop(signature, None)
            self._lists[signature] = steps
            while len(self._lists) > SIGNATURES:
                self._lists.popitem(last=False)
