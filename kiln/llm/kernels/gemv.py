"""Decode GEMV / skinny GEMM in Triton: y[M, N] = x[M, K] · W[N, K]ᵀ for the few rows of a decode step
(M = 1..16), with W in bf16/fp16, FP8 E4M3 or INT8 (one fp32 scale per output channel). Weight-only: an
8-bit W is dequantized in registers (E4M3 and |q| <= 127 are exact in bf16 and fp16) and products accumulate
in fp32, the per-channel scale multiplies the sum once. A decode step is bound by the bytes of W it reads,
so the kernel is built to stream W: BLOCK_N x BLOCK_K tiles of contiguous rows (16-byte vector loads),
several warps, num_stages of software pipelining, and split-K when N alone gives too few programs.

Four ways to multiply a tile (GemvConfig.variant):
  dot       x [16, BLOCK_K] (rows past M are zeros) · Wᵀ [BLOCK_K, BLOCK_N] on tensor cores;
  dot_swap  W [BLOCK_N, BLOCK_K] · xᵀ [BLOCK_K, 16] (W is the MMA's first operand, the "swap AB" of
            small-M GEMMs), the [BLOCK_N, 16] result stored transposed;
  fma       one program per row: W tile times the row broadcast, accumulated elementwise in fp32 over K,
            reduced across BLOCK_K once at the end (CUDA cores; W is re-read per row, from L2);
  fma_rows  the same over `rows` rows per program (zeros past M): W read once for them.

Knobs on any variant (measured on the H200 by bench/gemv_sweep.py, bench/results/gemv-2026-12-02b.md):
  pdl         programmatic dependent launch (sm_90): launched while the previous kernel drains; nothing but W is
              read before gdc_wait (W no kernel writes), and gdc_launch_dependents at the start lets the next
              PDL GEMV do the same: 1-6% per GEMV in a chain of them;
  prefetch    fma, fma_rows: W one tile ahead in registers (so the first tile is in flight across the wait);
              alone it is 0-13% slower (registers), with pdl up to 5% faster on the small projections;
  w_cache     the weight stream's load hint (.cg / evict_first): no measurable effect;
  persistent  N programs per SM looping over output tiles: 1-15% slower than one program per tile here.
Each is a config field, so the engine's timing at start decides, never a rule.

Split-K is deterministic: split s writes its fp32 partial sums to a workspace [S, M, N]; then either a second
small kernel (split_reduce="kernel") or the last program of each tile to arrive (split_reduce="last": an atomic
counter per tile, one launch fewer) adds them in the order s = 0..S-1, scales, adds the bias and rounds. The
atomics only count arrivals; no value is added atomically, so the sum's order never varies.

Batch invariance: a row's result depends on K, the weights and the config, never on M or the other rows.
dot/dot_swap always compute 16 rows (zeros past M) whose MMAs accumulate each output along K in the same
order; fma runs each row in its own program; fma_rows always `rows` rows (zeros past M). So for one config,
row 0 is bit-identical at M = 1 and M = 8 (tests/llm/test_gemv_kernel.py checks it); different configs may
round differently.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_ROWS = 16  # decode rows the dot variants compute per program (tl.dot needs >= 16)
MAX_PROGRAMS = 4096  # split-K candidates keep the grid at most this large (132 SMs on the H200)
VARIANTS = {"dot": 0, "dot_swap": 1, "fma": 2, "fma_rows": 3}
W_CACHE = {"": 0, "cg": 1, "evict_first": 2}  # GemvConfig.w_cache -> the kernel's W_CACHE
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"  # no grid dependency control under the interpreter


@dataclass(frozen=True)
class GemvConfig:
    variant: str = "dot"  # dot | dot_swap | fma | fma_rows (module docstring)
    block_n: int = 32
    block_k: int = 256
    split_k: int = 1  # K split over this many programs per N tile
    num_warps: int = 4
    num_stages: int = 3
    # split_k > 1: who adds the partial sums: "kernel" (a second small kernel) or "last" (the last program of
    # each tile to arrive, counted by an atomic: one launch); both add them in the order s = 0..S-1
    split_reduce: str = "kernel"
    rows: int = 1  # fma_rows: rows per program (a power of two); the other variants: 1
    # fma, fma_rows: the next W tile loaded into registers before this one is multiplied (the pipelining Triton
    # gives tl.dot loops by num_stages and not these)
    prefetch: bool = False
    w_cache: str = ""  # the weight stream's load hint: "" (default), "cg" (L2 only) or "evict_first"
    # programmatic dependent launch (sm_90+): this GEMV is placed while the previous kernel drains and reads
    # its first W tile (prefetch) before waiting for it; a kernel launched after it may start likewise
    pdl: bool = False
    # > 0: a persistent grid of this many programs per SM (split-K and row blocks included), each looping over
    # output tiles; 0: one program per tile
    persistent: int = 0

    def __post_init__(self):
        if self.variant not in VARIANTS:
            raise ValueError(f"GemvConfig.variant {self.variant!r}: expected one of {', '.join(VARIANTS)}")
        for name in ("block_n", "block_k", "num_warps", "rows"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"GemvConfig.{name} {value}: expected a power of two")
        if self.split_reduce not in ("kernel", "last"):
            raise ValueError(f"GemvConfig.split_reduce {self.split_reduce!r}: expected kernel or last")
        if self.split_k < 1 or self.num_stages < 1 or self.persistent < 0:
            raise ValueError(f"GemvConfig {self.name}: split_k and num_stages must be >= 1, persistent >= 0")
        if (self.rows > 1) != (self.variant == "fma_rows"):
            raise ValueError(f"GemvConfig {self.name}: rows > 1 is fma_rows' (and fma_rows needs rows > 1)")
        if self.variant in ("dot", "dot_swap") and (self.block_n < 16 or self.block_k < 16):
            raise ValueError(f"GemvConfig {self.name}: tl.dot needs block_n and block_k >= 16")
        if self.prefetch and self.variant not in ("fma", "fma_rows"):
            raise ValueError(f"GemvConfig {self.name}: prefetch is fma's and fma_rows' (tl.dot loops are pipelined "
                             "by num_stages)")
        if self.w_cache not in W_CACHE:
            raise ValueError(f"GemvConfig.w_cache {self.w_cache!r}: expected one of {', '.join(map(repr, W_CACHE))}")

    @property
    def name(self) -> str:
        last = "L" if self.split_k > 1 and self.split_reduce == "last" else ""
        rows = f" r{self.rows}" if self.rows > 1 else ""
        extras = "".join(f" {flag}" for flag, on in (("pf", self.prefetch), (self.w_cache, self.w_cache),
                                                      ("pdl", self.pdl), (f"p{self.persistent}", self.persistent))
                         if on)
        return (f"{self.variant}{rows} n{self.block_n} k{self.block_k} s{self.split_k}{last} "
                f"w{self.num_warps} st{self.num_stages}{extras}")

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("variant", "block_n", "block_k", "split_k", "num_warps", "num_stages",
                                              "split_reduce", "rows", "prefetch", "w_cache", "pdl",
                                              "persistent")}


@dataclass
class RopeKV:
    """gemv's rope fusion: where the q|k|v projection's RoPE (half-split, fp32 cos/sin tables [P, D/2]) and KV
    cache write go (kernels/fused.py rope_kv_write's contract): caches [blocks, block_size, Hkv, D]."""

    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    cos: torch.Tensor
    sin: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    num_heads: int
    num_kv_heads: int
    head_dim: int


@triton.jit
def _scaled(acc, offs_n, n_ok, scale_ptr, bias_ptr, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr):
    # acc: [rows, BLOCK_N] fp32 -> acc·scale + bias (columns offs_n), fp32
    if HAS_SCALE:
        acc = acc * tl.load(scale_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def _scale_bias_store(acc, offs_m, offs_n, ok, n_ok, scale_ptr, bias_ptr, y_ptr, res_ptr, stride_ym, stride_rm,
                      HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, RESIDUAL: tl.constexpr):
    y = _scaled(acc, offs_n, n_ok, scale_ptr, bias_ptr, HAS_SCALE, HAS_BIAS).to(y_ptr.dtype.element_ty)
    if RESIDUAL:  # residual + (x·Wᵀ rounded to the output dtype), summed in fp32: add_rms_norm's rounding
        r = tl.load(res_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], mask=ok, other=0.0)
        y = (r.to(tl.float32) + y.to(tl.float32)).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], y, mask=ok)


