"""Normalisations: BatchNormalization, InstanceNormalization, LayerNormalization,
GroupNormalization, RMSNormalization, LRN, LpNormalization, MeanVarianceNormalization.

Statistics are computed in fp32 for fp16/bf16 inputs (`stash_type` where the op has it;
float64 stays float64) and the result is cast back to the input's dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kiln.ops._util import norm_axis, torch_dtype
from kiln.ops.reduction import accumulation_dtype
from kiln.ops.registry import register


def _channel_shape(x: torch.Tensor) -> list[int]:
    """Shape that broadcasts a per-channel [C] vector over x: [C, 1, 1, ...] (rank-1 aligned)."""
    return [-1] + [1] * (x.dim() - 2)


def _stash_dtype(x: torch.Tensor, stash_type: int) -> torch.dtype:
    """Compute dtype of the statistics: stash_type (1 = float), never below the input's."""
    stash = torch_dtype(stash_type) or torch.float32
    if x.dtype == torch.float64 or not stash.is_floating_point:
        return x.dtype
    return stash


# --- BatchNormalization -----------------------------------------------------------------


@register("BatchNormalization")
def batch_normalization(ctx, x, scale, bias, input_mean, input_var, *,
                        epsilon=1e-5, momentum=0.9, training_mode=0, spatial=1, is_test=0,
                        consumed_inputs=None):
    """y = scale · (x − μ) / √(σ² + ε) + bias, per channel (axis 1).

    In training mode (opset 14+: `training_mode=1`; before, a node asking for the
    running statistics as outputs) μ, σ² are the batch's population statistics and
    running = input · momentum + batch · (1 − momentum).
    """
    acc = accumulation_dtype(x.dtype)
    xf = x.to(acc)
    training = bool(training_mode) if ctx.opset >= 14 else (ctx.num_outputs > 1 and not is_test)
    reduce_dims = [d for d in range(xf.dim()) if d != 1]
    if training:
        mean = xf.mean(dim=reduce_dims)
        var = xf.var(dim=reduce_dims, unbiased=False)
    else:
        mean, var = input_mean.to(acc), input_var.to(acc)
    shape = _channel_shape(xf)
    y = (xf - mean.reshape(shape)) / torch.sqrt(var.reshape(shape) + epsilon)
    y = (y * scale.to(acc).reshape(shape) + bias.to(acc).reshape(shape)).to(x.dtype)
    if not training or ctx.num_outputs == 1:
        return y
    stat_dtype = input_mean.dtype
    running_mean = (input_mean.to(acc) * momentum + mean * (1 - momentum)).to(stat_dtype)
    running_var = (input_var.to(acc) * momentum + var * (1 - momentum)).to(stat_dtype)
    outputs = (y, running_mean, running_var)
    if ctx.opset < 14:  # opsets 9..13 add saved_mean and saved_var
        outputs += (mean.to(stat_dtype), var.to(stat_dtype))
    return outputs[: ctx.num_outputs]


# --- Instance / Group normalisation -----------------------------------------------------


def _normalize_groups(x: torch.Tensor, num_groups: int, epsilon: float, dtype: torch.dtype) -> torch.Tensor:
    """(x − μ) / √(σ² + ε) with μ, σ² per (instance, group of channels); x: [N, C, ...]."""
    n = x.shape[0]
    grouped = x.to(dtype).reshape(n, num_groups, -1)  # [N, G, C/G · spatial]
    mean = grouped.mean(dim=-1, keepdim=True)
    var = grouped.var(dim=-1, unbiased=False, keepdim=True)
    return ((grouped - mean) / torch.sqrt(var + epsilon)).reshape(x.shape)


@register("InstanceNormalization")
def instance_normalization(ctx, x, scale, bias, *, epsilon=1e-5):
    acc = accumulation_dtype(x.dtype)
    y = _normalize_groups(x, x.shape[1], epsilon, acc)
    shape = _channel_shape(x)
    return (y * scale.to(acc).reshape(shape) + bias.to(acc).reshape(shape)).to(x.dtype)


