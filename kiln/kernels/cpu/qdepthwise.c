/* kiln::QConv depthwise on 8-bit NHWC activations (kiln/kernels/cpu/qdepthwise.py): a KxK layer with one filter per
 * channel (K <= 8 a side, any stride and padding), the zero point, int32 bias, scale, Relu/Clip and the
 * requantization in the same pass, a member of native segments.
 *
 *     d    = x − z_x                                     per input value, exact in float32 (|d| <= 255)
 *     acc  = Σ_{kh, kw} d[n, oh·s − pt + kh, ow·s − pl + kw, c] · w[kh, kw, c]      padding taps add nothing
 *     t    = int32(acc) + bias[c]                        acc is an integer below 2^24 in magnitude: exact (below)
 *     r    = act(scale[c]·float(t))                      scale = x_scale·w_scale[c]
 *     y    = r (float32), or saturate(round_half_even(r·(1 / y_scale)) + y_zero) to uint8 / int8 (the multiply by
 *            the float32 reciprocal of i8gemm.c and oneDNN's requantize: at a tie it may round a step from ONNX's
 *            division)
 *
 * Exact: each product |d·w| <= 255·128 = 32640 and a layer has at most 64 taps, so every partial sum is an integer
 * below 2^21 < 2^24: float32 FMAs add them with no rounding, whatever the weights (no vpmaddubsw pair bound here).
 * The bias joins in int32, as i8gemm.c's offset does (qdepthwise.py refuses a bias that could pass int32).
 *
 * Why float products of 8-bit values: NHWC puts a pixel's channels side by side, and a depthwise layer sums over
 * taps, not channels: vpmaddubsw's adjacent-byte pairs would be pairs of channels. Widening a vector of 8 (16 under
 * AVX-512) bytes to float32 costs a load-and-extend and a convert, then the FMAs run as the float kernel's
 * (depthwise.c) on a quarter of its input bytes. Each input vector is widened once per output block and tap row
 * and meets every tap of that row that reads it: a block of U output pixels reads (U − 1)·s + KW input columns.
 * oneDNN's int8 depthwise ran 1.27-1.89x its float one on Zen 3 (bench/results/quant-cpu-2026-12-07.md).
 *
 * Layout: the weights as float32 [KH][KW][Cp], bias (int32) and scale (float32) as [Cp] (Cp: C rounded up to the
 * vector width, zeros past C); a scalar loop takes the channels past the last whole vector. Threads over output rows.
 * Returns 0, or 2 (oneDNN's "invalid arguments") when an operand is not bound: the segment names the layer. */
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
    const int32_t *bias;          /* [Cp] */
    const float *scale;           /* [Cp] */
    long N, C, Cp, H, W, OH, OW;
    int KH, KW, SH, SW, PT, PL;
    int x_signed;                 /* int8 source (else uint8) */
    float x_zero;
    int activation;
    float alpha, beta;            /* Clip's min and max */
    int out;                      /* OUT_* */
    float y_scale;
    int y_zero;
    int threads;                  /* 1: no parallel region */
} qdw_plan;

#define MAX_SPAN 32  /* input columns of one block: (U − 1)·SW + KW <= 3·8 + 8 */
#define U 4          /* output pixels of a block */

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

static inline float input_scalar(const qdw_plan *p, const uint8_t *at)
{
    return (p->x_signed ? (float)*(const int8_t *)at : (float)*at) - p->x_zero;
}

