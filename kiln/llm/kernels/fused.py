"""Fused elementwise kernels for the decoder layers on CUDA, in Triton: what a decode step is made of
besides its GEMMs. In a captured decode step each torch op is a kernel of a few us whatever its size;
the Llama layer's norms, RoPE, cache writes and SwiGLU were ~35 of them per layer, these make them 4
(an 8B model's graphed batch-1 step: 7.1 ms end to end before, 5.2 ms after, on the H200).

- rms_norm / add_rms_norm: (x [+ delta]) / sqrt(mean(x²) + eps) · w, one program per row; the sum is
  rounded to the storage dtype before normalizing, and x·rstd before the weight, as the torch reference
  (kiln/llm/models/layers.py RMSNorm, transformers' LlamaRMSNorm) rounds.
- rope_kv_write: from the fused q/k/v projection [T, (Hq + 2·Hkv)·D]: q rotated into [T, Hq, D], k rotated
  and v written into their cache slots, one program per token (half-split RoPE, cos/sin tables in fp32).
- silu_mul: SwiGLU's silu(gate)·up from the fused [T, 2·I] projection, silu rounded before the product.
- fp8_quantize_rows: per-token E4M3 activations and their scales for torch._scaled_mm (one program a row).
- rms_norm_fp8, silu_mul_fp8: the norm (after the residual add) and SwiGLU with the per-token E4M3 quantization
  of their output in the same pass, where an FP8 GEMM is what reads it: the bf16 rows are never stored and read
  back (a Llama-3-8B prefill of 65k tokens moves ~9 GB a layer less). The arithmetic is the two kernels' in a row,
  and so is its order: a row's sum of squares is a Triton reduction, whose order follows the register layout the
  compiler picks for the whole row, and the compiler picks it from the widest vector the kernel's loads and
  stores allow: 16 E4M3 values (16 bytes) where the bf16 kernel has 8. Summed in that other order, rstd's last
  bit differed from rms_norm's in ~18% of rows and ~0.07% of rows quantized to another E4M3 byte (Llama-3-8B
  widths, an emulation of the two orders: bench/results/llm-2026-12-03c.md), enough to change a random
  Llama-3-8B's greedy tokens at batch 512 (H200, llm4 runs 1-2) though 37-row kernel tests found the same bits.
  The E4M3 row is therefore stored in vectors of as many values as 16 bytes of the row's dtype hold (8 for bf16),
  and the layouts are checked at compile time; so the 8B run's tokens are the two kernels' (H200, llm5 run 1: every
  GEMM output of a 512 x 128 prefill and two decode steps bit-equal, and a 128/128 run's tokens).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, delta_ptr, w_ptr, out_ptr, sum_ptr, scale_ptr, N, eps, stride_x, stride_d, stride_o,
                     stride_s, HAS_DELTA: tl.constexpr, FP8_MAX: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # 64-bit offsets: row * stride passes 2^31 in a large prefill step
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_DELTA:
        x = (x.to(tl.float32) + tl.load(delta_ptr + row * stride_d + cols, mask=ok, other=0.0).to(tl.float32))
        x = x.to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_s + cols, x, mask=ok)
    x = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / N + eps)
    dtype = sum_ptr.dtype.element_ty  # x's dtype (sum_ptr is x itself without a delta): the model's rounding
    y = (x * rstd).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    normed = (w * y).to(dtype)
    if FP8_MAX > 0:  # the consumer is an FP8 GEMM: the bf16 row quantized here, as fp8_quantize_rows would
        normed = normed.to(tl.float32)
        scale = _fp8_scale(scale_ptr + row, tl.max(tl.abs(normed), 0), FP8_MAX)
        # E4M3 stored as many to a vector as a 16-byte vector holds of the row's dtype (8 bf16): at its own 16 the
        # compiler lays the whole row out 16 a thread, so the sum of squares above is added in another order than
        # rms_norm adds it (see the module docstring); tests/llm/reduction_layout_sm90.py checks one layout for both
        fp8_cols = tl.max_contiguous(cols, 128 // dtype.primitive_bitwidth)
        tl.store(out_ptr + row * stride_o + fp8_cols, (normed / scale).to(out_ptr.dtype.element_ty), mask=ok)
    else:
        tl.store(out_ptr + row * stride_o + cols, normed, mask=ok)


@triton.jit
def _fp8_scale(scale_ptr, top, FP8_MAX: tl.constexpr):
    """A row's per-token E4M3 scale from its largest |value| (stored, and returned to divide by)."""
    scale = tl.maximum(top, 1e-12) / FP8_MAX
    tl.store(scale_ptr, scale)
    return scale


