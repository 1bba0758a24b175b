"""kiln serve on Ray Serve (kiln.serve.ray) on a local two-node ray.cluster_utils.Cluster: replicas on
different nodes, tritonclient.http against Ray's proxy, a replica killed with requests in flight, a GPU
model placed with its placement group. Every answer is checked against its own input.

The cluster is small and bounded: 2 CPUs and a 100 MiB object store per node, everything bound to
127.0.0.1 (Ray's loopback mode: RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 makes Ray resolve this machine's
address to 127.0.0.1, as it does on macOS), dashboard off, torn down at the end of the module.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.serve")

import tritonclient.http as httpclient
from conftest import free_port
from ray import serve
from ray._private import ray_constants
from ray.cluster_utils import Cluster
from serve_models import CONFIGS, MLP_W, half, mlp, slow
from tritonclient.utils import InferenceServerException

import kiln
from kiln.serve.ray import RayOptions, ReplicaOptions, deployment

# one cluster for the module: under xdist, `--dist loadgroup` keeps these tests on one worker
pytestmark = pytest.mark.xdist_group("ray_cluster")

NODE = {"num_cpus": 2, "object_store_memory": 100 << 20, "node_ip_address": "127.0.0.1"}
LOOPBACK = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
DEPLOY_TIMEOUT = 240  # s: replicas import torch and kiln on a shared 2-core machine

SLOW_CONFIG = """
max_batch_size: 1
instance_group [{ count: 1 }]
"""
GPU_CONFIG = """
max_batch_size: 16
instance_group [{ count: 1 kind: KIND_GPU }]
"""


def within(seconds: float, work):
    """work() on a thread, its result, or TimeoutError after `seconds` (a stuck deploy fails the test;
    the module's finalizer still tears the cluster down)."""
    result: dict = {}

    def target():
        try:
            result["value"] = work()
        except BaseException as e:  # noqa: BLE001 - re-raised on the test's thread
            result["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise TimeoutError(f"not done within {seconds} s")
    if "error" in result:
        raise result["error"]
    return result["value"]


def _start_cluster(attempts: int = 2) -> Cluster:
    """The head node, started again once when it times out: ray waits a fixed 30 s for its raylet to
    register, which a 2-core machine busy with other work can exceed (seen once in a fresh-clone CI run
    while another benchmark ran: no raylet log at all within the 30 s)."""
    for attempt in range(attempts):
        try:
            return Cluster(initialize_head=True, head_node_args={**NODE, "include_dashboard": False})
        except Exception as e:  # noqa: BLE001  ray raises a bare Exception on a startup timeout
            if attempt == attempts - 1 or "timed out during startup" not in str(e):
                raise
    raise AssertionError("unreachable")


# The environment the cluster's processes inherit: loopback only; and Serve's proxy given a minute to come up
# (its ready check waits 5 s, three misses in a row and the controller kills it: a fresh-clone CI on a 2-core
# machine busy with other work once lost the whole module's setup that way, "the actor never ran")
CLUSTER_ENV = {LOOPBACK: "0", "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
               "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60"}


@pytest.fixture(scope="module")
def cluster():
    saved_env, saved_flag = {k: os.environ.get(k) for k in CLUSTER_ENV}, ray_constants.ENABLE_RAY_CLUSTER
    os.environ.update(CLUSTER_ENV)  # the nodes' processes inherit it
    ray_constants.ENABLE_RAY_CLUSTER = False  # this process may have imported ray before
    local = None
    try:
        local = _start_cluster()
        local.add_node(**NODE)
        ray.init(address=local.address, log_to_driver=False, logging_level="warning")
        yield local
    finally:
        try:
            if ray.is_initialized():
                serve.shutdown()
        finally:
            ray.shutdown()
            if local is not None:
                local.shutdown()
            ray_constants.ENABLE_RAY_CLUSTER = saved_flag
            for name, value in saved_env.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def _engine(engines: Path, name: str, build) -> Path:
    path = engines / f"ray_{name}.kiln"
    if not path.exists():
        kiln.build(build().SerializeToString()).save(path)
    return path


@pytest.fixture(scope="module")
def ray_repository(tmp_path_factory, engines) -> Path:
    """mlp (2 instances, dynamic batching), half (FP16/BF16, no config), slow (~0.1 s a call, one at a
    time), broken (its config names an input the engine lacks: UNAVAILABLE, the others serve)."""
    root = tmp_path_factory.mktemp("ray_repository")
    models = {"mlp": (mlp, CONFIGS["mlp"]), "half": (half, None), "slow": (slow, SLOW_CONFIG),
              "broken": (mlp, CONFIGS["broken"])}
    for name, (build, config) in models.items():
        (root / name / "1").mkdir(parents=True)
        shutil.copy(_engine(engines, name if name != "broken" else "mlp", build), root / name / "1" / "model.kiln")
        if config:
            (root / name / "config.pbtxt").write_text(config)
    return root


# mlp and slow: one replica per node, each reserving a CPU; half and broken: one replica anywhere
OPTIONS = RayOptions(
    replicas=ReplicaOptions(num_replicas=1, num_cpus=0),
    models={"mlp": ReplicaOptions(num_replicas=2, num_cpus=1, max_replicas_per_node=1),
            "slow": ReplicaOptions(num_replicas=2, num_cpus=1, max_replicas_per_node=1)},
    shutdown_timeout=5)


@dataclass
class RayApp:
    port: int
    handle: object  # the ingress's DeploymentHandle


@pytest.fixture(scope="module")
def ray_app(cluster, ray_repository):
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
    handle = within(DEPLOY_TIMEOUT, lambda: serve.run(
        deployment(ray_repository, OPTIONS), name="kiln", route_prefix="/",
        logging_config={"log_level": "WARNING", "enable_access_log": False}))
    yield RayApp(port, handle)
    within(60, lambda: serve.delete("kiln"))


def _post(port: int, path: str, body: dict) -> tuple[int, dict, dict]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read()), dict(response.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


def _tensor(name: str, array: np.ndarray) -> dict:
    return {"name": name, "datatype": "FP32", "shape": list(array.shape), "data": array.ravel().tolist()}


def _outputs(answer: dict) -> dict[str, np.ndarray]:
    return {o["name"]: np.array(o["data"], np.float32).reshape(o["shape"]) for o in answer["outputs"]}


def _alive_nodes() -> set[str]:
    return {n["NodeID"] for n in ray.nodes() if n["Alive"]}


def test_index_names_the_broken_model_and_serves_the_rest(ray_app):
    index = ray_app.handle.index.remote().result()
    states = {row["name"]: (row["version"], row["state"]) for row in index}
    assert states == {"mlp": ("1", "READY"), "half": ("1", "READY"), "slow": ("1", "READY"),
                      "broken": ("", "UNAVAILABLE")}
    reason = next(row["reason"] for row in index if row["name"] == "broken")
    assert "not_there" in reason  # the load error, as kiln serve reports it
    status, answer, _ = _post(ray_app.port, "/v2/repository/index", {"ready": True})
    assert status == 200 and sorted(row["name"] for row in answer) == ["half", "mlp", "slow"]


def test_requests_spread_over_replicas_on_both_nodes(ray_app):
    """32 concurrent clients, each checking its own answer: mlp's two replicas (one per node) both answer."""
    rng = np.random.default_rng()
    inputs = [rng.standard_normal((int(rng.integers(1, 5)), 8)).astype(np.float32) for _ in range(64)]

    def ask(x: np.ndarray):
        status, answer, headers = _post(ray_app.port, "/v2/models/mlp/infer", {"inputs": [_tensor("x", x)]})
        assert status == 200, answer
        out = _outputs(answer)
        np.testing.assert_array_equal(out["z"], 2 * x)  # exact: shows these are this request's rows
        np.testing.assert_allclose(out["y"], np.maximum(x @ MLP_W, 0), rtol=1e-5, atol=1e-5)
        return headers["kiln-ray-node"], headers["kiln-ray-replica"], headers["kiln-ray-attempts"]

    with ThreadPoolExecutor(32) as pool:
        served = list(pool.map(ask, inputs, timeout=120))
    nodes = {node for node, _, _ in served}
    replicas = {replica for _, replica, _ in served}
    assert nodes == _alive_nodes() and len(nodes) == 2
    assert len(replicas) == 2 and all(r.startswith("SERVE_REPLICA::kiln#mlp#") for r in replicas)
    assert {attempts for _, _, attempts in served} == {"1"}
    # kiln's batcher merged concurrent requests inside the replicas: fewer engine calls than requests
    handle = serve.get_deployment_handle("mlp", app_name="kiln")
    calls = {}  # replica -> (requests, engine calls); a handle reaches one replica per call
    for _ in range(20):
        who, stats = handle.statistics.remote().result(timeout_s=30)
        calls[who.replica_id] = (stats[0]["inference_stats"]["success"]["count"], stats[0]["execution_count"])
        if len(calls) == 2:
            break
    assert any(requests > executions for requests, executions in calls.values()), calls


def test_tritonclient_http_against_the_ray_ingress(ray_app):
    client = httpclient.InferenceServerClient(f"127.0.0.1:{ray_app.port}", connection_timeout=60, network_timeout=60)
    try:
        assert client.is_server_live() and client.is_server_ready()
        assert client.get_server_metadata()["name"] == "kiln"
        assert client.is_model_ready("mlp") and not client.is_model_ready("broken")
        meta = client.get_model_metadata("mlp")
        assert meta["versions"] == ["1"]
        assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 8]}]
        config = client.get_model_config("mlp")
        assert config["max_batch_size"] == 16 and config["instance_group"][0]["count"] == 2

        x = np.random.default_rng().standard_normal((3, 8)).astype(np.float32)
        for binary in (True, False):
            tensor = httpclient.InferInput("x", [3, 8], "FP32")
            tensor.set_data_from_numpy(x, binary_data=binary)
            outputs = [httpclient.InferRequestedOutput(n, binary_data=binary) for n in ("y", "z")]
            result = client.infer("mlp", [tensor], outputs=outputs, request_id=f"r{binary}", model_version="1")
            np.testing.assert_array_equal(result.as_numpy("z"), 2 * x)
            np.testing.assert_allclose(result.as_numpy("y"), np.maximum(x @ MLP_W, 0), rtol=1e-5, atol=1e-5)
            assert result.get_response()["id"] == f"r{binary}"

        # FP16 and BF16 as raw bytes, through the ingress, Ray's object transfer and back
        h = np.random.default_rng().standard_normal((2, 4)).astype(np.float16)
        b = np.random.default_rng().standard_normal((2, 4)).astype(ml_dtypes.bfloat16)
        inputs = [httpclient.InferInput("h", [2, 4], "FP16"), httpclient.InferInput("b", [2, 4], "BF16")]
        inputs[0].set_data_from_numpy(h)
        inputs[1].set_data_from_numpy(b)
        result = client.infer("half", inputs)
        np.testing.assert_array_equal(result.as_numpy("h2"), h * np.float16(2))
        np.testing.assert_array_equal(result.as_numpy("bf"), b.astype(np.float32) + 1)

        # kiln serve's errors, raised in a replica or at the ingress, answered with kiln serve's status
        bad = httpclient.InferInput("x", [2, 5], "FP32")
        bad.set_data_from_numpy(np.zeros((2, 5), np.float32))
        with pytest.raises(InferenceServerException, match=r"input 'x' of model 'mlp': shape \[2, 5\]"):
            client.infer("mlp", [bad])
        with pytest.raises(InferenceServerException, match="unknown model 'nope'"):
            client.get_model_metadata("nope")
        with pytest.raises(InferenceServerException, match="statistics are kept by each replica"):
            client.get_inference_statistics("mlp")
    finally:
        client.close()
    status, answer, _ = _post(ray_app.port, "/v2/models/broken/infer", {"inputs": [_tensor("x", np.ones((1, 8)))]})
    assert status == 404 and "not loaded (UNAVAILABLE" in answer["error"]
    status, answer, _ = _post(ray_app.port, "/v2/repository/models/mlp/unload", {})
    assert status == 501 and "serve.delete" in answer["error"]


