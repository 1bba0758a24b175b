"""Device functions shared by kiln's Triton kernels.

Written with core `triton.language` only (no libdevice): the same source must run under
`TRITON_INTERPRET=1` in CI, which does not implement libdevice, and compile with triton 3.6.
Arguments arrive in fp32, the compute type of every kiln kernel.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def div(a, b):
    """IEEE-rounded a / b (triton's `/` on fp32 lowers to an approximate division)."""
    return tl.math.div_rn(a, b)


@triton.jit
def div_by_constant(a, b, inverse):
    """a / b rounded as IEEE's division, given inverse = 1/b correctly rounded (b the same for the whole program:
    its reciprocal formed once): q = a·inverse is within an ulp of a / b, r = a − q·b is exact in an fma, and
    q + r·inverse is then the correctly rounded quotient (Markstein's theorem; the last step of Itanium's
    division). Per value an fmul, two fmas and two selects, and no MUFU.RCP: div_rn issues one per value (with
    ~5 fmas and a slow-path test), and the special-function unit is the narrow one (16 results a cycle per SM on
    Hopper against 128 fmas): an FFN up's Gelu -> fp8 already needs two there per value. Kept q where it is exact
    (r = 0: a −0 quotient stays −0) or not finite (an overflow gives ±inf, as the division). Not for quotients in
    the subnormal range, where q is not within an ulp (a quantized output rounds them to zero anyway)."""
    q = a * inverse
    r = tl.fma(-q, b, a)
    corrected = tl.fma(r, inverse, q)
    return tl.where((r == 0.0) | (corrected != corrected), q, corrected)


@triton.jit
def reciprocal(x):
    return tl.math.div_rn(1.0, x)


@triton.jit
def sqrt(x):
    return tl.math.sqrt_rn(x)


@triton.jit
def relu(x):
    return tl.where(x < 0, 0.0, x)  # NaN stays NaN, as torch.relu


@triton.jit
def sigmoid(x):
    return tl.math.div_rn(1.0, 1.0 + tl.exp(-x))  # exp(-x) = inf gives 0


@triton.jit
def tanh(x):
    """tanh(|x|) = (1 - e)/(1 + e), e = exp(-2|x|); below 0.2 the odd Taylor series, where 1 - e
    would cancel (series error < 6e-8 relative there: next term 62x⁹/2835)."""
    ax = tl.abs(x)
    e = tl.exp(-2.0 * ax)
    large = tl.math.div_rn(1.0 - e, 1.0 + e)
    x2 = ax * ax
    small = ax * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * -0.05396825396825397)))
    r = tl.where(ax < 0.2, small, large)
    return tl.where(x < 0, -r, r)


@triton.jit
def gelu(x):
    """x·Φ(x) = ½x(1 + erf(x/√2))."""
    return 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))  # 1/√2


@triton.jit
def gelu_for_8bit(x):
    """x·Φ(x) with Φ from Abramowitz & Stegun 7.1.26 (|error of erf| <= 1.5e-7): for an int8 output (an E4M3
    one takes gelu_tanh_scaled), where tl.math.erf takes ~37 PTX instructions per value and this ~14 (the
    FFN up's Gelu -> fp8 pass over BERT-base's 24,576 x 3,072 product was compute-bound on the H200: 0.195 ms, a
    bias-only pass ~0.1). With a = |x|/√2, t = 1/(1 + p·a): erfc(a) ≈ t·P(t)·e^(-a²), so Φ(-|x|) = erfc(a)/2
    is formed without cancellation: the negative tail keeps its relative accuracy."""
    a = tl.abs(x) * 0.7071067811865476  # 1/√2
    t = 1.0 / (1.0 + 0.3275911 * a)  # an approximate division: its ~2 ulps are far below the formula's error
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    half_erfc = 0.5 * poly * tl.exp(-a * a)  # Φ(-|x|)
    return x * tl.where(x < 0, half_erfc, 1.0 - half_erfc)