@triton.jit
def _swiglu_store(gate, up, offs_m, offs_n, ok, n_ok, N, scale_ptr, bias_ptr, y_ptr, stride_ym,
                  HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr):
    # gate, up: [rows, BLOCK_N] fp32 sums of output columns offs_n and N + offs_n; each rounded to the output dtype
    # as the GEMV would store it, silu rounded before the product (fused.silu_mul's rounding)
    dtype = y_ptr.dtype.element_ty
    g = _scaled(gate, offs_n, n_ok, scale_ptr, bias_ptr, HAS_SCALE, HAS_BIAS).to(dtype).to(tl.float32)
    u = _scaled(up, N + offs_n, n_ok, scale_ptr, bias_ptr, HAS_SCALE, HAS_BIAS).to(dtype).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], (silu * u).to(dtype), mask=ok)


@triton.jit
def _rope_kv_store(a, b, offs_m, m_ok, n_ok, head, first, scale_ptr, bias_ptr, y_ptr, stride_ym, pos_ptr, slot_ptr,
                   cos_ptr, sin_ptr, k_cache, v_cache, stride_kslot, stride_vslot, HAS_SCALE: tl.constexpr,
                   HAS_BIAS: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr,
                   FP8_CACHE: tl.constexpr):
    # a, b: [rows, BLOCK_N] fp32 sums of W rows `first` and first + HALF (the two halves of a head's pair i);
    # rounded to the output dtype as the GEMV stores qkv, then fused.rope_kv_write's maths: q rotated into
    # y [M, Hq·2·HALF], k rotated (rounded, then saturated for an FP8 cache) and v into their cache slots
    dtype = y_ptr.dtype.element_ty
    a = _scaled(a, first, n_ok, scale_ptr, bias_ptr, HAS_SCALE, HAS_BIAS).to(dtype).to(tl.float32)
    b = _scaled(b, first + HALF, n_ok, scale_ptr, bias_ptr, HAS_SCALE, HAS_BIAS).to(dtype).to(tl.float32)
    ok = m_ok[:, None] & n_ok[None, :]
    i = first - head * (2 * HALF)  # the pair within the head
    pos = tl.load(pos_ptr + offs_m, mask=m_ok, other=0)
    cos = tl.load(cos_ptr + pos[:, None] * HALF + i[None, :], mask=ok, other=0.0)
    sin = tl.load(sin_ptr + pos[:, None] * HALF + i[None, :], mask=ok, other=0.0)
    rotated_a, rotated_b = a * cos - b * sin, b * cos + a * sin
    is_q = ok & (head < HQ)[None, :]
    q_dst = y_ptr + offs_m[:, None] * stride_ym + first[None, :]
    tl.store(q_dst, rotated_a.to(dtype), mask=is_q)
    tl.store(q_dst + HALF, rotated_b.to(dtype), mask=is_q)
    slot = tl.load(slot_ptr + offs_m, mask=m_ok, other=0)
    k_a, k_b = rotated_a.to(dtype).to(tl.float32), rotated_b.to(dtype).to(tl.float32)
    if FP8_CACHE:  # an FP8 E4M3 cache (unit scale): saturate at its largest finite value, as the torch write does
        k_a, k_b = tl.clamp(k_a, -448.0, 448.0), tl.clamp(k_b, -448.0, 448.0)
        a, b = tl.clamp(a, -448.0, 448.0), tl.clamp(b, -448.0, 448.0)
    is_k = ok & ((head >= HQ) & (head < HQ + HKV))[None, :]
    k_dst = k_cache + slot[:, None] * stride_kslot + (first - HQ * 2 * HALF)[None, :]
    tl.store(k_dst, k_a.to(k_cache.dtype.element_ty), mask=is_k)
    tl.store(k_dst + HALF, k_b.to(k_cache.dtype.element_ty), mask=is_k)
    is_v = ok & (head >= HQ + HKV)[None, :]
    v_dst = v_cache + slot[:, None] * stride_vslot + (first - (HQ + HKV) * 2 * HALF)[None, :]
    tl.store(v_dst, a.to(v_cache.dtype.element_ty), mask=is_v)
    tl.store(v_dst + HALF, b.to(v_cache.dtype.element_ty), mask=is_v)


