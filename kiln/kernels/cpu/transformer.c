/* kiln's transformer layers in C, members of native segments (kiln/runtime/native.py): compiled once
 * by kiln/kernels/cpu/transformer.py through native_loop.build (-O3 -march=native -fopenmp).
 *
 * Each kernel has the segment loop's signature, int fn(void *plan, void *stream, int nargs, const void *args),
 * and reads its operands' addresses from oneDNN memory objects (dnnl_memory_get_data_handle) at every
 * call: the segment binds a layer once and points only its entries and exits per run, as it does for
 * oneDNN's own primitives. Float32 throughout; statistics and softmax sums in float32 as torch's CPU
 * kernels keep them.
 *
 *   kiln_layer_norm   y = LN(x [+ r]) * scale + bias over the last axis; r may repeat over leading rows;
 *                     s = x + r also written when asked for (a pre-LN block's residual stream)
 *   kiln_add          y = a + b, b repeating over a's leading rows
 *   kiln_gather_rows  y[r] = table[ids[r]] (an embedding lookup; int64 ids, negative ones from the end)
 *   kiln_attention    softmax(q kᵀ scale + mask) v per (batch, head), q/k/v/out at any strides with a
 *                     contiguous last axis; additive or boolean mask at any broadcast strides; causal
 *   kiln_broadcast    Cast (to bool, float32), And, Or, Where over broadcast operands, and
 *   kiln_gather_nd    GatherND: what an exported attention mask is prepared with, run in the segment
 *
 * Returns 0, or 2 (oneDNN's "invalid arguments") for an operand that is not bound or an index out of
 * range: the segment then names the layer.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KILN_AVX2 1
#endif

typedef int (*get_handle_fn)(void *memory, void **handle);
typedef int (*parallel_for_fn)(long items, int threads, void (*fn)(void *ctx, long item), void *ctx);

static inline void *handle_of(get_handle_fn get, void *memory) {
    void *h = NULL;
    if (memory == NULL || get(memory, &h) != 0) return NULL;
    return h;
}

/* ---- LayerNorm ---------------------------------------------------------------------------------- */

typedef struct {
    get_handle_fn get_handle;
    void *x, *residual, *y;  /* dnnl_memory_t; residual may be NULL */
    void *sum;               /* dnnl_memory_t of s = x [+ r], a second output; NULL: not asked for */
    const float *scale, *bias;  /* [n] or NULL */
    long rows, n;
    long residual_rows;  /* the residual's rows: row r of x adds residual row r % residual_rows */
    float epsilon;
    long grain;  /* rows per OpenMP chunk; rows <= grain: one thread */
    int rms;     /* RMSNorm: no mean taken out, s / sqrt(mean(s²) + eps) */
    parallel_for_fn parallel_for;  /* kiln_parallel_for (pool.c): items of item_rows rows; NULL: OpenMP */
    long item_rows;                /* 0: too few rows to share out through the pool */
} ln_plan;

#ifdef KILN_AVX2
static inline float hsum(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}
#endif

/* sum of s = x (+ r), written to y when y is given; 16 lanes at a time, the tail in order */
static float row_sum(const float *x, const float *r, float *y, long n) {
    long i = 0;
    float sum = 0.0f;
#ifdef KILN_AVX2
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        __m256 s0 = _mm256_loadu_ps(x + i), s1 = _mm256_loadu_ps(x + i + 8);
        if (r) {
            s0 = _mm256_add_ps(s0, _mm256_loadu_ps(r + i));
            s1 = _mm256_add_ps(s1, _mm256_loadu_ps(r + i + 8));
        }
        if (y) {
            _mm256_storeu_ps(y + i, s0);
            _mm256_storeu_ps(y + i + 8, s1);
        }
        a0 = _mm256_add_ps(a0, s0);
        a1 = _mm256_add_ps(a1, s1);
    }
    sum = hsum(_mm256_add_ps(a0, a1));
#endif
    for (; i < n; ++i) {
        float v = r ? x[i] + r[i] : x[i];
        if (y) y[i] = v;
        sum += v;
    }
    return sum;
}

