"""`kiln serve --ray` as a user runs it: a process that starts its own local Ray cluster (`--ray-address
local`), deploys the repository, prints its models and `ready`, serves tritonclient.http on 127.0.0.1,
and on SIGTERM deletes the application (Ray Serve lets replicas finish what they hold) and exits 0."""

from __future__ import annotations

import os
import re
import shutil
import random
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("ray.serve")

import tritonclient.http as httpclient
from serve_models import CONFIGS, MLP_W, lines_until_ready, mlp

import kiln

REPO = Path(__file__).resolve().parents[2]


def _port_ray_leaves_alone() -> int:
    """A free loopback port outside the kernel's ephemeral range (32768-60999) and Ray's worker ports (10002-19999):
    a port the OS handed out as free could be handed again to one of the processes Ray starts before its proxy
    binds it (CI failed once: "Failed to bind to address '127.0.0.1:41997'")."""
    for port in random.sample(range(20000, 32000), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32000")


def test_kiln_serve_ray_cli(tmp_path, engines):
    engine = engines / "ray_mlp.kiln"
    if not engine.exists():
        kiln.build(mlp().SerializeToString()).save(engine)
    (tmp_path / "mlp" / "1").mkdir(parents=True)
    shutil.copy(engine, tmp_path / "mlp" / "1" / "model.kiln")
    (tmp_path / "mlp" / "config.pbtxt").write_text(CONFIGS["mlp"])
    port = _port_ray_leaves_alone()
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # Ray's loopback mode: every Ray process on 127.0.0.1
           "RAY_DEFAULT_OBJECT_STORE_MEMORY_PROPORTION": "0.01"}  # ~230 MiB of this machine's 23 GiB
    process = subprocess.Popen(
        [sys.executable, "-m", "kiln", "serve", "--ray", str(tmp_path), "--ray-address", "local", "--http-port",
         str(port), "--proxy-location", "HeadOnly", "--shutdown-timeout", "10"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    try:
        output = "".join(lines_until_ready(process, 240))
        assert "kiln serve: ready" in output, output
        assert "kiln serve: model mlp version 1: READY" in output
        assert re.search(rf"kiln serve: HTTP on 127\.0\.0\.1:{port}", output)

        client = httpclient.InferenceServerClient(f"127.0.0.1:{port}", connection_timeout=60, network_timeout=60)
        try:
            assert client.is_server_ready()
            x = np.random.default_rng().standard_normal((4, 8)).astype(np.float32)
            tensor = httpclient.InferInput("x", [4, 8], "FP32")
            tensor.set_data_from_numpy(x)
            result = client.infer("mlp", [tensor])
            np.testing.assert_array_equal(result.as_numpy("z"), 2 * x)
            np.testing.assert_allclose(result.as_numpy("y"), np.maximum(x @ MLP_W, 0), rtol=1e-5, atol=1e-5)
        finally:
            client.close()

        process.send_signal(signal.SIGTERM)
        rest, _ = process.communicate(timeout=120)
        assert process.returncode == 0, output + rest
        assert "kiln serve: stopped" in rest
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)  # its own session: the Ray processes it started go too
            process.wait(30)
