/* kiln's own FP32 GEMM for linear layers: y = epilogue(x @ Wᵀ), x [M, K] row-major, W [N, K] constant.
 * Compiled at first use by kiln/kernels/cpu/native_loop.py (-O3 -march=native -fopenmp), wrapped by
 * kiln/kernels/cpu/gemm_native.py.
 *
 * GotoBLAS/BLIS structure. W is packed once, at engine load, into panels of NR columns holding the
 * whole K: packed[p][k][j] = W[p*NR + j][k] (zeros past N), so a kc x NR micro-panel is contiguous
 * and stays in L1 while the microkernel runs down the rows. Up to a few MB of x (kiln_gemm_plan.small_m,
 * set by gemm_native.py) the tiles read x in place over the whole K: each W panel streams once, the rows
 * of x come from L2/L3, and a call is one fork/join. Past it, the K-blocked loop: kc x NR micro-panels of
 * W in L1, C tiles revisited per K block, x read in place (one fork/join) or, past pack_m rows, packed per
 * call into MR-row panels per M block of up to MC rows (GotoBLAS; two barriers per M block, which a thread
 * descheduled by other work holds up: off by default, gemm_native.py says why).
 * The microkernel keeps an MR x NR tile of C in registers: 6x16 on AVX2+FMA (12 ymm
 * accumulators), 8x48 (24 zmm) on AVX-512 for linear layers and 14x32 (28 zmm) for the recurrent kernels,
 * chosen at run time from cpuid (__builtin_cpu_supports), so one build runs on either. Written with GCC vector extensions: one template, instantiated per ISA by
 * a target attribute; "a*b + c" contracts to FMA (GNU C's default -ffp-contract=fast).
 *
 * The epilogue is kiln::FusedGemm's (kiln/ops/fused.py): + bias, the activation, the residual before or
 * after it. The bias is where a tile's sums start (its first K block); erf-GELU without a residual is applied
 * by the tile to its sums before the store (KILN_TILE_GELU, its last K block); the rest to each C tile right
 * after its last K block, while the tile is in L1 (erf-GELU in AVX-512 / AVX2 registers by cpuid, a table of
 * polynomials: kiln_gelu_avx512). The
 * 8x48 tile has edge tiles for a last panel of 16 or 32 columns (tile_for).
 * Threads: kiln_parallel_for (pool.c, compiled in front of this file) over work items (row group, panel
 * chunk) claimed dynamically, so a core slowed by other work takes fewer of them, and a worker descheduled
 * before it claimed any is not waited for; the packed GotoBLAS path (off by default) stays on OpenMP.
 */
#include <stddef.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "exp_poly.h"  /* exp_poly: the activations' σ and GELU-tanh; KILN_VSILU, silu_scalar: SiLU, SwiGLU */

typedef int (*get_handle_fn)(void *memory, void **handle);

/* Activations (kiln/kernels/cpu/gemm_native.py: ACTIVATIONS). */
enum { ACT_NONE, ACT_RELU, ACT_CLIP, ACT_LEAKY_RELU, ACT_GELU, ACT_GELU_TANH, ACT_TANH, ACT_SIGMOID, ACT_SILU,
       ACT_HARD_SIGMOID, ACT_HARD_SWISH, ACT_SWIGLU };

typedef struct {
    get_handle_fn get_handle;   /* dnnl_memory_get_data_handle when src/dst/residual are oneDNN memories
                                   (a native segment rebinds those), NULL when they are the addresses */
    void *src, *dst, *residual; /* residual NULL: none */
    const float *packed_w;      /* kiln_gemm_pack_w's layout for `kernel` */
    const float *bias;          /* [N] or NULL */
    float *scratch;             /* kiln_gemm_scratch_floats() floats: packed A */
    long M, K, N;
    int kernel, threads;        /* threads <= 0: omp_get_max_threads() at each call */
    int activation;
    float alpha, beta;
    int residual_after;         /* 1: act(y) + r; 0: act(y + r) */
    long small_m;               /* up to this many rows, x is read in place over the whole K (GEMV-like) */
    long pack_m;                /* past this many rows, A is packed (else read in place, K-blocked) */
    long out_n;                 /* the output's width: N, or for ACT_SWIGLU the gated half (see swiglu_epilogue) */
    float *c_scratch;           /* ACT_SWIGLU past small_m rows: [M, N] floats of C before the gating */
} kiln_gemm_plan;

/* bias: NULL, or n floats the tile starts its sums from where it does not load C (the bias fused: no pass over C
   for it afterwards; measured 512 x 16 x 64 on a Zen 4 core: the epilogue's bias pass took 5.5 of 16.5 us).
   flags: KILN_TILE_LOAD_C adds C's values to the sums (a K block after the first; recurrent.c's gates: 0 or 1),
   KILN_TILE_GELU applies erf-GELU to the sums before the store (a layer whose epilogue past the bias is GELU alone,
   at its last K block): no pass over the tile after it (BERT-base's FFN up, 128 x 768 x 3072 on one Zen 4 core:
   the pass cost ~4% of the layer; bench/results/packed-2026-12-06.md, section 7). */
typedef void (*tile_fn)(int m, long k, const float *a, long lda, const float *b, float *c, long ldc, int n,
                        int flags, const float *bias);
enum { KILN_TILE_LOAD_C = 1, KILN_TILE_GELU = 2 };

/* erf(x) ≈ x·P(x²)/Q(x²) on [-4, 4], Eigen's / XLA's float32 coefficients (erf_rational, the `any` ISA's tiles) */
static const float KILN_ERF_P[7] = {-2.72614225801306e-10f, 2.77068142495902e-08f, -2.10102402082508e-06f,
                                    -5.69250639462346e-05f, -7.34990630326855e-04f, -2.95459980854025e-03f,
                                    -1.60960333262415e-02f};
static const float KILN_ERF_Q[5] = {-1.45660718464996e-05f, -2.13374055278905e-04f, -1.68282697438203e-03f,
                                    -7.37332916720468e-03f, -1.42647390514189e-02f};

typedef struct {
    const char *name;
    int mr, nr;
    long kc, mc;                /* K block (kc x nr floats of W in L1), M block (mc x kc floats of A in L2) */
    tile_fn packed, direct;     /* A packed [k][MR] / A row-major with leading dimension lda */
    tile_fn narrow;             /* A in place, up to narrow_mr rows x nr / 2 columns (half a panel), or NULL */
    int narrow_mr;
    int (*supported)(void);
    int test_only;              /* never picked by kiln: runs another ISA's tile shape on this one */
    int edge_w;                 /* edge tiles: columns of one vector, or 0 (none) */
    tile_fn edge_packed[2], edge_direct[2];  /* a panel's first edge_w / 2·edge_w columns (see tile_for) */
} kernel_desc;

/* ---- the microkernel template ------------------------------------------------------------------------
   NAME_rows: C[0:M, 0:NR] (+)= A[0:M, 0:k] B[0:k, 0:NR], A element (i, p) at a[i*rs + p*cs], B packed
   [k][NR]; M a constant once inlined, so the accumulators are registers. NAME_tile: any m <= MR rows,
   n <= NR columns (a partial tile goes through a buffer). */
#define KILN_UNROLL _Pragma("GCC unroll 16")

