"""A model repository as a Ray Serve application: one deployment per model, one HTTP ingress.

    app = deployment("models/", RayOptions(replicas=ReplicaOptions(num_replicas=2)))
    serve.run(app, name="kiln", route_prefix="/")

Each model's deployment options come from its config and the ReplicaOptions: replicas (a number,
or autoscaling between two numbers on ongoing requests), CPUs per replica, and for a model whose
config asks for a GPU (instance_group kind KIND_GPU) one GPU in a placement-group bundle of its
own, so a replica and its GPU are reserved together and never half-placed. Ray Serve spreads a
deployment's replicas over the cluster's nodes; max_replicas_per_node makes that a rule.

The repository path must be readable at the same path on every node that runs a replica (a shared
filesystem or a copy), as Triton's repository is on a cluster.
"""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path

import ray
from ray import serve
from ray.serve import Application

from kiln.errors import KilnError
from kiln.serve.config import ModelConfig, read_model_config
from kiln.serve.core import DEFAULT_MAX_QUEUE_SIZE
from kiln.serve.errors import ModelLoadError
from kiln.serve.http_server import DEFAULT_MAX_REQUEST_BYTES
from kiln.serve.ray.ingress import Ingress, IngressOptions
from kiln.serve.ray.replica import ModelReplica
from kiln.serve.repository import ModelRepository

INGRESS = "kiln-ingress"  # the ingress deployment's name; each model's deployment is named after the model
APP_NAME = "kiln"


@dataclass
class ReplicaOptions:
    """How a model's replicas are placed and scaled (Ray Serve deployment options)."""

    num_replicas: int = 1
    autoscaling: tuple[int, int] | None = None  # (min, max) replicas, scaled on ongoing requests
    target_ongoing_requests: float | None = None  # per replica, for autoscaling; None: half the maximum
    max_ongoing_requests: int | None = None  # per replica; None: enough to fill two batches per instance
    num_cpus: float = 1.0
    num_gpus: float | None = None  # None: 1 for a KIND_GPU model, else 0
    max_replicas_per_node: int | None = None
    # Ray Serve's autoscaler timing, for autoscaling (None: the model config's ray_* parameter, else Ray's default)
    upscale_delay_s: float | None = None  # load above target this long before replicas are added (Ray: 30)
    downscale_delay_s: float | None = None  # load below target this long before replicas are removed (Ray: 600)
    look_back_period_s: float | None = None  # the ongoing requests are averaged over this window (Ray: 30)
    metrics_interval_s: float | None = None  # how often the handles report them (Ray: 10; None with a look-back
    #                                          under 20 s: half the look-back, so the window holds two reports)


# Ray's AutoscalingConfig defaults (ray.serve.config), which its autoscaler uses for a setting left out
RAY_AUTOSCALING_DEFAULTS = {"upscale_delay_s": 30.0, "downscale_delay_s": 600.0, "look_back_period_s": 30.0,
                            "metrics_interval_s": 10.0}
AUTOSCALING_TIMING = tuple(RAY_AUTOSCALING_DEFAULTS)


@dataclass
class RayOptions:
    repository: str | Path | None = None  # a model repository folder
    model: str | Path | None = None  # or one .onnx/.kiln file
    model_name: str | None = None
    replicas: ReplicaOptions = field(default_factory=ReplicaOptions)
    models: dict[str, ReplicaOptions] = field(default_factory=dict)  # per-model overrides of `replicas`
    max_queue_size: int = DEFAULT_MAX_QUEUE_SIZE  # per replica and model, where the config sets none
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    retries: int = 2  # sends again of a request whose replica died with it in flight
    ingress_replicas: int = 1
    ingress_max_ongoing_requests: int = 1024  # per ingress replica (it only decodes, waits and encodes)
    shutdown_timeout: float = 30.0  # seconds a stopping replica gives the requests it holds
    # where `run` serves (cluster-wide Serve options: they apply when Serve starts on the cluster)
    address: str | None = None  # the Ray cluster ("auto", "ray://host:10001", "local": a new one); None: RAY_ADDRESS or a new one
    host: str = "127.0.0.1"
    http_port: int = 8000
    proxy_location: str = "EveryNode"  # EveryNode | HeadOnly | Disabled (Ray Serve's ProxyLocation)
    app_name: str = APP_NAME
    log_level: str = "warning"  # the replicas' log level; per-request access logs are off, as in kiln serve

    def repository_of(self) -> ModelRepository:
        if (self.repository is None) == (self.model is None):
            raise KilnError("serve a model repository or one model file (one of repository=, model=)")
        if self.repository is not None:
            return ModelRepository(Path(self.repository).resolve())
        return ModelRepository.single(Path(self.model).resolve(), self.model_name)


