/* kiln::Elementwise (a chain of float32 elementwise ops, kiln/passes/fusion/elementwise.py) and Concat in C,
 * members of native segments; compiled with transformer.c (its handle_of, MAXD).
 *
 *   kiln_elementwise  y = program(in_0, .., in_{k-1}), every input broadcast to y's shape (strides 0 where it
 *                     broadcasts); constants are baked into the plan, activations read through their memory
 *   kiln_concat       y = Concat(in_0, .., in_{k-1}) along one axis, each input viewed as [outer, width_k]
 *
 * Why: through torch each line of an Elementwise program is a dispatch, an allocation and (past torch's
 * grain) a parallel region, and a Concat another copy step; a recommender's cross layers (x0 * (W x + b) + x)
 * spent as long in them as in their GEMMs on a shared 2-core VM, and they split the native segment.
 *
 * Evaluation runs over chunks of at most CHUNK elements of y's last axis (after kiln/kernels/cpu/elementwise.py
 * merged the dims every operand walks contiguously): each input's chunk is read in place (stride 1), splatted
 * (stride 0) or gathered, then each line of the program is one loop over the chunk that the compiler
 * vectorises. Past `grain` elements (an 8-bit chain: kiln_quantized_split, transformer.c) the chunks are shared
 * among the threads (parallel_items: gemm.c's pool; a plan with `team` set: OpenMP's team, team_items); a Concat's
 * rows likewise past its plan's grain. A chain of one 8-bit activation and per-column constants with an 8-bit output
 * is looked up instead (elementwise.py lookup_table; table_columns: 64-column blocks, gathers).
 */

#define EW_INPUTS 8   /* EW_INPUTS in elementwise.py */
#define EW_LINES 32   /* EW_LINES in elementwise.py */
#define EW_CHUNK 256

/* Ops (elementwise.py: OPS). */
enum { EW_ADD, EW_SUB, EW_MUL, EW_DIV, EW_POW, EW_MAX, EW_MIN, EW_NEG, EW_ABS, EW_EXP, EW_LOG, EW_SQRT,
       EW_RECIPROCAL, EW_RELU, EW_SIGMOID, EW_TANH, EW_ERF, EW_SIN, EW_COS, EW_FLOOR, EW_CEIL, EW_GELU,
       EW_GELU_TANH };

typedef struct {
    get_handle_fn get_handle;
    void *in_[EW_INPUTS];               /* activations: dnnl_memory_t (NULL for a constant or an unused slot) */
    const float *constant[EW_INPUTS];   /* constants: their data, row-major */
    void *out;
    long dims[MAXD];                    /* y's, 1s in front */
    long strides[EW_INPUTS][MAXD];      /* elements, 0 where the input broadcasts */
    int inputs, lines;
    int code[EW_LINES][3];              /* op, operand a, operand b: k < EW_INPUTS input k, else line k - EW_INPUTS */
    long grain;                         /* elements past which the chunks are shared among the threads (a float
                                           program's; one reading or writing 8 bits: kiln_quantized_split) */
    /* An explicitly quantized graph's chain (kiln/passes/fusion/elementwise_dequantize.py, int8 rules): input k of
       in_type 1 (uint8) or 2 (int8) is read as DequantizeLinear's (x - z)·s; out_type 1/2: y stored as
       QuantizeLinear's saturate(round(r / s) + z) (quantize_row, attention.c) of the last line r. */
    int in_type[EW_INPUTS], out_type;   /* 0 float32, 1 uint8, 2 int8; an input of in_type 3 no line reads (a
                                           Dequantize's or Quantize's scale or zero point: in `quant`) */
    const float *quant;                 /* [EW_INPUTS][2] inputs' {s, z}, then the output's {s, z, qmin, qmax} */
    /* A program of one 8-bit activation (input table_input, y's shape) and constants that vary along y's last axis
       at most, stored 8-bit: y[o][j] = table[j·256 + byte x[o][j]], the program evaluated by this kernel on every
       byte value of each column once, at build (kiln/kernels/cpu/elementwise.py lookup_table). NULL: evaluated. */
    const unsigned char *table;         /* [dims[MAXD-1]][256] + 3 bytes (a 4-byte gather reads past the last) */
    int table_input;
    int team;                           /* 1: the chunks shared on OpenMP's team (team_items), 0: on gemm.c's pool */
} elementwise_plan;

