"""kiln's native CPU code (segment_loop.c), compiled once with the machine's C compiler.

- The loop of a native segment: one call binds the run's inputs and outputs and makes every
  layer's call (`dnnl_primitive_execute`, or a kernel below). From Python, each layer costs a
  ctypes call on top of oneDNN's own work, and inside a network that call runs cold (the layer
  before evicted ctypes' and the interpreter's code and data): measured 5-13 µs a layer on
  MobileNetV2 and ResNet-50, 2 threads. The loop makes the whole segment one call.
- The input and output transforms of Winograd F(2x2, 3x3) (kiln/kernels/cpu/winograd.py).

Built into kiln's cache (`$KILN_CACHE/native`) per source, CPU model and feature flags, with the
best flags the compiler takes. Without a C compiler (or when KILN_NATIVE_LOOP=0) `load()` returns
None, says why in `reason()`, segments loop in Python (kiln/runtime/native.py: the same results, a
little slower) and the Winograd tactic is unavailable.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kiln.kernels.cpu import cpu_features

SOURCE = (Path(__file__).with_name("segment_loop.c")).read_text()
# The headers kiln's C files include by name (exp_poly.h): on the compiler's -I, since a source is compiled from a
# copy in a temporary folder, and part of every library's cache key, since the source text alone does not show
# a change to them.
INCLUDE_DIR = Path(__file__).parent

FLAGS = (("-O3", "-march=native", "-fopenmp"), ("-O3", "-fopenmp"), ("-O2",))
# KILN_CPU_ISA=avx2 (cpu_features.py): compiled for x86-64-v3 (AVX2 + FMA, no AVX-512 in any loop the
# compiler vectorises), tuned for this CPU, and gemm.c's run-time dispatch told never to take an AVX-512 tile.
AVX2_MARCH = ("-march=x86-64-v3", "-mtune=native")
AVX2_DEFINE = "-DKILN_MAX_ISA_AVX2=1"

_LOADED: ctypes.CDLL | None = None
_REASON: str | None = None


class KernelLibrary:
    """One of kiln's C kernel files (se.c, relayout.c, transformer.c): compiled by `build` on first use, loaded
    once per process (thread-safe). `load()` gives the library or None, and `reason()` then says why; each name
    in `functions` is bound as int f(plan, handles, count, args), the calling convention a native segment
    uses. `requires`: (a check, what to say when it fails or a function saying it) made before building;
    `setup(lib)`: after binding."""

    def __init__(self, stem: str, source: str, functions: Sequence[str],
                 requires: tuple[Callable[[], bool], str | Callable[[], str]] | None = None,
                 setup: Callable[[ctypes.CDLL], None] | None = None):
        self.stem, self.source, self.functions, self.requires, self.setup = stem, source, tuple(functions), requires, setup
        self._loaded: ctypes.CDLL | None = None
        self._reason: str | None = None
        self._lock = threading.Lock()

    def load(self) -> ctypes.CDLL | None:
        """The compiled kernels (built on first use, then reused from kiln's cache), or None."""
        with self._lock:
            if self._loaded is not None or self._reason is not None:
                return self._loaded
            if self.requires is not None and not self.requires[0]():
                why = self.requires[1]
                self._reason = why() if callable(why) else why
                return None
            built = build(self.stem, self.source)
            if isinstance(built, str):
                self._reason = built
                return None
            try:
                lib = ctypes.CDLL(str(built))
                for name in self.functions:
                    fn = getattr(lib, name)
                    fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                                             ctypes.c_void_p]
            except (OSError, AttributeError) as e:
                self._reason = f"{type(e).__name__}: {e}"
                return None
            if self.setup is not None:
                self.setup(lib)
            self._loaded = lib
            return lib

    def available(self) -> bool:
        return self.load() is not None

    def reason(self) -> str | None:
        """Why load() returned None (None when it did not)."""
        return self._reason


