"""Padding-free encoders: kiln-domain ops that pack a batch's real tokens and scatter them back.

A padding mask m [B, S] (nonzero: a real token) selects T = Σ(m ≠ 0) of the B·S positions. Its
token index is the flat positions of those tokens in row-major order,

    index = [b·S + s for b in 0..B-1 for s in 0..S-1 if m[b, s] ≠ 0]        # [T], int64
    cu_seqlens = [0, n_0, n_0 + n_1, ..., T],  n_b = Σ_s (m[b, s] ≠ 0)      # [B + 1], int32

so row b's tokens are index[cu_seqlens[b] : cu_seqlens[b + 1]], in their order along the sequence
(any pattern: right or left padding, holes). Per-token layers run on [T, ...] instead of
[B, S, ...]; attention, the one layer that mixes tokens, runs per row over that row's tokens
(kiln/passes/remove_padding.py builds the region; kiln/tactics/cuda/packed_attention.py has the
varlen flash tactic). A run may carry T' ≥ T rows (a token bucket, so CUDA graphs replay): the
dummy rows past T are computed like any other and never scattered out.

T' = B·S is the identity packing: every position is a row, in place (index = scatter = 0..B·S-1), so packing
and unpacking are views and attention masks the padding keys as the unpacked model does. The runtime asks for
it where packing would not pay (kiln/runtime/buckets.py token_bucket), and a mask without padding is one.
"""

from __future__ import annotations

import torch

from kiln.ops.fused import attention
from kiln.ops.registry import register


@register("TokenIndex", domain="kiln")
def token_index(ctx, mask, bucket=None):
    """mask [B, S] -> (index [T'], scatter [T'], cu_seqlens [B + 1] int32): the real tokens' flat positions (the
    module docstring's definitions), twice, and each row's start in the packed order.

    Without `bucket`, T' = T (on CUDA the nonzero synchronizes once with the host: T is data). With it, T' is
    bucket.shape[0] ≥ T (the runtime's token bucket, kiln/runtime/buckets.py; only its shape is read): no
    sync, so a CUDA graph per bucket replays any mask with at most T' tokens. The T' - T rows past the real
    ones are dummies: `index` (what PackTokens gathers) points them at position 0, `scatter` (where
    UnpackTokens writes) at B·S, a row it drops; no sequence of cu_seqlens holds them. A bucket of B·S rows is
    the identity packing (the module docstring): index = scatter = 0..B·S-1, and cu_seqlens has B + 2 entries,
    0, S, 2S, ..., B·S and B·S again: its length says that the rows hold padding an attention must hide (B + 1
    entries: every row a real token, as a mask without padding packs exactly to the same rows)."""
    keep = (mask != 0).reshape(-1)  # [B·S]
    if bucket is not None and bucket.shape[0] == keep.numel():
        index = torch.arange(keep.numel(), device=mask.device)
        spans = torch.arange(0, keep.numel() + mask.shape[1] + 1, mask.shape[1], dtype=torch.int32, device=mask.device)
        return index, index, spans.clamp_(max=keep.numel())  # [B + 2]: 0, S, ..., B·S, B·S
    counts = keep.reshape(mask.shape).sum(dim=1, dtype=torch.int32)  # [B]
    cu_seqlens = torch.zeros(mask.shape[0] + 1, dtype=torch.int32, device=mask.device)
    torch.cumsum(counts, dim=0, dtype=torch.int32, out=cu_seqlens[1:])
    if bucket is None:
        index = keep.nonzero().reshape(-1)  # [T]
        return index, index, cu_seqlens
    size, positions = bucket.shape[0], keep.numel()
    real = torch.cumsum(keep, 0)  # [B·S]: real tokens up to each position, itself included
    flat = torch.arange(positions, device=mask.device)
    # a real token's packed row; a padding position a slot of its own past the T' rows (dropped): one write per
    # slot, where one shared slot took a write per padding position, serialized on a GPU (~16K of them in a run
    # padded to BERT's 32x512 for packing, kiln/runtime/buckets.py graph_rows)
    slot = torch.where(keep, real - 1, size + flat - real)
    index = torch.zeros(size + positions, dtype=torch.int64, device=mask.device).scatter_(0, slot, flat)
    scatter = torch.full((size + positions,), positions, dtype=torch.int64, device=mask.device).scatter_(0, slot, flat)
    return index[:size], scatter[:size], cu_seqlens


@register("PaddingPositions", domain="kiln")
def padding_positions(ctx, ids, *, padding_idx, offset):
    """ids [..., S] -> int64 [..., S]: each real token's position along the last axis counted over the real
    tokens only, 1-based, plus `offset`; `offset` at padding (ids == padding_idx):

        keep = ids != padding_idx
        positions = cumsum(keep, -1) · keep + offset

    RoBERTa's position ids (transformers' create_position_ids_from_input_ids, offset = padding_idx + the past
    length; XLM-R, CamemBERT, Longformer... share it), which its exporter writes as nine int steps
    (kiln/passes/fusion/padding_positions.py)."""
    keep = (ids != padding_idx).to(torch.int64)  # [..., S]
    return torch.cumsum(keep, dim=-1) * keep + offset