def test_killed_replica_loses_no_request(ray_app):
    """20 clients on slow (~0.1 s a call, one call at a time per replica): one replica is SIGKILLed
    while its queue holds requests. Each of them is sent again to a live replica and every client gets
    its own answer (y = x exactly)."""
    rng = np.random.default_rng()
    inputs = [rng.standard_normal((1, 4)).astype(np.float32) for _ in range(20)]
    first: list[str] = []

    def ask(x: np.ndarray) -> tuple[int, str]:
        status, answer, headers = _post(ray_app.port, "/v2/models/slow/infer", {"inputs": [_tensor("x", x)]})
        assert status == 200, answer
        np.testing.assert_array_equal(_outputs(answer)["y"], x)
        first.append(headers["kiln-ray-replica"])
        return int(headers["kiln-ray-attempts"]), headers["kiln-ray-replica"]

    with ThreadPoolExecutor(20) as pool:
        futures = [pool.submit(ask, x) for x in inputs]
        deadline = time.monotonic() + 60
        while not first and time.monotonic() < deadline:  # once one answers, both replicas hold a queue
            time.sleep(0.005)
        victim = first[0]
        os.kill(_replica_pid(victim), signal.SIGKILL)  # a crash (the OOM killer, a segfault), not a stop
        results = [f.result(timeout=120) for f in futures]
    assert len(results) == 20
    retried = [replica for attempts, replica in results if attempts > 1]
    assert retried, "the killed replica held no request: nothing was sent again"
    assert victim not in retried
    # Ray Serve replaces the dead replica: two live replica actors again, the victim not among them, and
    # the controller counts both RUNNING. (Right after the kill the controller may still count the
    # victim as running: waiting on that count alone let the replacement be placed during the next
    # test, on the node that test adds.)
    deadline = time.monotonic() + 120
    while not (_gone(victim) and _live_replicas("slow") == 2 and _running_replicas("slow") == 2) \
            and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _gone(victim) and _live_replicas("slow") == 2 and _running_replicas("slow") == 2


