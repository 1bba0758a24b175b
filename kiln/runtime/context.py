"""ExecutionContext: per-caller execution state over a shared engine (kiln/runtime/engine.py, which makes it and
imports this module: the engine is not imported back, tests/unit/test_layering.py); checks every binding, picks
the profile, pads to buckets, replays CUDA graphs, warms up, and takes the CPU's direct paths.
"""

from __future__ import annotations

import itertools
import math
import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kiln.errors import BindingError, EngineFormatError
from kiln.ir import dtypes
from kiln.plan.spec import Profile
from kiln.runtime.bindings import _check_value, _numpy_signature, _tensor_signature, _to_user
from kiln.runtime.buckets import PACKING, graph_rows, graph_token_buckets, packed_rows, packing_rule, plan_buckets
from kiln.runtime.cuda_graphs import MAX_GRAPHS, MEMORY_BUDGET, GraphRunner
from kiln.runtime.direct_run import torch_signature
from kiln.runtime.first_calls import WARM_UP_HOSTS, WARM_UP_S, host_sizes, primitives_made
from kiln.runtime.static_replay import StaticReplay

# run()'s direct replays (kiln/runtime/static_replay.py; a bucketed run's inputs written straight into its graph's,
# GraphRunner.replay_padded): on for CUDA contexts, off with the environment's KILN_DIRECT_REPLAY=0 (H200,
# bench/results/stream-2026-12-04c.md: the GPU tests of fixed-shape, bucketed and padding-free engines pass with them;
# batch-1 p99/p50 through run() 1.16 -> 1.09 BERT-base, 1.17 -> 1.07 ResNet-50, outputs bitwise the old path's)


