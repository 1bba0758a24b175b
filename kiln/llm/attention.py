"""Attention over the paged KV cache, and the metadata that describes one step's batch.

A step's tokens are flattened into one [T] batch: request b owns rows query_start[b] ..
query_start[b] + query_lens[b], the last query_lens[b] positions of its seq_lens[b] tokens. Each
layer first writes the step's new K/V into their slots (`write_kv`), then every request attends
over its block table: so a request may read blocks another request of the same step is filling
(a prefix-cache hit on a prompt being computed right now) and still see the right values.

`paged_attention` is the reference: one request at a time, torch SDPA over K/V gathered from its
blocks, on any device; a request's result never depends on the rest of the batch. With the Triton
backend, requests with one query token (decodes, listed first) go through the paged decode kernel
(kiln/llm/kernels/paged_decode.py) and all the others through one launch of the paged prefill
kernel (kernels/paged_prefill.py).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: the cache slot each new token's K/V goes to
    query_start: list[int]  # [B] host: first row of each request in the flattened batch
    query_lens: list[int]  # [B] host: rows of each request this step
    seq_lens: list[int]  # [B] host: tokens each request attends over (cached + new)
    block_tables: torch.Tensor  # [B, max_blocks] int32: each request's blocks, padded with the null block
    seq_lens_tensor: torch.Tensor  # [B] int32, on the device (kernels)
    num_decodes: int = 0  # the first num_decodes requests have exactly one query row
    backend: str = "torch"  # torch | triton
    max_seq_len: int | None = None  # triton: sizes the decode kernel's grid (the runner passes max_model_len's)
    # triton backend: whole prompts (no cached prefix) through "flash" (torch's flash attention, varlen) or the
    # paged "triton" prefill kernel; every other prefill row always takes the paged kernel
    prefill_kernel: str = "triton"
    prefill_bounds: torch.Tensor | None = None  # flash: [prompts + 1] int32 row bounds, made by the first layer
    # triton backend only: the rest of the requests' rows in BLOCK_M tiles, for the prefill kernel
    query_start_tensor: torch.Tensor | None = None  # [B] int32
    query_lens_tensor: torch.Tensor | None = None  # [B] int32
    prefill_tiles: torch.Tensor | None = None  # [tiles, 2] int32: (request, first row)


PREFILL_BLOCK_M = 32  # query rows per program of the Triton prefill kernel


def prefill_tiles(query_lens: list[int], first_request: int, device: torch.device) -> torch.Tensor:
    """(request index, first row) of each PREFILL_BLOCK_M-row tile of requests first_request..: [tiles, 2]."""
    tiles = [(b, row) for b in range(first_request, len(query_lens))
             for row in range(0, query_lens[b], PREFILL_BLOCK_M)]
    return torch.tensor(tiles, dtype=torch.int32).reshape(-1, 2).to(device)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: [T, Hkv, D] -> slots of k_cache, v_cache: [num_blocks, block_size, Hkv, D]. An FP8 E4M3 cache
    (kv_cache_dtype="fp8", unit scale) stores them saturated at +-448, its largest finite value."""
    if k_cache.dtype != k.dtype:
        k, v = _to_cache(k, k_cache.dtype), _to_cache(v, v_cache.dtype)
    if k_cache.dtype == torch.float8_e4m3fn:  # index_copy_ has no FP8 kernel: copy the bytes
        k, v, k_cache, v_cache = k.view(torch.uint8), v.view(torch.uint8), k_cache.view(torch.uint8), v_cache.view(
            torch.uint8)
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


def _to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.float8_e4m3fn:
        x = x.clamp(-448.0, 448.0)  # a cast past the largest finite E4M3 value gives NaN
    return x.to(dtype)


def _whole_prompts(meta: AttentionMetadata, sliding_window: int | None) -> bool:
    """Whether every prefill request of the step is a whole prompt (no cached prefix) and no window applies."""
    n = meta.num_decodes
    return sliding_window is None and meta.query_lens[n:] == meta.seq_lens[n:]


