/* ONNX recurrent layers (RNN, GRU; LSTM in lstm.c) as one call per direction: kiln's GEMM microkernels
 * (gemm.c, compiled into the same library: kiln/kernels/cpu/recurrent.py prepends it) and the cell in one
 * loop over time. This file holds what the three cells share (the plan, the input projection, the states,
 * sequence lengths, activations) and the RNN and GRU loops.
 *
 *   xw = X·Wᵀ + b                     one GEMM over every time step: [S·N, I] x [I, G]
 *   per step t:  g = xw[t] + h·Rᵀ     the recurrent GEMM accumulates into xw[t] in place, then the cell
 *
 * Gate columns: W and R are packed with their rows permuted so that one NR-wide panel holds one gate of
 * NR hidden units, the gates of a unit block in consecutive panels (zero rows pad the last block). A
 * work item is one unit block: its gate panels, then the cell of those units. A step's items all finish
 * before the next step's start (every item reads all of h), the GRU with linear_before_reset=0 has two
 * stages a step (its candidate multiplies r ⊙ h, all of it, by R_h).
 *
 * Threads (run_stages): one participant per thread, on kiln_parallel_for (pool.c, or OpenMP's loop where
 * the pool is off); each participant waits for the previous stage's items to be done, whoever holds them,
 * then runs its own slice of the stage's items (the same slice every step), claimed at once from a counter of its own
 * (kiln_stage_whole_slices);
 * one kept waiting takes the others' unclaimed items. No thread leads: a thread the OS has not scheduled
 * yet holds no one up (the others take its items), one that starts late joins at the
 * running stage, and on the pool the call does not wait at its end for a worker that never started. (The
 * loop this replaced had the caller publish each stage inside an OpenMP region: a descheduled caller held
 * the others up, and the region's end waited for every thread. A 128-unit LSTM layer, batch 8, 96 steps,
 * 2 threads at load ~4.3 on the 2-vCPU EPYC: 23.4 -> 8.1 ms (lanes) and 24.0 -> 9.9 ms (rows), onnxruntime
 * 12.1 / 15.8 ms in the same rounds: bench/results/recurrent-2026-12-02-lstm.md.) One the OS preempted
 * while it held an item does hold the stage up: when a thread has waited STALL_NS for a stage, it finishes
 * the call alone (the others leave at their next stage) and says so in plan.stalled; the next call tries
 * every thread again. plan.waited_ns and loop_ns say how long the threads waited for each other.
 *
 *   RNN   h = f(g)                                                        (bias Wb + Rb in xw)
 *   GRU   z = f(g_z), r = f(g_r)                                          (ONNX gate order z, r, h)
 *         linear_before_reset=0: h̃ = g(xw_h + (r ⊙ h)·R_hᵀ)              (bias Wb_h + Rb_h in xw)
 *         linear_before_reset=1: h̃ = g(xw_h + r ⊙ (h·R_hᵀ + Rb_h))       (bias Wb_h in xw)
 *         h = (1 − z) ⊙ h̃ + z ⊙ h
 *
 * sequence_lens (lengths): row n runs its first L_n steps; past them it keeps its state and writes zeros
 * to Y; a row of length 0 ends in zeros (onnxruntime's answer). A reverse direction with lengths reads X
 * reversed within each row's length (copied once into the scratch before the input projection), so step s
 * of every row is at one place in xw and the step's GEMM tiles stay uniform.
 * clip clamps every gate's pre-activation to [-clip, clip] (not the LSTM's cell state), as the spec says.
 */

#include <sched.h>
#include <time.h>

enum { RACT_RELU, RACT_TANH, RACT_SIGMOID, RACT_AFFINE, RACT_LEAKY_RELU, RACT_THRESHOLDED_RELU,
       RACT_SCALED_TANH, RACT_HARD_SIGMOID, RACT_ELU, RACT_SOFTSIGN };

typedef struct {
    int kind;              /* RACT_* (kiln/kernels/cpu/recurrent.py: ACTIVATIONS) */
    float alpha, beta;
} recurrent_act;

