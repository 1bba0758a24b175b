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
  - int8/fp8 engines: their scales were calibrated on the old weights' activations (rebuild with
    calibration data);
  - an engine whose ONNX model is not known (given as bytes at build) and not passed with `onnx=`.
The tactics were timed and checked on the old weights: refit does not re-run the accuracy check.
"""

from __future__ import annotations

import datetime
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import safetensors.torch
import torch

from kiln.builder.config import BuildConfig
from kiln.builder.lower import lower
from kiln.builder.precision import lower_precision
from kiln.errors import KilnError
from kiln.frontend import onnx as onnx_frontend
from kiln.ir import dtypes
from kiln.passes import PassOptions, optimize
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
    """Each named initializer takes its new value: same dtype and shape, or refused."""
    held = _initializers(model)
    unknown = sorted(set(weights) - set(held))
    if unknown:
        shown = ", ".join(sorted(held)[:12]) + (" ..." if len(held) > 12 else "")
        raise RefitError(f"no initializer named {unknown[:10]} in the model the engine was built from "
                         f"(its initializers: {shown}); the names are the ONNX model's")
    problems = []
    arrays = {}
    for name, value in weights.items():
        array = _as_numpy(name, value)
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


def _new_model(engine: Engine, weights: WeightsSource, onnx_path: str | os.PathLike | None
               ) -> tuple[ir.Model, str, str]:
    """(the ONNX model with the new weights, imported; where the weights came from; the model's name)."""
    if isinstance(weights, (bytes, onnx.ModelProto)):
        return onnx_frontend.load(weights), "an ONNX model", "the given model"
    if isinstance(weights, (str, os.PathLike)):
        path = Path(weights)
        if not path.is_file():
            raise RefitError(f"{path}: no such weights file")
        if path.suffix == ".onnx":
            return onnx_frontend.load(path), str(path), str(path)
        if path.suffix != ".safetensors":
            raise RefitError(f"{path}: weights come as .safetensors (named as the ONNX initializers) or .onnx")
        weights, label = safetensors.torch.load_file(str(path)), str(path)
    else:
        label = f"{len(weights)} named tensor(s)"
    base = _source_model(engine, onnx_path)
    model = onnx_frontend.load(base)
    _replace(model, dict(weights))
    return model, label, str(base)


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


def derive_weights(engine: Engine, weights: WeightsSource, onnx: str | os.PathLike | None = None
                   ) -> tuple[dict[str, Any], RefitReport]:
    """The engine's weights (by engine key) as a build from the new weights would store them."""
    header = engine.plan.header
    try:
        config = BuildConfig.from_kwargs(**header["build_config"])
    except (KeyError, TypeError) as e:
        raise RefitError(f"the engine's build options cannot be read by this kiln ({e}); rebuild it") from None
    if config.precision in ("int8", "fp8"):
        raise RefitError(f"a {config.precision} engine's quantization scales were calibrated on the old weights; "
                         "new weights need new calibration: rebuild with --calib")
    model, label, base = _new_model(engine, weights, onnx)
    # The builder's stages, in its order and with its options (kiln/builder/build.py).
    graph = optimize(model, PassOptions(opt_level=config.opt_level, unsigned_activations=config.device == "cpu",
                                        cpu_rules=config.device == "cpu", refittable=config.refittable))
    program, derived, inputs, outputs = lower(graph)
    if config.precision in ("fp16", "bf16"):
        lower_precision(program, derived, config.precision, set(config.layer_precision))
    built_spec, new_spec = _structure(engine.plan.program.to_json()), _structure(program.to_json())
    same_io = [b.to_json() for b in inputs] == header["inputs"] and [b.to_json() for b in outputs] == header["outputs"]
    if built_spec != new_spec or not same_io:
        version = header.get("kiln_version")
        note = "" if version in (None, __version__) else \
            f" (the engine was built by kiln {version}: its builder may differ)"
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
    report = RefitReport(source=label, model=base, changed=sorted(changed), unchanged=len(derived) - len(changed))
    return changed, report


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                                                  b.contiguous().reshape(-1).view(torch.uint8))
    return np.array_equal(a, b)


def refit(engine: Engine, weights: WeightsSource, onnx: str | os.PathLike | None = None) -> RefitReport:
    """Derive the weights (derive_weights), swap them into the engine, record the refit in its header."""
    changed, report = derive_weights(engine, weights, onnx)
    engine.set_weights(changed)
    engine.plan.header.setdefault("refits", []).append(report.to_json())
    return report
