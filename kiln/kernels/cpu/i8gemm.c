/* kiln::QGemm on AVX2 without VNNI (kiln/kernels/cpu/i8gemm.py): y = epilogue(x @ wᵀ) for 8-bit rows x [M, K] and an
 * int8 weight w [N, K], exact in int32, the requantization fused.
 *
 *     u    = x (uint8), or x ^ 0x80 = x + 128 (int8 sources: the zero point given is then z_x + 128)
 *     acc  = Σ_k u[m, k]·w[n, k]                                   int32, exact (below)
 *     t    = acc + offset[n]                                        offset = bias[n] − z_x·Σ_k w[n, k] (int32):
 *                                                                   t = Σ (x − z_x)·w + bias, exactly
 *     r    = scale[n]·float(t)                                      scale = x_scale·w_scale[n] (float32)
 *     y    = act(r) (float32), or saturate(round_half_even(act_q(scale_q[n]·float(t))) + y_zero) to uint8 / int8:
 *            scale_q = x_scale·w_scale[n] / y_scale rounded once (onnxruntime's requantize: one multiply), act_q
 *            Relu/Clip with its bounds over y_scale (at a tie it may round a step from ONNX's exact product and
 *            division); GELU (ACT_GEMM) on r, then round(r·(1 / y_scale)); OUT_S32: t itself (tests)
 *
 * The products: vpmaddubsw (u8 · s8, adjacent pairs summed to int16), vpmaddwd by ones (pairs of those to int32),
 * vpaddd. Why not int16 pairs (vpmaddwd on widened operands, exact for any weight): on Zen 3 vpmaddwd issues once
 * a cycle, 16 multiply-adds, the same as fp32's two FMAs; vpmaddubsw + vpmaddwd issue together, 32 a cycle
 * (measured: 3.1 G vpmaddubsw+vpmaddwd+vpaddd triplets/s at 3.1 GHz, bench/results/int8-gemm-avx2-2026-12-07.md).
 *
 * Exact: vpmaddubsw saturates its int16 pair sum u1·w1 + u2·w2. With u <= 255, it cannot when |w1| + |w2| <= 128
 * for every pair this kernel forms (k = 2j, 2j + 1 of one channel): 255·128 = 32640 <= 32767. i8gemm.py checks
 * exactly those pairs when the weight is packed and refuses the weight otherwise (onnxruntime's and PyTorch's
 * reduce_range, 7-bit weights, always passes). The int32 sum: K·255·128 < 2^31 for K < 65793 (i8gemm.py refuses
 * more); offset and t are checked to fit int32 there too.
 *
 * Layout: the weight packed by kiln_i8_pack as [ceil(N/NR)][ceil(K/4)][NR][4] int8 (zeros past N and past K): one
 * 32-byte load is 8 channels' 4 consecutive k, one 32-bit broadcast a row's 4 k. Rows are read in place (uint8,
 * K a multiple of 4), else copied once per call into a padded uint8 block (int8 flipped, K padded with zeros).
 * Register tile: MR = 3 rows x NR = 32 channels (12 accumulators, weights as memory operands, a broadcast, the
 * ones, a product: 15 of AVX2's 16 registers; the k loop at 99 GMAC/s, 2x48 level, 5x16 with its weights in
 * registers 90-94, 4x24 and 6x16 72-75: bench/i8gemm_tiles.c). A panel with fewer than 32 real channels (the last
 * one of N = 16, 24, 40, ...: MobileNetV2's 16- and 24-channel projections) runs only its V vectors, on taller
 * tiles (V = 3: 4 rows, V = 2 and 1: 6): the zero half of a 16-channel panel is neither multiplied nor requantized.
 * Activations: Relu and Clip in registers; GELU (erf or tanh) through gemm.c's kiln_gemm_activate on each tile's r
 * (its vector tables), the pointer set by i8gemm.py.
 * Threads: items of one NR-channel panel over every row (the panel stays in L1/L2 while the rows stream), on
 * gemm.c's pool (kiln_shared_parallel_for, set by i8gemm.py), else an OpenMP loop. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__)
#include <immintrin.h>
#endif

typedef int (*get_handle_fn)(void *memory, void **handle);
typedef void (*kiln_item_fn)(void *ctx, long item);

/* gemm.c's pool (pool.c), set by kiln/kernels/cpu/i8gemm.py when the GEMM library is built; NULL: OpenMP. */
void (*kiln_shared_parallel_for)(long count, int threads, kiln_item_fn fn, void *ctx) = NULL;
/* gemm.c's activations (kiln_gemm_activate: GELU by its vector tables), set by i8gemm.py: ACT_GEMM applies
   plan.gemm_activation (gemm.c's code) to each tile's r through it. */