/* σ(x) = 1 / (1 + e^-x), e^-x by exp_poly.h's exp_poly (attention.c includes it) on 16 or 8 lanes (KILN_VEXP: the
   scalar form's operations in its order), the clamps NaN-preserving (a NaN x stays NaN; below -87 σ is ~6e-39, e^-x
   clamped, where libm's underflows to a denormal or 0: gemm.c's σ epilogue alike). Why: libm's expf is a scalar
   call per element, and GCC vectorises no loop over exp_poly's scalar form: a YOLO head's sigmoid over [8112, 85]
   took ~10x torch's (bench/results/zoo-new-zen4-2026-12-07c.md). */
#ifdef KILN_AVX2
#define EW_CLAMP8(x, lo, hi) _mm256_min_ps(_mm256_set1_ps(hi), _mm256_max_ps(_mm256_set1_ps(lo), x))
KILN_VEXP(ew_exp8, static inline, __m256, __v8si, EW_CLAMP8)
#ifdef __AVX512F__
#define EW_CLAMP16(x, lo, hi) _mm512_min_ps(_mm512_set1_ps(hi), _mm512_max_ps(_mm512_set1_ps(lo), x))
KILN_VEXP(ew_exp16, static inline, __m512, __v16si, EW_CLAMP16)
#endif
#endif

static void ew_sigmoid(const float *restrict a, float *restrict r, long n) {
    long j = 0;
#ifdef KILN_AVX2
#ifdef __AVX512F__
    for (; j + 16 <= n; j += 16) {
        const __m512 x = _mm512_loadu_ps(a + j);
        _mm512_storeu_ps(r + j, _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_set1_ps(1.0f) + ew_exp16(-x)));
    }
#endif
    for (; j + 8 <= n; j += 8) {
        const __m256 x = _mm256_loadu_ps(a + j);
        _mm256_storeu_ps(r + j, _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_set1_ps(1.0f) + ew_exp8(-x)));
    }
#endif
    for (; j < n; ++j) r[j] = 1.0f / (1.0f + exp_poly(-a[j]));
}

/* r[j] = Gelu(a[j]) = a·Φ(a), erf form, for j < n. AVX2: through erfc(|a|/√2) = t·exp(-z² + P(t)),
   t = 1/(1 + z/2) (Numerical Recipes' erfcc: relative error < 1.2e-7 for every z >= 0; the exp is attention.c's
   exp_le0), so Gelu = a - a·erfc/2 for a >= 0 and a·erfc/2 below. Why: libm's erff is a scalar call per
   element, and a BERT FFN's bias + Gelu over [128, 3072] took longer in C than in torch (~2 ms a layer). */
static void ew_gelu(const float *restrict a, float *restrict r, long n) {
    long j = 0;
#ifdef KILN_AVX2
    static const float c[10] = {-1.26551223f, 1.00002368f, 0.37409196f, 0.09678418f, -0.18628806f,
                                0.27886807f, -1.13520398f, 1.48851587f, -0.82215223f, 0.17087277f};
#ifdef __AVX512F__
    {  /* the same steps on 16 lanes (each lane's result is the 8-lane loop's): QDQ BERT-tiny's FFN chains
          (uint8 -> bias -> Gelu -> uint8) spent most of their time here */
        const __m512 half = _mm512_set1_ps(0.5f), one = _mm512_set1_ps(1.0f), sign = _mm512_set1_ps(-0.0f);
        for (; j + 16 <= n; j += 16) {
            const __m512 x = _mm512_loadu_ps(a + j);
            const __m512 z = _mm512_mul_ps(_mm512_andnot_ps(sign, x), _mm512_set1_ps(0.70710678118654752f));
            const __m512 t = _mm512_div_ps(one, _mm512_fmadd_ps(half, z, one));
            __m512 p = _mm512_set1_ps(c[9]);
            for (int k = 8; k >= 0; --k) p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(c[k]));
            const __m512 erfc = _mm512_mul_ps(t, exp_le0_16(_mm512_fnmadd_ps(z, z, p)));
            const __m512 h = _mm512_mul_ps(_mm512_mul_ps(half, x), erfc);  /* x·erfc(|x|/√2)/2 */
            const __mmask16 positive = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ);
            __m512 g = _mm512_mask_blend_ps(positive, h, _mm512_sub_ps(x, h));
            g = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), g, x);  /* NaN stays NaN */
            _mm512_storeu_ps(r + j, g);
        }
    }
