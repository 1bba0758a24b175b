"""kiln::PackedAttention on CUDA: varlen flash attention over the real tokens (kiln/ops/tokens.py).

q, k, v arrive packed, [T, ...] (T: the real tokens of a padding-free run, kiln/passes/remove_padding.py),
row b's tokens at [cu_seqlens[b], cu_seqlens[b + 1]). FlashAttention-2's varlen kernel takes exactly that:
per sequence, softmax(q·kᵀ·scale)·v over its own tokens, no mask tensor and no padding computed. Rows past
cu_seqlens[-1] (dummy rows of a token bucket) are not written; they are never scattered out. The identity
packing of a padded mask (T = B·S: every position a row, where packing would not pay; TokenIndex marks it by
B + 2 cu_seqlens entries) runs kiln's Triton flash kernel with the padding mask instead, as the plain engine's
attention does. (A mask without padding packs to the same rows with B + 1 entries: varlen, as the builder's
all-ones example inputs time it.)
The longest sequence is bounded by the mask's width S (a host int: no sync, so the layer can be captured in a
CUDA graph); the kernel skips the query blocks past each sequence's own length.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from kiln.plan.spec import StepSpec
from kiln.tactics.cuda.attention import attention_views, output_buffer
from kiln.tactics.cuda.library import triton_available
from kiln.tactics.registry import register
from kiln.tactics.tactic import InputMeta, Tactic, attribute

_HALF = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 128  # kiln's Triton flash kernel's (kiln/kernels/cuda/triton/attention.py), which the identity
# packing runs; at 128 its 128x64 tiles of 3 stages fit sm_90's shared memory with a padding mask's key vector
_HEADS_LAYOUT = [0, 2, 1, 3]  # [B, S, H, D] -> [B, H, S, D]: the only 4-D layout a packed [T, H, D] can come from


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """A packed [T, H·D] (with `heads`) or [T, H, D] input as [T, H, D] (a view)."""
    return x.unflatten(-1, (heads, -1)) if x.dim() == 2 else x


def packed_qkv(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
               attributes: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The three [T, H, D] views of PackedAttention's packed inputs (qkv_split: q holds q|k|v side by side)."""
    split = attributes.get("qkv_split")
    if split:
        q, k, v = torch.split(q, list(split), dim=-1)  # [T, Wq], [T, Wk], [T, Wv]
    return (_heads(q, attributes.get("q_num_heads") or 0), _heads(k, attributes.get("kv_num_heads") or 0),
            _heads(v, attributes.get("kv_num_heads") or 0))


def _supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    for name in ("q_perm", "k_perm", "v_perm", "out_perm"):
        perm = attribute(step, name, None)
        if perm is not None and list(perm) != _HEADS_LAYOUT:
            return f"{name} {list(perm)}: varlen flash reads and writes [T, H, D] (permutation {_HEADS_LAYOUT})"
    split = attribute(step, "qkv_split", None)
    q = inputs[0].shape
    if q is None or len(q) not in (2, 3):
        return "q is not packed [T, H·D] or [T, H, D]"
    if len(q) == 2 and not attribute(step, "q_num_heads", 0):
        return "a 2-D q without q_num_heads"
    width = split[0] if split else q[-1]
    head_dim = width // attribute(step, "q_num_heads", 1) if len(q) == 2 else q[-1]
    if head_dim % 8 or head_dim > MAX_HEAD_DIM:
        return f"head dim {head_dim}: flash attention takes multiples of 8, and kiln's Triton kernel (the identity " \
               f"packing's) up to {MAX_HEAD_DIM}"
    return True


def flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, longest: int,
                 scale: float) -> torch.Tensor:
    """q [T, H, D], k/v [T, Hkv, D], cu_seqlens [B + 1] int32 -> [T, H, Dv]: per sequence b, softmax(q·kᵀ·scale)·v
    over its tokens [cu_seqlens[b], cu_seqlens[b + 1]); `longest` bounds every sequence's length."""
    return torch.ops.aten._flash_attention_forward(q, k, v, cu_seqlens, cu_seqlens, longest, longest, 0.0, False,
                                                   False, scale=scale)[0]


