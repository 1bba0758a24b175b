"""kiln.serve.ray without a cluster: each model's deployment options from its config (checked by Ray
Serve's own option validation), the ingress's retries and errors over fake deployment handles, the
CLI's refusals, and ray staying out of `kiln serve` without --ray."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("ray.serve")

from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError
from ray.serve.exceptions import BackPressureError

from kiln.cli import main
from kiln.errors import KilnError
from kiln.serve.config import DynamicBatching, ModelConfig
from kiln.serve.core import InferRequest, InferResponse
from kiln.serve.errors import InvalidRequest, ModelLoadError, QueueFull, Unavailable
from kiln.serve.ray import (
    RayOptions,
    ReplicaOptions,
    build,
    deployment,
    deployment_options,
)
from kiln.serve.ray.app import parse_autoscale
from kiln.serve.ray.ingress import ANSWERED, Answered, RayCore
from kiln.serve.ray.replica import (
    ModelDescription,
    ModelReplica,
    ReplicaAnswer,
    ReplicaIdentity,
    VersionDescription,
)
from kiln.serve.repository import ModelRepository

REPO = Path(__file__).resolve().parents[2]


def _config(kind: str = "KIND_CPU", max_batch: int = 16, instances: int = 2, batching: bool = True) -> ModelConfig:
    return ModelConfig(name="m", max_batch_size=max_batch, instance_count=instances, instance_kind=kind,
                       dynamic_batching=DynamicBatching() if batching else None)


def _accepted_by_ray(options: dict) -> dict:
    """Ray Serve validates deployment options when they are set (types, ranges, conflicts)."""
    serve.deployment(ModelReplica).options(name="m", **options)
    return options


def test_cpu_model_options():
    options = _accepted_by_ray(deployment_options(_config(), ReplicaOptions(num_replicas=3, num_cpus=2)))
    # two batches of 16 in flight per instance, 2 instances: enough to keep the batcher's queue fed
    assert options == {"max_ongoing_requests": 64, "max_queued_requests": 1024, "ray_actor_options": {"num_cpus": 2},
                       "num_replicas": 3}
    bounded = _config()
    bounded.dynamic_batching.max_queue_size = 10
    assert deployment_options(bounded, ReplicaOptions(), max_queue_size=99)["max_queued_requests"] == 10
    assert deployment_options(_config(), ReplicaOptions(), max_queue_size=99)["max_queued_requests"] == 99
    unbatched = deployment_options(_config(max_batch=0, instances=1, batching=False), ReplicaOptions())
    assert unbatched["max_ongoing_requests"] == 8
    pinned = deployment_options(_config(), ReplicaOptions(max_ongoing_requests=5, max_replicas_per_node=1))
    assert pinned["max_ongoing_requests"] == 5 and pinned["max_replicas_per_node"] == 1


def test_gpu_model_reserves_its_gpu_in_a_bundle():
    options = _accepted_by_ray(deployment_options(_config("KIND_GPU"), ReplicaOptions(num_cpus=1)))
    assert options["ray_actor_options"] == {"num_cpus": 1, "num_gpus": 1}
    assert options["placement_group_bundles"] == [{"CPU": 1, "GPU": 1}]
    assert options["placement_group_strategy"] == "STRICT_PACK"
    no_cpu = deployment_options(_config("KIND_GPU"), ReplicaOptions(num_cpus=0))
    assert no_cpu["placement_group_bundles"] == [{"GPU": 1}]  # a bundle lists what it reserves
    # a CPU model given a GPU by option (a KIND_AUTO engine built for CUDA), and a GPU model kept off one
    assert deployment_options(_config(), ReplicaOptions(num_gpus=0.5))["ray_actor_options"]["num_gpus"] == 0.5
    assert "placement_group_bundles" not in deployment_options(_config("KIND_GPU"), ReplicaOptions(num_gpus=0))


def test_autoscaling_on_ongoing_requests():
    options = _accepted_by_ray(deployment_options(_config(), ReplicaOptions(autoscaling=(1, 4))))
    assert "num_replicas" not in options
    assert options["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 32}
    explicit = deployment_options(_config(), ReplicaOptions(autoscaling=(0, 2), target_ongoing_requests=3))
    assert explicit["autoscaling_config"]["target_ongoing_requests"] == 3
    with pytest.raises(KilnError, match="autoscaling between 3 and 2 replicas"):
        deployment_options(_config(), ReplicaOptions(autoscaling=(3, 2)))
    with pytest.raises(KilnError, match="num_replicas 0"):
        deployment_options(_config(), ReplicaOptions(num_replicas=0))
    assert parse_autoscale("1-4") == (1, 4) and parse_autoscale("0:2") == (0, 2)
    with pytest.raises(KilnError, match="expected MIN-MAX"):
        parse_autoscale("four")


def test_autoscaler_timing_from_options_and_model_config():
    """upscale/downscale delays, look-back and report interval: the model config's ray_* parameter over the
    ReplicaOptions (the CLI's) over Ray's default; a short look-back gets reports twice within it."""
    fast = ReplicaOptions(autoscaling=(1, 3), upscale_delay_s=0.5, downscale_delay_s=2, look_back_period_s=1)
    options = _accepted_by_ray(deployment_options(_config(), fast))
    assert options["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 32,
                                             "upscale_delay_s": 0.5, "downscale_delay_s": 2,
                                             "look_back_period_s": 1, "metrics_interval_s": 0.5}
    # only the delays: Ray's 30 s look-back and 10 s reports stay Ray's
    delays = deployment_options(_config(), ReplicaOptions(autoscaling=(1, 3), downscale_delay_s=0))
    assert delays["autoscaling_config"]["downscale_delay_s"] == 0
    assert "look_back_period_s" not in delays["autoscaling_config"]
    assert "metrics_interval_s" not in delays["autoscaling_config"]
    configured = _config()
    configured.parameters = {"ray_upscale_delay_s": "4", "ray_target_ongoing_requests": "3",
                             "ray_metrics_interval_s": "0.25"}
    scaled = _accepted_by_ray(deployment_options(configured, fast))["autoscaling_config"]
    assert (scaled["upscale_delay_s"], scaled["downscale_delay_s"], scaled["target_ongoing_requests"],
            scaled["metrics_interval_s"]) == (4.0, 2, 3.0, 0.25)
    assert "autoscaling_config" not in deployment_options(configured, ReplicaOptions(num_replicas=2))
    with pytest.raises(KilnError, match="look_back_period_s 5.0 must exceed metrics_interval_s 10"):
        deployment_options(_config(), ReplicaOptions(autoscaling=(1, 2), look_back_period_s=5.0,
                                                     metrics_interval_s=10))
    with pytest.raises(KilnError, match="upscale_delay_s -1: expected >= 0"):
        deployment_options(_config(), ReplicaOptions(autoscaling=(1, 2), upscale_delay_s=-1))
    with pytest.raises(KilnError, match="look_back_period_s 0: expected > 0"):
        deployment_options(_config(), ReplicaOptions(autoscaling=(1, 2), look_back_period_s=0))


def test_model_config_checks_its_ray_parameters(tmp_path):
    from kiln.serve.config import read_model_config
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.pbtxt").write_text(
        'parameters { key: "ray_downscale_delay_s" value: { string_value: "0" } }\n'
        'parameters { key: "ray_look_back_period_s" value: { string_value: "2.5" } }\n')
    assert read_model_config(tmp_path / "m").parameters == {"ray_downscale_delay_s": "0",
                                                           "ray_look_back_period_s": "2.5"}
    (tmp_path / "m" / "config.pbtxt").write_text(
        'parameters { key: "ray_look_back_period_s" value: { string_value: "0" } }\n'
        'parameters { key: "ray_upscale_delay_s" value: { string_value: "soon" } }\n')
    with pytest.raises(ModelLoadError) as error:
        read_model_config(tmp_path / "m")
    assert "parameter ray_look_back_period_s '0': expected a number > 0" in str(error.value)
    assert "parameter ray_upscale_delay_s 'soon': expected a number >= 0" in str(error.value)


def _repository(tmp_path: Path, *names: str) -> Path:
    for name in names:
        (tmp_path / name / "1").mkdir(parents=True)
    return tmp_path


def test_application_refusals(tmp_path):
    root = _repository(tmp_path, "a", "b")
    app = deployment(root, RayOptions(models={"b": ReplicaOptions(num_replicas=2)}))
    assert app is not None  # built without a cluster: nothing runs until serve.run
    with pytest.raises(KilnError, match=r"replica options for model\(s\) \['c'\]"):
        deployment(root, RayOptions(models={"c": ReplicaOptions()}))
    with pytest.raises(KilnError, match="may not be named 'kiln-ingress'"):
        deployment(_repository(tmp_path / "x", "kiln-ingress"))


def test_application_builder_arguments(tmp_path):
    """`serve run kiln.serve.ray:build repository=... replicas=2` hands build() its key=value pairs."""
    root = _repository(tmp_path, "a")
    assert build({"repository": str(root), "replicas": "2", "cpus": "0.5", "max_replicas_per_node": "1"}) is not None
    assert build({"repository": str(root), "autoscale": "1-3"}) is not None
    assert build({"repository": str(root), "autoscale": "1-3", "upscale_delay_s": "1", "downscale_delay_s": "5",
                  "look_back_period_s": "2", "target_ongoing_requests": "2"}) is not None
    with pytest.raises(KilnError, match="downscale_delay_s is a setting of autoscaling"):
        build({"repository": str(root), "downscale_delay_s": "5"})
    with pytest.raises(KilnError, match=r"unknown argument\(s\) \['replica'\]"):
        build({"repository": str(root), "replica": "2"})
    with pytest.raises(KilnError, match="one of repository=, model="):
        build({})


# ---- the ingress over fake handles ----------------------------------------------------------------

WHO = ReplicaIdentity("node-a", "SERVE_REPLICA::kiln#m#abc", 1)


class _Method:
    def __init__(self, outcomes):
        self.outcomes = list(outcomes)  # answers or exceptions, one per call
        self.calls = 0

    def remote(self, *args):
        self.calls += 1
        outcome = self.outcomes.pop(0)

        async def answer():
            if isinstance(outcome, BaseException):
                raise outcome
            return outcome(*args) if callable(outcome) else outcome

        return answer()


class _Handle:
    def __init__(self, infer_outcomes):
        config = _config(max_batch=4)
        self.describe = _Method([ModelDescription("m", "READY", "", {"1": VersionDescription(config, {"name": "m"})},
                                                  WHO)])
        self.infer = _Method(infer_outcomes)


def _echo(request: InferRequest) -> ReplicaAnswer:
    return ReplicaAnswer(WHO, InferResponse("m", "1", request.id, [("y", request.inputs["x"])]))


def _run(core: RayCore, request: InferRequest) -> tuple[InferResponse, Answered]:
    async def go():
        answered = Answered()
        ANSWERED.set(answered)
        await core.start()
        return await core.infer(request), answered

    return asyncio.run(go())


def _core(tmp_path, outcomes, retries=2) -> tuple[RayCore, _Handle]:
    handle = _Handle(outcomes)
    return RayCore(ModelRepository(_repository(tmp_path, "m")), {"m": handle}, retries), handle


def test_a_request_whose_replica_died_is_sent_again(tmp_path):
    x = np.random.default_rng().standard_normal((2, 4)).astype(np.float32)
    core, handle = _core(tmp_path, [ActorDiedError(), ActorUnavailableError("gone", None), _echo])
    response, answered = _run(core, InferRequest("m", inputs={"x": x}, id="r"))
    np.testing.assert_array_equal(response.outputs[0][1], x)
    assert response.id == "r" and handle.infer.calls == 3
    assert answered.attempts == 3 and answered.replica == WHO


def test_replica_deaths_past_the_retries_answer_503(tmp_path):
    core, handle = _core(tmp_path, [ActorDiedError()] * 2, retries=1)
    with pytest.raises(Unavailable, match="died 2 time") as raised:
        _run(core, InferRequest("m", inputs={"x": np.zeros((1, 4), np.float32)}))
    assert raised.value.http_status == 503 and handle.infer.calls == 2


def test_replica_errors_and_back_pressure_keep_their_status(tmp_path):
    refused = InvalidRequest("input 'x' of model 'm': shape [1, 5] given")
    core, _ = _core(tmp_path, [ReplicaAnswer(WHO, error=refused)])
    with pytest.raises(InvalidRequest, match="shape"):  # the replica's 400, raised as is at the ingress
        _run(core, InferRequest("m", inputs={"x": np.zeros((1, 5), np.float32)}))
    core, _ = _core(tmp_path / "q", [BackPressureError(num_queued_requests=5, max_queued_requests=5)])
    with pytest.raises(QueueFull):
        _run(core, InferRequest("m", inputs={"x": np.zeros((1, 4), np.float32)}))


# ---- the CLI ------------------------------------------------------------------------------------

@pytest.mark.parametrize("extra, message", [
    (["--grpc-port", "9001"], "serves HTTP only"),
    (["--replicas", "2", "--autoscale", "1-3"], "not both"),
    (["--model-control-mode", "explicit"], "explicit model control"),
    (["--http-port", "0"], "fixed --http-port"),
    (["--downscale-delay", "5", "--look-back-period", "2"], "--downscale-delay, --look-back-period: settings of "
                                                            "autoscaling"),
    (["--autoscale", "1-2", "--look-back-period", "2", "--autoscale-metrics-interval", "3"],
     "look_back_period_s 2.0 must exceed metrics_interval_s 3.0"),
])
def test_cli_refusals(tmp_path, capsys, extra, message):
    assert main(["serve", "--ray", str(_repository(tmp_path, "m")), *extra]) == 1
    assert message in capsys.readouterr().err


def test_kiln_serve_without_ray_imports_no_ray():
    code = ("import sys; import kiln.cli, kiln.cli.serve, kiln.serve.server; "
            "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                            check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
