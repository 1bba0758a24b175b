/* Padding-free encoders' memory ops (kiln/ops/tokens.py) as native-segment members: compiled as one unit
 * with transformer.c, after it (kiln/kernels/cpu/transformer.py SOURCE): it uses that file's includes,
 * handle_of, parallel_items, max_threads and the plan conventions described there.
 *
 *   kiln_token_index   mask [B, S] -> index [T'], scatter [T'] (int64), cu_seqlens [B + 1] (int32): the real
 *                      tokens' flat positions in row-major order, T' rows (the token bucket's: dummies past
 *                      the real ones gather position 0 and scatter to B·S, a dropped row); T' = B·S is the
 *                      identity packing: index = scatter = 0..B·S-1, cu_seqlens 0, S, ..., B·S, B·S
 *   kiln_pack_rows     y[t] = x[index[t]] (rows of n floats; x [B·S, n], y [T', n])
 *   kiln_unpack_rows   out[scatter[t]] = y[t], zeros at padding (mask == 0; `zero_padding` 0 at the identity
 *                      packing: every row copied as it is), a scatter of B·S dropped
 *
 *   kiln_padding_positions  ids [rows, S] (int64 or int32) -> positions [rows, S] int64: cumsum(keep)·keep +
 *                      offset along each row, keep = ids != padding (RoBERTa's position ids, kiln/ops/tokens.py)
 *
 * The mask is int64, int32 or bool (mask_bytes 8, 4, 1; nonzero: a real token). Returns 0, or 2 for an
 * operand that is not bound, a mask with more real tokens than T' rows, or an index out of range.
 */

static inline int mask_at(const void *mask, int bytes, long i) {
    if (bytes == 8) return ((const int64_t *)mask)[i] != 0;
    if (bytes == 4) return ((const int32_t *)mask)[i] != 0;
    return ((const unsigned char *)mask)[i] != 0;
}

/* ---- TokenIndex ---------------------------------------------------------------------------------- */

typedef struct {
    get_handle_fn get_handle;
    void *mask, *index, *scatter, *cu;  /* dnnl_memory_t */
    long B, S, rows;                    /* rows: T' (rows == B·S: the identity packing) */
    int mask_bytes;
} token_index_plan;

int kiln_token_index(void *object, void *stream, int nargs, const void *args) {
    (void)stream; (void)nargs; (void)args;
    const token_index_plan *p = (const token_index_plan *)object;
    const void *mask = handle_of(p->get_handle, p->mask);
    int64_t *index = (int64_t *)handle_of(p->get_handle, p->index);
    int64_t *scatter = (int64_t *)handle_of(p->get_handle, p->scatter);
    int32_t *cu = (int32_t *)handle_of(p->get_handle, p->cu);
    const long positions = p->B * p->S;
    if (!mask || !cu || ((!index || !scatter) && p->rows > 0)) return 2;
    if (p->rows == positions) {  /* the identity packing: every position a row, in place */
        for (long i = 0; i < positions; ++i) index[i] = scatter[i] = i;
        for (long b = 0; b <= p->B; ++b) cu[b] = (int32_t)(b * p->S);
        cu[p->B + 1] = (int32_t)positions;
        return 0;
    }
    long t = 0;
    cu[0] = 0;
    for (long b = 0; b < p->B; ++b) {
        for (long s = 0; s < p->S; ++s) {
            const long i = b * p->S + s;
            if (!mask_at(mask, p->mask_bytes, i)) continue;
            if (t >= p->rows) return 2;  /* more real tokens than the bucket's rows */
            index[t] = scatter[t] = i;
            ++t;
        }
        cu[b + 1] = (int32_t)t;
    }
    for (; t < p->rows; ++t) {  /* dummies: gathered from 0, scattered to the dropped row B·S */
        index[t] = 0;
        scatter[t] = positions;
    }
    return 0;
}

/* ---- PackTokens / UnpackTokens ------------------------------------------------------------------- */

typedef struct {
    get_handle_fn get_handle;
    void *x, *index, *y;  /* dnnl_memory_t */
    long rows, positions, n;  /* T', B·S, floats a row */
    long grain;               /* rows per work item; rows <= grain: one thread */
} pack_plan;

typedef struct {
    get_handle_fn get_handle;
    void *y, *scatter, *mask, *out;  /* dnnl_memory_t */
    long rows, positions, n;
    long grain;
    int mask_bytes, zero_padding;
} unpack_plan;

typedef struct {
    const float *from;
    float *to;
    const int64_t *at;     /* pack: the source row of each packed row; unpack: the target position of each */
    const void *mask;      /* unpack: zero the padding positions first (NULL: pack) */
    const unpack_plan *u;
    long rows, positions, n, grain;
    int failed;
} rows_loop;

/* Item: `grain` rows. Pack: y[t] = x[index[t]]. Unpack: the item's padding positions zeroed, then
   out[scatter[t]] = y[t] for its packed rows. No two items write one row: the zeroed rows are padding, the
   copied ones real tokens (the identity packing without zeroing copies every row, zeroes none). */