void (*kiln_gemm_activate)(float *c, int n, int activation, float alpha, float beta) = NULL;

enum { ACT_NONE = 0, ACT_RELU = 1, ACT_CLIP = 4, ACT_GEMM = 8 };  /* se.c's / w16gemm.c's; ACT_GEMM: gemm.c's, below */
enum { OUT_F32 = 0, OUT_U8 = 1, OUT_S8 = 2, OUT_S32 = 3 };  /* OUT_S32: t, exact (tests) */

#define LANES 8
#define NV 4
#define NR (LANES * NV)  /* channels per packed panel */
#define MR 3
_Static_assert(NV == 4, "store_bytes packs four vectors of a panel");

typedef struct {
    get_handle_fn get_handle;
    void *x, *y;            /* dnnl_memory_t: 8-bit [M, K] row-major; output [M, N] row-major */
    const int8_t *w;        /* kiln_i8_pack's */
    const int32_t *offset;  /* [Np] */
    const float *scale;     /* [Np] */
    const float *scale_q;   /* [Np]: scale / y_scale, an 8-bit output's one multiply */
    long M, K, N;
    int x_signed;           /* the source is int8: flipped to uint8 as it is copied */
    int activation;         /* ACT_* */
    int gemm_activation;    /* ACT_GEMM: gemm.c's code of the activation */
    float alpha, beta;      /* Clip's bounds */
    float alpha_q, beta_q;  /* the same over y_scale */
    int out;                /* OUT_* */
    float y_scale;
    long y_zero;
    int threads;
    int bounded;            /* every |scale_q·t| < 2^30 (requantize.py): an 8-bit output rounds with no float */
    int clamp_words;        /* clamp, and Relu/Clip clamp the packed words to [lo_word, hi_word] where the 8-bit */
    int lo_word, hi_word;   /* saturation does not (a monotone map commutes with a clamp) */
} i8_plan;

int kiln_i8_panel(void) { return NR; }
/* 2: the AVX2 products; 0: plain C (exact too, slow) */
int kiln_i8_isa(void) {
#if defined(__AVX2__)
    return 2;
#else
    return 0;
#endif
}

/* w int8 [N][K] -> [ceil(N/NR)][ceil(K/4)][NR][4], zeros past N and K */
void kiln_i8_pack(const int8_t *w, int8_t *out, long N, long K)
{
    const long K4 = (K + 3) / 4, panels = (N + NR - 1) / NR;
    memset(out, 0, (size_t)panels * K4 * NR * 4);
    for (long n = 0; n < N; n++)
        for (long k = 0; k < K; k++)
            out[(((n / NR) * K4 + k / 4) * NR + n % NR) * 4 + k % 4] = w[n * K + k];
}

static inline float act_scalar(float v, int kind, float lo, float hi)
{
    if (kind == ACT_RELU) return v > 0.0f ? v : 0.0f;
    if (kind == ACT_CLIP) return v < lo ? lo : (v > hi ? hi : v);
    return v;
}

