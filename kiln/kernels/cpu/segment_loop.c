/* kiln's native CPU code, compiled once at first use by kiln/kernels/cpu/native_loop.py with the
 * machine's C compiler (-O3 -march=native -fopenmp) into kiln's cache.
 *
 * kiln_run_segment: the loop of a native segment (kiln/runtime/native.py), one call a run;
 * kiln_run_segment_timed: the same, each call timed (a segment's per-layer profile).
 * kiln_wino_input / kiln_wino_output: the transforms of a Winograd F(2x2, 3x3) convolution
 * (kiln/kernels/cpu/winograd.py), around a batched GEMM that oneDNN runs.
 * kiln_batch_chunks: a oneDNN primitive made for b images run over N images, b at a time
 * (kiln/kernels/cpu/onednn_chunks.py).
 * kiln_omp_*: the OpenMP team's threads, and parking them (kiln/kernels/cpu/omp_governor.py's check of
 * libgomp's spin count).
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stddef.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#if defined(__linux__)
#include <sys/syscall.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

typedef int (*call_fn)(void *object, void *stream, int nargs, const void *args);
typedef int (*set_handle_fn)(void *memory, void *handle);

static long long now_ns(clockid_t clock) {
    struct timespec t;
    clock_gettime(clock, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* The loop of both entry points below; elapsed_ns NULL: no clock read. */
static int run_segment(call_fn const *functions, set_handle_fn set_handle, void *stream, int nbind,
                       void *const *memories, void *const *addresses, int n, void *const *objects,
                       const int *nargs, void *const *args, int *failed, long long *elapsed_ns, clockid_t clock) {
    for (int i = 0; i < nbind; ++i) {
        int status = set_handle(memories[i], addresses[i]);
        if (status != 0) {
            *failed = -1 - i;
            return status;
        }
    }
    long long before = elapsed_ns ? now_ns(clock) : 0;
    for (int i = 0; i < n; ++i) {
        int status = functions[i](objects[i], stream, nargs[i], args[i]);
        if (status != 0) {
            *failed = i;
            return status;
        }
        if (elapsed_ns) {
            long long after = now_ns(clock);
            elapsed_ns[i] = after - before;
            before = after;
        }
    }
    return 0;
}

/* Points memories [0, nbind) at their addresses (the run's inputs and outputs), then makes calls
   [0, n) in order: functions[i](objects[i], stream, nargs[i], args[i]) -- dnnl_primitive_execute
   on a primitive, or one of the kernels below on its plan. Returns 0, or the first failing status
   with *failed = the call's index (a binding's: -1 - its index). */
int kiln_run_segment(call_fn const *functions, set_handle_fn set_handle, void *stream, int nbind,
                     void *const *memories, void *const *addresses, int n, void *const *objects,
                     const int *nargs, void *const *args, int *failed) {
    return run_segment(functions, set_handle, stream, nbind, memories, addresses, n, objects, nargs, args, failed,
                       NULL, CLOCK_MONOTONIC);
}

/* kiln_run_segment with each call's time by `clock` in elapsed_ns[i] (CLOCK_MONOTONIC: wall; CLOCK_THREAD_CPUTIME_ID:
   the calling thread's CPU time): the layers' times as the network runs them, each after the layer before it
   (kiln/runtime/native.py: Segment.timed). */
int kiln_run_segment_timed(call_fn const *functions, set_handle_fn set_handle, void *stream, int nbind,
                           void *const *memories, void *const *addresses, int n, void *const *objects,
                           const int *nargs, void *const *args, int *failed, long long *elapsed_ns, int clock) {
    return run_segment(functions, set_handle, stream, nbind, memories, addresses, n, objects, nargs, args, failed,
                       elapsed_ns, (clockid_t)clock);
}

/* ---- Winograd F(2x2, 3x3) ------------------------------------------------------------------------
   Input NHWC [N, H, W, C], padding 1, stride 1; tiles of 2x2 outputs, TH x TW per image, T = N*TH*TW.
   V[16][T][C] = B^T d B of each 4x4 input patch d; the GEMM makes M[16][T][K] = V[e] @ U[e];
   the output transform writes Y = A^T m A (+ bias, residual, activation) as NHWC [N, H, W, K]. */

typedef int (*get_handle_fn)(void *memory, void **handle);

