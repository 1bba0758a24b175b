/* Squeeze-and-excitation as one layer, a member of native segments (kiln/runtime/native.py): compiled once
 * by kiln/kernels/cpu/se.py through native_loop.build (-O3 -march=native -fopenmp).
 *
 *   y[n, p, c] = x[n, p, c] * gate(W2 act(W1 mean_p(x[n, :, :]) + b1) + b2)[c]
 *
 * x and y are NHWC ([N, H*W, C] row-major: channels contiguous), the layout every 4-D activation has
 * inside a segment. One parallel region: each thread sums its own rows into partial sums per image (in
 * float over BLOCK runs of rows, then in double: a 112x112 map is 12544 rows), one thread turns the
 * means into the gate (two GEMVs of at most a few hundred thousand multiply-adds), then every thread scales
 * its rows. Written this way the block reads x twice (a 1.6 MB map of EfficientNet-B0's first stage stays
 * in the caches between the two passes) where the unfused graph read it three times and wrote two small
 * tensors through four primitives.
 *
 * kiln_silu: x = x·σ(x) in place, the SiLU of the convolutions around an SE block when it is cheaper here than
 * oneDNN's swish post-op (kiln/kernels/cpu/conv_silu.py): on an AMD EPYC (Zen 4) core that post-op costs
 * 0.55-1.1 ns an element with AVX2, ~0.5 with AVX-512; this loop (silu below) ~0.25 with AVX-512 and ~0.35-0.5
 * with AVX2, its pass over memory included (bench/se_kernels.py), before exp_poly.h's KILN_VSILU took 0.61-0.78x
 * of its SiLU's time (bench/silu_ab.py).
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

enum { ACT_NONE = 0, ACT_RELU = 1, ACT_SILU = 2, ACT_HARD_SWISH = 3, ACT_CLIP = 4, ACT_LEAKY_RELU = 5,
       ACT_SIGMOID = 6, ACT_HARD_SIGMOID = 7 };

typedef struct {
    get_handle_fn get_handle;
    void *x, *y;                  /* dnnl_memory_t: NHWC [N, HW, C] */
    const float *w1, *b1;         /* [R, C]; [R] or NULL */
    const float *w2t, *b2;        /* W2 transposed: [R, C]; [C] or NULL */
    double *partial;              /* [threads][N][C] */
    float *block;                 /* [threads][max(C, FLAT)]: a run's float sums, then the gate repeated */
    float *gate;                  /* [N][C] */
    float *hidden;                /* [N][R] */
    long N, HW, C, R;
    int activation;               /* of the hidden layer */
    float alpha, beta;
    int gate_kind;                /* ACT_SIGMOID or ACT_HARD_SIGMOID */
    float gate_alpha, gate_beta;
    int threads;                  /* the partial sums' room; 1: no parallel region */
} se_plan;

#define BLOCK 64

#pragma GCC push_options
#pragma GCC optimize("no-trapping-math")  /* selects below vectorise (kiln never unmasks FP exceptions) */

#if defined(__AVX512F__) || defined(__AVX2__)
#if defined(__AVX512F__)
#define SILU_LANES 16
#define SILU_MIN _mm512_min_ps
#define SILU_MAX _mm512_max_ps
#else
#define SILU_LANES 8
#define SILU_MIN _mm256_min_ps
#define SILU_MAX _mm256_max_ps
#endif
typedef float silu_v __attribute__((vector_size(SILU_LANES * 4)));
typedef int silu_vi __attribute__((vector_size(SILU_LANES * 4)));

/* x·σ(x) on a vector: exp_poly.h's rational form (one division; ≤ 3.4 ulp against float64, inf and NaN as
   stated there; tests/unit/test_conv_silu.py). It replaced exp_poly's steps with a degree-5 polynomial and
   x / (1 + e^-x), which cost 0.24-0.34 ns an element with AVX-512 and 0.35-0.50 with AVX2 over B0's maps on a
   Zen 4 core; the rational form 0.79x and 0.64x that per element (bench/silu_accuracy.py). */
KILN_VSILU(silu_vector, static inline, silu_v, silu_vi, SILU_MIN, SILU_MAX)

