"""oneDNN inner products created ahead of the row counts a CPU engine's profile can reach, on one background thread
(issue 10: a new shape's first call should cost no more than a repeat).

A linear layer at a row count other than its tuned one runs on an inner product created and JIT-compiled for that
row count (kiln/tactics/cpu/onednn_gemm.py): ~0.5-1.4 ms of thread CPU each, one per layer shape (shared by the layers
of that shape: 3 for BERT-base), so a BERT-base first call at a new row count of 3-255 waited that long for them.
The runtime-M matmul (one primitive for every row count, kiln/kernels/cpu/onednn_matmul.py) would spare the wait,
but a whole BERT-base call on it is 1.26-1.69x slower at 4-64 rows (21-67 ms a call, in situ, 1 thread;
bench/results/first-calls-2026-12-03.md): far more than the creation it saves. So the primitives are made before
the row counts are met, smallest row count first, each shape interleaved, into the shared cache
(onednn_primitives._SHARED_PRIMITIVES) where a layer bound at a new row count looks first. A row count met before
the thread reached it is created by the binding thread, as before, and found made here.

The runtime-M matmul that takes 1-2 rows (and 256+ on one thread) JIT-compiles its GEMM kernels on its first
execution, not at creation: BERT-base's first call at 1 or 2 rows ran 11-13 ms longer than the next new shape at
those rows (in situ, twice). The thread runs it once at each such row count too (RuntimeRows.warm).

Thread safety: oneDNN's primitive creation is thread-safe and the shared cache takes its lock; the thread touches
no layer's own state (only the cache). Its OpenMP count is the one the engine runs at (a kernel fixes its thread
count at creation, onednn.creating_with_threads; OpenMP's count is per thread). ctypes releases the GIL in every
oneDNN call, so the binding thread's Python waits at most the few µs of Python between two of them. The thread runs
at the lowest priority (nice 19): on a machine without an idle core it takes what the engine's threads leave.

Waiting: a caller of wait() makes what is still queued itself, in order, at its own priority, once the thread has
made the job in hand (one job is made at a time, by the thread or by a waiter: `_making`; the thread ends after its
job in hand while a caller waits, else it would take the lock back first every time). At nice 19 on a machine
whose cores are taken the thread is all but stopped, and a caller that only slept until it was idle waited for the
machine's idle time: the test suite's waits of 120 s ran out at load 22 (2 of a 3-run loop of ahead tests), and
warm_up's primitives_made() had no bound at all.

Exit: the thread is a daemon, and a daemon thread inside torch when the interpreter finalizes aborts the process. Its
C++ code (torch's op bindings, the storage deleter of a tensor made with torch.frombuffer) takes the GIL back through
pybind11, Python ends a thread that asks for the GIL while it finalizes (pthread_exit), and that forced unwind through
a C++ destructor is std::terminate: "terminate called without an active exception", after the program's own work was
done (issue 14: CI's `kiln serve` engine process; a script that builds an engine and exits, 1 run in 2-3 here). The
thread was found freeing its last job's closure (the layer it held, whose weights are frombuffer tensors) as the
interpreter finalized: stop() had returned as soon as the job was made. So the thread drops each job before it says
it is idle, and stop(), at exit (atexit), joins it: nothing of it runs once the interpreter finalizes.

Cost: ~150 KB of JIT code and descriptors per primitive (250 BERT-base FFN primitives: +38 MiB RSS; BERT-base's 768
jobs: +108 MiB on a 642 MiB process, ~1.2 s on another core), so at most AHEAD_PRIMITIVES are made per process
(an engine loaded after them gets what is left); KILN_ONEDNN_AHEAD=0 makes none.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kiln.kernels.cpu.onednn import creating_with_threads
from kiln.kernels.cpu.onednn_primitives import _SHARED_PRIMITIVES, InnerProduct, _shared_inner_product

log = logging.getLogger("kiln.runtime")

AHEAD_ROWS = 255  # the largest row count made ahead (past it a call's work makes creation a small share)
AHEAD_PRIMITIVES = 3 * _SHARED_PRIMITIVES.size // 4  # jobs made ahead at most, per process: the cache keeps them all
STOP_TIMEOUT_S = 60.0  # how long exit waits for the job in hand (a primitive: ms; an exact batch bind: ~0.4 s)


def enabled(environ: dict[str, str] | None = None) -> bool:
    environ = os.environ if environ is None else environ
    return environ.get("KILN_ONEDNN_AHEAD", "1") != "0"


@dataclass(frozen=True)
class Job:
    """One thing to make ahead: `make()` on the background thread; jobs of equal `key` are made once, `order`
    (a row count) sorts them (smallest first)."""

    key: tuple
    order: int
    make: Callable[[], bool]  # True: it made something (False: found made)
    counted: bool = True  # whether it takes one of the budget's (an engine's own plan work, once per load: not)


def inner_product_jobs(layer: InnerProduct, rows: Iterable[int]) -> list[Job]:
    """The inner products of `layer`'s shape and weight layout at each of `rows`, into the shared cache (one per
    layer shape: the layers of a shape share them)."""
    def make(r: int) -> Callable[[], bool]:
        def run() -> bool:
            if _SHARED_PRIMITIVES.find((r, *layer._epilogue), layer._weight_md) is not None:
                return False
            return _shared_inner_product(r, layer._epilogue, layer._weight_md) is not None
        return run

    return [Job(("inner product", layer._epilogue, layer.input_size[0], r), r, make(r)) for r in rows]


class Ahead:
    """One background thread making Jobs (oneDNN primitives, a kernel's first run) in the order scheduled."""

    def __init__(self, budget: int = AHEAD_PRIMITIVES):
        self.budget = budget  # jobs still to schedule
        self.made = 0  # jobs that made something (not found made)
        self.failed = 0  # jobs that raised (their first call makes what they would have)
        self._queue: deque[tuple[Job, int]] = deque()  # (job, OpenMP threads)
        self._scheduled: set[tuple] = set()  # (job key, threads)
        self._lock = threading.Lock()
        self._idle = threading.Event()
        self._idle.set()
        self._making = threading.Lock()  # held while a job is taken off the queue and made (the thread's or a waiter's)
        self._waiters = 0  # callers in wait(): the thread leaves the queue to them after its job in hand
        self._thread: threading.Thread | None = None  # the thread making jobs (None: none queued)
        self._last: threading.Thread | None = None  # the last thread started, which stop() joins
        self._stopped = False  # at exit: nothing more is scheduled

    def schedule(self, jobs: Iterable[Job], threads: int) -> int:
        """Queue the jobs not queued before at this thread count, smallest `order` first, the counted ones up to the
        budget; they are made on OpenMP's count `threads` (the engine's). Returns how many were queued."""
        with self._lock:
            if self._stopped:
                return 0
            fresh = []
            for job in jobs:
                if (job.key, threads) not in self._scheduled:
                    self._scheduled.add((job.key, threads))
                    fresh.append(job)
            fresh.sort(key=lambda job: job.order)  # stable: each row count's shapes in the order given
            counted = {id(job) for job in [job for job in fresh if job.counted][:max(self.budget, 0)]}
            fresh = [job for job in fresh if not job.counted or id(job) in counted]
            self.budget -= len(counted)
            self._queue.extend((job, threads) for job in fresh)
            if self._queue:
                self._idle.clear()  # (a waiter may have said idle while the thread, done, had not ended yet)
            if self._queue and self._thread is None:
                self._start()
        return len(fresh)

    def _start(self) -> None:
        """A thread for the queue (the caller holds the lock)."""
        self._thread = self._last = threading.Thread(target=self._work, name="kiln-onednn-ahead", daemon=True)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Whether every queued job is made (within `timeout` seconds). The caller makes the jobs still queued itself,
        in order, once the one in hand is made (the thread leaves the queue to it: the module's docstring says why); a
        job it has begun it finishes, past the timeout; what it leaves queued goes back to a thread."""
        if threading.current_thread() is self._thread:  # a job that waits: for the others, which only it can make
            return self._idle.wait(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            self._waiters += 1
        try:
            while not self._idle.is_set():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                if not self._making.acquire(timeout=-1 if left is None else left):  # the job in hand outlasted it
                    return self._idle.is_set()
                try:
                    with self._lock:
                        if not self._queue:  # nothing in hand (the lock is ours) and nothing queued: all made
                            self._idle.set()
                            break
                        job, threads = self._queue.popleft()
                    self._make(job, threads)
                    job = None  # what it held freed here, before the caller hears that it is made
                finally:
                    self._making.release()
            return True
        finally:
            with self._lock:
                self._waiters -= 1
                if self._queue and self._thread is None and not self._waiters and not self._stopped:
                    self._start()  # a waiter that ran out of time: the rest on a thread again

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """At exit: drop what is queued, schedule nothing more, and join the thread once it has made the job in hand,
        so that no creation is inside oneDNN while the process tears the library down, and nothing of the thread
        runs while the interpreter finalizes (the module's docstring says why: that aborts the process)."""
        with self._lock:
            self._queue.clear()
            self._stopped = True
            thread = self._last
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                log.warning("kiln: a job made ahead outlasted %.0f s at exit; the process may abort as it ends "
                            "(the thread is inside it)", timeout)

    def _work(self) -> None:
        _lowest_priority()
        while True:
            with self._making:
                with self._lock:
                    if not self._queue or self._waiters:  # all made, or a caller waits to make the rest (wait())
                        self._thread = None
                        if not self._queue:
                            self._idle.set()
                        return
                    job, threads = self._queue.popleft()
                self._make(job, threads)
                # dropped here, before the thread can say it is idle: the job's closure may hold the last reference to
                # a layer, and its tensors are freed on this thread (by the time wait() returns, not while Python exits)
                job = None

    def _make(self, job: Job, threads: int) -> None:
        """One job made on OpenMP's count `threads`; it never raises (work ahead is an optimisation: a call makes what
        a job could not)."""
        with creating_with_threads(threads):
            try:
                if job.make():
                    self.made += 1
            except Exception:  # noqa: BLE001
                self.failed += 1
                log.debug("kiln: a job made ahead failed; its first call makes it", exc_info=True)


def _lowest_priority() -> None:
    """This thread at nice 19 (Linux: a thread's own priority; elsewhere left as it is)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass


AHEAD = Ahead()
atexit.register(AHEAD.stop)