typedef struct {
    get_handle_fn get_handle;
    void *src, *dst, *residual;   /* dnnl_memory_t: their data handles are read at each run */
    float *V, *M;
    const float *bias;            /* [K] or NULL */
    long N, H, W, C, K, TH, TW;
    int activation;               /* 0 none, 1 relu, 2 clip [lo, hi] */
    float lo, hi;
    int residual_after;           /* 1: act(y) + r; 0: act(y + r) */
} wino_plan;

#define CB 64

/* Tile t of the input (patch rows 2i-1.., columns 2j-1..) into slot `slot` of V planes of `stride` tiles. */
static void input_tile(const wino_plan *p, const float *x, float *V, long stride, long slot, long t) {
    const long C = p->C, H = p->H, W = p->W;
    long n = t / (p->TH * p->TW), r = t % (p->TH * p->TW);
    long i0 = 2 * (r / p->TW) - 1, j0 = 2 * (r % p->TW) - 1;
    for (long c0 = 0; c0 < C; c0 += CB) {
        long cn = C - c0 < CB ? C - c0 : CB;
        float d[4][4][CB], u[4][4][CB];
        for (int a = 0; a < 4; ++a)
            for (int b = 0; b < 4; ++b) {
                long i = i0 + a, j = j0 + b;
                if (i < 0 || i >= H || j < 0 || j >= W) {
                    for (long c = 0; c < cn; ++c) d[a][b][c] = 0.0f;
                } else {
                    const float *row = x + ((n * H + i) * W + j) * C + c0;
                    for (long c = 0; c < cn; ++c) d[a][b][c] = row[c];
                }
            }
        for (int b = 0; b < 4; ++b)
            for (long c = 0; c < cn; ++c) {
                float d0 = d[0][b][c], d1 = d[1][b][c], d2 = d[2][b][c], d3 = d[3][b][c];
                u[0][b][c] = d0 - d2; u[1][b][c] = d1 + d2; u[2][b][c] = d2 - d1; u[3][b][c] = d1 - d3;
            }
        for (int a = 0; a < 4; ++a) {
            float *v0 = V + ((long)(a * 4 + 0) * stride + slot) * C + c0;
            float *v1 = V + ((long)(a * 4 + 1) * stride + slot) * C + c0;
            float *v2 = V + ((long)(a * 4 + 2) * stride + slot) * C + c0;
            float *v3 = V + ((long)(a * 4 + 3) * stride + slot) * C + c0;
            for (long c = 0; c < cn; ++c) {
                float e0 = u[a][0][c], e1 = u[a][1][c], e2 = u[a][2][c], e3 = u[a][3][c];
                v0[c] = e0 - e2; v1[c] = e1 + e2; v2[c] = e2 - e1; v3[c] = e1 - e3;
            }
        }
    }
}

static inline float activate(const wino_plan *p, float v) {
    if (p->activation == 1) return v > 0.0f ? v : 0.0f;
    if (p->activation == 2) return v < p->lo ? p->lo : (v > p->hi ? p->hi : v);
    return v;
}

/* Slot `slot` of M (planes of `stride` tiles) into tile t of the output, with the epilogue. */
static void output_tile(const wino_plan *p, float *y, const float *res, const float *M, long stride, long slot,
                        long t) {
    const long K = p->K, H = p->H, W = p->W;
    long n = t / (p->TH * p->TW), r = t % (p->TH * p->TW);
    long i0 = 2 * (r / p->TW), j0 = 2 * (r % p->TW);
    for (long k0 = 0; k0 < K; k0 += CB) {
        long kn = K - k0 < CB ? K - k0 : CB;
        float s[2][4][CB];
        for (int b = 0; b < 4; ++b) {
            const float *m0 = M + ((long)(0 * 4 + b) * stride + slot) * K + k0;
            const float *m1 = M + ((long)(1 * 4 + b) * stride + slot) * K + k0;
            const float *m2 = M + ((long)(2 * 4 + b) * stride + slot) * K + k0;
            const float *m3 = M + ((long)(3 * 4 + b) * stride + slot) * K + k0;
            for (long k = 0; k < kn; ++k) {
                s[0][b][k] = m0[k] + m1[k] + m2[k];
                s[1][b][k] = m1[k] - m2[k] - m3[k];
            }
        }
        for (int a = 0; a < 2; ++a) {
            long i = i0 + a;
            if (i >= H) continue;
            for (int b = 0; b < 2; ++b) {
                long j = j0 + b;
                if (j >= W) continue;
                long at = ((n * H + i) * W + j) * K + k0;
                float *out = y + at;
                const float *rr = res ? res + at : NULL;
                for (long k = 0; k < kn; ++k) {
                    float v = b == 0 ? s[a][0][k] + s[a][1][k] + s[a][2][k]
                                     : s[a][1][k] - s[a][2][k] - s[a][3][k];
                    if (p->bias) v += p->bias[k0 + k];
                    if (rr && !p->residual_after) v += rr[k];
                    v = activate(p, v);
                    if (rr && p->residual_after) v += rr[k];
                    out[k] = v;
                }
            }
        }
    }
}

