/* One direction of an ONNX LSTM layer (the default activations, no clip, peepholes or input_forget) with
 * the batch in the vector lanes: for a small batch (N <= 8) each step is one pass over the gate rows of W
 * and R, with the cell on the accumulators while they are in registers. Compiled after gemm.c,
 * recurrent.c and lstm.c (kiln/kernels/cpu/recurrent.py), on recurrent.c's plan, sequence lengths and
 * thread loop (run_stages).
 *
 *   per step s, per tile of UT hidden units (its 4·UT gate rows, i o f c of each unit):
 *       acc[r] = b[r] + Σ_k W[r, k]·xᵀ[k, :] + Σ_k R[r, k]·hᵀ[k, :]     acc[r]: a vector of the 8 batch rows
 *       i, o, f = σ(acc_i, acc_o, acc_f);  c = f ⊙ c + i ⊙ tanh(acc_c);  h = o ⊙ tanh(c)
 *
 * Why: with the batch across the columns (lstm.c), a batch of 8 is 6 + 2 rows of the 6x16 AVX2 tile (the
 * 2-row tile waits on its FMA latency), the input projection is a GEMM of its own over every step whose
 * output (S·N·4H floats, 1.5 MB at 96 steps, 8 rows, 128 units) leaves L2 before the loop reads it back,
 * and the cell runs row by row over 16-unit slices. Here the tile is UT units x 4 gates = 12 accumulators
 * of 8 lanes on AVX2 (24 on AVX-512, 32 registers), each FMA's operands a broadcast weight and one vector
 * of xᵀ or hᵀ; the input projection is the first K = I of the same accumulation (no xw buffer), and the
 * cell is vector code on whole registers. Measured (one AVX2 EPYC core, CPU time, batch 8, 96 steps,
 * 128 units): bench/results/recurrent-2026-12-02-lstm.md.
 *
 * Layouts: W and R packed per tile, [tiles][K][4·UT] (row q·UT + j of a tile: gate q of unit tile·UT + j,
 * zeros past H), the bias [tiles][4·UT] (Wb + Rb); xᵀ for every step, [S][I][8] in step order (a reverse
 * direction reads X backwards within each row's length), hᵀ and cᵀ [tiles·UT][8]. Lanes past N compute
 * on zeros and are never stored. Rows past their length keep h and c and write zeros to Y (recurrent.c).
 */

#include "exp_poly.h"

#define LANES 8

typedef float lanes_v __attribute__((vector_size(LANES * 4)));
typedef int lanes_i __attribute__((vector_size(LANES * 4)));

typedef struct {
    const kiln_recurrent_plan *p;
    float *xt, *h, *c;          /* xᵀ [S][I][8]; hᵀ of every step [S + 1][H'][8] (0: h0); cᵀ [H'][8] */
    long tiles, chunk;          /* tiles of UT units; tiles per work item */
    int ut;
    lanes_i lengths;            /* each lane's length (S past N) */
} lanes_ctx;

typedef void (*lanes_tile_fn)(const lanes_ctx *c, long step, long tile);

#if defined(__x86_64__) || defined(__i386__)
static int has_avx512_vl(void) { return has_avx512() && __builtin_cpu_supports("avx512vl"); }
#endif

typedef struct {
    const char *name;
    int units;                  /* UT: hidden units per tile */
    lanes_tile_fn tile;
    int (*supported)(void);
    int test_only;
} lanes_kernel;

#pragma GCC push_options
#pragma GCC optimize("no-trapping-math")

static inline __attribute__((always_inline)) lanes_v lanes_select(lanes_i mask, lanes_v a, lanes_v b) {
    return (lanes_v)((mask & (lanes_i)a) | (~mask & (lanes_i)b));
}
static inline __attribute__((always_inline)) lanes_v lanes_clamp(lanes_v x, float lo, float hi) {
    const lanes_v l = (lanes_v){0} + lo, u = (lanes_v){0} + hi;
    x = lanes_select(x < l, l, x);
    return lanes_select(x > u, u, x);
}

static inline __attribute__((always_inline)) lanes_v lanes_div(lanes_v a, lanes_v b) { return a / b; }

/* exp_poly (exp_poly.h) and gemm.c's tanh_rational (the scalar cell's and the GEMM epilogue's) on a vector V of
   floats (VI: of ints), with the caller's CLAMP(x, lo, hi) and DIV(a, b); lstm_fused.c takes the tanh. With a
   division and select-based clamps (this file's), the same operations in the same order as the scalar forms, so
   both cells round alike (but for exp's n near a half-integer: exp_poly.h). */
