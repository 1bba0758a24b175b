"""The view layers between a CPU program's native segments, each as its op with the op's own torch call on the same
arguments, its Python around that call cut (issue 10).

A decoder's loop runs, between its segments, layers that only view an activation (its heads split and merged,
grouped-query attention's k and v repeated, kᵀ): llama_tiny's 34, each through the op's implementation, which reads
its shape or axes input with `ints()` (a reshape of the tensor, `tolist`, an `int()` per value) and builds its target
with Python lists: 9-11 µs a Reshape, 12-27 an Unsqueeze or Expand on a loaded Zen 3
(bench/results/first-shape-views-2026-12-07.md). Session 29 took those from a signature's third call on as recorded
views (view_steps.py); its first and second calls still paid them, and the second paid the recording too.

Here each such layer's launch is its op's with:

- the shape (axes) input's ints kept with the tensor they were read from, found again by identity: a constant at
  every call, a shape value (Program.shape_plans) at every call of its signature; a miss reads them with one
  `tolist` (a 1-D integer tensor, as `ints()` reads it). Constants and shape values are never written in place
  (a shape plan is reused by every call of its signature, the template by every call), so the identity holds them;
  the kept tensor is held, so its identity cannot be another's;
- Expand's broadcast as one comparison per dim (the rule of `broadcast_sizes` for equal ranks; other ranks, or sizes
  that do not broadcast, go to the op, which raises as before);
- anything else (no shape input, a non-tensor, a tensor of another kind) the op itself.

The torch call and its arguments are the op's: `data.reshape(target)`, `x.expand(sizes)`, `x.reshape(shape)` for
(Un)squeeze, `x.permute(perm)`: the same tensors, views or copies, bit for bit, at every shape, first call or not
(tests/unit/test_view_launches.py against the op at random shapes and strides, and the programs against onnxruntime).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kiln.ops.registry import lookup
from kiln.ops.tensor import squeeze_axes, unsqueeze_axes

INTEGER_DTYPES = frozenset({torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8})


class _KeptInts:
    """A 1-D integer tensor's values as a tuple of Python ints, kept with the tensor last read (one per layer)."""

    __slots__ = ("_kept",)

    def __init__(self):
        self._kept: tuple[Any, tuple[int, ...]] | None = None  # (tensor, its ints): one tuple, read and set whole

    def __call__(self, value: torch.Tensor) -> tuple[int, ...] | None:
        """`value`'s ints as `ints()` reads them, or None where that differs (not 1-D, not an integer dtype)."""
        kept = self._kept
        if kept is not None and kept[0] is value:
            return kept[1]
        if value.dim() != 1 or value.dtype not in INTEGER_DTYPES:
            return None
        found = tuple(value.tolist())
        self._kept = (value, found)
        return found


def _reshape(op: Callable[..., Any]) -> Callable[..., Any]:
    ints_of = _KeptInts()

    def reshape(ctx, data, shape_input=None, *, allowzero=0, shape=None, consumed_inputs=None):
        # ONNX Reshape-5+: target from the shape input; 0 copies the input's dim unless allowzero; -1 left to torch
        if type(data) is torch.Tensor and type(shape_input) is torch.Tensor:
            target = ints_of(shape_input)
            if target is not None:
                if not allowzero and 0 in target:
                    sizes = data.shape
                    target = tuple(sizes[i] if d == 0 else d for i, d in enumerate(target))
                return data.reshape(target)
        return op(ctx, data, shape_input, allowzero=allowzero, shape=shape, consumed_inputs=consumed_inputs)

    return reshape


def _expand(op: Callable[..., Any]) -> Callable[..., Any]:
    ints_of = _KeptInts()

    def expand(ctx, x, shape):
        # out[i] = x[i] where x[i] != 1 (the target's dim then 1 or x[i]), else the target's: broadcast_sizes's rule
        if type(x) is torch.Tensor and type(shape) is torch.Tensor:
            target = ints_of(shape)
            if target is not None and len(target) == x.dim():
                sizes = x.shape
                if all(s == 1 or t == 1 or t == s for s, t in zip(sizes, target)):
                    return x.expand(tuple(t if s == 1 else s for s, t in zip(sizes, target)))
        return op(ctx, x, shape)

    return expand


def _unsqueeze(op: Callable[..., Any]) -> Callable[..., Any]:
    ints_of = _KeptInts()

    def unsqueeze(ctx, x, axes_input=None, *, axes=None):
        if type(x) is torch.Tensor and type(axes_input) is torch.Tensor:
            found = ints_of(axes_input)
            if found is not None:
                return unsqueeze_axes(x, list(found))
        return op(ctx, x, axes_input, axes=axes)

    return unsqueeze


def _squeeze(op: Callable[..., Any]) -> Callable[..., Any]:
    ints_of = _KeptInts()

    def squeeze(ctx, x, axes_input=None, *, axes=None):
        if type(x) is torch.Tensor and type(axes_input) is torch.Tensor:
            found = ints_of(axes_input)
            if found is not None:
                return squeeze_axes(x, list(found))
        return op(ctx, x, axes_input, axes=axes)

    return squeeze


def _transpose(op: Callable[..., Any]) -> Callable[..., Any]:
    def transpose(ctx, x, *, perm=None):
        if type(x) is torch.Tensor and perm is not None:
            return x.permute(perm)
        return op(ctx, x, perm=perm)

    return transpose


LEAN = {"Reshape": _reshape, "Expand": _expand, "Unsqueeze": _unsqueeze, "Squeeze": _squeeze, "Transpose": _transpose}


def lean_launch(op_type: str, domain: str, fn: Callable[..., Any]) -> Callable[..., Any] | None:
    """A launch of its own (its kept ints are its layer's) for a layer of `op_type` whose launch `fn` is the op's
    registered implementation itself; None for any other (a tactic's launch, a pinned-fp32 wrapper, another op)."""
    make = LEAN.get(op_type) if domain in ("", "ai.onnx") else None
    op = lookup(op_type, domain) if make is not None else None
    if op is None or fn is not op.fn:
        return None
    return make(fn)
