"""CUDA tactic for the half-precision kiln::FusedGemm that writes the engine's fp32 output (output_float32) when that
output's rows are not 16-byte aligned (N not a multiple of 4 fp32 values: GPT-2's logits, N = 50257).

    cuda.gemm.cublas_float32_out   cuBLAS's fp16/bf16 GEMM storing its fp32 accumulator (aten::mm.dtype_out) into
                                   rows padded to OUT_ALIGN values; the output is the [..., N] view of them

Why: cuBLAS picks its kernel by alignment, and the output's row pitch counts as much as the operands'. A contiguous
[M, 50257] result (fp16 or fp32) has rows 2- or 4-byte aligned, so cuBLAS falls back to an `align1` kernel: torch
eager's GPT-2 LM head (4096 x 768 x 50257, fp16 out) ran CUTLASS `align1` at 3.106 ms on the H100, which is why
cuda.gemm.cublas_addmm_act's fp32 path (the same unaligned store) lost the tuner's timing to kiln's Triton GEMM
(1.071 ms). torch.compile pads the output's row pitch and gets Hopper's `nvjet_sm90_hsh_160x256_64x4_2x1_v_bz_coopA_TNN`
at 0.464 ms (bench/results/zoo-cuda-h100-2026-12-07.md). Here the weight is padded with zero rows to N_pad (a
multiple of OUT_ALIGN) once, at load, and the GEMM writes a whole contiguous [M, N_pad] fp32 buffer: every operand and
the output aligned, and `out` contiguous. (Session 30's form wrote into the [..., N] view of padded rows instead:
3.05 ms on the H100, as slow as the unaligned store — aten's mm.dtype_out takes a non-contiguous `out` through a
contiguous temporary, so cuBLAS saw the unaligned [M, 50257] rows again.) The engine output is the strided view
[..., N] of the buffer (0.03% more memory and GEMM work at N = 50257); a copy to a contiguous tensor would be a second
pass over 823 MB, as slow as the GEMM it saves. The weight is [N_pad, K8] (K-major: cuBLAS's "T" operand), padded
with zero columns to K8 when K is not a multiple of 8 (x then padded per run, as cuda.gemm.cublas_padded).

Epilogues: the bias is added in fp32 in place after the GEMM (one pass; GPT-2's LM head has none); an activation or a
residual makes it decline (cuBLAS's fp32-out GEMM applies neither; kiln's Triton GEMM fuses them).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from kiln.plan.spec import StepSpec
from kiln.tactics.cuda.library import _gemm_supports, mm_stores_float32
from kiln.tactics.registry import register
from kiln.tactics.tactic import InputMeta, Tactic
from kiln.tactics.tactic import attribute as _attr
from kiln.tactics.tactic import tensor_input as _input

_HALF = (torch.float16, torch.bfloat16)
K_ALIGN = 8  # elements of x and w: 16 bytes of fp16/bf16
OUT_ALIGN = 32  # fp32 elements between output rows: 128 bytes (16 is what TMA needs; a whole line per row start)


def _up(n: int, align: int) -> int:
    return -(-n // align) * align


def mm_float32_into(x2: torch.Tensor, w_t: torch.Tensor, out: torch.Tensor) -> None:
    """out[M, N] (fp32, contiguous) = x2[M, K] · w_t[K, N], half inputs, fp32 accumulate and store: cuBLAS through
    aten::mm.dtype_out (CUDA only; tests on CPU replace this function)."""
    torch.ops.aten.mm.dtype_out(x2, w_t, torch.float32, out=out)


def _supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    if not _attr(step, "output_float32", 0):
        return "the layer stores its inputs' dtype: cuda.gemm.cublas_addmm_act is that cuBLAS GEMM"
    activation = _attr(step, "activation", "")
    if activation:
        return f"activation {activation!r}: cuBLAS's fp32-output GEMM applies no epilogue (the Triton GEMM fuses it)"
    if _input(inputs, 3) is not None:
        return "a residual: cuBLAS's fp32-output GEMM adds none (the Triton GEMM fuses it)"
    common = _gemm_supports(step, inputs, None)
    if common is not True:
        return common
    w, b = _input(inputs, 1), _input(inputs, 2)
    if not w.constant or (b is not None and not b.constant):
        return "the weight or bias is computed at run time (they are laid out once, at load)"
    n, k = w.shape
    if n % 4 == 0 and k % K_ALIGN == 0:
        return f"N = {n} and K = {k} give aligned rows already: cuda.gemm.cublas_addmm_act stores them contiguous"
    return True


def _prepare(step: StepSpec, constants: list[Any], device: torch.device):
    w, b = constants[1], constants[2] if len(constants) > 2 else None
    n, k = w.shape
    k_pad, n_pad = _up(k, K_ALIGN), _up(n, OUT_ALIGN)
    weight = F.pad(w.to(device), (0, k_pad - k, 0, n_pad - n)).contiguous()  # [N_pad, K8], zeros past N and K
    weight_t = weight.t()  # [K8, N_pad], a view: cuBLAS reads the [N_pad, K8] rows transposed ("TN")
    bias = None if b is None else b.to(device).reshape(-1).float()  # [N] fp32, added to the fp32 sums

    def launch(ctx, x, w_run=None, b_run=None, residual=None, **_attributes):
        x2 = x.reshape(-1, k)  # [M, K]
        if k_pad != k:
            x2 = F.pad(x2, (0, k_pad - k))  # [M, K8]: aligned rows
        rows = torch.empty(x2.shape[0], n_pad, dtype=torch.float32, device=x.device)  # [M, N_pad], contiguous
        mm_float32_into(x2, weight_t, rows)  # the zero weight rows write zeros past N
        y2 = rows[:, :n]  # [M, N], rows n_pad apart: the output, no copy
        if bias is not None:
            y2.add_(bias)
        return y2.view(*x.shape[:-1], n)  # [..., N], strided: splitting the leading dim keeps the view

    return launch


register(Tactic(
    name="cuda.gemm.cublas_float32_out", op_type="FusedGemm", domain="kiln", device="cuda", dtypes=_HALF,
    supports=_supports, prepare=_prepare, float32_output=True, available=mm_stores_float32,
    description="cuBLAS half GEMM storing fp32 (aten::mm.dtype_out) into rows padded to 128 bytes (the weight "
                "padded to match), the output a view of them: the engine's fp32 logits of an odd vocabulary (GPT-2's 50257) on aligned kernels",
))
