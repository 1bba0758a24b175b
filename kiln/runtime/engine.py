"""Engine: a loaded engine plan, ready to run (weights placed, programs made); `load` reads a `.kiln` file.

Its ExecutionContext (kiln/runtime/context.py) binds inputs, runs the program and hands outputs back; the conversion
and checking of bindings is kiln/runtime/bindings.py. numpy in -> numpy out; torch in -> torch out. Several
contexts share one engine's weights; on the CPU each runs a lane of its own (CpuLane: its activation arenas).
"""

from __future__ import annotations

import os
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from kiln.errors import BindingError, EngineFormatError
from kiln.ir import dtypes
from kiln.kernels.cpu import omp_governor, onednn_ahead
from kiln.plan import file as engine_file
from kiln.plan.spec import Binding, EnginePlan, Profile
from kiln.runtime import views_ahead
from kiln.runtime.bindings import _to_runtime
from kiln.runtime.buckets import plan_buckets
from kiln.runtime.cpu_paths import CheckedSignature
from kiln.runtime.context import ExecutionContext, WarmUp  # noqa: F401  (WarmUp re-exported: kiln.serve imports it)
from kiln.runtime.direct_run import DirectRuns
from kiln.runtime.first_calls import FirstCalls, primitives_ahead
from kiln.runtime.host import HOST_MAX_NUMEL
from kiln.runtime.program import Program


def _check_device(header: dict) -> torch.device:
    device = header.get("device", {"type": "cpu"})
    if device.get("type", "cpu") == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise EngineFormatError(
            f"this engine was built for {device.get('name', 'a CUDA GPU')} and needs CUDA, "
            "but no CUDA device is available here; rebuild it with --device cpu"
        )
    name = torch.cuda.get_device_name()
    capability = list(torch.cuda.get_device_capability())
    if device.get("name") != name or device.get("capability") != capability:
        raise EngineFormatError(
            f"this engine was built for {device.get('name')} (compute capability "
            f"{device.get('capability')}), but this machine has {name} ({capability}); "
            "engines are tuned per GPU: rebuild it here"
        )
    return torch.device("cuda")


@dataclass(frozen=True)
class CpuLane:
    """What one CPU execution context runs: the engine's programs as it owns them for its life (Engine.lend_lane),
    with what remembers their bound shapes. A lane's native segments plan into an activation arena of its own
    (kiln/runtime/native_arena.py), so contexts on threads of their own compute at once (issue 14); the layers,
    packed weights, shape plans and shape function are the engine's, shared. The engine's own programs are its
    first lane; more are made as more contexts live at once (Program.with_own_arena)."""

    program: Program
    plain_program: Program | None  # a padding-free engine's plain program
    first_calls: FirstCalls | None
    direct_runs: DirectRuns | None


# A loaded file's weights below this size are copied into the process's own memory on the CPU (biases, norm
# scales, small tables: a few MiB in all). Read at every run from the mapped file, each such read faults in the
# page cache's folio around it (up to 2 MiB on current kernels), and with it the neighbouring large weights that
# were packed at load and released: BERT-base's 48 GEMM weights came back 3 MiB each, 144 MiB in all, on every run.
OWN_COPY_BYTES = 1 << 20


def place_weight(value: Any, device: torch.device, mapped: bool = False) -> Any:
    """On CUDA, small integer constants stay on the host: they feed shape arithmetic. On the CPU, a small weight
    of a mapped engine file gets its own copy (OWN_COPY_BYTES)."""
    if not isinstance(value, torch.Tensor):
        return value
    if device.type == "cpu":
        if mapped and value.numel() * value.element_size() < OWN_COPY_BYTES:
            return value.clone()
        return value
    if not value.is_floating_point() and not value.is_complex() and value.numel() <= HOST_MAX_NUMEL:
        return value
    return value.to(device)


# Engine.refit's weight derivation (kiln/builder/refit.py), installed by the `kiln` facade.
REFIT: Any = None


