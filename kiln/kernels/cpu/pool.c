/* kiln_parallel_for: the parallel loops of kiln's own C kernels on a pool of their own, where a worker that
 * has not started an item by the time the caller has run out of items is simply not waited for.
 *
 * Why: an OpenMP parallel loop ends at a barrier every thread of the team must reach. On a machine shared
 * with other work (2 vCPUs at load 4-6), a worker descheduled when the loop begins is waited for a whole
 * scheduler slice although the caller did every item itself: kiln's attention at MobileViT's shapes took
 * 0.1 ms or 12 ms, nothing between (bench/results/zoo-cpu-2026-12-02.md). onnxruntime's pool revokes the
 * tasks no worker has started when the caller is done; this does the same: items are claimed from one
 * counter (generation << 32 | next item), the caller claims too, and it waits only for the items claimed.
 *
 * Workers poll for a new loop a short while (SPIN_NS), then sleep on a futex; while loops keep coming back to back,
 * longer (kiln_pool_spin_window: twice the longest of the last gaps between loops, up to kiln_pool_follow_ns), so that
 * the next call's first loop finds them awake. One loop at a time: a caller that finds the pool busy (another
 * thread's loop, or a loop inside an item) runs its items itself. After a fork the child has no workers: they are
 * started again. Compiled into each library that uses it.
 *
 * Where the other CPUs are busy, the futex wake puts a worker on its caller's own CPU, where the two take turns: a
 * worker that finds itself there leaves the loop to the caller and sleeps at once (kiln_pool_step_aside), and the next
 * loops leave it asleep for a short back-off (kiln_pool_backoff_max_ns), bench/results/pool-2threads-zen3-2026-12-07.md.
 */
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <time.h>
#include <unistd.h>
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#endif

typedef void (*kiln_item_fn)(void *ctx, long item);

#define POOL_MAX_WORKERS 63
#define POOL_SPIN_NS 30000L  /* a worker's poll for the next loop before it sleeps (libgomp's short spin: ~10k polls) */
#define POOL_GAPS 4          /* the gaps between loops a spin window follows: an engine call's loops and the call's gap */

static struct {
    pthread_mutex_t lock;       /* held by the caller of the running loop */
    unsigned long word;         /* generation << 32 | the next unclaimed item */
    unsigned int generation;    /* the futex the workers sleep on */
    int sleepers;
    kiln_item_fn fn;
    void *ctx;
    long count;
    int limit;                  /* workers [0, limit) take part in the current loop */
    long done;                  /* items of the current loop finished */
    int started;                /* workers running */
    pid_t pid;                  /* the process they run in */
    unsigned int last;          /* the last generation used (under lock) */
    long spin_ns;               /* how long a worker polls after the current loop before it sleeps */
    long ended_ns;              /* when the last loop ended, or 0 (under lock) */
    long gaps[POOL_GAPS];       /* ns between the last loops' end and the next one's start (under lock) */
    long loops;                 /* loops run on the workers (under lock) */
    long parks;                 /* the times a worker went to sleep on the futex */
    long worker_items;          /* items the workers ran (kiln_pool_stats) */
    long wait_ns;               /* how long callers waited, their own items done, for the workers' (kiln_pool_stats) */
    long shared_items;          /* worker items run on the CPU the loop's caller started on (kiln_pool_stats) */
    long steps_aside;           /* loops a worker woke for on the caller's CPU and left to it (kiln_pool_step_aside) */
    int caller_cpu;             /* the CPU the current (or last) loop's caller started on, or -1 */
    long aside_seen, items_seen; /* steps_aside and worker_items at the last loop's start (under lock) */
    long backoff_ns;            /* how long loops leave the sleeping workers asleep after a wake for nothing (under lock) */
    long quiet_until_ns;        /* no wake before this (under lock) */
} kiln_pool = {PTHREAD_MUTEX_INITIALIZER, 0, 0, 0, NULL, NULL, 0, 0, 0, 0, 0, 0, POOL_SPIN_NS, 0, {0}, 0, 0, 0, 0, 0, 0,
               -1, 0, 0, 0, 0};

/* Where a worker left a loop to its caller (kiln_pool_step_aside) and ran no item since, the next loops do not wake
   the sleeping workers for a while: 100 us, doubled at each such wake up to this (0: wake at every loop). Why: a wake
   that puts the worker on the caller's CPU costs the caller two switches (~8 us a loop on the Zen 3 at load 5-7:
   bench/results/pool-2threads-zen3-2026-12-07.md) for nothing; a worker that runs an item resets it, and a worker
   still polling takes part in every loop as before. The bound: a worker freed to run on another CPU later waits at most
   this long to be woken again (one wasted wake a bound: ~1% of a loaded core at 1 ms). */
