"""kiln's thread pool (kiln/kernels/cpu/pool.c): every item of a loop runs exactly once, on the caller and
its helpers, loop after loop (a late helper never runs an item of the next loop), with a second caller
running its loop itself while the pool is busy; and the kernels that use it give the results of their
OpenMP loops bit for bit (the same tiles, other threads)."""

from __future__ import annotations

import ctypes
import os
import threading

import numpy as np
import pytest
import torch

from kiln.kernels.cpu import gemm_native, pool

pytestmark = pytest.mark.skipif(pool.load() is None, reason=f"kiln's pool: {pool.reason()}")

ITEM = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_long)


def parallel_for(items: int, threads: int, fn) -> None:
    lib = pool.load()
    lib.kiln_parallel_for.argtypes = [ctypes.c_long, ctypes.c_int, ITEM, ctypes.c_void_p]
    lib.kiln_parallel_for(items, threads, fn, None)


def test_every_item_runs_once_loop_after_loop():
    rng = np.random.default_rng()
    for _ in range(60):
        items, threads = int(rng.integers(0, 40)), int(rng.integers(1, 5))
        counts = np.zeros(max(items, 1), np.int64)
        runners: set[int] = set()

        def item(_ctx, i, counts=counts):
            counts[i] += 1  # the GIL serializes the callbacks: no lost update
            runners.add(threading.get_ident())

        parallel_for(items, threads, ITEM(item))
        assert (counts[:items] == 1).all(), (items, threads, counts)
    assert pool.load().kiln_pool_helpers() >= 1


def test_a_second_caller_runs_its_loop_while_the_pool_is_busy():
    counts = {k: np.zeros(50, np.int64) for k in range(4)}
    failures: list[BaseException] = []

    def caller(k: int) -> None:
        try:
            def item(_ctx, i):
                counts[k][i] += 1
            fn = ITEM(item)
            for _ in range(20):
                parallel_for(50, 2, fn)
        except BaseException as e:  # noqa: BLE001  reported below, in the test's thread
            failures.append(e)

    workers = [threading.Thread(target=caller, args=(k,)) for k in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
    assert not failures and all(not w.is_alive() for w in workers)
    assert all((c == 20).all() for c in counts.values())


@pytest.mark.skipif(not gemm_native.available(), reason="kiln's GEMM is not built")
@pytest.mark.parametrize("m, k, n", [(197, 768, 1000), (7, 64, 300), (300, 3100, 96)])
def test_gemm_through_the_pool_equals_its_openmp_loop(m, k, n):
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        w, b, x = torch.randn(n, k), torch.randn(n), torch.randn(m, k)
        layer = gemm_native.PackedLinear(w, b, activation="Gelu", small_m=0 if k > 3000 else None)
        plan, _scratch = layer.plan(m)
        outputs = []
        for parallel_for_address in (pool.parallel_for(), None):
            y = torch.empty(m, n)
            plan.src, plan.dst, plan.parallel_for = x.data_ptr(), y.data_ptr(), parallel_for_address
            assert layer._lib.kiln_gemm(ctypes.byref(plan), None, 0, None) == 0
            outputs.append(y)
        assert torch.equal(outputs[0], outputs[1])
        torch.testing.assert_close(outputs[0], torch.nn.functional.gelu(x @ w.T + b), atol=1e-4, rtol=1e-4)
    finally:
        torch.set_num_threads(threads)


def test_idle_spin_follows_libgomp_settings():
    assert pool.spin_ns({"OMP_WAIT_POLICY": "PASSIVE"}) == 0
    assert pool.spin_ns({"GOMP_SPINCOUNT": "10000"}) == 10_000
    assert pool.spin_ns({}) == pool.DEFAULT_SPIN_NS
    assert pool.spin_ns({"OMP_WAIT_POLICY": "active"}) > pool.DEFAULT_SPIN_NS


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork")
def test_a_forked_child_makes_helpers_of_its_own():
    def item(_ctx, i):
        pass

    fn = ITEM(item)
    parallel_for(8, 2, fn)  # the parent's helpers exist
    pid = os.fork()
    if pid == 0:  # the child: its loop must finish (no helper of the parent's to wait for)
        try:
            counts = np.zeros(16, np.int64)

            def child_item(_ctx, i):
                counts[i] += 1

            parallel_for(16, 2, ITEM(child_item))
            os._exit(0 if (counts == 1).all() else 1)
        except BaseException:  # noqa: BLE001
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
