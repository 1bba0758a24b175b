"""One-pass elementwise kernels around kiln's quantized layers (kiln/ops/quantized.py):

    requantize(acc, epilogue, axis)   a library GEMM/conv's output (cuBLASLt's int32 from torch._int_mm,
                                      _scaled_mm's fp32, a float conv on dequantized values) -> the
                                      layer's output: (acc + bias[c])·scale[c], Relu/Clip, quantized
    dequantize(x, scale, zero, dtype) (x − zero)·scale of an 8-bit tensor, in x's layout
    quantize(x, scale, zero, dtype)   ONNX QuantizeLinear (per tensor, saturating) of a float tensor, in x's layout
    qadd(a, ..., b, ...)              kiln::QAdd: act(s_a·(a − z_a) + s_b·(b − z_b)) quantized (or float)

Each reads its inputs once and writes once: torch would take three to six passes over memory for
the same (convert, subtract, multiply, add, round, clamp, convert). Rounding and saturation are
qmath's (exact in the interpreter and on the GPU alike). Outputs keep the memory order of the
(first) input, so channels-last activations stay channels-last.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.cuda.triton import qmath
from kiln.kernels.cuda.triton.qgemm import INT_RANGE, OUTPUTS, QUANTIZED_INPUTS, Epilogue
from kiln.kernels.cuda.triton.qresidual import float32

BLOCK = 1024
SAME_LAYOUT_BLOCK = 4096  # 16 elements per thread at 8 warps: 16-byte loads of 8-bit values
_RANK = 4  # qadd's broadcasting walks up to 4 dims


def _memory_order(t: torch.Tensor) -> list[int]:
    """t's dims outermost-first in memory (identity for a contiguous tensor)."""
    return sorted(range(t.dim()), key=lambda d: -t.stride(d))


def _dense(t: torch.Tensor) -> bool:
    """Whether t's elements fill [data_ptr, data_ptr + numel) exactly once (some permutation of it is contiguous)."""
    return t.permute(_memory_order(t)).is_contiguous()


def _out_kind(dtype: torch.dtype) -> int:
    if dtype in INT_RANGE:
        return qmath.OUT_INT
    return qmath.OUT_FP8 if dtype == torch.float8_e4m3fn else qmath.OUT_FLOAT


