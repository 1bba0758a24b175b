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
 *   kiln_layer_norm_quantize
 *                     the same with an 8-bit residual dequantized as read and/or y stored 8 bits (QDQ BERT)
 *   kiln_add          y = a + b, b repeating over a's leading rows
 *   kiln_gather_rows  y[r] = table[ids[r]] (an embedding lookup; int64 ids, negative ones from the end)
 *   kiln_attention    softmax(q kᵀ scale + mask) v per (batch, head): attention.c, compiled with this file
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

typedef void (*kiln_item_fn)(void *ctx, long item);

/* gemm.c's thread pool (pool.c: a worker descheduled before it claimed an item is not waited for), set by
   kiln/kernels/cpu/transformer.py when the GEMM library is built; NULL: an OpenMP loop. */
void (*kiln_shared_parallel_for)(long count, int threads, kiln_item_fn fn, void *ctx) = NULL;

/* the loops of more than one item the calling thread ran on more than one thread: what a test reads to see a
   layer split (kiln_parallel_loops; transformer.parallel_loops) */
static __thread long parallel_loops;

long kiln_parallel_loops(void) { return parallel_loops; }

/* fn(ctx, item) for each item in [0, count) on up to `threads` threads */
static void parallel_items(long count, int threads, kiln_item_fn fn, void *ctx) {
    if (threads > 1 && count > 1) ++parallel_loops;
    if (kiln_shared_parallel_for != NULL && threads > 1 && count > 1) {
        kiln_shared_parallel_for(count, threads, fn, ctx);
        return;
    }
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1 && count > 1)
    for (long i = 0; i < count; ++i) fn(ctx, i);
}

/* parallel_items on OpenMP's team always, never gemm.c's pool: for a short streaming step between oneDNN layers in a
   native segment (a DenseNet's BN-ReLU chains and Concats), whose team has just left oneDNN's previous layer and
   waits for its next one awake (libgomp's spin, kiln/kernels/cpu/omp_governor.py), where the pool's worker has
   gone to sleep 30 us after its last loop and its wake-up takes about as long as the step: on the pool the caller ran
   nearly every item itself (bench/results/zoo-2threads-zen4-2026-12-07d.md). In a segment's serial form OpenMP's
   count is 1: one thread, no region. */
static void team_items(long count, int threads, kiln_item_fn fn, void *ctx) {
    if (threads > 1 && count > 1) ++parallel_loops;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1 && count > 1)
    for (long i = 0; i < count; ++i) fn(ctx, i);
}

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
    long grain;  /* rows per OpenMP chunk; rows <= grain: one thread (kiln_layer_norm_quantize: kiln_quantized_split) */
    int rms;     /* RMSNorm: no mean taken out, s / sqrt(mean(s²) + eps) */
    /* kiln_layer_norm_quantize only (kiln::LayerNormQuantize, CPU): */
    int residual_8bit;     /* 0: the residual is float32; 1: uint8, 2: int8, dequantized (r - z)·s as it is read */
    float residual_q[2];   /* the residual's scale, zero point */
    int out_8bit;          /* 1: y is stored uint8, 2: int8, saturate(round_half_even(y / s) + z) */
    float out_q[4];        /* scale, zero point, qmin, qmax */
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

#if defined(__AVX512F__) && defined(KILN_AVX2)
/* 1: rows of at most NARROW_WIDTH floats take ln_row_narrow (kiln/kernels/cpu/transformer.py set_narrow_norm: a
   bench's other side) */
int kiln_layer_norm_narrow = 1;
#define NARROW_WIDTH 64

/* ln_row for a row of n <= 64 floats held in up to four zmm registers (masked past n): read once, each reduction a
   single vector's, no scalar tail. Why: ConvNeXt's channel norms in its first stages are rows of 16 and 32 (its CI
   variant's [2, 256, 16]: 512 rows); ln_row's 16-float loops, horizontal sums and scalar tails cost ~20 ns a row
   there, 10 µs a norm on the Zen 4 EPYC, where onnxruntime's whole network takes 280 µs
   (bench/results/small-zen4-2026-12-06.md). */