/* One k of the tile: ACC[i][j] += a[i, p] · B[p, j-th vector] for its M rows. */
#define KILN_FMA_STEP(NAME, W, NV, BS, M, ACC, P)                                                            \
    do {                                                                                                     \
        NAME##_vec bv[NV];                                                                                   \
        KILN_UNROLL for (int j = 0; j < NV; ++j) memcpy(&bv[j], b + (P) * (BS) + j * (W), sizeof(NAME##_vec)); \
        KILN_UNROLL for (int i = 0; i < (M); ++i) {                                                          \
            const float av = a[i * rs + (P) * cs];                                                           \
            KILN_UNROLL for (int j = 0; j < NV; ++j) ACC[i][j] += av * bv[j];                                \
        }                                                                                                    \
    } while (0)

/* k steps before the end of a tile's K loop at which it prefetches its C lines (for writing): ~1500 cycles ahead on
   the 8x48 tile, time for a line from L3, where at the loop's start a whole-K tile's lines would sit in L1 through
   its 768 steps at K = 768 as the W panel streams past (measured level with this). Not prefetched where the tile
   does not load C (as before), each first store of a line waited for it: 128 x 768 x 2304 on one Zen 4 core 2-3%
   slower, whole K or K-blocked. */
#define KILN_C_AHEAD 64
#define KILN_PREFETCH_C(W, NV, M)                                                                            \
    KILN_UNROLL for (int i = 0; i < (M); ++i) {                                                              \
        KILN_UNROLL for (int o = 0; o < (W) * (NV); o += 16) __builtin_prefetch(c + i * ldc + o, 1, 3);      \
        __builtin_prefetch(c + i * ldc + (W) * (NV) - 1, 1, 3);                                              \
    }

/* erf-GELU of a vector of sums before the tile stores them, by the kernel's ISA (KILN_GELU_ISA): on AVX2 and
   AVX-512 kiln_gelu_avx2 / kiln_gelu_avx512 (a table of polynomials, below), `any` (the generic kernel, the tests'
   16-lane tiles built for AVX2) erf_rational's x·P(x²)/Q(x²) in GCC vector code: ½v(1 + erf(v/√2)) as h + h·erf,
   h = ½v, its clamps as compares and selects. */
#define KILN_GELU_avx2(NAME, v) kiln_gelu_avx2(v)
#define KILN_GELU_avx512(NAME, v) kiln_gelu_avx512(v)
#define KILN_GELU_any(NAME, v) NAME##_gelu_rational(v)
#define KILN_DEFINE_GELU(NAME, TARGET, W, ISA)                                                               \
    typedef int NAME##_ivec __attribute__((vector_size((W) * 4)));                                           \
    static inline __attribute__((always_inline, unused)) TARGET NAME##_vec NAME##_clamp(NAME##_vec v, float lo, \
                                                                               float hi) {                   \
        const NAME##_vec low = (NAME##_vec){0} + lo, high = (NAME##_vec){0} + hi;                            \
        NAME##_ivec m = v < low;                                                                             \
        v = (NAME##_vec)(((NAME##_ivec)v & ~m) | ((NAME##_ivec)low & m));                                    \
        m = v > high;                                                                                        \
        return (NAME##_vec)(((NAME##_ivec)v & ~m) | ((NAME##_ivec)high & m));                                \
    }                                                                                                        \
    static inline __attribute__((always_inline, unused)) TARGET NAME##_vec NAME##_gelu_rational(NAME##_vec v) { \
        const NAME##_vec x = NAME##_clamp(v * 0.70710678118654752f, -4.0f, 4.0f), x2 = x * x;                \
        NAME##_vec p = (NAME##_vec){0} + KILN_ERF_P[0], q = (NAME##_vec){0} + KILN_ERF_Q[0];                 \
        KILN_UNROLL for (int t = 1; t < 7; ++t) p = p * x2 + KILN_ERF_P[t];                                  \
        KILN_UNROLL for (int t = 1; t < 5; ++t) q = q * x2 + KILN_ERF_Q[t];                                  \
        const NAME##_vec r = NAME##_clamp(x * p / q, -1.0f, 1.0f), h = v * 0.5f;                             \
        return h * r + h;                                                                                    \
    }                                                                                                        \
    static inline __attribute__((always_inline)) TARGET NAME##_vec NAME##_gelu(NAME##_vec v) {               \
        return KILN_GELU_##ISA(NAME, v);                                                                     \
    }

#define KILN_DEFINE_KERNEL(NAME, TARGET, ISA, W, NV, MR, BS)                                                 \
    typedef float NAME##_vec __attribute__((vector_size((W) * 4)));                                          \
    KILN_DEFINE_GELU(NAME, TARGET, W, ISA)                                                                   \
    static inline __attribute__((always_inline)) TARGET void NAME##_rows(                                    \
        const int M, long k, const float *a, const long rs, const long cs, const float *b, float *c, long ldc, \
        int flags, const float *bias) {                                                                      \
        NAME##_vec acc[MR][NV], odd[MR][NV], start[NV];                                                      \
        const int load_c = flags & KILN_TILE_LOAD_C;                                                         \
        KILN_UNROLL for (int j = 0; j < NV; ++j) {                                                           \
            start[j] = (NAME##_vec){0};                                                                      \
            if (bias && !load_c) memcpy(&start[j], bias + j * (W), sizeof(NAME##_vec));                      \
        }                                                                                                    \
        KILN_UNROLL for (int i = 0; i < M; ++i) KILN_UNROLL for (int j = 0; j < NV; ++j) {                   \
            acc[i][j] = start[j];                                                                            \
            odd[i][j] = (NAME##_vec){0};                                                                     \
        }                                                                                                    \
        /* A short tile has fewer FMA chains than 2 ports x 4 cycles of latency keep busy: it alternates k   \
           between two sets of accumulators (the 2-row rest of an 8-row batch ran at half the 6-row speed). */\
        const int split = (M) * (NV) <= 6;                                                                   \
        /* C's lines: KILN_C_AHEAD steps before the end (a short tile: at once), unless it neither loads C nor   \
           runs long enough for a line to come before its store */                                           \
        const int prefetch_c = load_c || k > KILN_C_AHEAD;                                                   \
        long p = 0;                                                                                          \
        if (split) {                                                                                         \
            if (prefetch_c) KILN_PREFETCH_C(W, NV, M);                                                       \
            for (; p + 1 < k; p += 2) {                                                                      \
                KILN_FMA_STEP(NAME, W, NV, BS, M, acc, p);                                                   \
                KILN_FMA_STEP(NAME, W, NV, BS, M, odd, p + 1);                                               \
            }                                                                                                \
        } else {                                                                                             \
            for (; p + KILN_C_AHEAD < k; ++p) KILN_FMA_STEP(NAME, W, NV, BS, M, acc, p);                     \
            if (prefetch_c) KILN_PREFETCH_C(W, NV, M);                                                       \
        }                                                                                                    \
        for (; p < k; ++p) KILN_FMA_STEP(NAME, W, NV, BS, M, acc, p);                                        \
        if (split) KILN_UNROLL for (int i = 0; i < M; ++i) KILN_UNROLL for (int j = 0; j < NV; ++j)          \
            acc[i][j] += odd[i][j];                                                                          \
        KILN_UNROLL for (int i = 0; i < M; ++i) KILN_UNROLL for (int j = 0; j < NV; ++j) {                   \
            if (load_c) {                                                                                    \
                NAME##_vec old;                                                                              \
                memcpy(&old, c + i * ldc + j * (W), sizeof(NAME##_vec));                                     \
                acc[i][j] += old;                                                                            \
            }                                                                                                \
            if (flags & KILN_TILE_GELU) acc[i][j] = NAME##_gelu(acc[i][j]);                                  \
            memcpy(c + i * ldc + j * (W), &acc[i][j], sizeof(NAME##_vec));                                  \
        }                                                                                                    \
    }                                                                                                        \
    KILN_BODIES(NAME, TARGET, MR)                                                                            \
    static inline __attribute__((always_inline)) TARGET void NAME##_run(int m, long k, const float *a, long rs, \
                                  int packed, const float *b, float *c, long ldc, int n, int flags,          \
                                  const float *bias) {                                                       \
        if (n == (W) * (NV)) {                                                                               \
            KILN_DISPATCH(NAME, m, (k, a, rs, b, c, ldc, flags, bias));                                      \
            return;                                                                                          \
        }                                                                                                    \
        float tile[(MR) * (W) * (NV)] __attribute__((aligned(64))), padded[(W) * (NV)];                      \
        for (int i = 0; i < m; ++i)                                                                          \
            for (int j = 0; j < (W) * (NV); ++j)                                                             \
                tile[i * (W) * (NV) + j] = (flags & KILN_TILE_LOAD_C) && j < n ? c[i * ldc + j] : 0.0f;      \
        if (bias) for (int j = 0; j < (W) * (NV); ++j) padded[j] = j < n ? bias[j] : 0.0f;                   \
        KILN_DISPATCH(NAME, m, (k, a, rs, b, tile, (W) * (NV), flags, bias ? padded : NULL));                \
        for (int i = 0; i < m; ++i) memcpy(c + i * ldc, tile + i * (W) * (NV), (size_t)n * sizeof(float));  \
    }                                                                                                        \
    static __attribute__((unused)) TARGET void NAME##_packed(int m, long k, const float *a, long lda, const float *b, float *c, long ldc, \
                              int n, int flags, const float *bias) {                                         \
        (void)lda;                                                                                           \
        NAME##_run(m, k, a, 0, 1, b, c, ldc, n, flags, bias);                                                \
    }                                                                                                        \
    static TARGET void NAME##_direct(int m, long k, const float *a, long lda, const float *b, float *c, long ldc,   \
                              int n, int flags, const float *bias) {                                         \
        NAME##_run(m, k, a, lda, 0, b, c, ldc, n, flags, bias);                                              \
    }

/* One function per row count M (<= MR; larger ones are never called) and A layout, each compiled on its
   own: merged into one function, the bodies shared registers and spilled (measured: 43 GFLOP/s a core
   where each alone runs at 102). NAME_pM reads A packed ([k][MR]), NAME_dM in place (row stride rs). */
#define KILN_BODY(NAME, TARGET, MR, M)                                                                       \
    static __attribute__((noinline)) TARGET void NAME##_p##M(long k, const float *a, long rs, const float *b, \
                                                           float *c, long ldc, int flags, const float *bias) { \
        (void)rs;                                                                                            \
        NAME##_rows((M) <= (MR) ? (M) : 1, k, a, 1, MR, b, c, ldc, flags, bias);                             \
    }                                                                                                        \
    static __attribute__((noinline)) TARGET void NAME##_d##M(long k, const float *a, long rs, const float *b, \
                                                           float *c, long ldc, int flags, const float *bias) { \
        NAME##_rows((M) <= (MR) ? (M) : 1, k, a, rs, 1, b, c, ldc, flags, bias);                             \
    }
#define KILN_BODIES(NAME, TARGET, MR)                                                                        \
    KILN_BODY(NAME, TARGET, MR, 1) KILN_BODY(NAME, TARGET, MR, 2) KILN_BODY(NAME, TARGET, MR, 3)             \
    KILN_BODY(NAME, TARGET, MR, 4) KILN_BODY(NAME, TARGET, MR, 5) KILN_BODY(NAME, TARGET, MR, 6)             \
    KILN_BODY(NAME, TARGET, MR, 7) KILN_BODY(NAME, TARGET, MR, 8) KILN_BODY(NAME, TARGET, MR, 9)             \
    KILN_BODY(NAME, TARGET, MR, 10) KILN_BODY(NAME, TARGET, MR, 11) KILN_BODY(NAME, TARGET, MR, 12)          \
    KILN_BODY(NAME, TARGET, MR, 13) KILN_BODY(NAME, TARGET, MR, 14) KILN_BODY(NAME, TARGET, MR, 15)            \
    KILN_BODY(NAME, TARGET, MR, 16)
#define KILN_CALL(NAME, M, ARGS) \
    case M: if (packed) NAME##_p##M ARGS; else NAME##_d##M ARGS; break;
#define KILN_DISPATCH(NAME, m, ARGS)                                                                         \
    switch (m) {                                                                                             \
    KILN_CALL(NAME, 1, ARGS) KILN_CALL(NAME, 2, ARGS) KILN_CALL(NAME, 3, ARGS) KILN_CALL(NAME, 4, ARGS)      \
    KILN_CALL(NAME, 5, ARGS) KILN_CALL(NAME, 6, ARGS) KILN_CALL(NAME, 7, ARGS) KILN_CALL(NAME, 8, ARGS)      \
    KILN_CALL(NAME, 9, ARGS) KILN_CALL(NAME, 10, ARGS) KILN_CALL(NAME, 11, ARGS) KILN_CALL(NAME, 12, ARGS)   \
    KILN_CALL(NAME, 13, ARGS) KILN_CALL(NAME, 14, ARGS) KILN_CALL(NAME, 15, ARGS) KILN_CALL(NAME, 16, ARGS)  \
    default: break;                                                                                          \
    }

static int always(void) { return 1; }

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KILN_AVX2 __attribute__((target("avx2,fma")))
#define KILN_AVX512 __attribute__((target("avx512f,avx2,fma")))
typedef float kiln_v8 __attribute__((vector_size(32)));
typedef float kiln_v16 __attribute__((vector_size(64)));
/* erf-GELU on AVX-512 / AVX2 registers (the tiles' KILN_TILE_GELU, gelu_avx512 / gelu_avx2): GELU(v) = ½v + |v|·E,
   E = ½erf(|v|/√2) (v·erf(v/√2) is even), E a polynomial of degree 4 (AVX-512) / 6 (AVX2) in w = y - k on the
   interval k = rint(y) of y = min(|v|·S, n - 1), n = 16 / 8 intervals of width 1 (bench/gelu_table_fit.py fits and
   prints the tables: minimax per interval; the clamp is at |v|/√2 = 3.95, where erf is within 1.2e-8 of 1, and the
   last interval's constant is ½ exactly, so past it the result is ½v + ½|v|, ReLU, exactly). k is the low bits of
   y + 1.5·2²³, and each coefficient one vpermps of a register of n floats by them. Why: Eigen's rational form
   (erf_rational: a clamp, 11 FMAs, the divide or rcp + a Newton step, a clamp of erf, ~23 operations a vector, ~18
   of them on the two FMA pipes) cost BERT-base's FFN up 4-5 points of the FMA peak; this is 17 / 21 operations, 7 /
   9 of them on the FMA pipes, the permutes and adds on the others, and is closer to float64 (over -10..10 step
   1e-4: |error| <= 1.6e-7·max(1, |v|) / 9.1e-8·max(1, |v|) and 1.9e-7 / 1.6e-7 relative to max(1, |GELU|),
   where the rational form was at 1.8e-7 and 9.3e-7). NaN passes through (min(NaN, c) is c, then |NaN|·p + ½NaN),
   +inf -> +inf, -inf -> NaN (inf - inf; torch's gelu gives NaN for both). A/B: bench/results/packed-2026-12-06.md,
   section 11. */
#define KILN_GELU_S16 2.6852157f
static const float KILN_GELU_T16[5][16] __attribute__((aligned(64))) = {
    {-1.120798e-15f, 0.14520603f, 0.27180946f, 0.3680517f, 0.43184033f, 0.46870184f,
     0.4872735f, 0.49543124f, 0.49855536f, 0.49959838f, 0.49990198f, 0.49997902f,
     0.49999607f, 0.49999934f, 0.4999999f, 0.5f},
    {0.14856854f, 0.13861558f, 0.112581566f, 0.07959608f, 0.048987314f, 0.026244663f,
     0.012239422f, 0.0049686693f, 0.0017557961f, 0.0005400802f, 0.00014460621f, 3.370187e-05f,
     6.836789e-06f, 1.2071846e-06f, 1.8552815e-07f, 8.255391e-07f},
    {6.4706514e-16f, -0.009611866f, -0.015613517f, -0.016558269f, -0.013587862f, -0.009099667f,
     -0.005092547f, -0.0024119627f, -0.0009741089f, -0.00033709803f, -0.00010028949f, -2.571159e-05f,
     -5.690234e-06f, -1.0885004e-06f, -1.8016247e-07f, 8.325e-06f},
    {-0.003411946f, -0.0027446032f, -0.0011587386f, 0.00044503607f, 0.0013671411f, 0.0014890968f,
     0.0011283496f, 0.00066773023f, 0.00032217967f, 0.00012945394f, 4.3844742e-05f, 1.2613398e-05f,
     3.0982033e-06f, 6.521564e-07f, 1.17961626e-07f, 2.7454467e-05f},
    {1.1039829e-15f, 0.00031455958f, 0.0004381648f, 0.00033353386f, 0.00012341679f, -4.737532e-05f,
     -0.00011599354f, -0.00010539067f, -6.627684e-05f, -3.2327927e-05f, -1.2775854e-05f, -4.1814783e-06f,
     -1.1480829e-06f, -2.6663037e-07f, -5.2675517e-08f, 2.792734e-05f},
};
#define KILN_GELU_S8 1.2531006f
static const float KILN_GELU_T8[7][8] __attribute__((aligned(32))) = {
    {-1.5564429e-14f, 0.28757071f, 0.44476017f, 0.49166852f, 0.49929374f, 0.49996698f,
     0.49999917f, 0.5f},
    {0.31836373f, 0.23154588f, 0.08907903f, 0.018127412f, 0.0019513018f, 0.000111115776f,
     3.3479803e-06f, 1.8133541e-06f},
    {1.12913846e-14f, -0.0737281f, -0.05672893f, -0.017316388f, -0.002485297f, -0.00017689665f,
     -6.39542e-06f, 4.2483247e-05f},
    {-0.03377799f, -0.00892997f, 0.014625179f, 0.009106714f, 0.001903549f, 0.0001756715f,
     7.737917e-06f, 0.00037336207f},
    {-8.045544e-14f, 0.009241517f, 0.0013662322f, -0.0025102936f, -0.0009488321f, -0.00012122754f,
     -6.7288456e-06f, 0.0014677086f},
    {0.0031230333f, -0.0002858724f, -0.0017072796f, 6.499352e-05f, 0.00029872402f, 6.27496e-05f,
     4.8197858e-06f, 0.0026495215f},
    {1.4637e-13f, -0.00072479213f, 0.00023643121f, 0.00018511251f, -4.438927e-05f, -2.2138101e-05f,
     -2.4074827e-06f, 0.0017875567f},
};

static inline __attribute__((always_inline)) KILN_AVX512 kiln_v16 kiln_gelu_avx512(kiln_v16 v) {
    const __m512 x = (__m512)v, a = _mm512_abs_ps(x);
    const __m512 y = _mm512_min_ps(_mm512_mul_ps(a, _mm512_set1_ps(KILN_GELU_S16)), _mm512_set1_ps(15.0f));
    const __m512 t = _mm512_add_ps(y, _mm512_set1_ps(12582912.0f));  /* its low 4 bits: k */
    const __m512 w = _mm512_sub_ps(y, _mm512_sub_ps(t, _mm512_set1_ps(12582912.0f)));
    const __m512i k = _mm512_castps_si512(t);
    __m512 p = _mm512_permutexvar_ps(k, _mm512_load_ps(KILN_GELU_T16[4]));
    KILN_UNROLL for (int j = 3; j >= 0; --j)
        p = _mm512_fmadd_ps(p, w, _mm512_permutexvar_ps(k, _mm512_load_ps(KILN_GELU_T16[j])));
    return (kiln_v16)_mm512_fmadd_ps(a, p, _mm512_mul_ps(x, _mm512_set1_ps(0.5f)));
}
static inline __attribute__((always_inline)) KILN_AVX2 kiln_v8 kiln_gelu_avx2(kiln_v8 v) {
    const __m256 x = (__m256)v, a = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);
    const __m256 y = _mm256_min_ps(_mm256_mul_ps(a, _mm256_set1_ps(KILN_GELU_S8)), _mm256_set1_ps(7.0f));
    const __m256 t = _mm256_add_ps(y, _mm256_set1_ps(12582912.0f));  /* its low 3 bits: k */
    const __m256 w = _mm256_sub_ps(y, _mm256_sub_ps(t, _mm256_set1_ps(12582912.0f)));
    const __m256i k = _mm256_castps_si256(t);
    __m256 p = _mm256_permutevar8x32_ps(_mm256_load_ps(KILN_GELU_T8[6]), k);
    KILN_UNROLL for (int j = 5; j >= 0; --j)
        p = _mm256_fmadd_ps(p, w, _mm256_permutevar8x32_ps(_mm256_load_ps(KILN_GELU_T8[j]), k));
    return (kiln_v8)_mm256_fmadd_ps(a, p, _mm256_mul_ps(x, _mm256_set1_ps(0.5f)));
}
KILN_DEFINE_KERNEL(avx512, KILN_AVX512, avx512, 16, 2, 14, 32)
KILN_DEFINE_KERNEL(avx2, KILN_AVX2, avx2, 8, 2, 6, 16)
/* Narrow tiles for a small M past MR: one vector of columns (half a panel) for up to 16 / 8 rows at once,
   so the W panel is read once for all the rows (the wide tile would pass over it twice). */
KILN_DEFINE_KERNEL(avx512_narrow, KILN_AVX512, avx512, 16, 1, 16, 32)
KILN_DEFINE_KERNEL(avx2_narrow, KILN_AVX2, avx2, 8, 1, 8, 16)
/* AVX-512 for linear layers (gemm_native.linear_kernel): 8 rows x 48 columns, 24 zmm accumulators fed by 3 loads
   of W and 8 broadcasts of x per 24 FMAs (the 14x32 tile: 2 + 14 per 28). At 1-512 rows of T5-small's and
   BERT-base's shapes, one core, CPU time: level to 28% faster than the 14x32 (bench/results/gemm-2026-12-05d.md).
   No narrow tile: half a panel is not one vector; 9-16 rows run as two row blocks of the wide one. */
KILN_DEFINE_KERNEL(avx512_8x48, KILN_AVX512, avx512, 16, 3, 8, 48)
/* Its edge tiles: the last panel of an N that is not a multiple of 48 holds 16 or 32 real columns (ConvNeXt's
   N = 16, 64, 256: 16; N = 32, 128, 512: 32), where the wide tile ran all 48 through a stack buffer (2/3 or
   1/3 of its FMAs on zero columns, then the copy out): 512 x 64 x 16 at 28% of a Zen 4 core's peak. These read
   the first one or two vectors of each k row of the same packed panel (B stride 48) and write C in place. */
KILN_DEFINE_KERNEL(avx512_8x16of48, KILN_AVX512, avx512, 16, 1, 8, 48)
KILN_DEFINE_KERNEL(avx512_8x32of48, KILN_AVX512, avx512, 16, 2, 8, 48)
#ifdef KILN_GEMM_TEST_KERNELS
/* AVX-512's 14x32 tile (the same template at 16 lanes: its packing, edges, blocking) run with AVX2
   instructions: lets the tests of an AVX2 machine check all of the AVX-512 path but its instruction
   selection. Slow to run and to compile (its 28 accumulators spill): a build of its own, for tests. */
KILN_DEFINE_KERNEL(wide_on_avx2, KILN_AVX2, any, 16, 2, 14, 32)
KILN_DEFINE_KERNEL(wide_on_avx2_narrow, KILN_AVX2, any, 16, 1, 16, 32)
KILN_DEFINE_KERNEL(wide_8x48_on_avx2, KILN_AVX2, any, 16, 3, 8, 48)
KILN_DEFINE_KERNEL(wide_8x16of48_on_avx2, KILN_AVX2, any, 16, 1, 8, 48)
KILN_DEFINE_KERNEL(wide_8x32of48_on_avx2, KILN_AVX2, any, 16, 2, 8, 48)
#endif
#ifdef KILN_MAX_ISA_AVX2  /* KILN_CPU_ISA=avx2 (kiln/kernels/cpu/cpu_features.py): run as an AVX2-only CPU */
static int has_avx512(void) { return 0; }
#else
static int has_avx512(void) { __builtin_cpu_init(); return __builtin_cpu_supports("avx512f"); }
#endif
static int has_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
#endif
KILN_DEFINE_KERNEL(generic, , any, 4, 2, 4, 8)

static const kernel_desc KERNELS[] = {
#if defined(__x86_64__) || defined(__i386__)
    {"avx512 14x32", 14, 32, 192, 168, avx512_packed, avx512_direct, avx512_narrow_direct, 16, has_avx512, 0},
    {"avx512 8x48", 8, 48, 128, 168, avx512_8x48_packed, avx512_8x48_direct, NULL, 0, has_avx512, 0,
     16, {avx512_8x16of48_packed, avx512_8x32of48_packed}, {avx512_8x16of48_direct, avx512_8x32of48_direct}},
    {"avx2 6x16", 6, 16, 256, 240, avx2_packed, avx2_direct, avx2_narrow_direct, 8, has_avx2, 0},
#ifdef KILN_GEMM_TEST_KERNELS
    {"avx512 14x32 tile on avx2 (test)", 14, 32, 192, 168, wide_on_avx2_packed, wide_on_avx2_direct,
     wide_on_avx2_narrow_direct, 16, has_avx2, 1},
    {"avx512 8x48 tile on avx2 (test)", 8, 48, 128, 168, wide_8x48_on_avx2_packed, wide_8x48_on_avx2_direct, NULL, 0,
     has_avx2, 1, 16, {wide_8x16of48_on_avx2_packed, wide_8x32of48_on_avx2_packed},
     {wide_8x16of48_on_avx2_direct, wide_8x32of48_on_avx2_direct}},
#endif
#endif
    {"generic 4x8", 4, 8, 256, 256, generic_packed, generic_direct, NULL, 0, always, 0},
};
#define KERNEL_COUNT ((int)(sizeof(KERNELS) / sizeof(KERNELS[0])))

int kiln_gemm_kernel_count(void) { return KERNEL_COUNT; }
const char *kiln_gemm_kernel_name(int i) { return i >= 0 && i < KERNEL_COUNT ? KERNELS[i].name : NULL; }
int kiln_gemm_kernel_supported(int i) { return i >= 0 && i < KERNEL_COUNT && KERNELS[i].supported(); }
int kiln_gemm_kernel_test_only(int i) { return i >= 0 && i < KERNEL_COUNT && KERNELS[i].test_only; }
int kiln_gemm_kernel_nr(int i) { return i >= 0 && i < KERNEL_COUNT ? KERNELS[i].nr : 0; }
int kiln_gemm_kernel_mr(int i) { return i >= 0 && i < KERNEL_COUNT ? KERNELS[i].mr : 0; }

long kiln_gemm_packed_floats(int kernel, long n, long k) {
    long nr = KERNELS[kernel].nr;
    return (n + nr - 1) / nr * nr * k;
}

/* W [N, K] row-major -> packed[p][k][j] = W[p*NR + j][k], zeros past N. */
void kiln_gemm_pack_w(int kernel, const float *w, long n, long k, float *packed) {
    const long nr = KERNELS[kernel].nr, panels = (n + nr - 1) / nr;
    #pragma omp parallel for schedule(static)
    for (long p = 0; p < panels; ++p) {
        float *out = packed + p * k * nr;
        for (long k0 = 0; k0 < k; k0 += 64) {  /* 64 x NR blocks: reads W rows in runs of 64 floats */
            long kb = k - k0 < 64 ? k - k0 : 64;
            for (long j = 0; j < nr; ++j) {
                long row = p * nr + j;
                for (long t = 0; t < kb; ++t) out[(k0 + t) * nr + j] = row < n ? w[row * k + k0 + t] : 0.0f;
            }
        }
    }
}

/* ---- the epilogue ------------------------------------------------------------------------------------ */

/* Without it GCC keeps each select (x < -4 ? -4 : x) a branch, as a comparison might trap: the loops
   below would not vectorise. kiln never unmasks floating-point exceptions. */
#pragma GCC push_options
#pragma GCC optimize("no-trapping-math")

/* erf(x) as Eigen/XLA compute it for float32: x·P(x²)/Q(x²) on [-4, 4] (|error| < 1e-6 measured by the
   tests against float64). Plain arithmetic and selects: the loops below vectorise. */
static inline float erf_rational(float x) {
    x = x < -4.0f ? -4.0f : (x > 4.0f ? 4.0f : x);
    const float x2 = x * x;
    float p = -2.72614225801306e-10f;
    p = p * x2 + 2.77068142495902e-08f;
    p = p * x2 - 2.10102402082508e-06f;
    p = p * x2 - 5.69250639462346e-05f;
    p = p * x2 - 7.34990630326855e-04f;
    p = p * x2 - 2.95459980854025e-03f;
    p = p * x2 - 1.60960333262415e-02f;
    float q = -1.45660718464996e-05f;
    q = q * x2 - 2.13374055278905e-04f;
    q = q * x2 - 1.68282697438203e-03f;
    q = q * x2 - 7.37332916720468e-03f;
    q = q * x2 - 1.42647390514189e-02f;
    float r = x * p / q;
    return r > 1.0f ? 1.0f : (r < -1.0f ? -1.0f : r);
}

/* tanh(x) as Eigen and MLAS compute it for float32: x·P(x²)/Q(x²) on [-9, 9], clamped to [-1, 1]. */
static inline float tanh_rational(float x) {
    x = x < -9.0f ? -9.0f : (x > 9.0f ? 9.0f : x);
    const float x2 = x * x;
    float p = -2.76076847742355e-16f;
    p = p * x2 + 2.00018790482477e-13f;
    p = p * x2 - 8.60467152213735e-11f;
    p = p * x2 + 5.12229709037114e-08f;
    p = p * x2 + 1.48572235717979e-05f;
    p = p * x2 + 6.37261928875436e-04f;
    p = p * x2 + 4.89352455891786e-03f;
    float q = 1.19825839466702e-06f;
    q = q * x2 + 1.18534705686654e-04f;
    q = q * x2 + 2.26843463243900e-03f;
    q = q * x2 + 4.89352518554385e-03f;
    float r = x * p / q;
    return r > 1.0f ? 1.0f : (r < -1.0f ? -1.0f : r);
}

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
/* GELU of n floats at c in place, a register of lanes at a time: the tiles' kiln_gelu_avx512 / kiln_gelu_avx2 (the
   epilogue pass of a GELU with a residual; the tiles apply it alone). Why not activate()'s loop: GCC's
   auto-vectorised form of the rational one ran 1.35-1.5x slower on a Zen 4 core (32768 outputs in rows of 16 / 32 /
   64), and ConvNeXt's 512 x 16 x 64 GELU GEMM's epilogue was twice its multiply-adds. The tail of a row: masked
   (both ISAs: every element takes the same arithmetic). */
KILN_AVX512 static void gelu_avx512(float *c, int n) {
    for (int j = 0; j < n; j += 16) {
        const __mmask16 mask = n - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - j)) - 1);
        _mm512_mask_storeu_ps(c + j, mask, (__m512)kiln_gelu_avx512((kiln_v16)_mm512_maskz_loadu_ps(mask, c + j)));
    }
}
KILN_AVX2 static void gelu_avx2(float *c, int n) {
    int j = 0;
    for (; j + 8 <= n; j += 8) _mm256_storeu_ps(c + j, (__m256)kiln_gelu_avx2((kiln_v8)_mm256_loadu_ps(c + j)));
    if (j < n) {
        const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(n - j), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        _mm256_maskstore_ps(c + j, mask, (__m256)kiln_gelu_avx2((kiln_v8)_mm256_maskload_ps(c + j, mask)));
    }
}
/* 2: AVX-512, 1: AVX2 + FMA, 0: neither (cpuid once; KILN_CPU_ISA=avx2 caps it as it caps the tiles) */
static int epilogue_isa(void) {
    static int isa = -1;
    if (isa < 0) isa = has_avx512() ? 2 : (has_avx2() ? 1 : 0);
    return isa;
}