#define LSTM_VECTOR_MATH(NAME, TARGET, V, VI, CLAMP, DIV)                                                    \
    LSTM_VECTOR_SIGMOID(NAME, TARGET, V, VI, CLAMP, DIV)                                                     \
    LSTM_VECTOR_TANH(NAME, TARGET, V, CLAMP, DIV)

#define LSTM_VECTOR_SIGMOID(NAME, TARGET, V, VI, CLAMP, DIV)                                                 \
    KILN_VEXP(NAME##_exp, static inline __attribute__((always_inline)) TARGET, V, VI, CLAMP)                 \
    static inline __attribute__((always_inline)) TARGET V NAME##_sigmoid(V x) {                             \
        return DIV((V){0} + 1.0f, 1.0f + NAME##_exp(-x));                                                    \
    }

#define LSTM_VECTOR_TANH(NAME, TARGET, V, CLAMP, DIV)                                                        \
    static inline __attribute__((always_inline)) TARGET V NAME##_tanh(V x) {                                \
        x = CLAMP(x, -9.0f, 9.0f);                                                                           \
        const V x2 = x * x;                                                                                  \
        V p = (V){0} - 2.76076847742355e-16f;                                                                \
        p = p * x2 + 2.00018790482477e-13f;                                                                  \
        p = p * x2 - 8.60467152213735e-11f;                                                                  \
        p = p * x2 + 5.12229709037114e-08f;                                                                  \
        p = p * x2 + 1.48572235717979e-05f;                                                                  \
        p = p * x2 + 6.37261928875436e-04f;                                                                  \
        p = p * x2 + 4.89352455891786e-03f;                                                                  \
        V q = (V){0} + 1.19825839466702e-06f;                                                                \
        q = q * x2 + 1.18534705686654e-04f;                                                                  \
        q = q * x2 + 2.26843463243900e-03f;                                                                  \
        q = q * x2 + 4.89352518554385e-03f;                                                                  \
        return CLAMP(DIV(x * p, q), -1.0f, 1.0f);                                                            \
    }

/* One tile at one step: the accumulation (UT·4 vectors in registers) and the cell of its UT units. */
#define LANES_TILE(NAME, TARGET, UT)                                                                          \
    LSTM_VECTOR_MATH(NAME, TARGET, lanes_v, lanes_i, lanes_clamp, lanes_div)                                 \
    static TARGET void NAME##_tile(const lanes_ctx *c, long s, long t) {                                     \
        const kiln_recurrent_plan *p = c->p;                                                                 \
        const long I = p->I, H = p->H;                                                                       \
        enum { R = 4 * (UT) };                                                                               \
        lanes_v acc[4 * (UT)];                                                                               \
        const float *b = p->bias + t * R;                                                                    \
        _Pragma("GCC unroll 32") for (int r = 0; r < R; ++r) acc[r] = (lanes_v){0} + b[r];                   \
        const float *w = p->packed_w + t * I * R, *x = c->xt + s * I * LANES;                                \
        _Pragma("GCC unroll 4") for (long k = 0; k < I; ++k) {                                              \
            lanes_v xv;                                                                                      \
            memcpy(&xv, x + k * LANES, sizeof xv);                                                           \
            _Pragma("GCC unroll 32") for (int r = 0; r < R; ++r) acc[r] += w[k * R + r] * xv;                \
        }                                                                                                    \
        const long units = c->tiles * (UT);                                                                  \
        const float *h_prev = c->h + s * units * LANES;                                                      \
        float *h_next = c->h + (s + 1) * units * LANES;                                                      \
        if (s > 0 || p->h0 != NULL) {                                                                        \
            const float *rw = p->packed_r + t * H * R;                                                       \
            _Pragma("GCC unroll 4") for (long k = 0; k < H; ++k) {                                          \
                lanes_v hv;                                                                                  \
                memcpy(&hv, h_prev + k * LANES, sizeof hv);                                                  \
                _Pragma("GCC unroll 32") for (int r = 0; r < R; ++r) acc[r] += rw[k * R + r] * hv;           \
            }                                                                                                \
        }                                                                                                    \
        const lanes_i active = (lanes_i){0} + (int)s < c->lengths;                                           \
        _Pragma("GCC unroll 8") for (int j = 0; j < (UT); ++j) {                                             \
            const long u = t * (UT) + j;                                                                     \
            if (u >= H) break;                                                                               \
            lanes_v c_old, h_old;                                                                            \
            memcpy(&c_old, c->c + u * LANES, sizeof c_old);                                                  \
            memcpy(&h_old, h_prev + u * LANES, sizeof h_old);                                                \
            const lanes_v i = NAME##_sigmoid(acc[j]), o = NAME##_sigmoid(acc[(UT) + j]);                     \
            const lanes_v f = NAME##_sigmoid(acc[2 * (UT) + j]);                                             \
            const lanes_v cell = f * c_old + i * NAME##_tanh(acc[3 * (UT) + j]);                             \
            const lanes_v h = o * NAME##_tanh(cell);                                                         \
            const lanes_v c_new = lanes_select(active, cell, c_old), h_new = lanes_select(active, h, h_old);  \
            memcpy(c->c + u * LANES, &c_new, sizeof c_new);                                                  \
            memcpy(h_next + u * LANES, &h_new, sizeof h_new);                                                \
        }                                                                                                    \
    }

