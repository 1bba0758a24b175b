/* Depthwise KxK convolution (K <= 8 a side, any stride and padding; 3x3 and 5x5 at strides 1 and 2 specialised)
 * with its epilogue (bias, ReLU / Clip / SiLU), NHWC, a member of native segments (kiln/runtime/native.py):
 * compiled once by kiln/kernels/cpu/depthwise.py through native_loop.build (-march=native, or x86-64-v3 under
 * KILN_CPU_ISA=avx2: the vector width below follows what it was built for).
 *
 *   y[n, oh, ow, c] = act(b[c] + sum_{kh, kw} x[n, oh·s - pt + kh, ow·s - pl + kw, c] · w[kh, kw, c])
 *
 * Why: oneDNN's jit_dw was measured behind onnxruntime's MLAS on MobileNetV2's stride-2 layers under the AVX2 cap
 * (bench/results/zoo-cpu-avx2-2026-12-06.md), and applies EfficientNet's SiLU as its swish post-op; the autotuner
 * times this kernel against it per layer (bench/results/dw-avx2-2026-12-06.md). In NHWC a depthwise layer
 * vectorises over channels with no reordering at any stride: an output pixel's taps are whole channel vectors of
 * the input, s·C floats apart, so a stride-2 layer needs no deinterleave or gather. The work is a sweep over output
 * rows (split among threads); a row is cut into blocks of U output pixels, and per channel vector (or 2-4 of them
 * for short blocks) each input vector of a tap row is loaded once and meets every tap that reads it, every channel
 * vector of a block before the next block (its input pixels are read in address order). A 3x3 layer at stride 1
 * (and at stride 2: on every width under AVX-512, in blocks of 4 pixels on maps over 16 wide, on maps up to 16 wide
 * under AVX2) and a 5x5 layer at strides 1
 * and 2 take two output rows a pass (block2): each input row the two read is loaded once for both, 4 rows where
 * two passes load 6 (3x3, stride 1; 5x5: 6 for 10, or 7 at stride 2) (bench/results/dw-avx2-2026-12-06.md).
 * Padding is never materialised: tap rows above or below the input are skipped, an edge block reads its padding
 * columns from a zero row through a table of column pointers, and an interior block addresses its columns from the
 * row pointer.
 *
 * The weights are packed at build as [K_h][K_w][Cp] (Cp: C rounded up to the vector width, zeros past C) and
 * the bias as [Cp]: one vector load per tap. Channels past the last whole vector run as a scalar loop.
 *
 * Returns 0, or 2 (oneDNN's "invalid arguments") when an operand is not bound: the segment names the layer.
 */
#include <omp.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "exp_poly.h"

typedef int (*get_handle_fn)(void *memory, void **handle);

enum { ACT_NONE = 0, ACT_RELU = 1, ACT_SILU = 2, ACT_CLIP = 4 };  /* se.c's numbering */

typedef struct {
    get_handle_fn get_handle;
    void *x, *y;                  /* dnnl_memory_t: NHWC [N, H, W, C], [N, OH, OW, C] */
    const float *w;               /* [KH][KW][Cp] */
    const float *b;               /* [Cp] (zeros without a bias) */
    const float *zeros;           /* [Cp] zeros: what a padding column reads */
    long N, C, Cp, H, W, OH, OW;
    int KH, KW, SH, SW, PT, PL;
    int activation;
    float alpha, beta;            /* Clip's min and max */
    int threads;                  /* 1: no parallel region */
} dw_plan;

#pragma GCC push_options
#pragma GCC optimize("no-trapping-math")

#if defined(__AVX512F__)
#define LANES 16
#define VMIN _mm512_min_ps
#define VMAX _mm512_max_ps
#elif defined(__AVX2__)
#define LANES 8
#define VMIN _mm256_min_ps
#define VMAX _mm256_max_ps
#else
#define LANES 4
#define VMIN(a, b) ((a) < (b) ? (a) : (b))
#define VMAX(a, b) ((a) > (b) ? (a) : (b))
#endif
typedef float vf __attribute__((vector_size(LANES * 4)));
#if defined(__AVX512F__)
#define VECTOR_REGISTER(v) "+v"(v)  /* any of the 32 zmm */
#else
#define VECTOR_REGISTER(v) "+x"(v)
#endif
typedef int vi __attribute__((vector_size(LANES * 4)));
typedef float vf_u __attribute__((vector_size(LANES * 4), aligned(4)));  /* an unaligned vector in memory */

