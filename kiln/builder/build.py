"""The builder: ONNX model -> Engine. One function; each stage says why it is there."""

from __future__ import annotations

import datetime
import math
import os
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

import onnx_ir as ir
import torch

from kiln.builder import int8_speed
from kiln.builder.autotune import autotune, example_inputs
from kiln.builder.calibration import quantize, summarize
from kiln.builder.config import BuildConfig
from kiln.builder.lower import value_dtype_name
from kiln.builder.padding_free import Lowered, lower_precision_of, optimize_and_lower, packed_examples, value_shapes
from kiln.builder.precision import allow_fp8_attention, write_float32_outputs
from kiln.builder.profile_check import check_at_profile_ends
from kiln.builder.profiles import resolve as resolve_profiles
from kiln.builder.profiles import shapes_at
from kiln.builder.spill import spill
from kiln.errors import KilnError
from kiln.frontend import onnx as onnx_frontend
from kiln.ir import dtypes
from kiln.passes import PassOptions
from kiln.passes.remove_padding import REMOVE_PADDING
from kiln.plan.memory import plan_arena
from kiln.plan.spec import FORMAT_VERSION, EnginePlan, Profile, ProgramSpec
from kiln.quant.smoothquant import check_alpha
from kiln.runtime.engine import Engine, place_weight
from kiln.runtime.rss import PeakMemory, return_free_memory
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


def _own_weights(model: ir.Model) -> None:
    """Every tensor the imported graph reads from its proto (initializers, tensor attributes) in an array of its
    own, and the proto let go: protobuf's messages share one arena, and a reference to any part holds all of it.
    Held until lowering was done, the proto kept a second copy of the weights through the passes (a folded
    Conv+BatchNorm's new weights beside the proto's) and lowering (its copies of the tensors read from the proto):
    ResNet-50 peaked at +235 MiB there for its 97 MiB of weights. Owned arrays are also what lowering shares
    with the engine instead of copying (lower.py: copy_weights=False). A model file's large weights arrive owned
    already (read from the file into arrays of their own: kiln/frontend/onnx_file.py); this copies the rest."""
    for g in [model.graph, *model.graph.subgraphs()]:
        for value in g.initializers.values():
            if isinstance(value.const_value, ir.TensorProtoTensor):
                value.const_value = _own_copy(value.const_value)
        for node in g:
            for name, attr in list(node.attributes.items()):
                if attr.type == ir.AttributeType.TENSOR and isinstance(attr.value, ir.TensorProtoTensor):
                    node.attributes[name] = ir.AttrTensor(name, _own_copy(attr.value))


def _release_weights(model: ir.Model) -> None:
    """Drop the graph's large initializers once lowering has made them the engine's weights: what the build still
    reads of the graph is shapes and types, and a weight lowering had to copy (a cast) is held twice otherwise."""
    for g in [model.graph, *model.graph.subgraphs()]:
        for value in g.initializers.values():
            if value.const_value is not None and value.const_value.nbytes >= 1 << 16:
                value.const_value = None


def _own_copy(tensor: ir.TensorProtoTensor) -> ir.TensorProtocol:
    """The tensor's values in an array of its own (a string tensor, rare and small, stays as it is)."""
    if tensor.dtype == ir.DataType.STRING:
        return tensor
    return ir.Tensor(tensor.numpy().copy(), dtype=tensor.dtype, name=tensor.name)


def _weight_bytes(model: ir.Model) -> int:
    """What the model's initializers hold (every graph's), as imported: the unit of build memory."""
    return int(sum(v.const_value.nbytes for g in [model.graph, *model.graph.subgraphs()]
                   for v in g.initializers.values() if v.const_value is not None))


def _source_info(model: object, graph: ir.Model) -> dict:
    if isinstance(model, (str, os.PathLike)):
        path = Path(model).resolve()
        return {"path": str(path), "name": path.name}
    return {"path": None, "name": graph.graph.name or None}


def pass_options(config: BuildConfig) -> PassOptions:
    """The optimizer's options for a build (and for a refit, which derives weights as the build did)."""
    cpu = config.device == "cpu"
    # remove_padding: PackedAttention on every device (the CPU's is kiln's varlen C attention, a segment member)
    return PassOptions(opt_level=config.opt_level, verify=config.verify, unsigned_activations=cpu, cpu_rules=cpu,
                       cuda_rules=not cpu, refittable=config.refittable, remove_padding=config.remove_padding)