/* SiLU, c[j] = c[j]·σ(c[j]), and SwiGLU's gating, y[j] = silu(g[j] + bg[j])·(u[j] + bu[j]) (the biases NULL or
   not), in AVX-512 / AVX2 registers by exp_poly.h's KILN_VSILU: its rational form, one division, where the loops
   they replaced, x / (1 + exp_poly(-x)), ran exp_poly's degree-5 polynomial and a division (the epilogues alone at
   a tile's rows, A/B: bench/gemm_silu_ab.py). Specials as the header states: +inf -> +inf, -inf (and anything
   below -88) -> -5.3e-37, NaN -> NaN; the old loop gave x·6e-39 below -88 (-inf at -inf, -6e-9 at -1e30). The
   tail of a row: masked (AVX-512; SwiGLU's half panel of the 8x48 tile is 24 columns, 16 + 8), silu_scalar (AVX2),
   which treats the specials alike. */
typedef int kiln_vi8 __attribute__((vector_size(32)));
typedef int kiln_vi16 __attribute__((vector_size(64)));
KILN_VSILU(kiln_silu_avx512, static inline __attribute__((always_inline)) KILN_AVX512, kiln_v16, kiln_vi16,
           _mm512_min_ps, _mm512_max_ps)
KILN_VSILU(kiln_silu_avx2, static inline __attribute__((always_inline)) KILN_AVX2, kiln_v8, kiln_vi8,
           _mm256_min_ps, _mm256_max_ps)
