"""Dynamic batching: requests merged into engine calls never mix. The batcher alone (no network:
what it merges, pads and cuts), then a bounded concurrent load over HTTP and gRPC at once where
every response is checked against its own request's input."""

from __future__ import annotations

import asyncio
import gc
import time
import zlib

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from conftest import run_clients
from onnx import TensorProto, helper, numpy_helper
from serve_models import OPSET, mlp

import kiln
from kiln.serve import batcher as batcher_module
from kiln.serve.batcher import Batcher, BatchShapes, merge_rows
from kiln.serve.config import DynamicBatching, complete, parse_pbtxt
from kiln.serve.instances import INLINE_AFTER, Instance
from kiln.serve.stats import ModelStats


def _double_seq():
    """y = 2x, x FP32 [batch, seq]: requests of different seq must not share a call."""
    graph = helper.make_graph([helper.make_node("Mul", ["x", "two"], ["y"])], "double",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq"])],
                              [numpy_helper.from_array(np.array(2, np.float32), "two")])
    return helper.make_model(graph, opset_imports=OPSET, ir_version=10)


@pytest.fixture(scope="module")
def double_engine():
    return kiln.build(_double_seq().SerializeToString(), profiles=[{"x": ([1, 1], [4, 8], [16, 64])}])


@pytest.fixture(scope="module")
def padded_engine():
    """mlp whose only profile starts at batch 4: smaller batches are padded up to it."""
    return kiln.build(mlp().SerializeToString(), profiles=[{"x": ([4, 8], [8, 8], [16, 8])}])


def _config(engine, text: str, name: str = "m"):
    return complete(parse_pbtxt(text, "test") if text else None, engine, name)


async def _run(batcher: Batcher, requests: list[np.ndarray], signature=None) -> list[dict]:
    """Queue every request before the batcher's loop first runs, then let it work."""
    batcher.start()
    pending = [batcher.submit({"x": x}, x.shape[0], signature or (tuple(x.shape[1:]),), None) for x in requests]
    try:
        return await asyncio.wait_for(asyncio.gather(*(p.future for p in pending)), 60)
    finally:
        await batcher.close()


@pytest.mark.parametrize("held_bytes", [1 << 20, 64], ids=["held", "numpy"])
@pytest.mark.parametrize("row", [(3, 5), (20, 30)], ids=["small", "large"])
def test_merge_rows_is_concatenate(monkeypatch, held_bytes, row):
    """The batch merge, parts copied with the GIL held (up to HELD_COPY_BYTES) or by numpy (larger), or, where every
    part is small (NUMPY_HELD_ELEMENTS: rows of 15 elements here, of 600 in "large"), by one np.concatenate: exactly
    np.concatenate's rows for every plain dtype, read-only parts (views of requests) included, into a writable
    array of its own; other dtypes, shapes that differ and non-contiguous parts take np.concatenate itself."""
    import ml_dtypes

    monkeypatch.setattr(batcher_module, "HELD_COPY_BYTES", held_bytes)
    generator = np.random.default_rng()
    for dtype in (np.float16, np.float32, np.float64, np.int8, np.int32, np.int64, np.uint8, np.bool_):
        parts = [(generator.standard_normal((int(generator.integers(0, 4)), *row)) * 50).astype(dtype)
                 for _ in range(6)]
        parts[1].flags.writeable = False
        merged = merge_rows(parts)
        assert merged.dtype == dtype and merged.flags.writeable and merged.flags.c_contiguous
        assert not any(np.shares_memory(merged, part) for part in parts)
        np.testing.assert_array_equal(merged, np.concatenate(parts))
    odd = [[np.ones((2, 3), ml_dtypes.bfloat16), np.zeros((1, 3), ml_dtypes.bfloat16)],
           [np.array([[b"ab"], [b""]], dtype=object), np.array([[b"c"]], dtype=object)],
           [generator.standard_normal((3, 4)).T.astype(np.float32), np.ones((1, 3), np.float32)]]
    for parts in odd:
        np.testing.assert_array_equal(merge_rows(parts), np.concatenate(parts))
    with pytest.raises(ValueError):  # shapes past the batch axis that differ: numpy's error, never a wrong merge
        merge_rows([np.ones((1, 3), np.float32), np.ones((1, 4), np.float32)])


