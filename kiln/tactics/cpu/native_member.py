"""A kiln C kernel (kiln/kernels/cpu/transformer.py NativeKernel) as a layer's tactic, runnable inside a native
segment: `prepared_native` gives the launch on torch tensors (outside a segment), `launch.native` (the NativeStep a
segment binds at any sizes) and `launch.timed` (the bound call the autotuner times). The tactics on kiln's C kernels
use it: transformer.py, attention.py, broadcast.py, elementwise.py, rotary.py, tokens.py, qdq.py. Below, the same
for a plan kernel of one channels-last input (kiln/kernels/cpu/plan_member.py): depthwise.py, squeeze_excite.py.

A kernel is bound per input sizes (`at` gets every read's size): sizes are only plan fields, so binding
at a new shape costs a few ctypes calls, not a rebuild.
"""

from __future__ import annotations

import ctypes
import struct
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from kiln.kernels.cpu import native_loop
from kiln.kernels.cpu import transformer as kernels
from kiln.plan.spec import StepSpec
from kiln.tactics.traced_rules import TracedRule
from kiln.tactics.tactic import (InputMeta, NativeStep, PlanRule, SizedPlan, built_at, conv_geometry,
                                conv_operands_refusal, resizable, same_primitive)
from kiln.tactics.tactic import attribute as _attr

# kernels kept per layer for input sizes met at run time (least recently used out): as many as a segment keeps
# views (kiln/runtime/native.py VIEWS), so that a size a segment has bound once is never built again while its
# view lives (a kernel is its plan fields: a few hundred bytes)
_KEPT = 256


def sizes_config(step: StepSpec, inputs: list[InputMeta]) -> dict[str, Any]:
    """The tuned size of every tensor input: [[index, size], ...] (JSON keys would be strings)."""
    return {"input_sizes": [[k, list(m.shape)] for k, m in enumerate(inputs) if m.shape is not None]}


def _tuned_sizes(step: StepSpec) -> dict[int, tuple[int, ...]]:
    return {int(k): tuple(size) for k, size in step.tactic_config["input_sizes"]}