static inline __attribute__((always_inline)) void ln_row_narrow(const float *x, const float *r, float *y,
                                                                 float *s_out, const float *scale, const float *bias,
                                                                 long n, float epsilon, int rms, float inv_n) {
    __m512 v[4];
    __mmask16 m[4];
    __m512 acc = _mm512_setzero_ps();
    const int k = (int)((n + 15) / 16);
    for (int j = 0; j < 4; ++j) {
        if (j >= k) break;
        const long left = n - 16L * j;
        m[j] = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
        v[j] = _mm512_maskz_loadu_ps(m[j], x + 16 * j);
        if (r) v[j] = _mm512_add_ps(v[j], _mm512_maskz_loadu_ps(m[j], r + 16 * j));
        if (s_out) _mm512_mask_storeu_ps(s_out + 16 * j, m[j], v[j]);
        acc = _mm512_add_ps(acc, v[j]);
    }
    const float mean = rms ? 0.0f : _mm512_reduce_add_ps(acc) * inv_n;
    const __m512 mv = _mm512_set1_ps(mean);
    __m512 sq = _mm512_setzero_ps();
    for (int j = 0; j < 4; ++j) {
        if (j >= k) break;
        v[j] = _mm512_maskz_sub_ps(m[j], v[j], mv);  /* zeros past n */
        sq = _mm512_fmadd_ps(v[j], v[j], sq);
    }
    const __m512 rstd = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(sq) * inv_n + epsilon));
    for (int j = 0; j < 4; ++j) {
        if (j >= k) break;
        __m512 o = _mm512_mul_ps(v[j], rstd);
        if (scale) o = _mm512_mul_ps(o, _mm512_maskz_loadu_ps(m[j], scale + 16 * j));
        if (bias) o = _mm512_add_ps(o, _mm512_maskz_loadu_ps(m[j], bias + 16 * j));
        _mm512_mask_storeu_ps(y + 16 * j, m[j], o);
    }
}
#endif

static int max_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

/* Elements of a quantized transformer's 8-bit layers (an Elementwise chain that reads or writes 8 bits, a
   LayerNormQuantize) past which their rows are shared among the threads; below, one thread runs them. They cost
   ~0.5-1.3 ns an element on one thread (AVX2 Zen 3), so this is ~0.1 ms of work (attention.c's rule). Measured
   alone at 2 threads after a torch GEMM (the engine's order: the pool's worker asleep, OpenMP's spinning), load
   7-10: the split lost at every size below 98K elements (+20-40 µs a call at BERT-tiny's 8-33K) and was mixed from
   98K to 393K (0.72-1.24x; bench/qdq_split_sweep.py, bench/results/qdq-threads-2026-12-07.md). Float layers keep
   their plans' grain (PARALLEL_ELEMENTS). Set by transformer.set_quantized_split (a benchmark's other side, a
   test's). */
long kiln_quantized_split = 131072;

int kiln_layer_norm(void *object, void *stream, int nargs, const void *args) {
    (void)stream; (void)nargs; (void)args;
    const ln_plan *p = (const ln_plan *)object;
    const float *x = (const float *)handle_of(p->get_handle, p->x);
    float *y = (float *)handle_of(p->get_handle, p->y);
    const float *r = p->residual ? (const float *)handle_of(p->get_handle, p->residual) : NULL;
    float *s = p->sum ? (float *)handle_of(p->get_handle, p->sum) : NULL;
    if (!x || !y || (p->residual && !r) || (p->sum && !s)) return 2;
    const long rows = p->rows, n = p->n, rr = p->residual_rows > 0 ? p->residual_rows : rows;
#if defined(__AVX512F__) && defined(KILN_AVX2)
    if (kiln_layer_norm_narrow && n <= NARROW_WIDTH) {
        const float inv_n = 1.0f / (float)n;
        #pragma omp parallel for schedule(static) if (rows > p->grain)
        for (long row = 0; row < rows; ++row)
            ln_row_narrow(x + row * n, r ? r + (row % rr) * n : NULL, y + row * n, s ? s + row * n : NULL, p->scale,
                          p->bias, n, p->epsilon, p->rms, inv_n);
        return 0;
    }
#endif
    #pragma omp parallel for schedule(static) if (rows > p->grain)
    for (long row = 0; row < rows; ++row)
        ln_row(x + row * n, r ? r + (row % rr) * n : NULL, y + row * n, s ? s + row * n : NULL, p->scale, p->bias,
               n, p->epsilon, p->rms);
    return 0;
}

/* ---- LayerNorm with 8-bit residual / output (kiln::LayerNormQuantize) ---------------------------- */

/* elementwise.c's 8-bit reads and stores (16 lanes where the CPU has them): DequantizeLinear's (q - z)·s and
   QuantizeLinear's saturate(round_half_even(y / s) + z), per element as kiln_quantize's loops compute them */
static void ew_dequantize(const void *x, long s, int is_signed, float sc, float z, float *restrict r, long n);
static void ew_quantize(const float *restrict r, const float *q, int is_signed, void *y, long n);

/* noinline: the row's float residual goes through memory, so the compiler cannot contract the dequantization's ·s
   into the norm's x + r (an FMA would round once where the separate steps round twice) */
static __attribute__((noinline)) void ln_dequantize_row(const void *q, int is_signed, float s, float z, float *r,
                                                        long n) {
    ew_dequantize(q, 1, is_signed, s, z, r, n);
}