/* output pixels of a row computed at once per channel vector: U accumulators, the tap row's KW weight vectors
   and one input vector live in registers (16 ymm under AVX2: 6 + 5 + 1 at 5x5; 32 zmm under AVX-512) */
#if LANES == 16
#define UMAX 8
#else
#define UMAX 6
#endif
#define KMAX 8                              /* taps a side at most (depthwise.py checks) */
#define JMAX ((8 - 1) * 2 + KMAX)           /* input columns a block of 8 reads at stride 2 at most */

static inline vf load(const float *p) { return *(const vf_u *)p; }
static inline void store(float *p, vf v) { *(vf_u *)p = v; }

/* x·σ(x): exp_poly.h's table form under AVX-512 (<= 2.9 ulp against float64, one division; B0's SiLU layers
   0.95-1.00x the rational form's time, 1 thread), its rational form (<= 3.4 ulp) under AVX2, where the table form
   was 1.02-1.07x slower in the kernel (16 ymm: its table and constants beside the accumulators), though 0.97x on
   its own (bench/silu_ab.py; bench/results/dw-avx2-2026-12-06.md, session 26) */
#if LANES == 16
#define PERMUTE(table, t) _mm512_permutexvar_ps((__m512i)(t), (__m512)(table))
KILN_VSILU_TABLE(silu_vector, static inline, vf, vi, VMIN, VMAX, 4, PERMUTE)
#else
KILN_VSILU(silu_vector, static inline, vf, vi, VMIN, VMAX)
#endif

static inline vf activate(vf v, int kind, vf lo, vf hi) {
    switch (kind) {
    case ACT_RELU: return (vf)VMAX(v, (vf){0});
    case ACT_CLIP: return (vf)VMIN(VMAX(v, lo), hi);
    case ACT_SILU: return silu_vector(v);
    default: return v;
    }
}

static inline float activate_scalar(float v, int kind, float lo, float hi) {
    switch (kind) {
    case ACT_RELU: return v > 0.0f ? v : 0.0f;
    case ACT_CLIP: return v < lo ? lo : (v > hi ? hi : v);
    case ACT_SILU: return silu_scalar(v);
    default: return v;
    }
}

/* U output pixels of a row by V channel vectors, channels [c0, c1). Input column j of the block (0 <= j < J) in
   tap row kh is, for an EDGE block, cols[kh][j]: the pixel, or the zero row where that column is padding; else
   (every column inside the row) rows[kh] + j·C, plain address arithmetic with no table to load. kh in
   [kh0, kh1): the rows outside the input are skipped. Each input vector is loaded once and meets every tap that
   reads it: output u, tap kw read column u·S + kw. KW, S, U, V and EDGE are constants at every call (the wrappers
   below), so GCC unrolls the j and kw loops and the tests on them vanish: at stride 1 a 3x3 tap row is (U + 2)
   input loads and 3 weight loads for 3U FMAs. */
static inline __attribute__((always_inline)) void block(const dw_plan *p, const float *const *rows,
                                                        const float *const cols[][JMAX], int kh0, int kh1, float *out,
                                                        long c0, long c1, vf lo, vf hi, const int KW, const int S,
                                                        const int U, const int V, const int EDGE) {
    const long C = p->C, Cp = p->Cp;
    const int J = (U - 1) * S + KW;
    for (long c = c0; c + V * LANES <= c1; c += V * LANES) {
        vf acc[8][4];
        #pragma GCC unroll 16
        for (int u = 0; u < U; ++u)
            #pragma GCC unroll 4
            for (int v = 0; v < V; ++v) acc[u][v] = load(p->b + c + v * LANES);
        for (int kh = kh0; kh < kh1; ++kh) {
            const float *wt = p->w + (long)kh * KW * Cp + c;
            vf wv[KMAX][4];
            #pragma GCC unroll 8
            for (int kw = 0; kw < KW; ++kw)
                #pragma GCC unroll 4
                for (int v = 0; v < V; ++v) wv[kw][v] = load(wt + kw * Cp + v * LANES);
            #pragma GCC unroll 32
            for (int j = 0; j < J; ++j) {
                #pragma GCC unroll 4
                for (int v = 0; v < V; ++v) {
                    vf x = load((EDGE ? cols[kh][j] : rows[kh] + j * C) + c + v * LANES);
                    /* at stride 1 a vector meets KW taps: kept in a register, where GCC would fold its load into
                       each FMA (KW loads of it; MobileNetV2's 32x112² layer 1.2-1.4x slower so, 1 thread, AVX2);
                       at stride 2 a 3x3's vector meets 1-2 taps and the folded form was as fast or faster, a 5x5's
                       2-3 (kept: EfficientNet-B0's 144x56² 5x5 stride 2 0.97-0.98x the folded form's time) */
                    if (S == 1 || KW >= 5) __asm__("" : VECTOR_REGISTER(x));
                    #pragma GCC unroll 8
                    for (int kw = 0; kw < KW; ++kw) {
                        const int u = (j - kw) / S;
                        if (j >= kw && (j - kw) % S == 0 && u < U) acc[u][v] += x * wv[kw][v];
                    }
                }
            }
        }
        #pragma GCC unroll 16
        for (int u = 0; u < U; ++u)
            #pragma GCC unroll 4
            for (int v = 0; v < V; ++v) store(out + u * C + c + v * LANES, activate(acc[u][v], p->activation, lo, hi));
    }
}

