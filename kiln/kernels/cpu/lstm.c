/* One direction of an ONNX LSTM layer as one call: kiln's GEMM microkernels (gemm.c, compiled into the
 * same library: kiln/kernels/cpu/lstm.py prepends it) and the cell in one loop over time.
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
 */

typedef struct {
    const float *x;        /* time-major [S, N, I] rows, or batch-major [N, S, I] (batch_major) */
    float *y;              /* h of (t, n) at y[t*y_ts + n*y_ns] (H floats), or NULL */
    long y_ts, y_ns;
    const float *h0, *c0;  /* [N, H] rows at h0 + n*state_ns, or NULL: zeros */
    float *yh, *yc;        /* the final h and c, same strides, or NULL */
    long state_ns;
    const float *packed_w; /* kiln_gemm_pack_w of the permuted W [G, I], G = blocks·4·NR */
    const float *packed_r; /* ... of the permuted R [G, H] */
    const float *bias;     /* [G] permuted Wb + Rb */
    float *scratch;        /* kiln_lstm_scratch_floats() floats */
    long S, N, I, H;
    int kernel, threads, reverse, batch_major;
} kiln_lstm_plan;

static long lstm_gate_columns(int kernel, long h) {
    const long nr = KERNELS[kernel].nr;
    return (h + nr - 1) / nr * 4 * nr;
}

long kiln_lstm_gate_columns(int kernel, long h) { return lstm_gate_columns(kernel, h); }

long kiln_lstm_scratch_floats(int kernel, long s, long n, long h) {
    return s * n * lstm_gate_columns(kernel, h) + 3 * n * h + 16;
}

#pragma GCC push_options
#pragma GCC optimize("no-trapping-math")

/* The cell for units [j0, j0 + w) of every batch row: gates at g (row stride ldg; gate q at q*NR). */
static void lstm_cell(const float *g, long ldg, long nr, long N, long H, long j0, long w, float *c, float *h_next,
                      float *y, long y_ns) {
    for (long n = 0; n < N; ++n) {
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
        if (y != NULL) memcpy(y + n * y_ns + j0, hn, (size_t)w * sizeof(float));
    }
}

#pragma GCC pop_options

int kiln_lstm(void *object, void *stream, int nargs, const void *args) {
    (void)stream; (void)nargs; (void)args;
    const kiln_lstm_plan *p = (const kiln_lstm_plan *)object;
    if (p->kernel < 0 || p->kernel >= KERNEL_COUNT) return 2;
    const kernel_desc *kd = &KERNELS[p->kernel];
    const long S = p->S, N = p->N, H = p->H, nr = kd->nr, mr = kd->mr;
    const long G = lstm_gate_columns(p->kernel, H), blocks = G / (4 * nr);
    if (S <= 0 || N <= 0) return 0;
    float *xw = p->scratch, *h_a = xw + S * N * G, *h_b = h_a + N * H, *c = h_b + N * H;
    int threads = p->threads;
#ifdef _OPENMP
    if (threads <= 0) threads = omp_get_max_threads();
#endif
    if (threads < 1) threads = 1;

    /* xw = X·Wᵀ + b for every step at once; row (t, n) is t*N + n, or n*S + t batch-major */
    kiln_gemm_plan input = {0};
    input.src = (void *)p->x;
    input.dst = xw;
    input.packed_w = p->packed_w;
    input.bias = p->bias;
    input.M = S * N;
    input.K = p->I;
    input.N = G;
    input.kernel = p->kernel;
    input.threads = threads;
    input.small_m = 1L << 62;  /* x read in place, one fork/join */
    input.pack_m = 1L << 62;
    kiln_gemm(&input, NULL, 0, NULL);

    for (long n = 0; n < N; ++n) {
        if (p->h0) memcpy(h_a + n * H, p->h0 + n * p->state_ns, (size_t)H * sizeof(float));
        else memset(h_a + n * H, 0, (size_t)H * sizeof(float));
        if (p->c0) memcpy(c + n * H, p->c0 + n * p->state_ns, (size_t)H * sizeof(float));
        else memset(c + n * H, 0, (size_t)H * sizeof(float));
    }
    const int skip_first = p->h0 == NULL;  /* h = 0: the first step's recurrent GEMM adds nothing */
    const long row_t = p->batch_major ? 1 : N, row_n = p->batch_major ? S : 1;  /* xw rows of (t, n) */
    const long ldg = row_n * G;
    /* the batch in row chunks of MR (8 rows on AVX2: 6 + 2; measured a layer faster than 4 + 4 rows, and than
       gemm.c's narrow 8-row tile, in interleaved A/B runs of one process) */

    #pragma omp parallel num_threads(threads) if (threads > 1 && blocks > 1)
    {
        float *h_prev = h_a, *h_next = h_b;
        for (long step = 0; step < S; ++step) {
            const long t = p->reverse ? S - 1 - step : step;
            float *g = xw + t * row_t * G;  /* row n at g + n*ldg */
            float *y = p->y != NULL ? p->y + t * p->y_ts : NULL;
            #pragma omp for schedule(static)
            for (long u = 0; u < blocks; ++u) {
                if (!(skip_first && step == 0))
                    for (long q = 0; q < 4; ++q) {
                        const long panel = u * 4 + q;
                        const float *r = p->packed_r + panel * H * nr;
                        for (long r0 = 0; r0 < N; r0 += mr) {
                            const int m = (int)(N - r0 < mr ? N - r0 : mr);
                            kd->direct(m, H, h_prev + r0 * H, H, r, g + r0 * ldg + panel * nr, ldg, (int)nr, 1);
                        }
                    }
                const long j0 = u * nr, w = H - j0 < nr ? H - j0 : nr;
                lstm_cell(g + u * 4 * nr, ldg, nr, N, H, j0, w, c, h_next, y, p->y_ns);
            }  /* the barrier: all of h_next is written before any thread reads it */
            float *swap = h_prev;
            h_prev = h_next;
            h_next = swap;
        }
        #pragma omp single
        for (long n = 0; n < N; ++n) {
            if (p->yh) memcpy(p->yh + n * p->state_ns, h_prev + n * H, (size_t)H * sizeof(float));
            if (p->yc) memcpy(p->yc + n * p->state_ns, c + n * H, (size_t)H * sizeof(float));
        }
    }
    return 0;
}