@register("KeyLengths", domain="kiln")
def key_lengths(ctx, mask):
    """mask [B, S] -> int32 [B]: n_b where row b's real tokens (m ≠ 0) are its first n_b positions (right padding,
    no padding, or none at all: 0), -1 where they are not (left padding, holes). An attention given these lengths
    (kiln/ops/fused.py `attention`) visits a prefix row's first n_b keys without reading its mask: the same keys
    the mask keeps. Computed on the device, no sync: a CUDA graph replays it for any mask."""
    keep = mask != 0  # [B, S]
    counts = keep.sum(dim=1, dtype=torch.int32)  # [B]
    prefix = (keep == (torch.arange(mask.shape[1], device=mask.device) < counts[:, None])).all(dim=1)
    return torch.where(prefix, counts, -1)


@register("PackTokens", domain="kiln")
def pack_tokens(ctx, x, index, *, broadcast=0):
    """x [B, S, ...] -> x.flatten(0, 1)[index]: [T, ...], the real tokens in row-major order (B·S of them: the
    identity packing, a view). `broadcast`: x is [1, S, ...], the same for every row of the batch (a position
    embedding): token b·S + s reads x[0, s]."""
    if broadcast:
        return x[0].index_select(0, index % x.shape[1])
    rows = x.flatten(0, 1)
    return rows if index.shape[0] == rows.shape[0] else rows.index_select(0, index)


@register("UnpackTokens", domain="kiln")
def unpack_tokens(ctx, y, scatter, mask, *, zero_padding=1):
    """y [T, ...] -> [B, S, ...] (B, S: mask's shape): row t of y at flat position scatter[t], zeros at padding;
    a dummy row's position B·S is dropped. From the identity packing (T = B·S) a view of y, with its padding
    rows zeroed unless `zero_padding` = 0 (an attention's q/k/v: its mask hides those keys already)."""
    batch, seq = mask.shape
    if y.shape[0] == batch * seq:
        out = y.unflatten(0, (batch, seq))  # [B, S, ...]
        return out.masked_fill((mask == 0).reshape(batch, seq, *[1] * (y.dim() - 1)), 0) if zero_padding else out
    out = y.new_zeros((batch * seq + 1, *y.shape[1:]))
    out.index_copy_(0, scatter, y)
    return out[:-1].unflatten(0, (batch, seq))


def additive_padding_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """mask [B, S] -> [B, 1, 1, S]: 0 for a real key, -inf for padding (every query of a row sees its row's
    real keys only)."""
    hidden = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask == 0, float("-inf"))
    return hidden[:, None, None, :]


@register("PackedAttention", domain="kiln")
def packed_attention(ctx, q, k, v, mask, index, scatter, cu_seqlens, *, scale=1.0, q_perm=None, k_perm=None,
                     v_perm=None, out_perm=None, gqa=0, q_num_heads=0, kv_num_heads=0, qkv_split=None,
                     out_merge_heads=0):
    """kiln::Attention over packed tokens: q, k, v [T, ...] are what Attention reads as [B, S, ...] with the
    batch and sequence axes flattened to the real tokens (the layout attributes are Attention's, for the
    unpacked tensors); a query sees its own row's real tokens only; the output is packed [T, ...] too.
    Reference: scatter q/k/v to [B, S, ...] (their padding keys hidden), Attention with the padding mask as an additive
    mask, gather the real tokens back (TokenIndex's `index` and `scatter`; a dummy row gathers position 0).
    `cu_seqlens` is for the varlen kernels (the CUDA tactic)."""
    q4, k4, v4 = (None if x is None else unpack_tokens(ctx, x, scatter, mask, zero_padding=0) for x in (q, k, v))
    out = attention(ctx, q4, k4, v4, additive_padding_mask(mask, q.dtype), scale=scale, q_perm=q_perm,
                    k_perm=k_perm, v_perm=v_perm, out_perm=out_perm, gqa=gqa, nan_to_zero=1,
                    q_num_heads=q_num_heads, kv_num_heads=kv_num_heads, qkv_split=qkv_split,
                    out_merge_heads=out_merge_heads)  # [B, S, ...]; a row of padding only: 0, not NaN
    return pack_tokens(ctx, out, index)  # [T, ...]


@register("ZeroPadding", domain="kiln")
def zero_padding(ctx, y, mask):
    """y [B, S, ...] with its padding positions (mask = 0) zeroed: what UnpackTokens hands out from the identity
    packing. A padding-free engine's plain program (kiln/builder/padding_free.py) ends in one per output, so the
    engine's outputs are zero at padding whichever program ran."""
    batch, seq = mask.shape
    return y.masked_fill((mask == 0).reshape(batch, seq, *[1] * (y.dim() - 2)), 0)