def _tune(spec: ProgramSpec, lowered: Lowered, config: BuildConfig, device: torch.device, profiles: list[Profile],
          tuning_shapes: dict[str, list[int]], other_shapes: dict | None, io_casts: dict[str, str],
          shapes_of_values: dict[str, list | None], say: Progress, examples: list | None = None,
          launches: dict[tuple, Any] | None = None, release: Callable[[], None] | None = None) -> dict:
    """Tactic search for one program (the tuner's header record), and each choice checked at every profile's ends:
    a tactic that refuses or errs there goes back to the default. `launches`: the prepared launches of the programs
    the search binds after it (autotune's), for the engine to share; `release`: autotune's (spill.py)."""
    tactics = autotune(spec, lowered.weights, lowered.inputs, device=device, opt_level=config.opt_level,
                       shapes=tuning_shapes, timing_cache=config.timing_cache, allowed=config.tactics,
                       compile_workers=config.compile_workers, in_context_timing=config.in_context,
                       runs=config.tuning_runs, progress=say, io_casts=io_casts, other_shapes=other_shapes,
                       examples=examples, launches=launches, release=release)
    return_free_memory()  # the search's records and candidates are gone: before the engine packs its weights
    if profiles and "layers" in tactics:
        say("checking tactics at the profiles' ends")
        placed = {k: place_weight(v, device) for k, v in lowered.weights.items()}
        checks = check_at_profile_ends(spec, placed, lowered.inputs, profiles, device, io_casts, shapes_of_values,
                                       tuning_shapes)
        if checks:
            tactics["profiles"] = checks
    return tactics


def build(model: onnx_frontend.ModelSource | ir.Model, config: BuildConfig | None = None,
          progress: Progress | None = None) -> Engine:
    config = config or BuildConfig()
    if int8_speed.wanted(config):
        # INT8 only where measured faster: the fp32 and an every-layer int8 engine timed per layer on this machine,
        # the plan chosen by those times, the engine checked against fp32's (kiln/builder/int8_speed.py)
        return int8_speed.build_no_slower(model, config, progress or (lambda _msg: None), _build)
    return _build(model, config, progress)


