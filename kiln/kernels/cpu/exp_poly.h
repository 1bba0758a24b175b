/* e^x as Cephes' expf computes it: the one copy of its reduction and polynomial that kiln's C kernels share
 * (gemm.c's epilogues, recurrent.c's and lstm.c's cells, se.c, lstm_lanes.c's vector cell, attention.c's
 * softmax). Included by path: native_loop.build compiles with this folder on -I and keys its cache on this
 * folder's headers too, and the timing cache's kernels digest covers every .h under kiln/kernels.
 *
 *   x = n·ln2 + r, n = rint(x·log2 e), |r| <= ln2/2; r by Cody-Waite (ln2 = 0.693359375 - 2.12194440e-4, the
 *   first part exact in 9 bits, so n·it is exact for |n| < 2^15); e^r = 1 + r + r²·p(r), p of degree 5;
 *   2^n written into the float's exponent bits. Within 1.01 ulp of e^x on [-87, 88] (tests/unit/test_exp_poly.py).
 *
 * The pieces are macros on operators GNU C takes for a float and for a vector of floats alike, so that the
 * scalar and the vector forms run the same operations in the same order (an LSTM's scalar cell and vector cell
 * round alike). Except n: the vector forms round it by the 1.5·2²³ trick, whose multiply-add contracts to one
 * FMA, where rintf rounds x·log2 e first; within an ulp of x·log2 e from a half-integer the two can take
 * neighbouring n (e^x then differs by an ulp or so: 2 of 4M random x). What differs between callers stays
 * with them: how x is clamped, how n is rounded (rintf, the ISA's round or the trick) and attention.c's last
 * step, whose association, p·r² + (r + 1), predates this file (changing it would move softmaxes by an ulp).
 */
#ifndef KILN_EXP_POLY_H
#define KILN_EXP_POLY_H

#include <string.h>

#define KILN_EXP_LOG2E 1.44269504088896341f

/* rint(x·log2 e) by adding and subtracting 1.5·2²³ (round to nearest even in the FPU's default mode): for
   vectors, where GNU C has no rint; exact while |x·log2 e| < 2²² (any clamped x) */
#define KILN_EXP_RINT(x) (((x) * KILN_EXP_LOG2E + 12582912.0f) - 12582912.0f)

/* r = x - n·ln2 */
#define KILN_EXP_REDUCE(x, n) ((x) - (n) * 0.693359375f + (n) * 2.12194440e-4f)

/* p(r) of e^r = 1 + r + r²·p(r), Horner's order */
#define KILN_EXP_P(r)                                                                                        \
    (((((1.9875691500e-4f * (r) + 1.3981999507e-3f) * (r) + 8.3334519073e-3f) * (r) + 4.1665795894e-2f) * (r) \
      + 1.6666665459e-1f) * (r) + 5.0000001201e-1f)

/* e^r */
#define KILN_EXP_POLY(r) (KILN_EXP_P(r) * (r) * (r) + (r) + 1.0f)

/* 2^n as the bits of a vector of floats (VI: the vector of ints of its width), n integral and normal */
#define KILN_EXP_2N(n, VI) ((__builtin_convertvector(n, VI) + 127) << 23)

#pragma GCC push_options
#pragma GCC optimize("no-trapping-math")  /* as its callers: their loops vectorise the clamp's selects */

