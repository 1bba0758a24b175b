"""CPU tactic for kiln::Rotary on kiln's C kernel (kiln/kernels/cpu/transformer.c kiln_rotary):

    cpu.rotary.native   rotate-half rotary embedding of a contiguous float32 x (3-D with num_heads, or
                        up to 4-D), cos/sin tables broadcast over it; rotate_heads (a packed q|k|v)

Why: a decoder's rotary ran as a torch step per q and k per layer (~0.2 ms each at Llama-small's
1 x 128 tokens, one thread) and split every layer's native segment in two; as a member, the layer's
attention block runs in the segment loop.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kiln.kernels.cpu import transformer as kernels
from kiln.plan.spec import StepSpec
from kiln.tactics.cpu.native_member import prepared_native, sizes_config
from kiln.tactics.registry import register
from kiln.tactics.tactic import InputMeta, PlanRule, SizedPlan, Tactic
from kiln.tactics.tactic import attribute as _attr

_F32 = torch.float32


def rotary_view(x: tuple[int, ...], num_heads: int, rotate_heads: int) -> tuple[tuple[int, ...], tuple[int, ...], int] | str:
    """(x as [n0, n1, n2, D], the output's size, heads rotated) as kiln/ops/fused.py rotary computes it, or
    why the kernel cannot."""
    if num_heads and len(x) == 3:
        if x[-1] % num_heads:
            return f"{x[-1]} is not {num_heads} heads wide"
        view = (x[0], x[1], num_heads, x[2] // num_heads)
        return view, (tuple(x) if rotate_heads else view), (rotate_heads or num_heads)
    if rotate_heads:
        return "rotate_heads without num_heads over a 3-D x"
    if not 1 <= len(x) <= 4:
        return f"x is {len(x)}-D: at most 4"
    view = (1,) * (4 - len(x)) + tuple(x)
    return view, tuple(x), view[2]


def _supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    if not kernels.available():
        return f"kiln's transformer kernels are not built: {kernels.reason()}"
    if len(inputs) != 3 or any(m.shape is None or m.dtype != _F32 for m in inputs):
        return "x, cos and sin are not float32 tensors of known shapes"
    if _attr(step, "interleaved", 0):
        return "interleaved (GPT-J) pairs: only the rotate-half form"
    found = rotary_view(tuple(inputs[0].shape), int(_attr(step, "num_heads", 0)), int(_attr(step, "rotate_heads", 0)))
    if isinstance(found, str):
        return found
    view = found[0]
    if view[-1] % 2:
        return f"odd rotary depth {view[-1]}"
    for name, meta in (("cos", inputs[1]), ("sin", inputs[2])):
        size = tuple(meta.shape)
        if len(size) > 4 or not size or size[-1] != view[-1] or \
                any(d not in (1, want) for d, want in zip(reversed(size), reversed(view))):
            return f"{name} {list(size)} does not broadcast to x viewed as {list(view)} with a full last axis"
    if math.prod(view) == 0:
        return "an empty x"
    return True


def _prepare(step: StepSpec, constants: list[Any], device: torch.device):
    num_heads, rotate_heads = int(_attr(step, "num_heads", 0)), int(_attr(step, "rotate_heads", 0))

    def build(sizes: dict[int, tuple[int, ...]]) -> kernels.Rotary:
        found = rotary_view(sizes[0], num_heads, rotate_heads)
        if isinstance(found, str):
            raise ValueError(f"rotary at {sizes}: {found}")
        view, output_size, rotate = found
        return kernels.Rotary(view, output_size, rotate, sizes[1], sizes[2])

    def sized(sizes: dict[int, tuple[int, ...]]) -> SizedPlan:
        """kernels.Rotary's fields at `sizes` without building it: arithmetic and comparisons on the sizes only, so
        a segment's view at new sizes is traced (without it a view made the kernel at every new shape: llama_tiny's
        attention segments walked at each call, bench/results/first-shape-2026-12-06.md)."""
        found = rotary_view(sizes[0], num_heads, rotate_heads)
        if isinstance(found, str):
            raise ValueError(f"rotary at {sizes}: {found}")
        view, output_size, rotate = found
        n0, n1, n2, depth = view
        if depth % 2 or not 0 <= rotate <= n2:
            raise ValueError(f"rotary over {list(view)} (rotating {rotate} heads)")
        return SizedPlan((tuple(output_size),), dict(n0=n0, n1=n1, n2=n2, D=depth, rotate=rotate,
                                                     cs=broadcast_strides(sizes[1], view)[:3],
                                                     ss=broadcast_strides(sizes[2], view)[:3]))

    return prepared_native(step, lambda sizes: {0: _F32, 1: _F32, 2: _F32}, build,
                           plan_at=PlanRule(sized, ("rotary", num_heads, rotate_heads), traceable=True))


def broadcast_strides(size: tuple[int, ...], view: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of `size` expanded to `view` as torch's expand gives them (kernels.Rotary
    asks a meta tensor's expand; its plan's bytes must be the same), by arithmetic and comparisons alone (a traced
    rule's sizes are symbols): from the last dim, a dim it repeats 0, one it adds the product of the next size and
    stride (0 where it repeats); ValueError where it does not broadcast."""
    if len(size) > len(view) or not size or size[-1] != view[-1]:
        raise ValueError(f"a cos/sin table of {list(size)} for a rotary over {list(view)}")
    strides: list = []
    contiguous, next_size = 1, None
    for i in range(len(view) - 1, -1, -1):
        j = i - (len(view) - len(size))
        if j >= 0:
            have, stride = size[j], contiguous
            contiguous = contiguous * size[j]
        else:
            have, stride = 1, next_size * strides[-1]
        if have != view[i]:
            if have != 1:
                raise ValueError(f"a cos/sin table of {list(size)} does not broadcast to {list(view)}")
            stride = 0
        strides.append(stride)
        next_size = view[i]
    return tuple(reversed(strides))


register(Tactic(
    name="cpu.rotary.native", op_type="Rotary", domain="kiln", device="cpu", dtypes=(_F32,),
    supports=_supports, configure=sizes_config, prepare=_prepare, available=kernels.available, native=True,
    description="rotary position embedding (rotate-half; a packed q|k|v's q and k heads) in kiln's C, a "
                "native-segment member",
))
