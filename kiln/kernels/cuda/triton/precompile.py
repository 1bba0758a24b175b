"""Compile the Triton kernels a set of launches needs in parallel processes, before the launches run them.

Why: Triton compiles a kernel the first time a launch needs it, on the launching thread, one kernel at a time.
A tactic search on an FP8 ResNet-50 at opt level 3 needs 74 distinct kernels (every tile config of the
implicit-GEMM convolution at each loop kind, epilogue and residual variant), 84 s of one core with ptxas
(bench/results/fp8-build-2026-12-05.md), on a machine with 16 cores idle. Compiled here by a pool of
worker processes, each kernel lands in Triton's on-disk cache, where the launch's own compile finds it (same
source, signature, constants, options and target: the same cache key) and only loads the cubin.

    with recorded_launches() as kernels:   # a launch that would compile records the compile, runs nothing
        launch(...)
    pool = CompilePool(workers=8)
    wait(pool.submit(kernels))             # each distinct kernel once, in worker processes
    launch(...)                            # the JIT's compile is a disk-cache hit

Recording uses Triton's own launch path (`knobs.runtime.jit_cache_hook`, which may skip a compile): the
signature, constants and options are what the JIT computed for that launch, in this Triton version. A kernel
this process already compiled is not recorded: its launch runs as usual. A kernel a worker cannot import by
module and name (one made at run time, kiln's elementwise kernels) is not recorded either: the JIT compiles it.
Nothing here decides what runs: a kernel missing from the disk cache is compiled by its launch as before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import os
import pickle
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from typing import Any

import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime import driver


@dataclasses.dataclass(frozen=True)
class KernelCompile:
    """One kernel as a launch's JIT would compile it: what a worker process needs to compile the same."""

    module: str  # the @triton.jit function, imported by the worker
    name: str
    signature: dict[str, str]
    constexprs: dict[tuple[int, ...], Any]  # argument path -> value
    attrs: dict[tuple[int, ...], Any]  # argument path -> specialization (divisibility)
    options: dict[str, Any]  # the backend's options (num_warps, num_stages, ...), as Triton serializes them
    target: GPUTarget

    @property
    def key(self) -> str:
        """Identity of the compile: two launches with equal keys need one kernel."""
        return json.dumps([self.module, self.name, self.signature, sorted(map(repr, self.constexprs.items())),
                           sorted(map(repr, self.attrs.items())), self.options, repr(self.target)],
                          sort_keys=True, default=repr)


def _importable(jit_function: Any) -> tuple[str, str] | None:
    """(module, name) under which a worker finds this very function, else None (made at run time)."""
    module, name = jit_function.fn.__module__, jit_function.fn.__qualname__
    try:
        found = getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None
    return (module, name) if found is jit_function else None


@contextlib.contextmanager
def recorded_launches() -> Iterator[list[KernelCompile]]:
    """Inside, a Triton launch of this thread whose kernel this process has not compiled compiles nothing and runs
    nothing: the compile it needs is appended to the yielded list (once per distinct kernel). The launch returns None
    and its outputs are left as allocated: record on inputs whose results no one reads (a later op of the same launch
    reads them as they are: kiln's tactics index by their layer's inputs only, never by a kernel's output)."""
    recorded: dict[str, KernelCompile] = {}
    target = driver.active.get_current_target()
    recording = threading.get_ident()  # Triton's hook is process-wide: another thread's launches run as ever
    before = knobs.runtime.jit_cache_hook
    active = True

    def hook(*, fn, compile, **kwargs) -> bool:
        if not active or threading.get_ident() != recording:
            return bool(before(fn=fn, compile=compile, **kwargs)) if before is not None else False
        where = _importable(fn.jit_function)
        if where is None:
            return False  # compiled by the JIT now, as without recording
        serialized = json.loads(compile["specialization_data"])
        kernel = KernelCompile(module=where[0], name=where[1], signature=dict(compile["signature"]),
                               constexprs=dict(compile["constants"]), attrs=dict(compile["configs"][0]),
                               options=serialized["options"], target=target)
        recorded.setdefault(kernel.key, kernel)
        return True  # skip: no compile, no launch

    knobs.runtime.jit_cache_hook = hook
    kernels: list[KernelCompile] = []
    try:
        yield kernels
    finally:
        active = False  # a pass-through from now on, wherever it stays chained (a recording of another thread's)
        if knobs.runtime.jit_cache_hook is hook:
            knobs.runtime.jit_cache_hook = before
        kernels.extend(recorded.values())