def prepared_native(step: StepSpec, reads: Callable[[dict[int, tuple[int, ...]]], dict[int, torch.dtype]],
              build: Callable[[dict[int, tuple[int, ...]]], kernels.NativeKernel], max_rank: int | None = None,
              plan_at: PlanRule | None = None):
    """launch(ctx, *inputs) on the kernel for the inputs' sizes (built once per sizes), with
    launch.native at the tuned sizes; `reads(sizes)`: the step inputs the kernel reads and their dtypes.
    max_rank: inputs of a higher rank run as a step of their own, never inside a segment (a segment's 4-D
    values are NHWC in memory: ConvNeXt's residual Add of two [N, C, H, W] values inside one made the
    engine 0.036 off while the layer was exact alone, and the build reverted 30 layers).
    `plan_at(sizes)`: the kernel's plan fields at `sizes` (those it reads) without building it, where the layer
    has such a rule: NativeStep.plan_at gives it the sizes a segment gives `at`. Without one, NativeStep.plan_at
    is the kernel built at the sizes (once, as `at` builds it) read as integers (NativeKernel.integer_fields: a
    kernel whose plan holds only integers and addresses, reading its inputs in the roles it reads them at the
    tuned sizes); the view still saves the NativeStep, the replanned plan and its Replanned."""
    # each size's kernel and, once a segment has bound it there, its NativeStep; least recently used first
    kept: OrderedDict[tuple, list] = OrderedDict()
    lock = threading.Lock()  # an engine's contexts may bind one layer at once

    def entry(sizes: dict[int, tuple[int, ...]]) -> list:
        """[kernel, NativeStep or None] for `sizes`, built on first use."""
        key = tuple(sorted(sizes.items()))
        with lock:
            found = kept.get(key)
            if found is not None:
                kept.move_to_end(key)
                return found
        found = [build(sizes), None]
        with lock:
            kept[key] = found
            while len(kept) > _KEPT:
                kept.popitem(last=False)
        return found

    def kernel(sizes: dict[int, tuple[int, ...]]) -> kernels.NativeKernel:
        return entry(sizes)[0]

    rewritten: list[RewrittenLaunch | None] = []  # made at the first launch: [] not yet, [None] none

    def launch(ctx, *inputs, **_attributes):
        tensors = {k: v for k, v in enumerate(inputs) if isinstance(v, torch.Tensor)}
        wanted = reads({k: tuple(v.shape) for k, v in tensors.items()})
        for k, dtype in wanted.items():
            if tensors[k].dtype != dtype:
                raise TypeError(f"input {k} is {tensors[k].dtype}, the layer was built for {dtype}")
        sizes = {k: tuple(tensors[k].shape) for k in wanted}
        read = {k: tensors[k].contiguous() for k in wanted}
        if not rewritten:
            made = RewrittenLaunch.of(kernel(read_sizes(tuned)[1]), plan_at, read_sizes(tuned)[1]) \
                if plan_at is not None and tuned_roles is not None else None
            with lock:
                if not rewritten:
                    rewritten.append(made)
        if rewritten[0] is not None:
            out = rewritten[0](sizes, read)
            if out is not None:
                return out
        return kernel(sizes)(read)

    def read_sizes(sizes: dict[int, tuple[int, ...]]) -> tuple[dict[int, torch.dtype], dict[int, tuple[int, ...]]]:
        """The dtypes and sizes of the inputs the kernel reads, of the sizes a segment gives (ValueError: past
        max_rank)."""
        dtypes = reads(sizes)
        sizes = {k: tuple(sizes[k]) for k in dtypes}
        if max_rank is not None and any(len(v) > max_rank for v in sizes.values()):
            raise ValueError(f"inputs of rank {max_rank} at most in a native segment, given {list(sizes.values())}")
        return dtypes, sizes

    @resizable
    def native_at(sizes: dict[int, tuple[int, ...]]) -> NativeStep:
        dtypes, sizes = read_sizes(sizes)
        found = entry(sizes)
        if found[1] is None:  # a size bound before keeps its kernel and step as they were
            kernel_, first = found[0], min(sizes)
            found[1] = NativeStep(sizes[first], kernel_.output_size, same_primitive(kernel_),
                                  reads={k: (sizes[k], dtypes[k]) for k in sizes}, output_dtype=kernel_.output_dtype,
                                  more_outputs=kernel_.more_outputs,
                                  plan_at=sized_plan)
        return found[1]

    def from_kernel(sizes: dict[int, tuple[int, ...]]) -> SizedPlan:
        kernel_ = entry(sizes)[0]
        if kernel_.roles != tuned_roles:  # an Add's larger operand changed sides: other memory fields
            raise ValueError(f"{kernel_.what}: reads its inputs in other roles than at the tuned sizes")
        return SizedPlan((kernel_.output_size, *(size for size, _ in kernel_.more_outputs)), kernel_.integer_fields())

    # the layer's own kernels are in its fields (a table's address): its key is its own
    sized_plan = PlanRule(lambda sizes: from_kernel(read_sizes(sizes)[1]), ("layer", id(kept))) if plan_at is None \
        else PlanRule(lambda sizes: plan_at(read_sizes(sizes)[1]), plan_at.key, plan_at.traceable)

    def timed(*inputs) -> Callable[[], None]:
        """The layer on `inputs` as a native segment runs it: bound once, then one call into its C function
        (the autotuner times this: the launch's Python path is not paid inside a segment)."""
        tensors = {k: v.contiguous() for k, v in enumerate(inputs) if isinstance(v, torch.Tensor)}
        wanted = reads({k: tuple(v.shape) for k, v in tensors.items()})
        found = kernel({k: tuple(tensors[k].shape) for k in wanted})
        outputs = [torch.empty(size, dtype=dtype) for size, dtype in ((found.output_size, found.output_dtype),
                                                                      *found.more_outputs)]
        bound = found.bind_reads(outputs[0].data_ptr(), {k: tensors[k].data_ptr() for k in wanted}
                                 | {f"dst{j}": y.data_ptr() for j, y in enumerate(outputs[1:], 1)})
        kept = (tensors, outputs)  # what the bound call points at

        def run() -> None:
            bound.run()
            return kept

        return run

    tuned = _tuned_sizes(step)
    tuned_roles = None
    if max_rank is None or all(len(v) <= max_rank for v in tuned.values()):
        tuned_roles = kernel(read_sizes(tuned)[1]).roles
        launch.native = native_at(tuned)
        launch.timed = timed
    return launch


