"""A kiln C kernel (kiln/kernels/cpu/transformer.py NativeKernel) as a layer's tactic, runnable inside a native
segment: `prepared_native` gives the launch on torch tensors (outside a segment), `launch.native` (the NativeStep a
segment binds at any sizes) and `launch.timed` (the bound call the autotuner times). The tactics on kiln's C kernels
use it: transformer.py, attention.py, broadcast.py, elementwise.py, rotary.py, tokens.py, qdq.py. Below, the same
for a plan kernel of one channels-last input (kiln/kernels/cpu/plan_member.py): depthwise.py, squeeze_excite.py.

A kernel is bound per input sizes (`at` gets every read's size): sizes are only plan fields, so binding
at a new shape costs a few ctypes calls, not a rebuild.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from kiln.kernels.cpu import transformer as kernels
from kiln.plan.spec import StepSpec
from kiln.tactics.tactic import InputMeta, NativeStep, PlanRule, SizedPlan, built_at, resizable, same_primitive

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

    def launch(ctx, *inputs, **_attributes):
        tensors = {k: v for k, v in enumerate(inputs) if isinstance(v, torch.Tensor)}
        wanted = reads({k: tuple(v.shape) for k, v in tensors.items()})
        for k, dtype in wanted.items():
            if tensors[k].dtype != dtype:
                raise TypeError(f"input {k} is {tensors[k].dtype}, the layer was built for {dtype}")
        sizes = {k: tuple(tensors[k].shape) for k in wanted}
        return kernel(sizes)({k: tensors[k].contiguous() for k in wanted})

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
    if max_rank is None or all(len(v) <= max_rank for v in tuned.values()):
        tuned_roles = kernel(read_sizes(tuned)[1]).roles
        launch.native = native_at(tuned)
        launch.timed = timed
    return launch


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


def input_size_config(step: StepSpec, inputs: list[InputMeta]) -> dict[str, Any]:
    """The tuned size of the one activation input."""
    return {"input_size": list(inputs[0].shape)}


def prepared_sized(step: StepSpec, make: Callable[[tuple[int, ...]], Any]):
    """launch(ctx, x) on the kernel `make(size)` for x's size (channels-last in and out), with launch.native at the
    tuned size; the tuned size's kernel is made now (at load), others on first sight, a few kept."""
    tuned = tuple(step.tactic_config["input_size"])
    sized: dict[tuple[int, ...], Any] = {}

    def kernel(size: tuple[int, ...]) -> Any:
        return built_at(sized, size, make, lambda k: k == tuned, _SIZED_KEPT)

    kernel(tuned)  # at load: the tuned size's kernel

    def launch(ctx, x, *_inputs, **_attributes):
        x = x.contiguous(memory_format=torch.channels_last)  # [N, C, H, W]; free when already channels-last
        return kernel(tuple(x.shape))(x)  # channels-last

    @resizable
    def native_at(size: tuple[int, ...]) -> NativeStep:
        found = kernel(tuple(size))
        return NativeStep(tuple(size), found.output_size, same_primitive(found))

    launch.native = native_at(tuned)
    return launch