def model_config(repository: ModelRepository, name: str) -> ModelConfig:
    """The config a model's deployment options are derived from, read without loading its engine.
    A config that does not parse gets defaults here: the replica reports the error as the model's
    UNAVAILABLE reason, as kiln serve does."""
    if repository.root is None or name in repository.files:
        return ModelConfig(name=name)
    try:
        return read_model_config(repository.root / name) or ModelConfig(name=name)
    except ModelLoadError:
        return ModelConfig(name=name)


def deployment_options(config: ModelConfig, replicas: ReplicaOptions,
                       max_queue_size: int = DEFAULT_MAX_QUEUE_SIZE) -> dict:
    """Ray Serve options of a model's deployment.

    A replica takes up to max_ongoing_requests at once (into kiln's batcher, which merges them); the
    requests beyond wait in Ray's router at the ingress, at most the model's queue bound (its config's
    max_queue_size, else the server's), past which they are refused with 429 as kiln serve refuses them."""
    gpus = replicas.num_gpus if replicas.num_gpus is not None else (1 if config.instance_kind == "KIND_GPU" else 0)
    per_batch = max(config.max_batch_size, 1) if config.dynamic_batching is not None else 1
    ongoing = replicas.max_ongoing_requests or max(8, 2 * config.instance_count * per_batch)
    actor = {"num_cpus": replicas.num_cpus}
    options: dict = {"max_ongoing_requests": ongoing, "max_queued_requests": config.queue_bound or max_queue_size}
    if gpus:
        actor["num_gpus"] = gpus
        # the replica's resources reserved as one bundle, on one node (Ray Serve places the replica in bundle 0)
        options["placement_group_bundles"] = [{k: v for k, v in (("CPU", replicas.num_cpus), ("GPU", gpus)) if v}]
        options["placement_group_strategy"] = "STRICT_PACK"
    options["ray_actor_options"] = actor
    if replicas.autoscaling is not None:
        low, high = replicas.autoscaling
        if not 0 <= low <= high or high < 1:
            raise KilnError(f"model {config.name!r}: autoscaling between {low} and {high} replicas: "
                            "expected 0 <= min <= max, max >= 1")
        target = ray_parameter(config, "target_ongoing_requests", replicas.target_ongoing_requests)
        options["autoscaling_config"] = {"min_replicas": low, "max_replicas": high,
                                         "target_ongoing_requests": target or max(1, ongoing // 2),
                                         **autoscaling_timing(config, replicas)}
    else:
        if replicas.num_replicas < 1:
            raise KilnError(f"model {config.name!r}: num_replicas {replicas.num_replicas}: expected >= 1")
        options["num_replicas"] = replicas.num_replicas
    if replicas.max_replicas_per_node is not None:
        options["max_replicas_per_node"] = replicas.max_replicas_per_node
    return options


def ray_parameter(config: ModelConfig, key: str, given: float | None) -> float | None:
    """The model config's `parameters { key: "ray_<key>" }` (checked when the config was read), else `given`
    (the CLI's or RayOptions' value for every model)."""
    value = config.parameters.get(f"ray_{key}")
    return float(value) if value is not None else given


def autoscaling_timing(config: ModelConfig, replicas: ReplicaOptions) -> dict[str, float]:
    """The autoscaler timing settings of a model's autoscaling_config: each from the model config's ray_<setting>
    parameter, else the ReplicaOptions, else left to Ray. Ray's defaults (decide 30 s after the load rises and 10
    minutes after it falls, on a 30 s average reported every 10 s) suit a long-running service; a test or a bursty
    load wants seconds. A look-back of 20 s or less with no report interval given is reported every half look-back,
    so that the window averages at least two reports (Ray only warns when the window holds fewer than one)."""
    timing = {k: v for k in AUTOSCALING_TIMING if (v := ray_parameter(config, k, getattr(replicas, k))) is not None}
    for key, value in timing.items():
        if value < 0 or (value == 0 and key in ("look_back_period_s", "metrics_interval_s")):
            raise KilnError(f"model {config.name!r}: autoscaling {key} {value}: expected "
                            + ("> 0" if key in ("look_back_period_s", "metrics_interval_s") else ">= 0") + " seconds")
    look_back = timing.get("look_back_period_s", RAY_AUTOSCALING_DEFAULTS["look_back_period_s"])
    if "metrics_interval_s" not in timing and look_back <= 2 * RAY_AUTOSCALING_DEFAULTS["metrics_interval_s"]:
        timing["metrics_interval_s"] = look_back / 2
    interval = timing.get("metrics_interval_s", RAY_AUTOSCALING_DEFAULTS["metrics_interval_s"])
    if look_back <= interval:
        raise KilnError(f"model {config.name!r}: autoscaling look_back_period_s {look_back} must exceed "
                        f"metrics_interval_s {interval} (the window averages the reports within it)")
    return timing


def deployment(repository: str | Path | ModelRepository, options: RayOptions | None = None) -> Application:
    """The repository's models as a Ray Serve application (for serve.run): an ingress deployment
    with kiln serve's HTTP routes, and one deployment per model holding its engines."""
    options = options or RayOptions()
    if not isinstance(repository, ModelRepository):
        options = RayOptions(**{**options.__dict__, "repository": repository, "model": None})
        repository = options.repository_of()
    names = repository.names()
    if INGRESS in names:
        raise KilnError(f"a model may not be named {INGRESS!r} under Ray: that is the ingress deployment's name")
    unknown = sorted(set(options.models) - set(names))
    if unknown:
        raise KilnError(f"replica options for model(s) {unknown} not in the repository ({names})")
    models = {}
    for name in names:
        replicas = options.models.get(name, options.replicas)
        settings = deployment_options(model_config(repository, name), replicas, options.max_queue_size)
        models[name] = serve.deployment(ModelReplica).options(
            name=name, graceful_shutdown_timeout_s=options.shutdown_timeout, **settings).bind(
            repository, name, options.max_queue_size)
    ingress = serve.deployment(Ingress).options(name=INGRESS, num_replicas=options.ingress_replicas,
                                                max_ongoing_requests=options.ingress_max_ongoing_requests,
                                                ray_actor_options={"num_cpus": 0},
                                                graceful_shutdown_timeout_s=options.shutdown_timeout)
    return ingress.bind(repository, models, IngressOptions(options.retries, options.max_request_bytes))


def build(args: dict[str, str]) -> Application:
    """Ray Serve's application builder: `serve run kiln.serve.ray:build repository=models/ replicas=2`
    (keys: repository or model, name, replicas, autoscale=MIN-MAX, target_ongoing_requests, cpus,
    max_replicas_per_node, and with autoscale the autoscaler's timing: upscale_delay_s, downscale_delay_s,
    look_back_period_s, metrics_interval_s)."""
    known = {"repository", "model", "name", "replicas", "autoscale", "target_ongoing_requests", "cpus",
             "max_replicas_per_node", *AUTOSCALING_TIMING}
    extra = sorted(set(args) - known)
    if extra:
        raise KilnError(f"unknown argument(s) {extra}; kiln.serve.ray:build takes {sorted(known)}")
    replicas = ReplicaOptions(num_replicas=int(args.get("replicas", 1)), num_cpus=float(args.get("cpus", 1)),
                              autoscaling=parse_autoscale(args["autoscale"]) if "autoscale" in args else None)
    if "max_replicas_per_node" in args:
        replicas.max_replicas_per_node = int(args["max_replicas_per_node"])
    for key in ("target_ongoing_requests", *AUTOSCALING_TIMING):
        if key in args:
            if replicas.autoscaling is None:
                raise KilnError(f"{key} is a setting of autoscaling: give autoscale=MIN-MAX too")
            setattr(replicas, key, float(args[key]))
    options = RayOptions(repository=args.get("repository"), model=args.get("model"), model_name=args.get("name"),
                         replicas=replicas)
    return deployment(options.repository_of(), options)


def parse_autoscale(text: str) -> tuple[int, int]:
    """MIN-MAX (or MIN:MAX) replicas."""
    for sep in ("-", ":"):
        low, found, high = text.partition(sep)
        if found and low.strip().isdigit() and high.strip().isdigit():
            return int(low), int(high)
    raise KilnError(f"autoscale {text!r}: expected MIN-MAX replicas, e.g. 1-4")


def run(options: RayOptions, on_started=None) -> None:
    """Deploy on a Ray cluster (connecting to options.address, or starting a local one), serve until
    SIGINT/SIGTERM, then delete the application: Ray Serve lets every replica answer the requests it
    holds (up to shutdown_timeout) before stopping it. `kiln serve --ray` runs this; on_started gets
    the repository index once every deployment is up."""
    repository = options.repository_of()
    app = deployment(repository, options)
    # a new local cluster without the dashboard; an existing one as it was started
    address = options.address or os.environ.get("RAY_ADDRESS")  # what ray.init would connect to
    joining = address not in (None, "", "local")
    ray.init(address=options.address, **({} if joining else {"include_dashboard": False}),
             logging_level=options.log_level.upper())
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        serve.start(http_options={"host": options.host, "port": options.http_port},
                    proxy_location=options.proxy_location)
        handle = serve.run(app, name=options.app_name, route_prefix="/",
                           logging_config={"log_level": options.log_level.upper(), "enable_access_log": False})
        if on_started is not None:
            on_started(handle.index.remote().result())
        while not stop.wait(0.5):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        try:
            serve.delete(options.app_name)
        finally:
            ray.shutdown()