KILN_AVX512 static void silu_avx512(float *c, int n) {
    for (int j = 0; j < n; j += 16) {
        const __mmask16 mask = n - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - j)) - 1);
        _mm512_mask_storeu_ps(c + j, mask, (__m512)kiln_silu_avx512((kiln_v16)_mm512_maskz_loadu_ps(mask, c + j)));
    }
}
KILN_AVX2 static void silu_avx2(float *c, int n) {
    int j = 0;
    for (; j + 8 <= n; j += 8) _mm256_storeu_ps(c + j, (__m256)kiln_silu_avx2((kiln_v8)_mm256_loadu_ps(c + j)));
    for (; j < n; ++j) c[j] = silu_scalar(c[j]);
}
KILN_AVX512 static void gate_avx512(float *y, const float *g, const float *u, const float *bg, const float *bu,
                                    int n) {
    for (int j = 0; j < n; j += 16) {
        const __mmask16 mask = n - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - j)) - 1);
        kiln_v16 gate = (kiln_v16)_mm512_maskz_loadu_ps(mask, g + j), up = (kiln_v16)_mm512_maskz_loadu_ps(mask, u + j);
        if (bg) {
            gate += (kiln_v16)_mm512_maskz_loadu_ps(mask, bg + j);
            up += (kiln_v16)_mm512_maskz_loadu_ps(mask, bu + j);
        }
        _mm512_mask_storeu_ps(y + j, mask, (__m512)(kiln_silu_avx512(gate) * up));
    }
}
KILN_AVX2 static void gate_avx2(float *y, const float *g, const float *u, const float *bg, const float *bu, int n) {
    int j = 0;
    for (; j + 8 <= n; j += 8) {
        kiln_v8 gate = (kiln_v8)_mm256_loadu_ps(g + j), up = (kiln_v8)_mm256_loadu_ps(u + j);
        if (bg) {
            gate += (kiln_v8)_mm256_loadu_ps(bg + j);
            up += (kiln_v8)_mm256_loadu_ps(bu + j);
        }
        _mm256_storeu_ps(y + j, (__m256)(kiln_silu_avx2(gate) * up));
    }
    for (; j < n; ++j) y[j] = silu_scalar(bg ? g[j] + bg[j] : g[j]) * (bu ? u[j] + bu[j] : u[j]);
}
#endif

