/* Grouped KxK convolution with few channels a group (G = 2, 4, 8, 16 or 32 in and out, ResNeXt's and RegNet's
 * 3x3 layers) and its epilogue (bias, ReLU), NHWC, AVX2 (8 lanes), a member of native segments
 * (kiln/runtime/native.py): compiled once by kiln/kernels/cpu/grouped.py through native_loop.build (x86-64-v3
 * under KILN_CPU_ISA=avx2, -march=native else; the Python side offers it only where the build is AVX2's).
 *
 *   y[n, oh, ow, c] = act(b[c] + sum_{kh, kw, k < G} x[n, oh·s - pt + kh, ow·s - pl + kw, (c / G)·G + k]
 *                                                    · w[c, k, kh, kw])
 *
 * Why: under the AVX2 cap oneDNN runs ResNeXt-50 32x4d's 4-channel groups on its im2col GEMM (x64:gemm:jit, 2.3x
 * onnxruntime's MLAS at 128x56²) and its 8-channel ones on jit:avx2 (1.1-2.1x), bench/results/
 * zoo-new-avx2-zen4-2026-12-07d.md. Here an output vector is 8 consecutive output channels: with G >= 8 it lies
 * in one group, and each input channel k of the group is one broadcast multiplied into the group's G/8 vectors
 * (a small dense convolution per group); with G < 8 it spans 8/G groups, and input channel k of each is the
 * loaded 8 input channels at the same offset shuffled inside each 128-bit lane (vpermilps: lane j takes element
 * (j mod 4) - (j mod G) + k of its half). A block of U output pixels of a row keeps U x V accumulators (V: the
 * vectors a weight row feeds) in registers; each tap's weight vectors are loaded once per block.
 *
 * Weights are packed at build as [C / (8V)][KH][KW][G][V][8] (block b's V vectors, per tap and input channel),
 * the bias as [C]. Padding is never materialised: tap rows outside the input are skipped, and a block whose
 * pixels would read a padding column checks each pixel's taps.
 *
 * Returns 0, or 2 (oneDNN's "invalid arguments") when an operand is not bound: the segment names the layer.
 */
#include <omp.h>
#include <immintrin.h>

typedef int (*get_handle_fn)(void *memory, void **handle);

enum { ACT_NONE = 0, ACT_RELU = 1 };  /* se.c's numbering */

typedef struct {
    get_handle_fn get_handle;
    void *x, *y;                  /* dnnl_memory_t: NHWC [N, H, W, C], [N, OH, OW, C] */
    const float *w;               /* [C / (8V)][KH][KW][G][V][8] */
    const float *b;               /* [C] (zeros without a bias) */
    long N, C, H, W, OH, OW;
    int KH, KW, SH, SW, PT, PL;
    int G;                        /* channels a group, in and out */
    int activation;
    int threads;                  /* 1: no parallel region */
} gc_plan;

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)

enum { MAX_U = 6, MAX_V = 4 };

/* U output pixels from ow0 on, V vectors of output channels from c0 (block `blk` of the packed weights). `edge`:
   some pixel reads a padding column (checked per pixel and tap). G, V, U, edge are constants where inlined. */
static inline __attribute__((always_inline)) void pixels(const gc_plan *p, const float *xn, float *yrow, long oh,
                                                         long ow0, long c0, const float *wb, const int G,
                                                         const int V, const int U, const int edge) {
    const long C = p->C, W = p->W;
    __m256 acc[MAX_U][MAX_V];  /* fixed sizes: inlined with constants, the used ones live in registers */
    for (int v = 0; v < V; ++v) {
        const __m256 bias = _mm256_loadu_ps(p->b + c0 + 8 * v);
        for (int u = 0; u < U; ++u) acc[u][v] = bias;
    }
    /* G < 8: lane j of the shuffled vector k is element (j mod 4) - (j mod G) + k of its 128-bit half */
    __m256i pick[4];
    if (G < 8)
        for (int k = 0; k < G; ++k)
            pick[k] = _mm256_setr_epi32(0 - 0 % G + k, 1 - 1 % G + k, 2 - 2 % G + k, 3 - 3 % G + k,
                                        0 - 0 % G + k, 1 - 1 % G + k, 2 - 2 % G + k, 3 - 3 % G + k);
    const long group_in = G >= 8 ? c0 / G * G : c0;  /* the first input channel the block reads */
    for (int kh = 0; kh < p->KH; ++kh) {
        const long ih = oh * p->SH - p->PT + kh;
        if (ih < 0 || ih >= p->H) continue;
        const float *xr = xn + ih * W * C + group_in;
        for (int kw = 0; kw < p->KW; ++kw) {
            const float *wt = wb + (long)(kh * p->KW + kw) * G * V * 8;
            const float *xs[MAX_U];
            int inside[MAX_U];
            for (int u = 0; u < U; ++u) {
                const long iw = (ow0 + u) * p->SW - p->PL + kw;
                inside[u] = !edge || (iw >= 0 && iw < W);
                xs[u] = xr + iw * C;
            }
            if (G < 8) {
                __m256 wk[4];
                for (int k = 0; k < G; ++k) wk[k] = _mm256_loadu_ps(wt + 8 * k);
                for (int u = 0; u < U; ++u) {
                    if (!inside[u]) continue;
                    const __m256 xv = _mm256_loadu_ps(xs[u]);
                    for (int k = 0; k < G; ++k)
                        acc[u][0] = _mm256_fmadd_ps(_mm256_permutevar_ps(xv, pick[k]), wk[k], acc[u][0]);
                }
            } else {
                for (int k = 0; k < G; ++k) {
                    __m256 wk[MAX_V];
                    for (int v = 0; v < V; ++v) wk[v] = _mm256_loadu_ps(wt + (k * V + v) * 8);
                    for (int u = 0; u < U; ++u) {
                        if (!inside[u]) continue;
                        const __m256 xk = _mm256_broadcast_ss(xs[u] + k);
                        for (int v = 0; v < V; ++v) acc[u][v] = _mm256_fmadd_ps(xk, wk[v], acc[u][v]);
                    }
                }
            }
        }
    }
    const __m256 zero = _mm256_setzero_ps();
    for (int u = 0; u < U; ++u)
        for (int v = 0; v < V; ++v) {
            __m256 r = acc[u][v];
            if (p->activation == ACT_RELU) r = _mm256_max_ps(r, zero);
            _mm256_storeu_ps(yrow + (ow0 + u) * C + c0 + 8 * v, r);
        }
}

