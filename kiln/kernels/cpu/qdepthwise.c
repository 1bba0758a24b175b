/* kiln::QConv depthwise on 8-bit NHWC activations (kiln/kernels/cpu/qdepthwise.py): a KxK layer with one filter per
 * channel (K <= 8 a side, any stride and padding), the zero point, int32 bias, scale, Relu/Clip and the
 * requantization in the same pass, a member of native segments.
 *
 *     t    = bias[c] + Σ_{kh, kw} x[n, oh·s − pt + kh, ow·s − pl + kw, c] · w[kh, kw, c]     in int32, exact;
 *                                                        a padding tap reads z_x; bias = the layer's − z_x·Σ w
 *                                                        (qdepthwise.py): t = Σ (x − z_x)·w + the layer's bias
 *     y    = act(scale[c]·float(t))                      float32 out; scale = x_scale·w_scale[c]
 *     y    = saturate(round_half_even(act_q(scale_q[c]·float(t))) + y_zero)     uint8 / int8 out: scale_q =
 *            scale / y_scale (onnxruntime's requantize: one float multiply), act_q the activation's bounds over
 *            y_scale; at a tie it may round a step from ONNX's (exact) product and division
 *
 * How: pairs of taps through vpmaddwd. NHWC puts a pixel's channels side by side and a depthwise layer sums over
 * taps, so vpmaddubsw's adjacent-byte pairs would be pairs of channels. Instead each input row is widened once to
 * int16 into a per-thread ring of KH rows as *column pairs*: ring pair m of a row holds, for every channel c, the
 * two int16 values (x[j][c], x[j + 1][c]) of input columns j = m·G and j + 1 (G = 2 at even strides, where only
 * even columns start a pair, else 1), padding columns and rows z_x. The weights are paired alike: (w[kh][2p][c],
 * w[kh][2p + 1][c]), 0 past KW. Output pixel ow's taps 2p and 2p + 1 of tap row kh are then one vpmaddwd of ring pair
 * (ow·SW + 2p) / G with weight pair p: a 3x3 layer is 6 vpmaddwd + 6 vpaddd per 8 channels (AVX2) where the float
 * kernel (depthwise.c) runs 9 FMAs, and at stride 2 the ring holds only the even-column pairs (the de-interleave is
 * the widening). Exact for any int8 weight: |x·w| <= 255·128, a pair's sum < 2^16 and at most 64 taps (int32 sums,
 * qdepthwise.py checks the bias's range). The epilogue is i8gemm.c's (float scale, activation, requantize, pack).
 * Before (bench/results/int8-mnv2-avx2-2026-12-07.md): a float32 ring and the float kernel's FMAs, 0.7-1.0x
 * oneDNN's int8 layer at stride 1 and 1.1-1.26x at stride 2 (AVX2 on Zen 4); now bench/results/
 * int8-mnv2-avx2-zen4-2026-12-07b.md.
 *
 * Layout: the weights as int16 [KH][KP][Cp][2] (KP = ceil(KW / 2)), bias (int32) and scale (float32) as [Cp] (Cp: C
 * rounded up to the vector width, zeros past C); a ring row is [M][Cp][2] int16 (M pairs, qdepthwise.py); a scalar
 * loop takes the channels past the last whole vector. Threads over runs of output rows, each with its ring (the
 * plan's, allocated with it by qdepthwise.py). Returns 0, or 2 (oneDNN's "invalid arguments") when an operand is not
 * bound: the segment names the layer. */
#include <omp.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

typedef int (*get_handle_fn)(void *memory, void **handle);

enum { ACT_NONE = 0, ACT_RELU = 1, ACT_CLIP = 4 };  /* i8gemm.c's numbering */
enum { OUT_F32 = 0, OUT_U8 = 1, OUT_S8 = 2 };       /* i8gemm.c's */

