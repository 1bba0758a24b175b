"""A compiled step list: the interpreter loop the engine runs.

A `ProgramSpec` is plain data (what the engine file stores): the names of its inputs,
outputs, constants and outer-scope captures, and its steps. `Program` binds each value name
to a slot in a list, each step to its implementation, and frees a value's slot after its
last use (the liveness plan), so activations do not outlive their consumers.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from kiln.errors import ExecutionError
from kiln.ir import dtypes
from kiln.ops.registry import OpContext, lookup


@dataclass
class StepSpec:
    op_type: str
    name: str
    inputs: list[str]  # "" marks a missing optional input
    outputs: list[str]  # "" marks an output nobody asked for
    attributes: dict[str, Any] = field(default_factory=dict)  # JSON-able; see engine.plan
    domain: str = ""
    opset: int = 21
    captures: list[str] = field(default_factory=list)  # outer values its subgraphs read
    output_dtypes: list[str | None] = field(default_factory=list)
    fused_from: list[str] = field(default_factory=list)  # ONNX node names this step absorbed
    precision: str = ""  # "fp32": pinned to fp32 in a reduced-precision engine
    tactic: str = ""  # the kernel the autotuner chose (kiln/tactics); "": the op's registered implementation
    tactic_config: dict[str, Any] = field(default_factory=dict)  # JSON-able parameters of that tactic

    def to_json(self) -> dict:
        required = ("op_type", "name", "inputs", "outputs")
        return {k: v for k, v in self.__dict__.items() if k in required or v not in ([], {}, "")}

    @classmethod
    def from_json(cls, d: dict) -> StepSpec:
        return cls(**d)


@dataclass
class ProgramSpec:
    inputs: list[str]
    outputs: list[str]
    steps: list[StepSpec]
    constants: dict[str, str] = field(default_factory=dict)  # value name -> engine weight key
    captures: list[str] = field(default_factory=list)  # names read from the enclosing graph

    def to_json(self) -> dict:
        return {
            "inputs": self.inputs,
            "outputs": self.outputs,
            "constants": self.constants,
            "captures": self.captures,
            "steps": [s.to_json() for s in self.steps],
        }

    @classmethod
    def from_json(cls, d: dict) -> ProgramSpec:
        return cls(
            inputs=d["inputs"],
            outputs=d["outputs"],
            constants=d.get("constants", {}),
            captures=d.get("captures", []),
            steps=[StepSpec.from_json(s) for s in d["steps"]],
        )


def resolve_attribute(value: Any, weights: dict[str, Any], device: Any = None) -> Any:
    """JSON attribute -> runtime value: {"$tensor": key} -> weight, {"$graph": spec} -> Program."""
    if isinstance(value, dict):
        if "$tensor" in value:
            return weights[value["$tensor"]]
        if "$graph" in value:
            return Program(ProgramSpec.from_json(value["$graph"]), weights, device)
        if "$graphs" in value:
            return [Program(ProgramSpec.from_json(g), weights, device) for g in value["$graphs"]]
        if "$type" in value:
            return value["$type"]
    if isinstance(value, list) and value and isinstance(value[0], dict) and "$tensor" in value[0]:
        return [weights[v["$tensor"]] for v in value]
    return value


class Program:
    """Runs a ProgramSpec. One Program per (sub)graph; it holds no activations between runs."""

    def __init__(self, spec: ProgramSpec, weights: dict[str, Any], device: Any = None):
        self.spec = spec
        self.device = device  # None or cpu: plain loop; cuda: host/device split (runtime/device.py)
        slots: dict[str, int] = {}

        def slot(name: str) -> int:
            if name not in slots:
                slots[name] = len(slots)
            return slots[name]

        template_values: dict[int, Any] = {}
        for name, key in spec.constants.items():
            template_values[slot(name)] = weights[key]
        self.input_slots = [slot(n) for n in spec.inputs]
        self.capture_slots = [(n, slot(n)) for n in spec.captures]
        last_use: dict[str, int] = {}
        for i, step in enumerate(spec.steps):
            for n in list(step.inputs) + list(step.captures):
                if n:
                    last_use[n] = i
        keep = set(spec.outputs) | set(spec.constants)
        free_after: list[list[int]] = [[] for _ in spec.steps]
        for n, i in last_use.items():
            if n not in keep:
                free_after[i].append(slot(n))

        self.steps = []
        for i, step in enumerate(spec.steps):
            op = lookup(step.op_type, step.domain)
            if op is None:  # the builder checked this; a hand-edited engine may not be
                raise ExecutionError(f"layer {step.name!r}: no implementation of {step.op_type}")
            ctx = OpContext(
                name=step.name,
                op_type=step.op_type,
                domain=step.domain,
                opset=step.opset,
                num_inputs=len(step.inputs),
                num_outputs=len(step.outputs),
                output_dtypes=[dtypes.BY_NAME.get(d) if d else None for d in step.output_dtypes],
                capture_names=list(step.captures),
            )
            attrs = {k: resolve_attribute(v, weights, device) for k, v in step.attributes.items()}
            in_slots = [slot(n) if n else -1 for n in list(step.inputs) + list(step.captures)]
            out_slots = [slot(n) if n else -1 for n in step.outputs]
            fn = op.fn
            if step.tactic:  # pre-packs the step's weights once, here, at load
                from kiln.tactics.registry import launch_for

                # Inputs whose value dies at this step (freed after it; not a graph input, output or
                # capture): a tactic may write its result over one (kiln/tactics/cpu_onednn.py).
                dying = [k for k, n in enumerate(step.inputs) if n and slot(n) in free_after[i]
                         and n not in spec.inputs and n not in spec.captures]
                prepared = replace(step, tactic_config={**step.tactic_config, "dying_inputs": dying}) if dying else step
                fn = launch_for(prepared, op.fn, [template_values.get(s) for s in in_slots[:len(step.inputs)]], device)
            fn = fn if step.precision != "fp32" else _pinned_fp32(fn)
            self.steps.append((fn, ctx, in_slots, out_slots, attrs, free_after[i]))
        self.output_slots = [slot(n) for n in spec.outputs]
        # On the CPU, runs of layers whose tactics run bound oneDNN primitives become one step each
        # (kiln/runtime/native.py): the loop below runs `run_steps`; `steps` keeps every layer.
        self.segments = []
        self.run_steps = self.steps
        if (device is None or getattr(device, "type", "cpu") == "cpu") and os.environ.get("KILN_NATIVE_SEGMENTS") != "0":
            from kiln.runtime.native import segments

            self.run_steps, self.segments = segments(self.steps, self.output_slots)
        self.num_slots = len(slots) + 1  # the last slot takes outputs nobody reads
        self.template = [None] * self.num_slots
        for i, v in template_values.items():
            self.template[i] = v

    def with_kernels(self, wrap: Callable[[int, Any], Any], keep_values: bool = False) -> Program:
        """A copy whose step i calls `wrap(i, kernel)` instead of its kernel (for tracing, timing,
        replaying); the original is untouched. `keep_values`: no liveness frees."""
        copy = object.__new__(Program)
        copy.__dict__.update(self.__dict__)
        copy.steps = [(wrap(i, fn), ctx, ins, outs, attrs, [] if keep_values else free)
                      for i, (fn, ctx, ins, outs, attrs, free) in enumerate(self.steps)]
        copy.run_steps, copy.segments = copy.steps, []  # every layer is seen: no native segments
        return copy

    def run(self, inputs: list[Any], outer: dict[str, Any] | None = None, plan: Any = None) -> list[Any]:
        """Run once. `plan` (a runtime.device.ShapePlan) is only used on CUDA: see device.py."""
        if self.device is not None and self.device.type == "cuda":
            from kiln.runtime.device import run_on_device

            return run_on_device(self, inputs, outer, plan)
        env = list(self.template)
        for s, v in zip(self.input_slots, inputs):
            env[s] = v
        if self.capture_slots:
            for name, s in self.capture_slots:
                env[s] = outer[name]
        for fn, ctx, in_slots, out_slots, attrs, free in self.run_steps:
            args = [env[s] if s >= 0 else None for s in in_slots]
            result = call_step(fn, ctx, args, attrs)
            if len(out_slots) == 1:
                if isinstance(result, tuple):
                    result = result[0]
                env[out_slots[0]] = result
            else:
                for s, v in zip(out_slots, result):
                    env[s] = v
            result = v = None  # the slots alone hold the values: a kernel may overwrite a dying input
            for s in free:
                env[s] = None
        return [env[s] for s in self.output_slots]


def call_step(fn, ctx: OpContext, args: list[Any], attrs: dict[str, Any]) -> Any:
    try:
        return fn(ctx, *args, **attrs)
    except Exception as e:  # re-raised with the layer named; the cause is chained
        if isinstance(e, ExecutionError):
            raise
        raise ExecutionError(f"layer {ctx.name!r} ({ctx.op_type}) failed: {type(e).__name__}: {e}") from e


def _pinned_fp32(fn):
    """Run a layer in fp32 inside a half-precision engine: upcast its inputs, downcast its outputs."""
    import torch

    def up(v):
        return v.float() if isinstance(v, torch.Tensor) and v.dtype in (torch.float16, torch.bfloat16) else v

    def run(ctx, *args, **attrs):
        half = next((a.dtype for a in args if isinstance(a, torch.Tensor)
                     and a.dtype in (torch.float16, torch.bfloat16)), None)
        result = fn(ctx, *[up(a) for a in args], **attrs)
        if half is None:
            return result
        down = (lambda v: v.to(half) if isinstance(v, torch.Tensor) and v.dtype == torch.float32 else v)
        return tuple(down(r) for r in result) if isinstance(result, tuple) else down(result)

    return run