def _norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
          fp8_max: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(x + delta or x, the normed rows in x's dtype or E4M3 when fp8_max > 0, their fp32 scales [T, 1] or None)."""
    fp8 = fp8_max > 0
    out = torch.empty(x.shape, dtype=torch.float8_e4m3fn if fp8 else x.dtype, device=x.device)
    total = torch.empty_like(x) if delta is not None else x
    scale = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device) if fp8 else None
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0],)](x, x if delta is None else delta, weight, out, total,
                                        scale if fp8 else out, x.shape[1], eps, x.stride(0),
                                        0 if delta is None else delta.stride(0), out.stride(0), total.stride(0),
                                        HAS_DELTA=delta is not None, FP8_MAX=fp8_max,
                                        BLOCK=triton.next_power_of_2(x.shape[1]))
    return total, out, scale


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _norm(x, None, weight, eps, 0.0)[1]


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)) in one pass."""
    total, out, _ = _norm(x, delta, weight, eps, 0.0)
    return total, out


def rms_norm_fp8(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 fp8_max: float = 448.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x + delta (x when delta is None), and rms_norm of it quantized as fp8_quantize_rows would quantize the
    bf16 rows rms_norm writes: E4M3 [T, N], fp32 scales [T, 1]) in one pass: the normed rows never go to memory."""
    return _norm(x, delta, weight, eps, fp8_max)