@triton.jit
def gelu_tanh_scaled(x, multiplier):
    """multiplier·gelu(x) by GELU's tanh form, ½x(1 + tanh(u)) = x·σ(2u) = x / (1 + 2^(-2u·log2 e)), u =
    √(2/π)(x + 0.044715x³): for an E4M3 output (multiplier = 1/y_scale), whose grid is 2^-4 to 2^-3 of the value.
    The form of cuBLASLt's GELU epilogue, which the fp16 engine's FFN up takes for the erf GELU (tactics/cuda/
    library.py): at most 4.7e-4 from erf's (x = -2.70, where y = -0.0094), within the builder's FLOAT8_HALF_SLACK
    (2^-10 of the largest output) of an FFN whose outputs reach 0.5. ~8 instructions a value where erf to 1.5e-7
    (gelu_for_8bit) and IEEE's division by y_scale take ~22: BERT-base's FFN up (24,576 x 3,072) on the H200 was
    bound by them, not by memory (the pass 0.107 ms against 0.053 to move its bytes). σ rather than tanh: 1 + tanh
    cancels in the negative tail, 1 + e^(-2u) does not. e = inf (x below about -10) gives a signed zero."""
    e = tl.exp2(x * (-2.302208198144325 + -0.1029432395800235 * x * x))  # 2^(-2u·log2 e)
    return (x * multiplier) / (1.0 + e)  # an approximate division: its ~2 ulps are far below the form's error


@triton.jit
def gelu_tanh(x):
    """½x(1 + tanh(√(2/π)(x + 0.044715x³)))."""
    return 0.5 * x * (1.0 + tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))  # √(2/π)


@triton.jit
def silu(x):
    return x * sigmoid(x)


@triton.jit
def maximum(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)  # torch.maximum propagates NaN


@triton.jit
def minimum(a, b):
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def pow(a, b):
    """aᵇ = 2^(b·log2|a|), signed for a < 0 and odd integer b, NaN for a < 0 and fractional b.
    b = 1, 2, 3 are exact products (x², x³ are what exported graphs use)."""
    r = tl.exp2(b * tl.log2(tl.abs(a)))
    odd = tl.floor(b * 0.5) * 2.0 != b  # also true for fractional b, which the next line sorts out
    negative_base = tl.where(tl.floor(b) == b, tl.where(odd, -r, r), float("nan"))
    r = tl.where(a < 0, negative_base, r)
    r = tl.where(b == 0, 1.0, tl.where(a == 1, 1.0, r))  # x⁰ = 1 and 1ʸ = 1, NaN included (C99 pow)
    r = tl.where(b == 1, a, r)
    r = tl.where(b == 2, a * a, r)
    return tl.where(b == 3, a * a * a, r)


@triton.jit
def activate(y, ACTIVATION: tl.constexpr, alpha, beta):
    """The fused epilogue activations of kiln::FusedGemm / FusedConv (kiln/ops/fused.py)."""
    if ACTIVATION == "Relu":
        y = relu(y)
    elif ACTIVATION == "Clip":  # alpha = min, beta = max
        y = tl.minimum(tl.maximum(y, alpha), beta)
    elif ACTIVATION == "Sigmoid":
        y = sigmoid(y)
    elif ACTIVATION == "SiLU":
        y = silu(y)
    elif ACTIVATION == "Tanh":
        y = tanh(y)
    elif ACTIVATION == "Gelu":
        y = gelu(y)
    elif ACTIVATION == "GeluTanh":
        y = gelu_tanh(y)
    elif ACTIVATION == "LeakyRelu":
        y = tl.where(y < 0, y * alpha, y)
    elif ACTIVATION == "HardSigmoid":  # max(0, min(1, alpha·x + beta))
        y = tl.minimum(tl.maximum(y * alpha + beta, 0.0), 1.0)
    elif ACTIVATION == "HardSwish":  # x·relu6(x + 3)/6
        y = y * tl.minimum(tl.maximum(y + 3.0, 0.0), 6.0) * 0.16666666666666666
    return y


@triton.jit
def epilogue(y, residual, ACTIVATION: tl.constexpr, alpha, beta, HAS_RES: tl.constexpr, RES_AFTER: tl.constexpr):
    """act(y + residual), or act(y) + residual when RES_AFTER: the residual step of kiln::FusedGemm /
    FusedConv around the activation. Without HAS_RES, `residual` is not read (pass y)."""
    if HAS_RES:
        if not RES_AFTER:
            y += residual
    y = activate(y, ACTIVATION, alpha, beta)
    if HAS_RES:
        if RES_AFTER:
            y += residual
    return y


@triton.jit
def grouped_tile(pid, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program `pid` of a tiled GEMM: GROUP_M row tiles take each column
    tile in turn, so it is read from L2 while it is still there."""
    group_size = GROUP_M * tiles_n
    first_m = (pid // group_size) * GROUP_M
    rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (pid % group_size) % rows_in_group, (pid % group_size) // rows_in_group


ACTIVATIONS = ("", "Relu", "Clip", "Sigmoid", "SiLU", "Tanh", "Gelu", "GeluTanh", "LeakyRelu", "HardSigmoid",
               "HardSwish")
