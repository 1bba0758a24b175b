/* SiLU forms side by side on this CPU (issue 11): accuracy against float64 over every STEP-th float bit pattern,
 * by range of x, the specials, and time per element in a cache-resident loop, the forms interleaved (9 rounds,
 * medians). Built and run by bench/silu_ab.py for the native ISA and for x86-64-v3 (AVX2).
 *
 *   old:    exp_poly's steps with a degree-5 polynomial and x / (1 + e^-x): se.c's and depthwise.c's loop before
 *           session 24
 *   kiln:   exp_poly.h's KILN_VSILU (the [3/3] Padé form with one division), what the kernels compile now
 *   poly:   KILN_VSILU's reduction and exponent add with Cephes' degree-7 e^r, x / (1 + e^-x): the more
 *           accurate alternative, kept here for the comparison
 *   rcp:    KILN_VSILU with the division as a reciprocal estimate and one Newton step
 *   table:  exp_poly.h's KILN_VSILU_TABLE (x / (1 + e^-x), e^-x from a table of 2^(j/16) (AVX-512) or 2^(j/8) (AVX2)
 *           and a cubic), depthwise.c's SiLU under AVX-512 since session 26
 *   tabrcp: table with the division as a reciprocal estimate and one Newton step on the quotient
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "exp_poly.h"

#pragma GCC optimize("no-trapping-math")
#if defined(__AVX512F__)
#define LANES 16
#define VMIN _mm512_min_ps
#define VMAX _mm512_max_ps
#define VRCP _mm512_rcp14_ps
#else
#define LANES 8
#define VMIN _mm256_min_ps
#define VMAX _mm256_max_ps
#define VRCP _mm256_rcp_ps
#endif
typedef float vf __attribute__((vector_size(LANES * 4)));
typedef int vi __attribute__((vector_size(LANES * 4)));

static inline vf silu_old(vf x) {
    const vf z = (vf)VMIN(VMAX(-x, (vf){0} - 87.0f), (vf){0} + 88.0f);
    const vf n = KILN_EXP_RINT(z);
    const vf r = KILN_EXP_REDUCE(z, n);
    vf p = (vf){0} + 8.3128601646e-3f;
    p = p * r + 4.1889020096e-2f;
    p = p * r + 1.6667110632e-1f;
    p = p * r + 4.9999243235e-1f;
    p = p * r * r + r + 1.0f;
    return x / (1.0f + p * (vf)KILN_EXP_2N(n, vi));
}

KILN_VSILU(silu_kiln, static inline, vf, vi, VMIN, VMAX)

static inline vf silu_poly(vf x) {
    const vf a = (vf)VMAX((vf){0} - 88.0f, x);
    const vf b = (vf)VMIN((vf){0} + 87.0f, a);
    const vf t = b * -KILN_EXP_LOG2E + 12582912.0f;
    const vf n = t - 12582912.0f;
    vf r = n * 0.693359375f + b;
    r = n * -2.12194440e-4f + r;
    vf p = (vf){0} - 1.9875691500e-4f;  /* e^-r: Cephes' coefficients, the odd ones negated */
    p = p * r + 1.3981999507e-3f;
    p = p * r - 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r - 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r - 1.0f;
    p = p * r + 1.0f;
    return a / ((vf)((vi)p + ((vi)t << 23)) + 1.0f);
}

static inline vf silu_rcp(vf x) {
    const vf a = (vf)VMAX((vf){0} - 88.0f, x);
    const vf b = (vf)VMIN((vf){0} + 87.0f, a);
    const vf t = b * -KILN_EXP_LOG2E + 12582912.0f;
    const vf n = t - 12582912.0f;
    vf r = n * 0.693359375f + b;
    r = n * -2.12194440e-4f + r;
    const vf r2 = r * r;
    const vf e = r2 * 0.1f + 1.0f;
    const vf w = r2 * (1.0f / 120.0f) + 0.5f;
    const vf num = w * r + e, den = e - w * r;
    const vf d = (vf)((vi)den + ((vi)t << 23)) + num;
    const vf r0 = VRCP(d);
    const vf y0 = a * num * r0;
    return y0 * (1.0f - d * r0) + y0;
}