#if defined(__x86_64__) || defined(__i386__)
/* 24 accumulators of AVX-512's 32 registers: ymm16-31 need AVX-512VL */
LANES_TILE(lanes_avx512, __attribute__((target("avx512f,avx512vl,avx2,fma"))), 6)
LANES_TILE(lanes_avx2, KILN_AVX2, 3)      /* 12 of 16 */
#ifdef KILN_GEMM_TEST_KERNELS
LANES_TILE(lanes_wide_on_avx2, KILN_AVX2, 6)  /* AVX-512's tiling run with AVX2 instructions: for the tests */
#endif
#endif
LANES_TILE(lanes_generic, , 2)

#pragma GCC pop_options

static const lanes_kernel LANES_KERNELS[] = {
#if defined(__x86_64__) || defined(__i386__)
    {"avx512 6 units x 8 lanes", 6, lanes_avx512_tile, has_avx512_vl, 0},
    {"avx2 3 units x 8 lanes", 3, lanes_avx2_tile, has_avx2, 0},
#ifdef KILN_GEMM_TEST_KERNELS
    {"avx512 6 units x 8 lanes on avx2 (test)", 6, lanes_wide_on_avx2_tile, has_avx2, 1},
#endif
#endif
    {"generic 2 units x 8 lanes", 2, lanes_generic_tile, always, 0},
};
#define LANES_KERNEL_COUNT ((int)(sizeof(LANES_KERNELS) / sizeof(LANES_KERNELS[0])))

int kiln_lstm_lanes_kernel_count(void) { return LANES_KERNEL_COUNT; }
const char *kiln_lstm_lanes_kernel_name(int i) { return i >= 0 && i < LANES_KERNEL_COUNT ? LANES_KERNELS[i].name : NULL; }
int kiln_lstm_lanes_kernel_supported(int i) { return i >= 0 && i < LANES_KERNEL_COUNT && LANES_KERNELS[i].supported(); }
int kiln_lstm_lanes_kernel_test_only(int i) { return i >= 0 && i < LANES_KERNEL_COUNT && LANES_KERNELS[i].test_only; }
int kiln_lstm_lanes_batch(void) { return LANES; }

static long lanes_tiles(int kernel, long h) { return (h + LANES_KERNELS[kernel].units - 1) / LANES_KERNELS[kernel].units; }

/* Floats of a packed W [4H, K] (ONNX's gate order i, o, f, c) for `kernel`. */
long kiln_lstm_lanes_packed_floats(int kernel, long h, long k) {
    return lanes_tiles(kernel, h) * k * 4 * LANES_KERNELS[kernel].units;
}

/* out[t][k][q·UT + j] = w[q·H + t·UT + j][k] (zeros past H); `bias` [4H] (or NULL) into out_bias [tiles][4·UT]. */
void kiln_lstm_lanes_pack(int kernel, const float *w, long h, long k, float *out, const float *bias, float *out_bias) {
    const long ut = LANES_KERNELS[kernel].units, tiles = lanes_tiles(kernel, h), rows = 4 * ut;
    for (long t = 0; t < tiles; ++t)
        for (long q = 0; q < 4; ++q)
            for (long j = 0; j < ut; ++j) {
                const long unit = t * ut + j, r = q * ut + j;
                for (long kk = 0; kk < k; ++kk)
                    out[(t * k + kk) * rows + r] = unit < h ? w[(q * h + unit) * k + kk] : 0.0f;
                if (out_bias) out_bias[t * rows + r] = unit < h && bias ? bias[q * h + unit] : 0.0f;
            }
}