typedef struct {
    get_handle_fn get_handle;
    void *x, *y;                  /* dnnl_memory_t: NHWC [N, H, W, C] 8-bit, [N, OH, OW, C] */
    const int16_t *w;             /* [KH][KP][Cp][2]: tap pairs (2p, 2p + 1), 0 past KW */
    const int32_t *bias;          /* [Cp]: the layer's bias − z_x·Σ w */
    const float *scale;           /* [Cp] */
    const float *scale_q;         /* [Cp]: scale / y_scale, an 8-bit output's one multiply */
    const uint8_t *padding;       /* [C] bytes of z_x: a padding column's source */
    long N, C, Cp, H, W, OH, OW;
    int KH, KW, SH, SW, PT, PL;
    int KP;                       /* ceil(KW / 2) tap pairs a tap row */
    int G;                        /* input columns between ring pairs: 2 at even strides, else 1 */
    long M;                       /* pairs a ring row: ((OW − 1)·SW + 2·(KP − 1)) / G + 1 */
    int x_signed;                 /* int8 source (else uint8) */
    int activation;
    float alpha, beta;            /* Clip's min and max */
    float alpha_q, beta_q;        /* the same over y_scale */
    int out;                      /* OUT_* */
    int y_zero;
    int bounded;                  /* every |scale_q·t| < 2^30 (requantize.py): AVX2 rounds q with no float clamp */
    int clamp_words;              /* and clamps the packed words to [lo_word, hi_word] for Relu/Clip where the */
    int lo_word, hi_word;         /* 8-bit saturation does not (a monotone map commutes with a clamp) */
    int threads;                  /* 1: no parallel region */
    int16_t *rings;               /* [threads][ring_elements]: each thread's ring (qdepthwise.py's, per plan) */
    long ring_elements;           /* KH·M·Cp·2 */
} qdw_plan;

#define U 4           /* output pixels of a block */
#define MAX_KERNEL 8  /* taps a side (qdepthwise.py MAX_KERNEL) */

/* a thread's ring: KH widened input rows, row ih in slot ih mod KH (a row's KH tap rows are consecutive) */
typedef struct {
    int16_t *rows;   /* [KH][M][Cp][2] */
    long held[MAX_KERNEL][2];  /* (n, ih) each slot holds; n = −1: none */
} ring;

static inline float act_scalar(const qdw_plan *p, float r)
{
    if (p->activation == ACT_RELU) return r > 0.0f ? r : 0.0f;
    if (p->activation == ACT_CLIP) return r < p->alpha ? p->alpha : (r > p->beta ? p->beta : r);
    return r;
}

static inline void store_scalar(const qdw_plan *p, void *y, long at, long c, int32_t t)
{
    if (p->out == OUT_F32) { ((float *)y)[at] = act_scalar(p, p->scale[c] * (float)t); return; }
    float q = p->scale_q[c] * (float)t;
    if (p->activation == ACT_RELU) q = q > 0.0f ? q : 0.0f;
    if (p->activation == ACT_CLIP) q = q < p->alpha_q ? p->alpha_q : (q > p->beta_q ? p->beta_q : q);
    q = q != q ? -1e9f : (q < -1e9f ? -1e9f : (q > 1e9f ? 1e9f : q));
    long v = (long)__builtin_rintf(q) + p->y_zero;
    if (p->out == OUT_U8) ((uint8_t *)y)[at] = (uint8_t)(v < 0 ? 0 : (v > 255 ? 255 : v));
    else ((int8_t *)y)[at] = (int8_t)(v < -128 ? -128 : (v > 127 ? 127 : v));
}

/* the ring pair holding tap pair pp of output pixel ow */
static inline long pair_of(const qdw_plan *p, long ow, int pp) { return (ow * p->SW + 2 * pp) / p->G; }

