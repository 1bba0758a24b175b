/* kiln's thread pool for its own C kernels (kiln/kernels/cpu/pool.py says why): the calling thread and
 * up to threads - 1 helpers take the items of a loop from one counter; the caller waits only for items a
 * helper has started, never for a helper that has not woken up.
 *
 *   kiln_parallel_for(items, threads, fn, ctx)   fn(ctx, i) for every i < items, on the caller and the helpers
 *
 * OpenMP's parallel-for (libgomp) ends in a barrier that every thread of the team must reach: on a machine
 * whose cores other work keeps busy, a helper not yet scheduled when the loop's items run out still costs
 * the caller its wait for a time slice (measured on a loaded 2-core VM: ~1.3 ms a loop). Here a helper
 * that wakes late finds the counter past the end and goes back to sleep.
 *
 * The counter and the loop's generation share one 64-bit word (generation << 32 | next item): a helper
 * claims item i of generation g with a compare-and-swap that fails once the caller has moved on, so a late
 * helper never runs an item of the next loop with the last one's function. Idle helpers spin a little
 * (kiln_pool_configure), then sleep on a futex the caller wakes. One loop at a time: a caller that finds
 * the pool busy (a second thread, a kernel called from inside an item) runs its items itself.
 * Linux only (futex); elsewhere kiln_pool_available() is 0 and the kernels keep OpenMP.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdlib.h>

typedef void (*kiln_item_fn)(void *ctx, long item);

#ifdef __linux__
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#else
#define CPU_RELAX() ((void)0)
#endif

static struct {
    _Atomic uint64_t state;       /* generation << 32 | next item */
    _Atomic uint32_t generation;  /* the futex word idle helpers sleep on */
    _Atomic uint32_t done;        /* items finished in this generation: the futex word the caller sleeps on */
    _Atomic int sleepers, caller_sleeping;
    _Atomic(kiln_item_fn) fn;
    _Atomic(void *) ctx;
    _Atomic long items;
    _Atomic long spin_ns;         /* how long an idle thread spins before it sleeps */
    int helpers;
    pid_t pid;                    /* the process the helpers belong to (a forked child has none) */
    pthread_mutex_t busy;
} pool = {.spin_ns = 50000, .busy = PTHREAD_MUTEX_INITIALIZER};

static long futex(_Atomic uint32_t *word, int op, uint32_t value, long timeout_ns) {
    struct timespec ts = {timeout_ns / 1000000000L, timeout_ns % 1000000000L};
    return syscall(SYS_futex, (uint32_t *)word, op, value, timeout_ns > 0 ? &ts : NULL, NULL, 0);
}

static long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

/* Spin while *word == value, for the pool's spin time: 1 when it changed, 0 when the time ran out. */
static int spin_while(_Atomic uint32_t *word, uint32_t value) {
    const long limit = atomic_load_explicit(&pool.spin_ns, memory_order_relaxed);
    long start = -1;
    for (long i = 0;; ++i) {
        if (atomic_load_explicit(word, memory_order_acquire) != value) return 1;
        if ((i & 255) == 0) {
            long t = now_ns();
            if (start < 0) start = t;
            else if (t - start >= limit) return 0;
        }
        CPU_RELAX();
    }
}

/* Take and run items of generation g until there are none (or the caller has moved on). */
static void run_items(uint32_t g) {
    for (;;) {
        uint64_t s = atomic_load_explicit(&pool.state, memory_order_acquire);
        if ((uint32_t)(s >> 32) != g) return;
        const kiln_item_fn fn = atomic_load_explicit(&pool.fn, memory_order_relaxed);
        void *ctx = atomic_load_explicit(&pool.ctx, memory_order_relaxed);
        const long items = atomic_load_explicit(&pool.items, memory_order_relaxed);
        const long next = (long)(s & 0xffffffffu);
        if (next >= items) return;
        /* succeeds only while the state is still (g, next): the fields read above were generation g's */
        if (!atomic_compare_exchange_weak_explicit(&pool.state, &s, s + 1, memory_order_acq_rel,
                                                   memory_order_acquire))
            continue;
        fn(ctx, next);
        if (atomic_fetch_add_explicit(&pool.done, 1, memory_order_acq_rel) + 1 == (uint32_t)items
            && atomic_load(&pool.caller_sleeping))
            futex(&pool.done, FUTEX_WAKE_PRIVATE, 1, 0);
    }
}

