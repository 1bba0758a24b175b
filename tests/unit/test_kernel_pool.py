"""pool.c's kiln_parallel_for (the parallel loops of kiln's GEMM, attention and Elementwise kernels) against
OpenMP's loop and a single thread: the same items, so bitwise the same outputs; under calls from several
Python threads at once (one runs on the pool, the others alone); in a forked child (no workers inherited);
with 3 threads on 2 cores. Correctness only: what it buys on a loaded machine is in bench/results."""

from __future__ import annotations

import ctypes
import multiprocessing
import threading

import numpy as np
import pytest
import torch

from kiln.kernels.cpu import elementwise, gemm_native
from kiln.kernels.cpu import transformer as transformer_kernels
from tests.unit.test_tactics_cpu_transformer import prepared

pytestmark = pytest.mark.skipif(not gemm_native.available() or not transformer_kernels.available(),
                                reason="kiln's C kernels are not built")


def pool_enabled(value: int | None = None) -> int:
    flag = ctypes.c_int.in_dll(gemm_native.load(), "kiln_pool_enabled")
    if value is not None:
        flag.value = value
    return flag.value


def gemm_cases() -> list[tuple[gemm_native.PackedLinear, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    cases = []
    for m, k, n, small in ((256, 845, 1024, None), (12, 300, 700, None), (200, 300, 130, 0), (1, 64, 4000, None)):
        w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
        cases.append((gemm_native.PackedLinear(w, b, "Relu", small_m=small), torch.randn(m, k, generator=g)))
    return cases


def attention(q: torch.Tensor) -> torch.Tensor:
    launch, _, ctx = prepared("cpu.attention.native", "Attention", "kiln", [q, q * 0.5, q + 1], {"scale": 0.2}, set())
    return launch(ctx, q, q * 0.5, q + 1, scale=0.2)


@pytest.mark.parametrize("threads", [2, 3])
def test_pool_loops_match_openmp_and_one_thread_bitwise(threads):
    before = torch.get_num_threads()
    q = torch.randn(2, 4, 200, 36)
    ew = elementwise.Elementwise(["Mul i0 i1", "Add t0 i2"], {0: (1100, 1024), 1: (1100, 1024), 2: (1100, 1024)}, {})
    xs = {k: torch.randn(1100, 1024) for k in range(3)}
    results = {}
    previous = pool_enabled()
    try:
        for mode, (pool, n) in {"pool": (1, threads), "openmp": (0, threads), "one": (1, 1)}.items():
            pool_enabled(pool)
            torch.set_num_threads(n)
            results[mode] = [layer(x) for layer, x in gemm_cases()] + [attention(q), ew(xs)]
    finally:
        pool_enabled(previous)
        torch.set_num_threads(before)
    for mode in ("openmp", "one"):
        for got, want in zip(results["pool"], results[mode]):
            assert torch.equal(got, want), mode


@pytest.fixture
def on_the_pool():
    """kiln's pool for the test (it is the default only on a busy machine: kiln/openmp.py)."""
    previous = pool_enabled(1)
    yield
    pool_enabled(previous)


def test_calls_from_several_threads_at_once_are_all_right(on_the_pool):
    cases = gemm_cases()
    wants = [layer(x) for layer, x in cases]
    failures: list[str] = []

    def work(seed: int) -> None:
        for i in range(8):
            j = (seed + i) % len(cases)
            if not torch.equal(cases[j][0](cases[j][1]), wants[j]):
                failures.append(f"thread {seed}, call {i}, case {j}")

    threads = [threading.Thread(target=work, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a call never returned"
    assert not failures, failures


def _child(layer, x, queue) -> None:
    # no torch op here: libgomp (torch's OpenMP) is not fork-safe, a reduction in the child hangs whatever kiln does
    queue.put(layer(x).numpy().astype(np.float64).sum())


def test_a_forked_child_starts_its_own_workers(on_the_pool):
    layer, x = gemm_cases()[0]
    want = layer(x).numpy().astype(np.float64).sum()  # the parent's workers are running
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_child, args=(layer, x, queue))
    child.start()
    child.join(timeout=120)
    assert child.exitcode == 0
    assert queue.get(timeout=5) == want


def test_the_workers_spin_window_follows_loops_that_come_back_to_back():
    """pool.c's kiln_pool_spin_window: twice the longest of the last gaps between loops while all are under half the
    follow limit, else the short 30 us poll; never under it."""
    window = gemm_native.load().kiln_pool_spin_window

    def spin(gaps: list[int], follow: int) -> int:
        return window((ctypes.c_long * len(gaps))(*gaps), len(gaps), follow)

    engine_calls = [4_000, 150_000, 3_000, 160_000]  # an LSTM's two layers a call, ~0.15 ms between calls
    assert spin(engine_calls, 1_000_000) == 320_000  # awake through the next call's gap
    assert spin(engine_calls, 300_000) == 30_000  # a gap past half the limit: calls are not back to back
    assert spin(engine_calls, 0) == 30_000  # follow off: the form before
    assert spin([1_000, 2_000, 500, 0], 1_000_000) == 30_000  # never under the short poll
    assert spin([2**62, 1_000, 1_000, 1_000], 1_000_000) == 30_000  # after a first loop (no gap yet)


def test_the_pool_is_kilns_default_only_on_a_busy_machine():
    kiln_pool_wanted = gemm_native.kiln_pool_wanted
    assert kiln_pool_wanted({}, load=0.3, cpus=2) is False  # quiet: OpenMP's loop
    assert kiln_pool_wanted({}, load=1.5, cpus=2) is True  # busy: the pool
    assert kiln_pool_wanted({"KILN_POOL": "1"}, load=0.0, cpus=2) is True  # the user decides
    assert kiln_pool_wanted({"KILN_POOL": "0"}, load=9.0, cpus=2) is False


def _pool_counters() -> dict[str, int]:
    out = (ctypes.c_long * 6)()
    gemm_native.load().kiln_pool_stats(out)
    return dict(zip(("loops", "worker_items", "wait_ns", "parks", "shared_items", "steps_aside"), out))


def _pin_process(cpus: set[int]) -> None:
    """Every thread of this process (the pool's workers included) onto `cpus`."""
    import os
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, PermissionError):
            pass  # a thread that just ended, or one another test's library owns


@pytest.mark.parametrize("step_aside", [1, 0])
def test_a_worker_woken_on_the_callers_cpu_leaves_the_items_to_it(on_the_pool, step_aside):
    """pool.c's kiln_pool_step_aside: with the process on one CPU (a worker can only wake on the caller's CPU, as the
    kernel places it where the other CPUs are busy), a worker runs no item when it is on (1); it runs some when it is
    off (0, the form before). The outputs are the same either way, bitwise, as one thread's."""
    import os
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no sched_setaffinity")
    lib = gemm_native.load()
    flag = ctypes.c_int.in_dll(lib, "kiln_pool_step_aside")
    g = torch.Generator().manual_seed(5)
    layer = gemm_native.PackedLinear(torch.randn(1024, 512, generator=g), torch.randn(1024, generator=g), "Relu")
    x = torch.randn(384, 512, generator=g)
    before, previous, allowed = torch.get_num_threads(), flag.value, os.sched_getaffinity(0)
    try:
        torch.set_num_threads(1)
        want = layer(x)
        torch.set_num_threads(2)
        layer(x)  # the workers started (they inherit nothing: _pin_process moves them)
        _pin_process({min(allowed)})
        flag.value = step_aside
        start = _pool_counters()
        outs = [layer(x) for _ in range(30)]
        end = _pool_counters()
    finally:
        _pin_process(allowed)
        flag.value = previous
        torch.set_num_threads(before)
    for out in outs:
        assert torch.equal(out, want)
    shared = end["shared_items"] - start["shared_items"]
    if step_aside:
        assert shared == 0
        assert end["steps_aside"] > start["steps_aside"]
    else:
        assert shared > 0
        assert end["steps_aside"] == start["steps_aside"]


@pytest.mark.parametrize("backoff_ns", [1_000_000, 0])
def test_loops_leave_a_worker_that_stepped_aside_asleep_for_a_while(on_the_pool, backoff_ns):
    """pool.c's kiln_pool_backoff_max_ns: on one CPU, back-to-back loops of ~0.1 ms wake the sleeping worker (which
    then steps aside) at most once a back-off (100 us doubling to 1 ms: the ramp's 4 wakes, then one a ms) with it, at
    most loops without it (0). The outputs stay one thread's, bitwise."""
    import os
    import time
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no sched_setaffinity")
    lib = gemm_native.load()
    backoff = ctypes.c_long.in_dll(lib, "kiln_pool_backoff_max_ns")
    g = torch.Generator().manual_seed(6)
    layer = gemm_native.PackedLinear(torch.randn(512, 128, generator=g), None, "")
    x = torch.randn(96, 128, generator=g)  # 6.3 M multiply-adds: split (past PARALLEL_MACS), ~0.1-0.2 ms
    before, previous, allowed = torch.get_num_threads(), backoff.value, os.sched_getaffinity(0)
    calls = 100
    try:
        torch.set_num_threads(1)
        want = layer(x)
        torch.set_num_threads(2)
        layer(x)
        _pin_process({min(allowed)})
        backoff.value = backoff_ns
        for _ in range(5):
            layer(x)
        time.sleep(0.02)  # the worker asleep, the back-off's state settled on this process's one CPU
        start, began = _pool_counters(), time.perf_counter()
        outs = [layer(x) for _ in range(calls)]
        elapsed_ms = (time.perf_counter() - began) * 1e3
        time.sleep(0.02)  # a worker woken by the last loops steps aside after them
        end = _pool_counters()
    finally:
        _pin_process(allowed)
        backoff.value = previous
        torch.set_num_threads(before)
    for out in outs:
        assert torch.equal(out, want)
    wakes = end["steps_aside"] - start["steps_aside"]
    assert end["shared_items"] == start["shared_items"]
    bound = 6 + elapsed_ms  # the ramp (0.1 + 0.2 + 0.4 + 0.8 ms), then one wake a ms at most, +1 for the first
    if backoff_ns:
        assert wakes <= bound, (wakes, elapsed_ms)
    else:  # at most loops: ~100 of 100 here alone (13-14 with the back-off), fewer where other work takes the CPU
        assert wakes > 0, (wakes, elapsed_ms)