static void silu(float *v, long n) {
    long j = 0;
    for (; j + SILU_LANES <= n; j += SILU_LANES) {
        silu_v x;
        memcpy(&x, v + j, sizeof x);
        x = silu_vector(x);
        memcpy(v + j, &x, sizeof x);
    }
    if (j < n) {  /* the tail in a zero-padded vector */
        silu_v x = {0};
        memcpy(&x, v + j, (size_t)(n - j) * sizeof(float));
        x = silu_vector(x);
        memcpy(v + j, &x, (size_t)(n - j) * sizeof(float));
    }
}
#else
static void silu(float *v, long n) {
    for (long j = 0; j < n; ++j) v[j] = silu_scalar(v[j]);
}
#endif

static void activate(float *v, long n, int kind, float alpha, float beta) {
    switch (kind) {
    case ACT_RELU:
        for (long j = 0; j < n; ++j) v[j] = v[j] > 0.0f ? v[j] : 0.0f;
        break;
    case ACT_SILU:
        silu(v, n);
        break;
    case ACT_HARD_SWISH:  /* x·relu6(x + 3)/6 */
        for (long j = 0; j < n; ++j) {
            float t = v[j] + 3.0f;
            t = t < 0.0f ? 0.0f : (t > 6.0f ? 6.0f : t);
            v[j] = v[j] * t * (1.0f / 6.0f);
        }
        break;
    case ACT_CLIP:  /* alpha = min, beta = max */
        for (long j = 0; j < n; ++j) v[j] = v[j] < alpha ? alpha : (v[j] > beta ? beta : v[j]);
        break;
    case ACT_LEAKY_RELU:
        for (long j = 0; j < n; ++j) v[j] = v[j] >= 0.0f ? v[j] : alpha * v[j];
        break;
    case ACT_SIGMOID:
        for (long j = 0; j < n; ++j) v[j] = 1.0f / (1.0f + exp_poly(-v[j]));
        break;
    case ACT_HARD_SIGMOID:  /* max(0, min(1, alpha·x + beta)) */
        for (long j = 0; j < n; ++j) {
            float t = alpha * v[j] + beta;
            v[j] = t < 0.0f ? 0.0f : (t > 1.0f ? 1.0f : t);
        }
        break;
    default:
        break;
    }
}

#pragma GCC pop_options

typedef struct {
    get_handle_fn get_handle;
    void *x;                      /* dnnl_memory_t: n floats, overwritten */
    long n;
    int threads;                  /* 1: no parallel region */
} silu_plan;

#define SILU_CHUNK 4096

int kiln_silu(void *object, void *stream, int nargs, const void *args) {
    (void)stream; (void)nargs; (void)args;
    const silu_plan *p = (const silu_plan *)object;
    float *x = NULL;
    if (p->get_handle(p->x, (void **)&x) != 0 || x == NULL) return 2;
    const long chunks = (p->n + SILU_CHUNK - 1) / SILU_CHUNK;
    #pragma omp parallel for schedule(static) num_threads(p->threads) if (p->threads > 1)
    for (long k = 0; k < chunks; ++k) {
        const long lo = k * SILU_CHUNK;
        silu(x + lo, p->n - lo < SILU_CHUNK ? p->n - lo : SILU_CHUNK);
    }
    return 0;
}

/* Both passes run over `rows_at_once(C)` rows at a time as one flat run of floats, the channel pattern
   repeated: with a loop per row, B0's 32-channel map of 12544 rows paid a row's loop overhead for two vectors
   of work (0.115 ms against 0.085 for torch's unfused mean and mul). The block scratch holds one such run:
   [threads][max(C, FLAT)] floats (se.py allocates it so). */
#define FLAT 512
#define FLAT_ROOM(C) ((C) > FLAT ? (C) : FLAT)  /* a thread's block scratch */
static long rows_at_once(long C) { return C >= FLAT ? 1 : FLAT / C; }

/* rows [lo, hi) of the flattened [N*HW, C] input summed into partial[n][c] (zeroed by the caller): in float
   over BLOCK runs of rows, then in double */
static void sum_rows(const se_plan *p, const float *x, long lo, long hi, double *partial, float *restrict block) {
    const long C = p->C, HW = p->HW, m = rows_at_once(C);
    long r = lo;
    while (r < hi) {
        const long n = r / HW;
        long end = (n + 1) * HW;
        if (end > hi) end = hi;
        if (end > r + BLOCK * m) end = r + BLOCK * m;
        const long width = (end - r < m ? end - r : m) * C;
        memset(block, 0, (size_t)width * sizeof(float));
        for (long q = r; q < end; q += m) {
            const float *run = x + q * C;
            const long k_end = end - q < m ? (end - q) * C : width;
            for (long k = 0; k < k_end; ++k) block[k] += run[k];
        }
        double *acc = partial + n * C;
        for (long k = 0; k < width; k += C)
            for (long c = 0; c < C; ++c) acc[c] += block[k + c];
        r = end;
    }
}

