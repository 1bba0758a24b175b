/* One direction of an ONNX LSTM layer as one call, on recurrent.c's plan, input projection, states and
 * sequence lengths (kiln/kernels/cpu/recurrent.py compiles gemm.c, recurrent.c and this file as one).
 *
 *   xw = X·Wᵀ + (Wb + Rb)                     one GEMM over every time step: [S·N, I] x [I, G]
 *   per step t:  g = xw[t] + h·Rᵀ             the recurrent GEMM accumulates into xw[t] in place
 *                i, o, f = σ(g_i, g_o, g_f);  c̃ = tanh(g_c)        (ONNX's gate order i, o, f, c)
 *                c = f ⊙ c + i ⊙ c̃;  h = o ⊙ tanh(c);  Y[t] = h
 *
 * Gate columns: W and R are packed with their rows permuted so that one NR-wide panel holds one gate of
 * NR hidden units, the four gates of a unit block in four consecutive panels (and zero rows padding the
 * last block). A thread that owns unit block u computes its four gate panels and then the cell of those
 * units: the step's only synchronisation is one barrier (every thread reads all of h at the next step),
 * and a thread's share of R stays in its own core's cache across the steps (static schedule).
 * σ and tanh are gemm.c's Cephes/Eigen rational forms (vectorised loops; ~1e-7 from libm's).
 * The default activations without clip, peepholes or input_forget run one fused cell loop (lstm_cell);
 * the rest the staged cell (lstm_cell_generic: each gate activated in place by recurrent_activate):
 *     i = f(g_i + P_i ⊙ c),  f = input_forget ? 1 − i : f(g_f + P_f ⊙ c),  c = f ⊙ c + i ⊙ g(g_c),
 *     o = f(g_o + P_o ⊙ c),  h = o ⊙ h(c)
 */

#pragma GCC push_options
#pragma GCC optimize("no-trapping-math")

/* The cell for units [j0, j0 + w) of every batch row: gates at g (row stride ldg; gate q at q*NR). */
static void lstm_cell(const kiln_recurrent_plan *p, long step, float *g, long ldg, long nr, long j0, long w,
                      float *c, const float *h_prev, float *h_next) {
    const long H = p->H;
    for (long n = 0; n < p->N; ++n) {
        if (step >= length_of(p, n)) { hold_row(p, step, n, h_prev, h_next, j0, w); continue; }
        const float *gi = g + n * ldg, *go = gi + nr, *gf = gi + 2 * nr, *gc = gi + 3 * nr;
        float *cn = c + n * H + j0, *hn = h_next + n * H + j0;
        for (long j = 0; j < w; ++j) {
            const float i = 1.0f / (1.0f + exp_poly(-gi[j]));
            const float o = 1.0f / (1.0f + exp_poly(-go[j]));
            const float f = 1.0f / (1.0f + exp_poly(-gf[j]));
            const float cell = f * cn[j] + i * tanh_rational(gc[j]);
            cn[j] = cell;
            hn[j] = o * tanh_rational(cell);
        }
        float *y = y_row(p, step, n);
        if (y != NULL) memcpy(y + j0, hn, (size_t)w * sizeof(float));
    }
}

