"""kiln serve on CUDA: every instance on its own stream, concurrent requests each answered with its
own rows, its waits spinning or blocking (gpu-marked: skipped without CUDA); front ends staging their inputs, two
instances of a GEMM-heavy fp16 model replaying at once, every gRPC answer checked against its request's answer alone
(issue 14's wrong answers under --cuda-sync blocking). And what needs no GPU: the gate that keeps graph captures apart
from other instances' runs; cuda_sync's parameter and flag, and the wait each selects (torch.cuda's stream and event
stood in for)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import asyncio
import contextlib
import shutil

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from conftest import options
from serve_models import CONFIGS, MLP_W, mlp, slow, write_repository

import kiln
import kiln.serve
from kiln.cli import main as kiln_main
from kiln.serve import ServerThread
from kiln.serve.config import batch_buckets_mode, cuda_sync_mode, parse_pbtxt
from kiln.serve.core import ServerCore
from kiln.serve.errors import ModelLoadError
from kiln.serve.instances import GpuGate, Instance
from kiln.serve.perf import PerfOptions, sweep
from kiln.serve.repository import ModelRepository
from tests.gpu.common import CUBLAS_ONLY, DEEP_WIDTH, deep_mlp, deep_reference

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

CONFIG = """
max_batch_size: 16
instance_group [{{ count: 2 kind: KIND_GPU }}]
{batching}
"""


@pytest.fixture(scope="module")
def cuda_engines(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cuda-engines")
    profile = {"x": ([1, 8], [4, 8], [16, 8])}
    kiln.build(mlp().SerializeToString(), device="cuda", profiles=[profile]).save(folder / "mlp.kiln")
    # ~1 ms of matmuls per call whatever the batch: two instances have GPU work to overlap; y = x exactly
    kiln.build(slow(size=2048, steps=4).SerializeToString(), device="cuda",
               profiles=[{"x": ([1, 4], [4, 4], [16, 4])}]).save(folder / "slow.kiln")
    return folder


def _repository(root, engines, batching: str):
    for name in ("mlp", "slow"):
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / "model.kiln").write_bytes((engines / f"{name}.kiln").read_bytes())
        (root / name / "config.pbtxt").write_text(CONFIG.format(batching=batching))
    return root


def _ask(port: int, model: str, x: np.ndarray) -> dict[str, np.ndarray]:
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        tensor = grpcclient.InferInput("x", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        result = client.infer(model, [tensor])
        names = ["y", "z"] if model == "mlp" else ["y"]
        return {n: result.as_numpy(n) for n in names}
    finally:
        client.close()


BATCHED = "dynamic_batching { max_queue_delay_microseconds: 500 }"
NO_BUCKETS = 'parameters { key: "buckets" value: { string_value: "false" } }'  # graphs captured while serving
BLOCKING = 'parameters { key: "cuda_sync" value: { string_value: "blocking" } }'


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("batching", ["", BATCHED, f"{BATCHED}\n{NO_BUCKETS}", f"{BATCHED}\n{BLOCKING}"],
                         ids=["alone", "batched", "captures", "blocking"])
def test_two_instances_on_their_own_streams_answer_each_request_with_its_own_rows(tmp_path, cuda_engines, batching):
    repository = _repository(tmp_path / "repo", cuda_engines, batching)
    thread = ServerThread(options(repository))
    server = thread.start()
    try:
        for name in ("mlp", "slow"):
            instances = server.core.model(name).batcher.instances
            streams = {instance.stream for instance in instances}
            assert len(streams) == 2 and torch.cuda.default_stream() not in streams
            assert all((instance.done is not None) == (BLOCKING in batching) for instance in instances)
            assert all(instance.context.runner.stats.captures > 0 for instance in instances)  # warmed up at load
            # every batch size's graph captured at load, unless buckets are off (then captures come with requests)
            assert all(instance.captured_all == (NO_BUCKETS not in batching) for instance in instances)
        rng = np.random.default_rng()
        requests = [("mlp" if k % 2 else "slow", rng.standard_normal((int(rng.integers(1, 5)), 8 if k % 2 else 4))
                     .astype(np.float32)) for k in range(128)]
        with ThreadPoolExecutor(32) as pool:
            answers = list(pool.map(lambda r: _ask(server.ports.grpc, *r), requests))
        for (model, x), out in zip(requests, answers):
            if model == "mlp":
                np.testing.assert_array_equal(out["z"], 2 * x)  # exact: shows whose rows came back
                np.testing.assert_allclose(out["y"], np.maximum(x @ MLP_W, 0), rtol=1e-2, atol=1e-2)  # TF32 at most
            else:
                np.testing.assert_array_equal(out["y"], x)
        for name in ("mlp", "slow"):
            instances = server.core.model(name).batcher.instances
            assert all(instance.calls > 0 for instance in instances), "both instances served"
            if NO_BUCKETS in batching:  # batch sizes met first while serving were captured then
                assert sum(instance.context.runner.stats.captures for instance in instances) > 2
    finally:
        thread.stop()


DEEP_CONFIG = """
max_batch_size: 16
instance_group [{{ count: 2 kind: KIND_GPU }}]
dynamic_batching {{ max_queue_delay_microseconds: 0 }}
parameters {{ key: "cuda_sync" value: {{ string_value: "{sync}" }} }}
"""
FP16_TOL = 2e-2  # x max|y|: fp16 storage between the model's 8 GEMMs (tests/gpu's fp16 tolerance)


@pytest.fixture(scope="module")
def deep_engine(tmp_path_factory):
    """tests/gpu/common.deep_mlp built fp16 for batch 1..16: GEMMs cuBLAS splits along K (its workspace)."""
    model, weights = deep_mlp()
    path = tmp_path_factory.mktemp("deep-engine") / "deep.kiln"
    kiln.build(model.SerializeToString(), device="cuda", precision="fp16", tuning_runs=3, tactics=CUBLAS_ONLY,
               profiles=[{"x": ([1, DEEP_WIDTH], [8, DEEP_WIDTH], [16, DEEP_WIDTH])}]).save(path)
    return path, weights


def _ask_deep(port: int, x: np.ndarray) -> np.ndarray:
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        tensor = grpcclient.InferInput("x", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        return client.infer("deep", [tensor]).as_numpy("y")
    finally:
        client.close()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("sync", ["spin", "pinned", "blocking", "staged"])
def test_front_ends_and_two_instances_answer_every_grpc_request_as_alone(tmp_path, deep_engine, sync):
    """Issue 14's load in small: 2 front ends staging every input, gRPC (kiln's transport), 2 instances of an fp16
    model replaying at once, dynamic batching, 64 calls in flight for 3 s from kiln perf's wire client, whose 8
    distinct requests are each answered alone first and every answer under load checked in full against that
    (a wrong answer: another request's rows, or GEMMs corrupted by the other instance's graphs). The answers alone
    are checked against a float64 oracle first."""
    path, weights = deep_engine
    (tmp_path / "deep" / "1").mkdir(parents=True)
    shutil.copy(path, tmp_path / "deep" / "1" / "model.kiln")
    (tmp_path / "deep" / "config.pbtxt").write_text(DEEP_CONFIG.format(sync=sync))
    thread = ServerThread(options(tmp_path, frontends=2, staging_bytes=1 << 20, staging_min_bytes=1,
                                  grpc_transport="kiln"))
    server = thread.start()
    try:
        instances = server.core.model("deep").batcher.instances
        # "staged" spins as "spin" does, its copies through the context's pinned buffers (host_staging "pinned")
        assert all((i.done is not None) == (sync == "blocking") and i.pinned == (sync in ("pinned", "blocking"))
                   and i.context.host_staging == ("pinned" if sync == "staged" else "off") and i.captured_all
                   for i in instances)
        captured_on = {i.context.runner.capture_stream(i.context.engine.device).cuda_stream for i in instances}
        assert len(captured_on) == 2, "two instances' graphs captured on one stream share cuBLAS's workspace"
        rng = np.random.default_rng()
        for rows in (1, 3, 16):
            x = rng.standard_normal((rows, DEEP_WIDTH)).astype(np.float32)
            want = deep_reference(weights, x)
            assert np.abs(_ask_deep(server.ports.grpc, x) - want).max() <= FP16_TOL * np.abs(want).max()
        staged = sum(f.connection.staging.taken for f in server.frontends.frontends)
        load = PerfOptions(model="deep", url=f"127.0.0.1:{server.ports.grpc}", protocol="grpc", concurrency=[64],
                           warmup_s=0.5, window_s=3.0, client="wire", full_every=1, seed=int(rng.integers(1 << 30)))
        result = asyncio.run(sweep(load))[0]
        staged = sum(f.connection.staging.taken for f in server.frontends.frontends) - staged
        calls = [i.calls for i in instances]
        phases = server.core.model("deep").stats.phases
        print(f"\n{sync}: {result.checked} answers checked, {result.wrong} wrong, {result.errors} errors, "
              f"{result.requests / result.seconds:.0f} infer/s, {staged} tensors staged, calls per instance {calls}; "
              f"engine {phases.engine.ns / max(1, phases.engine.count) / 1000:.0f} us a call, GPU span "
              f"{phases.gpu.ns / max(1, phases.gpu.count) / 1000:.0f} us ({phases.gpu.count} of {phases.calls} calls)")
        assert result.wrong == 0 and result.errors == 0, result.first_error
        assert result.checked > 1000 and staged >= result.checked  # every request's tensor through an arena
        assert min(calls) > 100, "both instances served"
        assert phases.gpu.count > 0.9 * phases.calls and 0 < phases.gpu.ns <= phases.engine.ns  # spans measured
    finally:
        thread.stop()


def test_gate_runs_shared_calls_together_and_an_exclusive_one_alone():
    gate = GpuGate()
    log: list[str] = []
    together = threading.Barrier(2, timeout=10)

    def shared(name: str, wait: bool) -> None:
        with gate.shared():
            log.append(f"{name} in")
            if wait:
                together.wait()  # returns only when both shared runs are inside at once
            time.sleep(0.05)
            log.append(f"{name} out")

    def alone() -> None:
        with gate.alone():
            log.append("alone in")
            time.sleep(0.02)
            log.append("alone out")

    first = [threading.Thread(target=shared, args=(n, True)) for n in ("a", "b")]
    for t in first:
        t.start()
    while len(log) < 2:
        time.sleep(0.001)
    exclusive = threading.Thread(target=alone)
    exclusive.start()
    time.sleep(0.01)
    late = threading.Thread(target=shared, args=("c", False))  # comes while alone() waits: goes after it
    late.start()
    for t in [*first, exclusive, late]:
        t.join(10)
    start, end = log.index("alone in"), log.index("alone out")
    assert end == start + 1, log  # nothing ran while the exclusive one did
    assert log.index("a out") < start and log.index("b out") < start, log
    assert log.index("c in") > end, log


def test_cuda_sync_parameter_else_the_servers_default():
    blocking = parse_pbtxt(f"max_batch_size: 4\n{BLOCKING}", "m/config.pbtxt")
    assert cuda_sync_mode(blocking) == "blocking" and cuda_sync_mode(blocking, "spin") == "blocking"
    plain = parse_pbtxt("max_batch_size: 4", "m/config.pbtxt")
    assert cuda_sync_mode(plain) == "spin" and cuda_sync_mode(plain, "blocking") == "blocking"
    assert cuda_sync_mode(plain, "pinned") == "pinned" and cuda_sync_mode(plain, "staged") == "staged"
    with pytest.raises(ModelLoadError, match=r"m/config.pbtxt:\n  parameter cuda_sync 'busy': expected one of spin, "
                                             r"pinned, blocking"):
        parse_pbtxt('parameters { key: "cuda_sync" value: { string_value: "busy" } }', "m/config.pbtxt")
    plain.name = "m"
    with pytest.raises(ModelLoadError, match=r"model 'm': the server's --cuda-sync 'yield': expected one of"):
        cuda_sync_mode(plain, "yield")


def test_cuda_sync_reaches_each_instance(tmp_path, engines, monkeypatch):
    """The model's parameter over the server's default, handed to every instance (a CPU instance ignores it)."""
    root = write_repository(tmp_path, engines)
    seen = []
    init = Instance.__init__

    def recording(self, *args, cuda_sync, **kwargs):
        seen.append(cuda_sync)
        init(self, *args, cuda_sync=cuda_sync, **kwargs)

    monkeypatch.setattr(Instance, "__init__", recording)
    for config, default, expected in ((CONFIGS["mlp"], "blocking", "blocking"),
                                      (CONFIGS["mlp"] + BLOCKING, "spin", "blocking"), (CONFIGS["mlp"], "spin", "spin")):
        (root / "mlp" / "config.pbtxt").write_text(config)
        core = ServerCore(ModelRepository(root), cuda_sync=default)
        asyncio.run(core.load("mlp"))
        instances = core.model("mlp").batcher.instances
        assert seen[-2:] == [expected] * 2 and all(i.done is None for i in instances)  # KIND_CPU: no event
        asyncio.run(core.unload("mlp"))


def test_cuda_sync_flag(tmp_path, monkeypatch, capsys):
    served = []

    class Recorded:  # kiln serve's Server, stopped before it serves
        def __init__(self, options):
            served.append(options)

        async def serve_forever(self, started):
            pass

    monkeypatch.setattr(kiln.serve, "Server", Recorded)
    assert kiln_main(["serve", str(tmp_path), "--cuda-sync", "blocking"]) == 0
    assert kiln_main(["serve", str(tmp_path)]) == 0
    assert [o.cuda_sync for o in served] == ["blocking", "spin"]
    with pytest.raises(SystemExit):
        kiln_main(["serve", str(tmp_path), "--cuda-sync", "yield"])
    assert "--cuda-sync: invalid choice: 'yield'" in capsys.readouterr().err


def test_batch_buckets_parameter_flag_and_each_instance(tmp_path, engines, monkeypatch, capsys):
    """Issue 14: batch_buckets, the model's parameter over the server's --batch-buckets, reaches every instance's context
    (a CPU instance's too: it pads only where its config turns buckets on)."""
    half = parse_pbtxt('max_batch_size: 4\nparameters { key: "batch_buckets" value: { string_value: "half" } }',
                       "m/config.pbtxt")
    assert batch_buckets_mode(half) == "half" and batch_buckets_mode(half, "pow2") == "half"
    plain = parse_pbtxt("max_batch_size: 4", "m/config.pbtxt")
    assert batch_buckets_mode(plain) == "half" and batch_buckets_mode(plain, "pow2") == "pow2"
    with pytest.raises(ModelLoadError, match=r"m/config.pbtxt:\n  parameter batch_buckets 'thirds': expected one of "
                                             r"pow2, half"):
        parse_pbtxt('parameters { key: "batch_buckets" value: { string_value: "thirds" } }', "m/config.pbtxt")

    root = write_repository(tmp_path, engines)
    seen = []
    init = Instance.__init__

    def recording(self, *args, batch_buckets, **kwargs):
        seen.append(batch_buckets)
        init(self, *args, batch_buckets=batch_buckets, **kwargs)

    monkeypatch.setattr(Instance, "__init__", recording)
    bucketed = CONFIGS["mlp"] + '\nparameters { key: "buckets" value: { string_value: "true" } }'
    for config, default, expected in ((bucketed, "half", "half"), (bucketed, "pow2", "pow2"),
                                      (bucketed + '\nparameters { key: "batch_buckets" value: { string_value: "half" } }',
                                       "pow2", "half")):
        (root / "mlp" / "config.pbtxt").write_text(config)
        core = ServerCore(ModelRepository(root), batch_buckets=default)
        asyncio.run(core.load("mlp"))
        instances = core.model("mlp").batcher.instances
        assert seen[-2:] == [expected] * 2
        assert [i.context.buckets.batch_steps for i in instances] == [expected] * 2
        asyncio.run(core.unload("mlp"))

    served = []

    class Recorded:  # kiln serve's Server, stopped before it serves
        def __init__(self, options):
            served.append(options)

        async def serve_forever(self, started):
            pass

    monkeypatch.setattr(kiln.serve, "Server", Recorded)
    assert kiln_main(["serve", str(tmp_path), "--batch-buckets", "half"]) == 0
    assert kiln_main(["serve", str(tmp_path)]) == 0
    assert [o.batch_buckets for o in served] == ["half", "half"]  # the default since session 33
    with pytest.raises(SystemExit):
        kiln_main(["serve", str(tmp_path), "--batch-buckets", "thirds"])
    assert "--batch-buckets: invalid choice: 'thirds'" in capsys.readouterr().err


class _Stream:  # torch.cuda.Stream without a GPU: counts its synchronizations
    def __init__(self, device=None):
        self.synchronized = 0

    def synchronize(self):
        self.synchronized += 1


class _Event:  # torch.cuda.Event without a GPU: where it was recorded, how often waited on
    SPAN_MS = 1.25  # elapsed_time's answer between two timing events

    def __init__(self, enable_timing=False, blocking=False):
        self.timing, self.blocking, self.recorded, self.waited = enable_timing, blocking, [], 0

    def record(self, stream=None):  # None: the current stream (the runtime's host staging records there)
        self.recorded.append(stream)

    def synchronize(self):
        self.waited += 1

    def elapsed_time(self, end):
        assert self.timing and end.timing and len(self.recorded) == len(end.recorded)
        return self.SPAN_MS


class _Context:  # an execution context whose run doubles its input, torch in -> torch out (CPU tensors stand in)
    runner = None

    def __init__(self, host_staging="off", batch_buckets=None):
        self.fed = []
        self.host_staging = host_staging

    def run(self, feeds):
        self.fed.append(feeds)
        x = feeds["x"]
        return {"y": 2 * x}


class _Engine:
    device = torch.device("cuda")

    def create_execution_context(self, buckets=None, **options):
        return _Context(**options)


@pytest.mark.parametrize("sync", ["spin", "pinned", "blocking", "staged"])
def test_cuda_sync_selects_the_wait(monkeypatch, sync):
    """spin: the runtime's host arrays, then the stream synchronized; pinned: host tensors in, the outputs copied to
    the host, then the stream synchronized; blocking: as pinned, but a blocking event recorded on the instance's stream
    waited on, the stream never synchronized; staged: spin's, its context's host staging on (the runtime's pinned
    buffers and one wait per call, kiln/runtime/host_staging.py), the others' contexts with it off."""
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "set_stream", lambda stream: None)
    instance = Instance(_Engine(), "m", 0, None, None, warm_up=False, cuda_sync=sync)
    try:
        x = np.random.default_rng().standard_normal((3, 8)).astype(np.float32)
        for _ in range(3):
            outputs = instance.execute({"x": x})
            assert type(outputs["y"]) is np.ndarray
            np.testing.assert_array_equal(outputs["y"], 2 * x)
        fed = [type(feeds["x"]) for feeds in instance.context.fed]
        begin, ready, end = instance._span  # the call phases' GPU span: timing events around each call on its stream
        assert begin.recorded == end.recorded == [instance.stream] * 3 and instance.gpu_ns == int(_Event.SPAN_MS * 1e6)
        assert instance.context.host_staging == ("pinned" if sync == "staged" else "off")
        if sync in ("spin", "staged"):  # the runtime copies the outputs: no event between the network and the copies
            assert ready.recorded == [] and instance.copy_out_ns is None
        else:
            assert ready.recorded == [instance.stream] * 3 and instance.copy_out_ns == int(_Event.SPAN_MS * 1e6)
        if sync in ("spin", "staged"):
            assert instance.done is None and instance.stream.synchronized == 3 and fed == [np.ndarray] * 3
        elif sync == "pinned":
            assert instance.done is None and instance.stream.synchronized == 3 and fed == [torch.Tensor] * 3
        else:
            assert instance.done.blocking and instance.done.recorded == [instance.stream] * 3
            assert instance.done.waited == 3 and instance.stream.synchronized == 0 and fed == [torch.Tensor] * 3
    finally:
        instance.stop()