@triton.jit
def _epilogue(acc, offs_m, offs_n, m_ok, n_ok, pid_n, pid_k, pid_m, tiles, M, N, scale_ptr, bias_ptr, y_ptr, part_ptr,
              lock_ptr, res_ptr, stride_ym, stride_rm, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
              SPLIT: tl.constexpr, RESIDUAL: tl.constexpr):
    # acc: [rows, BLOCK_N] fp32
    ok = m_ok[:, None] & n_ok[None, :]
    if SPLIT == 0:
        _scale_bias_store(acc, offs_m, offs_n, ok, n_ok, scale_ptr, bias_ptr, y_ptr, res_ptr, stride_ym, stride_rm,
                          HAS_SCALE, HAS_BIAS, RESIDUAL)
    else:  # fp32 partial sums of this K split: workspace [S, M, N]
        parts = part_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.store(parts + pid_k * M * N, acc, mask=ok)
        if SPLIT == 2:  # the last split of this tile to arrive adds all S partials, in the order s = 0..S-1
            tl.debug_barrier()  # every thread's partials stored before the release below (CUTLASS's semaphore)
            lock = lock_ptr + pid_m * tiles + pid_n
            arrived = tl.atomic_add(lock, 1, sem="acq_rel", scope="gpu")
            tl.debug_barrier()
            if arrived == tl.num_programs(1) - 1:
                total = tl.zeros_like(acc)
                for s in range(0, tl.num_programs(1)):
                    total += tl.load(parts + s * M * N, mask=ok, other=0.0, cache_modifier=".cg")
                _scale_bias_store(total, offs_m, offs_n, ok, n_ok, scale_ptr, bias_ptr, y_ptr, res_ptr, stride_ym,
                                  stride_rm, HAS_SCALE, HAS_BIAS, RESIDUAL)
                tl.atomic_xchg(lock, 0, sem="relaxed", scope="gpu")  # zero again for the next launch


@triton.jit
def _load_x(x_rows, offs_k, m_ok, k_end, EVEN: tl.constexpr):
    """x [rows, BLOCK_K] at columns offs_k of the rows at x_rows ([rows, 1] pointers): zeros past M, and past
    k_end unless EVEN (K in whole tiles)."""
    if EVEN:
        return tl.load(x_rows + offs_k[None, :], mask=m_ok[:, None], other=0.0)
    return tl.load(x_rows + offs_k[None, :], mask=m_ok[:, None] & (offs_k < k_end)[None, :], other=0.0)


