"""A CUDA context's numpy calls through its host staging (kiln/runtime/host_staging.py, issue 14) on the GPU: the
answers bitwise those of the pageable path (the same graph replayed on the same input), each the caller's own array,
unchanged by later calls; the buffers made at warm-up; two contexts on two threads and streams at once, staged, every
answer as its context's answer alone, and those against a float64 oracle. The CPU's stand-in tests:
tests/unit/test_host_staging.py."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

import kiln
from tests.gpu.common import CUBLAS_ONLY, DEEP_WIDTH, deep_mlp, deep_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ORACLE_TOL = 2e-2  # x max|y|: fp16 storage between 8 GEMMs of fp32 accumulation (tests/gpu's fp16 tolerance)
ALONE_TOL = 4e-3  # x max|y|: the same graph on the same input (test_concurrent_contexts.py: split-K order may vary)
ROWS = (1, 3, 8, 13, 16)
SECONDS = 2.0


@pytest.fixture(scope="module")
def deep_engine():
    model, weights = deep_mlp()
    engine = kiln.build(model.SerializeToString(), device="cuda", precision="fp16", tuning_runs=3, tactics=CUBLAS_ONLY,
                        profiles=[{"x": ([1, DEEP_WIDTH], [8, DEEP_WIDTH], [16, DEEP_WIDTH])}])
    return engine, weights


@pytest.mark.parametrize("mode", ["copy", "pinned"])
def test_staged_numpy_calls_are_the_pageable_paths_bitwise(deep_engine, mode):
    engine, weights = deep_engine
    context = engine.create_execution_context(host_staging=mode)
    context.warm_up()
    staging = context._host_staging
    assert staging is not None and staging.mode == mode
    assert sorted(staging.buffers) == [("input", "x"), ("output", "y")]  # made at warm-up, at 16 rows
    made = {key: b.data_ptr() for key, b in staging.buffers.items()}
    rng = np.random.default_rng()
    kept = []
    for rows in ROWS + ROWS:
        x = rng.standard_normal((rows, DEEP_WIDTH)).astype(np.float32)
        context.host_staging = mode
        got = context.run({"x": x})["y"]
        context.host_staging = "off"
        want = context.run({"x": x})["y"]
        assert type(got) is np.ndarray and got.dtype == want.dtype and got.shape == want.shape == (rows, DEEP_WIDTH)
        assert got.tobytes() == want.tobytes(), rows
        oracle = deep_reference(weights, x)
        assert np.abs(got - oracle).max() <= ORACLE_TOL * np.abs(oracle).max()
        kept.append((got, want.copy()))
    assert all(got.tobytes() == want.tobytes() for got, want in kept)  # later calls changed no array handed back
    assert {key: b.data_ptr() for key, b in staging.buffers.items()} == made  # no call grew a buffer


def test_two_staged_contexts_at_once_each_answer_as_alone(deep_engine):
    engine, weights = deep_engine
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    contexts = [engine.create_execution_context(host_staging="copy") for _ in streams]
    for context, stream in zip(contexts, streams):  # kiln serve's Instance.warm_up: this thread, the instance's stream
        with torch.cuda.stream(stream):
            context.warm_up()
            context.warm_up()
        stream.synchronize()
    rng = np.random.default_rng()
    variants = [[rng.standard_normal((rows, DEEP_WIDTH)).astype(np.float32) for rows in ROWS] for _ in contexts]
    alone = []
    for context, stream, xs in zip(contexts, streams, variants):
        with torch.cuda.stream(stream):
            alone.append([context.run({"x": x})["y"] for x in xs])
        for x, y in zip(xs, alone[-1]):
            want = deep_reference(weights, x)
            assert np.abs(y - want).max() <= ORACLE_TOL * np.abs(want).max()
    counts, wrong, errors = [0, 0], [0, 0], []
    start = threading.Barrier(2)

    def serve(k: int) -> None:
        try:
            start.wait()
            deadline = time.perf_counter() + SECONDS
            i = 0
            with torch.cuda.stream(streams[k]):
                while time.perf_counter() < deadline:
                    j = i % len(ROWS)
                    y = contexts[k].run({"x": variants[k][j]})["y"]  # numpy out: done when it returns
                    counts[k] += 1
                    if not np.abs(y - alone[k][j]).max() <= ALONE_TOL * np.abs(alone[k][j]).max():
                        wrong[k] += 1
                    i += 1
        except Exception as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    threads = [threading.Thread(target=serve, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    print(f"\ntwo staged contexts at once, {SECONDS:.0f} s: {counts} calls checked, {wrong} wrong")
    assert min(counts) > 50
    assert wrong == [0, 0], f"answers that differ from their context's answer alone: {wrong} of {counts}"
