"""Device functions of kiln's quantized kernels: the requantizing epilogue every INT8/FP8 layer ends in.

    r = (acc + bias[c]) · scale[c]         scale = x_scale·w_scale (kiln/ops/quantized.py)
    r = act(r)                             Relu / Clip
    y = saturate(round_half_even(r / y_scale) + y_zero)      int8 / uint8 outputs
    y = e4m3(saturate(r / y_scale, ±448))                     float8e4m3fn outputs
    y = r                                                      float outputs

Rounding is done in fp32 arithmetic, not by a conversion instruction, for two reasons: the
interpreter (TRITON_INTERPRET=1, the CI path) rounds fp32 -> float8e4nv wrongly (ties away, a value
that rounds up into the next binade gets the wrong exponent, subnormals flushed: measured on
triton 3.9), and libdevice's rint does not exist there. So an fp8 result is first rounded onto the
E4M3 grid here, after which the conversion is exact on the GPU and in the interpreter alike, and
integer results are whole numbers in range before their (exact) conversion.
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
    return tl.where(bits < 0, -q, q)  # the sign of v, -0.0 included (as torch's conversion keeps it)


@triton.jit
def quantize_value(v, y_zero, OUT: tl.constexpr, QMIN: tl.constexpr, QMAX: tl.constexpr):
    """v = r / y_scale as the output: an integer of [QMIN, QMAX] (OUT_INT), an E4M3 grid value (OUT_FP8)."""
    if OUT == 1:
        # beyond 2^22 the rounding trick rounds to a coarser grid, but such v saturate anyway (and ±inf
        # stay ±inf): no bound is needed before it (two instructions per output in every quantized layer)
        v = tl.minimum(tl.maximum(round_half_even(v) + y_zero, QMIN * 1.0), QMAX * 1.0)
    elif OUT == 2:
        v = round_to_e4m3(v)
    return v


@triton.jit
def requantize(r, y_scale, y_zero, alpha, beta, ACTIVATION: tl.constexpr, OUT: tl.constexpr,
               QMIN: tl.constexpr, QMAX: tl.constexpr):
    """act(r) as the layer's output in fp32: an integer of [QMIN, QMAX] (OUT_INT), an E4M3 grid value
    (OUT_FP8) or r itself (OUT_FLOAT). r / y_scale is an IEEE division, as the reference's float32 one."""
    if ACTIVATION == "Relu":
        r = dm.relu(r)
    elif ACTIVATION == "Clip":  # alpha = min, beta = max
        r = tl.minimum(tl.maximum(r, alpha), beta)
    if OUT != 0:
        r = quantize_value(dm.div(r, y_scale), y_zero, OUT, QMIN, QMAX)
    return r


@triton.jit
def finish(acc, bias, scale, y_scale, y_zero, alpha, beta, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
           OUT: tl.constexpr, QMIN: tl.constexpr, QMAX: tl.constexpr):
    """The epilogue from the accumulator: int32 acc + int32 bias is exact (the zero-point correction
    folded into the bias); a float accumulator (FP8 products, a float layer's output) adds the bias
    in fp32. Then r = (acc + bias)·scale, the activation and the output's quantization."""
    if HAS_BIAS:
        if acc.dtype == tl.int32:
            acc = acc + bias
        else:
            acc = acc.to(tl.float32) + bias.to(tl.float32)
    r = acc.to(tl.float32) * scale
    return requantize(r, y_scale, y_zero, alpha, beta, ACTIVATION, OUT, QMIN, QMAX)


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


# How far the fast rounding below may be from the reference's (float64 product, float32 division) in
# units of the value: the fast path makes at most 4 float32 roundings and the reference 2 (6·2^-24 in all);
# 2^-20 leaves a margin. Only values this close to a tie (one in ~10^5) read the exact tables.
TIE_WINDOW = 2.0**-20


@triton.jit
def whole_to_int32(v):
    """A whole number |v| < 2^22 held in fp32 as int32, by the rounding constant's bits (two integer-pipe
    instructions where a conversion instruction issues at a quarter of their rate on Hopper)."""
    return (v + 12582912.0).to(tl.int32, bitcast=True) - 0x4B400000


