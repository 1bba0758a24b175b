/* A W8A16 pointwise (1x1, stride 1) convolution in one pass (kiln/kernels/cpu/w16gemm.py): float32 NHWC rows
 * quantized to 16 bits as they are read, times int8 weights widened to int16, summed in int32, and the layer's
 * epilogue (per-channel scale, bias, Relu/Clip, float32 out or requantized to uint8/int8) on the accumulators.
 *
 *     q   = saturate(round_half_even(x / x_scale), low, high)           ONNX QuantizeLinear to int16 / uint16
 *     a   = q - offset                                                   int16 (uint16: offset 32768, else 0)
 *     acc = Σ_k a[m, k]·w[o, k]                                          int32, exact (chunks below)
 *     r   = scale[o]·acc + bias[o]                                       scale = x_scale·w_scale[o]; bias: the
 *                                                                        real bias + scale·offset·Σ_k w[o, k]
 *     y   = act(r), or saturate(round_half_even(act(r)·(1 / y_scale)) + y_zero) to uint8 / int8 (a multiply by the
 *           float32 reciprocal, as oneDNN's requantize: at a tie it may round a step from ONNX's division)
 *
 * Why: the split path (split16.c + two oneDNN int8 convolutions) reads the input once, writes two byte tensors,
 * runs two convolutions (the second re-reading and re-writing the float output); this reads the float input once
 * and writes the output once. The int16 products: AVX-512 `vpdpwssd` (VNNI; vpmaddwd + vpaddd on AVX-512 without
 * it), AVX2 vpmaddwd + vpaddd, else plain C: whatever the compiler was told this CPU has (native_loop compiles
 * with -march=native, x86-64-v3 under KILN_CPU_ISA=avx2).
 *
 * Exact int32: |a| <= 32768 and |w| <= 127, so a chunk of k whose Σ|w[o, k]| <= 65535 cannot pass 2^31 in any
 * channel; w16gemm.py picks `kc` (pairs of k per chunk) so (the whole K where the weight allows, else 256 pairs:
 * 512·127·32768 < 2^31). Chunks past the first are summed in float32 (as the split path's two convolutions are).
 *
 * Layout: the weight packed by kiln_w16_pack as [O/LANES][K/2][LANES][2] int16 (zeros past O and past an odd K),
 * so one vector load gives LANES channels' pair at k-pair p, and one 32-bit broadcast a row's pair: vpdpwssd adds
 * both products to each channel's int32. A thread takes RB rows at a time, quantizes them into its own int16 block
 * (the float input read once) and runs every output channel on it in MR x NV·LANES register tiles. */
#include <stdint.h>
#include <string.h>
#if defined(__AVX512BW__) || defined(__AVX2__)
#include <immintrin.h>
#endif

typedef int (*get_handle_fn)(void *memory, void **handle);

enum { ACT_NONE = 0, ACT_RELU = 1, ACT_CLIP = 4 };  /* se.c's numbering */
enum { OUT_F32 = 0, OUT_U8 = 1, OUT_S8 = 2, OUT_S32 = 3 };  /* OUT_S32: the raw accumulators (tests) */

typedef struct {
    get_handle_fn get_handle;
    void *x, *y;              /* dnnl_memory_t: float32 [M, K] (NHWC), output [M, O] */
    const int16_t *w;         /* kiln_w16_pack's */
    const float *scale, *bias;/* [Op] */
    long M, K, O, kc;         /* rows, input channels, output channels, k pairs per exact chunk */
    float x_scale;
    long low, high, offset;   /* the 16-bit type's bounds; what is subtracted to make it int16 */
    int activation;
    float alpha, beta;        /* Clip's bounds */
    int out;                  /* OUT_* */
    float y_scale;
    long y_zero;
    int threads;
} w16_plan;

