"""kiln serve --ray under one load: one fixed replica against autoscaling between 1 and 3 replicas.

    python bench/serve_ray.py [--clients 8] [--seconds 60] [--rounds 2] [--size 1024 --steps 8]

A CPU model that takes one request at a time per replica (y = x + 0 * sum(M^steps), M filled from x:
matmuls no pass can fold, ~0.1 s a call at 1024 x 8 on one core) is served by Ray Serve on a local
single-node Ray cluster (every CPU of this machine, loopback only, dashboard off) with kiln's ingress
in front. Each arm deploys the model afresh ("fixed": num_replicas=1; "autoscale": --autoscale 1-3
with target_ongoing_requests 1 and the autoscaler's timing shortened to seconds), then `--clients`
loopback HTTP clients (keep-alive connections, each checking every answer against its own input)
ask back to back for `--seconds`. The arms alternate (fixed, autoscale, fixed, ...) over `--rounds`.

Per arm: requests/s, p50/p99 latency over the whole window and over its second half (by then the
autoscaled arm has had time to add its replicas), the most replicas seen RUNNING (serve.status(),
polled every 0.5 s), the seconds until that count was first reached, and the replicas that answered.
What autoscaling can gain is bounded by the machine's cores: each replica's engine runs on the
CPUs it finds, so on a 2-core machine three replicas share two cores.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kiln  # noqa: E402

CONFIG = """
max_batch_size: 1
instance_group [{ count: 1 }]
"""
APP = "bench"


def slow_model(size: int, steps: int) -> onnx.ModelProto:
    """y = x + 0 * sum(M^steps), M an expand of x's sum: steps size x size matmuls of real work."""
    rng = np.random.default_rng(0)
    weight = (rng.standard_normal((size, size)) / size).astype(np.float32)
    nodes = [helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0), helper.make_node("Expand", ["s", "square"], ["m0"])]
    nodes += [helper.make_node("MatMul", [f"m{k}", "W"], [f"m{k + 1}"]) for k in range(steps)]
    nodes += [helper.make_node("ReduceSum", [f"m{steps}"], ["total"], keepdims=0),
              helper.make_node("Mul", ["total", "zero"], ["nothing"]), helper.make_node("Add", ["x", "nothing"], ["y"])]
    graph = helper.make_graph(
        nodes, "slow", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        [numpy_helper.from_array(weight, "W"), numpy_helper.from_array(np.array([size, size], np.int64), "square"),
         numpy_helper.from_array(np.array(0, np.float32), "zero")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


class Load:
    """`clients` threads, each on its own keep-alive HTTP connection, asking until `seconds` have passed;
    every answer must equal its input (the model's y is x exactly)."""

    def __init__(self, port: int, clients: int, seconds: float, tag: str):
        self.port, self.seconds, self.tag = port, seconds, tag
        self.lock = threading.Lock()
        self.done: list[tuple[float, float]] = []  # (finish time, latency s)
        self.replicas: dict[str, int] = {}
        self.failures: list[str] = []
        self.threads = [threading.Thread(target=self._client, args=(k,), daemon=True) for k in range(clients)]

    def run(self) -> float:
        self.start = time.monotonic()
        for thread in self.threads:
            thread.start()
        for thread in self.threads:
            thread.join(self.seconds + 120)
        return self.start

    def _client(self, k: int) -> None:
        rng = np.random.default_rng(zlib.crc32(f"{self.tag}-{k}".encode()))
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        end = self.start + self.seconds
        while time.monotonic() < end:
            x = rng.standard_normal((1, 4)).astype(np.float32)
            body = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4],
                                           "data": x.ravel().tolist()}]})
            began = time.monotonic()
            try:
                connection.request("POST", "/v2/models/slow/infer", body, {"Content-Type": "application/json"})
                response = connection.getresponse()
                answer = json.loads(response.read())
                if response.status != 200:
                    raise RuntimeError(f"status {response.status}: {answer}")
                y = np.array(answer["outputs"][0]["data"], np.float32).reshape(1, 4)
                if not np.array_equal(y, x):
                    raise RuntimeError("an answer that is not its own input")
                replica = response.getheader("kiln-ray-replica", "?")
            except Exception as e:  # noqa: BLE001 - counted and shown; the client reconnects
                with self.lock:
                    self.failures.append(f"{type(e).__name__}: {e}")
                connection.close()
                connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
                continue
            finished = time.monotonic()
            with self.lock:
                self.done.append((finished, finished - began))
                self.replicas[replica] = self.replicas.get(replica, 0) + 1
        connection.close()