long kiln_pool_backoff_max_ns = 1000000L;
#define POOL_BACKOFF_MIN_NS 100000L

/* 1 (the default): a worker that finds itself on the CPU its loop's caller started on leaves the loop's items to the
   caller and sleeps on the futex at once, and a worker polling between loops on the last caller's CPU stops polling.
   Why: on a machine whose other CPUs are busy, the futex wake puts the worker on the caller's own CPU (the kernel's
   wake-affine choice when the worker's last CPU is taken), where the two take turns on one core: the split does
   nothing but add switches, and a worker polling there takes the caller's time. On a 2-vCPU Zen 3 at load ~5.5 every
   item a worker ran (4-12 a GEMM) ran on the caller's CPU, and llama_tiny's GEMMs alone ran 2-12% slower at 2 threads
   than at 1 (bench/results/pool-2threads-zen3-2026-12-07.md). 0: the form before 2026-12-07 (the tests, A/B). */
int kiln_pool_step_aside = 1;

extern int sched_getcpu(void);  /* glibc (sched.h with _GNU_SOURCE, which this file cannot rely on being first) */

static int pool_cpu(void) {
#if defined(__linux__)
    return sched_getcpu();
#else
    return -1;
#endif
}

/* Whether the calling thread runs on the CPU the current (or last) loop's caller started on. */
static int on_caller_cpu(void) {
    const int caller = __atomic_load_n(&kiln_pool.caller_cpu, __ATOMIC_RELAXED);
    return caller >= 0 && pool_cpu() == caller;
}

static inline void pool_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static long pool_now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

static void pool_wait(unsigned int *address, unsigned int value) {
#if defined(__linux__)
    syscall(SYS_futex, address, FUTEX_WAIT_PRIVATE, value, NULL, NULL, 0);
#else
    (void)address; (void)value;
    sched_yield();
#endif
}

