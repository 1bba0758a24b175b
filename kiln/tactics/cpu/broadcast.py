"""CPU tactics for the small ops an exported attention mask is prepared with, in kiln's C
(kiln/kernels/cpu/transformer.py Broadcast, GatherND), each runnable inside a native segment:

    cpu.cast.native       Cast of int64/int32/float32/bool to bool or float32
    cpu.and.native        And, Or of bool tensors, broadcast
    cpu.or.native
    cpu.where.native      Where(bool, float32, float32), broadcast
    cpu.gathernd.native   GatherND with batch_dims 0

Why: Hugging Face encoders exported by torch.onnx turn `attention_mask` into the additive mask with
Cast -> GatherND -> And -> Where on every call (ONNX Runtime runs the same graph). Through torch each
is a dispatch and a Python step (~40 µs together, more than the rest of a 2-layer BERT at 7 tokens);
as members the whole encoder, mask included, is one call into the segment loop, and the mask is
computed exactly as the graph says (no pattern to prove equivalent).
"""

from __future__ import annotations

from typing import Any

import torch

from kiln.kernels.cpu import transformer as kernels
from kiln.plan.spec import StepSpec
from kiln.tactics.cpu.native_member import prepared_native, sizes_config
from kiln.tactics.registry import register
from kiln.tactics.tactic import InputMeta, PlanRule, SizedPlan, Tactic
from kiln.tactics.tactic import attribute as _attr

_CAST_TO = {9: "cast_bool", 1: "cast_float"}  # ONNX TensorProto BOOL, FLOAT
_SOURCES = tuple(kernels.SOURCE_TYPES)


def broadcast_input_shapes(inputs: list[InputMeta]) -> list[tuple[int, ...]] | str:
    if any(m.shape is None for m in inputs):
        return "an input's shape is not known"
    try:
        out = torch.broadcast_shapes(*[torch.Size(m.shape) for m in inputs])
    except RuntimeError as e:
        return f"the inputs do not broadcast: {e}"
    if len(out) > kernels.MAX_DIMS:
        return f"{len(out)} dims: at most {kernels.MAX_DIMS}"
    return [tuple(m.shape) for m in inputs]


def _available_reason() -> str | None:
    return None if kernels.available() else f"kiln's transformer kernels are not built: {kernels.reason()}"


# ---- Cast ------------------------------------------------------------------------------------------

def _cast_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    if (why := _available_reason()) is not None:
        return why
    if int(_attr(step, "to", 0)) not in _CAST_TO:
        return f"casts to ONNX type {_attr(step, 'to', 0)}: only bool and float32"
    if inputs[0].dtype not in _SOURCES:
        return f"casts from {inputs[0].dtype}"
    shapes = broadcast_input_shapes(inputs[:1])
    return shapes if isinstance(shapes, str) else True


def _plan_rule(op: str, count: int, source: torch.dtype = torch.bool) -> PlanRule:
    """A broadcast's plan at other sizes (NativeStep.plan_at): its dims and strides, without a kernel."""
    def sized(sizes: dict[int, tuple[int, ...]]) -> SizedPlan:
        out, fields = kernels.Broadcast.size_fields([sizes[k] for k in range(count)])
        return SizedPlan((out,), fields)

    return PlanRule(sized, ("broadcast", op, count, source), traceable=True)


def _cast_prepare(step: StepSpec, constants: list[Any], device: torch.device):
    op = _CAST_TO[int(_attr(step, "to", 0))]
    source = {"int64": torch.int64, "int32": torch.int32, "float32": torch.float32, "bool": torch.bool}[
        step.tactic_config["source"]]
    return prepared_native(step, lambda sizes: {0: source}, lambda sizes: kernels.Broadcast(op, [sizes[0]], source),
                           plan_at=_plan_rule(op, 1, source))


def _cast_configure(step: StepSpec, inputs: list[InputMeta]) -> dict[str, Any]:
    return {**sizes_config(step, inputs), "source": str(inputs[0].dtype).removeprefix("torch.")}


