"""onnxruntime's session options and providers, read as kiln build options.

An application hands kiln the objects it built for onnxruntime: an `onnxruntime.SessionOptions`
(or this module's look-alike), `providers=[...]` with optional per-provider options. What kiln can
honour becomes a build option; everything else set away from onnxruntime's default is named in one
`UnhonouredOptionWarning`, never dropped silently.

    graph_optimization_level     ORT_DISABLE_ALL -> opt_level 0, ORT_ENABLE_BASIC -> 1, higher -> 2
    intra_op_num_threads > 0     torch.set_num_threads (process-wide, as torch's pool is)
    log_severity_level >= 3      silences kiln's "building an engine" notice on stderr
    CPUExecutionProvider         device cpu
    CUDA / TensorRT providers    device cuda (cpu, with a warning, where CUDA is absent: onnxruntime
                                 falls back the same way; the TensorRT options below still shape the engine)
    trt_fp16_enable              precision fp16          trt_int8_enable: not honoured (needs calibration)
    trt_profile_{min,opt,max}_shapes   an optimization profile ("x:1x3x224x224,y:...")
    trt_engine_cache_enable/_path      the engine cache (on by default in kiln)
    KilnExecutionProvider        its options are kiln.build options (precision, opt_level, profiles,
                                 ...) plus cache (bool) and cache_dir
"""

from __future__ import annotations

import enum
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from kiln.errors import KilnError


class UnhonouredOptionWarning(UserWarning):
    """An onnxruntime option was set that kiln does not honour (named in the message)."""


class GraphOptimizationLevel(enum.IntEnum):
    ORT_DISABLE_ALL = 0
    ORT_ENABLE_BASIC = 1
    ORT_ENABLE_EXTENDED = 2
    ORT_ENABLE_LAYOUT = 3
    ORT_ENABLE_ALL = 99


class ExecutionMode(enum.IntEnum):
    ORT_SEQUENTIAL = 0
    ORT_PARALLEL = 1


class ExecutionOrder(enum.IntEnum):
    DEFAULT = 0
    PRIORITY_BASED = 1
    MEMORY_EFFICIENT = 2


# onnxruntime.SessionOptions' attributes and their defaults (onnxruntime 1.2x)
SESSION_DEFAULTS: dict[str, Any] = {
    "graph_optimization_level": GraphOptimizationLevel.ORT_ENABLE_ALL,
    "intra_op_num_threads": 0,
    "inter_op_num_threads": 0,
    "execution_mode": ExecutionMode.ORT_SEQUENTIAL,
    "execution_order": ExecutionOrder.DEFAULT,
    "enable_profiling": False,
    "profile_file_prefix": "onnxruntime_profile_",
    "optimized_model_filepath": "",
    "enable_mem_pattern": True,
    "enable_mem_reuse": True,
    "enable_cpu_mem_arena": True,
    "use_deterministic_compute": False,
    "log_severity_level": -1,
    "log_verbosity_level": 0,
    "logid": "",
    "use_per_session_threads": True,
}


class SessionOptions:
    """onnxruntime.SessionOptions' attributes with its defaults, for code that builds its own."""

    def __init__(self) -> None:
        for name, value in SESSION_DEFAULTS.items():
            setattr(self, name, value)
        self._config: dict[str, str] = {}

    def add_session_config_entry(self, key: str, value: str) -> None:
        self._config[key] = value

    def get_session_config_entry(self, key: str) -> str:
        return self._config[key]


class RunOptions:
    """onnxruntime.RunOptions: accepted; only run_tag is kept (kiln runs are not cancellable)."""

    def __init__(self) -> None:
        self.run_tag = ""
        self.log_severity_level = -1
        self.log_verbosity_level = 0
        self.terminate = False
        self.only_execute_path_to_fetches = False


CPU = "CPUExecutionProvider"
CUDA_PROVIDERS = ("CUDAExecutionProvider", "TensorrtExecutionProvider")
KILN = "KilnExecutionProvider"
KNOWN_PROVIDERS = (KILN, *CUDA_PROVIDERS, CPU)


def available_providers() -> list[str]:
    return [KILN, *(CUDA_PROVIDERS if torch.cuda.is_available() else ()), CPU]


@dataclass
class SessionSettings:
    """What kiln takes from the options: the build options, the cache, and what it did not honour."""

    build: dict[str, Any] = field(default_factory=dict)  # kiln.build keyword options
    cache: bool = True
    cache_dir: str | None = None
    threads: int = 0  # torch.set_num_threads when > 0
    quiet: bool = False  # no build notice on stderr
    providers: list[str] = field(default_factory=list)  # what get_providers() reports
    provider_options: dict[str, dict[str, str]] = field(default_factory=dict)
    unhonoured: list[str] = field(default_factory=list)


def _int(value: Any) -> int:
    return int(getattr(value, "value", value))