def test_queued_requests_merge_into_one_call_and_split_back(double_engine):
    config = _config(double_engine, "max_batch_size: 16\ndynamic_batching {}")
    stats = ModelStats("m", "1")
    xs = [np.random.default_rng().standard_normal((rows, 8)).astype(np.float32) for rows in (1, 3, 2, 4)]
    results = asyncio.run(_run(Batcher(double_engine, config, stats, 64), xs))
    for x, out in zip(xs, results):
        np.testing.assert_array_equal(out["y"], 2 * x)
    assert stats.execution_count == 1 and stats.inference_count == 10
    assert list(stats.batches) == [10]


def test_call_phases_are_recorded_per_call_and_request(double_engine):
    """Every engine call records its phases once (gather .. answer), every request its queue and respond, on the
    thread path (handoff and return measured) and on the loop (none): counts that add up to the calls and requests
    run, non-negative durations, engine time no less than its thread's CPU time would allow, no GPU span on the CPU;
    and each request still gets exactly its own rows (2x its input, the engine alone)."""
    config = _config(double_engine, "max_batch_size: 16\ndynamic_batching {}")
    generator = np.random.default_rng()
    for inline in (False, True):
        stats = ModelStats("m", "1")
        batcher = Batcher(double_engine, config, stats, 64)
        if inline:  # the instance's calls run on the loop
            batcher.instances[0].calls = INLINE_AFTER + 1
            batcher.instances[0]._call_ns = 0.0
        xs = [generator.standard_normal((int(generator.integers(1, 4)), 8)).astype(np.float32) for _ in range(5)]
        results = asyncio.run(_run(batcher, xs))
        for x, out in zip(xs, results):
            np.testing.assert_array_equal(out["y"], double_engine.create_execution_context().run({"x": x})["y"])
        phases = stats.to_json()["call_phases"]
        assert phases["calls"] == stats.execution_count >= 1
        assert phases["requests"] == len(xs) and phases["rows"] == sum(x.shape[0] for x in xs)
        for name in ("gather", "handoff", "merge", "engine", "engine_cpu", "split", "return", "answer"):
            assert phases[name]["count"] == phases["calls"], name
            assert phases[name]["ns"] >= 0, name
        assert phases["gpu"]["count"] == 0  # a CPU instance has no GPU span
        assert phases["graph_calls"] == phases["graph_replays"] == 0  # nor CUDA graphs to count
        assert stats.to_json()["cuda_graphs"] == []
        assert phases["engine"]["ns"] > 0 and phases["queue"]["count"] == len(xs)
        if inline:
            assert phases["handoff"]["ns"] == 0 and phases["return"]["ns"] == 0
        else:
            assert phases["handoff"]["ns"] > 0 and phases["return"]["ns"] > 0


def test_different_shapes_never_share_a_call(double_engine):
    config = _config(double_engine, "max_batch_size: 16\ndynamic_batching {}")
    stats = ModelStats("m", "1")
    xs = [np.random.default_rng().standard_normal((2, seq)).astype(np.float32) for seq in (8, 16, 8, 16, 32)]

    async def run():
        batcher = Batcher(double_engine, config, stats, 64)
        batcher.start()
        pending = [batcher.submit({"x": x}, 2, ((x.shape[1],),), None) for x in xs]
        try:
            return await asyncio.wait_for(asyncio.gather(*(p.future for p in pending)), 60)
        finally:
            await batcher.close()

    for x, out in zip(xs, asyncio.run(run())):
        np.testing.assert_array_equal(out["y"], 2 * x)
    assert stats.execution_count == 3  # seq 8 (two requests), seq 16 (two), seq 32
    assert sorted(stats.batches) == [2, 4]


def test_max_batch_and_preferred_sizes_cut_batches(double_engine):
    config = _config(double_engine, "max_batch_size: 8\ndynamic_batching { preferred_batch_size: [4] }")
    stats = ModelStats("m", "1")
    xs = [np.random.default_rng().standard_normal((1, 8)).astype(np.float32) for _ in range(11)]
    for x, out in zip(xs, asyncio.run(_run(Batcher(double_engine, config, stats, 64), xs))):
        np.testing.assert_array_equal(out["y"], 2 * x)
    # 11 rows queued at once: cut at the preferred 4 each time (not the max 8); the last 3 alone
    assert stats.batches[4].compute_infer.count == 2 and stats.batches[3].compute_infer.count == 1