static void *helper_main(void *arg) {
    uint32_t seen = (uint32_t)(uintptr_t)arg;
    for (;;) {
        uint32_t g = atomic_load_explicit(&pool.generation, memory_order_acquire);
        if (g == seen) {
            if (spin_while(&pool.generation, seen)) continue;
            atomic_fetch_add(&pool.sleepers, 1);
            if (atomic_load(&pool.generation) == seen)
                futex(&pool.generation, FUTEX_WAIT_PRIVATE, seen, 100000000L);  /* 0.1 s: a safety net */
            atomic_fetch_sub(&pool.sleepers, 1);
            continue;
        }
        seen = g;
        run_items(g);
    }
    return NULL;
}

int kiln_pool_available(void) { return 1; }

void kiln_pool_configure(long spin_ns) { atomic_store(&pool.spin_ns, spin_ns < 0 ? 0 : spin_ns); }

int kiln_pool_helpers(void) { return pool.helpers; }

int kiln_parallel_for(long items, int threads, kiln_item_fn fn, void *ctx) {
    if (items <= 0) return 0;
    if (threads <= 1 || items == 1 || items >= (1L << 31) || pthread_mutex_trylock(&pool.busy) != 0) {
        for (long i = 0; i < items; ++i) fn(ctx, i);
        return 0;
    }
    if (pool.pid != getpid()) {  /* first use, or a child forked from a process whose helpers it lacks */
        pool.pid = getpid();
        pool.helpers = 0;
        atomic_store(&pool.sleepers, 0);
    }
    const uint32_t g = atomic_load(&pool.generation) + 1;
    while (pool.helpers < threads - 1 && pool.helpers < 255) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&t, &attr, helper_main, (void *)(uintptr_t)(g - 1));
        pthread_attr_destroy(&attr);
        if (failed) break;
        pool.helpers++;
    }
    atomic_store_explicit(&pool.fn, fn, memory_order_relaxed);
    atomic_store_explicit(&pool.ctx, ctx, memory_order_relaxed);
    atomic_store_explicit(&pool.items, items, memory_order_relaxed);
    atomic_store(&pool.done, 0);
    atomic_store_explicit(&pool.state, (uint64_t)g << 32, memory_order_release);
    atomic_store(&pool.generation, g);
    if (atomic_load(&pool.sleepers) > 0) futex(&pool.generation, FUTEX_WAKE_PRIVATE, INT32_MAX, 0);
    run_items(g);
    /* every item is taken: wait for those a helper is still running */
    for (;;) {
        uint32_t d = atomic_load_explicit(&pool.done, memory_order_acquire);
        if (d == (uint32_t)items) break;
        if (spin_while(&pool.done, d)) continue;
        atomic_store(&pool.caller_sleeping, 1);
        if (atomic_load(&pool.done) == d) futex(&pool.done, FUTEX_WAIT_PRIVATE, d, 1000000L);
        atomic_store(&pool.caller_sleeping, 0);
    }
    pthread_mutex_unlock(&pool.busy);
    return 0;
}

#else  /* no futex: the kernels keep OpenMP */

int kiln_pool_available(void) { return 0; }

void kiln_pool_configure(long spin_ns) { (void)spin_ns; }

int kiln_pool_helpers(void) { return 0; }

int kiln_parallel_for(long items, int threads, kiln_item_fn fn, void *ctx) {
    (void)threads;
    for (long i = 0; i < items; ++i) fn(ctx, i);
    return 0;
}

#endif