@triton.jit
def _load_w(w_rows, offs_k, n_ok, k_end, EVEN: tl.constexpr, W_CACHE: tl.constexpr, AHEAD: tl.constexpr):
    """W [BLOCK_N, BLOCK_K] at columns offs_k of the rows at w_rows ([BLOCK_N, 1] pointers). EVEN (N and K in
    whole tiles): no mask, unless AHEAD (prefetch's load one tile past the split's end: masked off whole; k_end a
    multiple of 16 keeps the mask uniform over each 16-byte vector). Not EVEN: zeros past N and k_end.
    W_CACHE 1: .cg (L2 only), 2: evict_first (each weight byte is read once a step: keep the caches for x)."""
    ptrs = w_rows + offs_k[None, :]
    if EVEN and not AHEAD:
        if W_CACHE == 1:
            return tl.load(ptrs, cache_modifier=".cg")
        elif W_CACHE == 2:
            return tl.load(ptrs, eviction_policy="evict_first")
        return tl.load(ptrs)
    if EVEN:
        mask = (offs_k < k_end)[None, :]
    else:
        mask = n_ok[:, None] & (offs_k < k_end)[None, :]
    if W_CACHE == 1:
        return tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg")
    elif W_CACHE == 2:
        return tl.load(ptrs, mask=mask, other=0.0, eviction_policy="evict_first")
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _tile_product(x_ptr, w_rows, norm_ptr, offs_m, m_ok, n_ok, k_begin, k_end, K, eps, stride_xm,
                  VARIANT: tl.constexpr, NORM: tl.constexpr, EVEN: tl.constexpr, IEEE: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FMA_ROWS: tl.constexpr,
                  PREFETCH: tl.constexpr, W_CACHE: tl.constexpr, PDL: tl.constexpr):
    """[rows, BLOCK_N] fp32: rows offs_m of x times the W rows at w_rows ([BLOCK_N, 1] pointers) over K in
    [k_begin, k_end). NORM: x·g (g at norm_ptr) multiplies W and each row's sum is scaled by its
    rstd = 1 / sqrt(mean(x²) + eps), mean(x²) summed from the same loads (so NORM needs the whole of K in
    one program): rmsnorm(x)·Wᵀ = rstd · (x·g)·Wᵀ.
    PDL: nothing the previous kernel may write (x, the norm weight's neighbours, outputs) is touched before
    gdc_wait; only W, which no kernel writes, is read ahead of it (PREFETCH's first tile)."""
    x_rows = x_ptr + offs_m[:, None] * stride_xm  # [rows, 1]; fma: rows = 1
    if VARIANT >= 2:  # fma, fma_rows: products summed per lane along K, across lanes at the end (CUDA cores)
        if PREFETCH:  # W one tile ahead in registers: Triton's pipeliner leaves a loop without tl.dot alone
            w_next = _load_w(w_rows, k_begin + tl.arange(0, BLOCK_K), n_ok, k_end, EVEN, W_CACHE, False)
        if PDL:
            tl.extra.cuda.gdc_wait()
        lanes = tl.zeros([FMA_ROWS, BLOCK_N, BLOCK_K], tl.float32)
        squares = tl.zeros([FMA_ROWS, BLOCK_K], tl.float32)
        for k0 in range(k_begin, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            if PREFETCH:
                w = w_next
                w_next = _load_w(w_rows, offs_k + BLOCK_K, n_ok, k_end, EVEN, W_CACHE, True)
            else:
                w = _load_w(w_rows, offs_k, n_ok, k_end, EVEN, W_CACHE, False)
            x = _load_x(x_rows, offs_k, m_ok, k_end, EVEN).to(tl.float32)  # [rows, BLOCK_K]
            if NORM:
                squares += x * x
                x = x * tl.load(norm_ptr + offs_k, mask=offs_k < k_end, other=0.0).to(tl.float32)[None, :]
            lanes += w.to(tl.float32)[None, :, :] * x[:, None, :]
        acc = tl.sum(lanes, axis=2)  # [rows, BLOCK_N]
        if NORM:
            acc = acc * (1.0 / tl.sqrt(tl.sum(squares, axis=1) / K + eps))[:, None]
    else:  # dot, dot_swap: BLOCK_M rows (zeros past M) on tensor cores
        if PDL:
            tl.extra.cuda.gdc_wait()
        if VARIANT == 0:
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        else:
            acc_t = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        squares = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
        for k0 in range(k_begin, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = _load_x(x_rows, offs_k, m_ok, k_end, EVEN)
            w = _load_w(w_rows, offs_k, n_ok, k_end, EVEN, W_CACHE, False)
            if NORM:  # x·g rounded to x's dtype: the MMA's operand
                xf = x.to(tl.float32)
                squares += xf * xf
                g = tl.load(norm_ptr + offs_k, mask=offs_k < k_end, other=0.0).to(tl.float32)
                x = (xf * g[None, :]).to(x.dtype)
            if IEEE:  # fp32 activations: exact fp32 products (no TF32)
                w = w.to(tl.float32)
                if VARIANT == 0:
                    acc += tl.dot(x, tl.trans(w), input_precision="ieee")
                else:
                    acc_t += tl.dot(w, tl.trans(x), input_precision="ieee")
            else:  # 8-bit weights widened to the activations' dtype: exact (E4M3, |q| <= 127)
                if w.dtype.is_int():  # int8 -> fp32 -> bf16 (Triton's interpreter casts int -> bf16 wrongly)
                    w = w.to(tl.float32)
                w = w.to(x.dtype)
                if VARIANT == 0:
                    acc = tl.dot(x, tl.trans(w), acc)
                else:
                    acc_t = tl.dot(w, tl.trans(x), acc_t)
        if VARIANT == 1:
            acc = tl.trans(acc_t)
        if NORM:
            acc = acc * (1.0 / tl.sqrt(tl.sum(squares, axis=1) / K + eps))[:, None]
    return acc


@triton.jit
def _gemv_tile(pid_n, pid_k, pid_m, tiles, x_ptr, w_ptr, scale_ptr, bias_ptr, y_ptr, part_ptr, lock_ptr, norm_ptr,
               res_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr, k_cache, v_cache, M, N, K, K_SPLIT, eps, stride_xm,
               stride_wn, stride_ym, stride_rm, stride_kslot, stride_vslot, VARIANT: tl.constexpr,
               HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, EVEN: tl.constexpr,
               IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               FMA_ROWS: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr, SWIGLU: tl.constexpr,
               ROPE: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, FP8_CACHE: tl.constexpr,
               PREFETCH: tl.constexpr, W_CACHE: tl.constexpr, PDL: tl.constexpr):
    """Output tile pid_n (of `tiles`), K split pid_k, row block pid_m: its product, fusions and store."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    k_begin = pid_k * K_SPLIT
    k_end = tl.minimum(k_begin + K_SPLIT, K)
    if VARIANT == 2:
        offs_m = pid_m + tl.arange(0, 1)
    elif VARIANT == 3:
        offs_m = pid_m * FMA_ROWS + tl.arange(0, FMA_ROWS)
    else:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    if ROPE:  # N counts head-pairs: column j is pair i = j % HALF of head j // HALF, W rows `first` and + HALF
        head = offs_n // HALF
        first = head * (2 * HALF) + offs_n % HALF
        a = _tile_product(x_ptr, w_ptr + first[:, None] * stride_wn, norm_ptr, offs_m, m_ok, n_ok, k_begin,
                          k_end, K, eps, stride_xm, VARIANT, NORM, EVEN, IEEE, BLOCK_M, BLOCK_N, BLOCK_K, FMA_ROWS,
                          PREFETCH, W_CACHE, PDL)
        b = _tile_product(x_ptr, w_ptr + (first + HALF)[:, None] * stride_wn, norm_ptr, offs_m, m_ok, n_ok,
                          k_begin, k_end, K, eps, stride_xm, VARIANT, NORM, EVEN, IEEE, BLOCK_M, BLOCK_N, BLOCK_K,
                          FMA_ROWS, PREFETCH, W_CACHE, PDL)
        _rope_kv_store(a, b, offs_m, m_ok, n_ok, head, first, scale_ptr, bias_ptr, y_ptr, stride_ym, pos_ptr,
                       slot_ptr, cos_ptr, sin_ptr, k_cache, v_cache, stride_kslot, stride_vslot, HAS_SCALE, HAS_BIAS,
                       HQ, HKV, HALF, FP8_CACHE)
    else:
        acc = _tile_product(x_ptr, w_ptr + offs_n[:, None] * stride_wn, norm_ptr, offs_m, m_ok, n_ok, k_begin,
                            k_end, K, eps, stride_xm, VARIANT, NORM, EVEN, IEEE, BLOCK_M, BLOCK_N, BLOCK_K, FMA_ROWS,
                            PREFETCH, W_CACHE, PDL)
        if SWIGLU:  # W is [gate; up], 2·N rows: this program's up columns are rows N + offs_n; no split
            up = _tile_product(x_ptr, w_ptr + (N + offs_n)[:, None] * stride_wn, norm_ptr, offs_m, m_ok, n_ok,
                               k_begin, k_end, K, eps, stride_xm, VARIANT, NORM, EVEN, IEEE, BLOCK_M, BLOCK_N, BLOCK_K,
                               FMA_ROWS, PREFETCH, W_CACHE, PDL)
            _swiglu_store(acc, up, offs_m, offs_n, m_ok[:, None] & n_ok[None, :], n_ok, N, scale_ptr, bias_ptr, y_ptr,
                          stride_ym, HAS_SCALE, HAS_BIAS)
        else:
            _epilogue(acc, offs_m, offs_n, m_ok, n_ok, pid_n, pid_k, pid_m, tiles, M, N, scale_ptr, bias_ptr, y_ptr,
                      part_ptr, lock_ptr, res_ptr, stride_ym, stride_rm, HAS_SCALE, HAS_BIAS, SPLIT, RESIDUAL)




@triton.jit(do_not_specialize=["M"])  # K_SPLIT: a multiple of BLOCK_K, so 16-byte aligned
def _gemv_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, y_ptr, part_ptr, lock_ptr, norm_ptr, res_ptr, pos_ptr, slot_ptr,
                 cos_ptr, sin_ptr, k_cache, v_cache, M, N, K, K_SPLIT, eps, stride_xm, stride_wn, stride_ym, stride_rm,
                 stride_kslot, stride_vslot, VARIANT: tl.constexpr, HAS_SCALE: tl.constexpr,
                 HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, EVEN: tl.constexpr, IEEE: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FMA_ROWS: tl.constexpr,
                 NORM: tl.constexpr, RESIDUAL: tl.constexpr, SWIGLU: tl.constexpr, ROPE: tl.constexpr,
                 HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, FP8_CACHE: tl.constexpr,
                 PREFETCH: tl.constexpr, W_CACHE: tl.constexpr, PDL: tl.constexpr, PERSISTENT: tl.constexpr):
    if PDL:  # the next kernel may start as this grid's last programs are placed: its W prefetch hides our tail
        tl.extra.cuda.gdc_launch_dependents()
    pid_k = tl.program_id(1)  # the K split
    pid_m = tl.program_id(2)  # fma: the row; fma_rows: the block of FMA_ROWS rows; dot, dot_swap: of BLOCK_M
    tiles = tl.cdiv(N, BLOCK_N)
    if PERSISTENT:  # a fixed grid of a few programs per SM, each taking every num_programs-th output tile
        for pid_n in range(tl.program_id(0), tiles, tl.num_programs(0)):
            _gemv_tile(pid_n, pid_k, pid_m, tiles, x_ptr, w_ptr, scale_ptr, bias_ptr, y_ptr, part_ptr, lock_ptr,
                       norm_ptr, res_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr, k_cache, v_cache, M, N, K, K_SPLIT,
                       eps, stride_xm, stride_wn, stride_ym, stride_rm, stride_kslot, stride_vslot, VARIANT,
                       HAS_SCALE, HAS_BIAS, SPLIT, EVEN, IEEE, BLOCK_M, BLOCK_N, BLOCK_K, FMA_ROWS, NORM, RESIDUAL,
                       SWIGLU, ROPE, HQ, HKV, HALF, FP8_CACHE, PREFETCH, W_CACHE, PDL)
    else:
        _gemv_tile(tl.program_id(0), pid_k, pid_m, tiles, x_ptr, w_ptr, scale_ptr, bias_ptr, y_ptr, part_ptr,
                   lock_ptr, norm_ptr, res_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr, k_cache, v_cache, M, N, K,
                   K_SPLIT, eps, stride_xm, stride_wn, stride_ym, stride_rm, stride_kslot, stride_vslot, VARIANT,
                   HAS_SCALE, HAS_BIAS, SPLIT, EVEN, IEEE, BLOCK_M, BLOCK_N, BLOCK_K, FMA_ROWS, NORM, RESIDUAL,
                   SWIGLU, ROPE, HQ, HKV, HALF, FP8_CACHE, PREFETCH, W_CACHE, PDL)


@triton.jit
def _split_reduce_kernel(part_ptr, scale_ptr, bias_ptr, y_ptr, res_ptr, M, N, stride_ym, stride_rm,
                         SPLITS: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
                         RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    n_ok = offs_n < N
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLITS):  # always s = 0, 1, ...: the same sum whatever M is
        acc += tl.load(part_ptr + (s * M + row) * N + offs_n, mask=n_ok, other=0.0)
    if HAS_SCALE:
        acc = acc * tl.load(scale_ptr + offs_n, mask=n_ok, other=0.0)
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    y = acc.to(y_ptr.dtype.element_ty)
    if RESIDUAL:
        r = tl.load(res_ptr + row * stride_rm + offs_n, mask=n_ok, other=0.0)
        y = (r.to(tl.float32) + y.to(tl.float32)).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + row * stride_ym + offs_n, y, mask=n_ok)


_LOCKS: dict[torch.device, torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []  # buffers a larger one replaced: a captured CUDA graph may still point at them


def _locks(device: torch.device, count: int) -> torch.Tensor:
    """The arrival counters of split_reduce="last", one per output tile: zeros, and every launch leaves them
    zero again (the last program resets its tile's). One buffer per device, shared by every launch in
    stream order. Allocated outside CUDA-graph capture: the first call of a config is a warm-up that runs
    eagerly (the engine's graph capture, bench/gemv.py and the tuner all call before they capture)."""
    found = _LOCKS.get(device)
    if found is None or found.numel() < count:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("gemv: split_reduce='last' needs its counters allocated before CUDA-graph capture; "
                               "call it once eagerly first")
        if found is not None:
            _OUTGROWN.append(found)
        found = _LOCKS[device] = torch.zeros(max(count, 1 << 16), dtype=torch.int32, device=device)
    return found


_SM_COUNTS: dict[torch.device, int] = {}


def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (a persistent grid's size); 4 elsewhere (the interpreter)."""
    if device.type != "cuda":
        return 4
    if device not in _SM_COUNTS:
        _SM_COUNTS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SM_COUNTS[device]


def split_length(k: int, config: GemvConfig) -> int:
    """Inputs per K split: a multiple of block_k, so every split but the last is whole tiles."""
    per = -(-k // config.split_k)
    return -(-per // config.block_k) * config.block_k


def gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
         config: GemvConfig = GemvConfig(), *, norm: torch.Tensor | None = None, eps: float = 0.0,
         residual: torch.Tensor | None = None, swiglu: bool = False, rope: RopeKV | None = None) -> torch.Tensor:
    """x: [..., K] (bf16, fp16 or fp32); weight: [N, K] in x's dtype, float8_e4m3fn or int8 (row-major);
    scale: [N] fp32 per output channel (8-bit weights), bias: [N] -> y [..., N] in x's dtype, y = x·Wᵀ + b.

    The decode layer's neighbours fused in (the three compose):
      norm [K]: RMSNorm of x first, y = rmsnorm(x)·Wᵀ + b = rstd·(x·norm)·Wᵀ + b, rstd = 1/sqrt(mean(x²) + eps)
                computed in the same pass over x (so the whole of K in one program: split_k 1);
      residual [..., N]: y = residual + (x·Wᵀ + b), the product rounded to x's dtype first (add_rms_norm's sum);
      swiglu: W holds [gate; up] (2·I rows, scale and bias likewise), y [..., I] = silu(gate)·up, each program
              computing matching gate and up columns (split_k 1; no residual);
      rope: W is q|k|v ((Hq + 2·Hkv)·D rows); each program computes both halves of its heads' RoPE pairs and
              stores fused.rope_kv_write's results: y [..., Hq·D] the rotated q, k and v into the cache's slots
              (split_k 1; no residual, no swiglu)."""
    k = x.shape[-1]
    n = weight.shape[0] // 2 if swiglu or rope is not None else weight.shape[0]  # rope: head-pairs
    if weight.shape[1] != k or weight.stride(1) != 1:
        raise ValueError(f"gemv: weight {list(weight.shape)} (strides {weight.stride()}) is not a row-major "
                         f"[N, {k}] matrix for x {list(x.shape)}")
    if weight.dtype in (torch.float8_e4m3fn, torch.int8) and scale is None:
        raise ValueError(f"gemv: a {weight.dtype} weight needs its per-channel scale")
    if (norm is not None or swiglu) and config.split_k != 1:
        raise ValueError(f"gemv: config {config.name} splits K; norm and swiglu need split_k 1")
    if swiglu and (weight.shape[0] % 2 or residual is not None):
        raise ValueError(f"gemv: swiglu needs an even [2·I, K] weight (got {list(weight.shape)}) and no residual")
    if rope is not None and (swiglu or residual is not None or config.split_k != 1
                             or weight.shape[0] != (rope.num_heads + 2 * rope.num_kv_heads) * rope.head_dim):
        raise ValueError(f"gemv: rope needs a q|k|v weight of {rope.num_heads}+2x{rope.num_kv_heads} heads of "
                         f"{rope.head_dim} (got {list(weight.shape)}), split_k 1, no swiglu and no residual")
    if norm is not None and norm.shape != (k,):
        raise ValueError(f"gemv: norm weight {list(norm.shape)} for x of {k} features")
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if residual is not None and (residual.shape[-1] != n or residual.numel() != m * n or residual.dtype != x.dtype):
        raise ValueError(f"gemv: residual {list(residual.shape)} {residual.dtype} for an output of [{m}, {n}] "
                         f"{x.dtype}")
    res2 = residual.reshape(m, n) if residual is not None else None
    length = split_length(k, config)
    splits = -(-k // length)
    if max(splits * m * n, m * x2.stride(0), weight.shape[0] * weight.stride(0)) >= 2**31:
        raise ValueError(f"gemv: {m} x {k} x {n} (split {splits}) is past int32 offsets: it is for decode rows, "
                         "use a GEMM")
    y = torch.empty((m, rope.num_heads * rope.head_dim if rope is not None else n), dtype=x.dtype, device=x.device)
    even = k % config.block_k == 0 and length % config.block_k == 0 and n % config.block_n == 0
    rows = m if config.variant == "fma" else -(-m // (config.rows if config.variant == "fma_rows" else MAX_ROWS))
    tiles = triton.cdiv(n, config.block_n)
    part = torch.empty((splits, m, n), dtype=torch.float32, device=x.device) if splits > 1 else y
    last = splits > 1 and config.split_reduce == "last"
    lock = _locks(x.device, rows * tiles) if last else y

    def given(t: torch.Tensor | None) -> torch.Tensor:  # an unused pointer argument (its flag off) points at y
        return y if t is None else t

    r = rope or RopeKV(y, y, y, y, y, y, 1, 1, 2)  # unused pointers when rope is off
    pdl = config.pdl and x.device.type == "cuda" and not INTERPRETED  # the interpreter runs launches in order
    programs = tiles if not config.persistent else min(tiles, max(1, config.persistent * _sm_count(x.device)
                                                                 // (splits * rows)))
    _gemv_kernel[(programs, splits, rows)](
        x2, weight, given(scale), given(bias), y, part, lock, given(norm), given(res2), r.positions, r.slot_mapping,
        r.cos, r.sin, r.k_cache, r.v_cache,
        m, n, k, length, eps, x2.stride(0), weight.stride(0), y.stride(0), 0 if res2 is None else res2.stride(0),
        r.k_cache.stride(1) if rope is not None else 0, r.v_cache.stride(1) if rope is not None else 0,
        VARIANT=VARIANTS[config.variant], HAS_SCALE=scale is not None, HAS_BIAS=bias is not None,
        SPLIT=0 if splits == 1 else 2 if last else 1,
        EVEN=even, IEEE=x.dtype == torch.float32, BLOCK_M=MAX_ROWS, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, FMA_ROWS=config.rows, NORM=norm is not None, RESIDUAL=res2 is not None,
        SWIGLU=swiglu, ROPE=rope is not None, HQ=r.num_heads, HKV=r.num_kv_heads, HALF=r.head_dim // 2,
        FP8_CACHE=r.k_cache.dtype == torch.float8_e4m3fn, PREFETCH=config.prefetch, W_CACHE=W_CACHE[config.w_cache],
        PDL=pdl, PERSISTENT=config.persistent > 0, num_warps=config.num_warps, num_stages=config.num_stages,
        **({"launch_pdl": True} if pdl else {}))
    if splits > 1 and not last:
        block = min(1024, triton.next_power_of_2(n))
        _split_reduce_kernel[(triton.cdiv(n, block), m)](
            part, given(scale), given(bias), y, given(res2), m, n, y.stride(0),
            0 if res2 is None else res2.stride(0), SPLITS=splits, HAS_SCALE=scale is not None,
            HAS_BIAS=bias is not None, RESIDUAL=res2 is not None, BLOCK=block, num_warps=4)
    return y.reshape(*x.shape[:-1], y.shape[1])


class DecodeGemv:
    """A linear layer's decode plan (kiln/llm/decode_gemv.py chooses it): rows bucket -> the config this GEMV
    runs at, or None where the layer's own path (cuBLAS) was faster. Rows past the last bucket: None."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor | None, plan: dict[int, GemvConfig | None]):
        self.weight, self.scale = weight, scale  # the layer's own tensors, not copies
        self.plan = dict(sorted(plan.items()))

    def config_for(self, rows: int) -> GemvConfig | None:
        for bucket, config in self.plan.items():
            if rows <= bucket:
                return config
        return None

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
        """x·Wᵀ (+ bias) by the GEMV, or None when x's rows are the layer's own path's."""
        config = self.config_for(x.numel() // x.shape[-1])
        return None if config is None else gemv(x, self.weight, self.scale, bias, config)


def candidate_configs(n: int, k: int, weight_dtype: torch.dtype) -> list[GemvConfig]:
    """The configs a tuner times for an [N, K] weight (bench/gemv.py sweeps them all; the engine a short list).
    Split-K while the grid stays under MAX_PROGRAMS: a second-kernel reduction only for 2 splits (its extra
    launch costs ~2-3 us in a graph), the last-arrival one for every split count."""
    wide = weight_dtype in (torch.float8_e4m3fn, torch.int8)  # 1-byte weights: twice the K per 16-byte load
    configs = []
    for tile in (
            ("dot", 16, 256, 4), ("dot", 32, 256, 4), ("dot", 64, 128, 4), ("dot", 16, 512, 4),
            ("dot_swap", 64, 128, 4), ("dot_swap", 64, 256, 4), ("dot_swap", 128, 128, 8),
            ("fma", 4, 512, 4), ("fma", 8, 256, 4), ("fma", 8, 512, 4), ("fma", 16, 512, 8), ("fma", 2, 1024, 4),
            ("fma", 4, 1024, 4), ("fma", 8, 1024, 8), ("fma_rows", 4, 512, 4, 2), ("fma_rows", 4, 512, 4, 4),
            ("fma_rows", 8, 256, 4, 4)):
        variant, block_n, block_k, warps = tile[:4]
        rows = tile[4] if len(tile) > 4 else 1
        if wide:
            block_k *= 2
        # fma has no tl.dot: Triton's pipeliner leaves its loop alone (sm_90 PTX: the same code at any
        # num_stages), so one stage; its loads in flight come from block_k and the programs per SM
        for stages in (3, 4) if variant in ("dot", "dot_swap") else (1,):
            tiles = -(-n // block_n)
            for split in (1, 2, 4, 8, 16):
                if split > 1 and (tiles * split > MAX_PROGRAMS or k // split < block_k):
                    continue
                for reduce in ("kernel", "last") if split == 2 else ("last",) if split > 2 else ("kernel",):
                    configs.append(GemvConfig(variant, block_n, block_k, split, warps, stages, reduce, rows))
    return configs
