"""bench/qconv_sweep.py's baseline: kiln's int8/fp8 implicit-GEMM convolution as it was at c7332ab (the
`cuda.qconv.triton_igemm.*` tactics that ran ResNet-50 INT8 at 19.2 ms, bench/results/quant-gpu-2026-12-01.md),
kept verbatim below this docstring so that the sweep times the old and the new kernels in one run. Not used by kiln.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kiln.kernels.cuda.triton import device_math as dm
from kiln.kernels.cuda.triton import qmath
from kiln.kernels.cuda.triton.qgemm import QUANTIZED_INPUTS, Epilogue


@dataclass(frozen=True)
class QConvConfig:
    block_m: int  # output pixels per tile
    block_n: int  # output channels per tile
    block_k: int  # reduction entries per step
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3

    @property
    def name(self) -> str:
        return f"{self.block_m}x{self.block_n}x{self.block_k}"


QCONV_CONFIGS = (  # largest first; BLOCK_K 64 keeps ResNet's Cin = 64 layers on the by-tap loop
    QConvConfig(256, 128, 64, num_warps=8, num_stages=4),
    QConvConfig(128, 128, 128, num_warps=8, num_stages=3),
    QConvConfig(128, 128, 64, num_warps=8, num_stages=4),
    QConvConfig(128, 64, 64, num_warps=4, num_stages=4),
    QConvConfig(64, 64, 64, num_warps=4, num_stages=4),  # batch 1: 7x7 and 14x14 stages
)


@triton.jit
def _qconv_kernel(x_ptr, w_ptr, bias_ptr, scale_ptr, out_ptr,
                  M, Cout, Cin, H, W, Ho, Wo, sxn, sxc, sxh, sxw,
                  SH, SW, PT, PL, DH, DW, pad, y_scale, y_zero, alpha, beta,
                  KH: tl.constexpr, KW: tl.constexpr, FLAT_K: tl.constexpr, FP8: tl.constexpr,
                  X_UNSIGNED: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, OUT: tl.constexpr,
                  QMIN: tl.constexpr, QMAX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    tile_m, tile_n = dm.grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(Cout, BLOCK_N), GROUP_M)
    rm = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)  # output pixels: [BM]
    rn = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)  # output channels: [BN]
    rk = tl.arange(0, BLOCK_K)  # [BK]
    row_ok = rm < M
    col_ok = rn < Cout
    ow = rm % Wo
    oh = (rm // Wo) % Ho
    nb = rm // (Wo * Ho)
    ih0 = oh * SH - PT  # [BM]
    iw0 = ow * SW - PL
    x_rows = x_ptr + nb.to(tl.int64) * sxn  # [BM]
    K = KH * KW * Cin
    w_cols = w_ptr + rn.to(tl.int64) * K  # [BN]: row co of the packed [Cout, K] weight
    if FP8:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        pad_value = 0.0  # float8's zero point is 0
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
        pad_value = pad  # x's own zero point: a padded tap contributes (z - z)·w = 0
    if FLAT_K:
        # K index k = (r·KW + s)·Cin + c decomposed per element: small Cin packs several taps per tile
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk  # [BK]
            k_ok = kk < K
            c = kk % Cin
            tap = kk // Cin
            ih = ih0[:, None] + ((tap // KW) * DH)[None, :]  # [BM, BK]
            iw = iw0[:, None] + ((tap % KW) * DW)[None, :]
            inside = (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
            a = tl.load(x_rows[:, None] + ih * sxh + iw * sxw + c[None, :] * sxc,
                        mask=row_ok[:, None] & k_ok[None, :] & inside, other=pad_value)
            b = tl.load(w_cols[None, :] + kk[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0 if FP8 else 0)
            if FP8:
                acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
            else:
                if X_UNSIGNED:
                    a = (a.to(tl.int32) - 128).to(tl.int8)
                acc = tl.dot(a, b, acc, out_dtype=tl.int32)
    else:
        c_blocks = tl.cdiv(Cin, BLOCK_K)
        for step in range(0, KH * KW * c_blocks):
            tap = step // c_blocks
            c = (step % c_blocks) * BLOCK_K + rk  # [BK] input channels of this step
            ih = ih0 + (tap // KW) * DH  # [BM]
            iw = iw0 + (tap % KW) * DW
            inside = (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
            c_ok = c < Cin
            a = tl.load((x_rows + ih * sxh + iw * sxw)[:, None] + c[None, :] * sxc,
                        mask=(row_ok & inside)[:, None] & c_ok[None, :], other=pad_value)
            b = tl.load(w_cols[None, :] + (tap * Cin + c)[:, None], mask=c_ok[:, None] & col_ok[None, :],
                        other=0.0 if FP8 else 0)
            if FP8:
                acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
            else:
                if X_UNSIGNED:
                    a = (a.to(tl.int32) - 128).to(tl.int8)
                acc = tl.dot(a, b, acc, out_dtype=tl.int32)

    scale = tl.load(scale_ptr + rn, mask=col_ok, other=0.0)[None, :]  # [1, BN]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + rn, mask=col_ok, other=0)[None, :]
    else:
        bias = scale  # not read
    y = qmath.finish(acc, bias, scale, y_scale, y_zero, alpha, beta, HAS_BIAS, ACTIVATION, OUT, QMIN, QMAX)
    offs = rm[:, None].to(tl.int64) * Cout + rn[None, :]  # NHWC: [M, Cout] row-major
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def pack_weight(w: torch.Tensor) -> torch.Tensor:
    """[Cout, Cin, KH, KW] -> [Cout, KH·KW·Cin] contiguous (K-major): column (r·KW + s)·Cin + c is the
    kernel's K index. Once per layer, at prepare."""
    if w.dim() != 4:
        raise ValueError(f"triton qconv2d: weight must be [Cout, Cin, KH, KW], got {tuple(w.shape)}")
    cout, cin, kh, kw = w.shape
    return w.permute(0, 2, 3, 1).reshape(cout, kh * kw * cin).contiguous()


