"""A compiled step list: the interpreter loop the engine runs.

A `ProgramSpec` (kiln/plan/spec.py) is plain data: the names of a (sub)graph's inputs, outputs,
constants and outer-scope captures, and its steps. `Program` binds each value name to a slot in a
list, each step to its implementation (a `BoundStep`), and frees a value's slot after its last use
(the liveness plan), so activations do not outlive their consumers.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from kiln.errors import ExecutionError
from kiln.ir import dtypes
from kiln.ops.registry import OpContext, lookup
from kiln.plan.spec import ProgramSpec, StepSpec
from kiln.runtime.host import ShapePlan, on_device, outputs_of, place, upload
from kiln.runtime.native_runs import segments
from kiln.runtime.shape_function import ShapeFunction, compile_shape_steps, computable_ahead
from kiln.runtime.shapes import HOST_INPUTS, shape_only_steps
from kiln.runtime.step import BoundStep, call_step, pinned_fp32
from kiln.runtime.view_launches import lean_launch
from kiln.runtime.view_steps import SignatureViews
from kiln.tactics.registry import launch_for


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

    def __init__(self, spec: ProgramSpec, weights: dict[str, Any], device: Any = None,
                 after_packing: Callable[[], None] | None = None, shared_launches: dict[tuple, Any] | None = None,
                 turns_with: Program | None = None):
        """`after_packing`: called after each layer's tactic is prepared (its weights packed), and once at
        the end: a loaded engine file lets go of the pages its weights were packed from. `shared_launches`:
        prepared launches another program of the same engine made (a padding-free engine's plain and packed
        programs), shared as this program's own layers share them (shared_launch_key). `turns_with`: another program
        that never runs at the same time as this one (the build's in-context stage runs its two in turn,
        kiln/builder/in_context.py): this one's native segments plan into its arena, and a segment of the same layers
        on the same launches is its segment (native_runs.segments' reuse): one arena and one set of bound calls
        resident, not two."""
        self.spec = spec
        self.device = device  # None or cpu: plain loop; cuda: host/device split (kiln/runtime/host.py)
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
        # Steps of shape-only values run once per input-shape signature (kiln/runtime/shapes.py); their
        # values are remembered, so never freed (nor written over by a later layer)
        shape_steps, shape_values = shape_only_steps(spec)
        keep = set(spec.outputs) | set(spec.constants) | shape_values
        free_after: list[list[int]] = [[] for _ in spec.steps]
        for n, i in last_use.items():
            if n not in keep:
                free_after[i].append(slot(n))

        self.steps = []
        origins: list[Any] = []  # per step, what its launch is: two programs' segments of the same ones are alike
        # Layers that read the same weights with the same tactic and configuration (ALBERT's 12 layers of
        # one layer's weights) share one prepared launch: its packed weights exist once, not once per layer.
        shared_launches = {} if shared_launches is None else shared_launches
        on_cuda = device is not None and getattr(device, "type", "cpu") != "cpu"
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
            # A shape-only step on the CPU runs once per input-shape signature, on small values: the op's
            # own implementation (a few µs of torch) rather than a native tactic's launch, which binds its
            # kernel per input size (~40-80 µs for an embedding gather or a mask's And at a new size)
            once_per_signature = i in shape_steps and not on_cuda
            if step.tactic and not once_per_signature:  # pre-packs the step's weights once, here, at load
                # Inputs whose value dies at this step (freed after it; not a graph input, output or
                # capture): a tactic may write its result over one (kiln/tactics/cpu/onednn.py).
                dying = [k for k, n in enumerate(step.inputs) if n and slot(n) in free_after[i]
                         and n not in spec.inputs and n not in spec.captures]
                prepared = replace(step, tactic_config={**step.tactic_config, "dying_inputs": dying,
                                                        "sole_references": sole_reference_counts()}) if dying else step
                constants = [template_values.get(s) for s in in_slots[:len(step.inputs)]]
                key = shared_launch_key(prepared, constants) if not on_cuda else None
                fn = shared_launches.get(key) if key is not None else None
                if fn is None:
                    fn = launch_for(prepared, op.fn, constants, device)
                    if key is not None:
                        shared_launches[key] = fn
                    if after_packing is not None:
                        after_packing()
                alike = key if key is not None else launch_key(prepared, constants)
                origins.append(("launch", id(fn)) if key is not None or alike is None else ("alike", alike))
            else:
                origins.append(("own", id(fn)))
            fn = fn if step.precision != "fp32" else pinned_fp32(fn)
            self.steps.append(BoundStep(fn, ctx, in_slots, out_slots, attrs, free_after[i]))
        self.output_slots = [slot(n) for n in spec.outputs]
        # On the CPU, runs of layers whose tactics run bound oneDNN primitives become one step each
        # (kiln/runtime/native.py): the loop below runs `run_steps`; `steps` keeps every layer.
        self.segments = []
        self.run_steps = self.steps
        if (device is None or getattr(device, "type", "cpu") == "cpu") and os.environ.get("KILN_NATIVE_SEGMENTS") != "0":
            shared = turns_with.segments if turns_with is not None else []
            self.run_steps, self.segments = segments(self.steps, self.output_slots, template_values, shape_steps,
                                                     arena=shared[0].arena if shared else None, reuse=shared,
                                                     origins=origins)
        if after_packing is not None:
            after_packing()
        self.shape_steps = shape_steps
        self.shape_slots = sorted({slot(n) for n in shape_values if n not in spec.constants})
        if not on_cuda and LEAN_VIEWS:  # the view layers between segments: their ops' torch calls, less Python
            shape_step_ids = {id(self.steps[i]) for i in shape_steps}
            fixed = set(self.shape_slots) | set(template_values)  # the same at every call of a signature
            for step in self.run_steps:
                if id(step) not in shape_step_ids and all(s < 0 or s in fixed for s in step.inputs[1:]):
                    lean = lean_launch(step.ctx.op_type, step.ctx.domain, step.fn)
                    if lean is not None:
                        step.fn = lean
        # the loop once a signature's shape values are known: without the steps that compute them
        computed_once = {id(self.steps[i]) for i in shape_steps}
        self.lean_steps = [s for s in self.run_steps if id(s) not in computed_once]
        # what a signature's plan keeps: the shape values a later step reads (or the program returns)
        shape_slots = set(self.shape_slots)
        self.plan_slots = sorted({s for step in self.lean_steps for s in step.inputs if s in shape_slots}
                                 | (shape_slots & set(self.output_slots)))
        self.shape_plans: OrderedDict[tuple, list[tuple[int, Any]]] | None = OrderedDict() if shape_steps else None
        # at a signature run before, the layers that view an activation as one torch view each (view_steps.py)
        self.signature_views = SignatureViews.of(self.lean_steps, shape_slots | set(template_values)) \
            if shape_steps and not on_cuda else None
        self._plan_sizes: dict[tuple, int] = {}
        # the plans' bytes and evictions (shape_plan_bytes, plan_evictions), in an object of their own: the copies of
        # with_own_arena share the plans, their lock and these counts by reference
        self._plan_tally = _PlanTally()
        self._plans_lock = threading.Lock()
        self.num_slots = len(slots) + 1  # the last slot takes outputs nobody reads
        self.template = [None] * self.num_slots
        for i, v in template_values.items():
            self.template[i] = v
        # On the CPU a new signature's shape values come from one generated function (kiln/runtime/shape_function.py)
        # instead of their steps through the op dispatch: those computable from the input shapes alone; the loop
        # then runs `first_steps` (the others stay where they stand)
        self.shape_function: ShapeFunction | None = None
        self.first_steps = self.run_steps
        ahead = [] if on_cuda else computable_ahead(self.steps, sorted(shape_steps), self.template, self.input_slots)
        if ahead:
            computed = {id(self.steps[i]) for i in ahead}
            first_steps = [s for s in self.run_steps if id(s) not in computed]
            written = {s for i in ahead for s in self.steps[i].outputs if s >= 0}
            read_later = {s for step in first_steps for s in step.inputs} | set(self.output_slots)
            pinned = {i for i in ahead if spec.steps[i].precision == "fp32"}  # their kernels cast (pinned_fp32)
            self.shape_function = compile_shape_steps(self.steps, ahead, self.template, self.input_slots,
                                                      sorted(written & read_later), pinned)
            if self.shape_function is not None:
                self.first_steps = first_steps
        # the shape function computes every shape value the loop reads: a new signature's plan can be made without a
        # run (plan_ahead), so a first call binds its segment and runs as its repeats do (kiln/runtime/direct_run.py)
        self.plans_ahead = self.shape_function is not None and \
            [id(s) for s in self.first_steps] == [id(s) for s in self.lean_steps]

    @property
    def shape_plan_bytes(self) -> int:
        """What the remembered shape values hold (an encoder's position and token-type embeddings are shape-only:
        [batch, seq, hidden] floats per signature)."""
        return self._plan_tally.bytes

    @shape_plan_bytes.setter
    def shape_plan_bytes(self, value: int) -> None:
        self._plan_tally.bytes = value

    @property
    def plan_evictions(self) -> int:
        """Shape plans let go so far (what holds on to them notices: direct_run.py)."""
        return self._plan_tally.evictions

    @plan_evictions.setter
    def plan_evictions(self, value: int) -> None:
        self._plan_tally.evictions = value

    @property
    def evicted_plans(self) -> deque[tuple[int, tuple]]:
        """The latest shape plans let go (at most SHAPE_PLANS): (plan_evictions once it was let go, its signature),
        oldest first. What holds on to plans forgets those signatures alone (DirectRuns); an eviction counted
        without its entry (plan_evictions set by hand) means any plan may have gone."""
        return self._plan_tally.evicted

    def with_own_arena(self, adopt: bool = True) -> Program:
        """A copy for another execution context (kiln/runtime/engine.py CpuLane): the same layers (prepared
        launches, packed weights), shape plans and shape function, shared; each native segment bound anew over an
        arena of its own, planned the same (Segment.on_arena; `adopt` False: what its segments take from their
        origins' views is left to a background job, views_ahead.twins_job, or their first new sizes). Two contexts'
        runs then compute at once, where segments over one arena take turns under its lock. A program without
        segments holds no activations between runs: it is its own copy."""
        if not self.segments:
            return self
        copy = object.__new__(Program)
        copy.__dict__.update(self.__dict__)
        arena = self.segments[0].arena  # the program's segments share one (kiln/runtime/native_runs.py)
        grown = max((s._grown.planned_bytes for s in self.segments if s._grown is not None), default=0)
        sibling = arena.sibling(grown) if arena is not None else None
        owned = {id(segment) for segment in self.segments}
        twins = {id(step): replace(step, fn=step.fn.on_arena(sibling, adopt))  # id of a segment's step -> the copy's
                 for step in self.run_steps if id(step.fn) in owned}
        copy.run_steps = [twins.get(id(s), s) for s in self.run_steps]
        copy.lean_steps = [twins.get(id(s), s) for s in self.lean_steps]
        copy.first_steps = [twins.get(id(s), s) for s in self.first_steps]
        copy.segments = [twins[id(s)].fn for s in self.run_steps if id(s) in twins]
        copy.signature_views = self.signature_views.fresh() if self.signature_views is not None else None
        return copy

    def with_kernels(self, wrap: Callable[[int, Any], Any], keep_values: bool = False) -> Program:
        """A copy whose step i calls `wrap(i, kernel)` instead of its kernel (for tracing, timing,
        replaying); the original is untouched. `keep_values`: no liveness frees."""
        copy = object.__new__(Program)
        copy.__dict__.update(self.__dict__)
        copy.steps = [replace(s, fn=wrap(i, s.fn), free=[] if keep_values else s.free)
                      for i, s in enumerate(self.steps)]
        copy.run_steps, copy.segments = copy.steps, []  # every layer is seen: no native segments
        copy.shape_plans = None  # ... and runs, shape steps included
        return copy

    def run(self, inputs: list[Any], outer: dict[str, Any] | None = None, plan: Any = None,
            into: dict[int, torch.Tensor] | None = None) -> list[Any]:
        """Run once. `plan` (a ShapePlan, kiln/runtime/host.py) is only used on CUDA. `into` (the CPU): tensors by
        output slot, each written by the step that computes that output where the step can (a kernel with
        `writes_into`: a native segment's exit of the tensor's size, strides and dtype); the others are fresh."""
        if self.device is not None and self.device.type == "cuda":
            return self._run_on_device(inputs, outer, plan)
        env = list(self.template)
        for s, v in zip(self.input_slots, inputs):
            env[s] = v
        if self.capture_slots:
            for name, s in self.capture_slots:
                env[s] = outer[name]
        steps, signature, recorders, recorded = self.run_steps, None, None, None
        if self.shape_plans is not None:  # this signature's shape values, when known: their steps are skipped
            signature = input_signature(inputs)
            known = None
            if signature is not None:
                with self._plans_lock:  # contexts of one engine share its Program: one thread at a time here
                    known = self.shape_plans.get(signature)
                    if known is not None:
                        self.shape_plans.move_to_end(signature)
            if known is not None:
                for s, v in known:
                    env[s] = v
                steps = self.lean_steps
                if self.signature_views is not None:  # its view layers as recorded, or recording (view_steps.py)
                    steps, recorders = self.signature_views.steps(signature, steps)
                    recorded = signature
                signature = None
            elif signature is not None and self.shape_function is not None:
                try:
                    self.shape_function(env)  # writes env only once every value is computed
                    steps = self.first_steps
                except Exception:  # noqa: BLE001  the steps one by one: they name a failing layer
                    pass
        writers = _writers(steps, into) if into else None
        for step in steps:
            args = [env[s] if s >= 0 else None for s in step.inputs]
            if writers is not None and id(step) in writers:
                result = call_step(step.fn, step.ctx, args, {**step.attributes, "into": writers[id(step)]})
            else:
                result = call_step(step.fn, step.ctx, args, step.attributes)
            out_slots = step.outputs
            if len(out_slots) == 1:
                if isinstance(result, tuple):
                    result = result[0]
                env[out_slots[0]] = result
            else:
                for s, v in zip(out_slots, result):
                    env[s] = v
            result = v = None  # the slots alone hold the values: a kernel may overwrite a dying input
            for s in step.free:
                env[s] = None
        if signature is not None:
            self._remember(signature, [(s, env[s]) for s in self.plan_slots])
            if self.signature_views is not None:
                self.signature_views.ran(signature)
        if recorders is not None:
            self.signature_views.keep(recorded, steps, recorders, env)
        return [env[s] for s in self.output_slots]

    def plan_ahead(self, inputs: list[Any], signature: tuple) -> bool:
        """Compute and remember a new signature's shape values without running a layer (the CPU's shape function;
        `plans_ahead`: it computes every shape value the loop reads). The values are those run() computes and keeps
        at this signature's first run: the same function on the same inputs. False where it cannot (no such
        function, or it raises: run() then names the failing layer)."""
        if not self.plans_ahead or self.shape_plans is None:
            return False
        env = list(self.template)
        for s, v in zip(self.input_slots, inputs):
            env[s] = v
        try:
            self.shape_function(env)
        except Exception:  # noqa: BLE001  run()'s steps one by one say what failed
            return False
        self._remember(signature, [(s, env[s]) for s in self.plan_slots])
        return True

    def _remember(self, signature: tuple, values: list[tuple[int, Any]]) -> None:
        """Keep a signature's shape values: at most SHAPE_PLANS signatures and SHAPE_PLAN_BYTES of tensors
        (the newest always kept), the least recently used out."""
        size = sum(v.nbytes for _, v in values if isinstance(v, torch.Tensor))
        with self._plans_lock:
            if signature in self.shape_plans:  # another thread's run recorded it meanwhile
                return
            self.shape_plans[signature] = values
            self._plan_sizes[signature] = size
            tally = self._plan_tally
            tally.bytes += size
            while len(self.shape_plans) > 1 and (len(self.shape_plans) > SHAPE_PLANS or tally.bytes > SHAPE_PLAN_BYTES):
                old, _ = self.shape_plans.popitem(last=False)
                tally.bytes -= self._plan_sizes.pop(old)
                tally.evicted.append((tally.evictions + 1, old))  # before the count: a reader of it finds the entry
                tally.evictions += 1

    def _run_on_device(self, inputs: list[Any], outer: dict[str, Any] | None, plan: ShapePlan | None) -> list[Any]:
        """Host steps (every input a constant or shape-derived value) run on the CPU, once per input
        shape with a ShapePlan; the rest on the device, never waiting on the host."""
        device = self.device
        env = list(self.template)
        for s, v in zip(self.input_slots, inputs):
            env[s] = v
        for name, s in self.capture_slots:
            env[s] = outer[name]
        for i, step in enumerate(self.steps):
            fn, ctx, in_slots, out_slots, attrs = step.fn, step.ctx, step.inputs, step.outputs, step.attributes
            cached = plan.host_outputs.get(i) if plan is not None else None
            if cached is not None:
                outs = cached
            else:
                args = [env[s] if s >= 0 else None for s in in_slots]
                if i in self.shape_steps:
                    # Host step: a shape-only value (kiln/runtime/shapes.py), once per input-shape signature.
                    # One that reads a weight already on the device (a position table gathered by
                    # shape-derived ids) takes its host inputs there too.
                    if any(on_device(a) for a in args):
                        keep = HOST_INPUTS.get(ctx.op_type, frozenset())
                        args = [upload(a, device) if j not in keep and isinstance(a, torch.Tensor) else a
                                for j, a in enumerate(args)]
                    outs = [place(o, device) for o in outputs_of(call_step(fn, ctx, args, attrs), len(out_slots))]
                    if plan is not None and plan.recording:
                        plan.host_outputs[i] = outs
                else:
                    uploads = plan.uploads.get(i) if plan is not None else None
                    if uploads is None:  # the host tensors this device layer reads as data: on the device
                        keep = HOST_INPUTS.get(ctx.op_type, frozenset())
                        uploads = {j: upload(a, device) for j, a in enumerate(args)
                                   if j not in keep and isinstance(a, (torch.Tensor, list)) and not on_device(a)
                                   and not (isinstance(a, list) and not a)}
                        if plan is not None and plan.recording:
                            plan.uploads[i] = uploads
                    if uploads:
                        args = [uploads.get(j, a) for j, a in enumerate(args)]
                    try:
                        result = call_step(fn, ctx, args, attrs)
                    except ExecutionError:
                        # Mixed host/device inputs the op cannot take: move the host values over.
                        moved = {j: upload(a, device) for j, a in enumerate(args)
                                 if isinstance(a, (torch.Tensor, list)) and not on_device(a)}
                        if not moved:
                            raise
                        if plan is not None and plan.recording:
                            plan.uploads[i] = {**plan.uploads.get(i, {}), **moved}
                        args = [moved.get(j, a) for j, a in enumerate(args)]
                        result = call_step(fn, ctx, args, attrs)
                    outs = outputs_of(result, len(out_slots))
            for s, v in zip(out_slots, outs):
                env[s] = v
            for s in step.free:
                env[s] = None
        return [env[s] for s in self.output_slots]


def _writers(steps: list[BoundStep], into: dict[int, torch.Tensor]) -> dict[int, list]:
    """Program.run's `into` per step that writes one of its slots and takes tensors to write into (`writes_into`):
    id of the step -> a tensor or None per output."""
    return {id(step): [into.get(s) for s in step.outputs] for step in steps
            if not into.keys().isdisjoint(step.outputs) and getattr(step.fn, "writes_into", False)}


@dataclass
class _PlanTally:
    """What a program's shape plans hold (bytes) and how many it let go (evictions)."""

    bytes: int = 0
    evictions: int = 0
    evicted: deque[tuple[int, tuple]] = field(default_factory=lambda: deque(maxlen=SHAPE_PLANS))  # evicted_plans


