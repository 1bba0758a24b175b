"""CUDA tactic for kiln::LayerNormQuantize (kiln/passes/fusion/layernorm_quantize.py): the LayerNorm in front of
an FP8/INT8 GEMM writes the 8-bit tensor itself.

    cuda.layer_norm_quantize.triton   one row per program in registers (kiln/kernels/cuda/triton/qnorm.py):
                                      residual add, fp32 statistics, γ/β, y rounded to its dtype (written
                                      when the op has 2 outputs), then y / y_scale rounded and saturated
    cuda.layer_norm_quantize.triton.rows<R>w<W>   the same kernel over R rows per program (γ, β read once for
                                      them), W warps: fewer, larger programs, timed against the one-row form

y_scale and the zero point are constants read at prepare: a launch does no host work but allocation.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch

from kiln.plan.spec import StepSpec
from kiln.tactics.cuda.quant_common import FP8, QUANTIZED, kernels, name_of, triton_available
from kiln.tactics.registry import register
from kiln.tactics.tactic import InputMeta, Tactic
from kiln.tactics.tactic import attribute as _attr
from kiln.tactics.tactic import tensor_input as _input

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_MAX_ROW = 8192  # qnorm.fits: the row is held in registers


def _supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    x = inputs[0]
    if not x.shape:
        return "x is a scalar"
    if int(_attr(step, "axis", -1)) not in (-1, len(x.shape) - 1):
        return f"axis {_attr(step, 'axis', -1)}: the kernel normalises the last axis"
    if x.shape[-1] > _MAX_ROW:
        return f"rows of {x.shape[-1]} elements: the kernel holds at most {_MAX_ROW} in registers"
    for i, name in ((1, "scale"), (2, "bias")):
        p = _input(inputs, i)
        if p is not None and (p.dtype != x.dtype or math.prod(p.shape) != x.shape[-1]):
            return f"the {name} is not {x.shape[-1]} values of x's dtype"
    residual, residual_scale = _input(inputs, 3), _input(inputs, 6)
    residual_dtype = FP8 if residual_scale is not None else x.dtype  # an E4M3 residual with its scale
    if residual is not None and (not kernels("qnorm").residual_broadcasts(residual.shape, x.shape)
                                 or residual.dtype != residual_dtype):
        return f"the residual {name_of(residual.dtype)}{list(residual.shape)} is not x's {list(x.shape)} (or its " \
               f"trailing dims) in {name_of(residual_dtype)}"
    if residual_scale is not None and (residual is None or not residual_scale.constant
                                       or math.prod(residual_scale.shape) != 1):
        return "the residual's scale is not a per-tensor constant of the engine (or there is no residual)"
    y_scale, y_zero = _input(inputs, 4), _input(inputs, 5)
    if y_scale is None or y_zero is None or not y_scale.constant or not y_zero.constant:
        return "the output scale and zero point are not constants of the engine"
    if math.prod(y_scale.shape) != 1 or math.prod(y_zero.shape) != 1:
        return "the output is not quantized per tensor"
    if y_zero.dtype not in QUANTIZED:
        return f"output type {name_of(y_zero.dtype)}: the kernel writes int8, uint8 or float8e4m3fn"
    return True


def _number(t: torch.Tensor) -> float:
    return float(t.reshape(-1)[0].to(torch.float32))


def _prepare(step: StepSpec, constants: list[Any], device: torch.device, rows: int = 0, num_warps: int = 0):
    qnorm = kernels("qnorm")
    epsilon = float(_attr(step, "epsilon", 1e-5))
    y_scale, y_zero = _number(constants[4]), _number(constants[5])
    out = constants[5].dtype
    residual_scale = _number(constants[6]) if len(constants) > 6 and constants[6] is not None else None
    config = qnorm.RowsConfig(rows, num_warps) if rows else None

    def launch(ctx, x, scale=None, bias=None, residual=None, *_quantization, **_attributes):
        q, y = qnorm.layer_norm_quantize(x, scale, bias, epsilon, y_scale, y_zero, out, residual=residual,
                                         residual_scale=residual_scale, write_y=ctx.num_outputs == 2, config=config)
        return (q, y) if y is not None else q

    return launch


_DESCRIPTION = ("(x + residual) -> LayerNorm -> per-tensor quantization in one pass over the row, the float y "
                "written too when something else reads it")
register(Tactic(
    name="cuda.layer_norm_quantize.triton", op_type="LayerNormQuantize", domain="kiln", device="cuda",
    dtypes=_FLOATS, supports=_supports, prepare=_prepare, available=triton_available, description=_DESCRIPTION,
))
for _rows, _warps in ((2, 4), (4, 8)):
    register(Tactic(
        name=f"cuda.layer_norm_quantize.triton.rows{_rows}w{_warps}", op_type="LayerNormQuantize", domain="kiln",
        device="cuda", dtypes=_FLOATS, supports=_supports, prepare=partial(_prepare, rows=_rows, num_warps=_warps),
        available=triton_available, description=f"{_DESCRIPTION}; {_rows} rows per program, {_warps} warps",
    ))
