"""Weight-only quantized GEMM in Triton: y = x · dequant(W)ᵀ with W read as int8 (per-channel scale),
int4 (two per byte, per-group scale and zero point) or uint8 with per-group scale and zero point
(pre-quantized 8-bit GPTQ / compressed-tensors checkpoints) and dequantized in registers, so a decode step
reads 1/2 (8 bits) or 1/4 (int4) of bf16's weight bytes — the bandwidth batch-1 decoding is bound by.

Program (m tile, n tile) walks K in BLOCK_K steps: loads x [BLOCK_M, BLOCK_K], the weight tile
[BLOCK_N, BLOCK_K] as stored, dequantizes it (int4: nibble k % 2 of byte k // 2; group k // GROUP)
and accumulates tl.dot in fp32; int8's per-channel scale multiplies the accumulator once at the end.
Layouts are kiln/llm/quantization.py's Int8Weight, Int4Weight and Int8GroupWeight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _grouped_gemm_kernel(x_ptr, packed_ptr, scale_ptr, zero_ptr, y_ptr, M, N, K, stride_xm, stride_pn, stride_sn,
                         stride_ym, BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)
        tile_ok = n_ok[:, None] & k_ok[None, :]
        if BITS == 4:
            byte = tl.load(packed_ptr + offs_n[:, None] * stride_pn + (offs_k // 2)[None, :], mask=tile_ok, other=0)
            q = (byte >> ((offs_k % 2) * 4)[None, :].to(tl.uint8)) & 0xF  # even k: low nibble
        else:  # 8 bits: one byte a value
            q = tl.load(packed_ptr + offs_n[:, None] * stride_pn + offs_k[None, :], mask=tile_ok, other=0)
        group = (offs_k // GROUP)[None, :]
        scale = tl.load(scale_ptr + offs_n[:, None] * stride_sn + group, mask=tile_ok, other=0.0)
        zero = tl.load(zero_ptr + offs_n[:, None] * stride_sn + group, mask=tile_ok, other=0.0)
        w = (q.to(tl.float32) - zero) * scale  # [BLOCK_N, BLOCK_K]
        if IEEE:  # fp32 activations: exact fp32 products (no TF32)
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:  # bf16/fp16 activations: the dequantized tile in their dtype, on tensor cores
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _int8_gemm_kernel(x_ptr, q_ptr, scale_ptr, y_ptr, M, N, K, stride_xm, stride_qn, stride_ym,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)
        q = tl.load(q_ptr + offs_n[:, None] * stride_qn + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                    other=0)
        if IEEE:
            acc += tl.dot(x, tl.trans(q.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(q.to(x.dtype)))  # |q| <= 127: exact in bf16 and fp16
    scale = tl.load(scale_ptr + offs_n, mask=n_ok, other=0.0)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], (acc * scale[None, :]).to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def _tiles(m: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): decode's few rows get a short M tile; tl.dot needs >= 16 each."""
    return (16 if m <= 16 else 64), 64, 64


def int4_gemm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
              group_size: int) -> torch.Tensor:
    """x: [M, K]; packed: [N, K/2] uint8; scale, zero: [N, K/group] fp32 -> [M, N] in x's dtype."""
    return _grouped_gemm(x, packed, scale, zero, group_size, bits=4)


def uint8_group_gemm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                     group_size: int) -> torch.Tensor:
    """x: [M, K]; q: [N, K] uint8; scale, zero: [N, K/group] fp32 -> [M, N] in x's dtype."""
    return _grouped_gemm(x, q, scale, zero, group_size, bits=8)


def _grouped_gemm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
                  bits: int) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    m, k = x2.shape
    n = packed.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_m, block_n, block_k = _tiles(m)
    block_k = min(block_k, group_size) if group_size >= 16 else block_k
    _grouped_gemm_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        x2, packed, scale, zero, y, m, n, k, x2.stride(0), packed.stride(0), scale.stride(0), y.stride(0),
        BITS=bits, GROUP=group_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=x.dtype == torch.float32)
    return y.reshape(*x.shape[:-1], n)


def int8_gemm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x: [M, K]; q: [N, K] int8; scale: [N] fp32 -> [M, N] in x's dtype."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    m, k = x2.shape
    n = q.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_m, block_n, block_k = _tiles(m)
    _int8_gemm_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        x2, q, scale, y, m, n, k, x2.stride(0), q.stride(0), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=x.dtype == torch.float32)
    return y.reshape(*x.shape[:-1], n)
