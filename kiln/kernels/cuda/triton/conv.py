"""A Triton 2-D convolution as an implicit GEMM, kiln's epilogue fused (kiln::FusedConv).

    out[n, co, oh, ow] = act(Σ_{r,s,c} x[n, c, oh·SH - PT + r·DH, ow·SW - PL + s·DW]·w[co, c, r, s] + bias[co]),
                         the residual added before or after act

seen as one GEMM: rows M = N·Ho·Wo output pixels, columns N = Cout, reduction K = KH·KW·Cin.
No im2col buffer is written: each program gathers its [BLOCK_M, BLOCK_K] tile of the virtual
im2col matrix straight from x (NHWC: a tile row is BLOCK_K consecutive channels of one input
pixel, a contiguous read), with the padding as masked-off lanes. The weight is laid out once,
at prepare, as a dense [KH·KW·Cin, Cout] matrix (`pack_weight`), whose row (r, s, c) is the
K index of the loop, so its [BLOCK_K, BLOCK_N] tile is a plain strided block.

Two K loops, chosen per layer (a constexpr):
  - by tap (Cin ≥ BLOCK_K): one flat loop over (tap, channel block). A tap's input coordinates
    and padding mask are per row ([BLOCK_M]); only the channel offset varies along K. The loop is
    flat, not nested, so Triton's software pipelining sees every iteration (a nested tap loop
    with a 1-iteration channel loop, 3x3 at Cin = 64, would never overlap loads with MMAs).
  - flat K (Cin < BLOCK_K, the 7x7 stem's Cin = 3): each K index decomposed into (r, s, c) per
    element, so a tile spans several taps: the stem's 147 K entries fill 3 tiles of 64, where a
    tap per step would take 49 tiles of 3 real channels and 61 padding lanes.
fp16/bf16 operands feed tl.dot with fp32 accumulation (tensor cores: wgmma on sm_90); fp32
operands multiply in full fp32 (input_precision "ieee") unless allow_tf32. The epilogue
(bias, activation of device_math, residual before or after it) runs on the fp32 tile in
registers before its one store; the output is NHWC ([N, Cout, Ho, Wo] with channels-last strides).

The tile config is a tactic parameter: kiln/tactics/cuda/conv.py registers CONV_CONFIGS as
separate tactics and the autotuner keeps the fastest (kiln's timing cache, not triton.autotune).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kiln.kernels.cuda.triton import device_math as dm
from kiln.kernels.cuda.triton.elementwise import FLOAT_DTYPES
from kiln.kernels.cuda.triton.epilogue import bias_activation


@dataclass(frozen=True)
class ConvConfig:
    block_m: int  # output pixels per tile
    block_n: int  # output channels per tile
    block_k: int  # reduction entries per step (input channels of one tap, or flat (r, s, c))
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3

    @property
    def name(self) -> str:
        return f"{self.block_m}x{self.block_n}x{self.block_k}"


CONV_CONFIGS = (  # largest first; the tactics register these (kiln/tactics/cuda/conv.py)
    ConvConfig(256, 128, 64, num_warps=8, num_stages=3),
    ConvConfig(128, 128, 64, num_warps=8, num_stages=3),
    ConvConfig(128, 64, 64, num_warps=4, num_stages=4),
    ConvConfig(64, 128, 32, num_warps=4, num_stages=4),
    ConvConfig(64, 64, 64, num_warps=4, num_stages=4),  # batch 1: the 7x7 and 14x14 stages have M = 49, 196
)


@triton.jit
def _conv_kernel(x_ptr, w_ptr, bias_ptr, res_ptr, out_ptr,
                 M, Cout, Cin, H, W, Ho, Wo,
                 sxn, sxc, sxh, sxw, srn, src, srh, srw,
                 SH, SW, PT, PL, DH, DW, alpha, beta,
                 KH: tl.constexpr, KW: tl.constexpr, FLAT_K: tl.constexpr,
                 HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ACTIVATION: tl.constexpr, RES_AFTER: tl.constexpr,
                 INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    tile_m, tile_n = dm.grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(Cout, BLOCK_N), GROUP_M)

    rm = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)  # output pixels: [BM]
    rn = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)  # output channels: [BN]
    rk = tl.arange(0, BLOCK_K)  # [BK]
    row_ok = rm < M
    col_ok = rn < Cout
    # output pixel -> (batch, oh, ow) -> the input position of tap (0, 0); rows past M read nothing
    ow = rm % Wo
    oh = (rm // Wo) % Ho
    nb = rm // (Wo * Ho)
    ih0 = oh * SH - PT  # [BM]
    iw0 = ow * SW - PL
    x_rows = x_ptr + nb.to(tl.int64) * sxn  # [BM] pointers to each row's image

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if FLAT_K:
        # K index k = (r·KW + s)·Cin + c decomposed per element: small Cin packs several taps per tile
        K = KH * KW * Cin
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk  # [BK]
            c = kk % Cin
            tap = kk // Cin
            r = tap // KW
            s = tap % KW
            ih = ih0[:, None] + (r * DH)[None, :]  # [BM, BK]
            iw = iw0[:, None] + (s * DW)[None, :]
            a_ok = row_ok[:, None] & (kk < K)[None, :] & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
            a = tl.load(x_rows[:, None] + ih * sxh + iw * sxw + c[None, :] * sxc, mask=a_ok, other=0.0)
            b = tl.load(w_ptr + kk[:, None].to(tl.int64) * Cout + rn[None, :],
                        mask=(kk < K)[:, None] & col_ok[None, :], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
    else:
        # one flat loop over (tap, channel block): the whole reduction is one pipelined loop
        c_blocks = tl.cdiv(Cin, BLOCK_K)
        for step in range(0, KH * KW * c_blocks):
            tap = step // c_blocks
            c = (step % c_blocks) * BLOCK_K + rk  # [BK] input channels of this step
            r = tap // KW
            s = tap % KW
            ih = ih0 + r * DH  # [BM]
            iw = iw0 + s * DW
            pixel_ok = row_ok & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)  # padding: masked lanes read 0
            c_ok = c < Cin
            a = tl.load((x_rows + ih * sxh + iw * sxw)[:, None] + c[None, :] * sxc,
                        mask=pixel_ok[:, None] & c_ok[None, :], other=0.0)
            w_rows = (tap * Cin + c).to(tl.int64) * Cout  # [BK]: row (r, s, c) of the packed weight
            b = tl.load(w_ptr + w_rows[:, None] + rn[None, :], mask=c_ok[:, None] & col_ok[None, :], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)

    # epilogue, on the fp32 tile in registers
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    residual = acc
    if HAS_RES:  # any strides (broadcast dims have stride 0): no copy of a residual in another layout
        res_offs = (nb.to(tl.int64) * srn + oh * srh + ow * srw)[:, None] + rn[None, :] * src
        residual = tl.load(res_ptr + res_offs, mask=mask, other=0.0).to(tl.float32)
    acc = dm.epilogue(acc, residual, ACTIVATION, alpha, beta, HAS_RES, RES_AFTER)
    out_offs = rm[:, None].to(tl.int64) * Cout + rn[None, :]  # NHWC: [M, Cout] row-major
    tl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def pack_weight(w: torch.Tensor) -> torch.Tensor:
    """[Cout, Cin, KH, KW] -> [KH·KW·Cin, Cout] contiguous: row (r·KW + s)·Cin + c is the kernel's K index.
    Done once per layer (the tactic's prepare), not per launch."""
    if w.dim() != 4:
        raise ValueError(f"triton conv2d: weight must be [Cout, Cin, KH, KW], got {tuple(w.shape)}")
    cout, cin, kh, kw = w.shape
    return w.permute(2, 3, 1, 0).reshape(kh * kw * cin, cout).contiguous()


def output_size(size: int, kernel: int, stride: int, pad_begin: int, pad_end: int, dilation: int) -> int:
    return (size + pad_begin + pad_end - dilation * (kernel - 1) - 1) // stride + 1


def conv2d(x: torch.Tensor, w_packed: torch.Tensor, kernel: tuple[int, int], bias: torch.Tensor | None = None,
           residual: torch.Tensor | None = None, *, strides: tuple[int, int] = (1, 1),
           pads: tuple[int, int, int, int] = (0, 0, 0, 0), dilations: tuple[int, int] = (1, 1),
           activation: str = "", alpha: float = 0.0, beta: float = 0.0, residual_after_activation: bool = False,
           config: ConvConfig | None = None, allow_tf32: bool = False) -> torch.Tensor:
    """act(conv2d(x, w) + bias [+ residual]) [+ residual], groups = 1, in x's dtype, NHWC out.

    x: [N, Cin, H, W], any strides (channels-last reads coalesce; others are correct, slower);
    w_packed: pack_weight(w) of w [Cout, Cin, KH, KW]; kernel: (KH, KW); pads: ONNX order
    (top, left, bottom, right), asymmetric allowed; bias: [Cout]; residual: broadcastable to the
    output [N, Cout, Ho, Wo], any strides. fp32 multiplies in full fp32 unless allow_tf32.
    Returns [N, Cout, Ho, Wo] with channels-last strides.
    """
    if activation not in dm.ACTIVATIONS:
        raise ValueError(f"triton conv2d: unknown activation {activation!r} (known: {dm.ACTIVATIONS})")
    if x.dtype not in FLOAT_DTYPES or w_packed.dtype != x.dtype:
        raise TypeError(f"triton conv2d: x and w must share a float16/bfloat16/float32 dtype, "
                        f"got {x.dtype} and {w_packed.dtype}")
    kh, kw = kernel
    if x.dim() != 4:
        raise ValueError(f"triton conv2d: x must be [N, C, H, W], got {tuple(x.shape)}")
    n, cin, h, wd = x.shape
    if w_packed.dim() != 2 or w_packed.shape[0] != kh * kw * cin or not w_packed.is_contiguous():
        raise ValueError(f"triton conv2d: x {tuple(x.shape)} with a {kh}x{kw} kernel needs the packed weight "
                         f"as a contiguous [{kh * kw * cin}, Cout], got {tuple(w_packed.shape)}")
    cout = w_packed.shape[1]
    (sh, sw), (pt, pl, pb, pr), (dh, dw) = strides, pads, dilations
    ho, wo = output_size(h, kh, sh, pt, pb, dh), output_size(wd, kw, sw, pl, pr, dw)
    if ho <= 0 or wo <= 0:
        raise ValueError(f"triton conv2d: a {kh}x{kw} kernel (dilation {dh}x{dw}) does not fit a padded "
                         f"{h}x{wd} input")
    out = torch.empty((n, ho, wo, cout), dtype=x.dtype, device=x.device).permute(0, 3, 1, 2)  # NHWC strides
    m = n * ho * wo
    if out.numel() == 0:
        return out
    if bias is not None:
        if bias.numel() != cout:
            raise ValueError(f"triton conv2d: bias has {bias.numel()} elements, expected Cout = {cout}")
        bias = bias.reshape(-1).contiguous()
    if residual is not None:
        residual = residual.expand(out.shape)  # a view: broadcast dims read with stride 0
    if config is None:
        config = next((c for c in CONV_CONFIGS if c.block_m <= max(m, 16) and c.block_n <= max(cout, 16)),
                      CONV_CONFIGS[-1])
    if cin == 0:  # an empty sum: the epilogue alone, on zeros
        return bias_activation(out.zero_(), bias, residual, activation=activation, alpha=alpha, beta=beta,
                               residual_after_activation=residual_after_activation, axis=1, inplace=True)
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(cout, config.block_n),)
    precision = "tf32" if allow_tf32 and x.dtype == torch.float32 else "ieee"
    res = residual if residual is not None else out
    _conv_kernel[grid](
        x, w_packed, bias if bias is not None else w_packed, res, out,
        m, cout, cin, h, wd, ho, wo,
        x.stride(0), x.stride(1), x.stride(2), x.stride(3), res.stride(0), res.stride(1), res.stride(2), res.stride(3),
        sh, sw, pt, pl, dh, dw, float(alpha), float(beta),
        KH=kh, KW=kw, FLAT_K=cin < config.block_k, HAS_BIAS=bias is not None, HAS_RES=residual is not None,
        ACTIVATION=activation, RES_AFTER=bool(residual_after_activation), INPUT_PRECISION=precision,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        num_warps=config.num_warps, num_stages=config.num_stages)
    return out
