"""Quantization: QuantizeLinear, DequantizeLinear, DynamicQuantizeLinear, MatMulInteger,
QLinearMatMul, QLinearConv.

int8/uint8/int16 stay torch tensors end to end (the hot path); types torch cannot do
arithmetic on or cannot hold (uint16, int4/uint4, int2/uint2, float4) go through numpy and
ml_dtypes. Integer products run in float64, which is exact for 8/16-bit operands summed
below 2**53 and runs on every device (torch has no integer matmul/conv on CUDA).
"""

from __future__ import annotations

import numpy as np
import torch

from kiln.ir import dtypes
from kiln.ops._util import from_numpy, norm_axis
from kiln.ops.nn import _conv, _conv_params
from kiln.ops.registry import register

_INT_RANGES = {
    "int8": (-128, 127), "uint8": (0, 255), "int16": (-32768, 32767), "uint16": (0, 65535),
    "int4": (-8, 7), "uint4": (0, 15), "int2": (-2, 1), "uint2": (0, 3),
}
_TORCH_INT = {"int8": torch.int8, "uint8": torch.uint8, "int16": torch.int16}
_FLOAT8_MAX = {"float8e4m3fn": 448.0, "float8e4m3fnuz": 240.0,
               "float8e5m2": 57344.0, "float8e5m2fnuz": 57344.0}


def _dtype_of(value) -> dtypes.DType:
    if isinstance(value, torch.Tensor):
        return dtypes.from_torch(value.dtype)
    return dtypes.from_numpy(np.asarray(value).dtype)


