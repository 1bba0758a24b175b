"""One OpenMP thread for what is created inside `one_thread()`: oneDNN's x64 kernels fix their thread count
(jcp.nthr) when the primitive descriptor is created, from omp_get_max_threads() then, and open every run's
parallel region with that many threads whatever the count at run time. So a layer too small for a second
thread to pay is made single-threaded by creating it under one thread (measured: setting one thread only
around the runs of primitives created for two left them on two).

The libgomp here is torch's (the same soname: oneDNN's and kiln's C kernels resolve to it).
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager

_OPENMP: list[ctypes.CDLL | None] = []


def openmp() -> ctypes.CDLL | None:
    """The loaded libgomp, or None (no OpenMP runtime by that name)."""
    if not _OPENMP:
        try:
            lib = ctypes.CDLL("libgomp.so.1")
            lib.omp_get_max_threads.restype = ctypes.c_int
            lib.omp_set_num_threads.argtypes = [ctypes.c_int]
            _OPENMP.append(lib)
        except OSError:
            _OPENMP.append(None)
    return _OPENMP[0]


@contextmanager
def one_thread(enabled: bool = True) -> Iterator[None]:
    """The calling thread's OpenMP thread count set to 1 inside (when `enabled`), restored after."""
    omp = openmp() if enabled else None
    if omp is None:
        yield
        return
    threads = omp.omp_get_max_threads()
    omp.omp_set_num_threads(1)
    try:
        yield
    finally:
        omp.omp_set_num_threads(threads)