#if defined(__AVX512BW__) && !defined(KILN_MAX_ISA_AVX2)
#define LANES 16
#define ISA_NAME 512
typedef __m512i vi;
typedef __m512 vf;
#if defined(__AVX512VNNI__)
#define DOT(acc, a, b) _mm512_dpwssd_epi32(acc, a, b)
#undef ISA_NAME
#define ISA_NAME 513
#else
#define DOT(acc, a, b) _mm512_add_epi32(acc, _mm512_madd_epi16(a, b))
#endif
#define VZERO() _mm512_setzero_si512()
#define VBCAST(p) _mm512_set1_epi32(*(const int32_t *)(p))
#define VLOAD(p) _mm512_loadu_si512((const void *)(p))
#define VCVT(a) _mm512_cvtepi32_ps(a)
#define FLOAD(p) _mm512_loadu_ps(p)
#define FSET(v) _mm512_set1_ps(v)
#define FMADD(a, b, c) _mm512_fmadd_ps(a, b, c)
#define FADD(a, b) _mm512_add_ps(a, b)
#define FMIN(a, b) _mm512_min_ps(a, b)
#define FMAX(a, b) _mm512_max_ps(a, b)
#define FMUL(a, b) _mm512_mul_ps(a, b)
#define FSTORE(p, v) _mm512_storeu_ps(p, v)
#define ISTORE(p, v) _mm512_storeu_si512((void *)(p), v)
#define FROUND_I(v) _mm512_cvtps_epi32(v)  /* the default rounding: to nearest, ties to even */
#define IADD(a, b) _mm512_add_epi32(a, b)
#define IMIN(a, b) _mm512_min_epi32(a, b)
#define IMAX(a, b) _mm512_max_epi32(a, b)
#define ISET(v) _mm512_set1_epi32(v)
#define RB 12
#elif defined(__AVX2__)
#define LANES 8
#define ISA_NAME 2
typedef __m256i vi;
typedef __m256 vf;
#define DOT(acc, a, b) _mm256_add_epi32(acc, _mm256_madd_epi16(a, b))
#define VZERO() _mm256_setzero_si256()
#define VBCAST(p) _mm256_set1_epi32(*(const int32_t *)(p))
#define VLOAD(p) _mm256_loadu_si256((const __m256i *)(p))
#define VCVT(a) _mm256_cvtepi32_ps(a)
#define FLOAD(p) _mm256_loadu_ps(p)
#define FSET(v) _mm256_set1_ps(v)
#define FMADD(a, b, c) _mm256_fmadd_ps(a, b, c)
#define FADD(a, b) _mm256_add_ps(a, b)
#define FMIN(a, b) _mm256_min_ps(a, b)
#define FMAX(a, b) _mm256_max_ps(a, b)
#define FMUL(a, b) _mm256_mul_ps(a, b)
#define FSTORE(p, v) _mm256_storeu_ps(p, v)
#define ISTORE(p, v) _mm256_storeu_si256((__m256i *)(p), v)
#define FROUND_I(v) _mm256_cvtps_epi32(v)
#define IADD(a, b) _mm256_add_epi32(a, b)
#define IMIN(a, b) _mm256_min_epi32(a, b)
#define IMAX(a, b) _mm256_max_epi32(a, b)
#define ISET(v) _mm256_set1_epi32(v)
#define RB 12
#else
#define LANES 8
#define ISA_NAME 0
#define RB 4
#endif

int kiln_w16_lanes(void) { return LANES; }
/* which products the library was compiled for: 513 AVX-512 VNNI vpdpwssd, 512 AVX-512BW vpmaddwd, 2 AVX2, 0 C */
int kiln_w16_isa(void) { return ISA_NAME; }

/* w int8 [O][K] -> [ceil(O/LANES)][ceil(K/2)][LANES][2] int16, zeros past O and K */
void kiln_w16_pack(const int8_t *w, int16_t *out, long O, long K)
{
    long K2 = (K + 1) / 2, blocks = (O + LANES - 1) / LANES;
    memset(out, 0, sizeof(int16_t) * blocks * K2 * LANES * 2);
    for (long o = 0; o < O; o++)
        for (long k = 0; k < K; k++)
            out[(((o / LANES) * K2 + k / 2) * LANES + o % LANES) * 2 + k % 2] = w[o * K + k];
}