static float row_centered_squares(const float *x, float mean, long n) {
    long i = 0;
    float sum = 0.0f;
#ifdef KILN_AVX2
    __m256 m = _mm256_set1_ps(mean), a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        __m256 d0 = _mm256_sub_ps(_mm256_loadu_ps(x + i), m), d1 = _mm256_sub_ps(_mm256_loadu_ps(x + i + 8), m);
        a0 = _mm256_fmadd_ps(d0, d0, a0);
        a1 = _mm256_fmadd_ps(d1, d1, a1);
    }
    sum = hsum(_mm256_add_ps(a0, a1));
#endif
    for (; i < n; ++i) { float d = x[i] - mean; sum += d * d; }
    return sum;
}

/* s_out: where s = x (+ r) is kept as an output of its own, or NULL (then s lives in y until normalized) */
static void ln_row(const float *x, const float *r, float *y, float *s_out, const float *scale, const float *bias,
                   long n, float epsilon, int rms) {
    float *s = s_out ? s_out : (r ? y : NULL);  /* where s is written, when it is not x itself */
    const float sum = s || !rms ? row_sum(x, r, s, n) : 0.0f;  /* RMSNorm sums only to write s */
    const float mean = rms ? 0.0f : sum / (float)n;
    if (s) x = s;
    const float rstd = 1.0f / sqrtf(row_centered_squares(x, mean, n) / (float)n + epsilon);
    for (long i = 0; i < n; ++i) {
        float v = (x[i] - mean) * rstd;
        if (scale) v *= scale[i];
        if (bias) v += bias[i];
        y[i] = v;
    }
}

static int max_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

typedef struct {
    const ln_plan *p;
    const float *x, *r;
    float *y, *s;
} ln_loop;

static void ln_item(void *loop, long item) {
    const ln_loop *l = (const ln_loop *)loop;
    const ln_plan *p = l->p;
    const long n = p->n, rr = p->residual_rows > 0 ? p->residual_rows : p->rows;
    const long last = (item + 1) * p->item_rows < p->rows ? (item + 1) * p->item_rows : p->rows;
    for (long row = item * p->item_rows; row < last; ++row)
        ln_row(l->x + row * n, l->r ? l->r + (row % rr) * n : NULL, l->y + row * n, l->s ? l->s + row * n : NULL,
               p->scale, p->bias, n, p->epsilon, p->rms);
}

int kiln_layer_norm(void *object, void *stream, int nargs, const void *args) {
    (void)stream; (void)nargs; (void)args;
    const ln_plan *p = (const ln_plan *)object;
    const float *x = (const float *)handle_of(p->get_handle, p->x);
    float *y = (float *)handle_of(p->get_handle, p->y);
    const float *r = p->residual ? (const float *)handle_of(p->get_handle, p->residual) : NULL;
    float *s = p->sum ? (float *)handle_of(p->get_handle, p->sum) : NULL;
    if (!x || !y || (p->residual && !r) || (p->sum && !s)) return 2;
    const long rows = p->rows, n = p->n, rr = p->residual_rows > 0 ? p->residual_rows : rows;
    if (p->parallel_for != NULL && p->item_rows > 0 && rows > p->item_rows) {
        ln_loop l = {p, x, r, y, s};
        return p->parallel_for((rows + p->item_rows - 1) / p->item_rows, max_threads(), ln_item, &l);
    }
    #pragma omp parallel for schedule(static) if (rows > p->grain)
    for (long row = 0; row < rows; ++row)
        ln_row(x + row * n, r ? r + (row % rr) * n : NULL, y + row * n, s ? s + row * n : NULL, p->scale, p->bias,
               n, p->epsilon, p->rms);
    return 0;
}

/* ---- Add (b repeating over a's leading rows) ---------------------------------------------------- */

typedef struct {
    get_handle_fn get_handle;
    void *a, *b, *y;
    long rows, n;  /* a, y: [rows, n] */
    long b_rows;   /* b: [b_rows, n], row r of a adds row r % b_rows */
    long grain;
    parallel_for_fn parallel_for;  /* as ln_plan's */
    long item_rows;
} add_plan;

typedef struct {
    const add_plan *p;
    const float *a, *b;
    float *y;
} add_loop;

static void add_rows(const add_plan *p, const float *a, const float *b, float *y, long first, long last) {
    const long n = p->n, br = p->b_rows;
    for (long row = first; row < last; ++row) {
        const float *ar = a + row * n, *bb = b + (row % br) * n;
        float *yr = y + row * n;
        for (long i = 0; i < n; ++i) yr[i] = ar[i] + bb[i];
    }
}