/* GELU of n floats by the widest registers this CPU has; 0 where it has none of those (activate's loop runs). */
static int gelu_vector(float *c, int n) {
#if defined(__x86_64__) || defined(__i386__)
    switch (epilogue_isa()) {
    case 2: gelu_avx512(c, n); return 1;
    case 1: gelu_avx2(c, n); return 1;
    default: break;
    }
#endif
    (void)c; (void)n;
    return 0;
}

/* SiLU of n floats at c in place, by the widest registers this CPU has, silu_scalar on none. */
static void silu_rows(float *c, int n) {
#if defined(__x86_64__) || defined(__i386__)
    switch (epilogue_isa()) {
    case 2: silu_avx512(c, n); return;
    case 1: silu_avx2(c, n); return;
    default: break;
    }
#endif
    for (int j = 0; j < n; ++j) c[j] = silu_scalar(c[j]);
}

/* y[j] = silu(g[j] + bg[j])·(u[j] + bu[j]) for j < n (bg and bu NULL: no bias) likewise; y does not alias g or u. */
static void gate_row(float *y, const float *g, const float *u, const float *bg, const float *bu, int n) {
#if defined(__x86_64__) || defined(__i386__)
    switch (epilogue_isa()) {
    case 2: gate_avx512(y, g, u, bg, bu, n); return;
    case 1: gate_avx2(y, g, u, bg, bu, n); return;
    default: break;
    }
#endif
    for (int j = 0; j < n; ++j) y[j] = silu_scalar(bg ? g[j] + bg[j] : g[j]) * (bu ? u[j] + bu[j] : u[j]);
}