#endif
    const __m256 half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    for (; j + 8 <= n; j += 8) {
        const __m256 x = _mm256_loadu_ps(a + j);
        const __m256 z = _mm256_mul_ps(_mm256_andnot_ps(sign, x), _mm256_set1_ps(0.70710678118654752f));
        const __m256 t = _mm256_div_ps(one, _mm256_fmadd_ps(half, z, one));
        __m256 p = _mm256_set1_ps(c[9]);
        for (int k = 8; k >= 0; --k) p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(c[k]));
        const __m256 erfc = _mm256_mul_ps(t, exp_le0(_mm256_fnmadd_ps(z, z, p)));
        const __m256 h = _mm256_mul_ps(_mm256_mul_ps(half, x), erfc);  /* x·erfc(|x|/√2)/2 */
        const __m256 positive = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ);
        __m256 g = _mm256_blendv_ps(h, _mm256_sub_ps(x, h), positive);
        g = _mm256_blendv_ps(g, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));  /* NaN stays NaN */
        _mm256_storeu_ps(r + j, g);
    }
#endif
    for (; j < n; ++j) r[j] = 0.5f * a[j] * (1.0f + erff(a[j] * 0.70710678118654752f));
}

/* r = op(a, b) over n elements; b unused by unary ops. */
static void ew_line(int op, const float *restrict a, const float *restrict b, float *restrict r, long n) {
    switch (op) {
        case EW_ADD: for (long j = 0; j < n; ++j) r[j] = a[j] + b[j]; break;
        case EW_SUB: for (long j = 0; j < n; ++j) r[j] = a[j] - b[j]; break;
        case EW_MUL: for (long j = 0; j < n; ++j) r[j] = a[j] * b[j]; break;
        case EW_DIV: for (long j = 0; j < n; ++j) r[j] = a[j] / b[j]; break;
        case EW_POW: for (long j = 0; j < n; ++j) r[j] = powf(a[j], b[j]); break;
        /* torch.maximum / minimum: NaN if either is NaN */
        case EW_MAX: for (long j = 0; j < n; ++j) r[j] = (a[j] != a[j] || b[j] != b[j]) ? a[j] + b[j] : (a[j] > b[j] ? a[j] : b[j]); break;
        case EW_MIN: for (long j = 0; j < n; ++j) r[j] = (a[j] != a[j] || b[j] != b[j]) ? a[j] + b[j] : (a[j] < b[j] ? a[j] : b[j]); break;
        case EW_NEG: for (long j = 0; j < n; ++j) r[j] = -a[j]; break;
        case EW_ABS: for (long j = 0; j < n; ++j) r[j] = fabsf(a[j]); break;
        case EW_EXP: for (long j = 0; j < n; ++j) r[j] = expf(a[j]); break;
        case EW_LOG: for (long j = 0; j < n; ++j) r[j] = logf(a[j]); break;
        case EW_SQRT: for (long j = 0; j < n; ++j) r[j] = sqrtf(a[j]); break;
        case EW_RECIPROCAL: for (long j = 0; j < n; ++j) r[j] = 1.0f / a[j]; break;
        case EW_RELU: for (long j = 0; j < n; ++j) r[j] = a[j] > 0.0f ? a[j] : (a[j] != a[j] ? a[j] : 0.0f); break;
        case EW_SIGMOID: ew_sigmoid(a, r, n); break;
        case EW_TANH: for (long j = 0; j < n; ++j) r[j] = tanhf(a[j]); break;
        case EW_ERF: for (long j = 0; j < n; ++j) r[j] = erff(a[j]); break;
        case EW_SIN: for (long j = 0; j < n; ++j) r[j] = sinf(a[j]); break;
        case EW_COS: for (long j = 0; j < n; ++j) r[j] = cosf(a[j]); break;
        case EW_FLOOR: for (long j = 0; j < n; ++j) r[j] = floorf(a[j]); break;
        case EW_CEIL: for (long j = 0; j < n; ++j) r[j] = ceilf(a[j]); break;
        case EW_GELU: ew_gelu(a, r, n); break;
        case EW_GELU_TANH:
            for (long j = 0; j < n; ++j)
                r[j] = 0.5f * a[j] * (1.0f + tanhf(0.79788456080286536f * (a[j] + 0.044715f * a[j] * a[j] * a[j])));
            break;
        default: break;
    }
}

/* r[j] = (x[j·s] - z)·sc for j < n, x uint8 (is_signed 0) or int8: DequantizeLinear as it reads the chunk */
static void ew_dequantize(const void *x, long s, int is_signed, float sc, float z, float *restrict r, long n) {
    long j = 0;
    if (s == 1) {
#ifdef __AVX512F__
        const __m512 vs = _mm512_set1_ps(sc), vz = _mm512_set1_ps(z);
        for (; j + 16 <= n; j += 16) {
            const __m128i b = _mm_loadu_si128((const __m128i *)((const char *)x + j));
            const __m512i w = is_signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
            _mm512_storeu_ps(r + j, _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(w), vz), vs));
        }