/* one output row (image n, row oh): every block of channels, pixels U at a time (a block reading a padding column
   checks each pixel's taps: on 7- and 14-wide maps most blocks touch an edge), the last OW mod U one by one */
#define ROW(G, V, U)                                                                                          \
    static void row_##G(const gc_plan *p, const float *x, float *y, long n, long oh) {                        \
        const float *xn = x + n * p->H * p->W * p->C;                                                         \
        float *yrow = y + (n * p->OH + oh) * p->OW * p->C;                                                    \
        const long blocks = p->C / (8 * V), taps = (long)p->KH * p->KW;                                       \
        /* the first and past the last output pixel whose taps all lie inside the row */                       \
        const long lo = (p->PL + p->SW - 1) / p->SW, hi = (p->W - p->KW + p->PL) / p->SW + 1;                 \
        for (long blk = 0; blk < blocks; ++blk) {                                                             \
            const long c0 = blk * 8 * V;                                                                      \
            const float *wb = p->w + blk * taps * G * V * 8;                                                  \
            long ow = 0;                                                                                      \
            for (; ow + U <= p->OW; ow += U) {                                                                \
                if (ow >= lo && ow + U <= hi) pixels(p, xn, yrow, oh, ow, c0, wb, G, V, U, 0);                \
                else pixels(p, xn, yrow, oh, ow, c0, wb, G, V, U, 1);                                         \
            }                                                                                                 \
            for (; ow < p->OW; ++ow) pixels(p, xn, yrow, oh, ow, c0, wb, G, V, 1, 1);                         \
        }                                                                                                     \
    }

/* U x V accumulators + the tap's weight vectors + an input vector within 16 ymm (G = 2, 4: U + G + G shuffle
   controls + 2; G = 8: 6 + 8 + 1; 16: 12 + 2 + 1; 32: 12 + 4 read from memory by the FMAs) */
ROW(2, 1, 6)
ROW(4, 1, 6)
ROW(8, 1, 6)
ROW(16, 2, 6)
ROW(32, 4, 3)
#undef ROW

typedef void (*row_fn)(const gc_plan *, const float *, float *, long, long);

int kiln_grouped_conv(void *object, void *stream, int nargs, const void *args) {
    (void)stream; (void)nargs; (void)args;
    const gc_plan *p = (const gc_plan *)object;
    float *x = NULL, *y = NULL;
    if (p->get_handle(p->x, (void **)&x) != 0 || x == NULL) return 2;
    if (p->get_handle(p->y, (void **)&y) != 0 || y == NULL) return 2;
    row_fn row = p->G == 2 ? row_2 : p->G == 4 ? row_4 : p->G == 8 ? row_8 : p->G == 16 ? row_16 : row_32;
    const long rows = p->N * p->OH;
    #pragma omp parallel num_threads(p->threads) if (p->threads > 1)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const long lo = rows * t / nt, hi = rows * (t + 1) / nt;
        for (long r = lo; r < hi; ++r) row(p, x, y, r / p->OH, r % p->OH);
    }
    return 0;
}

/* the vectors of output channels a block of packed weights holds for G channels a group (grouped.py packs so) */
int kiln_grouped_conv_vectors(void *object, void *stream, int g, const void *args) {
    (void)object; (void)stream; (void)args;
    return g == 16 ? 2 : g == 32 ? 4 : 1;
}

/* 8: built for AVX2 (the kernel's vectors); 0: not (grouped.py then offers no tactic) */
int kiln_grouped_conv_lanes(void *object, void *stream, int nargs, const void *args) {
    (void)object; (void)stream; (void)nargs; (void)args;
    return 8;
}

#else

int kiln_grouped_conv(void *object, void *stream, int nargs, const void *args) {
    (void)object; (void)stream; (void)nargs; (void)args;
    return 2;
}

int kiln_grouped_conv_vectors(void *object, void *stream, int g, const void *args) {
    (void)object; (void)stream; (void)g; (void)args;
    return 1;
}

int kiln_grouped_conv_lanes(void *object, void *stream, int nargs, const void *args) {
    (void)object; (void)stream; (void)nargs; (void)args;
    return 0;
}

#endif