def compile_kernel(kernel: KernelCompile) -> float:
    """Compile one kernel into Triton's disk cache (what a worker does); seconds taken."""
    start = time.perf_counter()
    fn = getattr(importlib.import_module(kernel.module), kernel.name)
    backend = make_backend(kernel.target)
    # as JITFunction.preload reads serialized options back: JSON lists are the options' tuples
    options = backend.parse_options({k: tuple(v) if isinstance(v, list) else v for k, v in kernel.options.items()})
    triton.compile(ASTSource(fn, kernel.signature, kernel.constexprs, kernel.attrs), target=kernel.target,
                   options=options.__dict__)
    return time.perf_counter() - start


def default_workers() -> int:
    """Processes to compile with: the cores this process may use, less one for the build itself."""
    return max(1, len(os.sched_getaffinity(0)) - 1)


class CompilePool:
    """Worker processes that compile kernels into this process's Triton disk cache.

    Each worker is `python -m kiln.kernels.cuda.triton.precompile`, fed pickled KernelCompiles on its stdin (a
    fresh interpreter: the parent may hold a CUDA context, and multiprocessing's spawn would re-run an unguarded
    __main__ in every worker); started on the first submit, ended by `close`. `submit` does not wait: the build
    goes on (the first layers are timed) while later layers' kernels compile."""

    def __init__(self, workers: int | None = None):
        self.workers = workers or default_workers()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._futures: dict[str, Future] = {}
        self.submitted: list[KernelCompile] = []  # each distinct kernel once, in the order submitted

    def submit(self, kernels: Iterable[KernelCompile]) -> list[Future]:
        """A future per kernel (seconds it took, or the compile's error), each distinct kernel compiled once."""
        if not self._threads:
            self._threads = [threading.Thread(target=self._serve, daemon=True) for _ in range(self.workers)]
            for thread in self._threads:
                thread.start()
        futures = []
        for kernel in kernels:
            if kernel.key not in self._futures:
                self._futures[kernel.key] = Future()
                self.submitted.append(kernel)
                self._jobs.put((kernel, self._futures[kernel.key]))
            futures.append(self._futures[kernel.key])
        return futures

    @property
    def seconds(self) -> float:
        """Compile time of the kernels done, summed over the workers: what the launching thread would have spent."""
        return sum(f.result() for f in self._futures.values() if f.done() and not f.cancelled() and not f.exception())

    def _serve(self) -> None:
        """One worker process, fed jobs until `close`; every future it takes is settled, the worker dead or not."""
        environment = {**os.environ, "TRITON_CACHE_DIR": knobs.cache.dir,  # this process's cache, wherever set
                       "PYTHONPATH": os.pathsep.join(sys.path)}  # kiln as this process imports it
        worker = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  env=environment)
        died = None
        while (job := self._jobs.get()) is not None:
            kernel, future = job
            if died is not None:  # its launch compiles it, as without a pool
                future.set_exception(RuntimeError(died))
                continue
            try:
                request = pickle.dumps(kernel)
            except Exception as e:  # noqa: BLE001  a constant that does not pickle: the launch compiles it
                future.set_exception(e)
                continue
            try:
                worker.stdin.write(request)
                worker.stdin.flush()
                ok, value = pickle.load(worker.stdout)
            except (OSError, EOFError, pickle.UnpicklingError) as e:
                died = f"the compile worker exited ({type(e).__name__}: {e})"
                future.set_exception(RuntimeError(died))
                continue
            if ok:
                future.set_result(value)
            else:
                future.set_exception(RuntimeError(value))
        try:
            worker.stdin.close()
        except OSError:
            pass  # it had exited
        worker.wait()

    def close(self) -> None:
        """End the workers once the compiles they hold are done; the ones not started are dropped (a search that
        stopped early needs none of them; a launch compiles what it needs)."""
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job[1].cancel()
        for _ in self._threads:
            self._jobs.put(None)
        for thread in self._threads:
            thread.join()
        self._threads = []


def _serve_parent() -> None:
    """A worker's loop: a pickled KernelCompile in, (True, seconds) or (False, error) out, until stdin closes.
    Triton's own prints go to stderr: stdout carries the answers only."""
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    sys.stdout = sys.stderr
    while True:
        try:
            kernel = pickle.load(sys.stdin.buffer)
        except EOFError:
            return
        try:
            answer = (True, compile_kernel(kernel))
        except Exception as e:  # noqa: BLE001  reported to the parent; the launch compiles it and raises there
            answer = (False, f"{type(e).__name__}: {str(e)[:500]}")
        pickle.dump(answer, answers)
        answers.flush()


if __name__ == "__main__":
    _serve_parent()
