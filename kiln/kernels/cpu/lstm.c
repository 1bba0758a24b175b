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
 * last block). A work item is a unit block: its four gate panels and then the cell of those units,
 * claimed by whichever thread is free (recurrent.c's run_stages); a step's items all finish before the
 * next step's start (every item reads all of h).
 * σ and tanh: exp_poly.h's Cephes exp and gemm.c's Eigen rational tanh (vectorised loops; ~1e-7 from libm's).
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

static void lstm_item(const loop_ctx *c, long step, long u) {
    const kiln_recurrent_plan *p = c->p;
    const long nr = c->nr;
    float *g = step_gates(c, step) + u * 4 * nr;
    const float *h_prev = h_prev_of(c, step);
    if (!(c->skip_first && step == 0))
        for (long q = 0; q < 4; ++q)
            recurrent_panel(c->kd, p->N, p->H, h_prev, p->packed_r + (u * 4 + q) * p->H * nr, g + q * nr, c->ldg, 1);
    const long j0 = u * nr, w = unit_width(c, u);
    if (p->generic) lstm_cell_generic(p, step, g, c->ldg, nr, j0, w, c->s.c, h_prev, h_next_of(c, step));
    else lstm_cell(p, step, g, c->ldg, nr, j0, w, c->s.c, h_prev, h_next_of(c, step));
}

int kiln_lstm(void *object, void *stream, int nargs, const void *args) {
    (void)stream; (void)nargs; (void)args;
    kiln_recurrent_plan *p = (kiln_recurrent_plan *)object;
    if (p->kernel < 0 || p->kernel >= KERNEL_COUNT || p->gates != 4 || KERNELS[p->kernel].nr > 64) return 2;
    const long G = recurrent_gate_columns(p->kernel, p->H, 4);
    if (p->S <= 0 || p->N <= 0) return 0;
    const loop_ctx c = loop_of(p, G, 1);
    const int threads = recurrent_threads(p);
    recurrent_input(p, &c.s, G, threads);
    load_states(p, &c.s);
    p->stalled = run_stages(&c, p->S, G / (4 * c.nr), threads, lstm_item);
    store_states(p, h_prev_of(&c, p->S), c.s.c);
    return 0;
}