/* block() for two output rows at once (rows oh and oh + 1 of a K x K layer at stride S, KH = KW = K, SH = SW = S),
   one channel vector at a time: input row ir (0 <= ir < K + S, from the first row's top tap row) is tap row ir of
   the first output row and tap row ir - S of the second, so each input vector of a row both read is loaded once
   for both (at stride 1 a 3x3 pair loads 4 input rows where two passes loaded 6; at stride 2, 5 where they
   loaded 6). rows/cols are indexed by ir; ir in [ir0, ir1): the rows inside the input (the others skipped).
   Registers: 2U accumulators, the 2K weight vectors of the row's two taps, one input vector. */
static inline __attribute__((always_inline)) void block2(const dw_plan *p, const float *const *rows,
                                                         const float *const cols[][JMAX], int ir0, int ir1,
                                                         float *out0, float *out1, long c0, long c1, vf lo, vf hi,
                                                         const int K, const int S, const int U, const int EDGE) {
    const long C = p->C, Cp = p->Cp;
    const int J = (U - 1) * S + K;
    for (long c = c0; c + LANES <= c1; c += LANES) {
        vf a0[8], a1[8];
        const vf bias = load(p->b + c);
        #pragma GCC unroll 8
        for (int u = 0; u < U; ++u) a0[u] = a1[u] = bias;
        #pragma GCC unroll 8
        for (int ir = 0; ir < K + S; ++ir) {
            if (ir < ir0 || ir >= ir1) continue;
            const int first = ir < K, second = ir >= S;  /* constants once the ir loop is unrolled */
            vf w0[KMAX], w1[KMAX];
            #pragma GCC unroll 8
            for (int kw = 0; kw < K; ++kw) {
                if (first) w0[kw] = load(p->w + ((long)ir * K + kw) * Cp + c);
                if (second) w1[kw] = load(p->w + ((long)(ir - S) * K + kw) * Cp + c);
            }
            #pragma GCC unroll 32
            for (int j = 0; j < J; ++j) {
                vf x = load((EDGE ? cols[ir][j] : rows[ir] + j * C) + c);
                __asm__("" : VECTOR_REGISTER(x));
                #pragma GCC unroll 8
                for (int kw = 0; kw < K; ++kw) {
                    const int u = (j - kw) / S;
                    if (j >= kw && (j - kw) % S == 0 && u < U) {
                        if (first) a0[u] += x * w0[kw];
                        if (second) a1[u] += x * w1[kw];
                    }
                }
            }
        }
        #pragma GCC unroll 8
        for (int u = 0; u < U; ++u) {
            store(out0 + u * C + c, activate(a0[u], p->activation, lo, hi));
            store(out1 + u * C + c, activate(a1[u], p->activation, lo, hi));
        }
    }
}

/* one pixel, any kernel width and stride (the layers the specialised blocks do not cover), channel vectors
   [0, Cv) four at a time: four independent chains of FMAs */
