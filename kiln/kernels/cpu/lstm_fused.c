/* One direction of an ONNX LSTM layer (the default activations, no clip, peepholes or input_forget) with
 * the input projection, the recurrent GEMM and the cell of a step in one register tile: the batch in the
 * rows, the four gates of a block of U hidden units in the columns (one vector each). Compiled after
 * gemm.c, recurrent.c, lstm.c and lstm_lanes.c (kiln/kernels/cpu/recurrent.py), on recurrent.c's plan,
 * sequence lengths, states and thread loop (run_stages).
 *
 *   per step s, per block of U units, per group of up to MR batch rows n:
 *       acc[n][q] = b_q + Σ_k W_q[:, k]·x[n, k] + Σ_k R_q[:, k]·h[n, k]     q = i, o, f, c: U lanes each
 *       i, o, f = σ(acc_i, acc_o, acc_f);  c = f ⊙ c + i ⊙ tanh(acc_c);  h = o ⊙ tanh(c);  Y = h
 *
 * Why: lstm.c (cpu.lstm.native) runs the input projection as a GEMM of its own over every step, whose
 * output (S·N·4H floats, 1.5 MB at 96 steps, 8 rows, 128 units) is written and read back, its gate panels
 * store their sums to that buffer and the cell reads them again row by row as scalar code the compiler
 * vectorises at 256 bits. lstm_lanes.c puts the batch in 8-lane vectors, so an AVX-512 core runs it at
 * half its FMA width. On an AVX-512 Xeon (one core, CPU time, batch 8, 96 steps, 128 units, I = 16)
 * lstm.c's gate panels ran at ~82 GFLOP/s, but the cell loop took 0.8 ms and the input GEMM (K = 16)
 * 0.45 ms of a 2.8 ms call. Here each FMA is a broadcast of x or h times a vector of U weights (16 on
 * AVX-512), the sums never leave the registers, and the cell is vector code on them.
 *
 * Two tiles: the four gates of up to MR rows in one pass over K (FUSED_ROWS), and the gates in two passes of two
 * (FUSED_PAIRS: each weight read once a step for more rows): on AVX-512 for a batch past its 6 rows, up to 8; on
 * AVX2 full tiles of 6 rows, the rest one-pass (fused_tiles: 8 rows as 6 + 2). A third on AVX2 where no step's
 * blocks are shared between threads (FUSED_WIDE: 4 rows, the gates i, c̃, f of a block, then the o gates of up to 3
 * blocks, each weight read once a step): the row split's 4-row slices, and one thread's rest of 4 or 8 rows.
 *
 * Threads: where each gets two rows or more, each runs a slice of the batch's rows through every step
 * (fused_row_slice): a row's recurrence reads only its own h and c, so the threads never wait for each other
 * (kiln_parallel_for's join at the end; a worker that starts late finds its slice taken). Else they split each
 * step's unit blocks, a barrier a step (run_stages_ahead), each thread computing the x parts of its blocks of the
 * next step before it waits there (fused_ahead). The zoo's LSTM forecaster (batch 8) at 2 threads on the Xeon:
 * 1.06 ms against 1.40 (onnxruntime 1.28), capped to AVX2 1.96 against 2.05 (1.96); on the Zen 4 EPYC capped to
 * AVX2 since the wide tile the row split 0.86x onnxruntime against the block split's 1.00x (load 10).
 *
 * Layouts: W and R packed per block, side by side along K, as two panels [blocks][2][I + H][2·U] (panel A
 * gates i, c̃, panel B f, o; column slot·U + j: unit block·U + j, zeros past H), the bias [blocks][4·U] (Wb + Rb,
 * slots i, c̃, f, o). h ping-pongs between
 * two [N, H] buffers (a step reads all of the previous h), c is [N, H]. A work item is one block for its
 * row groups (some of them where a thread would otherwise get fewer than two items); in the block split a step's
 * items all finish before the next step's start (recurrent.c's run_stages).
 * Rows past their length keep h and c and write zeros to Y; a reverse direction reads X backwards within
 * each row's length (recurrent.c).
 */

typedef struct fused_ctx fused_ctx;
typedef void (*fused_rows_fn)(const fused_ctx *c, long step, long block, long row0);
/* sums[i][slot·U + j] = bias + Σ_k x_i[k]·W[k] of a block's four gates for m rows from row0 (fused_ahead) */
typedef void (*fused_ahead_fn)(const fused_ctx *c, long step, long block, long row0, float *sums);

typedef struct {
    const char *name;
    int units;                  /* U: hidden units of a block (one vector) */
    int mr;                     /* rows of the widest one-pass tile */
    fused_rows_fn rows[8];      /* rows[m - 1]: a one-pass tile of m <= mr batch rows (FUSED_ROWS) */
    int pairs_mr;               /* rows of the widest two-pass tile, or 0: none */
    fused_rows_fn pairs[8];     /* pairs[m - 1]: a two-pass tile of m <= pairs_mr rows (FUSED_PAIRS) */
    int (*supported)(void);
    int test_only;
    int pairs_full;             /* 1: the rows as full two-pass tiles, the rest one-pass (fused_tiles); 0: even */
    fused_ahead_fn ahead[6];    /* ahead[m - 1]: the x part of a one-pass tile's m rows (FUSED_AHEAD), or NULL */
    fused_ahead_fn ahead_pairs[8]; /* ... of a two-pass tile's m rows, in its two passes */
    int wide_rows;              /* rows of the wide tile (FUSED_WIDE), or 0: none */
    fused_rows_fn wide[3];      /* wide[nb - 1]: the wide tile over nb blocks from `block` */
} fused_kernel;

/* One tile of a step's block: `rows` batch rows from row0, on `tile`. */
typedef struct {
    long row0, rows;
    fused_rows_fn tile;         /* or NULL: the kernel's wide tile, over groups of blocks (fused_row_slice) */
} fused_span;

struct fused_ctx {
    loop_ctx loop;              /* first: run_stages hands it back to fused_item */
    const kiln_recurrent_plan *p;
    const fused_kernel *kernel;
    const fused_span *spans;    /* the row groups of a step, in row order (fused_tiles) */
    float *h[2], *c;            /* h of even / odd steps' inputs [N, H]; c [N, H] */
    long blocks, groups;        /* unit blocks; row groups of a step (spans) */
    long per_item;              /* row groups of one work item (fused_item) */
    /* the block split's x parts computed ahead (fused_ahead), or NULL: at step s, block b's rows' sums are
       ahead_sums[s % 2][b][n][4·U] where ahead_step[(s % 2)·blocks + b].step is s + 1 */
    float *ahead_sums;
    struct { _Alignas(64) long step; } *ahead_step;
};

/* Block `block`'s x part of step `step` computed ahead, from row0's row on, or NULL: the tile computes it. */
static inline const float *fused_ahead_sums(const fused_ctx *c, long step, long block, long row0) {
    if (!c->ahead_sums) return NULL;
    const long slot = step % 2 * c->blocks + block;
    if (__atomic_load_n(&c->ahead_step[slot].step, __ATOMIC_ACQUIRE) != step + 1) return NULL;
    return c->ahead_sums + (slot * c->p->N + row0) * 4 * c->kernel->units;
}

/* Where row n reads X at step `step` (reverse: backwards within its length; past it: any row, unused). */
static const float *fused_x_row(const kiln_recurrent_plan *p, long step, long n) {
    const long length = length_of(p, n);
    long t = step;
    if (p->reverse) t = step < length ? length - 1 - step : step;
    return p->x + row_of(p, t, n) * p->I;
}

#include <stdlib.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#pragma GCC push_options
#pragma GCC optimize("no-trapping-math")