/* channels [c0, C) of output pixels [ow0, ow0 + count) of row (n, oh), one channel at a time */
static void block_scalar(const qdw_plan *p, const uint8_t *x, void *y, long n, long oh, long ow0, long count,
                         long c0)
{
    for (long u = 0; u < count; u++) {
        const long ow = ow0 + u;
        for (long c = c0; c < p->C; c++) {
            float acc = 0.0f;
            for (int kh = 0; kh < p->KH; kh++) {
                const long ih = oh * p->SH - p->PT + kh;
                if (ih < 0 || ih >= p->H) continue;
                for (int kw = 0; kw < p->KW; kw++) {
                    const long iw = ow * p->SW - p->PL + kw;
                    if (iw < 0 || iw >= p->W) continue;
                    acc += input_scalar(p, x + ((n * p->H + ih) * p->W + iw) * p->C + c) *
                           p->w[(kh * p->KW + kw) * p->Cp + c];
                }
            }
            store_scalar(p, y, ((n * p->OH + oh) * p->OW + ow) * p->C + c, c, acc);
        }
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
#define VSUB(a, b) _mm512_sub_ps(a, b)
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
/* int32 lanes already within the output's 8-bit range to bytes: the low byte of each (truncation) */
#define STORE_BYTES(a, v, is_unsigned) _mm_storeu_si128((__m128i *)(a), _mm512_cvtepi32_epi8(v))
#define IMAX(a, b) _mm512_max_epi32(a, b)
#define IMIN(a, b) _mm512_min_epi32(a, b)
#else
#define LANES 8
typedef __m256 vf;
typedef __m256i vi;
#define VZERO() _mm256_setzero_ps()
#define VSET(v) _mm256_set1_ps(v)
#define VLOAD(a) _mm256_loadu_ps(a)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VMUL(a, b) _mm256_mul_ps(a, b)
#define VSUB(a, b) _mm256_sub_ps(a, b)
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
/* int32 lanes already within the output's 8-bit range to bytes: packs exact at every step */
static inline __attribute__((always_inline)) void store_bytes8(void *a, __m256i v, int is_unsigned)
{
    const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    _mm_storel_epi64((__m128i *)a, is_unsigned ? _mm_packus_epi16(words, words) : _mm_packs_epi16(words, words));
}
#define STORE_BYTES(a, v, is_unsigned) store_bytes8(a, v, is_unsigned)
#define IMAX(a, b) _mm256_max_epi32(a, b)
#define IMIN(a, b) _mm256_min_epi32(a, b)
#endif

/* one channel vector's acc of an output pixel through the epilogue to y at `at` (elements) */
static inline __attribute__((always_inline)) void store_vector(const qdw_plan *p, void *y, long at, long c,
                                                               vf acc)
{
    const vi t = IADD(TO_INT(acc), ILOAD(p->bias + c)); /* acc is an integer: converted exactly */
    vf r = VMUL(TO_FLOAT(t), VLOAD(p->scale + c));
    if (p->activation == ACT_RELU) r = VMAX(r, VZERO());
    else if (p->activation == ACT_CLIP) r = VMIN(VMAX(r, VSET(p->alpha)), VSET(p->beta));
    if (p->out == OUT_F32) { VSTORE((float *)y + at, r); return; }
    vf q = VMUL(r, VSET(1.0f / p->y_scale));
    q = VMIN(VMAX(q, VSET(-1e9f)), VSET(1e9f)); /* NaN -> -1e9 (max returns its second operand) */
    vi v = IADD(TO_INT(q), ISET(p->y_zero));
    const int lo = p->out == OUT_U8 ? 0 : -128, hi = p->out == OUT_U8 ? 255 : 127;
    v = IMIN(IMAX(v, ISET(lo)), ISET(hi));
    STORE_BYTES((uint8_t *)y + at, v, p->out == OUT_U8);
}

/* `count` (<= U) output pixels from ow0, channels [c, c + LANES): each input column of a tap row widened once,
   then every tap of that row that reads it */
static inline __attribute__((always_inline)) void block_vector(const qdw_plan *p, const uint8_t *x, void *y, long n,
                                                               long oh, long ow0, long c, const int KW, const int SW,
                                                               const int count)
{
    const int span = (count - 1) * SW + KW;
    vf acc[U];
    for (int u = 0; u < count; u++) acc[u] = VZERO();
    const vf zero_point = VSET(p->x_zero);
    const long iw0 = ow0 * SW - p->PL;
    for (int kh = 0; kh < p->KH; kh++) {
        const long ih = oh * p->SH - p->PT + kh;
        if (ih < 0 || ih >= p->H) continue; /* a padding row adds nothing */
        const uint8_t *row = x + ((n * p->H + ih) * p->W) * p->C + c;
        vf d[MAX_SPAN];
        for (int j = 0; j < span; j++) {
            const long iw = iw0 + j;
            if (iw < 0 || iw >= p->W) { d[j] = VZERO(); continue; } /* padding: d = 0 */
            d[j] = VSUB(p->x_signed ? BYTES_S(row + iw * p->C) : BYTES_U(row + iw * p->C), zero_point);
        }
        const float *wk = p->w + (long)kh * KW * p->Cp + c;
        for (int kw = 0; kw < KW; kw++) {
            const vf wv = VLOAD(wk + kw * p->Cp);
            for (int u = 0; u < count; u++) acc[u] = VFMA(d[u * SW + kw], wv, acc[u]);
        }
    }
    for (int u = 0; u < count; u++)
        store_vector(p, y, ((n * p->OH + oh) * p->OW + ow0 + u) * p->C + c, c, acc[u]);
}

/* 3x3 at strides 1 and 2 (MobileNetV2's, EfficientNet's) with the span and taps known to the compiler: the loops
   unrolled, d[] and the accumulators in registers (6 + 4 at stride 1, 9 + 4 at 2, of AVX2's 16); any other layer
   through the same code with its geometry read at run time */
static void block_3x3_s1(const qdw_plan *p, const uint8_t *x, void *y, long n, long oh, long ow0, long c)
{
    block_vector(p, x, y, n, oh, ow0, c, 3, 1, U);
}

static void block_3x3_s2(const qdw_plan *p, const uint8_t *x, void *y, long n, long oh, long ow0, long c)
{
    block_vector(p, x, y, n, oh, ow0, c, 3, 2, U);
}

static void block_any(const qdw_plan *p, const uint8_t *x, void *y, long n, long oh, long ow0, long c)
{
    block_vector(p, x, y, n, oh, ow0, c, p->KW, p->SW, U);
}

/* the row's last OW mod U pixels */
static void block_tail(const qdw_plan *p, const uint8_t *x, void *y, long n, long oh, long ow0, long c, int count)
{
    block_vector(p, x, y, n, oh, ow0, c, p->KW, p->SW, count);
}

static void row_vector(const qdw_plan *p, const uint8_t *x, void *y, long n, long oh, long cv)
{
    void (*block)(const qdw_plan *, const uint8_t *, void *, long, long, long, long) =
        p->KW == 3 && p->SW == 1 ? block_3x3_s1 : (p->KW == 3 && p->SW == 2 ? block_3x3_s2 : block_any);
    long ow = 0;
    for (; ow + U <= p->OW; ow += U)
        for (long c = 0; c < cv; c += LANES) block(p, x, y, n, oh, ow, c);
    if (ow < p->OW)
        for (long c = 0; c < cv; c += LANES) block_tail(p, x, y, n, oh, ow, c, (int)(p->OW - ow));
}
#endif

static void row(const qdw_plan *p, const uint8_t *x, void *y, long r)
{
    const long n = r / p->OH, oh = r % p->OH;
#if defined(__AVX512F__) || defined(__AVX2__)
    const long cv = p->C / LANES * LANES;
    if (cv > 0 && (U - 1) * p->SW + p->KW <= MAX_SPAN) {
        row_vector(p, x, y, n, oh, cv);
        if (cv < p->C) block_scalar(p, x, y, n, oh, 0, p->OW, cv); /* channels past the last vector */
        return;
    }
#endif
    block_scalar(p, x, y, n, oh, 0, p->OW, 0);
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
#pragma omp parallel for schedule(static) num_threads(p->threads) if (p->threads > 1)
    for (long r = 0; r < rows; r++) row(p, x, y, r);
    return 0;
}