static void pixel_any(const dw_plan *p, const float *const cols[][JMAX], int kh0, int kh1, float *out, long c0,
                      long Cv, vf lo, vf hi) {
    const long Cp = p->Cp;
    const int KW = p->KW;
    long c = c0;
    for (; c + 4 * LANES <= Cv; c += 4 * LANES) {
        vf acc[4];
        for (int v = 0; v < 4; ++v) acc[v] = load(p->b + c + v * LANES);
        for (int kh = kh0; kh < kh1; ++kh)
            for (int kw = 0; kw < KW; ++kw) {
                const float *in = cols[kh][kw] + c, *wt = p->w + ((long)kh * KW + kw) * Cp + c;
                for (int v = 0; v < 4; ++v) acc[v] += load(in + v * LANES) * load(wt + v * LANES);
            }
        for (int v = 0; v < 4; ++v) store(out + c + v * LANES, activate(acc[v], p->activation, lo, hi));
    }
    for (; c < Cv; c += LANES) {
        vf acc = load(p->b + c);
        for (int kh = kh0; kh < kh1; ++kh)
            for (int kw = 0; kw < KW; ++kw) acc += load(cols[kh][kw] + c) * load(p->w + ((long)kh * KW + kw) * Cp + c);
        store(out + c, activate(acc, p->activation, lo, hi));
    }
}

/* the channels past the last whole vector of one pixel, one at a time */
static void pixel_tail(const dw_plan *p, const float *const cols[][JMAX], int kh0, int kh1, float *out, long Cv) {
    const long Cp = p->Cp;
    const int KW = p->KW;
    for (long c = Cv; c < p->C; ++c) {
        float acc = p->b[c];
        for (int kh = kh0; kh < kh1; ++kh)
            for (int kw = 0; kw < KW; ++kw) acc += cols[kh][kw][c] * p->w[((long)kh * KW + kw) * Cp + c];
        out[c] = activate_scalar(acc, p->activation, p->alpha, p->beta);
    }
}

/* U pixels by V channel vectors: channels [c0, c1) V·LANES at a time, then the vectors left one at a time; an
   interior block (rows) and an edge one (cols) */
#define BLOCK(KW, S, NAME, U, V)                                                                                \
    static void block_##KW##_##S##_##NAME(const dw_plan *p, const float *const *rows,                         \
                                          const float *const cols[][JMAX], int kh0, int kh1, float *out,       \
                                          long c0, long c1, vf lo, vf hi) {                                     \
        const long whole = c0 + (c1 - c0) / ((V) * LANES) * ((V) * LANES);                                     \
        if (rows != NULL) {                                                                                     \
            block(p, rows, cols, kh0, kh1, out, c0, whole, lo, hi, KW, S, U, V, 0);                             \
            if ((V) > 1) block(p, rows, cols, kh0, kh1, out, whole, c1, lo, hi, KW, S, U, 1, 0);               \
        } else {                                                                                                \
            block(p, rows, cols, kh0, kh1, out, c0, whole, lo, hi, KW, S, U, V, 1);                             \
            if ((V) > 1) block(p, rows, cols, kh0, kh1, out, whole, c1, lo, hi, KW, S, U, 1, 1);               \
        }                                                                                                       \
    }
/* a row's blocks, U = 1..8 pixels (up to UMAX are called): one channel vector at 4 pixels and more, two at 2-3,
   four at 1 (independent chains of FMAs where a block has few pixels). A row is cut greedily, UMAX pixels at a
   time, then one block of what is left: a 7-wide map is one block of 7 under AVX-512 (6 + 1 under AVX2), where
   blocks of UMAX, UMAX/2 and single pixels ran 3 of its 7 pixels with no input shared between taps (2 loads an
   FMA: MobileNetV2's 960x7² 1.5x oneDNN's time, AVX-512, 1 thread) */
#define V_OF(U) ((U) >= 4 ? 1 : (U) >= 2 ? 2 : 4)
#define BLOCKS(KW, S) BLOCK(KW, S, 1, 1, V_OF(1)) BLOCK(KW, S, 2, 2, V_OF(2)) BLOCK(KW, S, 3, 3, V_OF(3))            \
    BLOCK(KW, S, 4, 4, 1) BLOCK(KW, S, 5, 5, 1) BLOCK(KW, S, 6, 6, 1) BLOCK(KW, S, 7, 7, 1) BLOCK(KW, S, 8, 8, 1) \
    static const block_fn blocks_##KW##_##S[9] = {NULL, block_##KW##_##S##_1, block_##KW##_##S##_2,              \
        block_##KW##_##S##_3, block_##KW##_##S##_4, block_##KW##_##S##_5, block_##KW##_##S##_6,                    \
        block_##KW##_##S##_7, block_##KW##_##S##_8};

