/* kiln::QConv depthwise on 8-bit NHWC activations (kiln/kernels/cpu/qdepthwise.py): a KxK layer with one filter per
 * channel (K <= 8 a side, any stride and padding), the zero point, int32 bias, scale, Relu/Clip and the
 * requantization in the same pass, a member of native segments.
 *
 *     acc  = Σ_{kh, kw} x[n, oh·s − pt + kh, ow·s − pl + kw, c] · w[kh, kw, c]      a padding tap reads z_x
 *     t    = int32(acc) + bias[c]                        bias = the layer's − z_x·Σ_{kh, kw} w[kh, kw, c] (int32,
 *                                                        qdepthwise.py): t = Σ (x − z_x)·w + the layer's bias,
 *                                                        acc an integer below 2^24 in magnitude: exact (below);
 *                                                        where every |bias| + the sums' bound < 2^24 (`float_bias`,
 *                                                        most layers) acc starts at the bias instead: t = acc, exact
 *     r    = act(scale[c]·float(t))                      scale = x_scale·w_scale[c]
 *     y    = r (float32), or saturate(round_half_even(r·(1 / y_scale)) + y_zero) to uint8 / int8 (the multiply by
 *            the float32 reciprocal of i8gemm.c and oneDNN's requantize: at a tie it may round a step from ONNX's
 *            division)
 *
 * Exact: each product |x·w| <= 255·128 = 32640 (int8 sources: 128·128) and a layer has at most 64 taps, so every
 * partial sum is an integer below 2^21 < 2^24: float32 FMAs add them with no rounding, whatever the weights (no
 * vpmaddubsw pair bound here).
 *
 * Why float products of 8-bit values: NHWC puts a pixel's channels side by side, and a depthwise layer sums over
 * taps, not channels: vpmaddubsw's adjacent-byte pairs would be pairs of channels. So each input row is widened to
 * float32 once (a load-and-extend and a convert per vector of 8 bytes, 16 under AVX-512), into a ring of KH rows per
 * thread with its padding columns and rows written as z_x, and the taps run as the float kernel's (depthwise.c) do on
 * that ring, with no bounds test: a block of U output pixels per channel vector, U accumulators, each ring column and
 * tap weight vector of a tap row loaded once for the block. Widening in the tap loop instead (each input vector
 * widened once per block and tap row) ran 1.0-1.2x oneDNN's int8 layer, the ring 0.7-1.0x at stride 1 and 0.9-1.26x at
 * stride 2 (bench/results/int8-mnv2-avx2-2026-12-07.md); oneDNN's int8 depthwise itself ran 1.27-1.89x its float one
 * on Zen 3 (bench/results/quant-cpu-2026-12-07.md).
 *
 * Layout: the weights as float32 [KH][KW][Cp], bias (int32) and scale (float32) as [Cp] (Cp: C rounded up to the
 * vector width, zeros past C); a ring row is [(OW − 1)·SW + KW][Cp] floats; a scalar loop takes the channels past
 * the last whole vector. Threads over runs of output rows, each with its ring (the plan's, allocated with it by
 * qdepthwise.py: ~40-110 KB at MobileNetV2's layers). Returns 0, or 2 (oneDNN's "invalid arguments") when an operand
 * is not bound: the segment names the layer. */
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
    const float *w;               /* [KH][KW][Cp] */
    const int32_t *bias;          /* [Cp]: the layer's bias − z_x·Σ w */
    const float *bias_float;      /* [Cp]: the same as floats (exact where float_bias) */
    const float *scale;           /* [Cp] */
    long N, C, Cp, H, W, OH, OW;
    int KH, KW, SH, SW, PT, PL;
    int float_bias;               /* acc starts at bias_float: t = acc (every partial sum below 2^24) */
    int x_signed;                 /* int8 source (else uint8) */
    float x_zero;
    int activation;
    float alpha, beta;            /* Clip's min and max */
    int out;                      /* OUT_* */
    float y_scale;
    int y_zero;
    int threads;                  /* 1: no parallel region */
    float *rings;                 /* [threads][ring_floats]: each thread's ring (qdepthwise.py's, per plan) */
    long ring_floats;             /* KH·((OW − 1)·SW + KW)·Cp */
} qdw_plan;

#define U 4           /* output pixels of a block */
#define MAX_KERNEL 8  /* taps a side (qdepthwise.py MAX_KERNEL) */