class RewrittenLaunch:
    """A layer's launch (outside a native segment) at input sizes it has not met, without a kernel built there: its
    size rule's fields (NativeStep.plan_at, the rule a segment's view rewrites the layer's plan with) written into a
    copy of the plan of one call bound at the tuned sizes, run on that call's memory objects, each pointed at this
    launch's tensors. A kernel at each new size (its fields' arithmetic, then a KernelBound's four oneDNN memory
    objects and its plan) cost llama_tiny's two mask Wheres ~90 µs each of a first call at a new shape, right after a
    run has cooled the caches (bench/results/first-shape-2026-12-06.md); a rewritten plan, a struct copy and the
    rule. Plans kept per size (the oldest out past _KEPT), shared by the launches of one template plan and rule
    (_KeptPlans: llama_tiny's second mask Where at a new size takes the first's plan); one run at a time (they share
    the memory objects). Made at the layer's first launch (an engine's warm-up), with its rule's batch-1 / sequence-1
    paths traced there (_ones)."""

    def __init__(self, kernel: kernels.NativeKernel, plan_at: PlanRule, reads: list[int]):
        """`kernel`: the layer at its tuned sizes, reading step inputs `reads`."""
        self._bound = kernel.bind_reads(0, {k: 0 for k in reads}
                                        | {f"dst{j}": 0 for j in range(1, len(kernel.more_outputs) + 1)})
        self._template = bytes(memoryview(self._bound.plan).cast("B"))
        self._plan_type = type(self._bound.plan)
        self._dtypes = (kernel.output_dtype, *(dtype for _, dtype in kernel.more_outputs))
        self._roles = ["dst"] + [f"dst{j}" for j in range(1, len(kernel.more_outputs) + 1)]
        # its answers from closed forms traced from it (traced_rules.py) where it is arithmetic on the sizes: a
        # broadcast's fields are ~7 µs of Python warm, several times that on a first call's cooled caches
        self._plan_at = _traced(plan_at) if plan_at.traceable else plan_at
        self._writes: dict[tuple, list[tuple[str, struct.Struct, int]]] = {}  # by the rule's field names
        self._kept = _kept_plans((self._plan_type, self._template, plan_at.key))
        self._lock = threading.Lock()

    @classmethod
    def of(cls, kernel: kernels.NativeKernel, plan_at: PlanRule, sizes: dict[int, tuple[int, ...]]
           ) -> RewrittenLaunch | None:
        """The rewritten launch of the layer whose kernel at its tuned `sizes` is `kernel`, or None where a field
        its rule writes is not integers (or not the plan's), or the rule's fields written into the plan at these
        sizes do not give back the kernel's own plan (a value it leaves unset, another output size): then every new
        size builds its kernel, as before. The plan's other fields (a norm's epsilon) are the template's, as in a
        segment's rewritten view (kiln/runtime/native_views.py _plan_layout)."""
        try:
            launch = cls(kernel, plan_at, sorted(sizes))
            sized = launch._plan_at(sizes)
            writes = _plan_writes(launch._plan_type, sized.fields)
            outputs = (tuple(kernel.output_size), *(tuple(size) for size, _ in kernel.more_outputs))
            if writes is None or tuple(map(tuple, sized.output_sizes)) != outputs:
                return None
            launch._writes[tuple(sized.fields)] = writes
            if bytes(memoryview(launch._written(sized.fields)).cast("B")) != launch._template:
                return None
        except Exception:  # noqa: BLE001  whatever the rule or the plan refuses: each size builds its kernel
            return None
        if type(launch._plan_at) is TracedRule:
            for other in _ones(sizes):  # a batch or a sequence of 1 takes other paths (a broadcast's `d == 1`)
                try:
                    launch._plan_at(other)
                except Exception:  # noqa: BLE001  sizes the rule refuses: a launch there builds its kernel
                    pass
        return launch

    def _written(self, fields: dict[str, Any]) -> ctypes.Structure:
        """A copy of the template plan with `fields` written (KeyError: fields of a layout not met yet)."""
        plan = self._plan_type.from_buffer_copy(self._template)
        for name, packer, offset in self._writes[tuple(fields)]:
            value = fields[name]
            if type(value) is tuple:
                packer.pack_into(plan, offset, *value)
            else:
                packer.pack_into(plan, offset, value)
        return plan

    def _plan_of(self, sizes: dict[int, tuple[int, ...]]) -> tuple[ctypes.Structure, tuple] | object:
        """(plan, output sizes) at `sizes`, or _REFUSED where the rule refuses them (an Add's larger operand on the
        other side) or answers fields this plan cannot take."""
        try:
            sized = self._plan_at(sizes)
            names = tuple(sized.fields)
            if names not in self._writes:
                writes = _plan_writes(self._plan_type, sized.fields)
                if writes is None:
                    return _REFUSED
                self._writes[names] = writes
            return self._written(sized.fields), tuple(map(tuple, sized.output_sizes))
        except Exception:  # noqa: BLE001  the kernel built at these sizes runs them, or says why it cannot
            return _REFUSED

    def __call__(self, sizes: dict[int, tuple[int, ...]], inputs: dict[int, torch.Tensor]
                 ) -> torch.Tensor | tuple[torch.Tensor, ...] | None:
        """The layer on `inputs` (contiguous, of `sizes`): new outputs, or None where the rule refuses these sizes
        (the caller builds the kernel: it says why, or runs them)."""
        key = tuple(sorted(sizes.items()))
        kept = self._kept
        found = kept.plans.get(key)
        if found is None:
            found = self._plan_of(sizes)
            with kept.lock:
                kept.plans[key] = found
                while len(kept.plans) > _KEPT:
                    kept.plans.popitem(last=False)
        if found is _REFUSED:
            return None
        plan, output_sizes = found
        ys = [torch.empty(size, dtype=dtype) for size, dtype in zip(output_sizes, self._dtypes)]
        if all(y.numel() == 0 for y in ys):  # no rows: nothing to write (as NativeKernel.__call__)
            return tuple(ys) if len(ys) > 1 else ys[0]
        bound = self._bound
        with self._lock:
            for role, y in zip(self._roles, ys):
                bound.rebind(role, y.data_ptr())
            for k, v in inputs.items():
                bound.rebind(k, v.data_ptr())
            bound.run_plan(plan)
        return tuple(ys) if len(ys) > 1 else ys[0]


