/* A network's first convolution: few input channels (C_in <= 4: an RGB image), any kernel up to 11x11, strides 1 to
 * 4, any padding, no dilation or groups, with its epilogue (bias, ReLU / Clip); NCHW in (the image as it arrives: a
 * segment's entry needs no relayout), NHWC out (what the convolutions after it read); a member of native segments
 * (kiln/runtime/native.py), compiled once by kiln/kernels/cpu/stem.py through native_loop.build.
 *
 *   y[n, oh, ow, o] = act(b[o] + sum_{c, kh, kw} x[n, c, oh·s - pt + kh, ow·s - pl + kw] · w[o, c, kh, kw])
 *
 * Why: ResNet-tiny's 7x7/2 and RegNetY-tiny's 3x3/2 stems were the gap to onnxruntime on the Zen 3
 * (bench/results/zoo-cpu-zen3-all-2026-12-07.md). oneDNN's NHWC convolution needs the image copied into NHWC at
 * the segment's entry; this kernel reads it where it lies. The reduction is over every tap (C_in·KH·KW: 147 for a
 * 7x7 on RGB) and the vector over output channels: per tap, one broadcast input value per output pixel meets G
 * weight vectors of 8 output channels, into U x G accumulators (U pixels of a row x G vectors: 6 x 2 = 12 of 16
 * ymm). Alone it is ~5-10% ahead of oneDNN's jit:avx2 on 16 output channels and behind on 32-64 at 224²
 * (bench/results/stem-avx2-2026-12-07.md): which kernel a layer runs is the autotuner's pick
 * (kiln/tactics/cpu/stem.py).
 *
 * The weights are packed at build as [Op/8][C][KH][KW][8] (Op: O rounded up to 8, zeros past O): one vector load
 * per tap and group. Tap rows outside the input are skipped for the whole row; a block whose tap columns reach past
 * a side of the input reads a zero-padded copy of its window ([C][KH][span] floats on the stack).
 *
 * Returns 0, or 2 (oneDNN's "invalid arguments") when an operand is not bound: the segment names the layer.
 */
#include <omp.h>
#include <stddef.h>
#if defined(__AVX__)
#include <immintrin.h>
#endif

typedef int (*get_handle_fn)(void *memory, void **handle);

enum { ACT_NONE = 0, ACT_RELU = 1, ACT_CLIP = 4 };  /* se.c's numbering */

typedef struct {
    get_handle_fn get_handle;
    void *x, *y;                  /* dnnl_memory_t: NCHW [N, C, H, W], NHWC [N, OH, OW, O] */
    const float *w;               /* [Op/8][C][KH][KW][8] */
    const float *b;               /* [Op] (zeros without a bias) */
    long N, C, O, Op, H, W, OH, OW;
    int KH, KW, SH, SW, PT, PL;
    int activation;
    float alpha, beta;            /* Clip's min and max */
    int threads;                  /* 1: no parallel region */
} stem_plan;

#pragma GCC push_options
#pragma GCC optimize("no-trapping-math")

typedef float v8 __attribute__((vector_size(32)));
typedef float v8_u __attribute__((vector_size(32), aligned(4)));  /* an unaligned vector in memory */

#if defined(__AVX__)
static inline v8 vmax(v8 a, v8 b) { return (v8)_mm256_max_ps((__m256)a, (__m256)b); }
static inline v8 vmin(v8 a, v8 b) { return (v8)_mm256_min_ps((__m256)a, (__m256)b); }
#else
static inline v8 vmax(v8 a, v8 b) { for (int i = 0; i < 8; ++i) a[i] = a[i] > b[i] ? a[i] : b[i]; return a; }
static inline v8 vmin(v8 a, v8 b) { for (int i = 0; i < 8; ++i) a[i] = a[i] < b[i] ? a[i] : b[i]; return a; }
#endif

static inline v8 epilogue(const stem_plan *p, v8 v) {
    if (p->activation == ACT_RELU) {
        const v8 zero = {0};
        v = vmax(v, zero);
    } else if (p->activation == ACT_CLIP) {
        const v8 lo = {p->alpha, p->alpha, p->alpha, p->alpha, p->alpha, p->alpha, p->alpha, p->alpha};
        const v8 hi = {p->beta, p->beta, p->beta, p->beta, p->beta, p->beta, p->beta, p->beta};
        v = vmin(vmax(v, lo), hi);
    }
    return v;
}

static inline void store(const stem_plan *p, float *out, long g, v8 v) {
    const long left = p->O - g * 8;  /* output channels of this group that exist */
    if (left >= 8) {
        *(v8_u *)(out + g * 8) = v;
    } else {
        for (long i = 0; i < left; ++i) out[g * 8 + i] = v[i];
    }
}

/* U output pixels x G groups of 8 channels from group g0, from `src`: channel 0's tap row 0 at the block's first
   input column, channels `cstride` floats apart, rows `rstride` (the image itself, or a block's zero-padded copy at
   a side); tap rows kh_lo .. kh_hi - 1 (the others lie in the padding). Inlined with constant U and G: the U x G
   accumulators live in registers (one pixel at a time would chain every FMA on one or two accumulators). Not
   unrolled over a 3- or 7-wide tap row: GCC then reads each weight vector from memory once per FMA (12 loads where
   the loop makes 2), 1.16x -> 1.34x oneDNN's time on RegNetY-tiny's 3x3/2 stem (session 30). */
