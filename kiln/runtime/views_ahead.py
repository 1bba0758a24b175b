"""A program of several native segments: each segment's views made ready at load, as for one segment (issue 10).

A saved engine whose loop is one native segment traces its view's walk at load (first_calls._trace_job): the
segment's entry sizes at an input shape are its shape function's answer. A program whose segments are split by
layers kiln runs outside them (Swin's window partitions as Transposes and Reshapes between its segments, a pooler's
Gather, a layer without a native kernel in the middle) has each segment's entry sizes behind the layers before it,
so it got nothing ahead, and its first call at a new shape paid what the one-segment job makes at load: swin_tiny's
first odd batch ~50 ms outside the loop (bench/results/first-shape-2026-12-06.md).

Here the entry sizes come from the host, without a layer run on data (segment_entries): the shape function's values
(as a call computes them), each segment's exits from its own sizes (its runs' scaling, or its members' size rules),
and each layer between segments followed on the host: a view or index op (Reshape, Transpose, Gather, Slice,
Concat ...) run by its op's implementation on meta tensors (torch's sizes without data: no memory, no arithmetic),
so the op's own shape checks run on the glue before any call; an elementwise op or a GEMM by its inputs' sizes.
The walk stops at the first layer it cannot follow (another op, one that reads its input's values, a segment whose
layers refuse the sizes): the segments past it get nothing ahead and bind at their first call, as before.

The job (segments_job, on first_calls' background thread, after the plan rewrites) then does, per segment, at the
profiles' largest shapes and at trace_shapes's:
- a segment of images whose other batches run as runs of it (native_batches.py): native_batches.runs_ahead, whether
  its members compute each image alone and, where a batch leaves images past its runs, its view at one image; then
  the plans of every batch up to the largest shape's (native_batches.plans_ahead);
- a segment with views otherwise: its template grown to the largest entry sizes met (Segment.grow_ahead, before any
  trace), then its walk traced at each shape's entry sizes (Segment.trace_ahead), as the one-segment job does.
"""

from __future__ import annotations

import itertools
import math
import time
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from kiln.kernels.cpu import onednn_ahead
from kiln.ops._util import MULTIDIRECTIONAL, broadcast_sizes
from kiln.ops.registry import lookup
from kiln.runtime.native import Segment
from kiln.runtime.native_batches import another_batch, exit_sizes_in_runs, plans_ahead, runs_ahead
from kiln.runtime.program import SHAPE_PLANS, Program

_JOBS = itertools.count()


def segment_entries(program: Program, shapes: list[tuple[int, ...]], input_dtypes: list[torch.dtype],
                    known: list[tuple[int, Any]] | None = None) -> Iterator[tuple[Segment, tuple]]:
    """Each native segment of `program`'s loop with its entry sizes at inputs of `shapes` (of `input_dtypes`), in
    loop order, as far as the layers between them can be followed (the module's doc). A generator: what the caller
    does with a segment (runs_ahead) is done before its exits' sizes are asked. Nothing where the program's shape
    values need more than the inputs' sizes (a shape function reading data, or steps the loop runs). `known`: these
    shapes' plan (Program.shape_plans': the shape values the loop reads), written instead of running the shape
    function again (a decoder's builds its causal mask: ~1.5 ms of llama_tiny's ~2 a shape here)."""
    function = program.shape_function
    if (function is None and program.shape_steps) or \
            (function is not None and (not program.plans_ahead or not function.shapes_only)):
        return
    env = list(program.template)
    if known is not None:
        for s, value in known:
            env[s] = value
    else:
        for s, shape in zip(program.input_slots, shapes):
            env[s] = np.broadcast_to(np.zeros((), np.int64), shape)  # the shape function reads sizes only
        try:
            if function is not None:
                function(env)
        except Exception:  # noqa: BLE001  shapes its layers refuse: a call says why, this only looks ahead
            return
    for s, shape, dtype in zip(program.input_slots, shapes, input_dtypes):
        env[s] = torch.empty(shape, dtype=dtype, device="meta")
    last = max((i for i, step in enumerate(program.lean_steps) if isinstance(step.fn, Segment)), default=-1)
    for step in program.lean_steps[:last + 1]:
        args = [env[s] if s >= 0 else None for s in step.inputs]
        if isinstance(step.fn, Segment):
            key = tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else None for a in args)
            if None in key:
                return
            yield step.fn, key
            if step is program.lean_steps[last]:
                return  # nothing past the last segment is asked
            outputs = exit_sizes(step.fn, key)
            if outputs is None:
                return
            outputs = [torch.empty(size, dtype=dtype, device="meta")
                       for size, (_size, _strides, dtype) in zip(outputs, step.fn.exit_shapes)]
        else:
            outputs = _on_meta(step, args)
            if outputs is None:
                return
        for s, value in zip(step.outputs, outputs):
            if s >= 0:
                env[s] = value