/* one output value from t (the plain C path) */
static inline void store_scalar(const i8_plan *p, void *y, long m, long n, int32_t t)
{
    const long at = m * p->N + n;
    if (p->out == OUT_S32) { ((int32_t *)y)[at] = t; return; }
    if (p->out != OUT_F32 && p->activation != ACT_GEMM) {  /* 8-bit: act_q(scale_q·t), the vector path's */
        float q = act_scalar(p->scale_q[n] * (float)t, p->activation, p->alpha_q, p->beta_q);
        q = q > 1e9f ? 1e9f : (q < -1e9f ? -1e9f : q);
        long v = (long)__builtin_rintf(q) + p->y_zero;
        if (p->out == OUT_U8) ((uint8_t *)y)[at] = (uint8_t)(v < 0 ? 0 : (v > 255 ? 255 : v));
        else ((int8_t *)y)[at] = (int8_t)(v < -128 ? -128 : (v > 127 ? 127 : v));
        return;
    }
    float r = act_scalar(p->scale[n] * (float)t, p->activation, p->alpha, p->beta);
    if (p->activation == ACT_GEMM && kiln_gemm_activate != NULL)
        kiln_gemm_activate(&r, 1, p->gemm_activation, p->alpha, p->beta);
    if (p->out == OUT_F32) { ((float *)y)[at] = r; return; }
    float q = r * (1.0f / p->y_scale);
    q = q != q ? 0.0f : q;
    q = q < -1e9f ? -1e9f : (q > 1e9f ? 1e9f : q);
    long v = (long)__builtin_rintf(q) + p->y_zero;
    if (p->out == OUT_U8) ((uint8_t *)y)[at] = (uint8_t)(v < 0 ? 0 : (v > 255 ? 255 : v));
    else ((int8_t *)y)[at] = (int8_t)(v < -128 ? -128 : (v > 127 ? 127 : v));
}

typedef struct {
    const i8_plan *p;
    const uint8_t *a;  /* rows, stride astride (K rounded up to 4) */
    long astride;
    void *y;
} i8_loop;

#if defined(__AVX2__)
/* acc[R][V]: the int32 sums of an R x V·8 tile, from OFFSET (the bias offsets of its V·8 columns) plus the u8·s8
 products of R rows of a (astride apart) and the packed w over K4 groups of 4 (vpmaddubsw, then vpmaddwd by ones):
 the k loop of kernel_R_V and fused_R_V_MODE. R <= 6: the unroll pragmas unroll every loop over r and v whole. */
#define ACCUMULATE(R, V, OFFSET)                                                                                   \
    __m256i acc[R][V];                                                                                             \
    _Pragma("GCC unroll 6") for (int r = 0; r < R; r++)                                                            \
        _Pragma("GCC unroll 4") for (int v = 0; v < V; v++)                                                        \
            acc[r][v] = _mm256_loadu_si256((const __m256i *)((OFFSET) + v * LANES));                               \
    const __m256i ones = _mm256_set1_epi16(1);                                                                     \
    for (long q = 0; q < K4; q++) {                                                                                \
        const __m256i *wq = (const __m256i *)(w + q * NR * 4);                                                     \
        _Pragma("GCC unroll 6") for (int r = 0; r < R; r++) {                                                      \
            int32_t bytes;                                                                                         \
            memcpy(&bytes, a + r * astride + q * 4, 4);                                                            \
            const __m256i b = _mm256_set1_epi32(bytes);                                                            \
            _Pragma("GCC unroll 4") for (int v = 0; v < V; v++) {                                                  \
                const __m256i pairs = _mm256_maddubs_epi16(b, _mm256_loadu_si256(wq + v));                         \
                acc[r][v] = _mm256_add_epi32(acc[r][v], _mm256_madd_epi16(pairs, ones));                           \
            }                                                                                                      \
        }                                                                                                          \
    }

/* The k loop of an R x V·8 tile alone (R, V constant; the epilogue kept out, as w16gemm.c found GCC spills the
   accumulators otherwise): rows a + r·astride, the panel w, K4 groups of 4 k; t = offset + the int32 sums to out
   [R][NR] (the accumulators start at the offsets: no add in the epilogue). */
