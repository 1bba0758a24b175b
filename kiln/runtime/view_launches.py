"""The view layers between a CPU program's native segments, each as its op with the op's own torch call on the same
arguments, its Python around that call cut (issue 10).

A decoder's loop runs, between its segments, layers that only view an activation (its heads split and merged,
grouped-query attention's k and v repeated, kᵀ): llama_tiny's 34, each through the op's implementation, which reads
its shape or axes input with `ints()` (a reshape of the tensor, `tolist`, an `int()` per value) and builds its target
with Python lists: 9-11 µs a Reshape, 12-27 an Unsqueeze or Expand on a loaded Zen 3
(bench/results/first-shape-views-2026-12-07.md). Session 29 took those from a signature's third call on as recorded
views (view_steps.py); its first and second calls still paid them, and the second paid the recording too.

Here each such layer's launch is its op's with what it found kept, per layer, by its input's sizes and strides (an
entry serves the shape or axes tensor, or the perm, it was found with, by identity):

- an input geometry's first call: the op's torch call on the op's argument, read with one `tolist` of the shape
  (axes) tensor (a 1-D integer tensor, as `ints()` reads it; Expand's broadcast as one comparison per dim,
  broadcast_sizes's rule at equal ranks); the argument kept, nothing read of the output (a shape met once pays
  no more than the op);
- its second: the torch call on the kept argument, and the output's sizes and strides kept where it viewed the
  input at the input's storage offset;
- from its third: one `as_strided` of the input to the kept sizes and strides at its own storage offset (a view), or
  the torch call on the kept argument (a Reshape that copied);
- anything else (no shape input, a non-tensor, a tensor of another kind, sizes that do not broadcast) the op itself.

A signature's second call also makes its list of recorded views (view_steps.SignatureViews) from these entries: no
layer is wrapped and no output probed to record it (session 29's recording cost that call ~1.2x), and from its third
call the list runs (one look-up a call, not one a layer). What a view gives is a function of its input's sizes and
strides and the argument alone (torch computes a view's strides from those), at its input's storage offset; the
argument is a function of the shape tensor's values and the input's sizes. The identity stands for the values: only
layers whose other inputs are constants or shape values take these launches (Program), and those are never written
in place (a shape plan serves every call of its signature, the template every call); the entry holds the tensor, so
its identity is no other's while kept. Bit for bit the op's tensors (the same sizes, strides, offset and storage), at
every shape and call: tests/unit/test_view_launches.py against the op at random shapes, strides and offsets, and
llama_tiny against the ops' run and onnxruntime at random shapes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kiln.ops._util import norm_axis
from kiln.ops.registry import lookup

INTEGER_DTYPES = frozenset({torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8})
KEPT = 512  # entries a layer keeps (program.SHAPE_PLANS signatures, twice)


def _ints(value: torch.Tensor) -> tuple[int, ...] | None:
    """A 1-D integer tensor's values as `ints()` reads them; None for another kind (the op then reads it)."""
    if value.dim() != 1 or value.dtype not in INTEGER_DTYPES:
        return None
    return tuple(value.tolist())


