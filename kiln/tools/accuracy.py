"""`kiln compare`: an engine's outputs against onnxruntime fp32, with error statistics.

    report = compare("model.onnx", precision="fp16", mark_all=True)
    print(report.render())

With `mark_all`, every intermediate value that exists in both kiln's engine and the ONNX graph
is compared, in kiln's step order, and the first layer whose error exceeds the tolerance is
named — the tool for "INT8/FP16 accuracy collapsed: which layer?".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch

import kiln
from kiln.ir import dtypes
from kiln.runtime.program import Program

# Default tolerances per precision: |kiln - ref| <= atol + rtol * |ref| elementwise.
TOLERANCES = {"fp32": (1e-4, 1e-5), "tf32": (5e-3, 5e-3), "fp16": (2e-2, 2e-2), "bf16": (5e-2, 5e-2),
              "int8": (1e-1, 1e-1), "fp8": (1e-1, 1e-1)}  # a quantized layer: a few steps of its scale


@dataclass
class ErrorStats:
    name: str
    shape: tuple[int, ...]
    max_abs: float
    mean_abs: float
    p99_abs: float
    max_rel: float
    ref_max: float
    mismatched: float  # fraction of elements outside tolerance
    passed: bool

    def row(self) -> str:
        verdict = "ok" if self.passed else "FAIL"
        return (f"{self.name:<40} {str(list(self.shape)):<18} {self.max_abs:10.3g} {self.mean_abs:10.3g} "
                f"{self.p99_abs:10.3g} {self.max_rel:10.3g} {self.ref_max:10.3g} {100 * self.mismatched:8.3f}%  {verdict}")


@dataclass
class CompareReport:
    precision: str
    rtol: float
    atol: float
    outputs: list[ErrorStats]
    layers: list[tuple[str, str, ErrorStats]] = field(default_factory=list)  # (step, op, stats)
    first_divergence: tuple[str, str, ErrorStats] | None = None

    @property
    def passed(self) -> bool:
        return all(s.passed for s in self.outputs)

    def render(self, worst: int = 10, by_scale: bool = False) -> str:
        """`by_scale`: rank the layers by max |err| relative to their own max |ref| (--per-layer), not by
        the share of elements outside tolerance."""
        head = (f"{'value':<40} {'shape':<18} {'max |err|':>10} {'mean |err|':>10} {'p99 |err|':>10} "
                f"{'max rel':>10} {'max |ref|':>10} {'outside':>9}")
        lines = [f"kiln ({self.precision}) vs onnxruntime fp32; tolerance |err| <= {self.atol:g} + {self.rtol:g}*|ref|",
                 "", "outputs:", head]
        lines += [s.row() for s in self.outputs]
        if self.layers:
            lines += ["", f"layers compared: {len(self.layers)}"]
            if self.first_divergence:
                step, op, s = self.first_divergence
                lines.append(f"first layer outside tolerance: {step!r} ({op}), value {s.name!r}: "
                             f"max |err| {s.max_abs:.3g} at max |ref| {s.ref_max:.3g}")
            else:
                lines.append("every compared layer is within tolerance")
            if by_scale:
                ranked = sorted(self.layers, key=lambda t: -(t[2].max_abs / (t[2].ref_max or 1.0)))[:worst]
                how = "max |err| / max |ref|"
            else:
                ranked = sorted(self.layers, key=lambda t: -t[2].mismatched)[:worst]
                how = "share of elements outside tolerance"
            lines += ["", f"worst {len(ranked)} layers by {how}:", "step / op / " + head]
            lines += [f"{step} / {op} / {s.row()}" for step, op, s in ranked]
        lines.append("")
        lines.append("PASSED" if self.passed else "FAILED")
        return "\n".join(lines)


def error_stats(name: str, got: np.ndarray, ref: np.ndarray, rtol: float, atol: float) -> ErrorStats:
    got = np.asarray(got)
    ref = np.asarray(ref)
    if got.shape != ref.shape and got.size == ref.size:
        got = got.reshape(ref.shape)  # a fused layer may keep a value's name but merge/split axes
    if got.shape != ref.shape:
        return ErrorStats(name, tuple(got.shape), float("inf"), float("inf"), float("inf"), float("inf"),
                          float(np.abs(ref).max()) if ref.size else 0.0, 1.0, False)
    if got.dtype.kind not in "fc":
        equal = got == ref
        frac = 1.0 - float(equal.mean()) if got.size else 0.0
        return ErrorStats(name, tuple(got.shape), float(frac > 0), float(frac), float(frac > 0), 0.0, 0.0, frac, frac == 0)
    g = got.astype(np.float64)
    r = ref.astype(np.float64)
    err = np.abs(g - r)
    finite_mismatch = np.isnan(g) != np.isnan(r)
    err = np.where(np.isnan(g) & np.isnan(r), 0.0, err)
    outside = (err > atol + rtol * np.abs(r)) | finite_mismatch
    return ErrorStats(
        name=name,
        shape=tuple(got.shape),
        max_abs=float(err.max()) if err.size else 0.0,
        mean_abs=float(err.mean()) if err.size else 0.0,
        p99_abs=float(np.percentile(err, 99)) if err.size else 0.0,
        max_rel=float((err / np.maximum(np.abs(r), 1e-12)).max()) if err.size else 0.0,
        ref_max=float(np.abs(r).max()) if r.size else 0.0,
        mismatched=float(outside.mean()) if outside.size else 0.0,
        passed=not outside.any(),
    )


def random_inputs(engine: kiln.Engine, shapes: dict[str, list[int]] | None = None, seed: int = 0) -> dict[str, np.ndarray]:
    """Inputs for every binding: symbolic dims from `shapes` (else 1); floats ~ N(0, 1), ints in [0, 10)."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for b in engine.inputs:
        shape = (shapes or {}).get(b.name) or [d if isinstance(d, int) else 1 for d in (b.shape or [])]
        dt = dtypes.BY_NAME[b.dtype or "float"]
        if dt.is_float:
            feeds[b.name] = rng.standard_normal(shape).astype(dt.numpy)
        elif dt.name == "bool":
            feeds[b.name] = rng.integers(0, 2, shape).astype(bool)
        else:
            feeds[b.name] = rng.integers(0, 10, shape).astype(dt.numpy)
    return feeds


