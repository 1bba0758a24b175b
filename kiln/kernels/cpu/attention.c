/* kiln_attention: softmax(q kᵀ scale + mask) v per (batch, head), q/k/v/out at any strides with a contiguous
 * last axis; additive or boolean mask at any broadcast strides, or a key padding mask (int64 [B, T]: nonzero,
 * a real key); causal. Varlen (a padding-free encoder's packed rows, kiln/ops/tokens.py PackedAttention):
 * sequence b is the rows cu_seqlens[b] .. cu_seqlens[b + 1] of q/k/v/out (its start times the position
 * stride; the batch strides unused), S = T = the longest a sequence may be. Compiled as one unit with
 * transformer.c, after it (kiln/kernels/cpu/transformer.py SOURCE): it uses that file's includes,
 * handle_of, max_threads and the plan conventions described there.
 */

#include "exp_poly.h"

/* ---- Attention ---------------------------------------------------------------------------------- */

typedef struct {
    get_handle_fn get_handle;
    void *q, *k, *v, *mask, *out;  /* dnnl_memory_t; q, k, v may be one memory (a packed qkv) */
    long q_off, k_off, v_off;      /* elements from the memory's address to element [0, 0, 0, 0] */
    long B, H, Hkv, S, T, D, Dv;
    long qs[3], ks[3], vs[3], os[3];  /* strides in elements of batch, head, position; the last axis is 1 */
    long ms[4];       /* the mask's strides of batch, head, query, key (0: broadcast) */
    int mask_kind;    /* 0 none, 1 additive float32, 2 boolean (true: attend) */
    int causal;       /* query i sees keys 0..i */
    int nan_to_zero;  /* a row that sees no key gives 0 (else NaN, as softmax of -inf everywhere) */
    float scale;
    void *cu;         /* dnnl_memory_t of cu_seqlens, int32 [B + 1], for varlen; else NULL */
    long rows;        /* varlen: the packed rows q/k/v/out hold (cu_seqlens[B] <= rows) */
    /* An explicitly quantized graph's attention (kiln/ops/fused.py attention): q, k, v uint8, read as
       (x - zero)·scale; the scores (before the mask) and the probabilities (after the NaN guard) through
       DQ(Q(·)); the output written uint8. Quantizations: scale, zero point, qmin, qmax. */
    int quantized;                            /* q, k, v are uint8 */
    float q_quant[2], k_quant[2], v_quant[2]; /* scale, zero point */
    int score_quant, prob_quant, out_quant;   /* each applied or not */
    float score_q[4], prob_q[4], out_q[4];
} attention_plan;

#define QB 6    /* query rows computed together: a 6x16 tile of 12 accumulators, AVX2's GEMM shape */
#define KB 16   /* keys (or output dims) per register tile */

/* exp(x) for x <= 0 (a softmax's shifted scores) on a vector V of floats, NAME##_i its ints; below -87.3 it is
   exactly 0 as torch's is for a masked key. exp_poly.h's reduction and polynomial (Cephes' expf: ~2 ulp), n by
   the ISA's round; the last step keeps its own association, p·r² + (r + 1), which this softmax has always had
   (exp_poly's (p·r)·r + r + 1 rounds differently by an ulp now and then). MAX and ROUND: the ISA's max and
   round-to-nearest at V's width; the multiply-adds contract to FMAs (GNU C's fp-contract=fast, -march with
   FMA). Both widths below compile to the instructions their intrinsics forms did. */