/* a thread's ring: KH widened input rows, row ih in slot ih mod KH (a row's KH tap rows are consecutive) */
typedef struct {
    float *rows;     /* [KH][Wb][Cp] */
    long Wb;         /* (OW − 1)·SW + KW columns: input column j − PL */
    long held[MAX_KERNEL][2];  /* (n, ih) each slot holds; n = −1: none */
} ring;

static inline float act_scalar(const qdw_plan *p, float r)
{
    if (p->activation == ACT_RELU) return r > 0.0f ? r : 0.0f;
    if (p->activation == ACT_CLIP) return r < p->alpha ? p->alpha : (r > p->beta ? p->beta : r);
    return r;
}

static inline void store_scalar(const qdw_plan *p, void *y, long at, long c, float acc)
{
    const int32_t t = (int32_t)acc + p->bias[c];
    const float r = act_scalar(p, p->scale[c] * (float)t);
    if (p->out == OUT_F32) { ((float *)y)[at] = r; return; }
    float q = r * (1.0f / p->y_scale);
    q = q != q ? -1e9f : (q < -1e9f ? -1e9f : (q > 1e9f ? 1e9f : q));
    long v = (long)__builtin_rintf(q) + p->y_zero;
    if (p->out == OUT_U8) ((uint8_t *)y)[at] = (uint8_t)(v < 0 ? 0 : (v > 255 ? 255 : v));
    else ((int8_t *)y)[at] = (int8_t)(v < -128 ? -128 : (v > 127 ? 127 : v));
}

/* channels [c0, C) of output pixels [ow0, ow0 + count) of row (n, oh), one at a time, from the ring */
static void pixels_scalar(const qdw_plan *p, void *y, const float *const *tap_rows, long n, long oh, long ow0,
                          long count, long c0)
{
    for (long ow = ow0; ow < ow0 + count; ow++)
        for (long c = c0; c < p->C; c++) {
            float acc = 0.0f;
            for (int kh = 0; kh < p->KH; kh++)
                for (int kw = 0; kw < p->KW; kw++)
                    acc += tap_rows[kh][(ow * p->SW + kw) * p->Cp + c] * p->w[(kh * p->KW + kw) * p->Cp + c];
            store_scalar(p, y, ((n * p->OH + oh) * p->OW + ow) * p->C + c, c, acc); /* the int32 bias added after */
        }
}

#if defined(__AVX512F__) || defined(__AVX2__)
#if defined(__AVX512F__)
#define LANES 16
typedef __m512 vf;
typedef __m512i vi;
#define VZERO() _mm512_setzero_ps()
#define VSET(v) _mm512_set1_ps(v)
#define VLOAD(a) _mm512_loadu_ps(a)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VMUL(a, b) _mm512_mul_ps(a, b)
#define VMIN(a, b) _mm512_min_ps(a, b)
#define VMAX(a, b) _mm512_max_ps(a, b)
#define VSTORE(a, v) _mm512_storeu_ps(a, v)
#define TO_INT(v) _mm512_cvtps_epi32(v) /* round half to even (MXCSR's default) */
#define TO_FLOAT(v) _mm512_cvtepi32_ps(v)
#define IADD(a, b) _mm512_add_epi32(a, b)
#define ILOAD(a) _mm512_loadu_si512(a)
#define ISET(v) _mm512_set1_epi32(v)
#define BYTES_U(a) _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(a))))
#define BYTES_S(a) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(a))))
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
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VMUL(a, b) _mm256_mul_ps(a, b)
#define VMIN(a, b) _mm256_min_ps(a, b)
#define VMAX(a, b) _mm256_max_ps(a, b)
#define VSTORE(a, v) _mm256_storeu_ps(a, v)
#define TO_INT(v) _mm256_cvtps_epi32(v)
#define TO_FLOAT(v) _mm256_cvtepi32_ps(v)
#define IADD(a, b) _mm256_add_epi32(a, b)
#define ILOAD(a) _mm256_loadu_si256((const __m256i *)(a))
#define ISET(v) _mm256_set1_epi32(v)
#define BYTES_U(a) _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(a))))
#define BYTES_S(a) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(a))))
/* int32 lanes to bytes, saturated to uint8 or int8 (through int16: saturating at every step) */
static inline __attribute__((always_inline)) void store_bytes8(void *a, __m256i v, int is_unsigned)
{
    const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    _mm_storel_epi64((__m128i *)a, is_unsigned ? _mm_packus_epi16(words, words) : _mm_packs_epi16(words, words));
}
#define STORE_BYTES(a, v, is_unsigned) store_bytes8(a, v, is_unsigned)
#endif

