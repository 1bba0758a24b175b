"""A served model's configuration: Triton's model config (a subset), read, completed and checked.

A model folder of the repository may hold `config.pbtxt` (Triton's text format) or `config.json`
(the same message as JSON, as Triton's load API takes it); both parse into Triton's own
`ModelConfig` protobuf (shipped with tritonclient), so a field kiln does not know is an error with
its name, never silently dropped. What kiln serve reads:

    name, platform/backend ("", "kiln", "onnxruntime_onnx": a Triton ONNX model folder serves as is)
    max_batch_size          0: no batching, requests give full shapes; N: axis 0 is the batch, <= N
    input / output          name, data_type (TYPE_FP32...), dims (without the batch axis; -1: any)
    dynamic_batching        preferred_batch_size, max_queue_delay_microseconds,
                            default_queue_policy { max_queue_size, default_timeout_microseconds }
    instance_group          count (execution contexts of one engine), kind (KIND_CPU | KIND_GPU)
    version_policy          latest { num_versions } (default 1) | all {} | specific { versions }
    parameters              build options for a model.onnx: precision, opt_level, profile
                            (kiln build's --profile syntax), pad_dims; the batcher's pad_to_merge
                            and buckets (true/false, kiln/serve/batcher.py); warm_up: true | false |
                            SECONDS (a CPU instance binds the profile's shapes before the model is
                            ready, for at most SECONDS, "true": WARM_UP_DEFAULT; default: the server's
                            --warm-up; "false" also skips a CUDA instance's graph captures at load;
                            Triton's model_warmup, sample requests, is refused: kiln makes its own);
                            cuda_sync: spin | pinned | blocking | staged (how a CUDA instance waits for its stream,
                            kiln/serve/instances.py; default: the server's --cuda-sync);
                            batch_buckets: pow2 | half (the batch buckets a CUDA instance's graphs are captured
                            at: powers of two, or also 12, 24, 48, ... (less padding, more graphs),
                            kiln/runtime/buckets.py; default: the server's --batch-buckets);
                            under --ray, with --autoscale: ray_target_ongoing_requests and the
                            autoscaler's timing, ray_upscale_delay_s, ray_downscale_delay_s,
                            ray_look_back_period_s, ray_metrics_interval_s (seconds; default: the
                            CLI's, else Ray's; kiln/serve/ray/app.py autoscaling_timing)

A config that leaves out inputs and outputs is completed from the engine's bindings (Triton's
auto-complete); with max_batch_size also 0, batching is inferred: an engine whose inputs and
outputs all start with one symbolic dim serves batches up to its profile's largest.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from google.protobuf import json_format, text_format
from google.protobuf.descriptor import FieldDescriptor
from tritonclient.grpc import model_config_pb2 as pb

from kiln import Engine
from kiln.runtime.buckets import BATCH_STEPS
from kiln.serve import datatypes
from kiln.serve.datatypes import Datatype
from kiln.serve.errors import ModelLoadError

PLATFORMS = {"", "kiln", "onnxruntime_onnx", "onnxruntime"}
# parameters { key: ... }: build options for a model.onnx, and the batcher's own
# and Ray Serve's autoscaling settings of the model's deployment (kiln/serve/ray/app.py; kiln serve alone ignores them)
RAY_PARAMETERS = {"ray_target_ongoing_requests", "ray_upscale_delay_s", "ray_downscale_delay_s",
                  "ray_look_back_period_s", "ray_metrics_interval_s"}
PARAMETERS = {"precision", "opt_level", "profile", "pad_dims", "pad_to_merge", "buckets", "warm_up", "cuda_sync",
              "batch_buckets", *RAY_PARAMETERS}
UNSUPPORTED = ["sequence_batching", "ensemble_scheduling", "batch_input", "batch_output", "response_cache",
               "model_transaction_policy", "model_repository_agents"]
# warm_up's default (ServeOptions.warm_up, `kiln serve --warm-up`): a CPU instance binds the profile's shapes for at
# most this many seconds before its model is ready (bench/results/serve-warmup-2026-12-04c.md)
WARM_UP_DEFAULT = "0.5"
# how a CUDA instance waits for its stream (kiln/serve/instances.py), where a model's config sets no cuda_sync parameter
# (ServeOptions.cuda_sync, `kiln serve --cuda-sync`)
CUDA_SYNCS = ("spin", "pinned", "blocking", "staged")
CUDA_SYNC_DEFAULT = "spin"
# a bucketed instance's batch buckets (kiln/runtime/buckets.py BATCH_STEPS), where a model's config sets no
# batch_buckets parameter (ServeOptions.batch_buckets, `kiln serve --batch-buckets`): "half" since the H200 served
# BERT-base (2 instances, c = 64, gRPC) at 4,529 infer/s and p99 28.7 ms with it against 4,214 and 36.9 with "pow2"
# (bench/gpu_s33a.sh, bench/results/serve-buckets-2026-12-07.md); a context whose half buckets would pass its graph
# cache keeps pow2
BATCH_BUCKETS_DEFAULT = "half"


@dataclass
class TensorConfig:
    name: str
    datatype: Datatype
    dims: list[int]  # without the batch axis when max_batch_size > 0; -1: any size

    def shape(self, max_batch_size: int) -> list[int]:
        """The shape model metadata reports: -1 for the batch axis."""
        return ([-1] if max_batch_size > 0 else []) + list(self.dims)


@dataclass
class DynamicBatching:
    preferred_batch_size: list[int] = field(default_factory=list)
    max_queue_delay_microseconds: int = 0
    max_queue_size: int = 0  # 0: the server's bound (--max-queue-size); kiln never queues without one
    default_timeout_microseconds: int = 0  # 0: none


@dataclass
class VersionPolicy:
    kind: str = "latest"  # latest | all | specific
    num_versions: int = 1
    versions: list[int] = field(default_factory=list)

    def select(self, available: list[int]) -> list[int]:
        if self.kind == "all":
            return sorted(available)
        if self.kind == "specific":
            return sorted(v for v in available if v in self.versions)
        return sorted(available)[-self.num_versions:]


@dataclass
class ModelConfig:
    name: str
    max_batch_size: int = 0
    inputs: list[TensorConfig] = field(default_factory=list)
    outputs: list[TensorConfig] = field(default_factory=list)
    dynamic_batching: DynamicBatching | None = None
    instance_count: int = 1
    instance_kind: str = "KIND_AUTO"  # KIND_AUTO | KIND_CPU | KIND_GPU
    version_policy: VersionPolicy = field(default_factory=VersionPolicy)
    parameters: dict[str, str] = field(default_factory=dict)
    platform: str = "kiln"

    def input(self, name: str) -> TensorConfig | None:
        return next((t for t in self.inputs if t.name == name), None)

    def output(self, name: str) -> TensorConfig | None:
        return next((t for t in self.outputs if t.name == name), None)

    @property
    def queue_bound(self) -> int:
        return self.dynamic_batching.max_queue_size if self.dynamic_batching else 0

    # ---- Triton's message ----------------------------------------------------------------------

    def to_proto(self) -> pb.ModelConfig:
        message = pb.ModelConfig(name=self.name, platform=self.platform, backend="kiln",
                                 max_batch_size=self.max_batch_size)
        for tensors, target in ((self.inputs, message.input), (self.outputs, message.output)):
            for t in tensors:
                target.add(name=t.name, data_type=pb.DataType.Value(t.datatype.config), dims=t.dims)
        if self.dynamic_batching is not None:
            b = self.dynamic_batching
            message.dynamic_batching.preferred_batch_size.extend(b.preferred_batch_size)
            message.dynamic_batching.max_queue_delay_microseconds = b.max_queue_delay_microseconds
            message.dynamic_batching.default_queue_policy.max_queue_size = b.max_queue_size
            message.dynamic_batching.default_queue_policy.default_timeout_microseconds = \
                b.default_timeout_microseconds
        kind = self.instance_kind if self.instance_kind != "KIND_AUTO" else "KIND_CPU"
        message.instance_group.add(name=f"{self.name}_0", count=self.instance_count,
                                   kind=pb.ModelInstanceGroup.Kind.Value(kind))
        policy = self.version_policy
        if policy.kind == "all":
            message.version_policy.all.SetInParent()
        elif policy.kind == "specific":
            message.version_policy.specific.versions.extend(policy.versions)
        else:
            message.version_policy.latest.num_versions = policy.num_versions
        for key, value in self.parameters.items():
            message.parameters[key].string_value = value
        return message

    def to_json(self) -> dict[str, Any]:
        """The config as Triton's HTTP API returns it: proto field names, 64-bit integers as numbers."""
        message = self.to_proto()
        return _int64_as_numbers(message.DESCRIPTOR, json_format.MessageToDict(
            message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True))


