"""Resize and Upsample: separable resampling.

Per axis, numpy computes the source taps and weights once (coordinate_transformation_mode,
nearest rounding, linear/cubic kernels, antialias, exclude_outside), and torch gathers and
weighs; tf_crop_and_resize samples outside the input take extrapolation_value. Resize-10 and
Upsample are the asymmetric-coordinates, floor-rounding special case.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from kiln.ops._util import ints
from kiln.ops.registry import register


def _source_coords(mode: str, out_len: int, in_len: int, scale: float, roi: tuple[float, float]):
    """Output index -> input coordinate along one axis (coordinate_transformation_mode)."""
    y = np.arange(out_len, dtype=np.float64)
    out_width = scale * in_len  # the unrounded output length the modes are defined on
    if mode == "align_corners":
        return np.zeros(out_len) if out_width == 1 else y * (in_len - 1) / (out_width - 1)
    if mode == "asymmetric":
        return y / scale
    if mode == "tf_crop_and_resize":
        start, end = roi
        if out_width == 1:
            x = np.full(out_len, (end - start) * (in_len - 1) / 2)
        else:
            x = y * (end - start) * (in_len - 1) / (out_width - 1)
        return x + start * (in_len - 1)
    if mode == "pytorch_half_pixel":
        return np.full(out_len, -0.5) if out_width == 1 else (y + 0.5) / scale - 0.5
    if mode == "half_pixel":
        return (y + 0.5) / scale - 0.5
    if mode == "half_pixel_symmetric":
        offset = in_len / 2 * (1 - out_len / out_width)
        return offset + (y + 0.5) / scale - 0.5
    raise ValueError(f"Resize: unknown coordinate_transformation_mode {mode!r}")


def _cubic_kernel(t: np.ndarray, a: float) -> np.ndarray:
    t = np.abs(t)
    near = ((a + 2) * t - (a + 3)) * t * t + 1
    far = ((a * t - 5 * a) * t + 8 * a) * t - 4 * a
    return np.where(t <= 1, near, np.where(t < 2, far, 0.0))


def _resize_taps(x: np.ndarray, in_len: int, scale: float, mode: str, nearest_mode: str,
                 cubic_a: float, antialias: bool, exclude_outside: bool):
    """Per output index: input indices [out, n] and weights [out, n] (None for nearest)."""
    base = np.ceil(x).astype(np.int64) - 1  # the tap left of x; x itself when x is an integer
    ratio = x - base  # in (0, 1]
    if mode == "nearest":
        is_int = ratio == 1.0
        up = {"round_prefer_floor": ratio > 0.5, "round_prefer_ceil": ratio >= 0.5,
              "floor": np.zeros_like(is_int), "ceil": np.ones_like(is_int)}[nearest_mode]
        pick = base + (is_int | up)
        return np.clip(pick, 0, in_len - 1)[:, None], None
    s = min(scale, 1.0) if antialias else 1.0  # antialias widens the kernel when downsampling
    reach = 1.0 if mode == "linear" else 2.0
    start = int(np.floor(-reach / s) + 1)
    offsets = np.arange(start, 1 - start + 1)  # [n]
    t = (offsets[None, :] - ratio[:, None]) * s
    if mode == "linear":
        w = np.clip(1 - np.abs(t), 0, 1)
    elif mode == "cubic":
        w = _cubic_kernel(t, cubic_a)
    else:
        raise ValueError(f"Resize: unknown mode {mode!r}")
    if antialias:
        w = w / w.sum(axis=1, keepdims=True)
    idx = base[:, None] + offsets[None, :]
    if exclude_outside:
        w = np.where((idx < 0) | (idx >= in_len), 0.0, w)
        total = w.sum(axis=1, keepdims=True)
        w = w / np.where(total == 0, 1.0, total)
    return np.clip(idx, 0, in_len - 1), w


def _resize(x: torch.Tensor, scales: list[float], sizes: list[int], roi: list[float], *, mode,
            coordinate_mode, nearest_mode, cubic_a=-0.75, antialias=False, exclude_outside=False,
            extrapolation_value=0.0) -> torch.Tensor:
    """Separable resize: one gather (nearest) or gather-and-weigh (linear, cubic) per axis."""
    rank = x.dim()
    floating = x.dtype.is_floating_point
    y = x if (mode == "nearest" or x.dtype == torch.float64) else x.to(torch.float32)
    outside = None  # [*out] mask of tf_crop_and_resize samples taken outside the input
    for axis in range(rank):
        in_len, out_len, scale = x.shape[axis], sizes[axis], scales[axis]
        start, end = roi[axis], roi[rank + axis]
        if out_len == in_len and math.isclose(scale, 1.0) and (
                coordinate_mode != "tf_crop_and_resize" or (start == 0.0 and end == 1.0)):
            continue
        coords = _source_coords(coordinate_mode, out_len, in_len, scale, (start, end))
        idx, w = _resize_taps(coords, in_len, scale, mode, nearest_mode, cubic_a, antialias,
                              exclude_outside)
        index = torch.as_tensor(idx.reshape(-1), device=x.device)
        taken = y.index_select(axis, index)
        if w is None:
            y = taken
        else:
            shape = list(y.shape)
            shape[axis:axis + 1] = [out_len, idx.shape[1]]
            weights = torch.as_tensor(w, dtype=y.dtype, device=x.device)
            weights = weights.reshape([out_len, idx.shape[1]] + [1] * (rank - axis - 1))
            y = (taken.reshape(shape) * weights).sum(dim=axis + 1)
        if coordinate_mode == "tf_crop_and_resize":
            bad = (coords < 0) | (coords > in_len - 1)
            if bad.any():
                view = [1] * rank
                view[axis] = out_len
                mask = torch.as_tensor(bad, device=x.device).reshape(view)
                outside = mask if outside is None else (outside | mask)
    if outside is not None:
        y = torch.where(outside, torch.tensor(extrapolation_value, dtype=y.dtype, device=x.device), y)
    if y.dtype != x.dtype:
        y = y if floating else y.round()
        y = y.to(x.dtype)
    return y


def _resize_target(x, scales, sizes, axes, policy):
    """(scales, sizes) for every axis, from whichever of the two inputs was given."""
    rank = x.dim()
    axes = [a + rank if a < 0 else a for a in (axes or range(rank))]
    in_shape = list(x.shape)
    if sizes:
        full_sizes = list(in_shape)
        for a, s in zip(axes, sizes):
            full_sizes[a] = s
        full_scales = [full_sizes[i] / in_shape[i] for i in range(rank)]
        if policy != "stretch":
            pick = min if policy == "not_larger" else max
            scale = pick(full_scales[a] for a in axes)
            full_scales = [scale if i in axes else 1.0 for i in range(rank)]
            full_sizes = [int(scale * in_shape[i] + 0.5) if i in axes else in_shape[i]
                          for i in range(rank)]
        return full_scales, full_sizes, axes
    full_scales = [1.0] * rank
    for a, s in zip(axes, scales):
        full_scales[a] = s
    return full_scales, [int(s * n) for s, n in zip(full_scales, in_shape)], axes


def _floats(value) -> list[float]:
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        return [float(v) for v in value.reshape(-1).tolist()]
    return [float(v) for v in np.asarray(value).reshape(-1).tolist()]


@register("Resize")
def resize(ctx, x, roi=None, scales=None, sizes=None, *, antialias=0, axes=None,
           coordinate_transformation_mode="half_pixel", cubic_coeff_a=-0.75, exclude_outside=0,
           extrapolation_value=0.0, keep_aspect_ratio_policy="stretch", mode="nearest",
           nearest_mode="round_prefer_floor"):
    if ctx.opset < 11:  # Resize-10: (X, scales), asymmetric coordinates, nearest rounds down
        return _resize(x, _floats(roi), [int(s * n) for s, n in zip(_floats(roi), x.shape)],
                       [0.0] * x.dim() + [1.0] * x.dim(), mode=mode,
                       coordinate_mode="asymmetric", nearest_mode="floor")
    full_scales, full_sizes, axes = _resize_target(x, _floats(scales), ints(sizes), axes,
                                                   keep_aspect_ratio_policy)
    rank = x.dim()
    full_roi = [0.0] * rank + [1.0] * rank
    given = _floats(roi)
    if given and coordinate_transformation_mode == "tf_crop_and_resize":
        for i, a in enumerate(axes):
            full_roi[a], full_roi[rank + a] = given[i], given[len(axes) + i]
    return _resize(x, full_scales, full_sizes, full_roi, mode=mode,
                   coordinate_mode=coordinate_transformation_mode, nearest_mode=nearest_mode,
                   cubic_a=cubic_coeff_a, antialias=bool(antialias),
                   exclude_outside=bool(exclude_outside), extrapolation_value=extrapolation_value)


@register("Upsample")
def upsample(ctx, x, scales=None, *, mode="nearest", **legacy):
    """Upsample-7 takes `scales` as an attribute, Upsample-9 as an input."""
    factors = _floats(scales) if scales is not None else [float(s) for s in legacy.get("scales", [])]
    if not factors:
        raise ValueError(f"Upsample {ctx.name!r}: no scales given")
    sizes = [int(s * n) for s, n in zip(factors, x.shape)]
    return _resize(x, factors, sizes, [0.0] * x.dim() + [1.0] * x.dim(), mode=mode,
                   coordinate_mode="asymmetric", nearest_mode="floor")