typedef void (*block_fn)(const dw_plan *, const float *const *, const float *const[][JMAX], int, int, float *, long,
                         long, vf, vf);
BLOCKS(3, 1)
BLOCKS(3, 2)
BLOCKS(5, 1)
BLOCKS(5, 2)

/* two rows' blocks, U = 1..U2MAX pixels, the whole vectors of [c0, c1) (block2) */
#define BLOCK2(K, S, U)                                                                                           \
    static void block2_##K##_##S##_##U(const dw_plan *p, const float *const *rows,                               \
                                       const float *const cols[][JMAX], int ir0, int ir1, float *out0,           \
                                       float *out1, long c0, long c1, vf lo, vf hi) {                            \
        if (rows != NULL)                                                                                       \
            block2(p, rows, cols, ir0, ir1, out0, out1, c0, c1, lo, hi, K, S, U, 0);                            \
        else                                                                                                    \
            block2(p, rows, cols, ir0, ir1, out0, out1, c0, c1, lo, hi, K, S, U, 1);                            \
    }
typedef void (*block2_fn)(const dw_plan *, const float *const *, const float *const[][JMAX], int, int, float *,
                          float *, long, long, vf, vf);
#if LANES == 16
#define U2MAX 8
#define BLOCKS2(K, S) BLOCK2(K, S, 1) BLOCK2(K, S, 2) BLOCK2(K, S, 3) BLOCK2(K, S, 4) BLOCK2(K, S, 5)              \
    BLOCK2(K, S, 6) BLOCK2(K, S, 7) BLOCK2(K, S, 8)                                                              \
    static const block2_fn blocks2_##K##_##S[9] = {NULL, block2_##K##_##S##_1, block2_##K##_##S##_2,              \
        block2_##K##_##S##_3, block2_##K##_##S##_4, block2_##K##_##S##_5, block2_##K##_##S##_6,                    \
        block2_##K##_##S##_7, block2_##K##_##S##_8};
#else
#define U2MAX 4
#define BLOCKS2(K, S) BLOCK2(K, S, 1) BLOCK2(K, S, 2) BLOCK2(K, S, 3) BLOCK2(K, S, 4)                             \
    static const block2_fn blocks2_##K##_##S[9] = {NULL, block2_##K##_##S##_1, block2_##K##_##S##_2,              \
        block2_##K##_##S##_3, block2_##K##_##S##_4, NULL, NULL, NULL, NULL};
#endif
BLOCKS2(3, 1)
BLOCKS2(3, 2)
BLOCKS2(5, 1)
BLOCKS2(5, 2)
#define PAIR_S2_MAX_OW 16  /* output width up to which a 3x3 stride-2 layer takes pairs of rows under AVX2 */

/* cols[kh][j] for the U pixels from `ow` of output row `oh`: input column ow·S - pl + j of tap row kh, or the
   zero row where that column is padding (the padding is never written out), for the tap rows inside the input;
   taps: KH, or KH + SH for a pair of output rows (block2's input rows) */
static void columns(const dw_plan *p, const float *x, long n, long oh, long ow, int U, const float *cols[][JMAX],
                    int taps) {
    const long C = p->C, W = p->W, ih0 = oh * p->SH - p->PT, iw = ow * p->SW - p->PL;
    const int J = (U - 1) * p->SW + p->KW;
    const int kh0 = ih0 < 0 ? (int)-ih0 : 0, kh1 = ih0 + taps > p->H ? (int)(p->H - ih0) : taps;
    for (int kh = kh0; kh < kh1; ++kh) {
        const float *r = x + ((n * p->H) + ih0 + kh) * W * C;
        for (int j = 0; j < J; ++j) cols[kh][j] = iw + j >= 0 && iw + j < W ? r + (iw + j) * C : p->zeros;
    }
}