def _int64_as_numbers(descriptor, value: dict) -> dict:
    wide = {FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64,
            FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64}
    for key, item in value.items():
        f = descriptor.fields_by_name.get(key)
        if f is None:
            continue
        if f.type in wide:
            value[key] = [int(x) for x in item] if isinstance(item, list) else int(item)
        elif f.message_type is not None:
            sub = f.message_type
            if sub.GetOptions().map_entry:
                v = sub.fields_by_name["value"]
                if v.message_type is not None:
                    for k in item:
                        _int64_as_numbers(v.message_type, item[k])
            elif isinstance(item, list):
                for x in item:
                    _int64_as_numbers(sub, x)
            else:
                _int64_as_numbers(sub, item)
    return value


# ---- reading ------------------------------------------------------------------------------------

def parse_pbtxt(text: str, where: str) -> ModelConfig:
    try:
        message = text_format.Parse(text, pb.ModelConfig())
    except text_format.ParseError as e:
        raise ModelLoadError(f"{where}: not a Triton model config: {e}") from None
    return from_proto(message, where)


def parse_json(text: str | dict, where: str) -> ModelConfig:
    try:
        data = json.loads(text) if isinstance(text, str) else text
        message = json_format.ParseDict(data, pb.ModelConfig())
    except (json.JSONDecodeError, json_format.ParseError, TypeError, AttributeError) as e:
        raise ModelLoadError(f"{where}: not a Triton model config in JSON: {e}") from None
    return from_proto(message, where)


