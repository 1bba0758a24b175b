"""CPU tactic for kiln::Attention on kiln's own C kernel (kiln/kernels/cpu/transformer.py Attention), a
native-segment member (native_member.py):

    cpu.attention.native   kiln::Attention: q/k/v at the strides its layout attributes give (a packed
                           qkv, heads split and permuted), additive or boolean mask, causal, GQA

attention_plan computes the views of q, k, v, the mask and the output from the input sizes alone, with torch's
view arithmetic and no tensor (it runs per layer at every new input size); tokens.py's PackedAttention plans
with it too, and shares kernels through shared_attention.
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
from kiln.tactics.cpu.native_member import prepared_native, sizes_config
from kiln.tactics.registry import register
from kiln.tactics.tactic import InputMeta, PlanRule, SizedPlan, Tactic, tensor_input

_F32 = torch.float32


def _contiguous(size: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """A row-major tensor of `size` as (shape, strides, storage offset), as torch.empty(size) has them. Plain
    arithmetic on the dims (no int()): a traced rule (kiln/tactics/traced_rules.py) follows it as expressions."""
    strides, step = [], 1
    for d in reversed(size):
        strides.append(step)
        step *= max(d, 1)
    return tuple(size), tuple(reversed(strides)), 0


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
        if quant and attrs.get("float8_quant"):
            refused = "a float8 (E4M3) quantized attention: the kernel reads and writes uint8"
        elif quant and not all(name in quant for name in ("q_quant", "k_quant", "v_quant")):
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

    return prepared_native(step, reads, build, plan_at=PlanRule(sized, ("attention", described, mask_dtype), traceable=True))


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