def _read_session_options(options: Any, settings: SessionSettings) -> None:
    if options is None:
        return
    for name, default in SESSION_DEFAULTS.items():
        if not hasattr(options, name):
            continue
        value = getattr(options, name)
        if name == "graph_optimization_level":
            level = _int(value)
            settings.build["opt_level"] = 0 if level == 0 else 1 if level == 1 else 2
            continue
        if name == "intra_op_num_threads":
            settings.threads = _int(value)
            continue
        if name == "log_severity_level":
            settings.quiet = _int(value) >= 3
            continue
        if name in ("log_verbosity_level", "logid", "use_per_session_threads", "profile_file_prefix"):
            continue  # about onnxruntime's own logs and pools: nothing in kiln to honour or to miss
        same = _int(value) == _int(default) if isinstance(default, (int, enum.Enum)) else value == default
        if not same:
            settings.unhonoured.append(f"SessionOptions.{name}={value!r}")


def _shape_list(text: str, where: str) -> dict[str, str]:
    """'x:1x3x224x224,y:1x8' -> {x: '1x3x224x224', y: '1x8'} (TensorRT EP's profile syntax)."""
    shapes = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, dims = part.rpartition(":")
        if not sep or not name:
            raise KilnError(f"{where}: {part!r} is not NAME:DIMxDIM...")
        shapes[name] = dims
    return shapes


def _tensorrt_options(options: dict[str, Any], settings: SessionSettings) -> None:
    profile = {}
    for key, value in options.items():
        text = str(value)
        if key == "trt_fp16_enable":
            if text.lower() in ("1", "true"):
                settings.build["precision"] = "fp16"
        elif key in ("trt_profile_min_shapes", "trt_profile_opt_shapes", "trt_profile_max_shapes"):
            profile[key.split("_")[2]] = _shape_list(text, f"TensorrtExecutionProvider option {key}")
        elif key == "trt_engine_cache_enable":
            settings.cache = text.lower() in ("1", "true")
        elif key == "trt_engine_cache_path":
            settings.cache_dir = text
        elif key == "device_id" and text in ("0", ""):
            continue
        else:
            settings.unhonoured.append(f"TensorrtExecutionProvider option {key}={value!r}")
    if profile:
        if set(profile) != {"min", "opt", "max"} or not profile["min"].keys() == profile["opt"].keys() \
                == profile["max"].keys():
            raise KilnError("TensorrtExecutionProvider: trt_profile_min_shapes, trt_profile_opt_shapes and "
                            "trt_profile_max_shapes must all be given, for the same inputs")
        settings.build["profiles"] = [{name: f"{profile['min'][name]},{profile['opt'][name]},{profile['max'][name]}"
                                       for name in profile["min"]}]


def _kiln_options(options: dict[str, Any], settings: SessionSettings) -> None:
    for key, value in options.items():
        if key == "cache":
            settings.cache = bool(value) and str(value).lower() not in ("0", "false")
        elif key == "cache_dir":
            settings.cache_dir = str(value)
        else:
            settings.build[key] = value


def read(sess_options: Any, providers: list | None, provider_options: list[dict] | None,
         cuda_available: bool) -> SessionSettings:
    """The settings a session runs with; `unhonoured` lists what kiln will not do."""
    settings = SessionSettings()
    _read_session_options(sess_options, settings)
    given: list[tuple[str, dict]] = []
    for k, entry in enumerate(providers or [CPU]):
        name, opts = (entry[0], dict(entry[1])) if isinstance(entry, (tuple, list)) else (entry, {})
        if provider_options is not None and k < len(provider_options):
            opts.update(provider_options[k] or {})
        given.append((str(name), opts))
    device = None
    for name, opts in given:
        if name not in KNOWN_PROVIDERS:
            settings.unhonoured.append(f"provider {name!r} (kiln runs on the CPU or on CUDA)")
            continue
        if name in CUDA_PROVIDERS and not cuda_available:
            settings.unhonoured.append(f"provider {name!r}: no CUDA device here, running on the CPU")
            if name == "TensorrtExecutionProvider":
                _tensorrt_options(opts, settings)  # they describe the engine, which kiln builds on any device
            continue
        if device is None:  # the first usable provider decides the device, as onnxruntime's order does
            device = "cuda" if name in CUDA_PROVIDERS else str(opts.get("device", "cpu"))
        if name == "TensorrtExecutionProvider":
            _tensorrt_options(opts, settings)
        elif name == KILN:
            _kiln_options(opts, settings)
        elif name == "CUDAExecutionProvider":
            for key, value in opts.items():
                if key != "device_id" or str(value) not in ("0", ""):
                    settings.unhonoured.append(f"CUDAExecutionProvider option {key}={value!r}")
        elif opts:
            settings.unhonoured.extend(f"{name} option {k}={v!r}" for k, v in opts.items())
        settings.provider_options[name] = {k: str(v) for k, v in opts.items()}
    settings.build.pop("device", None)
    device = device or "cpu"
    settings.build["device"] = device
    settings.providers = ["CUDAExecutionProvider", CPU] if device == "cuda" else [CPU]
    return settings


def warn_unhonoured(settings: SessionSettings, stacklevel: int = 3) -> None:
    if settings.unhonoured:
        warnings.warn("kiln.InferenceSession does not honour: " + "; ".join(settings.unhonoured)
                      + " (kiln builds its own optimized engine: see docs/frontdoors.md)",
                      UnhonouredOptionWarning, stacklevel=stacklevel)
