"""How a QConv with its residual add fused (kiln/passes/fusion/qdq_residual.py) is judged: by the tolerance of the
unfused pair it replaces (the contract decided for issue 12), not by the one step of a single rounding.

The unfused pair is QConv -> QAdd, each judged alone by the builder's check (kiln/builder/accuracy.py): the
convolution's own 8-bit result c within one step of the reference's (a float32 epilogue rounds a near-tie
either way; an FP8 kernel's fp32 sums move more than ties), and the sum within one step of what the add makes of
the c it is given. A fused kernel is allowed exactly that composition:

    INT8 (int8/uint8 sum):  |y − y_ref| <= ceil(s_c / s_y) + 1 steps of the sum
                            (one step of c is s_c / s_y steps of the sum before its own rounding, and the add's
                            rounding one more; Relu and saturation shrink differences, never grow them)
    FP8 (E4M3 sum):         per element, from the two roundings: c anywhere in [c⁻, c⁺] (its E4M3 neighbours,
                            widened by the builder's FP8 slack near zero), r(c) = act(s_c·c + s_r·(res − z_r))
                            is monotone in c, so y lies in [q(r(c⁻)), q(r(c⁺))], widened by the add's one E4M3
                            step (and its slack) on each side

The FP8 bound has to be per element: one step of c is 1/16-1/8 of c, and where the residual cancels c the sum is
small, so that step is up to ~100 steps of the sum's grid (bench/fp8_residual_rounding.py, measured on the
H200: bench/results/quant-gpu-2026-12-04.md); a uniform step count that allowed that everywhere would pass a
wrong kernel. A wrong scale or a missing term is off by far more than either bound.

Tactic.checker's protocol: a layer without a residual gets None here, and the builder's own check judges it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from kiln.ops.fused import _activate_
from kiln.ops.quantization import quantize_linear
from kiln.tactics.tactic import Launch

FP8 = torch.float8_e4m3fn
# What the builder's check lets an FP8 output be off near zero beyond its steps, as a share of the tensor's largest
# |value| (kiln/builder/accuracy.py FLOAT8_HALF_SLACK: the same number, which this layer cannot import from above)
FLOAT8_SLACK = 2.0**-10
_E4M3_LARGEST = 126  # the ordinal of 448 (127 is NaN)


def ordinal(x: torch.Tensor) -> torch.Tensor:
    """Each E4M3 value's position on its grid (int64): neighbours differ by one, ±0 are both 0."""
    bits = x.view(torch.uint8).to(torch.int64)
    magnitude = bits & 0x7F
    return torch.where(bits >= 0x80, -magnitude, magnitude)


def e4m3_at(ordinals: torch.Tensor) -> torch.Tensor:
    """The E4M3 values (float64) at `ordinals`, saturated to ±448 (on their device)."""
    o = ordinals.clamp(-_E4M3_LARGEST, _E4M3_LARGEST)
    bits = torch.where(o < 0, 0x80 | (-o), o).to(torch.uint8)
    return bits.view(FP8).double()


def residual_steps(conv_scale: float, y_scale: float) -> int:
    """INT8: how many steps of the sum a fused residual layer may be from the reference (module docstring)."""
    return math.ceil(conv_scale / y_scale) + 1


def _number(t: torch.Tensor) -> float:
    return float(t.reshape(-1)[0].to(torch.float32))


def _shape_problem(result: Any, want: torch.Tensor) -> str | None:
    if not isinstance(result, torch.Tensor) or result.shape != want.shape or result.dtype != want.dtype:
        given = f"{result.dtype}{list(result.shape)}" if isinstance(result, torch.Tensor) else type(result).__name__
        return f"gave {given}, the reference {want.dtype}{list(want.shape)}"
    return None


