"""A quantized stride-2 convolution of few input channels (a ResNet's 7x7/2 stem on 3 channels) as a dense
implicit GEMM, by space-to-depth.

On 3 channels the implicit GEMM's reduction is K = 7·7·3 = 147 scattered entries per output pixel, which
qconv.py's "flat" loop gathers one element at a time (3.4-3.6 ms for ResNet-50's stem at batch 256 on the
H200, where cuDNN's fp16 convolution takes 0.55: bench/results/quant-gpu-2026-12-04.md). Folding each 2x2 block
of pixels into channels makes it a stride-1 convolution whose reduction is contiguous memory:

    x_pad = x padded by the layer's pads (its zero point), to 2·Hs x 2·Ws      Hs = Ho + T − 1, T = ceil(k / 2)
    xs[n, i, j, (dy, dx, c)] = x_pad[n, c, 2i + dy, 2j + dx]    channels padded to 16 (C <= 4): [N, Hs, Ws, 16]
    ws[o, R, (S, dy, dx, c)] = w[o, c, 2R + dy, 2S + dx]        (0 beyond the k x k kernel or channel 4C)
    y[n, o, oh, ow] = Σ_R Σ_{64 bytes} xs[n, oh + R, ow .. ow + T − 1, :] · ws[o, R, :]

For T = 4 (a 7x7 or 8x8 kernel) a tap row R is 4 adjacent pixels x 16 channels = 64 contiguous bytes of xs
per output pixel: qconv.py's "taps" loop with KH = T, KW = 1, Cin = 64 and the pixel stride 16 (the rows
overlap: each pixel's 16 bytes are read by T output pixels), four 16-byte aligned K steps of 64, no masks.

Exactly the layer's arithmetic (the same products, zero-point padding included: a padded pixel holds x's zero
point, which the bias's −z·Σw correction cancels as for any padded tap); only the order of the sums differs
(exact for int8, fp32 for FP8 as every kernel here). The transform costs one pad, one fill and one strided copy
of the 8-bit input (~0.2 GB of traffic at batch 256).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton

from kiln.kernels.cuda.triton.qconv import QConvConfig, _qconv_kernel, _residual_args, _residual_values, \
    output_size
from kiln.kernels.cuda.triton.qgemm import QUANTIZED_INPUTS, Epilogue

CHANNELS = 16  # xs's channels: 2·2·C padded to 16 bytes (a 16-byte aligned pixel)


def taps_of(kernel: int) -> int:
    """T: tap rows (and pixels per row) of the space-to-depth kernel."""
    return math.ceil(kernel / 2)


def refusal(cin: int, kernel: tuple[int, int], strides: tuple[int, int], dilations: tuple[int, int],
            block_k: int) -> str | None:
    """Why a layer cannot run as a space-to-depth GEMM with K steps of block_k (None: it can)."""
    if tuple(strides) != (2, 2) or tuple(dilations) != (1, 1):
        return f"strides {list(strides)}, dilations {list(dilations)}: space-to-depth is for stride 2, dilation 1"
    if kernel[0] != kernel[1]:
        return f"a {kernel[0]}x{kernel[1]} kernel (square only)"
    if 4 * cin > CHANNELS:
        return f"{cin} input channels: 4·C must fit {CHANNELS} bytes a pixel (a stem of at most 4 channels)"
    if taps_of(kernel[0]) * CHANNELS != block_k:
        return f"a {kernel[0]}x{kernel[0]} kernel's tap row is {taps_of(kernel[0]) * CHANNELS} bytes, the K step " \
               f"{block_k}"
    return None


def pack_weight(w: torch.Tensor) -> torch.Tensor:
    """[Cout, C, k, k] int8/float8 -> [Cout, T·T·16] (ws above, K-major as qconv.pack_weight): once per layer."""
    cout, c, k, _ = w.shape
    t = taps_of(k)
    bits = F.pad(w.view(torch.uint8), (0, 2 * t - k, 0, 2 * t - k))  # zero bytes: 0 in int8 and in E4M3
    bits = bits.view(cout, c, t, 2, t, 2).permute(0, 2, 4, 3, 5, 1).reshape(cout, t, t, 4 * c)  # [o, R, S, dy·dx·c]
    bits = F.pad(bits, (0, CHANNELS - 4 * c))
    return bits.reshape(cout, t * t * CHANNELS).contiguous().view(w.dtype)


def space_to_depth(x: torch.Tensor, zero_bits: int, kernel: int, pads: tuple[int, int, int, int], ho: int,
                   wo: int) -> torch.Tensor:
    """x [N, C, H, W] (any layout) -> xs [N, Hs, Ws, 16] contiguous, x's dtype (module docstring); zero_bits: x's
    zero point as a byte (what padding and the spare channels hold)."""
    n, c, h, w = x.shape
    t = taps_of(kernel)
    hs, ws = ho + t - 1, wo + t - 1
    pt, pl = pads[0], pads[1]
    padded = F.pad(x.view(torch.uint8), (pl, 2 * ws - w - pl, pt, 2 * hs - h - pt), value=zero_bits)  # crops if < 0
    xs = torch.full((n, hs, ws, CHANNELS), zero_bits, dtype=torch.uint8, device=x.device)
    xs[..., :4 * c].unflatten(-1, (2, 2, c)).copy_(padded.view(n, c, hs, 2, ws, 2).permute(0, 2, 4, 3, 5, 1))
    return xs.view(x.dtype)


def qconv2d_space_to_depth(x: torch.Tensor, w_packed: torch.Tensor, kernel: int, epilogue: Epilogue, *,
                           x_zero: int = 0, pads: tuple[int, int, int, int] = (0, 0, 0, 0),
                           config: QConvConfig, padding: torch.Tensor | None = None) -> torch.Tensor:
    """requantize(conv2d(x − x_zero, w, stride 2)) for a k x k kernel on C <= 4 channels, NHWC out, as
    qconv.qconv2d: x [N, C, H, W] int8/uint8 (w int8) or float8e4m3fn; w_packed = pack_weight(w); pads in ONNX
    order; padding: a row of >= 64 zero points (never read: every read is inside xs)."""
    if x.dim() != 4 or x.dtype not in QUANTIZED_INPUTS:
        raise TypeError(f"triton qconv2d space-to-depth: x must be an 8-bit [N, C, H, W], got {x.dtype}"
                        f"{list(x.shape)}")
    n, c, h, w = x.shape
    t = taps_of(kernel)
    fp8 = x.dtype == torch.float8_e4m3fn
    why = refusal(c, (kernel, kernel), (2, 2), (1, 1), config.block_k)
    if why is not None:
        raise ValueError(f"triton qconv2d space-to-depth: {why}")
    if w_packed.dim() != 2 or w_packed.shape[1] != t * t * CHANNELS or \
            w_packed.dtype != (torch.float8_e4m3fn if fp8 else torch.int8):
        raise ValueError(f"triton qconv2d space-to-depth: the weight must be pack_weight(w): [Cout, {t * t * CHANNELS}] "
                         f"{'float8e4m3fn' if fp8 else 'int8'}, got {w_packed.dtype}{list(w_packed.shape)}")
    cout = w_packed.shape[0]
    epilogue.check(cout)
    pt, pl, pb, pr = pads
    ho, wo = output_size(h, kernel, 2, pt, pb, 1), output_size(w, kernel, 2, pl, pr, 1)
    if ho <= 0 or wo <= 0:
        raise ValueError(f"triton qconv2d space-to-depth: a {kernel}x{kernel} kernel does not fit a padded {h}x{w} input")
    out = torch.empty((n, ho, wo, cout), dtype=epilogue.out_dtype, device=x.device).permute(0, 3, 1, 2)
    if out.numel() == 0:
        return out
    zero_bits = int(torch.tensor(x_zero, dtype=torch.float32).to(x.dtype).view(torch.uint8)) if not fp8 else 0
    xs = space_to_depth(x, zero_bits, kernel, pads, ho, wo)  # [N, Hs, Ws, 16]
    if padding is None or padding.dtype != x.dtype or padding.numel() < t * CHANNELS:
        padding = xs.reshape(-1)[: t * CHANNELS]  # any readable bytes: no tap reads outside xs
    m = n * ho * wo
    qmin, qmax = epilogue.qrange
    bias = epilogue.bias if epilogue.bias is not None else epilogue.scale
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(cout, config.block_n),)
    hs, ws = xs.shape[1], xs.shape[2]
    _qconv_kernel[grid](
        xs, padding, w_packed, bias, epilogue.scale, out, out,
        m, cout, t * CHANNELS, hs, ws, ho, wo, xs.stride(0), xs.stride(1), xs.stride(2),
        1, 1, 0, 0, 1, 1, float(epilogue.y_scale), float(epilogue.y_zero),
        float(epilogue.alpha), float(epilogue.beta), *_residual_values(None),
        KH=t, KW=1, LOOP="taps", EVEN_K=True, FP8=fp8, FP8_PRECISE=config.fp8_precise,
        X_UNSIGNED=x.dtype == torch.uint8, HAS_BIAS=epilogue.bias is not None, PRESCALED=epilogue.prescaled,
        MMA_F16=False, ACTIVATION=epilogue.activation, OUT=epilogue.out_kind, QMIN=qmin, QMAX=qmax,
        **_residual_args(None), BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, GROUP_M=config.group_m, num_warps=config.num_warps, num_stages=config.num_stages)
    return out
