/* A network's first convolution: few input channels (C_in <= 4: an RGB image), any kernel up to 11x11, any stride and
 * padding, no dilation or groups, with its epilogue (bias, ReLU / Clip), NCHW in (the image as it arrives: a segment's entry
 * needs no relayout), NHWC out (what the convolutions after it read), a member of native segments (kiln/runtime/native.py): compiled once by kiln/kernels/cpu/stem.py through native_loop.build.
 *
 *   y[n, oh, ow, o] = act(b[o] + sum_{kh, kw, c} x[n, oh·s - pt + kh, ow·s - pl + kw, c] · w[o, c, kh, kw])
 *
 * Why: with 3 input channels oneDNN's direct convolution keeps an FMA port about half busy on AVX2 (its reduction
 * over C_in is 3 long), and ResNet-tiny's 7x7/2 and RegNetY-tiny's 3x3/2 stems were the gap to onnxruntime on the
 * Zen 3 (bench/results/zoo-cpu-zen3-all-2026-12-07.md). Here the reduction is over every tap (KH·KW·C_in: 147 for
 * a 7x7 on RGB) and the vector over output channels: per tap, one broadcast input value per output pixel meets
 * G weight vectors of 8 output channels, into U x G accumulators (U pixels of a row x G vectors: 6 x 2 = 12 of 16
 * ymm). Reading NCHW, a segment whose entry is the image (NCHW) reads it where it lies, where oneDNN's NHWC
 * convolution has it copied into NHWC first. Which kernel a layer runs is the autotuner's pick, timed beside oneDNN's (kiln/tactics/cpu/stem.py).
 *
 * The weights are packed at build as [Op/8][KH][KW][C][8] (Op: O rounded up to 8, zeros past O): one vector load
 * per tap and group. Padding is never materialised: tap rows outside the input are skipped for the whole block,
 * and the output columns whose taps reach past a side run one pixel at a time with the columns checked.
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
    const float *w;               /* [Op/8][KH][KW][C][8] */
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

/* U output pixels (ow0 .. ow0 + U - 1 of row `oh`) x G groups of 8 channels from group g0. checked = 0: every tap
   column of the block lies inside the input; checked = 1 (a block at a side): a column outside reads zero. Inlined
   with constant U, G, checked: the U x G accumulators live in registers (U = 1 would chain every FMA on one or two
   accumulators: 4 cycles a tap on Zen 3, so the sides run in blocks too). */
static inline __attribute__((always_inline)) void block(const stem_plan *p, const float *x, float *y, long n, long oh,
                                                         long ow0, long g0, const int U, const int G,
                                                         const int checked) {
    v8 acc[6][2];
    for (int g = 0; g < G; ++g) {
        const v8 bias = *(const v8_u *)(p->b + (g0 + g) * 8);
        for (int u = 0; u < U; ++u) acc[u][g] = bias;
    }
    const long C = p->C, W = p->W, KW = p->KW, SW = p->SW;
    const long tap_stride = p->KH * KW * C * 8;  /* floats between groups' packed weights */
    const long ih0 = oh * p->SH - p->PT, iw0 = ow0 * SW - p->PL;
    for (long kh = 0; kh < p->KH; ++kh) {
        const long ih = ih0 + kh;
        if (ih < 0 || ih >= p->H) continue;
        const float *row = x + (n * C * p->H + ih) * W;  /* channel 0's row ih; channel c's is c·H·W further */
        const float *wk = p->w + g0 * tap_stride + kh * KW * C * 8;
        for (long kw = 0; kw < KW; ++kw) {
            const long iw = iw0 + kw;
            const float *wt = wk + kw * C * 8;
            for (long c = 0; c < C; ++c) {
                const float *px = row + c * p->H * W + iw;
                v8 wv[2];
                for (int g = 0; g < G; ++g) wv[g] = *(const v8 *)(wt + g * tap_stride + c * 8);
                for (int u = 0; u < U; ++u) {
                    float xv;
                    if (checked) {
                        const long col = iw + u * SW;
                        xv = col >= 0 && col < W ? px[u * SW] : 0.0f;
                    } else {
                        xv = px[u * SW];
                    }
                    const v8 xb = {xv, xv, xv, xv, xv, xv, xv, xv};
                    for (int g = 0; g < G; ++g) acc[u][g] += xb * wv[g];
                }
            }
        }
    }
    for (int u = 0; u < U; ++u) {
        float *out = y + ((n * p->OH + oh) * p->OW + ow0 + u) * p->O;
        for (int g = 0; g < G; ++g) store(p, out, g0 + g, epilogue(p, acc[u][g]));
    }
}

#define UMAX 6  /* pixels a block: 6 x 2 accumulators + 2 weights + 1 input of 16 ymm */

/* a block of u <= UMAX pixels (u known only at run time: the sides' and a row's last) */
static void block_any(const stem_plan *p, const float *x, float *y, long n, long oh, long ow0, long g0, int u, int G,
                      int checked) {
#define CASE(U) case U: \
        if (G == 2) { if (checked) block(p, x, y, n, oh, ow0, g0, U, 2, 1); else block(p, x, y, n, oh, ow0, g0, U, 2, 0); } \
        else { if (checked) block(p, x, y, n, oh, ow0, g0, U, 1, 1); else block(p, x, y, n, oh, ow0, g0, U, 1, 0); } \
        break;
    switch (u) { CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) default: break; }
#undef CASE
}

/* One output row: the groups two at a time (one at the end of an odd count), the row in blocks of UMAX pixels; a
   block reaching past a side of the input checks its columns. */
static void row(const stem_plan *p, const float *x, float *y, long n, long oh) {
    /* interior columns: ow·SW - PL >= 0 and ow·SW - PL + KW - 1 < W */
    long lo = (p->PL + p->SW - 1) / p->SW, hi = p->W - p->KW + p->PL >= 0 ? (p->W - p->KW + p->PL) / p->SW + 1 : 0;
    if (hi > p->OW) hi = p->OW;
    if (lo > hi) lo = hi;
    const long groups = p->Op / 8;
    for (long g0 = 0; g0 < groups; g0 += 2) {
        const int G = g0 + 1 < groups ? 2 : 1;
        for (long ow = 0; ow < p->OW; ow += UMAX) {
            const int u = p->OW - ow < UMAX ? (int)(p->OW - ow) : UMAX;
            const int checked = ow < lo || ow + u > hi;
            if (u == UMAX && !checked) {
                if (G == 2) block(p, x, y, n, oh, ow, g0, UMAX, 2, 0); else block(p, x, y, n, oh, ow, g0, UMAX, 1, 0);
            } else {
                block_any(p, x, y, n, oh, ow, g0, u, G, checked);
            }
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
