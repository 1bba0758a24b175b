/* LD_PRELOAD shim for bench/openmp_regions.py (and tests/unit/test_openmp_regions.py): counts the OpenMP
 * parallel regions a process enters, how many threads each asked for, how long each took and how late its
 * second thread started (the wake-up of a sleeping or descheduled worker).
 *
 * Both of libgomp's entry points are wrapped: GOMP_parallel (GCC >= 4.9: kiln's own C kernels, torch) and
 * GOMP_parallel_start / GOMP_parallel_end (the older API oneDNN 3.2's wheel was built with). The real functions
 * are found with dlsym(RTLD_NEXT): the shim links no OpenMP runtime itself, so the process keeps torch's libgomp.
 * Not thread-safe: one thread is expected to enter regions at a time (a native segment's loop, a kiln call).
 *
 *   cc -O2 -shared -fPIC -o openmp_regions.so openmp_regions.c -ldl
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <time.h>

typedef void (*region_fn)(void *);
typedef void (*parallel_t)(region_fn, void *, unsigned, unsigned);
typedef void (*parallel_start_t)(region_fn, void *, unsigned);
typedef void (*parallel_end_t)(void);
typedef int (*thread_num_t)(void);

#define KEPT 1024  /* regions whose details are kept per reset */

long kiln_shim_regions;            /* regions since the last reset */
long kiln_shim_multi;              /* of which asked for more than one thread (0: OpenMP's count) */
int kiln_shim_threads[KEPT];       /* threads asked for (0: OpenMP's count) */
double kiln_shim_us[KEPT];         /* each region's time, fork to join */
double kiln_shim_late_us[KEPT];    /* when thread 1 started its share after the fork; -1: no thread 1 */

static parallel_t real_parallel;
static parallel_start_t real_start;
static parallel_end_t real_end;
static thread_num_t thread_num;

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec * 1e-3;
}

typedef struct {
    region_fn fn;
    void *data;
    double start, late;
} wrapped;

static void trampoline(void *p) {
    wrapped *w = (wrapped *)p;
    if (!thread_num) thread_num = (thread_num_t)dlsym(RTLD_DEFAULT, "omp_get_thread_num");
    if (thread_num && thread_num() == 1) w->late = now_us() - w->start;
    w->fn(w->data);
}

static void count(unsigned threads, double start, double late) {
    const long i = kiln_shim_regions++;
    if (threads != 1) kiln_shim_multi++;
    if (i < KEPT) {
        kiln_shim_threads[i] = (int)threads;
        kiln_shim_us[i] = now_us() - start;
        kiln_shim_late_us[i] = late;
    }
}

void GOMP_parallel(region_fn fn, void *data, unsigned threads, unsigned flags) {
    if (!real_parallel) real_parallel = (parallel_t)dlsym(RTLD_NEXT, "GOMP_parallel");
    wrapped w = {fn, data, now_us(), -1.0};
    real_parallel(trampoline, &w, threads, flags);
    count(threads, w.start, w.late);
}

static wrapped started;  /* the region between GOMP_parallel_start and GOMP_parallel_end */
static unsigned started_threads;

void GOMP_parallel_start(region_fn fn, void *data, unsigned threads) {
    if (!real_start) real_start = (parallel_start_t)dlsym(RTLD_NEXT, "GOMP_parallel_start");
    started.fn = fn, started.data = data, started.start = now_us(), started.late = -1.0;
    started_threads = threads;
    real_start(trampoline, &started, threads);  /* the caller runs fn itself as thread 0; workers run the trampoline */
}

void GOMP_parallel_end(void) {
    if (!real_end) real_end = (parallel_end_t)dlsym(RTLD_NEXT, "GOMP_parallel_end");
    real_end();
    count(started_threads, started.start, started.late);
}

void kiln_shim_reset(void) {
    kiln_shim_regions = kiln_shim_multi = 0;
}