/* rows [m0, m0 + rows) of x quantized into a (RB rows of K2·2 int16, zeros past K and past the rows) */
static void quantize_rows(const w16_plan *p, const float *x, long m0, long rows, int16_t *a, long K2)
{
    const float magic = 12582912.0f; /* 1.5·2^23: (v + magic) - magic rounds half to even for |v| < 2^22 */
    const float below = (float)p->low, above = (float)p->high, shift = (float)p->offset, s = p->x_scale;
    const long K = p->K;
    for (long r = 0; r < RB; r++) {
        int16_t *row = a + r * K2 * 2;
        if (r >= rows) {
            memset(row, 0, sizeof(int16_t) * K2 * 2);
            continue;
        }
        const float *src = x + (m0 + r) * K;
        for (long k = 0; k < K; k++) {
            float v = src[k] / s;
            v = v < below ? below : v;
            v = v > above ? above : v;
            v = v != v ? 0.0f : v; /* NaN: ONNX leaves it undefined; 0 */
            v = (v + magic) - magic;
            row[k] = (int16_t)(int32_t)(v - shift);
        }
        if (K % 2) row[K] = 0;
    }
}

static inline float act_scalar(float v, int kind, float lo, float hi)
{
    if (kind == ACT_RELU) return v > 0.0f ? v : 0.0f;
    if (kind == ACT_CLIP) return v < lo ? lo : (v > hi ? hi : v);
    return v;
}

/* one output value (scalar path and the channel tail): r from the int32 (or the chunks' float) sum */
static inline void store_scalar(const w16_plan *p, void *y, long m, long o, float r, int32_t raw)
{
    long at = m * p->O + o;
    if (p->out == OUT_S32) { ((int32_t *)y)[at] = raw; return; }
    r = act_scalar(r, p->activation, p->alpha, p->beta);
    if (p->out == OUT_F32) { ((float *)y)[at] = r; return; }
    float q = r * (1.0f / p->y_scale);
    q = q != q ? 0.0f : q;
    q = q < -1e9f ? -1e9f : (q > 1e9f ? 1e9f : q);
    long v = (long)__builtin_rintf(q) + p->y_zero;
    if (p->out == OUT_U8) ((uint8_t *)y)[at] = (uint8_t)(v < 0 ? 0 : (v > 255 ? 255 : v));
    else ((int8_t *)y)[at] = (int8_t)(v < -128 ? -128 : (v > 127 ? 127 : v));
}

#if LANES == 16 || defined(__AVX2__)
/* LANES channels [o, o + LANES) of row m: r (float sums) or raw (int32, OUT_S32) through the epilogue */
static inline __attribute__((always_inline)) void store_vector(const w16_plan *p, void *y, long m, long o, vf r,
                                                               vi raw)
{
    const long O = p->O, at = m * O + o;
    const int whole = o + LANES <= O;
    if (p->out == OUT_S32) {
        if (whole) { ISTORE((int32_t *)y + at, raw); return; }
        int32_t t[LANES];
        ISTORE(t, raw);
        for (long j = 0; o + j < O; j++) ((int32_t *)y)[at + j] = t[j];
        return;
    }
    if (p->activation == ACT_RELU) r = FMAX(r, FSET(0.0f));
    else if (p->activation == ACT_CLIP) r = FMIN(FMAX(r, FSET(p->alpha)), FSET(p->beta));
    if (p->out == OUT_F32) {
        if (whole) { FSTORE((float *)y + at, r); return; }
        float t[LANES];
        FSTORE(t, r);
        for (long j = 0; o + j < O; j++) ((float *)y)[at + j] = t[j];
        return;
    }
    vf q = FMUL(r, FSET(1.0f / p->y_scale)); /* a multiply: a division per vector cost 25% at K = 16 */
    q = FMIN(FMAX(q, FSET(-1e9f)), FSET(1e9f)); /* NaN -> -1e9 (max returns its second operand): saturates */
    vi v = IADD(FROUND_I(q), ISET((int)p->y_zero));
#if LANES == 16  /* saturating narrowing stores: vpmovusdb / vpmovsdb, masked at the channel tail */
    const __m128i bytes = p->out == OUT_U8 ? _mm512_cvtusepi32_epi8(_mm512_max_epi32(v, ISET(0)))
                                           : _mm512_cvtsepi32_epi8(v);  /* to a register: the store forms are slow */
    if (whole) _mm_storeu_si128((__m128i *)((uint8_t *)y + at), bytes);
    else _mm_mask_storeu_epi8((uint8_t *)y + at, (__mmask16)((1u << (O - o)) - 1), bytes);
    return;
#endif
    const int lo = p->out == OUT_U8 ? 0 : -128, hi = p->out == OUT_U8 ? 255 : 127;
    v = IMIN(IMAX(v, ISET(lo)), ISET(hi));
    int32_t t[LANES];
    ISTORE(t, v);
    const long n = whole ? LANES : O - o;
    if (p->out == OUT_U8) for (long j = 0; j < n; j++) ((uint8_t *)y)[at + j] = (uint8_t)t[j];
    else for (long j = 0; j < n; j++) ((int8_t *)y)[at + j] = (int8_t)t[j];
}