typedef float fused_v4 __attribute__((vector_size(16)));
typedef int fused_i4 __attribute__((vector_size(16)));
static inline fused_v4 fused_min(fused_v4 a, fused_v4 b) { const fused_i4 m = a < b; return (fused_v4)((m & (fused_i4)a) | (~m & (fused_i4)b)); }
static inline fused_v4 fused_max(fused_v4 a, fused_v4 b) { const fused_i4 m = a > b; return (fused_v4)((m & (fused_i4)a) | (~m & (fused_i4)b)); }
static inline fused_v4 fused_rcp(fused_v4 d) { return 1.0f / d; }

/* σ and tanh, with the ISA's min / max for the clamps and its reciprocal estimate plus one Newton step for the
   divisions (RCP: 14 bits on AVX-512, 12 on AVX2; one step gives ~2 ulp): the cell costs as much as a third of
   the step's FMAs at 8 rows x 128 units, and a vector division is the slowest of its operations. tanh is
   lstm_lanes.c's LSTM_VECTOR_TANH (gemm.c's tanh_rational on a vector); σ is the rational form MLAS's logistic
   takes from Eigen, x·p(x²) / q(x²) + 1/2 on x clamped to ±18 (p of degree 4 in x², q of 5; within 2.2e-7
   of the exact σ): 17 operations against 25 for 1 / (1 + exp(-x)), and a chain two thirds as long, since p and q
   run side by side. σ and tanh were 10-16% of a layer's time; capped to AVX2 (one thread, batch 8, 128 units,
   96 steps, I = 16 / 128) a layer ran 1.333 -> 1.319 ms and 2.199 -> 2.153 ms, with AVX-512 0.812 -> 0.781 and
   1.324 -> 1.290 (bench/recurrent_layer_ab.py, bench/results/lstmavx2-2026-12-05c.md). */
#define FUSED_MATH(NAME, TARGET, V, MIN, MAX, RCP)                                                           \
    static inline __attribute__((always_inline)) TARGET V NAME##_clamp(V x, float lo, float hi) {           \
        return (V)MIN(MAX(x, (V){0} + lo), (V){0} + hi);                                                     \
    }                                                                                                        \
    static inline __attribute__((always_inline)) TARGET V NAME##_div(V a, V d) {                            \
        const V r = (V)RCP(d);                                                                               \
        return a * (r * (2.0f - d * r));                                                                     \
    }                                                                                                        \
    static inline __attribute__((always_inline)) TARGET V NAME##_sigmoid(V x) {                             \
        x = NAME##_clamp(x, -18.0f, 18.0f);                                                                  \
        const V x2 = x * x;                                                                                  \
        V p = (V){0} + 4.37031012579801e-11f;                                                                \
        p = p * x2 + 1.15627324459942e-07f;                                                                  \
        p = p * x2 + 6.08574864600143e-05f;                                                                  \
        p = p * x2 + 8.51377133304701e-03f;                                                                  \
        p = p * x2 + 2.48287947061529e-01f;                                                                  \
        V q = (V){0} + 6.10247389755681e-13f;                                                                \
        q = q * x2 + 5.76102136993427e-09f;                                                                  \
        q = q * x2 + 6.29106785017040e-06f;                                                                  \
        q = q * x2 + 1.70198817374094e-03f;                                                                  \
        q = q * x2 + 1.16817656904453e-01f;                                                                  \
        q = q * x2 + 9.93151921023180e-01f;                                                                  \
        return NAME##_div(x * p, q) + 0.5f;                                                                  \
    }                                                                                                        \
    LSTM_VECTOR_TANH(NAME, TARGET, V, NAME##_clamp, NAME##_div)

/* What both tiles below declare first: the block's panels and bias, the rows' X and h, where the block's
   units go. */
#define FUSED_PROLOGUE(U, M)                                                                                 \
    const kiln_recurrent_plan *p = c->p;                                                                     \
    const long I = p->I, H = p->H;                                                                           \
    const float *w = p->packed_w + block * (I + H) * 4 * (U), *b = p->bias + block * 4 * (U);                \
    const float *x[M];                                                                                       \
    _Pragma("GCC unroll 8") for (int i = 0; i < (M); ++i) x[i] = fused_x_row(p, step, row0 + i);             \
    const float *h_prev = c->h[step % 2] + row0 * H;                                                         \
    const int recurrent = step > 0 || p->h0 != NULL;                                                         \
    const long j0 = block * (U), width = H - j0 < (U) ? H - j0 : (U);                                        \
    float *h_next = c->h[(step + 1) % 2] + row0 * H + j0, *cell = c->c + row0 * H + j0;                    \
    const float *xs = fused_ahead_sums(c, step, block, row0);

/* acc[i][q] = bias_q + Σ_k x_i[k]·W[k][q] + Σ_k h_i[k]·R[k][q] for G gate vectors: q = 0, 1 from panel A, q = 2, 3
   from panel B (each [I + H][2·U], kiln_lstm_fused_pack's; G = 2 reads panel A only) */
#define FUSED_SUMS(V, U, M, G, PANEL_A, PANEL_B, BIAS)                                                       \
    if (xs) { /* the x part computed ahead (fused_ahead): the same sums in the same order */                 \
        _Pragma("GCC unroll 4") for (int q = 0; q < (G); ++q)                                                \
            _Pragma("GCC unroll 8") for (int i = 0; i < (M); ++i)                                            \
                memcpy(&acc[i][q], xs + i * 4 * (U) + ((BIAS) - b) + q * (U), sizeof(V));                   \
    } else {                                                                                                 \
        _Pragma("GCC unroll 4") for (int q = 0; q < (G); ++q) {                                              \
            V bq;                                                                                            \
            memcpy(&bq, (BIAS) + q * (U), sizeof bq);                                                        \
            _Pragma("GCC unroll 8") for (int i = 0; i < (M); ++i) acc[i][q] = bq;                            \
        }                                                                                                    \
        for (long k = 0; k < I; ++k) {                                                                       \
            V wv[G];                                                                                         \
            _Pragma("GCC unroll 4") for (int q = 0; q < (G); ++q)                                            \
                memcpy(&wv[q], (q < 2 ? (PANEL_A) : (PANEL_B)) + k * 2 * (U) + q % 2 * (U), sizeof(V));     \
            _Pragma("GCC unroll 8") for (int i = 0; i < (M); ++i) {                                          \
                const float xk = x[i][k];  /* a scalar times a vector: the broadcast is the FMA's operand */ \
                _Pragma("GCC unroll 4") for (int q = 0; q < (G); ++q) acc[i][q] += xk * wv[q];               \
            }                                                                                                \
        }                                                                                                    \
    }                                                                                                        \
    if (recurrent) {                                                                                         \
        for (long k = I; k < I + H; ++k) {                                                                   \
            V wv[G];                                                                                         \
            _Pragma("GCC unroll 4") for (int q = 0; q < (G); ++q)                                            \
                memcpy(&wv[q], (q < 2 ? (PANEL_A) : (PANEL_B)) + k * 2 * (U) + q % 2 * (U), sizeof(V));     \
            _Pragma("GCC unroll 8") for (int i = 0; i < (M); ++i) {                                          \
                const float hs = h_prev[i * H + k - I];                                                      \
                _Pragma("GCC unroll 4") for (int q = 0; q < (G); ++q) acc[i][q] += hs * wv[q];               \
            }                                                                                                \
        }                                                                                                    \
    }

/* c_old[i]: the rows' cell state of the block's units (zeros past H) */
#define FUSED_C_OLD(V, U, M)                                                                                 \
    V c_old[M];                                                                                              \
    _Pragma("GCC unroll 8") for (int i = 0; i < (M); ++i) {                                                  \
        c_old[i] = (V){0};                                                                                   \
        if (width == (U)) memcpy(&c_old[i], cell + i * H, sizeof c_old[i]);                                  \
        else memcpy(&c_old[i], cell + i * H, (size_t)width * sizeof(float));                                 \
    }

/* The rows' new c and h of the block's units to the state and Y (a row past its length holds its state) */
#define FUSED_STORE(U, M, C_NEW, H_NEW)                                                                      \
    _Pragma("GCC unroll 8") for (int i = 0; i < (M); ++i) {                                                  \
        if (step >= length_of(p, row0 + i)) {                                                                \
            hold_row(p, step, row0 + i, c->h[step % 2], c->h[(step + 1) % 2], j0, width);                    \
            continue;                                                                                        \
        }                                                                                                    \
        float *y = y_row(p, step, row0 + i);                                                                 \
        const size_t bytes = (size_t)width * sizeof(float);                                                  \
        if (width == (U)) {                                                                                  \
            memcpy(cell + i * H, &(C_NEW), sizeof(C_NEW));                                                   \
            memcpy(h_next + i * H, &(H_NEW), sizeof(H_NEW));                                                 \
            if (y != NULL) memcpy(y + j0, &(H_NEW), sizeof(H_NEW));                                          \
        } else {                                                                                             \
            memcpy(cell + i * H, &(C_NEW), bytes);                                                           \
            memcpy(h_next + i * H, &(H_NEW), bytes);                                                         \
            if (y != NULL) memcpy(y + j0, &(H_NEW), bytes);                                                  \
        }                                                                                                    \
    }

/* One tile: M batch rows from row0, one block of U units, the four gates in one pass over K (slots i, c̃ of
   panel A, f, o of panel B). M is a constant in each instance, so the M·4 accumulators are registers. */
#define FUSED_ROWS(NAME, TARGET, V, U, M)                                                                    \
    static __attribute__((noinline)) TARGET void NAME##_rows##M(const fused_ctx *c, long step, long block,   \
                                                                long row0) {                                 \
        FUSED_PROLOGUE(U, M)                                                                                 \
        V acc[M][4];                                                                                         \
        FUSED_SUMS(V, U, M, 4, w, w + (I + H) * 2 * (U), b)                                                  \
        /* the cell of every row first, branch-free and phase by phase (the gates of all rows, then c, then    \
           h), so that the rows' independent chains of dependent operations are in flight together: row by  \
           row, the cell ran 1.5x slower on the Xeon (latency-bound); then the stores */                      \
        FUSED_C_OLD(V, U, M)                                                                                 \
        _Pragma("GCC unroll 8") for (int i = 0; i < (M); ++i) {                                              \
            acc[i][0] = NAME##_sigmoid(acc[i][0]);                                                           \
            acc[i][2] = NAME##_sigmoid(acc[i][2]);                                                           \
            acc[i][3] = NAME##_sigmoid(acc[i][3]);                                                           \
        }                                                                                                    \
        _Pragma("GCC unroll 8") for (int i = 0; i < (M); ++i) acc[i][1] = NAME##_tanh(acc[i][1]);            \
        _Pragma("GCC unroll 8") for (int i = 0; i < (M); ++i)                                                \
            acc[i][2] = acc[i][2] * c_old[i] + acc[i][0] * acc[i][1];                     /* c = f c + i c̃ */ \
        _Pragma("GCC unroll 8") for (int i = 0; i < (M); ++i)                                                \
            acc[i][0] = acc[i][3] * NAME##_tanh(acc[i][2]);                               /* h = o tanh(c) */ \
        FUSED_STORE(U, M, acc[i][2], acc[i][0])                                                              \
    }