#define DEFINE_KERNEL(R, V)                                                                                        \
    static __attribute__((noinline)) void kernel_##R##_##V(const uint8_t *a, long astride, const int8_t *w,      \
                                                           long K4, const int32_t *offset, int32_t *out) {        \
        ACCUMULATE(R, V, offset);                                                                                  \
        _Pragma("GCC unroll 6") for (int r = 0; r < R; r++)                                                       \
            _Pragma("GCC unroll 4") for (int v = 0; v < V; v++)                                                   \
                _mm256_storeu_si256((__m256i *)(out + (r * NV + v) * LANES), acc[r][v]);                           \
    }
DEFINE_KERNEL(3, 4) DEFINE_KERNEL(2, 4) DEFINE_KERNEL(1, 4)
DEFINE_KERNEL(4, 3) DEFINE_KERNEL(3, 3) DEFINE_KERNEL(2, 3) DEFINE_KERNEL(1, 3)
DEFINE_KERNEL(6, 2) DEFINE_KERNEL(5, 2) DEFINE_KERNEL(4, 2) DEFINE_KERNEL(3, 2) DEFINE_KERNEL(2, 2) DEFINE_KERNEL(1, 2)
DEFINE_KERNEL(6, 1) DEFINE_KERNEL(5, 1) DEFINE_KERNEL(4, 1) DEFINE_KERNEL(3, 1) DEFINE_KERNEL(2, 1) DEFINE_KERNEL(1, 1)

static inline __attribute__((always_inline)) __m256i clamp_words(const i8_plan *p, __m256i words)
{
    return _mm256_min_epi16(_mm256_max_epi16(words, _mm256_set1_epi16((short)p->lo_word)),
                            _mm256_set1_epi16((short)p->hi_word));
}

/* A whole R x V·8 tile (3 x 32, or 4 x 24: a 24-channel projection) with its epilogue in the same function: the
   outputs from the accumulators, no round trip of the sums through memory (K = 16-32, MobileNetV2's expand layers:
   the epilogue is as long as the k loop). MODE: ON_WORDS / ON_WORDS_CLAMPED (an 8-bit output on a bounded plan,
   requantize.py) or AS_FLOATS (float32 out, Relu/Clip or none). y: the tile's first output, rows N apart */
enum { ON_WORDS = 0, ON_WORDS_CLAMPED = 1, AS_FLOATS = 2 };
#define DEFINE_FUSED(R, V, MODE)                                                                                   \
    static __attribute__((noinline)) void fused_##R##_##V##_##MODE(const i8_plan *p, const uint8_t *a,            \
                                                                   long astride, const int8_t *w, long K4,        \
                                                                   long n0, void *y) {                            \
        ACCUMULATE(R, V, p->offset + n0);                                                                          \
        if (MODE == AS_FLOATS) {                                                                                   \
            _Pragma("GCC unroll 4") for (int r = 0; r < R; r++)                                                   \
                _Pragma("GCC unroll 4") for (int v = 0; v < V; v++)                                               \
                    _mm256_storeu_ps((float *)y + r * p->N + v * LANES,                                            \
                                     clamp_activate(p, _mm256_mul_ps(_mm256_cvtepi32_ps(acc[r][v]),                \
                                                                     _mm256_loadu_ps(p->scale + n0 + v * LANES))));\
            return;                                                                                                \
        }                                                                                                          \
        const __m256i zero = _mm256_set1_epi16((short)p->y_zero);                                                  \
        _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                                                     \
            __m256i q[NV];                                                                                         \
            _Pragma("GCC unroll 4") for (int v = 0; v < V; v++)                                                   \
                q[v] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_cvtepi32_ps(acc[r][v]),                             \
                                                        _mm256_loadu_ps(p->scale_q + n0 + v * LANES)));            \
            if (V == 3) q[3] = q[2];                                                                               \
            __m256i w01 = _mm256_adds_epi16(_mm256_packs_epi32(q[0], q[1]), zero);                                 \
            __m256i w23 = _mm256_adds_epi16(_mm256_packs_epi32(q[2], q[3]), zero);                                 \
            if (MODE == ON_WORDS_CLAMPED) {                                                                        \
                w01 = clamp_words(p, w01);                                                                         \
                w23 = clamp_words(p, w23);                                                                         \
            }                                                                                                      \
            const __m256i bytes = p->out == OUT_U8 ? _mm256_packus_epi16(w01, w23) : _mm256_packs_epi16(w01, w23); \
            const __m256i ordered =                                                                                \
                _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));                     \
            uint8_t *row = (uint8_t *)y + r * p->N;                                                                \
            if (V == 4) _mm256_storeu_si256((__m256i *)row, ordered);                                              \
            else {  /* 24 bytes: q0, q1, then q2 */                                                                \
                _mm_storeu_si128((__m128i *)row, _mm256_castsi256_si128(ordered));                                 \
                _mm_storel_epi64((__m128i *)(row + 16), _mm256_extracti128_si256(ordered, 1));                     \
            }                                                                                                      \
        }                                                                                                          \
    }
