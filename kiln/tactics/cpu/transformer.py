"""CPU tactics for a transformer's layers besides its GEMMs, on kiln's own C kernels
(kiln/kernels/cpu/transformer.py), each runnable inside a native segment:

    cpu.layernorm.native   kiln::LayerNorm over the last axis (+ a residual repeating over the rows; the sum
                           as a second output in a pre-LN block)
    cpu.layernormalization.native
                           ONNX LayerNormalization over the last axis (only Y asked for) on the same
                           kernel: ConvNeXt's channel norm on [N, H, W, C], Swin's and MobileViT's norms
    cpu.attention.native   kiln::Attention: q/k/v at the strides its layout attributes give (a packed
                           qkv, heads split and permuted), additive or boolean mask, causal, GQA
    cpu.add.native         Add of float32 tensors, one repeating over the other's rows
    cpu.gather.native      Gather of rows of a constant float32 table by int64 ids (an embedding)

Why: with these an exported encoder's layers from the embeddings to the last LayerNorm are all native,
and a run is one call into the segment loop instead of a Python step and a torch dispatch per layer
(~20-50 µs each: at BERT's small shapes more than onnxruntime's whole latency). Outside a segment each
runs its kernel on torch tensors.

A kernel is bound per input sizes (`at` gets every read's size): sizes are only plan fields, so binding
at a new shape costs a few ctypes calls, not a rebuild.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kiln.kernels.cpu import transformer as kernels
from kiln.plan.spec import StepSpec
from kiln.tactics.registry import register
from kiln.tactics.tactic import (InputMeta, NativeStep, PlanRule, SizedPlan, Tactic, resizable, same_primitive,
                                  tensor_input)
from kiln.tactics.tactic import attribute as _attr

_F32 = torch.float32
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
        else PlanRule(lambda sizes: plan_at(read_sizes(sizes)[1]), plan_at.key)

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
                           plan_at=PlanRule(sized, ("layer_norm", _tuned_sizes(step)[0][-1], keep_sum)))


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


# ---- RMSNorm (kiln::RMSNorm: T5, Llama-style encoders) ---------------------------------------------

def _rms_prepare(step: StepSpec, constants: list[Any], device: torch.device):
    scale = kernels.vector(constants[1] if len(constants) > 1 else None)
    epsilon = float(_attr(step, "epsilon", 1e-6))
    return prepared_native(step, lambda sizes: {0: _F32},
                           lambda sizes: kernels.LayerNorm(sizes[0], scale, None, epsilon, rms=True))


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
                           max_rank=3, plan_at=PlanRule(sized, ("add", swapped_tuned)))


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
                           plan_at=PlanRule(sized, ("gather_rows", n)))


register(Tactic(
    name="cpu.gather.native", op_type="Gather", domain="", device="cpu", dtypes=(_F32,),
    supports=_gather_supports, configure=sizes_config, prepare=_gather_prepare, available=kernels.available,
    native=True, description="rows of a constant table by int64 ids (an embedding) in kiln's C, a native-segment member",
))


# ---- Attention -------------------------------------------------------------------------------------

def _contiguous(size: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """A row-major tensor of `size` as (shape, strides, storage offset), as torch.empty(size) has them."""
    strides, step = [], 1
    for d in reversed(size):
        strides.append(step)
        step *= max(int(d), 1)
    return tuple(int(d) for d in size), tuple(reversed(strides)), 0


def _view_strides(shape: tuple[int, ...], strides: tuple[int, ...], new_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides torch.Tensor.view gives a tensor of (shape, strides) viewed as new_shape (ATen's
    computeStride, size-1 axes included, so plans match those made from meta tensors); ValueError when
    no view exists."""
    new_strides = [0] * len(new_shape)
    view_d = len(new_shape) - 1
    chunk_base = strides[-1] if strides else 1
    tensor_numel = view_numel = 1
    for d in range(len(shape) - 1, -1, -1):
        tensor_numel *= shape[d]
        if d == 0 or (shape[d - 1] != 1 and strides[d - 1] != tensor_numel * chunk_base):
            while view_d >= 0 and (view_numel < tensor_numel or new_shape[view_d] == 1):
                new_strides[view_d] = view_numel * chunk_base
                view_numel *= new_shape[view_d]
                view_d -= 1
            if view_numel != tensor_numel:
                raise ValueError(f"{list(shape)} (strides {list(strides)}) has no view as {list(new_shape)}")
            if d > 0:
                chunk_base, tensor_numel, view_numel = strides[d - 1], 1, 1
    if view_d != -1:
        raise ValueError(f"{list(shape)} has no view as {list(new_shape)}")
    return tuple(new_strides)


