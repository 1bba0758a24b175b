"""How a QGemm with its product quantized (kiln/ops/quantized.py inputs 9-11; kiln/passes/fusion/qgemm_epilogue.py)
is judged: by the tolerance of the unfused pair it replaces, a QGemm writing E4M3 then the Elementwise chain
reading it, as quant_residual_check.py judges a QConv with its residual add.

The unfused QGemm was allowed its E4M3 product p one step from the reference's (a float32 epilogue rounds a
near-tie either way; FP8 sums move more than ties, hence the builder's slack near zero); the chain then computes
r(p) = act(s_p·p + b)·m exactly. A fused kernel may do that composition, per element:

    p anywhere in [p⁻, p⁺]   its E4M3 neighbours, widened by FLOAT8_SLACK·max|p| (the builder's FP8 slack)
    r over that interval     from r(p⁻), r(p), r(p⁺): act is monotone (Relu) or, for Gelu, has one minimum,
                             x0 = -0.7518 (taken when s_p·p + b crosses it); m may be negative
    an E4M3 output           within [q(r_low), q(r_high)], widened by one step and the slack
    a float output           within [r_low, r_high], widened by half-precision rounding (2^-9 of the value) and
                             FLOAT8_SLACK of the largest |r| (fp16 tensor-core sums, the Gelu's tanh form)

A wrong scale, bias or multiplier is off by far more. One E4M3 step of p is 1/16-1/8 of p: a uniform fp16
tolerance on the float output would refuse every kernel whose sums differ from the reference's near a tie.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kiln.ops.fused import _activate_
from kiln.ops.quantization import quantize_linear
from kiln.tactics.cuda.quant_residual_check import FLOAT8_SLACK, _number, _shape_problem, e4m3_at, ordinal
from kiln.tactics.tactic import Launch

FP8 = torch.float8_e4m3fn
GELU_MINIMUM_AT = -0.7517915  # argmin of x·Φ(x)
HALF_ROUNDING = 2.0**-9


def product_bounds(reference: Launch, ctx, args: list[Any], attributes: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    """(lowest, highest) real value (float64) each output's chain may take with p within a step, and the
    reference's output."""
    product_scale, product_zero = args[9], args[10]
    bias = args[11] if len(args) > 11 else None
    alone = {**attributes, "activation": "", "alpha": 0.0, "beta": 0.0, "multiplier": 1.0}
    with torch.inference_mode():
        want = reference(ctx, *args, **attributes)
        p = reference(ctx, *args[:6], product_scale, product_zero, args[8], **alone)  # the GEMM's own E4M3 result
    p_real = p.double()
    slack = FLOAT8_SLACK * float(p_real.abs().max()) if p.numel() else 0.0
    p_low = torch.minimum(e4m3_at(ordinal(p) - 1), p_real - slack)
    p_high = torch.maximum(e4m3_at(ordinal(p) + 1), p_real + slack)
    scale = _number(product_scale)
    b = 0.0 if bias is None else bias.double()
    activation = attributes.get("activation", "")
    multiplier = float(attributes.get("multiplier", 1.0))

    def chain(pre: torch.Tensor) -> torch.Tensor:
        return _activate_(pre.clone(), activation, float(attributes.get("alpha", 0.0)),
                          float(attributes.get("beta", 0.0))) * multiplier

    pre_low, pre_mid, pre_high = p_low * scale + b, p_real * scale + b, p_high * scale + b
    ends = torch.stack([chain(pre_low), chain(pre_mid), chain(pre_high)])
    low, high = ends.min(dim=0).values, ends.max(dim=0).values
    if activation in ("Gelu", "GeluTanh"):  # the one minimum inside [pre_low, pre_high]
        bottom = chain(torch.full((), GELU_MINIMUM_AT, dtype=torch.float64))
        inside = (pre_low <= GELU_MINIMUM_AT) & (pre_high >= GELU_MINIMUM_AT)
        low = torch.where(inside, torch.minimum(low, bottom), low)
        high = torch.where(inside, torch.maximum(high, bottom), high)
    return low, high, want


def _quantized_check(ctx, args: list[Any], low: torch.Tensor, high: torch.Tensor,
                     want: torch.Tensor) -> Callable[[Any], str | None]:
    y_scale, y_zero = args[6], args[7]
    y_low, y_high = quantize_linear(ctx, low.float(), y_scale, y_zero), quantize_linear(ctx, high.float(), y_scale,
                                                                                        y_zero)
    slack = FLOAT8_SLACK * float(want.double().abs().max()) if want.numel() else 0.0
    lowest, highest = ordinal(y_low) - 1, ordinal(y_high) + 1
    low_value, high_value = y_low.double() - slack, y_high.double() + slack

    def check(result: Any) -> str | None:
        problem = _shape_problem(result, want)
        if problem:
            return problem
        result = result.to(want.device)
        got, value = ordinal(result), result.double()
        inside = ((got >= lowest) & (got <= highest)) | ((value >= low_value) & (value <= high_value))
        if bool(inside.all()):
            return None
        return f"{int((~inside).sum())} outputs beyond the unfused pair's E4M3 bound (the product within a step, " \
               f"the chain's quantization within a step), up to {float((value - want.double()).abs().max()):.3g} off"
    return check


def _float_check(low: torch.Tensor, high: torch.Tensor, want: torch.Tensor) -> Callable[[Any], str | None]:
    slack = FLOAT8_SLACK * float(torch.maximum(low.abs(), high.abs()).max()) if want.numel() else 0.0
    low = low - HALF_ROUNDING * low.abs() - slack
    high = high + HALF_ROUNDING * high.abs() + slack

    def check(result: Any) -> str | None:
        problem = _shape_problem(result, want)
        if problem:
            return problem
        value = result.to(want.device).double()
        inside = (value >= low) & (value <= high)
        if bool(inside.all()):
            return None
        return f"{int((~inside).sum())} outputs beyond the unfused pair's bound (the product within an E4M3 step, " \
               f"the chain in float), up to {float((value - want.double()).abs().max()):.3g} off"
    return check


def product_layer_checker(reference: Launch, ctx, args: list[Any],
                          attributes: dict[str, Any]) -> Callable[[Any], str | None] | None:
    """Tactic.checker of the CUDA QGemm tactics: a QGemm whose product is quantized judged by its unfused pair's
    tolerance (module docstring); None for any other QGemm (the builder's check)."""
    if len(args) <= 10 or args[9] is None:
        return None
    low, high, want = product_bounds(reference, ctx, args, attributes)
    if args[6] is not None:
        return _quantized_check(ctx, args, low, high, want)
    return _float_check(low, high, want)