/* channels [c0, C) of output pixels [ow0, ow0 + count) of row (n, oh), one at a time, from the ring */
static void pixels_scalar(const qdw_plan *p, void *y, const int16_t *const *tap_rows, long n, long oh, long ow0,
                          long count, long c0)
{
    const long Cp = p->Cp;
    for (long ow = ow0; ow < ow0 + count; ow++)
        for (long c = c0; c < p->C; c++) {
            int32_t t = p->bias[c];
            for (int kh = 0; kh < p->KH; kh++)
                for (int pp = 0; pp < p->KP; pp++) {
                    const int16_t *x2 = tap_rows[kh] + (pair_of(p, ow, pp) * Cp + c) * 2;
                    const int16_t *w2 = p->w + (((long)kh * p->KP + pp) * Cp + c) * 2;
                    t += (int32_t)x2[0] * w2[0] + (int32_t)x2[1] * w2[1];
                }
            store_scalar(p, y, ((n * p->OH + oh) * p->OW + ow) * p->C + c, c, t);
        }
}

#if defined(__AVX512F__) || defined(__AVX2__)
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define LANES 16
typedef __m512 vf;
typedef __m512i vi;
#define VZERO() _mm512_setzero_ps()
#define VSET(v) _mm512_set1_ps(v)
#define VLOAD(a) _mm512_loadu_ps(a)
#define VMUL(a, b) _mm512_mul_ps(a, b)
#define VMIN(a, b) _mm512_min_ps(a, b)
#define VMAX(a, b) _mm512_max_ps(a, b)
#define VSTORE(a, v) _mm512_storeu_ps(a, v)
#define TO_INT(v) _mm512_cvtps_epi32(v) /* round half to even (MXCSR's default) */
#define TO_FLOAT(v) _mm512_cvtepi32_ps(v)
#define IADD(a, b) _mm512_add_epi32(a, b)
#define ILOAD(a) _mm512_loadu_si512((const void *)(a))
#define ISET(v) _mm512_set1_epi32(v)
#if defined(__AVX512VNNI__)
#define MADD(acc, a, b) _mm512_dpwssd_epi32(acc, a, b) /* acc + a pair's two products, one instruction */
#else
#define MADD(acc, a, b) _mm512_add_epi32(acc, _mm512_madd_epi16(a, b))
#endif
#define PIN(v) __asm__("" : "+v"(v))
/* int32 lanes to bytes, saturated to uint8 (negatives to 0 first: vpmovusdb reads them unsigned) or int8 */
#define STORE_BYTES(a, v, is_unsigned)                                                                           \
    _mm_storeu_si128((__m128i *)(a),                                                                               \
                     (is_unsigned) ? _mm512_cvtusepi32_epi8(_mm512_max_epi32(v, _mm512_setzero_si512()))         \
                                   : _mm512_cvtsepi32_epi8(v))
#else
#define LANES 8
typedef __m256 vf;
typedef __m256i vi;
#define VZERO() _mm256_setzero_ps()
#define VSET(v) _mm256_set1_ps(v)
#define VLOAD(a) _mm256_loadu_ps(a)
#define VMUL(a, b) _mm256_mul_ps(a, b)
#define VMIN(a, b) _mm256_min_ps(a, b)
#define VMAX(a, b) _mm256_max_ps(a, b)
#define VSTORE(a, v) _mm256_storeu_ps(a, v)
#define TO_INT(v) _mm256_cvtps_epi32(v)
#define TO_FLOAT(v) _mm256_cvtepi32_ps(v)
#define IADD(a, b) _mm256_add_epi32(a, b)
#define ILOAD(a) _mm256_loadu_si256((const __m256i *)(a))
#define ISET(v) _mm256_set1_epi32(v)
#define MADD(acc, a, b) _mm256_add_epi32(acc, _mm256_madd_epi16(a, b))
#define PIN(v) __asm__("" : "+x"(v))
#endif

/* the epilogue's constants, read from the plan once per block (a byte store may alias the plan: the compiler would
   read them again after every store) */
typedef struct {
    const float *scale, *scale_q;
    vf alpha, beta, alpha_q, beta_q;
    int y_zero;
    int activation, out;
    int lo_word, hi_word;
} epilogue;