SHAPE_PLANS = 256  # input-shape signatures whose shape values a Program remembers (least recently used go): as
# many as a native segment keeps views (kiln/runtime/native.py VIEWS): a shape whose view is kept skips its shape steps
SHAPE_PLAN_BYTES = 64 << 20  # ... and the most their tensors hold (BERT-base's at 8 x 256: ~7 MB a signature)
LEAN_VIEWS = True  # a CPU program's view layers (Reshape, Expand, (Un)squeeze, Transpose) take view_launches.py's
# launches: their ops' torch calls on kept arguments, then kept views (benches load an engine with it off to compare)


SHARE_MIN_ELEMENTS = 4096  # a weight this large is worth one prepared launch for every layer reading it


def shared_launch_key(step: StepSpec, constants: list[Any]) -> tuple | None:
    """What makes two layers' prepared launches interchangeable: the op, tactic, its configuration and
    attributes, and the very weight objects they read (the engine stores a weight once per content,
    kiln/builder/lower.py; small constants by value). None when the layer reads no large weight or its
    attributes are not plain data.

    CPU launches only: a CPU tactic's launch returns a fresh output (or one its arena hands out only
    while no tensor holds it), keeps per-call state under a lock, and a native segment binds each member
    on memory objects of its own, so two layers may call one launch in turn."""
    if not any(isinstance(c, torch.Tensor) and c.numel() >= SHARE_MIN_ELEMENTS for c in constants):
        return None
    return launch_key(step, constants)