_REFUSED = object()  # RewrittenLaunch's answer kept for sizes its rule refuses (the kernel there runs them)


# traced rules by key, shared by the layers of one shape (llama_tiny's two mask Wheres trace one path per class of
# sizes, not two), kept while a launch holds them
_TRACED: weakref.WeakValueDictionary[tuple, TracedRule] = weakref.WeakValueDictionary()
_TRACED_LOCK = threading.Lock()


def _traced(rule: PlanRule) -> TracedRule:
    with _TRACED_LOCK:
        found = _TRACED.get(rule.key)
        if found is None:
            found = _TRACED[rule.key] = TracedRule(rule)
        return found


class _KeptPlans:
    """RewrittenLaunch's plans by input sizes, least recently used out past _KEPT: one for the launches of one
    template plan (its bytes and type) and rule, whose plans at equal sizes are equal (the template with the rule's
    fields written over). A plan is only read by a run."""

    def __init__(self) -> None:
        self.plans: OrderedDict[tuple, tuple[ctypes.Structure, tuple] | object] = OrderedDict()
        self.lock = threading.Lock()


_KEPT_PLANS: weakref.WeakValueDictionary[tuple, _KeptPlans] = weakref.WeakValueDictionary()  # while a launch holds it


def _kept_plans(key: tuple) -> _KeptPlans:
    with _TRACED_LOCK:
        found = _KEPT_PLANS.get(key)
        if found is None:
            found = _KEPT_PLANS[key] = _KeptPlans()
        return found


def _ones(sizes: dict[int, tuple[int, ...]]) -> list[dict[int, tuple[int, ...]]]:
    """`sizes` with every dim of a value set to 1, for each set of the values above 1 (three at most, the
    largest; the tuned sizes' batch, heads, sequence): the paths a traced rule takes at a batch or a sequence of 1,
    traced with the launch rather than at a first call there (~0.4 ms a path)."""
    values = sorted({d for size in sizes.values() for d in size if d > 1}, reverse=True)[:3]
    out = []
    for mask in range(1, 1 << len(values)):
        ones = {v for j, v in enumerate(values) if mask >> j & 1}
        out.append({k: tuple(1 if d in ones else d for d in size) for k, size in sizes.items()})
    return out


def _plan_writes(plan_type: type[ctypes.Structure], fields: dict[str, Any]
                 ) -> list[tuple[str, struct.Struct, int]] | None:
    """(field, its packer, byte offset) of each of a SizedPlan's fields in `plan_type`, or None where one is not a
    field of it, not integers, or of another count of elements than the field holds."""
    kinds = dict(plan_type._fields_)
    writes = []
    for name, value in fields.items():
        kind = kinds.get(name)
        held = native_loop.integer_field(kind) if kind is not None else None
        items = value if type(value) is tuple else (value,)
        if held is None or len(items) != held[0] or None in items:
            return None
        code = {8: "q", 4: "i"}.get(held[1])
        if code is None:
            return None
        writes.append((name, struct.Struct(f"={held[0]}{code}"), getattr(plan_type, name).offset))
    return writes


# ---- one channels-last input: the plan kernels (kiln/kernels/cpu/plan_member.py) -------------------------------
# depthwise.py and squeeze_excite.py: a layer of one 4-D input (its constants packed at build) whose kernel is
# built per input size and runs on NHWC memory

_SIZED_KEPT = 8  # kernels kept per layer for input sizes other than the tuned one


