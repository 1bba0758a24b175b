/* Softmax over the last axis (ONNX Softmax, kiln::Softmax) in C, a member of native segments; compiled with
 * transformer.c (handle_of) and attention.c (exp_shifted: exp_le0's ~2 ulp exp on 16 / 8 lanes).
 *
 *   kiln_softmax  y[r] = exp(x[r] - max x[r]) / sum exp(x[r] - max x[r]) for each row r of [rows, n]
 *
 * Why: a small classifier ends in a Softmax (an MLP's [8, 4] scores); as a torch step it splits the network's
 * segment and its call is a dispatch, an allocation and the step loop's Python, several times the work. Rows
 * are shared among OpenMP's threads past `grain` rows (the LayerNorm's rule: PARALLEL_ELEMENTS elements).
 * torch's order: the sum of the shifted exps, then each times 1 / sum. A row holding a NaN or an infinity is
 * computed with libm's expf (exp_le0 takes NaN to 0, and inf - inf is NaN as torch has it).
 */

typedef struct {
    get_handle_fn get_handle;
    void *x, *y;          /* dnnl_memory_t: [rows, n] float32, row-major */
    long rows, n, grain;  /* grain: rows past which the rows are shared among the threads */
} softmax_plan;

static void softmax_row(const float *restrict x, float *restrict y, long n) {
    float max = -INFINITY;
    int finite = 1;
    for (long j = 0; j < n; ++j) {
        const float v = x[j];
        finite &= isfinite(v) != 0;
        max = v > max ? v : max;
    }
    float sum = 0.0f;
    if (finite) {
        memcpy(y, x, (size_t)n * sizeof(float));
        sum = exp_shifted(y, n, max);
    } else {
        for (long j = 0; j < n; ++j) { const float e = expf(x[j] - max); y[j] = e; sum += e; }
    }
    const float inv = 1.0f / sum;
    for (long j = 0; j < n; ++j) y[j] *= inv;
}

int kiln_softmax(void *object, void *stream, int nargs, const void *args) {
    (void)stream; (void)nargs; (void)args;
    const softmax_plan *p = (const softmax_plan *)object;
    const float *x = (const float *)handle_of(p->get_handle, p->x);
    float *y = (float *)handle_of(p->get_handle, p->y);
    if (!x || !y) return 2;
    const long rows = p->rows, n = p->n;
    if (n <= 0) return 0;
    #pragma omp parallel for schedule(static) if (rows > p->grain)
    for (long row = 0; row < rows; ++row) softmax_row(x + row * n, y + row * n, n);
    return 0;
}
