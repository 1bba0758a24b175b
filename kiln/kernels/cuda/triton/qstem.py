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
(exact for int8, fp32 for FP8 as every kernel here). The fold is one Triton pass (it was torch's pad, fill and
strided copy: three passes, ~0.2 GB of traffic at batch 256), which can also quantize a float image on the way:
a graph's input QuantizeLinear folded into the stem (kiln/passes/fusion/qdq_layers.py) reads the image once.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kiln.kernels.cuda.triton import qmath
from kiln.kernels.cuda.triton.qconv import QConvConfig, _qconv_kernel, _residual_args, _residual_values, \
    output_size
from kiln.kernels.cuda.triton.qgemm import INT_RANGE, QUANTIZED_INPUTS, Epilogue

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


@triton.jit
def _space_to_depth_kernel(x_ptr, xs_ptr, P, H, W, HS, WS, sxn, sxc, sxh, sxw, pad_top, pad_left, pad_value,
                           x_scale, x_zero, C: tl.constexpr, QUANTIZE: tl.constexpr, OUT: tl.constexpr,
                           QMIN: tl.constexpr, QMAX: tl.constexpr, HARDWARE_E4M3: tl.constexpr,
                           INDEX64: tl.constexpr, BLOCK_P: tl.constexpr):
    """xs[p, k] (p = (n, i, j) of [N, Hs, Ws], k < 16) = x_pad[n, c, 2i + dy, 2j + dx] for k = (dy·2 + dx)·C + c,
    pad_value beyond x and for k >= 4·C. QUANTIZE: x is float, quantized on the way (ONNX QuantizeLinear:
    x / x_scale as an IEEE division, round half to even, + x_zero, saturated: qmath's, as the quantize kernel);
    else x and xs are 8-bit, moved as bytes. Writes are 16 contiguous bytes a pixel; reads gather x's taps."""
    pid = tl.program_id(0)
    if INDEX64:
        pid = pid.to(tl.int64)
    p = pid * BLOCK_P + tl.arange(0, BLOCK_P)
    k = tl.arange(0, 16)
    j = p % WS
    rest = p // WS
    i = rest % HS
    n = rest // HS
    c = k % C
    dx = (k // C) % 2
    dy = k // (2 * C)
    row = 2 * i[:, None] + dy[None, :] - pad_top  # [BLOCK_P, 16]
    col = 2 * j[:, None] + dx[None, :] - pad_left
    inside = (row >= 0) & (row < H) & (col >= 0) & (col < W) & (k < 4 * C)[None, :] & (p < P)[:, None]
    ptrs = x_ptr + n[:, None] * sxn + c[None, :] * sxc + row * sxh + col * sxw
    if QUANTIZE:
        v = tl.load(ptrs, mask=inside, other=0.0).to(tl.float32)
        v = qmath.requantize(v, x_scale, x_zero, 0.0, 0.0, "", OUT, QMIN, QMAX, HARDWARE_E4M3)
        v = tl.where(inside, v, pad_value)
    else:
        v = tl.load(ptrs, mask=inside, other=pad_value)
    tl.store(xs_ptr + p[:, None] * 16 + k[None, :], v.to(xs_ptr.dtype.element_ty), mask=(p < P)[:, None])


S2D_BLOCK = 256  # pixels a program: 4 KiB of xs


def space_to_depth(x: torch.Tensor, zero_bits: int, kernel: int, pads: tuple[int, int, int, int], ho: int,
                   wo: int, quantize: tuple[float, float, torch.dtype] | None = None) -> torch.Tensor:
    """x [N, C, H, W] (any layout) -> xs [N, Hs, Ws, 16] contiguous (module docstring), in one pass: zero_bits, x's
    zero point as a byte, is what padding and the spare channels hold. x 8-bit: xs has its dtype. quantize =
    (x_scale, x_zero, 8-bit dtype): x is float, and xs holds QuantizeLinear(x) (the stem's input quantization and
    its relayout in one read of the image: ResNet-50's batch 256 reads 154 MB of fp32 once, writes 54 MB)."""
    n, c, h, w = x.shape
    if c > CHANNELS // 4:
        raise ValueError(f"triton space_to_depth: {c} channels, at most {CHANNELS // 4} fold into {CHANNELS} bytes")
    t = taps_of(kernel)
    hs, ws = ho + t - 1, wo + t - 1
    if quantize is None:
        if x.dtype not in QUANTIZED_INPUTS:
            raise TypeError(f"triton space_to_depth: x is 8-bit without quantize=(scale, zero, dtype), got {x.dtype}")
        out_dtype, source = x.dtype, x.view(torch.uint8)
        xs = torch.empty((n, hs, ws, CHANNELS), dtype=torch.uint8, device=x.device)
        pad_value, scale, zero, kind, qmin, qmax = float(zero_bits), 1.0, 0.0, qmath.OUT_INT, 0, 255
    else:
        scale, zero, out_dtype = quantize
        if not x.is_floating_point() or x.dtype in QUANTIZED_INPUTS or out_dtype not in QUANTIZED_INPUTS:
            raise TypeError(f"triton space_to_depth: quantizes a float x to an 8-bit type, got {x.dtype} -> "
                            f"{out_dtype}")
        source = x
        xs = torch.empty((n, hs, ws, CHANNELS), dtype=out_dtype, device=x.device)
        fp8 = out_dtype == torch.float8_e4m3fn
        kind = qmath.OUT_FP8 if fp8 else qmath.OUT_INT
        qmin, qmax = INT_RANGE.get(out_dtype, (0, 0))
        pad_value = 0.0 if fp8 else float(zero)
    pixels = n * hs * ws
    if pixels:
        last = sum((s - 1) * abs(st) for s, st in zip(x.shape, x.stride()))
        index64 = max(last, pixels * CHANNELS) + S2D_BLOCK * CHANNELS >= 2**31
        _space_to_depth_kernel[(triton.cdiv(pixels, S2D_BLOCK),)](
            source, xs, pixels, h, w, hs, ws, *x.stride(), pads[0], pads[1], pad_value, float(scale), float(zero),
            C=c, QUANTIZE=quantize is not None, OUT=kind, QMIN=qmin, QMAX=qmax,
            HARDWARE_E4M3=x.is_cuda, INDEX64=index64, BLOCK_P=S2D_BLOCK, num_warps=4)
    return xs.view(out_dtype)


def space_to_depth_torch(x: torch.Tensor, zero_bits: int, kernel: int, pads: tuple[int, int, int, int], ho: int,
                         wo: int) -> torch.Tensor:
    """space_to_depth of an 8-bit x in torch (pad, fill, strided copy: three passes): the tests' second opinion."""
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
                           config: QConvConfig, padding: torch.Tensor | None = None,
                           quantize: tuple[float, torch.dtype] | None = None) -> torch.Tensor:
    """requantize(conv2d(x − x_zero, w, stride 2)) for a k x k kernel on C <= 4 channels, NHWC out, as
    qconv.qconv2d: x [N, C, H, W] int8/uint8 (w int8) or float8e4m3fn; w_packed = pack_weight(w); pads in ONNX
    order; padding: a row of >= 64 zero points (never read: every read is inside xs). quantize = (x_scale, 8-bit
    dtype): x is float and the layer reads QuantizeLinear(x; x_scale, x_zero), quantized as it is folded."""
    x_type = x.dtype if quantize is None else quantize[1]
    if x.dim() != 4 or x_type not in QUANTIZED_INPUTS or (quantize is not None and not x.is_floating_point()):
        raise TypeError(f"triton qconv2d space-to-depth: x must be an 8-bit [N, C, H, W] (a float one with "
                        f"quantize=(scale, dtype)), got {x.dtype}{list(x.shape)}")
    n, c, h, w = x.shape
    t = taps_of(kernel)
    fp8 = x_type == torch.float8_e4m3fn
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
    zero_bits = int(torch.tensor(x_zero, dtype=torch.float32).to(x_type).view(torch.uint8)) if not fp8 else 0
    xs = space_to_depth(x, zero_bits, kernel, pads, ho, wo,
                        None if quantize is None else (quantize[0], x_zero, x_type))  # [N, Hs, Ws, 16]
    if padding is None or padding.dtype != x_type or padding.numel() < t * CHANNELS:
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
        X_UNSIGNED=x_type == torch.uint8, HAS_BIAS=epilogue.bias is not None, PRESCALED=epilogue.prescaled,
        MMA_F16=False, ACTIVATION=epilogue.activation, OUT=epilogue.out_kind, QMIN=qmin, QMAX=qmax,
        **_residual_args(None), BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, GROUP_M=config.group_m, num_warps=config.num_warps, num_stages=config.num_stages)
    return out