static void activate(float *c, int n, int activation, float alpha, float beta) {
    switch (activation) {
    case ACT_RELU:
        for (int j = 0; j < n; ++j) c[j] = c[j] > 0.0f ? c[j] : 0.0f;
        break;
    case ACT_CLIP:  /* alpha = min, beta = max */
        for (int j = 0; j < n; ++j) c[j] = c[j] < alpha ? alpha : (c[j] > beta ? beta : c[j]);
        break;
    case ACT_LEAKY_RELU:
        for (int j = 0; j < n; ++j) c[j] = c[j] >= 0.0f ? c[j] : alpha * c[j];
        break;
    case ACT_GELU:  /* x·Φ(x) = ½x(1 + erf(x/√2)) */
        if (gelu_vector(c, n)) break;
        for (int j = 0; j < n; ++j) c[j] = 0.5f * c[j] * (1.0f + erf_rational(c[j] * 0.70710678118654752f));
        break;
    case ACT_GELU_TANH:  /* ½x(1 + tanh(u)) = x·σ(2u), u = √(2/π)(x + 0.044715x³): no cancellation for x < 0 */
        for (int j = 0; j < n; ++j) {
            float x = c[j];
            c[j] = x / (1.0f + exp_poly(-1.5957691216057308f * (x + 0.044715f * x * x * x)));
        }
        break;
    case ACT_TANH:
        for (int j = 0; j < n; ++j) c[j] = tanh_rational(c[j]);
        break;
    case ACT_SIGMOID:
        for (int j = 0; j < n; ++j) c[j] = 1.0f / (1.0f + exp_poly(-c[j]));
        break;
    case ACT_SILU:
        silu_rows(c, n);
        break;
    case ACT_HARD_SIGMOID:  /* max(0, min(1, alpha·x + beta)) */
        for (int j = 0; j < n; ++j) {
            float v = alpha * c[j] + beta;
            c[j] = v < 0.0f ? 0.0f : (v > 1.0f ? 1.0f : v);
        }
        break;
    case ACT_HARD_SWISH:  /* x·relu6(x + 3)/6 */
        for (int j = 0; j < n; ++j) {
            float v = c[j] + 3.0f;
            v = v < 0.0f ? 0.0f : (v > 6.0f ? 6.0f : v);
            c[j] = c[j] * v * (1.0f / 6.0f);
        }
        break;
    default:
        break;
    }
}

/* activate() exported: kiln's other C kernels (i8gemm.c's GELU epilogue) apply gemm.c's activations, by its codes, on the
   same vector forms. */
void kiln_gemm_activate(float *c, int n, int activation, float alpha, float beta) {
    activate(c, n, activation, alpha, beta);
}

#pragma GCC pop_options

/* KILN_TILE_GELU where the tiles apply the whole epilogue past the bias in registers (GELU, no residual), else 0. */
static int tile_gelu(const kiln_gemm_plan *p, const float *res) {
    return p->activation == ACT_GELU && res == NULL ? KILN_TILE_GELU : 0;
}

/* Whether a tile needs the epilogue pass: the tiles start their sums from the bias (tile_bias) and apply GELU alone
   (tile_gelu), so an activation or a residual is left for it otherwise. */
static int has_epilogue(const kiln_gemm_plan *p, const float *res) {
    return res != NULL || (p->activation != ACT_NONE && !tile_gelu(p, res));
}

/* The bias the tile at columns [col0, ...) starts from: at the first K block (later ones add to C), not for SwiGLU
   (its epilogue adds the interleaved bias to both halves). */
static inline const float *tile_bias(const kiln_gemm_plan *p, long col0, long k0) {
    return p->bias != NULL && k0 == 0 && p->activation != ACT_SWIGLU ? p->bias + col0 : NULL;
}

/* Rows [row0, row0 + m), columns [col0, col0 + n) of y: + bias (with_bias: where no tile added it), activation and
   residual. */
static void epilogue(const kiln_gemm_plan *p, float *y, const float *res, long row0, long col0, int m, int n,
                     int with_bias) {
    const long N = p->N;
    const float *bias = p->bias && with_bias ? p->bias + col0 : NULL;
    for (int i = 0; i < m; ++i) {
        float *c = y + (row0 + i) * N + col0;
        const float *r = res ? res + (row0 + i) * N + col0 : NULL;
        if (bias) for (int j = 0; j < n; ++j) c[j] += bias[j];
        if (r && !p->residual_after) for (int j = 0; j < n; ++j) c[j] += r[j];
        activate(c, n, p->activation, p->alpha, p->beta);
        if (r && p->residual_after) for (int j = 0; j < n; ++j) c[j] += r[j];
    }
}

/* SwiGLU (kiln::FusedGemm's "SwiGLU": y = silu(h[:, :H]) · h[:, H:], h = x Wᵀ + b). gemm_native.py packs
   W = [W_gate; W_up] so that panel q holds gate rows [q·NR/2, (q+1)·NR/2) in its first half and the
   matching up rows in its second (zero rows past H), the bias likewise: a C tile of one panel holds both
   operands of NR/2 output columns. c: the tile (m rows, leading dimension ldc) of panel q, rows from row0;
   y [M, out_n]: the output, written here (+ the residual, after the gating). */
#pragma GCC push_options
#pragma GCC optimize("no-trapping-math")
static void swiglu_epilogue(const kiln_gemm_plan *p, long nr, const float *c, long ldc, float *y, const float *res,
                            long row0, long q, int m) {
    const long half = nr / 2, col0 = q * half, out_n = p->out_n;
    const int n = (int)(out_n - col0 < half ? out_n - col0 : half);
    const float *bias = p->bias ? p->bias + q * nr : NULL;
    float gate[32];  /* half <= 32 (NR <= 64): the gated row, on the stack so that the loop below vectorises */
    for (int i = 0; i < m; ++i) {
        gate_row(gate, c + i * ldc, c + i * ldc + half, bias, bias ? bias + half : NULL, (int)half);
        float *out = y + (row0 + i) * out_n + col0;
        const float *r = res ? res + (row0 + i) * out_n + col0 : NULL;
        if (r) for (int j = 0; j < n; ++j) out[j] = gate[j] + r[j];
        else for (int j = 0; j < n; ++j) out[j] = gate[j];
    }
}
#pragma GCC pop_options

/* ---- the driver -------------------------------------------------------------------------------------- */

static long ceil_div(long a, long b) { return (a + b - 1) / b; }

/* Row blocks: ceil(M / MR) blocks of near-equal size (8 rows: 4 + 4, not 6 + 2; a tile of few rows is
   bound by its loads of W, not by its FMAs). Block q: rows [first, first + rows). */
static void row_block(long M, long blocks, long q, long *first, long *rows) {
    const long base = M / blocks, rem = M % blocks;
    *first = q * base + (q < rem ? q : rem);
    *rows = base + (q < rem);
}

/* The tile for a panel's first n columns: an edge tile where n fits one (fewer FMAs on zero columns, no copy
   through a buffer), else the full-width tile. */
static inline tile_fn tile_for(const kernel_desc *kd, int n, int packed) {
    for (int e = 0; e < 2 && kd->edge_w > 0; ++e)
        if (n <= (e + 1) * kd->edge_w) return packed ? kd->edge_packed[e] : kd->edge_direct[e];
    return packed ? kd->packed : kd->direct;
}

