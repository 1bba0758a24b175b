/* An ONNX RNN / GRU / LSTM layer as a member of a native segment (kiln/kernels/cpu/recurrent.py RecurrentLayer),
 * and two stacked layers run side by side. Compiled after recurrent.c, lstm.c, lstm_lanes.c and lstm_fused.c.
 *
 * The stack: where a one-direction layer's Y is the X of the next member, a one-direction LSTM on lstm_fused.c
 * (which reads X step by step), the member below runs both, at two or three threads one per thread, each loop on
 * its thread alone: the upper layer's step t waits only until the lower one has written step t of Y (a counter
 * the lower one raises after each step), never the other way. A step of either layer is a few microseconds of
 * work; split over two threads, each step ends at a barrier where the threads exchange h (recurrent.c's
 * run_stages); stacked, the lower layer never waits and the upper one only when it catches up, so the two
 * layers' time is about the slower one's plus one step. The upper member's own call then only returns the
 * status of its run. Layers that cannot be stacked (two directions, a reverse one, a loop reading all of X before
 * its first step, states or lengths written by the layer below) run one after the other, as without the link.
 *
 * Which is faster is measured, not guessed: the stack is bound by the slower layer (the upper LSTM reads 2·H
 * inputs a step where the lower one reads I + H), splitting each step by the barrier's cost against the step's
 * work. On the Xeon (2 threads, SCHED_FIFO, the zoo's LSTM forecaster) the stack won with AVX-512 (1.20 vs 1.42 ms)
 * and lost capped to AVX2 (2.18 vs 2.06 ms), where a step is twice the work. So the lower member times both forms
 * (the pair's wall time, both in its call): stack_choice below, a C twin of kiln/kernels/cpu/form_choice.py's
 * rule (the median of each form's last runs; the other form probed every STACK_PROBE_EVERY runs).
 */

typedef int (*recurrent_loop_fn)(void *object, void *stream, int nargs, const void *args);

#define STACK_WINDOW 3       /* run times per form the estimate is the median of */
#define STACK_PROBE_EVERY 16 /* runs between probes of the form not chosen */
#define STACK_WARMUP 2       /* the first runs (one of each form) are not counted: cold caches, pages first touched */

/* Which form a linked pair runs, from the pair's measured wall times: 0 in turn, 1 stacked. Pure bookkeeping, no
   clock (tests/unit/test_recurrent_stack.py feeds it made-up times through kiln_recurrent_stack_record). */
typedef struct {
    long ns[2][STACK_WINDOW];  /* each form's last counted times, a ring */
    long counted[2];
    long runs;                 /* recorded so far, warm-up included */
    int best;                  /* the form of the lower estimate */
} stack_choice;

static long median_ns(const long *ns, long counted) {
    long v[STACK_WINDOW];
    const long n = counted < STACK_WINDOW ? counted : STACK_WINDOW;
    for (long i = 0; i < n; ++i) v[i] = ns[i];
    for (long i = 1; i < n; ++i)  /* insertion sort of at most three */
        for (long j = i; j > 0 && v[j - 1] > v[j]; --j) {
            const long t = v[j];
            v[j] = v[j - 1];
            v[j - 1] = t;
        }
    return v[n / 2];
}

/* The form to run next: the two alternate until each has a window of counted times, then the better one, and the
   other every STACK_PROBE_EVERY runs. */
static int stack_form(const stack_choice *s) {
    if (s->counted[0] < STACK_WINDOW || s->counted[1] < STACK_WINDOW) return (int)(s->runs % 2);
    return s->runs % STACK_PROBE_EVERY == 0 ? !s->best : s->best;
}

static void stack_record(stack_choice *s, int form, long ns) {
    if (s->runs++ >= STACK_WARMUP) s->ns[form][s->counted[form]++ % STACK_WINDOW] = ns;
    if (s->counted[0] > 0 && s->counted[1] > 0)
        s->best = median_ns(s->ns[1], s->counted[1]) < median_ns(s->ns[0], s->counted[0]);
}

int kiln_recurrent_stack_form(const void *choice) { return stack_form((const stack_choice *)choice); }
void kiln_recurrent_stack_record(void *choice, int form, long ns) { stack_record((stack_choice *)choice, form, ns); }

