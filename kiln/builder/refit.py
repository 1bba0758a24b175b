"""Refit: new weights into a built engine, without rebuilding it (TensorRT's refitter).

An engine's weights are not the model's: the builder folded BatchNorm into convolutions (W' = W·γ/σ),
folded constant subgraphs (a Transpose of a weight becomes the transposed weight), merged parallel
GEMMs, fused Q/DQ scales into layers, shared identical weights, and cast the lot to half precision.
So refit re-derives them exactly as the builder did: the new weights go into the ONNX model the engine
was built from, the builder's own stages run again with the engine's build options (import, optimize,
lower, precision), and the program they produce must equal the engine's, step for step (tactic choices
aside), with every weight key of the same dtype and shape. Then the new values replace the old ones and
each layer re-prepares (packs) them; tactics, profiles and memory plan stay as they were built, so a
refit engine computes what a fresh build computes when that build chooses the same tactics, to the bit.

Refused, with the reason:
  - a name, shape or dtype that does not match the model's initializers;
  - new weights that change what the builder does with the graph (two weights that were identical and
    stored once now differ, a bias that was zero and removed is not, a constant folds differently): the
    first step that differs is named;
  - an engine whose ONNX model is not known (given as bytes at build) and not passed with `onnx=`.
The tactics were timed and checked on the old weights: refit does not re-run the accuracy check.

INT8/FP8 engines of kiln's calibration (precision int8/fp8) refit as TensorRT's do: the builder's
quantization (kiln/builder/calibration.py's `quantize`, kiln/quant/qdq.py) runs again on the new
weights, so the per-channel weight scales, the int8/fp8 weights and the int32 biases (at s_x·s_w) are
re-derived exactly as a build would; the ACTIVATION ranges stay the calibrated ones the engine records
(header["quantization"]["ranges"], given to the builder as its calibration cache) and so do the
per-channel input means bias correction was formed from (header["quantization"]["channel_means"], in
the same cache: the correction Σ (W_q − W)·E[x] is formed again from the new weights' rounding), and the layers an
accuracy target kept float stay float. `recalibrate=DATA` measures the ranges again on the new weights
with the engine's calibrator (and chooses the float layers again), as a fresh build with that data
would. Refused: an engine that does not record its ranges (recalibrate, or rebuild), and one built for
another CPU's weight width (7-bit weights without VNNI, 8-bit with), and a SmoothQuant build (its
smoothing factors come from activation statistics the engine does not record) unless recalibrated. Explicit Q/DQ models need none of
this: their quantized weights and scales are initializers, replaced as given.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import safetensors.torch
import torch

from kiln.builder.build import pass_options
from kiln.builder.calibration import quantize
from kiln.builder.config import BuildConfig
from kiln.builder.padding_free import lower_precision_of, optimize_and_lower
from kiln.errors import KilnError
from kiln.frontend import onnx as onnx_frontend
from kiln.ir import dtypes
from kiln.quant import cache as calibration_cache
from kiln.quant import qdq
from kiln.runtime.engine import Engine
from kiln.version import __version__

WeightsSource = str | os.PathLike | bytes | onnx.ModelProto | dict[str, Any]


class RefitError(KilnError):
    """The engine cannot take these weights without a rebuild; the message says why."""


@dataclass
class RefitReport:
    """What a refit changed (recorded in the engine header's "refit")."""

    source: str  # where the new weights came from
    model: str  # the ONNX model the weights were derived through
    changed: list[str]  # engine weight keys whose values changed
    unchanged: int
    # the model's initializers replaced in the engine's model (a partial refit); [] when a whole model was given
    initializers: list[str] = field(default_factory=list)
    # int8/fp8 engines of kiln's calibration: what became of the activation scales ("" otherwise)
    activation_scales: str = ""
    requantized: list[str] = field(default_factory=list)  # layers whose weight scales were derived again

    def to_json(self) -> dict:
        return {**asdict(self), "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}


def _as_numpy(name: str, value: Any) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return dtypes.torch_to_numpy(value.detach().cpu().contiguous())
    if isinstance(value, np.ndarray):
        return value
    raise RefitError(f"weight {name!r}: a {type(value).__name__}, not a tensor or numpy array")


def _initializers(model: ir.Model) -> dict[str, ir.Value]:
    found: dict[str, ir.Value] = {}
    for graph in [model.graph, *model.graph.subgraphs()]:
        found.update(graph.initializers)
    return found


def _replace(model: ir.Model, weights: dict[str, Any]) -> None:
    """Each named initializer takes its new value: same dtype and shape, or refused (every problem listed)."""
    held = _initializers(model)
    problems = []
    unknown = sorted(set(weights) - set(held))
    if unknown:
        shown = ", ".join(sorted(held)[:12]) + (" ..." if len(held) > 12 else "")
        problems.append(f"no initializer named {unknown[:10]}{' ...' if len(unknown) > 10 else ''} in the model the "
                        f"engine was built from (its initializers: {shown}); the names are the ONNX model's")
    arrays = {}
    for name, value in weights.items():
        if name not in held:
            continue
        try:
            array = _as_numpy(name, value)
        except RefitError as e:
            problems.append(str(e))
            continue
        old = held[name].const_value
        want_dtype = dtypes.from_onnx(int(old.dtype)).name
        given_dtype = dtypes.from_numpy(array.dtype).name
        if given_dtype != want_dtype or list(array.shape) != list(old.shape):
            problems.append(f"{name!r}: the model holds {want_dtype} {list(old.shape)}, given {given_dtype} "
                            f"{list(array.shape)}")
        arrays[name] = array
    if problems:
        raise RefitError("weights that do not fit the model:\n  " + "\n  ".join(problems))
    for name, array in arrays.items():
        held[name].const_value = ir.Tensor(np.ascontiguousarray(array), name=name)


def _source_model(engine: Engine, onnx_path: str | os.PathLike | None) -> Path:
    if onnx_path is not None:
        return Path(onnx_path)
    recorded = (engine.plan.header.get("source") or {}).get("path")
    if not recorded:
        raise RefitError("the engine does not record the ONNX model it was built from (it was built from bytes); "
                         "pass that model (onnx=... / --onnx) to map the new weights through it")
    if not Path(recorded).is_file():
        raise RefitError(f"the engine was built from {recorded}, which is not there any more; pass the model "
                         "(onnx=... / --onnx)")
    return Path(recorded)


@dataclass
class _NewModel:
    model: ir.Model  # the ONNX model with the new weights, imported
    source: str  # where the new weights came from
    base: str  # the model they were put into (or the whole model given)
    initializers: list[str]  # the names replaced in `base`; [] for a whole model


def _stale_after_earlier_refits(engine: Engine, given: set[str], base: Path) -> None:
    """The model the engine was built from still holds the weights earlier refits replaced: a partial refit
    derived through it would put those old values back. Refused unless they are given again."""
    stale: set[str] = set()
    for entry in engine.plan.header.get("refits", []):
        if entry.get("initializers") == [] and entry.get("changed"):  # a whole model was given then
            raise RefitError(f"an earlier refit took a whole model ({entry.get('source')}); {base} holds other "
                             "weights, which these would be derived with: refit from a whole model (.onnx), or pass "
                             "the model that holds the engine's weights now (onnx=... / --onnx)")
        stale |= set(entry.get("initializers") or [])
    stale -= given
    if stale:
        shown = sorted(stale)
        raise RefitError(f"earlier refits replaced {shown[:10]}{' ...' if len(shown) > 10 else ''}, which {base} still "
                         "holds with their old values: give them again with these weights, refit from a whole model "
                         "(.onnx), or pass the model that holds the engine's weights now (onnx=... / --onnx)")


def _new_model(engine: Engine, weights: WeightsSource, onnx_path: str | os.PathLike | None) -> _NewModel:
    if isinstance(weights, (bytes, onnx.ModelProto)):
        return _NewModel(onnx_frontend.load(weights), "an ONNX model", "the given model", [])
    if isinstance(weights, (str, os.PathLike)):
        path = Path(weights)
        if not path.is_file():
            raise RefitError(f"{path}: no such weights file")
        if path.suffix == ".onnx":
            return _NewModel(onnx_frontend.load(path), str(path), str(path), [])
        if path.suffix != ".safetensors":
            raise RefitError(f"{path}: weights come as .safetensors (named as the ONNX initializers) or .onnx")
        weights, label = safetensors.torch.load_file(str(path)), str(path)
    else:
        label = f"{len(weights)} named tensor(s)"
    base = _source_model(engine, onnx_path)
    if onnx_path is None:  # the recorded model: as it was at build
        _stale_after_earlier_refits(engine, set(weights), base)
    model = onnx_frontend.load(base)
    _replace(model, dict(weights))
    return _NewModel(model, label, str(base), sorted(weights))


def _structure(spec: dict) -> dict:
    """A program's JSON with the autotuner's choices taken out (they are the engine's to keep)."""
    steps = []
    for step in spec["steps"]:
        step = {k: v for k, v in step.items() if k not in ("tactic", "tactic_config")}
        step["attributes"] = {k: _nested(v) for k, v in step.get("attributes", {}).items()}
        steps.append(step)
    return {**spec, "steps": steps}


def _nested(value: Any) -> Any:
    if isinstance(value, dict) and "$graph" in value:
        return {"$graph": _structure(value["$graph"])}
    if isinstance(value, dict) and "$graphs" in value:
        return {"$graphs": [_structure(g) for g in value["$graphs"]]}
    return value


def _first_difference(built: dict, derived: dict) -> str:
    if built["constants"] != derived["constants"]:
        moved = sorted(k for k in set(built["constants"]) | set(derived["constants"])
                       if built["constants"].get(k) != derived["constants"].get(k))
        return (f"the weights of {moved[:6]} are stored differently: the builder stores identical weights once, "
                "so weights that were equal and are not now (or the reverse) change the engine's layout; an engine "
                "built with refittable=True (kiln build --refittable) keeps every weight apart")
    if len(built["steps"]) != len(derived["steps"]):
        return (f"the engine has {len(built['steps'])} layers, these weights give {len(derived['steps'])}: the "
                "builder's folding and fusions depend on the values (a zero bias removed, a constant that folds)")
    for i, (a, b) in enumerate(zip(built["steps"], derived["steps"])):
        if a != b:
            fields = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
            return (f"layer {i} {a.get('name')!r} ({a.get('op_type')}) differs in {fields}: engine "
                    f"{json.dumps({k: a.get(k) for k in fields})[:300]}, new {json.dumps({k: b.get(k) for k in fields})[:300]}")
    return "the program's inputs or outputs differ"


@dataclass
class _Quantized:
    """The builder's quantization run again on the new weights: the model with Q/DQ, and what was kept."""

    model: ir.Model
    record: dict  # calibration.quantize's header record
    activation_scales: str  # for the report and the CLI


def _weight_width(record: dict) -> str:
    return str(record.get("weights", "")).split(" (")[0]  # "7-bit per channel, depthwise 8-bit" / "8-bit per channel"


def _check_weight_width(built: dict, record: dict) -> None:
    """The int8 weights derived here are for this CPU's kernels (7-bit without VNNI); the engine's tactics
    were chosen for those of the CPU that built it."""
    if _weight_width(record) != _weight_width(built):
        raise RefitError(f"the engine holds {_weight_width(built)} weights and this CPU's int8 kernels take "
                         f"{_weight_width(record)} ({record.get('weights')}): its quantized weights cannot be "
                         "derived here as the build derived them; refit on a CPU like the one that built it")


def _quiet(_message: str) -> None:
    """The builder's progress, unsaid during a refit."""


def _requantize(model: ir.Model, config: BuildConfig, built: dict, recalibrate: Any) -> _Quantized:
    """Quantize the new model as the build did: its recorded activation ranges as the calibration cache
    and its float layers pinned, or (recalibrate) calibration on the given data, as a fresh build would."""
    mode = built.get("mode")
    if recalibrate is not None:
        fresh = dataclasses.replace(config, calibration=recalibrate, calibration_cache=None)
        try:
            model, record = quantize(model, fresh, _quiet)
        except KilnError as e:
            raise RefitError(f"recalibration on the new weights failed: {e}") from None
        if mode in ("kernels", "emulate"):
            _check_weight_width(built, record)
        done = record.get("calibration") or {}
        note = (f"recalibrated on the new weights: {done.get('tensors', 0)} activation range(s) measured on "
                f"{done.get('batches', 0)} batch(es) ({config.calibrator})") if done else record.get("note", "")
        return _Quantized(model, record, note)
    if mode not in ("kernels", "emulate"):  # "auto" with no kernel on the device: nothing was quantized
        model, record = quantize(model, config, _quiet)
        return _Quantized(model, record, record.get("note", ""))
    if config.smoothquant is not None:
        raise RefitError(f"this {config.precision} engine was built with SmoothQuant (alpha {config.smoothquant}): its "
                         "smoothing factors are formed from the weights and the activations' per-channel maxima "
                         "measured at build, which the engine does not record; refit with recalibrate=DATA "
                         "(kiln refit --calib DIR), or rebuild")
    if config.equalize is not None:
        raise RefitError(f"this {config.precision} engine was built with cross-layer equalization (alpha "
                         f"{config.equalize}): its factors are formed from the activations' per-channel maxima "
                         "measured at build, which the engine does not record; refit with recalibrate=DATA "
                         "(kiln refit --calib DIR), or rebuild")
    if built.get("gptq"):
        raise RefitError(f"this {config.precision} engine was built with GPTQ weights: their rounding is formed from "
                         "the layers' input second moments measured at build, which the engine does not record; "
                         "refit with recalibrate=DATA (kiln refit --calib DIR), or rebuild")
    ranges = built.get("ranges")
    if not isinstance(ranges, dict):
        raise RefitError(f"this {config.precision} engine does not record the activation ranges it was calibrated "
                         "with (built by an older kiln): refit with recalibrate=DATA (kiln refit --calib DIR), "
                         "or rebuild")
    channel_means = built.get("channel_means") or {}
    if built.get("bias_correction") and not channel_means:
        raise RefitError(f"this {config.precision} engine was built with bias correction but does not record the "
                         "per-channel input means it was formed from (built by an older kiln): refit with "
                         "recalibrate=DATA (kiln refit --calib DIR), or rebuild")
    pinned = dict(config.layer_precision)
    pinned.update({name: "fp32" for name in (built.get("accuracy") or {}).get("kept_float") or {}})
    # ... and those its int8 speed check kept fp32 (kiln/builder/int8_speed.py): pinned, not chosen again
    pinned.update({name: "fp32" for name in (built.get("speed") or {}).get("kept_fp32") or {}})
    pinned.update({name: qdq.WEIGHT_ONLY for name in built.get("weight_only") or {}})  # as the build chose
    pinned.update({name: qdq.W8A16 for name in built.get("w8a16") or ()})  # ... their inputs at 16 bits
    with tempfile.TemporaryDirectory(prefix="kiln-refit-") as folder:
        cache = os.path.join(folder, "ranges.json")
        calibration_cache.save(cache, config.calibrator, config.precision, ranges,
                               int((built.get("calibration") or {}).get("batches", 0)),
                               channel_mean={k: np.asarray(v, np.float64) for k, v in channel_means.items()},
                               low={k: float(v) for k, v in (built.get("lows") or {}).items()})
        kept = dataclasses.replace(config, calibration=None, calibration_cache=cache, accuracy_target=None,
                                   layer_precision=pinned, layer_times=None)
        try:
            model, record = quantize(model, kept, _quiet)
        except KilnError as e:  # a quantized layer's input the recorded ranges do not cover
            raise RefitError(f"the engine's calibrated activation ranges do not cover the new model's quantized "
                             f"layers ({str(e).splitlines()[0]}): refit with recalibrate=DATA (--calib DIR)") from None
    _check_weight_width(built, record)
    note = (f"kept: the {len(ranges)} activation range(s) calibrated at build ({config.calibrator}); weight scales, "
            "quantized weights and int32 biases derived from the new weights (recalibrate=DATA / --calib DIR "
            "measures the activation ranges again)")
    return _Quantized(model, record, note)


@dataclass
class Derived:
    """What a build from the new weights would store, where it differs from the engine."""

    weights: dict[str, Any]  # engine key -> the new value, for the keys whose values changed
    report: RefitReport
    quantization: dict | None = None  # recalibrated: the engine header's new "quantization" entries


def derive_weights(engine: Engine, weights: WeightsSource, onnx: str | os.PathLike | None = None,
                   recalibrate: Any = None) -> Derived:
    """The engine's weights (by engine key) as a build from the new weights would store them."""
    header = engine.plan.header
    try:
        config = BuildConfig.from_kwargs(**header["build_config"])
    except (KeyError, TypeError) as e:
        raise RefitError(f"the engine's build options cannot be read by this kiln ({e}); rebuild it") from None
    quantized = config.precision in ("int8", "fp8")
    if recalibrate is not None and not quantized:
        raise RefitError(f"recalibrate: the engine is {config.precision}, nothing in it was calibrated")
    new_model = _new_model(engine, weights, onnx)
    model = new_model.model
    # The builder's stages, in its order and with its options (kiln/builder/build.py).
    storage = config.precision
    requantized: _Quantized | None = None
    if quantized:
        requantized = _requantize(model, config, header.get("quantization") or {}, recalibrate)
        model = requantized.model
        storage = "fp16" if config.device == "cuda" else "fp32"
    graph, lowered = optimize_and_lower(model, replace(pass_options(config), verify=False))
    program, derived, inputs, outputs = lowered.program, lowered.weights, lowered.inputs, lowered.outputs
    if storage in ("fp16", "bf16"):
        lower_precision_of(lowered, storage, set(config.layer_precision))
    built_spec, new_spec = _structure(engine.plan.program.to_json()), _structure(program.to_json())
    if (engine.plan.plain is None) != (lowered.plain is None):
        raise RefitError("the engine " + ("carries" if engine.plan.plain is not None else "does not carry")
                         + " a plain program beside its padding-free one, these weights' build would not: rebuild it")
    if lowered.plain is not None and built_spec == new_spec:  # a padding-free engine's plain program too
        built_spec, new_spec = _structure(engine.plan.plain.to_json()), _structure(lowered.plain.to_json())
    same_io = [b.to_json() for b in inputs] == header["inputs"] and [b.to_json() for b in outputs] == header["outputs"]
    if built_spec != new_spec or not same_io:
        version = header.get("kiln_version")
        note = "" if version in (None, __version__) else \
            f" (the engine was built by kiln {version}: its builder may differ)"
        if recalibrate is not None:
            note += ("; the new calibration quantizes differently from the build's (another layer left float, "
                     "or a range of 0): rebuild with this calibration data")
        raise RefitError("these weights change the engine's structure, so they need a rebuild: "
                         + _first_difference(built_spec, new_spec) + note)
    problems = []
    for key, old in engine.plan.weights.items():
        new = derived.get(key)
        if new is None or type(new) is not type(old) or new.dtype != old.dtype or tuple(new.shape) != tuple(old.shape):
            problems.append(f"{key!r}: engine {getattr(old, 'dtype', '?')} {list(getattr(old, 'shape', []))}, derived "
                            f"{getattr(new, 'dtype', None)} {list(getattr(new, 'shape', []))}")
    if problems:
        raise RefitError("derived weights do not fit the engine:\n  " + "\n  ".join(problems[:10]))
    changed = {k: v for k, v in derived.items() if not _equal(v, engine.plan.weights[k])}
    report = RefitReport(source=new_model.source, model=new_model.base, changed=sorted(changed),
                         unchanged=len(derived) - len(changed), initializers=new_model.initializers)
    if requantized is None:
        return Derived(changed, report)
    report.activation_scales = requantized.activation_scales
    report.requantized = list(requantized.record.get("quantized", []))
    # recalibrated: the engine holds the new ranges from now on, and a later refit keeps those
    entries = {k: requantized.record[k] for k in ("calibration", "ranges", "accuracy", "kept_float", "quantized",
                                                        "smoothquant", "bias_correction", "channel_means")
               if k in requantized.record} if recalibrate is not None else None
    return Derived(changed, report, entries)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                                                  b.contiguous().reshape(-1).view(torch.uint8))
    return np.array_equal(a, b)


def refit(engine: Engine, weights: WeightsSource, onnx: str | os.PathLike | None = None,
          recalibrate: Any = None) -> RefitReport:
    """Derive the weights (derive_weights), swap them into the engine, record the refit in its header.
    recalibrate: calibration data (as kiln.build's `calibration`) for an int8/fp8 engine's activation
    ranges to be measured again on the new weights; without it they stay the calibrated ones."""
    derived = derive_weights(engine, weights, onnx, recalibrate)
    apply(engine, derived)
    return derived.report


def apply(engine: Engine, derived: Derived) -> None:
    """Swap derived weights into the engine (its layers re-prepare them) and record the refit in its header."""
    engine.set_weights(derived.weights)
    if derived.quantization is not None:
        engine.plan.header.setdefault("quantization", {}).update(derived.quantization)
    engine.plan.header.setdefault("refits", []).append(derived.report.to_json())
