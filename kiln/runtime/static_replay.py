"""context.run's path for a fixed-shape CUDA engine whose graph is captured, fed CUDA tensors of exactly its bindings.

A batch-1 call is ~0.4 ms of GPU time on the H200 (ResNet-50, BERT-base 1 x 128): the host's work before the replay
is time the GPU waits, and its variation is much of a call's jitter (issue 10: p99/p50 <= 1.05 end to end). So the
call does as little as a call can before the launch:

- the checks of each input are attribute reads against what was remembered at the capture (dtype, shape, device);
- the inputs go into the graph's own input tensors in one `torch._foreach_copy_` (one kernel for inputs of one
  dtype, BERT's ids and mask; a boundary cast to fp16 is a copy of its own), from a list made once and filled in
  place: nothing the collector tracks outlives a line before the replay (a `torch.Size` read for the shape check is
  freed at once), so no collection is due there;
- no `torch.inference_mode` is entered (~1-2 µs a call): the graph's input tensors are ordinary tensors
  (GraphRunner(plain_inputs=True)), and a tensor that requires grad takes the general path;
- after the launch, while the GPU runs: the stats, and outputs handed back in the user's dtype (fp16 -> fp32 casts
  of a reduced-precision engine as ordinary tensors, not inference tensors a caller could not update in place).

H200 (bench/results/stream-2026-12-04c.md, 2,000 calls): batch-1 p99/p50 through run() 1.16 -> 1.09 (BERT-base 1 x 128
with its mask) and 1.17 -> 1.07 (ResNet-50), outputs bitwise the old path's; execute() on bound tensors stays 1.02-1.03.

ExecutionContext makes one once its graph is captured (kiln/runtime/context.py; KILN_DIRECT_REPLAY=0: the old path,
inference mode and a copy_ an input); anything the path does not take
(another dtype or shape, a CPU tensor, an extra key, an evicted graph) returns None, and the general path checks,
explains and runs.

Opt-in (`capture_inputs`, the environment's KILN_REPLAY_CAPTURES_INPUTS=1): a caller that passes its inputs at the
same addresses as on its previous call (a control loop writing into its own input buffers; the caching allocator
often hands a new tensor the block the last one freed) gets a second graph captured over those addresses, the input
copies inside it: a call at those addresses is then one launch before the GPU starts, as execute()'s. Outputs as the
direct path's (the cast after the launch: fresh fp32 tensors). At most CAPTURES_OF_INPUTS such captures a context
(each a few ms): a caller whose addresses keep changing takes the direct path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


CAPTURES_OF_INPUTS = 4


class StaticReplay:
    """The captured graph of a fixed-shape CUDA engine, run from a dict of CUDA tensors."""

    def __init__(self, names: list[str], signature: list[tuple[torch.dtype, torch.Size]],
                 outputs: list[tuple[str, torch.dtype | None]], entry: Any, stats: Any, on_cuda: bool = True,
                 capture_inputs: Callable[[list[torch.Tensor]], tuple[Any, list[torch.Tensor]] | None] | None = None):
        """`signature`: the user's (dtype, shape) per input, in `names`' order; `outputs`: (name, the dtype each is
        handed back in, None for the graph's own); `entry`: the GraphRunner's captured entry (kiln/runtime/
        cuda_graphs.py _Captured) whose static inputs are ordinary tensors; `stats`: its GraphStats; `on_cuda`: the
        device the inputs must be on (False: the CPU, where tests stand a graph in); `capture_inputs`: sources -> (a
        graph reading them at their addresses, its outputs) or None, the opt-in above."""
        if any(t.is_inference() for t in entry.static_inputs):
            raise ValueError("StaticReplay copies into the graph's inputs outside inference mode: capture them as "
                             "ordinary tensors (GraphRunner(plain_inputs=True))")
        self.checks = tuple((name, dtype, shape) for name, (dtype, shape) in zip(names, signature))
        self.entry = entry
        self.stats = stats
        self.static_inputs = list(entry.static_inputs)
        self.sources: list[torch.Tensor | None] = [None] * len(names)  # the call's inputs, filled in place
        self.outputs = tuple((name, dtype, static) for (name, dtype), static in zip(outputs, entry.static_outputs))
        self.on_cuda = on_cuda
        self.output_casts = tuple((name, dtype) for name, dtype in outputs)
        self.capture_inputs = capture_inputs
        self.captures_left = CAPTURES_OF_INPUTS if capture_inputs is not None else 0
        self.last_addresses = [0] * len(names)  # data_ptr of each input at the last call
        self.inputs_graph: tuple[Any, list[int], tuple] | None = None  # (graph, its input addresses, its outputs)

    def __call__(self, feeds: dict[str, Any]) -> dict[str, Any] | None:
        sources, graph = self.sources, self.entry.graph
        if len(feeds) != len(sources) or graph is None:  # None: evicted (its memory is not held here)
            return None
        k = 0
        for name, dtype, shape in self.checks:
            value = feeds.get(name)
            if type(value) is not torch.Tensor or value.dtype is not dtype or value.shape != shape \
                    or value.is_cuda is not self.on_cuda or value.requires_grad:
                sources[:] = [None] * len(sources)
                return None
            sources[k] = value
            k += 1
        inputs_graph = self.inputs_graph
        if inputs_graph is not None and self._at(inputs_graph[1]):
            inputs_graph[0].replay()  # the copies inside: one launch
            for i in range(k):
                sources[i] = None
            self.stats.replays += 1
            return {name: out if dtype is None else out.to(dtype) for name, dtype, out in inputs_graph[2]}
        if k == 1:
            self.static_inputs[0].copy_(sources[0])
        else:
            torch._foreach_copy_(self.static_inputs, sources)
        graph.replay()
        # the GPU runs the graph from here on
        self.stats.replays += 1
        results = {name: static if dtype is None else static.to(dtype) for name, dtype, static in self.outputs}
        if self.captures_left:
            self._remember_addresses()
        for i in range(k):
            sources[i] = None  # no reference to a caller's tensor kept past the call
        return results

    def _at(self, addresses: list[int]) -> bool:
        """Whether this call's inputs are contiguous at `addresses` (no allocation: a call's check before its launch)."""
        i = 0
        for source in self.sources:
            if source.data_ptr() != addresses[i] or not source.is_contiguous():
                return False
            i += 1
        return True

    def _remember_addresses(self) -> None:
        """After the launch: inputs at the addresses of the last call's are captured with them (capture_inputs)."""
        last = self.last_addresses
        repeated = self._at(last)
        for i, source in enumerate(self.sources):
            last[i] = source.data_ptr()
        if not repeated:
            return
        self.captures_left -= 1
        captured = self.capture_inputs(list(self.sources))
        if captured is not None:
            graph, outputs = captured
            self.inputs_graph = (graph, list(last), tuple((name, dtype, out) for (name, dtype), out
                                                          in zip(self.output_casts, outputs)))