/* The staged cell (any activations, clip, peepholes, input_forget); the gates are activated in place. */
static void lstm_cell_generic(const kiln_recurrent_plan *p, long step, float *g, long ldg, long nr, long j0, long w,
                              float *c, const float *h_prev, float *h_next) {
    const long H = p->H, units = H + nr - 1 - (H - 1) % nr;  /* blocks·NR */
    const float *pi = p->peepholes ? p->peepholes + j0 : NULL;
    const float *po = pi ? pi + units : NULL, *pf = pi ? pi + 2 * units : NULL;
    float hc[64];  /* h(c) of w <= NR units */
    for (long n = 0; n < p->N; ++n) {
        if (step >= length_of(p, n)) { hold_row(p, step, n, h_prev, h_next, j0, w); continue; }
        float *gi = g + n * ldg, *go = gi + nr, *gf = gi + 2 * nr, *gc = gi + 3 * nr;
        float *cn = c + n * H + j0, *hn = h_next + n * H + j0;
        if (pi) for (long j = 0; j < w; ++j) { gi[j] += pi[j] * cn[j]; gf[j] += pf[j] * cn[j]; }
        recurrent_activate(gi, w, &p->act[0], p->clip);
        if (p->input_forget) for (long j = 0; j < w; ++j) gf[j] = 1.0f - gi[j];
        else recurrent_activate(gf, w, &p->act[0], p->clip);
        recurrent_activate(gc, w, &p->act[1], p->clip);
        for (long j = 0; j < w; ++j) cn[j] = gf[j] * cn[j] + gi[j] * gc[j];
        if (po) for (long j = 0; j < w; ++j) go[j] += po[j] * cn[j];
        recurrent_activate(go, w, &p->act[0], p->clip);
        memcpy(hc, cn, (size_t)w * sizeof(float));
        recurrent_activate(hc, w, &p->act[2], 0.0f);  /* the cell state is never clipped */
        for (long j = 0; j < w; ++j) hn[j] = go[j] * hc[j];
        float *y = y_row(p, step, n);
        if (y != NULL) memcpy(y + j0, hn, (size_t)w * sizeof(float));
    }
}

#pragma GCC pop_options

int kiln_lstm(void *object, void *stream, int nargs, const void *args) {
    (void)stream; (void)nargs; (void)args;
    const kiln_recurrent_plan *p = (const kiln_recurrent_plan *)object;
    if (p->kernel < 0 || p->kernel >= KERNEL_COUNT || p->gates != 4 || KERNELS[p->kernel].nr > 64) return 2;
    const kernel_desc *kd = &KERNELS[p->kernel];
    const long S = p->S, N = p->N, H = p->H, nr = kd->nr;
    const long G = recurrent_gate_columns(p->kernel, H, 4), blocks = G / (4 * nr);
    if (S <= 0 || N <= 0) return 0;
    const recurrent_scratch s = scratch_of(p, G);
    const int threads = recurrent_threads(p);
    recurrent_input(p, &s, G, threads);
    load_states(p, &s);
    const int skip_first = p->h0 == NULL;  /* h = 0: the first step's recurrent GEMM adds nothing */
    const long row_t = p->batch_major ? 1 : N, ldg = (p->batch_major ? S : 1) * G;  /* xw rows of (t, n) */
    const int time_reversed = p->reverse && p->lengths == NULL;  /* else xw is in step order */
    float *h_final = S % 2 ? s.h_b : s.h_a;
    /* the batch in row chunks of MR (8 rows on AVX2: 6 + 2; measured a layer faster than 4 + 4 rows, and than
       gemm.c's narrow 8-row tile, in interleaved A/B runs of one process) */

    #pragma omp parallel num_threads(threads) if (threads > 1 && blocks > 1)
    {
        float *h_prev = s.h_a, *h_next = s.h_b;
        for (long step = 0; step < S; ++step) {
            float *g = s.xw + (time_reversed ? S - 1 - step : step) * row_t * G;  /* row n at g + n*ldg */
            #pragma omp for schedule(static)
            for (long u = 0; u < blocks; ++u) {
                if (!(skip_first && step == 0))
                    for (long q = 0; q < 4; ++q) {
                        const long panel = u * 4 + q;
                        recurrent_panel(kd, N, H, h_prev, p->packed_r + panel * H * nr, g + panel * nr, ldg, 1);
                    }
                const long j0 = u * nr, w = H - j0 < nr ? H - j0 : nr;
                if (p->generic) lstm_cell_generic(p, step, g + u * 4 * nr, ldg, nr, j0, w, s.c, h_prev, h_next);
                else lstm_cell(p, step, g + u * 4 * nr, ldg, nr, j0, w, s.c, h_prev, h_next);
            }  /* the barrier: all of h_next is written before any thread reads it */
            float *swap = h_prev;
            h_prev = h_next;
            h_next = swap;
        }
    }
    store_states(p, h_final, s.c);
    return 0;
}