def not_built_refusal(module: Any, what: str) -> str | None:
    """Why a tactic on a plan kernel's module (depthwise, se) cannot run here: its library is not built."""
    return None if module.available() else f"kiln's {what} kernel is not built: {module.reason()}"


def float_constant_refusal(meta: InputMeta, name: str) -> str | None:
    """Why `meta` cannot be a constant operand the kernel packs at build."""
    if not meta.constant or meta.dtype != torch.float32:
        return f"the {name} is not a float32 constant of the engine"
    return None


def direct_conv_refusal(step: StepSpec, inputs: list[InputMeta], module: Any, what: str) -> bool | str:
    """True, or why kiln's own direct-convolution kernel `module` (depthwise, stem: float32, a constant 4-D weight,
    bias and one of `module.ACTIVATIONS` in the same pass, no residual) cannot run this kiln::FusedConv; the
    geometry is `module.refusal`'s to judge."""
    x = inputs[0]
    w = inputs[1] if len(inputs) > 1 else None
    b = inputs[2] if len(inputs) > 2 else None
    if x.shape is None or len(x.shape) != 4:
        return "only 2-D convolutions (4-D input)"
    if x.dtype != torch.float32:
        return f"input dtype {x.dtype}, only float32"
    if w is None or not w.constant or w.shape is None or len(w.shape) != 4 or w.dtype != torch.float32:
        return "the weight is not a constant float32 4-D tensor of the engine"
    if b is not None and b.shape is not None and (refusal := float_constant_refusal(b, "bias")) is not None:
        return refusal
    if len(inputs) > 3 and inputs[3].shape is not None:
        return f"a residual: the {what} kernel adds none"
    if _attr(step, "final_activation", ""):
        return f"a final activation: the {what} kernel applies one activation"
    activation = _attr(step, "activation", "")
    if activation not in module.ACTIVATIONS:
        return f"activation {activation!r}: the kernel applies {sorted(module.ACTIVATIONS)}"
    if (refusal := conv_operands_refusal(step, x, w)) is not None:
        return refusal
    pads, strides, dilations = conv_geometry(step, tuple(w.shape))
    why = module.refusal(tuple(w.shape), tuple(x.shape), int(_attr(step, "group", 1)), pads, strides, dilations)
    return True if why is None else why


def direct_conv_prepared(step: StepSpec, constants: list[Any], kernel: Callable[..., Any], rows_input: bool = False):
    """`prepared_sized` for kiln's own direct-convolution kernels (depthwise, stem): `kernel(w, b, size, strides, pads,
    dilations=, activation=, alpha=, beta=)` per input size, the geometry and epilogue from the step."""
    w = constants[1]
    b = constants[2] if len(constants) > 2 else None
    pads, strides, dilations = conv_geometry(step, tuple(w.shape))
    epilogue = dict(activation=_attr(step, "activation", ""), alpha=float(_attr(step, "alpha", 0.0)),
                    beta=float(_attr(step, "beta", 0.0)))
    return prepared_sized(step, lambda size: kernel(w, b, size, strides, pads, dilations=dilations, **epilogue),
                          rows_input=rows_input)


def input_size_config(step: StepSpec, inputs: list[InputMeta]) -> dict[str, Any]:
    """The tuned size of the one activation input."""
    return {"input_size": list(inputs[0].shape)}


def prepared_sized(step: StepSpec, make: Callable[[tuple[int, ...]], Any], rows_input: bool = False):
    """launch(ctx, x) on the kernel `make(size)` for x's size (channels-last in and out; rows_input: x contiguous,
    NCHW, as the stem kernel reads it), with launch.native at the tuned size; the tuned size's kernel is made now (at
    load), others on first sight, a few kept."""
    tuned = tuple(step.tactic_config["input_size"])
    sized: dict[tuple[int, ...], Any] = {}

    def kernel(size: tuple[int, ...]) -> Any:
        return built_at(sized, size, make, lambda k: k == tuned, _SIZED_KEPT)

    kernel(tuned)  # at load: the tuned size's kernel

    def launch(ctx, x, *_inputs, **_attributes):
        # x: [N, C, H, W]; free when already in the kernel's layout
        x = x.contiguous() if rows_input else x.contiguous(memory_format=torch.channels_last)
        return kernel(tuple(x.shape))(x)  # channels-last

    @resizable
    def native_at(size: tuple[int, ...]) -> NativeStep:
        found = kernel(tuple(size))
        return NativeStep(tuple(size), found.output_size, same_primitive(found), rows_input=rows_input)

    launch.native = native_at(tuned)
    return launch