/* The k loop of an MR x NV·LANES tile alone (MR, NV constants: each instance its own small function, so the
   register allocator sees only the accumulators, NV weight vectors and a broadcast: with the epilogue inlined
   beside it GCC kept the accumulators on the stack, 3x slower): rows a + r·astride, k pairs [q0, q1), the int32
   sums to out [MR][NV·LANES]. */
#define DEFINE_KERNEL(MR, NV)                                                                                      \
    static __attribute__((noinline)) void kernel_##MR##_##NV(const int16_t *a, long astride, const int16_t *w,    \
                                                             long wstride, long q0, long q1, int32_t *out) {      \
        vi acc[MR][NV];                                                                                            \
        _Pragma("GCC unroll 16") for (int r = 0; r < MR; r++)                                                     \
            _Pragma("GCC unroll 16") for (int v = 0; v < NV; v++) acc[r][v] = VZERO();                            \
        for (long q = q0; q < q1; q++) {                                                                           \
            vi wv[NV];                                                                                             \
            _Pragma("GCC unroll 16") for (int v = 0; v < NV; v++) wv[v] = VLOAD(w + v * wstride + q * LANES * 2); \
            _Pragma("GCC unroll 16") for (int r = 0; r < MR; r++) {                                               \
                const vi b = VBCAST(a + r * astride + q * 2);                                                      \
                _Pragma("GCC unroll 16") for (int v = 0; v < NV; v++) acc[r][v] = DOT(acc[r][v], b, wv[v]);        \
            }                                                                                                      \
        }                                                                                                          \
        _Pragma("GCC unroll 16") for (int r = 0; r < MR; r++)                                                     \
            _Pragma("GCC unroll 16") for (int v = 0; v < NV; v++) ISTORE(out + (r * NV + v) * LANES, acc[r][v]);  \
    }

#if LANES == 16
DEFINE_KERNEL(6, 4)
DEFINE_KERNEL(6, 3)
DEFINE_KERNEL(12, 2)
DEFINE_KERNEL(12, 1)
#else
DEFINE_KERNEL(4, 3)
DEFINE_KERNEL(6, 2)
DEFINE_KERNEL(6, 1)
#endif

typedef void (*kernel_fn)(const int16_t *, long, const int16_t *, long, long, long, int32_t *);

/* An MR x NV·LANES tile: rows [r0, r0 + MR) of the block a, channel blocks [ob, ob + NV); each chunk of kc pairs
   exact in int32 (kernel), chunks past the first summed in float32; then the epilogue, from L1. */
static void tile(const w16_plan *p, const int16_t *a, long K2, long r0, long rows, long m0, long ob, void *y,
                 const int MR, const int NV, kernel_fn kernel)
{
    int32_t sums[12 * 4 * LANES] __attribute__((aligned(64)));
    float part[12 * 4 * LANES] __attribute__((aligned(64)));
    const long kc = p->kc, wstride = K2 * LANES * 2;
    const int chunked = kc < K2;
    for (long c0 = 0; c0 < K2; c0 += kc) {
        const long c1 = c0 + kc < K2 ? c0 + kc : K2;
        kernel(a + r0 * K2 * 2, K2 * 2, p->w + ob * wstride, wstride, c0, c1, sums);
        if (chunked)
            for (int i = 0; i < MR * NV; i++) {
                vf f = VCVT(VLOAD(sums + i * LANES));
                FSTORE(part + i * LANES, c0 == 0 ? f : FADD(FLOAD(part + i * LANES), f));
            }
    }
    for (int v = 0; v < NV; v++) {
        const long o = (ob + v) * LANES;
        const vf s = FLOAD(p->scale + o), b = FLOAD(p->bias + o);
        for (int r = 0; r < MR && r0 + r < rows; r++) {
            const int i = (r * NV + v) * LANES;
            const vi raw = VLOAD(sums + i);
            const vf sum = chunked ? FLOAD(part + i) : VCVT(raw);
            store_vector(p, y, m0 + r0 + r, o, FMADD(sum, s, b), raw);
        }
    }
}
#define tile(p, a, K2, r0, rows, m0, ob, y, MR, NV) tile(p, a, K2, r0, rows, m0, ob, y, MR, NV, kernel_##MR##_##NV)