typedef struct {
    const float *x;        /* time-major [S, N, I] rows, or batch-major [N, S, I] (batch_major) */
    float *y;              /* h of (t, n) at y[t*y_ts + n*y_ns] (H floats), or NULL */
    long y_ts, y_ns;
    const float *h0, *c0;  /* [N, H] rows at h0 + n*state_ns, or NULL: zeros (c0, yc: the LSTM's only) */
    float *yh, *yc;        /* the final h and c, same strides, or NULL */
    long state_ns;
    const float *packed_w; /* kiln_gemm_pack_w of the permuted W [G, I], G = blocks·gates·NR */
    const float *packed_r; /* ... of the permuted R [G, H] */
    const float *bias;     /* [G] permuted bias folded into xw */
    const float *bias_rh;  /* GRU linear_before_reset=1: Rb_h [blocks·NR] by unit, else NULL */
    const float *peepholes;/* LSTM: P [3, blocks·NR] (i, o, f) by unit, or NULL */
    const int *lengths;    /* [N] in [0, S], or NULL: every row runs S steps */
    float *scratch;        /* kiln_recurrent_scratch_floats() floats */
    long S, N, I, H;
    int kernel, threads, reverse, batch_major;
    int gates;             /* 1 RNN, 3 GRU, 4 LSTM */
    int linear_before_reset, input_forget;
    int generic;           /* LSTM: 0 = the default activations, no clip, peepholes or input_forget (fused cell) */
    recurrent_act act[3];  /* the spec's f, g, h (RNN: f; GRU: f, g; LSTM: f, g, h) */
    float clip;            /* > 0: gate pre-activations clamped to [-clip, clip] */
    int stalled;           /* out: 1 when a thread held a stage up past STALL_NS and the call went on alone */
    long waited_ns;        /* out: the longest time one thread spent waiting for another's items */
    long loop_ns;          /* out: the loop over time, start to end */
    int split;             /* lstm_fused.c at two threads and more: 0 the library's default (kiln_lstm_fused_row_split),
                              1 the batch's rows, 2 each step's unit blocks (cpu.lstm.fused / cpu.lstm.fused_blocks) */
    int row_slices;        /* out: lstm_fused.c: the slices of rows the threads ran (1: one, or the block split) */
    int ahead;             /* out: lstm_fused.c: 1 where the block split computed each step's x parts ahead */
    int wide;              /* out: lstm_fused.c: 1 where a slice ran on the kernel's wide tile (FUSED_WIDE) */
} kiln_recurrent_plan;

static long recurrent_gate_columns(int kernel, long h, int gates) {
    const long nr = KERNELS[kernel].nr;
    return (h + nr - 1) / nr * gates * nr;
}

long kiln_recurrent_gate_columns(int kernel, long h, int gates) { return recurrent_gate_columns(kernel, h, gates); }

/* xw [S·N, G], h_a, h_b, c, rh [N, H], the GRU's h·R_hᵀ [N, G/3], the length-reversed X [S·N, I] */
long kiln_recurrent_scratch_floats(int kernel, long s, long n, long i, long h, int gates) {
    const long g = recurrent_gate_columns(kernel, h, gates);
    return s * n * g + 4 * n * h + n * g + s * n * i;
}

typedef struct {
    float *xw, *h_a, *h_b, *c, *rh, *hr, *x;
} recurrent_scratch;

static recurrent_scratch scratch_of(const kiln_recurrent_plan *p, long G) {
    recurrent_scratch s;
    const long N = p->N, H = p->H;
    s.xw = p->scratch;
    s.h_a = s.xw + p->S * N * G;
    s.h_b = s.h_a + N * H;
    s.c = s.h_b + N * H;
    s.rh = s.c + N * H;
    s.hr = s.rh + N * H;
    s.x = s.hr + N * G;
    return s;
}

static int recurrent_threads(const kiln_recurrent_plan *p) {
    int threads = p->threads;
#ifdef _OPENMP
    if (threads <= 0) threads = omp_get_max_threads();
#endif
    return threads < 1 ? 1 : threads;
}

static long row_of(const kiln_recurrent_plan *p, long t, long n) {  /* the X / xw row of (time t, batch row n) */
    return p->batch_major ? n * p->S + t : t * p->N + n;
}

static long length_of(const kiln_recurrent_plan *p, long n) { return p->lengths ? p->lengths[n] : p->S; }

/* Where step `step` of row n writes its h (the time it computes; past its length: zeros at t = step). */
static float *y_row(const kiln_recurrent_plan *p, long step, long n) {
    if (p->y == NULL) return NULL;
    const long length = length_of(p, n);
    const long t = step >= length ? step : (p->reverse ? length - 1 - step : step);
    return p->y + t * p->y_ts + n * p->y_ns;
}

/* xw = X·Wᵀ + b for every step at once (X reversed within each length first, where that applies). */
static void recurrent_input(const kiln_recurrent_plan *p, const recurrent_scratch *s, long G, int threads) {
    const float *x = p->x;
    const long I = p->I;
    if (p->reverse && p->lengths) {
        for (long n = 0; n < p->N; ++n) {
            const long length = length_of(p, n);
            for (long t = 0; t < p->S; ++t) {
                const long from = t < length ? length - 1 - t : t;
                memcpy(s->x + row_of(p, t, n) * I, x + row_of(p, from, n) * I, (size_t)I * sizeof(float));
            }
        }
        x = s->x;
    }
    kiln_gemm_plan input = {0};
    input.src = (void *)x;
    input.dst = s->xw;
    input.packed_w = p->packed_w;
    input.bias = p->bias;
    input.M = p->S * p->N;
    input.K = I;
    input.N = G;
    input.kernel = p->kernel;
    input.threads = threads;
    input.small_m = 1L << 62;  /* x read in place, one fork/join */
    input.pack_m = 1L << 62;
    kiln_gemm(&input, NULL, 0, NULL);
}

