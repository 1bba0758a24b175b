"""Two execution contexts of one engine replaying their CUDA graphs at once, each on its own stream, as kiln serve's
instances do: both warmed up (captured) on this one thread first, then run from two threads. Before
kiln/runtime/capture_streams.py their graphs were all captured on torch.cuda.graph's one default stream by one thread,
so they shared torch's cuBLAS workspace and corrupted each other's split-K GEMMs (issue 14). Every answer is checked
against the answer its context gave to the same input alone, and those against a float64 oracle."""

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
# x max|y|: the same graph on the same input; a few fp16 ulps (2^-10 relative each) in case a split-K reduction's
# order varies; a workspace race leaves tiles of other sums, errors of the order of max|y|
ALONE_TOL = 4e-3
SECONDS = 3.0  # of concurrent runs
ROWS = (1, 2, 3, 5, 8, 13, 16)  # batch sizes: several bucket graphs, few rows (the GEMMs cuBLAS splits along K)
IN_FLIGHT = 8  # calls a thread queues on its stream before it waits and checks them


@pytest.fixture(scope="module")
def deep_engine():
    model, weights = deep_mlp()
    engine = kiln.build(model.SerializeToString(), device="cuda", precision="fp16", tuning_runs=3, tactics=CUBLAS_ONLY,
                        profiles=[{"x": ([1, DEEP_WIDTH], [8, DEEP_WIDTH], [16, DEEP_WIDTH])}])
    return engine, weights


def _alone(context, stream, variants):
    with torch.cuda.stream(stream):
        answers = [context.run({"x": x})["y"].clone() for x in variants]
    stream.synchronize()
    return answers


def test_two_contexts_replaying_at_once_each_answer_as_alone(deep_engine):
    engine, weights = deep_engine
    rng = np.random.default_rng()
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    contexts = [engine.create_execution_context() for _ in streams]
    for context, stream in zip(contexts, streams):  # kiln serve's Instance.warm_up: this thread, the instance's stream
        with torch.cuda.stream(stream):
            context.warm_up()
            context.warm_up()
        stream.synchronize()
    assert all(c.runner.stats.captures >= 2 for c in contexts)
    variants = [[torch.from_numpy(rng.standard_normal((rows, DEEP_WIDTH)).astype(np.float32)).cuda()
                 for rows in ROWS] for _ in contexts]  # each context its own inputs
    alone = [_alone(c, s, v) for c, s, v in zip(contexts, streams, variants)]
    for xs, answers in zip(variants, alone):
        for x, y in zip(xs, answers):
            want = deep_reference(weights, x.cpu().numpy())
            assert np.abs(y.cpu().numpy() - want).max() <= ORACLE_TOL * np.abs(want).max()
    counts, wrong, errors = [0, 0], [0, 0], []
    start = threading.Barrier(2)

    def serve(k: int) -> None:
        context, stream, xs, answers = contexts[k], streams[k], variants[k], alone[k]
        try:
            start.wait()
            deadline = time.perf_counter() + SECONDS
            i = 0
            while time.perf_counter() < deadline:
                pending = []
                with torch.cuda.stream(stream):
                    for _ in range(IN_FLIGHT):
                        j = i % len(xs)
                        pending.append((j, context.run({"x": xs[j]})["y"].clone()))  # the context's buffers: copied
                        i += 1
                stream.synchronize()
                for j, y in pending:
                    counts[k] += 1
                    scale = answers[j].abs().max()
                    if not (y - answers[j]).abs().max() <= ALONE_TOL * scale:
                        wrong[k] += 1
        except Exception as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    threads = [threading.Thread(target=serve, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    print(f"\ntwo contexts at once, {SECONDS:.0f} s: {counts} calls checked, {wrong} wrong")
    assert min(counts) > 100
    assert wrong == [0, 0], f"answers that differ from their context's answer alone: {wrong} of {counts}"
    captured_on = [c.runner.capture_stream(engine.device).cuda_stream for c in contexts]
    assert captured_on[0] != captured_on[1]
