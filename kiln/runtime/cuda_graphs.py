"""CUDA graphs: one per input-shape signature of an execution context, replayed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kiln.runtime.host import ShapePlan, host_sync_is_an_error
from kiln.runtime.program import Program


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph | None
    plan: ShapePlan
    static_inputs: list[Any]
    static_outputs: list[Any]
    reason: str = ""  # why this signature runs eagerly, when graph is None


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
            # the error names the layer (call_step): "layer 'x' (Op) failed: ..."; inspect/bench show it
            entry.reason = f"a layer synchronizes with the host: {str(e).splitlines()[0][:300]}"
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
