"""CPU tactics for a padding-free encoder (kiln/ops/tokens.py, kiln/passes/remove_padding.py) on kiln's C
(kiln/kernels/cpu/tokens.py, attention.c), each runnable inside a native segment:

    cpu.tokenindex.native       kiln::TokenIndex: the real tokens' positions and cu_seqlens from the mask, into
                                the token bucket's T' rows (the runtime always feeds the bucket)
    cpu.packtokens.native       kiln::PackTokens: rows gathered by the token index
    cpu.unpacktokens.native     kiln::UnpackTokens: rows scattered back, zeros at padding
    cpu.paddingpositions.native kiln::PaddingPositions: RoBERTa's position ids from the input ids (nine int
                                torch steps before it, ~0.14 ms of roberta_tiny's 0.30 on a Zen 3)
    cpu.packed_attention.native kiln::PackedAttention on the packed rows: varlen (each sequence its rows
                                cu_seqlens[b] .. cu_seqlens[b + 1]); at the identity packing (T' = B·S) every
                                row of S positions with its padding keys hidden by the mask

Why: the plain BERT runs as one native segment; with these the padding-free one does too (the token ops were
torch steps splitting it in four). Each is timed against its torch form by the autotuner like any tactic.
"""

from __future__ import annotations

from typing import Any

import torch

from kiln.kernels.cpu import tokens as kernels
from kiln.kernels.cpu import transformer as transformer_kernels
from kiln.plan.spec import StepSpec
from kiln.tactics.cpu.attention import attention_plan, shared_attention
from kiln.tactics.cpu.native_member import prepared_native, sizes_config
from kiln.tactics.registry import register
from kiln.tactics.tactic import InputMeta, Tactic
from kiln.tactics.tactic import attribute as _attr

_F32 = torch.float32
_DTYPES = {str(dtype): dtype for dtype in kernels.MASK_BYTES}  # tactic_config holds the mask's dtype by name


def _built() -> bool | str:
    return True if transformer_kernels.available() else \
        f"kiln's transformer kernels are not built: {transformer_kernels.reason()}"


def _mask_reason(meta: InputMeta | None) -> str | None:
    if meta is None or meta.shape is None or len(meta.shape) != 2:
        return "the padding mask is not a [batch, seq] tensor"
    if meta.dtype not in kernels.MASK_BYTES:
        return f"the padding mask is {meta.dtype}: only {', '.join(map(str, kernels.MASK_BYTES))}"
    return None


def _configure_mask(at: int):
    """sizes_config plus the mask's dtype (step input `at`), fixed by the graph."""

    def configure(step: StepSpec, inputs: list[InputMeta]) -> dict[str, Any]:
        return {**sizes_config(step, inputs), "mask_dtype": str(inputs[at].dtype)}

    return configure


def _mask_dtype(step: StepSpec) -> torch.dtype:
    return _DTYPES[step.tactic_config["mask_dtype"]]


# ---- TokenIndex ------------------------------------------------------------------------------------

def _token_index_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    built = _built()
    if built is not True:
        return built
    reason = _mask_reason(inputs[0])
    if reason is not None:
        return reason
    if len(inputs) > 1 and inputs[1].shape is not None and len(inputs[1].shape) != 1:
        return f"the token bucket is {list(inputs[1].shape)}, not [T']"
    return True


def _token_index_configure(step: StepSpec, inputs: list[InputMeta]) -> dict[str, Any]:
    """The builder's runs feed no token bucket (T' = T): the tuned sizes then give it the mask's B·S rows, so
    that the native step reads it (a run inside a segment always has one: the runtime feeds it)."""
    config = _configure_mask(0)(step, inputs)
    if len(config["input_sizes"]) < 2:
        config["input_sizes"].append([1, [int(torch.Size(inputs[0].shape).numel())]])
    return config


def _with_bucket(mask: torch.Tensor) -> torch.Tensor:
    """A token bucket of the mask's real tokens (T' = T): what a run without one packs to."""
    return torch.empty(int(torch.count_nonzero(mask)), dtype=torch.uint8)


def _token_index_prepare(step: StepSpec, constants: list[Any], device: torch.device):
    mask_dtype = _mask_dtype(step)
    native = prepared_native(step, lambda sizes: {0: mask_dtype, 1: torch.uint8},
                             lambda sizes: kernels.TokenIndex(sizes[0], mask_dtype, sizes[1][0]))

    def launch(ctx, mask, bucket=None, **attributes):
        if bucket is not None:
            return native(ctx, mask, bucket, **attributes)
        index, scatter, cu_seqlens = native(ctx, mask, _with_bucket(mask), **attributes)
        # T' = T: a mask without padding packs to B·S rows, whose B + 2 cu_seqlens (the identity packing's) say
        # that they hold padding; without a bucket the op's are B + 1
        return index, scatter, cu_seqlens[:mask.shape[0] + 1]

    def timed(mask, bucket=None):
        return native.timed(mask, bucket if bucket is not None else _with_bucket(mask))

    launch.native, launch.timed = native.native, timed
    return launch


