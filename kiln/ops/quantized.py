"""kiln's quantized layers (domain "kiln"): what kiln/passes/fusion/qdq.py makes of an explicitly
quantized graph (DequantizeLinear -> Conv/Gemm/MatMul [-> Relu/Clip] -> QuantizeLinear, residual Adds
between Q/DQ pairs), and what the INT8/FP8 kernels of every device implement (kiln/tactics/*/).

THE CONTRACT (docs/quantization.md says the same with the passes around it). Inputs follow ONNX's
QLinearConv order, so a reader of ORT's QLinearConv/QLinearMatMul/QLinearAdd knows them already:

    QConv (x, x_scale, x_zero_point, w, w_scale, w_zero_point, y_scale, y_zero_point, bias,
           [residual, residual_scale, residual_zero_point, conv_scale, conv_zero_point])
    QGemm (x, x_scale, x_zero_point, w, w_scale, w_zero_point, y_scale, y_zero_point, bias,
           [product_scale, product_zero_point, product_bias])
    QAdd  (a, a_scale, a_zero_point, b, b_scale, b_zero_point, y_scale, y_zero_point)

    x, a, b       quantized activations: uint8 or int8 (float8e4m3fn for FP8); QConv x is [N, C, *spatial],
                  QGemm x is [..., K]. QConv x may also be float32/float16/bfloat16: the layer then reads
                  QuantizeLinear(x; x_scale, x_zero_point) (a stem's input quantization folded into it on CUDA
                  builds, kiln/passes/fusion/qdq_layers.py: the kernel quantizes as it lays the image out)
    *_scale       float32; activations per tensor (a scalar); w_scale a scalar or one per output
                  channel ([O] for QConv, [N] for QGemm)
    *_zero_point  the quantized value of real 0, of the tensor's own dtype, same shape as its scale
                  (always present, so the dtype is explicit; 0 for float8). The fusion only makes
                  layers whose weights are symmetric (w_zero_point all 0); kernels may rely on it
    w             QConv: int8 [O, C/group, *kernel] as ONNX Conv; QGemm: int8 [N, K] (already
                  transposed, as kiln::FusedGemm stores it), x @ wᵀ
    bias          int32 [O] / [N] at scale x_scale·w_scale, zero point 0 (ONNX QLinearConv's B), or absent
    y_scale, y_zero_point
                  present: the output is quantized to y_zero_point's dtype (uint8/int8/float8);
                  absent (empty input): the output is float, of type `output_dtype` (ONNX enum,
                  default 1 = float32): the dequantized result, for a float consumer

    attributes    QConv: Conv's (auto_pad, dilations, group, kernel_shape, pads, strides);
                  all: activation ("" | "Relu" | "Clip" | "Gelu" | "GeluTanh"; kiln::FusedConv's names),
                  alpha/beta (Clip's min/max), output_dtype

The arithmetic every kernel implements (the reference below, in float64 where exact):

    acc[o]  = Σ (x − x_zero_point) · (w[o] − w_zero_point[o])          exact integers (int32 on a kernel)
    r[o]    = x_scale · w_scale[o] · (acc[o] + bias[o])                the real-valued layer output
    r       = act(r)                                                    Relu: max(r, 0); Clip: clamp(r, alpha, beta);
                                                                        Gelu (erf), GeluTanh: as kiln/ops/fused.py
    y       = saturate(round_half_even(r / y_scale) + y_zero_point)    or r itself (float output)

QConv with a residual (inputs 9-13, all present; kiln/passes/fusion/qdq_residual.py makes it of
QConv -> QAdd on CUDA builds): the unfused graph's arithmetic, its intermediate rounding included, so the
fused layer equals QConv (8-bit output) followed by QAdd, and onnxruntime's QDQ graph as closely as they do:

    c       = saturate(round_half_even(x_scale·w_scale[o]·(acc[o] + bias[o]) / conv_scale) + conv_zero_point)
    r       = act(conv_scale·(c − conv_zero_point) + residual_scale·(residual − residual_zero_point))
    y       = saturate(round_half_even(r / y_scale) + y_zero_point)

    residual          8-bit, the output's shape (no broadcasting); its scale and zero point per tensor
    conv_scale, conv_zero_point    the 8-bit tensor the convolution alone wrote before the fusion
    activation        applies to the sum (ResNet's Relu after the Add); the convolution has none of its own
    y_scale, y_zero_point          the sum's quantization (required)

QGemm with its product quantized (inputs 9-11; kiln/passes/fusion/qgemm_epilogue.py makes it of a QGemm and the
Elementwise chain reading its E4M3 output on CUDA builds): onnxruntime's FP8 QDQ transformers quantize each
MatMul's output and add the bias after its DequantizeLinear, y = Q(act(DQ(Q(x·W)) + b)·m). The layer keeps that
rounding, so it equals the QGemm (8-bit output) and the chain it absorbed, not a GEMM with the bias inside:

    p       = saturate(round(x_scale·w_scale[o]·(acc[o] + bias[o]) / product_scale))   E4M3 (zero point 0)
    r       = act(float32(p)·product_scale + product_bias[o]) · multiplier             float32, as the chain
    y       = saturate(round(r / y_scale) + y_zero_point)       or r itself (float output of `output_dtype`)

    product_scale, product_zero_point   the E4M3 tensor the GEMM alone wrote before the fusion (per tensor)
    product_bias      float [N] (the Add after the DequantizeLinear), or absent
    multiplier        attribute, float (default 1): a scalar Mul after the activation (the attention's 1/√d share
                      that a query projection's chain applies before its QuantizeLinear)

QAdd: r = act(a_scale·(a − a_zero_point) + b_scale·(b − b_zero_point)) (numpy broadcasting), then y as
above. A kernel computing r in float32 (oneDNN's scales, fbgemm's requantization) may land one
quantization step away from the reference where r / y_scale sits near a rounding tie: the tests allow
that one step and no more.
"""

