"""A Triton GEMM with kiln's epilogue fused (kiln::FusedGemm): out = act(x @ wᵀ + bias) [+ residual].

x: [..., K], w: [N, K] (stored as torch.nn.functional.linear wants it) -> out: [..., N]. Each
program computes one BLOCK_M x BLOCK_N tile, accumulating in fp32 over K in BLOCK_K steps; the
bias, activation and residual are applied to the tile in registers before its one store, so
the GEMM output never makes a round trip through memory. Tiles are visited in groups of GROUP_M
rows (L2 reuse of w, as in Triton's matmul tutorial).

The config (block sizes, warps, stages) is a tactic parameter: the tactic framework times
GEMM_CONFIGS on the real shape and keeps the fastest (kiln's timing cache, not triton.autotune).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kiln.kernels.cuda.triton import device_math as dm
from kiln.kernels.cuda.triton.elementwise import FLOAT_DTYPES
from kiln.kernels.cuda.triton.epilogue import bias_activation


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3


GEMM_CONFIGS = (  # Hopper/Ampere-friendly tiles from Triton's matmul tutorial, largest first
    GemmConfig(128, 256, 64, num_warps=8, num_stages=3),
    GemmConfig(128, 128, 64, num_warps=8, num_stages=3),
    GemmConfig(128, 128, 32, num_warps=4, num_stages=4),
    GemmConfig(128, 64, 32, num_warps=4, num_stages=4),
    GemmConfig(64, 128, 32, num_warps=4, num_stages=4),
    GemmConfig(64, 64, 32, num_warps=4, num_stages=5),
    GemmConfig(32, 64, 32, num_warps=2, num_stages=5),
    GemmConfig(16, 64, 64, num_warps=2, num_stages=4),  # small M (batch-1 decode, GEMV-like)
)


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, bias_ptr, res_ptr, out_ptr, M, N, K, stride_xm, stride_xk, stride_wn, stride_wk,
                 alpha, beta, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ACTIVATION: tl.constexpr,
                 RES_AFTER: tl.constexpr, INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    tile_m, tile_n = dm.grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)

    rm = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)  # rm: [BM]
    rn = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)  # rn: [BN]
    rk = tl.arange(0, BLOCK_K)  # rk: [BK]
    x_tile = x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :] * stride_xk  # [BM, BK]
    w_tile = w_ptr + rk[:, None] * stride_wk + rn[None, :].to(tl.int64) * stride_wn  # [BK, BN] = wᵀ tile
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_left = K - k
        a = tl.load(x_tile, mask=(rm[:, None] < M) & (rk[None, :] < k_left), other=0.0)
        b = tl.load(w_tile, mask=(rk[:, None] < k_left) & (rn[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        x_tile += BLOCK_K * stride_xk
        w_tile += BLOCK_K * stride_wk

    # epilogue, on the fp32 tile in registers
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    offs = rm[:, None].to(tl.int64) * N + rn[None, :]  # out and residual: [M, N] contiguous
    residual = acc
    if HAS_RES:
        residual = tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    acc = dm.epilogue(acc, residual, ACTIVATION, alpha, beta, HAS_RES, RES_AFTER)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
         *, activation: str = "", alpha: float = 0.0, beta: float = 0.0, residual_after_activation: bool = True,
         config: GemmConfig | None = None, allow_tf32: bool = False,
         out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """act(x @ wᵀ + bias) + residual (or act(x @ wᵀ + bias + residual)), in x's dtype.

    x: [..., K]; w: [N, K] (any strides); bias: [N]; residual: broadcastable to [..., N].
    fp32 inputs multiply in full fp32 unless allow_tf32. config: one of GEMM_CONFIGS (default: the
    largest whose tile the problem fills, a starting point only — time them).
    out_dtype: the output's dtype (default x's); float32 stores the fp32 tile as it is (an engine's fp32 output).
    """
    if activation not in dm.ACTIVATIONS:
        raise ValueError(f"triton gemm: unknown activation {activation!r} (known: {dm.ACTIVATIONS})")
    if x.dtype not in FLOAT_DTYPES or w.dtype != x.dtype:
        raise TypeError(f"triton gemm: x and w must share a float16/bfloat16/float32 dtype, "
                        f"got {x.dtype} and {w.dtype}")
    if w.dim() != 2 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"triton gemm: x {tuple(x.shape)} @ wᵀ needs w as [N, {x.shape[-1]}], got {tuple(w.shape)}")
    n, k = w.shape
    lead = x.shape[:-1]
    out = torch.empty((*lead, n), dtype=out_dtype or x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    if k == 0:  # an empty sum: the epilogue alone
        return bias_activation(out.zero_(), bias, residual, activation=activation, alpha=alpha, beta=beta,
                               residual_after_activation=residual_after_activation, inplace=True)
    x2 = x.reshape(-1, k)  # x2: [M, K]
    m = x2.shape[0]
    if bias is not None:
        if bias.numel() != n:
            raise ValueError(f"triton gemm: bias has {bias.numel()} elements, expected N = {n}")
        bias = bias.reshape(-1).contiguous()
    if residual is not None:
        residual = residual.expand(out.shape).contiguous()
    if config is None:
        config = next((c for c in GEMM_CONFIGS if c.block_m <= max(m, 16) and c.block_n <= max(n, 16)),
                      GEMM_CONFIGS[-1])
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n),)
    precision = "tf32" if allow_tf32 and x.dtype == torch.float32 else "ieee"
    _gemm_kernel[grid](
        x2, w, bias if bias is not None else x2, residual if residual is not None else x2, out, m, n, k,
        x2.stride(0), x2.stride(1), w.stride(0), w.stride(1), float(alpha), float(beta),
        HAS_BIAS=bias is not None, HAS_RES=residual is not None, ACTIVATION=activation,
        RES_AFTER=bool(residual_after_activation), INPUT_PRECISION=precision, BLOCK_M=config.block_m,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m, num_warps=config.num_warps,
        num_stages=config.num_stages)
    return out


@triton.jit
def _swiglu_gemm_kernel(x_ptr, w_ptr, w_up_ptr, bias_ptr, res_ptr, out_ptr, M, H, K, stride_xm, stride_xk, stride_wn,
                        stride_wk, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    tile_m, tile_n = dm.grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(H, BLOCK_N), GROUP_M)

    rm = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)  # rm: [BM]
    rn = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)  # rn: [BN] output columns = gate rows of w; up rows are rn + H
    rk = tl.arange(0, BLOCK_K)  # rk: [BK]
    x_tile = x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :] * stride_xk  # [BM, BK]
    gate_tile = w_ptr + rk[:, None] * stride_wk + rn[None, :].to(tl.int64) * stride_wn  # [BK, BN] = w_gateᵀ tile
    up_tile = w_up_ptr + rk[:, None] * stride_wk + rn[None, :].to(tl.int64) * stride_wn  # [BK, BN] = w_upᵀ tile
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_left = K - k
        a = tl.load(x_tile, mask=(rm[:, None] < M) & (rk[None, :] < k_left), other=0.0)
        w_mask = (rk[:, None] < k_left) & (rn[None, :] < H)
        gate = tl.dot(a, tl.load(gate_tile, mask=w_mask, other=0.0), gate, input_precision=INPUT_PRECISION)
        up = tl.dot(a, tl.load(up_tile, mask=w_mask, other=0.0), up, input_precision=INPUT_PRECISION)
        x_tile += BLOCK_K * stride_xk
        gate_tile += BLOCK_K * stride_wk
        up_tile += BLOCK_K * stride_wk

    # epilogue, on the two fp32 tiles in registers: silu(gate + b_gate) · (up + b_up) [+ residual]
    if HAS_BIAS:
        gate += tl.load(bias_ptr + rn, mask=rn < H, other=0.0).to(tl.float32)[None, :]
        up += tl.load(bias_ptr + H + rn, mask=rn < H, other=0.0).to(tl.float32)[None, :]
    y = dm.silu(gate) * up
    mask = (rm[:, None] < M) & (rn[None, :] < H)
    offs = rm[:, None].to(tl.int64) * H + rn[None, :]  # out and residual: [M, H] contiguous
    if HAS_RES:
        y += tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def swiglu_gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                residual: torch.Tensor | None = None, *, config: GemmConfig | None = None,
                allow_tf32: bool = False) -> torch.Tensor:
    """silu(x @ w_gateᵀ + b_gate) · (x @ w_upᵀ + b_up) [+ residual]: kiln::FusedGemm's SwiGLU in one kernel.

    x: [..., K]; w: [2H, K] = [w_gate; w_up] (any strides); bias: [2H]; residual: broadcastable to [..., H].
    Each program accumulates the gate tile and the matching up tile side by side and stores only their
    gated product: the [..., 2H] GEMM output, which the unfused form writes and reads back, never exists.
    """
    if x.dtype not in FLOAT_DTYPES or w.dtype != x.dtype:
        raise TypeError(f"triton swiglu_gemm: x and w must share a float16/bfloat16/float32 dtype, "
                        f"got {x.dtype} and {w.dtype}")
    if w.dim() != 2 or x.shape[-1] != w.shape[1] or w.shape[0] % 2:
        raise ValueError(f"triton swiglu_gemm: x {tuple(x.shape)} needs w as [2H, {x.shape[-1]}], got {tuple(w.shape)}")
    n, k = w.shape
    h = n // 2
    lead = x.shape[:-1]
    if bias is not None and bias.numel() != n:
        raise ValueError(f"triton swiglu_gemm: bias has {bias.numel()} elements, expected 2H = {n}")
    if k == 0 or x.numel() == 0 or h == 0:  # the empty or degenerate cases: the reference's arithmetic (x·w = 0)
        y = torch.zeros((*lead, n), dtype=torch.float32, device=x.device)
        if bias is not None:
            y += bias.reshape(-1).float()
        gate, up = y.chunk(2, dim=-1)
        out = torch.nn.functional.silu(gate) * up
        return (out if residual is None else out + residual.float()).to(x.dtype)
    x2 = x.reshape(-1, k)  # x2: [M, K]
    m = x2.shape[0]
    out = torch.empty((*lead, h), dtype=x.dtype, device=x.device)
    if bias is not None:
        bias = bias.reshape(-1).contiguous()
    if residual is not None:
        residual = residual.expand(out.shape).contiguous()
    if config is None:
        config = next((c for c in GEMM_CONFIGS if c.block_m <= max(m, 16) and c.block_n <= max(h, 16)),
                      GEMM_CONFIGS[-1])
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(h, config.block_n),)
    precision = "tf32" if allow_tf32 and x.dtype == torch.float32 else "ieee"
    _swiglu_gemm_kernel[grid](
        x2, w, w[h:], bias if bias is not None else x2, residual if residual is not None else x2, out, m, h, k,
        x2.stride(0), x2.stride(1), w.stride(0), w.stride(1), HAS_BIAS=bias is not None,
        HAS_RES=residual is not None, INPUT_PRECISION=precision, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, GROUP_M=config.group_m, num_warps=config.num_warps, num_stages=config.num_stages)
    return out
