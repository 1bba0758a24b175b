/* i8gemm.c's register tile chosen by measurement: the u8·s8 k loop (vpmaddubsw, vpmaddwd by ones, vpaddd) of an
 * R-row x 8·NV-channel tile over every row and panel of an M x K x N GEMM, one thread, the thread's CPU time, best of 30.
 * WREG: the NV weight vectors loaded into registers once per k group (else memory operands of vpmaddubsw).
 *
 *     for t in "-DR=3 -DNV=4" "-DR=4 -DNV=3" "-DR=6 -DNV=2" "-DR=5 -DNV=2 -DWREG" "-DR=4 -DNV=2 -DWREG" "-DR=2 -DNV=6"; do
 *         cc -O3 -march=native $t bench/i8gemm_tiles.c -o /tmp/tiles && /tmp/tiles 128 384 1536; done
 *
 * Results: bench/results/int8-gemm-avx2-2026-12-07.md. */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#ifndef R
#define R 3
#endif
#ifndef NV
#define NV 4
#endif
#define NR (8 * NV)

static double now(void) { struct timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

static __attribute__((noinline)) void tile(const uint8_t *a, long astride, const int8_t *w, long k4, int32_t *out)
{
    __m256i acc[R][NV];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < NV; v++) acc[r][v] = _mm256_setzero_si256();
    const __m256i ones = _mm256_set1_epi16(1);
    for (long q = 0; q < k4; q++) {
#ifdef WREG
        __m256i wv[NV];
        for (int v = 0; v < NV; v++) wv[v] = _mm256_loadu_si256((const __m256i *)(w + q * NR * 4 + v * 32));
#endif
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const __m256i b = _mm256_set1_epi32(*(const int32_t *)(a + r * astride + q * 4));
#pragma GCC unroll 8
            for (int v = 0; v < NV; v++) {
#ifdef WREG
                const __m256i t = _mm256_maddubs_epi16(b, wv[v]);
#else
                const __m256i t = _mm256_maddubs_epi16(b, _mm256_loadu_si256((const __m256i *)(w + q * NR * 4 + v * 32)));
#endif
                acc[r][v] = _mm256_add_epi32(acc[r][v], _mm256_madd_epi16(t, ones));
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int v = 0; v < NV; v++) _mm256_storeu_si256((__m256i *)(out + (r * NV + v) * 8), acc[r][v]);
}

int main(int argc, char **argv)
{
    if (argc < 4) { fprintf(stderr, "usage: %s M K N\n", argv[0]); return 1; }
    const long M = atol(argv[1]), K = atol(argv[2]), N = atol(argv[3]), k4 = K / 4, panels = N / NR;
    uint8_t *a = aligned_alloc(64, M * K);
    int8_t *w = aligned_alloc(64, N * K);
    int32_t out[R * NR];
    for (long i = 0; i < M * K; i++) a[i] = (uint8_t)rand();
    for (long i = 0; i < N * K; i++) w[i] = (int8_t)(rand() % 128 - 64);
    double best = 1e9;
    for (int rep = 0; rep < 30; rep++) {
        const double t = now();
        for (long p = 0; p < panels; p++)
            for (long m = 0; m + R <= M; m += R) tile(a + m * K, K, w + p * NR * K, k4, out);
        const double dt = now() - t;
        best = dt < best ? dt : best;
    }
    printf("R %d x NR %d%s  %ldx%ldx%ld: %.3f ms  %.1f GMAC/s\n", R, NR,
#ifdef WREG
           " (weights in registers)",
#else
           "",
#endif
           M, K, N, best * 1e3, (double)(M / R * R) * K * (panels * NR) / best / 1e9);
    return 0;
}