def exit_sizes(segment: Segment, key: tuple) -> list[tuple[int, ...]] | None:
    """The sizes of `segment`'s exits at entries of sizes `key`: the planned ones, those of another batch's runs
    (native_batches.exit_sizes_in_runs), those its view's walk finds by its members' rules alone (making nothing, as
    Segment.trace_ahead walks), else its members' NativeSteps at `key` (made under its resize lock, as a view makes
    them); None where a layer cannot bind `key`."""
    if key == segment._planned_key:
        return [tuple(size) for size, _strides, _dtype in segment.exit_shapes]
    in_runs = exit_sizes_in_runs(segment, key)
    if in_runs is not None:
        return in_runs
    template = segment._grown or segment
    rewrite = template._rewrite if segment._views else None
    walked = None
    if rewrite is not None and tuple(map(len, key)) == tuple(map(len, template.entry_sizes)):
        try:
            walked = rewrite._walk(template, key, rules_only=True)
        except Exception:  # noqa: BLE001  a rule that cannot say: the members' NativeSteps below do
            walked = None
    if walked is not None:
        return [tuple(size) for size in walked[1]]
    with segment._resize_lock:
        try:
            at = segment._natives_at(key)
        except Exception:  # noqa: BLE001  a layer refusing these sizes: its first call binds (or runs) as before
            return None
    sizes = dict(zip(segment.entries, key))
    sizes.update((slot, tuple(form[0])) for slot, form in at.forms.items())
    found = [sizes.get(slot) for slot in segment.exits]
    return None if None in found else found


# Layers between segments whose sizes the walk follows. Run by the op on meta tensors: views and index ops, whose
# meta kernels are torch's C++ ones (a meta kernel written in Python, as torch's elementwise references are, imports
# torch._dynamo at its first call: ~2 s of CPU and its memory in a process that only runs engines)
ON_META = frozenset({"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Expand", "Slice",
                     "Concat", "Split", "Gather", "GatherElements"})
# ... elementwise ones by their sizes alone: one input's sizes and dtype (a unary op, a Softmax along any axis), or the
# inputs' broadcast
SAME_SIZES = frozenset({"Abs", "Acos", "Acosh", "Asin", "Asinh", "Atan", "Atanh", "Ceil", "Celu", "Cos", "Cosh",
                        "Elu", "Erf", "Exp", "Floor", "Gelu", "HardSigmoid", "HardSwish", "LeakyRelu", "Log", "Mish",
                        "Neg", "Not", "Reciprocal", "Relu", "Round", "Selu", "Shrink", "Sigmoid", "Sign", "Sin",
                        "Sinh", "Softmax", "LogSoftmax", "Softplus", "Softsign", "Sqrt", "Tan", "Tanh",
                        "ThresholdedRelu", "BitwiseNot"})