class _CudaLike:  # a CPU engine that the Instance takes for a CUDA one: its context a CUDA-graph context's stand-in
    device = torch.device("cuda")

    def __init__(self, engine, cost_ms):
        self.engine, self.cost_ms = engine, cost_ms

    def create_execution_context(self, buckets=None, host_staging="off", batch_buckets=None):  # None: on, as CUDA's
        context = _graph_context(self.engine, True, self.cost_ms, buckets=True if buckets is None else buckets,
                                 batch_buckets=batch_buckets)
        if host_staging != "off":  # pinned memory and the CUDA event stood in (tests/unit/test_host_staging.py)
            from kiln.runtime.host_staging import HostStaging
            context._host_staging = HostStaging(torch.device("cpu"), host_staging,
                                                allocate=lambda n: torch.empty(n, dtype=torch.uint8), event=_Event)
        return context


def _graph_context(engine, direct, cost_ms, **options):
    """tests/unit/test_direct_replay.py's stand-in graph context, its 'captures' timed as the runner's are (`cost_ms`
    of the bucket's batch size: what the context's batch splits decide on)."""
    from kiln.runtime.cuda_graphs import _Captured
    from tests.unit.test_direct_replay import _StandInRunner
    from tests.unit.test_direct_replay import _graph_context as stand_in

    class Timed(_StandInRunner):
        def _first_run(self, key, inputs, program):
            outputs = super()._first_run(key, inputs, program)
            entry: _Captured = self.entries[key]
            entry.ms = cost_ms(inputs[0].shape[0])
            return outputs

    context = stand_in(engine, direct, **options)
    context.runner = Timed(engine.program, plain_inputs=direct)
    return context


