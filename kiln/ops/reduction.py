"""Reductions (Reduce*), the softmax family and the losses built on log-softmax.

Floating reductions accumulate in fp32 for fp16/bf16 storage (float64 stays float64) and
cast back; integer sums run in int64 and wrap back to the storage type like ONNX does.
Axes come from the `axes` attribute before opset 13 (ReduceSum) / 18 (the others) and
from the second input after; the one function reads whichever the node has.
"""

from __future__ import annotations

import torch

from kiln.ops._util import ints, norm_axis
from kiln.ops.registry import register

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype floating math runs in: fp32 for 16-bit floats, else the dtype itself."""
    return torch.float32 if dtype in _LOW_PRECISION else dtype


def _reduce_axes(data: torch.Tensor, axes_input, axes_attr, noop_with_empty_axes: int) -> list[int] | None:
    """The normalised axes to reduce, or None when the node is a no-op (empty axes + noop)."""
    axes = ints(axes_input) if axes_input is not None else list(axes_attr or [])
    if not axes:
        if noop_with_empty_axes:
            return None
        return list(range(data.dim()))
    return sorted({norm_axis(a, data.dim()) for a in axes})


def _reduced_shape(shape, axes: list[int], keepdims: int) -> list[int]:
    if keepdims:
        return [1 if i in axes else d for i, d in enumerate(shape)]
    return [d for i, d in enumerate(shape) if i not in axes]


def _empty_reduction(data: torch.Tensor, axes: list[int], keepdims: int, fill) -> torch.Tensor:
    """The result of reducing an empty tensor: the reduction's identity, broadcast."""
    return torch.full(_reduced_shape(data.shape, axes, keepdims), fill, dtype=data.dtype, device=data.device)


def _sum(x: torch.Tensor, axes: list[int], keepdims: int) -> torch.Tensor:
    if not axes:  # torch reads dim=() as "all dims"; an explicit empty list means none here
        return x
    return torch.sum(x, dim=axes, keepdim=bool(keepdims))


def _as_float(data: torch.Tensor) -> torch.Tensor:
    if data.is_floating_point():
        return data.to(accumulation_dtype(data.dtype))
    return data.to(torch.float64)


def _integer_sum(data: torch.Tensor, axes: list[int], keepdims: int) -> torch.Tensor:
    return _sum(data.to(torch.int64), axes, keepdims).to(data.dtype)


def _reduction(name: str, compute, empty_fill=0.0):
    """Register Reduce<name>: `compute(data, axes, keepdims) -> tensor` in the storage dtype."""

    def reduce(ctx, data, axes_input=None, *, axes=None, keepdims=1, noop_with_empty_axes=0):
        dims = _reduce_axes(data, axes_input, axes, noop_with_empty_axes)
        if dims is None:
            return data
        if data.numel() == 0 and any(data.shape[a] == 0 for a in dims):
            fill = empty_fill(data) if callable(empty_fill) else empty_fill
            return _empty_reduction(data, dims, keepdims, fill)
        return compute(data, dims, keepdims)

    reduce.__name__ = f"reduce_{name.lower()}"
    register(f"Reduce{name}")(reduce)
    return reduce


def _float_then_cast(fn):
    """A reduction done in floating point (fp32 for 16-bit, float64 for ints), cast back."""

    def compute(data, axes, keepdims):
        return fn(_as_float(data), axes, keepdims).to(data.dtype)

    return compute


def _sum_compute(data, axes, keepdims):
    if data.is_floating_point():
        return _sum(data.to(accumulation_dtype(data.dtype)), axes, keepdims).to(data.dtype)
    if data.dtype == torch.bool:
        return _sum(data, axes, keepdims).to(torch.bool)
    return _integer_sum(data, axes, keepdims)


def _sum_square_compute(data, axes, keepdims):
    if data.is_floating_point():
        x = data.to(accumulation_dtype(data.dtype))
        return _sum(x * x, axes, keepdims).to(data.dtype)
    x = data.to(torch.int64)
    return _sum(x * x, axes, keepdims).to(data.dtype)


def _l1_compute(data, axes, keepdims):
    if data.is_floating_point():
        return _sum(data.to(accumulation_dtype(data.dtype)).abs(), axes, keepdims).to(data.dtype)
    return _sum(data.to(torch.int64).abs(), axes, keepdims).to(data.dtype)


def _mean_compute(data, axes, keepdims):
    count = 1
    for a in axes:
        count *= data.shape[a]
    if data.is_floating_point():
        return (_sum(data.to(accumulation_dtype(data.dtype)), axes, keepdims) / count).to(data.dtype)
    total = _sum(data.to(torch.int64), axes, keepdims)
    return torch.div(total, count, rounding_mode="trunc").to(data.dtype)  # numpy's int mean truncates


def _extreme(largest: bool):
    def compute(data, axes, keepdims):
        if data.dtype == torch.bool:
            fn = torch.any if largest else torch.all
            out = data
            for a in sorted(axes, reverse=True):
                out = fn(out, dim=a, keepdim=bool(keepdims))
            return out
        x = data if data.dtype not in (torch.uint16, torch.uint32, torch.uint64) else data.to(torch.int64)
        out = torch.amax(x, dim=axes, keepdim=bool(keepdims)) if largest else torch.amin(x, dim=axes, keepdim=bool(keepdims))
        return out.to(data.dtype)

    return compute


def _extreme_fill(largest: bool):
    def fill(data):
        if data.dtype == torch.bool:
            return not largest
        if data.is_floating_point():
            return float("-inf") if largest else float("inf")
        info = torch.iinfo(data.dtype)
        return info.min if largest else info.max

    return fill


