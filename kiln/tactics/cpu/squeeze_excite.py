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
from kiln.tactics.registry import register
from kiln.tactics.tactic import InputMeta, NativeStep, Tactic, resizable, same_primitive
from kiln.tactics.tactic import attribute as _attr

_CL = torch.channels_last
_F32 = torch.float32
_KEPT = 8  # kernels kept per layer for input sizes other than the tuned one


def _supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    if not se.available():
        return f"kiln's squeeze-excitation kernel is not built: {se.reason()}"
    x = inputs[0]
    if x.shape is None or len(x.shape) != 4:
        return "only 4-D inputs [N, C, H, W]"
    for k, name in ((1, "squeeze weight"), (2, "squeeze bias"), (3, "excite weight"), (4, "excite bias")):
        meta = inputs[k] if k < len(inputs) else None
        if meta is None or meta.shape is None:
            if k in (1, 3):
                return f"the {name} is missing"
            continue
        if not meta.constant or meta.dtype != _F32:
            return f"the {name} is not a float32 constant of the engine"
    activation, gate = _attr(step, "activation", ""), _attr(step, "gate", "Sigmoid")
    if activation not in se.ACTIVATIONS:
        return f"activation {activation!r}: the kernel applies {sorted(se.ACTIVATIONS)}"
    if gate not in se.GATES:
        return f"gate {gate!r}: the kernel gates with {se.GATES}"
    return True


def _configure(step: StepSpec, inputs: list[InputMeta]) -> dict[str, Any]:
    return {"input_size": list(inputs[0].shape)}


def _prepare(step: StepSpec, constants: list[Any], device: torch.device):
    w1, w2 = constants[1], constants[3]
    b1 = constants[2] if len(constants) > 2 else None
    b2 = constants[4] if len(constants) > 4 else None
    epilogue = dict(activation=_attr(step, "activation", ""), alpha=float(_attr(step, "alpha", 0.0)),
                    beta=float(_attr(step, "beta", 0.0)), gate=_attr(step, "gate", "Sigmoid"),
                    gate_alpha=float(_attr(step, "gate_alpha", 0.0)), gate_beta=float(_attr(step, "gate_beta", 0.0)))
    tuned = tuple(step.tactic_config["input_size"])
    kernels: dict[tuple[int, ...], se.SqueezeExcite] = {}

    def kernel(size: tuple[int, ...]) -> se.SqueezeExcite:
        found = kernels.get(size)
        if found is None:
            if len(kernels) > _KEPT:
                kernels.pop(next(k for k in kernels if k != tuned))
            found = kernels[size] = se.SqueezeExcite(w1, b1, w2, b2, size, **epilogue)
        return found

    kernel(tuned)  # at load: the tuned size's kernel

    def launch(ctx, x, *_inputs, **_attributes):
        x = x.contiguous(memory_format=_CL)  # [N, C, H, W]; free when already channels-last
        return kernel(tuple(x.shape))(x)  # [N, C, H, W] channels-last

    @resizable

    def native_at(size: tuple[int, ...]) -> NativeStep:
        found = kernel(tuple(size))
        return NativeStep(tuple(size), found.output_size, same_primitive(found))

    launch.native = native_at(tuned)
    return launch


register(Tactic(
    name="cpu.squeeze_excite.native", op_type="SqueezeExcite", domain="kiln", device="cpu", dtypes=(_F32,),
    supports=_supports, configure=_configure, prepare=_prepare, layout="channels_last", available=se.available,
    native=True, description="squeeze-and-excitation block (pool, two GEMVs, gate, scale) in kiln's C, NHWC, "
                             "a native-segment member",
))
