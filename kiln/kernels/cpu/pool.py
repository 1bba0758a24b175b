"""kiln's thread pool (pool.c) for the loops of its own C kernels: the GEMM (gemm.c) and attention
(transformer.c). oneDNN's primitives keep libgomp's OpenMP.

Why: an OpenMP parallel-for ends in a barrier every thread of the team must reach, so on cores that
other work keeps busy a helper thread not yet scheduled holds the caller up when the items run out,
even if the caller ran them all: measured on the shared 2-core VM, ~1.3 ms a loop at a load average of
8, against ~0.2 ms for the same loop whose caller waits only for items already started (onnxruntime's
thread pool works that way; kiln's GEMM and attention ran 2-thread transformer layers up to twice
onnxruntime's time there while level with it per core, bench/results/gemm-2026-12-01.md). The kernels
get `kiln_parallel_for`'s address in their plans (`parallel_for()`); 0 keeps their OpenMP loops.

Idle helpers spin as long as libgomp's would (GOMP_SPINCOUNT, which kiln/openmp.py shortens on a
busy machine; OMP_WAIT_POLICY=passive: not at all), then sleep. KILN_POOL=0 turns the pool off.
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

from kiln.kernels.cpu import native_loop

SOURCE = Path(__file__).with_name("pool.c").read_text()

DEFAULT_SPIN_NS = 200_000  # libgomp's default 300,000 spins: ~0.1-0.3 ms
NS_PER_SPIN = 1.0  # GOMP_SPINCOUNT counts iterations of a pause loop: ~1 ns each here (order of magnitude)

_LOADED: ctypes.CDLL | None = None
_REASON: str | None = None
_LOCK = threading.Lock()


def spin_ns(environ: dict[str, str] | None = None) -> int:
    """How long an idle thread spins before it sleeps, as libgomp's settings say."""
    environ = os.environ if environ is None else environ
    policy = environ.get("OMP_WAIT_POLICY", "").lower()
    if policy == "passive":
        return 0
    count = environ.get("GOMP_SPINCOUNT", "")
    if count.isdigit():
        return int(int(count) * NS_PER_SPIN)
    if count.lower() == "infinite" or policy == "active":
        return 100_000_000  # 0.1 s, then sleep all the same
    return DEFAULT_SPIN_NS


def load() -> ctypes.CDLL | None:
    """The compiled pool (built on first use, then reused from kiln's cache), or None."""
    global _LOADED, _REASON
    with _LOCK:
        if _LOADED is not None or _REASON is not None:
            return _LOADED
        if os.environ.get("KILN_POOL") == "0":
            _REASON = "KILN_POOL=0"
            return None
        built = native_loop.build("pool", SOURCE)
        if isinstance(built, str):
            _REASON = built
            return None
        try:
            lib = ctypes.CDLL(str(built))
            lib.kiln_pool_available.restype = ctypes.c_int
            lib.kiln_pool_helpers.restype = ctypes.c_int
            lib.kiln_pool_configure.argtypes = [ctypes.c_long]
            if not lib.kiln_pool_available():
                _REASON = "no futex on this platform: the kernels keep OpenMP"
                return None
            lib.kiln_pool_configure(spin_ns())
        except (OSError, AttributeError) as e:
            _REASON = f"{type(e).__name__}: {e}"
            return None
        _LOADED = lib
        return lib


def reason() -> str | None:
    """Why load() returned None (None when it did not)."""
    return _REASON


def parallel_for() -> int:
    """The address of kiln_parallel_for for a kernel's plan, or 0 (the kernel then uses OpenMP)."""
    lib = load()
    return ctypes.cast(lib.kiln_parallel_for, ctypes.c_void_p).value if lib is not None else 0