/* every output channel of the block's rows (rows <= RB valid), in tiles of NV channel vectors */
static void run_block(const w16_plan *p, const int16_t *a, long K2, long rows, long m0, void *y)
{
    const long blocks = (p->O + LANES - 1) / LANES;
    long ob = 0;
#if LANES == 16
    for (; ob + 4 <= blocks; ob += 4) { tile(p, a, K2, 0, rows, m0, ob, y, 6, 4); tile(p, a, K2, 6, rows, m0, ob, y, 6, 4); }
    switch (blocks - ob) {
    case 3: tile(p, a, K2, 0, rows, m0, ob, y, 6, 3); tile(p, a, K2, 6, rows, m0, ob, y, 6, 3); break;
    case 2: tile(p, a, K2, 0, rows, m0, ob, y, 12, 2); break;
    case 1: tile(p, a, K2, 0, rows, m0, ob, y, 12, 1); break;
    default: break;
    }
#else  /* 16 ymm: 12 accumulators, NV weights, a broadcast */
    for (; ob + 3 <= blocks; ob += 3)
        for (int r0 = 0; r0 < RB; r0 += 4) tile(p, a, K2, r0, rows, m0, ob, y, 4, 3);
    switch (blocks - ob) {
    case 2: tile(p, a, K2, 0, rows, m0, ob, y, 6, 2); tile(p, a, K2, 6, rows, m0, ob, y, 6, 2); break;
    case 1: tile(p, a, K2, 0, rows, m0, ob, y, 6, 1); tile(p, a, K2, 6, rows, m0, ob, y, 6, 1); break;
    default: break;
    }
#endif
}
#else
/* plain C: int64 per chunk would be exact too, but the chunks keep the vector paths' arithmetic */
static void run_block(const w16_plan *p, const int16_t *a, long K2, long rows, long m0, void *y)
{
    for (long r = 0; r < rows; r++)
        for (long o = 0; o < p->O; o++) {
            const int16_t *w = p->w + (o / LANES) * K2 * LANES * 2 + (o % LANES) * 2;
            float f = 0.0f;
            int32_t acc = 0;
            for (long c0 = 0; c0 < K2; c0 += p->kc) {
                acc = 0;
                long c1 = c0 + p->kc < K2 ? c0 + p->kc : K2;
                for (long q = c0; q < c1; q++)
                    acc += (int32_t)a[r * K2 * 2 + 2 * q] * w[q * LANES * 2] +
                           (int32_t)a[r * K2 * 2 + 2 * q + 1] * w[q * LANES * 2 + 1];
                f += (float)acc;
            }
            store_scalar(p, y, m0 + r, o, (p->kc < K2 ? f : (float)acc) * p->scale[o] + p->bias[o], acc);
        }
}
#endif

void kiln_w16_run(const w16_plan *p, const float *x, void *y)
{
    const long K2 = (p->K + 1) / 2, blocks = (p->M + RB - 1) / RB;
#pragma omp parallel num_threads(p->threads) if (p->threads > 1 && blocks > 1)
    {
        int16_t a[RB * K2 * 2] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (long b = 0; b < blocks; b++) {
            const long m0 = b * RB, rows = p->M - m0 < RB ? p->M - m0 : RB;
            quantize_rows(p, x, m0, rows, a, K2);
            run_block(p, a, K2, rows, m0, y);
        }
    }
}

/* The layer as a call of a native segment's loop (segment_loop.c call_fn): the input's and output's addresses
   read from their dnnl_memory_t at each run. */
int kiln_w16_call(void *object, void *stream, int nargs, const void *args)
{
    (void)stream; (void)nargs; (void)args;
    const w16_plan *p = (const w16_plan *)object;
    void *x = 0, *y = 0;
    if (p->get_handle(p->x, &x) || !x || p->get_handle(p->y, &y) || !y) return 2;
    kiln_w16_run(p, (const float *)x, y);
    return 0;
}