/* the epilogue's constants, read from the plan once per block (a byte store may alias the plan: the compiler would
   read them again after every store) */
typedef struct {
    const int32_t *bias;
    const float *scale;
    vf alpha, beta, inverse;
    vi y_zero;
    int activation, out, float_bias;
} epilogue;

static inline __attribute__((always_inline)) epilogue epilogue_of(const qdw_plan *p)
{
    epilogue e = {p->bias, p->scale, VSET(p->alpha), VSET(p->beta), VSET(1.0f / p->y_scale), ISET(p->y_zero),
                  p->activation, p->out, p->float_bias};
    return e;
}

/* one channel vector's acc of an output pixel through the epilogue to y at `at` (elements) */
static inline __attribute__((always_inline)) void store_vector(const epilogue *e, void *y, long at, long c, vf acc)
{
    /* acc is an integer: t = acc (the bias in it) or int32(acc) + bias, exactly */
    vf r = VMUL(e->float_bias ? acc : TO_FLOAT(IADD(TO_INT(acc), ILOAD(e->bias + c))), VLOAD(e->scale + c));
    if (e->activation == ACT_RELU) r = VMAX(r, VZERO());
    else if (e->activation == ACT_CLIP) r = VMIN(VMAX(r, e->alpha), e->beta);
    if (e->out == OUT_F32) { VSTORE((float *)y + at, r); return; }
    vf q = VMUL(r, e->inverse);
    if (e->activation != ACT_CLIP) q = VMIN(VMAX(q, VSET(-1e9f)), VSET(1e9f)); /* within int32 (Clip's is) */
    STORE_BYTES((uint8_t *)y + at, IADD(TO_INT(q), e->y_zero), e->out == OUT_U8); /* saturating */
}

/* `count` (<= U) output pixels from ow0 of row (n, oh), channels [0, cv) a vector at a time, from the ring's tap
   rows: `count` accumulators; per tap row its (count − 1)·SW + KW columns and each tap's weight loaded once */
static inline __attribute__((always_inline)) void block_vector(const qdw_plan *p, void *y,
                                                               const float *const *tap_rows, long n, long oh, long ow0,
                                                               long cv, const int KH, const int KW, const int SW,
                                                               const int count)
{
    const long C = p->C, Cp = p->Cp;
    const long out_at = ((n * p->OH + oh) * p->OW + ow0) * C;
    const epilogue e = epilogue_of(p);
    for (long c = 0; c < cv; c += LANES) {
        const vf start = e.float_bias ? VLOAD(p->bias_float + c) : VZERO();
        vf acc[U];
        for (int u = 0; u < count; u++) acc[u] = start;
        for (int kh = 0; kh < KH; kh++) {
            const float *src = tap_rows[kh] + ow0 * SW * Cp + c;
            const float *wk = p->w + (long)kh * KW * Cp + c;
            vf d[(U - 1) * MAX_KERNEL + MAX_KERNEL]; /* the row's (count − 1)·SW + KW columns, each loaded once */
            for (int j = 0; j < (count - 1) * SW + KW; j++) d[j] = VLOAD(src + j * Cp);
            for (int kw = 0; kw < KW; kw++) {
                const vf wv = VLOAD(wk + kw * Cp);
                for (int u = 0; u < count; u++) acc[u] = VFMA(d[u * SW + kw], wv, acc[u]);
            }
        }
        for (int u = 0; u < count; u++) store_vector(&e, y, out_at + u * C + c, c, acc[u]);
    }
}

/* 3x3 at strides 1 and 2 (MobileNetV2's, EfficientNet's) with the taps known to the compiler (the loops unrolled),
   and their last OW mod U pixels; any other layer through the same code with its geometry read at run time */
#define BLOCK_3x3(SW, COUNT)                                                                                         \
    static void block_3x3_s##SW##_##COUNT(const qdw_plan *p, void *y, const float *const *tap_rows, long n, long oh, \
                                          long ow0, long cv)                                                          \
    {                                                                                                                 \
        block_vector(p, y, tap_rows, n, oh, ow0, cv, 3, 3, SW, COUNT);                                                \
    }
BLOCK_3x3(1, 4) BLOCK_3x3(1, 3) BLOCK_3x3(1, 2) BLOCK_3x3(1, 1)
BLOCK_3x3(2, 4) BLOCK_3x3(2, 3) BLOCK_3x3(2, 2) BLOCK_3x3(2, 1)