def launch_key(step: StepSpec, constants: list[Any]) -> tuple | None:
    """shared_launch_key for any layer, one without a large weight too (a pooling layer): what makes two prepared
    launches of it do the same (Program's turns_with compares segments by it); None where the attributes are not
    plain data."""
    try:
        described = json.dumps([step.tactic_config, step.attributes], sort_keys=True)
    except (TypeError, ValueError):
        return None
    return (step.op_type, step.domain, step.opset, step.tactic, step.precision, described,
            tuple(step.output_dtypes), tuple(_constant_key(c) for c in constants))


def _constant_key(value: Any) -> Any:
    """A large weight by identity; a small one by value (each fused layer keeps its own bias copy)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor) and value.numel() < SHARE_MIN_ELEMENTS and value.device.type == "cpu":
        return (str(value.dtype), tuple(value.shape), value.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return id(value)


def input_signature(inputs: list[Any]) -> tuple | None:
    """The input shapes and dtypes, as a key; None when an input is not a tensor."""
    key = []
    for v in inputs:
        if not isinstance(v, torch.Tensor):
            return None
        key.append((tuple(v.shape), v.dtype))
    return tuple(key)


_SOLE_REFERENCES: dict[str, int | None] = {}


def sole_reference_counts() -> dict[str, int | None]:
    """sys.getrefcount of a kernel's input that only its slot in this loop holds, as `run` passes it:
    "plain" without keyword attributes, "keywords" with some (CPython copies the arguments once
    more then); None where it cannot be measured. A tactic that writes its result over a dying
    input (kiln/tactics/cpu/onednn.py) does so only when the input's count is no higher: nothing
    but the slot holds it. Measured once, through this loop itself, so it follows the loop's code:
    a probe kernel reads values produced 1 to 3 steps before it; the smallest count is the slot's."""
    if not _SOLE_REFERENCES:
        for key, attributes in (("plain", {}), ("keywords", {"probe": 1})):
            seen: list[int] = []

            def probe(ctx, a, b, c, **_attributes):  # counted as a launch counts its residual: a parameter
                seen.extend((sys.getrefcount(a), sys.getrefcount(b), sys.getrefcount(c)))
                return a

            try:
                steps = [StepSpec("Relu", f"s{i}", ["x"], [f"v{i}"]) for i in range(3)]
                steps.append(StepSpec("Sum", "probe", ["v0", "v1", "v2"], ["z"], dict(attributes)))
                program = Program(ProgramSpec(["x"], ["z"], steps), {}).with_kernels(
                    lambda i, fn: probe if i == 3 else fn)
                program.run([torch.zeros(1)])
                _SOLE_REFERENCES[key] = min(seen) if len(seen) == 3 else None
            except Exception:  # noqa: BLE001  the loop changed shape: no input is ever written over
                _SOLE_REFERENCES[key] = None
    return dict(_SOLE_REFERENCES)