#endif
#ifdef KILN_AVX2
        {   /* the scalar loop's steps on 8 lanes: exact int -> float, then (x - z)·s rounded as the scalar's two */
            const __m256 vs = _mm256_set1_ps(sc), vz = _mm256_set1_ps(z);
            for (; j + 8 <= n; j += 8) {
                const __m128i b = _mm_loadl_epi64((const __m128i *)((const char *)x + j));
                const __m256i w = is_signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
                _mm256_storeu_ps(r + j, _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(w), vz), vs));
            }
        }
#endif
        if (is_signed) for (; j < n; ++j) r[j] = ((float)((const signed char *)x)[j] - z) * sc;
        else for (; j < n; ++j) r[j] = ((float)((const unsigned char *)x)[j] - z) * sc;
        return;
    }
    if (is_signed) for (; j < n; ++j) r[j] = ((float)((const signed char *)x)[j * s] - z) * sc;
    else for (; j < n; ++j) r[j] = ((float)((const unsigned char *)x)[j * s] - z) * sc;
}

/* y[j] = saturate(round_half_even(r[j] / q[0]) + q[1]) into [q[2], q[3]] as 8 bits, j < n: QuantizeLinear as it
   stores the chunk (quantize_row's rounding, attention.c; 16 lanes where the CPU has them) */
static void ew_quantize(const float *restrict r, const float *q, int is_signed, void *y, long n) {
    long j = 0;
#ifdef __AVX512F__
    const __m512 s = _mm512_set1_ps(q[0]), z = _mm512_set1_ps(q[1]), lo = _mm512_set1_ps(q[2]),
                 hi = _mm512_set1_ps(q[3]);
    for (; j + 16 <= n; j += 16) {
        __m512 v = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(r + j), s),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v = _mm512_min_ps(_mm512_max_ps(_mm512_add_ps(v, z), lo), hi);  /* NaN: max gives lo, as quantize_row */
        const __m512i w = _mm512_cvtps_epi32(v);
        _mm_storeu_si128((__m128i *)((char *)y + j), is_signed ? _mm512_cvtsepi32_epi8(w) : _mm512_cvtusepi32_epi8(w));
    }
#elif defined(KILN_AVX2)
    {   /* quantize_row's AVX2 steps (x·1 is exact: its c = 1 left out), then the integral floats packed to 8 bits
           (exact: they are in [qmin, qmax]) in place of its float row and a scalar conversion; 32 a step */
        const __m256 s = _mm256_set1_ps(q[0]), z = _mm256_set1_ps(q[1]), lo = _mm256_set1_ps(q[2]),
                     hi = _mm256_set1_ps(q[3]);
        const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
#define EW_QUANTIZE8(k) _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(_mm256_add_ps(_mm256_round_ps( \
            _mm256_div_ps(_mm256_loadu_ps(r + j + (k)), s), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), z), lo), hi))
        for (; j + 32 <= n; j += 32) {
            const __m256i a = _mm256_packs_epi32(EW_QUANTIZE8(0), EW_QUANTIZE8(8));    /* int16, lanes interleaved */
            const __m256i b = _mm256_packs_epi32(EW_QUANTIZE8(16), EW_QUANTIZE8(24));
            const __m256i bytes = is_signed ? _mm256_packs_epi16(a, b) : _mm256_packus_epi16(a, b);
            _mm256_storeu_si256((__m256i *)((char *)y + j), _mm256_permutevar8x32_epi32(bytes, order));
        }
#undef EW_QUANTIZE8
    }
#endif
    if (j < n) {
        float t[EW_CHUNK];
        quantize_row(r + j, t, n - j, 1.0f, q, 0);  /* integral values in [qmin, qmax] */
        if (is_signed) for (long i = 0; i < n - j; ++i) ((signed char *)y)[j + i] = (signed char)(int)t[i];
        else for (long i = 0; i < n - j; ++i) ((unsigned char *)y)[j + i] = (unsigned char)(int)t[i];
    }
}

