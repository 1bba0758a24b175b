"""Running a program on CUDA: host shape arithmetic, device kernels, one CUDA graph per shape.

Values computed only from constants and shapes (Shape, Gather on a shape, Concat of dims,
Range over a length...) are functions of the input *shapes*, not of the data. The runtime
computes them on the CPU, once per input-shape signature, and remembers them in a
`ShapePlan` — as TensorRT computes shape tensors on the host. What remains is device work
that never waits on the host, so the whole step list can be captured into one CUDA graph
per concrete input shape and replayed (`GraphRunner`).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from kiln.errors import ExecutionError
from kiln.runtime.program import Program, call_step

HOST_MAX_NUMEL = 4096  # host results larger than this move to the device once and stay there
NEVER_ON_HOST = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Bernoulli", "Multinomial"}


@dataclass
class ShapePlan:
    """What one input-shape signature taught the runtime (valid for that signature only)."""

    host_outputs: dict[int, list[Any]] = field(default_factory=dict)  # step -> its outputs
    uploads: dict[int, dict[int, Any]] = field(default_factory=dict)  # step -> arg -> device copy
    recording: bool = True


def _on_device(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.device.type == "cuda"
    if isinstance(value, list):
        return any(_on_device(v) for v in value)
    return False


def _upload(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor) and value.device != device:
        return value.to(device)
    if isinstance(value, list):
        return [_upload(v, device) for v in value]
    return value


def _place(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() > HOST_MAX_NUMEL:
        return value.to(device)
    return value


def _outputs(result: Any, n: int) -> list[Any]:
    if n == 1:
        return [result[0] if isinstance(result, tuple) else result]
    return list(result)


def run_on_device(program: Program, inputs: list[Any], outer: dict[str, Any] | None,
                  plan: ShapePlan | None) -> list[Any]:
    device = program.device
    env = list(program.template)
    for s, v in zip(program.input_slots, inputs):
        env[s] = v
    for name, s in program.capture_slots:
        env[s] = outer[name]
    for i, (fn, ctx, in_slots, out_slots, attrs, free) in enumerate(program.steps):
        cached = plan.host_outputs.get(i) if plan is not None else None
        if cached is not None:
            outs = cached
        else:
            args = [env[s] if s >= 0 else None for s in in_slots]
            if not any(_on_device(a) for a in args) and ctx.op_type not in NEVER_ON_HOST:
                # Host step: every input is a constant or shape-derived value.
                outs = [_place(o, device) for o in _outputs(call_step(fn, ctx, args, attrs), len(out_slots))]
                if plan is not None and plan.recording:
                    plan.host_outputs[i] = outs
            else:
                uploads = plan.uploads.get(i) if plan is not None else None
                if uploads:
                    args = [uploads.get(j, a) for j, a in enumerate(args)]
                try:
                    result = call_step(fn, ctx, args, attrs)
                except ExecutionError:
                    # Mixed host/device inputs the op cannot take: move the host values over.
                    moved = {j: _upload(a, device) for j, a in enumerate(args)
                             if isinstance(a, (torch.Tensor, list)) and not _on_device(a)}
                    if not moved:
                        raise
                    if plan is not None and plan.recording:
                        plan.uploads[i] = moved
                    args = [moved.get(j, a) for j, a in enumerate(args)]
                    result = call_step(fn, ctx, args, attrs)
                outs = _outputs(result, len(out_slots))
        for s, v in zip(out_slots, outs):
            env[s] = v
        for s in free:
            env[s] = None
    return [env[s] for s in program.output_slots]


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph | None
    plan: ShapePlan
    static_inputs: list[Any]
    static_outputs: list[Any]
    reason: str = ""  # why this signature runs eagerly, when graph is None


@contextlib.contextmanager
def host_sync_is_an_error() -> Iterator[None]:
    """Inside, torch raises on any operation that would synchronize with the host: a run that
    passes may be captured into a CUDA graph (the runtime's capture, the autotuner's timing)."""
    with warnings.catch_warnings():  # "prototype feature": it is, and it is what we need
        warnings.simplefilter("ignore", UserWarning)
        torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


class GraphRunner:
    """Per execution context: one ShapePlan and one CUDA graph per input-shape signature.

    Outputs of a replay live in the graph's memory and are overwritten by the next run on
    the same context (TensorRT's contract for a context's output buffers).
    """

    def __init__(self, program: Program, use_graphs: bool = True):
        self.program = program
        self.use_graphs = use_graphs
        self.entries: dict[tuple, _Captured] = {}

    @staticmethod
    def _key(inputs: list[Any]) -> tuple | None:
        key = []
        for v in inputs:
            if not isinstance(v, torch.Tensor):
                return None
            key.append((tuple(v.shape), v.dtype))
        return tuple(key)

    def run(self, inputs: list[Any]) -> list[Any]:
        key = self._key(inputs)
        if key is None:  # sequences/optionals: no shape signature, run eagerly
            return self.program.run(inputs)
        entry = self.entries.get(key)
        if entry is None:
            return self._first_run(key, inputs)
        if entry.graph is None:
            return self.program.run(inputs, plan=entry.plan)
        for dst, src in zip(entry.static_inputs, inputs):
            if dst.data_ptr() != src.data_ptr():
                dst.copy_(src)
        entry.graph.replay()
        return entry.static_outputs

    def _first_run(self, key: tuple, inputs: list[Any]) -> list[Any]:
        plan = ShapePlan()
        outputs = self.program.run(inputs, plan=plan)  # eager; records host values, warms up kernels
        plan.recording = False
        entry = _Captured(None, plan, [], [], reason="CUDA graphs disabled")
        self.entries[key] = entry
        if not self.use_graphs:
            return outputs
        static_inputs = [t.clone() for t in inputs]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        try:
            # A second eager run that may not synchronize with the host: if any layer does
            # (data-dependent shapes: NonZero, Unique, a Loop on data...), capture is impossible.
            with host_sync_is_an_error(), torch.cuda.stream(stream):
                self.program.run(static_inputs, plan=plan)
        except Exception as e:  # noqa: BLE001  any failure here means: stay eager
            entry.reason = f"a layer synchronizes with the host ({type(e).__name__}: {str(e)[:120]})"
            return outputs
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                static_outputs = self.program.run(static_inputs, plan=plan)
        except Exception as e:  # noqa: BLE001
            entry.reason = f"capture failed ({type(e).__name__}: {str(e)[:120]})"
            torch.cuda.synchronize()
            return outputs
        entry.graph, entry.static_inputs, entry.static_outputs, entry.reason = graph, static_inputs, static_outputs, ""
        return outputs