/* channels [c0, c1) (whole vectors) of output row `oh` of image `n`: blocks of UMAX pixels, then UMAX/2, then one */
static void row(const dw_plan *p, const float *x, float *y, long n, long oh, long c0, long c1,
                const block_fn *blocks) {
    const long C = p->C, OW = p->OW;
    const vf lo = (vf){0} + p->alpha, hi = (vf){0} + p->beta;
    float *out = y + (n * p->OH + oh) * OW * C;
    const float *cols[KMAX][JMAX], *rows[KMAX];
    const long ih0 = oh * p->SH - p->PT;
    const int kh0 = ih0 < 0 ? (int)-ih0 : 0, kh1 = ih0 + p->KH > p->H ? (int)(p->H - ih0) : p->KH;
    long ow = 0;
    while (ow < OW) {
        const int U = blocks == NULL ? 1 : OW - ow < UMAX ? (int)(OW - ow) : UMAX;
        const long iw = ow * p->SW - p->PL;
        float *o = out + ow * C;
        const float *const(*c)[JMAX] = (const float *const(*)[JMAX])cols;
        if (blocks != NULL && iw >= 0 && iw + (U - 1) * p->SW + p->KW <= p->W) {  /* every column inside the row */
            for (int kh = kh0; kh < kh1; ++kh) rows[kh] = x + ((n * p->H + ih0 + kh) * p->W + iw) * C;
            blocks[U](p, (const float *const *)rows, c, kh0, kh1, o, c0, c1, lo, hi);
        } else {
            columns(p, x, n, oh, ow, U, cols, p->KH);
            if (blocks == NULL)
                pixel_any(p, c, kh0, kh1, o, c0, c1, lo, hi);
            else
                blocks[U](p, NULL, c, kh0, kh1, o, c0, c1, lo, hi);
        }
        ow += U;
    }
}

/* channels [c0, c1) (whole vectors) of output rows oh and oh + 1 of image `n` (block2): blocks of umax pixels
   (<= U2MAX), then one of what is left */
static void row2(const dw_plan *p, const float *x, float *y, long n, long oh, long c0, long c1,
                 const block2_fn *blocks, int umax) {
    const long C = p->C, OW = p->OW;
    const int taps = p->KH + p->SH;
    const vf lo = (vf){0} + p->alpha, hi = (vf){0} + p->beta;
    float *out = y + (n * p->OH + oh) * OW * C;
    const float *cols[KMAX][JMAX], *rows[KMAX];
    const long ih0 = oh * p->SH - p->PT;
    const int ir0 = ih0 < 0 ? (int)-ih0 : 0, ir1 = ih0 + taps > p->H ? (int)(p->H - ih0) : taps;
    long ow = 0;
    while (ow < OW) {
        const int U = OW - ow < umax ? (int)(OW - ow) : umax;
        const long iw = ow * p->SW - p->PL;
        float *o = out + ow * C;
        if (iw >= 0 && iw + (U - 1) * p->SW + p->KW <= p->W) {  /* every column inside the row */
            for (int ir = ir0; ir < ir1; ++ir) rows[ir] = x + ((n * p->H + ih0 + ir) * p->W + iw) * C;
            blocks[U](p, (const float *const *)rows, (const float *const(*)[JMAX])cols, ir0, ir1, o, o + OW * C, c0,
                      c1, lo, hi);
        } else {
            columns(p, x, n, oh, ow, U, cols, taps);
            blocks[U](p, NULL, (const float *const(*)[JMAX])cols, ir0, ir1, o, o + OW * C, c0, c1, lo, hi);
        }
        ow += U;
    }
}

/* the channels past the last whole vector of output row `oh`, one pixel and one channel at a time */
static void row_tail(const dw_plan *p, const float *x, float *y, long n, long oh, long Cv) {
    float *out = y + (n * p->OH + oh) * p->OW * p->C;
    const float *cols[KMAX][JMAX];
    const long ih0 = oh * p->SH - p->PT;
    const int kh0 = ih0 < 0 ? (int)-ih0 : 0, kh1 = ih0 + p->KH > p->H ? (int)(p->H - ih0) : p->KH;
    for (long ow = 0; ow < p->OW; ++ow) {
        columns(p, x, n, oh, ow, 1, cols, p->KH);
        pixel_tail(p, (const float *const(*)[JMAX])cols, kh0, kh1, out + ow * p->C, Cv);
    }
}

#pragma GCC pop_options

/* Each thread takes a run of output rows, all channels of a pixel block before the next block. (Passes over the
   rows by chunks of channels, so that a chunk's KH input rows stay in L1, were slower at every chunk size tried
   on a Zen 4 core under AVX2: 96x112² stride 2, 1 thread: 16 channels 798 us, 64 191, all 96 155.) */