from __future__ import annotations

import dataclasses

import torch

from kiln.ir import dtypes
from kiln.ops.fused import _activate_
from kiln.ops.fused import layer_norm as _layer_norm
from kiln.ops.nn import _conv, _conv_params
from kiln.ops.quantization import _param, dequantize_linear, quantize_linear
from kiln.ops.registry import register

QUANTIZED_LAYERS = ("QConv", "QGemm", "QAdd")
FLOAT_INPUTS = (torch.float32, torch.float16, torch.bfloat16)  # a QConv x QuantizeLinear makes 8-bit first
LAYER_NORM_QUANTIZE_OPS = ("LayerNormQuantize",)


def _real(q: torch.Tensor, scale: torch.Tensor, zero_point, axis: int = 0,
          dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """q − zero point as float64 (exact for 8-bit integers and float8), scale not applied."""
    y = q.to(dtype)
    if zero_point is not None:
        y = y - _param(zero_point.to(dtype), q.dim(), q.shape, axis, 0)
    return y


def _exact_dtype(x: torch.Tensor, x_zero_point, w: torch.Tensor, w_zero_point, terms: int) -> torch.dtype:
    """float32 when every partial sum of `terms` products (x − z_x)(w − z_w) is an integer below 2^24,
    so float32 sums them exactly in any order (the reference then runs at float speed), else float64."""
    if not (x.dtype in (torch.uint8, torch.int8) and w.dtype in (torch.uint8, torch.int8)):
        return torch.float64
    info = torch.iinfo(x.dtype)
    z = 0 if x_zero_point is None else int(x_zero_point.reshape(-1)[0]) if x_zero_point.numel() == 1 else None
    x_span = max(info.max - min(z, info.max), max(z, info.min) - info.min) if z is not None else 255
    w_span = int((w.to(torch.int32) - (0 if w_zero_point is None else w_zero_point.to(torch.int32).reshape(
        -1, *[1] * (w.dim() - 1)))).abs().max()) if w.numel() else 0
    return torch.float32 if terms * x_span * w_span < 2**24 else torch.float64


def _activate(r: torch.Tensor, activation: str, alpha: float, beta: float) -> torch.Tensor:
    return _activate_(r, activation, alpha, beta)  # kiln's epilogue activations (kiln/ops/fused.py)


def _output(ctx, r: torch.Tensor, y_scale, y_zero_point, output_dtype: int) -> torch.Tensor:
    """r quantized by (y_scale, y_zero_point), or r as a float of `output_dtype` when y_scale is absent."""
    if y_scale is None:
        return r.to(dtypes.from_onnx(output_dtype or 1).torch)
    # float32 as a kernel divides; round half to even and saturation as ONNX QuantizeLinear
    return quantize_linear(ctx, r.to(torch.float32), y_scale, y_zero_point)


def _channel_scale(x_scale: torch.Tensor, w_scale: torch.Tensor, rank: int, axis: int) -> torch.Tensor:
    """x_scale · w_scale in float64, broadcast along the output-channel axis of a rank-`rank` result."""
    s = x_scale.to(torch.float64).reshape(()) * w_scale.to(torch.float64).reshape(-1)
    if s.numel() == 1:
        return s.reshape(())
    shape = [1] * rank
    shape[axis] = -1
    return s.reshape(shape)


@register("QConv", domain="kiln")
def qconv(ctx, x, x_scale, x_zero_point, w, w_scale, w_zero_point, y_scale=None, y_zero_point=None, bias=None,
          residual=None, residual_scale=None, residual_zero_point=None, conv_scale=None, conv_zero_point=None, *,
          auto_pad="NOTSET", dilations=None, group=1, kernel_shape=None, pads=None, strides=None,
          activation="", alpha=0.0, beta=0.0, output_dtype=1):
    """Convolution of quantized x and w with int32 bias, activation and requantization (module docstring);
    with a residual, the convolution's own 8-bit result plus the residual, then activation and requantization."""
    if x.dtype in FLOAT_INPUTS:  # the input's QuantizeLinear folded in
        x = quantize_linear(ctx, x, x_scale, x_zero_point)
    exact = _exact_dtype(x, x_zero_point, w, w_zero_point, w[0].numel())
    xf = _real(x, x_scale, x_zero_point, dtype=exact)  # [N, C, *spatial]
    wf = _real(w, w_scale, w_zero_point, axis=0, dtype=exact)  # [O, C/group, *kernel]
    kernel = list(kernel_shape) if kernel_shape else list(w.shape[2:])
    strides, dilations, pads = _conv_params(xf, kernel, auto_pad, dilations, pads, strides)
    acc = _conv(xf, wf, None, strides, dilations, pads, group).to(torch.float64)  # exact integers
    if bias is not None:
        acc = acc + bias.to(torch.float64).reshape(-1, *[1] * (acc.dim() - 2))
    r = acc * _channel_scale(x_scale, w_scale, acc.dim(), 1)  # [N, O, *spatial']
    if residual is None:
        return _output(ctx, _activate(r, activation, alpha, beta), y_scale, y_zero_point, output_dtype)
    if conv_scale is None or y_scale is None or residual.shape != r.shape:
        raise ValueError(f"QConv with a residual needs conv_scale/conv_zero_point, y_scale/y_zero_point and a "
                         f"residual of the output's shape {list(r.shape)}; got residual {list(residual.shape)}, "
                         f"conv_scale {'absent' if conv_scale is None else 'given'}, "
                         f"y_scale {'absent' if y_scale is None else 'given'}")
    c = _output(ctx, r, conv_scale, conv_zero_point, output_dtype)  # the convolution's own 8-bit result
    r = _real(c, conv_scale, conv_zero_point) * conv_scale.to(torch.float64) + \
        _real(residual, residual_scale, residual_zero_point) * residual_scale.to(torch.float64)
    return _output(ctx, _activate(r, activation, alpha, beta), y_scale, y_zero_point, output_dtype)


@register("QGemm", domain="kiln")
def qgemm(ctx, x, x_scale, x_zero_point, w, w_scale, w_zero_point, y_scale=None, y_zero_point=None, bias=None,
          product_scale=None, product_zero_point=None, product_bias=None, *,
          activation="", alpha=0.0, beta=0.0, output_dtype=1, multiplier=1.0):
    """x [..., K] @ w [N, K]ᵀ of quantized operands with int32 bias, activation and requantization; with a
    product scale, the product's own E4M3 rounding, then the float chain after it (module docstring)."""
    exact = _exact_dtype(x, x_zero_point, w, w_zero_point, w.shape[-1])
    xf = _real(x, x_scale, x_zero_point, dtype=exact)
    wf = _real(w, w_scale, w_zero_point, axis=0, dtype=exact)
    acc = torch.matmul(xf, wf.t()).to(torch.float64)  # [..., N], exact integers
    if bias is not None:
        acc = acc + bias.to(torch.float64)
    r = acc * _channel_scale(x_scale, w_scale, acc.dim(), -1)
    if product_scale is not None:
        return _product_chain(ctx, r, product_scale, product_zero_point, product_bias, activation, alpha, beta,
                              multiplier, y_scale, y_zero_point, output_dtype)
    return _output(ctx, _activate(r, activation, alpha, beta), y_scale, y_zero_point, output_dtype)


def _product_chain(ctx, r, product_scale, product_zero_point, product_bias, activation, alpha, beta, multiplier,
                   y_scale, y_zero_point, output_dtype):
    """A QGemm's product quantized (E4M3), then DequantizeLinear, the bias Add, the activation and the Mul in
    float32, as the ONNX graph's float tensors between them, then the output (module docstring)."""
    if product_zero_point is None or product_zero_point.dtype != torch.float8_e4m3fn or \
            float(product_zero_point.float().abs().max()) != 0.0:
        raise ValueError("QGemm: the product is quantized to float8e4m3fn with zero point 0 (product_zero_point)")
    p = quantize_linear(ctx, r.to(torch.float32), product_scale, product_zero_point)  # the graph's Q after MatMul
    real = p.to(torch.float32) * product_scale.to(torch.float32)  # its DequantizeLinear
    if product_bias is not None:
        real = real + product_bias.to(torch.float32)
    real = _activate(real, activation, alpha, beta)
    if multiplier != 1.0:
        real = real * torch.tensor(multiplier, dtype=torch.float32)
    return _output(ctx, real, y_scale, y_zero_point, output_dtype)


@register("QAdd", domain="kiln")
def qadd(ctx, a, a_scale, a_zero_point, b, b_scale, b_zero_point, y_scale=None, y_zero_point=None, *,
         activation="", alpha=0.0, beta=0.0, output_dtype=1):
    """a + b of quantized operands (each its own scale and zero point), activation, requantization."""
    r = _real(a, a_scale, a_zero_point) * a_scale.to(torch.float64) + \
        _real(b, b_scale, b_zero_point) * b_scale.to(torch.float64)
    return _output(ctx, _activate(r, activation, alpha, beta), y_scale, y_zero_point, output_dtype)


@register("LayerNormQuantize", domain="kiln")
def layer_norm_quantize(ctx, x, scale=None, bias=None, residual=None, y_scale=None, y_zero_point=None,
                        residual_scale=None, residual_zero_point=None, *, axis=-1, epsilon=1e-5):
    """kiln::LayerNorm then a per-tensor QuantizeLinear of its output (kiln/passes/fusion/layernorm_quantize.py):
    outputs (y_q, [y]); y in x's dtype is what is quantized, as the unfused QuantizeLinear reads it. With a
    residual_scale the residual is E4M3 (the previous LayerNorm's quantized output): its DequantizeLinear,
    float32(r)·residual_scale rounded to x's dtype, as the unfused one wrote it, is what is added; with a
    residual_zero_point too it is uint8/int8 (CPU builds), dequantized as DequantizeLinear does."""
    if residual_zero_point is not None:  # a uint8/int8 residual (CPU builds): DequantizeLinear's float32 result
        if residual is None or residual.dtype not in (torch.uint8, torch.int8) or residual_scale is None:
            raise ValueError(f"LayerNormQuantize {ctx.name}: a residual zero point goes with a uint8/int8 residual and "
                             f"its scale, got {None if residual is None else residual.dtype}")
        residual = dequantize_linear(ctx, residual, residual_scale, residual_zero_point).to(x.dtype)
    elif residual_scale is not None:
        if residual is None or residual.dtype != torch.float8_e4m3fn:
            raise ValueError(f"LayerNormQuantize {ctx.name}: a residual_scale goes with a float8e4m3fn residual, got "
                             f"{None if residual is None else residual.dtype}")
        residual = (residual.to(torch.float32) * residual_scale.to(torch.float32)).to(x.dtype)
    y = _layer_norm(dataclasses.replace(ctx, num_outputs=1), x, scale, bias, residual, axis=axis, epsilon=epsilon)
    y_q = quantize_linear(ctx, y, y_scale, y_zero_point)
    return (y_q, y) if ctx.num_outputs == 2 else y_q