#define TILE_ROWS 6  /* the tallest tile */
typedef void (*kernel_fn)(const uint8_t *, long, const int8_t *, long, const int32_t *, int32_t *);
static const int MR_OF[NV + 1] = {0, 6, 6, 4, MR};  /* rows of a tile by the panel's vectors */
static const kernel_fn KERNELS[NV + 1][TILE_ROWS + 1] = {
    {0},
    {0, kernel_1_1, kernel_2_1, kernel_3_1, kernel_4_1, kernel_5_1, kernel_6_1},
    {0, kernel_1_2, kernel_2_2, kernel_3_2, kernel_4_2, kernel_5_2, kernel_6_2},
    {0, kernel_1_3, kernel_2_3, kernel_3_3, kernel_4_3},
    {0, kernel_1_4, kernel_2_4, kernel_3_4}};

/* Relu / Clip on r (the activations the kernel applies in registers; ACT_GEMM's is applied to a tile's floats) */
static inline __attribute__((always_inline)) __m256 clamp_activate(const i8_plan *p, __m256 r)
{
    if (p->activation == ACT_RELU) return _mm256_max_ps(r, _mm256_setzero_ps());
    if (p->activation == ACT_CLIP)
        return _mm256_min_ps(_mm256_max_ps(r, _mm256_set1_ps(p->alpha)), _mm256_set1_ps(p->beta));
    return r;
}

DEFINE_FUSED(3, 4, ON_WORDS) DEFINE_FUSED(3, 4, ON_WORDS_CLAMPED) DEFINE_FUSED(3, 4, AS_FLOATS)
DEFINE_FUSED(4, 3, ON_WORDS) DEFINE_FUSED(4, 3, ON_WORDS_CLAMPED) DEFINE_FUSED(4, 3, AS_FLOATS)
typedef void (*fused_fn)(const i8_plan *, const uint8_t *, long, const int8_t *, long, long, void *);
static const fused_fn FUSED_3_4[] = {fused_3_4_ON_WORDS, fused_3_4_ON_WORDS_CLAMPED, fused_3_4_AS_FLOATS};
static const fused_fn FUSED_4_3[] = {fused_4_3_ON_WORDS, fused_4_3_ON_WORDS_CLAMPED, fused_4_3_AS_FLOATS};

/* the fused tile's epilogue for this plan, or -1: none (the sums through memory) */
static int fused_mode(const i8_plan *p)
{
    if ((p->out == OUT_U8 || p->out == OUT_S8) && p->bounded) return p->clamp_words ? ON_WORDS_CLAMPED : ON_WORDS;
    if (p->out == OUT_F32 && (p->activation == ACT_NONE || p->activation == ACT_RELU || p->activation == ACT_CLIP))
        return AS_FLOATS;
    return -1;
}

/* r (activated) as 8 int32 of the 8-bit output: round(r·(1/y_scale)) + y_zero, ties to even, NaN saturating low */
static inline __attribute__((always_inline)) __m256i requantize(const i8_plan *p, __m256 r)
{
    __m256 q = _mm256_mul_ps(r, _mm256_set1_ps(1.0f / p->y_scale)); /* a multiply, as w16gemm.c */
    q = _mm256_min_ps(_mm256_max_ps(q, _mm256_set1_ps(-1e9f)), _mm256_set1_ps(1e9f)); /* NaN -> -1e9 */
    return _mm256_add_epi32(_mm256_cvtps_epi32(q), _mm256_set1_epi32((int)p->y_zero));
}