static void pack_item(void *loop, long item) {
    rows_loop *l = (rows_loop *)loop;
    const long first = item * l->grain, last = first + l->grain < l->rows ? first + l->grain : l->rows;
    const size_t bytes = (size_t)l->n * sizeof(float);
    for (long t = first; t < last; ++t) {
        const int64_t i = l->at[t];
        if (i < 0 || i >= l->positions) {
            __atomic_store_n(&l->failed, 1, __ATOMIC_RELAXED);
            return;
        }
        memcpy(l->to + t * l->n, l->from + i * l->n, bytes);
    }
}

int kiln_pack_rows(void *object, void *stream, int nargs, const void *args) {
    (void)stream; (void)nargs; (void)args;
    const pack_plan *p = (const pack_plan *)object;
    const float *x = (const float *)handle_of(p->get_handle, p->x);
    const int64_t *index = (const int64_t *)handle_of(p->get_handle, p->index);
    float *y = (float *)handle_of(p->get_handle, p->y);
    if (p->rows == 0) return 0;
    if (!x || !index || !y) return 2;
    rows_loop l = {x, y, index, NULL, NULL, p->rows, p->positions, p->n, p->grain, 0};
    const long items = (p->rows + p->grain - 1) / p->grain;
    parallel_items(items, items > 1 ? max_threads() : 1, pack_item, &l);
    return l.failed ? 2 : 0;
}

static void unpack_item(void *loop, long item) {
    rows_loop *l = (rows_loop *)loop;
    const unpack_plan *p = l->u;
    const size_t bytes = (size_t)l->n * sizeof(float);
    long first = item * l->grain, last = first + l->grain < l->positions ? first + l->grain : l->positions;
    for (long i = first; i < last; ++i)  /* padding positions: zero (the identity packing without zeroing: none) */
        if (!mask_at(l->mask, p->mask_bytes, i) && (p->zero_padding || p->rows != p->positions))
            memset(l->to + i * l->n, 0, bytes);
    first = item * l->grain;
    last = first + l->grain < l->rows ? first + l->grain : l->rows;
    for (long t = first; t < last; ++t) {
        const int64_t i = l->at[t];
        if (i == l->positions) continue;  /* a dummy row: dropped */
        if (i < 0 || i > l->positions) {
            __atomic_store_n(&l->failed, 1, __ATOMIC_RELAXED);
            return;
        }
        if (p->zero_padding && !mask_at(l->mask, p->mask_bytes, i)) continue;  /* zeroed above */
        memcpy(l->to + i * l->n, l->from + t * l->n, bytes);
    }
}

int kiln_unpack_rows(void *object, void *stream, int nargs, const void *args) {
    (void)stream; (void)nargs; (void)args;
    const unpack_plan *p = (const unpack_plan *)object;
    const float *y = (const float *)handle_of(p->get_handle, p->y);
    const int64_t *scatter = (const int64_t *)handle_of(p->get_handle, p->scatter);
    const void *mask = handle_of(p->get_handle, p->mask);
    float *out = (float *)handle_of(p->get_handle, p->out);
    if (p->positions == 0) return 0;
    if (!mask || !out || ((!y || !scatter) && p->rows > 0)) return 2;
    rows_loop l = {y, out, scatter, mask, p, p->rows, p->positions, p->n, p->grain, 0};
    const long most = p->rows > p->positions ? p->rows : p->positions;
    const long items = (most + p->grain - 1) / p->grain;
    parallel_items(items, items > 1 ? max_threads() : 1, unpack_item, &l);
    return l.failed ? 2 : 0;
}

/* ---- PaddingPositions ---------------------------------------------------------------------------- */

typedef struct {
    get_handle_fn get_handle;
    void *ids, *out;      /* dnnl_memory_t */
    long rows, S;         /* ids [rows, S] */
    long padding, offset;
    int ids_bytes;        /* 8 or 4 */
} padding_positions_plan;

int kiln_padding_positions(void *object, void *stream, int nargs, const void *args) {
    (void)stream; (void)nargs; (void)args;
    const padding_positions_plan *p = (const padding_positions_plan *)object;
    const void *ids = handle_of(p->get_handle, p->ids);
    int64_t *out = (int64_t *)handle_of(p->get_handle, p->out);
    if ((!ids || !out) && p->rows * p->S > 0) return 2;
    for (long r = 0; r < p->rows; ++r) {
        int64_t count = 0;
        for (long s = 0; s < p->S; ++s) {
            const long i = r * p->S + s;
            const int64_t v = p->ids_bytes == 8 ? ((const int64_t *)ids)[i] : (int64_t)((const int32_t *)ids)[i];
            const int keep = v != (int64_t)p->padding;
            count += keep;
            out[i] = (keep ? count : 0) + (int64_t)p->offset;
        }
    }
    return 0;
}