static inline __attribute__((always_inline)) void block(const stem_plan *p, const float *src, long cstride,
                                                         long rstride, long kh_lo, long kh_hi, float *out, long g0,
                                                         const int U, const int G) {
    v8 acc[6][2];
    for (int g = 0; g < G; ++g) {
        const v8 bias = *(const v8_u *)(p->b + (g0 + g) * 8);
        for (int u = 0; u < U; ++u) acc[u][g] = bias;
    }
    const long C = p->C, KH = p->KH, KW = p->KW, SW = p->SW;
    const long group_stride = C * KH * KW * 8;  /* floats between groups' packed weights */
    for (long c = 0; c < C; ++c) {
        for (long kh = kh_lo; kh < kh_hi; ++kh) {
            const float *r = src + c * cstride + kh * rstride;
            const float *wt = p->w + g0 * group_stride + ((c * KH + kh) * KW) * 8;
            for (long kw = 0; kw < KW; ++kw) {
                v8 wv[2];
                for (int g = 0; g < G; ++g) wv[g] = *(const v8 *)(wt + g * group_stride + kw * 8);
                for (int u = 0; u < U; ++u) {
                    const float xv = r[kw + u * SW];
                    const v8 xb = {xv, xv, xv, xv, xv, xv, xv, xv};
                    for (int g = 0; g < G; ++g) acc[u][g] += xb * wv[g];
                }
            }
        }
    }
    for (int u = 0; u < U; ++u)
        for (int g = 0; g < G; ++g) store(p, out + u * p->O, g0 + g, epilogue(p, acc[u][g]));
}

#define UMAX 6  /* pixels a block: 6 x 2 accumulators + 2 weights + 1 input of 16 ymm */

/* a block of u <= UMAX pixels (u known only at run time: the sides' and a row's last) */
static void block_any(const stem_plan *p, const float *src, long cstride, long rstride, long kh_lo, long kh_hi,
                      float *out, long g0, int u, int G) {
#define CASE(U) case U: \
        if (G == 2) block(p, src, cstride, rstride, kh_lo, kh_hi, out, g0, U, 2); \
        else block(p, src, cstride, rstride, kh_lo, kh_hi, out, g0, U, 1); \
        break;
    switch (u) { CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) default: break; }
#undef CASE
}

#define MAX_C 4
#define MAX_K 11
#define MAX_SPAN (5 * 4 + MAX_K)  /* (UMAX - 1) · stride + KW input columns of a block, strides up to 4 */

/* One output row: blocks of UMAX pixels, each for every group (two at a time, one at the end of an odd count); a
   block whose tap columns reach past a side of the input reads a zero-padded copy of its window. */
static void row(const stem_plan *p, const float *x, float *y, long n, long oh) {
    const long C = p->C, H = p->H, W = p->W, KH = p->KH, KW = p->KW, SW = p->SW;
    /* interior columns: ow·SW - PL >= 0 and ow·SW - PL + KW - 1 < W */
    long lo = (p->PL + SW - 1) / SW, hi = W - KW + p->PL >= 0 ? (W - KW + p->PL) / SW + 1 : 0;
    if (hi > p->OW) hi = p->OW;
    if (lo > hi) lo = hi;
    const long ih0 = oh * p->SH - p->PT;
    const long kh_lo = ih0 < 0 ? -ih0 : 0, kh_hi = ih0 + KH > H ? H - ih0 : KH;
    const float *image = x + n * C * H * W;
    const long groups = p->Op / 8;
    float window[MAX_C * MAX_K * MAX_SPAN];
    for (long ow = 0; ow < p->OW; ow += UMAX) {
        const int u = p->OW - ow < UMAX ? (int)(p->OW - ow) : UMAX;
        const long iw0 = ow * SW - p->PL;
        float *out = y + ((n * p->OH + oh) * p->OW + ow) * p->O;
        const float *src = image + ih0 * W + iw0;  /* tap row 0 may lie above the image: only kh_lo.. are read */
        long cstride = H * W, rstride = W;
        if (ow < lo || ow + u > hi) {  /* a side: the window [C][KH][span], zeros outside the image */
            const long span = (u - 1) * SW + KW;
            for (long c = 0; c < C; ++c)
                for (long kh = kh_lo; kh < kh_hi; ++kh) {
                    const float *in = image + c * H * W + (ih0 + kh) * W;
                    float *to = window + (c * KH + kh) * span;
                    for (long j = 0; j < span; ++j) {
                        const long col = iw0 + j;
                        to[j] = col >= 0 && col < W ? in[col] : 0.0f;
                    }
                }
            src = window, cstride = KH * span, rstride = span;
        }
        for (long g0 = 0; g0 < groups; g0 += 2) {
            const int G = g0 + 1 < groups ? 2 : 1;
            if (u == UMAX && G == 2) block(p, src, cstride, rstride, kh_lo, kh_hi, out, g0, UMAX, 2);
            else block_any(p, src, cstride, rstride, kh_lo, kh_hi, out, g0, u, G);
        }
    }
}

int kiln_stem(void *object, void *stream, int nargs, const void *args) {
    (void)stream; (void)nargs; (void)args;
    const stem_plan *p = (const stem_plan *)object;
    float *x = NULL, *y = NULL;
    if (p->get_handle(p->x, (void **)&x) != 0 || x == NULL) return 2;
    if (p->get_handle(p->y, (void **)&y) != 0 || y == NULL) return 2;
    const long rows = p->N * p->OH;
    #pragma omp parallel num_threads(p->threads) if (p->threads > 1)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const long lo = rows * t / nt, hi = rows * (t + 1) / nt;
        for (long r = lo; r < hi; ++r) row(p, x, y, r / p->OH, r % p->OH);
    }
    return 0;
}

#pragma GCC pop_options