#if LANES == 16
#define PERMUTE(table, t) _mm512_permutexvar_ps((__m512i)(t), (__m512)(table))
KILN_VSILU_TABLE(silu_table, static inline, vf, vi, VMIN, VMAX, 4, PERMUTE)
#else
#define PERMUTE(table, t) _mm256_permutevar8x32_ps((__m256)(table), (__m256i)(t))
KILN_VSILU_TABLE(silu_table, static inline, vf, vi, VMIN, VMAX, 3, PERMUTE)
#endif

static inline vf silu_tabrcp(vf x) {  /* KILN_VSILU_TABLE's steps, the division as rcp + one Newton step */
    const vf a = (vf)VMAX((vf){0} - 88.0f, x);
    const vf b = (vf)VMIN((vf){0} + 87.0f, a);
#if LANES == 16
    const vf table = KILN_EXP2_TABLE_4;
    const vf t = b * (-KILN_EXP_LOG2E * 16) + 12582912.0f;
    const vf m = t - 12582912.0f;
    vf r = m * (0.693359375f / 16) + b;
    r = m * (-2.12194440e-4f / 16) + r;
    vf q = r * KILN_SILU_C3_4 + KILN_SILU_C2_4;
    const vi scale = ((vi)t << 19) & (vi){0} + (int)0xFF800000;
#else
    const vf table = KILN_EXP2_TABLE_3;
    const vf t = b * (-KILN_EXP_LOG2E * 8) + 12582912.0f;
    const vf m = t - 12582912.0f;
    vf r = m * (0.693359375f / 8) + b;
    r = m * (-2.12194440e-4f / 8) + r;
    vf q = r * KILN_SILU_C3_3 + KILN_SILU_C2_3;
    const vi scale = ((vi)t << 20) & (vi){0} + (int)0xFF800000;
#endif
    q = (q * r - 1.0f) * r;
    const vf s = (vf)PERMUTE(table, t);
    const vf d = (vf)((vi)(q * s + s) + scale) + 1.0f;
    const vf r0 = VRCP(d);
    const vf y0 = a * r0;
    return (a - d * y0) * r0 + y0;
}

typedef vf (*form)(vf);
#define FORMS 6
static const char *names[FORMS] = {"old", "kiln", "poly", "rcp", "table", "tabrcp"};

#define N_BENCH (1 << 14)
static float buf[N_BENCH] __attribute__((aligned(64)));
#define BENCH(F)                                                                                              \
    static double bench_##F(int reps) {                                                                       \
        struct timespec t0, t1;                                                                               \
        clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t0);                                                          \
        for (int k = 0; k < reps; ++k)                                                                        \
            for (int j = 0; j < N_BENCH; j += LANES) {                                                        \
                vf v;                                                                                         \
                memcpy(&v, buf + j, sizeof v);                                                                \
                v = F(v);                                                                                     \
                memcpy(buf + j, &v, sizeof v);                                                                \
            }                                                                                                 \
        clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t1);                                                          \
        return ((t1.tv_sec - t0.tv_sec) * 1e9 + (t1.tv_nsec - t0.tv_nsec)) / ((double)reps * N_BENCH);        \
    }
BENCH(silu_old) BENCH(silu_kiln) BENCH(silu_poly) BENCH(silu_rcp) BENCH(silu_table) BENCH(silu_tabrcp)

static double ulps(float y, double want) {
    const double a = fabs(want);
    int e;
    if (a < 1.1754943508222875e-38) return fabs((double)y - want) / ldexp(1.0, -149);
    frexp(a, &e);
    return fabs((double)y - want) / ldexp(1.0, e - 24);
}