/* One chunk: y[0:n] for the output row starting at flat element `base`, input k's first element at off[k]. */
static void ew_chunk(const elementwise_plan *p, const void *const *in, const long *off, void *y, long n) {
    float buffers[EW_INPUTS][EW_CHUNK] __attribute__((aligned(64)));
    float temps[EW_LINES][EW_CHUNK] __attribute__((aligned(64)));
    const float *operand[EW_INPUTS + EW_LINES];
    for (int k = 0; k < p->inputs; ++k) {
        const long s = p->strides[k][MAXD - 1];
        if (p->in_type[k] == 3) continue;
        if (p->in_type[k] != 0) {  /* 8-bit: dequantized into the chunk's buffer */
            ew_dequantize((const char *)in[k] + off[k], s, p->in_type[k] == 2, p->quant[2 * k], p->quant[2 * k + 1],
                          buffers[k], n);
            operand[k] = buffers[k];
            continue;
        }
        const float *x = (const float *)in[k] + off[k];
        if (s == 1) {
            operand[k] = x;
        } else {
            for (long j = 0; j < n; ++j) buffers[k][j] = x[j * s];
            operand[k] = buffers[k];
        }
    }
    for (int l = 0; l < p->lines; ++l) {
        float *r = l == p->lines - 1 && p->out_type == 0 ? (float *)y : temps[l];
        ew_line(p->code[l][0], operand[p->code[l][1]], operand[p->code[l][2]], r, n);
        operand[EW_INPUTS + l] = r;
    }
    if (p->out_type != 0) ew_quantize(temps[p->lines - 1], p->quant + 2 * EW_INPUTS, p->out_type == 2, y, n);
}

typedef struct {
    const elementwise_plan *p;
    const void *const *in;
    char *y;                            /* bytes: float32 or 8-bit elements (out_type) */
    long n, per_row, chunks;
} elementwise_loop;

/* Chunks [16 item, 16 item + 16) of y, row by row. */
static void elementwise_item(void *loop, long item) {
    const elementwise_loop *l = (const elementwise_loop *)loop;
    const elementwise_plan *p = l->p;
    for (long it = item * 16; it < (item + 1) * 16 && it < l->chunks; ++it) {
        const long o = it / l->per_row, j0 = (it % l->per_row) * EW_CHUNK;
        long rem = o, off[EW_INPUTS] = {0};
        for (int d = MAXD - 2; d >= 0 && rem > 0; --d) {  /* (the leading dims of 1 and index 0 add nothing) */
            const long i = rem % p->dims[d];
            rem /= p->dims[d];
            if (i != 0)
                for (int k = 0; k < p->inputs; ++k) off[k] += i * p->strides[k][d];
        }
        for (int k = 0; k < p->inputs; ++k) off[k] += j0 * p->strides[k][MAXD - 1];
        const long bytes = p->out_type != 0 ? 1 : (long)sizeof(float);
        ew_chunk(p, l->in, off, l->y + (o * l->n + j0) * bytes, l->n - j0 < EW_CHUNK ? l->n - j0 : EW_CHUNK);
    }
}

typedef struct {
    const elementwise_plan *p;
    const unsigned char *x;
    unsigned char *y;
    long n, rows;
} table_loop;

/* How a table is read (kiln/kernels/cpu/elementwise.py set_table_lookup; a benchmark's other side, a test's):
   1, the default: columns in blocks of TABLE_BLOCK (each block's 256-byte columns stay in L1 while the item's 16
   rows pass over them) and 8 or 16 bytes a gather (AVX2 vpgatherdd on ymm, AVX-512 on zmm); 0: the kernel before,
   row by row (a byte at a time on AVX2, AVX-512's gather). The same bytes either way: every y[o][j] is
   table[j][x[o][j]], whatever the order. */
long kiln_table_lookup = 1;
#define TABLE_BLOCK 64   /* columns: 16 KB of table, half an L1 data cache */

/* y[j] = table[j·256 + x[j]] for j in [j0, j1): x and y a row's, the table padded by 3 bytes (a 4-byte gather
   reads past the last column's byte 255). */
static void table_columns(const unsigned char *restrict table, const unsigned char *restrict x,
                          unsigned char *restrict y, long j0, long j1) {
    long j = j0;
#ifdef __AVX512F__
    {
        const __m512i column_step = _mm512_set1_epi32(16 * 256);
        __m512i base = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(256));
        base = _mm512_add_epi32(base, _mm512_set1_epi32((int)(j0 * 256)));
        for (; j + 16 <= j1; j += 16) {
            const __m512i at = _mm512_add_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(x + j))), base);
            const __m512i g = _mm512_i32gather_epi32(at, (const void *)table, 1);  /* the byte at `at`, and 3 more */
            _mm_storeu_si128((__m128i *)(y + j), _mm512_cvtepi32_epi8(g));        /* (the low byte of each) */
            base = _mm512_add_epi32(base, column_step);
        }
    }
