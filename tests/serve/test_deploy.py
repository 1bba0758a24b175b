"""deploy/: the Dockerfile and the KServe InferenceService manifest, read as Docker and Kubernetes would read them
and checked against kiln serve itself (no Docker or cluster here): the image's command and the manifest's args are
flags `kiln serve` parses, the ports and probes are the ones it serves on, the shutdown grace is longer than its
own, the serve extra the image installs brings the event loop and HTTP parser the benchmarks measured, and
`kiln serve` started with exactly the container's command line (the address and ports moved to 127.0.0.1's free
ones) answers the manifest's probes, gRPC and /metrics, then stops cleanly on SIGTERM as the kubelet sends it."""

from __future__ import annotations

import http.client
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from serve_models import lines_until_ready

from kiln.cli import _parser as build_parser

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"


def _dockerfile() -> dict[str, list[str]]:
    """The Dockerfile's instructions (continuation lines joined), each keyword's arguments in order."""
    text = re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile").read_text())
    found: dict[str, list[str]] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keyword, _, rest = line.partition(" ")
        found.setdefault(keyword.upper(), []).append(rest.strip())
    return found


def _exec_form(value: str) -> list[str]:
    form = json.loads(value)  # the exec form: a JSON array (the shell form would wrap kiln in /bin/sh -c)
    assert isinstance(form, list) and all(isinstance(v, str) for v in form), value
    return form


def _image_command() -> list[str]:
    """What the container runs with no arguments given: ENTRYPOINT + CMD."""
    docker = _dockerfile()
    assert len(docker["ENTRYPOINT"]) == 1 and len(docker["CMD"]) == 1
    return _exec_form(docker["ENTRYPOINT"][0]) + _exec_form(docker["CMD"][0])


def _entrypoint() -> list[str]:
    return _exec_form(_dockerfile()["ENTRYPOINT"][0])


def _serve_args(argv: list[str]):
    """`kiln serve ...` parsed by kiln's own CLI (a flag it does not know exits: SystemExit)."""
    assert argv[:2] == ["kiln", "serve"], argv
    return build_parser().parse_args(argv[1:])


def _inference_service() -> dict:
    documents = [d for d in yaml.safe_load_all((DEPLOY / "kserve-inferenceservice.yaml").read_text()) if d]
    services = [d for d in documents if d.get("kind") == "InferenceService"]
    assert len(services) == 1
    service = services[0]
    assert service["apiVersion"] == "serving.kserve.io/v1beta1"
    return service


def _container(service: dict) -> dict:
    containers = service["spec"]["predictor"]["containers"]
    assert len(containers) == 1 and containers[0]["name"] == "kserve-container"  # KServe's name for a custom predictor
    return containers[0]


def test_image_runs_kiln_serve_on_every_interface_with_the_default_ports():
    args = _serve_args(_image_command())
    assert args.host == "0.0.0.0"  # a container's port is reached from outside it: not the default 127.0.0.1
    assert args.repository == "/models"
    docker = _dockerfile()
    exposed = {int(port) for line in docker["EXPOSE"] for port in line.split()}
    # the defaults the image relies on (no port flags): HTTP 8000, gRPC 8001, metrics 8002
    assert args.http_port == 8000 and args.grpc_port is None and args.metrics_port is None
    assert exposed == {8000, 8001, 8002}
    (healthcheck,) = docker["HEALTHCHECK"]
    assert "http://127.0.0.1:8000/v2/health/ready" in healthcheck
    for line in docker["COPY"]:  # what the image builds from exists in the checkout
        for source in shlex.split(line)[:-1]:
            assert (REPO / source).exists(), source


def test_the_image_installs_the_fast_event_loop_and_http_parser():
    """The image installs `.[serve]`: that extra must bring uvloop and httptools, or kiln serve runs on asyncio's
    loop and uvicorn's pure-Python h11 parser, not the configuration every bench/results/serve-* number was
    measured on (uvloop took about a quarter off the server's CPU per gRPC request: kiln/serve/server.py)."""
    assert any('".[serve]"' in line or "'.[serve]'" in line for line in _dockerfile()["RUN"])
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["serve"]
    names = {re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].lower() for requirement in extra}
    assert {"uvloop", "httptools", "uvicorn", "fastapi", "grpcio", "tritonclient", "hpack"} <= names, names