def _live_replicas(deployment_name: str) -> int:
    """Replica actors of the deployment that answer a call (started, not dead)."""
    prefix = f"SERVE_REPLICA::kiln#{deployment_name}#"
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]
    live = 0
    for name in names:
        try:
            ray.get(ray.get_actor(name, namespace="serve").__ray_call__.remote(lambda _self: None), timeout=10)
        except Exception:  # noqa: BLE001 - dead, dying or not yet started
            continue
        live += 1
    return live


def _running_replicas(deployment_name: str) -> int:
    states = serve.status().applications["kiln"].deployments[deployment_name].replica_states
    return states.get("RUNNING", 0)


def _gone(replica: str) -> bool:
    try:
        ray.get_actor(replica, namespace="serve")
    except ValueError:  # no live actor of that name
        return True
    return False


def _replica_pid(replica: str) -> int:
    """The process of a replica named in a response header (its actor name), asked of the actor itself."""
    actor = ray.get_actor(replica, namespace="serve")
    return ray.get(actor.__ray_call__.remote(lambda _self: os.getpid()), timeout=30)


def test_gpu_model_replica_is_placed_with_its_gpu(cluster, ray_app, ray_repository, tmp_path):
    """A KIND_GPU model's replica reserves a GPU in a placement-group bundle: on a cluster where only a
    third node has one (declared: there is no GPU here), the replica lands there. Without CUDA the
    model itself cannot load (its engine is a CPU one), so it is UNAVAILABLE with that reason."""
    # 2 CPUs: the bundle's CPU stays free even if Ray places some other replica on the new node
    gpu_node = cluster.add_node(num_cpus=2, num_gpus=1, object_store_memory=100 << 20, node_ip_address="127.0.0.1")
    try:
        (tmp_path / "onGPU" / "1").mkdir(parents=True)
        shutil.copy(ray_repository / "mlp" / "1" / "model.kiln", tmp_path / "onGPU" / "1" / "model.kiln")
        (tmp_path / "onGPU" / "config.pbtxt").write_text(GPU_CONFIG)
        handle = within(DEPLOY_TIMEOUT, lambda: serve.run(
            deployment(tmp_path, RayOptions(replicas=ReplicaOptions(num_cpus=1))), name="gpu", route_prefix="/gpu",
            logging_config={"log_level": "WARNING", "enable_access_log": False}))
        try:
            replica = handle.replicas.remote().result()["onGPU"]
            assert replica.node_id == gpu_node.node_id
            bundles = [pg for pg in ray.util.placement_group_table().values()
                       if pg["state"] == "CREATED" and pg["bundles"] == {0: {"CPU": 1.0, "GPU": 1.0}}]
            assert [pg["bundles_to_node_id"][0] for pg in bundles] == [gpu_node.node_id]
            row = handle.index.remote().result()[0]
            assert row["state"] == "UNAVAILABLE" and "KIND_GPU" in row["reason"]
        finally:
            within(60, lambda: serve.delete("gpu"))
    finally:
        cluster.remove_node(gpu_node)