def _build(model: onnx_frontend.ModelSource | ir.Model, config: BuildConfig,
           progress: Progress | None = None) -> Engine:
    """One build: import, quantize, optimize, lower, tune, plan memory (`build` may call it several times)."""
    say = progress or (lambda _msg: None)
    memory_at_start = PeakMemory.start()
    # Import: read and check the model, list every unsupported node at once.
    say("importing")
    graph = model if isinstance(model, ir.Model) else onnx_frontend.load(model)
    model_weight_bytes = _weight_bytes(graph)
    if not isinstance(model, ir.Model):  # the graph is the build's own
        _own_weights(graph)
        return_free_memory()
    if config.precision == "best":  # the fastest storage kiln can run accurately on the device
        config.precision = "fp16" if config.device == "cuda" else "fp32"
    quantization: dict = {}
    storage = config.precision
    if check_alpha(config.smoothquant) is not None and config.precision not in ("int8", "fp8"):
        raise KilnError(f"smoothquant={config.smoothquant}: smoothing prepares activations for int8/fp8 "
                        f"quantization; this build's precision is {config.precision} (add --int8 or --fp8)")
    if config.precision in ("int8", "fp8"):
        # Quantize: measure each Conv/Gemm/MatMul input's range on calibration data and make the
        # quantization explicit (Q/DQ); the layers no quantized kernel runs stay in float storage.
        graph, quantization = quantize(graph, config, say)
        storage = "fp16" if config.device == "cuda" else "fp32"
    # Optimize: restructure the graph so fewer, cheaper steps run; lower: one step per node, weights out of the
    # graph, subgraphs as nested programs (padding-free: the plain program too, on the same weights).
    say("optimizing and lowering")
    graph, lowered = optimize_and_lower(graph, pass_options(config), copy_weights=isinstance(model, ir.Model))
    program, weights, inputs, outputs = lowered.program, lowered.weights, lowered.inputs, lowered.outputs
    if quantization.get("attention_fp8_scales"):
        # FP8 attention: each measured attention may compute in E4M3 at its calibrated scale (a tactic choice)
        quantization["attention_fp8_steps"] = [allow_fp8_attention(p, quantization["attention_fp8_scales"])
                                               for p in (lowered.program, lowered.plain) if p is not None]
    io_casts: dict[str, str] = {}
    if storage in ("fp16", "bf16"):
        # Precision: half-precision storage, fp32 accumulation inside the kernels.
        say(f"lowering precision to {storage}")
        io_casts = lower_precision_of(lowered, storage, set(config.layer_precision))
        if config.device == "cuda":  # a GEMM making an fp32 output stores fp32 itself: no cast pass at the boundary
            for lowered_program in (lowered.program, lowered.plain):
                if lowered_program is not None:
                    write_float32_outputs(lowered_program, storage, set(config.layer_precision))
    # Profiles: the shapes each input may take (the user's, else kiln's default for symbolic dims);
    # tactics are tuned at the first profile's opt shape.
    profiles = resolve_profiles(config.profiles, inputs, graph.graph, config.shapes)
    tuning_shapes = {**(shapes_at(profiles[0], "opt") if profiles else {}), **config.shapes}
    shapes_of_values = value_shapes(graph)
    if not isinstance(model, ir.Model):  # the graph is the build's own: its weights are now the engine's copies
        _release_weights(graph)
    # On the CPU the large weights go to a mapped file: their pages leave memory once packed (spill.py)
    mapped = spill(weights, say) if config.device == "cpu" else None
    release = mapped.release if mapped is not None else None
    return_free_memory()
    # Tactic search: time each layer's candidate kernels on real shapes, keep the fastest correct one.
    say("selecting tactics")
    device = torch.device(config.device)
    # On the CPU a profile's range is timed at more than its opt shape: at the geometric middle of min and
    # opt and at min too (a tactic fast at opt but slow at small shapes, outside a native segment, would
    # cost every short request; a single token alone is a degenerate GEMV, so not the only other point).
    other_shapes = None
    if profiles and device.type == "cpu":
        low = shapes_at(profiles[0], "min")
        mid = {name: [max(1, round(math.sqrt(a * b))) for a, b in zip(low[name], tuning_shapes.get(name, low[name]))]
               for name in low}
        other_shapes = {"mid": mid, "min": low}
    plain_tactics = None
    if lowered.plain is not None:
        # A padding-free engine's plain program, tuned as the plain build tunes it: where a run does not pack,
        # the engine is the plain engine. With CUDA graphs of bucketed shapes that is at small buckets and at the
        # profile's largest shape (a mask with next to no padding, kiln/runtime/buckets.py graph_rows), so there
        # it is timed at the max too: an attention kernel fast at the opt shape may lose there by more than it
        # wins at opt (at BERT-base 32x512 kiln's Triton flash took 1.24 ms with the mask, torch's cuDNN 0.81
        # without one).
        plain_shapes = other_shapes
        if profiles and device.type == "cuda":
            plain_shapes = {"max": shapes_at(profiles[0], "max")}
        say("tactics of the plain program (runs that do not pack their tokens)")
        plain_tactics = _tune(lowered.plain, lowered, config, device, profiles, tuning_shapes, plain_shapes,
                              io_casts, lowered.plain_value_shapes, say, release=release)
        # ... and its packed program where it runs: on the rows of a packed run, not at the opt shape's B·S
        mask = graph.meta[REMOVE_PADDING]["mask"]
        examples, tokens = packed_examples(example_inputs(inputs, tuning_shapes), inputs, mask)
        shape = list(next(e for e, b in zip(examples, inputs) if b.name == mask).shape)
        graph.meta[REMOVE_PADDING]["tuned_at"] = {"mask": shape, "tokens": tokens}
        say(f"tactics of the packed program at {tokens} packed token rows (a {shape[0]}x{shape[1]} mask that saves "
            "just enough to pack: kiln/builder/padding_free.py tuning_tokens)")
    else:
        examples = None
    # the launches the search's last programs prepared (the network packed as it will run) are the engine's: its load
    # packs only what they lack (ResNet-50 packed its weights three times in a row: in context, the whole-network
    # check, the engine). The plain program's are not kept: held through this search they would add a network.
    launches: dict[tuple, Any] = {}
    tactics = _tune(program, lowered, config, device, profiles, tuning_shapes,
                    other_shapes if examples is None else None, io_casts, shapes_of_values, say, examples, launches,
                    release)
    if quantization.get("mode") == "kernels" or any(s.op_type in ("QConv", "QGemm") for s in program.steps):
        # what each quantized layer runs in, and why (int8 where its kernel was faster and exact)
        quantization["layers"] = summarize(program, tactics, quantization, storage)
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
        "value_types": {v.name: {"dtype": value_dtype_name(v), "shape": shapes_of_values[v.name]}
                        for node in graph.graph for v in node.outputs},
        "tactics": tactics,
        "quantization": quantization,
        "remove_padding": graph.meta.get(REMOVE_PADDING),  # what runs on the real tokens only (None: off)
        # a padding-free engine's plain program (runs that do not pack): what the tuner chose for it
        **({"plain_tactics": plain_tactics} if lowered.plain is not None else {}),
        "weights_bytes": int(sum(getattr(w, "nbytes", 0) for w in weights.values())),
    }
    engine = Engine(EnginePlan(header=header, program=program, weights=weights, plain=lowered.plain), launches)
    if release is not None:  # what the engine's load packed anew, and the profiles' check, read
        release()
        engine.plan.mapped = mapped  # engine.save reads the spilled pages back to write them, then lets them go
    # Peak RSS growth over the whole build, the engine's load (its layers' packed weights) included.
    header["build_memory"] = {"peak_rss_delta_bytes": memory_at_start.delta(), "measured_by": memory_at_start.method,
                              "model_weight_bytes": model_weight_bytes}
    say("done")
    return engine