/* kiln_layer_norm whose residual is 8 bits and/or whose y is stored 8 bits (QuantizeLinear's rounding, as
 * kiln_quantize stores it). Why: onnxruntime's QDQ BERT quantizes each LayerNorm's output for
 * the next GEMMs and dequantizes it again for the next norm's residual: two steps a norm, each a pass over the
 * tensor in memory (QDQ BERT-tiny: 4 + 4 of its 44). Blocks of rows go through two float buffers (on the stack,
 * in L1/L2): the residual dequantized into one before the norm reads it, y written into the other and then
 * quantized, with the same float32 operations per element as the separate steps, so the result is theirs bit for
 * bit (tests/unit/test_int8_layernorm_fusion.py). */
#define LNQ_BLOCK 4096  /* elements a block of rows takes through the buffers (rows of more: one row a block) */
#define LNQ_CHUNK 256   /* ew_quantize's longest call (its AVX2 tail's buffer: EW_CHUNK, elementwise.c) */

typedef struct {
    const ln_plan *p;
    const float *x;
    const void *r;
    void *y;
    long per_block;
} lnq_loop;

/* rows [block·per_block, ...) through the buffers: one long dequantize / quantize loop per block, as the separate
   steps' (a call per row of 128 cost ~2 µs more a norm of BERT-tiny's [128, 128] than their passes) */
static void lnq_block(void *loop, long block) {
    const lnq_loop *l = (const lnq_loop *)loop;
    const ln_plan *p = l->p;
    const long rows = p->rows, n = p->n, rr = p->residual_rows > 0 ? p->residual_rows : rows;
    const int r8 = l->r != NULL && p->residual_8bit, y8 = p->out_8bit;
    const size_t rsize = r8 ? 1 : sizeof(float), ysize = y8 ? 1 : sizeof(float);
    const long first = block * l->per_block, last = first + l->per_block < rows ? first + l->per_block : rows;
    float stack[2 * LNQ_BLOCK] __attribute__((aligned(64)));
    float *heap = n > LNQ_BLOCK ? (float *)malloc(sizeof(float) * (size_t)(2 * n)) : NULL;
    float *rbuf = heap ? heap : stack, *ybuf = heap ? heap + n : stack + LNQ_BLOCK;
    if (n > LNQ_BLOCK && heap == NULL) return;  /* (kiln_layer_norm_quantize checked the allocation first) */
    if (r8 && rr == rows)  /* the block's residual rows at once */
        ln_dequantize_row((const char *)l->r + first * n, p->residual_8bit == 2, p->residual_q[0], p->residual_q[1],
                          rbuf, (last - first) * n);
    for (long row = first; row < last; ++row) {
        const char *rrow = l->r ? (const char *)l->r + (size_t)((row % rr) * n) * rsize : NULL;
        const float *rf = (const float *)rrow;
        if (r8) {
            rf = rbuf + (row - first) * n;
            if (rr != rows)  /* a residual repeating over the rows: its row */
                ln_dequantize_row(rrow, p->residual_8bit == 2, p->residual_q[0], p->residual_q[1],
                                  rbuf + (row - first) * n, n);
        }
        float *yf = y8 ? ybuf + (row - first) * n : (float *)((char *)l->y + (size_t)(row * n) * ysize);
#if defined(__AVX512F__) && defined(KILN_AVX2)
        if (kiln_layer_norm_narrow && n <= NARROW_WIDTH)
            ln_row_narrow(l->x + row * n, rf, yf, NULL, p->scale, p->bias, n, p->epsilon, p->rms, 1.0f / (float)n);
        else
#endif
            ln_row(l->x + row * n, rf, yf, NULL, p->scale, p->bias, n, p->epsilon, p->rms);
    }
    if (y8)
        for (long c = 0; c < (last - first) * n; c += LNQ_CHUNK) {
            const long m = (last - first) * n - c < LNQ_CHUNK ? (last - first) * n - c : LNQ_CHUNK;
            ew_quantize(ybuf + c, p->out_q, y8 == 2, (char *)l->y + first * n + c, m);
        }
    free(heap);
}

int kiln_layer_norm_quantize(void *object, void *stream, int nargs, const void *args) {
    (void)stream; (void)nargs; (void)args;
    const ln_plan *p = (const ln_plan *)object;
    lnq_loop l = {p, (const float *)handle_of(p->get_handle, p->x),
                  p->residual ? handle_of(p->get_handle, p->residual) : NULL, handle_of(p->get_handle, p->y),
                  p->n < LNQ_BLOCK ? LNQ_BLOCK / p->n : 1};
    if (!l.x || !l.y || (p->residual && !l.r) || p->sum || p->n < 1) return 2;
    if (p->n > LNQ_BLOCK) {  /* rows wider than the stack buffers: each block allocates its own */
        void *probe = malloc(sizeof(float) * (size_t)(2 * p->n));
        if (probe == NULL) return 2;
        free(probe);
    }
    const long blocks = (p->rows + l.per_block - 1) / l.per_block;
    parallel_items(blocks, p->rows * p->n > kiln_quantized_split ? max_threads() : 1, lnq_block, &l);
    return 0;
}

