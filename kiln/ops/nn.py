"""Convolution, pooling and sampling ops (Resize and Upsample are in resize.py).

A convolution's padding is made explicit (ONNX allows asymmetric pads and SAME_* auto-padding);
the torch kernel then runs with padding 0, so its own padding conventions never enter. A pool's
padding never is (see Pooling below): its windows are reduced over the taps inside the input.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from kiln.ops._util import ints
from kiln.ops.registry import register


def _auto_pads(auto_pad: str, in_sizes, kernel, strides, dilations) -> list[int]:
    """SAME_UPPER/SAME_LOWER/VALID -> explicit [begin..., end...] pads (conv and pool rule)."""
    n = len(in_sizes)
    if auto_pad == "VALID":
        return [0] * (2 * n)
    begin, end = [], []
    for size, k, s, d in zip(in_sizes, kernel, strides, dilations):
        out = -(-size // s)
        total = max((out - 1) * s + (k - 1) * d + 1 - size, 0)
        small, big = total // 2, total - total // 2
        begin.append(small if auto_pad == "SAME_UPPER" else big)
        end.append(big if auto_pad == "SAME_UPPER" else small)
    return begin + end


def _conv_params(x, kernel, auto_pad, dilations, pads, strides):
    n = x.dim() - 2
    strides = list(strides) if strides else [1] * n
    dilations = list(dilations) if dilations else [1] * n
    if auto_pad not in ("", "NOTSET"):
        pads = _auto_pads(auto_pad, list(x.shape[2:]), kernel, strides, dilations)
    pads = list(pads) if pads else [0] * (2 * n)
    return strides, dilations, pads


def _pad_spatial(x: torch.Tensor, begin, end, value=0.0) -> torch.Tensor:
    """Pad (or crop, for negative amounts) the trailing spatial dims; F.pad wants last dim first."""
    if not any(begin) and not any(end):
        return x
    spec = []
    for b, e in zip(reversed(begin), reversed(end)):
        spec += [b, e]
    return F.pad(x, spec, value=value)


_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}
# torch's oneDNN bf16 convolution is wrong on AVX-512/AMX Xeons (torch 2.13's oneDNN, measured 2026-12-03)
# when a group has few input channels: every output off by ~100% of its magnitude (2.6 on outputs of max 2.6
# against float64) for 2..14 channels per group (even counts) and kernels 8..64 wide, 1-D, 2-D (any
# height) and 3-D, grouped or not; 1 channel (depthwise), 16 and more, and fp16 are right. Such layers
# are computed in fp32 and rounded once (2-2.7x the time of the wrong bf16 kernel; few channels, few FLOPs).
BF16_WRONG_BELOW_CHANNELS = 16


def convolution(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, **geometry) -> torch.Tensor:
    """F.conv{1,2,3}d(x, w, b, **geometry) by x's spatial rank, in fp32 where torch's bf16 CPU kernel is wrong
    (BF16_WRONG_BELOW_CHANNELS); geometry: stride, padding, dilation, groups."""
    n = x.dim() - 2
    if n not in _CONV:
        raise NotImplementedError(f"Conv over {n} spatial dims: kiln supports 1 to 3")
    if x.dtype == torch.bfloat16 and x.device.type == "cpu" and 1 < w.shape[1] < BF16_WRONG_BELOW_CHANNELS:
        y = _CONV[n](x.float(), w.float(), None if b is None else b.float(), **geometry)  # fp32 accumulation
        return y.to(torch.bfloat16)
    return _CONV[n](x, w, b, **geometry)


def _conv(x, w, b, strides, dilations, pads, group):
    n = x.dim() - 2
    x = _pad_spatial(x, pads[:n], pads[n:])
    return convolution(x, w, b, stride=strides, dilation=dilations, groups=group)


@register("Conv")
def conv(ctx, x, w, b=None, *, auto_pad="NOTSET", dilations=None, group=1, kernel_shape=None,
         pads=None, strides=None):
    kernel = list(kernel_shape) if kernel_shape else list(w.shape[2:])
    strides, dilations, pads = _conv_params(x, kernel, auto_pad, dilations, pads, strides)
    return _conv(x, w, b, strides, dilations, pads, group)


def _exact_float(*ts):
    """Integer conv/matmul run in float64: exact for int8/int16 products summed below 2**53."""
    return [None if t is None else t.to(torch.float64) for t in ts]


@register("ConvInteger")
def conv_integer(ctx, x, w, x_zero_point=None, w_zero_point=None, *, auto_pad="NOTSET",
                 dilations=None, group=1, kernel_shape=None, pads=None, strides=None):
    xf, wf = _exact_float(x, w)
    if x_zero_point is not None:
        xf = xf - x_zero_point.to(torch.float64)
    if w_zero_point is not None:
        wz = w_zero_point.to(torch.float64)
        wf = wf - (wz.reshape(-1, *[1] * (w.dim() - 1)) if wz.numel() > 1 else wz)
    kernel = list(kernel_shape) if kernel_shape else list(w.shape[2:])
    strides, dilations, pads = _conv_params(x, kernel, auto_pad, dilations, pads, strides)
    # Pads are zeros after the zero-point shift, as in the ONNX reference.
    return _conv(xf, wf, None, strides, dilations, pads, group).round().to(torch.int32)


@register("ConvTranspose")
def conv_transpose(ctx, x, w, b=None, *, auto_pad="NOTSET", dilations=None, group=1,
                   kernel_shape=None, output_padding=None, output_shape=None, pads=None,
                   strides=None):
    n = x.dim() - 2
    kernel = list(kernel_shape) if kernel_shape else list(w.shape[2:])
    strides = list(strides) if strides else [1] * n
    dilations = list(dilations) if dilations else [1] * n
    output_padding = list(output_padding) if output_padding else [0] * n
    in_sizes = list(x.shape[2:])
    full = [s * (i - 1) + op + (k - 1) * d + 1
            for s, i, op, k, d in zip(strides, in_sizes, output_padding, kernel, dilations)]
    if output_shape or auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        target = list(output_shape)[-n:] if output_shape else [i * s for i, s in zip(in_sizes, strides)]
        total = [f - t for f, t in zip(full, target)]
        if auto_pad == "SAME_UPPER":
            begin, end = [t // 2 for t in total], [t - t // 2 for t in total]
        else:
            begin, end = [t - t // 2 for t in total], [t // 2 for t in total]
    elif pads:
        begin, end = list(pads[:n]), list(pads[n:])
    else:
        begin, end = [0] * n, [0] * n
    if n not in _CONV_T:
        raise NotImplementedError(f"ConvTranspose over {n} spatial dims: kiln supports 1 to 3")
    # Full transposed conv, then output_padding appended and the pads cropped (negative pads grow).
    y = _CONV_T[n](x, w, None, stride=strides, dilation=dilations, groups=group)
    y = _pad_spatial(y, [-p for p in begin], [op - p for op, p in zip(output_padding, end)])
    if b is not None:
        y = y + b.reshape(1, -1, *[1] * n)
    return y


@register("DeformConv")
def deform_conv(ctx, x, w, offset, b=None, mask=None, *, dilations=None, group=1,
                kernel_shape=None, offset_group=1, pads=None, strides=None):
    """Bilinear sampling at offset positions (zero outside the image), then a grouped matmul."""
    n_, c, h, wd = x.shape
    oc = w.shape[0]
    kh, kw = (list(kernel_shape) if kernel_shape else list(w.shape[2:]))
    sh, sw = list(strides) if strides else [1, 1]
    dh, dw = list(dilations) if dilations else [1, 1]
    pt, pl = (list(pads) if pads else [0, 0, 0, 0])[:2]
    oh, ow = offset.shape[2:]
    k = kh * kw
    g_off = offset_group
    dev, dt = x.device, x.dtype
    # base sampling grid: [K, oH, oW]
    ki, kj = torch.meshgrid(torch.arange(kh, device=dev), torch.arange(kw, device=dev), indexing="ij")
    oi, oj = torch.meshgrid(torch.arange(oh, device=dev), torch.arange(ow, device=dev), indexing="ij")
    base_h = (oi * sh - pt)[None] + (ki.reshape(-1) * dh)[:, None, None]
    base_w = (oj * sw - pl)[None] + (kj.reshape(-1) * dw)[:, None, None]
    off = offset.reshape(n_, g_off, k, 2, oh, ow)
    ph = base_h.to(dt) + off[:, :, :, 0]  # [N, Goff, K, oH, oW]
    pw = base_w.to(dt) + off[:, :, :, 1]
    h0, w0 = torch.floor(ph), torch.floor(pw)
    lh, lw = ph - h0, pw - w0
    h0, w0 = h0.long(), w0.long()
    xg = x.reshape(n_, g_off, c // g_off, h * wd)
    cols = torch.zeros(n_, g_off, c // g_off, k * oh * ow, dtype=dt, device=dev)
    for dy, dx, wt in ((0, 0, (1 - lh) * (1 - lw)), (0, 1, (1 - lh) * lw),
                       (1, 0, lh * (1 - lw)), (1, 1, lh * lw)):
        yy, xx = h0 + dy, w0 + dx
        valid = (yy >= 0) & (yy < h) & (xx >= 0) & (xx < wd)
        idx = (yy.clamp(0, h - 1) * wd + xx.clamp(0, wd - 1)).reshape(n_, g_off, 1, -1)
        vals = torch.gather(xg, 3, idx.expand(-1, -1, c // g_off, -1))
        cols = cols + vals * (wt * valid).reshape(n_, g_off, 1, -1)
    if mask is not None:
        cols = cols * mask.reshape(n_, g_off, 1, -1)
    # cols: [N, C, K, L] -> per conv group [N, G, C/G*K, L]
    cols = cols.reshape(n_, group, (c // group) * k, oh * ow)
    wg = w.reshape(group, oc // group, -1)  # [G, oC/G, C/G*K]
    y = torch.einsum("gok,ngkl->ngol", wg, cols).reshape(n_, oc, oh, ow)
    if b is not None:
        y = y + b.reshape(1, -1, 1, 1)
    return y


# ---------------------------------------------------------------------------------------------
# Pooling
#
# Padding is never materialised here (unlike convolution above): in a pool it only ever adds
# nothing to a sum, -inf to a max, or a count to a divisor. Each window is reduced over the taps
# that land inside the input, and the divisor is counted from the geometry. A kernel far larger
# than its input therefore costs what the input costs: EfficientNet's head in transformers is
# AvgPool2d(1280, ceil_mode=True) on a 7x7 map, whose ceil_mode tail, padded explicitly, was a
# 1280x1280 plane per channel (8 GB at batch 1; 250 GiB at batch 32 in fp16 on the H200).


def _pool_geometry(x, kernel, auto_pad, ceil_mode, dilations, pads, strides):
    """Output sizes and the explicit pads that make every window lie inside the padded input.

    Returns (out_sizes, begin, end, extra, strides, dilations): `extra` is the tail ceil_mode
    adds beyond the declared end pads (it never counts as padding for count_include_pad). The
    CUDA pooling kernels read their geometry here too, so kernel and reference cannot disagree.
    """
    n = x.dim() - 2
    in_sizes = list(x.shape[2:])
    strides = list(strides) if strides else [1] * n
    dilations = list(dilations) if dilations else [1] * n
    if auto_pad in ("SAME_UPPER", "SAME_LOWER", "VALID"):
        pads = _auto_pads(auto_pad, in_sizes, kernel, strides, dilations)
    pads = list(pads) if pads else [0] * (2 * n)
    begin, end = pads[:n], pads[n:]
    outs, extra = [], []
    for i in range(n):
        span = (kernel[i] - 1) * dilations[i] + 1
        room = in_sizes[i] + begin[i] + end[i] - span
        if ceil_mode:
            out = -(-room // strides[i]) + 1
            if (out - 1) * strides[i] >= in_sizes[i] + begin[i]:  # last window must start inside
                out -= 1
        else:
            out = room // strides[i] + 1
        outs.append(out)
        extra.append(max((out - 1) * strides[i] + span - (in_sizes[i] + begin[i] + end[i]), 0))
    return outs, begin, end, extra, strides, dilations


@dataclass(frozen=True)
class PoolAxis:
    """One spatial axis of ONNX's window grid: window o reads o*stride - begin + t*dilation,
    t in [0, kernel); positions outside [0, size) are padding (declared, auto or ceil's tail)."""

    size: int
    kernel: int
    stride: int
    dilation: int
    begin: int  # the declared (or auto_pad) pads; ceil_mode's tail is not padding
    end: int
    out: int

    def taps_within(self, lo: int, hi: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per window, the first tap t landing in [lo, hi) and how many do: two [out] int64 tensors."""
        start = torch.arange(self.out, device=device) * self.stride - self.begin  # [out]
        first = (-((start - lo) // self.dilation)).clamp(min=0)  # ceil((lo - start) / dilation)
        last = ((hi - 1 - start) // self.dilation).clamp(max=self.kernel - 1)
        return first, (last - first + 1).clamp(min=0)

    def counts(self, include_pad: bool) -> torch.Tensor:
        """[out] float64: the taps a window's divisor counts (the input, plus the declared pads
        when include_pad; never ceil_mode's tail)."""
        lo, hi = (-self.begin, self.size + self.end) if include_pad else (0, self.size)
        return self.taps_within(lo, hi)[1].to(torch.float64)

    def tap_grid(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(index [out, width] int64 into [0, size), valid [out, width] bool): each window's taps
        inside the input, numbered from its first such tap; width <= min(kernel, size)."""
        first, count = self.taps_within(0, self.size)
        width = max(int(count.max()) if self.out else 0, 1)  # an all-padding window: one invalid tap
        j = torch.arange(width)
        start = torch.arange(self.out) * self.stride - self.begin
        index = start[:, None] + (first[:, None] + j) * self.dilation  # [out, width]
        valid = j < count[:, None]
        return index.clamp(0, self.size - 1).to(device), valid.to(device)

    def torch_out(self, ceil_mode: bool) -> int:
        """The windows torch's pooling kernels give with padding `begin` on both sides."""
        span = (self.kernel - 1) * self.dilation + 1
        out = (self.size + 2 * self.begin - span + (self.stride - 1 if ceil_mode else 0)) // self.stride + 1
        if ceil_mode and (out - 1) * self.stride >= self.size + self.begin:
            out -= 1
        return out


def _pool_axes(x, kernel, auto_pad, ceil_mode, dilations, pads, strides) -> list[PoolAxis]:
    outs, begin, end, _extra, strides, dilations = _pool_geometry(
        x, kernel, auto_pad, ceil_mode, dilations, pads, strides)
    return [PoolAxis(int(x.shape[2 + i]), int(kernel[i]), int(strides[i]), int(dilations[i]), int(begin[i]),
                     int(end[i]), int(outs[i])) for i in range(len(outs))]


def _torch_ceil_mode(axes: list[PoolAxis]) -> bool | None:
    """The ceil_mode with which torch's kernels, padded by `begin` on both sides, place ONNX's
    windows and give at least `out` of them (the extra ones are cropped); None when no setting
    does (a begin pad over half the kernel, or end pads past what torch's grid reaches).

    torch clips every window to the input as ONNX's padding semantics need: a max ignores the
    outside, a sum adds nothing, and its exclude-pad divisor counts the taps inside.
    """
    if not 1 <= len(axes) <= 3 or any(2 * a.begin > a.kernel or a.out < 1 for a in axes):
        return None
    for ceil_mode in (False, True):
        if all(a.torch_out(ceil_mode) >= a.out for a in axes):
            return ceil_mode
    return None


def _crop(y: torch.Tensor, axes: list[PoolAxis]) -> torch.Tensor:
    if all(y.shape[2 + i] == a.out for i, a in enumerate(axes)):
        return y
    return y[(slice(None), slice(None), *[slice(0, a.out) for a in axes])]


def _reduce_windows(x: torch.Tensor, axes: list[PoolAxis], reduce: str) -> torch.Tensor:
    """Sum or max of every window over its taps inside the input, one axis at a time (a box's
    sum and max are separable): [N, C, *sizes] -> [N, C, *outs]. Each step gathers [out, width]
    taps along one axis, width <= min(kernel, size): no padding, no window grid of the whole."""
    for i, axis in enumerate(axes):
        dim = 2 + i
        index, valid = axis.tap_grid(x.device)  # [out, width]
        taps = x.index_select(dim, index.reshape(-1)).unflatten(dim, tuple(index.shape))
        invalid = ~valid.reshape(*valid.shape, *[1] * (x.dim() - dim - 1))  # [out, width, 1...]
        fill = 0 if reduce == "sum" else _lowest(x.dtype)
        taps = taps.masked_fill(invalid, fill)  # [N, C, ..., out, width, ...]
        x = taps.sum(dim + 1) if reduce == "sum" else taps.amax(dim + 1)
    return x


def _lowest(dtype):
    return -math.inf if dtype.is_floating_point else torch.iinfo(dtype).min


_MAX_POOL = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}


@register("MaxPool")
def max_pool(ctx, x, *, auto_pad="NOTSET", ceil_mode=0, dilations=None, kernel_shape=None,
             pads=None, storage_order=0, strides=None):
    axes = _pool_axes(x, list(kernel_shape), auto_pad, ceil_mode, dilations, pads, strides)
    if ctx.num_outputs >= 2:
        return _max_pool_with_indices(x, axes, storage_order)
    torch_ceil = _torch_ceil_mode(axes) if x.dtype.is_floating_point else None
    if torch_ceil is not None:
        # torch's kernel pads with -inf itself: no padded copy, and channels-last input stays so.
        y = _MAX_POOL[len(axes)](x, [a.kernel for a in axes], [a.stride for a in axes], [a.begin for a in axes],
                                 [a.dilation for a in axes], ceil_mode=torch_ceil)
        return _crop(y, axes)
    return _reduce_windows(x, axes, "max")


def _max_pool_with_indices(x: torch.Tensor, axes: list[PoolAxis], storage_order: int):
    """Values and ONNX's flat indices (over N*C*spatial of the unpadded input; storage_order 1:
    column-major spatial) of each window's first maximum, in the window's row-major tap order."""
    n = len(axes)
    in_sizes = [a.size for a in axes]
    steps = [1] * n
    if storage_order == 1:
        for i in range(1, n):
            steps[i] = steps[i - 1] * in_sizes[i - 1]
    else:
        for i in reversed(range(n - 1)):
            steps[i] = steps[i + 1] * in_sizes[i + 1]
    index, valid, flat = [], None, None
    for i, axis in enumerate(axes):
        tap_index, tap_valid = axis.tap_grid(x.device)  # [out_i, width_i]
        shape = [1] * (2 * n)
        shape[2 * i:2 * i + 2] = tap_index.shape
        index.append(tap_index.reshape(shape))
        valid = tap_valid.reshape(shape) if valid is None else valid & tap_valid.reshape(shape)
        flat = tap_index.reshape(shape) * steps[i] + (0 if flat is None else flat)
    # [N, C, out0, width0, out1, width1, ...] -> [N, C, *outs, taps]: window-major, taps row-major.
    order = [2 * i for i in range(n)] + [2 * i + 1 for i in range(n)]
    outs = [a.out for a in axes]
    taps = x[(slice(None), slice(None), *index)]
    taps = taps.permute(0, 1, *[2 + o for o in order]).reshape(*x.shape[:2], *outs, -1)
    valid = valid.permute(order).reshape(*outs, -1)
    flat = flat.permute(order).reshape(*outs, -1)
    values, arg = taps.masked_fill(~valid, _lowest(x.dtype)).max(dim=-1)  # [N, C, *outs]
    spatial = flat.expand(*x.shape[:2], *flat.shape).gather(-1, arg.unsqueeze(-1)).squeeze(-1)
    plane = math.prod(in_sizes)
    nc = torch.arange(x.shape[0] * x.shape[1], device=x.device).reshape(*x.shape[:2], *[1] * n)
    return values, (spatial + nc * plane).to(torch.int64)


def _window_sums(x: torch.Tensor, axes: list[PoolAxis], count_include_pad: int | None) -> torch.Tensor:
    """Each window's sum over the input, divided by ONNX's AveragePool divisor unless
    count_include_pad is None (LpPool): [N, C, *sizes] -> [N, C, *outs], in x's (fp32/fp64) dtype."""
    torch_ceil = _torch_ceil_mode(axes) if all(a.dilation == 1 for a in axes) else None
    if torch_ceil is None:
        total = _reduce_windows(x, axes, "sum")
        divided = False
    else:
        # torch's own divisor is ONNX's when pads are excluded, and when included if the end pads
        # equal the begin ones (torch pads both sides alike); otherwise it sums and kiln divides.
        native = count_include_pad == 0 or (count_include_pad == 1 and all(a.end == a.begin for a in axes))
        one_d = len(axes) == 1  # avg_pool1d has no divisor_override: run it as 2-D over [L, 1]
        y = x.unsqueeze(-1) if one_d else x
        pool = {2: F.avg_pool2d, 3: F.avg_pool3d}[y.dim() - 2]
        extra = [1] if one_d else []
        total = pool(y, [a.kernel for a in axes] + extra, [a.stride for a in axes] + extra,
                     [a.begin for a in axes] + [0] * len(extra), ceil_mode=torch_ceil,
                     count_include_pad=bool(count_include_pad), divisor_override=None if native else 1)
        total = _crop(total.squeeze(-1) if one_d else total, axes)
        divided = native
    if count_include_pad is None or divided:
        return total
    count = axes[0].counts(bool(count_include_pad))
    for axis in axes[1:]:
        count = count[..., None] * axis.counts(bool(count_include_pad))  # [out0, out1, ...]
    return total / count.to(total.dtype).to(total.device)


def _avg_or_lp(x, kernel, auto_pad, ceil_mode, dilations, pads, strides, count_include_pad, p):
    axes = _pool_axes(x, kernel, auto_pad, ceil_mode, dilations, pads, strides)
    compute = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)  # fp32 sums for fp16/bf16
    if p is None:
        return _window_sums(compute, axes, int(count_include_pad)).to(x.dtype)
    total = _window_sums(compute.abs().pow(p), axes, None)  # LpPool: padding adds |0|^p = 0
    return total.pow(1.0 / p).to(x.dtype)


@register("AveragePool")
def average_pool(ctx, x, *, auto_pad="NOTSET", ceil_mode=0, count_include_pad=0, dilations=None,
                 kernel_shape=None, pads=None, strides=None):
    return _avg_or_lp(x, list(kernel_shape), auto_pad, ceil_mode, dilations, pads, strides,
                      count_include_pad, None)


@register("LpPool")
def lp_pool(ctx, x, *, auto_pad="NOTSET", ceil_mode=0, dilations=None, kernel_shape=None, p=2,
            pads=None, strides=None):
    return _avg_or_lp(x, list(kernel_shape), auto_pad, ceil_mode, dilations, pads, strides, 1, p)


@register("GlobalAveragePool")
def global_average_pool(ctx, x):
    return x.mean(dim=tuple(range(2, x.dim())), keepdim=True)


@register("GlobalMaxPool")
def global_max_pool(ctx, x):
    return x.amax(dim=tuple(range(2, x.dim())), keepdim=True)


@register("GlobalLpPool")
def global_lp_pool(ctx, x, *, p=2):
    return x.abs().pow(p).sum(dim=tuple(range(2, x.dim())), keepdim=True).pow(1.0 / p)


@register("MaxUnpool")
def max_unpool(ctx, x, indices, output_shape=None, *, kernel_shape=None, pads=None, strides=None):
    n = x.dim() - 2
    strides = list(strides) if strides else [1] * n
    pads = list(pads) if pads else [0] * (2 * n)
    inferred = list(x.shape[:2]) + [(i - 1) * s + k - pads[d] - pads[n + d] for d, (i, s, k) in
                                    enumerate(zip(x.shape[2:], strides, kernel_shape))]
    out = torch.zeros(math.prod(inferred), dtype=x.dtype, device=x.device)
    out[indices.reshape(-1).long()] = x.reshape(-1)
    out = out.reshape(inferred)
    if output_shape is None:
        return out
    # Indices address the inferred shape; a larger output_shape pads at the end (ONNX reference).
    shape = ints(output_shape)
    return _pad_spatial(out, [0] * n, [t - i for t, i in zip(shape[2:], inferred[2:])])


@register("Col2Im")
def col2im(ctx, x, image_shape, block_shape, *, dilations=None, pads=None, strides=None):
    """Sum every column of x back onto its block position in the (padded) image."""
    image, block = ints(image_shape), ints(block_shape)
    n = len(image)
    dilations = list(dilations) if dilations else [1] * n
    strides = list(strides) if strides else [1] * n
    pads = list(pads) if pads else [0] * (2 * n)
    padded = [i + pads[d] + pads[n + d] for d, i in enumerate(image)]
    counts = [(p - (k - 1) * dl - 1) // s + 1 for p, k, dl, s in zip(padded, block, dilations, strides)]
    # target[k, l]: flat position in the padded image of block element k of column l
    kpos = np.stack(np.meshgrid(*[np.arange(k) * dl for k, dl in zip(block, dilations)],
                                indexing="ij"), 0).reshape(n, -1)
    lpos = np.stack(np.meshgrid(*[np.arange(c) * s for c, s in zip(counts, strides)],
                                indexing="ij"), 0).reshape(n, -1)
    coords = kpos[:, :, None] + lpos[:, None, :]  # [n, K, L]
    target = np.ravel_multi_index(tuple(coords), padded)
    batch, channels = x.shape[0], x.shape[1] // math.prod(block)
    cols = x.reshape(batch * channels, -1)
    out = torch.zeros(batch * channels, math.prod(padded), dtype=x.dtype, device=x.device)
    out.index_add_(1, torch.as_tensor(target.reshape(-1), device=x.device), cols)
    out = out.reshape(batch, channels, *padded)
    return _pad_spatial(out, [-p for p in pads[:n]], [-p for p in pads[n:]])


# ---------------------------------------------------------------------------------------------
# Sampling (Resize and Upsample are in resize.py)


_GRID_MODES = {"linear": "bilinear", "bilinear": "bilinear", "cubic": "bicubic",
               "bicubic": "bicubic", "nearest": "nearest"}


@register("GridSample")
def grid_sample(ctx, x, grid, *, align_corners=0, mode="linear", padding_mode="zeros"):
    # torch wants the grid in the input's dtype; its nearest rounds half to even like ONNX.
    return F.grid_sample(x, grid.to(x.dtype), mode=_GRID_MODES[mode], padding_mode=padding_mode,
                         align_corners=bool(align_corners))


@register("AffineGrid")
def affine_grid(ctx, theta, size, *, align_corners=0):
    return F.affine_grid(theta, ints(size), align_corners=bool(align_corners))