@triton.jit
def _rotate(x_ptr, heads, half, ok, cos, sin, HALF: tl.constexpr):
    x1 = tl.load(x_ptr + heads[:, None] * (2 * HALF) + half[None, :], mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + heads[:, None] * (2 * HALF) + HALF + half[None, :], mask=ok, other=0.0).to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _rope_kv_kernel(qkv_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr, q_ptr, k_cache, v_cache, stride_qkv, stride_q,
                    stride_kslot, stride_vslot, HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr,
                    BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr, FP8: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)  # 64-bit offsets (a large prefill step's rows)
    pos = tl.load(pos_ptr + t)
    slot = tl.load(slot_ptr + t)
    half = tl.arange(0, BLOCK_HALF)
    half_ok = half < HALF
    cos = tl.load(cos_ptr + pos * HALF + half, mask=half_ok, other=0.0)[None, :]
    sin = tl.load(sin_ptr + pos * HALF + half, mask=half_ok, other=0.0)[None, :]
    row = qkv_ptr + t * stride_qkv
    hq = tl.arange(0, BLOCK_HQ)
    ok = (hq < HQ)[:, None] & half_ok[None, :]
    a, b = _rotate(row, hq, half, ok, cos, sin, HALF)
    dst = q_ptr + t * stride_q + hq[:, None] * (2 * HALF) + half[None, :]
    tl.store(dst, a.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(dst + HALF, b.to(q_ptr.dtype.element_ty), mask=ok)
    hk = tl.arange(0, BLOCK_HKV)
    ok = (hk < HKV)[:, None] & half_ok[None, :]
    a, b = _rotate(row + HQ * 2 * HALF, hk, half, ok, cos, sin, HALF)
    # k rounded to q's dtype first, as the torch code does (rotate in the model dtype, then store)
    a, b = a.to(q_ptr.dtype.element_ty), b.to(q_ptr.dtype.element_ty)
    v_src = row + (HQ + HKV) * 2 * HALF + hk[:, None] * (2 * HALF) + half[None, :]
    v_a, v_b = tl.load(v_src, mask=ok, other=0.0), tl.load(v_src + HALF, mask=ok, other=0.0)
    if FP8:  # an FP8 E4M3 cache (unit scale): saturate at its largest finite value, as the torch write does
        a, b = tl.clamp(a.to(tl.float32), -448.0, 448.0), tl.clamp(b.to(tl.float32), -448.0, 448.0)
        v_a, v_b = tl.clamp(v_a.to(tl.float32), -448.0, 448.0), tl.clamp(v_b.to(tl.float32), -448.0, 448.0)
    dst = k_cache + slot * stride_kslot + hk[:, None] * (2 * HALF) + half[None, :]
    tl.store(dst, a.to(k_cache.dtype.element_ty), mask=ok)
    tl.store(dst + HALF, b.to(k_cache.dtype.element_ty), mask=ok)
    v_dst = v_cache + slot * stride_vslot + hk[:, None] * (2 * HALF) + half[None, :]
    tl.store(v_dst, v_a.to(v_cache.dtype.element_ty), mask=ok)
    tl.store(v_dst + HALF, v_b.to(v_cache.dtype.element_ty), mask=ok)


def rope_kv_write(qkv: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int,
                  num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """qkv [T, (Hq + 2·Hkv)·D] (rows contiguous) -> rotated q [T, Hq, D]; rotated k and v into the cache's
    slots (k_cache, v_cache: [blocks, block_size, Hkv, D], a token's heads contiguous)."""
    tokens = qkv.shape[0]
    q = torch.empty((tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if tokens == 0:
        return q
    half = head_dim // 2
    _rope_kv_kernel[(tokens,)](
        qkv, positions, slot_mapping, cos, sin, q, k_cache, v_cache, qkv.stride(0), q.stride(0),
        k_cache.stride(1), v_cache.stride(1), HQ=num_heads, HKV=num_kv_heads, HALF=half,
        BLOCK_HQ=triton.next_power_of_2(num_heads), BLOCK_HKV=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(half), FP8=k_cache.dtype == torch.float8_e4m3fn)
    return q


@triton.jit
def _silu(gate, up, dtype: tl.constexpr):
    """silu(gate)·up in fp32 from fp32 halves, rounded as the torch code rounds: silu to dtype, then the product."""
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return (silu * up).to(dtype)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, N, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # 64-bit offsets: 75k rows x 28672 (Llama-3-8B's gate|up) pass 2^31
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + N + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, _silu(gate, up, out_ptr.dtype.element_ty), mask=ok)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2·I] (gate then up) -> silu(gate)·up [T, I]."""
    n = x.shape[1] // 2
    out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(n))
    if x.shape[0]:
        _silu_mul_kernel[(x.shape[0], triton.cdiv(n, block))](x, out, n, x.stride(0), out.stride(0), BLOCK=block)
    return out


WHOLE_ROW_MAX = 16384  # the per-token quantizers hold a row this wide in registers (16 warps): one read of it


def _row_launch(n: int) -> dict:
    """A per-token quantizer's tile: the whole row when it fits (read once), else 2048-wide chunks read twice
    (once for the row's largest value, once to quantize)."""
    block = triton.next_power_of_2(n)
    if block <= WHOLE_ROW_MAX:
        return dict(BLOCK=block, WHOLE_ROW=True, num_warps=max(4, min(16, block // 1024)))
    return dict(BLOCK=2048, WHOLE_ROW=False, num_warps=4)


@triton.jit
def _silu_row(x_row, N, cols, dtype: tl.constexpr):
    """silu(gate)·up of columns `cols` of a [2·N] gate|up row, rounded to dtype, in fp32 (0 past N)."""
    gate = tl.load(x_row + cols, mask=cols < N, other=0.0).to(tl.float32)
    up = tl.load(x_row + N + cols, mask=cols < N, other=0.0).to(tl.float32)
    return _silu(gate, up, dtype).to(tl.float32)


@triton.jit
def _silu_mul_fp8_kernel(x_ptr, q_ptr, scale_ptr, N, stride_x, stride_q, FP8_MAX: tl.constexpr,
                         BLOCK: tl.constexpr, WHOLE_ROW: tl.constexpr):
    """One row: silu(gate)·up rounded to x's dtype, quantized per token; never written in bf16."""
    row = tl.program_id(0).to(tl.int64)  # 64-bit offsets (a large prefill step's rows)
    x_row, q_row = x_ptr + row * stride_x, q_ptr + row * stride_q
    dtype = x_ptr.dtype.element_ty
    if WHOLE_ROW:
        cols = tl.arange(0, BLOCK)
        act = _silu_row(x_row, N, cols, dtype)
        scale = _fp8_scale(scale_ptr + row, tl.max(tl.abs(act), 0), FP8_MAX)
        tl.store(q_row + cols, (act / scale).to(q_ptr.dtype.element_ty), mask=cols < N)
    else:  # the product computed twice: for the row's largest value, then to quantize
        top = tl.zeros([BLOCK], tl.float32)
        for c0 in range(0, N, BLOCK):
            top = tl.maximum(top, tl.abs(_silu_row(x_row, N, c0 + tl.arange(0, BLOCK), dtype)))
        scale = _fp8_scale(scale_ptr + row, tl.max(top, 0), FP8_MAX)
        for c0 in range(0, N, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            act = _silu_row(x_row, N, cols, dtype)
            tl.store(q_row + cols, (act / scale).to(q_ptr.dtype.element_ty), mask=cols < N)


def silu_mul_fp8(x: torch.Tensor, fp8_max: float = 448.0) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, 2·I] (gate then up) -> silu(gate)·up quantized per token as fp8_quantize_rows would quantize
    silu_mul's output (E4M3 [T, I], fp32 scales [T, 1]), without writing that output."""
    n = x.shape[1] // 2
    q = torch.empty((x.shape[0], n), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)
    if x.shape[0]:
        _silu_mul_fp8_kernel[(x.shape[0],)](x, q, scale, n, x.stride(0), q.stride(0), FP8_MAX=fp8_max,
                                            **_row_launch(n))
    return q, scale


@triton.jit
def _fp8_rows_kernel(x_ptr, q_ptr, scale_ptr, N, stride_x, stride_q, FP8_MAX: tl.constexpr, BLOCK: tl.constexpr,
                     WHOLE_ROW: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # 64-bit offsets (a large prefill step's rows)
    x_row, q_row = x_ptr + row * stride_x, q_ptr + row * stride_q
    if WHOLE_ROW:
        cols = tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < N, other=0.0).to(tl.float32)
        scale = _fp8_scale(scale_ptr + row, tl.max(tl.abs(x), 0), FP8_MAX)
        tl.store(q_row + cols, (x / scale).to(q_ptr.dtype.element_ty), mask=cols < N)
    else:  # the row read twice: for its largest value, then to quantize
        top = tl.zeros([BLOCK], tl.float32)
        for c0 in range(0, N, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            top = tl.maximum(top, tl.abs(tl.load(x_row + cols, mask=cols < N, other=0.0).to(tl.float32)))
        scale = _fp8_scale(scale_ptr + row, tl.max(top, 0), FP8_MAX)
        for c0 in range(0, N, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            x = tl.load(x_row + cols, mask=cols < N, other=0.0).to(tl.float32)
            tl.store(q_row + cols, (x / scale).to(q_ptr.dtype.element_ty), mask=cols < N)


def fp8_quantize_rows(x: torch.Tensor, fp8_max: float = 448.0) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (E4M3 [T, K], fp32 scales [T, 1]) with scale = max|row| / 448 (as FP8Weight's reference)."""
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)
    if x.shape[0]:
        _fp8_rows_kernel[(x.shape[0],)](x, q, scale, x.shape[1], x.stride(0), q.stride(0), FP8_MAX=fp8_max,
                                        **_row_launch(x.shape[1]))
    return q, scale

