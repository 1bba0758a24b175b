"""Which clock the autotuner times CPU candidates by (kiln/builder/autotune.py: measure): the wall clock on a
quiet machine, the process's CPU time where other work shares the CPUs."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from kiln.openmp import runnable_tasks

WALL, PROCESS_CPU = "wall", "process cpu"

# Other work shares the CPUs when its runnable tasks are at least this share of them (kiln/openmp.py's BUSY).
BUSY_SHARE = 0.5


def real_time() -> bool:
    """Whether the calling thread runs at a real-time priority (SCHED_FIFO or SCHED_RR), as threads it starts will:
    other work then waits for it instead of taking its cores."""
    try:
        return os.sched_getscheduler(0) in (os.SCHED_FIFO, os.SCHED_RR)
    except (AttributeError, OSError):  # not Linux
        return False


def cpu_clock(threads: int, cpus: int | None = None, runnable: int | None = None,
              load: float | None = None, has_cores: bool | None = None) -> str:
    """The clock candidates are timed by on the CPU: WALL, or PROCESS_CPU where other work shares the CPUs.

    Why: with other work runnable, a kernel of several threads waits at each of its barriers for a thread the
    OS took off its core, and its wall time says more about the scheduler than about the kernel. Timed by
    wall, an LSTM layer's three kiln loops ran 2-30 ms apart from build to build on a 2-vCPU VM with busy
    loops beside (lower quartile of 10 rounds), and 3 of 5 builds took cpu.lstm.lanes where the quiet host's
    pick, cpu.lstm.fused, is ~1.5x faster; the process's CPU time of the same calls (every thread's, waits
    that sleep left out) stayed within ~30% (bench/results/zoo-cpu-avx2-2026-12-03.md). On a machine whose
    cores are all busy the CPU time a kernel takes is also what its latency will be made of, so the kernel
    that needs the least of it is the one to keep. On a quiet machine the wall clock, which counts what
    several threads gain.

    A wait that spins (libgomp's long spin, chosen as kiln is imported on a quiet machine) is CPU time too:
    neither clock sees past it (bench/results/zoo-cpu-avx2-2026-12-03.md, "the failure left").

    Busy: other work at least BUSY_SHARE of the CPUs: the tasks runnable beside the reading thread (runnable_tasks,
    which leaves this process's other threads out) or, without /proc/loadavg's count, the 1-min load average beyond
    this process's `threads` (the average counts them, its OpenMP workers spinning between calls). Not `runnable`
    less `threads`: with this process's threads already left out, that took one other task on 2 vCPUs for none, and
    timed by the wall clock while a neighbour took a share of the cores (by the process's CPU time, kiln's LSTM
    loops timed within 1.03-1.08x of each other in every fresh build on a 2-vCPU Zen 3, by the wall clock up to
    1.23x: bench/results/lstm-2t-2026-12-07.md, "the picks on merged main").
    Not where the build runs at a real-time priority (`has_cores`, by default real_time()): the other tasks wait,
    its threads run side by side as on a quiet machine, and only the wall clock sees how well a kernel's threads
    share its work. Timed by the process's CPU time there, or under load by either clock, two threads that take
    turns on the cores measure the sum of their work: the LSTM forecaster's layers capped to AVX2 then timed
    cpu.lstm.lanes within 4% of cpu.lstm.fused, where with the cores free its per-step barrier made it 18-23%
    slower (bench/results/tcn-2026-12-05c.md). The process's CPU time is read as every thread's own clock
    (process_cpu_reader): time.process_time leaves out a worker's time since its last context switch or tick."""
    if has_cores is None:
        has_cores = real_time()
    if has_cores:
        return WALL
    cpus = max(cpus if cpus is not None else (os.cpu_count() or 1), 1)
    if runnable is None and load is None:
        runnable = runnable_tasks()
        if runnable is None:
            try:
                load = os.getloadavg()[0]
            except OSError:
                return WALL
    others = runnable - 1 if runnable is not None else load - threads
    return PROCESS_CPU if others >= BUSY_SHARE * cpus else WALL


def process_cpu_reader(task_dir: str = "/proc/self/task") -> Callable[[], float]:
    """A reader of this process's CPU time in seconds that counts every thread's time up to the read: the sum of each
    thread's own CPU clock, the threads listed once here (a thread that ends later counts no more; one started later
    is not counted: list after a warm-up). Off Linux, time.process_time.

    Why not time.process_time: the kernel sums the other threads' time as of their last context switch or scheduler
    tick (4 ms at this VM's HZ 250), so a worker that ran through a whole call of 1-3 ms without either counted little
    or nothing of it, and the least of the tuner's rounds took the round that counted least of it: on a busy 2-vCPU
    Zen 3 one fresh build timed the forecaster's second LSTM layer on the block split at 1.58 ms of CPU, every other
    loop at 2.6-3.0 ms (on one thread that layer's work takes 2.6 ms), and took it (bench/results/
    lstm-2t-2026-12-07.md). A thread's own clock (CLOCK_THREAD_CPUTIME_ID, read from another thread) adds its time
    since. A read costs a clock_gettime a thread (~1 us each)."""
    try:
        tids = [int(t) for t in os.listdir(task_dir)]
    except OSError:
        return time.process_time
    clocks = [(~tid << 3) | 6 for tid in tids]  # the kernel's MAKE_THREAD_CPUCLOCK(tid, CPUCLOCK_SCHED)

    def read() -> float:
        total = 0.0
        for clock in clocks:
            try:
                total += time.clock_gettime(clock)
            except OSError:  # the thread ended
                continue
        return total

    return read
