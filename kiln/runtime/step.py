"""A step as the runtime's loops run it (program.py's interpreter, native.py's segments): its
kernel bound to slots, and the one place a layer's failure is turned into an error naming it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kiln.errors import ExecutionError
from kiln.ops.registry import OpContext


@dataclass(slots=True)
class BoundStep:
    """One step as the loop runs it: its kernel, the op context, and slots instead of names."""

    fn: Callable[..., Any]  # fn(ctx, *inputs, **attributes): the tactic's launch or the op's implementation
    ctx: OpContext
    inputs: list[int]  # slots of the step's inputs then its captures; -1: a missing optional input
    outputs: list[int]  # slots it writes; -1: an output nobody reads
    attributes: dict[str, Any]  # runtime values (weights, nested Programs)
    free: list[int]  # slots whose value dies here: cleared after the step


def call_step(fn, ctx: OpContext, args: list[Any], attrs: dict[str, Any]) -> Any:
    try:
        return fn(ctx, *args, **attrs)
    except Exception as e:  # re-raised with the layer named; the cause is chained
        if isinstance(e, ExecutionError):
            raise
        raise ExecutionError(f"layer {ctx.name!r} ({ctx.op_type}) failed: {type(e).__name__}: {e}") from e


def pinned_fp32(fn):
    """Run a layer in fp32 inside a half-precision engine: upcast its inputs, downcast its outputs."""
    def up(v):
        return v.float() if isinstance(v, torch.Tensor) and v.dtype in (torch.float16, torch.bfloat16) else v

    def run(ctx, *args, **attrs):
        half = next((a.dtype for a in args if isinstance(a, torch.Tensor)
                     and a.dtype in (torch.float16, torch.bfloat16)), None)
        result = fn(ctx, *[up(a) for a in args], **attrs)
        if half is None:
            return result
        down = (lambda v: v.to(half) if isinstance(v, torch.Tensor) and v.dtype == torch.float32 else v)
        return tuple(down(r) for r in result) if isinstance(result, tuple) else down(result)

    return run