#define EXP_LE0(NAME, V, MAX, ROUND)                                                                         \
    typedef int NAME##_i __attribute__((vector_size(sizeof(V))));                                            \
    static inline V NAME(V x) {                                                                              \
        const V lo = (V){0} - 87.3f;                                                                         \
        const NAME##_i keep = x >= lo;                                                                       \
        x = MAX(x, lo);                                                                                      \
        const V n = ROUND(x * KILN_EXP_LOG2E, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);                \
        const V r = KILN_EXP_REDUCE(x, n);                                                                   \
        const V p = KILN_EXP_P(r) * (r * r) + (r + 1.0f);                                                    \
        return (V)((NAME##_i)(p * (V)KILN_EXP_2N(n, NAME##_i)) & keep);                                      \
    }

#ifdef KILN_AVX2
EXP_LE0(exp_le0, __m256, _mm256_max_ps, _mm256_round_ps)
#endif
#ifdef __AVX512F__
/* 16 lanes: T5's softmax spent half its time in the 8-lane one */
EXP_LE0(exp_le0_16, __m512, _mm512_max_ps, _mm512_roundscale_ps)
#endif

/* r[j] = clamp(round(x[j]·c / s) + z, qmin, qmax) for j < n (round half to even, as ONNX QuantizeLinear), qp =
   {s, z, qmin, qmax}; dequantized back, (r - z)·s, when `back`: DQ(Q(x·c)). c: the softmax's 1 / sum for the
   probabilities, taken in this pass rather than one of its own (x·1 is exact: c = 1 is Q(x) itself). */
static void quantize_row(const float *x, float *r, long n, float c, const float *qp, int back) {
    long j = 0;
#if defined(__AVX512F__) && defined(KILN_AVX2)
    {  /* 16 lanes: the int8 attention's scores and probabilities spent ~7% of QDQ BERT-tiny here */
        const __m512 s = _mm512_set1_ps(qp[0]), z = _mm512_set1_ps(qp[1]), lo = _mm512_set1_ps(qp[2]),
                     hi = _mm512_set1_ps(qp[3]), c16 = _mm512_set1_ps(c);
        for (; j + 16 <= n; j += 16) {
            __m512 v = _mm512_roundscale_ps(_mm512_div_ps(_mm512_mul_ps(_mm512_loadu_ps(x + j), c16), s),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            v = _mm512_min_ps(_mm512_max_ps(_mm512_add_ps(v, z), lo), hi);
            _mm512_storeu_ps(r + j, back ? _mm512_mul_ps(_mm512_sub_ps(v, z), s) : v);
        }
    }
#endif
#ifdef KILN_AVX2
    const __m256 s = _mm256_set1_ps(qp[0]), z = _mm256_set1_ps(qp[1]), lo = _mm256_set1_ps(qp[2]),
                 hi = _mm256_set1_ps(qp[3]), c8 = _mm256_set1_ps(c);
    for (; j + 8 <= n; j += 8) {
        __m256 v = _mm256_round_ps(_mm256_div_ps(_mm256_mul_ps(_mm256_loadu_ps(x + j), c8), s),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v = _mm256_min_ps(_mm256_max_ps(_mm256_add_ps(v, z), lo), hi);
        _mm256_storeu_ps(r + j, back ? _mm256_mul_ps(_mm256_sub_ps(v, z), s) : v);
    }
#endif
    for (; j < n; ++j) {
        float v = nearbyintf(x[j] * c / qp[0]) + qp[1];
        v = v < qp[2] ? qp[2] : (v > qp[3] ? qp[3] : v);
        r[j] = back ? (v - qp[1]) * qp[0] : v;
    }
}

/* The int8 attention's scores in one pass: s[j] = DQ(Q(s[j]·scale)) + m[j] for j < t (m NULL: no mask; else an
   additive float32 row, contiguous), qp as quantize_row's; returns max_j s[j]. It replaces three passes over the
   scores (s·scale; quantize_row; scale_add_max with scale 1) with their float32 operations in the same order at
   the same lane widths (quantize_row's, which clamp a NaN to qmin on the vector lanes and keep it on the scalar
   ones; scale_add_max's max, whose operand order decides which NaN or zero is the max), so its bits are theirs:
   x·1 is exact, and the empty asm keeps the product (q - z)·s from contracting with the mask's add into an FMA
   (one rounding where the passes made two). */
static float score_quantize_add_max(float *s, long t, float scale, const float *qp, const float *m) {
    long j = 0;
    float max = -INFINITY;
#if defined(__AVX512F__) && defined(KILN_AVX2)
    {
        const __m512 c = _mm512_set1_ps(scale), qs = _mm512_set1_ps(qp[0]), z = _mm512_set1_ps(qp[1]),
                     lo = _mm512_set1_ps(qp[2]), hi = _mm512_set1_ps(qp[3]);
        __m512 mx16 = _mm512_set1_ps(-INFINITY);
        for (; j + 16 <= t; j += 16) {
            __m512 v = _mm512_roundscale_ps(_mm512_div_ps(_mm512_mul_ps(_mm512_loadu_ps(s + j), c), qs),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            v = _mm512_min_ps(_mm512_max_ps(_mm512_add_ps(v, z), lo), hi);
            v = _mm512_mul_ps(_mm512_sub_ps(v, z), qs);
            __asm__("" : "+v"(v));
            if (m) v = _mm512_add_ps(v, _mm512_loadu_ps(m + j));
            _mm512_storeu_ps(s + j, v);
            mx16 = _mm512_max_ps(mx16, v);
        }
        max = _mm512_reduce_max_ps(mx16);
    }
#endif
#ifdef KILN_AVX2
    const __m256 c = _mm256_set1_ps(scale), qs = _mm256_set1_ps(qp[0]), z = _mm256_set1_ps(qp[1]),
                 lo = _mm256_set1_ps(qp[2]), hi = _mm256_set1_ps(qp[3]);
    __m256 mx = _mm256_set1_ps(-INFINITY);
    for (; j + 8 <= t; j += 8) {
        __m256 v = _mm256_round_ps(_mm256_div_ps(_mm256_mul_ps(_mm256_loadu_ps(s + j), c), qs),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v = _mm256_min_ps(_mm256_max_ps(_mm256_add_ps(v, z), lo), hi);
        v = _mm256_mul_ps(_mm256_sub_ps(v, z), qs);
        __asm__("" : "+x"(v));
        if (m) v = _mm256_add_ps(v, _mm256_loadu_ps(m + j));
        _mm256_storeu_ps(s + j, v);
        mx = _mm256_max_ps(mx, v);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, mx);
    for (int i = 0; i < 8; ++i) max = lanes[i] > max ? lanes[i] : max;
#endif
    for (; j < t; ++j) {
        float v = nearbyintf(s[j] * scale / qp[0]) + qp[1];
        v = v < qp[2] ? qp[2] : (v > qp[3] ? qp[3] : v);
        v = (v - qp[1]) * qp[0];
        __asm__("" : "+x"(v));
        s[j] = v + (m ? m[j] : 0.0f);
        max = s[j] > max ? s[j] : max;
    }
    return max;
}

/* rows [first, last) of a uint8 [.., position, dim] head as float (x - z)·s, dst [position][n] */
static void dequantize_rows(const unsigned char *x, long row_stride, long first, long last, long n, const float *qp,
                            float *dst) {
    const float s = qp[0], z = qp[1];
    for (long i = first; i < last; ++i) {
        const unsigned char *row = x + i * row_stride;
        float *d = dst + i * n;
        long j = 0;
#ifdef __AVX512F__
        const __m512 vs = _mm512_set1_ps(s), vz = _mm512_set1_ps(z);
        for (; j + 16 <= n; j += 16) {  /* (a char pointer may alias d: the compiler wrote this loop scalar) */
            const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + j))));
            _mm512_storeu_ps(d + j, _mm512_mul_ps(_mm512_sub_ps(w, vz), vs));
        }
#endif
        for (; j < n; ++j) d[j] = ((float)row[j] - z) * s;
    }
}

/* s[j] = s[j] * scale + m[j] (m NULL: no mask; additive float32, contiguous), returns max_j s[j] */
static float scale_add_max(float *s, long t, float scale, const float *m) {
    long j = 0;
    float max = -INFINITY;
#ifdef __AVX512F__
    const __m512 c16 = _mm512_set1_ps(scale);
    __m512 mx16 = _mm512_set1_ps(-INFINITY);
    for (; j + 16 <= t; j += 16) {
        __m512 v = _mm512_mul_ps(_mm512_loadu_ps(s + j), c16);
        if (m) v = _mm512_add_ps(v, _mm512_loadu_ps(m + j));
        _mm512_storeu_ps(s + j, v);
        mx16 = _mm512_max_ps(mx16, v);
    }
    max = _mm512_reduce_max_ps(mx16);
#endif
#ifdef KILN_AVX2
    __m256 c = _mm256_set1_ps(scale), mx = _mm256_set1_ps(-INFINITY);
    for (; j + 8 <= t; j += 8) {
        __m256 v = _mm256_mul_ps(_mm256_loadu_ps(s + j), c);
        if (m) v = _mm256_add_ps(v, _mm256_loadu_ps(m + j));
        _mm256_storeu_ps(s + j, v);
        mx = _mm256_max_ps(mx, v);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, mx);
    for (int i = 0; i < 8; ++i) max = lanes[i] > max ? lanes[i] : max;
#endif
    for (; j < t; ++j) {
        s[j] = s[j] * scale + (m ? m[j] : 0.0f);
        max = s[j] > max ? s[j] : max;
    }
    return max;
}

/* s[j] = exp(s[j] - max) for j < t, returns the sum; max is -inf-free here */
static float exp_shifted(float *s, long t, float max) {
    long j = 0;
    float sum = 0.0f;
#ifdef __AVX512F__
    const __m512 m16 = _mm512_set1_ps(max);
    __m512 acc16 = _mm512_setzero_ps();
    for (; j + 16 <= t; j += 16) {
        __m512 e = exp_le0_16(_mm512_sub_ps(_mm512_loadu_ps(s + j), m16));
        _mm512_storeu_ps(s + j, e);
        acc16 = _mm512_add_ps(acc16, e);
    }
    sum = _mm512_reduce_add_ps(acc16);
#endif
#ifdef KILN_AVX2
    __m256 m = _mm256_set1_ps(max), acc = _mm256_setzero_ps();
    for (; j + 8 <= t; j += 8) {
        __m256 e = exp_le0(_mm256_sub_ps(_mm256_loadu_ps(s + j), m));
        _mm256_storeu_ps(s + j, e);
        acc = _mm256_add_ps(acc, e);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    for (int i = 0; i < 8; ++i) sum += lanes[i];
#endif
    for (; j < t; ++j) { float e = expf(s[j] - max); s[j] = e; sum += e; }
    return sum;
}

/* scores[r][j] = q_r · k_j for QB rows and keys [0, limit) (a multiple of KB): kᵀ packed in blocks of KB
   keys, kb[(j / KB)][d][j % KB], so a tile's loads are one contiguous stream; scores [QB][tp]. */
static void scores_tile(const float *const *qrow, const float *kb, long D, long tp, long limit, float *scores) {
    long j0 = 0;
#ifdef __AVX512F__
    /* two blocks at a time, a 6x32 tile of 12 zmm accumulators: AVX-512's two FMA ports kept busy, twice AVX2's
       multiply-adds an instruction (T5's 128 keys of 64 dims: the AVX2 tile lost to torch's SDPA by 1.5x) */
    for (; j0 + 2 * KB <= limit; j0 += 2 * KB) {
        const float *b0 = kb + (j0 / KB) * D * KB, *b1 = b0 + D * KB;
        __m512 a[QB][2];
        for (int r = 0; r < QB; ++r) a[r][0] = a[r][1] = _mm512_setzero_ps();
        for (long d = 0; d < D; ++d) {
            __m512 k0 = _mm512_loadu_ps(b0 + d * KB), k1 = _mm512_loadu_ps(b1 + d * KB);
            for (int r = 0; r < QB; ++r) {
                __m512 q = _mm512_set1_ps(qrow[r][d]);
                a[r][0] = _mm512_fmadd_ps(q, k0, a[r][0]);
                a[r][1] = _mm512_fmadd_ps(q, k1, a[r][1]);
            }
        }
        for (int r = 0; r < QB; ++r) {
            _mm512_storeu_ps(scores + r * tp + j0, a[r][0]);
            _mm512_storeu_ps(scores + r * tp + j0 + KB, a[r][1]);
        }
    }
#endif
    for (; j0 < limit; j0 += KB) {
        const float *block = kb + (j0 / KB) * D * KB;
#ifdef KILN_AVX2
        __m256 a[QB][2];
        for (int r = 0; r < QB; ++r) a[r][0] = a[r][1] = _mm256_setzero_ps();
        for (long d = 0; d < D; ++d) {
            __m256 k0 = _mm256_loadu_ps(block + d * KB), k1 = _mm256_loadu_ps(block + d * KB + 8);
            for (int r = 0; r < QB; ++r) {
                __m256 q = _mm256_broadcast_ss(qrow[r] + d);
                a[r][0] = _mm256_fmadd_ps(q, k0, a[r][0]);
                a[r][1] = _mm256_fmadd_ps(q, k1, a[r][1]);
            }
        }
        for (int r = 0; r < QB; ++r) {
            _mm256_storeu_ps(scores + r * tp + j0, a[r][0]);
            _mm256_storeu_ps(scores + r * tp + j0 + 8, a[r][1]);
        }
#else
        for (int r = 0; r < QB; ++r)
            for (long j = 0; j < KB; ++j) {
                float acc = 0.0f;
                for (long d = 0; d < D; ++d) acc += qrow[r][d] * block[d * KB + j];
                scores[r * tp + j0 + j] = acc;
            }
#endif
    }
}

/* out_r = (sum_{j < t} p[r][j] v_j)·w[r] for QB rows. v's first `packed` dims in chunks of KB: chunk c's row j
   at chunks + c * chunk_stride + j * row_stride (a chunk past Dv zero-padded: its tile goes through a buffer);
   the dims past them at tail + j * tail_stride, one at a time. w: the softmax's 1 / sum of each row, applied to
   its Dv outputs rather than to its t probabilities (a pass over the scores saved, as torch's flash kernel does). */
static void pv_tile(const float *p, long tp, long t, const float *chunks, long chunk_stride, long row_stride,
                    long packed, const float *tail, long tail_stride, long Dv, const float *w, float *const *orow) {
    long d0 = 0;
#ifdef __AVX512F__
    /* two chunks at a time, 6x32 in 12 zmm accumulators; a chunk past Dv (zero-padded) stored masked */
    for (; d0 + 2 * KB <= packed; d0 += 2 * KB) {
        const float *v0 = chunks + (d0 / KB) * chunk_stride, *v1 = v0 + chunk_stride;
        __m512 a[QB][2];
        for (int r = 0; r < QB; ++r) a[r][0] = a[r][1] = _mm512_setzero_ps();
        for (long j = 0; j < t; ++j) {
            __m512 x0 = _mm512_loadu_ps(v0 + j * row_stride), x1 = _mm512_loadu_ps(v1 + j * row_stride);
            for (int r = 0; r < QB; ++r) {
                __m512 pr = _mm512_set1_ps(p[r * tp + j]);
                a[r][0] = _mm512_fmadd_ps(pr, x0, a[r][0]);
                a[r][1] = _mm512_fmadd_ps(pr, x1, a[r][1]);
            }
        }
        const long n0 = Dv - d0 < KB ? Dv - d0 : KB, n1 = Dv - d0 - KB < KB ? Dv - d0 - KB : KB;  /* both > 0 */
        const __mmask16 m0 = (__mmask16)((1u << n0) - 1), m1 = (__mmask16)((1u << n1) - 1);
        for (int r = 0; r < QB; ++r) {
            const __m512 wr = _mm512_set1_ps(w[r]);
            _mm512_mask_storeu_ps(orow[r] + d0, m0, _mm512_mul_ps(a[r][0], wr));
            _mm512_mask_storeu_ps(orow[r] + d0 + KB, m1, _mm512_mul_ps(a[r][1], wr));
        }
    }
#endif
#ifdef KILN_AVX2
    for (; d0 + KB <= packed; d0 += KB) {
        const float *vc = chunks + (d0 / KB) * chunk_stride;
        /* twelve named accumulators, not an array: GCC 12 kept a[QB][2] on the stack and stored every one of them
           at every key (12 stores to 12 FMAs), which held this loop to half the FMA rate (BERT-base's attention at
           AVX2: 1.2x torch's SDPA) */
        __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00,
               a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
        const float *p0 = p, *p1 = p + tp, *p2 = p + 2 * tp, *p3 = p + 3 * tp, *p4 = p + 4 * tp, *p5 = p + 5 * tp;
        for (long j = 0; j < t; ++j) {
            const __m256 v0 = _mm256_loadu_ps(vc + j * row_stride), v1 = _mm256_loadu_ps(vc + j * row_stride + 8);
            __m256 pr = _mm256_broadcast_ss(p0 + j);
            a00 = _mm256_fmadd_ps(pr, v0, a00); a01 = _mm256_fmadd_ps(pr, v1, a01);
            pr = _mm256_broadcast_ss(p1 + j);
            a10 = _mm256_fmadd_ps(pr, v0, a10); a11 = _mm256_fmadd_ps(pr, v1, a11);
            pr = _mm256_broadcast_ss(p2 + j);
            a20 = _mm256_fmadd_ps(pr, v0, a20); a21 = _mm256_fmadd_ps(pr, v1, a21);
            pr = _mm256_broadcast_ss(p3 + j);
            a30 = _mm256_fmadd_ps(pr, v0, a30); a31 = _mm256_fmadd_ps(pr, v1, a31);
            pr = _mm256_broadcast_ss(p4 + j);
            a40 = _mm256_fmadd_ps(pr, v0, a40); a41 = _mm256_fmadd_ps(pr, v1, a41);
            pr = _mm256_broadcast_ss(p5 + j);
            a50 = _mm256_fmadd_ps(pr, v0, a50); a51 = _mm256_fmadd_ps(pr, v1, a51);
        }
        const __m256 w0 = _mm256_set1_ps(w[0]), w1 = _mm256_set1_ps(w[1]), w2 = _mm256_set1_ps(w[2]),
                     w3 = _mm256_set1_ps(w[3]), w4 = _mm256_set1_ps(w[4]), w5 = _mm256_set1_ps(w[5]);
        const __m256 acc[QB][2] = {{a00 * w0, a01 * w0}, {a10 * w1, a11 * w1}, {a20 * w2, a21 * w2},
                                   {a30 * w3, a31 * w3}, {a40 * w4, a41 * w4}, {a50 * w5, a51 * w5}};
        if (d0 + KB <= Dv) {
            for (int r = 0; r < QB; ++r) {
                _mm256_storeu_ps(orow[r] + d0, acc[r][0]);
                _mm256_storeu_ps(orow[r] + d0 + 8, acc[r][1]);
            }
        } else {  /* the zero-padded last chunk: only its Dv - d0 dims are the output's */
            float tile[KB];
            for (int r = 0; r < QB; ++r) {
                _mm256_storeu_ps(tile, acc[r][0]);
                _mm256_storeu_ps(tile + 8, acc[r][1]);
                memcpy(orow[r] + d0, tile, (size_t)(Dv - d0) * sizeof(float));
            }
            d0 = Dv;
        }
    }
#else
    (void)chunks; (void)chunk_stride; (void)row_stride; (void)packed;
#endif
    for (; d0 < Dv; ++d0)
        for (int r = 0; r < QB; ++r) {
            float acc = 0.0f;
            for (long j = 0; j < t; ++j) acc += p[r * tp + j] * tail[j * tail_stride + d0];
            orow[r][d0] = acc * w[r];
        }
}

/* kᵀ in blocks of KB keys, kt[(j / KB)][d][j % KB] for keys j < tp, zeros past T: eight keys by eight dims at a
   time through an 8x8 register transpose (the element-by-element scatter it replaces was ~5% of BERT-base's
   attention at AVX2), the rest one by one */
static void pack_keys(const float *kb, long k_row, long T, long D, long tp, float *kt) {
    long j0 = 0;
#ifdef KILN_AVX2
    for (; j0 + 8 <= T; j0 += 8) {
        float *base = kt + (j0 / KB) * D * KB + j0 % KB;
        long d0 = 0;
        for (; d0 + 8 <= D; d0 += 8) {
            __m256 r0 = _mm256_loadu_ps(kb + (j0 + 0) * k_row + d0), r1 = _mm256_loadu_ps(kb + (j0 + 1) * k_row + d0),
                   r2 = _mm256_loadu_ps(kb + (j0 + 2) * k_row + d0), r3 = _mm256_loadu_ps(kb + (j0 + 3) * k_row + d0),
                   r4 = _mm256_loadu_ps(kb + (j0 + 4) * k_row + d0), r5 = _mm256_loadu_ps(kb + (j0 + 5) * k_row + d0),
                   r6 = _mm256_loadu_ps(kb + (j0 + 6) * k_row + d0), r7 = _mm256_loadu_ps(kb + (j0 + 7) * k_row + d0);
            __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1), t2 = _mm256_unpacklo_ps(r2, r3),
                   t3 = _mm256_unpackhi_ps(r2, r3), t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5),
                   t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
            r0 = _mm256_shuffle_ps(t0, t2, 0x44); r1 = _mm256_shuffle_ps(t0, t2, 0xEE);
            r2 = _mm256_shuffle_ps(t1, t3, 0x44); r3 = _mm256_shuffle_ps(t1, t3, 0xEE);
            r4 = _mm256_shuffle_ps(t4, t6, 0x44); r5 = _mm256_shuffle_ps(t4, t6, 0xEE);
            r6 = _mm256_shuffle_ps(t5, t7, 0x44); r7 = _mm256_shuffle_ps(t5, t7, 0xEE);
            float *dst = base + d0 * KB;  /* row d of the block: dims d0.. of keys j0..j0+7 */
            _mm256_storeu_ps(dst + 0 * KB, _mm256_permute2f128_ps(r0, r4, 0x20));
            _mm256_storeu_ps(dst + 1 * KB, _mm256_permute2f128_ps(r1, r5, 0x20));
            _mm256_storeu_ps(dst + 2 * KB, _mm256_permute2f128_ps(r2, r6, 0x20));
            _mm256_storeu_ps(dst + 3 * KB, _mm256_permute2f128_ps(r3, r7, 0x20));
            _mm256_storeu_ps(dst + 4 * KB, _mm256_permute2f128_ps(r0, r4, 0x31));
            _mm256_storeu_ps(dst + 5 * KB, _mm256_permute2f128_ps(r1, r5, 0x31));
            _mm256_storeu_ps(dst + 6 * KB, _mm256_permute2f128_ps(r2, r6, 0x31));
            _mm256_storeu_ps(dst + 7 * KB, _mm256_permute2f128_ps(r3, r7, 0x31));
        }
        for (; d0 < D; ++d0)
            for (long j = j0; j < j0 + 8; ++j) base[d0 * KB + (j - j0)] = kb[j * k_row + d0];
    }
#endif
    for (long j = j0; j < tp; ++j) {
        float *dst = kt + (j / KB) * D * KB + j % KB;
        if (j < T) {
            const float *kj = kb + j * k_row;
            for (long d = 0; d < D; ++d) dst[d * KB] = kj[d];
        } else {
            for (long d = 0; d < D; ++d) dst[d * KB] = 0.0f;
        }
    }
}

/* One (batch, head), its query rows [first, last) of keys [0, T); the sequence starts at row `start` of
   q/k/v/out (varlen; else 0 and batch b at b times the batch strides). work: kᵀ blocks [tp / KB][D][KB],
   scores [QB][tp], a dump row [Dv], v's chunks [ceil(Dv / KB)][T][KB], a key padding mask as an additive row [T]. */
static void attention_head(const attention_plan *p, const float *q, const float *k, const float *v,
                           const void *mask, float *out, long b, long h, long first, long last, long T, long start,
                           float *work) {
    const long S = last, D = p->D, Dv = p->Dv, tp = (T + KB - 1) / KB * KB;
    const long hk = h / (p->H / p->Hkv), batch = p->cu ? 0 : b;  /* varlen: the start row places the sequence */
    float *kt = work, *scores = work + D * tp, *dump = scores + QB * tp, *vpacked = dump + Dv;
    float *keys = vpacked + T * ((Dv + KB - 1) / KB * KB);
    long q_row = p->qs[2], k_row = p->ks[2], v_row = p->vs[2];
    const float *qb, *kb, *vb;
    if (p->quantized) {  /* this head's uint8 rows as float, (x - z)·s: [S][D], [T][D], [T][Dv] after `keys` */
        float *qf = keys + T, *kf = qf + S * D, *vf = kf + T * D;
        const unsigned char *q8 = (const unsigned char *)q + batch * p->qs[0] + start * p->qs[2] + h * p->qs[1];
        const unsigned char *k8 = (const unsigned char *)k + batch * p->ks[0] + start * p->ks[2] + hk * p->ks[1];
        const unsigned char *v8 = (const unsigned char *)v + batch * p->vs[0] + start * p->vs[2] + hk * p->vs[1];
        dequantize_rows(q8, p->qs[2], first, S, D, p->q_quant, qf);
        dequantize_rows(k8, p->ks[2], 0, T, D, p->k_quant, kf);
        dequantize_rows(v8, p->vs[2], 0, T, Dv, p->v_quant, vf);
        qb = qf, kb = kf, vb = vf, q_row = D, k_row = D, v_row = Dv;
    } else {
        qb = q + batch * p->qs[0] + start * p->qs[2] + h * p->qs[1];
        kb = k + batch * p->ks[0] + start * p->ks[2] + hk * p->ks[1];
        vb = v + batch * p->vs[0] + start * p->vs[2] + hk * p->vs[1];
    }
    /* a uint8 output: each tile's rows computed into `tile` [QB][Dv], then quantized to their place */
    float *ob = p->out_quant ? NULL : out + batch * p->os[0] + start * p->os[2] + h * p->os[1];
    unsigned char *ob8 = p->out_quant ? (unsigned char *)out + batch * p->os[0] + start * p->os[2] + h * p->os[1]
                                      : NULL;
    float *tile = p->quantized ? keys + T + S * D + T * D + T * Dv : dump;
    if (p->mask_kind == 3) {  /* the key padding mask, once per head as an additive row: the vector path below */
        const int64_t *m = (const int64_t *)mask + b * p->ms[0] + h * p->ms[1];
        for (long j = 0; j < T; ++j) keys[j] = m[j * p->ms[3]] ? 0.0f : -INFINITY;
    }
    /* v as chunks of KB dims, each a contiguous [T][KB] stream, when enough query tiles read it; the last
       chunk zero-padded past Dv (MobileViT-S's heads of 36 dims: the 4 past 32 one at a time, strided, took
       twice the vector part's instructions) */
    const float *chunks = vb;
    long chunk_stride = KB, row_stride = v_row, packed = Dv / KB * KB;
    if (S - first > QB) {
        const long nc = (Dv + KB - 1) / KB;
        for (long c = 0; c < nc; ++c) {
            const long n = Dv - c * KB < KB ? Dv - c * KB : KB;
            for (long j = 0; j < T; ++j) {
                float *dst = vpacked + (c * T + j) * KB;
                const float *src = vb + j * v_row + c * KB;
#ifdef KILN_AVX2
                if (n == KB) {  /* a whole chunk: two vector copies, not a call of memcpy per row (8% of BERT's) */
                    _mm256_storeu_ps(dst, _mm256_loadu_ps(src));
                    _mm256_storeu_ps(dst + 8, _mm256_loadu_ps(src + 8));
                    continue;
                }
#endif
                memcpy(dst, src, (size_t)n * sizeof(float));
                for (long d = n; d < KB; ++d) dst[d] = 0.0f;
            }
        }
        chunks = vpacked;
        chunk_stride = T * KB;
        row_stride = KB;
        packed = nc * KB;
    }
    pack_keys(kb, k_row, T, D, tp, kt);
    for (long i0 = first; i0 < S; i0 += QB) {
        const float *qrow[QB];
        float *orow[QB], w[QB];
        for (int r = 0; r < QB; ++r) {
            long i = i0 + r < S ? i0 + r : S - 1;  /* past the last row: recompute it, write nowhere */
            qrow[r] = qb + i * q_row;
            orow[r] = p->out_quant ? tile + r * Dv : (i0 + r < S ? ob + i * p->os[2] : dump);
        }
        /* the causal mask hides keys past the last row of the tile: compute no further */
        long tmax = p->causal ? (i0 + QB < T ? i0 + QB : T) : T;
        long tpad = (tmax + KB - 1) / KB * KB;
        scores_tile(qrow, kt, D, tp, tpad, scores);
        for (int r = 0; r < QB; ++r) {
            long i = i0 + r < S ? i0 + r : S - 1;
            float *s = scores + r * tp;
            long t = p->causal ? (i + 1 < T ? i + 1 : T) : T;
            float max = -INFINITY, scale = p->scale;
            const int one_pass = p->score_quant && (p->mask_kind == 0 || p->mask_kind == 3
                                                    || (p->mask_kind == 1 && p->ms[3] == 1));
            if (one_pass) {
                /* DQ(Q(q kᵀ scale)) + the additive mask (or none), max: one pass */
                const float *m = p->mask_kind == 3 ? keys
                               : p->mask_kind == 1 ? (const float *)mask + b * p->ms[0] + h * p->ms[1] + i * p->ms[2]
                                                   : NULL;
                max = score_quantize_add_max(s, t, scale, p->score_q, m);
            } else if (p->score_quant) {  /* DQ(Q(q kᵀ scale)), then a strided or boolean mask below */
                quantize_row(s, s, t, scale, p->score_q, 1);
                scale = 1.0f;
            }
            if (one_pass) {
                /* the scores and their max are done */
            } else if (p->mask_kind == 1 && p->ms[3] == 1) {
                max = scale_add_max(s, t, scale, (const float *)mask + b * p->ms[0] + h * p->ms[1] + i * p->ms[2]);
            } else if (p->mask_kind == 1) {
                const float *m = (const float *)mask + b * p->ms[0] + h * p->ms[1] + i * p->ms[2];
                for (long j = 0; j < t; ++j) { s[j] = s[j] * scale + m[j * p->ms[3]]; max = s[j] > max ? s[j] : max; }
            } else if (p->mask_kind == 2) {
                const unsigned char *m = (const unsigned char *)mask + b * p->ms[0] + h * p->ms[1] + i * p->ms[2];
                for (long j = 0; j < t; ++j) {
                    s[j] = m[j * p->ms[3]] ? s[j] * scale : -INFINITY;
                    max = s[j] > max ? s[j] : max;
                }
            } else if (p->mask_kind == 3) {  /* hidden keys: -inf added, so exp gives 0 */
                max = scale_add_max(s, t, scale, keys);
            } else {
                max = scale_add_max(s, t, scale, NULL);
            }
            w[r] = 1.0f;
            if (max == -INFINITY || isnan(max)) {  /* no key to attend to (or NaN scores): NaN, as softmax gives */
                for (long j = 0; j < tpad; ++j) s[j] = 0.0f;
                float fill = p->nan_to_zero && max == -INFINITY ? 0.0f : NAN;
                for (long j = 0; j < t; ++j) s[j] = fill;
                continue;
            }
            const float inv = 1.0f / exp_shifted(s, t, max);
            if (p->prob_quant) {  /* DQ(Q(P)) of the probabilities themselves */
                quantize_row(s, s, t, inv, p->prob_q, 1);  /* P = e·inv, taken in the same pass */
            } else {
                w[r] = inv;  /* applied to the row's output (pv_tile) */
            }
            for (long j = t; j < tpad; ++j) s[j] = 0.0f;
        }
        pv_tile(scores, tp, tmax, chunks, chunk_stride, row_stride, packed, vb, v_row, Dv, w, orow);
        if (p->out_quant) {  /* Q(out) into the uint8 output */
            for (int r = 0; r < QB && i0 + r < S; ++r) {
                float *row = tile + r * Dv;
                unsigned char *dst = ob8 + (i0 + r) * p->os[2];
                quantize_row(row, row, Dv, 1.0f, p->out_q, 0);
                long d = 0;
#ifdef __AVX512F__
                for (; d + 16 <= Dv; d += 16)  /* integral values in [qmin, qmax]: exact as int32, then bytes */
                    _mm_storeu_si128((__m128i *)(dst + d),
                                     _mm512_cvtusepi32_epi8(_mm512_cvtps_epi32(_mm512_loadu_ps(row + d))));
#endif
                for (; d < Dv; ++d) dst[d] = (unsigned char)row[d];
            }
        }
    }
}

/* A thread's work memory for attention_head, kept from call to call (grown when a call needs more): a
   malloc per item would map and fault in fresh pages for every head of every call. */
static float *thread_work(long floats) {
    static __thread float *work = NULL;
    static __thread long capacity = 0;
    if (floats > capacity) {
        free(work);
        work = (float *)malloc((size_t)floats * sizeof(float));
        capacity = work != NULL ? floats : 0;
    }
    return work;
}

typedef struct {
    const attention_plan *p;
    const float *q, *k, *v;
    const void *mask;
    float *out;
    long chunks, rows;  /* runs of query rows per head, rows per run (a multiple of QB) */
    const int32_t *cu;  /* varlen: cu_seqlens [B + 1]; else NULL */
    int failed;
} attention_loop;

/* The keys of (b, h) up to the last one its mask leaves visible to every query: the keys past it are hidden
   (additive mask <= HIDDEN, boolean false, key padding 0) from every row alike, so their exp is exactly 0:
   leaving them out adds no term, only moves the sums' vector/tail split (fp32 rounding), and skips their scores,
   softmax and products (a right-padded sequence's pads: BERT's additive mask is the dtype's minimum). A mask
   that varies by query, or hides every key (such a row attends to all alike, or is NaN), keeps T. */
#define HIDDEN -1e30f
static long visible_keys(const attention_plan *p, const void *mask, long b, long h, long T) {
    if (!p->mask_kind || p->ms[2] != 0 || p->cu) return T;
    const long at = b * p->ms[0] + h * p->ms[1], step = p->ms[3];
    long t = T;
    if (p->mask_kind == 1) {
        const float *m = (const float *)mask + at;
        while (t > 0 && m[(t - 1) * step] <= HIDDEN) --t;
    } else if (p->mask_kind == 2) {
        const unsigned char *m = (const unsigned char *)mask + at;
        while (t > 0 && !m[(t - 1) * step]) --t;
    } else if (p->mask_kind == 3) {
        const int64_t *m = (const int64_t *)mask + at;
        while (t > 0 && !m[(t - 1) * step]) --t;
    }
    return t > 0 ? t : T;
}

/* A quantized attention's (query, key) pair's softmax in multiply-adds' time: 1 thread, AVX2 Zen 3, ns per pair
   = a + b (D + Dv) over D = 16 and 64 gave a / b = 77 (uint8 q/k/v, quantized scores and probabilities; float: 58).
   0: the pairs counted by their products only (before; a benchmark's other side sets it,
   transformer.set_attention_pair_work) */
long kiln_attention_pair_work = 64;

/* Item = (batch·head, run of query rows). */
static void attention_item(void *loop, long item) {
    attention_loop *l = (attention_loop *)loop;
    const attention_plan *p = l->p;
    const long tp = (p->T + KB - 1) / KB * KB;
    /* kᵀ blocks, scores, a dump row, v's chunks, the key row; quantized: + q, k, v as float and a [QB][Dv] tile */
    const long quantized = p->quantized ? p->S * p->D + p->T * (p->D + p->Dv) + QB * p->Dv : 0;
    float *work = thread_work(p->D * tp + QB * tp + p->Dv + p->T * ((p->Dv + KB - 1) / KB * KB) + p->T + quantized);
    if (work == NULL) {
        __atomic_store_n(&l->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    const long bh = item / l->chunks, first = (item % l->chunks) * l->rows, b = bh / p->H;
    const long start = l->cu ? l->cu[b] : 0, length = l->cu ? l->cu[b + 1] - start : p->S;
    const long last = first + l->rows < length ? first + l->rows : length;
    if (first < last)
        attention_head(p, l->q, l->k, l->v, l->mask, l->out, b, bh % p->H, first, last,
                       l->cu ? length : visible_keys(p, l->mask, b, bh % p->H, p->T), start, work);
}

int kiln_attention(void *object, void *stream, int nargs, const void *args) {
    (void)stream; (void)nargs; (void)args;
    const attention_plan *p = (const attention_plan *)object;
    const float *q = (const float *)handle_of(p->get_handle, p->q);
    const float *k = (const float *)handle_of(p->get_handle, p->k);
    const float *v = (const float *)handle_of(p->get_handle, p->v);
    float *out = (float *)handle_of(p->get_handle, p->out);
    const void *mask = p->mask_kind ? handle_of(p->get_handle, p->mask) : NULL;
    const int32_t *cu = p->cu ? (const int32_t *)handle_of(p->get_handle, p->cu) : NULL;
    if (!q || !k || !v || !out || (p->mask_kind && !mask) || (p->cu && !cu)) return 2;
    if (p->quantized) {  /* uint8 elements: the offsets in bytes; attention_head reads them as uint8 */
        q = (const float *)((const unsigned char *)q + p->q_off);
        k = (const float *)((const unsigned char *)k + p->k_off);
        v = (const float *)((const unsigned char *)v + p->v_off);
    } else {
        q += p->q_off; k += p->k_off; v += p->v_off;
    }
    const long heads = p->B * p->H;
    long pairs = p->B * p->S * p->T;  /* (query, key) pairs of a head */
    if (cu) {  /* varlen: each sequence's own, checked against the rows there are */
        pairs = 0;
        for (long b = 0; b < p->B; ++b) {
            const long n = (long)cu[b + 1] - cu[b];
            if (cu[b] < 0 || n < 0 || n > p->S || cu[b + 1] > p->rows) return 2;
            pairs += n * n;
        }
    }
    /* one thread below ~4M multiply-adds' time (~0.1 ms): a parallel loop's end waits out any descheduled
       thread of a loaded machine, which costs more than small work gains. Each (query, key) pair also costs
       its softmax (scale, max, exp, sum; quantized: its score's and probability's rounding), at BERT-tiny's
       16-wide heads most of the time: counted where the attention is quantized, whose engine's segment has a
       form choice (its int8 matmuls' serial twins) that runs it on one thread when the machine is busy. A float
       segment may have none (BERT-tiny's): there the count stays the products' (bench/results/quant-threads) */
    const long work = pairs * p->H * (p->D + p->Dv + (p->quantized ? kiln_attention_pair_work : 0));
    const int parallel = work > (4L << 20) && (heads > 1 || p->S > 8 * QB);
    const int threads = parallel ? max_threads() : 1;
    /* work items: (batch, head, a run of query rows). Heads alone leave threads idle when they do not divide
       evenly (YOLOS's 3 heads on 2 threads: one thread does 2 heads, the other 1) and give a thread slowed by
       other work a whole head; so each head's rows split until there are ~4 items a thread, each run at least
       8 row tiles (its kᵀ and v packing then costs ~1% of its products) */
    long chunks = 1;
    if (threads > 1) {
        const long want = (4L * threads + heads - 1) / heads, most = (p->S + 8 * QB - 1) / (8 * QB);
        chunks = want < most ? want : most;
        if (chunks < 1) chunks = 1;
    }
    attention_loop l = {p, q, k, v, mask, out, chunks, ((p->S + chunks - 1) / chunks + QB - 1) / QB * QB, cu, 0};
    const long items = heads * chunks;
    parallel_items(items, threads, attention_item, &l);
    return l.failed ? 1 : 0;  /* 1: oneDNN's "out of memory" */
}