def read_model_config(folder: Path) -> ModelConfig | None:
    """The model folder's config.pbtxt or config.json, or None when it has neither."""
    pbtxt, js = folder / "config.pbtxt", folder / "config.json"
    if pbtxt.exists() and js.exists():
        raise ModelLoadError(f"{folder}: both config.pbtxt and config.json; keep one")
    if pbtxt.exists():
        config = parse_pbtxt(pbtxt.read_text(), str(pbtxt))
    elif js.exists():
        config = parse_json(js.read_text(), str(js))
    else:
        return None
    config.name = config.name or folder.name
    if config.name != folder.name:
        raise ModelLoadError(f"{folder}: the config names model {config.name!r}, its folder {folder.name!r}")
    return config


def from_proto(message: pb.ModelConfig, where: str) -> ModelConfig:
    problems = [f"{name} is not supported by kiln serve; remove it" for name in UNSUPPORTED
                if _is_set(message, name)]
    if len(message.model_warmup):
        problems.append("model_warmup (sample requests) is not supported by kiln serve; kiln warms a model up itself: "
                        "parameters { key: \"warm_up\" value: { string_value: \"true\" | \"false\" | \"SECONDS\" } }")
    platform = message.platform or message.backend
    if platform not in PLATFORMS:
        problems.append(f"platform/backend {platform!r}: kiln serves {sorted(PLATFORMS - {''})} models")
    if message.max_batch_size < 0:
        problems.append(f"max_batch_size {message.max_batch_size} must be >= 0")
    tensors: dict[str, list[TensorConfig]] = {"input": [], "output": []}
    for kind, found in tensors.items():
        for t in getattr(message, kind):
            type_name = pb.DataType.Name(t.data_type)
            datatype = datatypes.BY_CONFIG.get(type_name)
            if datatype is None:
                problems.append(f"{kind} {t.name!r}: data_type {type_name} is not supported")
                continue
            if t.HasField("reshape"):
                problems.append(f"{kind} {t.name!r}: reshape is not supported")
            if any(d < -1 for d in t.dims):
                problems.append(f"{kind} {t.name!r}: dims {list(t.dims)} must be >= -1")
            found.append(TensorConfig(t.name, datatype, list(t.dims)))
    batching = None
    if message.HasField("dynamic_batching"):
        d = message.dynamic_batching
        if message.max_batch_size == 0 and (message.input or message.output):
            problems.append("dynamic_batching needs max_batch_size > 0")
        bad = [p for p in d.preferred_batch_size if p < 1 or message.max_batch_size and p > message.max_batch_size]
        if bad:
            problems.append(f"preferred_batch_size {bad} must lie in 1..max_batch_size ({message.max_batch_size})")
        if d.priority_levels or d.priority_queue_policy:
            problems.append("dynamic_batching priority levels are not supported")
        policy = d.default_queue_policy
        batching = DynamicBatching(list(d.preferred_batch_size), d.max_queue_delay_microseconds,
                                   policy.max_queue_size, policy.default_timeout_microseconds)
    count, kinds = 0, set()
    for group in message.instance_group:
        count += group.count if group.count else 1
        kinds.add(pb.ModelInstanceGroup.Kind.Name(group.kind))
    kinds.discard("KIND_AUTO")
    if kinds - {"KIND_CPU", "KIND_GPU"}:
        problems.append(f"instance_group kind {sorted(kinds - {'KIND_CPU', 'KIND_GPU'})}: kiln runs KIND_CPU or KIND_GPU")
    if len(kinds & {"KIND_CPU", "KIND_GPU"}) > 1:
        problems.append("instance groups of both KIND_CPU and KIND_GPU: an engine runs on one device; keep one")
    choice = message.version_policy.WhichOneof("policy_choice")
    policy = VersionPolicy()
    if choice == "all":
        policy = VersionPolicy("all")
    elif choice == "specific":
        policy = VersionPolicy("specific", versions=list(message.version_policy.specific.versions))
    elif choice == "latest":
        policy = VersionPolicy("latest", max(1, message.version_policy.latest.num_versions))
    parameters = {}
    for key, value in message.parameters.items():
        parameters[key] = value.string_value
    unknown = sorted(set(parameters) - PARAMETERS)
    if unknown:
        problems.append(f"parameters {unknown} are not kiln's; it reads {sorted(PARAMETERS)}")
    for key, parse in (("warm_up", parse_warm_up), ("cuda_sync", parse_cuda_sync), ("batch_buckets", parse_batch_buckets)):
        if key in parameters:
            try:
                parse(parameters[key], f"parameter {key}")
            except ValueError as e:
                problems.append(str(e))
    for key in sorted(RAY_PARAMETERS & set(parameters)):
        try:
            parse_seconds(parameters[key], f"parameter {key}", positive=not key.endswith("_delay_s"))
        except ValueError as e:
            problems.append(str(e))
    if problems:
        raise ModelLoadError(f"{where}:\n  " + "\n  ".join(problems))
    return ModelConfig(
        name=message.name, max_batch_size=message.max_batch_size, inputs=tensors["input"],
        outputs=tensors["output"], dynamic_batching=batching, instance_count=max(1, count or 1),
        instance_kind=next(iter(kinds), "KIND_AUTO"), version_policy=policy, parameters=parameters,
        platform="kiln")