/* how an 8-bit output applies Relu/Clip: on the floats (and clamped to convert), or on the packed words */
enum { ON_FLOATS = 0, ON_WORDS = 1, ON_WORDS_CLAMPED = 2 };

static inline __attribute__((always_inline)) epilogue epilogue_of(const qdw_plan *p)
{
    epilogue e = {p->scale, p->scale_q, VSET(p->alpha), VSET(p->beta), VSET(p->alpha_q), VSET(p->beta_q),
                  p->y_zero, p->activation, p->out, p->lo_word, p->hi_word};
    return e;
}

/* float32 out: act(scale·t) */
static inline __attribute__((always_inline)) void store_float(const epilogue *e, float *y, long c, vi t)
{
    vf r = VMUL(TO_FLOAT(t), VLOAD(e->scale + c));
    if (e->activation == ACT_RELU) r = VMAX(r, VZERO());
    else if (e->activation == ACT_CLIP) r = VMIN(VMAX(r, e->alpha), e->beta);
    VSTORE(y, r);
}

/* 8-bit out: round(act_q(scale_q·t)) as int32 lanes, within int32 (the zero point added by the caller); ON_WORDS:
   round(scale_q·t), the activation left to the words */
static inline __attribute__((always_inline)) vi quantized(const epilogue *e, long c, vi t, const int mode)
{
    vf q = VMUL(TO_FLOAT(t), VLOAD(e->scale_q + c));
    if (mode != ON_FLOATS) return TO_INT(q);
    if (e->activation == ACT_CLIP) q = VMIN(VMAX(q, e->alpha_q), e->beta_q);
    else q = VMIN(VMAX(q, e->activation == ACT_RELU ? VZERO() : VSET(-1e9f)), VSET(1e9f));
    return TO_INT(q);
}

#if LANES == 16
/* one vector's sums t to y at `at` (elements) */
static inline __attribute__((always_inline)) void store_vector(const epilogue *e, void *y, long at, long c, vi t,
                                                               const int mode)
{
    (void)mode; /* AVX-512: on the floats */
    if (e->out == OUT_F32) { store_float(e, (float *)y + at, c, t); return; }
    STORE_BYTES((uint8_t *)y + at, IADD(quantized(e, c, t, ON_FLOATS), ISET(e->y_zero)), e->out == OUT_U8);
}
#define store_pair(e, y, at, c, t0, t1, mode)                                                                        \
    (store_vector(e, y, at, c, t0, mode), store_vector(e, y, (at) + LANES, (c) + LANES, t1, mode))
#else
/* int32 lanes of two vectors to 16 bytes: int16 saturated, the zero point added (saturating), 8-bit saturated; the
   packs work within 128-bit lanes, so the dwords come out as (a 0-3, b 0-3 | a 4-7, b 4-7) and one permute orders
   them */
static inline __attribute__((always_inline)) __m128i bytes16(const epilogue *e, __m256i a, __m256i b, const int mode)
{
    __m256i words = _mm256_adds_epi16(_mm256_packs_epi32(a, b), _mm256_set1_epi16((short)e->y_zero));
    if (mode == ON_WORDS_CLAMPED)
        words = _mm256_min_epi16(_mm256_max_epi16(words, _mm256_set1_epi16((short)e->lo_word)),
                                 _mm256_set1_epi16((short)e->hi_word));
    const __m256i bytes = e->out == OUT_U8 ? _mm256_packus_epi16(words, words) : _mm256_packs_epi16(words, words);
    return _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 0, 4, 1, 5)));
}

static inline __attribute__((always_inline)) void store_vector(const epilogue *e, void *y, long at, long c, vi t,
                                                               const int mode)
{
    if (e->out == OUT_F32) { store_float(e, (float *)y + at, c, t); return; }
    const __m256i q = quantized(e, c, t, mode);
    _mm_storel_epi64((__m128i *)((uint8_t *)y + at), bytes16(e, q, q, mode));
}