/* e^x, x clamped to where 2^n is a normal float (below: ~0, above: ~FLT_MAX) */
static inline float exp_poly(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float n = __builtin_rintf(x * KILN_EXP_LOG2E);
    const float r = KILN_EXP_REDUCE(x, n);
    const float p = KILN_EXP_POLY(r);
    const int bits = ((int)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

#pragma GCC pop_options

/* exp_poly on a vector V of floats (VI: of ints), defined as NAME with the attributes DECLARE (e.g. static
   inline and a target) and the caller's CLAMP(x, lo, hi): the same operations in the same order as exp_poly */
#define KILN_VEXP(NAME, DECLARE, V, VI, CLAMP)                                                               \
    DECLARE V NAME(V x) {                                                                                    \
        x = CLAMP(x, -87.0f, 88.0f);                                                                         \
        const V n = KILN_EXP_RINT(x);                                                                        \
        const V r = KILN_EXP_REDUCE(x, n);                                                                   \
        const V p = KILN_EXP_POLY(r);                                                                        \
        return p * (V)KILN_EXP_2N(n, VI);                                                                    \
    }

/* x·σ(x) on a vector V of floats (VI: of ints), defined as NAME with the attributes DECLARE, MIN and MAX the
   ISA's min and max (they return their second operand where either is NaN, so a NaN x passes through): the SiLU
   of depthwise.c's, se.c's and gemm.c's epilogues (gemm.c's SwiGLU gating too). Not exp_poly and a division by
   1 + e^-x: on a Zen 4 core the FMA pipes bound that one, so this form trims them. With x' = min(max(x, -88), 87),
   n = rint(-x'·log2 e) (the 1.5·2²³ trick, with its bits used as 2^n below) and r = x' + n·ln2 (Cody-Waite,
   |r| <= ln2/2), e^-x' = 2^n·e^-r, and
   e^-r = q(-r)/q(r), q the [3/3] Padé numerator of e^r scaled to q(0) = 1 (1 + r/2 + r²/10 + r³/120; its error
   is under 6e-9 relative on the range), so
       SiLU = x'·q(r) / (q(r) + 2^n·q(-r)),
   one division, 2^n applied as an integer add to q(-r)'s exponent bits (exact: q(-r) is in [0.7, 1.4] and n
   in [-126, 127]; at n = -126 the sum may leave the normal range, where it is under 2^-126 against q(r) >= 0.7,
   and so only rounds away). Against float64 (bench/silu_accuracy.py, every 61st float): <= 3.4 ulp for x in
   [-87, 0), <= 2.3 on [0, 20), <= 1.02 above (the loop it replaced: 3.5, 2.0, 0.02). Below x = -88 the result
   is that at -88 (x clamped), -5.3e-37: within 6e-37 of the true value (under 1.4e-36 in magnitude there),
   where the old x / (1 + e^88) came out as x·6e-39 (-1e30 gave -6e-9, -inf gave -inf). So: +inf -> +inf, -inf ->
   -5.3e-37, NaN -> NaN, ±0 -> ±0. Per element 0.64x the old loop's time under AVX2 and 0.79x under AVX-512 on
   an AMD EPYC (Zen 4) core (bench/results/dw-avx2-2026-12-06.md). */
#define KILN_VSILU(NAME, DECLARE, V, VI, MIN, MAX)                                                           \
    DECLARE V NAME(V x) {                                                                                    \
        const V a = (V)MAX((V){0} - 88.0f, x);                                                               \
        const V b = (V)MIN((V){0} + 87.0f, a);                                                               \
        const V t = b * -KILN_EXP_LOG2E + 12582912.0f; /* bits: 0x4B400000 + n */                           \
        const V n = t - 12582912.0f;                                                                         \
        V r = n * 0.693359375f + b;                                                                          \
        r = n * -2.12194440e-4f + r;                                                                         \
        const V r2 = r * r;                                                                                  \
        const V e = r2 * 0.1f + 1.0f;                        /* q's even part */                             \
        const V w = r2 * (1.0f / 120.0f) + 0.5f;             /* q's odd part over r */                       \
        const V num = w * r + e, den = e - w * r;            /* q(r), q(-r) */                               \
        const V scaled = (V)((VI)den + ((VI)t << 23));       /* 2^n·q(-r): n << 23 added to the exponent */  \
        return a * num / (scaled + num);                                                                     \
    }

/* 2^(j/8) and 2^(j/16), j = 0..7 / 0..15, rounded to float: KILN_VSILU_TABLE's tables */
#define KILN_EXP2_TABLE_3                                                                                    \
    {1.0f, 1.09050773f, 1.18920712f, 1.29683955f, 1.41421356f, 1.54221083f, 1.68179283f, 1.83400809f}
#define KILN_EXP2_TABLE_4                                                                                    \
    {1.0f, 1.04427378f, 1.09050773f, 1.13878863f, 1.18920712f, 1.24185781f, 1.29683955f, 1.35425555f,         \
     1.41421356f, 1.47682615f, 1.54221083f, 1.61049033f, 1.68179283f, 1.75625216f, 1.83400809f, 1.91520656f}
/* e^-r - 1 = r·(-1 + c2·r + c3·r²) on |r| <= ln2/2^(BITS+1): the cubic fitted to the relative error of e^-r
   (Lawson's iteration on Chebyshev nodes; 2.5e-8 at BITS = 3, 1.6e-9 at 4, where Taylor's 1/2, -1/6 give 1.5e-7
   and 9.3e-9) */
#define KILN_SILU_C2_3 0.50006479f
#define KILN_SILU_C3_3 -0.16664298f
#define KILN_SILU_C2_4 0.50001621f
#define KILN_SILU_C3_4 -0.16666074f

/* x·σ(x) as x' / (1 + e^-x') with e^-x' from a table of 2^(j/2^BITS) and a cubic: KILN_VSILU's clamp and
   results (the same specials: +inf -> +inf, -inf and x < -88 -> SiLU(-88), NaN -> NaN, ±0 -> ±0) in fewer
   FMA-pipe operations, for a V of exactly 2^BITS lanes (8: BITS 3, AVX2; 16: BITS 4, AVX-512) and PERMUTE(table,
   t), the ISA's one-instruction permute of a register by the low BITS bits of each lane of t's bits (vpermps /
   vpermps zmm). With m = rint(-x'·log2 e·2^BITS) (the 1.5·2²³ trick: t's low bits are m's) and r = x' + m·ln2/2^BITS
   (Cody-Waite, |r| <= ln2/2^(BITS+1)): e^-x' = 2^(m >> BITS) · 2^((m & (2^BITS-1))/2^BITS) · e^-r, the middle factor
   s from the table, s·e^-r = s·q + s with q = e^-r - 1 the cubic above (q small, so s's product rounds little),
   and 2^(m >> BITS) an integer add to the exponent bits: (t << (23 - BITS)) keeps m's bits from BITS up at the
   exponent's place (the 1.5·2²³ offset shifts out), the mask drops the fraction's. (m >> BITS in [-126, 126] on
   the clamp, s·e^-r in [0.98, 1.98]: at -126 the sum can fall to the subnormal range, where it is under 2^-125
   against 1 and only rounds away.) Operations: 7 FMA-pipe ones (KILN_VSILU: 9), a permute, three integer ones,
   two adds, the two clamps and the division. Against float64 (bench/silu_ab.py, every 61st float): <= 2.2 ulp on
   [-88, -20), <= 2.9 on [-20, 0), <= 1.8 on [0, 20), 0.02 above (KILN_VSILU: 2.7, 3.4, 2.3, 1.0). */
#define KILN_VSILU_TABLE(NAME, DECLARE, V, VI, MIN, MAX, BITS, PERMUTE)                                     \
    DECLARE V NAME(V x) {                                                                                    \
        const V table = KILN_EXP2_TABLE_##BITS;                                                              \
        const V a = (V)MAX((V){0} - 88.0f, x);                                                               \
        const V b = (V)MIN((V){0} + 87.0f, a);                                                               \
        const V t = b * (-KILN_EXP_LOG2E * (1 << BITS)) + 12582912.0f; /* bits: 0x4B400000 + m */            \
        const V m = t - 12582912.0f;                                                                         \
        V r = m * (0.693359375f / (1 << BITS)) + b;                                                          \
        r = m * (-2.12194440e-4f / (1 << BITS)) + r;                                                         \
        V q = r * KILN_SILU_C3_##BITS + KILN_SILU_C2_##BITS;                                                 \
        q = (q * r - 1.0f) * r;                                                                              \
        const V s = (V)PERMUTE(table, t);                                                                    \
        const VI scale = ((VI)t << (23 - BITS)) & (VI){0} + (int)0xFF800000; /* (m >> BITS) << 23 */         \
        const V e = (V)((VI)(q * s + s) + scale);                                                            \
        return a / (e + 1.0f);                                                                               \
    }

/* the scalar SiLU beside KILN_VSILU (the channels past a vector): exp_poly and a division, x clamped below at
   -88 as there, so that ±inf and NaN come out alike */
static inline float silu_scalar(float x) {
    x = x < -88.0f ? -88.0f : x;
    return x / (1.0f + exp_poly(-x));
}

#endif