def parse_warm_up(value: str, what: str) -> float | None:
    """A warm-up setting: "true"/"on" (the default cap, WARM_UP_DEFAULT seconds), "false"/"off"/"0" (None: no warm-up)
    or seconds > 0, the most a CPU instance's warm-up may take (ValueError naming `what` otherwise)."""
    text = value.strip().lower()
    if text in ("true", "on", "yes"):  # not "1": that is one second
        return float(WARM_UP_DEFAULT)
    if text in ("false", "off", "no", "0"):
        return None
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{what} {value!r}: expected true, false or the most seconds a CPU instance's warm-up may "
                         "take (a number > 0)")
    return seconds


def parse_seconds(value: str, what: str, positive: bool = False) -> float:
    """A finite number >= 0 (> 0 where `positive`), ValueError naming `what` otherwise."""
    try:
        number = float(value.strip())
    except ValueError:
        number = math.nan
    if not math.isfinite(number) or number < 0 or (positive and number == 0):
        raise ValueError(f"{what} {value!r}: expected a number {'>' if positive else '>='} 0")
    return number


def parse_cuda_sync(value: str, what: str) -> str:
    """A CUDA instance's wait for its stream: "spin", "pinned", "blocking" or "staged" (ValueError naming `what`
    otherwise)."""
    text = value.strip().lower()
    if text not in CUDA_SYNCS:
        raise ValueError(f"{what} {value!r}: expected one of {', '.join(CUDA_SYNCS)}")
    return text