/* One tile of M <= 8 rows in two passes over K of two gates each: (i, c̃), whose i ⊙ c̃ waits in ig, then
   (f, o) of panel B and the cell. Why: 8 rows x 4 gates do not fit in the registers, and as two tiles of 4 rows
   (FUSED_ROWS at batch 8) each reads the block's 64 KB of weights (I = H = 128), twice a step from L2: on the
   Zen 4 EPYC a 4-row tile ran at ~70% of the FMA peak, a 6-row one at ~93%, this one at ~93% for 8 rows
   (bench/results/lstm-epyc-2026-12-03.md). Here a step reads each weight once. With fewer rows its 2 to 8
   accumulators wait on the FMA latency: FUSED_ROWS runs the batches that fit its tile. */
#define FUSED_PAIRS(NAME, TARGET, V, U, M)                                                                   \
    static __attribute__((noinline)) TARGET void NAME##_pairs##M(const fused_ctx *c, long step, long block,  \
                                                                 long row0) {                                \
        FUSED_PROLOGUE(U, M)                                                                                 \
        V acc[M][2], ig[M];                                                                                  \
        FUSED_SUMS(V, U, M, 2, w, w, b)                                                                      \
        _Pragma("GCC unroll 8") for (int i = 0; i < (M); ++i) acc[i][0] = NAME##_sigmoid(acc[i][0]);         \
        _Pragma("GCC unroll 8") for (int i = 0; i < (M); ++i) ig[i] = acc[i][0] * NAME##_tanh(acc[i][1]);    \
        FUSED_SUMS(V, U, M, 2, w + (I + H) * 2 * (U), w, b + 2 * (U))                                        \
        FUSED_C_OLD(V, U, M)                                                                                 \
        _Pragma("GCC unroll 8") for (int i = 0; i < (M); ++i)                                                \
            _Pragma("GCC unroll 2") for (int q = 0; q < 2; ++q) acc[i][q] = NAME##_sigmoid(acc[i][q]);       \
        _Pragma("GCC unroll 8") for (int i = 0; i < (M); ++i)                                                \
            acc[i][0] = acc[i][0] * c_old[i] + ig[i];                                     /* c = f c + i c̃ */ \
        _Pragma("GCC unroll 8") for (int i = 0; i < (M); ++i)                                                \
            ig[i] = acc[i][1] * NAME##_tanh(acc[i][0]);                                   /* h = o tanh(c) */ \
        FUSED_STORE(U, M, acc[i][0], ig[i])                                                                  \
    }

/* One tile of M rows over NB consecutive blocks in two kinds of pass, each weight read once a step: per block the
   gates i, c̃, f (M x 3 accumulators) and the new cell state c = σ(f) ⊙ c + σ(i) ⊙ tanh(c̃), which needs no o; then
   the o gates of all NB blocks at once (M x NB accumulators) and h = σ(o) ⊙ tanh(c). Why: capped to AVX2 (16 ymm)
   a thread of the row split owns 4 of the forecaster's 8 rows, and its tiles were 2 + 2 one-pass (each weight
   streamed twice a step, 8 accumulators) or the 4-row two-pass tile (8 accumulators, each pass waiting on the FMA
   latency); 4 rows x 3 gates and 4 rows x 3 blocks are 12 accumulators, a weight vector a gate and the broadcast.
   The sums run in FUSED_SUMS's order (bias, then k = 0 .. I + H - 1) and the cell in FUSED_PAIRS's expressions:
   bit-equal to the other tiles. Only in the row split (fused_row_slice), where no x part is computed ahead. */
/* acc[i][g] = *BIAS[g] + Σ_k x_i[k]·W_g[k] + Σ_k h_i[k]·R_g[k] for G vectors, row k of vector g at PTR[g] + k·2·U
   (FUSED_SUMS's order). The weight vectors held in registers (the asm): GCC otherwise folds them into the FMAs as
   memory operands, and a k then loads M·G vectors and M broadcasts, as many loads as the core's two a cycle take
   in the FMAs' time. */