def _cache_dir() -> Path:
    root = os.environ.get("KILN_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "kiln") / "native"


def _cpu_identity() -> str:
    """The CPU model and its feature flags (Linux), else what platform says."""
    import platform

    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "|".join(next((x for x in lines if x.startswith(key)), "") for key in ("model name", "flags"))
    except OSError:
        return platform.processor() or platform.machine()


def compile_flags() -> tuple[tuple[str, ...], ...]:
    """FLAGS (the compiler's options to try, best first) under the KILN_CPU_ISA cap."""
    if cpu_features.isa_cap() != "avx2":
        return FLAGS
    return tuple(tuple(m for f in flags for m in (AVX2_MARCH if f == "-march=native" else (f,))) + (AVX2_DEFINE,)
                 for flags in FLAGS)


def find_compiler() -> str | None:
    """$CC, else the first of cc, gcc, clang on PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def reason() -> str | None:
    """Why load() returned None (None when it did not)."""
    return _REASON


def load() -> ctypes.CDLL | None:
    """The compiled loop (built on first use, then reused from the cache), or None."""
    global _LOADED, _REASON
    if _LOADED is not None or _REASON is not None:
        return _LOADED
    if os.environ.get("KILN_NATIVE_LOOP") == "0":
        _REASON = "KILN_NATIVE_LOOP=0"
        return None
    built = build("segment_loop", SOURCE)
    if isinstance(built, str):
        _REASON = built
        return None
    try:
        library = ctypes.CDLL(str(built))
        loop = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
        timed = [*loop, ctypes.c_void_p, ctypes.c_int]  # ... and the per-call times, by a clock
        for fn, argtypes in ((library.kiln_run_segment, loop), (library.kiln_run_segment_timed, timed)):
            fn.restype, fn.argtypes = ctypes.c_int, argtypes
        # the loop as a segment's run calls it (Segment._c_loop): no argtypes, so ctypes converts nothing (each argument
        # is a ctypes object already, or a Python int for an int parameter): ~0.55 µs a call here against ~1.3 µs
        # through argtypes' eleven conversions (bench/results/call-overhead-zen4-2026-12-07.md)
        library.kiln_run_segment_bare = library._FuncPtr(("kiln_run_segment", library))
        library.kiln_run_segment_bare.restype = ctypes.c_int
        # the OpenMP team's threads and their parking (kiln/kernels/cpu/omp_governor.py)
        for fn, argtypes in ((library.kiln_omp_available, []), (library.kiln_omp_max_threads, []),
                             (library.kiln_omp_team, [ctypes.POINTER(ctypes.c_int), ctypes.c_int]),
                             (library.kiln_omp_park, [ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_ulonglong,
                                                      ctypes.c_long, ctypes.POINTER(ctypes.c_int),
                                                      ctypes.POINTER(ctypes.c_int)])):
            fn.restype, fn.argtypes = ctypes.c_int, argtypes
    except OSError as e:
        _REASON = f"{type(e).__name__}: {e}"
        return None
    _LOADED = library
    return library


def headers_digest(directory: Path | None = None) -> str:
    """A digest of the C headers in `directory` (INCLUDE_DIR), names and contents: a library is rebuilt when one
    changes."""
    digest = hashlib.sha256()
    for path in sorted((directory or INCLUDE_DIR).glob("*.h")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def build(stem: str, source: str) -> Path | str:
    """`source` compiled into a shared library in kiln's cache (once per source, headers, CPU and flags): its
    path, or why it could not be built. Also compiles kiln's GEMM (kiln/kernels/cpu/gemm_native.py)."""
    # -march=native: the binary is for this CPU's instruction sets; the cache may be shared with others
    options = compile_flags()
    key = source + headers_digest() + _cpu_identity() + repr(options)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    target = _cache_dir() / f"{stem}-{digest}.so"
    if target.exists():
        return target
    compiler = find_compiler()
    if compiler is None:
        return "no C compiler (cc, gcc or clang) on PATH"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as work:
            code, built = Path(work) / f"{stem}.c", Path(work) / f"{stem}.so"
            code.write_text(source)
            for flags in options:  # the best the compiler takes: without OpenMP the transforms run on one thread
                done = subprocess.run([compiler, *flags, "-I", str(INCLUDE_DIR), "-shared", "-fPIC", "-o", str(built),
                                       str(code)],
                                      capture_output=True, text=True, timeout=120)
                if done.returncode == 0:
                    break
            else:
                return f"{compiler} failed: {done.stderr.strip()[:300]}"
            os.replace(built, target)  # atomic: another process may be building it too
    except (OSError, subprocess.SubprocessError) as e:
        return f"{type(e).__name__}: {e}"
    return target


def execute_function() -> int:
    """The address of dnnl_primitive_execute: the function of a call given as None (a oneDNN primitive's)."""
    from kiln.kernels.cpu import onednn

    return ctypes.cast(onednn.load().lib.dnnl_primitive_execute, ctypes.c_void_p).value


def call_arrays(calls: list[tuple[int | None, int, int, int]]) -> tuple[ctypes.Array, ...]:
    """The loop's (functions, objects, nargs, args) arrays for `calls` [(function or None for
    dnnl_primitive_execute, object, nargs, args)]."""
    execute = execute_function()
    count = len(calls)
    return ((ctypes.c_void_p * count)(*[f or execute for f, _, _, _ in calls]),
            (ctypes.c_void_p * count)(*[o for _, o, _, _ in calls]),
            (ctypes.c_int * count)(*[n for _, _, n, _ in calls]),
            (ctypes.c_void_p * count)(*[a for _, _, _, a in calls]))


def run_calls(calls: list[tuple[int | None, int, int, int]]) -> tuple[int, int]:
    """Make `calls` once through the compiled loop, binding nothing: (status, index of the failing
    call). For a layer run on its own; a segment keeps its arrays built (kiln/runtime/native.py)."""
    from kiln.kernels.cpu import onednn

    lib = onednn.load()
    functions, objects, nargs, args = call_arrays(calls)
    failed = ctypes.c_int(-1)
    nothing = (ctypes.c_void_p * 1)()
    status = load().kiln_run_segment(functions, ctypes.cast(lib.lib.dnnl_memory_set_data_handle, ctypes.c_void_p),
                                     lib.stream, 0, nothing, nothing, len(calls), objects, nargs, args,
                                     ctypes.byref(failed))
    return status, failed.value


def integer_field(kind: type) -> tuple[int, int] | None:
    """(how many, bytes each) of the C integers or addresses a plan field of ctypes type `kind` holds (an array,
    nested or not, holds its elements), or None when it holds anything else (a float): what a native segment's view
    may write into a copy of a plan (kiln/runtime/native_views.py _PlanRewrite)."""
    count = 1
    while issubclass(kind, ctypes.Array):
        kind, count = kind._type_, count * kind._length_
    if kind not in (ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32):
        return None
    return count, ctypes.sizeof(kind)


class Replanned:
    """A bound call's plan at other sizes on the same memory objects (those of `source`, the call
    bound at the template's sizes): (function, plan), and what the plan points at kept alive."""

    __slots__ = ("_function", "_plan", "_source", "_keep", "__weakref__")  # a view over a segment keeps one a member

    def __init__(self, function: int, plan: ctypes.Structure, source: Any, *keep: Any):
        self._function, self._plan, self._source, self._keep = function, plan, source, keep

    def calls(self) -> list[tuple[int | None, int, int, int]]:
        return [(self._function, ctypes.addressof(self._plan), 0, 0)]

    def memory(self, role: Any) -> int:
        return self._source.memory(role)
