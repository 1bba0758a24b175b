"""Paged decode attention in Triton: one query token per request against its K/V in cache blocks.

Split-KV (flash decoding): a request's keys are cut into at most MAX_SPLITS splits of at least
MIN_SPLIT_TOKENS keys each (the split length a multiple of BLOCK_N); program (b, kv head, split) walks its
split in tiles of BLOCK_N tokens, finding each token's block through the block table
(so the page size is a parameter, independent of the tile), and keeps an online softmax:

    m' = max(m, rowmax(s)),   p = e^(s - m'),   l = l·e^(m - m') + rowsum(p),   acc = acc·e^(m - m') + p·v

It writes acc / l and the log-sum-exp m + log l per split; a second kernel merges the splits:
out = Σ_i e^(lse_i - M) o_i / Σ_i e^(lse_i - M). A request with one split writes its result directly (the merge
of one split is that split, bit for bit) and the merge skips it; splits past a request's keys exit at once.
GQA: the query heads sharing one K/V head are packed into the rows of one program (BLOCK_H ≥ 16 rows for
tl.dot), so each K/V tile is read once per group.

The split length is a function of the request's own length only, never of the batch or the grid: a
request's result does not depend on what else is in the batch. How short a split may be trades the two ends
of the batch range (H200, Llama-3-8B heads, 192 keys, bench/llm_step_profile.py, 2026-12-03): 32-key splits
spread a batch-1 step over 6 programs per K/V head (5.9 us a layer against 9.1 with one 256-key split), but at
batch 256 they make 12k programs of one 32-key tile each plus an fp32 partial per split to write and merge:
114 us a layer (1.8 TB/s of KV) against 67 us (3.0 TB/s) with one split, and at batch 1024 452 against 236.
Decode throughput is made at large batches, so splits are at least 256 keys: a request of up to 256 keys is
one program per K/V head and needs no merge; past that, at most MAX_SPLITS splits. Measured so (run 2, same
page): 65 us a layer at batch 256 (3.1 TB/s), 232 at 1024; batch 1 8.8 (+3 us a layer, ~2% of its step); the
FP8 Llama-3-8B step at batch 256 replays in 7.7 ms instead of 9.3 (bench/results/llm-throughput-2026-12-03.md). The grid's split count only
needs to cover the longest request (MAX_SPLITS at most), so a CUDA graph captured for max_model_len replays for
any batch and length.
"""

from __future__ import annotations

import math
import os
import re

import torch
import triton
import triton.language as tl

from kiln.llm.kernels.online_softmax import accumulate, scores, softmax_step

MIN_SPLIT_TOKENS = 256  # keys per split at least (see above: 32 is faster at batch 1, 2x slower at batch 256+)
MAX_SPLITS = 16  # splits per request at most: a request of L keys has splits of max(256, ceil(L / 16)) keys
# The split kernel's launch (H200, 192 keys, batch 512 + 1024, bench/llm_step_profile.py, llm4 run 1, 2026-12-03:
# bench/results/llm-2026-12-03b.md): 32-key tiles with num_stages 5 (Triton then keeps the next K/V tile in flight
# while one is computed; at 3 it waits for each) took 353.5 us where 64-key tiles at 3 stages took 380.5 (bf16 KV),
# and with an FP8 cache and fp16 products 346.8 against 394.4. Grid order (heads first) and 64-key tiles at 5 stages
# gained nothing; 2 warps lost.
TILE_TOKENS = 32  # keys per tile (BLOCK_N)
NUM_STAGES = 5
# Warps a program, by cache: 4 for a bf16/fp16 cache; 1 for an FP8 cache read as fp16 (fp8_f16_dot). With one
# warp no tile's p and row sums are exchanged between warps and 4x more programs fit an SM: an FP8 cache at batch
# 512 and 192 keys took 81 us a layer (2.49 TB/s of FP8 KV) against ~110 with 4 warps (H200, llm7's sweep,
# 2026-12-04), where a bf16 cache takes 113: the FP8 cache's half bytes had bought nothing with 4 warps. The warps
# change bits (the dot's accumulation order): fixed per cache dtype, so a request never depends on its batch.
NUM_WARPS = 4
FP8_NUM_WARPS = 1
# An FP8 cache's launch may be overridden (opt-in, until measured) by KILN_LLM_DECODE_FP8: space-separated settings
# "hH nN wW sS spP hf1" — H K/V heads a program (the packed kernel below when H > 1), N keys a tile, W warps,
# S stages, P the shortest split (keys), hf1 the split kernel's heads-first grid; any left out keep the defaults above. Read once, at import: fixed per process, so a
# request's result still never depends on its batch.
FP8_LAUNCH_ENV = "KILN_LLM_DECODE_FP8"
_LAUNCH_KEYS = {"h": "kv_heads_per_program", "n": "block_n", "w": "num_warps", "s": "num_stages", "sp": "split_tokens",
                "hf": "heads_first"}