/* xᵀ [S][I][8], hᵀ [S + 1][tiles·UT][8], cᵀ [tiles·UT][8] */
long kiln_lstm_lanes_scratch_floats(int kernel, long s, long i, long h) {
    const long units = lanes_tiles(kernel, h) * LANES_KERNELS[kernel].units;
    return s * i * LANES + (s + 2) * units * LANES;
}

typedef struct {
    loop_ctx loop;  /* first: run_stages hands it back to lanes_item */
    lanes_ctx lanes;
    lanes_tile_fn tile;
} lanes_loop;

static void lanes_item(const loop_ctx *c, long step, long item) {
    const lanes_loop *l = (const lanes_loop *)c;
    const long t_end = (item + 1) * l->lanes.chunk < l->lanes.tiles ? (item + 1) * l->lanes.chunk : l->lanes.tiles;
    for (long t = item * l->lanes.chunk; t < t_end; ++t) l->tile(&l->lanes, step, t);
}

/* plan.packed_w / packed_r / bias: kiln_lstm_lanes_pack's layouts for plan.kernel, an index of LANES_KERNELS. */
int kiln_lstm_lanes(void *object, void *stream, int nargs, const void *args) {
    (void)stream; (void)nargs; (void)args;
    kiln_recurrent_plan *p = (kiln_recurrent_plan *)object;
    if (p->kernel < 0 || p->kernel >= LANES_KERNEL_COUNT || p->gates != 4 || p->generic || p->N > LANES) return 2;
    if (p->S <= 0 || p->N <= 0) return 0;
    const long S = p->S, N = p->N, I = p->I, H = p->H;
    const int ut = LANES_KERNELS[p->kernel].units;
    lanes_loop l;
    memset(&l, 0, sizeof l);
    l.tile = LANES_KERNELS[p->kernel].tile;
    lanes_ctx *c = &l.lanes;
    c->p = p;
    c->ut = ut;
    c->tiles = lanes_tiles(p->kernel, H);
    const long units = c->tiles * ut;
    c->xt = p->scratch;
    c->h = c->xt + S * I * LANES;
    c->c = c->h + (S + 1) * units * LANES;
    l.loop.p = p;
    for (int n = 0; n < LANES; ++n) c->lengths[n] = n < N ? (int)length_of(p, n) : (int)S;
    /* xᵀ in step order: step s of row n reads X at time s, or length−1−s reversed (past the length: s) */
    for (long s = 0; s < S; ++s) {
        float *xs = c->xt + s * I * LANES;
        for (long n = 0; n < LANES; ++n) {
            if (n >= N) {
                for (long i = 0; i < I; ++i) xs[i * LANES + n] = 0.0f;
                continue;
            }
            const long length = length_of(p, n);
            const long t = p->reverse && s < length ? length - 1 - s : s;
            const float *x = p->x + row_of(p, t, n) * I;
            for (long i = 0; i < I; ++i) xs[i * LANES + n] = x[i];
        }
    }
    memset(c->h, 0, (size_t)(units * LANES) * sizeof(float));
    memset(c->c, 0, (size_t)(units * LANES) * sizeof(float));
    for (long n = 0; n < N; ++n)
        for (long u = 0; u < H; ++u) {
            if (p->h0) c->h[u * LANES + n] = p->h0[n * p->state_ns + u];
            if (p->c0) c->c[u * LANES + n] = p->c0[n * p->state_ns + u];
        }
    const int threads = recurrent_threads(p);
    const long items_wanted = threads > 1 ? 4L * threads : 1;
    c->chunk = (c->tiles + items_wanted - 1) / items_wanted;
    const long items = (c->tiles + c->chunk - 1) / c->chunk;
    p->stalled = run_stages(&l.loop, S, items, threads, lanes_item);
    /* Y from hᵀ of every step: off the loop's path, each row written contiguously */
    for (long s = 0; p->y != NULL && s < S; ++s) {
        const float *hs = c->h + (s + 1) * units * LANES;
        for (long n = 0; n < N; ++n) {
            float *y = y_row(p, s, n);
            if (s >= length_of(p, n)) memset(y, 0, (size_t)H * sizeof(float));
            else for (long u = 0; u < H; ++u) y[u] = hs[u * LANES + n];
        }
    }
    const float *h = c->h + S * units * LANES;
    for (long n = 0; n < N; ++n) {
        const int empty = length_of(p, n) == 0;
        for (long u = 0; u < H; ++u) {
            if (p->yh) p->yh[n * p->state_ns + u] = empty ? 0.0f : h[u * LANES + n];
            if (p->yc) p->yc[n * p->state_ns + u] = empty ? 0.0f : c->c[u * LANES + n];
        }
    }
    return 0;
}
