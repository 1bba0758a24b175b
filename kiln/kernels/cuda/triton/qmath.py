"""Device functions of kiln's quantized kernels: the requantizing epilogue every INT8/FP8 layer ends in.

    r = (acc + bias[c]) · scale[c]         scale = x_scale·w_scale (kiln/ops/quantized.py)
    r = act(r)                             Relu / Clip / Gelu (erf; to 1.5e-7 before an int8 output, the tanh
                                           form before an E4M3 one: device_math.gelu_tanh_scaled) / GeluTanh
    y = saturate(round_half_even(r / y_scale) + y_zero)      int8 / uint8 outputs
    y = e4m3(saturate(r / y_scale, ±448))                     float8e4m3fn outputs
    y = r                                                      float outputs

A QGemm with its product quantized (kiln/ops/quantized.py inputs 9-11: onnxruntime's y = DQ(Q(x·W)) + b) rounds
r onto the E4M3 grid of product_scale first, then runs the float chain it absorbed (finish_product_columns):

    p = e4m3(saturate(r / product_scale, ±448));  r = act(p·product_scale + product_bias[c])·multiplier;  y as above

Rounding is done in fp32 arithmetic, not by a conversion instruction, for two reasons: the
interpreter (TRITON_INTERPRET=1, the CI path) rounds fp32 -> float8e4nv wrongly (ties away, a value
that rounds up into the next binade gets the wrong exponent, subnormals flushed: measured on
triton 3.9), and libdevice's rint does not exist there. So an fp8 result is first rounded onto the
E4M3 grid here, after which the conversion is exact on the GPU and in the interpreter alike, and
integer results are whole numbers in range before their (exact) conversion. A kernel launched on the GPU may
instead leave the fp8 rounding to its store (HARDWARE_E4M3: cvt.rn.satfinite, the same rule in one instruction;
tests/gpu/test_quant_cuda.py compares the two bit for bit).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kiln.kernels.cuda.triton import device_math as dm

FP8_MAX = 448.0  # largest finite float8e4m3fn
# What a quantized kernel writes (a constexpr of every kernel here)
OUT_FLOAT, OUT_INT, OUT_FP8 = 0, 1, 2


@triton.jit
def round_half_even(v):
    """v rounded to the nearest integer, ties to even, for |v| < 2²²: adding 1.5·2²³ puts v where the
    fp32 spacing is 1, so the add itself rounds (round-to-nearest-even, IEEE's default), and the
    subtraction is exact."""
    return (v + 12582912.0) - 12582912.0


@triton.jit
def round_to_e4m3(v):
    """v saturated to ±448 and rounded (nearest, ties to even) onto the float8e4m3fn grid, in fp32.

    E4M3 keeps 3 mantissa bits: within binade [2^e, 2^(e+1)) the spacing is 2^(e-3), and below the
    smallest normal 2^-6 the subnormal spacing 2^-9 (the binade -6 spacing). Scaling by the
    reciprocal spacing (a power of two: exact) puts the grid on the integers."""
    v = tl.minimum(tl.maximum(v, -448.0), 448.0)  # FP8_MAX (a jit function reads no Python global)
    bits = v.to(tl.int32, bitcast=True)
    biased = tl.maximum((bits >> 23) & 0xFF, 127 - 6)  # fp32 biased exponent, subnormals at the -6 binade
    inverse = ((257 - biased) << 23).to(tl.float32, bitcast=True)  # 2^(3 - e): biased 127 + 3 - (biased - 127)
    spacing = ((biased - 3) << 23).to(tl.float32, bitcast=True)  # 2^(e - 3)
    q = tl.abs(round_half_even(v * inverse) * spacing)
    # v's sign bit on q, so a negative v that rounds to zero gives -0.0 as the store's conversion and torch's do
    # (on the GPU `-q` compiles to 0 - q, which is +0.0 for q = 0: the H200 run of 2026-12-03c found 7 such values)
    return (q.to(tl.int32, bitcast=True) | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def quantize_value(v, y_zero, OUT: tl.constexpr, QMIN: tl.constexpr, QMAX: tl.constexpr,
                   HARDWARE_E4M3: tl.constexpr = False):
    """v = r / y_scale as the output: an integer of [QMIN, QMAX] (OUT_INT), an E4M3 grid value (OUT_FP8).
    HARDWARE_E4M3 (a kernel on the GPU, never the interpreter): v is left to the store's conversion, which sm_90
    compiles to cvt.rn.satfinite.e4m3x2.f32 (nearest-even, saturating at ±448: round_to_e4m3 in one instruction
    per two values, where the arithmetic takes ~15 per value)."""
    if OUT == 1:
        # beyond 2^22 the rounding trick rounds to a coarser grid, but such v saturate anyway (and ±inf
        # stay ±inf): no bound is needed before it (two instructions per output in every quantized layer)
        v = tl.minimum(tl.maximum(round_half_even(v) + y_zero, QMIN * 1.0), QMAX * 1.0)
    elif OUT == 2 and not HARDWARE_E4M3:
        v = round_to_e4m3(v)
    return v


@triton.jit
def requantize(r, y_scale, y_zero, alpha, beta, ACTIVATION: tl.constexpr, OUT: tl.constexpr,
               QMIN: tl.constexpr, QMAX: tl.constexpr, HARDWARE_E4M3: tl.constexpr = False):
    """act(r) as the layer's output in fp32: an integer of [QMIN, QMAX] (OUT_INT), an E4M3 grid value
    (OUT_FP8) or r itself (OUT_FLOAT). r / y_scale is rounded as the reference's float32 division
    (device_math.div_by_constant), except after a Gelu to E4M3: gelu(r)·(1 / y_scale) in one expression (its tanh
    form's error is far above the division's rounding)."""
    if ACTIVATION == "Gelu" and OUT == 2:  # an FFN's up projection writing the down projection's E4M3 input
        return quantize_value(dm.gelu_tanh_scaled(r, dm.reciprocal(y_scale)), y_zero, OUT, QMIN, QMAX, HARDWARE_E4M3)
    if ACTIVATION == "Relu":
        r = dm.relu(r)
    elif ACTIVATION == "Clip":  # alpha = min, beta = max
        r = tl.minimum(tl.maximum(r, alpha), beta)
    elif ACTIVATION == "Gelu":  # an FFN's up projection: its int8 output is the down projection's input
        r = dm.gelu_for_8bit(r) if OUT == 1 else dm.gelu(r)
    elif ACTIVATION == "GeluTanh":
        r = dm.gelu_tanh(r)
    if OUT != 0:  # r / y_scale as IEEE's division, from y_scale's reciprocal (a scalar: once per program)
        r = quantize_value(dm.div_by_constant(r, y_scale, dm.reciprocal(y_scale)), y_zero, OUT, QMIN, QMAX,
                           HARDWARE_E4M3)
    return r


@triton.jit
def finish(acc, bias, scale, y_scale, y_zero, alpha, beta, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
           OUT: tl.constexpr, QMIN: tl.constexpr, QMAX: tl.constexpr, HARDWARE_E4M3: tl.constexpr = False):
    """The epilogue from the accumulator: int32 acc + int32 bias is exact (the zero-point correction
    folded into the bias); a float accumulator (FP8 products, a float layer's output) adds the bias
    in fp32. Then r = (acc + bias)·scale, the activation and the output's quantization."""
    if HAS_BIAS:
        if acc.dtype == tl.int32:
            acc = acc + bias
        else:
            acc = acc.to(tl.float32) + bias.to(tl.float32)
    r = acc.to(tl.float32) * scale
    return requantize(r, y_scale, y_zero, alpha, beta, ACTIVATION, OUT, QMIN, QMAX, HARDWARE_E4M3)


@triton.jit
def finish_columns(acc, bias_ptr, scale_ptr, cols, col_ok, y_scale, y_zero, alpha, beta, HAS_BIAS: tl.constexpr,
                   ACTIVATION: tl.constexpr, OUT: tl.constexpr, QMIN: tl.constexpr, QMAX: tl.constexpr,
                   HARDWARE_E4M3: tl.constexpr = False):
    """finish() of a [rows, C] tile whose channels are its columns `cols` [C]: their scale and bias read here once,
    as [1, C] vectors (a GEMM's tile, the rows requantize pass)."""
    scale = tl.load(scale_ptr + cols, mask=col_ok, other=0.0)[None, :]  # [1, C]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols, mask=col_ok, other=0)[None, :]
    else:
        bias = scale  # not read
    return finish(acc, bias, scale, y_scale, y_zero, alpha, beta, HAS_BIAS, ACTIVATION, OUT, QMIN, QMAX, HARDWARE_E4M3)


@triton.jit
def round_in_registers(v, HARDWARE_E4M3: tl.constexpr = False):
    """v rounded onto the E4M3 grid (saturating, nearest-even) as an fp32 value that is not stored: on the GPU by
    the conversion instruction there and back (cvt.rn.satfinite, as the store's), else in arithmetic."""
    if HARDWARE_E4M3:
        return v.to(tl.float8e4nv).to(tl.float32)
    return round_to_e4m3(v)


@triton.jit
def finish_product_columns(acc, bias_ptr, scale_ptr, product_bias_ptr, cols, col_ok, product_scale, multiplier,
                           y_scale, y_zero, alpha, beta, HAS_BIAS: tl.constexpr, HAS_PRODUCT_BIAS: tl.constexpr,
                           MULTIPLY: tl.constexpr, ACTIVATION: tl.constexpr, OUT: tl.constexpr, QMIN: tl.constexpr,
                           QMAX: tl.constexpr, HARDWARE_E4M3: tl.constexpr = False):
    """finish_columns() of a QGemm whose product is quantized (module docstring): the product's own E4M3
    rounding (r / product_scale as IEEE's division, as the QuantizeLinear it replaces), its DequantizeLinear, the
    bias, the activation and the multiplier in fp32, then the output."""
    p = finish_columns(acc, bias_ptr, scale_ptr, cols, col_ok, product_scale, 0.0, 0.0, 0.0, HAS_BIAS, "", 0, 0, 0)
    p = round_in_registers(dm.div_by_constant(p, product_scale, dm.reciprocal(product_scale)), HARDWARE_E4M3)
    r = p * product_scale
    if HAS_PRODUCT_BIAS:
        r = r + tl.load(product_bias_ptr + cols, mask=col_ok, other=0.0)[None, :].to(tl.float32)
    if MULTIPLY:  # the activation, then the Mul, then the output's quantization alone
        r = requantize(r, 1.0, 0.0, alpha, beta, ACTIVATION, 0, QMIN, QMAX) * multiplier
        return requantize(r, y_scale, y_zero, alpha, beta, "", OUT, QMIN, QMAX, HARDWARE_E4M3)
    return requantize(r, y_scale, y_zero, alpha, beta, ACTIVATION, OUT, QMIN, QMAX, HARDWARE_E4M3)


@triton.jit
def finish_prescaled(acc, bias, multiplier, y_zero, alpha, beta, HAS_BIAS: tl.constexpr,
                     ACTIVATION: tl.constexpr, OUT: tl.constexpr, QMIN: tl.constexpr, QMAX: tl.constexpr):
    """finish() of an Epilogue.prescaled() epilogue: y_scale is folded into the per-channel multiplier
    (scale / y_scale) and the Clip bounds on the host, so each output costs one multiply where finish()
    has an IEEE division (~10 instructions: it dominates layers with a short K). The value can differ
    from finish()'s by one step where r / y_scale lies within fp32 rounding of a tie."""
    if HAS_BIAS:
        if acc.dtype == tl.int32:
            acc = acc + bias
        else:
            acc = acc.to(tl.float32) + bias.to(tl.float32)
    v = acc.to(tl.float32) * multiplier
    if ACTIVATION == "Relu":
        v = dm.relu(v)
    elif ACTIVATION == "Clip":
        v = tl.minimum(tl.maximum(v, alpha), beta)
    return quantize_value(v, y_zero, OUT, QMIN, QMAX)


@triton.jit
def to_float(x):
    """An 8-bit load as fp32. int8/uint8 by the bits, not a conversion: 0x4B400000 + x is the fp32 1.5·2^23 + x,
    the integer add and one fp32 subtraction exact, on the full-rate pipes, where cvt.rn.f32.s16 issues on
    the conversion unit (a quarter of the rate on Hopper: an elementwise pass over 8-bit tensors does 2-3 a
    value)."""
    if x.dtype == tl.int8 or x.dtype == tl.uint8:
        return (x.to(tl.int32) + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0
    return x.to(tl.float32)


@triton.jit
def to_integer(v, y_zero, QMIN: tl.constexpr, QMAX: tl.constexpr):
    """quantize_value's integer output as an int32, by the bits: v clamped to [QMIN − z, QMAX − z] (whole
    bounds: clamping before rounding is clamping after), rounded half to even by the 1.5·2^23 add, whose
    low bits are then round(v) in two's complement: no fp32 -> int conversion (the conversion unit's)."""
    v = tl.minimum(tl.maximum(v, QMIN - y_zero), QMAX - y_zero)
    return (v + 12582912.0).to(tl.int32, bitcast=True) + (tl.cast(y_zero, tl.int32) - 0x4B400000)


@triton.jit
def add_quantized(a, b, a_multiplier, a_zero, b_multiplier, b_zero, y_zero, alpha, beta, ACTIVATION: tl.constexpr,
                  OUT: tl.constexpr, QMIN: tl.constexpr, QMAX: tl.constexpr, HARDWARE_E4M3: tl.constexpr = False):
    """kiln::QAdd's arithmetic on two 8-bit values (fp32 whole numbers or E4M3 values): r = (a − z_a)·s_a +
    (b − z_b)·s_b, act(r), requantized, with the multipliers s / y_scale (and the Clip bounds / y_scale) formed
    on the host: a multiply per term and no division, where requantize() divides; int8/uint8 out by the bits
    (to_integer). The QAdd pass at ResNet-50's residual sizes was arithmetic-bound: with these, at the copy floor
    for FP8, within 15-18% of it for int8 (H200, bench/results/quant-gpu-2026-12-04.md). One step off where the
    sum lies within fp32 rounding of a tie, as the contract allows every quantized kernel. A float output
    (OUT_FLOAT) passes s_a, s_b and writes act(r)."""
    v = (a - a_zero) * a_multiplier + (b - b_zero) * b_multiplier  # a − z, b − z exact: 8-bit values in fp32
    if ACTIVATION == "Relu":
        v = dm.relu(v)
    elif ACTIVATION == "Clip":  # alpha = min, beta = max (divided by y_scale for a quantized output)
        v = tl.minimum(tl.maximum(v, alpha), beta)
    if OUT == 1:
        y = to_integer(v, y_zero, QMIN, QMAX)
    else:
        y = quantize_value(v, y_zero, OUT, QMIN, QMAX, HARDWARE_E4M3)
    return y
