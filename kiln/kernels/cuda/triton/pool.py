"""2-D pooling for channels-last (NHWC) activations: MaxPool, AveragePool and the global mean over H, W.

    max_pool2d(x, kernel, strides, pads, dilations, ceil_mode)            ONNX MaxPool (values only)
    avg_pool2d(x, kernel, strides, pads, dilations, ceil_mode, count_include_pad)   ONNX AveragePool
    mean_hw(x, keepdims)                                                  GlobalAveragePool / ReduceMean(2, 3)

x is a 4-D [N, C, H, W] tensor in any memory layout (its strides are passed in); the kernels
are laid out for channels-last, where one pixel's channels are contiguous: a program owns a
block of output pixels x a block of channels, so every load of one tap is BLOCK_C contiguous
elements per pixel (vectorised, coalesced) and each output is written once. torch's CUDA
MaxPool on NHWC fp16 runs at ~1/8 of memory speed at ResNet-50's first pool; this reads each
input tap once per window and keeps the window's state in registers.

The pooled outputs are allocated channels-last, so a pool between two NHWC convolutions adds
no layout conversion. Arithmetic is fp32 (max compares the fp32 image of the stored value,
exact for fp16/bf16; sums accumulate in fp32) and rounds once to x's dtype. NaN follows torch:
a NaN anywhere in a max window gives NaN, and sums propagate it.

The window geometry (output size, auto_pad, ceil_mode's tail) is kiln.ops.nn's, the same
function the reference implementation uses, so the two cannot disagree about shapes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl

from kiln.kernels.cuda.triton.elementwise import FLOAT_DTYPES


@dataclass(frozen=True)
class PoolConfig:
    """Tile of one program: BLOCK_P output pixels x BLOCK_C channels (0: chosen from the shape)."""

    block_p: int = 0
    block_c: int = 0
    num_warps: int = 4


# Elements of one program's tile: 2048 fp32 accumulators over 128 threads is 16 registers each,
# with room for the loaded tap; large enough that each program moves a few KiB.
TILE = 2048
MAX_BLOCK_C = 64  # 128 B of fp16 per pixel and tap: one full cache line per row of the tile
INT8_DTYPES = (torch.int8, torch.uint8)  # max_pool2d of a quantized tensor (its max is the max of the values)


@triton.jit
def _pool2d_kernel(x_ptr, y_ptr, P, C, H, W, OH, OW, sxn, sxc, sxh, sxw, count_h_end, count_w_end,
                   KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
                   PH: tl.constexpr, PW: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr,
                   IS_MAX: tl.constexpr, COUNT_PAD: tl.constexpr, C_CONTIG: tl.constexpr, INDEX64: tl.constexpr,
                   BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    """y[n, oh, ow, c] (NHWC, dense) = max / mean of x over the window of (oh, ow).

    P = N*OH*OW output pixels. Taps outside [0, H) x [0, W) are padding: -inf for max, excluded
    from the sum. The average's divisor counts the taps inside [0, H) x [0, W), or, with
    COUNT_PAD, inside [-PH, count_h_end) x [-PW, count_w_end) — the declared pads without
    ceil_mode's tail, as ONNX defines it.
    """
    pid_p = tl.program_id(0)
    pid_c = tl.program_id(1)
    p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    if INDEX64:
        p = p.to(tl.int64)
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    p_mask = p < P
    c_mask = c < C
    ow = p % OW
    rest = p // OW
    oh = rest % OH
    n = rest // OH
    h0 = oh * SH - PH
    w0 = ow * SW - PW
    if C_CONTIG:
        c_off = c  # stride 1 known to the compiler: vectorised loads along channels
    else:
        c_off = c * sxc
    pixel_base = n * sxn
    if IS_MAX:
        acc = tl.full([BLOCK_P, BLOCK_C], float("-inf"), tl.float32)
    else:
        acc = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
        count = tl.zeros([BLOCK_P], dtype=tl.float32)
    for kh in tl.static_range(KH):
        ih = h0 + kh * DH
        h_in = (ih >= 0) & (ih < H)
        for kw in tl.static_range(KW):
            iw = w0 + kw * DW
            inside = h_in & (iw >= 0) & (iw < W)
            offs = pixel_base + ih * sxh + iw * sxw
            mask = (inside & p_mask)[:, None] & c_mask[None, :]
            ptrs = x_ptr + offs[:, None] + c_off[None, :]
            if IS_MAX:
                # padding is -inf after the conversion (an 8-bit load cannot hold it); 8-bit values are exact in fp32
                v = tl.where(mask, tl.load(ptrs, mask=mask, other=0).to(tl.float32), float("-inf"))
                # NaN wins, as in torch's kernel: (v > acc) is false for NaN on either side.
                acc = tl.where((v > acc) | (v != v), v, acc)
            else:
                acc += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
                if COUNT_PAD:
                    counted = (ih >= -PH) & (ih < count_h_end) & (iw >= -PW) & (iw < count_w_end)
                else:
                    counted = inside
                count += counted.to(tl.float32)
    if not IS_MAX:
        acc = acc / count[:, None]
    y_ptrs = y_ptr + p[:, None] * C + c[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=p_mask[:, None] & c_mask[None, :])


@triton.jit
def _mean_hw_kernel(x_ptr, y_ptr, C, HW, W, sxn, sxc, sxh, sxw, FLAT_HW: tl.constexpr, C_CONTIG: tl.constexpr,
                    BLOCK_HW: tl.constexpr, BLOCK_C: tl.constexpr):
    """y[n, c] = sum over (h, w) of x[n, c, h, w] / HW, summed in fp32. One program per (n, channel block).

    FLAT_HW: sxh == W * sxw (NHWC and NCHW dense), so pixel i sits at i * sxw without a division.
    """
    n = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = c < C
    if C_CONTIG:
        c_off = c
    else:
        c_off = c * sxc
    hw = tl.arange(0, BLOCK_HW)
    base = x_ptr + n * sxn
    acc = tl.zeros([BLOCK_HW, BLOCK_C], dtype=tl.float32)
    for start in range(0, HW, BLOCK_HW):
        i = start + hw
        if FLAT_HW:
            offs = i.to(tl.int64) * sxw
        else:
            offs = (i // W).to(tl.int64) * sxh + (i % W).to(tl.int64) * sxw
        mask = (i < HW)[:, None] & c_mask[None, :]
        acc += tl.load(base + offs[:, None] + c_off[None, :], mask=mask, other=0.0).to(tl.float32)
    total = tl.sum(acc, axis=0)
    tl.store(y_ptr + n * C + c, (total / HW).to(y_ptr.dtype.element_ty), mask=c_mask)


# ---- host side ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Geometry:
    out_h: int
    out_w: int
    pad_h: int  # begin pads
    pad_w: int
    count_h_end: int  # end of the region count_include_pad counts: H + declared end pad
    count_w_end: int
    strides: tuple[int, int]
    dilations: tuple[int, int]


@lru_cache(maxsize=256)
def _geometry(shape: tuple[int, ...], kernel: tuple[int, ...], strides: tuple[int, ...] | None,
              pads: tuple[int, ...] | None, dilations: tuple[int, ...] | None, ceil_mode: bool,
              auto_pad: str) -> _Geometry:
    """The reference's window geometry (kiln.ops.nn), once per shape: host arithmetic only."""
    from kiln.ops.nn import _pool_geometry  # the one definition of ONNX pooling geometry

    meta = torch.empty(shape, device="meta")
    outs, begin, end, _extra, st, dil = _pool_geometry(meta, list(kernel), auto_pad, int(ceil_mode),
                                                       list(dilations) if dilations else None,
                                                       list(pads) if pads else None,
                                                       list(strides) if strides else None)
    return _Geometry(outs[0], outs[1], begin[0], begin[1], shape[2] + end[0], shape[3] + end[1],
                     (st[0], st[1]), (dil[0], dil[1]))


