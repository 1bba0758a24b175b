"""Ray Serve's autoscaling of a kiln model under load, on a local two-node ray.cluster_utils.Cluster
(kiln serve --ray --autoscale 1-3, with the autoscaler's timing shortened to seconds): bounded
concurrent load over loopback HTTP raises the replica count from 1 to 3, and once the load drops to
one client it falls back to 1 while that client keeps asking. Every answer is checked against its own
input (the model returns its input exactly), none may fail or go missing, and the answers name the
replicas that computed them: all three served.

Slow (a cluster, and three replicas that each import torch and kiln: a minute or two on a shared
2-core machine); the options it runs on are checked fast in test_ray_units.py
(test_autoscaler_timing_from_options_and_model_config). The cluster is test_ray.py's: loopback only,
2 CPUs and 100 MiB of object store per node, dashboard off, torn down at the end of the module.
"""

from __future__ import annotations

import shutil
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.serve")

from conftest import free_port
from ray import serve
from serve_models import slow
from test_ray import DEPLOY_TIMEOUT, _engine, _outputs, _post, _tensor, cluster, within  # noqa: F401 - cluster: the fixture

from kiln.serve.ray import RayOptions, ReplicaOptions, deployment

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray_cluster")]

APP = "auto"
# one request at a time per replica (~0.1 s of matmuls each), so concurrent clients queue at the ingress and the
# ongoing requests per replica exceed the target of 1
SLOW_CONFIG = """
max_batch_size: 1
instance_group [{ count: 1 }]
"""
# half a CPU each: three replicas fit the two 2-CPU nodes beside nothing else; the autoscaler decides within
# seconds (Ray's defaults: 30 s up, 10 min down)
AUTOSCALE = ReplicaOptions(autoscaling=(1, 3), target_ongoing_requests=1, max_ongoing_requests=2, num_cpus=0.5,
                           upscale_delay_s=1, downscale_delay_s=4, look_back_period_s=2)
HEAVY_CLIENTS = 8
SCALE_TIMEOUT = 240  # s to reach 3 replicas, and again to fall back to 1: each new replica imports torch and kiln


@pytest.fixture(scope="module")
def autoscaled(cluster, tmp_path_factory, engines):
    root = tmp_path_factory.mktemp("ray_autoscale")
    (root / "slow" / "1").mkdir(parents=True)
    shutil.copy(_engine(engines, "slow", slow), root / "slow" / "1" / "model.kiln")
    (root / "slow" / "config.pbtxt").write_text(SLOW_CONFIG)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
    within(DEPLOY_TIMEOUT, lambda: serve.run(
        deployment(root, RayOptions(replicas=AUTOSCALE, shutdown_timeout=10)), name=APP, route_prefix="/",
        logging_config={"log_level": "WARNING", "enable_access_log": False}))
    yield port
    within(60, lambda: serve.delete(APP))


def _running(deployment_name: str = "slow") -> int:
    return serve.status().applications[APP].deployments[deployment_name].replica_states.get("RUNNING", 0)


class Load:
    """`clients` threads over loopback HTTP, each asking until stopped with inputs of its own (seeded by the
    client's name) and checking every answer: y == x exactly shows it is this request's own row."""

    def __init__(self, port: int, clients: int, name: str):
        self.port, self.stop, self.lock = port, threading.Event(), threading.Lock()
        self.sent = self.answered = 0
        self.replicas: dict[str, int] = {}  # replica -> answers it computed
        self.failures: list[str] = []
        self.threads = [threading.Thread(target=self._client, args=(f"{name}-{k}",), daemon=True)
                        for k in range(clients)]
        for thread in self.threads:
            thread.start()

    def _client(self, name: str) -> None:
        rng = np.random.default_rng(zlib.crc32(name.encode()))
        while not self.stop.is_set():
            x = rng.standard_normal((1, 4)).astype(np.float32)
            with self.lock:
                self.sent += 1
            try:
                status, answer, headers = _post(self.port, "/v2/models/slow/infer", {"inputs": [_tensor("x", x)]})
                if status != 200:
                    raise AssertionError(f"status {status}: {answer}")
                np.testing.assert_array_equal(_outputs(answer)["y"], x)
            except Exception as e:  # noqa: BLE001 - every failure is reported by finish()
                with self.lock:
                    self.failures.append(f"{name}: {type(e).__name__}: {e}")
                continue
            with self.lock:
                self.answered += 1
                replica = headers["kiln-ray-replica"]
                self.replicas[replica] = self.replicas.get(replica, 0) + 1

    def finish(self, timeout: float = 120) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout)
        assert not any(t.is_alive() for t in self.threads), f"a client did not finish in {timeout:.0f} s"
        assert not self.failures, self.failures[:5]
        assert self.answered == self.sent  # none lost


def _wait_for(condition, timeout: float, load: Load) -> tuple[bool, list[int]]:
    """Polls condition(running replicas) every 0.5 s until true or timeout; the counts seen, in order.
    Stops early if the load has failures (the test reports them)."""
    seen: list[int] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not load.failures:
        count = _running()
        if not seen or seen[-1] != count:
            seen.append(count)
        if condition(count):
            return True, seen
        time.sleep(0.5)
    return False, seen


def test_replicas_follow_the_load_up_and_down(autoscaled):
    assert _running() == 1  # min_replicas, before any load
    heavy = Load(autoscaled, HEAVY_CLIENTS, "heavy")
    try:
        rose, up = _wait_for(lambda n: n == 3, SCALE_TIMEOUT, heavy)
        # the new replicas take requests: the load keeps going until each of the three has answered some
        deadline = time.monotonic() + 60
        while rose and len(heavy.replicas) < 3 and time.monotonic() < deadline and not heavy.failures:
            time.sleep(0.2)
    finally:
        heavy.finish()
    assert rose, f"running replicas under {HEAVY_CLIENTS} clients: {up}, never 3"
    assert up[0] == 1 and max(up) == 3, up  # never past max_replicas
    assert len(heavy.replicas) == 3 and all(r.startswith(f"SERVE_REPLICA::{APP}#slow#") for r in heavy.replicas), \
        heavy.replicas

    light = Load(autoscaled, 1, "light")  # one client keeps asking while replicas are removed
    try:
        fell, down = _wait_for(lambda n: n == 1, SCALE_TIMEOUT, light)
        time.sleep(3)  # and a few more answers from the one replica left
    finally:
        light.finish()
    assert fell, f"running replicas under one client: {down}, never back to 1"
    assert light.answered > 0 and _running() == 1
    assert max(down) <= 3, down