typedef void (*block_fn)(const qdw_plan *, void *, const float *const *, long, long, long, long);
static const block_fn BLOCKS_3x3[2][U] = {
    {block_3x3_s1_1, block_3x3_s1_2, block_3x3_s1_3, block_3x3_s1_4},
    {block_3x3_s2_1, block_3x3_s2_2, block_3x3_s2_3, block_3x3_s2_4}};

static void block_any(const qdw_plan *p, void *y, const float *const *tap_rows, long n, long oh, long ow0, long cv,
                      int count)
{
    block_vector(p, y, tap_rows, n, oh, ow0, cv, p->KH, p->KW, p->SW, count);
}

static void row_pixels(const qdw_plan *p, void *y, const float *const *tap_rows, long n, long oh)
{
    const long cv = p->C / LANES * LANES;
    if (cv > 0) {
        const int fixed = p->KH == 3 && p->KW == 3 && (p->SW == 1 || p->SW == 2);
        for (long ow = 0; ow < p->OW; ow += U) {
            const int count = p->OW - ow < U ? (int)(p->OW - ow) : U;
            if (fixed) BLOCKS_3x3[p->SW - 1][count - 1](p, y, tap_rows, n, oh, ow, cv);
            else block_any(p, y, tap_rows, n, oh, ow, cv, count);
        }
    }
    if (cv < p->C) pixels_scalar(p, y, tap_rows, n, oh, 0, p->OW, cv); /* channels past the last vector */
}
#else
static void row_pixels(const qdw_plan *p, void *y, const float *const *tap_rows, long n, long oh)
{
    pixels_scalar(p, y, tap_rows, n, oh, 0, p->OW, 0);
}
#endif

/* input row ih of image n into slot ih mod KH as floats, z_x at padding columns, the whole row z_x above or below */
static void widen_row(const qdw_plan *p, const uint8_t *x, ring *g, long n, long ih)
{
    const long slot = ih % p->KH < 0 ? ih % p->KH + p->KH : ih % p->KH;
    if (g->held[slot][0] == n && g->held[slot][1] == ih) return;
    g->held[slot][0] = n;
    g->held[slot][1] = ih;
    const long C = p->C, Cp = p->Cp;
    float *dst = g->rows + slot * g->Wb * Cp;
    const int inside_row = ih >= 0 && ih < p->H;
    const uint8_t *src = inside_row ? x + (n * p->H + ih) * p->W * C : x;
    for (long j = 0; j < g->Wb; j++) {
        const long iw = j - p->PL;
        float *d = dst + j * Cp;
        if (!inside_row || iw < 0 || iw >= p->W) {
            for (long c = 0; c < Cp; c++) d[c] = p->x_zero;
            continue;
        }
        const uint8_t *s = src + iw * C;
        long c = 0;
#if defined(__AVX512F__) || defined(__AVX2__)
        if (p->x_signed)
            for (; c + LANES <= C; c += LANES) VSTORE(d + c, BYTES_S(s + c));
        else
            for (; c + LANES <= C; c += LANES) VSTORE(d + c, BYTES_U(s + c));
#endif
        for (; c < C; c++) d[c] = p->x_signed ? (float)((const int8_t *)s)[c] : (float)s[c];
        for (; c < Cp; c++) d[c] = 0.0f;  /* past C: zero weights there */
    }
}

/* output row (n, oh): its tap rows widened into the ring (those not held), then every pixel */
static void output_row(const qdw_plan *p, const uint8_t *x, void *y, ring *g, long n, long oh)
{
    const float *tap_rows[MAX_KERNEL];
    for (int kh = 0; kh < p->KH; kh++) {
        const long ih = oh * p->SH - p->PT + kh;
        widen_row(p, x, g, n, ih);
        const long slot = ih % p->KH < 0 ? ih % p->KH + p->KH : ih % p->KH;
        tap_rows[kh] = g->rows + slot * g->Wb * p->Cp;
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
    const long rows = p->N * p->OH, Wb = (p->OW - 1) * p->SW + p->KW;
#pragma omp parallel num_threads(p->threads) if (p->threads > 1)
    {
        const long team = omp_get_num_threads(), me = omp_get_thread_num();
        const long first = rows * me / team, last = rows * (me + 1) / team;  /* a run of output rows each */
        ring g = {p->rings + me * p->ring_floats, Wb, {{0}}};
        for (int k = 0; k < MAX_KERNEL; k++) g.held[k][0] = -1;
        for (long r = first; r < last; r++) output_row(p, x, y, &g, r / p->OH, r % p->OH);
    }
    return 0;
}