def test_without_dynamic_batching_each_request_runs_alone(double_engine):
    config = _config(double_engine, "max_batch_size: 8")
    stats = ModelStats("m", "1")
    xs = [np.random.default_rng().standard_normal((2, 8)).astype(np.float32) for _ in range(3)]
    for x, out in zip(xs, asyncio.run(_run(Batcher(double_engine, config, stats, 64), xs))):
        np.testing.assert_array_equal(out["y"], 2 * x)
    assert stats.execution_count == 3


def test_two_cpu_instances_run_calls_side_by_side(double_engine):
    """instance_group count 2 on the CPU: two execution contexts, each on its thread. Requests queued together while
    both are idle go one to each, and the two engine calls run at the same time: each call waits at a barrier for the
    other (serialized calls would break it after 30 s and fail their requests); each request gets its own rows."""
    import threading

    config = _config(double_engine, "max_batch_size: 8\ninstance_group [{ count: 2 kind: KIND_CPU }]")
    stats = ModelStats("m", "1")
    rng = np.random.default_rng(zlib.crc32(b"two-cpu-instances"))
    xs = [rng.standard_normal((int(rows), 8)).astype(np.float32) for rows in (1, 3)]
    together = threading.Barrier(2, timeout=30)
    ran_on: list[str] = []
    threads: list[str] = []

    async def run():
        batcher = Batcher(double_engine, config, stats, 64)
        assert len(batcher.instances) == 2 and not any(i.inline for i in batcher.instances)
        threads.extend(i.thread.name for i in batcher.instances)
        for instance in batcher.instances:
            real = instance.context.run

            def meeting(feeds, real=real):
                together.wait()
                ran_on.append(threading.current_thread().name)
                return real(feeds)

            instance.context.run = meeting
        return await _run(batcher, xs)

    for x, out in zip(xs, asyncio.run(run())):
        np.testing.assert_array_equal(out["y"], 2 * x)
    assert sorted(ran_on) == sorted(threads) and len(set(threads)) == 2 and stats.execution_count == 2


def _inline_by_count(monkeypatch) -> None:
    """Instances go inline after INLINE_AFTER calls whatever their calls' measured CPU time: these tests are of the
    inline path, not of the choice (test_inline_timing_skips_a_preempted_call_and_sees_slow_ones times that with set
    calls). Measured, one call's full collection in a long test process (tens of ms of this thread's CPU: 1/8 of it
    lands in the moving average) or its binding keeps the instance off the loop past the loop's last call."""
    monkeypatch.setattr("kiln.serve.instances.INLINE_NS", 10**15)


@pytest.mark.parametrize("batching", [False, True])
def test_inline_call_is_answered_at_submit(double_engine, batching, monkeypatch):
    """Once its calls run inline, a request that finds nothing queued is answered inside submit (its caller's
    await does not wait for the loop). Without dynamic batching every such request; with it (no queue delay) the
    first of a turn of the loop only, while requests come one at a time: the ones submitted after it in the same
    turn wait for the turn's dispatch and share one call, and once calls merge requests every request waits for
    the dispatch until a call runs one request again. Inline by the call count alone (_inline_by_count)."""
    _inline_by_count(monkeypatch)
    config = _config(double_engine, "max_batch_size: 8" + ("\ndynamic_batching {}" if batching else ""))
    generator = np.random.default_rng()

    async def run() -> None:
        stats = ModelStats("m", "1")
        batcher = Batcher(double_engine, config, stats, 64)
        batcher.start()
        try:
            for _ in range(INLINE_AFTER + 8):
                inline = batcher.instances[0].inline
                x = generator.standard_normal((2, 8)).astype(np.float32)
                pending = batcher.submit({"x": x}, 2, ((8,),), None)
                assert pending.future.done() == inline
                out = await asyncio.wait_for(pending.future, 60)
                np.testing.assert_array_equal(out["y"], 2 * x)
                await asyncio.sleep(0)  # the next turn of the loop
            assert inline  # the tiny model's calls went inline
            calls = stats.execution_count
            xs = [generator.standard_normal((1, 8)).astype(np.float32) for _ in range(4)]  # one turn: 4 requests
            pending = [batcher.submit({"x": x}, 1, ((8,),), None) for x in xs]
            assert [p.future.done() for p in pending] == [True, not batching, not batching, not batching]
            for x, out in zip(xs, await asyncio.wait_for(asyncio.gather(*(p.future for p in pending)), 60)):
                np.testing.assert_array_equal(out["y"], 2 * x)
            assert stats.execution_count - calls == (2 if batching else 4)  # alone, then the other three merged
            await asyncio.sleep(0)
            # calls merge requests now: with batching, every request waits for the turn's dispatch, until a call
            # runs one request again
            for turn in range(3):
                calls = stats.execution_count
                xs = [generator.standard_normal((1, 8)).astype(np.float32) for _ in range(4 if turn == 0 else 1)]
                pending = [batcher.submit({"x": x}, 1, ((8,),), None) for x in xs]
                assert [p.future.done() for p in pending] == [not batching or turn == 2] * len(xs)
                for x, out in zip(xs, await asyncio.wait_for(asyncio.gather(*(p.future for p in pending)), 60)):
                    np.testing.assert_array_equal(out["y"], 2 * x)
                assert stats.execution_count - calls == (1 if batching else len(xs))
                await asyncio.sleep(0)
        finally:
            await batcher.close()

    asyncio.run(run())


