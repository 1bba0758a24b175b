"""Paged prefill attention in Triton: many query rows per request (a prompt, a chunk of one, a prompt
after a prefix-cache hit, draft tokens) against all of the request's keys in cache blocks.

One program per (tile of BLOCK_M query rows of one request, query head). The tiles of a step are listed
once on the host (kiln.llm.attention.prefill_tiles: request index and first row of each tile), so requests of any
lengths share one launch. A query at position p (a request's queries are its last positions) sees keys
0..p (bottom-right causal), and with a sliding window only the last `window` of them. Keys are walked
in BLOCK_N tiles through the block table with the online softmax of the decode kernel; GQA maps query
head h to K/V head h // group. Keys past the tile's last query are never visited.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.llm.kernels.online_softmax import accumulate, scores, softmax_step

NO_WINDOW = 1 << 30  # the window passed when there is none: every key is within it


@triton.jit
def _prefill_kernel(q_ptr, k_cache, v_cache, block_tables, query_start, query_lens, seq_lens, tiles, out_ptr, scale,
                    window, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                    stride_tb, stride_ot, stride_oh, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_D: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    IEEE: tl.constexpr, F16_DOT: tl.constexpr):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    b = tl.load(tiles + 2 * tile)
    first = tl.load(tiles + 2 * tile + 1)
    q_start = tl.load(query_start + b)
    q_len = tl.load(query_lens + b)
    seq_len = tl.load(seq_lens + b)

    rows = first + tl.arange(0, BLOCK_M)
    row_ok = rows < q_len
    query_pos = seq_len - q_len + rows  # [BLOCK_M]
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + (q_start + rows)[:, None] * stride_qt + head * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if F16_DOT:  # an FP8 cache read as fp16 (one native conversion, exact); q scaled first, for fp16's range
        q = tl.clamp(q.to(tl.float32) * scale, -65504.0, 65504.0).to(tl.float16)  # saturated, never inf

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    last_key = tl.minimum(seq_len - q_len + first + BLOCK_M, seq_len)  # past the tile's last query: never seen
    # the earliest key any row of the tile sees (window is 2^30 when there is none), at a tile boundary
    lowest = (tl.maximum(seq_len - q_len + first - window + 1, 0) // BLOCK_N) * BLOCK_N
    for n0 in range(lowest, last_key, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        in_seq = pos < last_key
        block = tl.load(block_tables + b * stride_tb + pos // PAGE, mask=in_seq, other=0)
        slot = pos % PAGE
        k = tl.load(k_cache + block[:, None] * stride_kb + slot[:, None] * stride_kt + kv_head * stride_kh + d[None, :],
                    mask=in_seq[:, None] & d_ok[None, :], other=0.0).to(q.dtype)  # fp8 KV widened
        s = scores(q, k, scale, IEEE, F16_DOT)
        visible = in_seq[None, :] & (pos[None, :] <= query_pos[:, None]) & (pos[None, :] > query_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        p, alpha, l, m = softmax_step(s, m, l)
        v = tl.load(v_cache + block[:, None] * stride_vb + slot[:, None] * stride_vt + kv_head * stride_vh + d[None, :],
                    mask=in_seq[:, None] & d_ok[None, :], other=0.0).to(q.dtype)
        acc = accumulate(acc, alpha, p, v, IEEE)
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(out_ptr + (q_start + rows)[:, None] * stride_ot + head * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                            query_start: torch.Tensor, query_lens: torch.Tensor, seq_lens: torch.Tensor,
                            tiles: torch.Tensor, scale: float, sliding_window: int | None = None,
                            out: torch.Tensor | None = None, block_m: int = 32, block_n: int = 32,
                            fp8_f16_dot: bool = True, num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    """q: [T, Hq, D] (the step's flattened rows); k_cache, v_cache: [num_blocks, page, Hkv, D] in q's dtype or FP8
    E4M3 (unit scale); block_tables [B, max_blocks], query_start/query_lens/seq_lens [B] int32; tiles from
    kiln.llm.attention.prefill_tiles (block_m rows each). Writes the tiles' rows of `out` (default: a new [T, Hq, D]).
    fp8_f16_dot: with an FP8 cache and a bf16 q, the products in fp16 as the decode kernel takes them (q·scale
    saturated at fp16's ±65504; K, V and p rounded to fp16, 3 more mantissa bits than bf16): E4M3 widens to fp16 in
    one conversion, to bf16 in two on sm_90. num_warps, num_stages: the launch (Triton's defaults, 4 and 3)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    page, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q) if out is None else out
    if tiles.shape[0] == 0:
        return out
    _prefill_kernel[(tiles.shape[0], num_heads)](
        q, k_cache, v_cache, block_tables, query_start, query_lens, seq_lens, tiles, out, scale, sliding_window or NO_WINDOW,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        PAGE=page, BLOCK_M=block_m, BLOCK_N=block_n, IEEE=q.dtype == torch.float32,
        F16_DOT=fp8_f16_dot and k_cache.dtype == torch.float8_e4m3fn and q.dtype == torch.bfloat16,
        num_warps=num_warps, num_stages=num_stages)
    return out