def _unflatten_last(view: tuple, parts: int) -> tuple:
    """view.unflatten(-1, (parts, -1))."""
    shape, strides, offset = view
    if parts < 1 or shape[-1] % parts:
        raise ValueError(f"the last axis of {list(shape)} does not split into {parts} heads")
    new_shape = (*shape[:-1], parts, shape[-1] // parts)
    return new_shape, _view_strides(shape, strides, new_shape), offset


@dataclass(frozen=True, slots=True)
class _AttentionAttributes:
    """A kiln::Attention's attributes as attention_plan reads them, parsed once per layer (its rule at a new input
    size then does only the size arithmetic): the values and the checks that depend on the attributes alone, each
    check's answer given where attention_plan gives it."""

    split: list[int] | None  # qkv_split's widths
    q_heads: int
    kv_heads: int
    perms: dict[str, tuple[Any, tuple[int, ...], int] | None]  # name -> (as given, as ints, its rank or -1)
    gqa: bool
    out_perm: Any
    out_merge_heads: bool
    scale: float | None  # None: 1 / sqrt(D)
    causal: bool
    nan_to_zero: bool
    quant: dict[str, list[float]]
    quant_refused: str | None  # why the quantization attributes cannot be, checked in attention_plan's order

    @classmethod
    def of(cls, attrs: dict[str, Any]) -> _AttentionAttributes:
        split = attrs.get("qkv_split")
        perms = {}
        for name in ("q", "k", "v"):
            perm = attrs.get(f"{name}_perm")
            if perm:
                ints = tuple(int(p) for p in perm)
                perms[name] = (perm, ints, len(ints) if sorted(ints) == list(range(len(ints))) else -1)
            else:
                perms[name] = None
        scale = attrs.get("scale", 1.0)
        quant = {name: [float(x) for x in attrs[name]] for name in QUANT_ATTRIBUTES if attrs.get(name)}
        refused = None
        if quant and not all(name in quant for name in ("q_quant", "k_quant", "v_quant")):
            refused = "q, k and v are not all 8-bit (the kernel reads all three as uint8 or none)"
        elif "out_quant" in quant and "q_quant" not in quant:
            refused = "an 8-bit output of float inputs"
        else:
            for name, q in quant.items():  # in QUANT_ATTRIBUTES' order
                if q[0] <= 0:
                    refused = f"{name} has scale {q[0]}"
                    break
                if len(q) > 2 and (q[2], q[3]) != (0.0, 255.0):
                    refused = f"{name} quantizes to [{q[2]:g}, {q[3]:g}]: the kernel writes uint8"
                    break
        return cls([int(w) for w in split] if split else None, int(attrs.get("q_num_heads") or 0),
                   int(attrs.get("kv_num_heads") or 0), perms, bool(attrs.get("gqa")), attrs.get("out_perm"),
                   bool(attrs.get("out_merge_heads")), None if scale is None else float(scale),
                   bool(attrs.get("is_causal")), bool(attrs.get("nan_to_zero")), quant, refused)


def _head_views(parsed: _AttentionAttributes, sizes: dict[int, tuple[int, ...]]) -> dict[str, Any] | str:
    """q, k, v as the op views them ([B, H, S, D], kiln/ops/fused.py attention), computed as views are
    (shape, strides, storage offset: the arithmetic of torch's split, unflatten and permute, without a
    tensor: this runs per layer for every new input size): {name: (step input, storage offset,
    strides)} plus the dims, or why the kernel cannot."""
    if 0 not in sizes:
        return "no q"
    tensors = {k: _contiguous(sizes[k]) for k in (0, 1, 2) if k in sizes}
    q, k, v = tensors.get(0), tensors.get(1), tensors.get(2)
    source = {"q": 0, "k": 1, "v": 2}
    widths = parsed.split
    if widths:
        shape, strides, offset = q
        if not shape or sum(widths) != shape[-1]:
            return f"qkv_split {widths} does not cover the last axis of {list(shape)}"
        parts, start = [], 0
        for w in widths:  # torch.split(q, widths, dim=-1): views, each `start` columns in
            parts.append(((*shape[:-1], w), strides, offset + start * strides[-1]))
            start += w
        q, k, v = parts
        source = {"q": 0, "k": 0, "v": 0}
    if k is None or v is None:
        return "k or v is missing"
    qh, kvh = parsed.q_heads, parsed.kv_heads
    try:
        if qh and len(q[0]) == 3:
            q = _unflatten_last(q, qh)
        if kvh and len(k[0]) == 3:
            k = _unflatten_last(k, kvh)
        if kvh and len(v[0]) == 3:
            v = _unflatten_last(v, kvh)
    except ValueError as e:
        return str(e)
    views = {}
    for name, (shape, strides, offset) in (("q", q), ("k", k), ("v", v)):
        perm = parsed.perms[name]
        if perm is not None:
            given, ints, rank = perm
            if rank != len(shape):
                return f"{name}_perm {list(given)} is not a permutation of {len(shape)} axes"
            shape, strides = tuple(shape[p] for p in ints), tuple(strides[p] for p in ints)
        if len(shape) != 4 or strides[3] != 1:
            return f"{name} is not [B, H, S, D] with a contiguous last axis ({list(shape)}, strides {list(strides)})"
        views[name] = (source[name], offset, tuple(strides[:3]), tuple(shape))
    (B, H, S, D), (Bk, Hkv, T, Dk), (Bv, Hv, Tv, Dv) = views["q"][3], views["k"][3], views["v"][3]
    if not (B == Bk == Bv) or Dk != D or Tv != T or Hv != Hkv or Hkv < 1 or H % Hkv:
        return f"q {list(views['q'][3])}, k {list(views['k'][3])}, v {list(views['v'][3])} do not fit together"
    if Hkv != H and not parsed.gqa:
        return "k and v have fewer heads than q without gqa"
    return {"views": views, "dims": dict(B=B, H=H, Hkv=Hkv, S=S, T=T, D=D, Dv=Dv)}


def _expanded_strides(size: tuple[int, ...], to: tuple[int, ...]) -> tuple[int, ...]:
    """torch.empty(size).expand(to).stride(), by torch's own rule (inferExpandGeometry): a new leading
    axis has the stride of the axes after it, and an axis broadcast from 1 has stride 0."""
    _, strides, _ = _contiguous(size)
    out: list[int] = [0] * len(to)
    lead = len(to) - len(size)
    for i in range(len(to) - 1, -1, -1):
        if i >= lead:
            have, stride = size[i - lead], strides[i - lead]
        else:
            have, stride = 1, to[i + 1] * out[i + 1] if i + 1 < len(to) else 1
        out[i] = 0 if have != to[i] else stride
    return tuple(out)


def attention_plan(attrs: dict[str, Any], sizes: dict[int, tuple[int, ...]], mask_dtype: torch.dtype | None,
                   parsed: _AttentionAttributes | None = None):
    """Everything kernels.Attention needs at these sizes, or why not. `parsed`: _AttentionAttributes.of(attrs), when
    the caller keeps it (a layer's rule at new input sizes)."""
    parsed = parsed if parsed is not None else _AttentionAttributes.of(attrs)
    found = _head_views(parsed, sizes)
    if isinstance(found, str):
        return found
    dims = found["dims"]
    B, H, S, T, Dv = dims["B"], dims["H"], dims["S"], dims["T"], dims["Dv"]
    mask = None
    if 3 in sizes:
        if mask_dtype not in (_F32, torch.bool):
            return f"mask dtype {mask_dtype}: only float32 (added) or bool"
        m = tuple(sizes[3])
        if len(m) > 4 or any(d not in (1, want) for d, want in zip(reversed(m), (T, S, H, B))):
            return f"the mask {list(m)} does not broadcast to [B, H, S, T] = {[B, H, S, T]}"
        mask = ("add" if mask_dtype == _F32 else "bool", _expanded_strides(m, (B, H, S, T)))
    out_perm = parsed.out_perm
    shape = [B, H, S, Dv]
    permuted = [shape[i] for i in out_perm] if out_perm else shape
    _, out_strides, _ = _contiguous(tuple(permuted))
    if out_perm:
        inverse = [0] * 4
        for i, p in enumerate(out_perm):
            inverse[p] = i
        out_strides = tuple(out_strides[i] for i in inverse)  # [B, H, S, Dv] over the output's memory
    if out_strides[3] != 1:
        return "the output's last axis would not be contiguous"
    output_size = (*permuted[:2], permuted[2] * permuted[3]) if parsed.out_merge_heads else tuple(permuted)
    scale = 1.0 / math.sqrt(dims["D"]) if parsed.scale is None else parsed.scale
    causal = parsed.causal and 3 not in sizes
    views = {name: view[:3] for name, view in found["views"].items()}
    if parsed.quant_refused is not None:
        return parsed.quant_refused
    quant = {name: list(q) for name, q in parsed.quant.items()}  # the caller's own lists
    return dict(dims=dims, q=views["q"], k=views["k"], v=views["v"], out_strides=tuple(out_strides[:3]),
                output_size=output_size, mask=mask, scale=scale, causal=causal,
                nan_to_zero=parsed.nan_to_zero, quant=quant or None)


# kiln::Attention's quantization attributes (kiln/ops/fused.py attention): an explicitly quantized graph's
QUANT_ATTRIBUTES = ("q_quant", "k_quant", "v_quant", "score_quant", "prob_quant", "out_quant")


def _input_dtype(attrs: dict[str, Any]) -> torch.dtype:
    """What q, k and v are: uint8 in a quantized attention."""
    return torch.uint8 if attrs.get("q_quant") else _F32


def _attention_attributes(step: StepSpec) -> dict[str, Any]:
    return {k: v for k, v in step.attributes.items()}


def _attention_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    if not kernels.available():
        return f"kiln's transformer kernels are not built: {kernels.reason()}"
    if tensor_input(inputs, 4) is not None:
        return "key lengths (kiln::KeyLengths): the kernel reads the mask only"
    sizes = {k: m.shape for k, m in enumerate(inputs[:4]) if m.shape is not None}
    attrs = _attention_attributes(step)
    for k in (0, 1, 2):
        if k in sizes and inputs[k].dtype != _input_dtype(attrs):
            return f"input {k} is {inputs[k].dtype}: only {_input_dtype(attrs)} here"
    mask_dtype = inputs[3].dtype if 3 in sizes else None
    found = attention_plan(attrs, sizes, mask_dtype)
    return found if isinstance(found, str) else True


def _attention_prepare(step: StepSpec, constants: list[Any], device: torch.device):
    attrs = _attention_attributes(step)
    # the mask's dtype is fixed by the graph: float32 unless the tuned inputs said otherwise
    mask_dtype = torch.bool if step.tactic_config.get("mask_bool") else _F32

    def reads(sizes):
        found = {k: _input_dtype(attrs) for k in (0, 1, 2) if k in sizes}
        if 3 in sizes:
            found[3] = mask_dtype
        return found

    described = repr(sorted(attrs.items()))  # plain data: ints, floats, lists of ints
    parsed = _AttentionAttributes.of(attrs)  # once: a new input size does only the size arithmetic

    def planned(sizes):
        plan = attention_plan(attrs, sizes, mask_dtype if 3 in sizes else None, parsed)
        if isinstance(plan, str):
            raise ValueError(f"attention at {sizes}: {plan}")
        return plan

    def build(sizes):
        return shared_attention((described, tuple(sorted(sizes.items())), mask_dtype if 3 in sizes else None),
                                lambda: kernels.Attention(**planned(sizes)))

    def sized(sizes):  # the kernel's size fields without the kernel (the layers of a configuration share them)
        plan = planned(sizes)
        return SizedPlan((tuple(plan["output_size"]),), kernels.Attention.size_fields(**plan))

    return prepared_native(step, reads, build, plan_at=PlanRule(sized, ("attention", described, mask_dtype)))


# attention kernels by (configuration, input sizes), shared by the layers of one configuration: a kernel
# is its plan fields, and every binding (kiln/kernels/cpu/transformer.py KernelBound) has memory of its own
_SHARED_ATTENTION: OrderedDict[tuple, kernels.Attention] = OrderedDict()
_SHARED_LOCK = threading.Lock()
_SHARED_KEPT = 64


def shared_attention(key: tuple, make: Callable[[], kernels.Attention]) -> kernels.Attention:
    """The attention kernel of `key` (a layer's configuration and input sizes), made once: an encoder's attention
    layers have one configuration, so at a new input size the first makes the kernel (~0.1-0.7 ms: it holds no
    weights) and the others take it."""
    with _SHARED_LOCK:
        found = _SHARED_ATTENTION.get(key)
        if found is not None:
            _SHARED_ATTENTION.move_to_end(key)
            return found
    found = make()
    with _SHARED_LOCK:
        _SHARED_ATTENTION[key] = found
        while len(_SHARED_ATTENTION) > _SHARED_KEPT:
            _SHARED_ATTENTION.popitem(last=False)
    return found


def _attention_configure(step: StepSpec, inputs: list[InputMeta]) -> dict[str, Any]:
    config = sizes_config(step, inputs[:4])
    if len(inputs) > 3 and inputs[3].dtype == torch.bool:
        config["mask_bool"] = True
    return config


register(Tactic(
    name="cpu.attention.native", op_type="Attention", domain="kiln", device="cpu", dtypes=(_F32, torch.uint8),
    supports=_attention_supports, configure=_attention_configure, prepare=_attention_prepare,
    available=kernels.available, native=True,
    description="attention per (batch, head) in kiln's C (packed kᵀ, register tiles, vector exp), a native-segment "
                "member",
))