register(Tactic(
    name="cpu.cast.native", op_type="Cast", domain="", device="cpu", dtypes=_SOURCES,
    supports=_cast_supports, configure=_cast_configure, prepare=_cast_prepare, available=kernels.available,
    native=True, description="Cast to bool or float32 in kiln's C, a native-segment member",
))


# ---- And, Or ---------------------------------------------------------------------------------------

def _logical_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    if (why := _available_reason()) is not None:
        return why
    if len(inputs) != 2 or any(m.dtype != torch.bool for m in inputs):
        return "only two bool tensors"
    shapes = broadcast_input_shapes(inputs)
    return shapes if isinstance(shapes, str) else True


def _logical_prepare(op: str):
    def prepare(step: StepSpec, constants: list[Any], device: torch.device):
        return prepared_native(step, lambda sizes: {0: torch.bool, 1: torch.bool},
                               lambda sizes: kernels.Broadcast(op, [sizes[0], sizes[1]]), plan_at=_plan_rule(op, 2))
    return prepare


for _op in ("And", "Or"):
    register(Tactic(
        name=f"cpu.{_op.lower()}.native", op_type=_op, domain="", device="cpu", dtypes=(torch.bool,),
        supports=_logical_supports, configure=sizes_config, prepare=_logical_prepare(_op.lower()),
        available=kernels.available, native=True, description=f"{_op} of bool tensors, broadcast, in kiln's C",
    ))


# ---- Where -----------------------------------------------------------------------------------------

def _where_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    if (why := _available_reason()) is not None:
        return why
    if len(inputs) != 3 or inputs[0].dtype != torch.bool or any(m.dtype != torch.float32 for m in inputs[1:]):
        return "only a bool condition choosing between float32 tensors"
    shapes = broadcast_input_shapes(inputs)
    return shapes if isinstance(shapes, str) else True


def _where_prepare(step: StepSpec, constants: list[Any], device: torch.device):
    return prepared_native(step, lambda sizes: {0: torch.bool, 1: torch.float32, 2: torch.float32},
                           lambda sizes: kernels.Broadcast("where", [sizes[0], sizes[1], sizes[2]]),
                           plan_at=_plan_rule("where", 3))


register(Tactic(
    name="cpu.where.native", op_type="Where", domain="", device="cpu", dtypes=(torch.bool,),
    supports=_where_supports, configure=sizes_config, prepare=_where_prepare, available=kernels.available,
    native=True, description="Where(bool, float32, float32), broadcast, in kiln's C, a native-segment member",
))


# ---- GatherND --------------------------------------------------------------------------------------

def _gather_nd_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    if (why := _available_reason()) is not None:
        return why
    data, indices = inputs[0], inputs[1] if len(inputs) > 1 else None
    if int(_attr(step, "batch_dims", 0)) != 0:
        return "batch_dims is not 0"
    if data.shape is None or indices is None or indices.shape is None or indices.dtype != torch.int64:
        return "the shapes are not known, or the indices are not int64"
    if not indices.shape or not 1 <= indices.shape[-1] <= min(len(data.shape), kernels.MAX_DIMS):
        return f"index tuples of {indices.shape[-1] if indices.shape else 0} into a {len(data.shape)}-D tensor"
    return True


def _gather_nd_prepare(step: StepSpec, constants: list[Any], device: torch.device):
    dtype = {"int64": torch.int64, "int32": torch.int32, "float32": torch.float32, "bool": torch.bool}[
        step.tactic_config["source"]]
    def sized(sizes):  # the kernel's size fields without the kernel
        out, fields = kernels.GatherND.size_fields(sizes[0], sizes[1])
        return SizedPlan((out,), fields)

    return prepared_native(step, lambda sizes: {0: dtype, 1: torch.int64},
                           lambda sizes: kernels.GatherND(sizes[0], dtype, sizes[1]),
                           plan_at=PlanRule(sized, ("gather_nd", dtype), traceable=True))


register(Tactic(
    name="cpu.gathernd.native", op_type="GatherND", domain="", device="cpu", dtypes=_SOURCES,
    supports=_gather_nd_supports, configure=_cast_configure, prepare=_gather_nd_prepare, available=kernels.available,
    native=True, description="GatherND (batch_dims 0) in kiln's C, a native-segment member",
))