def parse_launch(text: str) -> dict[str, int]:
    """"h4 n32 w1 s5 sp256" -> {"kv_heads_per_program": 4, "block_n": 32, ...}; a clear error otherwise."""
    launch = {}
    for item in text.split():
        match = re.fullmatch(r"(sp|hf|h|n|w|s)(\d+)", item)
        if match is None:
            raise ValueError(f"{FP8_LAUNCH_ENV}={text!r}: {item!r} is not one of hN nN wN sN spN hf0/hf1 "
                             "(K/V heads a program, keys a tile, warps, stages, shortest split, heads-first grid)")
        key = _LAUNCH_KEYS[match.group(1)]
        launch[key] = bool(int(match.group(2))) if key == "heads_first" else int(match.group(2))
    return launch


FP8_LAUNCH = parse_launch(os.environ.get(FP8_LAUNCH_ENV, ""))
NO_WINDOW = 1 << 30  # the window passed when there is none: every key is within it


@triton.jit
def _decode_split_kernel(q_ptr, k_cache, v_cache, block_tables, seq_lens, partial_ptr, lse_ptr, out_ptr, scale,
                         window, stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                         stride_tb, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
                         GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                         PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr,
                         MAX_SPLITS: tl.constexpr, IEEE: tl.constexpr, F16_DOT: tl.constexpr,
                         HEADS_FIRST: tl.constexpr):
    if HEADS_FIRST:  # grid (kv heads, batch, splits): a request's K/V heads run side by side, on the same pages
        kv_head = tl.program_id(0)
        b = tl.program_id(1).to(tl.int64)
    else:
        b = tl.program_id(0).to(tl.int64)  # 64-bit offsets throughout (large batches, large caches)
        kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens + b)
    # this request's split length: from its own length alone (batch invariance), a whole number of tiles
    split_len = tl.maximum(MIN_SPLIT, tl.cdiv(tl.cdiv(seq_len, MAX_SPLITS), BLOCK_N) * BLOCK_N)
    start = split * split_len
    if start >= seq_len:  # past this request's keys: the merge reads only the splits that hold some
        return
    end = tl.minimum(start + split_len, seq_len)
    lowest = tl.maximum(seq_len - window, 0)  # sliding window (2^30 when none): keys before it are masked

    rows = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + rows
    row_ok = rows < GROUP
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]
    if F16_DOT:  # an FP8 cache read as fp16 (one native conversion, exact); q scaled first, for fp16's range
        q = tl.clamp(q.to(tl.float32) * scale, -65504.0, 65504.0).to(tl.float16)  # saturated, never inf

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = (pos < end) & (pos >= lowest)
        block = tl.load(block_tables + b * stride_tb + pos // PAGE, mask=pos < end, other=0).to(tl.int64)
        slot = pos % PAGE
        k = tl.load(k_cache + block[:, None] * stride_kb + slot[:, None] * stride_kt + kv_head * stride_kh + d[None, :],
                    mask=valid[:, None] & d_ok[None, :], other=0.0).to(q.dtype)  # [BLOCK_N, BLOCK_D]; fp8 KV widened
        s = scores(q, k, scale, IEEE, F16_DOT)
        s = tl.where(valid[None, :], s, float("-inf"))  # [BLOCK_H, BLOCK_N]
        p, alpha, l, m = softmax_step(s, m, l)
        v = tl.load(v_cache + block[:, None] * stride_vb + slot[:, None] * stride_vt + kv_head * stride_vh + d[None, :],
                    mask=valid[:, None] & d_ok[None, :], other=0.0).to(q.dtype)
        acc = accumulate(acc, alpha, p, v, IEEE)

    _store_split(acc, m, l, out_ptr, partial_ptr, lse_ptr, b, heads, row_ok, d, d_ok, split, split_len, seq_len,
                 stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh)


@triton.jit
def _store_split(acc, m, l, out_ptr, partial_ptr, lse_ptr, b, heads, row_ok, d, d_ok, split, split_len, seq_len,
                 stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh):
    """Both split kernels' close: the rows' softmax-weighted sum of values (acc / l) as the partial and its
    log-sum-exp (m + log l; -inf for rows that saw no key), for _merge_splits_kernel."""
    has_keys = l > 0
    out = acc / tl.where(has_keys, l, 1.0)[:, None]
    if split_len >= seq_len:
        # the request's only split: its result is final (merging one split multiplies it by e^0 = 1 and divides
        # by 1, so these are the merge's bits), written without the partial's round trip; the merge skips it
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])
        return
    lse = tl.where(has_keys, m + tl.log(tl.where(has_keys, l, 1.0)), float("-inf"))
    tl.store(partial_ptr + b * stride_pb + heads[:, None] * stride_ph + split * stride_ps + d[None, :], out,
             mask=row_ok[:, None] & d_ok[None, :])
    tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=row_ok)


