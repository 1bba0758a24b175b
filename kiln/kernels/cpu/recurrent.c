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
 * thread that owns unit block u computes its gate panels and then the cell of those units (static
 * schedule: a thread's share of R stays in its core's cache across the steps); a step synchronises once
 * (every thread reads all of h at the next step), the GRU with linear_before_reset=0 twice (its candidate
 * multiplies r ⊙ h, all of it, by R_h).
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
} kiln_recurrent_plan;

static long recurrent_gate_columns(int kernel, long h, int gates) {
    const long nr = KERNELS[kernel].nr;
    return (h + nr - 1) / nr * gates * nr;
}

long kiln_recurrent_gate_columns(int kernel, long h, int gates) { return recurrent_gate_columns(kernel, h, gates); }

/* xw [S·N, G], h_a, h_b, c, rh [N, H], the GRU's h·R_hᵀ [N, G/3], the length-reversed X [S·N, I] */
long kiln_recurrent_scratch_floats(int kernel, long s, long n, long i, long h, int gates) {
    const long g = recurrent_gate_columns(kernel, h, gates);
    return s * n * g + 4 * n * h + n * g + s * n * i + 64;
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

/* The recurrent GEMM of one gate panel for every batch row: c (+)= h·R_panelᵀ, row n at c + n*ldc. */
static void recurrent_panel(const kernel_desc *kd, long N, long H, const float *h, const float *r_panel, float *c,
                            long ldc, int load_c) {
    for (long r0 = 0; r0 < N; r0 += kd->mr) {
        const int m = (int)(N - r0 < kd->mr ? N - r0 : kd->mr);
        kd->direct(m, H, h + r0 * H, H, r_panel, c + r0 * ldc, ldc, (int)kd->nr, load_c);
    }
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

int kiln_rnn(void *object, void *stream, int nargs, const void *args) {
    (void)stream; (void)nargs; (void)args;
    const kiln_recurrent_plan *p = (const kiln_recurrent_plan *)object;
    if (p->kernel < 0 || p->kernel >= KERNEL_COUNT || p->gates != 1) return 2;
    const kernel_desc *kd = &KERNELS[p->kernel];
    const long S = p->S, N = p->N, H = p->H, nr = kd->nr;
    const long G = recurrent_gate_columns(p->kernel, H, 1), blocks = G / nr;
    if (S <= 0 || N <= 0) return 0;
    const recurrent_scratch s = scratch_of(p, G);
    const int threads = recurrent_threads(p);
    recurrent_input(p, &s, G, threads);
    load_states(p, &s);
    const int skip_first = p->h0 == NULL;  /* h = 0: the first step's recurrent GEMM adds nothing */
    const long row_t = p->batch_major ? 1 : N, ldg = (p->batch_major ? S : 1) * G;
    const int time_reversed = p->reverse && p->lengths == NULL;  /* else xw is in step order */
    float *h_final = S % 2 ? s.h_b : s.h_a;

    #pragma omp parallel num_threads(threads) if (threads > 1 && blocks > 1)
    {
        float *h_prev = s.h_a, *h_next = s.h_b;
        for (long step = 0; step < S; ++step) {
            float *g = s.xw + (time_reversed ? S - 1 - step : step) * row_t * G;  /* row n at g + n*ldg */
            #pragma omp for schedule(static)
            for (long u = 0; u < blocks; ++u) {
                if (!(skip_first && step == 0))
                    recurrent_panel(kd, N, H, h_prev, p->packed_r + u * H * nr, g + u * nr, ldg, 1);
                const long j0 = u * nr, w = H - j0 < nr ? H - j0 : nr;
                rnn_cell(p, step, g + u * nr, ldg, h_prev, h_next, j0, w);
            }  /* the barrier: all of h_next is written before any thread reads it */
            float *swap = h_prev;
            h_prev = h_next;
            h_next = swap;
        }
    }
    store_states(p, h_final, NULL);
    return 0;
}

int kiln_gru(void *object, void *stream, int nargs, const void *args) {
    (void)stream; (void)nargs; (void)args;
    const kiln_recurrent_plan *p = (const kiln_recurrent_plan *)object;
    if (p->kernel < 0 || p->kernel >= KERNEL_COUNT || p->gates != 3) return 2;
    if (p->linear_before_reset && p->bias_rh == NULL) return 3;
    const kernel_desc *kd = &KERNELS[p->kernel];
    const long S = p->S, N = p->N, H = p->H, nr = kd->nr;
    const long G = recurrent_gate_columns(p->kernel, H, 3), blocks = G / (3 * nr);
    if (S <= 0 || N <= 0) return 0;
    const recurrent_scratch s = scratch_of(p, G);
    const int threads = recurrent_threads(p);
    recurrent_input(p, &s, G, threads);
    load_states(p, &s);
    const int skip_first = p->h0 == NULL;
    const long row_t = p->batch_major ? 1 : N, ldg = (p->batch_major ? S : 1) * G;
    const long ldhr = blocks * nr;  /* h·R_hᵀ of linear_before_reset=1: [N, blocks·NR] */
    const int time_reversed = p->reverse && p->lengths == NULL;
    float *h_final = S % 2 ? s.h_b : s.h_a;

    #pragma omp parallel num_threads(threads) if (threads > 1 && blocks > 1)
    {
        float *h_prev = s.h_a, *h_next = s.h_b;
        for (long step = 0; step < S; ++step) {
            float *g = s.xw + (time_reversed ? S - 1 - step : step) * row_t * G;
            const int recur = !(skip_first && step == 0);
            if (p->linear_before_reset) {
                #pragma omp for schedule(static)
                for (long u = 0; u < blocks; ++u) {
                    const float *r = p->packed_r + u * 3 * H * nr;
                    float *gu = g + u * 3 * nr, *hr = s.hr + u * nr;
                    if (recur) {
                        recurrent_panel(kd, N, H, h_prev, r, gu, ldg, 1);                    /* z */
                        recurrent_panel(kd, N, H, h_prev, r + H * nr, gu + nr, ldg, 1);      /* r */
                        recurrent_panel(kd, N, H, h_prev, r + 2 * H * nr, hr, ldhr, 0);      /* h·R_hᵀ */
                    } else {
                        for (long n = 0; n < N; ++n) memset(hr + n * ldhr, 0, (size_t)nr * sizeof(float));
                    }
                    const long j0 = u * nr, w = H - j0 < nr ? H - j0 : nr;
                    gru_cell(p, step, gu, ldg, hr, ldhr, h_prev, h_next, j0, w, nr);
                }  /* the barrier */
            } else {
                #pragma omp for schedule(static)
                for (long u = 0; u < blocks; ++u) {
                    const float *r = p->packed_r + u * 3 * H * nr;
                    float *gu = g + u * 3 * nr;
                    if (recur) {
                        recurrent_panel(kd, N, H, h_prev, r, gu, ldg, 1);
                        recurrent_panel(kd, N, H, h_prev, r + H * nr, gu + nr, ldg, 1);
                    }
                    const long j0 = u * nr, w = H - j0 < nr ? H - j0 : nr;
                    gru_reset(p, gu, ldg, h_prev, s.rh, j0, w, nr);
                }  /* barrier: all of r ⊙ h is written */
                #pragma omp for schedule(static)
                for (long u = 0; u < blocks; ++u) {
                    float *gu = g + u * 3 * nr;
                    if (recur) recurrent_panel(kd, N, H, s.rh, p->packed_r + (u * 3 + 2) * H * nr, gu + 2 * nr, ldg, 1);
                    const long j0 = u * nr, w = H - j0 < nr ? H - j0 : nr;
                    gru_cell(p, step, gu, ldg, NULL, 0, h_prev, h_next, j0, w, nr);
                }  /* the barrier */
            }
            float *swap = h_prev;
            h_prev = h_next;
            h_next = swap;
        }
    }
    store_states(p, h_final, NULL);
    return 0;
}