/* One ONNX RNN / GRU / LSTM layer (every direction) inside a native segment (kiln/runtime/native.py): its
   operands are oneDNN memory objects whose addresses are read at each call, as the segment points its
   entries and exits per run; everything else is in the directions' plans, made when the layer was bound. */
typedef struct recurrent_member_plan {
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
    struct recurrent_member_plan *above;  /* the segment's next member, a recurrent layer this one may run
                                             alongside itself (the stack), or NULL */
    int ran;                   /* set by the member below when it ran this one: this one's call returns `status` */
    int status;
    int stacked;               /* out: 1 when this member's last call ran the member above alongside itself */
    stack_choice choice;       /* the times of the pair's two forms (where `above` may be stacked) */
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

/* 1: a linked pair runs the form measured faster (stack_choice); 0: never stacked, 2: always (tests; and
   bench/recurrent_stack.py, which times the three in one process) */
int kiln_recurrent_stack = 1;

/* sequence_lens the segment computes, checked here, where the segment runs without Python: each in [0, S]. *lengths:
   them, or NULL where every row runs S steps (or the member has none of its own). */
static int member_lengths(const recurrent_member_plan *m, const int **lengths) {
    *lengths = NULL;
    if (m->lengths == NULL) return 0;
    void *h = NULL;
    if (m->get_handle(m->lengths, &h) != 0 || h == NULL) return 2;
    const long S = m->plans[0].S, N = m->plans[0].N;
    int full = 1;
    for (long n = 0; n < N; ++n) {
        const int length = ((const int *)h)[n];
        if (length < 0 || length > S) return KILN_RECURRENT_BAD_LENGTHS;
        full &= length == S;
    }
    *lengths = full ? NULL : (const int *)h;
    return 0;
}

static int openmp_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

/* Two directions on two or three threads run one per thread, each loop in order (a step of one direction is a few
   microseconds of work: two threads on it wait for each other at every step's barrier, two directions never do);
   on one thread, or four and more, one after the other, each on every thread. */
static int member_layer(const recurrent_member_plan *m, const int *lengths, int threads) {
    member_run r = {m, lengths, 0, {0, 0}};
    if (kiln_recurrent_directions_apart && m->directions == 2 && threads >= 2 && threads < 4) {
        r.threads = 1;
        kiln_parallel_for(2, 2, member_direction, &r);
    } else {
        for (long d = 0; d < m->directions && d < 2; ++d) member_direction(&r, d);
    }
    return r.status[0] ? r.status[0] : r.status[1];
}

/* A member's operand as a span of floats (Y: every step and row; a state: every row; lengths: N int32), or start
   NULL: none, or the plans' own (constants of the engine, outside the segment's memory). */
typedef struct {
    const float *start;
    long floats;
} operand_span;

static operand_span span_of(const recurrent_member_plan *m, void *memory, long floats) {
    void *h = NULL;
    operand_span s = {NULL, floats};
    if (memory != NULL && m->get_handle(memory, &h) == 0) s.start = (const float *)h;
    return s;
}

static int overlap(operand_span a, operand_span b) {
    return a.start != NULL && b.start != NULL && a.start < b.start + b.floats && b.start < a.start + a.floats;
}

/* One direction's operands: reads X, h0, c0, lengths; writes Y, Y_h, Y_c. */
static void operand_spans(const recurrent_member_plan *m, operand_span reads[4], operand_span writes[3]) {
    const kiln_recurrent_plan *p = &m->plans[0];
    const long state = (p->N - 1) * p->state_ns + p->H;
    reads[0] = span_of(m, m->x, p->S * p->N * p->I);
    reads[1] = span_of(m, m->h0, state);
    reads[2] = span_of(m, m->c0, state);
    reads[3] = span_of(m, m->lengths, p->N);
    writes[0] = span_of(m, m->y, (p->S - 1) * p->y_ts + (p->N - 1) * p->y_ns + p->H);
    writes[1] = span_of(m, m->yh, state);
    writes[2] = span_of(m, m->yc, state);
}

/* Whether `below` may run `above` alongside itself: one forward direction each, the upper one on the loop that
   reads X step by step, its X exactly the lower one's Y, and no other operand of one written by the other (the
   segment's memory plan keeps the lower one's reads live through the upper one: NativeStep.overlaps_next). */
static int stackable(const recurrent_member_plan *below, const recurrent_member_plan *above) {
    const kiln_recurrent_plan *p = &below->plans[0], *q = &above->plans[0];
    if (below->directions != 1 || above->directions != 1 || p->reverse || q->reverse) return 0;
    if (above->loop != kiln_lstm_fused || below->loop == kiln_lstm_lanes)  /* lanes: Y written after its loop */
        return 0;
    if (p->S != q->S || p->N != q->N || p->batch_major != q->batch_major || q->I != p->H) return 0;
    operand_span lower_reads[4], lower_writes[3], upper_reads[4], upper_writes[3];
    operand_spans(below, lower_reads, lower_writes);
    operand_spans(above, upper_reads, upper_writes);
    if (lower_writes[0].start == NULL || upper_reads[0].start != lower_writes[0].start) return 0;
    for (int i = 0; i < 3; ++i) {
        for (int j = 0; j < 4; ++j)
            if (overlap(upper_writes[i], lower_reads[j]) || (j > 0 && overlap(upper_reads[j], lower_writes[i])))
                return 0;
        for (int j = 0; j < 3; ++j)
            if (overlap(upper_writes[i], lower_writes[j])) return 0;
    }
    return 1;
}

/* The two layers of a stack: the lower one counts the steps of Y it has written, the upper one waits on them. */
typedef struct {
    recurrent_member_plan *layer[2];
    const int *lengths[2];
    long steps;               /* of the lower layer's Y written so far; LONG_MAX once its loop has returned */
    int status[2];
} stack_run;

static void stack_layer(void *ctx, long k) {
    stack_run *r = (stack_run *)ctx;
    kiln_recurrent_plan *p = &r->layer[k]->plans[0];
    member_run run = {r->layer[k], r->lengths[k], 1, {0, 0}};
    if (k == 0) p->steps_out = &r->steps;
    else p->steps_in = &r->steps;
    member_direction(&run, 0);
    p->steps_in = NULL;
    p->steps_out = NULL;
    if (k == 0) __atomic_store_n(&r->steps, LONG_MAX, __ATOMIC_RELEASE);  /* failed early: the upper one waits no more */
    r->status[k] = run.status[0];
}

/* The member and the one above it, one per thread (kiln_parallel_for's items in order: a worker that starts late
   finds the lower layer done, and runs the upper one without waiting, or the caller has run both). */
static int member_stack(recurrent_member_plan *m, const int *lengths) {
    recurrent_member_plan *above = m->above;
    stack_run r = {{m, above}, {lengths, NULL}, 0, {0, 0}};
    const int status = member_lengths(above, &r.lengths[1]);
    if (status) return status;
    kiln_parallel_for(2, 2, stack_layer, &r);
    above->ran = 1;
    above->status = r.status[1];
    return r.status[0];
}

/* The member and the one above it one after the other, each on every thread (the pair timed in one call). */
static int member_pair(recurrent_member_plan *m, const int *lengths, int threads) {
    recurrent_member_plan *above = m->above;
    const int *above_lengths;
    int status = member_layer(m, lengths, threads);
    if (status) return status;
    above->status = member_lengths(above, &above_lengths);
    if (above->status == 0) above->status = member_layer(above, above_lengths, threads);
    above->ran = 1;
    return 0;
}

/* A recurrent layer as a native segment's member: its directions (member_layer), or it and the member above (the
   file's comment); the member above's own call then only returns its status. */
int kiln_recurrent_member(void *object, void *stream, int nargs, const void *args) {
    recurrent_member_plan *m = (recurrent_member_plan *)object;
    (void)stream, (void)nargs, (void)args;
    if (m->ran) {
        m->ran = 0;
        return m->status;
    }
    const int *lengths;
    int status = member_lengths(m, &lengths);
    if (status) return status;
    const int threads = openmp_threads();
    m->stacked = 0;
    if (!(kiln_recurrent_stack && m->above != NULL && threads >= 2 && threads < 4 && stackable(m, m->above))) {
        if (m->above) m->above->ran = 0;  /* a run stacked before, cut short by an error: the member above runs */
        return member_layer(m, lengths, threads);
    }
    m->stacked = kiln_recurrent_stack == 2 || stack_form(&m->choice);
    const long start = now_ns();
    status = m->stacked ? member_stack(m, lengths) : member_pair(m, lengths, threads);
    if (kiln_recurrent_stack == 1 && status == 0) stack_record(&m->choice, m->stacked, now_ns() - start);
    return status;
}
