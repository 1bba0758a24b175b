"""ExecutionContext.warm_up (kiln/runtime/context.py): a run at every bucket of a profile, so that a stream of
requests meets no first call (on CUDA each run captures its graph); on the CPU with padded first calls, the host
sizes bound, smallest first, while padding a call into one costs less than binding its shape would
(kiln/runtime/first_calls.py). WarmUp says what it did.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass

import torch

from kiln.ir import dtypes
from kiln.plan.spec import Profile
from kiln.runtime.bindings import _numpy_signature
from kiln.runtime.buckets import graph_token_buckets
from kiln.runtime.direct_run import torch_signature
from kiln.runtime.first_calls import WARM_UP_HOSTS, WARM_UP_S, host_sizes, primitives_made


HOSTS_UP_TO = 4  # warm_up binds buckets as hosts while a run takes at most this many times binding's cost
BUDGET_FROM = 3  # ... binding's cost once this many are measured (their median)


@dataclass(frozen=True)
class WarmUp:
    """What ExecutionContext.warm_up did: runs, the shapes it could run (buckets or hosts), the shapes the engine
    holds bound after it (padded first calls; 0 otherwise), seconds (wall clock) and why it stopped."""

    runs: int
    shapes: int
    bound: int
    seconds: float
    stopped: str

    def describe(self) -> str:
        return (f"warm-up: {self.runs} runs of {self.shapes} shapes, {self.bound} bound, {self.seconds:.2f} s "
                f"({self.stopped})")


class WarmingUp:
    """ExecutionContext's warm-up, a mixin of it: it runs through the context's run() and reads what its __init__ set
    (engine, buckets, _first_calls, _graph_packing, _token_mask, _checked, _direct, profile)."""

    def warm_up(self, profile: int = 0, seconds: float = WARM_UP_S) -> int:
        """Run once at every bucket of a profile (every combination of the padded dims' sizes), so a
        stream of requests meets no first call: on CUDA each run captures its graph. Returns the
        number of runs. Without buckets: one run at the profile's opt shape. With padded first calls on the CPU
        (kiln/runtime/first_calls.py), two runs at each host size (first_calls.host_sizes: at most 25% padding
        along each dim), smallest work first: each is then bound, a host a new shape may run padded in, its time and
        what binding it cost measured; up to the first whose run takes longer than HOSTS_UP_TO times binding
        (padding in a larger one would cost more than binding: BERT-base's past ~2 x 32 at one thread), at most
        WARM_UP_HOSTS shapes and `seconds` of wall clock (bert_tiny's 192 shapes of 8 x 128: ~0.4-0.6 s).
        `self.warmed_up` says what it did. On the CPU it returns once the oneDNN primitives of the profiles' row
        counts are made (BERT-base: ~1-1.5 s after load, on another thread)."""
        plan = self.engine.profiles[profile] if self.engine.profiles else None
        if plan is None:
            return 0
        start = time.perf_counter()
        shapes = self._warm_up_shapes(plan)
        stopped = "every shape run"
        if self._graph_packing is not None:
            runs = self._warm_up_graph_packing(plan, shapes)
        elif self._first_calls is None:
            largest: dict[tuple[str, str], int] = {}  # host staging: the most bytes each binding met
            for sizes in shapes:
                feeds = self._warm_up_feeds(plan, sizes)
                outputs = self.run(feeds)
                if self._host_staging is not None:
                    for kind, values in (("input", feeds), ("output", outputs)):
                        for name, v in values.items():
                            if isinstance(v, torch.Tensor):
                                key = (kind, name)
                                largest[key] = max(largest.get(key, 0), v.numel() * v.element_size())
            if self._host_staging is not None:  # each buffer made once, at its largest (kiln/runtime/host_staging.py)
                for (kind, name), nbytes in largest.items():
                    self._host_staging.reserve(kind, name, nbytes)
            runs = len(shapes)
        else:
            # The load's background jobs first (the view's template grown to the profile's largest, its walk traced):
            # a host bound before them paid their one-time work in its binding (llama_tiny: 5-11 ms measured against
            # ~0.1-0.3 ms after), which became the padding budget: later first calls then ran padded in hosts
            # up to 8x64 (~4 ms) instead of binding (bench/results/llama-cpu-2026-12-07.md).
            primitives_made(seconds)
            runs, stopped = self._bind_hosts(plan, sorted(shapes, key=lambda sizes: math.prod(sizes.values())),
                                             time.perf_counter() + seconds)
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize()
        else:  # and what the background thread makes ahead of new row counts (first_calls.primitives_ahead)
            primitives_made()
        bound = len(self._first_calls.bound) if self._first_calls is not None else 0
        self.warmed_up = WarmUp(runs, len(shapes), bound, time.perf_counter() - start, stopped)
        return runs

    def _warm_up_shapes(self, plan: Profile) -> list[dict[str, int]]:
        """The sizes of every symbolic dim warm_up runs at `plan`: each combination of the buckets' sizes (the CPU's
        hosts with padded first calls), the opt size of a dim not padded."""
        symbols: dict[str, list[int]] = {}
        ladder = self.buckets if self.buckets is not None else getattr(self._first_calls, "buckets", None)
        hosts = self.buckets is None and self._first_calls is not None  # the CPU's ladder of hosts
        for b in self.engine.inputs:
            r = plan.inputs.get(b.name)
            for axis, d in enumerate(b.shape or []):
                if isinstance(d, str) and r is not None and d not in symbols:
                    if ladder is not None and d in ladder.symbols:
                        symbols[d] = self._host_sizes(d, r.min[axis], r.max[axis]) if hosts \
                            else ladder.sizes(d, r.min[axis], r.max[axis])
                    else:
                        symbols[d] = [r.opt[axis]]
        return [dict(zip(symbols, values)) for values in itertools.product(*symbols.values())]

    def bucket_graphs(self, profile: int = 0) -> int:
        """How many bucketed signatures warm_up(profile) runs, each a CUDA graph where graphs replay: every
        combination of the buckets' sizes; a context packing by graph_rows, its plain buckets below graphs_from
        positions, a packed one per token bucket and the plain largest shape (_warm_up_graph_packing)."""
        plan = self.engine.profiles[profile] if self.engine.profiles else None
        if plan is None or self.buckets is None:
            return 0
        shapes = self._warm_up_shapes(plan)
        if self._graph_packing is None:
            return len(shapes)
        mask_symbols = [d for d in self.engine.inputs[self._token_mask].shape if isinstance(d, str)]
        small = sum(1 for sizes in shapes if math.prod(sizes.get(d, 1) for d in mask_symbols)
                    < self._graph_packing.graphs_from)
        most = math.prod(max(sizes.get(d, 1) for sizes in shapes) for d in mask_symbols)
        return small + len(graph_token_buckets(most, self._graph_packing)) + 1

    def _host_sizes(self, symbol: str, low: int, high: int) -> list[int]:
        """The sizes of `symbol` a CPU warm-up binds as hosts of first calls (first_calls.host_sizes)."""
        return host_sizes(low, high)

    def _warm_up_graph_packing(self, plan: Profile, shapes: list[dict[str, int]]) -> int:
        """Every graph a context packing by graph_rows replays: the plain program's at each bucket below
        graphs_from positions, the packed program's at the profile's largest shape for each token bucket (a mask
        of exactly that many real tokens), and the plain program's there (a mask of ones). Returns the runs."""
        mask_name = self.engine.input_names[self._token_mask]
        mask_symbols = [d for d in self.engine.inputs[self._token_mask].shape if isinstance(d, str)]
        small = [sizes for sizes in shapes if math.prod(sizes.get(d, 1) for d in mask_symbols)
                 < self._graph_packing.graphs_from]
        for sizes in small:
            self.run(self._warm_up_feeds(plan, sizes))
        largest = self._warm_up_feeds(plan, {d: max(sizes[d] for sizes in shapes) for d in shapes[0]})
        mask = largest[mask_name]
        for rows in graph_token_buckets(mask.numel(), self._graph_packing):
            mask.zero_()
            mask.view(-1)[:rows] = 1  # exactly `rows` real tokens: their own token bucket
            self.run(largest)
        mask.fill_(1)
        self.run(largest)
        return len(small) + len(graph_token_buckets(mask.numel(), self._graph_packing)) + 1

    def _bind_hosts(self, plan: Profile, shapes: list[dict[str, int]], deadline: float) -> tuple[int, str]:
        """Each shape (by work, ascending: none is then padded in an earlier one) run twice, bound and timed, until
        one's repeat takes longer than HOSTS_UP_TO times binding (once BUDGET_FROM bindings are measured),
        WARM_UP_HOSTS are bound or the clock passes `deadline` (perf_counter). Returns the runs and why it stopped."""
        runs = 0
        for k, sizes in enumerate(shapes):
            if k >= WARM_UP_HOSTS:
                return runs, f"WARM_UP_HOSTS ({WARM_UP_HOSTS}) bound"
            if time.perf_counter() > deadline:
                return runs, "out of time"
            feeds = self._warm_up_feeds(plan, sizes)
            self.run(feeds)
            start = time.thread_time_ns()
            self.run(feeds)
            runs += 2
            self._ready_for_numpy(feeds)
            ms = (time.thread_time_ns() - start) / 1e6
            measured = len(self._first_calls.bind_ms) >= BUDGET_FROM  # one sample may be 0: a repeat slower
            if measured and ms > HOSTS_UP_TO * self._first_calls.budget_ms():  # than its first call
                return runs, f"a run at {sizes} took over HOSTS_UP_TO x binding"
        return runs, "every shape run"

    def _ready_for_numpy(self, feeds: dict[str, torch.Tensor]) -> None:
        """A bound host as a stream's numpy calls meet it: its numpy signature checked (the profile its run selected)
        and its direct run made (kiln/runtime/direct_run.py), here rather than at the stream's first call of that
        shape (~13 + ~22 µs of a ~120-200 µs bert_tiny call, load 6)."""
        if self._checked is None:
            return
        arrays = {name: v.numpy() for name, v in feeds.items()}  # CPU tensors: numpy views of them
        key = _numpy_signature(self.engine.input_names, arrays)
        if key is None:
            return
        if key not in self._checked:
            self._remember_checked(key)  # at the profile _check selected for these shapes in the run just made
        if self._direct is not None:
            signature = torch_signature([arrays[name] for name in self.engine.input_names])
            if signature is not None:
                self._direct.find(signature)

    def _warm_up_feeds(self, plan: Profile, sizes: dict[str, int]) -> dict[str, torch.Tensor]:
        """Inputs of the symbols' `sizes` (other dims at the profile's opt): zeros, masks of ones."""
        feeds = {}
        for b in self.engine.inputs:
            r = plan.inputs.get(b.name)
            shape = [sizes[d] if isinstance(d, str) and d in sizes else (r.opt[axis] if r else d)
                     for axis, d in enumerate(b.shape or [])]
            dt = dtypes.BY_NAME[b.dtype or "float"].torch
            fill = 1 if "mask" in b.name.lower() else 0  # a mask keeps every token: no empty row
            feeds[b.name] = torch.full(shape, fill, dtype=dt, device=self.engine.device)
        return feeds