TO_BOOL = frozenset({"Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "And", "Or", "Xor", "IsInf", "IsNaN"})


def _on_meta(step, args: list) -> list[torch.Tensor] | None:
    """The outputs of a layer between segments as meta tensors (sizes and dtypes, no data): an ON_META op by its own
    implementation on meta tensors (its float inputs moved there; integer ones, read as axes, shapes or indices,
    kept), an elementwise one by its inputs' sizes (SAME_SIZES, MULTIDIRECTIONAL). None where it is none of these,
    reads an activation's values or refuses the sizes: the segments past it bind at their first call."""
    op_type = step.ctx.op_type
    if step.ctx.domain not in ("", "ai.onnx", "kiln") or (step.ctx.domain == "kiln") != (op_type == "FusedGemm") \
            or len(step.outputs) != 1 and op_type != "Split" \
            or not any(isinstance(a, torch.Tensor) and a.is_meta for a in args):
        return None
    if op_type in SAME_SIZES or op_type in TO_BOOL or op_type in MULTIDIRECTIONAL:
        shaped = [a for a in args if isinstance(a, torch.Tensor)]
        if len(shaped) != len(args) or (op_type in SAME_SIZES and len(shaped) != 1):
            return None
        try:
            size = broadcast_sizes(*(tuple(a.shape) for a in shaped))
        except ValueError:
            return None
        dtype = torch.bool if op_type in TO_BOOL else shaped[1 if op_type == "Where" else 0].dtype
        return [torch.empty(size, dtype=dtype, device="meta")]
    if op_type in ("MatMul", "FusedGemm"):
        return _product_on_meta(op_type, args, step.attributes)
    if op_type == "Reshape" and (found := _reshaped_on_meta(args, step.attributes)) is not None:
        return [found]
    op = lookup(op_type, step.ctx.domain) if op_type in ON_META else None
    if op is None:
        return None
    moved = [a.to("meta") if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    try:
        result = op.fn(step.ctx, *moved, **step.attributes)
    except Exception:  # noqa: BLE001  an op that needs values: the segments past it bind at their first call
        return None
    outputs = list(result) if isinstance(result, (tuple, list)) and len(step.outputs) > 1 else \
        [result[0] if isinstance(result, tuple) else result]
    if len(outputs) != len(step.outputs) or not all(isinstance(o, torch.Tensor) and o.is_meta for o in outputs):
        return None
    return outputs


def _reshaped_on_meta(args: list, attributes: dict) -> torch.Tensor | None:
    """A Reshape's output as a meta tensor by ONNX's rule on its target's values (0 copies the data's dim unless
    allowzero, one -1 takes the rest): torch's reshape of a meta tensor runs its Python decomposition, ~35 µs a
    Reshape of the ~1.2 ms a llama_tiny shape's walk took (views_ahead_at walks 128). None where the target is not
    a plain 1-D int64 tensor or the sizes do not hold (the op itself then runs, and says why)."""
    if len(args) < 2 or not isinstance(args[0], torch.Tensor) or not args[0].is_meta \
            or not isinstance(args[1], torch.Tensor) or args[1].is_meta or args[1].dim() != 1 or args[1].dtype != torch.int64:
        return None
    data, target = args[0], args[1].tolist()
    if not attributes.get("allowzero", 0):
        if len(target) > data.dim() and 0 in target[data.dim():]:
            return None
        target = [data.shape[i] if d == 0 else d for i, d in enumerate(target)]
    if target.count(-1) > 1 or any(d < -1 for d in target):
        return None
    known = math.prod(d for d in target if d != -1)
    if -1 in target:
        if known == 0 or data.numel() % known:
            return None
        target = [data.numel() // known if d == -1 else d for d in target]
    elif known != data.numel():
        return None
    return torch.empty(target, dtype=data.dtype, device="meta")


def _product_on_meta(op_type: str, args: list, attributes: dict) -> list[torch.Tensor] | None:
    """A MatMul's (numpy's matmul of rank >= 2 operands) or a kiln FusedGemm's (x [..., K] @ W[N, K]ᵀ -> [..., N],
    SwiGLU halving N) output by its operands' sizes: a GEMM layer the loop runs between segments (one on oneDNN's
    matmul, outside a segment). None where they do not multiply."""
    a, b = args[0], args[1] if len(args) > 1 else None
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a.dim() < 2 or b.dim() < 2:
        return None
    if op_type == "FusedGemm":
        if b.dim() != 2 or a.shape[-1] != b.shape[1]:
            return None
        n = b.shape[0] // 2 if attributes.get("activation") == "SwiGLU" else b.shape[0]
        dtype = torch.float32 if attributes.get("output_float32") else a.dtype
        return [torch.empty((*a.shape[:-1], n), dtype=dtype, device="meta")]
    if a.shape[-1] != b.shape[-2]:
        return None
    try:
        batch = broadcast_sizes(tuple(a.shape[:-2]), tuple(b.shape[:-2]))
    except ValueError:
        return None
    return [torch.empty((*batch, a.shape[-2], b.shape[-1]), dtype=a.dtype, device="meta")]


def segments_job(program: Program, shapes: list[list[tuple[int, ...]]], largest: list[list[tuple[int, ...]]],
                 input_dtypes: list[torch.dtype], plans: list[list[tuple[int, ...]]] = ()
                 ) -> onednn_ahead.Job | None:
    """The job readying every segment of a program of several (the module's doc) at `shapes` (trace_shapes's),
    growing templates to `largest` (each profile's largest input shapes) first, then computing the shape plans of
    `plans` (first_calls.plan_shapes: plans_ahead). None where no segment has views. Holds the program weakly; lets
    a calling thread have the GIL between shapes."""
    if not shapes or not any(isinstance(step.fn, Segment) and step.fn._views for step in program.lean_steps):
        return None
    program_ref = weakref.ref(program)

    def make() -> bool:
        met: dict[int, tuple[Segment, list[tuple]]] = {}  # the largest shapes' entry sizes of each view segment
        made = False
        for inputs in largest:
            made = _ready_at(program_ref, inputs, input_dtypes, met) or made
        for segment, keys in met.values():
            if segment._planned_batch is None:
                made = grow(segment, keys) or made
            else:  # the most images a largest shape gives it
                batch, first = segment._planned_batch, segment._planned_key[0][0]
                made = plans_ahead(segment, max(k[0][0] * batch // first for k in keys)) or made
        del met
        for inputs in shapes:
            made = _ready_at(program_ref, inputs, input_dtypes, None) or made
            time.sleep(0)  # the GIL to a calling thread, if one waits
        made = plans_ahead_at(program_ref, plans, input_dtypes) or made
        return views_ahead_at(program_ref, plans, input_dtypes) or made
    return onednn_ahead.Job(("segment views", next(_JOBS)), 0, make, counted=False)


VIEWS_AHEAD_BYTES = 4 << 20  # the views' plans and calls views_ahead_at makes at most (llama_tiny's: ~1.5 KB each)


def views_ahead_at(program_ref: weakref.ref, plans: list[list[tuple[int, ...]]], input_dtypes: list[torch.dtype]
                   ) -> bool:
    """Each view segment's view (Segment.view_ahead: from its traced walk, one call each) at its entry sizes for each
    input shape of `plans` whose shape plan is kept (plans_ahead_at's, in order), until the views hold
    VIEWS_AHEAD_BYTES: a later first call at such a shape then binds nothing. With the plans made ahead, each of
    llama_tiny's five segments still made its view at the call (~45 µs each, ~0.25 ms of ~0.65 outside the loop,
    bench/results/first-shape-2026-12-06.md). A segment running another batch in runs of its own is left out (its
    batches have plans of their own: native_batches.plans_ahead)."""
    made, held = False, 0
    for shapes in plans:
        program = program_ref()
        if program is None or program.shape_plans is None:
            return made
        signature = tuple((tuple(shape), dtype) for shape, dtype in zip(shapes, input_dtypes))
        with program._plans_lock:
            known = program.shape_plans.get(signature)
        if known is None:  # (past the plans made ahead: a call makes both)
            return made
        for segment, key in segment_entries(program, shapes, input_dtypes, known):
            if segment._planned_batch is None:
                size = segment.view_ahead(key)
                made, held = made or size > 0, held + size
        del program
        if held > VIEWS_AHEAD_BYTES:
            return made
        time.sleep(0)  # the GIL to a calling thread, if one waits
    return made


PLANS_AHEAD_BYTES = 8 << 20  # the shape plans' tensors plans_ahead_at keeps at most (of SHAPE_PLAN_BYTES: 64 MB)


def plans_ahead_at(program_ref: weakref.ref, plans: list[list[tuple[int, ...]]], input_dtypes: list[torch.dtype]
                   ) -> bool:
    """The shape plans (Program.plan_ahead: the shape function's values, as a call's first run keeps them) of each
    input shape of `plans`, in order, until their tensors pass PLANS_AHEAD_BYTES or the program keeps half its
    SHAPE_PLANS (the calls' own plans keep the other half before one made here goes). A decoder's shape function
    builds its causal mask from both dims at each new batch x sequence: gpt2_tiny's ~14 ops, ~0.4-0.8 ms of a later
    first call's ~1 ms outside the loop (bench/results/first-shape-2026-12-06.md), which the call then skips as a
    repeat does. Nothing where the shape values need more than the inputs' sizes (plans_ahead, shapes_only)."""
    made, held = False, 0
    for shapes in plans:
        program = program_ref()
        if program is None or not program.plans_ahead or program.shape_plans is None \
                or not program.shape_function.shapes_only:
            return made
        signature = tuple((tuple(shape), dtype) for shape, dtype in zip(shapes, input_dtypes))
        with program._plans_lock:
            known, kept = signature in program.shape_plans, len(program.shape_plans)
        if kept >= SHAPE_PLANS // 2:
            return made
        if not known:  # the function reads the inputs' sizes only: zero-strided arrays (DirectRuns.bind's inputs)
            arrays = [np.broadcast_to(np.zeros((), np.int64), shape) for shape in shapes]
            if not program.plan_ahead(arrays, signature):
                return made
            made = True
            held += program._plan_sizes.get(signature, 0)
            if held > PLANS_AHEAD_BYTES:
                return made
        del program
        time.sleep(0)  # the GIL to a calling thread, if one waits
    return made


def _ready_at(program_ref: weakref.ref, inputs: list[tuple[int, ...]], input_dtypes: list[torch.dtype],
              met: dict[int, tuple[Segment, list[tuple]]] | None) -> bool:
    """Each segment readied at its entry sizes for `inputs`: runs_ahead for a segment running that batch in runs;
    for one with views, its walk traced there. In the largest shapes' pass (`met` given) the sizes are noted instead
    of traced: a view template grows to them, a segment of images gets the plans of every batch up to them."""
    program = program_ref()
    if program is None:
        return False
    made = False
    for segment, key in segment_entries(program, inputs, input_dtypes):
        if key == segment._planned_key:
            continue
        batch, planned = segment._planned_batch, segment._planned_key
        in_runs = batch is not None and another_batch(planned, key) and not key[0][0] * batch % planned[0][0]
        if met is not None and (in_runs or (batch is None and segment._views)):
            met.setdefault(id(segment), (segment, []))[1].append(key)
        if in_runs:
            made = runs_ahead(segment, left=bool(key[0][0] * batch // planned[0][0] % batch)) or made
        elif segment._views and met is None:
            made = segment.trace_ahead(key) or made
    return made


TWINS_AHEAD = True  # a new context's lane readied on the background thread (twins_job); False: at its creation
TWIN_VIEWS = 32  # views a new context's segment binds ahead (twins_job): its origin's most recently used sizes
TWIN_RECORDS = 32  # direct-run records a new context makes ahead (twins_job): its origin lane's, the latest


def twins_job(program: Program, direct: Any = None, origin_direct: Any = None) -> onednn_ahead.Job | None:
    """A new execution context's lane (`program`: Program.with_own_arena's copy made with adopt=False) readied on the
    background thread, so that neither its creation nor its first calls make what its origin lane made already
    (issue 10/14): each twin segment adopts its origin's grown template and plan rewrite (~2.5 ms of creation on
    bert_tiny before, most of it the grown template's binding and its pages' first touch) and binds its views at the
    origin's latest sizes (Segment.adopt_views), then `direct` (the lane's DirectRuns, or None) makes its records of
    the signatures `origin_direct` (the origin lane's) holds, from those views and the shared shape plans: a first
    call at a shape another context has run is then a repeat. A call that comes first adopts and binds what it needs
    itself (Segment._bind_sizes), under the lock the job takes per view. Holds the lane weakly; never raises (a
    failure leaves the work to the calls, as before)."""
    twins = [weakref.ref(s) for s in program.segments if s._origin is not None and s._views]
    if not twins:
        return None
    records = (weakref.ref(direct), weakref.ref(origin_direct)) if direct is not None and origin_direct is not None \
        else None

    def make() -> bool:
        made = 0
        try:
            for ref in twins:
                twin = ref()
                if twin is not None:
                    made += twin.adopt_views(TWIN_VIEWS)
                del twin
            if records is not None:
                made += _records_ahead(*records)
        except Exception:  # noqa: BLE001  work ahead: what it could not make, a call makes
            return made > 0
        return made > 0
    return onednn_ahead.Job(("twin views", next(_JOBS)), 0, make, counted=False)


def _records_ahead(direct_ref: weakref.ref, origin_ref: weakref.ref) -> int:
    """The direct-run records (kiln/runtime/direct_run.py DirectRuns.find) of the origin lane's TWIN_RECORDS latest
    signatures, made in the twin lane's DirectRuns where its views are bound (find binds nothing). How many it made."""
    direct, origin = direct_ref(), origin_ref()
    if direct is None or origin is None:
        return 0
    with origin._lock:
        signatures = [s for s, record in origin._records.items() if record is not None][-TWIN_RECORDS:]
    made = 0
    for signature in signatures:
        if signature not in direct._records:
            made += direct.find(signature) is not None
        time.sleep(0)
    return made


def grow(segment: Segment, keys: list[tuple]) -> bool:
    """The segment's view template grown to the largest of `keys` along each entry dim (Segment.grow_ahead), before
    its walk is traced: a first call past the planned arena would grow it, and the next new shapes trace again."""
    if any(tuple(map(len, k)) != tuple(map(len, keys[0])) for k in keys):
        return False
    grown = tuple(tuple(map(max, *dims)) if len(keys) > 1 else dims[0] for dims in zip(*keys))
    try:
        return segment.grow_ahead(grown)
    except ValueError:  # a layer that cannot bind them: a call past the arena binds as before
        return False
