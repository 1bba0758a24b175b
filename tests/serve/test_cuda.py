"""kiln serve on CUDA: every instance on its own stream, concurrent requests each answered with its
own rows (gpu-marked: skipped without CUDA). And the gate that keeps graph captures apart from other
instances' runs, which needs no GPU."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from conftest import options
from serve_models import MLP_W, mlp, slow

import kiln
from kiln.serve import ServerThread
from kiln.serve.instances import GpuGate

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


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("batching", ["", BATCHED, f"{BATCHED}\n{NO_BUCKETS}"], ids=["alone", "batched", "captures"])
def test_two_instances_on_their_own_streams_answer_each_request_with_its_own_rows(tmp_path, cuda_engines, batching):
    repository = _repository(tmp_path / "repo", cuda_engines, batching)
    thread = ServerThread(options(repository))
    server = thread.start()
    try:
        for name in ("mlp", "slow"):
            instances = server.core.model(name).batcher.instances
            streams = {instance.stream for instance in instances}
            assert len(streams) == 2 and torch.cuda.default_stream() not in streams
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