def output_size(size: int, kernel: int, stride: int, pad_begin: int, pad_end: int, dilation: int) -> int:
    return (size + pad_begin + pad_end - dilation * (kernel - 1) - 1) // stride + 1


def qconv2d(x: torch.Tensor, w_packed: torch.Tensor, kernel: tuple[int, int], epilogue: Epilogue, *,
            x_zero: int = 0, strides: tuple[int, int] = (1, 1), pads: tuple[int, int, int, int] = (0, 0, 0, 0),
            dilations: tuple[int, int] = (1, 1), config: QConvConfig | None = None) -> torch.Tensor:
    """requantize(conv2d(x − x_zero, w)), groups 1, NHWC out.

    x: [N, Cin, H, W] int8/uint8 (w int8) or float8e4m3fn (w float8e4m3fn), any strides (NHWC reads
    coalesce); w_packed: pack_weight(w); x_zero: x's zero point (what padding reads; the correction
    for the rest is in epilogue.bias, qgemm.fold_zero_point); pads in ONNX order (top, left, bottom,
    right). Returns [N, Cout, Ho, Wo] with channels-last strides in epilogue.out_dtype.
    """
    fp8 = x.dtype == torch.float8_e4m3fn
    if x.dtype not in QUANTIZED_INPUTS or w_packed.dtype != (torch.float8_e4m3fn if fp8 else torch.int8):
        raise TypeError(f"triton qconv2d: x int8/uint8 with w int8, or both float8e4m3fn; got {x.dtype}, "
                        f"{w_packed.dtype}")
    if x.dim() != 4:
        raise ValueError(f"triton qconv2d: x must be [N, C, H, W], got {tuple(x.shape)}")
    kh, kw = kernel
    n, cin, h, wd = x.shape
    if w_packed.dim() != 2 or w_packed.shape[1] != kh * kw * cin or not w_packed.is_contiguous():
        raise ValueError(f"triton qconv2d: x {tuple(x.shape)} with a {kh}x{kw} kernel needs the packed weight as a "
                         f"contiguous [Cout, {kh * kw * cin}], got {tuple(w_packed.shape)}")
    cout = w_packed.shape[0]
    epilogue.check(cout)
    if epilogue.bias is not None and epilogue.bias.dtype != (torch.float32 if fp8 else torch.int32):
        raise TypeError(f"triton qconv2d: the bias of an {'fp8' if fp8 else 'int8'} layer is "
                        f"{'float32' if fp8 else 'int32'}, got {epilogue.bias.dtype}")
    (sh, sw), (pt, pl, pb, pr), (dh, dw) = strides, pads, dilations
    ho, wo = output_size(h, kh, sh, pt, pb, dh), output_size(wd, kw, sw, pl, pr, dw)
    if ho <= 0 or wo <= 0:
        raise ValueError(f"triton qconv2d: a {kh}x{kw} kernel (dilation {dh}x{dw}) does not fit a padded {h}x{wd} input")
    out = torch.empty((n, ho, wo, cout), dtype=epilogue.out_dtype, device=x.device).permute(0, 3, 1, 2)
    m = n * ho * wo
    if out.numel() == 0:
        return out
    if config is None:
        config = next((c for c in QCONV_CONFIGS if c.block_m <= max(m, 16) and c.block_n <= max(cout, 16)),
                      QCONV_CONFIGS[-1])
    qmin, qmax = epilogue.qrange
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(cout, config.block_n),)
    _qconv_kernel[grid](
        x, w_packed, epilogue.bias if epilogue.bias is not None else epilogue.scale, epilogue.scale, out,
        m, cout, cin, h, wd, ho, wo, x.stride(0), x.stride(1), x.stride(2), x.stride(3),
        sh, sw, pt, pl, dh, dw, int(x_zero), float(epilogue.y_scale), float(epilogue.y_zero),
        float(epilogue.alpha), float(epilogue.beta),
        KH=kh, KW=kw, FLAT_K=cin < config.block_k, FP8=fp8, X_UNSIGNED=x.dtype == torch.uint8,
        HAS_BIAS=epilogue.bias is not None, ACTIVATION=epilogue.activation, OUT=epilogue.out_kind, QMIN=qmin,
        QMAX=qmax, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        num_warps=config.num_warps, num_stages=config.num_stages)
    return out