static void load_states(const kiln_recurrent_plan *p, const recurrent_scratch *s) {
    const long H = p->H;
    for (long n = 0; n < p->N; ++n) {
        if (p->h0) memcpy(s->h_a + n * H, p->h0 + n * p->state_ns, (size_t)H * sizeof(float));
        else memset(s->h_a + n * H, 0, (size_t)H * sizeof(float));
        if (p->c0) memcpy(s->c + n * H, p->c0 + n * p->state_ns, (size_t)H * sizeof(float));
        else memset(s->c + n * H, 0, (size_t)H * sizeof(float));
    }
}

static void store_states(const kiln_recurrent_plan *p, const float *h, const float *c) {
    const long H = p->H;
    for (long n = 0; n < p->N; ++n) {
        const int empty = length_of(p, n) == 0;
        if (p->yh) {
            if (empty) memset(p->yh + n * p->state_ns, 0, (size_t)H * sizeof(float));
            else memcpy(p->yh + n * p->state_ns, h + n * H, (size_t)H * sizeof(float));
        }
        if (p->yc && c) {
            if (empty) memset(p->yc + n * p->state_ns, 0, (size_t)H * sizeof(float));
            else memcpy(p->yc + n * p->state_ns, c + n * H, (size_t)H * sizeof(float));
        }
    }
}

/* Row n is past its length at `step`: it keeps units [j0, j0 + w) of h and writes zeros to Y. */
static void hold_row(const kiln_recurrent_plan *p, long step, long n, const float *h_prev, float *h_next, long j0,
                     long w) {
    memcpy(h_next + n * p->H + j0, h_prev + n * p->H + j0, (size_t)w * sizeof(float));
    float *y = y_row(p, step, n);
    if (y) memset(y + j0, 0, (size_t)w * sizeof(float));
}

/* The recurrent GEMM of one gate panel for every batch row: c (+)= h·R_panelᵀ, row n at c + n*ldc. The batch
   in row chunks of MR (8 rows on AVX2: 6 + 2; measured an LSTM layer faster than 4 + 4 rows, and than gemm.c's
   narrow 8-row tile, in interleaved A/B runs of one process). */
static void recurrent_panel(const kernel_desc *kd, long N, long H, const float *h, const float *r_panel, float *c,
                            long ldc, int load_c) {
    for (long r0 = 0; r0 < N; r0 += kd->mr) {
        const int m = (int)(N - r0 < kd->mr ? N - r0 : kd->mr);
        kd->direct(m, H, h + r0 * H, H, r_panel, c + r0 * ldc, ldc, (int)kd->nr, load_c, NULL);
    }
}

/* ---- the loop over time -------------------------------------------------------------------------- */

typedef struct loop_ctx loop_ctx;
typedef void (*item_fn)(const loop_ctx *c, long stage, long item);

struct loop_ctx {
    const kiln_recurrent_plan *p;
    const kernel_desc *kd;
    recurrent_scratch s;
    long G, nr, ldg, row_t, ldhr;
    int skip_first, time_reversed, phases;
};

static loop_ctx loop_of(const kiln_recurrent_plan *p, long G, int phases) {
    loop_ctx c;
    c.p = p;
    c.kd = &KERNELS[p->kernel];
    c.s = scratch_of(p, G);
    c.G = G;
    c.nr = c.kd->nr;
    c.row_t = p->batch_major ? 1 : p->N;  /* xw rows of (t, n): t*row_t + n*ldg/G */
    c.ldg = (p->batch_major ? p->S : 1) * G;
    c.ldhr = G / p->gates;
    c.skip_first = p->h0 == NULL;  /* h = 0: the first step's recurrent GEMM adds nothing */
    c.time_reversed = p->reverse && p->lengths == NULL;  /* else xw is in step order */
    c.phases = phases;
    return c;
}

static float *step_gates(const loop_ctx *c, long step) {  /* row n at + n*ldg */
    const long t = c->time_reversed ? c->p->S - 1 - step : step;
    return c->s.xw + t * c->row_t * c->G;
}
static float *h_prev_of(const loop_ctx *c, long step) { return step % 2 ? c->s.h_b : c->s.h_a; }
static float *h_next_of(const loop_ctx *c, long step) { return step % 2 ? c->s.h_a : c->s.h_b; }
static long unit_width(const loop_ctx *c, long u) { return c->p->H - u * c->nr < c->nr ? c->p->H - u * c->nr : c->nr; }

#define STALL_NS 200000L  /* 0.2 ms: a hundred times an item of a 128-unit LSTM */

static void spin_pause(long *spins) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
    if (++*spins % 4096 == 0) sched_yield();  /* a long wait: let whatever the OS put first run */
}

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