register(Tactic(
    name="cpu.tokenindex.native", op_type="TokenIndex", domain="kiln", device="cpu",
    dtypes=tuple(kernels.MASK_BYTES),
    supports=_token_index_supports, configure=_token_index_configure, prepare=_token_index_prepare,
    available=transformer_kernels.available, native=True,
    description="a padding mask's real tokens (index, scatter, cu_seqlens) into the token bucket's rows in kiln's "
                "C, a native-segment member",
))


# ---- PackTokens / UnpackTokens ---------------------------------------------------------------------

def _rows_reason(meta: InputMeta | None, least: int) -> str | None:
    if meta is None or meta.shape is None or meta.dtype != _F32:
        return "only float32 tensors of known shapes"
    if not least <= len(meta.shape) <= 3:  # a segment's 4-D values may be NHWC in memory
        return f"rank {len(meta.shape)}: {least} to 3"
    return None


def _pack_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    built = _built()
    if built is not True:
        return built
    reason = _rows_reason(inputs[0], 2)
    if reason is None and (len(inputs) < 2 or inputs[1].dtype != torch.int64):
        reason = "the token index is not int64"
    if reason is None and _attr(step, "broadcast", 0):
        reason = "a [1, S, ...] operand read for every row of the batch: the kernel gathers the B·S rows of x"
    return reason or True


def _pack_prepare(step: StepSpec, constants: list[Any], device: torch.device):
    return prepared_native(step, lambda sizes: {0: _F32, 1: torch.int64},
                           lambda sizes: kernels.PackRows(sizes[0], sizes[1][0]), max_rank=3)


register(Tactic(
    name="cpu.packtokens.native", op_type="PackTokens", domain="kiln", device="cpu", dtypes=(_F32,),
    supports=_pack_supports, configure=sizes_config, prepare=_pack_prepare, available=transformer_kernels.available,
    native=True, description="rows gathered by a padding-free encoder's token index in kiln's C, a native-segment "
                             "member",
))


def _unpack_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    built = _built()
    if built is not True:
        return built
    reason = _rows_reason(inputs[0], 1) or (_mask_reason(inputs[2]) if len(inputs) > 2 else "no padding mask")
    if reason is None and inputs[1].dtype != torch.int64:
        reason = "the scatter index is not int64"
    return reason or True


def _unpack_prepare(step: StepSpec, constants: list[Any], device: torch.device):
    mask_dtype, zero_padding = _mask_dtype(step), bool(_attr(step, "zero_padding", 1))
    return prepared_native(step, lambda sizes: {0: _F32, 1: torch.int64, 2: mask_dtype},
                           lambda sizes: kernels.UnpackRows(sizes[0], sizes[2], mask_dtype, zero_padding), max_rank=3)


register(Tactic(
    name="cpu.unpacktokens.native", op_type="UnpackTokens", domain="kiln", device="cpu", dtypes=(_F32,),
    supports=_unpack_supports, configure=_configure_mask(2), prepare=_unpack_prepare,
    available=transformer_kernels.available, native=True,
    description="packed rows scattered back to [batch, seq, ...] with zeros at padding in kiln's C, a native-segment "
                "member",
))


# ---- PaddingPositions ------------------------------------------------------------------------------

def _positions_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    built = _built()
    if built is not True:
        return built
    ids = inputs[0]
    if ids is None or ids.shape is None or len(ids.shape) < 1 or ids.dtype not in kernels.IDS_BYTES:
        return "the ids are not an int64 or int32 tensor of known rank"
    return True


def _positions_configure(step: StepSpec, inputs: list[InputMeta]) -> dict[str, Any]:
    return {**sizes_config(step, inputs), "ids_dtype": str(inputs[0].dtype)}


def _positions_prepare(step: StepSpec, constants: list[Any], device: torch.device):
    ids_dtype = _DTYPES[step.tactic_config["ids_dtype"]]
    padding, offset = int(_attr(step, "padding_idx", 0)), int(_attr(step, "offset", 0))
    return prepared_native(step, lambda sizes: {0: ids_dtype},
                           lambda sizes: kernels.PaddingPositions(sizes[0], ids_dtype, padding, offset), max_rank=3)


register(Tactic(
    name="cpu.paddingpositions.native", op_type="PaddingPositions", domain="kiln", device="cpu",
    dtypes=tuple(kernels.IDS_BYTES),
    supports=_positions_supports, configure=_positions_configure, prepare=_positions_prepare,
    available=transformer_kernels.available, native=True,
    description="RoBERTa's position ids (a running count of the real tokens) in kiln's C, a native-segment member",
))


# ---- PackedAttention -------------------------------------------------------------------------------