static int handles(const wino_plan *p, float **x, float **y, float **res) {
    *x = *y = *res = NULL;
    if (p->get_handle(p->src, (void **)x) != 0 || *x == NULL) return 2;
    if (p->get_handle(p->dst, (void **)y) != 0 || *y == NULL) return 2;
    if (p->residual != NULL && (p->get_handle(p->residual, (void **)res) != 0 || *res == NULL)) return 2;
    return 0;
}

/* Whole-layer transforms: V (and M) hold every tile; oneDNN's matmul runs between them on both threads. */
int kiln_wino_input(void *object, void *stream, int nargs, const void *args) {
    (void)stream; (void)nargs; (void)args;
    wino_plan *p = (wino_plan *)object;
    float *x, *y, *res;
    if (handles(p, &x, &y, &res)) return 2;
    const long T = p->N * p->TH * p->TW;
    #pragma omp parallel for schedule(static)
    for (long t = 0; t < T; ++t) input_tile(p, x, p->V, T, t, t);
    return 0;
}

int kiln_wino_output(void *object, void *stream, int nargs, const void *args) {
    (void)stream; (void)nargs; (void)args;
    wino_plan *p = (wino_plan *)object;
    float *x, *y, *res;
    if (handles(p, &x, &y, &res)) return 2;
    const long T = p->N * p->TH * p->TW;
    #pragma omp parallel for schedule(static)
    for (long t = 0; t < T; ++t) output_tile(p, y, res, p->M, T, t, t);
    return 0;
}

/* ---- a primitive over a batch, in chunks ----------------------------------------------------------
   A layer that computes each image on its own (a convolution, a pooling, a reorder) made for b images runs over
   N = count * b + count1 * b1 images: `count` runs of `primitive` with each role's memory pointed `strides[r]`
   bytes further each run, then `count1` runs of `primitive1` (made for b1 images, on memory objects of its own)
   past them. The roles' base addresses are read from `memories` at each call (a segment points its entries and
   exits there per run) and put back after. */

#define CHUNK_ROLES 4

typedef struct {
    call_fn execute;
    set_handle_fn set_handle;
    get_handle_fn get_handle;
    void *primitive;
    int nargs;
    const void *args;
    long count;
    void *primitive1;
    int nargs1;
    const void *args1;
    long count1;
    int nroles;
    void *memories[CHUNK_ROLES];   /* `primitive`'s memory objects of each role */
    void *memories1[CHUNK_ROLES];  /* `primitive1`'s */
    long strides[CHUNK_ROLES];     /* bytes of one chunk of b images, per role */
    long strides1[CHUNK_ROLES];    /* of b1 images */
} chunk_plan;

int kiln_batch_chunks(void *object, void *stream, int nargs, const void *args) {
    (void)nargs; (void)args;
    const chunk_plan *p = (const chunk_plan *)object;
    char *base[CHUNK_ROLES];
    for (int r = 0; r < p->nroles; ++r)
        if (p->get_handle(p->memories[r], (void **)&base[r]) != 0) return 2;
    int status = 0;
    for (long i = 0; i < p->count && status == 0; ++i) {
        for (int r = 0; r < p->nroles && status == 0; ++r)
            status = p->set_handle(p->memories[r], base[r] + i * p->strides[r]);
        if (status == 0) status = p->execute(p->primitive, stream, p->nargs, p->args);
    }
    for (long j = 0; j < p->count1 && status == 0; ++j) {
        for (int r = 0; r < p->nroles && status == 0; ++r)
            status = p->set_handle(p->memories1[r], base[r] + p->count * p->strides[r] + j * p->strides1[r]);
        if (status == 0) status = p->execute(p->primitive1, stream, p->nargs1, p->args1);
    }
    for (int r = 0; r < p->nroles; ++r) {
        int restored = p->set_handle(p->memories[r], base[r]);
        if (status == 0) status = restored;
    }
    return status;
}