/* sum_c a[c]·b[c] in LANES independent sums: one running sum is a chain of dependent adds the compiler may
   not reorder (no -ffast-math), 4 cycles each; 1152 x 48 of them made the GEMV of B0's last blocks ~55 µs */
#define LANES 16
static float dot(const float *a, const float *b, long n) {
    float acc[LANES] = {0.0f};
    long c = 0;
    for (; c + LANES <= n; c += LANES)
        for (int l = 0; l < LANES; ++l) acc[l] += a[c + l] * b[c + l];
    float s = 0.0f;
    for (; c < n; ++c) s += a[c] * b[c];
    for (int l = 0; l < LANES; ++l) s += acc[l];
    return s;
}

/* gate[n] from the means of image n (partials of `threads` threads) */
static void excite(const se_plan *p, int threads, long n) {
    const long C = p->C, R = p->R;
    float *gate = p->gate + n * C, *hidden = p->hidden + n * R;
    const double inv = 1.0 / (double)p->HW;
    for (long c = 0; c < C; ++c) {
        double s = 0.0;
        for (int t = 0; t < threads; ++t) s += p->partial[((long)t * p->N + n) * C + c];
        gate[c] = (float)(s * inv);  /* the mean, for now */
    }
    for (long r = 0; r < R; ++r) hidden[r] = dot(p->w1 + r * C, gate, C) + (p->b1 ? p->b1[r] : 0.0f);
    activate(hidden, R, p->activation, p->alpha, p->beta);
    for (long c = 0; c < C; ++c) gate[c] = p->b2 ? p->b2[c] : 0.0f;
    for (long r = 0; r < R; ++r) {
        const float *w = p->w2t + r * C;
        const float h = hidden[r];
        for (long c = 0; c < C; ++c) gate[c] += w[c] * h;
    }
    activate(gate, C, p->gate_kind, p->gate_alpha, p->gate_beta);
}

/* rows [lo, hi) scaled by their image's gate, repeated across the block scratch for flat runs of rows */
static void scale_rows(const se_plan *p, const float *x, float *y, long lo, long hi, float *restrict pattern) {
    const long C = p->C, HW = p->HW, m = rows_at_once(C);
    long r = lo;
    while (r < hi) {
        const long n = r / HW;
        const long end = (n + 1) * HW < hi ? (n + 1) * HW : hi;
        for (long j = 0; j < m; ++j) memcpy(pattern + j * C, p->gate + n * C, (size_t)C * sizeof(float));
        for (long q = r; q < end; q += m) {
            const float *run = x + q * C;
            float *out = y + q * C;  /* may be x: no restrict */
            const long k_end = (end - q < m ? end - q : m) * C;
            for (long k = 0; k < k_end; ++k) out[k] = run[k] * pattern[k];
        }
        r = end;
    }
}

int kiln_squeeze_excite(void *object, void *stream, int nargs, const void *args) {
    (void)stream; (void)nargs; (void)args;
    se_plan *p = (se_plan *)object;
    float *x = NULL, *y = NULL;
    if (p->get_handle(p->x, (void **)&x) != 0 || x == NULL) return 2;
    if (p->get_handle(p->y, (void **)&y) != 0 || y == NULL) return 2;
    const long rows = p->N * p->HW;
    int threads = p->threads;
    if (threads > omp_get_max_threads()) threads = omp_get_max_threads();
    if (threads < 1) threads = 1;
    memset(p->partial, 0, sizeof(double) * (size_t)threads * (size_t)(p->N * p->C));
    #pragma omp parallel num_threads(threads) if (threads > 1)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const long lo = rows * t / nt, hi = rows * (t + 1) / nt;
        sum_rows(p, x, lo, hi, p->partial + (long)t * p->N * p->C, p->block + (long)t * FLAT_ROOM(p->C));
        #pragma omp barrier
        #pragma omp for schedule(static)
        for (long n = 0; n < p->N; ++n) excite(p, nt, n);
        /* the for's barrier: every gate is ready */
        scale_rows(p, x, y, lo, hi, p->block + (long)t * FLAT_ROOM(p->C));
    }
    return 0;
}