@pytest.fixture(scope="module")
def bert_fixed_seq():
    """bert_tiny as bench/serve.py serves BERT-base: batch 1..16 at one sequence length (16), the mask an input."""
    import onnxruntime as ort

    from kiln import zoo

    exported = zoo.export("bert_tiny", dynamic=True, batch=2)
    engine = kiln.build(str(exported.path), profiles=[{"input_ids": "1x16,16x16,16x16"}])
    return engine, ort.InferenceSession(str(exported.path), providers=["CPUExecutionProvider"])


def _fewest_chunks(rows: int, sizes: list[int]) -> int:
    """The fewest bucket sizes that sum to exactly `rows` (what a split takes where a replay's ms is its rows: every
    padded row and every chunk beyond the first costs)."""
    fewest = [0] + [rows + 1] * rows
    for n in range(1, rows + 1):
        fewest[n] = min((fewest[n - s] + 1 for s in sizes if s <= n), default=rows + 1)
    return fewest[rows]


@pytest.mark.parametrize("costs,sync,steps", [("flat", "spin", "pow2"), ("linear", "spin", "pow2"),
                                              ("linear", "staged", "pow2"), ("flat", "spin", "half"),
                                              ("linear", "spin", "half")])
def test_every_batch_a_served_engine_forms_replays_a_graph_warm_up_captured(monkeypatch, bert_fixed_seq, costs, sync,
                                                                            steps):
    """Issue 14: a CUDA instance's warm-up captures the graph of every batch bucket of a fixed-sequence profile (bench/
    serve.py's BERT: batch 1..max, seq fixed), reports them (graph_report: warm_up_captured, captured_all), and every
    batch size the batcher can hand it after (1..max rows, numpy as the spin path feeds, torch as pinned's) replays
    graphs only: no capture, no eager run (each call's graph_counts, summed into call_phases' graph counts); its
    answers are onnxruntime's. 'linear' replay times (ms = rows) make every batch off a bucket run split into
    bucket chunks (buckets.split), 'flat' ones (ms = 1 + rows / 100) padded to its bucket: both replay only.
    `steps` "half" (batch_buckets: 12 between 8 and 16): warm-up captures it too, and a batch of 9..12 replays it
    (flat) or splits by the measured times as the powers of two do (linear: 14 = 12 + 2, two replays, not three).
    The runtime's graphs are CPU stand-ins (tests/unit/test_direct_replay.py), torch.cuda's stream and event too;
    'staged': the numpy calls through the context's host staging (its pinned memory and event stood in)."""
    from kiln.serve.stats import ModelStats

    engine, session = bert_fixed_seq
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "set_stream", lambda stream: None)
    cost = (lambda rows: float(rows)) if costs == "linear" else (lambda rows: 1.0 + rows / 100)
    instance = Instance(_CudaLike(engine, cost), "bert", 0, None, None, warm_up=True, cuda_sync=sync,
                        batch_buckets=steps)
    buckets = [1, 2, 4, 8, 16] if steps == "pow2" else [1, 2, 4, 8, 12, 16]
    assert instance.context.buckets.sizes("batch", 1, 16) == buckets
    staging = instance.context._host_staging
    assert (staging is not None) == (sync == "staged")
    stats = ModelStats("bert", "1")
    stats.graph_reports = lambda: [instance.graph_report()]
    try:
        report = instance.graph_report()
        assert instance.captured_all and report["captured_all"]
        assert report["warm_up_captured"] == [f"{b}x16,{b}x16" for b in buckets], report
        assert report["warm_up_eager"] == {} and report["captures"] == len(buckets) and report["evictions"] == 0
        replayed: list[int] = []  # the batch bucket of each padded replay
        runner = instance.context.runner
        replay_padded = runner.replay_padded

        def recording(inputs, shapes, program=None):
            replayed.append(shapes[0][0])
            return replay_padded(inputs, shapes, program)

        runner.replay_padded = recording
        rng = np.random.default_rng()
        sizes = list(range(1, 17)) + [int(b) for b in rng.integers(1, 17, 8)]
        for k, batch in enumerate(sizes):
            ids = rng.integers(0, 1024, (batch, 16))
            mask = np.ones((batch, 16), np.int64)
            mask[:, int(rng.integers(1, 17)):] = 0  # the batcher's rows padded to the longest: zeros under a 0 mask
            feeds = {"input_ids": ids, "attention_mask": mask}
            if k % 2:  # as cuda_sync pinned feeds it: host tensors
                feeds = {n: torch.from_numpy(v) for n, v in feeds.items()}
            outputs = instance.execute(feeds)
            counts = instance.graph_counts
            stats.record_phases(1, batch, 0, 0, 0, 1, instance.cpu_ns, instance.gpu_ns, 0, 0, 0, None, counts)
            split = costs == "linear" and batch not in buckets  # off a bucket: chunks of buckets
            assert (counts.captures, counts.eager, counts.splits) == (0, 0, int(split)), (batch, counts)
            assert counts.replays == (_fewest_chunks(batch, buckets) if split else 1), (batch, counts)
            if not split:  # one replay, of the smallest bucket that holds the batch (12 for 9..12 rows with "half")
                assert replayed[-1] == min(b for b in buckets if b >= batch), (batch, replayed[-1:])
            got = next(iter(outputs.values()))
            got = got.numpy() if isinstance(got, torch.Tensor) else got
            want = session.run(None, {"input_ids": ids, "attention_mask": mask})[0]
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"batch {batch}")
        if staging is not None:  # the numpy calls (every other one) staged: each binding's buffer made at warm-up
            assert sorted(staging.buffers) == [("input", "attention_mask"), ("input", "input_ids"),
                                               ("output", next(iter(outputs)))] and staging._event.waited == len(
                sizes[::2])
        phases = stats.to_json()["call_phases"]
        assert phases["graph_calls"] == len(sizes) and phases["graph_captures"] == phases["graph_eager"] == 0
        assert phases["graph_replays"] >= len(sizes)
        assert stats.to_json()["cuda_graphs"][0]["replays"] == report["replays"] + phases["graph_replays"]
    finally:
        instance.stop()


def test_graph_counts_are_the_calls_own():
    """GraphCounts: the runtime's counters after minus before a call; an instance without a runner counts none."""
    from kiln.runtime.cuda_graphs import GraphStats
    from kiln.serve.instances import GraphCounts

    s = GraphStats(captures=2, replays=5, eager_runs=3, split_runs=1)
    before = GraphCounts.of(s)
    s.replays += 2
    s.eager_runs += 1
    assert GraphCounts.of(s).since(before) == GraphCounts(replays=2, captures=0, eager=1, splits=0)
    assert _Context.runner is None  # the stub above: Instance.graph_report() is None, graph_counts None