@triton.jit
def near_tie(v, k, magnitude):
    """v within TIE_WINDOW·magnitude of the tie k ± 0.5 (k = round_half_even(v)): where the reference may
    round the other way. |v − k| and 0.5 − |v − k| are exact near a tie (Sterbenz)."""
    return tl.abs(tl.abs(v - k) - 0.5) <= magnitude * 9.5367431640625e-07  # TIE_WINDOW (no globals in jit)


@triton.jit
def exact_integer_result(acc, bias, scale, y_scale, y_zero, thresholds_ptr, rn, col_ok, HAS_BIAS: tl.constexpr,
                         PRESCALED: tl.constexpr, QMIN: tl.constexpr, QMAX: tl.constexpr):
    """A layer's 8-bit result c, no activation, equal to the reference's at every element (kiln/ops/
    quantized.py: round_half_even(fp32(a·s64) / y_scale) with a = acc + bias, s64 = x_scale·w_scale in
    float64), where finish() may be one step off at a near-tie. A residual add after it multiplies that
    step by conv_scale / y_scale (ResNet-50's blocks: more than one step of the sum).

    The fast path is finish()'s; a value near a tie reads the exact answer instead: the reference rounds
    monotonically in the integer a, so c >= b exactly when a >= thresholds[channel, b − lo − 1], the least
    such a (qresidual.rounding_thresholds, made at prepare with the reference's arithmetic)."""
    if acc.dtype == tl.int32:
        a = acc
    else:
        a = acc.to(tl.int32)  # int8 on fp16 tensor cores: whole numbers below 2^24
    if HAS_BIAS:
        a = a + bias
    v = a.to(tl.float32) * scale
    if not PRESCALED:
        v = dm.div(v, y_scale)
    k = round_half_even(v)
    b = k + tl.where(v > k, 1.0, 0.0)  # the nearer tie lies between b − 1 and b
    lo = QMIN - y_zero  # below b = lo + 1 and above QMAX − y_zero the clamp decides, not the tie
    near = near_tie(v, k, tl.abs(v)) & (b > lo) & (b <= QMAX - y_zero) & col_ok
    j = whole_to_int32(tl.minimum(tl.maximum(b - lo - 1.0, 0.0), 255.0))
    threshold = tl.load(thresholds_ptr + rn[None, :] * 256 + j, mask=near, other=0)
    k = tl.where(near, tl.where(a >= threshold, b, b - 1.0), k)
    return tl.minimum(tl.maximum(k + y_zero, QMIN * 1.0), QMAX * 1.0)


@triton.jit
def add_residual(c, res, a_multiplier, a_zero, b_multiplier, b_zero, y_zero, sums_ptr, ACTIVATION: tl.constexpr,
                 A_MIN: tl.constexpr, B_MIN: tl.constexpr, QMIN: tl.constexpr, QMAX: tl.constexpr):
    """A layer's 8-bit result c plus an 8-bit residual (fp32 whole numbers), activation, requantization:
    kiln::QAdd's arithmetic (r = (c − z_c)·s_c + (res − z_r)·s_r, y = round(act(r) / y_scale) + z_y) with
    the multipliers s / y_scale (fp32). A sum near a tie reads the reference's own result for the pair
    (c, res) from `sums` (qresidual.sum_table, 256·256 values), so the sum is exact, as c is."""
    t_a = (c - a_zero) * a_multiplier  # c − z, res − z exact: 8-bit values in fp32
    t_b = (res - b_zero) * b_multiplier
    v = t_a + t_b
    if ACTIVATION == "Relu":
        v = dm.relu(v)
    k = round_half_even(v)
    near = near_tie(v, k, tl.abs(t_a) + tl.abs(t_b))  # the terms' size bounds the rounding of their sum
    exact = tl.load(sums_ptr + whole_to_int32((c - A_MIN) * 256.0 + (res - B_MIN)), mask=near, other=0.0)
    return tl.where(near, exact, tl.minimum(tl.maximum(k + y_zero, QMIN * 1.0), QMAX * 1.0))
