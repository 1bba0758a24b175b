"""The builder: ONNX model -> Engine. One function; each stage says why it is there."""

from __future__ import annotations

import datetime
import os
import platform
from collections.abc import Callable
from pathlib import Path

import onnx_ir as ir
import torch

from kiln.builder.autotune import autotune
from kiln.builder.config import BuildConfig
from kiln.builder.lower import lower, value_dtype_name
from kiln.builder.precision import lower_precision
from kiln.builder.profile_check import check_at_profile_ends
from kiln.builder.profiles import resolve as resolve_profiles
from kiln.builder.profiles import shapes_at
from kiln.errors import KilnError
from kiln.frontend import onnx as onnx_frontend
from kiln.ir import dtypes
from kiln.passes import PassOptions, optimize
from kiln.plan.memory import plan_arena
from kiln.plan.spec import FORMAT_VERSION, EnginePlan
from kiln.runtime.engine import Engine, place_weight
from kiln.version import __version__

Progress = Callable[[str], None]


def _device_info(config: BuildConfig) -> dict:
    if config.device == "cpu":
        return {"type": "cpu", "name": platform.processor() or platform.machine()}
    if not torch.cuda.is_available():
        raise KilnError(f"--device {config.device}: no CUDA device is available here")
    return {
        "type": "cuda",
        "name": torch.cuda.get_device_name(),
        "capability": list(torch.cuda.get_device_capability()),
    }


def _value_sizes(model: ir.Model, shapes: dict[str, list[int]]) -> dict[str, int | None]:
    symbols: dict[str, int] = {}
    for v in model.graph.inputs:
        given = shapes.get(v.name)
        if given and v.shape is not None:
            for d, n in zip(v.shape, given):
                if not isinstance(d, int) and d.value:
                    symbols[d.value] = n
    sizes: dict[str, int | None] = {}
    for node in model.graph:
        for v in node.outputs:
            name = value_dtype_name(v)
            if v.shape is None or name is None or dtypes.BY_NAME[name].numpy is None:
                sizes[v.name] = None
                continue
            numel = 1
            for d in v.shape:
                numel *= d if isinstance(d, int) else symbols.get(d.value or "", 1)
            itemsize = dtypes.BY_NAME[name].numpy.itemsize if name != "string" else 8
            sizes[v.name] = numel * itemsize
    return sizes


def _source_info(model: object, graph: ir.Model) -> dict:
    if isinstance(model, (str, os.PathLike)):
        path = Path(model).resolve()
        return {"path": str(path), "name": path.name}
    return {"path": None, "name": graph.graph.name or None}


def build(model: onnx_frontend.ModelSource | ir.Model, config: BuildConfig | None = None,
          progress: Progress | None = None) -> Engine:
    config = config or BuildConfig()
    say = progress or (lambda _msg: None)
    # Import: read and check the model, list every unsupported node at once.
    say("importing")
    graph = model if isinstance(model, ir.Model) else onnx_frontend.load(model)
    # Optimize: restructure the graph so fewer, cheaper steps run.
    say("optimizing")
    graph = optimize(graph, PassOptions(opt_level=config.opt_level, verify=config.verify))
    # Lower: one step per node, weights out of the graph, subgraphs as nested programs.
    say("lowering")
    program, weights, inputs, outputs = lower(graph)
    io_casts: dict[str, str] = {}
    if config.precision == "best":  # the fastest storage kiln can run accurately on the device
        config.precision = "fp16" if config.device == "cuda" else "fp32"
    if config.precision in ("int8", "fp8"):
        raise KilnError(
            f"precision {config.precision!r} needs calibration, which this kiln does not implement yet; "
            "build with fp32, tf32, fp16, bf16 or best")
    if config.precision in ("fp16", "bf16"):
        # Precision: half-precision storage, fp32 accumulation inside the kernels.
        say(f"lowering precision to {config.precision}")
        io_casts = lower_precision(program, weights, config.precision, set(config.layer_precision))
    # Profiles: the shapes each input may take (the user's, else kiln's default for symbolic dims);
    # tactics are tuned at the first profile's opt shape.
    profiles = resolve_profiles(config.profiles, inputs, graph.graph, config.shapes)
    tuning_shapes = {**(shapes_at(profiles[0], "opt") if profiles else {}), **config.shapes}
    value_shapes = {v.name: None if v.shape is None else [d if isinstance(d, int) else d.value for d in v.shape]
                    for node in graph.graph for v in node.outputs}
    # Tactic search: time each layer's candidate kernels on real shapes, keep the fastest correct one.
    say("selecting tactics")
    device = torch.device(config.device)
    tactics = autotune(program, weights, inputs, device=device, opt_level=config.opt_level,
                       shapes=tuning_shapes, timing_cache=config.timing_cache, allowed=config.tactics,
                       runs=config.tuning_runs, progress=say, io_casts=io_casts)
    # ... and valid at every profile's ends: a tactic that refuses or errs there goes back to the default.
    if profiles and "layers" in tactics:
        say("checking tactics at the profiles' ends")
        placed = {k: place_weight(v, device) for k, v in weights.items()}
        checks = check_at_profile_ends(program, placed, inputs, profiles, device, io_casts, value_shapes,
                                       tuning_shapes)
        if checks:
            tactics["profiles"] = checks
    # Plan memory: liveness of every activation, packed into one arena.
    say("planning memory")
    memory = plan_arena(program, _value_sizes(graph, tuning_shapes))
    header = {
        "format_version": FORMAT_VERSION,
        "kiln_version": __version__,
        "torch_version": torch.__version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "producer": f"{graph.producer_name or '?'} {graph.producer_version or ''}".strip(),
        "source": _source_info(model, graph),  # lets `kiln bench --against onnxruntime` find the model
        "device": _device_info(config),
        "build_config": config.to_json(),
        "inputs": [b.to_json() for b in inputs],
        "profiles": [p.to_json() for p in profiles],
        "outputs": [b.to_json() for b in outputs],
        "memory": {k: v for k, v in memory.items() if k != "offsets"},
        "io_casts": io_casts,
        "value_types": {v.name: {"dtype": value_dtype_name(v), "shape": value_shapes[v.name]}
                        for node in graph.graph for v in node.outputs},
        "tactics": tactics,
        "weights_bytes": int(sum(getattr(w, "nbytes", 0) for w in weights.values())),
    }
    say("done")
    return Engine(EnginePlan(header=header, program=program, weights=weights))