/* ---- the OpenMP team: who its threads are, and parking them ---------------------------------------
   libgomp's idle threads spin `gomp_spin_count_var` polls (read at the start of each wait) before they sleep
   on a futex. kiln/kernels/cpu/omp_governor.py finds that counter, checks it by what the team's threads do
   (kiln_omp_team's regions, their voluntary context switches) and sets it per engine call. */

#define OMP_MAX_TEAM 256

/* 1 where this library was built with OpenMP (the governor needs a parallel region of its own). */
int kiln_omp_available(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* The calling thread's OpenMP team size (omp_get_max_threads: what oneDNN and torch run on); 1 without OpenMP. */
int kiln_omp_max_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

/* Run one empty parallel region of the calling thread's team size, the thread ids (gettid) of its threads in
   tids[0, n) (the caller's first); returns n. */
int kiln_omp_team(int *tids, int most) {
    int n = 1;
    tids[0] = 0;
#if defined(_OPENMP) && defined(__linux__)
    int want = omp_get_max_threads();
    if (want > most) want = most;
    #pragma omp parallel num_threads(want)
    {
        int i = omp_get_thread_num();
        if (i < want) tids[i] = (int)syscall(SYS_gettid);
        #pragma omp single
        n = omp_get_num_threads();
    }
#else
    (void)most;
#endif
    return n;
}

/* The scheduler state of this process's thread `tid` (/proc/self/task/<tid>/stat: 'R', 'S', ...); 0 unknown. */
static char task_state(int tid) {
#if defined(__linux__)
    char path[64], buf[512];
    int k = 0;
    /* "/proc/self/task/" + tid + "/stat" without stdio */
    const char *head = "/proc/self/task/";
    while (*head) path[k++] = *head++;
    char digits[16];
    int d = 0;
    for (unsigned v = (unsigned)tid; d == 0 || v; v /= 10) digits[d++] = (char)('0' + v % 10);
    while (d) path[k++] = digits[--d];
    const char *tail = "/stat";
    while (*tail) path[k++] = *tail++;
    path[k] = 0;
    int fd = open(path, O_RDONLY);
    if (fd < 0) return 0;
    ssize_t got = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (got <= 0) return 0;
    buf[got] = 0;
    char *close_paren = strrchr(buf, ')');  /* the state follows the command name, which may hold spaces */
    return close_paren && close_paren[1] == ' ' ? close_paren[2] : 0;
#else
    (void)tid;
    return 0;
#endif
}

static long omp_now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

/* Park the calling thread's OpenMP team: set *spin (libgomp's spin count) to `idle`, run an empty region so
   that every thread starts its next wait under it, wait (at most wait_ns) until each of them is asleep, then
   set *spin to `after` (the count other code of the process runs under; a thread already asleep keeps
   sleeping until the next region wakes it), or leave it at `idle` where one was not seen asleep in time. tids[0, *n) are the team's thread ids from the last park (*n 0: none
   yet): where every one of them is asleep already (the call ran no OpenMP region since), no region is run (it
   would wake them, ~20-50 us on a VM); else they are the region's, written back. Returns how many of the team's
   threads (the caller's excluded) were seen asleep; -1 without OpenMP. */
int kiln_omp_park(unsigned long long *spin, unsigned long long idle, unsigned long long after, long wait_ns,
                  int *tids, int *n) {
#if defined(_OPENMP) && defined(__linux__)
    if (*n > 1 && *n == omp_get_max_threads()) {
        int asleep = 0;
        for (int i = 1; i < *n; ++i) asleep += task_state(tids[i]) == 'S';
        if (asleep == *n - 1) {
            __atomic_store_n(spin, after, __ATOMIC_SEQ_CST);
            return asleep;
        }
    }
    __atomic_store_n(spin, idle, __ATOMIC_SEQ_CST);
    *n = kiln_omp_team(tids, OMP_MAX_TEAM);
    int asleep = 0;
    const long start = omp_now_ns();
    for (int i = 1; i < *n; ++i) {
        for (;;) {
            char state = task_state(tids[i]);
            if (state != 'R') {  /* S (the futex), or unknown: not spinning */
                asleep += state == 'S';
                break;
            }
            if (omp_now_ns() - start > wait_ns) break;
        }
    }
    /* a thread not seen asleep (on a loaded machine it may wait for a core before it starts its wait) would
       take `after` if it were stored now: the count stays `idle` until the caller's next call sets it */
    if (asleep == *n - 1) __atomic_store_n(spin, after, __ATOMIC_SEQ_CST);
    return asleep;
#else
    (void)spin; (void)idle; (void)after; (void)wait_ns; (void)tids; (void)n;
    return -1;
#endif
}