/* ---- Add (b repeating over a's leading rows) ---------------------------------------------------- */

typedef struct {
    get_handle_fn get_handle;
    void *a, *b, *y;
    long rows, n;  /* a, y: [rows, n] */
    long b_rows;   /* b: [b_rows, n], row r of a adds row r % b_rows */
    long grain;
} add_plan;

static void add_rows(const add_plan *p, const float *a, const float *b, float *y, long first, long last) {
    const long n = p->n, br = p->b_rows;
    for (long row = first; row < last; ++row) {
        const float *ar = a + row * n, *bb = b + (row % br) * n;
        float *yr = y + row * n;
        for (long i = 0; i < n; ++i) yr[i] = ar[i] + bb[i];
    }
}


int kiln_add(void *object, void *stream, int nargs, const void *args) {
    (void)stream; (void)nargs; (void)args;
    const add_plan *p = (const add_plan *)object;
    const float *a = (const float *)handle_of(p->get_handle, p->a);
    const float *b = (const float *)handle_of(p->get_handle, p->b);
    float *y = (float *)handle_of(p->get_handle, p->y);
    if (!a || !b || !y) return 2;
    const long rows = p->rows;
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
                /* unit or zero strides (a mask over a contiguous bias, a scalar fill): loops the compiler
                   vectorizes; the general strided loop otherwise */
                if (s0 == 1 && s1 == 1 && s2 == 0) {
                    const float fill = b[0];
                    for (long j = 0; j < n; ++j) y[j] = c[j] ? a[j] : fill;
                } else if (s0 == 1 && s1 == 0 && s2 == 1) {
                    const float fill = a[0];
                    for (long j = 0; j < n; ++j) y[j] = c[j] ? fill : b[j];
                } else if (s0 == 1 && s1 == 1 && s2 == 1) {
                    for (long j = 0; j < n; ++j) y[j] = c[j] ? a[j] : b[j];
                } else {
                    for (long j = 0; j < n; ++j) y[j] = c[j * s0] ? a[j * s1] : b[j * s2];
                }
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

/* ---- Rotary position embedding (kiln::Rotary, rotate-half form) ---------------------------------
   x contiguous, viewed as [n0, n1, n2, D]: y = x·cos + rotate_half(x)·sin for the first `rotate` of the
   n2 (heads) axis, rotate_half(x) = (-x[D/2:], x[:D/2]); the other heads are copied (a packed q|k|v whose v
   is not rotated). cos and sin at element strides over (n0, n1, n2) (0 where they broadcast), their last
   axis contiguous. */

typedef struct {
    get_handle_fn get_handle;
    void *x, *cos, *sin, *y;
    long n0, n1, n2, D, rotate;
    long cs[3], ss[3];
} rotary_plan;

int kiln_rotary(void *object, void *stream, int nargs, const void *args) {
    (void)stream; (void)nargs; (void)args;
    const rotary_plan *p = (const rotary_plan *)object;
    const float *x = (const float *)handle_of(p->get_handle, p->x);
    const float *c = (const float *)handle_of(p->get_handle, p->cos);
    const float *s = (const float *)handle_of(p->get_handle, p->sin);
    float *y = (float *)handle_of(p->get_handle, p->y);
    if (!x || !c || !s || !y) return 2;
    const long half = p->D / 2, rows = p->n0 * p->n1;
    #pragma omp parallel for schedule(static) if (rows * p->n2 * p->D > (1L << 20))
    for (long r = 0; r < rows; ++r) {
        const long i0 = r / p->n1, i1 = r % p->n1;
        for (long h = 0; h < p->n2; ++h) {
            const float *xi = x + (r * p->n2 + h) * p->D;
            float *yo = y + (r * p->n2 + h) * p->D;
            if (h >= p->rotate) {
                memcpy(yo, xi, (size_t)p->D * sizeof(float));
                continue;
            }
            const float *ci = c + i0 * p->cs[0] + i1 * p->cs[1] + h * p->cs[2];
            const float *si = s + i0 * p->ss[0] + i1 * p->ss[1] + h * p->ss[2];
            for (long j = 0; j < half; ++j) yo[j] = xi[j] * ci[j] - xi[half + j] * si[j];
            for (long j = 0; j < half; ++j) yo[half + j] = xi[half + j] * ci[half + j] + xi[j] * si[half + j];
        }
    }
    return 0;
}