/* A participant's counters, each on a cache line of its own, written by that participant alone but for a
   steal: the items of its slice claimed (counted over every stage: its slice of stage k is the k-th run of
   `slice` claims), and the items it finished, its own or stolen (over every stage too). */
typedef struct { _Alignas(64) long claimed; } stage_claims;
typedef struct { _Alignas(64) long finished; } stage_finished;

/* Work a participant may do for stage k before it waits for stage k - 1 to end (run_stages_ahead): items [first,
   end) are its own slice of stage k. Whatever it computes must not depend on stage k - 1, and an item of the slice
   another participant steals must run right with or without it. */
typedef void (*ahead_fn)(const loop_ctx *c, int participant, long stage, long first, long end);

/* One run_stages call: its counters and what its threads measured. */
typedef struct {
    const loop_ctx *c;
    long stages, items;
    int participants;
    item_fn fn;
    ahead_fn ahead;        /* or NULL */
    stage_claims *claims;
    stage_finished *finished;
    int alone;             /* -1, or the participant that waited out a stall: the others leave at the next stage */
    long waited_ns;        /* the longest total any participant spent waiting for another's items */
} stages_run;

static long slice_start(const stages_run *r, long q) { return r->items * q / r->participants; }

/* An unclaimed item of participant q's slice of stage k, now claimed, or -1: none left (or stage k is over, and
   the caller's view of the running stage stale: a claim never reaches into another stage's items). */