/* Row blocks per M block: the fewest M blocks of at most kd->mc rows (packed A, mc x kc, stays in L2). */
static long blocks_per_m_block(const kernel_desc *kd, long row_blocks) {
    const long most = kd->mc / kd->mr, m_blocks = ceil_div(row_blocks, most);
    return ceil_div(row_blocks, m_blocks);
}

long kiln_gemm_scratch_floats(int kernel, long m, long k) {
    const kernel_desc *kd = &KERNELS[kernel];
    return blocks_per_m_block(kd, ceil_div(m, kd->mr)) * kd->mr * k + 64;
}

/* Work items per thread that panel_chunk aims at (a global so that bench/pool_2threads_gemm.py can time others
   in one process; nothing else writes it). */
long kiln_gemm_items_per_thread = 4;

/* Panels per work item: enough items for every thread to take several (dynamic balance: a core slowed
   by other work takes fewer), at most 8 panels (a chunk's C tile, mc x 8·NR, stays in L2 across the K
   blocks). */
static long panel_chunk(long panels, long row_groups, int threads) {
    long chunk = panels * row_groups / (kiln_gemm_items_per_thread * threads);
    return chunk < 1 ? 1 : (chunk > 8 ? 8 : chunk);
}

/* Slice `part` of `parts` of the `floats` floats at `next` into L2 (nothing when next is NULL): a W panel
   the tiles will read next, prefetched a slice per tile, so that the first tile on it does not wait on W from
   L3 at every line (W is read once and is larger than L2). */
static inline void prefetch_slice(const void *next, long floats, long part, long parts) {
    if (next == NULL) return;
    const long lines = floats * (long)sizeof(float) / 64, per = ceil_div(lines, parts);
    for (long l = part * per; l < (part + 1) * per && l < lines; ++l) __builtin_prefetch((const char *)next + l * 64, 0, 2);
}

/* The shared state of run_small's parallel loop (kiln_parallel_for: pool.c). */
typedef struct {
    const kiln_gemm_plan *p;
    const kernel_desc *kd;
    const float *x;
    float *y;
    const float *res;
    int epi, swiglu, gelu;  /* gelu: tile_gelu's flag */
    long chunk, chunks, group_blocks;
} small_loop;

static void narrow_item(void *loop, long c);
static void small_item(void *loop, long it);

/* x read in place, each tile over the whole K: W streams through once (per row group). Work items: row
   groups (only when the panels alone are too few for the threads) x chunks of panels. */
static void run_small(const kiln_gemm_plan *p, const kernel_desc *kd, const float *x, float *y, const float *res,
                      int threads) {
    const long M = p->M, K = p->K, N = p->N, nr = kd->nr, panels = ceil_div(N, nr);
    const int epi = has_epilogue(p, res), swiglu = p->activation == ACT_SWIGLU;
    /* Past MR rows (two wide row blocks, each re-reading the W panel), up to narrow_mr: every row at once,
       half a panel at a time (8x768x768, one core: ~80 GFLOP/s where 4 + 4 wide rows ran at ~60; at MR rows
       or fewer the wide tile does more FMAs per load and wins) */
    if (kd->narrow != NULL && M > kd->mr && M <= kd->narrow_mr) {
        const long chunk = panel_chunk(panels, 1, threads), chunks = ceil_div(panels, chunk);
        small_loop l = {p, kd, x, y, res, epi, swiglu, tile_gelu(p, res), chunk, chunks, 0};
        kiln_parallel_for(chunks, threads, narrow_item, &l);
        return;
    }
    const long row_blocks = ceil_div(M, kd->mr);
    long groups = ceil_div(2L * threads, panels);
    groups = groups > row_blocks ? row_blocks : groups;
    const long group_blocks = ceil_div(row_blocks, groups);
    const long chunk = panel_chunk(panels, groups, threads), chunks = ceil_div(panels, chunk);
    small_loop l = {p, kd, x, y, res, epi, swiglu, tile_gelu(p, res), chunk, chunks, group_blocks};
    kiln_parallel_for(groups * chunks, threads, small_item, &l);
}

/* The narrow tiles' item: chunk c of the W panels, every row. */
static void narrow_item(void *loop, long c) {
    const small_loop *l = (const small_loop *)loop;
    const kiln_gemm_plan *p = l->p;
    const long M = p->M, K = p->K, N = p->N, nr = l->kd->nr, panels = ceil_div(N, nr), half = nr / 2;
    for (long q = c * l->chunk; q < (c + 1) * l->chunk && q < panels; ++q) {
        float tile[16 * 32] __attribute__((aligned(64)));  /* SwiGLU: both halves of the panel */
        for (long col0 = q * nr; col0 < (q + 1) * nr && col0 < N; col0 += half) {
            const int n = (int)(N - col0 < half ? N - col0 : half);
            const float *w = p->packed_w + q * K * nr + (col0 - q * nr);
            if (l->swiglu) {
                l->kd->narrow((int)M, K, l->x, K, w, tile + (col0 - q * nr), nr, n, 0, NULL);
                continue;
            }
            l->kd->narrow((int)M, K, l->x, K, w, l->y + col0, N, n, l->gelu, tile_bias(p, col0, 0));
            if (l->epi) epilogue(p, l->y, l->res, 0, col0, (int)M, n, 0);
        }
        if (l->swiglu) swiglu_epilogue(p, nr, tile, nr, l->y, l->res, 0, q, (int)M);
    }
}

/* The wide tiles' item `it`: (row group, chunk of W panels). */
static void small_item(void *loop, long it) {
    const small_loop *l = (const small_loop *)loop;
    const kiln_gemm_plan *p = l->p;
    const long M = p->M, K = p->K, N = p->N, nr = l->kd->nr, panels = ceil_div(N, nr);
    const long row_blocks = ceil_div(M, l->kd->mr), g = it / l->chunks, c = it % l->chunks;
    const long r_end = (g + 1) * l->group_blocks < row_blocks ? (g + 1) * l->group_blocks : row_blocks;
    for (long q = c * l->chunk; q < (c + 1) * l->chunk && q < panels; ++q) {
        const long col0 = q * nr;
        const int n = (int)(N - col0 < nr ? N - col0 : nr);
        for (long r = g * l->group_blocks; r < r_end; ++r) {
            long row0, m;
            row_block(M, row_blocks, r, &row0, &m);
            if (l->swiglu) {  /* the tile on the stack, gated into y */
                float tile[16 * 32] __attribute__((aligned(64)));
                l->kd->direct((int)m, K, l->x + row0 * K, K, p->packed_w + q * K * nr, tile, nr, n, 0, NULL);
                swiglu_epilogue(p, nr, tile, nr, l->y, l->res, row0, q, (int)m);
                continue;
            }
            tile_for(l->kd, n, 0)((int)m, K, l->x + row0 * K, K, p->packed_w + q * K * nr, l->y + row0 * N + col0, N, n,
                                  l->gelu, tile_bias(p, col0, 0));
            if (l->epi) epilogue(p, l->y, l->res, row0, col0, (int)m, n, 0);
        }
    }
}

/* A [rows, K] (rows <= MR) -> panel[k][i] */
static void pack_a(const float *x, long K, int rows, int mr, float *panel) {
    for (long k0 = 0; k0 < K; k0 += 64) {
        long kb = K - k0 < 64 ? K - k0 : 64;
        for (int i = 0; i < rows; ++i) {
            const float *src = x + i * K + k0;
            float *dst = panel + k0 * mr + i;
            for (long t = 0; t < kb; ++t) dst[t * mr] = src[t];
        }
    }
}

/* Work items of an M block: row groups (when the panels alone are too few to share among the threads)
   x chunks of panels. */
typedef struct { long groups, group_blocks, chunk, chunks; } item_grid;

static item_grid grid_of(long blocks, long panels, int threads) {
    item_grid g;
    g.groups = ceil_div(2L * threads, panels);
    g.groups = g.groups > blocks ? blocks : g.groups;
    g.group_blocks = ceil_div(blocks, g.groups);
    g.chunk = panel_chunk(panels, g.groups, threads);
    g.chunks = ceil_div(panels, g.chunk);
    return g;
}

/* One item of the K-blocked loop: for each K block, each panel's kc x NR micro-panel stays in L1 while
   the tiles run down the item's row blocks [q0, q1) of the M block starting at row block b0. A is packed
   (a_packed: the M block's panels) or read in place (a_packed NULL). */
