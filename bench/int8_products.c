/* The multiply-add throughput of one core for each way an AVX2 int8 GEMM can multiply (bench for i8gemm.c's choice):
 *
 *     cc -O2 -march=native bench/int8_products.c -o /tmp/int8_products && /tmp/int8_products
 *
 * 12 independent accumulators each (no latency chain), 10^8 iterations: instructions per second, multiply-adds per
 * second of this thread's CPU time (8-bit pairs: 32 per vpmaddubsw triplet; 16-bit: 16 per vpmaddwd; fp32: 8 per FMA), and the clock of a
 * dependent add chain. Results: bench/results/int8-gemm-avx2-2026-12-07.md. */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

static double now(void) { struct timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

int main(void)
{
    const long n = 100000000;
    __m256i a[12];
    const __m256i w0 = _mm256_set1_epi16(3), w1 = _mm256_set1_epi16(5), b = _mm256_set1_epi16(7);
    for (int i = 0; i < 12; i++) a[i] = _mm256_set1_epi32(i);
    double t = now();
    for (long i = 0; i < n; i++) {
#pragma GCC unroll 12
        for (int j = 0; j < 12; j++) a[j] = _mm256_add_epi32(a[j], _mm256_madd_epi16(b, (j & 1) ? w0 : w1));
        __asm__ volatile("" : "+x"(a[0]), "+x"(a[1]), "+x"(a[2]), "+x"(a[3]), "+x"(a[4]), "+x"(a[5]));
    }
    t = now() - t;
    int s = 0;
    for (int j = 0; j < 12; j++) s += _mm256_extract_epi32(a[j], 0);
    printf("int16: vpmaddwd + vpaddd            %.2f G/s  %.1f GMAC/s  (%d)\n", n * 12 / t / 1e9, n * 12 * 16 / t / 1e9, s);

    const __m256i ones = _mm256_set1_epi16(1), u = _mm256_set1_epi8(100), s0 = _mm256_set1_epi8(3), s1 = _mm256_set1_epi8(2);
    for (int i = 0; i < 12; i++) a[i] = _mm256_set1_epi32(i);
    t = now();
    for (long i = 0; i < n; i++) {
#pragma GCC unroll 12
        for (int j = 0; j < 12; j++)
            a[j] = _mm256_add_epi32(a[j], _mm256_madd_epi16(_mm256_maddubs_epi16(u, (j & 1) ? s0 : s1), ones));
        __asm__ volatile("" : "+x"(a[0]), "+x"(a[1]));
    }
    t = now() - t;
    s = 0;
    for (int j = 0; j < 12; j++) s += _mm256_extract_epi32(a[j], 0);
    printf("u8s8:  vpmaddubsw + vpmaddwd + vpaddd %.2f G/s  %.1f GMAC/s  (%d)\n", n * 12 / t / 1e9, n * 12 * 32 / t / 1e9, s);

    __m256 f[12];
    const __m256 x = _mm256_set1_ps(0.999f), y = _mm256_set1_ps(0.001f);
    for (int i = 0; i < 12; i++) f[i] = _mm256_set1_ps((float)i);
    t = now();
    for (long i = 0; i < n; i++) {
#pragma GCC unroll 12
        for (int j = 0; j < 12; j++) f[j] = _mm256_fmadd_ps(f[j], x, y);
    }
    t = now() - t;
    float fs = 0;
    for (int j = 0; j < 12; j++) fs += f[j][0];
    printf("fp32:  vfmadd231ps                  %.2f G/s  %.1f GMAC/s  (%g)\n", n * 12 / t / 1e9, n * 12 * 8 / t / 1e9, fs);

    long c = 1;
    t = now();
    for (long i = 0; i < n * 4; i++) __asm__ volatile("add $1, %0" : "+r"(c));
    t = now() - t;
    printf("clock: a dependent add chain        %.2f GHz\n", n * 4 / t / 1e9);
    return 0;
}
