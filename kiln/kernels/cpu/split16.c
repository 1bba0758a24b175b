/* A float tensor quantized to 16 bits and stored as its two bytes (kiln/kernels/cpu/split16.py): what a W8A16
 * convolution (onednn_int8.W8A16Conv2d) reads, in one pass over the float input.
 *
 *     q  = saturate(round_half_even(x / scale) + zero, low, high)      ONNX QuantizeLinear to (u)int16
 *     u  = q - low                                                       0 .. 65535 (int16: q + 32768)
 *     hi = u >> 8,  lo = u & 255                                         uint8 each, x's element order
 *
 * x / scale is float32 division, as ONNX and kiln/ops/quantization.py compute it. Clamping before the rounding
 * is the same as after (the bounds are integers); |v| <= 65535 < 2^22, so (v + 1.5·2^23) - 1.5·2^23 rounds half
 * to even in the default rounding mode (no -ffast-math here: the compiler keeps both additions) and vectorises. */
#include <stdint.h>

void kiln_split16(const float *x, uint8_t *hi, uint8_t *lo, long n, float scale, long zero, long low, long high)
{
    const float magic = 12582912.0f; /* 1.5 * 2^23 */
    const float below = (float)(low - zero), above = (float)(high - zero);
    const float shift = (float)(zero - low);
#pragma omp parallel for schedule(static) if (n > 262144)
    for (long i = 0; i < n; i++) {
        float v = x[i] / scale;
        v = v < below ? below : v;
        v = v > above ? above : v;
        v = v != v ? 0.0f : v; /* NaN: ONNX leaves it undefined; 0 (the zero point) */
        v = (v + magic) - magic;
        uint32_t u = (uint32_t)(int32_t)(v + shift);
        hi[i] = (uint8_t)(u >> 8);
        lo[i] = (uint8_t)(u & 255u);
    }
}

/* The split as a call of a native segment's loop (kiln/kernels/cpu/segment_loop.c call_fn): the float input's
 * address read from its dnnl_memory_t at each run (a segment points its entry at each call's tensor). */
typedef int (*get_handle_fn)(void *memory, void **handle);

typedef struct {
    get_handle_fn get_handle;
    void *src;                /* dnnl_memory_t of the float32 input */
    uint8_t *hi, *lo;         /* the bytes, x's element order (NHWC) */
    long n;
    float scale;
    long zero, low, high;
} split16_plan;

int kiln_split16_call(void *object, void *stream, int nargs, const void *args)
{
    (void)stream; (void)nargs; (void)args;
    const split16_plan *p = (const split16_plan *)object;
    void *x = 0;
    if (p->get_handle(p->src, &x) || !x) return 2;
    kiln_split16((const float *)x, p->hi, p->lo, p->n, p->scale, p->zero, p->low, p->high);
    return 0;
}
