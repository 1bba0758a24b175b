"""CUDA tactic for a half-precision kiln::FusedGemm whose K or N is not a multiple of 8.

    cuda.gemm.cublas_padded    the weight (and bias) zero-padded to [N8, K8] at load, x padded to K8 per run, one
                               cuBLAS GEMM on 16-byte-aligned rows, the first N columns kept

cuBLAS picks its kernel by alignment: a DCN's cross layers (256 x 845 x 845, fp16) ran its sm75 WMMA `align1`
kernel at 14.4 us each on the H200 (5 of them: 72 of the recommender's 104 us of GPU time; torch pays the same),
where aligned shapes of that size take Hopper's kernels. The padded columns of x meet zero rows of the weight,
so the sums are the same; the pad of x and the copy of the kept columns are two small kernels more, which is why
this is a candidate the tuner times against the others, not a rewrite.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from kiln.ops.fused import _epilogue
from kiln.plan.spec import StepSpec
from kiln.tactics.cuda.library import _gemm_supports
from kiln.tactics.registry import register
from kiln.tactics.tactic import InputMeta, Tactic
from kiln.tactics.tactic import attribute as _attr
from kiln.tactics.tactic import tensor_input as _input

_FLOAT = (torch.float16, torch.bfloat16, torch.float32)
ALIGN = 8  # elements: 16 bytes of fp16/bf16


def _up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    common = _gemm_supports(step, inputs, None)
    if common is not True:
        return common
    w, b = _input(inputs, 1), _input(inputs, 2)
    if not w.constant or (b is not None and not b.constant):
        return "the weight or bias is computed at run time (they are padded once, at load)"
    n, k = w.shape
    if n % ALIGN == 0 and k % ALIGN == 0:
        return "K and N are multiples of 8 already"
    if n == 1:
        return "one output column: cuBLAS's GEMV, alignment does not matter"
    return True


def _prepare(step: StepSpec, constants: list[Any], device: torch.device):
    w, b = constants[1], constants[2] if len(constants) > 2 else None
    n, k = w.shape
    padded_w = F.pad(w.to(device), (0, _up(k) - k, 0, _up(n) - n))  # [N8, K8], zeros around W
    padded_b = None if b is None else F.pad(b.to(device).reshape(-1), (0, _up(n) - n))  # [N8]
    activation = _attr(step, "activation", "")
    alpha, beta = float(_attr(step, "alpha", 0.0)), float(_attr(step, "beta", 0.0))
    after = bool(_attr(step, "residual_after_activation", 1))
    relu_in_gemm = activation == "Relu" and padded_b is not None

    def launch(ctx, x, w_run, b_run=None, residual=None, **_attributes):
        x2 = x.reshape(-1, k)
        if k % ALIGN:
            x2 = F.pad(x2, (0, _up(k) - k))  # [M, K8]: aligned rows
        if relu_in_gemm and (residual is None or after):
            y2 = torch._addmm_activation(padded_b, x2, padded_w.t())  # relu(x·Wᵀ + b) in cuBLASLt's epilogue
            act = ""
        else:
            y2 = torch.mm(x2, padded_w.t()) if padded_b is None else torch.addmm(padded_b, x2, padded_w.t())
            act = activation
        y = y2[:, :n] if n % ALIGN else y2  # [M, N]
        y = y.reshape(*x.shape[:-1], n)
        if act or residual is not None:
            return _epilogue(y.contiguous(), residual, act, alpha, beta, after)  # in place on the compact copy
        return y.contiguous()

    return launch


register(Tactic(
    name="cuda.gemm.cublas_padded", op_type="FusedGemm", domain="kiln", device="cuda", dtypes=_FLOAT,
    supports=_supports, prepare=_prepare,
    description="weight zero-padded to multiples of 8 at load, x padded per run: cuBLAS on aligned rows",
))