def test_manifest_args_are_kiln_serve_flags_and_its_probes_and_ports_match():
    service = _inference_service()
    container = _container(service)
    # args replace the image's CMD and keep its ENTRYPOINT (kiln serve --host 0.0.0.0): a `command` would drop
    # --host and the server would listen on the pod's loopback only, where no probe or ingress reaches it
    assert "command" not in container
    args = _serve_args(_entrypoint() + container["args"])
    assert args.host == "0.0.0.0"
    served = {args.http_port: "HTTP", args.grpc_port: "gRPC", args.metrics_port: "metrics"}
    (port,) = container["ports"]
    # KServe routes one port: h2c for gRPC, http1 for HTTP/JSON
    assert served.get(port["containerPort"]) == {"h2c": "gRPC", "http1": "HTTP"}[port["name"]]
    probes = {kind: container[kind]["httpGet"] for kind in ("livenessProbe", "readinessProbe", "startupProbe")}
    assert all(probe["port"] == args.http_port for probe in probes.values())
    assert probes["livenessProbe"]["path"] == "/v2/health/live"
    assert probes["readinessProbe"]["path"] == probes["startupProbe"]["path"] == "/v2/health/ready"
    # the kubelet's SIGKILL comes terminationGracePeriodSeconds after its SIGTERM: requests in flight need kiln
    # serve's own shutdown timeout to pass first
    grace = service["spec"]["predictor"]["terminationGracePeriodSeconds"]
    assert grace > args.shutdown_timeout
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert args.repository == mounts["models"]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(port: int, path: str) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


@pytest.fixture(scope="module")
def mlp_repository(tmp_path_factory) -> Path:
    """One small model (the test repository's mlp, default config): kiln serve starts in seconds."""
    import kiln
    from serve_models import mlp

    root = tmp_path_factory.mktemp("deploy-repository")
    (root / "mlp" / "1").mkdir(parents=True)
    kiln.build(mlp().SerializeToString()).save(root / "mlp" / "1" / "model.kiln")
    return root


def test_the_manifests_command_line_serves_its_probes_grpc_and_metrics(mlp_repository):
    """kiln serve run with the container's own command line (ENTRYPOINT + the manifest's args), on 127.0.0.1 and free
    ports instead of every interface and 8080-8082, and a one-model repository for /mnt/models: the probes answer 200
    where the manifest points them, tritonclient's gRPC answers on the container port, /metrics on the metrics port
    has Triton's names, and SIGTERM (the kubelet's stop) ends it with status 0 within the grace period."""
    import tritonclient.grpc as grpcclient

    repository = mlp_repository
    service = _inference_service()
    container = _container(service)
    argv = _entrypoint() + container["args"]
    args = _serve_args(argv)
    moved = {str(args.http_port): str(_free_port()), str(args.grpc_port): str(_free_port()),
             str(args.metrics_port): str(_free_port())}
    command = []
    for k, value in enumerate(argv[2:]):
        previous = argv[2 + k - 1] if k else ""
        if previous == "--host":
            value = "127.0.0.1"  # tests bind loopback only
        elif previous in ("--http-port", "--grpc-port", "--metrics-port"):
            value = moved[value]
        elif value == args.repository:
            value = str(repository)
        command.append(value)
    process = subprocess.Popen([sys.executable, "-m", "kiln", "serve", *command], cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        lines = lines_until_ready(process, 120)
        assert lines and lines[-1].strip() == "kiln serve: ready", "".join(lines)
        http_port = int(moved[str(args.http_port)])
        for kind in ("livenessProbe", "readinessProbe", "startupProbe"):
            probe = container[kind]["httpGet"]
            assert _get(int(moved[str(probe["port"])]), probe["path"])[0] == 200, kind
        grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{moved[str(args.grpc_port)]}")
        try:
            assert grpc.is_server_ready() and grpc.is_model_ready("mlp")
        finally:
            grpc.close()
        status, body = _get(int(moved[str(args.metrics_port)]), "/metrics")
        assert status == 200 and b'nv_inference_request_success{model="mlp"' in body
        assert _get(http_port, "/v2/health/ready")[0] == 200
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=service["spec"]["predictor"]["terminationGracePeriodSeconds"])
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, output
    assert "kiln serve: stopped" in output


@pytest.mark.parametrize("flag", ["--no-such-flag", "--http-port"])
def test_a_manifest_with_a_flag_kiln_serve_does_not_take_is_caught(flag):
    """The checks above can fail: an unknown flag, or one missing its value, does not parse."""
    with pytest.raises(SystemExit):
        _serve_args(["kiln", "serve", "/mnt/models", flag])