def _check_input(x: torch.Tensor, what: str) -> None:
    if x.dim() != 4:
        raise ValueError(f"triton {what}: expected a 4-D [N, C, H, W] tensor, got shape {tuple(x.shape)}")
    if x.dtype not in FLOAT_DTYPES and not (what == "max_pool2d" and x.dtype in INT8_DTYPES):
        raise TypeError(f"triton {what}: expected a float16/bfloat16/float32 tensor (int8/uint8 for max_pool2d), "
                        f"got {x.dtype}")


def _tile(pixels: int, channels: int, config: PoolConfig) -> tuple[int, int]:
    block_c = config.block_c or min(triton.next_power_of_2(max(channels, 1)), MAX_BLOCK_C)
    block_p = config.block_p or min(max(TILE // block_c, 16), triton.next_power_of_2(max(pixels, 1)))
    return block_p, block_c


def _pool2d(x: torch.Tensor, kernel, strides, pads, dilations, ceil_mode: bool, auto_pad: str, is_max: bool,
            count_include_pad: bool, config: PoolConfig | None) -> torch.Tensor:
    what = "max_pool2d" if is_max else "avg_pool2d"
    _check_input(x, what)
    if len(kernel) != 2:
        raise ValueError(f"triton {what}: kernel {list(kernel)} is not 2-D")
    g = _geometry(tuple(x.shape), tuple(kernel), tuple(strides) if strides else None, tuple(pads) if pads else None,
                  tuple(dilations) if dilations else None, bool(ceil_mode), auto_pad or "NOTSET")
    n, c, h, w = x.shape
    if min(g.out_h, g.out_w) <= 0:
        raise ValueError(f"triton {what}: window {list(kernel)} does not fit input {tuple(x.shape)}")
    y = torch.empty((n, c, g.out_h, g.out_w), dtype=x.dtype, device=x.device, memory_format=torch.channels_last)
    pixels = n * g.out_h * g.out_w
    if pixels == 0 or c == 0:
        return y
    block_p, block_c = _tile(pixels, c, config or PoolConfig())
    last_in = sum((s - 1) * abs(st) for s, st in zip(x.shape, x.stride()))
    index64 = max(last_in, pixels * c) + (block_p + 1) * max(c, block_c) >= 2**31
    grid = (triton.cdiv(pixels, block_p), triton.cdiv(c, block_c))
    _pool2d_kernel[grid](
        x, y, pixels, c, h, w, g.out_h, g.out_w, *x.stride(), g.count_h_end, g.count_w_end,
        KH=int(kernel[0]), KW=int(kernel[1]), SH=g.strides[0], SW=g.strides[1], PH=g.pad_h, PW=g.pad_w,
        DH=g.dilations[0], DW=g.dilations[1], IS_MAX=is_max, COUNT_PAD=bool(count_include_pad),
        C_CONTIG=x.stride(1) == 1, INDEX64=index64, BLOCK_P=block_p, BLOCK_C=block_c,
        num_warps=(config or PoolConfig()).num_warps)
    return y


def max_pool2d(x: torch.Tensor, kernel, strides=None, pads=None, dilations=None, ceil_mode: bool = False,
               auto_pad: str = "NOTSET", config: PoolConfig | None = None) -> torch.Tensor:
    """ONNX MaxPool's first output for a 4-D x: [N, C, OH, OW], channels-last, x's dtype.

    pads: ONNX order [h_begin, w_begin, h_end, w_end]; None means zeros (strides/dilations: ones).
    """
    return _pool2d(x, kernel, strides, pads, dilations, ceil_mode, auto_pad, True, False, config)


def avg_pool2d(x: torch.Tensor, kernel, strides=None, pads=None, dilations=None, ceil_mode: bool = False,
               count_include_pad: bool = False, auto_pad: str = "NOTSET",
               config: PoolConfig | None = None) -> torch.Tensor:
    """ONNX AveragePool for a 4-D x: [N, C, OH, OW], channels-last, x's dtype, sum and divide in fp32."""
    return _pool2d(x, kernel, strides, pads, dilations, ceil_mode, auto_pad, False, count_include_pad, config)


MEAN_BLOCK_C = 64
MEAN_TILE = 4096  # elements summed per loop iteration by one program


def mean_hw(x: torch.Tensor, keepdims: bool = True) -> torch.Tensor:
    """The mean of x over H and W ([N, C, 1, 1] with keepdims, else [N, C]), fp32 sum, x's dtype.

    Needs H * W > 0 (the mean of nothing is the reference's business). One program per image and
    channel block walks all of H x W: ResNet/MobileNet heads (7x7) are one or a few iterations.
    """
    _check_input(x, "mean_hw")
    n, c, h, w = x.shape
    if h * w == 0:
        raise ValueError(f"triton mean_hw: empty spatial dims in {tuple(x.shape)}")
    y = torch.empty((n, c), dtype=x.dtype, device=x.device)
    if n and c:
        block_c = min(triton.next_power_of_2(c), MEAN_BLOCK_C)
        block_hw = min(triton.next_power_of_2(h * w), max(MEAN_TILE // block_c, 1))
        sxn, sxc, sxh, sxw = x.stride()
        _mean_hw_kernel[(n, triton.cdiv(c, block_c))](
            x, y, c, h * w, w, sxn, sxc, sxh, sxw, FLAT_HW=(h == 1 or sxh == w * sxw), C_CONTIG=sxc == 1,
            BLOCK_HW=block_hw, BLOCK_C=block_c, num_warps=4)
    return y.view(n, c, 1, 1) if keepdims else y


__all__ = ["PoolConfig", "max_pool2d", "avg_pool2d", "mean_hw"]