#define FUSED_WIDE_SUMS(V, U, M, G, PTR, BIAS)                                                               \
    _Pragma("GCC unroll 4") for (int g = 0; g < (G); ++g) {                                                  \
        V bq;                                                                                                \
        memcpy(&bq, (BIAS)[g], sizeof bq);                                                                   \
        _Pragma("GCC unroll 8") for (int i = 0; i < (M); ++i) acc[i][g] = bq;                                \
    }                                                                                                        \
    for (long k = 0; k < I; ++k) {                                                                           \
        V wv[G];                                                                                             \
        _Pragma("GCC unroll 4") for (int g = 0; g < (G); ++g) {                                              \
            memcpy(&wv[g], (PTR)[g] + k * 2 * (U), sizeof(V));                                               \
            __asm__("" : "+v"(wv[g]));                                                                       \
        }                                                                                                    \
        _Pragma("GCC unroll 8") for (int i = 0; i < (M); ++i) {                                              \
            const float xk = x[i][k];                                                                        \
            _Pragma("GCC unroll 4") for (int g = 0; g < (G); ++g) acc[i][g] += xk * wv[g];                   \
        }                                                                                                    \
    }                                                                                                        \
    if (recurrent)                                                                                           \
        for (long k = I; k < I + H; ++k) {                                                                   \
            V wv[G];                                                                                         \
            _Pragma("GCC unroll 4") for (int g = 0; g < (G); ++g) {                                          \
                memcpy(&wv[g], (PTR)[g] + k * 2 * (U), sizeof(V));                                           \
                __asm__("" : "+v"(wv[g]));                                                                   \
            }                                                                                                \
            _Pragma("GCC unroll 8") for (int i = 0; i < (M); ++i) {                                          \
                const float hs = h_prev[i * H + k - I];                                                      \
                _Pragma("GCC unroll 4") for (int g = 0; g < (G); ++g) acc[i][g] += hs * wv[g];               \
            }                                                                                                \
        }

#define FUSED_WIDE(NAME, TARGET, V, U, M, NB)                                                                \
    static __attribute__((noinline)) TARGET void NAME##_wide##M##x##NB(const fused_ctx *c, long step,        \
                                                                       long block0, long row0) {             \
        const kiln_recurrent_plan *p = c->p;                                                                 \
        const long I = p->I, H = p->H;                                                                       \
        const float *x[M];                                                                                   \
        _Pragma("GCC unroll 8") for (int i = 0; i < (M); ++i) x[i] = fused_x_row(p, step, row0 + i);         \
        const float *h_prev = c->h[step % 2] + row0 * H;                                                     \
        const int recurrent = step > 0 || p->h0 != NULL;                                                     \
        V c_new[NB][M];                                                                                      \
        _Pragma("GCC unroll 4") for (int bb = 0; bb < (NB); ++bb) {                                          \
            const long block = block0 + bb;                                                                  \
            const float *w = p->packed_w + block * (I + H) * 4 * (U), *b = p->bias + block * 4 * (U);        \
            const long j0 = block * (U), width = H - j0 < (U) ? H - j0 : (U);                                \
            const float *cell = c->c + row0 * H + j0;                                                        \
            const float *ptr[3] = {w, w + (U), w + (I + H) * 2 * (U)}, *bias[3] = {b, b + (U), b + 2 * (U)}; \
            V acc[M][3], ig[M];                                                                              \
            FUSED_WIDE_SUMS(V, U, M, 3, ptr, bias)                              /* slots i, c̃ (A), f (B) */ \
            FUSED_C_OLD(V, U, M)                                                                             \
            _Pragma("GCC unroll 8") for (int i = 0; i < (M); ++i) {                                          \
                acc[i][0] = NAME##_sigmoid(acc[i][0]);                                                       \
                acc[i][2] = NAME##_sigmoid(acc[i][2]);                                                       \
            }                                                                                                \
            _Pragma("GCC unroll 8") for (int i = 0; i < (M); ++i) {                                          \
                ig[i] = acc[i][0] * NAME##_tanh(acc[i][1]);                                                  \
                __asm__("" : "+v"(ig[i])); /* rounded, as FUSED_PAIRS' (its pass 2 between): fma(f, c, ig) */ \
            }                                                                                                \
            _Pragma("GCC unroll 8") for (int i = 0; i < (M); ++i)                                            \
                c_new[bb][i] = acc[i][2] * c_old[i] + ig[i];                              /* c = f c + i c̃ */ \
        }                                                                                                    \
        /* the o gates of the NB blocks (panel B's second slot) */                                           \
        const float *ptr[NB], *bias[NB];                                                                     \
        _Pragma("GCC unroll 4") for (int bb = 0; bb < (NB); ++bb) {                                          \
            ptr[bb] = p->packed_w + (block0 + bb) * (I + H) * 4 * (U) + (I + H) * 2 * (U) + (U);             \
            bias[bb] = p->bias + (block0 + bb) * 4 * (U) + 3 * (U);                                          \
        }                                                                                                    \
        V acc[M][NB];                                                                                        \
        FUSED_WIDE_SUMS(V, U, M, NB, ptr, bias)                                                              \
        _Pragma("GCC unroll 4") for (int bb = 0; bb < (NB); ++bb)                                            \
            _Pragma("GCC unroll 8") for (int i = 0; i < (M); ++i) acc[i][bb] = NAME##_sigmoid(acc[i][bb]);   \
        _Pragma("GCC unroll 4") for (int bb = 0; bb < (NB); ++bb) {                                          \
            const long block = block0 + bb, j0 = block * (U), width = H - j0 < (U) ? H - j0 : (U);           \
            float *h_next = c->h[(step + 1) % 2] + row0 * H + j0, *cell = c->c + row0 * H + j0;              \
            V h_new[M];                                                                                      \
            _Pragma("GCC unroll 8") for (int i = 0; i < (M); ++i)                                            \
                h_new[i] = acc[i][bb] * NAME##_tanh(c_new[bb][i]);                        /* h = o tanh(c) */ \
            FUSED_STORE(U, M, c_new[bb][i], h_new[i])                                                        \
        }                                                                                                    \
    }