static void blocked_item(const kiln_gemm_plan *p, const kernel_desc *kd, const float *x, float *y, float *out,
                         const float *res, const float *a_packed, long row_blocks, long b0, long q0, long q1,
                         long p0, long p1, int epi) {
    const long M = p->M, K = p->K, N = p->N, mr = kd->mr, nr = kd->nr, kc = kd->kc;
    const int gelu = tile_gelu(p, res);
    for (long k0 = 0; k0 < K; k0 += kc) {
        const long kb = K - k0 < kc ? K - k0 : kc;
        const int last = k0 + kb == K;
        for (long pn = p0; pn < p1; ++pn) {
            const long col0 = pn * nr;
            const int n = (int)(N - col0 < nr ? N - col0 : nr);
            const float *b = p->packed_w + pn * K * nr + k0 * nr;
            /* The next kc x NR micro-panel (the next panel's, else the first panel's at the next K block) is
               prefetched into L2 a slice per tile, so that the first tile on it does not wait on W from L3 at
               every line (W is read once and is larger than L2). Measured with the C change above: +9-22% at
               1024 x 768 x 3072 on the AVX2 tile, within the noise at 128 rows (avx2-gemm-2026-12-04d.md). */
            const int next_panel = pn + 1 < p1;
            const char *next = next_panel ? (const char *)(b + K * nr)
                               : k0 + kc < K ? (const char *)(p->packed_w + p0 * K * nr + (k0 + kc) * nr) : NULL;
            const long next_kb = next_panel ? kb : (K - k0 - kc < kc ? K - k0 - kc : kc);
            for (long q = q0; q < q1; ++q) {
                long row0, m;
                row_block(M, row_blocks, b0 + q, &row0, &m);
                prefetch_slice(next, next_kb * nr, q - q0, q1 - q0);
                const float *a = a_packed ? a_packed + q * mr * K + k0 * mr : x + row0 * K + k0;
                tile_for(kd, n, a_packed != NULL)((int)m, kb, a, K, b, y + row0 * N + col0, N, n,
                                                  (k0 > 0 ? KILN_TILE_LOAD_C : 0) | (last ? gelu : 0),
                                                  tile_bias(p, col0, k0));
                if (last && p->activation == ACT_SWIGLU)
                    swiglu_epilogue(p, nr, y + row0 * N + col0, N, out, res, row0, pn, (int)m);
                else if (last && epi) epilogue(p, y, res, row0, col0, (int)m, n, 0);
            }
        }
    }
}

/* K-blocked, x read in place: every item of every M block in one dynamic loop (one fork/join). */
typedef struct {
    const kiln_gemm_plan *p;
    const kernel_desc *kd;
    const float *x, *res;
    float *y, *out;
    item_grid g;
    long per_m_block, per;
    int epi;
} in_place_loop;

static void in_place_item(void *loop, long it) {
    const in_place_loop *l = (const in_place_loop *)loop;
    const long panels = ceil_div(l->p->N, l->kd->nr), row_blocks = ceil_div(l->p->M, l->kd->mr);
    const item_grid g = l->g;
    const long mb = it / l->per, gi = it % l->per / g.chunks, c = it % g.chunks;
    const long b0 = mb * l->per_m_block, blocks = row_blocks - b0 < l->per_m_block ? row_blocks - b0 : l->per_m_block;
    const long q0 = gi * g.group_blocks, q1 = (gi + 1) * g.group_blocks < blocks ? (gi + 1) * g.group_blocks : blocks;
    const long p1 = (c + 1) * g.chunk < panels ? (c + 1) * g.chunk : panels;
    if (q0 < q1) blocked_item(l->p, l->kd, l->x, l->y, l->out, l->res, NULL, row_blocks, b0, q0, q1, c * g.chunk, p1, l->epi);
}

static void run_blocked_in_place(const kiln_gemm_plan *p, const kernel_desc *kd, const float *x, float *y,
                                 float *out, const float *res, int threads) {
    const long panels = ceil_div(p->N, kd->nr), row_blocks = ceil_div(p->M, kd->mr);
    const long per_m_block = blocks_per_m_block(kd, row_blocks), m_blocks = ceil_div(row_blocks, per_m_block);
    const item_grid g = grid_of(per_m_block, panels, threads);
    in_place_loop l = {p, kd, x, res, y, out, g, per_m_block, g.groups * g.chunks, has_epilogue(p, res)};
    kiln_parallel_for(m_blocks * l.per, threads, in_place_item, &l);
}

/* K-blocked GotoBLAS loop, x packed: per M block, the threads pack its MR-row panels (whichever is free
   takes the next), then share its items. Two barriers per M block: a thread that other work deschedules
   holds the others up (measured on a shared 2-core VM: well behind the in-place paths there). */
static void run_blocked_packed(const kiln_gemm_plan *p, const kernel_desc *kd, const float *x, float *y,
                               float *out, const float *res, int threads) {
    const long M = p->M, K = p->K, mr = kd->mr;
    const long panels = ceil_div(p->N, kd->nr), row_blocks = ceil_div(M, mr);
    const long per_m_block = blocks_per_m_block(kd, row_blocks);
    const int epi = has_epilogue(p, res);
    float *a_packed = p->scratch;
    #pragma omp parallel num_threads(threads) if (threads > 1)
    for (long b0 = 0; b0 < row_blocks; b0 += per_m_block) {
        const long blocks = row_blocks - b0 < per_m_block ? row_blocks - b0 : per_m_block;
        #pragma omp for schedule(dynamic, 1)
        for (long q = 0; q < blocks; ++q) {
            long row0, m;
            row_block(M, row_blocks, b0 + q, &row0, &m);
            pack_a(x + row0 * K, K, (int)m, (int)mr, a_packed + q * mr * K);
        }
        const item_grid g = grid_of(blocks, panels, threads);
        #pragma omp for schedule(dynamic, 1)
        for (long it = 0; it < g.groups * g.chunks; ++it) {
            const long gi = it / g.chunks, c = it % g.chunks;
            const long q1 = (gi + 1) * g.group_blocks < blocks ? (gi + 1) * g.group_blocks : blocks;
            const long p1 = (c + 1) * g.chunk < panels ? (c + 1) * g.chunk : panels;
            blocked_item(p, kd, x, y, out, res, a_packed, row_blocks, b0, gi * g.group_blocks, q1, c * g.chunk, p1,
                         epi);
        }
    }
}

/* One call of a native segment (kiln/runtime/native.py), or of the layer run on its own. */
int kiln_gemm(void *object, void *stream, int nargs, const void *args) {
    (void)stream; (void)nargs; (void)args;
    const kiln_gemm_plan *p = (const kiln_gemm_plan *)object;
    if (p->kernel < 0 || p->kernel >= KERNEL_COUNT) return 2;
    const kernel_desc *kd = &KERNELS[p->kernel];
    const float *x = (const float *)p->src, *res = (const float *)p->residual;
    float *y = (float *)p->dst;
    if (p->get_handle != NULL) {
        void *h = NULL;
        if (p->get_handle(p->src, &h) != 0 || h == NULL) return 2;
        x = (const float *)h;
        if (p->get_handle(p->dst, &h) != 0 || h == NULL) return 2;
        y = (float *)h;
        if (p->residual != NULL) {
            if (p->get_handle(p->residual, &h) != 0 || h == NULL) return 2;
            res = (const float *)h;
        }
    }
    if (p->M <= 0 || p->N <= 0) return 0;
    const int swiglu = p->activation == ACT_SWIGLU;
    if (swiglu && p->K <= 0) {  /* an empty sum: y = silu(b_gate) · b_up */
        static const float zeros[64];
        for (long i = 0; i < p->M; ++i)
            for (long q = 0; q < ceil_div(p->N, kd->nr); ++q) swiglu_epilogue(p, kd->nr, zeros, 0, y, res, i, q, 1);
        return 0;
    }
    if (p->K <= 0) {  /* an empty sum: y = epilogue(0) */
        for (long i = 0; i < p->M; ++i) memset(y + i * p->N, 0, (size_t)p->N * sizeof(float));
        for (long i = 0; i < p->M; ++i) epilogue(p, y, res, i, 0, 1, (int)p->N, 1);
        return 0;
    }
    int threads = p->threads;
#ifdef _OPENMP
    if (threads <= 0) threads = omp_get_max_threads();  /* what torch.set_num_threads set (one libgomp) */
#endif
    if (threads < 1) threads = 1;
    if (p->M <= p->small_m) {
        run_small(p, kd, x, y, res, threads);
        return 0;
    }
    /* the K-blocked paths revisit C per K block: SwiGLU's C goes to c_scratch, gated into y at the last one */
    float *c = swiglu ? p->c_scratch : y;
    if (c == NULL) return 3;
    if (p->M > p->pack_m) run_blocked_packed(p, kd, x, c, y, res, threads);
    else run_blocked_in_place(p, kd, x, c, y, res, threads);
    return 0;
}