/* two neighbouring channel vectors of one pixel: one pack and one 16-byte store for both */
static inline __attribute__((always_inline)) void store_pair(const epilogue *e, void *y, long at, long c, vi t0,
                                                             vi t1, const int mode)
{
    if (e->out == OUT_F32) {
        store_float(e, (float *)y + at, c, t0);
        store_float(e, (float *)y + at + LANES, c + LANES, t1);
        return;
    }
    _mm_storeu_si128((__m128i *)((uint8_t *)y + at),
                     bytes16(e, quantized(e, c, t0, mode), quantized(e, c + LANES, t1, mode), mode));
}
#endif

/* acc + the products of a pair of taps, in this order: integer adds are associative, and without the (empty) asm the
   compiler regroups a block's 48 adds into trees whose partial sums spill to the stack (2x slower) */
static inline __attribute__((always_inline)) vi madd_add(vi acc, vi a, vi b)
{
    vi r = MADD(acc, a, b);
    PIN(r);
    return r;
}

/* `count` (<= U) output pixels from ow0 of row (n, oh), channels [0, cv) NV vectors at a time (then one), from the
   ring's tap rows: NV·count int32 accumulators starting at the bias; per tap pair its weight vectors loaded once for
   the block. PX: ring pairs between neighbouring pixels (SW / G), PP: between tap pairs (2 / G) */
static inline __attribute__((always_inline)) void block_channels(const qdw_plan *p, const epilogue *e, void *y,
                                                                 const int16_t *const *tap_rows, long out_at, long ow0,
                                                                 long c, const int NV, const int KH, const int KP,
                                                                 const long PX, const long PP, const int count,
                                                                 const int mode)
{
    const long C = p->C, Cp = p->Cp;
    vi acc[2][U];
    for (int v = 0; v < NV; v++) {
        const vi start = ILOAD(p->bias + c + v * LANES);
        for (int u = 0; u < count; u++) acc[v][u] = start;
    }
    for (int kh = 0; kh < KH; kh++) {
        const int16_t *src = tap_rows[kh] + (ow0 * PX * Cp + c) * 2;
        for (int pp = 0; pp < KP; pp++) {
            const int16_t *wp = p->w + (((long)kh * KP + pp) * Cp + c) * 2;
            for (int v = 0; v < NV; v++) {
                const vi wv = ILOAD(wp + v * LANES * 2);
                for (int u = 0; u < count; u++)
                    acc[v][u] = madd_add(acc[v][u], ILOAD(src + (u * PX + pp * PP) * Cp * 2 + v * LANES * 2), wv);
            }
        }
    }
    for (int u = 0; u < count; u++) {
        if (NV == 2) store_pair(e, y, out_at + u * C + c, c, acc[0][u], acc[1][u], mode);
        else store_vector(e, y, out_at + u * C + c, c, acc[0][u], mode);
    }
}

static inline __attribute__((always_inline)) void block_vector(const qdw_plan *p, void *y,
                                                               const int16_t *const *tap_rows, long n, long oh,
                                                               long ow0, long cv, const int KH, const int KP,
                                                               const long PX, const long PP, const int count,
                                                               const int mode)
{
    const long out_at = ((n * p->OH + oh) * p->OW + ow0) * p->C;
    const epilogue e = epilogue_of(p);
    long c = 0;
    for (; c + 2 * LANES <= cv; c += 2 * LANES)
        block_channels(p, &e, y, tap_rows, out_at, ow0, c, 2, KH, KP, PX, PP, count, mode);
    if (c < cv) block_channels(p, &e, y, tap_rows, out_at, ow0, c, 1, KH, KP, PX, PP, count, mode);
}

/* the epilogue a layer runs (AVX2: on the words where the plan is bounded) */
static inline int mode_of(const qdw_plan *p)
{
    if (LANES != 8 || !p->bounded || p->out == OUT_F32) return ON_FLOATS;
    return p->clamp_words ? ON_WORDS_CLAMPED : ON_WORDS;
}