@triton.jit
def _decode_packed_kernel(q_ptr, k_cache, v_cache, block_tables, seq_lens, partial_ptr, lse_ptr, out_ptr, scale,
                          window, stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                          stride_vh, stride_tb, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob,
                          stride_oh, GROUP: tl.constexpr, HPP: tl.constexpr, BLOCK_H: tl.constexpr,
                          HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                          MIN_SPLIT: tl.constexpr, MAX_SPLITS: tl.constexpr, IEEE: tl.constexpr,
                          F16_DOT: tl.constexpr):
    """_decode_split_kernel with HPP adjacent K/V heads a program (kv_heads_per_program): the rows are the
    HPP x GROUP query heads of those K/V heads (contiguous in q; GQA 4:1 and HPP 4 fill tl.dot's 16 rows with no
    padding), the columns of a tile are BLOCK_N keys x HPP heads, key-major (a key's HPP heads are HPP x HEAD_DIM
    contiguous bytes of its cache slot: longer runs for the loads), and a row sees only its own head's columns
    (the others are masked to -inf before the softmax, so p is exactly 0 there and p·v adds exact zeros). The same
    splits (from the request's length alone) and the same partial/lse layout: _merge_splits_kernel merges them."""
    b = tl.program_id(0).to(tl.int64)
    kv0 = tl.program_id(1) * HPP
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens + b)
    split_len = tl.maximum(MIN_SPLIT, tl.cdiv(tl.cdiv(seq_len, MAX_SPLITS), BLOCK_N) * BLOCK_N)
    start = split * split_len
    if start >= seq_len:
        return
    end = tl.minimum(start + split_len, seq_len)
    lowest = tl.maximum(seq_len - window, 0)

    rows = tl.arange(0, BLOCK_H)
    heads = kv0 * GROUP + rows
    row_ok = rows < HPP * GROUP
    row_kv = rows // GROUP  # the row's K/V head, relative to kv0
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]
    if F16_DOT:
        q = tl.clamp(q.to(tl.float32) * scale, -65504.0, 65504.0).to(tl.float16)

    cols = tl.arange(0, BLOCK_N * HPP)
    col_key = cols // HPP
    col_kv = cols % HPP
    own = row_kv[:, None] == col_kv[None, :]  # [BLOCK_H, BLOCK_N * HPP]: a row's own head's columns
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + col_key
        valid = (pos < end) & (pos >= lowest)
        block = tl.load(block_tables + b * stride_tb + pos // PAGE, mask=pos < end, other=0).to(tl.int64)
        slot = pos % PAGE
        k_off = block * stride_kb + slot * stride_kt + (kv0 + col_kv) * stride_kh
        k = tl.load(k_cache + k_off[:, None] + d[None, :], mask=valid[:, None] & d_ok[None, :],
                    other=0.0).to(q.dtype)  # [BLOCK_N * HPP, BLOCK_D]
        s = scores(q, k, scale, IEEE, F16_DOT)
        s = tl.where(valid[None, :] & own, s, float("-inf"))
        p, alpha, l, m = softmax_step(s, m, l)
        v_off = block * stride_vb + slot * stride_vt + (kv0 + col_kv) * stride_vh
        v = tl.load(v_cache + v_off[:, None] + d[None, :], mask=valid[:, None] & d_ok[None, :],
                    other=0.0).to(q.dtype)
        acc = accumulate(acc, alpha, p, v, IEEE)

    _store_split(acc, m, l, out_ptr, partial_ptr, lse_ptr, b, heads, row_ok, d, d_ok, split, split_len, seq_len,
                 stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh)


@triton.jit
def _merge_splits_kernel(partial_ptr, lse_ptr, out_ptr, seq_lens, num_splits, stride_pb, stride_ph, stride_ps,
                         stride_lb, stride_lh, stride_ob, stride_oh, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                         MIN_SPLIT: tl.constexpr, MAX_SPLITS: tl.constexpr):
    """Program (request, K/V head) merges the splits of the GROUP query heads sharing that K/V head (one program per
    query head made 16k programs a layer at batch 512 that mostly exit at once: 10.6 us a layer on the H200).

    The splits are added one at a time, in split order (an unrolled loop over MAX_SPLITS, a per-engine constant):
    no reduction runs across splits but the max (exact in any order). A tl.sum over a [splits, head dim] tile, as
    before, added them in an order the compiler's register layout picked, and that layout followed the grid (the
    tile's power-of-two height from the grid's split count, the lse row stride's divisibility by 16): a request
    merged from 5 splits got other bits in a grid sized for 4096 keys than in one for 72 (the H200 failed that
    check, llm7 2026-12-04). Compiled for sm_90 the tile had 2 splits a warp at 8 rows and 4 at 16, and a warp
    reduction shuffles from the widest lane offset down: (x0+x1)+(x2+x3) against (x0+x2)+(x1+x3).
    tests/llm/merge_order_sm90.py checks that no reduction here adds. Splits that hold no keys (past the request,
    or outside its window) weigh an exact 0 and are never read; the loop's masked iterations add exact zeros."""
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens + b)
    split_len = tl.maximum(MIN_SPLIT, tl.cdiv(tl.cdiv(seq_len, MAX_SPLITS), BLOCK_N) * BLOCK_N)  # as the split kernel
    if split_len >= seq_len:  # one split: the split kernel wrote the result
        return
    g = tl.arange(0, BLOCK_G)
    g_ok = g < GROUP
    heads = kv_head * GROUP + g
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    lse_row = lse_ptr + b * stride_lb + heads * stride_lh  # [BLOCK_G]
    part_row = partial_ptr + b * stride_pb + heads[:, None] * stride_ph + d[None, :]  # [BLOCK_G, BLOCK_D]
    top = tl.full([BLOCK_G], float("-inf"), tl.float32)
    for i in tl.static_range(MAX_SPLITS):  # the largest lse of each head: a max, exact in any order
        split = g * 0 + i  # [BLOCK_G]: the mask a tensor (a scalar one is not, in the interpreter)
        has = g_ok & (split < num_splits) & (split * split_len < seq_len)
        top = tl.maximum(top, tl.load(lse_row + i, mask=has, other=float("-inf")))
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    total = tl.zeros([BLOCK_G], tl.float32)
    for i in tl.static_range(MAX_SPLITS):  # split 0, then 1, ...: the order is the code's, not the layout's
        split = g * 0 + i
        has = g_ok & (split < num_splits) & (split * split_len < seq_len)
        lse = tl.load(lse_row + i, mask=has, other=float("-inf"))
        weight = tl.where(lse == float("-inf"), 0.0, tl.exp(lse - tl.where(top == float("-inf"), 0.0, top)))
        partial = tl.load(part_row + i * stride_ps, mask=has[:, None] & d_ok[None, :], other=0.0)
        acc = acc + weight[:, None] * partial
        total = total + weight
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=g_ok[:, None] & d_ok[None, :])


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, sliding_window: int | None = None,
                           max_seq_len: int | None = None, split_tokens: int | None = None,
                           block_n: int | None = None, max_splits: int = MAX_SPLITS, num_warps: int | None = None,
                           out: torch.Tensor | None = None, fp8_f16_dot: bool = True,
                           num_stages: int | None = None, heads_first: bool | None = None,
                           kv_heads_per_program: int | None = None) -> torch.Tensor:
    """q: [B, Hq, D] (one token per request); k_cache, v_cache: [num_blocks, page, Hkv, D] in q's dtype or FP8 E4M3
    (read widened to q's dtype, unit scale);
    block_tables: [B, max_blocks] int32; seq_lens: [B] int32 (keys per request, the new one included).
    Returns [B, Hq, D] in q's dtype. max_seq_len sizes the grid (default: block_tables' capacity); it never
    changes a result. split_tokens: the shortest split; max_splits: the most splits of one request; block_n, num_warps:
    the split kernel's tile and warps (the result's bits may depend on them: fixed per engine, so no request's result
    depends on the batch; default warps NUM_WARPS, or FP8_NUM_WARPS for an FP8 cache with fp16 products); num_stages, heads_first: launch settings that change no bit (on sm_90 Triton keeps one K/V
    tile in flight behind the one being computed from num_stages 5, none at 3, the block table's load coming first;
    heads_first orders the grid so a request's K/V heads, adjacent in each cache slot, run at once). out: [B, Hq, D]
    to write into (e.g. rows of the step's attention output: no copy after), else a new tensor. fp8_f16_dot: with an
    FP8 cache and a bf16 q, the products in fp16 (q·scale saturated at fp16's ±65504, K, V and p rounded to fp16:
    3 more mantissa bits than bf16) instead of bf16, whose widening from E4M3 takes a second conversion on sm_90:
    8-14% faster alone on the H200 (the default since llm4 run 1, where a 128/128 engine run at batch 512 took it).
    kv_heads_per_program: K/V heads a program (a power of two dividing the K/V heads; > 1 runs _decode_packed_kernel:
    all those heads' query rows in one tile, each K/V byte read once). split_tokens, block_n, num_stages, num_warps,
    kv_heads_per_program left None: MIN_SPLIT_TOKENS, TILE_TOKENS, NUM_STAGES, (FP8_)NUM_WARPS and 1, an FP8 cache
    with fp16 products taking KILN_LLM_DECODE_FP8's settings (FP8_LAUNCH) over those."""
    batch, num_heads, head_dim = q.shape
    _, page, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * page
    f16_dot = fp8_f16_dot and k_cache.dtype == torch.float8_e4m3fn and q.dtype == torch.bfloat16
    launch = FP8_LAUNCH if f16_dot else {}
    split_tokens = split_tokens if split_tokens is not None else launch.get("split_tokens", MIN_SPLIT_TOKENS)
    block_n = block_n if block_n is not None else launch.get("block_n", TILE_TOKENS)
    num_stages = num_stages if num_stages is not None else launch.get("num_stages", NUM_STAGES)
    if num_warps is None:
        num_warps = launch.get("num_warps", FP8_NUM_WARPS if f16_dot else NUM_WARPS)
    heads_first = heads_first if heads_first is not None else launch.get("heads_first", False)
    hpp = kv_heads_per_program if kv_heads_per_program is not None else launch.get("kv_heads_per_program", 1)
    if hpp < 1 or hpp & (hpp - 1) or num_kv_heads % hpp:
        raise ValueError(f"paged_decode_attention: kv_heads_per_program must be a power of two dividing the "
                         f"{num_kv_heads} K/V heads of k_cache {list(k_cache.shape)}, got {hpp}")
    block_n = max(16, min(block_n, split_tokens))
    split_tokens = math.ceil(split_tokens / block_n) * block_n  # whole tiles, as the kernel rounds
    num_splits = max(1, min(max_splits, math.ceil(max_seq_len / split_tokens)))
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1:
        raise ValueError(f"paged_decode_attention: out must be {list(q.shape)} {q.dtype} with contiguous head dims, "
                         f"got {list(out.shape)} {out.dtype} strides {out.stride()}")
    partial = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
    lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
    block_d = triton.next_power_of_2(head_dim)
    if hpp > 1:
        _decode_packed_kernel[(batch, num_kv_heads // hpp, num_splits)](
            q, k_cache, v_cache, block_tables, seq_lens, partial, lse, out, scale, sliding_window or NO_WINDOW,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
            partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1), out.stride(0),
            out.stride(1), GROUP=group, HPP=hpp, BLOCK_H=max(16, triton.next_power_of_2(group * hpp)),
            HEAD_DIM=head_dim, BLOCK_D=max(16, block_d), PAGE=page, BLOCK_N=block_n, MIN_SPLIT=split_tokens,
            MAX_SPLITS=max_splits, IEEE=q.dtype == torch.float32, num_warps=num_warps, num_stages=num_stages,
            F16_DOT=f16_dot)
    else:
        grid = (num_kv_heads, batch, num_splits) if heads_first else (batch, num_kv_heads, num_splits)
        _decode_split_kernel[grid](
            q, k_cache, v_cache, block_tables, seq_lens, partial, lse, out, scale, sliding_window or NO_WINDOW,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
            partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1), out.stride(0),
            out.stride(1), GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
            BLOCK_D=max(16, block_d), PAGE=page, BLOCK_N=block_n, MIN_SPLIT=split_tokens, MAX_SPLITS=max_splits,
            IEEE=q.dtype == torch.float32, num_warps=num_warps, num_stages=num_stages,
            F16_DOT=f16_dot, HEADS_FIRST=heads_first)
    if num_splits == 1:  # every request fits one split: the split kernel wrote every result
        return out
    _merge_splits_kernel[(batch, num_kv_heads)](
        partial, lse, out, seq_lens, num_splits, partial.stride(0), partial.stride(1), partial.stride(2),
        lse.stride(0), lse.stride(1), out.stride(0), out.stride(1), GROUP=group,
        BLOCK_G=triton.next_power_of_2(group), HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=block_n,
        MIN_SPLIT=split_tokens, MAX_SPLITS=max_splits)
    return out