#elif defined(KILN_AVX2)
    {   /* 32 columns: 4 gathers of 8 dwords from each column's 256 bytes, the low byte of each dword kept (vpshufb
           takes dword k's byte 0 to byte k of its 128-bit lane), then the 4 x 8 bytes put back in column order */
        const __m256i lane = _mm256_setr_epi32(0, 256, 512, 768, 1024, 1280, 1536, 1792);
        const __m256i low_bytes = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                                   0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
        const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
#define TABLE_GATHER8(c) _mm256_shuffle_epi8(_mm256_i32gather_epi32((const int *)(table + (c) * 256), \
            _mm256_add_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(x + (c)))), lane), 1), low_bytes)
        for (; j + 32 <= j1; j += 32) {
            const __m256i g0 = TABLE_GATHER8(j), g1 = TABLE_GATHER8(j + 8), g2 = TABLE_GATHER8(j + 16),
                          g3 = TABLE_GATHER8(j + 24);
            /* g_k: columns j+8k..+3 in bytes 0-3 of lane 0, j+8k+4..+7 in bytes 0-3 of lane 1 */
            const __m256i g01 = _mm256_unpacklo_epi32(g0, g1), g23 = _mm256_unpacklo_epi32(g2, g3);
            const __m256i all = _mm256_permutevar8x32_epi32(_mm256_unpacklo_epi64(g01, g23), order);
            _mm256_storeu_si256((__m256i *)(y + j), all);
        }
        for (; j + 8 <= j1; j += 8) {
            const __m256i g = _mm256_permutevar8x32_epi32(TABLE_GATHER8(j), _mm256_setr_epi32(0, 4, 1, 1, 1, 1, 1, 1));
            _mm_storel_epi64((__m128i *)(y + j), _mm256_castsi256_si128(g));
        }
#undef TABLE_GATHER8
    }
#endif
    for (; j < j1; ++j) y[j] = table[j * 256 + x[j]];
}

/* Rows [16 item, 16 item + 16) of y through the table. */
static void table_item(void *loop, long item) {
    const table_loop *l = (const table_loop *)loop;
    const unsigned char *table = l->p->table;
    const long first = item * 16, last = (item + 1) * 16 < l->rows ? (item + 1) * 16 : l->rows;
    if (kiln_table_lookup == 0) {  /* the kernel before: row by row, AVX-512's gather or a byte at a time */
        for (long o = first; o < last; ++o) {
            const unsigned char *x = l->x + o * l->n;
            unsigned char *y = l->y + o * l->n;
#ifdef __AVX512F__
            table_columns(table, x, y, 0, l->n);
#else
            for (long j = 0; j < l->n; ++j) y[j] = table[j * 256 + x[j]];
#endif
        }
        return;
    }
    for (long j0 = 0; j0 < l->n; j0 += TABLE_BLOCK) {
        const long j1 = j0 + TABLE_BLOCK < l->n ? j0 + TABLE_BLOCK : l->n;
        for (long o = first; o < last; ++o) table_columns(table, l->x + o * l->n, l->y + o * l->n, j0, j1);
    }
}

int kiln_elementwise(void *object, void *stream, int nargs, const void *args) {
    (void)stream; (void)nargs; (void)args;
    const elementwise_plan *p = (const elementwise_plan *)object;
    const void *in[EW_INPUTS] = {NULL};
    for (int k = 0; k < p->inputs; ++k) {
        in[k] = p->constant[k] != NULL ? (const void *)p->constant[k] : handle_of(p->get_handle, p->in_[k]);
        if (in[k] == NULL) return 2;
    }
    char *y = (char *)handle_of(p->get_handle, p->out);
    if (y == NULL || p->lines < 1) return 2;
    const long n = p->dims[MAXD - 1];
    long outer = 1;
    for (int d = 0; d < MAXD - 1; ++d) outer *= p->dims[d];
    if (n <= 0 || outer <= 0) return 0;
    int eight_bit = p->out_type != 0;  /* a quantized graph's chain: kiln_quantized_split's grain (transformer.c) */
    for (int k = 0; k < p->inputs; ++k) eight_bit |= p->in_type[k] == 1 || p->in_type[k] == 2;
    const int threads = outer * n > (eight_bit ? kiln_quantized_split : p->grain) ? max_threads() : 1;
    if (p->table != NULL) {
        table_loop t = {p, (const unsigned char *)in[p->table_input], (unsigned char *)y, n, outer};
        parallel_items((outer + 15) / 16, threads, table_item, &t);
        return 0;
    }
    const long per_row = (n + EW_CHUNK - 1) / EW_CHUNK;
    /* items of 16 chunks: a few hundred of them at most past the grain, each ~4k elements */
    elementwise_loop l = {p, in, y, n, per_row, outer * per_row};
    const long items = (l.chunks + 15) / 16;
    (p->team ? team_items : parallel_items)(items, threads, elementwise_item, &l);
    return 0;
}

