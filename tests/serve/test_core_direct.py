"""ServerCore.infer's direct path (Batcher.run_now): a request that finds its model idle (nothing queued, its instance
inline, the first of its turn of the loop) runs at once on the calling thread, with no Pending future and no submit;
any other goes through the queue as before. Which path a request takes is decided by the batcher's state (the queue,
the idle instances, the turn), never by a time: instances go inline by their call count alone (INLINE_NS pinned)."""

from __future__ import annotations

import asyncio
import contextlib
import zlib
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from serve_models import MLP_W, OPSET, mlp

import kiln
from kiln.serve.core import InferRequest, ServerCore
from kiln.serve.errors import Unavailable
from kiln.serve.instances import INLINE_AFTER
from kiln.serve.repository import ModelRepository


@pytest.fixture(scope="module")
def double_repository(tmp_path_factory) -> Path:
    """y = 2x (FP32 [batch, 8]), dynamic batching with no queue delay, one CPU instance."""
    graph = helper.make_graph([helper.make_node("Mul", ["x", "two"], ["y"])], "double",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])],
                              [numpy_helper.from_array(np.array(2, np.float32), "two")])
    root = tmp_path_factory.mktemp("direct")
    (root / "double" / "1").mkdir(parents=True)
    engine = kiln.build(helper.make_model(graph, opset_imports=OPSET, ir_version=10).SerializeToString())
    engine.save(root / "double" / "1" / "model.kiln")
    (root / "double" / "config.pbtxt").write_text(
        "max_batch_size: 8\ndynamic_batching { }\ninstance_group [{ count: 1 kind: KIND_CPU }]\n")
    # mlp whose only profile starts at batch 4: a request of fewer rows runs padded, through the queue
    (root / "padded" / "1").mkdir(parents=True)
    kiln.build(mlp().SerializeToString(), profiles=[{"x": ([4, 8], [8, 8], [16, 8])}]).save(
        root / "padded" / "1" / "model.kiln")
    (root / "padded" / "config.pbtxt").write_text("max_batch_size: 16\ndynamic_batching { }\n")
    return root


@pytest.fixture(autouse=True)
def inline_by_count(monkeypatch):
    """Inline after INLINE_AFTER calls whatever their measured CPU time (these tests are of the path, not the choice)."""
    monkeypatch.setattr("kiln.serve.instances.INLINE_NS", 10**15)


def _counting_submit(batcher) -> list[int]:
    """Wraps the batcher's submit: the list's length is how many requests went through the queue."""
    calls: list[int] = []
    submit = batcher.submit

    def counted(*args, **kwargs):
        calls.append(1)
        return submit(*args, **kwargs)

    batcher.submit = counted
    return calls


async def _warm(core: ServerCore, model, generator, rows: int = 1) -> None:
    for _ in range(INLINE_AFTER + 2):
        x = generator.standard_normal((rows, 8)).astype(np.float32)
        await core.infer(InferRequest(model.name, inputs={"x": x}), model)
        await asyncio.sleep(0)
    assert model.batcher.instances[0].inline


@contextlib.asynccontextmanager
async def _warmed(repository: Path, generator, name: str = "double", models: list[str] | None = None, rows: int = 1):
    """A started core (`models`: start's list, None: every model) whose model `name` is warmed until its instance
    runs inline: (the core, the model, the count of requests queued from then on); the core closed after."""
    core = ServerCore(ModelRepository(repository))
    await core.start(models)
    model = core.model(name)
    try:
        await _warm(core, model, generator, rows)
        yield core, model, _counting_submit(model.batcher)
    finally:
        await core.close()


def test_an_idle_models_lone_request_runs_at_once_without_the_queue(double_repository):
    """One request per turn of the loop, the model idle: each is answered by run_now (never submit), with its own
    rows (fresh inputs, read-only ones as a received message's views), a timeout or none, and recorded as the
    queued path records a batch of one (a queue time of 0)."""
    generator = np.random.default_rng(zlib.crc32(b"direct-lone"))

    async def main() -> None:
        async with _warmed(double_repository, generator) as (core, model, queued):
            stats = model.stats
            calls, successes, queue = stats.execution_count, stats.success.count, (stats.queue.count, stats.queue.ns)
            n = 24
            answers = []
            for k in range(n):
                rows = 1 + k % 3
                x = generator.standard_normal((rows, 8)).astype(np.float32)
                if k % 2:
                    x.flags.writeable = False
                request = InferRequest("double", id=f"r{k}", inputs={"x": x}, timeout_us=10**7 if k % 4 == 0 else None)
                response = await core.infer(request, model)
                assert response.id == f"r{k}" and [name for name, _ in response.outputs] == ["y"]
                answers.append((x, response.outputs[0][1]))
                await asyncio.sleep(0)  # the next turn of the loop, as the next read's
            assert queued == []  # none went through the queue
            for x, y in answers:  # each its own: no answer is a buffer a later call wrote
                np.testing.assert_array_equal(y, 2 * x)
            assert stats.execution_count - calls == n and stats.success.count - successes == n
            assert (stats.queue.count, stats.queue.ns) == (queue[0] + n, queue[1])
            assert model.batcher.idle == model.batcher.instances and not model.batcher.pending

    asyncio.run(main())