class ExecutionContext:
    """Per-caller execution state over a shared engine; checks every binding before running."""

    def __init__(self, engine: Any, use_cuda_graphs: bool | None = None, buckets: bool | None = None,
                 max_graphs: int = MAX_GRAPHS, graph_memory_budget: int = MEMORY_BUDGET, packing: str = "auto",
                 pad_first_calls: bool | None = None, warm_up: bool = False):
        """`buckets`: pad dynamic dims to a few sizes where padding is exact (kiln/runtime/buckets.py);
        default on for CUDA graphs (a bounded number of graphs), off on the CPU (padding only costs
        there). `max_graphs`, `graph_memory_budget`: the CUDA graph cache's bounds (LRU). `packing`, for a
        padding-free engine: "auto" packs a run's real tokens where that pays (the device's
        buckets.PACKING_RULES; where CUDA graphs replay bucketed shapes, every run of 2K+ positions, at the
        profile's largest shape: buckets.graph_rows), "always" wherever a row is saved, "never" runs every position.
        A run that does not pack runs the engine's plain program (the plain engine's, kiln/builder/padding_free.py;
        its graphs in the same cache), or, in an engine without one, the packed program with every position a row
        (the identity packing).
        `pad_first_calls`: on the CPU without buckets, run a call at a shape not yet bound padded inside a bound
        one where padding is exact and costs less than binding (kiln/runtime/first_calls.py); default on, off with
        the environment's KILN_PAD_FIRST_CALLS=0 (and for a padding-free engine, whose runs pack their tokens).
        `warm_up`: run warm_up() before returning (at load, so a stream's first calls capture no graph)."""
        if packing not in PACKING:
            raise ValueError(f"packing={packing!r}: expected one of {PACKING}")
        self.engine = engine
        self.packing = packing
        self.profile = 0  # the optimization profile of the last run
        self.runner = None
        self._direct_replay = engine.device.type == "cuda" and os.environ.get("KILN_DIRECT_REPLAY", "1") != "0"
        self._inputs_in_graph = os.environ.get("KILN_REPLAY_CAPTURES_INPUTS") == "1"  # StaticReplay's capture_inputs
        if engine.device.type == "cuda":
            if use_cuda_graphs is None:
                use_cuda_graphs = engine.plan.header.get("build_config", {}).get("cuda_graphs", True)
            self.runner = GraphRunner(engine.program, use_graphs=use_cuda_graphs, max_graphs=max_graphs,
                                      memory_budget=graph_memory_budget, plain_inputs=self._direct_replay)
        if buckets is None:
            buckets = self.runner is not None and self.runner.use_graphs
        pad_dims = engine.plan.header.get("build_config", {}).get("pad_dims") or []
        self.buckets = plan_buckets(engine.inputs, engine.outputs, pad_dims) if buckets and engine.profiles else None
        # a padding-free engine: each run says how many rows it packs (a token bucket where shapes are bucketed)
        self._token_mask = _token_mask_position(engine)
        if self._token_mask is not None and self.buckets is not None and engine.plain_program is None:
            self.buckets.batch = None  # padded rows hold no real token: they cost nothing, so a batch never splits
        # (with a plain program, a run that does not pack may split its batch as the plain engine's would)
        self._graph_packing = self._graph_packing_rule()
        if self._graph_packing is not None:
            self.buckets.batch = None  # a run of graphs_from positions packs (no row of padding costs a GEMM row);
            # a smaller one costs the GPU about as much at its bucket as at its rows: no split either way
        self._static = _static_signature(engine) if self._token_mask is None else None
        self._whole_segment = _whole_segment(engine) if self._static is not None else None
        # CPU engines with symbolic dims: the input signatures already checked, so a call of one of them
        # skips the checks (a BERT at 7 tokens runs in ~0.1 ms of C; the checks were as much again)
        self._checked: dict[tuple, int] | None = {} if self._static is None and self.runner is None \
            and not engine.internal_dtype and self.buckets is None else None
        self._cuda_static = _cuda_static_signature(engine) if self.runner is not None and self.runner.use_graphs \
            and self._token_mask is None else None
        if pad_first_calls is None:
            pad_first_calls = os.environ.get("KILN_PAD_FIRST_CALLS", "1") != "0"
        self._first_calls = engine.first_calls if pad_first_calls and self.buckets is None and self.runner is None \
            and self._token_mask is None else None
        # numpy feeds of a bound shape of a one-segment program: one call of its compiled loop (direct_run.py); off
        # with the environment's KILN_DIRECT_RUN=0
        self._direct = engine.direct_runs if self._checked is not None and self._token_mask is None \
            and os.environ.get("KILN_DIRECT_RUN", "1") != "0" else None
        self._bucketed: dict[tuple, _BucketedRun] = {}  # bucketed runs: input signature -> what its shapes decide
        self._bound: dict[str, torch.Tensor] = {}  # set_tensor_address: caller-owned tensors by binding name
        self._io_graph: tuple[Any, dict[str, torch.Tensor]] | None = None  # execute()'s whole-call graph
        self.warmed_up: WarmUp | None = None  # the last warm_up()'s report
        self._static_replay: StaticReplay | None = None  # run()'s path once a fixed-shape engine's graph is captured
        self._token_buckets: dict[int, torch.Tensor] = {}  # a padding-free run's token bucket by rows (its shape)
        if warm_up:
            self.warm_up()

    def _graph_packing_rule(self):
        """The device's PackingRule where its graph_rows apply: a padding-free engine whose runs replay CUDA graphs
        of bucketed shapes, packing "auto" (kiln/runtime/buckets.py graph_rows); else None."""
        rule = packing_rule(self.engine.device)
        if self._token_mask is None or self.buckets is None or self.runner is None or not self.runner.use_graphs \
                or self.packing != "auto" or rule.graphs_from is None:
            return None
        return rule

    def set_tensor_address(self, name: str, tensor: torch.Tensor) -> None:
        """Bind a caller-owned tensor to an input or an output, as TensorRT's setTensorAddress does: execute()
        reads the inputs from and writes the outputs into the bound tensors, which must stay alive and in place
        (bind again to change one). Checked here: the binding exists, the dtype is the binding's, the shape fits
        the binding's fixed dims, the tensor is contiguous and on the engine's device."""
        binding = next((b for b in self.engine.inputs if b.name == name), None)
        label = f"input {name!r}"
        if binding is None:
            binding = next((b for b in self.engine.outputs if b.name == name), None)
            label = f"output {name!r}"
        if binding is None:
            raise BindingError(f"no input or output named {name!r}; the engine's inputs are {self.engine.input_names}, "
                               f"its outputs {self.engine.output_names}")
        if binding.kind != "tensor":
            raise BindingError(f"{label} is a {binding.kind}, not a tensor: run() takes and returns it")
        if type(tensor) is not torch.Tensor:
            raise BindingError(f"{label}: set_tensor_address takes a torch.Tensor, given {type(tensor).__name__}")
        _check_value(label, binding, tensor)
        problems = [p.outside({name: tuple(tensor.shape)}) for p in self.engine.profiles]
        if problems and all(problems):
            raise BindingError(f"{label}: shape {list(tensor.shape)} is outside every optimization profile: "
                               + "; ".join(problems))
        if tensor.device.type != self.engine.device.type:
            raise BindingError(f"{label}: the engine runs on {self.engine.device.type}, the tensor is on {tensor.device}")
        if not tensor.is_contiguous():
            raise BindingError(f"{label}: a bound tensor must be contiguous")
        self._bound[name] = tensor
        self._io_graph = None  # captured over the old addresses

    def execute(self) -> dict[str, torch.Tensor]:
        """Run on the bound tensors (set_tensor_address): every input must be bound; outputs that are bound are
        written there, the others come back as this context's buffers, overwritten by its next run. On the GPU the
        call is enqueued on the current stream, as run() is. A fixed-shape CUDA engine with CUDA graphs runs the
        whole call (input casts, network, output copies) as one captured graph, built at the first execute():
        a call is then one graph launch, with no Python per layer or per binding (a control loop's worst call
        is the GPU's own)."""
        graph = self._io_graph
        if graph is not None:
            graph[0].replay()
            return graph[1]
        missing = [n for n in self.engine.input_names if n not in self._bound]
        if missing:
            raise BindingError(f"execute(): input(s) {missing} not bound; bind each with set_tensor_address(name, tensor)")
        feeds = {n: self._bound[n] for n in self.engine.input_names}
        if self._cuda_static is not None:
            captured = self._capture_io_graph(feeds)
            if captured is not None:
                self._io_graph = captured
                captured[0].replay()
                return captured[1]
        results = self.run(feeds)
        outputs = {}
        for name, value in results.items():
            bound = self._bound.get(name)
            if bound is None:
                outputs[name] = value
                continue
            if tuple(value.shape) != tuple(bound.shape):
                raise BindingError(f"output {name!r}: the run produced shape {list(value.shape)}, the bound tensor "
                                   f"is {list(bound.shape)}")
            bound.copy_(value)
            outputs[name] = bound
        return outputs

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
        stream = torch.cuda.Stream()
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
        stream = torch.cuda.Stream()
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

    def _check(self, feeds: dict[str, Any]) -> None:
        expected = {b.name: b for b in self.engine.inputs}
        missing = [n for n in expected if n not in feeds]
        unknown = [n for n in feeds if n not in expected]
        if missing or unknown:
            parts = []
            if missing:
                parts.append(f"missing input(s) {missing}")
            if unknown:
                parts.append(f"unknown input(s) {unknown}")
            raise BindingError(f"{'; '.join(parts)}; the engine's inputs are {list(expected)}")
        symbols: dict[str, tuple[int, str]] = {}
        for name, binding in expected.items():
            value = feeds[name]
            if binding.kind != "tensor":
                continue
            if not isinstance(value, (np.ndarray, torch.Tensor)):
                value = np.asarray(value)
                feeds[name] = value
            _check_value(f"input {name!r}", binding, value, symbols)
        if self.engine.profiles:
            self.profile = self._select_profile(feeds)

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
        shapes = [dict(zip(symbols, values)) for values in itertools.product(*symbols.values())]
        stopped = "every shape run"
        if self._graph_packing is not None:
            runs = self._warm_up_graph_packing(plan, shapes)
        elif self._first_calls is None:
            for sizes in shapes:
                self.run(self._warm_up_feeds(plan, sizes))
            runs = len(shapes)
        else:
            runs, stopped = self._bind_hosts(plan, sorted(shapes, key=lambda sizes: math.prod(sizes.values())),
                                             start + seconds)
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize()
        else:  # and what the background thread makes ahead of new row counts (first_calls.primitives_ahead)
            primitives_made()
        bound = len(self._first_calls.bound) if self._first_calls is not None else 0
        self.warmed_up = WarmUp(runs, len(shapes), bound, time.perf_counter() - start, stopped)
        return runs

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
        if key not in self._checked and len(self._checked) < CHECKED_SIGNATURES:
            self._checked[key] = self.profile  # as _check set it for these shapes in the run just made
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

    def _select_profile(self, feeds: dict[str, Any]) -> int:
        """The first optimization profile holding every input's shape, or an error naming them all."""
        shapes = {name: tuple(v.shape) for name, v in feeds.items() if isinstance(v, (np.ndarray, torch.Tensor))}
        problems = []
        for k, profile in enumerate(self.engine.profiles):
            problem = profile.outside(shapes)
            if problem is None:
                return k
            problems.append(f"profile {k} ({profile.describe()}): {problem}")
        given = ", ".join(f"{n} {list(s)}" for n, s in shapes.items())
        raise BindingError(f"input shapes {given} are outside every optimization profile of this engine:\n  "
                           + "\n  ".join(problems) + "\nrebuild it with a --profile (profiles=[...]) that covers them")

    def run(self, feeds: dict[str, Any] | list[Any]) -> dict[str, Any]:
        if self._static_replay is not None and type(feeds) is dict:
            done = self._static_replay(feeds)
            if done is not None:
                return done
        if self._static is not None and type(feeds) is dict:
            done = self._run_static(feeds)
            if done is not None:
                return done
        if self._checked is not None and type(feeds) is dict:
            done = self._run_checked(feeds)
            if done is not None:
                return done
        if self._cuda_static is not None and type(feeds) is dict:
            done = self._replay_static(feeds)
            if done is not None:
                return done
        if not isinstance(feeds, dict):
            feeds = dict(zip(self.engine.input_names, feeds))
        else:
            feeds = dict(feeds)
        tokens = self._count_tokens(feeds)  # a host mask's real tokens (a CUDA mask's: counted if needed)
        signature = _tensor_signature(self.engine.input_names, feeds) if self.buckets is not None else None
        known = self._bucketed.get(signature) if signature is not None else None
        if known is None:
            self._check(feeds)
        else:  # these shapes and dtypes were checked by an earlier run
            self.profile = known.profile
        as_torch = any(isinstance(v, torch.Tensor) for v in feeds.values())
        args = self.engine.program_inputs(feeds)
        internal = self.engine.internal_dtype
        with torch.inference_mode():
            targets = None
            if self.buckets is not None:  # padded up to the run's buckets, cropped back after
                if known is None:
                    known = self._bucketed_run(args)
                    if signature is not None and len(self._bucketed) < CHECKED_SIGNATURES:
                        self._bucketed[signature] = known
                targets = known.targets
                packed = self._graph_packed(args, tokens, known)
                if packed is not None:  # the profile's largest shape, packed to a token bucket: one graph per bucket
                    rows, targets = packed
                else:
                    rows = self._packed_rows(args, tokens, targets)
                chunks = self.buckets.split(targets) if rows is None else None  # a packed run is one
                if chunks is not None:
                    results = self._run_chunks(args, targets, chunks)
                else:
                    results = self._replay_padded(args, rows, targets) if self._direct_replay else None
                    if results is None:  # padded, then run (the first runs at a bucket record and capture)
                        args = self.buckets.pad(args, targets)
                        captured = self.runner.stats.captures if self.runner is not None else 0
                        results = self._run_program(args, rows)
                        if rows is None and self.runner is not None and self.runner.stats.captures != captured:
                            # timed at its capture
                            plain = self.engine.plain_program if self._token_mask is not None else None
                            self.buckets.learn(targets, self.runner.replay_ms(args) if plain is None
                                               else self.runner.replay_ms(args, plain))
                    results = self.buckets.crop(results, targets)
            else:
                results = self._run_program(args, self._packed_rows(args, tokens))
        if internal:
            results = [r.to(dtypes.BY_NAME[b.dtype].torch) if b.dtype in internal and isinstance(r, torch.Tensor)
                       else r for r, b in zip(results, self.engine.outputs)]
        if self._checked is not None:
            key = _numpy_signature(self.engine.input_names, feeds)
            if key is not None and len(self._checked) < CHECKED_SIGNATURES:
                self._checked[key] = self.profile
        return {b.name: _to_user(v, as_torch) for b, v in zip(self.engine.outputs, results)}

    def _run_program(self, args: list[Any], rows: int | None = None) -> list[Any]:
        """Run the engine's program on `args`; for a padding-free engine (_packed_rows), `rows` packed rows: its
        packed program, the token bucket of that many rows appended (its last input, kiln/passes/remove_padding.py),
        or None: its plain program."""
        program = None
        if rows is not None:
            args = [*args, self._token_bucket(rows, args[self._token_mask].device)]
        elif self._token_mask is not None:
            program = self.engine.plain_program
        if self.runner is not None:
            return self.runner.run(args) if program is None else self.runner.run(args, program)
        if program is not None:
            return program.run(args)
        if self._first_calls is not None:
            return self._first_calls.run(args)
        return self.engine.program.run(args)

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

    def _token_bucket(self, rows: int, device: torch.device) -> torch.Tensor:
        """A padding-free program's last input: `rows` bytes, read for its shape alone, made once per row count."""
        bucket = self._token_buckets.get(rows)
        if bucket is None or bucket.device != device:
            if len(self._token_buckets) >= CHECKED_SIGNATURES:
                self._token_buckets.clear()
            bucket = self._token_buckets[rows] = torch.empty(rows, dtype=torch.uint8, device=device)
        return bucket

    def _packed_rows(self, args: list[Any], tokens: int | None = None,
                     targets: dict[str, tuple[int, int]] | None = None) -> int | None:
        """For a padding-free engine, the rows this run packs its tokens to (their token bucket where shapes are
        bucketed: `targets`, the buckets the run pads to), or None where it runs the plain program: where the run
        would take the identity packing (every position a row: packing does not pay, kiln/runtime/buckets.py
        packed_rows) and the engine carries that program (kiln/builder/padding_free.py). None for other engines.
        `tokens`: the mask's real tokens if counted on the host already."""
        if self._token_mask is None:
            return None
        mask = args[self._token_mask]
        positions = mask.numel() if targets is None else self._positions(mask, targets)
        rows = packed_rows(mask, tokens, self.buckets is not None, self.packing, positions)
        return None if rows == positions and self.engine.plain_program is not None else rows

    def _bucketed_run(self, args: list[Any]) -> _BucketedRun:
        """What a bucketed run derives from its inputs' shapes alone (the profile is self.profile, selected)."""
        profile, names = self.engine.profiles[self.profile], self.engine.input_names
        targets = self.buckets.targets(args, profile, names)
        if self._graph_packing is None:
            return _BucketedRun(self.profile, targets)
        mask = args[self._token_mask]
        widest = self.buckets.targets(args, profile, names, widest=True)
        return _BucketedRun(self.profile, targets, self._positions(mask, targets), widest,
                            self._positions(mask, widest))

    def _graph_packed(self, args: list[Any], tokens: int | None,
                      known: _BucketedRun) -> tuple[int | None, dict[str, tuple[int, int]]] | None:
        """graph_rows' choice for a run of a context that packs by it (_graph_packing): (the rows it packs to, or
        None for the plain program; the targets it pads to). At least graphs_from bucketed positions: the rows of
        its token bucket at the profile's largest shape (the plain program there where they would be every
        position); below: the plain program at its bucket, no token count. None for other contexts, and below
        graphs_from in an engine without a plain program (_packed_rows decides). Counting a CUDA mask's tokens is
        the run's one synchronization with the host."""
        rule = self._graph_packing
        if rule is None:
            return None
        if known.positions < rule.graphs_from:
            return (None, known.targets) if self.engine.plain_program is not None else None
        mask = args[self._token_mask]
        rows = graph_rows(int(torch.count_nonzero(mask)) if tokens is None else tokens, known.most, rule)
        return (None if rows == known.most and self.engine.plain_program is not None else rows), known.widest

    def _positions(self, mask: torch.Tensor, targets: dict[str, tuple[int, int]]) -> int:
        """B·S of the padding mask padded to `targets`."""
        shape = list(mask.shape)
        for axis, symbol in self.buckets.pads[self._token_mask]:
            shape[axis] = targets[symbol][1]
        return math.prod(shape)

    def _count_tokens(self, feeds: dict[str, Any]) -> int | None:
        """A padding-free engine's real tokens where they are on the host (a numpy mask, a CPU tensor): counted
        here, no device sync. A CUDA mask's: None, counted by packed_rows where the decision needs them (a run of
        PACK_MIN_SAVING's positions or more): the run's one synchronization with the host, ~70 µs of a run on the
        H200. Counting it asynchronously (a non-blocking copy into pinned memory, an event read at the decision)
        was measured slower still (bench/results/padding-free-plain-2026-12-02.md, run 2): the host work between
        the count and the decision is shorter than the round trip, and the copy and the event cost host time of
        their own, which a run of a CUDA graph adds to its latency as it is."""
        if self._token_mask is None or self.packing == "never":
            return None
        value = feeds.get(self.engine.input_names[self._token_mask])
        if isinstance(value, np.ndarray):
            return int(np.count_nonzero(value))
        if isinstance(value, torch.Tensor) and not value.is_cuda and self.engine.device.type == "cuda":
            return int(torch.count_nonzero(value))  # on its way to the device: counted where it is
        return None

    def _host_tokens(self, feeds: dict[str, Any]) -> int | None:
        """The real tokens of a padding mask fed as a host array, counted there (no device sync); else None."""
        value = feeds.get(self.engine.input_names[self._token_mask]) if self._token_mask is not None else None
        return int(np.count_nonzero(value)) if isinstance(value, np.ndarray) else None

    def _run_chunks(self, args: list[Any], targets: dict[str, tuple[int, int]],
                    chunks: list[tuple[int, int]]) -> list[Any]:
        """The batch's rows as bucket-sized chunks, one padded run each, every chunk's outputs copied
        into its rows of fresh outputs before the next run (a run's outputs live in its graph's or
        arena's memory). Exact as batch padding is: rows of a batch never meet."""
        batch = self.buckets.batch
        carries = [any(symbol == batch for _, symbol in pads) for pads in self.buckets.pads]
        real = targets[batch][0]
        outputs: list[Any] = []
        start = 0
        for rows, bucket in chunks:
            chunk = [x.narrow(0, start, rows) if c else x for x, c in zip(args, carries)]
            sizes = {**targets, batch: (rows, bucket)}
            results = self.buckets.crop(self._run_program(self.buckets.pad(chunk, sizes)), sizes)  # plain runs
            if not outputs:
                outputs = [r.new_empty((real, *r.shape[1:])) for r in results]
            for out, r in zip(outputs, results):
                out.narrow(0, start, rows).copy_(r)
            start += rows
        if self.runner is not None:
            self.runner.stats.split_runs += 1
        return outputs

    def _run_checked(self, feeds: dict[str, Any]) -> dict[str, Any] | None:
        """A CPU engine fed numpy arrays (C-contiguous, writable, of numpy's own dtypes): checked once per
        signature (remembered), then straight to the program. Else None: the general path."""
        names = self.engine.input_names
        key = _numpy_signature(names, feeds)
        if key is None:
            return None
        profile = self._checked.get(key)
        if profile is None:  # a new signature: checked here (errors as the general path raises them), then run
            self._check(feeds)  # as a checked one (the general path's conversions give the same tensors for these)
            profile = self.profile
            if len(self._checked) < CHECKED_SIGNATURES:
                self._checked[key] = profile
        self.profile = profile
        if self._direct is not None:
            results = self._run_direct([feeds[n] for n in names])
            if results is not None:
                return {b.name: v for b, v in zip(self.engine.outputs, results)}
        args = [torch.from_numpy(feeds[n]) for n in names]
        with torch.inference_mode():
            results = self._run_program(args, self._packed_rows(args, self._host_tokens(feeds)))
        return {b.name: _to_user(v, False) for b, v in zip(self.engine.outputs, results)}

    def _run_direct(self, arrays: list[np.ndarray]) -> list[np.ndarray] | None:
        """Checked numpy inputs of a bound shape (or, padding first calls, of a new one a bound shape hosts) as one
        call of the segment's compiled loop (kiln/runtime/direct_run.py); None: the general path."""
        signature = torch_signature(arrays)
        if signature is None:
            return None
        if self._first_calls is not None:
            return self._first_calls.run_direct(arrays, signature, self._direct)
        record = self._direct.find(signature)
        return record.run(arrays) if record is not None else None

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

    def _run_static(self, feeds: dict[str, Any]) -> dict[str, Any] | None:
        """The common case in a few lines: a CPU engine of fixed input shapes fed exactly those, as
        C-contiguous writable numpy arrays of the bound dtypes. After a large network each line of
        Python runs from cold caches (~0.2 ms for ResNet-50's general path); anything else returns
        None and takes the general path, which checks and explains."""
        names, signature, outputs = self._static
        if len(feeds) != len(names):
            return None
        arrays = []
        for name, (dtype, shape) in zip(names, signature):
            value = feeds.get(name)
            if (type(value) is not np.ndarray or value.dtype != dtype or value.shape != shape
                    or not value.flags.c_contiguous or not value.flags.writeable):
                return None
            arrays.append(value)
        whole = self._whole_segment
        if whole is not None:  # the program is one native segment: numpy in, numpy out, no torch call
            results = whole.run_numpy(arrays)
            if results is not None:
                return {b.name: r for b, r in zip(outputs, results)}
        args = [torch.from_numpy(a) for a in arrays]
        with torch.inference_mode():
            results = self.engine.program.run(args)
        return {b.name: _to_user(v, False) for b, v in zip(outputs, results)}  # real dtypes: one .numpy() each


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