/* ---- Concat -------------------------------------------------------------------------------------- */

#define CONCAT_INPUTS 64  /* CONCAT_INPUTS in elementwise.py: a DenseNet block's last Concat joins 25 */
#define CONCAT_ITEM 16384 /* elements a work item copies at least (whole rows of y): 64 KB, a few microseconds */

typedef struct {
    get_handle_fn get_handle;
    void *in_[CONCAT_INPUTS], *out;
    long widths[CONCAT_INPUTS];   /* elements of input k per outer index (its dims from the axis on) */
    long outer;               /* the product of the dims before the axis */
    int inputs;
    long grain;               /* y's elements past which its rows are shared among the threads */
    int team;                 /* 1: shared on OpenMP's team (team_items), 0: on gemm.c's pool */
} concat_plan;

typedef struct {
    const concat_plan *p;
    const float *const *in;
    float *y;
    long total, rows;         /* y's elements per outer index; outer indices per work item */
} concat_loop;

/* Rows [rows·item, rows·(item + 1)) of y: each input's part of each row copied to its place. */
static void concat_item(void *loop, long item) {
    const concat_loop *l = (const concat_loop *)loop;
    const concat_plan *p = l->p;
    const long first = item * l->rows, last = first + l->rows < p->outer ? first + l->rows : p->outer;
    for (long o = first; o < last; ++o) {
        float *row = l->y + o * l->total;
        for (int k = 0; k < p->inputs; ++k) {
            memcpy(row, l->in[k] + o * p->widths[k], (size_t)p->widths[k] * sizeof(float));
            row += p->widths[k];
        }
    }
}

/* Past the plan's grain the rows are shared among the threads (on OpenMP's team where the plan says `team`: a Concat
   between a segment's oneDNN layers; else gemm.c's pool, where a worker that starts late finds them taken). Why: a
   DenseNet block's Concat on NHWC memory (3136 rows of 64-256 channels at 56x56) is a stream of 0.4-3 MB, and on one
   thread it was a serial step of the segment's parallel form (bench/results/zoo-new-2threads-zen4-2026-12-07c.md). */
int kiln_concat(void *object, void *stream, int nargs, const void *args) {
    (void)stream; (void)nargs; (void)args;
    const concat_plan *p = (const concat_plan *)object;
    const float *in[CONCAT_INPUTS] = {NULL};
    long total = 0;
    for (int k = 0; k < p->inputs; ++k) {
        if (p->widths[k] > 0 && (in[k] = (const float *)handle_of(p->get_handle, p->in_[k])) == NULL) return 2;
        total += p->widths[k];
    }
    float *y = (float *)handle_of(p->get_handle, p->out);
    if (y == NULL) return 2;
    if (p->outer <= 0 || total <= 0) return 0;
    const long rows = total >= CONCAT_ITEM ? 1 : CONCAT_ITEM / total;
    concat_loop l = {p, in, y, total, rows};
    (p->team ? team_items : parallel_items)((p->outer + rows - 1) / rows,
                                            p->outer * total > p->grain ? max_threads() : 1, concat_item, &l);
    return 0;
}

/* ---- kiln::EmbeddingConcat: a recommender's per-field lookups and their Concat ------------------------------
 * y[n] = part_0[n] | part_1[n] | ..., part_k a table looked up by ids[n, field_k] (negative ids from its end) or
 * an activation [N, width_k] copied as it is (kiln/passes/fusion/embedding_concat.py). Why: its default is one
 * torch index_select per field and a cat, in Python, outside the native segment that follows (DCN: 26 lookups of
 * 256 rows, 0.82 ms of one core against ~0.2 for onnxruntime's Gathers and Concat); here it is one loop over the
 * rows, on one thread (a run moves ~1 MB: a parallel region would cost more than it saves). An id out of range
 * returns 2 (ONNX: an error), the segment naming the layer. */
#define EC_PARTS 64   /* EC_PARTS in elementwise.py */

typedef struct {
    get_handle_fn get_handle;
    void *ids;                      /* [N, F] int64 (or int32) */
    void *in_[EC_PARTS];            /* activations [N, width]: NULL for a table */
    const float *table[EC_PARTS];   /* tables [vocab, width]: NULL for an activation */
    void *out;                      /* [N, sum of widths] */
    long width[EC_PARTS], vocab[EC_PARTS], field[EC_PARTS];
    long rows, fields;              /* N, F */
    int parts, ids_int32;
} embedding_concat_plan;