class Engine:
    """A loaded engine plan, ready to run. `kiln.build` and `kiln.load` return one."""

    def __init__(self, plan: EnginePlan, shared_launches: dict[tuple, Any] | None = None):
        """`shared_launches`: launches prepared on these very weights (the build's: its layers are not packed
        again), as Program takes them."""
        self.plan = plan
        self.device = _check_device(plan.header)
        weights = {k: place_weight(v, self.device, mapped=plan.mapped is not None) for k, v in plan.weights.items()}
        self._make_programs(weights, shared_launches)
        # Reduced-precision engines keep float32 bindings; values are cast at the boundary.
        casts = plan.header.get("io_casts", {})
        self.internal_dtype = {n: dtypes.BY_NAME[casts[n]].torch for n in casts}
        if plan.header.get("build_config", {}).get("precision") == "tf32" and self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        self.inputs: list[Binding] = plan.inputs
        self.outputs: list[Binding] = plan.outputs
        self.profiles: list[Profile] = plan.profiles
        self._make_lanes()
        # numpy input signatures a CPU context has checked, with the profile each selects: the check follows from the
        # signature alone (bindings.NumpyCheck), so every context of the engine skips it once one has made it (a
        # second context's first call at a shape the first ran checked it again: ~12-15 µs of bert_tiny's ~55 over
        # its repeat, bench/results/first-shape-2026-12-06.md); ExecutionContext._checked
        self.checked_signatures: dict[tuple, CheckedSignature] = {}
        if self.device.type == "cpu":
            # libgomp's spin count found here (~0.1 s, once a process: omp_governor._check), not in the first call
            omp_governor.governor().locate()
            # the oneDNN primitives of the profiles' row counts, made in the background
            primitives_ahead(self.program, self.profiles, self._program_dtypes())
        self._threads = threading.local()  # Engine.run's contexts, one per calling thread

    def _make_programs(self, weights: dict[str, Any], launches: dict[tuple, Any] | None = None) -> None:
        """The program, and a padding-free engine's plain program (run where a run would not pack its tokens)
        on the same weights: on the CPU a layer of each that reads the same weights with the same tactic and
        configuration shares one prepared (packed) launch. A loaded file's weight pages leave memory as each
        layer's copy is packed (or moved to the GPU)."""
        release = self.plan.mapped.release if self.plan.mapped is not None else None
        launches = {} if launches is None else launches
        self.program = Program(self.plan.program, weights, self.device, after_packing=release,
                               shared_launches=launches)
        self.plain_program = None if self.plan.plain is None else Program(
            self.plan.plain, weights, self.device, after_packing=release, shared_launches=launches)

    def _make_lanes(self) -> None:
        """The engine's own lane (its programs) as the first a CPU context takes, and an empty pool behind it."""
        self.first_calls = _first_calls(self, self.program)  # new shapes run padded in bound ones (CPU; first_calls.py)
        self.direct_runs = _direct_runs(self, self.program)  # bound shapes of a one-segment program (direct_run.py)
        self._free_lanes: list[CpuLane | None] = [None]  # None: the engine's own, as its attributes are when lent
        self._lending = threading.Lock()

    def lend_lane(self, context: Any) -> CpuLane:
        """The lane a new CPU execution context runs on until it is freed: the engine's own where no living context
        holds it (a lone context runs engine.program), else one a freed context gave back, else a new one (its
        programs' activation arenas its own, CpuLane). So an engine binds as many lanes as it had contexts alive at
        once. Lanes lent before a refit go back to the old weights' pool."""
        pool = self._free_lanes
        with self._lending:
            if None in pool:
                pool.remove(None)
                lane = None
            else:
                lane = pool.pop() if pool else self._new_lane()
        weakref.finalize(context, pool.append, lane)
        if lane is None:
            return CpuLane(self.program, self.plain_program, self.first_calls, self.direct_runs)
        if self._lanes_ahead():
            self._ready_lane(lane)  # a new one, or one a freed context gave back: the shapes run since, too
        return lane

    def _lanes_ahead(self) -> bool:
        """Whether another lane is readied on the background thread (views_ahead.twins_job), not at its creation."""
        return views_ahead.TWINS_AHEAD and onednn_ahead.enabled()

    def _new_lane(self) -> CpuLane:
        """A lane of its own (CpuLane). Where lanes are readied ahead (_lanes_ahead), what its segments take from the
        engine's lane (the grown view templates, their plan rewrites) is left to the background job lend_lane queues
        (_ready_lane), which also binds its views and direct-run records at the shapes the engine's lane has bound: a
        context's creation binds its segments only, and its first call at a shape another context ran finds its view
        (session 26's h-ctx3, bench/results/first-shape-2026-12-06.md)."""
        later = self._lanes_ahead()
        program = self.program.with_own_arena(adopt=not later)
        plain = None if self.plain_program is None else self.plain_program.with_own_arena(adopt=not later)
        return CpuLane(program, plain, _first_calls(self, program), _direct_runs(self, program))

    def _ready_lane(self, lane: CpuLane) -> None:
        """Queue the lane's job (views_ahead.twins_job): its programs' twins adopt what they have not yet, and bind
        their views (and records) at the engine's lane's latest shapes that they have not bound."""
        jobs = [views_ahead.twins_job(lane.program, lane.direct_runs, self.direct_runs)]
        if lane.plain_program is not None:
            jobs.append(views_ahead.twins_job(lane.plain_program))
        jobs = [job for job in jobs if job is not None]
        if jobs:
            onednn_ahead.AHEAD.schedule(jobs, torch.get_num_threads())

    def _program_dtypes(self) -> list[torch.dtype] | None:
        """The dtypes of the program's inputs (a half-precision engine's float inputs cast as program_inputs casts
        them); None where an input is not a tensor of a known type."""
        found = []
        for b in self.inputs:
            if b.kind != "tensor" or b.dtype not in dtypes.BY_NAME:
                return None
            found.append(self.internal_dtype.get(b.dtype, dtypes.BY_NAME[b.dtype].torch))
        return found

    @property
    def input_names(self) -> list[str]:
        return [b.name for b in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [b.name for b in self.outputs]

    def program_inputs(self, feeds: dict[str, Any]) -> list[Any]:
        """Feeds by binding name -> the program's inputs: on the engine's device, float inputs of a
        half-precision engine cast as its boundary casts them. (Bindings are not checked here.)"""
        args = [_to_runtime(feeds[b.name], b, self.device) for b in self.inputs]
        return [a.to(self.internal_dtype[b.dtype]) if b.dtype in self.internal_dtype and isinstance(a, torch.Tensor)
                else a for a, b in zip(args, self.inputs)]

    def create_execution_context(self, **options: Any) -> ExecutionContext:
        """A new context (its own activations, CUDA graphs and buckets); options: ExecutionContext's."""
        return ExecutionContext(self, **options)

    def run(self, feeds: dict[str, Any] | list[Any]) -> dict[str, Any]:
        """Run on this thread's own context (made on its first call), so threads may call one engine at
        once: a context's outputs are its buffers until its next run (a CUDA graph's static outputs), and
        another thread's run must not be that next run. For many threads, make contexts and pool them."""
        context = getattr(self._threads, "context", None)
        if context is None:
            context = self._threads.context = ExecutionContext(self)
        return context.run(feeds)

    def save(self, path: str | os.PathLike) -> None:
        engine_file.save(self.plan, path)

    def refit(self, weights: Any, **options: Any) -> Any:
        """Replace weights without rebuilding: `weights` a .safetensors or .onnx path, an ONNX model, or
        {initializer name: tensor}; re-derived as the builder derived them, or refused with the reason
        (kiln/builder/refit.py, which the `kiln` facade installs as REFIT: the runtime never imports the
        builder). Contexts made before a refit may still run the old weights (their bound native segments
        and CUDA graphs): make new ones after it."""
        if REFIT is None:
            raise EngineFormatError("refit derives weights with kiln's builder, which is not installed here")
        return REFIT(self, weights, **options)

    def set_weights(self, weights: dict[str, Any]) -> None:
        """Swap in weights by engine key, each of its old dtype and shape; the layers re-prepare (pack) them."""
        for key, value in weights.items():
            old = self.plan.weights.get(key)
            if old is None or type(old) is not type(value) or old.dtype != value.dtype or old.shape != value.shape:
                given = f"{getattr(value, 'dtype', type(value).__name__)} {list(getattr(value, 'shape', []))}"
                raise BindingError(f"weight {key!r}: the engine holds "
                                   + (f"{old.dtype} {list(old.shape)}" if old is not None else "no such weight")
                                   + f", given {given}")
        self.plan.weights.update(weights)
        placed = {k: place_weight(v, self.device) for k, v in self.plan.weights.items()}
        self._make_programs(placed)
        self._make_lanes()
        self._threads = threading.local()  # contexts of the old weights (bound segments, graphs) go

    def __repr__(self) -> str:
        ins = ", ".join(f"{b.name}: {b.describe()}" for b in self.inputs)
        outs = ", ".join(f"{b.name}: {b.describe()}" for b in self.outputs)
        plain = "" if self.plan.plain is None else f" (and a plain program of {len(self.plan.plain.steps)})"
        return f"<kiln.Engine {len(self.plan.program.steps)} layers{plain} on {self.device}; ({ins}) -> ({outs})>"


def _direct_runs(engine: Engine, program: Program) -> DirectRuns | None:
    """The DirectRuns of a CPU engine's program (one lane's) where it is one native segment once its shape values
    are known, and the engine runs without boundary casts and is not padding-free; else None."""
    if engine.device.type != "cpu" or engine.internal_dtype or engine.plan.header.get("remove_padding"):
        return None
    return DirectRuns.of(program)


def _first_calls(engine: Engine, program: Program) -> FirstCalls | None:
    """The padding of first calls over a CPU engine's program (one lane's) for an engine of dynamic shapes whose
    first calls bind something (shape values, native segments) and that has dims where padding is exact; else
    None."""
    if engine.device.type != "cpu" or not engine.profiles or (not program.segments and program.shape_plans is None):
        return None
    pad_dims = engine.plan.header.get("build_config", {}).get("pad_dims") or []
    buckets = plan_buckets(engine.inputs, engine.outputs, pad_dims)
    return FirstCalls(program, buckets, engine.inputs) if buckets is not None else None


def load(path: str | os.PathLike) -> Engine:
    """Load a `.kiln` engine file (checked: size, magic, version, checksum, device)."""
    return Engine(engine_file.load(path))
