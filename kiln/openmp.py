"""How kiln's OpenMP threads wait when idle, decided as kiln is imported (before torch loads libgomp).

libgomp (torch's, which oneDNN and kiln's C kernels share) reads its wait policy once, when torch loads
it; by default an idle thread spins 300,000 iterations before it sleeps. Where the cores are busy with
other work (a shared VM, a host running other jobs) the spinning threads take the time slices the
working ones need: ResNet-50 batch 1 on a 2-vCPU EPYC with two busy loops beside it ran at 1.97x
onnxruntime's latency spinning and at 0.95x with a short spin. On an idle machine the short spin costs
instead (0-27% on CNNs, ~1.4x on a stream of small transformer requests: a sleeping thread wakes for
every layer). So: a short spin when the machine is busy as kiln is imported (1-min load average at least
half its CPUs), unless the user chose a policy, and only before torch is loaded
(bench/results/cpu-2026-12-01.md). No torch import here.

How short: 100 iterations, not 10,000. On the busy 2-vCPU EPYC at 2 threads, 10,000 still let MobileNetV2's
engines run 2-5x slower than with 100 or 0 (int8: one oneDNN call per layer, each ~0.5 ms instead of tens
of microseconds; ResNet-50 fp32 108 -> 71 ms), and 100 was as fast as 0 (bench/results/
quant-cpu-epyc-2026-12-03.md, "2 threads: the spin").
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

SHORT_SPIN = "100"  # GOMP_SPINCOUNT when busy
BUSY = 0.5  # load average per CPU from which the machine counts as busy
POLICY = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def busy(load: float, cpus: int) -> bool:
    return load >= BUSY * max(cpus, 1)


def choose_wait_policy(environ: MutableMapping[str, str] | None = None, modules: dict | None = None,
                       load: float | None = None, cpus: int | None = None) -> str | None:
    """Set GOMP_SPINCOUNT in `environ` (os.environ) when the machine is busy, the user set no policy and
    torch is not loaded yet; returns what it set, or None."""
    environ = os.environ if environ is None else environ
    modules = sys.modules if modules is None else modules
    if "torch" in modules or any(k in environ for k in POLICY):
        return None
    if load is None:
        try:
            load = os.getloadavg()[0]
        except OSError:  # no load average on this platform: libgomp's default
            return None
    if not busy(load, cpus if cpus is not None else (os.cpu_count() or 1)):
        return None
    environ["GOMP_SPINCOUNT"] = SHORT_SPIN
    return SHORT_SPIN