/* count (<= 8) activated values r of row m, channels [n, n + count), to the float32 or 8-bit output */
static inline __attribute__((always_inline)) void store_real(const i8_plan *p, void *y, long m, long n, __m256 r,
                                                             long count)
{
    const long at = m * p->N + n;
    if (p->out == OUT_F32) {
        if (count == LANES) { _mm256_storeu_ps((float *)y + at, r); return; }
        float s[LANES];
        _mm256_storeu_ps(s, r);
        memcpy((float *)y + at, s, sizeof(float) * count);
        return;
    }
    const __m256i v = requantize(p, r);
    const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    const __m128i bytes = p->out == OUT_U8 ? _mm_packus_epi16(words, words) : _mm_packs_epi16(words, words);
    if (count == LANES) { _mm_storel_epi64((__m128i *)((uint8_t *)y + at), bytes); return; }
    uint8_t s[16];
    _mm_storeu_si128((__m128i *)s, bytes);
    memcpy((uint8_t *)y + at, s, count);
}

/* 8 int32 of an 8-bit output before its zero point: round(act_q(scale_q·t)) (the caller adds y_zero in int16,
   saturating, as it packs). Above 1e9 clamped; below -2^31 the conversion gives INT_MIN, which saturates low too */
static inline __attribute__((always_inline)) __m256i quantize_q(const i8_plan *p, __m256i t, __m256 scale_q)
{
    __m256 q = _mm256_mul_ps(_mm256_cvtepi32_ps(t), scale_q);
    if (p->bounded) return _mm256_cvtps_epi32(q);  /* the activation on the words (store_q) */
    if (p->activation == ACT_CLIP)
        return _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(q, _mm256_set1_ps(p->alpha_q)),
                                                _mm256_set1_ps(p->beta_q)));
    if (p->activation == ACT_RELU) q = _mm256_max_ps(q, _mm256_setzero_ps());
    return _mm256_cvtps_epi32(_mm256_min_ps(q, _mm256_set1_ps(1e9f)));
}

/* the count (<= NR) quantized values q of row m, channels [n0, n0 + count), with the zero point, to 8 bits: packs
   work within 128-bit halves, so bytes come out as [q0 0-3, q1 0-3, q2 0-3, q3 0-3 | the 4-7s] and one permute
   orders them; a whole panel is one 32-byte store, else 16 channels (two vectors) a store */
static inline __attribute__((always_inline)) void store_q(const i8_plan *p, void *y, long m, long n0,
                                                          const __m256i *q, long count)
{
    uint8_t *dst = (uint8_t *)y + m * p->N + n0;
    const __m256i zero = _mm256_set1_epi16((short)p->y_zero);
    const int is_unsigned = p->out == OUT_U8;
    if (count == NR) {
        __m256i w01 = _mm256_adds_epi16(_mm256_packs_epi32(q[0], q[1]), zero);
        __m256i w23 = _mm256_adds_epi16(_mm256_packs_epi32(q[2], q[3]), zero);
        if (p->bounded && p->clamp_words) {
            w01 = clamp_words(p, w01);
            w23 = clamp_words(p, w23);
        }
        const __m256i bytes = is_unsigned ? _mm256_packus_epi16(w01, w23) : _mm256_packs_epi16(w01, w23);
        _mm256_storeu_si256((__m256i *)dst,
                            _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        return;
    }
    for (int v = 0; v * LANES < count; v += 2) {
        const long left = count - v * LANES;
        __m256i words = _mm256_adds_epi16(_mm256_packs_epi32(q[v], left > LANES ? q[v + 1] : q[v]), zero);
        if (p->bounded && p->clamp_words) words = clamp_words(p, words);
        const __m256i bytes = is_unsigned ? _mm256_packus_epi16(words, words) : _mm256_packs_epi16(words, words);
        const __m128i ordered = _mm256_castsi256_si128(
            _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 0, 4, 1, 5)));  /* q[v], q[v + 1] */
        if (left >= 2 * LANES) _mm_storeu_si128((__m128i *)(dst + v * LANES), ordered);
        else if (left == LANES) _mm_storel_epi64((__m128i *)(dst + v * LANES), ordered);
        else {
            uint8_t bytes16[16];
            _mm_storeu_si128((__m128i *)bytes16, ordered);
            memcpy(dst + v * LANES, bytes16, left);
        }
    }
}

