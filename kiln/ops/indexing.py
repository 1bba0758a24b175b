"""Indexing ops: Gather/Scatter families, TopK, ArgMax, NonZero, Unique, CumSum, OneHot, ..."""

from __future__ import annotations

import math

import numpy as np
import torch

from kiln.ops._util import from_numpy, ints, norm_axis, to_numpy
from kiln.ops.registry import register


def _norm_indices(indices: torch.Tensor, dim: int) -> torch.Tensor:
    """int64 indices with negatives counted from the end of a `dim`-long axis."""
    indices = indices.to(torch.int64)
    return torch.where(indices < 0, indices + dim, indices)


def _linear_index(indices: torch.Tensor, dims: list[int]) -> torch.Tensor:
    """[..., m] multi-indices into the leading `dims` -> [...] flat indices."""
    idx = indices.to(torch.int64)
    flat = torch.zeros(idx.shape[:-1], dtype=torch.int64, device=idx.device)
    for j, dim in enumerate(dims):  # Python ints only: no host-to-device copy (CUDA graphs capture this)
        column = idx[..., j]
        flat = flat + torch.where(column < 0, column + dim, column) * math.prod(dims[j + 1:])
    return flat


@register("Gather")
def gather(ctx, data, indices, *, axis=0):
    axis = norm_axis(axis, data.ndim)
    if not isinstance(data, torch.Tensor):
        idx = to_numpy(indices).astype(np.int64)
        return np.take(data, np.where(idx < 0, idx + data.shape[axis], idx), axis=axis)
    if indices.dim() == 0 and indices.device.type == "cpu" and data.device.type == "cpu":
        # one index (y[:, -1] of a sequence): a copy of the slice; index_select walks a strided input
        # element by element (~3x slower on a transposed [8, 96, 128])
        i = int(indices)
        if not -data.shape[axis] <= i < data.shape[axis]:
            raise IndexError(f"Gather index {i} is out of range for axis {axis} of size {data.shape[axis]}")
        return data.select(axis, i).clone(memory_format=torch.contiguous_format)
    idx = _norm_indices(indices, data.shape[axis])
    out = data.index_select(axis, idx.reshape(-1))
    return out.reshape(data.shape[:axis] + idx.shape + data.shape[axis + 1:])


@register("GatherElements")
def gather_elements(ctx, data, indices, *, axis=0):
    axis = norm_axis(axis, data.ndim)
    return torch.gather(data, axis, _norm_indices(indices, data.shape[axis]))


@register("GatherND")
def gather_nd(ctx, data, indices, *, batch_dims=0):
    b = batch_dims
    m = indices.shape[-1]
    batch_shape = list(data.shape[:b])
    nbatch = math.prod(batch_shape)
    index_dims = list(data.shape[b:b + m])
    rest = list(data.shape[b + m:])
    flat = data.reshape(nbatch, math.prod(index_dims), *rest)  # [B, prod(index dims), *rest]
    lin = _linear_index(indices.reshape(nbatch, -1, m), index_dims)  # [B, N]
    batch = torch.arange(nbatch, device=data.device).unsqueeze(1)
    out = flat[batch, lin]  # [B, N, *rest]
    return out.reshape(*batch_shape, *indices.shape[b:-1], *rest)


_REDUCE = {"add": "sum", "mul": "prod", "max": "amax", "min": "amin"}


@register("ScatterElements", "Scatter")
def scatter_elements(ctx, data, indices, updates, *, axis=0, reduction="none"):
    axis = norm_axis(axis, data.ndim)
    idx = _norm_indices(indices, data.shape[axis])
    if reduction == "none":
        return data.clone().scatter_(axis, idx, updates)
    return data.scatter_reduce(axis, idx, updates, reduce=_REDUCE[reduction], include_self=True)


@register("ScatterND")
def scatter_nd(ctx, data, indices, updates, *, reduction="none"):
    m = indices.shape[-1]
    index_dims = list(data.shape[:m])
    rest = list(data.shape[m:])
    out = data.reshape(math.prod(index_dims), *rest).clone()  # [prod(index dims), *rest]
    lin = _linear_index(indices, index_dims).reshape(-1)  # [N]
    src = updates.reshape(-1, *rest)  # [N, *rest]
    if reduction == "none":
        out[lin] = src
    elif reduction == "add":
        out.index_add_(0, lin, src)
    else:
        index = lin.reshape(-1, *[1] * len(rest)).expand(src.shape)
        out.scatter_reduce_(0, index, src, _REDUCE[reduction], include_self=True)
    return out.reshape(data.shape)


@register("TensorScatter")
def tensor_scatter(ctx, past_cache, update, write_indices=None, *, axis=-2, mode="linear"):
    """Write `update` into the cache along `axis`, per batch row from write_indices[b]."""
    axis = norm_axis(axis, past_cache.ndim)
    batch, max_len, seq_len = past_cache.shape[0], past_cache.shape[axis], update.shape[axis]
    device = past_cache.device
    if write_indices is None:
        write_indices = torch.zeros(batch, dtype=torch.int64, device=device)
    pos = write_indices.to(torch.int64).reshape(batch, 1) + torch.arange(seq_len, device=device)  # [B, S]
    if mode == "circular":
        pos = pos.remainder(max_len)
    # Broadcast the [B, S] positions over the update's other dims, then scatter along axis.
    shape = [1] * update.ndim
    shape[0], shape[axis] = batch, seq_len
    index = pos.reshape(shape).expand(update.shape)
    return past_cache.clone().scatter_(axis, index, update)