static void add_item(void *loop, long item) {
    const add_loop *l = (const add_loop *)loop;
    const long first = item * l->p->item_rows, last = first + l->p->item_rows;
    add_rows(l->p, l->a, l->b, l->y, first, last < l->p->rows ? last : l->p->rows);
}

int kiln_add(void *object, void *stream, int nargs, const void *args) {
    (void)stream; (void)nargs; (void)args;
    const add_plan *p = (const add_plan *)object;
    const float *a = (const float *)handle_of(p->get_handle, p->a);
    const float *b = (const float *)handle_of(p->get_handle, p->b);
    float *y = (float *)handle_of(p->get_handle, p->y);
    if (!a || !b || !y) return 2;
    const long rows = p->rows;
    if (p->parallel_for != NULL && p->item_rows > 0 && rows > p->item_rows) {
        add_loop l = {p, a, b, y};
        return p->parallel_for((rows + p->item_rows - 1) / p->item_rows, max_threads(), add_item, &l);
    }
    #pragma omp parallel for schedule(static) if (rows > p->grain)
    for (long row = 0; row < rows; ++row) add_rows(p, a, b, y, row, row + 1);
    return 0;
}

/* ---- Gather of table rows (embedding lookup) ---------------------------------------------------- */

typedef struct {
    get_handle_fn get_handle;
    void *ids, *y;       /* ids: int64 [count] */
    const float *table;  /* [vocab, n] */
    long count, vocab, n;
} gather_plan;

int kiln_gather_rows(void *object, void *stream, int nargs, const void *args) {
    (void)stream; (void)nargs; (void)args;
    const gather_plan *p = (const gather_plan *)object;
    const int64_t *ids = (const int64_t *)handle_of(p->get_handle, p->ids);
    float *y = (float *)handle_of(p->get_handle, p->y);
    if (!ids || !y) return 2;
    for (long i = 0; i < p->count; ++i) {
        int64_t id = ids[i];
        if (id < 0) id += p->vocab;
        if (id < 0 || id >= p->vocab) return 2;  /* ONNX: out of range is an error */
        memcpy(y + i * p->n, p->table + id * p->n, (size_t)p->n * sizeof(float));
    }
    return 0;
}

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
    parallel_for_fn parallel_for;  /* kiln_parallel_for (pool.c), or NULL: OpenMP */
} attention_plan;

#define QB 6    /* query rows computed together: a 6x16 tile of 12 accumulators, AVX2's GEMM shape */
#define KB 16   /* keys (or output dims) per register tile */

#ifdef KILN_AVX2
/* exp(x) for x <= 0 (a softmax's shifted scores), 8 lanes; below -87.3 it is exactly 0 as torch's is
   for a masked key. Cody-Waite reduction by ln 2, Cephes' expf polynomial: ~2 ulp. */
static inline __m256 exp_le0(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3f);
    __m256 keep = _mm256_cmp_ps(x, lo, _CMP_GE_OQ);
    x = _mm256_max_ps(x, lo);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), keep);
}
#endif

