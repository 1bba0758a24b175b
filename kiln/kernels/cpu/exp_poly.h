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

#endif
