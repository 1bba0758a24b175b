"""CPU tactics for Softmax over the last axis in kiln's C (kiln/kernels/cpu/softmax.c), native-segment members:

    cpu.softmax.native       ONNX Softmax whose axis is the last (from opset 13 the one axis; before, the 2-D coercion
                             at the last axis is the same rows)
    cpu.kiln_softmax.native  kiln::Softmax (a decomposed softmax fused, kiln/passes/fusion/softmax.py) alike

Why: a classifier's Softmax after its last GEMM ran as a torch step after the segment of the GEMMs (a [8, 32] -> 64
-> 4 MLP: two native members, then torch's softmax, its conversions and the step loop's Python); as a member the
whole network is one call of the segment's loop (bench/tiny_models.py).
"""

from __future__ import annotations

from typing import Any

import torch

from kiln.kernels.cpu import softmax as kernels
from kiln.kernels.cpu import transformer as transformer_kernels
from kiln.plan.spec import StepSpec
from kiln.tactics.cpu.native_member import _tuned_sizes, prepared_native, sizes_config
from kiln.tactics.registry import register
from kiln.tactics.tactic import InputMeta, PlanRule, SizedPlan, Tactic
from kiln.tactics.tactic import attribute as _attr

_F32 = torch.float32


def _axis(step: StepSpec, rank: int) -> int:
    """The axis the step normalizes rows along, or -1 where its rows are not one axis's (before opset 13 the input
    is coerced to 2-D at `axis`: the same rows only where that is the last axis)."""
    default = 1 if step.domain == "" and step.opset < 13 else -1
    axis = int(_attr(step, "axis", default))
    return axis + rank if axis < 0 else axis


def _softmax_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    if not transformer_kernels.available():
        return f"kiln's C kernels are not built: {transformer_kernels.reason()}"
    x = inputs[0]
    if x.shape is None or x.dtype != _F32:
        return "only a float32 tensor of known shape"
    rank = len(x.shape)
    if rank == 0 or 0 in x.shape:
        return f"an empty or scalar input {list(x.shape)}"
    if rank > 3:  # no segment member (a segment's 4-D values are NHWC; an attention's scores): torch's, as before
        return f"rank {rank}: 3 at most"
    if _axis(step, rank) != rank - 1:
        return f"axis {_attr(step, 'axis', None)} of a rank-{rank} input: only the last axis"
    return True


def _softmax_prepare(step: StepSpec, constants: list[Any], device: torch.device):
    width = _tuned_sizes(step)[0][-1]

    def reads(sizes: dict[int, tuple[int, ...]]) -> dict[int, torch.dtype]:
        return {0: _F32}

    def build(sizes: dict[int, tuple[int, ...]]) -> kernels.Softmax:
        return kernels.Softmax(sizes[0])

    def sized(sizes: dict[int, tuple[int, ...]]) -> SizedPlan:
        size = tuple(sizes[0])
        if not size or size[-1] != width:
            raise ValueError(f"softmax over rows of {size[-1] if size else 0}, built for {width}")
        return SizedPlan((size,), kernels.Softmax.size_fields(size))

    return prepared_native(step, reads, build, max_rank=3,
                           plan_at=PlanRule(sized, ("softmax", width), traceable=True))


for _name, _domain in (("cpu.softmax.native", ""), ("cpu.kiln_softmax.native", "kiln")):
    register(Tactic(
        name=_name, op_type="Softmax", domain=_domain, device="cpu", dtypes=(_F32,),
        supports=_softmax_supports, configure=sizes_config, prepare=_softmax_prepare,
        available=transformer_kernels.available, native=True,
        description="Softmax over the last axis in kiln's C, a native-segment member",
    ))
