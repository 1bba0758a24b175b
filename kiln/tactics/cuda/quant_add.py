"""CUDA tactics for kiln::QAdd (kiln/ops/quantized.py): the residual Add between quantized tensors.

    cuda.qadd.triton   one Triton pass: two 8-bit reads (any strides, numpy broadcasting, rank <= 4), the
                       sum in fp32, Relu/Clip, requantization (or float out) and one 8-bit write, in a's layout
    cuda.qadd.torch    the same arithmetic in torch ops (several passes; any rank)

Scales and zero points are constants read at prepare: a launch reads nothing on the host.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kiln.plan.spec import StepSpec
from kiln.tactics.cuda.quant_common import ACTIVATIONS, FLOAT_OUTPUTS, QUANTIZED, kernels, name_of, triton_available
from kiln.tactics.registry import register
from kiln.tactics.tactic import InputMeta, Tactic
from kiln.tactics.tactic import attribute as _attr
from kiln.tactics.tactic import tensor_input as _input

_FP8 = torch.float8_e4m3fn
_INT_RANGE = {torch.int8: (-128, 127), torch.uint8: (0, 255)}


def _supports(step: StepSpec, inputs: list[InputMeta], max_rank: int | None) -> bool | str:
    for i, name in ((1, "a_scale"), (2, "a_zero_point"), (4, "b_scale"), (5, "b_zero_point")):
        if i >= len(inputs) or inputs[i].shape is None or not inputs[i].constant:
            return f"{name} is not a constant of the engine"
    a, b = inputs[0], _input(inputs, 3)
    if b is None or b.dtype not in QUANTIZED:
        return f"b is {name_of(None if b is None else b.dtype)}, not int8/uint8/float8e4m3fn"
    for q, zero, name in ((a, inputs[2], "a"), (b, inputs[5], "b")):
        if zero.dtype != q.dtype:
            return f"{name}'s zero point is {name_of(zero.dtype)}, {name} is {name_of(q.dtype)}"
    if any(math.prod(inputs[i].shape) != 1 for i in (1, 2, 4, 5)):
        return "a or b is not quantized per tensor"
    y_scale, y_zero = _input(inputs, 6), _input(inputs, 7)
    if y_scale is not None:
        if not y_scale.constant or y_zero is None or not y_zero.constant or y_zero.dtype not in QUANTIZED:
            return "the output scale and zero point are not int8/uint8/float8e4m3fn constants of the engine"
    elif int(_attr(step, "output_dtype", 1) or 1) not in FLOAT_OUTPUTS:
        return "a float output other than float32/float16/bfloat16"
    if _attr(step, "activation", "") not in ACTIVATIONS:
        return f"activation {_attr(step, 'activation', '')!r}"
    try:
        shape = torch.broadcast_shapes(a.shape, b.shape)
    except RuntimeError:
        return f"a {list(a.shape)} and b {list(b.shape)} do not broadcast"
    if max_rank is not None and len(shape) > max_rank:
        return f"rank {len(shape)}: the kernel walks at most {max_rank} dims"
    return True


def _parameters(step: StepSpec, constants: list[Any]) -> dict[str, Any]:
    """The layer's constants as host numbers, and its output dtype."""
    def number(t: torch.Tensor) -> float:
        return float(t.reshape(-1)[0].to(torch.float32))

    a_scale, a_zero, _, b_scale, b_zero = constants[1:6]
    y_scale = constants[6] if len(constants) > 6 else None
    y_zero = constants[7] if len(constants) > 7 else None
    out = y_zero.dtype if y_scale is not None else FLOAT_OUTPUTS[int(_attr(step, "output_dtype", 1) or 1)]
    return {"a_scale": number(a_scale), "a_zero": number(a_zero), "b_scale": number(b_scale),
            "b_zero": number(b_zero), "out_dtype": out, "y_scale": 1.0 if y_scale is None else number(y_scale),
            "y_zero": 0.0 if y_zero is None else number(y_zero), "activation": _attr(step, "activation", ""),
            "alpha": float(_attr(step, "alpha", 0.0)), "beta": float(_attr(step, "beta", 0.0))}


def _prepare_triton(step: StepSpec, constants: list[Any], device: torch.device):
    qadd = kernels("qelementwise").qadd
    p = _parameters(step, constants)

    def launch(ctx, a, a_s, a_z, b, *_inputs, **_attributes):
        return qadd(a, p["a_scale"], p["a_zero"], b, p["b_scale"], p["b_zero"], out_dtype=p["out_dtype"],
                    y_scale=p["y_scale"], y_zero=p["y_zero"], activation=p["activation"], alpha=p["alpha"],
                    beta=p["beta"])

    return launch


register(Tactic(
    name="cuda.qadd.triton", op_type="QAdd", domain="kiln", device="cuda", dtypes=QUANTIZED,
    supports=lambda step, inputs: _supports(step, inputs, 4), prepare=_prepare_triton, available=triton_available,
    description="quantized Add in one Triton pass (two 8-bit reads, fp32 sum, Relu/Clip, requantization, one write)",
))


def _prepare_torch(step: StepSpec, constants: list[Any], device: torch.device):
    p = _parameters(step, constants)
    out, activation = p["out_dtype"], p["activation"]

    def launch(ctx, a, a_s, a_z, b, *_inputs, **_attributes):
        r = (a.to(torch.float32) - p["a_zero"]).mul_(p["a_scale"])  # a's layout
        rb = (b.to(torch.float32) - p["b_zero"]).mul_(p["b_scale"])
        r = r.add_(rb) if torch.broadcast_shapes(r.shape, rb.shape) == r.shape else r + rb
        if activation == "Relu":
            r.relu_()
        elif activation == "Clip":
            r.clamp_(p["alpha"], p["beta"])
        if out in _INT_RANGE:
            low, high = _INT_RANGE[out]
            return r.div_(p["y_scale"]).round_().add_(p["y_zero"]).clamp_(low, high).to(out)  # half to even
        if out == _FP8:
            return r.div_(p["y_scale"]).clamp_(-448.0, 448.0).to(out)  # saturate, then round to nearest even
        return r.to(out)

    return launch


register(Tactic(
    name="cuda.qadd.torch", op_type="QAdd", domain="kiln", device="cuda", dtypes=QUANTIZED,
    supports=lambda step, inputs: _supports(step, inputs, None), prepare=_prepare_torch,
    description="quantized Add in fp32 torch ops (dequantize both, add, Relu/Clip, requantize)",
))