/* 3x3 at strides 1 and 2 (MobileNetV2's, EfficientNet's) with the taps and the epilogue known to the compiler (the
   loops unrolled), and their last OW mod U pixels; any other layer through the same code with its geometry read at
   run time. Stride 1: G = 1, pairs a pixel apart 1, tap pairs 2; stride 2: G = 2, 1 and 1 */
#define BLOCK_3x3(MODE, SW, PX, PP, COUNT)                                                                           \
    static void block_3x3_##MODE##_s##SW##_##COUNT(const qdw_plan *p, void *y, const int16_t *const *tap_rows,      \
                                                   long n, long oh, long ow0, long cv)                                \
    {                                                                                                                 \
        block_vector(p, y, tap_rows, n, oh, ow0, cv, 3, 2, PX, PP, COUNT, MODE);                                      \
    }
#define BLOCKS_OF(MODE)                                                                                              \
    BLOCK_3x3(MODE, 1, 1, 2, 4) BLOCK_3x3(MODE, 1, 1, 2, 3) BLOCK_3x3(MODE, 1, 1, 2, 2) BLOCK_3x3(MODE, 1, 1, 2, 1) \
    BLOCK_3x3(MODE, 2, 1, 1, 4) BLOCK_3x3(MODE, 2, 1, 1, 3) BLOCK_3x3(MODE, 2, 1, 1, 2) BLOCK_3x3(MODE, 2, 1, 1, 1)
BLOCKS_OF(ON_FLOATS)
#if LANES == 8
BLOCKS_OF(ON_WORDS)
BLOCKS_OF(ON_WORDS_CLAMPED)
#endif

typedef void (*block_fn)(const qdw_plan *, void *, const int16_t *const *, long, long, long, long);
#define TABLE_OF(MODE)                                                                                               \
    {{block_3x3_##MODE##_s1_1, block_3x3_##MODE##_s1_2, block_3x3_##MODE##_s1_3, block_3x3_##MODE##_s1_4},          \
     {block_3x3_##MODE##_s2_1, block_3x3_##MODE##_s2_2, block_3x3_##MODE##_s2_3, block_3x3_##MODE##_s2_4}}
static const block_fn BLOCKS_3x3[][2][U] = {
    TABLE_OF(ON_FLOATS),
#if LANES == 8
    TABLE_OF(ON_WORDS), TABLE_OF(ON_WORDS_CLAMPED),
#endif
};

static void block_any(const qdw_plan *p, void *y, const int16_t *const *tap_rows, long n, long oh, long ow0, long cv,
                      int count)
{
    block_vector(p, y, tap_rows, n, oh, ow0, cv, p->KH, p->KP, p->SW / p->G, 2 / p->G, count, ON_FLOATS);
}

static void row_pixels(const qdw_plan *p, void *y, const int16_t *const *tap_rows, long n, long oh)
{
    const long cv = p->C / LANES * LANES;
    if (cv > 0) {
        const int fixed = p->KH == 3 && p->KW == 3 && (p->SW == 1 || p->SW == 2), mode = mode_of(p);
        for (long ow = 0; ow < p->OW; ow += U) {
            const int count = p->OW - ow < U ? (int)(p->OW - ow) : U;
            if (fixed) BLOCKS_3x3[mode][p->SW - 1][count - 1](p, y, tap_rows, n, oh, ow, cv);
            else block_any(p, y, tap_rows, n, oh, ow, cv, count);
        }
    }
    if (cv < p->C) pixels_scalar(p, y, tap_rows, n, oh, 0, p->OW, cv); /* channels past the last vector */
}
#else
static void row_pixels(const qdw_plan *p, void *y, const int16_t *const *tap_rows, long n, long oh)
{
    pixels_scalar(p, y, tap_rows, n, oh, 0, p->OW, 0);
}
#endif

#if defined(__AVX2__)
/* 16 channels of a pair: interleave the two columns' bytes, extend each half to 8 int16 pairs */
static inline __attribute__((always_inline)) void pairs16(int16_t *d, __m128i xa, __m128i xb, int x_signed)
{
    const __m128i lo = _mm_unpacklo_epi8(xa, xb), hi = _mm_unpackhi_epi8(xa, xb);
    _mm256_storeu_si256((__m256i *)d, x_signed ? _mm256_cvtepi8_epi16(lo) : _mm256_cvtepu8_epi16(lo));
    _mm256_storeu_si256((__m256i *)(d + 16), x_signed ? _mm256_cvtepi8_epi16(hi) : _mm256_cvtepu8_epi16(hi));
}
#endif

/* channels [c, Cp) of one ring pair d from input columns a and b (zeros past C: zero weights there) */
static void pair_channels(const qdw_plan *p, int16_t *d, const uint8_t *a, const uint8_t *b, long c)
{
    const long C = p->C;
#if defined(__AVX2__)
    for (; c + 16 <= C; c += 16)
        pairs16(d + 2 * c, _mm_loadu_si128((const __m128i *)(a + c)), _mm_loadu_si128((const __m128i *)(b + c)),
                p->x_signed);
    for (; c + 8 <= C; c += 8) {
        const __m128i ab = _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)(a + c)),
                                             _mm_loadl_epi64((const __m128i *)(b + c)));
        _mm256_storeu_si256((__m256i *)(d + 2 * c), p->x_signed ? _mm256_cvtepi8_epi16(ab) : _mm256_cvtepu8_epi16(ab));
    }
#endif
    for (; c < C; c++) {
        d[2 * c] = p->x_signed ? (int16_t)(int8_t)a[c] : (int16_t)a[c];
        d[2 * c + 1] = p->x_signed ? (int16_t)(int8_t)b[c] : (int16_t)b[c];
    }
    for (; c < p->Cp; c++) d[2 * c] = d[2 * c + 1] = 0;
}