@register("GroupNormalization")
def group_normalization(ctx, x, scale, bias, *, num_groups, epsilon=1e-5, stash_type=1):
    """Opset 18 takes scale/bias per group ([G]); opset 21 per channel ([C])."""
    channels = x.shape[1]
    y = _normalize_groups(x, num_groups, epsilon, _stash_dtype(x, stash_type))
    if ctx.opset >= 21:
        y = y.to(x.dtype)  # stage two (scale, shift) runs in the input type
    acc = y.dtype
    scale, bias = scale.to(acc), bias.to(acc)
    if ctx.opset < 21 and scale.numel() == num_groups and channels != num_groups:
        per_group = channels // num_groups
        scale = scale.repeat_interleave(per_group)
        bias = bias.repeat_interleave(per_group)
    shape = _channel_shape(x)
    return (y * scale.reshape(shape) + bias.reshape(shape)).to(x.dtype)


# --- Layer / RMS normalisation ----------------------------------------------------------


@register("LayerNormalization")
def layer_normalization(ctx, x, scale, bias=None, *, axis=-1, epsilon=1e-5, stash_type=1):
    """Normalise over dims [axis, rank); Mean and InvStdDev keep those dims as 1."""
    axis = norm_axis(axis, x.dim())
    dims = list(range(axis, x.dim()))
    normalized = tuple(x.shape[axis:])
    if (ctx.num_outputs == 1 and stash_type == 1 and x.is_floating_point()
            and tuple(scale.shape) == normalized and (bias is None or tuple(bias.shape) == normalized)
            and scale.dtype == x.dtype and (bias is None or bias.dtype == x.dtype)):
        # torch's fused kernel: one pass, fp32 accumulation for half inputs.
        return F.layer_norm(x, normalized, scale, bias, epsilon)
    dtype = _stash_dtype(x, stash_type)
    xf = x.to(dtype)
    mean = xf.mean(dim=dims, keepdim=True)
    var = ((xf - mean) ** 2).mean(dim=dims, keepdim=True)
    inv_std = torch.rsqrt(var + epsilon)
    y = ((xf - mean) * inv_std).to(x.dtype)
    y = y * scale
    if bias is not None:
        y = y + bias
    if ctx.num_outputs == 1:
        return y
    return (y, mean, inv_std)[: ctx.num_outputs]


@register("RMSNormalization")
def rms_normalization(ctx, x, scale, *, axis=-1, epsilon=1e-5, stash_type=1):
    """y = x / √(mean(x², dims [axis, rank)) + ε) · scale."""
    axis = norm_axis(axis, x.dim())
    dims = list(range(axis, x.dim()))
    xf = x.to(_stash_dtype(x, stash_type))
    y = xf * torch.rsqrt((xf * xf).mean(dim=dims, keepdim=True) + epsilon)
    return y.to(x.dtype) * scale


# --- LRN, Lp, MVN -----------------------------------------------------------------------


@register("LRN")
def local_response_normalization(ctx, x, *, size, alpha=1e-4, beta=0.75, bias=1.0):
    """y = x / (bias + α/size · Σ x²)^β over the channel window [c − ⌊(size−1)/2⌋, c + ⌈(size−1)/2⌉]."""
    acc = accumulation_dtype(x.dtype)
    squares = x.to(acc) ** 2  # [N, C, ...]
    before, after = math.floor((size - 1) / 2), math.ceil((size - 1) / 2)
    channels = x.shape[1]
    pad = [0] * (2 * (x.dim() - 2)) + [before, after]  # F.pad lists dims last-first
    padded = torch.nn.functional.pad(squares, pad)
    window_sum = sum(padded.narrow(1, offset, channels) for offset in range(size))
    return (x.to(acc) / (bias + (alpha / size) * window_sum) ** beta).to(x.dtype)


@register("LpNormalization")
def lp_normalization(ctx, x, *, axis=-1, p=2):
    """x / ‖x‖_p along axis; a zero norm gives 0 rather than NaN."""
    acc = accumulation_dtype(x.dtype)
    xf = x.to(acc)
    norm = torch.linalg.vector_norm(xf, ord=p, dim=norm_axis(axis, x.dim()), keepdim=True)
    y = torch.where(norm == 0, torch.zeros_like(xf), xf / norm)
    return y.to(x.dtype)


@register("MeanVarianceNormalization")
def mean_variance_normalization(ctx, x, *, axes=(0, 2, 3)):
    """(x − E[x]) / (√(E[x²] − E[x]²) + 1e-9), statistics over `axes`."""
    acc = accumulation_dtype(x.dtype)
    xf = x.to(acc)
    dims = [norm_axis(a, x.dim()) for a in axes]
    mean = xf.mean(dim=dims, keepdim=True)
    std = torch.sqrt((xf * xf).mean(dim=dims, keepdim=True) - mean * mean)
    return ((xf - mean) / (std + 1e-9)).to(x.dtype)
