"""ExecutionContext: per-caller execution state over a shared engine (kiln/runtime/engine.py, which makes it and
imports this module: the engine is not imported back, tests/unit/test_layering.py); checks every binding, picks
the profile, pads to buckets, packs a padding-free engine's tokens and runs the program. Its mixins, a module each:
the CUDA graph paths (graph_paths.py), the CPU's direct paths (cpu_paths.py) and the warm-up (warm_up.py).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kiln.errors import BindingError, EngineFormatError
from kiln.kernels.cpu import omp_governor
from kiln.ir import dtypes
from kiln.runtime.bindings import NumpyCheck, _check_value, _numpy_signature, _tensor_signature, _to_user
from kiln.runtime.buckets import BATCH_STEPS, PACKING, graph_rows, packed_rows, packing_rule, plan_buckets
from kiln.runtime.cpu_paths import CheckedSignature, CpuPaths, _static_signature, _tiny_calls
from kiln.runtime.cuda_graphs import MAX_GRAPHS, MEMORY_BUDGET, GraphRunner
from kiln.runtime.direct_run import StaticRun
from kiln.runtime.graph_paths import GraphPaths, _cuda_static_signature
from kiln.runtime.host_staging import HostStaging, staging_mode
from kiln.runtime.static_replay import StaticReplay
from kiln.runtime.warm_up import WarmingUp, WarmUp

log = logging.getLogger(__name__)

# run()'s direct replays (kiln/runtime/static_replay.py; a bucketed run's inputs written straight into its graph's,
# GraphRunner.replay_padded): on for CUDA contexts, off with the environment's KILN_DIRECT_REPLAY=0 (H200,
# bench/results/stream-2026-12-04c.md: the GPU tests of fixed-shape, bucketed and padding-free engines pass with them;
# batch-1 p99/p50 through run() 1.16 -> 1.09 BERT-base, 1.17 -> 1.07 ResNet-50, outputs bitwise the old path's)


class ExecutionContext(WarmingUp, CpuPaths, GraphPaths):
    """Per-caller execution state over a shared engine; checks every binding before running."""

    def __init__(self, engine: Any, use_cuda_graphs: bool | None = None, buckets: bool | None = None,
                 max_graphs: int = MAX_GRAPHS, graph_memory_budget: int = MEMORY_BUDGET, packing: str = "auto",
                 pad_first_calls: bool | None = None, warm_up: bool = False, host_staging: str | bool | None = None,
                 batch_buckets: str | None = None):
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
        `warm_up`: run warm_up() before returning (at load, so a stream's first calls capture no graph).
        `host_staging`, for a CUDA engine: a numpy call's inputs and outputs through pinned buffers of this context,
        one wait per call with the GIL released (kiln/runtime/host_staging.py): "copy" (outputs fresh arrays, as
        before), "pinned" (outputs over pinned blocks of torch's host cache), "off" (pageable copies, as before);
        default the environment's KILN_HOST_STAGING, else "pinned". Ignored on the CPU.
        `batch_buckets`, with buckets: "pow2" (a batch pads to powers of two) or "half" (also 12, 24, 48, ...: a 1.5x
        step from 8; more graphs, less padding: kiln/runtime/buckets.py); default the environment's
        KILN_BATCH_BUCKETS, else "pow2"."""
        if packing not in PACKING:
            raise ValueError(f"packing={packing!r}: expected one of {PACKING}")
        if batch_buckets is None:
            batch_buckets = os.environ.get("KILN_BATCH_BUCKETS") or "pow2"
        if batch_buckets not in BATCH_STEPS:
            raise ValueError(f"batch_buckets={batch_buckets!r}: expected one of {BATCH_STEPS}")
        self.engine = engine
        # libgomp's wait per call: spin while a run is in progress, park after it (kiln/kernels/cpu/omp_governor.py)
        self._omp = omp_governor.governor() if engine.device.type == "cpu" else None
        # the programs it runs: on the CPU a lane of the engine's, its own while it lives (activation arenas of its
        # own: contexts on threads of their own compute at once); on CUDA the engine's, each context its own graphs
        lane = engine.lend_lane(self) if engine.device.type == "cpu" else None
        self.program = lane.program if lane is not None else engine.program
        self.plain_program = lane.plain_program if lane is not None else engine.plain_program
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
        if self.buckets is not None:
            self.buckets.batch_steps = batch_buckets
        # a padding-free engine: each run says how many rows it packs (a token bucket where shapes are bucketed)
        self._token_mask = _token_mask_position(engine)
        if self._token_mask is not None and self.buckets is not None and self.plain_program is None:
            self.buckets.batch = None  # padded rows hold no real token: they cost nothing, so a batch never splits
        # (with a plain program, a run that does not pack may split its batch as the plain engine's would)
        self._graph_packing = self._graph_packing_rule()
        if self._graph_packing is not None:
            self.buckets.batch = None  # a run of graphs_from positions packs (no row of padding costs a GEMM row);
            # a smaller one costs the GPU about as much at its bucket as at its rows: no split either way
        if self.buckets is not None and batch_buckets == "half":
            # half steps only where every profile's buckets fit the graph cache: past it, a stream over the profile
            # would evict and capture again (BERT 1..32 x 1..512: 80 buckets, 71 padding-free, for 64 graphs)
            most = max(self.bucket_graphs(k) for k in range(len(engine.profiles)))
            if most > max_graphs:
                self.buckets.batch_steps = "pow2"
                log.info("batch_buckets 'half': %d bucketed shapes would pass the %d graphs a context keeps; the "
                         "batch buckets stay powers of two (%d shapes)", most, max_graphs,
                         max(self.bucket_graphs(k) for k in range(len(engine.profiles))))
        self._static = _static_signature(engine) if self._token_mask is None else None
        # a fixed-shape program that is one native segment: numpy in, numpy out (direct_run.py StaticRun)
        self._whole_segment = StaticRun.of(self.program, self._static[1]) if self._static is not None else None
        self._output_names = engine.output_names
        self._input_names = engine.input_names  # (Engine.input_names makes its list per call)
        # CPU engines with symbolic dims: the input signatures already checked, so a call of one of them
        # skips the checks (a BERT at 7 tokens runs in ~0.1 ms of C; the checks were as much again); the engine's,
        # shared by its contexts (Engine.checked_signatures: a signature's check is its own, whichever context ran it)
        self._checked: dict[tuple, CheckedSignature] | None = engine.checked_signatures if self._static is None \
            and self.runner is None and not engine.internal_dtype and self.buckets is None else None
        self._numpy_check = NumpyCheck.of(engine.inputs, engine.profiles) if self._checked is not None else None
        self._cuda_static = _cuda_static_signature(engine) if self.runner is not None and self.runner.use_graphs \
            and self._token_mask is None else None
        if pad_first_calls is None:
            pad_first_calls = os.environ.get("KILN_PAD_FIRST_CALLS", "1") != "0"
        self._first_calls = lane.first_calls if pad_first_calls and self.buckets is None and self.runner is None \
            and self._token_mask is None else None
        # numpy feeds of a bound shape of a one-segment program: one call of its compiled loop (direct_run.py); off
        # with the environment's KILN_DIRECT_RUN=0
        self._direct = lane.direct_runs if self._checked is not None and self._token_mask is None \
            and os.environ.get("KILN_DIRECT_RUN", "1") != "0" else None
        if self._omp is not None and _tiny_calls(engine, self._whole_segment, self._direct):
            self._omp = None  # every call one tiny segment's run: no parallel region to govern (Segment.tiny)
        self._bucketed: dict[tuple, _BucketedRun] = {}  # bucketed runs: input signature -> what its shapes decide
        self._bound: dict[str, torch.Tensor] = {}  # set_tensor_address: caller-owned tensors by binding name
        self._io_graph: tuple[Any, dict[str, torch.Tensor]] | None = None  # execute()'s whole-call graph
        self._into: dict[int, torch.Tensor] | None = None  # during execute() on the CPU: bound outputs by output slot
        self.warmed_up: WarmUp | None = None  # the last warm_up()'s report
        self._static_replay: StaticReplay | None = None  # run()'s path once a fixed-shape engine's graph is captured
        self._token_buckets: dict[int, torch.Tensor] = {}  # a padding-free run's token bucket by rows (its shape)
        self._host_staging: HostStaging | None = None  # numpy calls on CUDA through pinned buffers (host_staging.py)
        self._staging_kept: HostStaging | None = None  # its buffers, kept while staging is switched off
        self.host_staging = host_staging
        if warm_up:
            self.warm_up()

    @property
    def host_staging(self) -> str:
        """How a numpy call's inputs and outputs cross to and from the GPU: "off", "copy" or "pinned"
        (kiln/runtime/host_staging.py)."""
        return self._host_staging.mode if self._host_staging is not None else "off"

    @host_staging.setter
    def host_staging(self, mode: str | bool | None) -> None:
        mode = staging_mode(mode)
        if mode == "off" or self.engine.device.type != "cuda":  # a CPU engine's numpy feeds are its own memory
            self._host_staging = None  # (its buffers kept for a later switch back on: self._staging_kept)
            return
        kept = self._staging_kept
        if kept is None:
            kept = self._staging_kept = HostStaging(self.engine.device, mode)
        kept.mode = mode
        self._host_staging = kept

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
        written there (on the CPU in place where the layer computing one can write it, _outputs_into; else copied
        after the run), the others come back as this context's buffers, overwritten by its next run. On the GPU the
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
        self._into = self._outputs_into() if self.engine.device.type == "cpu" else None
        try:
            results = self.run(feeds)
        finally:
            self._into = None
        outputs = {}
        for name, value in results.items():
            bound = self._bound.get(name)
            if bound is None:
                outputs[name] = value
                continue
            if tuple(value.shape) != tuple(bound.shape):
                raise BindingError(f"output {name!r}: the run produced shape {list(value.shape)}, the bound tensor "
                                   f"is {list(bound.shape)}")
            if value.data_ptr() != bound.data_ptr() or value.dtype != bound.dtype or value.stride() != bound.stride():
                bound.copy_(value)  # (else the run wrote it there: Program.run's `into`)
            outputs[name] = bound
        return outputs

    def _outputs_into(self) -> dict[int, torch.Tensor] | None:
        """The bound outputs a CPU run may write in place (Program.run's `into`, by output slot): each whose memory
        no other bound tensor shares (an input the run still reads, another output), of an engine without boundary
        casts or buckets (a padded run's outputs are crops). The program's step that computes one writes it where it
        can; execute() copies the others."""
        if not self._bound or self.engine.internal_dtype or self.buckets is not None:
            return None
        spans = {name: (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for name, t in self._bound.items()}
        into = {}
        for binding, slot in zip(self.engine.outputs, self.program.output_slots):
            span = spans.get(binding.name)
            if span is not None and span[0] < span[1] and not any(
                    other != binding.name and lo < span[1] and span[0] < hi for other, (lo, hi) in spans.items()):
                into[slot] = self._bound[binding.name]
        return into or None

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

    def _remember_checked(self, key: tuple) -> CheckedSignature:
        """A numpy signature `key` as checked, for every CPU context of the engine (Engine.checked_signatures), at
        the profile of this context's last check (CHECKED_SIGNATURES at most: a signature past them is checked at each
        call). Its CheckedSignature, remembered or not."""
        checked = CheckedSignature.of(key, self.profile)
        if len(self._checked) < CHECKED_SIGNATURES:
            self._checked[key] = checked
        return checked

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
        governor = self._omp
        if governor is None or governor.idle():
            return self._run(feeds)
        governor.begin()
        try:
            return self._run(feeds)
        finally:
            governor.end()

    def _run(self, feeds: dict[str, Any] | list[Any]) -> dict[str, Any]:
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
        signature = None
        if self.buckets is not None:  # torch feeds, else numpy feeds (a served instance's): checked once a signature
            signature = _tensor_signature(self.engine.input_names, feeds) \
                or _numpy_signature(self.engine.input_names, feeds)
        known = self._bucketed.get(signature) if signature is not None else None
        if known is None:
            self._check(feeds)
        else:  # these shapes and dtypes were checked by an earlier run
            self.profile = known.profile
        as_torch = any(isinstance(v, torch.Tensor) for v in feeds.values())
        staging = self._host_staging if not as_torch else None
        args = self.engine.program_inputs(feeds if staging is None else staging.feeds(feeds))
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
                            plain = self.plain_program if self._token_mask is not None else None
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
            if key is not None:
                self._remember_checked(key)
        if staging is not None:  # one wait for every output's copy, the GIL released
            return staging.outputs(self.engine.output_names, results, _numpy_out)
        return {b.name: _to_user(v, as_torch) for b, v in zip(self.engine.outputs, results)}

    def _run_program(self, args: list[Any], rows: int | None = None) -> list[Any]:
        """Run the engine's program on `args`; for a padding-free engine (_packed_rows), `rows` packed rows: its
        packed program, the token bucket of that many rows appended (its last input, kiln/passes/remove_padding.py),
        or None: its plain program."""
        program = None
        if rows is not None:
            args = [*args, self._token_bucket(rows, args[self._token_mask].device)]
        elif self._token_mask is not None:
            program = self.plain_program
        if self.runner is not None:
            return self.runner.run(args) if program is None else self.runner.run(args, program)
        if program is not None:
            return program.run(args)
        into = self._into if rows is None else None  # (a packed program's outputs are its rows')
        if self._first_calls is not None:
            return self._first_calls.run(args, into)
        return self.program.run(args, into=into)

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
        return None if rows == positions and self.plain_program is not None else rows

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
            return (None, known.targets) if self.plain_program is not None else None
        mask = args[self._token_mask]
        rows = graph_rows(int(torch.count_nonzero(mask)) if tokens is None else tokens, known.most, rule)
        return (None if rows == known.most and self.plain_program is not None else rows), known.widest

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


def _numpy_out(value: Any) -> Any:
    return _to_user(value, False)


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