@triton.jit
def _requantize_kernel(acc_ptr, bias_ptr, scale_ptr, out_ptr, numel, inner, channels, y_scale, y_zero, alpha, beta,
                       HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, OUT: tl.constexpr, QMIN: tl.constexpr,
                       QMAX: tl.constexpr, INDEX64: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    if INDEX64:
        pid = pid.to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    channel = (offs // inner) % channels
    acc = tl.load(acc_ptr + offs, mask=mask, other=0)
    scale = tl.load(scale_ptr + channel, mask=mask, other=0.0)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + channel, mask=mask, other=0)
    else:
        bias = scale  # not read
    y = qmath.finish(acc, bias, scale, y_scale, y_zero, alpha, beta, HAS_BIAS, ACTIVATION, OUT, QMIN, QMAX)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _requantize_rows_kernel(acc_ptr, bias_ptr, scale_ptr, out_ptr, rows, channels, y_scale, y_zero, alpha, beta,
                            product_bias_ptr, product_scale, multiplier, PRODUCT: tl.constexpr,
                            HAS_PRODUCT_BIAS: tl.constexpr, MULTIPLY: tl.constexpr, HAS_BIAS: tl.constexpr,
                            ACTIVATION: tl.constexpr, OUT: tl.constexpr, QMIN: tl.constexpr,
                            QMAX: tl.constexpr, HARDWARE_E4M3: tl.constexpr, INDEX64: tl.constexpr,
                            BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """_requantize_kernel where the channel is the innermost dim in memory (a GEMM's [M, N], a channels-last conv):
    [BLOCK_R, BLOCK_C] tiles, so the tile's scale and bias are loaded once as [1, BLOCK_C] vectors, where the flat
    kernel finds each element's channel by an integer modulo and gathers its scale and bias."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]
    if INDEX64:
        r = r.to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BC]
    c_ok = c < channels
    mask = (r < rows)[:, None] & c_ok[None, :]
    offs = r[:, None] * channels + c[None, :]  # [BR, BC]
    acc = tl.load(acc_ptr + offs, mask=mask, other=0)
    if PRODUCT:  # a QGemm's quantized product and the chain after it (qmath)
        y = qmath.finish_product_columns(acc, bias_ptr, scale_ptr, product_bias_ptr, c, c_ok, product_scale, multiplier,
                                         y_scale, y_zero, alpha, beta, HAS_BIAS, HAS_PRODUCT_BIAS, MULTIPLY,
                                         ACTIVATION, OUT, QMIN, QMAX, HARDWARE_E4M3)
    else:
        y = qmath.finish_columns(acc, bias_ptr, scale_ptr, c, c_ok, y_scale, y_zero, alpha, beta, HAS_BIAS,
                                 ACTIVATION, OUT, QMIN, QMAX, HARDWARE_E4M3)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


ROWS_TILE = 4096  # elements per program of the rows kernel (16 per thread at 8 warps: 16-byte loads of fp16)


def requantize(acc: torch.Tensor, epilogue: Epilogue, axis: int = -1) -> torch.Tensor:
    """The layer's output from its accumulator `acc` (int32, or float), in acc's layout: bias and scale run
    along `axis` (-1 for a GEMM, 1 for a convolution). An int32 acc with an int32 bias adds them exactly."""
    if acc.dtype not in (torch.int32, torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"triton requantize: the accumulator is int32 or float, got {acc.dtype}")
    axis = axis + acc.dim() if axis < 0 else axis
    channels = acc.shape[axis] if acc.dim() else 1
    epilogue.check(channels)
    if epilogue.bias is not None and acc.dtype == torch.int32 and epilogue.bias.dtype != torch.int32:
        raise TypeError(f"triton requantize: an int32 accumulator takes an int32 bias, got {epilogue.bias.dtype}")
    if not _dense(acc):
        acc = acc.contiguous()
    order = _memory_order(acc)
    out = torch.empty_like(acc, dtype=epilogue.out_dtype)  # acc's strides (dense: preserved)
    numel = acc.numel()
    if numel == 0:
        return out
    inner = 1
    for d in order[order.index(axis) + 1:] if acc.dim() else []:
        inner *= acc.shape[d]
    qmin, qmax = epilogue.qrange
    if inner == 1:  # the channel innermost: rows of `channels` values
        rows = numel // channels
        block_c = min(triton.next_power_of_2(channels), 256)
        block_r = max(ROWS_TILE // block_c, 1)
        _requantize_rows_kernel[(triton.cdiv(rows, block_r), triton.cdiv(channels, block_c))](
            acc, epilogue.bias if epilogue.bias is not None else epilogue.scale, epilogue.scale, out, rows, channels,
            float(epilogue.y_scale), float(epilogue.y_zero), float(epilogue.alpha), float(epilogue.beta),
            *epilogue.product_arguments(), **epilogue.product_constants(),
            HAS_BIAS=epilogue.bias is not None, ACTIVATION=epilogue.activation, OUT=epilogue.out_kind, QMIN=qmin,
            QMAX=qmax, HARDWARE_E4M3=acc.is_cuda, INDEX64=numel + ROWS_TILE >= 2**31, BLOCK_R=block_r,
            BLOCK_C=block_c, num_warps=8)
        return out
    if epilogue.quantized_product:
        raise ValueError("triton requantize: a quantized product runs along the innermost dim (a GEMM's rows) only")
    _requantize_kernel[(triton.cdiv(numel, BLOCK),)](
        acc, epilogue.bias if epilogue.bias is not None else epilogue.scale, epilogue.scale, out, numel, inner,
        channels, float(epilogue.y_scale), float(epilogue.y_zero), float(epilogue.alpha), float(epilogue.beta),
        HAS_BIAS=epilogue.bias is not None, ACTIVATION=epilogue.activation, OUT=epilogue.out_kind, QMIN=qmin,
        QMAX=qmax, INDEX64=numel + BLOCK >= 2**31, BLOCK=BLOCK, num_warps=4)
    return out


@triton.jit
def _dequantize_kernel(x_ptr, out_ptr, numel, scale, zero, INDEX64: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    if INDEX64:
        pid = pid.to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    x = tl.load(x_ptr + offs, mask=mask).to(tl.float32)  # masked-off lanes are never stored
    tl.store(out_ptr + offs, ((x - zero) * scale).to(out_ptr.dtype.element_ty), mask=mask)


def dequantize(x: torch.Tensor, scale: float, zero: float, dtype: torch.dtype) -> torch.Tensor:
    """(x − zero)·scale in `dtype`, x's layout kept (a strided view is compacted first)."""
    if x.dtype not in QUANTIZED_INPUTS:
        raise TypeError(f"triton dequantize: x is int8/uint8/float8e4m3fn, got {x.dtype}")
    if not _dense(x):
        x = x.contiguous()
    out = torch.empty_like(x, dtype=dtype)
    numel = x.numel()
    if numel:
        _dequantize_kernel[(triton.cdiv(numel, BLOCK),)](x, out, numel, float(scale), float(zero),
                                                         INDEX64=numel + BLOCK >= 2**31, BLOCK=BLOCK, num_warps=4)
    return out


@triton.jit
def _quantize_kernel(x_ptr, out_ptr, numel, y_scale, y_zero, OUT: tl.constexpr, QMIN: tl.constexpr,
                     QMAX: tl.constexpr, HARDWARE_E4M3: tl.constexpr, INDEX64: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    if INDEX64:
        pid = pid.to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = qmath.requantize(x, y_scale, y_zero, 0.0, 0.0, "", OUT, QMIN, QMAX, HARDWARE_E4M3)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def quantize(x: torch.Tensor, scale: float, zero: float, out_dtype: torch.dtype) -> torch.Tensor:
    """ONNX QuantizeLinear with per-tensor parameters (saturating): x / scale (an IEEE division in fp32),
    round half to even, + zero, clamped (float8: onto the E4M3 grid, ±448), in x's layout."""
    if not x.is_floating_point() or x.dtype in QUANTIZED_INPUTS:
        raise TypeError(f"triton quantize: x is float32/float16/bfloat16, got {x.dtype}")
    if out_dtype not in QUANTIZED_INPUTS:
        raise TypeError(f"triton quantize: the output is int8/uint8/float8e4m3fn, got {out_dtype}")
    if not _dense(x):
        x = x.contiguous()
    out = torch.empty_like(x, dtype=out_dtype)
    numel = x.numel()
    if numel:
        qmin, qmax = INT_RANGE.get(out_dtype, (0, 0))
        _quantize_kernel[(triton.cdiv(numel, SAME_LAYOUT_BLOCK),)](
            x, out, numel, float(scale), float(zero), OUT=_out_kind(out_dtype), QMIN=qmin, QMAX=qmax,
            HARDWARE_E4M3=x.is_cuda, INDEX64=numel + SAME_LAYOUT_BLOCK >= 2**31, BLOCK=SAME_LAYOUT_BLOCK, num_warps=8)
    return out


@triton.jit
def _qadd_kernel(a_ptr, b_ptr, out_ptr, numel, size1, size2, size3, sa0, sa1, sa2, sa3, sb0, sb1, sb2, sb3,
                 a_multiplier, a_zero, b_multiplier, b_zero, y_zero, alpha, beta,
                 ACTIVATION: tl.constexpr, OUT: tl.constexpr, QMIN: tl.constexpr, QMAX: tl.constexpr,
                 HARDWARE_E4M3: tl.constexpr, INDEX64: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    if INDEX64:
        pid = pid.to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)  # the output's memory order
    mask = offs < numel
    i3 = offs % size3
    rest = offs // size3
    i2 = rest % size2
    rest = rest // size2
    i1 = rest % size1
    i0 = rest // size1
    # masked-off lanes are never stored
    a = qmath.to_float(tl.load(a_ptr + i0 * sa0 + i1 * sa1 + i2 * sa2 + i3 * sa3, mask=mask))
    b = qmath.to_float(tl.load(b_ptr + i0 * sb0 + i1 * sb1 + i2 * sb2 + i3 * sb3, mask=mask))
    y = qmath.add_quantized(a, b, a_multiplier, a_zero, b_multiplier, b_zero, y_zero, alpha, beta, ACTIVATION, OUT,
                            QMIN, QMAX, HARDWARE_E4M3)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _qadd_same_layout_kernel(a_ptr, b_ptr, out_ptr, numel, a_multiplier, a_zero, b_multiplier, b_zero, y_zero,
                             alpha, beta, ACTIVATION: tl.constexpr, OUT: tl.constexpr, QMIN: tl.constexpr,
                             QMAX: tl.constexpr, HARDWARE_E4M3: tl.constexpr, INDEX64: tl.constexpr,
                             BLOCK: tl.constexpr):
    """a, b and out dense with one shape and one set of strides (a residual Add of two NHWC tensors): the
    same flat offset in all three, so the 8-bit loads and stores vectorise (the 4-D walk's index arithmetic
    hides their contiguity from the compiler: measured at ~400 GB/s on the H200)."""
    pid = tl.program_id(0)
    if INDEX64:
        pid = pid.to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    a = qmath.to_float(tl.load(a_ptr + offs, mask=mask))  # masked-off lanes are never stored
    b = qmath.to_float(tl.load(b_ptr + offs, mask=mask))
    y = qmath.add_quantized(a, b, a_multiplier, a_zero, b_multiplier, b_zero, y_zero, alpha, beta, ACTIVATION, OUT,
                            QMIN, QMAX, HARDWARE_E4M3)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def qadd(a: torch.Tensor, a_scale: float, a_zero: float, b: torch.Tensor, b_scale: float, b_zero: float, *,
         out_dtype: torch.dtype, y_scale: float = 1.0, y_zero: float = 0.0, activation: str = "",
         alpha: float = 0.0, beta: float = 0.0) -> torch.Tensor:
    """kiln::QAdd with per-tensor parameters: a and b broadcast (numpy rules, rank <= 4 after
    broadcasting); the output takes a's layout when a has the output's shape and is dense."""
    if a.dtype not in QUANTIZED_INPUTS or b.dtype not in QUANTIZED_INPUTS:
        raise TypeError(f"triton qadd: a and b are int8/uint8/float8e4m3fn, got {a.dtype}, {b.dtype}")
    if out_dtype not in OUTPUTS:
        raise TypeError(f"triton qadd: output dtype {out_dtype} is not one of {OUTPUTS}")
    if activation not in ("", "Relu", "Clip"):
        raise ValueError(f"triton qadd: activation {activation!r} is not '', 'Relu' or 'Clip'")
    shape = torch.broadcast_shapes(a.shape, b.shape)
    if len(shape) > _RANK:
        raise ValueError(f"triton qadd: output rank {len(shape)} is above {_RANK}")
    if tuple(a.shape) == tuple(shape) and _dense(a):
        out = torch.empty_like(a, dtype=out_dtype)
    else:
        out = torch.empty(shape, dtype=out_dtype, device=a.device)
    numel = out.numel()
    if numel == 0:
        return out
    qmin, qmax = INT_RANGE.get(out_dtype, (0, 0))
    # qmath.add_quantized's multipliers: s / y_scale (fp32 of the fp32 quotient) and the Clip bounds in y's units
    y = float32(y_scale) if out_dtype in QUANTIZED_INPUTS else 1.0
    values = (float32(float32(a_scale) / y), float(a_zero), float32(float32(b_scale) / y), float(b_zero),
              float(y_zero), float(alpha) / y, float(beta) / y)
    options = dict(ACTIVATION=activation, OUT=_out_kind(out_dtype), QMIN=qmin, QMAX=qmax, HARDWARE_E4M3=a.is_cuda)
    if a.shape == b.shape == out.shape and a.stride() == b.stride() == out.stride():  # out dense: a is too
        _qadd_same_layout_kernel[(triton.cdiv(numel, SAME_LAYOUT_BLOCK),)](
            a, b, out, numel, *values, **options, INDEX64=numel + SAME_LAYOUT_BLOCK >= 2**31, BLOCK=SAME_LAYOUT_BLOCK,
            num_warps=8)
        return out
    order = _memory_order(out) if out.dim() else []
    a_e, b_e = a.expand(shape), b.expand(shape)  # views: broadcast dims have stride 0
    pad = _RANK - len(order)
    sizes = [1] * pad + [shape[d] for d in order]
    sa = [0] * pad + [a_e.stride(d) for d in order]
    sb = [0] * pad + [b_e.stride(d) for d in order]
    _qadd_kernel[(triton.cdiv(numel, BLOCK),)](
        a_e, b_e, out, numel, sizes[1], sizes[2], sizes[3], *sa, *sb, *values, **options,
        INDEX64=numel + BLOCK >= 2**31, BLOCK=BLOCK, num_warps=4)
    return out