def test_alone_at_submit_answers_its_own_rows_and_records_as_a_batch(double_engine, padded_engine, monkeypatch):
    """The c=1 path (a request alone, its instance inline, run inside submit): each answer is its
    own request's (fresh inputs every request, read-only ones as a received message's views are, and a request
    the engine's output buffer would hand another's answer if it were reused), the statistics are what the general
    path records for a batch of one, a burst in one turn still merges behind the first request, and a request its
    profile holds only padded takes the general path (a call of 4 rows). Inline by the call count alone
    (_inline_by_count)."""
    _inline_by_count(monkeypatch)
    generator = np.random.default_rng(zlib.crc32(b"alone-at-submit"))

    async def run(engine, rows: int, width: int, output: str) -> None:
        stats = ModelStats("m", "1")
        batcher = Batcher(engine, _config(engine, "max_batch_size: 16\ndynamic_batching {}"), stats, 64)
        batcher.start()
        instance = batcher.instances[0]
        try:
            answers = []
            for k in range(INLINE_AFTER + 12):
                x = generator.standard_normal((rows, width)).astype(np.float32)
                if k % 2:
                    x.flags.writeable = False  # as a request's view of its message's bytes
                inline = instance.inline
                pending = batcher.submit({"x": x}, rows, ((width,),), None)
                assert pending.future.done() == inline
                out = (await asyncio.wait_for(pending.future, 60))[output]
                np.testing.assert_array_equal(out, 2 * x)
                assert pending.queue_ns is not None and pending.queue_ns >= 0
                answers.append((x, out))
                await asyncio.sleep(0)
            assert inline
            for x, out in answers:  # still each its own: no answer is a buffer a later call wrote
                np.testing.assert_array_equal(out, 2 * x)
            calls = len(answers)
            assert stats.execution_count == calls and stats.compute_infer.count == calls
            assert stats.compute_input.count == stats.compute_output.count == calls
            if engine is padded_engine:  # rows 1 and 2 padded to the profile's 4: never run alone unpadded
                assert list(stats.batches) == [4] and stats.inference_count == 4 * calls
                return
            assert list(stats.batches) == [rows] and stats.inference_count == rows * calls
            assert stats.batches[rows].compute_infer.count == calls and stats.batches[rows].compute_infer.ns > 0
            xs = [generator.standard_normal((1, width)).astype(np.float32) for _ in range(5)]  # one turn: 5 requests
            pending = [batcher.submit({"x": x}, 1, ((width,),), None) for x in xs]
            assert [p.future.done() for p in pending] == [True, False, False, False, False]
            outs = await asyncio.wait_for(asyncio.gather(*(p.future for p in pending)), 60)
            for x, out in zip(xs, outs):
                np.testing.assert_array_equal(out["y"], 2 * x)
            assert stats.execution_count == calls + 2 and stats.batches[4].compute_infer.count == 1
        finally:
            await batcher.close()

    asyncio.run(run(double_engine, 2, 8, "y"))
    asyncio.run(run(padded_engine, 1, 8, "z"))  # z = 2x