def _prod_compute(data, axes, keepdims):
    x = data.to(accumulation_dtype(data.dtype)) if data.is_floating_point() else data.to(torch.int64)
    for a in sorted(axes, reverse=True):
        x = torch.prod(x, dim=a, keepdim=bool(keepdims))
    return x.to(data.dtype)


def _log_sum_exp(x, axes, keepdims):
    return torch.logsumexp(x, dim=axes, keepdim=bool(keepdims))


_reduction("Sum", _sum_compute)
_reduction("SumSquare", _sum_square_compute)
_reduction("L1", _l1_compute)
_reduction("L2", _float_then_cast(lambda x, axes, keepdims: torch.sqrt(_sum(x * x, axes, keepdims))))
_reduction("Mean", _mean_compute, empty_fill=float("nan"))
_reduction("Max", _extreme(True), empty_fill=_extreme_fill(True))
_reduction("Min", _extreme(False), empty_fill=_extreme_fill(False))
_reduction("Prod", _prod_compute, empty_fill=1)
_reduction("LogSum", _float_then_cast(lambda x, axes, keepdims: torch.log(_sum(x, axes, keepdims))),
           empty_fill=float("-inf"))
_reduction("LogSumExp", _float_then_cast(_log_sum_exp), empty_fill=float("-inf"))


# --- softmax family ---------------------------------------------------------------------


def _along_axis(ctx, x: torch.Tensor, axis: int | None, fn) -> torch.Tensor:
    """Apply `fn(x, dim)` the way the opset defines `axis`.

    Before opset 13 the input is coerced to 2D [prod(shape[:axis]), prod(shape[axis:])]
    and the op runs over the second dimension (default axis 1); from 13 on it runs over
    the one axis (default -1).
    """
    if x.dim() == 0:
        return fn(x.reshape(1), 0).reshape(())
    if ctx.opset < 13:
        axis = norm_axis(1 if axis is None else axis, x.dim())
        rows = 1
        for d in x.shape[:axis]:
            rows *= d
        return fn(x.reshape(rows, -1), 1).reshape(x.shape)
    return fn(x, norm_axis(-1 if axis is None else axis, x.dim()))


def _softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.softmax(x.to(accumulation_dtype(x.dtype)), dim=dim).to(x.dtype)


def _log_softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.log_softmax(x.to(accumulation_dtype(x.dtype)), dim=dim).to(x.dtype)


def _hardmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    if x.numel() == 0:
        return torch.zeros_like(x)
    first_max = torch.argmax(x, dim=dim, keepdim=True)  # torch returns the first maximum
    return torch.zeros_like(x).scatter_(dim, first_max, 1)


@register("Softmax")
def softmax(ctx, x, *, axis=None):
    return _along_axis(ctx, x, axis, _softmax)


@register("LogSoftmax")
def log_softmax(ctx, x, *, axis=None):
    return _along_axis(ctx, x, axis, _log_softmax)


@register("Hardmax")
def hardmax(ctx, x, *, axis=None):
    return _along_axis(ctx, x, axis, _hardmax)


# --- losses -----------------------------------------------------------------------------


def negative_log_likelihood(
    log_prob: torch.Tensor,  # [N, C, d1...]
    target: torch.Tensor,  # [N, d1...]
    weight: torch.Tensor | None,  # [C]
    reduction: str,
    ignore_index: int | None,
) -> torch.Tensor:
    """loss[n, d] = -log_prob[n, target[n, d], d] * weight[target[n, d]]; ignored targets weigh 0.

    "mean" divides by the sum of the weights that were applied (the count of kept
    targets when there is no weight), as onnx and torch do.
    """
    target = target.to(torch.int64)
    num_classes = log_prob.shape[1]
    ignored = target == ignore_index if ignore_index is not None else torch.zeros_like(target, dtype=torch.bool)
    safe_target = torch.where(ignored, torch.zeros_like(target), target).clamp(0, num_classes - 1)
    picked = -torch.gather(log_prob, 1, safe_target.unsqueeze(1)).squeeze(1)  # [N, d1...]
    if weight is not None:
        w = weight.to(log_prob.dtype)[safe_target]
    else:
        w = torch.ones_like(picked)
    w = torch.where(ignored, torch.zeros_like(w), w)
    loss = picked * w
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    if reduction == "mean":
        return loss.sum() / w.sum()
    raise ValueError(f"reduction must be 'none', 'sum' or 'mean', got {reduction!r}")


@register("NegativeLogLikelihoodLoss")
def negative_log_likelihood_loss(ctx, x, target, weight=None, *, ignore_index=None, reduction="mean"):
    acc = accumulation_dtype(x.dtype)
    w = weight.to(acc) if weight is not None else None
    return negative_log_likelihood(x.to(acc), target, w, reduction, ignore_index).to(x.dtype)


@register("SoftmaxCrossEntropyLoss")
def softmax_cross_entropy_loss(ctx, scores, labels, weights=None, *, ignore_index=None, reduction="mean"):
    acc = accumulation_dtype(scores.dtype)
    log_prob = torch.log_softmax(scores.to(acc), dim=1) if scores.dim() > 1 else scores.to(acc)
    w = weights.to(acc) if weights is not None else None
    loss = negative_log_likelihood(log_prob, labels, w, reduction, ignore_index).to(scores.dtype)
    if ctx.num_outputs > 1:
        return loss, log_prob.to(scores.dtype)
    return loss