def flash_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                            scale: float, out: torch.Tensor) -> None:
    """The prefill rows (after the num_decodes decode rows) of a step whose prefill requests are whole prompts,
    through torch's flash attention over variable-length sequences (causal, GQA) into out's rows. Their K/V are
    read back from the cache slots this step wrote (slot_mapping), so the attention sees what the paged kernel
    would: an FP8 cache's rounded values, widened to q's dtype. CUDA, fp16/bf16 q only.

    Why: the paged prefill kernel walks each 32-row tile's keys one 32-key tile at a time through the block
    table; at 512 x 128-token prompts it ran at ~40 TFLOP/s (53 ms of a 0.93 s prefill, H200, llm4)."""
    n = meta.num_decodes
    first = meta.query_start[n]
    rows = sum(meta.query_lens[n:])
    slots = meta.slot_mapping[first:first + rows]  # [Tp]: the prompts' tokens, in order
    heads, dim = k_cache.shape[2], k_cache.shape[3]
    if k_cache.dtype == torch.float8_e4m3fn:  # gather the bytes (no FP8 indexing kernel), then widen
        k = k_cache.view(torch.uint8).view(-1, heads, dim)[slots].view(k_cache.dtype).to(q.dtype)
        v = v_cache.view(torch.uint8).view(-1, heads, dim)[slots].view(v_cache.dtype).to(q.dtype)
    else:
        k = k_cache.view(-1, heads, dim)[slots]  # [Tp, Hkv, D]
        v = v_cache.view(-1, heads, dim)[slots]
    lengths = meta.query_lens[n:]
    if meta.prefill_bounds is None:  # once a step, not once a layer: a host-to-device copy
        meta.prefill_bounds = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32).to(q.device)
    bounds, longest = meta.prefill_bounds, max(lengths)
    result = torch.ops.aten._flash_attention_forward(q[first:first + rows], k, v, bounds, bounds, longest, longest,
                                                     0.0, True, False, scale=scale)[0]
    out[first:first + rows] = result  # [Tp, Hq, D]


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """q: [T, Hq, D] -> [T, Hq, D]; each request's queries see its keys up to their own position
    (and, with a sliding window, only the last `sliding_window` of them)."""
    out = torch.empty_like(q)
    if meta.backend == "triton":
        # here, not at the top: a run on the torch backend (any CPU run) never imports triton
        from kiln.llm.kernels.paged_decode import paged_decode_attention
        from kiln.llm.kernels.paged_prefill import paged_prefill_attention
        n = meta.num_decodes
        if n:
            paged_decode_attention(q[:n], k_cache, v_cache, meta.block_tables[:n], meta.seq_lens_tensor[:n], scale,
                                   sliding_window, meta.max_seq_len, out=out[:n])  # in place: no copy after
        if n < len(meta.query_lens) and meta.prefill_kernel == "flash" and _whole_prompts(meta, sliding_window):
            flash_prefill_attention(q, k_cache, v_cache, meta, scale, out)
        elif n < len(meta.query_lens):
            paged_prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start_tensor,
                                    meta.query_lens_tensor, meta.seq_lens_tensor, meta.prefill_tiles, scale,
                                    sliding_window, out=out, block_m=PREFILL_BLOCK_M)
        return out
    block_size = k_cache.shape[1]
    for b in range(len(meta.query_lens)):
        start, num_q, num_kv = meta.query_start[b], meta.query_lens[b], meta.seq_lens[b]
        blocks = meta.block_tables[b, :(num_kv + block_size - 1) // block_size]
        k = k_cache[blocks].flatten(0, 1)[:num_kv].to(q.dtype)  # [L, Hkv, D]; an FP8 cache widened
        v = v_cache[blocks].flatten(0, 1)[:num_kv].to(q.dtype)
        out[start:start + num_q] = _attend(q[start:start + num_q], k, v, scale, sliding_window)
    return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            sliding_window: int | None) -> torch.Tensor:
    """One request: q [Q, Hq, D] are the last Q positions of k, v [L, Hkv, D]."""
    num_q, num_kv = q.shape[0], k.shape[0]
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [H, S, D]
    group = q.shape[0] // k.shape[0]
    if group > 1:
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    if num_q == num_kv and sliding_window is None:  # a whole prompt: plain causal (flash attention on CUDA)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        query_pos = torch.arange(num_kv - num_q, num_kv, device=q.device)[:, None]  # bottom-right aligned
        key_pos = torch.arange(num_kv, device=q.device)[None, :]
        mask = key_pos <= query_pos
        if sliding_window is not None:
            mask &= key_pos > query_pos - sliding_window
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.transpose(0, 1)  # [Q, Hq, D]
