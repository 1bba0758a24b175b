"""Convolution, pooling and sampling ops (Resize and Upsample are in resize.py).

Padding is always made explicit (ONNX allows asymmetric pads, SAME_* auto-padding and a
ceil_mode whose last window must start inside the input); the torch kernel then runs with
padding 0, so its own padding/ceil conventions never enter.
"""

from __future__ import annotations

import math

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


def _conv(x, w, b, strides, dilations, pads, group):
    n = x.dim() - 2
    x = _pad_spatial(x, pads[:n], pads[n:])
    if n in _CONV:
        return _CONV[n](x, w, b, stride=strides, dilation=dilations, groups=group)
    raise NotImplementedError(f"Conv over {n} spatial dims: kiln supports 1 to 3")


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


def _pool_geometry(x, kernel, auto_pad, ceil_mode, dilations, pads, strides):
    """Output sizes and the explicit pads that make every window lie inside the padded input.

    Returns (out_sizes, begin, end, extra): `extra` is the tail padding ceil_mode adds beyond
    the declared end pads (it never counts as padding for count_include_pad).
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


def _windows(x, kernel, strides, dilations):
    """[N, C, *padded] -> [N, C, *out, *kernel] view of every (dilated) pooling window."""
    n = x.dim() - 2
    for i in range(n):
        span = (kernel[i] - 1) * dilations[i] + 1
        x = x.unfold(2 + i, span, strides[i])
        if dilations[i] > 1:
            x = x[..., :: dilations[i]]
    return x


def _lowest(dtype):
    return -math.inf if dtype.is_floating_point else torch.iinfo(dtype).min


@register("MaxPool")
def max_pool(ctx, x, *, auto_pad="NOTSET", ceil_mode=0, dilations=None, kernel_shape=None,
             pads=None, storage_order=0, strides=None):
    n = x.dim() - 2
    kernel = list(kernel_shape)
    outs, begin, end, extra, strides, dilations = _pool_geometry(
        x, kernel, auto_pad, ceil_mode, dilations, pads, strides)
    after = [e + t for e, t in zip(end, extra)]
    if ctx.num_outputs < 2 and x.dtype.is_floating_point and n <= 3:
        pool = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}[n]
        if begin == after and all(2 * p <= k for p, k in zip(begin, kernel)):
            # Symmetric padding torch's kernel takes itself (it pads with -inf): no padded copy,
            # and the input's memory format (channels-last) is kept.
            return pool(x, kernel, strides, begin, dilations)
        return pool(_pad_spatial(x, begin, after, _lowest(x.dtype)), kernel, strides, 0, dilations)
    padded = _pad_spatial(x, begin, after, _lowest(x.dtype))
    win = _windows(padded, kernel, strides, dilations)
    flat = win.reshape(*win.shape[: 2 + n], -1)
    values, arg = flat.max(dim=-1)
    if ctx.num_outputs < 2:
        return values
    # Window-local argmax -> coordinates in the unpadded input -> ONNX flat index over N*C*spatial.
    in_sizes = list(x.shape[2:])
    rem = arg
    coords = [None] * n
    for i in reversed(range(n)):
        coords[i] = rem % kernel[i]
        rem = rem // kernel[i]
    index = torch.zeros_like(arg)
    steps = [1] * n
    if storage_order == 1:  # column-major spatial layout
        for i in range(1, n):
            steps[i] = steps[i - 1] * in_sizes[i - 1]
    else:
        for i in reversed(range(n - 1)):
            steps[i] = steps[i + 1] * in_sizes[i + 1]
    for i in range(n):
        shape = [1] * (2 + n)
        shape[2 + i] = outs[i]
        start = (torch.arange(outs[i], device=x.device) * strides[i] - begin[i]).reshape(shape)
        index = index + (start + coords[i] * dilations[i]) * steps[i]
    plane = math.prod(in_sizes)
    nc = torch.arange(x.shape[0] * x.shape[1], device=x.device).reshape(x.shape[0], x.shape[1], *[1] * n)
    return values, (index + nc * plane).to(torch.int64)


_AVG_POOL = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}


def _avg_or_lp(x, kernel, auto_pad, ceil_mode, dilations, pads, strides, count_include_pad, p):
    n = x.dim() - 2
    outs, begin, end, extra, strides, dilations = _pool_geometry(
        x, kernel, auto_pad, ceil_mode, dilations, pads, strides)
    tail = [e + t for e, t in zip(end, extra)]
    compute = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    if p is not None:
        compute = compute.abs().pow(p)
    padded = _pad_spatial(compute, begin, tail, 0.0)
    if n in _AVG_POOL and all(d == 1 for d in dilations):
        # torch's pooling kernel (no dilation support) on the explicitly padded input.
        total = _AVG_POOL[n](padded, kernel, strides) * math.prod(kernel)
    else:
        total = _windows(padded, kernel, strides, dilations).sum(dim=tuple(range(-n, 0)))
    if p is not None:
        return total.pow(1.0 / p).to(x.dtype)
    # Divisor: input cells, plus the declared pads when count_include_pad (never ceil's tail).
    ones = torch.ones((1, 1, *x.shape[2:]), dtype=compute.dtype, device=x.device)
    if count_include_pad:
        ones = _pad_spatial(ones, begin, end, 1.0)
        ones = _pad_spatial(ones, [0] * n, extra, 0.0)
    else:
        ones = _pad_spatial(ones, begin, tail, 0.0)
    if ones.shape[2:] == x.shape[2:]:  # no padding at all: every window is full
        return (total / math.prod(kernel)).to(x.dtype)
    count = _windows(ones, kernel, strides, dilations).sum(dim=tuple(range(-n, 0)))
    return (total / count).to(x.dtype)


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
