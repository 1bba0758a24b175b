"""CUDA tactic for kiln::Rotary: kiln's Triton kernel (kiln/kernels/cuda/triton/rotary.py).

    cuda.rotary.triton    one pass over q or k (or a packed q|k|v's q and k heads), read through its
                          strides, cos/sin broadcast in the kernel; the default runs ~6 torch kernels
                          (mul, chunk, neg, cat, addcmul) over copies
"""

from __future__ import annotations

import importlib
import math

import torch

from kiln.plan.spec import StepSpec
from kiln.tactics.cuda.library import triton_available
from kiln.tactics.registry import register
from kiln.tactics.tactic import InputMeta, Tactic
from kiln.tactics.tactic import attribute as _attr

_FLOAT = (torch.float16, torch.bfloat16, torch.float32)


def _viewed(step: StepSpec, x: tuple[int, ...]) -> tuple[int, ...]:
    num_heads = int(_attr(step, "num_heads", 0))
    if num_heads and len(x) == 3:
        return (*x[:2], num_heads, x[2] // num_heads) if x[2] % num_heads == 0 else ()
    return x


def _supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    if len(inputs) < 3 or any(m.shape is None for m in inputs[:3]):
        return "x, cos and sin must all be tensors"
    x, cos, sin = inputs[:3]
    if not (x.dtype == cos.dtype == sin.dtype):
        return f"x, cos and sin differ in dtype ({x.dtype}, {cos.dtype}, {sin.dtype}): the op's result would be promoted"
    viewed = _viewed(step, x.shape)
    if not viewed:
        return f"x's last dim {x.shape[-1]} is not num_heads x head_dim"
    if not 1 <= len(viewed) <= 4:
        return f"x is rank {len(viewed)}: the kernel walks [A, B, H, D]"
    if viewed[-1] % 2:
        return f"the rotary width {viewed[-1]} is odd"
    try:
        out = torch.broadcast_shapes(viewed, cos.shape, sin.shape)
    except RuntimeError:
        return f"cos {list(cos.shape)} / sin {list(sin.shape)} do not broadcast to x {list(viewed)}"
    if tuple(out) != tuple(viewed):
        return f"cos/sin broadcast x {list(viewed)} to {list(out)}: the kernel writes x's shape"
    if math.prod(viewed) >= 2**31:
        return "x has 2^31 elements or more"
    return True


def _prepare(step: StepSpec, constants: list, device: torch.device):
    kernels = importlib.import_module("kiln.kernels.cuda.triton")
    num_heads = int(_attr(step, "num_heads", 0))
    interleaved = bool(int(_attr(step, "interleaved", 0)))
    rotate_heads = int(_attr(step, "rotate_heads", 0))

    def launch(ctx, x, cos, sin, **_attributes):
        return kernels.rotary(x, cos, sin, num_heads=num_heads, interleaved=interleaved, rotate_heads=rotate_heads)

    return launch


register(Tactic(
    name="cuda.rotary.triton", op_type="Rotary", domain="kiln", device="cuda", dtypes=_FLOAT,
    supports=_supports, prepare=_prepare, available=triton_available,
    description="rotary embedding in one Triton pass over strided q/k (a packed q|k|v's q and k heads)",
))
