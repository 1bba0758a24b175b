"""Tensor plumbing: shape-changing and copying ops (Reshape, Transpose, Concat, Split, Slice, Pad, ...).

Most of these are views in torch. String tensors (numpy object arrays) take the numpy path in
the ops a string graph plausibly uses (Identity, Reshape, Transpose, Concat, Squeeze, ...).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from kiln.ops._util import broadcast_sizes, ints, norm_axis
from kiln.ops.registry import register


def _shape(x: Any) -> list[int]:
    return list(x.shape)


@register("Identity")
def identity(ctx, x):
    return x


@register("Reshape")
def reshape(ctx, data, shape_input=None, *, allowzero=0, shape=None, consumed_inputs=None):
    # Reshape-1 took the shape as an attribute; from 5 on it is an input.
    target = ints(shape_input) if shape_input is not None else list(shape or [])
    return reshape_to(data, target, allowzero)


def reshape_to(data, target: list[int], allowzero: int = 0):
    """Reshape on Python ints (kiln/runtime/shape_function.py calls it with dims it keeps as ints)."""
    in_shape = _shape(data)
    if not allowzero:
        target = [in_shape[i] if d == 0 else d for i, d in enumerate(target)]
    return data.reshape(tuple(target))


@register("Transpose")
def transpose(ctx, x, *, perm=None):
    perm = list(perm) if perm is not None else list(range(x.ndim))[::-1]
    if isinstance(x, torch.Tensor):
        return x.permute(perm)
    return np.transpose(x, perm)


@register("Concat")
def concat(ctx, *inputs, axis=1):
    axis = norm_axis(axis, inputs[0].ndim)
    if all(isinstance(t, torch.Tensor) for t in inputs):
        return torch.cat(inputs, dim=axis)
    return np.concatenate([np.asarray(t) for t in inputs], axis=axis)


@register("Split")
def split(ctx, x, split_input=None, *, axis=0, split=None, num_outputs=None):
    # Split sizes: an input from opset 13, an attribute before; num_outputs (18+) or the
    # node's output count otherwise, ceil-sized with a smaller last chunk.
    axis = norm_axis(axis, x.ndim)
    dim = x.shape[axis]
    sizes = ints(split_input) if split_input is not None else list(split or [])
    if not sizes:
        n = num_outputs if num_outputs is not None else ctx.num_outputs
        chunk = -(-dim // n) if n else 0
        sizes = [min(chunk, max(dim - i * chunk, 0)) for i in range(n)]
    if sum(sizes) != dim:
        raise ValueError(f"Split {ctx.name!r}: split sizes {sizes} do not add up to dim {dim} of axis {axis}")
    if isinstance(x, torch.Tensor):
        return tuple(torch.split(x, sizes, dim=axis))
    cuts = np.cumsum(sizes)[:-1]
    return tuple(np.split(x, cuts, axis=axis))


def _slice_bounds(start: int, end: int, step: int, dim: int) -> tuple[int, int]:
    """ONNX Slice clamping: the resulting (start, end) walk like range(start, end, step)."""
    if start < 0:
        start += dim
    if end < 0:
        end += dim
    if step > 0:
        start = min(max(start, 0), dim)
        end = min(max(end, 0), dim)
    else:
        start = min(max(start, 0), dim - 1)
        end = min(max(end, -1), dim - 1)
    return start, end


@register("Slice")
def slice_(ctx, data, starts_input=None, ends_input=None, axes_input=None, steps_input=None,
           *, starts=None, ends=None, axes=None):
    # Slice-1 had starts/ends/axes attributes; from 10 on they (and steps) are inputs.
    if starts_input is not None:
        starts, ends, axes = ints(starts_input), ints(ends_input), ints(axes_input) or None
        steps = ints(steps_input) or None
    else:
        starts, ends, steps = list(starts), list(ends), None
    return slice_ints(data, starts, ends, axes, steps, ctx.name)


def slice_ints(data, starts: list[int], ends: list[int], axes: list[int] | None, steps: list[int] | None,
               name: str = ""):
    """Slice on Python ints (axes, steps: None or [] for the defaults)."""
    rank = data.ndim
    axes = [norm_axis(a, rank) for a in axes] if axes else list(range(len(starts)))
    steps = steps or [1] * len(starts)
    out = data
    for start, end, axis, step in zip(starts, ends, axes, steps):
        if step == 0:
            raise ValueError(f"Slice {name!r}: step 0 on axis {axis}")
        dim = out.shape[axis]
        start, end = _slice_bounds(start, end, step, dim)
        if step > 0:
            index: Any = slice(start, max(end, start), step)
        elif isinstance(out, torch.Tensor):
            idx = torch.arange(start, end, step, device=out.device, dtype=torch.int64)
            out = out.index_select(axis, idx)
            continue
        else:
            index = slice(start, end if end >= 0 else None, step)
        out = out[(slice(None),) * axis + (index,)]
    return out


@register("Squeeze")
def squeeze(ctx, x, axes_input=None, *, axes=None):
    return squeeze_axes(x, ints(axes_input) if axes_input is not None else list(axes or []))


def squeeze_axes(x, axes: list[int]):
    """Squeeze on Python ints ([]: every axis of size 1)."""
    if not axes:
        axes = [i for i, d in enumerate(x.shape) if d == 1]
    axes = sorted({norm_axis(a, x.ndim) for a in axes})
    shape = [d for i, d in enumerate(x.shape) if i not in axes]
    return x.reshape(tuple(shape))


@register("Unsqueeze")
def unsqueeze(ctx, x, axes_input=None, *, axes=None):
    return unsqueeze_axes(x, ints(axes_input) if axes_input is not None else list(axes or []))


def unsqueeze_axes(x, axes: list[int]):
    """Unsqueeze on Python ints."""
    rank = x.ndim + len(axes)
    axes = sorted(norm_axis(a, rank) for a in axes)
    shape = list(x.shape)
    for a in axes:
        shape.insert(a, 1)
    return x.reshape(tuple(shape))


@register("Flatten")
def flatten(ctx, x, *, axis=1):
    axis = norm_axis(axis, x.ndim)
    shape = _shape(x)
    return x.reshape(math.prod(shape[:axis]), math.prod(shape[axis:]))


@register("Expand")
def expand(ctx, x, shape):
    return expand_to(x, tuple(ints(shape)))


def expand_to(x, shape: tuple[int, ...]):
    """Expand on Python ints."""
    out = broadcast_sizes(tuple(x.shape), shape)
    if isinstance(x, torch.Tensor):
        return x.expand(out)
    return np.broadcast_to(x, out).copy()


@register("Tile")
def tile(ctx, x, repeats, tiles=None, axis=None):
    reps = ints(repeats)
    if tiles is not None:  # Tile-1: a scalar count along one axis
        reps = [1] * x.ndim
        reps[int(ints(axis)[0])] = ints(tiles)[0]
    if isinstance(x, torch.Tensor):
        return x.repeat(*reps) if reps else x.clone()
    return np.tile(x, reps)


def _pad_index(n_before: int, n_after: int, dim: int, mode: str, device) -> torch.Tensor:
    """Source index, along one axis, of each output position for edge/reflect/wrap padding."""
    pos = torch.arange(-n_before, dim + n_after, device=device, dtype=torch.int64)
    if mode == "edge" or (mode == "reflect" and dim == 1):
        return pos.clamp(0, dim - 1)
    if mode == "wrap":
        return pos.remainder(dim)
    period = 2 * (dim - 1)  # reflect, excluding the edge value: 0 1 2 1 0 1 2 ...
    j = pos.remainder(period)
    return torch.where(j < dim, j, period - j)


@register("Pad")
def pad(ctx, data, pads_input=None, constant_value=None, axes=None, *, mode="constant", pads=None,
        value=0.0, paddings=None):
    # Pad-2 took pads/value as attributes (Pad-1 called pads "paddings"); from 11 they are inputs.
    rank = data.ndim
    pads = ints(pads_input) if pads_input is not None else list(pads if pads is not None else paddings)
    axes = [norm_axis(a, rank) for a in ints(axes)] if axes is not None else list(range(rank))
    n = len(axes)
    begin, end = [0] * rank, [0] * rank
    for i, a in enumerate(axes):
        begin[a], end[a] = pads[i], pads[n + i]
    if isinstance(constant_value, torch.Tensor) and constant_value.numel():
        fill = constant_value.reshape(-1)[0].item()
    elif pads_input is None:
        fill = value
    else:
        fill = 0
    if mode == "constant":
        # Crop the negative pads, then copy into a filled tensor of the output shape.
        cropped = data[tuple(slice(max(-b, 0), d - max(-e, 0)) for b, e, d in zip(begin, end, data.shape))]
        out_shape = [d + b + e for d, b, e in zip(data.shape, begin, end)]
        out = torch.full(out_shape, fill, dtype=data.dtype, device=data.device)
        out[tuple(slice(max(b, 0), max(b, 0) + c) for b, c in zip(begin, cropped.shape))] = cropped
        return out
    if mode not in ("edge", "reflect", "wrap"):
        raise ValueError(f"Pad {ctx.name!r}: unknown mode {mode!r}")
    out = data
    for axis in range(rank):
        if begin[axis] or end[axis]:
            idx = _pad_index(begin[axis], end[axis], out.shape[axis], mode, out.device)
            out = out.index_select(axis, idx)
    return out


@register("Shape")
def shape_(ctx, x, *, start=0, end=None):
    dims = _shape(x)
    rank = len(dims)
    start = min(max(start + rank if start < 0 else start, 0), rank)
    end = rank if end is None else min(max(end + rank if end < 0 else end, 0), rank)
    return torch.tensor(dims[start:end], dtype=torch.int64)  # on the host: a shape, read there (kiln/runtime/host.py)


@register("Size")
def size(ctx, x):
    return torch.tensor(math.prod(_shape(x)), dtype=torch.int64)  # on the host, as Shape


@register("DepthToSpace")
def depth_to_space(ctx, x, *, blocksize, mode="DCR"):
    b, c, h, w = x.shape
    bs = blocksize
    if mode == "DCR":
        y = x.reshape(b, bs, bs, c // (bs * bs), h, w).permute(0, 3, 4, 1, 5, 2)
    else:  # CRD
        y = x.reshape(b, c // (bs * bs), bs, bs, h, w).permute(0, 1, 4, 2, 5, 3)
    return y.reshape(b, c // (bs * bs), h * bs, w * bs)


@register("SpaceToDepth")
def space_to_depth(ctx, x, *, blocksize, mode="DCR"):
    b, c, h, w = x.shape
    bs = blocksize
    y = x.reshape(b, c, h // bs, bs, w // bs, bs)
    y = y.permute(0, 3, 5, 1, 2, 4) if mode == "DCR" else y.permute(0, 1, 3, 5, 2, 4)
    return y.reshape(b, c * bs * bs, h // bs, w // bs)


@register("CenterCropPad")
def center_crop_pad(ctx, x, shape, *, axes=None):
    rank = x.ndim
    axes = [norm_axis(a, rank) for a in axes] if axes is not None else list(range(rank))
    target = ints(shape)
    out_shape = list(x.shape)
    src, dst = [slice(None)] * rank, [slice(None)] * rank
    for a, t in zip(axes, target):
        dim = x.shape[a]
        out_shape[a] = t
        if t <= dim:  # crop, the extra row falls at the end
            off = (dim - t) // 2
            src[a] = slice(off, off + t)
        else:  # pad with zeros, the extra row falls at the end
            off = (t - dim) // 2
            dst[a] = slice(off, off + dim)
    out = torch.zeros(out_shape, dtype=x.dtype, device=x.device)
    out[tuple(dst)] = x[tuple(src)]
    return out


@register("Einsum")
def einsum(ctx, *inputs, equation):
    return torch.einsum(equation.replace(" ", ""), *inputs)


@register("Det")
def det(ctx, x):
    return torch.linalg.det(x)