def test_inline_timing_skips_a_preempted_call_and_sees_slow_ones(double_engine):
    """An instance's calls are timed on the thread's CPU clock: a call that slept (wall time, no CPU, as one preempted
    on a busy machine) leaves the instance inline, calls that spend CPU take it back to its thread within two calls.
    The shape is bound before the count starts and the collector is off, so neither the first call's binding nor a
    full collection in a long test process (both CPU of this thread) lands in the average (CI flaked on one)."""
    instance = Instance(double_engine, "m", 0, run=None, finish=None)
    x = {"x": np.random.default_rng().standard_normal((2, 8)).astype(np.float32)}
    real = instance.context.run
    for _ in range(3):
        real(x)
    collecting = gc.isenabled()
    gc.collect()
    gc.disable()

    def asleep(feeds):
        time.sleep(0.02)  # 20 ms of wall time, no CPU: as a call preempted on a busy machine
        return real(feeds)

    def busy(feeds):
        end = time.thread_time() + 0.002  # 2 ms of this thread's CPU
        while time.thread_time() < end:
            pass
        return real(feeds)

    try:
        for _ in range(INLINE_AFTER + 1):
            np.testing.assert_array_equal(instance.execute(x)["y"], 2 * x["x"])
        assert instance.inline
        instance.context.run = asleep
        instance.execute(x)
        assert instance.inline
        instance.context.run = real
        instance.execute(x)  # timed on the CPU clock: fast
        assert instance.inline
        instance.context.run = busy
        instance.execute(x)
        np.testing.assert_array_equal(instance.execute(x)["y"], 2 * x["x"])
        assert not instance.inline
    finally:
        if collecting:
            gc.enable()
        instance.stop()


def test_batches_below_the_profile_are_padded_and_cropped(padded_engine):
    config = _config(padded_engine, "")
    assert config.max_batch_size == 16
    shapes = BatchShapes(padded_engine, config)
    assert shapes.padded(((8,),), 1) == 4 and shapes.padded(((8,),), 9) == 9 and shapes.padded(((8,),), 17) is None
    stats = ModelStats("m", "1")
    xs = [np.random.default_rng().standard_normal((1, 8)).astype(np.float32)]
    (out,) = asyncio.run(_run(Batcher(padded_engine, config, stats, 64), xs))
    assert out["z"].shape == (1, 8)
    np.testing.assert_array_equal(out["z"], 2 * xs[0])
    assert list(stats.batches) == [4] and stats.inference_count == 4  # the engine call ran 4 rows


def test_buckets_parameter_pads_calls_inside_the_runtime(double_engine):
    config = _config(double_engine, 'max_batch_size: 16\ndynamic_batching {}\n'
                                    'parameters { key: "buckets" value: { string_value: "true" } }')
    stats = ModelStats("m", "1")
    batcher = Batcher(double_engine, config, stats, 64)
    assert batcher.instances[0].context.buckets is not None
    xs = [np.random.default_rng().standard_normal((rows, 5)).astype(np.float32) for rows in (1, 2)]
    for x, out in zip(xs, asyncio.run(_run(batcher, xs))):
        np.testing.assert_array_equal(out["y"], 2 * x)  # 3 rows ran as a batch of 4 inside, cropped back


def test_queue_bound_refuses_at_once(double_engine):
    from kiln.serve.errors import QueueFull

    config = _config(double_engine, "max_batch_size: 8\ndynamic_batching { default_queue_policy { max_queue_size: 2 } }")

    async def run():
        batcher = Batcher(double_engine, config, ModelStats("m", "1"), 1024)
        batcher.start()
        x = np.ones((1, 8), np.float32)
        first = [batcher.submit({"x": x}, 1, ((8,),), None) for _ in range(2)]
        with pytest.raises(QueueFull, match="maximum of 2"):
            batcher.submit({"x": x}, 1, ((8,),), None)
        await asyncio.gather(*(p.future for p in first))
        batcher.submit({"x": x}, 1, ((8,),), None)  # room again
        await batcher.close()

    asyncio.run(run())