/* input row ih of image n into slot ih mod KH as int16 column pairs, z_x at padding columns, the whole row z_x above
   or below: pair m of channel c is (x[m·G][c], x[m·G + 1][c]). The pairs whose two columns are inside the row go
   with no bounds test; at stride 1 (G = 1) pair m's second column is pair m + 1's first: with few channels (a
   pair's work is short) each column is loaded once, the channel loop outside (MobileNetV2's 32-channel 112² layer:
   -10%; with more channels the pairs in order ran as fast or faster) */
#define NARROW 32
static void widen_row(const qdw_plan *p, const uint8_t *x, ring *g, long n, long ih)
{
    const long slot = ih % p->KH < 0 ? ih % p->KH + p->KH : ih % p->KH;
    if (g->held[slot][0] == n && g->held[slot][1] == ih) return;
    g->held[slot][0] = n;
    g->held[slot][1] = ih;
    const long C = p->C, Cp = p->Cp, G = p->G;
    int16_t *dst = g->rows + slot * p->M * Cp * 2;
    const int inside_row = ih >= 0 && ih < p->H;
    const uint8_t *src = inside_row ? x + (n * p->H + ih) * p->W * C : x;
    /* [first, last): the pairs with both columns inside (none in a padding row) */
    long first = (p->PL + G - 1) / G, last = (p->W - 2 + p->PL) / G + 1;
    if (!inside_row || p->W < 2) first = last = 0;
    if (last > p->M) last = p->M;
    if (first > last) first = last;
    for (long m = 0; m < p->M; m++) {
        if (m == first && first < last) m = last;  /* the inside pairs below */
        if (m >= p->M) break;
        const long iw = m * G - p->PL;  /* the pair's first input column */
        const uint8_t *a = inside_row && iw >= 0 && iw < p->W ? src + iw * C : p->padding;
        const uint8_t *b = inside_row && iw + 1 >= 0 && iw + 1 < p->W ? src + (iw + 1) * C : p->padding;
        pair_channels(p, dst + m * Cp * 2, a, b, 0);
    }
    if (first >= last) return;
    long c = 0;
#if defined(__AVX2__)
    if (G == 1 && C <= NARROW)  /* few channels: each column loaded once, the pairs inside the channel loop */
        for (; c + 16 <= C; c += 16) {
            const uint8_t *column = src + (first - p->PL) * C + c;
            int16_t *d = dst + first * Cp * 2 + 2 * c;
            __m128i xa = _mm_loadu_si128((const __m128i *)column);
            for (long m = first; m < last; m++, column += C, d += Cp * 2) {
                const __m128i xb = _mm_loadu_si128((const __m128i *)(column + C));
                pairs16(d, xa, xb, p->x_signed);
                xa = xb;
            }
        }
    else if (p->x_signed)  /* pair by pair, in order */
        for (long m = first; m < last; m++) {
            const uint8_t *a = src + (m * G - p->PL) * C;
            int16_t *d = dst + m * Cp * 2;
            for (long k = 0; k + 16 <= C; k += 16)
                pairs16(d + 2 * k, _mm_loadu_si128((const __m128i *)(a + k)),
                        _mm_loadu_si128((const __m128i *)(a + C + k)), 1);
        }
    else
        for (long m = first; m < last; m++) {
            const uint8_t *a = src + (m * G - p->PL) * C;
            int16_t *d = dst + m * Cp * 2;
            for (long k = 0; k + 16 <= C; k += 16)
                pairs16(d + 2 * k, _mm_loadu_si128((const __m128i *)(a + k)),
                        _mm_loadu_si128((const __m128i *)(a + C + k)), 0);
        }
    c = C / 16 * 16;
#endif
    if (c < Cp)  /* the channels past the last 16 */
        for (long m = first; m < last; m++) {
            const uint8_t *a = src + (m * G - p->PL) * C;
            pair_channels(p, dst + m * Cp * 2, a, a + C, c);
        }
}