@register("Compress")
def compress(ctx, x, condition, *, axis=None):
    if axis is None:
        x, axis = x.reshape(-1), 0
    axis = norm_axis(axis, x.ndim)
    keep = torch.nonzero(condition.reshape(-1).to(torch.bool)).reshape(-1)
    return x.index_select(axis, keep.to(x.device))


@register("NonZero")
def nonzero(ctx, x):
    return torch.nonzero(x).t().contiguous()  # [rank, count]


@register("Unique")
def unique(ctx, x, *, axis=None, sorted=1):
    a = to_numpy(x)
    if axis is None:
        a = a.reshape(-1)
        axis = 0
    axis = norm_axis(axis, a.ndim)
    _, first, inverse, counts = np.unique(a, return_index=True, return_inverse=True, return_counts=True, axis=axis)
    inverse = inverse.reshape(-1)
    if not sorted:  # order of first occurrence
        order = np.argsort(first, kind="stable")
        rank = np.empty_like(order)
        rank[order] = np.arange(len(order))
        first, counts, inverse = first[order], counts[order], rank[inverse]
    y = np.take(a, first, axis=axis)
    i64 = lambda v: torch.from_numpy(np.ascontiguousarray(v, dtype=np.int64))  # noqa: E731
    return from_numpy(y, like=x), i64(first), i64(inverse), i64(counts)


@register("TopK")
def top_k(ctx, x, k_input=None, *, axis=-1, largest=1, sorted=1, k=None):
    # k is an attribute before opset 10. Ties keep the lower index first (a stable sort).
    k = ints(k_input)[0] if k_input is not None else k
    axis = norm_axis(axis, x.ndim)
    values, indices = torch.sort(x, dim=axis, descending=bool(largest), stable=True)
    return values.narrow(axis, 0, k), indices.narrow(axis, 0, k)


def _arg_reduce(x, axis, keepdims, select_last_index, fn):
    axis = norm_axis(axis, x.ndim)
    if select_last_index:
        last = x.shape[axis] - 1
        out = last - fn(torch.flip(x, (axis,)), dim=axis, keepdim=bool(keepdims))
    else:
        out = fn(x, dim=axis, keepdim=bool(keepdims))
    return out.to(torch.int64)


@register("ArgMax")
def arg_max(ctx, x, *, axis=0, keepdims=1, select_last_index=0):
    return _arg_reduce(x, axis, keepdims, select_last_index, torch.argmax)


@register("ArgMin")
def arg_min(ctx, x, *, axis=0, keepdims=1, select_last_index=0):
    return _arg_reduce(x, axis, keepdims, select_last_index, torch.argmin)


@register("OneHot")
def one_hot(ctx, indices, depth, values, *, axis=-1):
    depth = int(ints(depth.to(torch.int64) if isinstance(depth, torch.Tensor) else depth)[0])
    rank = indices.ndim + 1
    axis = norm_axis(axis, rank)
    idx = indices.to(torch.int64)  # float indices truncate toward zero, as ONNX casts them
    idx = torch.where(idx < 0, idx + depth, idx)
    classes = torch.arange(depth, device=indices.device)
    hot = idx.unsqueeze(-1) == classes  # [..., depth]
    hot = hot.movedim(-1, axis)
    off, on = values.reshape(-1)[0], values.reshape(-1)[1]
    return torch.where(hot, on, off)


@register("Trilu")
def trilu(ctx, x, k=None, *, upper=1):
    k = ints(k)[0] if k is not None else 0
    return torch.triu(x, k) if upper else torch.tril(x, k)


@register("ReverseSequence")
def reverse_sequence(ctx, x, sequence_lens, *, batch_axis=1, time_axis=0):
    steps = x.shape[time_axis]
    t = torch.arange(steps, device=x.device).unsqueeze(1)  # [T, 1]
    lens = sequence_lens.to(torch.int64).reshape(1, -1)  # [1, B]
    src = torch.where(t < lens, lens - 1 - t, t)  # [T, B]: source time of each output time
    if time_axis > batch_axis:
        src = src.t()
    shape = [1] * x.ndim
    shape[time_axis], shape[batch_axis] = x.shape[time_axis], x.shape[batch_axis]
    return torch.gather(x, time_axis, src.reshape(shape).expand(x.shape))


def _cumulative(x, axis, exclusive, reverse, op, identity):
    axis = norm_axis(int(ints(axis)[0]), x.ndim)
    if x.shape[axis] == 0:
        return x.clone()
    if reverse:
        x = torch.flip(x, (axis,))
    if exclusive:  # shift by one: [identity, x0, x0+x1, ...]
        head = torch.full_like(x.narrow(axis, 0, 1), identity)
        x = torch.cat([head, x.narrow(axis, 0, x.shape[axis] - 1)], dim=axis)
    out = op(x, dim=axis, dtype=x.dtype)
    return torch.flip(out, (axis,)) if reverse else out


@register("CumSum")
def cum_sum(ctx, x, axis, *, exclusive=0, reverse=0):
    return _cumulative(x, axis, exclusive, reverse, torch.cumsum, 0)


@register("CumProd")
def cum_prod(ctx, x, axis, *, exclusive=0, reverse=0):
    return _cumulative(x, axis, exclusive, reverse, torch.cumprod, 1)
