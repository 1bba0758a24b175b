/* kiln::Relayout's copy, a member of native segments (kiln/runtime/native.py): compiled once by
 * kiln/kernels/cpu/relayout.py through native_loop.build.
 *
 *   y[i] = x[base + sum_k digit_k(i) * stride[k]]     y contiguous, the digits of i in the mixed radix of size[]
 *
 * The plan's walk is over memory on both sides (a 4-D value of a segment is NHWC), dims merged where they
 * can be, at most MAX_DIMS. An innermost dim of stride 1 is a memcpy of its run (MobileViT's unfold and
 * fold, NHWC on the 4-D side: rows of channels); an innermost dim of a few elements over a contiguous next one
 * is a small transpose per row of those two (interleave); otherwise a strided gather. One thread: the copies this
 * carries are a few hundred kilobytes to a few megabytes (tens of microseconds), less than a parallel
 * region's barrier costs on a busy machine.
 *
 * Returns 0, or 2 (oneDNN's "invalid arguments") when an operand is not bound: the segment names the layer.
 */
#include <string.h>

#define MAX_DIMS 8
#define INTERLEAVE_MAX 8  /* innermost dims of up to this many elements over a contiguous one: interleave() */

typedef int (*get_handle_fn)(void *memory, void **handle);

typedef struct {
    get_handle_fn get_handle;
    void *x, *y;                  /* dnnl_memory_t */
    long base;                    /* where the walk starts in x (a Slice's first element), elements */
    long rank;                    /* dims of the walk, 1..MAX_DIMS */
    long size[MAX_DIMS];          /* outer to inner */
    long stride[MAX_DIMS];        /* in x, elements */
} relayout_plan;

/* The offset in x of the next element of the dims 0..last of the walk (an odometer: digit[k] its place along dim
 * k), from the current one's. */
static inline long next_offset(const relayout_plan *p, long *digit, long offset, long last) {
    for (long k = last; k >= 0; --k) {
        offset += p->stride[k];
        if (++digit[k] < p->size[k]) break;
        offset -= p->stride[k] * p->size[k];
        digit[k] = 0;
    }
    return offset;
}

/* The two innermost dims of the walk as one small transpose each: y[a·inner + i] = x[a + i·step] for a < run
 * (the next-inner dim, stride 1 in x) and i < inner. ShuffleNet's channel shuffle on NHWC memory is that, per pixel,
 * with inner 2: [2, C/2] -> [C/2, 2]; the strided gather of the general walk took 1.3 ns an element (a row of two
 * elements a turn of the odometer), ~10x torch's copy of the same shuffle on NCHW (bench/results/zoo-new-*). */
static void interleave(const relayout_plan *p, const float *x, float *y) {
    const long r = p->rank, inner = p->size[r - 1], step = p->stride[r - 1], run = p->size[r - 2];
    long blocks = 1;
    for (long k = 0; k < r - 2; ++k) blocks *= p->size[k];
    long digit[MAX_DIMS] = {0};
    long offset = p->base;  /* of the current block in x */
    for (long b = 0; b < blocks; ++b) {
        const float *src = x + offset;
        float *dst = y + b * run * inner;
        if (inner == 2) {
            const float *s0 = src, *s1 = src + step;
            for (long a = 0; a < run; ++a) {
                dst[2 * a] = s0[a];
                dst[2 * a + 1] = s1[a];
            }
        } else {
            for (long i = 0; i < inner; ++i) {
                const float *s = src + i * step;
                for (long a = 0; a < run; ++a) dst[a * inner + i] = s[a];
            }
        }
        offset = next_offset(p, digit, offset, r - 3);  /* the next block */
    }
}

int kiln_relayout(void *object, void *stream, int nargs, const void *args) {
    (void)stream; (void)nargs; (void)args;
    const relayout_plan *p = (const relayout_plan *)object;
    const float *x = NULL;
    float *y = NULL;
    if (p->get_handle(p->x, (void **)&x) != 0 || x == NULL) return 2;
    if (p->get_handle(p->y, (void **)&y) != 0 || y == NULL) return 2;
    const long r = p->rank, inner = p->size[r - 1], step = p->stride[r - 1];
    if (step != 1 && inner <= INTERLEAVE_MAX && r >= 2 && p->stride[r - 2] == 1 && p->size[r - 2] >= inner) {
        interleave(p, x, y);
        return 0;
    }
    long rows = 1;
    for (long k = 0; k < r - 1; ++k) rows *= p->size[k];
    long digit[MAX_DIMS] = {0};
    long offset = p->base;  /* of the current row in x */
    for (long row = 0; row < rows; ++row) {
        const float *src = x + offset;
        float *dst = y + row * inner;
        if (step == 1) {
            memcpy(dst, src, sizeof(float) * (size_t)inner);
        } else {
            for (long i = 0; i < inner; ++i) dst[i] = src[i * step];
        }
        offset = next_offset(p, digit, offset, r - 2);  /* the next row */
    }
    return 0;
}