/* one panel (NR channels from n0, of which V vectors hold real ones) over every row */
static void panel_item(void *ctx, long panel)
{
    const i8_loop *l = (const i8_loop *)ctx;
    const i8_plan *p = l->p;
    const long K4 = (p->K + 3) / 4, n0 = panel * NR;
    const long count = p->N - n0 < NR ? p->N - n0 : NR;  /* the panel's real channels */
    const int V = (int)((count + LANES - 1) / LANES), mr = MR_OF[V];
    const int8_t *w = p->w + panel * K4 * NR * 4;
    int32_t sums[TILE_ROWS * NR] __attribute__((aligned(32)));
    float real[TILE_ROWS * NR] __attribute__((aligned(32))); /* a tile's r for ACT_GEMM's activation pass */
    __m256 scale[NV], scale_q[NV];
    for (int v = 0; v < NV; v++) {
        scale[v] = _mm256_loadu_ps(p->scale + n0 + v * LANES);
        scale_q[v] = _mm256_loadu_ps(p->scale_q + n0 + v * LANES);
    }
    const int outside = p->activation == ACT_GEMM && kiln_gemm_activate != NULL;
    const int bytes_q = (p->out == OUT_U8 || p->out == OUT_S8) && !outside;  /* act_q(scale_q·t) */
    const int mode = fused_mode(p);  /* whole 3 x 32 / 4 x 24 tiles through fused_R_V */
    const fused_fn fused = mode < 0 ? NULL : V == NV ? FUSED_3_4[mode] : V == 3 ? FUSED_4_3[mode] : NULL;
    const long out_bytes = p->out == OUT_F32 ? 4 : 1;
    for (long m0 = 0; m0 < p->M; m0 += mr) {
        const long rows = p->M - m0 < mr ? p->M - m0 : mr;
        if (fused != NULL && rows == mr) {
            fused(p, l->a + m0 * l->astride, l->astride, w, K4, n0, (uint8_t *)l->y + (m0 * p->N + n0) * out_bytes);
            continue;
        }
        KERNELS[V][rows](l->a + m0 * l->astride, l->astride, w, K4, p->offset + n0, sums);
        if (p->out == OUT_S32) {  /* t itself */
            for (long r = 0; r < rows; r++)
                for (int v = 0; v < V; v++) {
                    const long n = n0 + v * LANES, left = p->N - n < LANES ? p->N - n : LANES;
                    int32_t t[LANES];
                    memcpy(t, sums + (r * NV + v) * LANES, sizeof t);
                    memcpy((int32_t *)l->y + (m0 + r) * p->N + n, t, sizeof(int32_t) * left);
                }
            continue;
        }
        if (bytes_q) {
            for (long r = 0; r < rows; r++) {
                __m256i q[NV];
                for (int v = 0; v < V; v++)
                    q[v] = quantize_q(p, _mm256_load_si256((const __m256i *)(sums + (r * NV + v) * LANES)),
                                      scale_q[v]);
                store_q(p, l->y, m0 + r, n0, q, count);
            }
            continue;
        }
        if (outside) {  /* r of the whole tile, then gemm.c's activation over it in one call */
            for (long r = 0; r < rows; r++)
                for (int v = 0; v < V; v++) {
                    const __m256i t = _mm256_load_si256((const __m256i *)(sums + (r * NV + v) * LANES));
                    _mm256_store_ps(real + (r * NV + v) * LANES, _mm256_mul_ps(_mm256_cvtepi32_ps(t), scale[v]));
                }
            if (V == NV) kiln_gemm_activate(real, (int)(rows * NR), p->gemm_activation, p->alpha, p->beta);
            else  /* the rows' real vectors only */
                for (long r = 0; r < rows; r++)
                    kiln_gemm_activate(real + r * NR, V * LANES, p->gemm_activation, p->alpha, p->beta);
        }
        for (long r = 0; r < rows; r++)
            for (int v = 0; v < V; v++) {
                __m256 rv;
                if (outside) rv = _mm256_load_ps(real + (r * NV + v) * LANES);
                else {
                    const __m256i t = _mm256_load_si256((const __m256i *)(sums + (r * NV + v) * LANES));
                    rv = clamp_activate(p, _mm256_mul_ps(_mm256_cvtepi32_ps(t), scale[v]));
                }
                const long n = n0 + v * LANES;
                store_real(p, l->y, m0 + r, n, rv, p->N - n < LANES ? p->N - n : LANES);
            }
    }
}
#else
/* plain C: the same sums, int64 per value then taken as int32 (the sums fit: i8gemm.py's checks) */
static void panel_item(void *ctx, long panel)
{
    const i8_loop *l = (const i8_loop *)ctx;
    const i8_plan *p = l->p;
    const long K4 = (p->K + 3) / 4;
    const int8_t *w = p->w + panel * K4 * NR * 4;
    for (long m = 0; m < p->M; m++)
        for (long j = 0; j < NR && panel * NR + j < p->N; j++) {
            int64_t acc = 0;
            for (long k = 0; k < K4 * 4; k++)
                acc += (int64_t)l->a[m * l->astride + k] * w[((k / 4) * NR + j) * 4 + k % 4];
            store_scalar(p, l->y, m, panel * NR + j, (int32_t)(acc + p->offset[panel * NR + j]));
        }
}
#endif