CHECKED_SIGNATURES = 4096  # input signatures a CPU context remembers as checked (a few hundred bytes each)


@dataclass(frozen=True)
class _BucketedRun:
    """What a bucketed context derives from a signature of input shapes, remembered per signature: a run of known
    shapes skips the binding checks and the bucket arithmetic: host work before the replay, which a CUDA run's GPU
    waits for (BERT-base's stream on the H200: the GPU idle 0.14-0.23 ms a call before, 0.11-0.16 after, medians;
    bench/results/stream-2026-12-04.md)."""
    profile: int
    targets: dict[str, tuple[int, int]]  # symbol -> (real size, bucket size)
    positions: int = 0  # graph packing (_graph_packing): B·S of the mask padded to `targets`
    widest: dict[str, tuple[int, int]] | None = None  # graph packing: the targets at the profile's largest shape
    most: int = 0  # graph packing: B·S of the mask there


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


def _static_signature(engine: Any) -> tuple | None:
    """(input names, [(numpy dtype, shape)], output bindings) of a CPU engine whose inputs are all
    tensors of fixed shapes and numpy-native dtypes, run without boundary casts; else None."""
    if engine.device.type != "cpu" or engine.internal_dtype:
        return None
    signature = []
    for b in engine.inputs:
        dt = dtypes.BY_NAME.get(b.dtype) if b.dtype else None
        if (b.kind != "tensor" or b.shape is None or not all(isinstance(d, int) for d in b.shape) or dt is None
                or dt.torch not in dtypes.NUMPY_REAL):
            return None
        signature.append((np.dtype(dt.numpy), tuple(b.shape)))
    return [b.name for b in engine.inputs], signature, list(engine.outputs)


def _token_mask_position(engine: Any) -> int | None:
    """The padding mask's position among a padding-free engine's inputs (None for other engines); its program
    takes one input more, last: the token bucket (kiln/passes/remove_padding.py)."""
    removal = engine.plan.header.get("remove_padding")
    if not removal:
        return None
    program_inputs = engine.plan.program.inputs
    if not program_inputs or program_inputs[-1] != removal["bucket_input"] or removal["mask"] not in engine.input_names:
        raise EngineFormatError(f"a padding-free engine's program must take the token bucket "
                                f"{removal['bucket_input']!r} last and the mask {removal['mask']!r} as an input; "
                                f"its inputs are {program_inputs}: rebuild it")
    return engine.input_names.index(removal["mask"])


def _whole_segment(engine: Any):
    """The program's one step when it is a native segment reading the inputs and writing the
    outputs, in their order (kiln/runtime/native.py); else None."""
    program = engine.program
    if len(program.run_steps) != 1 or len(program.segments) != 1:
        return None
    segment = program.segments[0]
    if segment.entries != program.input_slots or segment.exits != program.output_slots:
        return None
    return segment