class _Kept(dict):
    """What a layer's launch found, by (the input's sizes, its strides): (the shape or axes tensor, or the perm, it
    was found with: an entry serves that one alone, by identity, and holds it, so that its identity is no other's
    while kept; the argument of the op's torch call, None where the op runs itself; the output's sizes and strides
    where it viewed the input at the input's storage offset, else None, None; whether the output was looked at).
    An input geometry's first call keeps the argument alone, its second looks at what the call gave. At most KEPT
    entries (then it starts over)."""

    __slots__ = ("last",)  # the key of the entry a call last found or made (view_steps.SignatureViews.keep reads it)

    def __init__(self):
        super().__init__()
        self.last: tuple | None = None

    def first(self, key: tuple, other: Any, argument: Any) -> None:
        if len(self) >= KEPT:
            self.clear()
        self[key] = (other, argument, None, None, False)

    def looked(self, key: tuple, found: tuple, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Keep whether `y` (what the torch call on found's argument gave for `x`) views `x`, and how; `y`."""
        # at x's offset (a copy's storage is new: elsewhere; a meta tensor has no address to tell by)
        if y.data_ptr() == x.data_ptr() and y.numel() > 0 and not x.is_meta:
            self[key] = (found[0], found[1], y.shape, y.stride(), True)
        else:
            self[key] = (found[0], found[1], None, None, True)
        return y


def _reshape(op: Callable[..., Any]) -> Callable[..., Any]:
    kept = _Kept()

    def reshape(ctx, data, shape_input=None, *, allowzero=0, shape=None, consumed_inputs=None):
        # ONNX Reshape-5+: target from the shape input; 0 copies the input's dim unless allowzero; -1 left to torch
        if type(data) is torch.Tensor and type(shape_input) is torch.Tensor:
            kept.last = key = (data.shape, data.stride())
            found = kept.get(key)
            if found is not None and found[0] is shape_input:
                if found[2] is not None:
                    return data.as_strided(found[2], found[3], data.storage_offset())
                if found[1] is not None:
                    y = data.reshape(found[1])
                    return y if found[4] else kept.looked(key, found, data, y)
            else:
                target = _ints(shape_input)
                if target is not None and not allowzero and 0 in target:
                    sizes = key[0]
                    target = tuple(sizes[i] if d == 0 else d for i, d in enumerate(target))
                kept.first(key, shape_input, target)
                if target is not None:
                    return data.reshape(target)
        return op(ctx, data, shape_input, allowzero=allowzero, shape=shape, consumed_inputs=consumed_inputs)

    reshape.kept = kept
    return reshape


def _expand(op: Callable[..., Any]) -> Callable[..., Any]:
    kept = _Kept()

    def expand(ctx, x, shape):
        # out[i] = x[i] where x[i] != 1 (the target's dim then 1 or x[i]), else the target's: broadcast_sizes's rule
        if type(x) is torch.Tensor and type(shape) is torch.Tensor:
            kept.last = key = (x.shape, x.stride())
            found = kept.get(key)
            if found is not None and found[0] is shape:
                if found[2] is not None:
                    return x.as_strided(found[2], found[3], x.storage_offset())
                if found[1] is not None:
                    y = x.expand(found[1])
                    return y if found[4] else kept.looked(key, found, x, y)
            else:
                sizes, target, out = key[0], _ints(shape), None
                if target is not None and len(target) == len(sizes) \
                        and all(s == 1 or t == 1 or t == s for s, t in zip(sizes, target)):
                    out = tuple(t if s == 1 else s for s, t in zip(sizes, target))
                kept.first(key, shape, out)
                if out is not None:
                    return x.expand(out)
        return op(ctx, x, shape)

    expand.kept = kept
    return expand


def _resized(sizes_of: Callable[[torch.Size, tuple[int, ...]], tuple[int, ...]]):
    """(Un)squeeze-13+: `x.reshape(sizes_of(x's sizes, the axes' ints))`, as unsqueeze_axes and squeeze_axes do."""
    def make(op: Callable[..., Any]) -> Callable[..., Any]:
        kept = _Kept()

        def resized(ctx, x, axes_input=None, *, axes=None):
            if type(x) is torch.Tensor and type(axes_input) is torch.Tensor:
                kept.last = key = (x.shape, x.stride())
                found = kept.get(key)
                if found is not None and found[0] is axes_input:
                    if found[2] is not None:
                        return x.as_strided(found[2], found[3], x.storage_offset())
                    if found[1] is not None:
                        y = x.reshape(found[1])
                        return y if found[4] else kept.looked(key, found, x, y)
                else:
                    read = _ints(axes_input)
                    out = sizes_of(key[0], read) if read is not None else None
                    kept.first(key, axes_input, out)
                    if out is not None:
                        return x.reshape(out)
            return op(ctx, x, axes_input, axes=axes)

        resized.kept = kept
        return resized

    return make


def _unsqueezed(sizes: torch.Size, axes: tuple[int, ...]) -> tuple[int, ...]:
    """unsqueeze_axes's sizes: a 1 inserted at each axis (counted in the output's rank), in order."""
    rank = len(sizes) + len(axes)
    out = list(sizes)
    for a in sorted(norm_axis(a, rank) for a in axes):
        out.insert(a, 1)
    return tuple(out)


def _squeezed(sizes: torch.Size, axes: tuple[int, ...]) -> tuple[int, ...]:
    """squeeze_axes's sizes: the input's less the axes named (none named: every axis of size 1)."""
    named = {norm_axis(a, len(sizes)) for a in (axes or [i for i, d in enumerate(sizes) if d == 1])}
    return tuple(d for i, d in enumerate(sizes) if i not in named)


def _transpose(op: Callable[..., Any]) -> Callable[..., Any]:
    kept = _Kept()

    def transpose(ctx, x, *, perm=None):
        if type(x) is torch.Tensor and perm is not None:
            kept.last = key = (x.shape, x.stride())
            found = kept.get(key)
            if found is not None and found[0] is perm:
                if found[2] is not None:
                    return x.as_strided(found[2], found[3], x.storage_offset())
                y = x.permute(perm)
                return y if found[4] else kept.looked(key, found, x, y)
            kept.first(key, perm, perm)
            return x.permute(perm)
        return op(ctx, x, perm=perm)

    transpose.kept = kept
    return transpose


LEAN = {"Reshape": _reshape, "Expand": _expand, "Transpose": _transpose,
        "Unsqueeze": _resized(_unsqueezed), "Squeeze": _resized(_squeezed)}


def lean_launch(op_type: str, domain: str, fn: Callable[..., Any]) -> Callable[..., Any] | None:
    """A launch of its own (what it keeps is its layer's), called as the op is, for a layer of `op_type` whose launch
    `fn` is the op's registered implementation itself; None for any other (a tactic's launch, a pinned-fp32 wrapper,
    another op)."""
    make = LEAN.get(op_type) if domain in ("", "ai.onnx") else None
    op = lookup(op_type, domain) if make is not None else None
    if op is None or fn is not op.fn:
        return None
    return make(fn)