/* s[j] = s[j] * scale + m[j] (m NULL: no mask; additive float32, contiguous), returns max_j s[j] */
static float scale_add_max(float *s, long t, float scale, const float *m) {
    long j = 0;
    float max = -INFINITY;
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
    for (long j0 = 0; j0 < limit; j0 += KB) {
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

/* out_r = sum_{j < t} p[r][j] v_j for QB rows. v's first `full` dims in chunks of KB: chunk c's row j at
   chunks + c * chunk_stride + j * row_stride; the dims past them (Dv % KB) at tail + j * tail_stride. */
static void pv_tile(const float *p, long tp, long t, const float *chunks, long chunk_stride, long row_stride,
                    long full, const float *tail, long tail_stride, long Dv, float *const *orow) {
    long d0 = 0;
#ifdef KILN_AVX2
    for (; d0 + KB <= full; d0 += KB) {
        const float *vc = chunks + (d0 / KB) * chunk_stride;
        __m256 a[QB][2];
        for (int r = 0; r < QB; ++r) a[r][0] = a[r][1] = _mm256_setzero_ps();
        for (long j = 0; j < t; ++j) {
            __m256 v0 = _mm256_loadu_ps(vc + j * row_stride), v1 = _mm256_loadu_ps(vc + j * row_stride + 8);
            for (int r = 0; r < QB; ++r) {
                __m256 pr = _mm256_broadcast_ss(p + r * tp + j);
                a[r][0] = _mm256_fmadd_ps(pr, v0, a[r][0]);
                a[r][1] = _mm256_fmadd_ps(pr, v1, a[r][1]);
            }
        }
        for (int r = 0; r < QB; ++r) {
            _mm256_storeu_ps(orow[r] + d0, a[r][0]);
            _mm256_storeu_ps(orow[r] + d0 + 8, a[r][1]);
        }
    }
#endif
    for (; d0 < Dv; ++d0)
        for (int r = 0; r < QB; ++r) {
            float acc = 0.0f;
            for (long j = 0; j < t; ++j) acc += p[r * tp + j] * tail[j * tail_stride + d0];
            orow[r][d0] = acc;
        }
}

/* One (batch, head), its query rows [first, last). work: kᵀ blocks [tp / KB][D][KB], scores [QB][tp], a dump
   row [Dv], v's full chunks [Dv / KB][T][KB]. */
static void attention_head(const attention_plan *p, const float *q, const float *k, const float *v,
                           const void *mask, float *out, long b, long h, long first, long last, float *work) {
    const long S = last, T = p->T, D = p->D, Dv = p->Dv, tp = (T + KB - 1) / KB * KB;
    const long hk = h / (p->H / p->Hkv);
    const float *qb = q + b * p->qs[0] + h * p->qs[1];
    const float *kb = k + b * p->ks[0] + hk * p->ks[1];
    const float *vb = v + b * p->vs[0] + hk * p->vs[1];
    float *ob = out + b * p->os[0] + h * p->os[1];
    float *kt = work, *scores = work + D * tp, *dump = scores + QB * tp, *vpacked = dump + Dv;
    const long full = Dv / KB * KB;
    /* v as chunks of KB dims, each a contiguous [T][KB] stream, when enough query tiles read it */
    const float *chunks = vb;
    long chunk_stride = KB, row_stride = p->vs[2];
    if (S - first > QB && full > 0) {
        for (long c = 0; c < full / KB; ++c)
            for (long j = 0; j < T; ++j)
                memcpy(vpacked + (c * T + j) * KB, vb + j * p->vs[2] + c * KB, KB * sizeof(float));
        chunks = vpacked;
        chunk_stride = T * KB;
        row_stride = KB;
    }
    for (long j = 0; j < tp; ++j) {  /* kᵀ in blocks of KB keys, zeros past the last */
        float *dst = kt + (j / KB) * D * KB + j % KB;
        if (j < T) {
            const float *kj = kb + j * p->ks[2];
            for (long d = 0; d < D; ++d) dst[d * KB] = kj[d];
        } else {
            for (long d = 0; d < D; ++d) dst[d * KB] = 0.0f;
        }
    }
    const float scale = p->scale;
    for (long i0 = first; i0 < S; i0 += QB) {
        const float *qrow[QB];
        float *orow[QB];
        for (int r = 0; r < QB; ++r) {
            long i = i0 + r < S ? i0 + r : S - 1;  /* past the last row: recompute it, write nowhere */
            qrow[r] = qb + i * p->qs[2];
            orow[r] = i0 + r < S ? ob + i * p->os[2] : dump;
        }
        /* the causal mask hides keys past the last row of the tile: compute no further */
        long tmax = p->causal ? (i0 + QB < T ? i0 + QB : T) : T;
        long tpad = (tmax + KB - 1) / KB * KB;
        scores_tile(qrow, kt, D, tp, tpad, scores);
        for (int r = 0; r < QB; ++r) {
            long i = i0 + r < S ? i0 + r : S - 1;
            float *s = scores + r * tp;
            long t = p->causal ? (i + 1 < T ? i + 1 : T) : T;
            float max = -INFINITY;
            if (p->mask_kind == 1 && p->ms[3] == 1) {
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
            } else {
                max = scale_add_max(s, t, scale, NULL);
            }
            if (max == -INFINITY || isnan(max)) {  /* no key to attend to (or NaN scores): NaN, as softmax gives */
                for (long j = 0; j < tpad; ++j) s[j] = 0.0f;
                float fill = p->nan_to_zero && max == -INFINITY ? 0.0f : NAN;
                for (long j = 0; j < t; ++j) s[j] = fill;
                continue;
            }
            float inv = 1.0f / exp_shifted(s, t, max);
            for (long j = 0; j < t; ++j) s[j] *= inv;
            for (long j = t; j < tpad; ++j) s[j] = 0.0f;
        }
        pv_tile(scores, tp, tmax, chunks, chunk_stride, row_stride, full, vb, p->vs[2], Dv, orow);
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
    int failed;
} attention_loop;

/* Item = (batch·head, run of query rows). */
static void attention_item(void *loop, long item) {
    attention_loop *l = (attention_loop *)loop;
    const attention_plan *p = l->p;
    const long tp = (p->T + KB - 1) / KB * KB;
    float *work = thread_work(p->D * tp + QB * tp + p->Dv + p->T * (p->Dv / KB * KB));
    if (work == NULL) {
        __atomic_store_n(&l->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    const long bh = item / l->chunks, first = (item % l->chunks) * l->rows;
    const long last = first + l->rows < p->S ? first + l->rows : p->S;
    if (first < last)
        attention_head(p, l->q, l->k, l->v, l->mask, l->out, bh / p->H, bh % p->H, first, last, work);
}

int kiln_attention(void *object, void *stream, int nargs, const void *args) {
    (void)stream; (void)nargs; (void)args;
    const attention_plan *p = (const attention_plan *)object;
    const float *q = (const float *)handle_of(p->get_handle, p->q);
    const float *k = (const float *)handle_of(p->get_handle, p->k);
    const float *v = (const float *)handle_of(p->get_handle, p->v);
    float *out = (float *)handle_of(p->get_handle, p->out);
    const void *mask = p->mask_kind ? handle_of(p->get_handle, p->mask) : NULL;
    if (!q || !k || !v || !out || (p->mask_kind && !mask)) return 2;
    q += p->q_off; k += p->k_off; v += p->v_off;
    const long heads = p->B * p->H;
    /* one thread below ~4M multiply-adds (~0.1 ms): a parallel loop's end waits out any descheduled
       thread of a loaded machine, which costs more than small work gains */
    const int parallel = heads * p->S * p->T * (p->D + p->Dv) > (4L << 20) && (heads > 1 || p->S > 8 * QB);
#ifdef _OPENMP
    const int threads = parallel ? omp_get_max_threads() : 1;
#else
    const int threads = 1;
#endif
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
    attention_loop l = {p, q, k, v, mask, out, chunks, ((p->S + chunks - 1) / chunks + QB - 1) / QB * QB, 0};
    const long items = heads * chunks;
    if (p->parallel_for != NULL || threads <= 1) {
        if (p->parallel_for != NULL) p->parallel_for(items, threads, attention_item, &l);
        else for (long item = 0; item < items; ++item) attention_item(&l, item);
    } else {
        #pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
        for (long item = 0; item < items; ++item) attention_item(&l, item);
    }
    return l.failed ? 1 : 0;  /* 1: oneDNN's "out of memory" */
}

/* ---- Broadcasting elementwise ops of an exported attention mask's preparation -------------------
   Cast (to bool or float32), And, Or, Where (float32 branches) over up to 6 dims; each input's strides
   are 0 where it broadcasts; the output is contiguous. */

#define MAXD 6

typedef struct {
    get_handle_fn get_handle;
    void *in[3], *out;
    long dims[MAXD];         /* the output's, 1s in front */
    long strides[3][MAXD];   /* elements of each input */
    int op;                  /* 0 cast to bool, 1 cast to float32, 2 and, 3 or, 4 where */
    int src_type;            /* casts: 0 int64, 1 int32, 2 float32, 3 bool */
} broadcast_plan;

static inline int truth(const void *x, int type, long i) {
    switch (type) {
        case 0: return ((const int64_t *)x)[i] != 0;
        case 1: return ((const int32_t *)x)[i] != 0;
        case 2: return ((const float *)x)[i] != 0.0f;
        default: return ((const unsigned char *)x)[i] != 0;
    }
}

static inline float as_float(const void *x, int type, long i) {
    switch (type) {
        case 0: return (float)((const int64_t *)x)[i];
        case 1: return (float)((const int32_t *)x)[i];
        case 2: return ((const float *)x)[i];
        default: return (float)((const unsigned char *)x)[i];
    }
}

int kiln_broadcast(void *object, void *stream, int nargs, const void *args) {
    (void)stream; (void)nargs; (void)args;
    const broadcast_plan *p = (const broadcast_plan *)object;
    const int inputs = p->op == 4 ? 3 : (p->op >= 2 ? 2 : 1);
    const void *in[3] = {NULL, NULL, NULL};
    for (int k = 0; k < inputs; ++k)
        if ((in[k] = handle_of(p->get_handle, p->in[k])) == NULL) return 2;
    void *out = handle_of(p->get_handle, p->out);
    if (!out) return 2;
    const long n = p->dims[MAXD - 1];
    long outer = 1;
    for (int d = 0; d < MAXD - 1; ++d) outer *= p->dims[d];
    const long s0 = p->strides[0][MAXD - 1], s1 = p->strides[1][MAXD - 1], s2 = p->strides[2][MAXD - 1];
    for (long o = 0; o < outer; ++o) {
        long rem = o, off[3] = {0, 0, 0};
        for (int d = MAXD - 2; d >= 0; --d) {
            long i = rem % p->dims[d];
            rem /= p->dims[d];
            for (int k = 0; k < inputs; ++k) off[k] += i * p->strides[k][d];
        }
        const long base = o * n;
        switch (p->op) {
            case 0: {
                unsigned char *y = (unsigned char *)out + base;
                for (long j = 0; j < n; ++j) y[j] = (unsigned char)truth(in[0], p->src_type, off[0] + j * s0);
                break;
            }
            case 1: {
                float *y = (float *)out + base;
                for (long j = 0; j < n; ++j) y[j] = as_float(in[0], p->src_type, off[0] + j * s0);
                break;
            }
            case 2: case 3: {
                const unsigned char *a = (const unsigned char *)in[0] + off[0];
                const unsigned char *b = (const unsigned char *)in[1] + off[1];
                unsigned char *y = (unsigned char *)out + base;
                if (p->op == 2)
                    for (long j = 0; j < n; ++j) y[j] = (a[j * s0] != 0) & (b[j * s1] != 0);
                else
                    for (long j = 0; j < n; ++j) y[j] = (a[j * s0] != 0) | (b[j * s1] != 0);
                break;
            }
            default: {
                const unsigned char *c = (const unsigned char *)in[0] + off[0];
                const float *a = (const float *)in[1] + off[1], *b = (const float *)in[2] + off[2];
                float *y = (float *)out + base;
                for (long j = 0; j < n; ++j) y[j] = c[j * s0] ? a[j * s1] : b[j * s2];
                break;
            }
        }
    }
    return 0;
}

/* ---- GatherND (batch_dims 0): out[i] = data[indices[i, 0], .., indices[i, m-1]] (a slice of `rest`) -- */

typedef struct {
    get_handle_fn get_handle;
    void *data, *indices, *out;   /* indices: int64 [count, m] */
    long count, m, rest, element; /* rest: elements per slice; element: bytes per element */
    long dims[MAXD];              /* data's first m dims */
} gather_nd_plan;

int kiln_gather_nd(void *object, void *stream, int nargs, const void *args) {
    (void)stream; (void)nargs; (void)args;
    const gather_nd_plan *p = (const gather_nd_plan *)object;
    const char *data = (const char *)handle_of(p->get_handle, p->data);
    const int64_t *idx = (const int64_t *)handle_of(p->get_handle, p->indices);
    char *out = (char *)handle_of(p->get_handle, p->out);
    if (!data || !idx || !out) return 2;
    const long bytes = p->rest * p->element;
    for (long i = 0; i < p->count; ++i) {
        long at = 0;
        for (long j = 0; j < p->m; ++j) {
            int64_t k = idx[i * p->m + j];
            if (k < 0) k += p->dims[j];
            if (k < 0 || k >= p->dims[j]) return 2;  /* ONNX: out of range is an error */
            at = at * p->dims[j] + k;
        }
        if (bytes == 1) out[i] = data[at];
        else memcpy(out + i * bytes, data + at * bytes, (size_t)bytes);
    }
    return 0;
}
