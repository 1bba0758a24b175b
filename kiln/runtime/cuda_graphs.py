"""CUDA graphs: one per input-shape signature of an execution context, replayed, in a bounded cache.

A context captures a graph the second time it meets a signature (the first run is eager: it
records the signature's shape values and warms the kernels up) and replays it after. Graphs are
kept least recently used first out, within a count and a memory budget (each graph's memory is
what its capture allocated: its private pool, inputs and outputs), so a stream of shapes cannot
grow device memory without bound; shape buckets (kiln/runtime/buckets.py) keep the number of
signatures small in the first place. `stats` counts captures, replays, evictions and eager runs.

Each runner warms up and captures on a stream of its own (kiln/runtime/capture_streams.py): graphs captured on one
stream by one thread share torch's cuBLAS workspace, and two contexts' graphs replayed at once must not. The
environment's KILN_CAPTURE_STREAMS=0 gives back the old behaviour (torch.cuda.graph's one default capture stream, the
warm-up run on a fresh side stream), for A/B runs of that race (tests/gpu/test_concurrent_contexts.py).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from kiln.runtime.buckets import pad_to
from kiln.runtime.capture_streams import CAPTURE_STREAMS
from kiln.runtime.host import ShapePlan, host_sync_is_an_error
from kiln.runtime.program import Program

MAX_GRAPHS = 64
MEMORY_BUDGET = 4 << 30  # bytes of captured graphs per context


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph | None
    plan: ShapePlan
    static_inputs: list[Any]
    static_outputs: list[Any]
    reason: str = ""  # why this signature runs eagerly, when graph is None
    bytes: int = 0  # device memory the capture took
    ms: float | None = None  # one replay's time, measured after the capture (shape buckets' split costs)

    def fill(self, inputs: list[torch.Tensor]) -> None:
        """Each input into its static input, zero-padded where it is smaller (a run padded to a shape bucket): the
        padded copy a run would make first is never made."""
        for dst, src in zip(self.static_inputs, inputs):
            if dst.shape == src.shape:
                if dst.data_ptr() != src.data_ptr():
                    dst.copy_(src)
            else:
                pad_to(src, dst)


@dataclass
class GraphStats:
    captures: int = 0
    replays: int = 0
    evictions: int = 0
    eager_runs: int = 0  # first sight of a signature, or a signature that cannot be captured
    split_runs: int = 0  # runs whose batch ran as several bucket-sized chunks (kiln/runtime/buckets.py)
    graphs: int = 0  # held now
    graph_bytes: int = 0  # held now
    peak_graph_bytes: int = 0
    eager_reasons: dict[str, str] = field(default_factory=dict)  # signature -> why it runs eagerly

    def to_json(self) -> dict:
        return dict(self.__dict__)


class GraphRunner:
    """Per execution context: one ShapePlan and one CUDA graph per input-shape signature.

    Outputs of a replay live in the graph's memory and are overwritten by the next run on
    the same context (TensorRT's contract for a context's output buffers).
    """

    def __init__(self, program: Program, use_graphs: bool = True, max_graphs: int = MAX_GRAPHS,
                 memory_budget: int = MEMORY_BUDGET, plain_inputs: bool = False):
        """`plain_inputs`: the graphs' input tensors are ordinary tensors, not inference tensors, so a caller may
        copy into them outside torch.inference_mode (kiln/runtime/static_replay.py)."""
        self.program = program
        self.plain_inputs = plain_inputs
        self.use_graphs = use_graphs
        self.max_graphs = max_graphs
        self.memory_budget = memory_budget
        self.entries: OrderedDict[tuple, _Captured] = OrderedDict()
        self.stats = GraphStats()
        self._capture_stream: Any = None  # taken at the first capture (capture_stream), given back with the runner
        self.own_capture_stream = os.environ.get("KILN_CAPTURE_STREAMS", "1") != "0"  # 0: the old shared one (A/B)

    def capture_stream(self, device: torch.device) -> Any:
        """The stream this runner warms up and captures its graphs on, no other live runner's (its graphs' cuBLAS
        workspace is then theirs alone: kiln/runtime/capture_streams.py). KILN_CAPTURE_STREAMS=0: a side stream from
        torch's pool, as before (the capture then on torch.cuda.graph's default stream)."""
        if not self.own_capture_stream:
            return torch.cuda.Stream()
        if self._capture_stream is None:
            self._capture_stream = CAPTURE_STREAMS.take_for(self, device)
        return self._capture_stream

    @staticmethod
    def _key(inputs: list[Any], other: bool = False) -> tuple | None:
        key = [("other program",)] if other else []
        for v in inputs:
            if not isinstance(v, torch.Tensor):
                return None
            key.append((tuple(v.shape), v.dtype))
        return tuple(key)

    def run(self, inputs: list[Any], program: Program | None = None) -> list[Any]:
        """`program`: another program of the engine than the runner's own (a padding-free engine's plain one,
        kiln/runtime/context.py); its graphs share this cache, its bounds and its stats."""
        program = program or self.program
        key = self._key(inputs, program is not self.program)
        if key is None:  # sequences/optionals: no shape signature, run eagerly
            self.stats.eager_runs += 1
            return program.run(inputs)
        entry = self.entries.get(key)
        if entry is None:
            return self._first_run(key, inputs, program)
        self.entries.move_to_end(key)
        if entry.graph is None:  # graphs off, or this signature cannot be captured (entry.reason)
            self.stats.eager_runs += 1
            return program.run(inputs, plan=entry.plan)
        for dst, src in zip(entry.static_inputs, inputs):
            if dst.data_ptr() != src.data_ptr():
                dst.copy_(src)
        entry.graph.replay()
        self.stats.replays += 1
        return entry.static_outputs

    def replay_padded(self, inputs: list[torch.Tensor], shapes: list[tuple[int, ...]],
                      program: Program | None = None) -> list[Any] | None:
        """The graph captured at `shapes` (the inputs' shapes padded to their buckets), replayed with each input
        written straight into its static input, zero-padded (_Captured.fill); None where no graph is captured for
        them (the caller pads and runs: the first runs at a shape record and capture). Same results as run() on the
        padded inputs."""
        key = [("other program",)] if program is not None and program is not self.program else []
        key += [(shape, x.dtype) for shape, x in zip(shapes, inputs)]
        key = tuple(key)
        entry = self.entries.get(key)
        if entry is None or entry.graph is None:
            return None
        self.entries.move_to_end(key)
        entry.fill(inputs)
        entry.graph.replay()
        self.stats.replays += 1
        return entry.static_outputs

    def replay_ms(self, inputs: list[Any], program: Program | None = None) -> float | None:
        """The measured time of one replay of the graph captured for these inputs' shapes, if any."""
        entry = self.entries.get(self._key(inputs, program is not None and program is not self.program))
        return entry.ms if entry is not None and entry.graph is not None else None

    def _first_run(self, key: tuple, inputs: list[Any], program: Program) -> list[Any]:
        plan = ShapePlan()
        outputs = program.run(inputs, plan=plan)  # eager; records host values, warms up kernels
        self.stats.eager_runs += 1
        plan.recording = False
        entry = _Captured(None, plan, [], [], reason="CUDA graphs disabled")
        self.entries[key] = entry
        if not self.use_graphs:
            return outputs
        free_before = torch.cuda.memory_allocated()
        with torch.inference_mode(not self.plain_inputs):
            static_inputs = [t.clone() for t in inputs]
        stream = self.capture_stream(static_inputs[0].device if static_inputs else torch.cuda.current_device())
        stream.wait_stream(torch.cuda.current_stream())
        try:
            # A second eager run that may not synchronize with the host: if any layer does
            # (data-dependent shapes: NonZero, Unique, a Loop on data...), capture is impossible. On the capture
            # stream: cuBLAS's workspace for it is allocated here, outside the graph's private pool.
            with host_sync_is_an_error(), torch.cuda.stream(stream):
                program.run(static_inputs, plan=plan)
        except Exception as e:  # noqa: BLE001  any failure here means: stay eager
            # the error names the layer (call_step): "layer 'x' (Op) failed: ..."; bench shows it
            entry.reason = f"a layer synchronizes with the host: {str(e).splitlines()[0][:300]}"
            self.stats.eager_reasons[str(key)] = entry.reason
            return outputs
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            # this runner's stream, not torch.cuda.graph's one default (unless KILN_CAPTURE_STREAMS=0)
            with torch.cuda.graph(graph, stream=stream if self.own_capture_stream else None):
                static_outputs = program.run(static_inputs, plan=plan)
        except Exception as e:  # noqa: BLE001
            entry.reason = f"capture failed ({type(e).__name__}: {str(e)[:120]})"
            self.stats.eager_reasons[str(key)] = entry.reason
            torch.cuda.synchronize()
            return outputs
        entry.graph, entry.static_inputs, entry.static_outputs, entry.reason = graph, static_inputs, static_outputs, ""
        entry.ms = _replay_ms(graph)
        entry.bytes = max(torch.cuda.memory_allocated() - free_before, 0)
        self.stats.captures += 1
        self.stats.graphs += 1
        self.stats.graph_bytes += entry.bytes
        self.stats.peak_graph_bytes = max(self.stats.peak_graph_bytes, self.stats.graph_bytes)
        self._evict(keep=key)
        return outputs

    def _evict(self, keep: tuple) -> None:
        """Least recently used graphs out until the count and the memory are within bounds."""
        while self.stats.graphs > self.max_graphs or (self.stats.graph_bytes > self.memory_budget
                                                      and self.stats.graphs > 1):
            victim = next((k for k, e in self.entries.items() if e.graph is not None and k != keep), None)
            if victim is None:
                return
            entry = self.entries.pop(victim)
            self.stats.graphs -= 1
            self.stats.graph_bytes -= entry.bytes
            self.stats.evictions += 1
            entry.graph = None  # its pool goes back to torch's allocator with the last reference


def _replay_ms(graph: torch.cuda.CUDAGraph, replays: int = 2) -> float:
    """The fastest of a few replays, in ms (CUDA events): what running this bucket costs the GPU."""
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return min(times)