/* output row (n, oh): its tap rows widened into the ring (those not held), then every pixel */
static void output_row(const qdw_plan *p, const uint8_t *x, void *y, ring *g, long n, long oh)
{
    const int16_t *tap_rows[MAX_KERNEL];
    for (int kh = 0; kh < p->KH; kh++) {
        const long ih = oh * p->SH - p->PT + kh;
        widen_row(p, x, g, n, ih);
        const long slot = ih % p->KH < 0 ? ih % p->KH + p->KH : ih % p->KH;
        tap_rows[kh] = g->rows + slot * p->M * p->Cp * 2;
    }
    row_pixels(p, y, tap_rows, n, oh);
}

/* get_handle for a plan whose x and y hold the addresses themselves: the layer's own per-call path
   (qdepthwise.py QDepthwiseConv.__call__), with no memory object to point at each call's tensors */
int kiln_qdepthwise_address(void *memory, void **handle)
{
    *handle = memory;
    return 0;
}

int kiln_qdepthwise_lanes(void *object, void *stream, int nargs, const void *args)
{
    (void)object; (void)stream; (void)nargs; (void)args;
#if defined(__AVX512F__) || defined(__AVX2__)
    return LANES;
#else
    return 1;
#endif
}

int kiln_qdepthwise(void *object, void *stream, int nargs, const void *args)
{
    (void)stream; (void)nargs; (void)args;
    const qdw_plan *p = (const qdw_plan *)object;
    void *xh = 0, *y = 0;
    if (p->get_handle(p->x, &xh) || !xh || p->get_handle(p->y, &y) || !y) return 2;
    const uint8_t *x = (const uint8_t *)xh;
    const long rows = p->N * p->OH;
#pragma omp parallel num_threads(p->threads) if (p->threads > 1)
    {
        const long team = omp_get_num_threads(), me = omp_get_thread_num();
        const long first = rows * me / team, last = rows * (me + 1) / team;  /* a run of output rows each */
        ring g = {p->rings + me * p->ring_elements, {{0}}};
        for (int k = 0; k < MAX_KERNEL; k++) g.held[k][0] = -1;
        for (long r = first; r < last; r++) output_row(p, x, y, &g, r / p->OH, r % p->OH);
    }
    return 0;
}