def test_masked_sequences_of_different_lengths_share_a_call_and_are_cropped_back():
    """BERT tiny: an attention mask covers the sequence, so zero padding is exact there; requests of
    seq 9..16 (one bucket) merge into one call padded to 16, each answer cropped to its own length
    and equal to the engine run on that request alone; seq 40 (another bucket) runs on its own."""
    from kiln import zoo

    engine = kiln.build(str(zoo.export("bert_tiny", dynamic=True).path))
    config = _config(engine, "")
    stats = ModelStats("bert", "1")
    rng = np.random.default_rng()
    requests = []
    for batch, seq in ((1, 9), (2, 16), (1, 12), (2, 40), (1, 13)):
        ids = rng.integers(0, 1000, (batch, seq))
        mask = np.ones((batch, seq), np.int64)
        mask[:, seq - 2:] = 0  # the requests' own padding too
        requests.append({"input_ids": ids, "attention_mask": mask})

    async def run():
        batcher = Batcher(engine, config, stats, 64)
        batcher.start()
        pending = [batcher.submit(r, r["input_ids"].shape[0], tuple(a.shape[1:] for a in r.values()), None)
                   for r in requests]
        try:
            return await asyncio.wait_for(asyncio.gather(*(p.future for p in pending)), 60)
        finally:
            await batcher.close()

    output = engine.output_names[0]
    for request, answer in zip(requests, asyncio.run(run())):
        alone = engine.run(request)[output]
        assert answer[output].shape == alone.shape
        # padded keys are masked out; only fp32 summation order differs from the call alone
        np.testing.assert_allclose(answer[output], alone, rtol=1e-4, atol=1e-4)
    assert stats.execution_count == 2 and sorted(stats.batches) == [2, 5]  # seq 9-16 (5 rows), seq 40 (2)


def test_config_default_batching_is_inferred(double_engine):
    config = _config(double_engine, "")
    assert config.max_batch_size == 16 and config.dynamic_batching == DynamicBatching()
    assert [t.dims for t in config.inputs] == [[-1]]


# ---- a bounded concurrent load over the network ---------------------------------------------------

CLIENTS, REQUESTS = 16, 20


def test_concurrent_clients_each_get_their_own_rows(grpc_server, engine_of):
    """16 clients (half HTTP binary/JSON, half gRPC) x 20 requests of 1..4 rows, all at once."""
    server = grpc_server
    http = httpclient.InferenceServerClient(f"127.0.0.1:{server.ports.http}", network_timeout=60)
    engine = engine_of("mlp", "2")
    before = http.get_inference_statistics("mlp")["model_stats"][0]
    failures: list[str] = []
    rows_sent = [0] * CLIENTS

    def client(k: int) -> None:
        rng = np.random.default_rng(k)
        use_grpc = k % 2 == 1
        module = grpcclient if use_grpc else httpclient
        address = f"127.0.0.1:{server.ports.grpc if use_grpc else server.ports.http}"
        connection = module.InferenceServerClient(address)
        try:
            for n in range(REQUESTS):
                x = rng.standard_normal((int(rng.integers(1, 5)), 8)).astype(np.float32)
                tensor = module.InferInput("x", list(x.shape), "FP32")
                if use_grpc:
                    tensor.set_data_from_numpy(x)
                else:
                    tensor.set_data_from_numpy(x, binary_data=n % 2 == 0)
                result = connection.infer("mlp", [tensor], request_id=f"{k}-{n}")
                rows_sent[k] += x.shape[0]
                z, y = result.as_numpy("z"), result.as_numpy("y")
                if z.shape != x.shape or not np.array_equal(z, 2 * x):
                    failures.append(f"client {k} request {n}: z is not 2x of its own input")
                elif not np.allclose(y, engine.run({"x": x})["y"], rtol=1e-5, atol=1e-6):
                    # fp32 GEMM rounding differs across batch sizes; a mixed-up row is off by O(1)
                    failures.append(f"client {k} request {n}: y differs from the engine run alone")
        except Exception as e:  # noqa: BLE001 - reported below with the client's name
            failures.append(f"client {k}: {type(e).__name__}: {e}")
        finally:
            connection.close()

    run_clients(client, CLIENTS, 120, failures)
    after = http.get_inference_statistics("mlp")["model_stats"][0]
    requests = after["inference_stats"]["success"]["count"] - before["inference_stats"]["success"]["count"]
    assert requests == CLIENTS * REQUESTS
    assert after["inference_count"] - before["inference_count"] == sum(rows_sent)
    assert after["execution_count"] - before["execution_count"] < requests  # some requests shared a call
    calls = after["call_phases"]["calls"] - before["call_phases"]["calls"]
    assert calls == after["execution_count"] - before["execution_count"]
    assert after["call_phases"]["queue"]["count"] - before["call_phases"]["queue"]["count"] == requests
    responded = after["call_phases"]["respond"]["count"] - before["call_phases"]["respond"]["count"]
    assert 0 < responded <= requests  # answered from a call's future (not a lone request run at once: run_now)
    assert http.is_server_ready()
    http.close()