def parse_batch_buckets(value: str, what: str) -> str:
    """A batch's buckets: "pow2" or "half" (kiln/runtime/buckets.py BATCH_STEPS; ValueError naming `what` otherwise)."""
    text = value.strip().lower()
    if text not in BATCH_STEPS:
        raise ValueError(f"{what} {value!r}: expected one of {', '.join(BATCH_STEPS)} (powers of two, or also a 1.5x "
                         "step between them from 8)")
    return text


def warm_up_seconds(config: ModelConfig, default: str = WARM_UP_DEFAULT) -> float | None:
    """The model's warm-up cap in seconds (None: no warm-up): its warm_up parameter, else the server's default."""
    return _setting(config, "warm_up", default, parse_warm_up)


def cuda_sync_mode(config: ModelConfig, default: str = CUDA_SYNC_DEFAULT) -> str:
    """How the model's CUDA instances wait for their streams: its cuda_sync parameter, else the server's default."""
    return _setting(config, "cuda_sync", default, parse_cuda_sync)


def batch_buckets_mode(config: ModelConfig, default: str = BATCH_BUCKETS_DEFAULT) -> str:
    """The model's batch buckets: its batch_buckets parameter, else the server's default."""
    return _setting(config, "batch_buckets", default, parse_batch_buckets)


def _setting(config: ModelConfig, key: str, default: str, parse: Callable[[str, str], Any]) -> Any:
    """parse(the model's parameter `key`, else the server's default --key): ModelLoadError naming the model and
    which of the two was wrong."""
    flag = "--" + key.replace("_", "-")
    value = config.parameters.get(key, default)
    try:
        return parse(value, f"parameter {key}" if key in config.parameters else f"the server's {flag}")
    except ValueError as e:
        raise ModelLoadError(f"model {config.name!r}: {e}") from None


def _is_set(message, name: str) -> bool:
    f = message.DESCRIPTOR.fields_by_name[name]
    return bool(len(getattr(message, name))) if f.is_repeated else message.HasField(name)


# ---- against the engine -------------------------------------------------------------------------

def batch_symbol(engine: Engine) -> str | None:
    """The symbolic dim every input and output starts with (their batch axis), else None."""
    first = set()
    for b in engine.inputs + engine.outputs:
        if b.kind != "tensor" or not b.shape:
            return None
        first.add(b.shape[0])
    symbol = first.pop() if len(first) == 1 else None
    return symbol if isinstance(symbol, str) else None


def profile_batch_max(engine: Engine) -> int:
    """The largest batch any optimization profile takes (the engine's batch axis is axis 0)."""
    first = engine.inputs[0].name
    return max((p.inputs[first].max[0] for p in engine.profiles if first in p.inputs), default=0)