def _running() -> int:
    from ray import serve
    try:
        return serve.status().applications[APP].deployments["slow"].replica_states.get("RUNNING", 0)
    except KeyError:
        return 0


def _stats(rows: list[tuple[float, float]], since: float, until: float) -> tuple[float, float, float]:
    latencies = sorted(latency for finished, latency in rows if since <= finished <= until)
    if not latencies:
        return 0.0, float("nan"), float("nan")
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
    return len(latencies) / (until - since), statistics.median(latencies) * 1e3, p99 * 1e3


def arm(root: Path, autoscale: bool, port: int, args, tag: str) -> dict:
    from ray import serve

    from kiln.serve.ray import RayOptions, ReplicaOptions, deployment
    replicas = (ReplicaOptions(autoscaling=(1, 3), target_ongoing_requests=1, max_ongoing_requests=2, num_cpus=0,
                               upscale_delay_s=1, downscale_delay_s=4, look_back_period_s=2)
                if autoscale else ReplicaOptions(num_replicas=1, max_ongoing_requests=2, num_cpus=0))
    serve.run(deployment(root, RayOptions(replicas=replicas, shutdown_timeout=10)), name=APP, route_prefix="/",
              logging_config={"log_level": "WARNING", "enable_access_log": False})
    load = Load(port, args.clients, args.seconds, tag)
    timeline: list[tuple[float, int]] = []
    stop = threading.Event()

    def watch():  # never raises: a status read that fails is skipped
        while not stop.is_set():
            try:
                timeline.append((time.monotonic(), _running()))
            except Exception as e:  # noqa: BLE001 - the controller busy or restarting: the next poll may answer
                print(f"serve.status(): {type(e).__name__}: {e}", file=sys.stderr)
            stop.wait(0.5)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    start = load.run()
    stop.set()
    watcher.join()
    end = start + args.seconds
    most = max((count for _, count in timeline), default=0)
    reached = next((t for t, count in timeline if count == most), start) - start
    row = {"arm": "autoscale 1-3" if autoscale else "fixed 1", "tag": tag, "most": most, "reached_s": max(0.0, reached),
           "answered": len(load.done), "failures": len(load.failures), "answering": len(load.replicas),
           "all": _stats(load.done, start, end), "second_half": _stats(load.done, start + args.seconds / 2, end),
           "first_failures": load.failures[:3]}
    serve.delete(APP)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()

    os.environ.update({"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # loopback only: Ray's nodes on 127.0.0.1
                       "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60"})
    import ray
    from ray import serve

    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        (root / "slow" / "1").mkdir(parents=True)
        kiln.build(slow_model(args.size, args.steps).SerializeToString()).save(root / "slow" / "1" / "model.kiln")
        (root / "slow" / "config.pbtxt").write_text(CONFIG)
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False, logging_level="warning",
                 _node_ip_address="127.0.0.1", object_store_memory=200 << 20)
        rows = []
        try:
            import socket
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
            for round_ in range(args.rounds):
                for autoscale in (False, True):
                    row = arm(root, autoscale, port, args, f"r{round_}-{'auto' if autoscale else 'fixed'}")
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        finally:
            serve.shutdown()
            ray.shutdown()
    load = open("/proc/loadavg").read().split()[:3] if os.path.exists("/proc/loadavg") else ["?"]
    print(f"\n{os.cpu_count()} CPUs, {args.clients} clients x {args.seconds:.0f} s per arm, model {args.size}x"
          f"{args.steps} matmuls, one request at a time per replica; load after: {' '.join(load)}")
    print("| arm | round | req/s | p50 ms | p99 ms | 2nd half req/s | p50 ms | p99 ms | most replicas (at s) "
          "| replicas answering | failures |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        (rps, p50, p99), (rps2, p50b, p99b) = row["all"], row["second_half"]
        print(f"| {row['arm']} | {row['tag'][:2]} | {rps:.1f} | {p50:.0f} | {p99:.0f} | {rps2:.1f} | {p50b:.0f} | "
              f"{p99b:.0f} | {row['most']} ({row['reached_s']:.0f}) | {row['answering']} | {row['failures']} |")
    return 1 if any(row["failures"] for row in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
