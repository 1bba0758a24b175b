"""cuda.gemm.cublas_padded (kiln/tactics/cuda/gemm_padded.py) on CPU tensors (torch's CPU GEMMs stand in for cuBLAS)
against kiln::FusedGemm's registered implementation: zero padding changes no sum."""

from __future__ import annotations

import pytest
import torch

from tests.unit.tactic_check import make_step, reason, run_against_reference

NAME = "cuda.gemm.cublas_padded"


def _step(n_inputs: int, activation: str = "", after: int = 1):
    return make_step("FusedGemm", "kiln", n_inputs, activation=activation, alpha=0.0, beta=0.0,
                     residual_after_activation=after)


@pytest.mark.parametrize("k, n", [(845, 845), (845, 1024), (64, 13)])  # DCN's cross and deep layers, an odd N
@pytest.mark.parametrize("activation, bias, residual, after", [
    ("", True, False, 1), ("Relu", True, False, 1), ("Relu", False, False, 1), ("Gelu", True, True, 1),
    ("Relu", True, True, 0)])
def test_padded_gemm_against_the_op(k, n, activation, bias, residual, after):
    x = torch.randn(2, 7, k)
    args = [x, torch.randn(n, k) / k ** 0.5]
    if bias or residual:
        args.append(torch.randn(n) if bias else None)
    if residual:
        args.append(torch.randn(2, 7, n))
    got = run_against_reference(NAME, _step(len(args), activation, after), args, {1, 2} if bias else {1})
    assert got.shape == (2, 7, n) and got.is_contiguous()


def test_refusals():
    x = torch.randn(4, 32).half()
    assert "multiples of 8 already" in reason(NAME, _step(2), [x, torch.randn(48, 32).half()], {1})
    assert "at load" in reason(NAME, _step(2), [torch.randn(4, 30).half(), torch.randn(48, 30).half()], set())
    unaligned = [torch.randn(4, 30).half(), torch.randn(48, 30).half(), torch.randn(48).half()]
    assert "at load" in reason(NAME, _step(3), unaligned, {1})  # a bias computed at run time
    assert "GEMV" in reason(NAME, _step(2), [torch.randn(4, 30).half(), torch.randn(1, 30).half()], {1})