static void accuracy(const char *name, form f, uint32_t step) {
    /* bins: x < -88 (absolute error), [-88, -20), [-20, 0), [0, 20), >= 20 (ulp) */
    double worst[5] = {0};
    float at[5] = {0}, xs[LANES], ys[LANES];
    int k = 0;
    for (uint64_t bits = 0; bits < 0x100000000ull; bits += step) {
        const uint32_t b32 = (uint32_t)bits;
        float x;
        memcpy(&x, &b32, 4);
        if (!isfinite(x)) continue;
        xs[k++] = x;
        if (k < LANES) continue;
        vf v;
        memcpy(&v, xs, sizeof v);
        v = f(v);
        memcpy(ys, &v, sizeof v);
        for (int i = 0; i < LANES; ++i) {
            const double xd = xs[i], want = xd / (1.0 + exp(-xd));
            const int bin = xd < -88 ? 0 : xd < -20 ? 1 : xd < 0 ? 2 : xd < 20 ? 3 : 4;
            const double err = bin == 0 ? fabs((double)ys[i] - want) : ulps(ys[i], want);
            if (err > worst[bin]) worst[bin] = err, at[bin] = xs[i];
        }
        k = 0;
    }
    float special[LANES] = {INFINITY, -INFINITY, NAN, -NAN, 0.0f, -0.0f, 1e30f, -1e30f};
    vf v;
    memcpy(&v, special, sizeof v);
    v = f(v);
    memcpy(ys, &v, sizeof v);
    printf("| %s | %.2g (%g) | %.2f (%g) | %.2f (%g) | %.2f (%g) | %.2f (%g) | %g, %g, %g, %g, %g |\n", name,
           worst[0], at[0], worst[1], at[1], worst[2], at[2], worst[3], at[3], worst[4], at[4], ys[0], ys[1], ys[2],
           ys[6], ys[7]);
}

int main(int argc, char **argv) {
    const uint32_t step = argc > 1 ? (uint32_t)atoi(argv[1]) : 61;
    const form forms[FORMS] = {silu_old, silu_kiln, silu_poly, silu_rcp, silu_table, silu_tabrcp};
    printf("\n%d lanes, every %u-th float: worst error against float64\n\n", LANES, step);
    printf("| form | x < -88 abs | [-88, -20) ulp | [-20, 0) ulp | [0, 20) ulp | >= 20 ulp | inf, -inf, nan, 1e30, -1e30 |\n");
    printf("|---|---|---|---|---|---|---|\n");
    for (int i = 0; i < FORMS; ++i) accuracy(names[i], forms[i], step);
    double t[FORMS][9];
    for (int round = 0; round < 9; ++round) {
        for (int j = 0; j < N_BENCH; ++j) buf[j] = (float)(j % 977) * 0.02f - 10.0f;
        t[0][round] = bench_silu_old(200);
        t[1][round] = bench_silu_kiln(200);
        t[2][round] = bench_silu_poly(200);
        t[3][round] = bench_silu_rcp(200);
        t[4][round] = bench_silu_table(200);
        t[5][round] = bench_silu_tabrcp(200);
    }
    printf("\n| form | ns an element, %d lanes (median of 9 interleaved rounds) | / old |\n|---|---|---|\n", LANES);
    double median[FORMS];
    for (int i = 0; i < FORMS; ++i) {
        double s[9];
        memcpy(s, t[i], sizeof s);
        for (int a = 0; a < 9; ++a)
            for (int b = a + 1; b < 9; ++b)
                if (s[b] < s[a]) { const double q = s[a]; s[a] = s[b]; s[b] = q; }
        median[i] = s[4];
    }
    for (int i = 0; i < FORMS; ++i) printf("| %s | %.3f | %.2f |\n", names[i], median[i], median[i] / median[0]);
    return 0;
}
