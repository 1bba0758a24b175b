"""CPU tactics for a transformer's layers besides its GEMMs, on kiln's own C kernels
(kiln/kernels/cpu/transformer.py), each runnable inside a native segment (native_member.py):

    cpu.layernorm.native   kiln::LayerNorm over the last axis (+ a residual repeating over the rows; the sum
                           as a second output in a pre-LN block)
    cpu.layernormalization.native
                           ONNX LayerNormalization over the last axis (only Y asked for) on the same
                           kernel: ConvNeXt's channel norm on [N, H, W, C], Swin's and MobileViT's norms
    cpu.rmsnorm.native     kiln::RMSNorm on the LayerNorm kernel without the mean
    cpu.layernormquantize.native
                           kiln::LayerNormQuantize (uint8/int8): the LayerNorm's y quantized as it is stored, an
                           8-bit residual dequantized as it is read (QDQ BERT's norms)
    cpu.add.native         Add of float32 tensors, one repeating over the other's rows
    cpu.gather.native      Gather of rows of a constant float32 table by int64 ids (an embedding)

and attention.py's cpu.attention.native. Why: with these an exported encoder's layers from the embeddings to the
last LayerNorm are all native, and a run is one call into the segment loop instead of a Python step and a torch
dispatch per layer (~20-50 µs each: at BERT's small shapes more than onnxruntime's whole latency). Outside a
segment each runs its kernel on torch tensors.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kiln.kernels.cpu import transformer as kernels
from kiln.plan.spec import StepSpec
from kiln.tactics.cpu.native_member import _tuned_sizes, prepared_native, sizes_config
from kiln.tactics.registry import register
from kiln.tactics.tactic import InputMeta, PlanRule, SizedPlan, Tactic
from kiln.tactics.tactic import attribute as _attr

_F32 = torch.float32


def _float(meta: InputMeta | None) -> bool:
    return meta is not None and meta.shape is not None and meta.dtype == _F32


# ---- LayerNorm -------------------------------------------------------------------------------------

def _ln_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    if not kernels.available():
        return f"kiln's transformer kernels are not built: {kernels.reason()}"
    x = inputs[0]
    if x.shape is None or len(x.shape) < 1 or x.shape[-1] < 1:
        return "the input's shape is not known"
    if len(step.outputs) > 2:
        return f"{len(step.outputs)} outputs: the norm and at most the sum x + residual"
    axis = int(_attr(step, "axis", -1))
    if axis not in (-1, len(x.shape) - 1):
        return f"normalizes from axis {axis}: only the last axis"
    for k, name in ((1, "scale"), (2, "bias")):
        w = inputs[k] if k < len(inputs) else None
        if w is None or w.shape is None:
            continue
        if not w.constant or w.dtype != _F32 or math.prod(w.shape) != x.shape[-1]:
            return f"the {name} is not a float32 constant of the normalized width {x.shape[-1]}"
    residual = inputs[3] if len(inputs) > 3 else None
    if residual is not None and residual.shape is not None:
        if residual.dtype != _F32:
            return f"residual dtype {residual.dtype}, only float32"
        if not kernels.repeats_over_rows(residual.shape, x.shape):
            return f"the residual {list(residual.shape)} does not repeat over the rows of {list(x.shape)}"
    return True


def _ln_prepare(step: StepSpec, constants: list[Any], device: torch.device):
    scale = kernels.vector(constants[1] if len(constants) > 1 else None)  # converted once, not per size
    bias = kernels.vector(constants[2] if len(constants) > 2 else None)
    epsilon = float(_attr(step, "epsilon", 1e-5))
    keep_sum = len(step.outputs) == 2  # pre-LN: the sum x + residual is the residual stream, read on

    def reads(sizes):
        return {k: _F32 for k in (0, 3) if k in sizes}

    first: list[kernels.LayerNorm] = []  # the first size's kernel: others are copies at their sizes (at_size)

    def build(sizes):
        if first:
            return first[0].at_size(sizes[0], sizes.get(3))
        first.append(kernels.LayerNorm(sizes[0], scale, bias, epsilon, sizes.get(3), keep_sum=keep_sum))
        return first[0]

    def sized(sizes):  # at_size's fields, without the copy
        size = sizes[0]
        first[0].check_width(size)
        return SizedPlan((size, size) if keep_sum else (size,), kernels.LayerNorm.size_fields(size, sizes.get(3)))

    return prepared_native(step, reads, build, max_rank=3,
                           plan_at=PlanRule(sized, ("layer_norm", _tuned_sizes(step)[0][-1], keep_sum), traceable=True))


register(Tactic(
    name="cpu.layernorm.native", op_type="LayerNorm", domain="kiln", device="cpu", dtypes=(_F32,),
    supports=_ln_supports, configure=sizes_config, prepare=_ln_prepare, available=kernels.available, native=True,
    description="LayerNorm (+ residual) over the last axis in kiln's C, a native-segment member",
))


def _onnx_ln_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    if any(step.outputs[1:]):
        return "the Mean or InvStdDev output is asked for"
    if int(_attr(step, "stash_type", 1)) != 1:
        return "stash_type is not float32"
    return _ln_supports(step, inputs[:3])


register(Tactic(
    name="cpu.layernormalization.native", op_type="LayerNormalization", domain="", device="cpu", dtypes=(_F32,),
    # ai.onnx LayerNormalization (x, scale, bias) is kiln::LayerNorm without the residual
    supports=_onnx_ln_supports, configure=sizes_config, prepare=_ln_prepare, available=kernels.available,
    native=True, description="ONNX LayerNormalization over the last axis in kiln's C, a native-segment member",
))


# ---- LayerNormQuantize (8-bit y, 8-bit or float residual) --------------------------------------------

_EIGHT = (torch.uint8, torch.int8)


def _one_constant(meta: InputMeta | None, dtypes: tuple) -> bool:
    return meta is not None and meta.constant and meta.shape is not None and math.prod(meta.shape) == 1 and \
        meta.dtype in dtypes


def _lnq_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    # LayerNormQuantize(x, γ, β, [r], y_scale, y_zero, [r_scale, r_zero]): outputs (y_q) only on the CPU
    if len(step.outputs) != 1:
        return "the float y is also an output (the CUDA kernel writes both)"
    if len(inputs) not in (6, 8):
        return f"{len(inputs)} inputs: the residual's scale comes with its zero point on the CPU"
    if not _one_constant(inputs[4], (_F32,)) or not _one_constant(inputs[5], _EIGHT):
        return "y's scale / zero point are not one float32 / uint8 / int8 constant each"
    residual = inputs[3]
    if len(inputs) == 8:
        if residual is None or residual.dtype not in _EIGHT:
            return f"a residual scale with a residual of {None if residual is None else residual.dtype}"
        if not _one_constant(inputs[6], (_F32,)) or not _one_constant(inputs[7], (residual.dtype,)):
            return "the residual's scale / zero point are not one float32 / its dtype's constant each"
        inputs = [*inputs[:3], InputMeta(shape=residual.shape, dtype=_F32, constant=residual.constant)]
    return _ln_supports(step, inputs[:4])


def _lnq_prepare(step: StepSpec, constants: list[Any], device: torch.device):
    scale = kernels.vector(constants[1] if len(constants) > 1 else None)
    bias = kernels.vector(constants[2] if len(constants) > 2 else None)
    epsilon = float(_attr(step, "epsilon", 1e-5))
    y_zero = constants[5]
    out_quant = (float(constants[4].reshape(-1)[0]), int(y_zero.reshape(-1)[0]), y_zero.dtype)
    residual_quant = None
    if len(constants) == 8:
        r_zero = constants[7]
        residual_quant = (float(constants[6].reshape(-1)[0]), int(r_zero.reshape(-1)[0]), r_zero.dtype)

    def reads(sizes):
        return {k: (residual_quant[2] if k == 3 and residual_quant else _F32) for k in (0, 3) if k in sizes}

    first: list[kernels.LayerNormQuantize] = []

    def build(sizes):
        if first:
            return first[0].at_size(sizes[0], sizes.get(3))
        first.append(kernels.LayerNormQuantize(sizes[0], scale, bias, epsilon, sizes.get(3), out_quant,
                                               residual_quant))
        return first[0]

    def sized(sizes):  # at_size's fields (rows, residual rows: LayerNorm's), without the copy
        size = sizes[0]
        first[0].check_width(size)
        return SizedPlan((size,), kernels.LayerNorm.size_fields(size, sizes.get(3)))

    return prepared_native(step, reads, build, max_rank=3,
                           plan_at=PlanRule(sized, ("layer_norm_quantize", _tuned_sizes(step)[0][-1]), traceable=True))


register(Tactic(
    name="cpu.layernormquantize.native", op_type="LayerNormQuantize", domain="kiln", device="cpu", dtypes=(_F32,),
    supports=_lnq_supports, configure=sizes_config, prepare=_lnq_prepare, available=kernels.available, native=True,
    description="LayerNorm (+ an 8-bit or float residual) with its uint8/int8 QuantizeLinear in the store, in kiln's "
                "C, a native-segment member",
))


# ---- RMSNorm (kiln::RMSNorm: T5, Llama-style encoders) ---------------------------------------------

def _rms_prepare(step: StepSpec, constants: list[Any], device: torch.device):
    scale = kernels.vector(constants[1] if len(constants) > 1 else None)
    epsilon = float(_attr(step, "epsilon", 1e-6))
    width = _tuned_sizes(step)[0][-1]

    def sized(sizes):  # the kernel's fields that follow the size (LayerNorm's), without building it
        size = sizes[0]
        if not size or size[-1] != width:
            raise ValueError(f"rms norm: rows of {size[-1] if size else 0}, built for {width}")
        return SizedPlan((size,), kernels.LayerNorm.size_fields(size, None))

    # a size rule (as LayerNorm's): a segment's view at new sizes writes the rows, never builds the kernel, and its
    # walk is traced (llama_tiny's segments walked at every new shape without it, ~1-6 ms a shape: the norm's
    # NativeStep made at the call; bench/results/first-shape-2026-12-06.md)
    return prepared_native(step, lambda sizes: {0: _F32},
                           lambda sizes: kernels.LayerNorm(sizes[0], scale, None, epsilon, rms=True),
                           plan_at=PlanRule(sized, ("rms_norm", width), traceable=True))


register(Tactic(
    name="cpu.rmsnorm.native", op_type="RMSNorm", domain="kiln", device="cpu", dtypes=(_F32,),
    # kiln::RMSNorm (x, scale) passes LayerNorm's checks as they are: one output, no bias, no residual
    supports=_ln_supports, configure=sizes_config, prepare=_rms_prepare, available=kernels.available, native=True,
    description="RMSNorm over the last axis in kiln's C (the LayerNorm kernel without the mean), a native-segment "
                "member",
))


# ---- Add -------------------------------------------------------------------------------------------

def _add_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    if not kernels.available():
        return f"kiln's transformer kernels are not built: {kernels.reason()}"
    if len(inputs) != 2 or not _float(inputs[0]) or not _float(inputs[1]):
        return "only float32 tensors of known shapes"
    a, b = inputs[0].shape, inputs[1].shape
    big, small = (a, b) if math.prod(a) >= math.prod(b) else (b, a)
    if not big or not kernels.repeats_over_rows(small, big):
        return f"{list(small)} does not repeat over the rows of {list(big)}"
    return True


def _add_prepare(step: StepSpec, constants: list[Any], device: torch.device):
    tuned = _tuned_sizes(step)
    swapped_tuned = kernels.Add.size_fields(tuned[0], tuned[1])[0]

    def sized(sizes):  # the kernel's fields without the kernel; its operands on the sides they were tuned on
        swapped, out, fields = kernels.Add.size_fields(sizes[0], sizes[1])
        if swapped != swapped_tuned:  # the larger operand changed sides: other memory fields
            raise ValueError(f"add {list(sizes[0])} + {list(sizes[1])}: the larger operand is on the other side")
        return SizedPlan((out,), fields)

    return prepared_native(step, lambda sizes: {0: _F32, 1: _F32}, lambda sizes: kernels.Add(sizes[0], sizes[1]),
                           max_rank=3, plan_at=PlanRule(sized, ("add", swapped_tuned), traceable=True))


register(Tactic(
    name="cpu.add.native", op_type="Add", domain="", device="cpu", dtypes=(_F32,),
    supports=_add_supports, configure=sizes_config, prepare=_add_prepare, available=kernels.available, native=True,
    description="Add (one operand's rows repeating over the other's) in kiln's C, a native-segment member",
))


# ---- Gather (embedding) ----------------------------------------------------------------------------

def _gather_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    if not kernels.available():
        return f"kiln's transformer kernels are not built: {kernels.reason()}"
    table, ids = inputs[0], inputs[1] if len(inputs) > 1 else None
    if not table.constant or table.dtype != _F32 or table.shape is None or len(table.shape) != 2:
        return "the table is not a float32 constant matrix of the engine"
    if int(_attr(step, "axis", 0)) not in (0, -2):
        return "gathers along another axis than the rows"
    if ids is None or ids.shape is None or ids.dtype != torch.int64 or ids.constant:
        return "the indices are not int64 computed at run time"
    return True


def _gather_prepare(step: StepSpec, constants: list[Any], device: torch.device):
    table = constants[0].detach().to(_F32).contiguous()  # converted once, not per input size
    n = int(table.shape[1])

    def sized(sizes):  # the kernel's size fields without the kernel
        out, fields = kernels.GatherRows.size_fields(sizes[1], n)
        return SizedPlan((out,), fields)

    return prepared_native(step, lambda sizes: {1: torch.int64}, lambda sizes: kernels.GatherRows(table, sizes[1]),
                           plan_at=PlanRule(sized, ("gather_rows", n), traceable=True))


register(Tactic(
    name="cpu.gather.native", op_type="Gather", domain="", device="cpu", dtypes=(_F32,),
    supports=_gather_supports, configure=sizes_config, prepare=_gather_prepare, available=kernels.available,
    native=True, description="rows of a constant table by int64 ids (an embedding) in kiln's C, a native-segment member",
))