def test_64_clients_50_requests_of_mixed_models_shapes_and_protocols(server, engine_of):
    """Issue 14's bounded load: 64 clients x 50 requests at once (a third each HTTP binary, HTTP JSON and gRPC), each
    request to mlp (FP32) or half (FP16 and BF16 in, FP32 and BF16 out) with 1..4 rows, drawn per request; every
    answer checked against its own input (exact where the model is: 2x, x + 1 and its bfloat16 rounding; mlp's
    GEMM against the engine run on the request alone) and the statistics count every request once."""
    import ml_dtypes

    count, per_client = 64, 50
    http = httpclient.InferenceServerClient(f"127.0.0.1:{server.ports.http}", network_timeout=120)
    before = {m: http.get_inference_statistics(m)["model_stats"][0] for m in ("mlp", "half")}
    mlp_engine = engine_of("mlp")
    failures: list[str] = []
    sent = {"mlp": [0] * count, "half": [0] * count}

    def client(k: int) -> None:
        rng = np.random.default_rng(zlib.crc32(f"load-64x50-{k}".encode()))
        use_grpc, json_body = k % 3 == 2, k % 3 == 1
        module = grpcclient if use_grpc else httpclient
        connection = module.InferenceServerClient(f"127.0.0.1:{server.ports.grpc if use_grpc else server.ports.http}")

        def tensor(name, array, datatype, binary=True):
            t = module.InferInput(name, list(array.shape), datatype)
            if use_grpc:
                t.set_data_from_numpy(array)
            else:
                t.set_data_from_numpy(array, binary_data=binary)
            return t

        try:
            for n in range(per_client):
                rows = int(rng.integers(1, 5))
                if rng.random() < 0.5:
                    x = rng.standard_normal((rows, 8)).astype(np.float32)
                    result = connection.infer("mlp", [tensor("x", x, "FP32", not json_body)], request_id=f"{k}-{n}")
                    sent["mlp"][k] += 1
                    z, y = result.as_numpy("z"), result.as_numpy("y")
                    if z is None or z.shape != x.shape or not np.array_equal(z, 2 * x):
                        failures.append(f"client {k} request {n}: mlp's z is not 2x of its own input")
                    elif not np.allclose(y, mlp_engine.run({"x": x})["y"], rtol=1e-5, atol=1e-6):
                        failures.append(f"client {k} request {n}: mlp's y differs from the engine run alone")
                else:
                    h = rng.standard_normal((rows, 4)).astype(np.float16)
                    b = rng.standard_normal((rows, 4)).astype(ml_dtypes.bfloat16)
                    result = connection.infer("half", [tensor("h", h, "FP16", not json_body), tensor("b", b, "BF16")],
                                              request_id=f"{k}-{n}")
                    sent["half"][k] += 1
                    h2, bf, bb = result.as_numpy("h2"), result.as_numpy("bf"), result.as_numpy("bb")
                    expected_bf = b.astype(np.float32) + 1
                    if h2 is None or h2.dtype != np.float16 or not np.array_equal(h2, 2 * h):
                        failures.append(f"client {k} request {n}: half's h2 is not 2h of its own input")
                    elif not np.array_equal(bf, expected_bf) or bb.dtype != ml_dtypes.bfloat16 \
                            or not np.array_equal(bb, expected_bf.astype(ml_dtypes.bfloat16)):
                        failures.append(f"client {k} request {n}: half's bf/bb are not b + 1 of its own input")
        except Exception as e:  # noqa: BLE001 - reported below with the client's name
            failures.append(f"client {k}: {type(e).__name__}: {e}")
        finally:
            connection.close()

    run_clients(client, count, 600, failures)
    for model in ("mlp", "half"):
        after = http.get_inference_statistics(model)["model_stats"][0]
        answered = after["inference_stats"]["success"]["count"] - before[model]["inference_stats"]["success"]["count"]
        assert answered == sum(sent[model]), model
        assert after["execution_count"] - before[model]["execution_count"] < answered, model  # calls were shared
    assert sum(map(sum, sent.values())) == count * per_client
    assert http.is_server_ready()
    http.close()
