"""How kiln's OpenMP threads wait when idle, decided as kiln is imported (before torch loads libgomp).

libgomp (torch's, which oneDNN and kiln's C kernels share) reads its wait policy once, when torch loads
it; by default an idle thread spins 300,000 iterations before it sleeps. Where the cores are busy with
other work (a shared VM, a host running other jobs) the spinning threads take the time slices the
working ones need: ResNet-50 batch 1 on a 2-vCPU EPYC with two busy loops beside it ran at 1.97x
onnxruntime's latency spinning and at 0.95x with a short spin. On an idle machine the short spin costs
instead (0-27% on CNNs, ~1.4x on a stream of small transformer requests: a sleeping thread wakes for
every layer). So: a short spin when the machine is busy as kiln is imported (other tasks runnable at that
moment at least half its CPUs), unless the user chose a policy, and only before torch is loaded
(bench/results/cpu-2026-12-01.md). No torch import here.

Busy is judged by the tasks runnable now (/proc/loadavg's count, a median of readings), not by the 1-min load
average, which trails what ran the minute before: `bash scripts/demo.sh` installs its packages and then imports
kiln on an idle 2-vCPU Xeon at a load average of ~1.4, which chose the short spin and ran MobileNetV2 at 4.4 ms
against onnxruntime's 2.8 (torch eager 32.8 ms); with libgomp's default, 2.5 ms (torch eager 10.7).

How short: 100 iterations, not 10,000. On the busy 2-vCPU EPYC at 2 threads, 10,000 still let MobileNetV2's
engines run 2-5x slower than with 100 or 0 (int8: one oneDNN call per layer, each ~0.5 ms instead of tens
of microseconds; ResNet-50 fp32 108 -> 71 ms), and 100 was as fast as 0 (bench/results/
quant-cpu-epyc-2026-12-03.md, "2 threads: the spin"). 128 rather than 100: libgomp's throttled count (its spin
when it runs more threads than CPUs) is 100, and kiln/kernels/cpu/omp_governor.py finds libgomp's spin count by
its value, which must then be found once.

This import-time choice is now the fallback and the count outside engine calls: once an engine runs, the
governor sets the count per call (spin while a call runs where its threads fit the free cores, park after it).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import MutableMapping

SHORT_SPIN = "128"  # GOMP_SPINCOUNT when busy (not 100: see above)
CHOSEN: str | None = None  # what choose_wait_policy set in os.environ (None: nothing)
BUSY = 0.5  # other work per CPU (tasks runnable, or the load average) from which the machine counts as busy
POLICY = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
# /proc/loadavg's count is of one instant: the median of a few readings a millisecond apart, so that one task
# waking for a moment on a quiet machine does not decide (it did for 2 of 10 layers in 5 quiet builds).
RUNNABLE_READINGS = 5


def own_running_threads(task_dir: str = "/proc/self/task") -> int:
    """This process's threads in state R (running or runnable) now, the reading one included; 1 where they
    cannot be read."""
    running = 0
    try:
        for task in os.listdir(task_dir):
            try:
                with open(f"{task_dir}/{task}/stat") as f:
                    # the state follows the command name's closing parenthesis (a name may hold spaces)
                    running += f.read().rpartition(")")[2].split()[0] == "R"
            except (OSError, IndexError):
                continue  # the thread ended meanwhile
    except OSError:
        return 1
    return max(running, 1)


def runnable_tasks(readings: int = RUNNABLE_READINGS, loadavg: str = "/proc/loadavg",
                   task_dir: str = "/proc/self/task") -> int | None:
    """Tasks runnable on the machine, this reading one included and this process's other threads not: the median
    of `readings` of /proc/loadavg's count, 1 ms apart; None off Linux.

    Why not this process's other threads: right after `import numpy` OpenBLAS's worker threads spin (state R) for
    a moment; counted as other work, they made every script that imports numpy before kiln take the short spin
    on an idle 2-vCPU EPYC, and its CNNs' parallel layers run 1.5x slower (bench/zoo.py's MobileNetV2 at 2 threads
    6.1-7.1 ms against 3.8-4.0 with libgomp's default; onnxruntime 4.2-4.7)."""
    found = []
    for i in range(readings):
        if i:
            time.sleep(0.001)
        try:
            with open(loadavg) as f:
                count = int(f.read().split()[3].split("/")[0])
        except (OSError, IndexError, ValueError):
            return None
        found.append(max(count - own_running_threads(task_dir) + 1, 1))
    return int(statistics.median(found))


def busy(others: float, cpus: int) -> bool:
    """Whether `others` (work beside this process: runnable tasks, or a load average) is at least BUSY a CPU."""
    return others >= BUSY * max(cpus, 1)


def choose_wait_policy(environ: MutableMapping[str, str] | None = None, modules: dict | None = None,
                       runnable: int | None = None, load: float | None = None,
                       cpus: int | None = None) -> str | None:
    """Set GOMP_SPINCOUNT in `environ` (os.environ) when the machine is busy, the user set no policy and
    torch is not loaded yet; returns what it set, or None. Busy: the tasks `runnable` now besides this one
    (runnable_tasks), or, where that cannot be read, the 1-min `load` average."""
    environ = os.environ if environ is None else environ
    modules = sys.modules if modules is None else modules
    if "torch" in modules or any(k in environ for k in POLICY):
        return None
    if runnable is None and load is None:
        runnable = runnable_tasks()
        if runnable is None:
            try:
                load = os.getloadavg()[0]
            except OSError:  # no load average on this platform: libgomp's default
                return None
    others = runnable - 1 if runnable is not None else load
    if not busy(others, cpus if cpus is not None else (os.cpu_count() or 1)):
        return None
    environ["GOMP_SPINCOUNT"] = SHORT_SPIN
    if environ is os.environ:
        global CHOSEN
        CHOSEN = SHORT_SPIN
    return SHORT_SPIN