static void pool_wake(unsigned int *address) {
#if defined(__linux__)
    syscall(SYS_futex, address, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
#else
    (void)address;
#endif
}

/* Claim and run items of generation g until none is left (or the loop is over); how many it ran. */
static long pool_run_items(unsigned int g) {
    for (long ran = 0;; ++ran) {
        unsigned long w = __atomic_load_n(&kiln_pool.word, __ATOMIC_ACQUIRE);
        if ((unsigned int)(w >> 32) != g) return ran;
        const long item = (long)(w & 0xffffffffUL);
        /* read before the claim: a claim that succeeds proves generation g still running, so these are its */
        kiln_item_fn fn = __atomic_load_n(&kiln_pool.fn, __ATOMIC_RELAXED);
        void *ctx = __atomic_load_n(&kiln_pool.ctx, __ATOMIC_RELAXED);
        if (item >= __atomic_load_n(&kiln_pool.count, __ATOMIC_RELAXED)) return ran;
        if (!__atomic_compare_exchange_n(&kiln_pool.word, &w, w + 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
            --ran;
            continue;
        }
        fn(ctx, item);
        __atomic_add_fetch(&kiln_pool.done, 1, __ATOMIC_RELEASE);
    }
}

/* How long past a loop's end a worker polls for the next one while loops keep coming back to back: where the last
   POOL_GAPS gaps between loops were all under half of kiln_pool_follow_ns, twice the longest of them (at least
   SPIN_NS); else SPIN_NS. The one rule behind kiln_pool_follow_ns, exported for tests. */
long kiln_pool_spin_window(const long *gaps, int n, long follow) {
    long longest = 0;
    for (int i = 0; i < n; ++i) longest = gaps[i] > longest ? gaps[i] : longest;
    if (longest > follow / 2) return POOL_SPIN_NS;
    return 2 * longest > POOL_SPIN_NS ? 2 * longest : POOL_SPIN_NS;
}

static void *pool_worker(void *arg) {
    const int id = (int)(long)arg;
    unsigned int seen = __atomic_load_n(&kiln_pool.generation, __ATOMIC_ACQUIRE);
    int park = 0;  /* sleep at once: the worker left the last loop to its caller (kiln_pool_step_aside) */
    for (;;) {
        unsigned int g;
        long since = 0;
        int polls = 0;
        const long window = park ? 0 : __atomic_load_n(&kiln_pool.spin_ns, __ATOMIC_RELAXED);
        while ((g = __atomic_load_n(&kiln_pool.generation, __ATOMIC_ACQUIRE)) == seen) {
            pool_relax();
            if (++polls % 64) continue;
            const long now = pool_now_ns();
            if (since == 0) since = now;
            if (now - since < window && !(kiln_pool_step_aside && on_caller_cpu())) continue;
            __atomic_add_fetch(&kiln_pool.sleepers, 1, __ATOMIC_SEQ_CST);
            __atomic_add_fetch(&kiln_pool.parks, 1, __ATOMIC_RELAXED);
            if (__atomic_load_n(&kiln_pool.generation, __ATOMIC_SEQ_CST) == seen)
                pool_wait(&kiln_pool.generation, seen);
            __atomic_sub_fetch(&kiln_pool.sleepers, 1, __ATOMIC_SEQ_CST);
            since = 0;
        }
        seen = g;
        park = 0;
        if (id < __atomic_load_n(&kiln_pool.limit, __ATOMIC_RELAXED)) {
            const int shared = on_caller_cpu();
            if (shared && kiln_pool_step_aside) {
                __atomic_add_fetch(&kiln_pool.steps_aside, 1, __ATOMIC_RELAXED);
                park = 1;
                continue;
            }
            const long ran = pool_run_items(g);
            if (ran) __atomic_add_fetch(&kiln_pool.worker_items, ran, __ATOMIC_RELAXED);
            if (ran && shared) __atomic_add_fetch(&kiln_pool.shared_items, ran, __ATOMIC_RELAXED);
        }
    }
    return NULL;
}

/* The longest a worker polls past a loop while loops keep coming (kiln_pool_spin_window), or 0 (the default): SPIN_NS
   after every loop, the form before 2026-12-07. kiln/kernels/cpu/omp_governor.py sets it (gemm_native.POOL_FOLLOW_NS)
   where an engine's threads fit the free cores, as it lets libgomp's threads spin, and 0 where they do not. Why: a
   worker asleep on the futex when an engine's next call starts its first loop starts its item late, and where a loop
   is two items of ~1 ms (the LSTM's row split: a slice of the batch a thread) the call waits for it. The zoo's LSTM
   forecaster on a 2-vCPU Zen 3 at SCHED_FIFO (the cores its own): 2.71 ms against 3.28 following calls for up to
   1 ms (onnxruntime 2.76; the worker asleep 0.23 times a call against 1.54, no more CPU a call); at normal priority
   on the quiet machine level (3.64 against 3.66 ms), at load 6-7 it lost (14.5 against 12.4 ms, 0.7 ms more CPU a
   call): a spinning worker takes a share of the cores the others want (bench/results/lstm-2t-2026-12-07.md; bench/lstm_follow_ab.py times it). Cost: while
   calls come back to back, the workers poll through the gaps between them, and after the last one up to twice the
   longest recent gap (at most this); idle, they sleep as before. */
long kiln_pool_follow_ns = 0;

/* How many times the workers went to sleep on the futex (tests: the spin window kept them awake or not). */
long kiln_pool_parks(void) {
    return __atomic_load_n(&kiln_pool.parks, __ATOMIC_RELAXED);
}

/* Counters for benchmarks: out[0] loops run on the workers, [1] items the workers ran, [2] ns callers waited for
   the workers' items after their own, [3] the workers' parks on the futex, [4] worker items that ran on the CPU
   their loop's caller started on, [5] loops a worker left to the caller (kiln_pool_step_aside). */
void kiln_pool_stats(long *out) {
    out[4] = __atomic_load_n(&kiln_pool.shared_items, __ATOMIC_RELAXED);
    out[5] = __atomic_load_n(&kiln_pool.steps_aside, __ATOMIC_RELAXED);
    out[0] = kiln_pool.loops;
    out[1] = __atomic_load_n(&kiln_pool.worker_items, __ATOMIC_RELAXED);
    out[2] = kiln_pool.wait_ns;
    out[3] = __atomic_load_n(&kiln_pool.parks, __ATOMIC_RELAXED);
}

/* 0: kiln_parallel_for is an OpenMP dynamic loop instead (KILN_POOL=0; kiln/kernels/cpu/gemm_native.py sets it) */
int kiln_pool_enabled = 1;

/* fn(ctx, item) for every item in [0, count), on up to `threads` threads (the caller's included). */
static void kiln_parallel_for(long count, int threads, kiln_item_fn fn, void *ctx) {
    if (!kiln_pool_enabled) {
        #pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1 && count > 1)
        for (long i = 0; i < count; ++i) fn(ctx, i);
        return;
    }
    if (threads <= 1 || count <= 1 || count > 0xffffffffL || pthread_mutex_trylock(&kiln_pool.lock) != 0) {
        for (long i = 0; i < count; ++i) fn(ctx, i);
        return;
    }
    if (kiln_pool.pid != getpid()) {  /* a forked child: its parent's workers are not here */
        kiln_pool.pid = getpid();
        kiln_pool.started = 0;
    }
    int want = threads - 1 < POOL_MAX_WORKERS ? threads - 1 : POOL_MAX_WORKERS;
    while (kiln_pool.started < want) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int failed = pthread_create(&thread, &attr, pool_worker, (void *)(long)kiln_pool.started);
        pthread_attr_destroy(&attr);
        if (failed) break;
        kiln_pool.started++;
    }
    want = want < kiln_pool.started ? want : kiln_pool.started;
    if (++kiln_pool.last == 0) kiln_pool.last = 1;
    const unsigned int g = kiln_pool.last;
    /* the gap since the last loop, and from it how long the workers poll after this one */
    const long start_ns = pool_now_ns();
    kiln_pool.gaps[kiln_pool.loops++ % POOL_GAPS] = kiln_pool.ended_ns ? start_ns - kiln_pool.ended_ns : LONG_MAX;
    /* a wake for nothing since the last loop (a worker stepped aside, none ran an item): leave the sleepers be a while */
    const long aside = __atomic_load_n(&kiln_pool.steps_aside, __ATOMIC_RELAXED);
    const long items = __atomic_load_n(&kiln_pool.worker_items, __ATOMIC_RELAXED);
    if (items != kiln_pool.items_seen || kiln_pool_backoff_max_ns <= 0) {
        kiln_pool.backoff_ns = 0;
        kiln_pool.quiet_until_ns = 0;
    } else if (aside != kiln_pool.aside_seen) {
        const long doubled = kiln_pool.backoff_ns ? 2 * kiln_pool.backoff_ns : POOL_BACKOFF_MIN_NS;
        kiln_pool.backoff_ns = doubled < kiln_pool_backoff_max_ns ? doubled : kiln_pool_backoff_max_ns;
        kiln_pool.quiet_until_ns = start_ns + kiln_pool.backoff_ns;
    }
    kiln_pool.aside_seen = aside;
    kiln_pool.items_seen = items;
    __atomic_store_n(&kiln_pool.spin_ns, kiln_pool_spin_window(kiln_pool.gaps, POOL_GAPS, kiln_pool_follow_ns),
                     __ATOMIC_RELAXED);
    __atomic_store_n(&kiln_pool.caller_cpu, pool_cpu(), __ATOMIC_RELAXED);
    __atomic_store_n(&kiln_pool.fn, fn, __ATOMIC_RELAXED);
    __atomic_store_n(&kiln_pool.ctx, ctx, __ATOMIC_RELAXED);
    __atomic_store_n(&kiln_pool.count, count, __ATOMIC_RELAXED);
    __atomic_store_n(&kiln_pool.limit, want, __ATOMIC_RELAXED);
    __atomic_store_n(&kiln_pool.done, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&kiln_pool.word, (unsigned long)g << 32, __ATOMIC_RELEASE);
    __atomic_store_n(&kiln_pool.generation, g, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&kiln_pool.sleepers, __ATOMIC_SEQ_CST) > 0 && start_ns >= kiln_pool.quiet_until_ns)
        pool_wake(&kiln_pool.generation);
    pool_run_items(g);
    /* only the items a worker claimed are waited for */
    const long waited = __atomic_load_n(&kiln_pool.done, __ATOMIC_ACQUIRE) < count ? pool_now_ns() : 0;
    for (int polls = 0; __atomic_load_n(&kiln_pool.done, __ATOMIC_ACQUIRE) < count; ++polls) {
        if (polls < 4096) pool_relax();
        else sched_yield();
    }
    kiln_pool.ended_ns = pool_now_ns();
    if (waited) kiln_pool.wait_ns += kiln_pool.ended_ns - waited;
    pthread_mutex_unlock(&kiln_pool.lock);
}

/* The same, exported: kiln's other kernels (transformer.c's attention and elementwise) run their loops on this
   library's pool through it, so that one set of workers serves every kiln kernel of a network. */
void kiln_pool_parallel_for(long count, int threads, kiln_item_fn fn, void *ctx) {
    kiln_parallel_for(count, threads, fn, ctx);
}