static long claim_item(stages_run *r, int q, long k) {
    const long first = slice_start(r, q), slice = slice_start(r, q + 1) - first;
    long seen = __atomic_load_n(&r->claims[q].claimed, __ATOMIC_RELAXED);
    while (seen < (k + 1) * slice)
        if (__atomic_compare_exchange_n(&r->claims[q].claimed, &seen, seen + 1, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
            return first + seen - k * slice;
    return -1;
}

/* 1: a participant claims what is left of its own slice of a stage at once (claim_slice: one locked operation a
   stage); 0: item by item (claim_item), as before 2026-12-06. Other participants' items are stolen one at a time
   either way. Why: a locked read-modify-write per item costs its ~20 cycles and keeps the core from overlapping
   one item's tail (an LSTM cell's chain of dependent operations) with the next item's loads, 8 times a step in
   the LSTM forecaster's block split (cpu.lstm.fused_blocks, 2 threads, 16 blocks of 8 units capped to AVX2).
   What a stall costs is unchanged: a participant preempted inside its slice held the stage up before too (the
   item it held), and finishes the rest of its slice (a few us) once it runs again. bench/recurrent_barrier_ab.py
   times both in one process. */
int kiln_stage_whole_slices = 1;

/* What is left of participant q's own slice of stage k, now claimed: its first item, the end in *end; or -1 (none
   left, or stage k is over: as claim_item). */
static long claim_slice(stages_run *r, int q, long k, long *end) {
    const long first = slice_start(r, q), slice = slice_start(r, q + 1) - first;
    long seen = __atomic_load_n(&r->claims[q].claimed, __ATOMIC_RELAXED);
    while (seen < (k + 1) * slice)
        if (__atomic_compare_exchange_n(&r->claims[q].claimed, &seen, (k + 1) * slice, 0, __ATOMIC_RELAXED,
                                        __ATOMIC_RELAXED)) {
            *end = first + slice;
            return first + seen - k * slice;
        }
    return -1;
}

/* Items finished by everyone: stage k is over when they reach (k + 1)·items (no item of a stage is claimed
   before the previous stage is over). */
static long items_finished(const stages_run *r) {
    long sum = 0;
    for (int q = 0; q < r->participants; ++q) sum += __atomic_load_n(&r->finished[q].finished, __ATOMIC_ACQUIRE);
    return sum;
}

/* What participant id finished, published: once a slice, not per item (the others poll the line while they
   wait, and each store would take it back from their caches). */
static void publish(stages_run *r, int id, long finished) {
    __atomic_store_n(&r->finished[id].finished, finished, __ATOMIC_RELEASE);
}

/* Run one unclaimed item of stage k from another participant's slice; 0 when none is left. */
static int steal_item(stages_run *r, int id, long k, long *finished) {
    for (int j = 1; j < r->participants; ++j) {
        const int q = (id + j) % r->participants;
        const long item = claim_item(r, q, k);
        if (item >= 0) {
            r->fn(r->c, k, item);
            publish(r, id, ++*finished);
            return 1;
        }
    }
    return 0;
}

#define STEAL_NS 3000L  /* 2-3 items of a 128-unit LSTM: a participant this late is not merely a little slower */

/* One thread's part: stage by stage, its own slice of the stage's items (participant p: items
   [p·items/P, (p+1)·items/P), the same units every step, so their weights stay in its core's caches), then a
   wait for the others' slices. Each participant claims from a counter of its own and publishes what it
   finished on another: a step costs a barrier's one exchange of cache lines between cores, not a contended
   atomic per item (bench/results/lstm-epyc-2026-12-04.md). A participant that has waited STEAL_NS claims the
   others' unclaimed items (one descheduled or not started yet holds no one up), and after a stage in which it
   stole, it steals at once. One that starts late finds its slices claimed and joins at the running stage. */
static void stage_participant(void *ctx, long id_) {
    stages_run *r = (stages_run *)ctx;
    const int id = (int)id_;
    long waited = 0, finished = 0;
    int eager = 0;  /* it stole in the last stage: its partners are behind, steal without waiting */
    int left = 0;   /* it left for another participant that waited out a stall */
    for (long k = 0; k < r->stages; ++k) {
        /* its own slice of stage k ahead, where no one has claimed it yet (one that starts late skips it) */
        const long first = slice_start(r, id), end = slice_start(r, id + 1);
        if (k > 0 && r->ahead && items_finished(r) < k * r->items &&
            __atomic_load_n(&r->claims[id].claimed, __ATOMIC_RELAXED) == k * (end - first))
            r->ahead(r->c, id, k, first, end);
        if (k > 0 && items_finished(r) < k * r->items) {
            const long start = now_ns();
            long spins = 0, now = start;
            int stole = 0;
            while (items_finished(r) < k * r->items) {
                const int alone = __atomic_load_n(&r->alone, __ATOMIC_RELAXED);
                if ((eager || alone == id || now - start > STEAL_NS) && steal_item(r, id, k - 1, &finished)) {
                    stole = 1;
                    continue;
                }
                spin_pause(&spins);
                if (spins % 64 == 0) now = now_ns();
                if (now - start > STALL_NS && alone < 0)
                    __atomic_store_n(&r->alone, id, __ATOMIC_RELAXED);
            }
            eager = stole;
            waited += now_ns() - start;
        }
        const int alone = __atomic_load_n(&r->alone, __ATOMIC_RELAXED);
        if (alone >= 0 && alone != id) {
            left = 1;
            break;
        }
        const long before = finished;
        if (kiln_stage_whole_slices) {
            long item, end;
            while ((item = claim_slice(r, id, k, &end)) >= 0)
                for (; item < end; ++item, ++finished) r->fn(r->c, k, item);
        } else {
            for (long item; (item = claim_item(r, id, k)) >= 0; ++finished) r->fn(r->c, k, item);
        }
        if (finished > before) publish(r, id, finished);
    }
    /* the last stage's unclaimed items: no later stage waits for them (one that left for a stall claims none) */
    if (!left && r->stages > 0)
        while (steal_item(r, id, r->stages - 1, &finished)) {
        }
    long seen = __atomic_load_n(&r->waited_ns, __ATOMIC_RELAXED);
    while (waited > seen && !__atomic_compare_exchange_n(&r->waited_ns, &seen, waited, 0, __ATOMIC_RELAXED,
                                                         __ATOMIC_RELAXED)) {
    }
}

/* Stages 0 .. stages-1 in order, each `items` calls of fn, one participant per thread on kiln_parallel_for
   (pool.c: a worker that has not started when the caller is done is not waited for; OpenMP's loop where the
   pool is off). Returns when every stage is done; 1 when a thread waited out a stall and the others left (the
   file's comment). Sets plan.waited_ns and loop_ns. */
static int run_stages_ahead(const loop_ctx *c, long stages, long items, int threads, item_fn fn, ahead_fn ahead) {
    kiln_recurrent_plan *p = (kiln_recurrent_plan *)c->p;
    const long start = now_ns();
    if (threads <= 1 || items <= 1) {
        /* one thread: the items in order, no counters. A locked read-modify-write per claim also keeps the
           core from overlapping one item's tail (an LSTM cell's chain of dependent operations) with the next
           item's loads: the fused LSTM (lstm_fused.c) ran 5-10% faster on the Xeon without them. */
        for (long k = 0; k < stages; ++k)
            for (long item = 0; item < items; ++item) fn(c, k, item);
        p->waited_ns = 0;
        p->loop_ns = now_ns() - start;
        return 0;
    }
    const int participants = threads < items ? threads : (int)items;
    stage_claims claims[participants];
    stage_finished finished[participants];
    memset(claims, 0, sizeof claims);
    memset(finished, 0, sizeof finished);
    stages_run r = {c, stages, items, participants, fn, ahead, claims, finished, -1, 0};
    kiln_parallel_for(participants, participants, stage_participant, &r);
    p->waited_ns = r.waited_ns;
    p->loop_ns = now_ns() - start;
    return r.alone >= 0;
}

static int run_stages(const loop_ctx *c, long stages, long items, int threads, item_fn fn) {
    return run_stages_ahead(c, stages, items, threads, fn, NULL);
}

#pragma GCC push_options
#pragma GCC optimize("no-trapping-math")

static void clamp_all(float *v, long n, float clip) {
    for (long j = 0; j < n; ++j) v[j] = v[j] < -clip ? -clip : (v[j] > clip ? clip : v[j]);
}

/* v = act(clip(v)) in place; one vectorisable loop per kind (alpha/beta as kiln/ops/rnn.py takes them). */
static void recurrent_activate(float *v, long n, const recurrent_act *a, float clip) {
    const float alpha = a->alpha, beta = a->beta;
    if (clip > 0.0f) clamp_all(v, n, clip);
    switch (a->kind) {
    case RACT_RELU: for (long j = 0; j < n; ++j) v[j] = v[j] > 0.0f ? v[j] : 0.0f; break;
    case RACT_TANH: for (long j = 0; j < n; ++j) v[j] = tanh_rational(v[j]); break;
    case RACT_SIGMOID: for (long j = 0; j < n; ++j) v[j] = 1.0f / (1.0f + exp_poly(-v[j])); break;
    case RACT_AFFINE: for (long j = 0; j < n; ++j) v[j] = alpha * v[j] + beta; break;
    case RACT_LEAKY_RELU: for (long j = 0; j < n; ++j) v[j] = v[j] >= 0.0f ? v[j] : alpha * v[j]; break;
    case RACT_THRESHOLDED_RELU: for (long j = 0; j < n; ++j) v[j] = v[j] > alpha ? v[j] : 0.0f; break;
    case RACT_SCALED_TANH: for (long j = 0; j < n; ++j) v[j] = alpha * tanh_rational(beta * v[j]); break;
    case RACT_HARD_SIGMOID:
        for (long j = 0; j < n; ++j) {
            const float u = alpha * v[j] + beta;
            v[j] = u < 0.0f ? 0.0f : (u > 1.0f ? 1.0f : u);
        }
        break;
    case RACT_ELU: for (long j = 0; j < n; ++j) v[j] = v[j] >= 0.0f ? v[j] : alpha * (exp_poly(v[j]) - 1.0f); break;
    case RACT_SOFTSIGN: for (long j = 0; j < n; ++j) v[j] = v[j] / (1.0f + (v[j] < 0.0f ? -v[j] : v[j])); break;
    default: break;
    }
}

/* RNN cell, units [j0, j0 + w) of every row: h = f(g). g row n at g + n*ldg. */
static void rnn_cell(const kiln_recurrent_plan *p, long step, float *g, long ldg, const float *h_prev, float *h_next,
                     long j0, long w) {
    for (long n = 0; n < p->N; ++n) {
        if (step >= length_of(p, n)) { hold_row(p, step, n, h_prev, h_next, j0, w); continue; }
        float *gn = g + n * ldg, *hn = h_next + n * p->H + j0;
        recurrent_activate(gn, w, &p->act[0], p->clip);
        memcpy(hn, gn, (size_t)w * sizeof(float));
        float *y = y_row(p, step, n);
        if (y) memcpy(y + j0, hn, (size_t)w * sizeof(float));
    }
}

/* GRU cell, units [j0, j0 + w): z, r activated in place (linear_before_reset=0: already, by gru_reset),
   the candidate's pre-activation in g_h (plus r ⊙ (hr + Rb_h) with linear_before_reset=1). */
static void gru_cell(const kiln_recurrent_plan *p, long step, float *g, long ldg, const float *hr, long ldhr,
                     const float *h_prev, float *h_next, long j0, long w, long nr) {
    const float *rbh = p->bias_rh ? p->bias_rh + j0 : NULL;
    for (long n = 0; n < p->N; ++n) {
        if (step >= length_of(p, n)) { hold_row(p, step, n, h_prev, h_next, j0, w); continue; }
        float *gz = g + n * ldg, *gr = gz + nr, *gh = gz + 2 * nr;
        const float *hp = h_prev + n * p->H + j0;
        float *hn = h_next + n * p->H + j0;
        if (p->linear_before_reset) {
            recurrent_activate(gz, w, &p->act[0], p->clip);
            recurrent_activate(gr, w, &p->act[0], p->clip);
            const float *hrn = hr + n * ldhr;
            for (long j = 0; j < w; ++j) gh[j] += gr[j] * (hrn[j] + rbh[j]);
        }
        recurrent_activate(gh, w, &p->act[1], p->clip);
        for (long j = 0; j < w; ++j) hn[j] = (1.0f - gz[j]) * gh[j] + gz[j] * hp[j];
        float *y = y_row(p, step, n);
        if (y) memcpy(y + j0, hn, (size_t)w * sizeof(float));
    }
}

/* GRU linear_before_reset=0, first half of a step: z, r of units [j0, j0 + w) activated, rh = r ⊙ h. */
static void gru_reset(const kiln_recurrent_plan *p, float *g, long ldg, const float *h_prev, float *rh, long j0,
                      long w, long nr) {
    for (long n = 0; n < p->N; ++n) {
        float *gz = g + n * ldg, *gr = gz + nr;
        recurrent_activate(gz, w, &p->act[0], p->clip);
        recurrent_activate(gr, w, &p->act[0], p->clip);
        const float *hp = h_prev + n * p->H + j0;
        float *out = rh + n * p->H + j0;
        for (long j = 0; j < w; ++j) out[j] = gr[j] * hp[j];
    }
}

#pragma GCC pop_options

static void rnn_item(const loop_ctx *c, long step, long u) {
    const kiln_recurrent_plan *p = c->p;
    float *g = step_gates(c, step) + u * c->nr;
    const float *h_prev = h_prev_of(c, step);
    if (!(c->skip_first && step == 0))
        recurrent_panel(c->kd, p->N, p->H, h_prev, p->packed_r + u * p->H * c->nr, g, c->ldg, 1);
    rnn_cell(p, step, g, c->ldg, h_prev, h_next_of(c, step), u * c->nr, unit_width(c, u));
}

/* linear_before_reset=1: z, r into xw, h·R_hᵀ into hr, then the cell */
static void gru_item(const loop_ctx *c, long step, long u) {
    const kiln_recurrent_plan *p = c->p;
    const long N = p->N, H = p->H, nr = c->nr;
    const float *r = p->packed_r + u * 3 * H * nr, *h_prev = h_prev_of(c, step);
    float *g = step_gates(c, step) + u * 3 * nr, *hr = c->s.hr + u * nr;
    if (!(c->skip_first && step == 0)) {
        recurrent_panel(c->kd, N, H, h_prev, r, g, c->ldg, 1);                      /* z */
        recurrent_panel(c->kd, N, H, h_prev, r + H * nr, g + nr, c->ldg, 1);        /* r */
        recurrent_panel(c->kd, N, H, h_prev, r + 2 * H * nr, hr, c->ldhr, 0);       /* h·R_hᵀ */
    } else {
        for (long n = 0; n < N; ++n) memset(hr + n * c->ldhr, 0, (size_t)nr * sizeof(float));
    }
    gru_cell(p, step, g, c->ldg, hr, c->ldhr, h_prev, h_next_of(c, step), u * nr, unit_width(c, u), nr);
}

/* linear_before_reset=0, stage 2·step: z, r and r ⊙ h; stage 2·step + 1: (r ⊙ h)·R_hᵀ and the cell */
static void gru_reset_item(const loop_ctx *c, long stage, long u) {
    const kiln_recurrent_plan *p = c->p;
    const long step = stage / 2, N = p->N, H = p->H, nr = c->nr;
    const int recur = !(c->skip_first && step == 0);
    const float *h_prev = h_prev_of(c, step);
    float *g = step_gates(c, step) + u * 3 * nr;
    if (stage % 2 == 0) {
        const float *r = p->packed_r + u * 3 * H * nr;
        if (recur) {
            recurrent_panel(c->kd, N, H, h_prev, r, g, c->ldg, 1);
            recurrent_panel(c->kd, N, H, h_prev, r + H * nr, g + nr, c->ldg, 1);
        }
        gru_reset(p, g, c->ldg, h_prev, c->s.rh, u * nr, unit_width(c, u), nr);
        return;
    }
    if (recur) recurrent_panel(c->kd, N, H, c->s.rh, p->packed_r + (u * 3 + 2) * H * nr, g + 2 * nr, c->ldg, 1);
    gru_cell(p, step, g, c->ldg, NULL, 0, h_prev, h_next_of(c, step), u * nr, unit_width(c, u), nr);
}

int kiln_rnn(void *object, void *stream, int nargs, const void *args) {
    (void)stream; (void)nargs; (void)args;
    kiln_recurrent_plan *p = (kiln_recurrent_plan *)object;
    if (p->kernel < 0 || p->kernel >= KERNEL_COUNT || p->gates != 1) return 2;
    const long G = recurrent_gate_columns(p->kernel, p->H, 1);
    if (p->S <= 0 || p->N <= 0) return 0;
    const loop_ctx c = loop_of(p, G, 1);
    const int threads = recurrent_threads(p);
    recurrent_input(p, &c.s, G, threads);
    load_states(p, &c.s);
    p->stalled = run_stages(&c, p->S, G / c.nr, threads, rnn_item);
    store_states(p, h_prev_of(&c, p->S), NULL);
    return 0;
}

int kiln_gru(void *object, void *stream, int nargs, const void *args) {
    (void)stream; (void)nargs; (void)args;
    kiln_recurrent_plan *p = (kiln_recurrent_plan *)object;
    if (p->kernel < 0 || p->kernel >= KERNEL_COUNT || p->gates != 3) return 2;
    if (p->linear_before_reset && p->bias_rh == NULL) return 3;
    const long G = recurrent_gate_columns(p->kernel, p->H, 3);
    if (p->S <= 0 || p->N <= 0) return 0;
    const int phases = p->linear_before_reset ? 1 : 2;
    const loop_ctx c = loop_of(p, G, phases);
    const int threads = recurrent_threads(p);
    recurrent_input(p, &c.s, G, threads);
    load_states(p, &c.s);
    p->stalled =
        run_stages(&c, p->S * phases, G / (3 * c.nr), threads, phases == 1 ? gru_item : gru_reset_item);
    store_states(p, h_prev_of(&c, p->S), NULL);
    return 0;
}

/* ---- a layer as a member of a native segment ------------------------------------------------------- */

typedef int (*recurrent_loop_fn)(void *object, void *stream, int nargs, const void *args);

/* One ONNX RNN / GRU / LSTM layer (every direction) inside a native segment (kiln/runtime/native.py): its
   operands are oneDNN memory objects whose addresses are read at each call, as the segment points its
   entries and exits per run; everything else is in the directions' plans, made when the layer was bound. */
typedef struct {
    get_handle_fn get_handle;
    void *x, *y;               /* dnnl_memory_t: X (row-major, as the plans' layout says), Y or NULL */
    void *h0, *c0;             /* dnnl_memory_t of initial states the segment computes, or NULL: the plans' own */
    void *yh, *yc;             /* dnnl_memory_t of the final states, or NULL: not asked for */
    kiln_recurrent_plan *plans;  /* [directions] */
    recurrent_loop_fn loop;    /* kiln_rnn, kiln_gru, kiln_lstm, kiln_lstm_lanes or kiln_lstm_fused */
    long directions;
    long y_direction, state_direction;  /* floats from one direction's Y / state to the next's */
    void *lengths;             /* dnnl_memory_t of sequence_lens (int32 [N]) the segment computes, or NULL: the
                                  plans' own (constants of the engine, or none) */
} recurrent_member_plan;

#define KILN_RECURRENT_BAD_LENGTHS 1001  /* kiln/kernels/cpu/onednn.py _STATUS says it */

static float *member_operand(const recurrent_member_plan *m, void *memory, long offset, int *missing) {
    void *h = NULL;
    if (memory == NULL) return NULL;
    if (m->get_handle(memory, &h) != 0 || h == NULL) *missing = 1;
    return h == NULL ? NULL : (float *)h + offset;
}

/* One direction of a member's run: its operands pointed from the memory objects, then its loop. */
typedef struct {
    const recurrent_member_plan *m;
    const int *lengths;
    int threads;              /* each direction's loop: 0 OpenMP's count, 1 in order on the calling thread */
    int status[2];
} member_run;

static void member_direction(void *ctx, long d) {
    member_run *r = (member_run *)ctx;
    const recurrent_member_plan *m = r->m;
    kiln_recurrent_plan *p = &m->plans[d];
    int missing = 0;
    if (m->lengths) p->lengths = r->lengths;
    p->threads = r->threads;
    p->x = member_operand(m, m->x, 0, &missing);
    p->y = member_operand(m, m->y, d * m->y_direction, &missing);
    if (m->h0) p->h0 = member_operand(m, m->h0, d * m->state_direction, &missing);
    if (m->c0) p->c0 = member_operand(m, m->c0, d * m->state_direction, &missing);
    p->yh = member_operand(m, m->yh, d * m->state_direction, &missing);
    p->yc = member_operand(m, m->yc, d * m->state_direction, &missing);
    /* an operand not bound: the segment names the layer */
    r->status[d] = missing || p->x == NULL ? 2 : m->loop(p, NULL, 0, NULL);
}

/* 0: two directions always one after the other (bench/recurrent_members.py times both ways in one process) */
int kiln_recurrent_directions_apart = 1;

/* A recurrent layer as a native segment's member. Two directions on two or three threads run one per thread, each
   loop in order (a step of one direction is a few microseconds of work: two threads on it wait for each other
   at every step's barrier, two directions never do); on one thread, or four and more, one after the other, each on
   every thread. */
int kiln_recurrent_member(void *object, void *stream, int nargs, const void *args) {
    const recurrent_member_plan *m = (const recurrent_member_plan *)object;
    member_run r = {m, NULL, 0, {0, 0}};
    (void)stream, (void)nargs, (void)args;
    if (m->lengths) {  /* checked here, where the segment runs without Python: each in [0, S]; all S: none */
        void *h = NULL;
        if (m->get_handle(m->lengths, &h) != 0 || h == NULL) return 2;
        const long S = m->plans[0].S, N = m->plans[0].N;
        int full = 1;
        for (long n = 0; n < N; ++n) {
            const int length = ((const int *)h)[n];
            if (length < 0 || length > S) return KILN_RECURRENT_BAD_LENGTHS;
            full &= length == S;
        }
        r.lengths = full ? NULL : (const int *)h;
    }
    int threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    if (kiln_recurrent_directions_apart && m->directions == 2 && threads >= 2 && threads < 4) {
        r.threads = 1;
        kiln_parallel_for(2, 2, member_direction, &r);
    } else {
        for (long d = 0; d < m->directions && d < 2; ++d) member_direction(&r, d);
    }
    return r.status[0] ? r.status[0] : r.status[1];
}