def _integer_check(want: torch.Tensor, steps: int) -> Callable[[Any], str | None]:
    def check(result: Any) -> str | None:
        problem = _shape_problem(result, want)
        if problem:
            return problem
        off = int((result.to(want.device, torch.int32) - want.to(torch.int32)).abs().max()) if want.numel() else 0
        return None if off <= steps else \
            f"the sum is up to {off} steps from the reference; the unfused pair's tolerance is {steps} " \
            "(ceil(conv_scale / y_scale) + 1)"
    return check


def fp8_bounds(reference: Launch, ctx, args: list[Any], attributes: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    """(lowest, highest) E4M3 ordinal and (lowest, highest) real value (float64) each output of the fused FP8
    layer may take (module docstring), and the reference's output; on the layer's device (ResNet-50's residual
    layers at batch 256 have 2·10^8 outputs: a CPU pass over them takes seconds)."""
    y_scale, y_zero = args[6], args[7]
    residual, r_scale, r_zero, c_scale, c_zero = args[9:14]
    alone = {**attributes, "activation": "", "alpha": 0.0, "beta": 0.0}
    with torch.inference_mode():
        want = reference(ctx, *args, **attributes)
        c = reference(ctx, *args[:6], c_scale, c_zero, args[8], **alone)  # the convolution's own E4M3 result
    c_real = c.double() - _number(c_zero)
    c_slack = FLOAT8_SLACK * float(c_real.abs().max()) if c.numel() else 0.0
    c_low = torch.minimum(e4m3_at(ordinal(c) - 1), c_real - c_slack)
    c_high = torch.maximum(e4m3_at(ordinal(c) + 1), c_real + c_slack)
    term = (residual.double() - _number(r_zero)) * _number(r_scale)  # the residual's real value

    def quantized(c_value: torch.Tensor) -> torch.Tensor:
        r = _activate_(c_value * _number(c_scale) + term, attributes.get("activation", ""),
                       float(attributes.get("alpha", 0.0)), float(attributes.get("beta", 0.0)))
        return quantize_linear(ctx, r.float(), y_scale, y_zero)  # monotone in r: the bounds' ends

    y_low, y_high = quantized(c_low), quantized(c_high)
    y_slack = FLOAT8_SLACK * float(want.double().abs().max()) if want.numel() else 0.0
    return (ordinal(y_low) - 1, (ordinal(y_high) + 1).clamp_max(_E4M3_LARGEST), y_low.double() - y_slack,
            y_high.double() + y_slack, want)


def _fp8_check(reference: Launch, ctx, args: list[Any], attributes: dict[str, Any]) -> Callable[[Any], str | None]:
    low, high, low_value, high_value, want = fp8_bounds(reference, ctx, args, attributes)

    def check(result: Any) -> str | None:
        problem = _shape_problem(result, want)
        if problem:
            return problem
        result = result.to(want.device)
        got = ordinal(result)
        value = result.double()
        inside = ((got >= low) & (got <= high)) | ((value >= low_value) & (value <= high_value))
        if not torch.equal(torch.isnan(value), torch.isnan(want.double())):
            return "NaNs differ from the reference"
        if bool(inside.all()):
            return None
        beyond = torch.maximum(low - got, got - high).clamp_min(0)[~inside]
        return f"{int((~inside).sum())} outputs beyond the unfused pair's E4M3 bound (c within a step, the sum " \
               f"within a step), up to {int(beyond.max())} steps"
    return check


def residual_layer_checker(reference: Launch, ctx, args: list[Any],
                           attributes: dict[str, Any]) -> Callable[[Any], str | None] | None:
    """Tactic.checker of the CUDA QConv tactics: a fused residual layer judged by its unfused pair's tolerance
    (module docstring); None for a layer without a residual (the builder's check)."""
    if len(args) <= 13 or args[9] is None or args[6] is None:
        return None
    if args[7].dtype == FP8:
        return _fp8_check(reference, ctx, args, attributes)
    with torch.inference_mode():
        want = reference(ctx, *args, **attributes)
    return _integer_check(want, residual_steps(_number(args[12]), _number(args[6])))
