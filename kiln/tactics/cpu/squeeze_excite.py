"""CPU tactic for kiln::SqueezeExcite on kiln's C kernel (kiln/kernels/cpu/se.py), a native-segment member.

    cpu.squeeze_excite.native   pool, two GEMVs with their activations, gate and channel scale in one call,
                                NHWC activations (the layout of the convolutions around it)

Why: the block's channel scale has no oneDNN primitive, so unfused (or run by the op's torch code) it
leaves the segment and costs a Python step and four torch calls per block: EfficientNet-B0 has 16.
Here the block is one call of the segment loop. Outside a segment it runs the same kernel on a
channels-last tensor. A kernel is bound per input size (dynamic batch: one more on first sight).
"""

from __future__ import annotations

from typing import Any

import torch

from kiln.kernels.cpu import se
from kiln.plan.spec import StepSpec
from kiln.tactics.cpu.native_member import (float_constant_refusal, input_size_config, not_built_refusal,
                                            prepared_sized)
from kiln.tactics.registry import register
from kiln.tactics.tactic import InputMeta, Tactic
from kiln.tactics.tactic import attribute as _attr

_F32 = torch.float32


def _supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    if (refusal := not_built_refusal(se, "squeeze-excitation")) is not None:
        return refusal
    x = inputs[0]
    if x.shape is None or len(x.shape) != 4:
        return "only 4-D inputs [N, C, H, W]"
    for k, name in ((1, "squeeze weight"), (2, "squeeze bias"), (3, "excite weight"), (4, "excite bias")):
        meta = inputs[k] if k < len(inputs) else None
        if meta is None or meta.shape is None:
            if k in (1, 3):
                return f"the {name} is missing"
            continue
        if (refusal := float_constant_refusal(meta, name)) is not None:
            return refusal
    activation, gate = _attr(step, "activation", ""), _attr(step, "gate", "Sigmoid")
    if activation not in se.ACTIVATIONS:
        return f"activation {activation!r}: the kernel applies {sorted(se.ACTIVATIONS)}"
    if gate not in se.GATES:
        return f"gate {gate!r}: the kernel gates with {se.GATES}"
    return True


def _prepare(step: StepSpec, constants: list[Any], device: torch.device):
    w1, w2 = constants[1], constants[3]
    b1 = constants[2] if len(constants) > 2 else None
    b2 = constants[4] if len(constants) > 4 else None
    epilogue = dict(activation=_attr(step, "activation", ""), alpha=float(_attr(step, "alpha", 0.0)),
                    beta=float(_attr(step, "beta", 0.0)), gate=_attr(step, "gate", "Sigmoid"),
                    gate_alpha=float(_attr(step, "gate_alpha", 0.0)), gate_beta=float(_attr(step, "gate_beta", 0.0)))
    return prepared_sized(step, lambda size: se.SqueezeExcite(w1, b1, w2, b2, size, **epilogue))


register(Tactic(
    name="cpu.squeeze_excite.native", op_type="SqueezeExcite", domain="kiln", device="cpu", dtypes=(_F32,),
    supports=_supports, configure=input_size_config, prepare=_prepare, layout="channels_last", available=se.available,
    native=True, description="squeeze-and-excitation block (pool, two GEMVs, gate, scale) in kiln's C, NHWC, "
                             "a native-segment member",
))