/* the wide tiles of 4 rows over 1 to 3 blocks (12 vector accumulators) */
#define FUSED_WIDE_KERNEL(NAME, TARGET, U)                                                                   \
    FUSED_WIDE(NAME, TARGET, NAME##_v, U, 4, 1) FUSED_WIDE(NAME, TARGET, NAME##_v, U, 4, 2)                  \
    FUSED_WIDE(NAME, TARGET, NAME##_v, U, 4, 3)
#define FUSED_WIDE_FNS(NAME) {NAME##_wide4x1, NAME##_wide4x2, NAME##_wide4x3}

/* The x part of a block's four gates for M rows (the bias and Σ_k x·W, FUSED_SUMS's first half in its order) to
   sums[i][4·U], for fused_ahead: G = 4 in one pass (the one-pass tile's shape), G = 2 in two (the two-pass tile's:
   each weight read once for M rows). */
#define FUSED_AHEAD(NAME, TARGET, V, U, M, G, KIND)                                                          \
    static __attribute__((noinline)) TARGET void NAME##_ahead_##KIND##M(const fused_ctx *c, long step,       \
                                                                        long block, long row0, float *sums) { \
        const kiln_recurrent_plan *p = c->p;                                                                 \
        const long I = p->I, H = p->H;                                                                       \
        const float *w = p->packed_w + block * (I + H) * 4 * (U), *b = p->bias + block * 4 * (U);            \
        const float *x[M];                                                                                   \
        _Pragma("GCC unroll 8") for (int i = 0; i < (M); ++i) x[i] = fused_x_row(p, step, row0 + i);         \
        const float *xs = NULL, *h_prev = NULL;                                                              \
        const int recurrent = 0;                                                                             \
        V acc[M][G];                                                                                         \
        _Pragma("GCC unroll 2") for (int pass = 0; pass < 4 / (G); ++pass) {                                 \
            const float *panel = w + pass * (I + H) * 2 * (U);                                               \
            FUSED_SUMS(V, U, M, G, panel, w + (I + H) * 2 * (U), b + pass * 2 * (U))                         \
            _Pragma("GCC unroll 8") for (int i = 0; i < (M); ++i)                                            \
                _Pragma("GCC unroll 4") for (int q = 0; q < (G); ++q)                                        \
                    memcpy(sums + i * 4 * (U) + pass * 2 * (U) + q * (U), &acc[i][q], sizeof(V));            \
        }                                                                                                    \
    }

#define FUSED_KERNEL(NAME, TARGET, U, MIN, MAX, RCP)                                                       \
    typedef float NAME##_v __attribute__((vector_size((U) * 4)));                                            \
    FUSED_MATH(NAME, TARGET, NAME##_v, MIN, MAX, RCP)                                                        \
    FUSED_ROWS(NAME, TARGET, NAME##_v, U, 1) FUSED_ROWS(NAME, TARGET, NAME##_v, U, 2)                        \
    FUSED_ROWS(NAME, TARGET, NAME##_v, U, 3) FUSED_ROWS(NAME, TARGET, NAME##_v, U, 4)                        \
    FUSED_ROWS(NAME, TARGET, NAME##_v, U, 5) FUSED_ROWS(NAME, TARGET, NAME##_v, U, 6)                        \
    FUSED_AHEAD(NAME, TARGET, NAME##_v, U, 1, 4, rows) FUSED_AHEAD(NAME, TARGET, NAME##_v, U, 2, 4, rows)    \
    FUSED_AHEAD(NAME, TARGET, NAME##_v, U, 3, 4, rows) FUSED_AHEAD(NAME, TARGET, NAME##_v, U, 4, 4, rows)    \
    FUSED_AHEAD(NAME, TARGET, NAME##_v, U, 5, 4, rows) FUSED_AHEAD(NAME, TARGET, NAME##_v, U, 6, 4, rows)

#define FUSED_ROW_FNS(NAME) {NAME##_rows1, NAME##_rows2, NAME##_rows3, NAME##_rows4, NAME##_rows5, NAME##_rows6}
#define FUSED_AHEAD_FNS(NAME)                                                                                \
    {NAME##_ahead_rows1, NAME##_ahead_rows2, NAME##_ahead_rows3, NAME##_ahead_rows4, NAME##_ahead_rows5,        \
     NAME##_ahead_rows6}
#define FUSED_AHEAD_PAIR_FNS(NAME)                                                                           \
    {NAME##_ahead_pairs1, NAME##_ahead_pairs2, NAME##_ahead_pairs3, NAME##_ahead_pairs4, NAME##_ahead_pairs5,   \
     NAME##_ahead_pairs6, NAME##_ahead_pairs7, NAME##_ahead_pairs8}

/* the two-pass tiles of a FUSED_KERNEL's vector type and math, up to 8 rows */
#define FUSED_PAIRS_KERNEL(NAME, TARGET, U)                                                                  \
    FUSED_PAIRS(NAME, TARGET, NAME##_v, U, 1) FUSED_PAIRS(NAME, TARGET, NAME##_v, U, 2)                      \
    FUSED_PAIRS(NAME, TARGET, NAME##_v, U, 3) FUSED_PAIRS(NAME, TARGET, NAME##_v, U, 4)                      \
    FUSED_PAIRS(NAME, TARGET, NAME##_v, U, 5) FUSED_PAIRS(NAME, TARGET, NAME##_v, U, 6)                      \
    FUSED_PAIRS(NAME, TARGET, NAME##_v, U, 7) FUSED_PAIRS(NAME, TARGET, NAME##_v, U, 8)                      \
    FUSED_AHEAD_PAIRS_UP_TO6(NAME, TARGET, U)                                                                \
    FUSED_AHEAD(NAME, TARGET, NAME##_v, U, 7, 2, pairs) FUSED_AHEAD(NAME, TARGET, NAME##_v, U, 8, 2, pairs)

#define FUSED_AHEAD_PAIRS_UP_TO6(NAME, TARGET, U)                                                            \
    FUSED_AHEAD(NAME, TARGET, NAME##_v, U, 1, 2, pairs) FUSED_AHEAD(NAME, TARGET, NAME##_v, U, 2, 2, pairs)  \
    FUSED_AHEAD(NAME, TARGET, NAME##_v, U, 3, 2, pairs) FUSED_AHEAD(NAME, TARGET, NAME##_v, U, 4, 2, pairs)  \
    FUSED_AHEAD(NAME, TARGET, NAME##_v, U, 5, 2, pairs) FUSED_AHEAD(NAME, TARGET, NAME##_v, U, 6, 2, pairs)

/* the two-pass tiles up to 6 rows: AVX2's 16 ymm hold 6 rows x 2 gates = 12 accumulators, a weight vector and the
   broadcast */
#define FUSED_PAIRS_KERNEL6(NAME, TARGET, U)                                                                 \
    FUSED_PAIRS(NAME, TARGET, NAME##_v, U, 1) FUSED_PAIRS(NAME, TARGET, NAME##_v, U, 2)                      \
    FUSED_PAIRS(NAME, TARGET, NAME##_v, U, 3) FUSED_PAIRS(NAME, TARGET, NAME##_v, U, 4)                      \
    FUSED_PAIRS(NAME, TARGET, NAME##_v, U, 5) FUSED_PAIRS(NAME, TARGET, NAME##_v, U, 6)                      \
    FUSED_AHEAD_PAIRS_UP_TO6(NAME, TARGET, U)

#define FUSED_AHEAD_PAIR_FNS6(NAME)                                                                          \
    {NAME##_ahead_pairs1, NAME##_ahead_pairs2, NAME##_ahead_pairs3, NAME##_ahead_pairs4, NAME##_ahead_pairs5,   \
     NAME##_ahead_pairs6}

#define FUSED_PAIR_FNS6(NAME) {NAME##_pairs1, NAME##_pairs2, NAME##_pairs3, NAME##_pairs4, NAME##_pairs5, NAME##_pairs6}

#define FUSED_PAIR_FNS(NAME)                                                                                 \
    {NAME##_pairs1, NAME##_pairs2, NAME##_pairs3, NAME##_pairs4, NAME##_pairs5, NAME##_pairs6, NAME##_pairs7,  \
     NAME##_pairs8}

#if defined(__x86_64__) || defined(__i386__)
/* AVX-512: 6 rows x 4 gates = 24 zmm accumulators of 32; AVX2: 4 gates x 8 units, up to 3 rows (12 of 16), and
   2 gates x 8 units, up to 6 rows (12 of 16) in two passes */
FUSED_KERNEL(fused_avx512, KILN_AVX512, 16, _mm512_min_ps, _mm512_max_ps, _mm512_rcp14_ps)
FUSED_PAIRS_KERNEL(fused_avx512, KILN_AVX512, 16)  /* 8 rows x 2 gates = 16 zmm accumulators */
FUSED_WIDE_KERNEL(fused_avx512, KILN_AVX512, 16)   /* 4 rows x 3 gates, 4 rows x 3 blocks: 12 zmm */
FUSED_KERNEL(fused_avx2, KILN_AVX2, 8, _mm256_min_ps, _mm256_max_ps, _mm256_rcp_ps)
FUSED_PAIRS_KERNEL6(fused_avx2, KILN_AVX2, 8)
FUSED_WIDE_KERNEL(fused_avx2, KILN_AVX2, 8)  /* 4 rows x 3 gates, 4 rows x 3 blocks */
#endif
FUSED_KERNEL(fused_generic, , 4, fused_min, fused_max, fused_rcp)

#pragma GCC pop_options

static const fused_kernel FUSED_KERNELS[] = {
#if defined(__x86_64__) || defined(__i386__)
    {"avx512 16 units x 4 gates, 6 rows; 2+2 gates, 8 rows; 3+1 gates, 4 rows", 16, 6, FUSED_ROW_FNS(fused_avx512),
     8, FUSED_PAIR_FNS(fused_avx512), has_avx512, 0, 0, FUSED_AHEAD_FNS(fused_avx512),
     FUSED_AHEAD_PAIR_FNS(fused_avx512), 4, FUSED_WIDE_FNS(fused_avx512)},
    {"avx2 8 units x 4 gates, 3 rows; 2+2 gates, 6 rows; 3+1 gates, 4 rows", 8, 3, FUSED_ROW_FNS(fused_avx2),
     6, FUSED_PAIR_FNS6(fused_avx2), has_avx2, 0, 1, FUSED_AHEAD_FNS(fused_avx2), FUSED_AHEAD_PAIR_FNS6(fused_avx2),
     4, FUSED_WIDE_FNS(fused_avx2)},
    /* the AVX2 kernel before the 6-row two-pass tile (2026-12-06): benches time it beside the one above */
    {"avx2onepass 8 units x 4 gates, 3 rows", 8, 3, FUSED_ROW_FNS(fused_avx2), 0, {0}, has_avx2, 1, 0,
     FUSED_AHEAD_FNS(fused_avx2)},
#endif
    {"generic 4 units x 4 gates, 4 rows", 4, 4, FUSED_ROW_FNS(fused_generic), 0, {0}, always, 0, 0,
     FUSED_AHEAD_FNS(fused_generic)},
};
#define FUSED_KERNEL_COUNT ((int)(sizeof(FUSED_KERNELS) / sizeof(FUSED_KERNELS[0])))

int kiln_lstm_fused_kernel_count(void) { return FUSED_KERNEL_COUNT; }
const char *kiln_lstm_fused_kernel_name(int i) { return i >= 0 && i < FUSED_KERNEL_COUNT ? FUSED_KERNELS[i].name : NULL; }
int kiln_lstm_fused_kernel_supported(int i) { return i >= 0 && i < FUSED_KERNEL_COUNT && FUSED_KERNELS[i].supported(); }
int kiln_lstm_fused_kernel_test_only(int i) { return i >= 0 && i < FUSED_KERNEL_COUNT && FUSED_KERNELS[i].test_only; }
int kiln_lstm_fused_kernel_units(int i) { return i >= 0 && i < FUSED_KERNEL_COUNT ? FUSED_KERNELS[i].units : 0; }

static long fused_blocks(int kernel, long h) { return (h + FUSED_KERNELS[kernel].units - 1) / FUSED_KERNELS[kernel].units; }

/* Floats of W [4H, I] and R [4H, H] packed side by side for `kernel`, and of the packed bias. */
long kiln_lstm_fused_packed_floats(int kernel, long h, long i) {
    return fused_blocks(kernel, h) * (i + h + 1) * 4 * FUSED_KERNELS[kernel].units;
}

/* out[b][panel][k][slot·U + j] = (k < I ? W[g·H + b·U + j][k] : R[g·H + b·U + j][k − I]), zeros past H, for
   ONNX gate g (i, o, f, c) = panel A's slots (i, c̃), panel B's (f, o); then the bias [blocks][4·U] in the slots'
   order (i, c̃, f, o) from `bias` [4H] (Wb + Rb, or NULL: zeros). Both tiles read this layout: the one-pass
   tile both panels at once, the two-pass tile one after the other. */
void kiln_lstm_fused_pack(int kernel, const float *w, const float *r, const float *bias, long h, long i, float *out) {
    static const int GATE_OF_SLOT[4] = {0, 3, 2, 1};
    const long u = FUSED_KERNELS[kernel].units, blocks = fused_blocks(kernel, h), k_all = i + h;
    float *out_bias = out + blocks * k_all * 4 * u;
    for (long b = 0; b < blocks; ++b)
        for (long slot = 0; slot < 4; ++slot)
            for (long j = 0; j < u; ++j) {
                const long unit = b * u + j, row = GATE_OF_SLOT[slot] * h + unit;
                float *panel = out + (2 * b + slot / 2) * k_all * 2 * u + slot % 2 * u + j;
                for (long k = 0; k < k_all; ++k) {
                    const float v = k < i ? w[row * i + k] : r[row * h + k - i];
                    panel[k * 2 * u] = unit < h ? v : 0.0f;
                }
                out_bias[b * 4 * u + slot * u + j] = unit < h && bias ? bias[row] : 0.0f;
            }
}

/* h [2][N, H], c [N, H] */
long kiln_lstm_fused_scratch_floats(long s, long n, long h) { (void)s; return 3 * n * h; }

/* The batch in ceil(N / MR) groups of rows, as even as they go (8 rows of a 6-row tile: 4 + 4, not 6 + 2):
   group g's first row and row count. */
static long fused_group(long n, long groups, long g, long *rows) {
    const long base = n / groups, extra = n % groups;
    *rows = base + (g < extra);
    return g * base + (g < extra ? g : extra);
}

/* A work item: one block of units for `per_item` consecutive row groups, which read the same weights (the
   second group's from L1 / L2) and whose tiles the core overlaps (one's cell with the next one's sums). */
static void fused_item(const loop_ctx *lc, long step, long item) {
    const fused_ctx *c = (const fused_ctx *)lc;
    const long chunks = (c->groups + c->per_item - 1) / c->per_item;
    const long block = item / chunks, first = item % chunks * c->per_item;
    const long last = first + c->per_item < c->groups ? first + c->per_item : c->groups;
    for (long g = first; g < last; ++g) c->spans[g].tile(c, step, block, c->spans[g].row0);
}

/* 1: in the block split each thread computes the x part of its own blocks of step s (the bias and Σ x·W, which
   read no h) before it waits for step s - 1 to end (fused_ahead, recurrent.c's run_stages_ahead), and the tiles
   start from those sums; 0: the tiles compute them after the wait (the form before 2026-12-06). Why: a thread that
   finishes its blocks of a step first waits for the other's h at the step's barrier; the x part is work it can do
   meanwhile, and the barrier's latency and the threads' drift apart are absorbed by it (at I = 128 half of a step's
   multiply-adds, at I = 16 a ninth). The same sums in the same order: bit-equal to the rows split and one thread.
   bench/recurrent_barrier_ab.py times both. */
int kiln_lstm_fused_ahead = 1;
#define FUSED_AHEAD_MOST (256L << 10)  /* a step's x parts of every block, in bytes: past it the tiles compute them */

/* run_stages_ahead's hook in the block split (an item is a block with all its rows): the x part of the
   participant's own blocks of step `step`, each published to the tiles (ahead_step) once written. The buffers
   alternate by step parity: this thread writes step s's only after step s - 2 ended (it has waited for it before
   it claimed its items of step s - 1), so no tile still reads them; a tile of a block stolen before its x part was
   published computes it itself. */
static void fused_ahead(const loop_ctx *lc, int participant, long step, long first, long end) {
    (void)participant;
    const fused_ctx *c = (const fused_ctx *)lc;
    const fused_kernel *k = c->kernel;
    const long N = c->p->N, U = k->units;
    for (long block = first; block < end; ++block) {
        const long slot = step % 2 * c->blocks + block;
        float *sums = c->ahead_sums + slot * N * 4 * U;
        for (long g = 0; g < c->groups; ++g) {  /* the tiles' rows in the tiles' shapes (fused_tiles) */
            const fused_span *s = &c->spans[g];
            const int pairs = k->pairs_mr > 0 && s->rows <= k->pairs_mr && s->tile == k->pairs[s->rows - 1];
            (pairs ? k->ahead_pairs : k->ahead)[s->rows - 1](c, step, block, s->row0, sums + s->row0 * 4 * U);
        }
        __atomic_store_n(&c->ahead_step[slot].step, step + 1, __ATOMIC_RELEASE);
    }
}

/* 1: at two threads and more, each thread runs a slice of the batch's rows through every step (fused_row_slice),
   where each gets two rows or more; 0: the threads split each step's unit blocks (run_stages), a barrier a step.
   The default of a plan whose `split` is 0; bench/recurrent_threads.py times both in one process. Which wins
   depends on the CPU: on the Xeon the row split (forecaster 1.06 vs 1.40 ms), on the Zen 4 EPYC the block split
   (one layer, 2 threads, batch 8: I = 16 0.665 vs 0.740 ms, I = 128 1.060 vs 1.247; bench/results/
   small-zen4-2026-12-06.md), where each thread's 4-row one-pass tile runs further below the FMA peak than the
   8-row two-pass tile both threads share by blocks. So the builder times both: cpu.lstm.fused (split 0: this
   default) and cpu.lstm.fused_blocks (split 2). */
int kiln_lstm_fused_row_split = 1;

typedef struct {
    const fused_ctx *c;
    const long *first;          /* participant q's row groups: spans [first[q], first[q + 1]) */
    long start;                 /* the loop's start (now_ns), for the trace */
    struct fused_trace *trace;  /* or NULL */
} fused_slices;

/* A row split's timeline, for benches (bench/lstm_timeline.py): when kiln_lstm_fused_tracing is 1, each row-split
   loop writes one record to kiln_lstm_fused_traces[count % FUSED_TRACES] (count: kiln_lstm_fused_trace_count): the
   loop's start and end (CLOCK_MONOTONIC ns, Python's time.monotonic_ns), each slice's start and end, and which
   thread ran it (0: the caller). Off by default: the loop then reads one int. */
#define FUSED_TRACES 4096
#define FUSED_TRACE_SLICES 8
struct fused_trace {
    long start, end;
    long slices;
    long slice_start[FUSED_TRACE_SLICES], slice_end[FUSED_TRACE_SLICES];
    long by_worker[FUSED_TRACE_SLICES];
};
int kiln_lstm_fused_tracing = 0;
long kiln_lstm_fused_trace_count = 0;
struct fused_trace kiln_lstm_fused_traces[FUSED_TRACES];
static __thread int fused_caller;  /* 1 on the thread that called kiln_lstm_fused's row split */

/* Where no step's blocks are shared between threads (the row split, one thread), which rows run on the kernel's
   wide tile (FUSED_WIDE, 4 rows; fused_tiles): on AVX2 2, a rest of 4 rows past the full two-pass tiles, and of 8
   (4 + 4 rather than 6 + 2); 1, a rest of 4 only; on AVX-512 (1 or 2) a slice of 4 rows; 0, none: the one-pass
   tiles (4 rows: 2 + 2 on AVX2, one 4-row tile on AVX-512), the form before 2026-12-06.
   Capped to AVX2 on the Zen 4 EPYC (one layer, 96 steps, 128 units, I = 16 / 128, thread CPU time, load 7-8;
   bench/results/lstm-2026-12-06.md): 4 rows 0.597 / 1.042 ms on the wide tile against 0.782 / 1.340 as 2 + 2
   (onnxruntime 0.675 / 1.061); 8 rows at one thread 1.200 / 2.122 as 4 + 4 against 1.304 / 2.221 as 6 + 2.
   bench/lstm_wide_ab.py times them. */
int kiln_lstm_fused_wide = 2;

/* The blocks of the wide tile's next group from block b0 of `blocks`: 3 (12 accumulators), 2 + 2 for the last 4 (8
   each, rather than 3 + 1's 4: a pass of 4 accumulators waits on the FMA latency), what is left under 3. */
static long fused_wide_group(long blocks, long b0) {
    const long left = blocks - b0;
    return left == 4 ? 2 : left >= 3 ? 3 : left;
}

/* Participant q's row groups through every step, with no barrier: a row's recurrence reads its own h and c only.
   A wide span (tile NULL) runs the blocks in groups (fused_wide_group), the slice's other spans beside it. */
static void fused_row_slice_steps(const fused_ctx *c, long first, long last);
static void fused_row_slice(void *ctx, long q) {
    const fused_slices *r = (const fused_slices *)ctx;
    const fused_ctx *c = r->c;
    const long first = r->first[q], last = r->first[q + 1];
    if (r->trace && q < FUSED_TRACE_SLICES) {
        r->trace->slice_start[q] = now_ns();
        r->trace->by_worker[q] = !fused_caller;
    }
    fused_row_slice_steps(c, first, last);
    if (r->trace && q < FUSED_TRACE_SLICES) r->trace->slice_end[q] = now_ns();
}

static void fused_row_slice_steps(const fused_ctx *c, long first, long last) {
    int wide = 0;
    for (long g = first; g < last; ++g) wide |= c->spans[g].tile == NULL;
    if (!wide) {
        for (long step = 0; step < c->p->S; ++step)
            for (long block = 0; block < c->blocks; ++block)
                for (long g = first; g < last; ++g) c->spans[g].tile(c, step, block, c->spans[g].row0);
        return;
    }
    for (long step = 0; step < c->p->S; ++step)
        for (long b0 = 0, nb; b0 < c->blocks; b0 += nb) {
            nb = fused_wide_group(c->blocks, b0);
            for (long g = first; g < last; ++g) {
                const fused_span *s = &c->spans[g];
                if (s->tile == NULL) c->kernel->wide[nb - 1](c, step, b0, s->row0);
                else for (long block = b0; block < b0 + nb; ++block) s->tile(c, step, block, s->row0);
            }
        }
}

/* Rows [row0, row0 + n) of a slice as tiles, written to spans (NULL: only counted); returns how many.
   pairs_full kernels: as many full two-pass tiles (pairs_mr rows) as fit, the rest in one-pass tiles as even as
   they go (8 rows on AVX2: 6 + 2, 4 rows: 2 + 2). Why: capped to AVX2 (16 ymm) the one-pass tile holds 3 rows,
   and a step streams each block's weights from L2 once a tile; the 6-row two-pass tile reads each weight for 6
   rows. One thread, thread CPU time, 96 steps, 128 units, Zen 4 EPYC capped to AVX2 (bench/results/
   zoo-cpu-avx2-2026-12-06.md, session 22): batch 6 as one 6-row two-pass tile 0.933 / 1.525 ms (I = 16 / 128)
   against 1.175 / 2.018 as 3 + 3 one-pass (onnxruntime 0.966 / 1.709); but a 4-row two-pass tile (8 accumulators)
   lost to 2 + 2 one-pass, 1.656 vs 1.397 ms (I = 128).
   `wide` (the row split and one thread, fused_row_slice; kiln_lstm_fused_wide's modes): where the rest is the
   wide tile's 4 rows, or 8 in mode 2 (8 rows: 4 + 4), wide tiles instead (FUSED_WIDE: each weight read once a step
   for the 4 rows, 12 accumulators); on kernels with even tiles (AVX-512), a slice of exactly 4 rows.
   Other kernels: ceil(n / MR) tiles as even as they go, two-pass where the rows exceed the one-pass tile's. */
static long fused_tiles(const fused_kernel *k, long row0, long n, int wide, fused_span *spans) {
    long count = 0;
    if (k->pairs_full && k->pairs_mr > 0) {
        const long wr = wide ? k->wide_rows : 0;
        /* wide == 2: a rest of 2 rows past a full tile as two wide tiles (8 rows: 4 + 4, not 6 + 2) */
        const long pairs_end = wr > 0 && wide == 2 && n > k->pairs_mr && n % k->pairs_mr == 2 * wr - k->pairs_mr
                                   ? n - 2 * wr : n;
        for (long left = pairs_end; left >= k->pairs_mr; left -= k->pairs_mr, ++count) {
            if (spans) spans[count] = (fused_span){row0, k->pairs_mr, k->pairs[k->pairs_mr - 1]};
            n -= k->pairs_mr;
            row0 += k->pairs_mr;
        }
        if (wr > 0 && n % wr == 0 && n / wr <= 2) {  /* the rest as wide tiles */
            for (; n > 0; n -= wr, row0 += wr, ++count)
                if (spans) spans[count] = (fused_span){row0, wr, NULL};
            return count;
        }
        const long groups = (n + k->mr - 1) / k->mr;
        for (long g = 0; g < groups; ++g, ++count) {
            long rows;
            const long first = fused_group(n, groups, g, &rows);
            if (spans) spans[count] = (fused_span){row0 + first, rows, k->rows[rows - 1]};
        }
        return count;
    }
    if (wide && k->wide_rows > 0 && n == k->wide_rows) {
        if (spans) spans[count] = (fused_span){row0, n, NULL};
        return count + 1;
    }
    const int two_pass = k->pairs_mr > 0 && n > k->mr;
    const long groups = (n + (two_pass ? k->pairs_mr : k->mr) - 1) / (two_pass ? k->pairs_mr : k->mr);
    for (long g = 0; g < groups; ++g, ++count) {
        long rows;
        const long first = fused_group(n, groups, g, &rows);
        if (spans) spans[count] = (fused_span){row0 + first, rows, (two_pass ? k->pairs : k->rows)[rows - 1]};
    }
    return count;
}

/* The tiles `kernel` runs a slice of n rows on, in row order (fused_tiles; `wide`: the row split's plan):
   rows[t] and two_pass[t] (1: the two-pass tile, 2: the wide tile) for t < the count returned, at most `most` of
   them written. For tests and benches. */
long kiln_lstm_fused_tile_plan(int kernel, long n, int wide, long *rows, int *two_pass, long most) {
    if (kernel < 0 || kernel >= FUSED_KERNEL_COUNT || n <= 0) return 0;
    const fused_kernel *k = &FUSED_KERNELS[kernel];
    const long count = fused_tiles(k, 0, n, wide, NULL);
    fused_span spans[count];
    fused_tiles(k, 0, n, wide, spans);
    for (long t = 0; t < count && t < most; ++t) {
        rows[t] = spans[t].rows;
        two_pass[t] = spans[t].tile == NULL ? 2 : k->pairs_mr > 0 && spans[t].tile == k->pairs[spans[t].rows - 1];
    }
    return count;
}

/* plan.packed_w: kiln_lstm_fused_pack's layout for plan.kernel (an index of FUSED_KERNELS), the bias after
   the weights (plan.bias points there). */
int kiln_lstm_fused(void *object, void *stream, int nargs, const void *args) {
    (void)stream; (void)nargs; (void)args;
    kiln_recurrent_plan *p = (kiln_recurrent_plan *)object;
    if (p->kernel < 0 || p->kernel >= FUSED_KERNEL_COUNT || p->gates != 4 || p->generic) return 2;
    if (p->S <= 0 || p->N <= 0) return 0;
    const fused_kernel *kernel = &FUSED_KERNELS[p->kernel];
    const long N = p->N, H = p->H;
    fused_ctx c;
    memset(&c, 0, sizeof c);
    c.p = p;
    c.kernel = kernel;
    c.loop.p = p;
    c.h[0] = p->scratch;
    c.h[1] = c.h[0] + N * H;
    c.c = c.h[1] + N * H;
    c.blocks = fused_blocks(p->kernel, H);
    const int threads = recurrent_threads(p);
    /* the rows a thread runs: all of them, or a slice of at least two rows (row split: one row a thread ran 1.2x
       slower than the block split; two and more 0.83-0.97x with AVX-512, 0.88-1.04x capped to AVX2: the table in
       bench/results/recurrent-2026-12-05b.md) */
    const long most_slices = N / 2 > 1 ? N / 2 : 1;  /* two rows or more each */
    const int row_split = p->split ? p->split == 1 : kiln_lstm_fused_row_split;
    const long slices = row_split ? (most_slices < threads ? most_slices : threads) : 1;
    /* the wide tile where no step's blocks are shared between threads: the row split, or one thread */
    const int wide = slices > 1 || threads == 1 ? kiln_lstm_fused_wide : 0;
    p->row_slices = (int)slices;
    p->ahead = 0;
    p->wide = 0;
    /* each slice's rows (as even as they go) as tiles: spans [first[q], first[q + 1]) */
    long first[slices + 1];
    first[0] = 0;
    for (long q = 0; q < slices; ++q)
        first[q + 1] = first[q] +
                       fused_tiles(kernel, N * q / slices, N * (q + 1) / slices - N * q / slices, wide, NULL);
    fused_span *spans = (fused_span *)malloc((size_t)first[slices] * sizeof *spans);
    if (!spans) return 3;
    for (long q = 0; q < slices; ++q)
        fused_tiles(kernel, N * q / slices, N * (q + 1) / slices - N * q / slices, wide, spans + first[q]);
    c.spans = spans;
    c.groups = first[slices];
    /* whole blocks as items while there are two items a thread, else fewer groups an item */
    const long splits = (2L * threads + c.blocks - 1) / c.blocks;
    c.per_item = (c.groups + splits - 1) / splits;
    recurrent_scratch states = {0};
    states.h_a = c.h[0];
    states.c = c.c;
    load_states(p, &states);
    int wide_spans = 0;
    for (long g = 0; g < c.groups; ++g) wide_spans |= spans[g].tile == NULL;
    if (slices > 1 || wide_spans) {  /* one thread with a wide span: its one slice, with no stage loop */
        p->wide = wide_spans;
        const long start = now_ns();
        struct fused_trace *trace = NULL;
        if (kiln_lstm_fused_tracing) {
            trace = &kiln_lstm_fused_traces[kiln_lstm_fused_trace_count++ % FUSED_TRACES];
            memset(trace, 0, sizeof *trace);
            trace->start = start;
            trace->slices = slices;
        }
        fused_slices r = {&c, first, start, trace};
        fused_caller = 1;
        kiln_parallel_for(slices, (int)slices, fused_row_slice, &r);
        fused_caller = 0;
        p->stalled = 0;
        p->waited_ns = 0;
        p->loop_ns = now_ns() - start;
        if (trace) trace->end = start + p->loop_ns;
    } else {
        const long chunks = (c.groups + c.per_item - 1) / c.per_item;
        void *ahead = NULL;
        /* the x parts ahead where an item is a whole block (fused_ahead) and a step's sums stay in a core's L1 and
           L2 until its tiles read them (FUSED_AHEAD_MOST bytes: the forecaster's 8 rows x 128 units are 16 KB):
           [2][blocks] steps, then the sums [2][blocks][N][4·U] */
        const size_t step_sums = (size_t)(c.blocks * N * 4 * kernel->units) * sizeof(float);
        if (threads > 1 && chunks == 1 && c.blocks > 1 && step_sums <= FUSED_AHEAD_MOST && kiln_lstm_fused_ahead &&
            kernel->ahead[0]) {
            const size_t steps = (size_t)(2 * c.blocks) * sizeof *c.ahead_step;
            if (posix_memalign(&ahead, 64, steps + 2 * step_sums))
                ahead = NULL;
            if (ahead) {
                memset(ahead, 0, steps);
                c.ahead_step = ahead;
                c.ahead_sums = (float *)((char *)ahead + steps);
            }
        }
        p->stalled = run_stages_ahead(&c.loop, p->S, c.blocks * chunks, threads, fused_item,
                                      ahead ? fused_ahead : NULL);
        p->ahead = ahead != NULL;
        free(ahead);
    }
    store_states(p, c.h[p->S % 2], c.c);
    free(spans);
    return 0;
}