def varlen_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, longest: int,
                scale: float) -> torch.Tensor:
    """flash_varlen's contract through torch.nn.attention.varlen (its backend picks FlashAttention or cuDNN)."""
    from torch.nn.attention import varlen  # a torch module, imported when the tactic runs (not in every torch)

    gqa = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}  # a keyword older torch versions lack
    return varlen.varlen_attn(q, k, v, cu_seqlens, cu_seqlens, longest, longest, scale=scale, **gqa)


def identity_attention(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, mask: torch.Tensor,
                       attributes: dict[str, Any]) -> torch.Tensor:
    """The identity packing (every position a row, kiln/ops/tokens.py): attention on [B, S, ...] views of the
    rows, the padding keys hidden by the mask, in kiln's Triton flash kernel (the plain engine's); out [B·S, ...]."""
    kernels = importlib.import_module("kiln.kernels.cuda.triton.attention")
    rows = mask.shape
    q4, k4, v4 = attention_views(*(None if x is None else x.unflatten(0, rows) for x in (q, k, v)), attributes)
    buffer, out = output_buffer(q4, v4, attributes.get("out_perm"))
    config = kernels.AttentionConfig(128, 64, num_warps=4, num_stages=3)  # the first of the tactics' tile list
    kernels.flash_attention(q4, k4, v4, (mask != 0)[:, None, None, :], scale=attributes.get("scale", 1.0),
                            nan_to_zero=True, out=out, config=config)
    result = buffer.flatten(-2) if attributes.get("out_merge_heads") else buffer  # [B, S, ...]
    return result.flatten(0, 1)


def _prepare(step: StepSpec, constants: list[Any], device: torch.device, kernel: str = "flash_varlen"):
    def launch(ctx, q, k, v, mask, index, scatter, cu_seqlens, **attributes):
        if cu_seqlens.shape[0] == mask.shape[0] + 2:  # the identity packing of a padded mask: keys to hide
            return identity_attention(q, k, v, mask, attributes)
        q3, k3, v3 = packed_qkv(q, k, v, attributes)  # [T, H, D], [T, Hkv, D] x2
        q3, k3, v3 = (x if x.stride(-1) == 1 else x.contiguous() for x in (q3, k3, v3))
        longest = mask.shape[1]  # an upper bound of every row's tokens, known on the host
        if q3.shape[0] == 0:  # no real token in the whole batch
            out = q3.new_zeros((0, q3.shape[1], v3.shape[-1]))
        else:
            out = KERNELS[kernel](q3, k3, v3, cu_seqlens, longest, attributes.get("scale", 1.0))  # [T, H, Dv]
        return out.flatten(-2) if attributes.get("out_merge_heads") else out

    return launch


# by name, looked up at each call (tests/unit/test_remove_padding.py stands a CPU version in for flash_varlen)
KERNELS = {"flash_varlen": lambda *args: flash_varlen(*args), "varlen_attn": lambda *args: varlen_attn(*args)}


def _flash_available() -> bool:
    return torch.cuda.is_available() and triton_available() and hasattr(torch.ops.aten, "_flash_attention_forward")


def _varlen_available() -> bool:
    return torch.cuda.is_available() and triton_available() \
        and importlib.util.find_spec("torch.nn.attention.varlen") is not None


register(Tactic(
    name="cuda.packed_attention.flash_varlen", op_type="PackedAttention", domain="kiln", device="cuda",
    dtypes=_HALF, supports=_supports, prepare=_prepare, available=_flash_available,
    description="FlashAttention-2 varlen (torch.ops.aten._flash_attention_forward with cumulative sequence "
                "lengths): each sequence's real tokens only, no mask, no padding",
))
register(Tactic(
    name="cuda.packed_attention.varlen_attn", op_type="PackedAttention", domain="kiln", device="cuda",
    dtypes=_HALF, supports=_supports, available=_varlen_available,
    prepare=lambda step, constants, device: _prepare(step, constants, device, "varlen_attn"),
    description="torch.nn.attention.varlen.varlen_attn (FlashAttention or cuDNN, as torch picks): the same "
                "contract as flash_varlen",
))