def trace(program: Program, inputs: list[Any]) -> dict[str, Any]:
    """Run `program` keeping every step's outputs, by value name (no liveness frees)."""
    recorded: dict[str, Any] = {}
    names = [spec.outputs for spec in program.spec.steps]

    def record(i: int, fn):
        def call(ctx, *args, **kw):
            result = fn(ctx, *args, **kw)
            values = [result] if len(names[i]) == 1 and not isinstance(result, tuple) else list(result)
            for n, v in zip(names[i], values):
                if n:
                    recorded[n] = v
            return result

        return call

    traced = program.with_kernels(record, keep_values=True)
    with torch.inference_mode():
        traced.run(inputs)
    return recorded


def replay(program: Program, reference: dict[str, np.ndarray], inputs: list[Any]) -> dict[str, tuple[Any, Any]]:
    """Run `program` with every step fed the reference's values of its inputs (by value name, where the
    reference has them, cast to what the step was given: an int8 reference becomes uint8 + 128 where kiln
    made that activation unsigned, exactly), so that each layer is judged alone, free of what its
    predecessors' rounding made of its inputs. {value: (kiln's output, the reference's, in kiln's dtype)}
    for every step output the reference also has."""
    got: dict[str, tuple[Any, Any]] = {}
    specs = program.spec.steps

    def as_given(value: np.ndarray, like: torch.Tensor) -> torch.Tensor:
        if value.dtype == np.int8 and like.dtype == torch.uint8:  # kiln's unsigned activations (qdq_propagate)
            value = (value.astype(np.int16) + 128).astype(np.uint8)
        return dtypes.numpy_to_torch(np.ascontiguousarray(value)).to(like.device)

    def feed(i: int, fn):
        spec = specs[i]

        def call(ctx, *args, **kw):
            args = [as_given(reference[n], a) if n in reference and isinstance(a, torch.Tensor) and
                    n not in program.spec.constants else a for n, a in zip(spec.inputs, args)] + \
                list(args[len(spec.inputs):])
            result = fn(ctx, *args, **kw)
            values = [result] if len(spec.outputs) == 1 and not isinstance(result, tuple) else list(result)
            for n, v in zip(spec.outputs, values):
                if n in reference and isinstance(v, torch.Tensor):
                    got[n] = (v, as_given(reference[n], v))
            return result

        return call

    with torch.inference_mode():
        program.with_kernels(feed, keep_values=True).run(inputs)
    return got


def _all_outputs_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """The same model with every typed intermediate value of the main graph as an extra output."""
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    typed = {v.name: v for v in list(inferred.graph.value_info)}
    existing = {o.name for o in inferred.graph.output}
    for node in inferred.graph.node:
        for name in node.output:
            v = typed.get(name)
            if name and name not in existing and v is not None and v.type.HasField("tensor_type"):
                inferred.graph.output.append(v)
                existing.add(name)
    return inferred


def compare(model: str | Path | onnx.ModelProto, *, precision: str = "fp32", device: str = "cpu",
            opt_level: int = 2, inputs: dict[str, np.ndarray] | None = None, shapes: dict | None = None,
            rtol: float | None = None, atol: float | None = None, mark_all: bool = False,
            seed: int = 0, build_options: dict[str, Any] | None = None) -> CompareReport:
    """`build_options`: more kiln.build options (calibration data, calibrator, quantization for int8/fp8)."""
    import onnxruntime as ort

    proto = model if isinstance(model, onnx.ModelProto) else onnx.load(str(model))
    default_rtol, default_atol = TOLERANCES.get(precision, TOLERANCES["fp32"])
    rtol = default_rtol if rtol is None else rtol
    atol = default_atol if atol is None else atol
    engine = kiln.build(proto if isinstance(model, onnx.ModelProto) else model,
                        precision=precision, device=device, opt_level=opt_level, **(build_options or {}))
    feeds = inputs or random_inputs(engine, shapes, seed)
    reference = _all_outputs_model(proto) if mark_all else proto
    session = ort.InferenceSession(reference.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    ref = dict(zip(names, session.run(None, {k: v for k, v in feeds.items()})))
    got = engine.run(feeds)
    report = CompareReport(precision, rtol, atol,
                           [error_stats(n, got[n], ref[n], rtol, atol) for n in engine.output_names])
    if mark_all:
        values = trace(engine.program, engine.program_inputs(feeds))
        for spec in engine.plan.program.steps:
            for name in spec.outputs:
                if name in ref and name in values and isinstance(values[name], torch.Tensor):
                    value = values[name]
                    if value.dtype in (torch.float16, torch.bfloat16):
                        value = value.float()
                    stats = error_stats(name, dtypes.torch_to_numpy(value), ref[name], rtol, atol)
                    report.layers.append((spec.name, spec.op_type, stats))
                    if not stats.passed and report.first_divergence is None:
                        report.first_divergence = (spec.name, spec.op_type, stats)
    return report