def test_a_burst_in_one_turn_still_merges_behind_the_first(double_repository):
    """Requests started in one turn of the loop: the first runs at once, the others go through the queue and share
    the turn's dispatch (one call), each answered its own rows."""
    generator = np.random.default_rng(zlib.crc32(b"direct-burst"))

    async def main() -> None:
        async with _warmed(double_repository, generator) as (core, model, queued):
            calls = model.stats.execution_count
            xs = [generator.standard_normal((1, 8)).astype(np.float32) for _ in range(5)]
            tasks = [asyncio.get_running_loop().create_task(core.infer(InferRequest("double", inputs={"x": x}), model))
                     for x in xs]  # their first steps run in one turn
            responses = await asyncio.wait_for(asyncio.gather(*tasks), 60)
            for x, response in zip(xs, responses):
                np.testing.assert_array_equal(response.outputs[0][1], 2 * x)
            assert len(queued) == 4  # all but the first
            assert model.stats.execution_count - calls == 2  # the first alone, the other four merged

    asyncio.run(main())


def test_a_direct_calls_error_is_its_callers_alone(double_repository):
    """The engine failing on the direct path: that request gets the error (recorded as a BACKEND failure, its
    queue time 0), the instance is idle again and the next request runs at once; a closing batcher sends requests
    to submit, which refuses them."""
    generator = np.random.default_rng(zlib.crc32(b"direct-error"))

    async def main() -> None:
        async with _warmed(double_repository, generator) as (core, model, queued):
            instance = model.batcher.instances[0]
            real = instance.context.run

            def failing(feeds):
                raise RuntimeError("the engine failed")

            instance.context.run = failing
            queue_count = model.stats.queue.count
            x = generator.standard_normal((2, 8)).astype(np.float32)
            with pytest.raises(RuntimeError, match="the engine failed"):
                await core.infer(InferRequest("double", inputs={"x": x}), model)
            instance.context.run = real
            assert model.stats.failures_by_reason == {"BACKEND": 1} and model.stats.queue.count == queue_count + 1
            assert model.batcher.idle == [instance]
            await asyncio.sleep(0)
            response = await core.infer(InferRequest("double", inputs={"x": x}), model)
            np.testing.assert_array_equal(response.outputs[0][1], 2 * x)
            assert queued == []
            model.batcher.closing = True  # as close() sets it: nothing more runs, directly or queued
            try:
                await asyncio.sleep(0)
                with pytest.raises(Unavailable):
                    await core.infer(InferRequest("double", inputs={"x": x}), model)
                assert queued == [1]
            finally:
                model.batcher.closing = False

    asyncio.run(main())


def test_a_request_its_profile_holds_only_padded_goes_through_the_queue(double_repository):
    """run_now runs unpadded calls only: a 1- or 2-row request of a model whose profile starts at 4 rows is
    submitted (and run alone at submit, padded to 4: _run_batch), its rows cropped back; a 4-row one runs at once."""
    generator = np.random.default_rng(zlib.crc32(b"direct-padded"))

    async def main() -> None:
        async with _warmed(double_repository, generator, "padded", ["padded"], rows=4) as (core, model, queued):
            for k, rows in enumerate([1, 2, 4, 1, 4]):
                x = generator.standard_normal((rows, 8)).astype(np.float32)
                outputs = dict((await core.infer(InferRequest("padded", inputs={"x": x}), model)).outputs)
                np.testing.assert_array_equal(outputs["z"], 2 * x)
                np.testing.assert_allclose(outputs["y"], np.maximum(x @ MLP_W, 0), rtol=1e-5, atol=1e-5)  # FP32 GEMM
                assert len(queued) == [1, 2, 2, 3, 3][k]
                await asyncio.sleep(0)
            assert set(model.stats.batches) == {4}  # every call 4 rows

    asyncio.run(main())