def complete(config: ModelConfig | None, engine: Engine, name: str) -> ModelConfig:
    """Fill what the config leaves out from the engine's bindings, then check the two agree."""
    config = config or ModelConfig(name=name)
    if not config.inputs and not config.outputs:
        if config.max_batch_size == 0 and batch_symbol(engine) and profile_batch_max(engine) > 1:
            config.max_batch_size = profile_batch_max(engine)
            if config.dynamic_batching is None:
                config.dynamic_batching = DynamicBatching()  # delay 0: batches form only under load
        skip = 1 if config.max_batch_size > 0 else 0
        for bindings, target in ((engine.inputs, config.inputs), (engine.outputs, config.outputs)):
            for b in bindings:
                datatype = datatypes.BY_ONNX.get(b.dtype or "")
                if datatype is None or b.kind != "tensor" or b.shape is None:
                    raise ModelLoadError(f"model {name!r}: binding {b.name!r} ({b.describe()}) cannot be served: "
                                         "kiln serve takes tensors of known rank and a protocol datatype")
                target.append(TensorConfig(b.name, datatype, [d if isinstance(d, int) else -1
                                                              for d in b.shape[skip:]]))
    if config.instance_kind == "KIND_AUTO":
        config.instance_kind = "KIND_GPU" if engine.device.type == "cuda" else "KIND_CPU"
    check(config, engine)
    return config


def check(config: ModelConfig, engine: Engine) -> None:
    """Every disagreement between a config and its engine, at once (ModelLoadError)."""
    problems = []
    name = config.name
    batching = config.max_batch_size > 0
    if batching and not batch_symbol(engine):
        problems.append(f"max_batch_size {config.max_batch_size}: the engine's inputs and outputs do not all start "
                        "with one symbolic (batch) dim, so requests cannot be batched; set max_batch_size: 0")
    elif batching and engine.profiles and config.max_batch_size > profile_batch_max(engine):
        problems.append(f"max_batch_size {config.max_batch_size} is larger than the engine's profiles allow "
                        f"({profile_batch_max(engine)}); lower it or rebuild with a larger --profile")
    skip = 1 if batching else 0
    for kind, tensors, bindings in (("input", config.inputs, engine.inputs), ("output", config.outputs, engine.outputs)):
        by_name = {b.name: b for b in bindings}
        for t in tensors:
            b = by_name.get(t.name)
            if b is None:
                problems.append(f"{kind} {t.name!r} is not one of the engine's {kind}s {list(by_name)}")
                continue
            if datatypes.BY_ONNX.get(b.dtype or "") is not t.datatype:
                problems.append(f"{kind} {t.name!r}: config data_type {t.datatype.config}, the engine's is {b.dtype}")
            if b.shape is None:
                continue
            dims = b.shape[skip:]
            if len(dims) != len(t.dims):
                problems.append(f"{kind} {t.name!r}: config dims {t.dims} ({'batch + ' if batching else ''}"
                                f"rank {len(t.dims)}), the engine's shape is {b.describe()}")
                continue
            for want, have in zip(t.dims, dims):
                if isinstance(have, int) and want != have:
                    problems.append(f"{kind} {t.name!r}: config dims {t.dims}, the engine's shape is {b.describe()}")
                    break
        if kind == "input":
            missing = sorted(set(by_name) - {t.name for t in tensors})
            if missing:
                problems.append(f"the engine's input(s) {missing} are missing from the config")
    if config.dynamic_batching and not batching:
        problems.append("dynamic_batching needs max_batch_size > 0")
    device = "KIND_GPU" if engine.device.type == "cuda" else "KIND_CPU"
    if config.instance_kind not in ("KIND_AUTO", device):
        problems.append(f"instance_group kind {config.instance_kind}, but the engine runs on {engine.device.type}")
    if problems:
        raise ModelLoadError(f"model {name!r}: config and engine disagree:\n  " + "\n  ".join(problems))