static int max_threads(void)
{
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

static void parallel_items(long count, int threads, kiln_item_fn fn, void *ctx)
{
    if (kiln_shared_parallel_for != NULL && threads > 1 && count > 1) {
        kiln_shared_parallel_for(count, threads, fn, ctx);
        return;
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1 && count > 1)
    for (long i = 0; i < count; ++i) fn(ctx, i);
}

/* y = the layer of x; returns 0, or 1 where a copy of the rows could not be allocated */
int kiln_i8_run(const i8_plan *p, const void *x, void *y)
{
    const long K4 = (p->K + 3) / 4, panels = (p->N + NR - 1) / NR;
    if (p->M <= 0 || p->N <= 0) return 0;  /* no rows (an empty batch) or no channels: nothing to write */
    i8_loop l = {p, (const uint8_t *)x, p->K, y};
    uint8_t *copy = NULL;
    if (p->x_signed || p->K % 4) {  /* rows padded to K4·4 (and flipped to uint8) once per call */
        copy = (uint8_t *)aligned_alloc(64, (size_t)((p->M * K4 * 4 + 63) / 64 * 64));
        if (copy == NULL) return 1;
        const uint8_t flip = p->x_signed ? 0x80 : 0;
        for (long m = 0; m < p->M; m++) {
            const uint8_t *src = (const uint8_t *)x + m * p->K;
            uint8_t *dst = copy + m * K4 * 4;
            for (long k = 0; k < p->K; k++) dst[k] = src[k] ^ flip;
            for (long k = p->K; k < K4 * 4; k++) dst[k] = 0;
        }
        l.a = copy;
        l.astride = K4 * 4;
    }
    const int threads = p->threads > 0 ? p->threads : max_threads();
    parallel_items(panels, threads, panel_item, &l);
    free(copy);
    return 0;
}

/* The layer as a call of a native segment's loop (segment_loop.c call_fn): the input's and output's addresses
   read from their dnnl_memory_t at each run. */
int kiln_i8_call(void *object, void *stream, int nargs, const void *args)
{
    (void)stream; (void)nargs; (void)args;
    const i8_plan *p = (const i8_plan *)object;
    void *x = 0, *y = 0;
    if (p->get_handle(p->x, &x) || !x || p->get_handle(p->y, &y) || !y) return 2;
    return kiln_i8_run(p, x, y) ? 2 : 0;
}