def packed_attention_plan(attrs: dict[str, Any], sizes: dict[int, tuple[int, ...]]) -> dict[str, Any] | str:
    """kernels.Attention's arguments for PackedAttention at these sizes (q/k/v [T', ...], the mask [B, S],
    cu_seqlens [B + 1], or [B + 2] at the identity packing), or why not. The packed tensors are planned as the
    unpacked attention's with one sequence of T' rows ([1, T', ...]); then varlen: sequence b starts at row
    cu_seqlens[b]; or, at the identity packing, batch b at row b·S, its padding keys hidden by the mask."""
    if 3 not in sizes or 6 not in sizes:
        return "no padding mask or cu_seqlens"
    batch, seq = sizes[3]
    rows = sizes[0][0]
    # strides do not depend on the row count: planned at one row at least (a mask of padding only packs to none,
    # and a view of no rows has no strides to give)
    plan = attention_plan(attrs, {k: (1, max(rows, 1), *sizes[k][1:]) for k in (0, 1, 2) if k in sizes}, None)
    if isinstance(plan, str):
        return plan
    if plan["causal"]:
        return "a causal attention"
    identity = sizes[6][0] == batch + 2
    if identity and rows != batch * seq:
        return f"cu_seqlens of {sizes[6][0]} entries (the identity packing) for {rows} rows of a {batch}x{seq} mask"
    longest = seq if identity else min(seq, rows)
    plan["dims"] = {**plan["dims"], "B": batch, "S": longest, "T": longest}
    for name in ("q", "k", "v"):  # (step input, offset, strides of batch, head, position)
        source, offset, (_, head, position) = plan[name]
        plan[name] = (source, offset, (seq * position if identity else 0, head, position))
    _, head, position = plan["out_strides"]
    plan["out_strides"] = (seq * position if identity else 0, head, position)
    plan["output_size"] = (rows, *plan["output_size"][2:])  # [1, T', ...] -> [T', ...]
    plan["nan_to_zero"] = True  # a row of padding only: 0 (the identity packing), as the reference
    if identity:
        plan["mask"] = ("keys", (seq, 0, 0, 1))
    else:
        plan["varlen"] = (6, rows)
    return plan


def _packed_attention_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    built = _built()
    if built is not True:
        return built
    if len(inputs) < 7 or inputs[3].dtype != torch.int64 or inputs[6].dtype != torch.int32:
        return "the padding mask is not int64 or cu_seqlens not int32 (the identity packing reads the mask's keys)"
    sizes = {k: m.shape for k, m in enumerate(inputs[:7]) if m.shape is not None}
    for k in (0, 1, 2):
        if k in sizes and inputs[k].dtype != _F32:
            return f"input {k} is {inputs[k].dtype}: only float32"
    found = packed_attention_plan(dict(step.attributes), sizes)
    return found if isinstance(found, str) else True


def _packed_attention_configure(step: StepSpec, inputs: list[InputMeta]) -> dict[str, Any]:
    """sizes_config, cu_seqlens at B·S rows as the runtime has them: the identity packing's B + 2 entries (the
    builder's runs feed a mask of ones and no bucket, whose cu_seqlens has B + 1: tuned so, this layer's sizes
    would not chain with the native TokenIndex's and a segment would end here)."""
    config = sizes_config(step, inputs)
    sizes = {k: size for k, size in config["input_sizes"]}
    if 0 in sizes and 3 in sizes and 6 in sizes and sizes[0][0] == sizes[3][0] * sizes[3][1] \
            and sizes[6] == [sizes[3][0] + 1]:
        config["input_sizes"] = [[k, [sizes[3][0] + 2] if k == 6 else size] for k, size in config["input_sizes"]]
    return config


def _packed_attention_prepare(step: StepSpec, constants: list[Any], device: torch.device):
    attrs = dict(step.attributes)
    described = repr(sorted(attrs.items()))  # plain data: ints, floats, lists of ints

    def reads(sizes):
        return {**{k: _F32 for k in (0, 1, 2) if k in sizes}, 3: torch.int64, 6: torch.int32}

    def build(sizes):
        def make():
            plan = packed_attention_plan(attrs, sizes)
            if isinstance(plan, str):
                raise ValueError(f"packed attention at {sizes}: {plan}")
            return transformer_kernels.Attention(**plan)

        return shared_attention(("packed", described, tuple(sorted(sizes.items()))), make)

    return prepared_native(step, reads, build)


register(Tactic(
    name="cpu.packed_attention.native", op_type="PackedAttention", domain="kiln", device="cpu", dtypes=(_F32,),
    supports=_packed_attention_supports, configure=_packed_attention_configure, prepare=_packed_attention_prepare,
    available=transformer_kernels.available, native=True,
    description="attention over packed rows per sequence (varlen, cu_seqlens) in kiln's C, the identity packing "
                "with its padding keys hidden, a native-segment member",
))