int kiln_embedding_concat(void *object, void *stream, int nargs, const void *args) {
    (void)stream; (void)nargs; (void)args;
    const embedding_concat_plan *p = (const embedding_concat_plan *)object;
    const void *ids = handle_of(p->get_handle, p->ids);
    float *y = (float *)handle_of(p->get_handle, p->out);
    if (ids == NULL || y == NULL) return 2;
    const float *in[EC_PARTS] = {NULL};
    long total = 0;
    for (int k = 0; k < p->parts; ++k) {
        if (p->table[k] == NULL && (in[k] = (const float *)handle_of(p->get_handle, p->in_[k])) == NULL) return 2;
        total += p->width[k];
    }
    for (long n = 0; n < p->rows; ++n) {
        float *row = y + n * total;
        for (int k = 0; k < p->parts; ++k) {
            const long w = p->width[k];
            const float *from;
            if (p->table[k] != NULL) {
                const long at = n * p->fields + p->field[k];
                int64_t id = p->ids_int32 ? (int64_t)((const int32_t *)ids)[at] : ((const int64_t *)ids)[at];
                if (id < 0) id += p->vocab[k];
                if (id < 0 || id >= p->vocab[k]) return 2;
                from = p->table[k] + id * w;
            } else {
                from = in[k] + n * w;
            }
            memcpy(row, from, (size_t)w * sizeof(float));
            row += w;
        }
    }
    return 0;
}

/* ---- QuantizeLinear / DequantizeLinear per tensor ----------------------------------------------------- */

/* Why: BERT's QDQ model (onnxruntime's quantize_static) quantizes or dequantizes every GEMM's input and output:
 * ~170 such steps a run. As oneDNN reorders with scale attributes they took ~0.1 ms each at [128, 768]; this
 * loop reads and writes each element once (the rounding in quantize_row, attention.c). Any layout: an
 * elementwise map of a contiguous buffer. */
typedef struct {
    get_handle_fn get_handle;
    void *src, *dst;
    long n;           /* elements */
    float q[4];       /* scale, zero point, qmin, qmax */
    int quantize;     /* 1: y = saturate(round(x / scale) + zero) (8-bit); 0: y = (x - zero)·scale (float32) */
    int is_signed;    /* the 8-bit side is int8, else uint8 */
    long grain;       /* elements past which the chunks are shared among the threads */
} quantize_plan;

#define Q_ITEM 4096   /* elements a work item converts */

typedef struct {
    const quantize_plan *p;
    const void *x;
    void *y;
} quantize_loop;

static void quantize_item(void *loop, long item) {
    const quantize_loop *l = (const quantize_loop *)loop;
    const quantize_plan *p = l->p;
    const long first = item * Q_ITEM, last = first + Q_ITEM < p->n ? first + Q_ITEM : p->n;
    if (p->quantize) {
        float r[EW_CHUNK] __attribute__((aligned(64)));
        for (long c = first; c < last; c += EW_CHUNK) {
            const long m = last - c < EW_CHUNK ? last - c : EW_CHUNK;
            quantize_row((const float *)l->x + c, r, m, 1.0f, p->q, 0);  /* integral values in [qmin, qmax] */
            if (p->is_signed) {
                signed char *y = (signed char *)l->y + c;
                for (long j = 0; j < m; ++j) y[j] = (signed char)(int)r[j];
            } else {
                unsigned char *y = (unsigned char *)l->y + c;
                for (long j = 0; j < m; ++j) y[j] = (unsigned char)(int)r[j];
            }
        }
    } else {
        const float s = p->q[0], z = p->q[1];
        float *y = (float *)l->y + first;
        if (p->is_signed) {
            const signed char *x = (const signed char *)l->x + first;
            for (long j = 0; j < last - first; ++j) y[j] = ((float)x[j] - z) * s;
        } else {
            const unsigned char *x = (const unsigned char *)l->x + first;
            for (long j = 0; j < last - first; ++j) y[j] = ((float)x[j] - z) * s;
        }
    }
}

int kiln_quantize(void *object, void *stream, int nargs, const void *args) {
    (void)stream; (void)nargs; (void)args;
    const quantize_plan *p = (const quantize_plan *)object;
    quantize_loop l = {p, handle_of(p->get_handle, p->src), handle_of(p->get_handle, p->dst)};
    if (l.x == NULL || l.y == NULL) return 2;
    const long items = (p->n + Q_ITEM - 1) / Q_ITEM;
    parallel_items(items, p->n > p->grain ? max_threads() : 1, quantize_item, &l);
    return 0;
}
