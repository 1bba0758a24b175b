"""ExecutionContext's CUDA graph paths (kiln/runtime/context.py): execute()'s one graph of a whole call over bound
tensors, run()'s direct replay of a fixed-shape engine's graph (kiln/runtime/static_replay.py) with its inputs'
graph, and a bucketed run's inputs written straight into its graph's (GraphRunner.replay_padded).
"""

from __future__ import annotations

from typing import Any

import torch

from kiln.ir import dtypes
from kiln.runtime.static_replay import StaticReplay


class GraphPaths:
    """ExecutionContext's CUDA graph paths, a mixin of it: they read what its __init__ set (engine, runner, buckets,
    _cuda_static, _direct_replay, _inputs_in_graph, _static_replay, _bound, _token_mask) and run through its run()."""

    def _capture_io_graph(self, feeds: dict[str, torch.Tensor]) -> tuple[Any, dict[str, torch.Tensor]] | None:
        """One CUDA graph of the whole call over the bound tensors: each input cast into the network's dtype,
        the network (replaying the shape values its ordinary graph recorded), each output copied (cast) into its
        bound tensor or into a context-owned one. It shares the ordinary graph's memory pool: the two are never
        replayed at once and neither keeps a freed block's contents between replays. None when the ordinary
        graph is not captured (a layer that syncs): execute() then runs the general path."""
        for _ in range(2):  # the first run records the shapes and warms up, the second captures (GraphRunner)
            self.run(feeds)
        names, _, key, outputs = self._cuda_static
        entry = self.runner.entries.get(key)
        if entry is None or entry.graph is None:
            return None
        targets = {}
        for (name, dtype), static in zip(outputs, entry.static_outputs):
            bound = self._bound.get(name)
            targets[name] = bound if bound is not None else torch.empty(
                static.shape, dtype=dtype or static.dtype, device=self.engine.device)
        graph = torch.cuda.CUDAGraph()
        stream = self.runner.capture_stream(self.engine.device)  # its own: cuBLAS's workspace (capture_streams.py)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.inference_mode(), torch.cuda.stream(stream):
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, pool=entry.graph.pool(), stream=stream):
                args = [feeds[n].to(d) for n, (_, d) in zip(names, key)]
                results = self.engine.program.run(args, plan=entry.plan)
                for (name, _), r in zip(outputs, results):
                    targets[name].copy_(r)
        torch.cuda.current_stream().wait_stream(stream)
        return graph, targets

    def _capture_inputs(self, sources: list[torch.Tensor]) -> tuple[Any, list[torch.Tensor]] | None:
        """StaticReplay's graph of a caller's inputs at their addresses (its capture_inputs): each input copied (cast)
        from the caller's tensor into the network's dtype, then the network, on the ordinary graph's memory pool
        (as _capture_io_graph's: never replayed at once). None where the ordinary graph is gone."""
        names, _, key, _ = self._cuda_static
        entry = self.runner.entries.get(key)
        if entry is None or entry.graph is None:
            return None
        graph = torch.cuda.CUDAGraph()
        stream = self.runner.capture_stream(self.engine.device)  # its own: cuBLAS's workspace (capture_streams.py)
        stream.wait_stream(torch.cuda.current_stream())
        try:
            with torch.inference_mode(), torch.cuda.stream(stream):
                torch.cuda.synchronize()
                with torch.cuda.graph(graph, pool=entry.graph.pool(), stream=stream):
                    args = [source.to(dtype, copy=True) for source, (_, dtype) in zip(sources, key)]
                    results = self.engine.program.run(args, plan=entry.plan)
        except RuntimeError:  # the ordinary graph captured; this one failing leaves the call on the direct path
            return None
        finally:
            torch.cuda.current_stream().wait_stream(stream)
        return graph, results

    def _replay_padded(self, args: list[Any], rows: int | None,
                       targets: dict[str, tuple[int, int]]) -> list[Any] | None:
        """A bucketed run whose graph is captured: its inputs written straight into the graph's, zero-padded to their
        buckets (GraphRunner.replay_padded), the program's as _run_program picks it; None where there is no such
        graph (or no CUDA graphs), and the run pads and runs."""
        if self.runner is None or not self.runner.use_graphs:
            return None
        shapes = self.buckets.padded_shapes(args, targets)
        program = None
        if rows is not None:
            args = [*args, self._token_bucket(rows, args[self._token_mask].device)]
            shapes.append((rows,))
        elif self._token_mask is not None:
            program = self.engine.plain_program
        return self.runner.replay_padded(args, shapes, program)

    def _replay_static(self, feeds: dict[str, Any]) -> dict[str, Any] | None:
        """A CUDA engine of fixed shapes, fed CUDA tensors of exactly its bindings, whose graph is
        captured: copy into the graph's inputs (the boundary cast to fp16/bf16 in the same copy) and
        replay, with as little Python as a call can have; a batch-1 call is about 0.4 ms, so the host
        work around the replay is much of it, and much of its jitter. Else None: the general path."""
        names, signature, key, outputs = self._cuda_static
        if len(feeds) != len(names):
            return None
        entry = self.runner.entries.get(key)
        if entry is None or entry.graph is None:
            return None  # the general path checks, runs the first time and captures
        if self._direct_replay:
            if self._static_replay is not None and self._static_replay.entry is entry:
                return None  # it was asked first and declined these feeds: the general path checks and runs them
            capture = self._capture_inputs if self._inputs_in_graph else None
            self._static_replay = StaticReplay(names, signature, outputs, entry, self.runner.stats,
                                               on_cuda=self.engine.device.type == "cuda", capture_inputs=capture)
            return self._static_replay(feeds)
        values = []
        for name, (dtype, shape) in zip(names, signature):
            value = feeds.get(name)
            if type(value) is not torch.Tensor or value.dtype != dtype or value.shape != shape or not value.is_cuda:
                return None
            values.append(value)
        with torch.inference_mode():
            for dst, src in zip(entry.static_inputs, values):
                dst.copy_(src)
            entry.graph.replay()
            self.runner.entries.move_to_end(key)
            self.runner.stats.replays += 1
            return {name: r if dtype is None else r.to(dtype) for (name, dtype), r in zip(outputs, entry.static_outputs)}


def _cuda_static_signature(engine: Any) -> tuple | None:
    """(input names, [(user dtype, shape)], the graph key with internal dtypes, output bindings with the
    dtype each is handed back in) of a CUDA engine whose inputs are all tensors of fixed shapes; else None."""
    if engine.profiles:
        return None
    names, signature, key = [], [], []
    for b in engine.inputs:
        dt = dtypes.BY_NAME.get(b.dtype) if b.dtype else None
        if b.kind != "tensor" or b.shape is None or not all(isinstance(d, int) for d in b.shape) or dt is None \
                or dt.torch is None:
            return None
        shape = torch.Size(b.shape)
        names.append(b.name)
        signature.append((dt.torch, shape))
        key.append((tuple(b.shape), engine.internal_dtype.get(b.dtype, dt.torch)))
    outputs = [(b.name, dtypes.BY_NAME[b.dtype].torch if b.dtype in engine.internal_dtype else None)
               for b in engine.outputs]
    return names, signature, tuple(key), outputs
