"""CPU tactics for kiln::Elementwise programs and Concat in kiln's C (kiln/kernels/cpu/elementwise.c),
native-segment members:

    cpu.elementwise.native  a fused chain of float32 elementwise ops (kiln/passes/fusion/elementwise.py),
                            inputs broadcast, constants baked into the plan
    cpu.concat.native       Concat of float32 tensors along any axis

Why: their default runs each program line as a torch call (an allocation and, past torch's grain, a
parallel region each) and splits the native segment around it; a DCN recommender's cross layers,
x0 * (W x + b) + x, and its Concat before the head took a third of its run on a shared 2-core VM.
Inputs of rank 4 run as steps of their own (a segment's 4-D values are NHWC in memory).
"""

from __future__ import annotations

from typing import Any

import torch

from kiln.kernels.cpu import elementwise as kernels
from kiln.kernels.cpu import transformer as transformer_kernels
from kiln.plan.spec import StepSpec
from kiln.tactics.cpu.broadcast import broadcast_input_shapes
from kiln.tactics.cpu.transformer import prepared_native, sizes_config
from kiln.tactics.registry import register
from kiln.tactics.tactic import InputMeta, Tactic
from kiln.tactics.tactic import attribute as _attr

_F32 = torch.float32


def _float_inputs(inputs: list[InputMeta]) -> str | None:
    if not transformer_kernels.available():
        return f"kiln's C kernels are not built: {transformer_kernels.reason()}"
    if any(m.shape is None or m.dtype != _F32 for m in inputs):
        return "only float32 tensors of known shapes"
    return None


# ---- kiln::Elementwise -------------------------------------------------------------------------------

def _elementwise_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    if (why := _float_inputs(inputs)) is not None:
        return why
    lines = kernels.parse(list(_attr(step, "code", [])), len(inputs))
    if isinstance(lines, str):
        return lines
    shapes = broadcast_input_shapes(inputs)
    if isinstance(shapes, str):
        return shapes
    if torch.broadcast_shapes(*shapes).numel() == 0:
        return "an empty output"
    return True


def _elementwise_prepare(step: StepSpec, constants: list[Any], device: torch.device):
    code = list(_attr(step, "code", []))
    baked = {k: c for k, c in enumerate(constants) if isinstance(c, torch.Tensor)}

    def reads(sizes: dict[int, tuple[int, ...]]) -> dict[int, torch.dtype]:
        return {k: _F32 for k in sizes if k not in baked}

    return prepared_native(step, reads, lambda sizes: kernels.Elementwise(code, sizes, baked), max_rank=3)


register(Tactic(
    name="cpu.elementwise.native", op_type="Elementwise", domain="kiln", device="cpu", dtypes=(_F32,),
    supports=_elementwise_supports, configure=sizes_config, prepare=_elementwise_prepare,
    available=transformer_kernels.available, native=True,
    description="a chain of float32 elementwise ops, broadcast, in kiln's C, a native-segment member",
))


# ---- Concat ------------------------------------------------------------------------------------------

def _concat_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    if (why := _float_inputs(inputs)) is not None:
        return why
    if not 1 <= len(inputs) <= kernels.EW_INPUTS:
        return f"{len(inputs)} inputs: 1 to {kernels.EW_INPUTS}"
    if any(m.constant for m in inputs):
        return "a constant input (folded or left to the default)"
    rank, axis = len(inputs[0].shape), int(_attr(step, "axis", 0))
    if rank == 0 or not -rank <= axis < rank:
        return f"axis {axis} of a rank-{rank} tensor"
    try:
        kernels.Concat([m.shape for m in inputs], axis)
    except ValueError as e:
        return str(e)
    return True


def _concat_prepare(step: StepSpec, constants: list[Any], device: torch.device):
    axis = int(_attr(step, "axis", 0))

    def reads(sizes: dict[int, tuple[int, ...]]) -> dict[int, torch.dtype]:
        return {k: _F32 for k in sizes}

    return prepared_native(step, reads, lambda sizes: kernels.Concat([sizes[k] for k in sorted(sizes)], axis),
                           max_rank=3)


register(Tactic(
    name="cpu.concat.native", op_type="Concat", domain="", device="cpu", dtypes=(_F32,),
    supports=_concat_supports, configure=sizes_config, prepare=_concat_prepare,
    available=transformer_kernels.available, native=True,
    description="Concat of float32 tensors in kiln's C, a native-segment member",
))