def _as_float(value, like: torch.Tensor | None, dtype=torch.float32) -> torch.Tensor:
    """Any quantized/float value (torch, or numpy for sub-byte types) as a float torch tensor."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype)
    t = torch.from_numpy(np.asarray(value).astype(np.float64)).to(dtype)
    return t.to(like.device) if like is not None else t


def _param(p: torch.Tensor, x_rank: int, x_shape, axis: int, block_size: int) -> torch.Tensor:
    """Scale/zero point broadcast against x: per tensor, per axis (1-D) or blocked along axis."""
    if p.dim() == 0 or (p.numel() == 1 and not block_size):
        return p.reshape(())
    axis = norm_axis(axis, x_rank)
    if block_size:
        return p.repeat_interleave(block_size, dim=axis).narrow(axis, 0, x_shape[axis])
    shape = [1] * x_rank
    shape[axis] = -1
    return p.reshape(shape)


@register("QuantizeLinear")
def quantize_linear(ctx, x, y_scale, y_zero_point=None, *, axis=1, block_size=0, output_dtype=0,
                    precision=0, saturate=1):
    if y_zero_point is not None:
        target = _dtype_of(y_zero_point)
    elif output_dtype:
        target = dtypes.from_onnx(output_dtype)
    else:
        target = dtypes.BY_NAME["uint8"]
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    scale = _param(_as_float(y_scale, x, compute), x.dim(), x.shape, axis, block_size)
    y = x.to(compute) / scale
    zp = None
    if y_zero_point is not None:
        zp = _param(_as_float(y_zero_point, x, compute), x.dim(), x.shape, axis, block_size)
    if target.name in _INT_RANGES:
        lo, hi = _INT_RANGES[target.name]
        q = torch.round(y)  # round half to even, as ONNX specifies
        if zp is not None:
            q = q + zp
        q = q.clamp(lo, hi)
        if target.name in _TORCH_INT:
            return q.to(_TORCH_INT[target.name])
        return from_numpy(q.cpu().numpy().astype(np.int32).astype(target.numpy), like=x)
    if target.name in _FLOAT8_MAX:
        if saturate:
            limit = _FLOAT8_MAX[target.name]
            y = torch.where(torch.isnan(y), y, y.clamp(-limit, limit))
        if target.torch is not None:
            return y.to(target.torch)
        return from_numpy(y.cpu().numpy().astype(target.numpy), like=x)
    if target.name == "float4e2m1":
        if zp is not None:
            y = y + zp
        return y.cpu().numpy().astype(target.numpy)  # ml_dtypes saturates (no inf/nan codes)
    raise NotImplementedError(f"QuantizeLinear {ctx.name!r}: output type {target.name} is not supported")


@register("DequantizeLinear")
def dequantize_linear(ctx, x, x_scale, x_zero_point=None, *, axis=1, block_size=0, output_dtype=0):
    like = x_scale if isinstance(x_scale, torch.Tensor) else None
    if output_dtype:
        out = dtypes.from_onnx(output_dtype).torch
    else:
        out = x_scale.dtype
    compute = torch.float64 if out == torch.float64 else torch.float32
    shape = tuple(x.shape)
    rank = len(shape)
    y = _as_float(x, like, compute)
    if x_zero_point is not None:
        y = y - _param(_as_float(x_zero_point, like, compute), rank, shape, axis, block_size)
    scale = _param(_as_float(x_scale, like, compute), rank, shape, axis, block_size)
    return (y * scale).to(out)


@register("DynamicQuantizeLinear")
def dynamic_quantize_linear(ctx, x):
    """uint8 asymmetric quantization with a range that always contains 0."""
    lo = torch.clamp(x.min(), max=0.0)
    hi = torch.clamp(x.max(), min=0.0)
    scale = ((hi - lo) / 255.0).to(torch.float32)
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    zp = torch.round(-lo / safe).clamp(0, 255)
    y = (torch.round(x / safe) + zp).clamp(0, 255)
    return y.to(torch.uint8), scale, zp.to(torch.uint8)


def _shifted(v: torch.Tensor, zp, axis_shape=None) -> torch.Tensor:
    out = v.to(torch.float64)
    if zp is not None:
        z = zp.to(torch.float64)
        if axis_shape is not None and z.numel() > 1:
            z = z.reshape(axis_shape)
        out = out - z
    return out


@register("MatMulInteger")
def matmul_integer(ctx, a, b, a_zero_point=None, b_zero_point=None):
    # a_zero_point may be per row of a ([M]), b_zero_point per column of b ([N]).
    af = _shifted(a, a_zero_point, (-1, 1))
    bf = _shifted(b, b_zero_point, (1, -1))
    return torch.matmul(af, bf).round().to(torch.int32)


def _requantize(acc: torch.Tensor, multiplier: torch.Tensor, y_zero_point, like_dtype):
    """int32-valued accumulator * (s_in * s_w / s_out) + zero point, rounded and saturated."""
    y = acc * multiplier.to(torch.float64)
    out = y_zero_point.dtype if y_zero_point is not None else like_dtype
    if y_zero_point is not None:
        y = y + y_zero_point.to(torch.float64)
    lo, hi = _INT_RANGES[dtypes.from_torch(out).name]
    return torch.round(y).clamp(lo, hi).to(out)


@register("QLinearMatMul")
def qlinear_matmul(ctx, a, a_scale, a_zero_point, b, b_scale, b_zero_point, y_scale, y_zero_point):
    acc = torch.matmul(_shifted(a, a_zero_point, (-1, 1)), _shifted(b, b_zero_point, (1, -1)))
    # The scale ratio is formed in the scales' own dtype, as the ONNX reference does.
    multiplier = a_scale * b_scale / y_scale
    return _requantize(acc, multiplier, y_zero_point, a.dtype)


@register("QLinearConv")
def qlinear_conv(ctx, x, x_scale, x_zero_point, w, w_scale, w_zero_point, y_scale, y_zero_point,
                 b=None, *, auto_pad="NOTSET", dilations=None, group=1, kernel_shape=None,
                 pads=None, strides=None):
    n = x.dim() - 2
    xf = _shifted(x, x_zero_point)
    wf = _shifted(w, w_zero_point, (-1, *[1] * (w.dim() - 1)))
    kernel = list(kernel_shape) if kernel_shape else list(w.shape[2:])
    strides, dilations, pads = _conv_params(x, kernel, auto_pad, dilations, pads, strides)
    acc = _conv(xf, wf, None if b is None else b.to(torch.float64), strides, dilations, pads, group)
    multiplier = x_scale * w_scale / y_scale
    if multiplier.numel() > 1:  # per output channel
        multiplier = multiplier.reshape(1, -1, *[1] * n)
    return _requantize(acc, multiplier, y_zero_point, x.dtype)