int kiln_depthwise(void *object, void *stream, int nargs, const void *args) {
    (void)stream; (void)nargs; (void)args;
    const dw_plan *p = (const dw_plan *)object;
    float *x = NULL, *y = NULL;
    if (p->get_handle(p->x, (void **)&x) != 0 || x == NULL) return 2;
    if (p->get_handle(p->y, (void **)&y) != 0 || y == NULL) return 2;
    const long rows = p->N * p->OH, Cv = p->C / LANES * LANES;
    const block_fn *blocks = NULL;  /* the general path (pixel_any) for other kernels and strides */
#define PICK(K, SS) if (p->KW == K && p->SW == SS) blocks = blocks_##K##_##SS;
    PICK(3, 1) PICK(3, 2) PICK(5, 1) PICK(5, 2)
#undef PICK
    const block2_fn *pairs = NULL;  /* two output rows a pass (block2): square kernels and strides */
    int umax = U2MAX;               /* pixels a block of pairs */
    /* not on a map narrower than one block of pairs: 7 wide under AVX-512 (MobileNetV2's 960x7², B0's 1152x7²)
       pairs were 1.05x one row's time (one block of 7 either way); under AVX2 0.84x (4 + 3 against 6 + 1) */
    if (p->KH == p->KW && p->SH == p->SW && p->OW >= U2MAX) {
        if (p->KW == 3 && p->SW == 1) pairs = blocks2_3_1;
        /* at stride 2 under AVX2 only on narrow maps: there (MobileNetV2's 192x28² and 576x14², B0's 240x28²) pairs
           were 0.88-0.95x one row's time, where on 56-112-wide maps, which stream their input from L3, 1.00-1.03x;
           under AVX-512 on every width (blocks of 8 pixels: 16 accumulators + 6 weights + 1 input of 32 zmm): on
           the wide maps 0.90-0.92x one row's time (MobileNetV2's 96x112² and 144x56², 1 thread) */
        if (p->KW == 3 && p->SW == 2 && (LANES == 16 || p->OW <= PAIR_S2_MAX_OW)) pairs = blocks2_3_2;
        /* and there, on maps wider than that, blocks of 4 pixels, not 8: MobileNetV2's 96x112² 0.90-0.92x the time
           of blocks of 8, 144x56² 0.96-0.99x, B0's 96x112² (SiLU) 0.92-0.93x (1 thread; blocks of 3 the same within
           0.01-0.03, of 2 0.95-0.97x); on the narrow maps (192x28², 240x28²: 14 outputs wide) smaller blocks were
           1.05-1.31x slower. A block's channel-vector sweeps (one vector at a time over its 5 x (2U + 1) input
           pixels) then revisit 45 pixels' lines, not 85: 17 KB of L1 at 96 channels where 8-pixel blocks used 32 KB
           (session 26) */
        if (LANES == 16 && p->KW == 3 && p->SW == 2 && p->OW > PAIR_S2_MAX_OW) umax = 4;
        /* 5x5 at both strides and every width (EfficientNet-B0's five 5x5 layers, SiLU, 1 thread): 0.91-0.98x one
           row's time under AVX2 (blocks of 4: 8 accumulators + 10 weights + 1 input spill a little, and blocks of
           3 or 2 were slower still), 0.89-0.97x under AVX-512 where taken (maps 8 and more outputs wide) */
        if (p->KW == 5 && p->SW == 1) pairs = blocks2_5_1;
        if (p->KW == 5 && p->SW == 2) pairs = blocks2_5_2;
    }
    #pragma omp parallel num_threads(p->threads) if (p->threads > 1)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const long lo = rows * t / nt, hi = rows * (t + 1) / nt;
        for (long r = lo; r < hi; ++r) {
            if (pairs != NULL && r + 1 < hi && (r + 1) % p->OH != 0) {  /* the next row of the same image */
                row2(p, x, y, r / p->OH, r % p->OH, 0, Cv, pairs, umax);
                ++r;
            } else {
                row(p, x, y, r / p->OH, r % p->OH, 0, Cv, blocks);
            }
        }
        if (Cv < p->C)
            for (long r = lo; r < hi; ++r) row_tail(p, x, y, r / p->OH, r % p->OH, Cv);
    }
    return 0;
}

/* the vector width this library was built with (depthwise.py pads the packed channels to it) */
int kiln_depthwise_lanes(void *object, void *stream, int nargs, const void *args) {
    (void)object; (void)stream; (void)nargs; (void)args;
    return LANES;
}
