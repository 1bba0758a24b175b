"""cuda.gemm.cublas_float32_out (kiln/tactics/cuda/gemm_float32_out.py) without a GPU: which layers it takes and why it
declines the others; its launch on CPU tensors with cuBLAS's aten::mm.dtype_out (CUDA only) replaced by an fp32 CPU
GEMM into the same strided rows, against kiln::FusedGemm's registered implementation and a float64 numpy product.
tests/gpu/test_gemm_float32_out.py runs the real cuBLAS call."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kiln.tactics.cuda.gemm_float32_out as float32_out
from tests.unit.tactic_check import make_step, metas, reason, run_against_reference

NAME = "cuda.gemm.cublas_float32_out"
HALF = torch.float16


def _step(n_inputs: int, output_float32: int = 1, **attributes):
    return make_step("FusedGemm", "kiln", n_inputs, output_float32=output_float32, **attributes)


def _gemm(k: int, n: int, dtype=HALF, bias: bool = False) -> list[torch.Tensor]:
    args = [torch.randn(2, 3, k).to(dtype), (torch.randn(n, k) / k ** 0.5).to(dtype)]
    return args + [torch.randn(n).to(dtype)] if bias else args


def test_takes_an_odd_vocabulary_storing_the_fp32_output():
    from kiln.tactics import registry

    args = _gemm(768, 50257 // 64)  # GPT-2's K, an odd N (785) kept small
    assert registry.get(NAME).check(_step(2), metas(args, {1})) is True
    bf16 = _gemm(40, 13, torch.bfloat16, bias=True)  # K not a multiple of 8, a bias
    assert registry.get(NAME).check(_step(3), metas(bf16, {1, 2})) is True


def test_refusals_name_their_reason():
    odd = _gemm(64, 13)
    assert "cublas_addmm_act" in reason(NAME, _step(2, output_float32=0), odd, {1})  # a half output: not this one
    assert "epilogue" in reason(NAME, _step(2, activation="Relu"), odd, {1})
    residual = [*odd, None, torch.randn(2, 3, 13).half()]
    assert "residual" in reason(NAME, _step(4), residual, {1})
    assert "run time" in reason(NAME, _step(2), odd, set())  # the weight computed by the engine
    assert "run time" in reason(NAME, _step(3), _gemm(64, 13, bias=True), {1})  # the bias computed by the engine
    assert "aligned rows already" in reason(NAME, _step(2), _gemm(64, 48), {1})  # Phi-3's 32064 is such an N
    assert "one dtype" in reason(NAME, _step(2), [odd[0], odd[1].bfloat16()], {1})
    assert "takes float16, bfloat16" in reason(NAME, _step(2), [a.float() for a in odd], {1})  # fp32 engines


def test_declines_without_mm_dtype(monkeypatch):
    from kiln.tactics import registry

    monkeypatch.setattr(torch.ops.aten.mm, "overloads", lambda: ["default", "out"])  # a torch before 2.8
    assert "not available" in registry.get(NAME).check(_step(2), metas(_gemm(64, 13), {1}))


def _cpu_mm_float32_into(seen: list):
    """aten::mm.dtype_out's contract on CPU: fp32 sums of the half products written into a contiguous `out`."""
    def mm(x2, w_t, out):
        assert out.dtype == torch.float32 and out.is_contiguous() and out.shape[1] % float32_out.OUT_ALIGN == 0
        assert x2.shape[1] % float32_out.K_ALIGN == 0 and x2.dtype == w_t.dtype
        seen.append(out.data_ptr())
        torch.mm(x2.float(), w_t.float(), out=out)
        assert out.data_ptr() == seen[-1]  # written in place, not replaced
    return mm


@pytest.mark.parametrize("k, n, dtype, bias", [(768, 785, HALF, False), (40, 13, torch.bfloat16, True),
                                               (30, 50, HALF, True), (64, 1, HALF, False)])
def test_launch_against_the_op_and_numpy(monkeypatch, k, n, dtype, bias):
    seen = []
    monkeypatch.setattr(float32_out, "mm_float32_into", _cpu_mm_float32_into(seen))
    args = _gemm(k, n, dtype, bias)
    got = run_against_reference(NAME, _step(len(args)), args, {1, 2} if bias else {1})  # the tuner's check
    assert seen and got.dtype == torch.float32 and got.shape == (2, 3, n)
    assert got.stride() == (3 * got.stride(1), -(-n // 32) * 32, 1)  # rows 128 bytes apart, no copy
    x, w = (a.double().numpy() for a in args[:2])
    want = x @ w.T + (args[2].double().numpy() if bias else 0.0)  # the half inputs' exact products, float64
    # fp32 sums of K exact products: a few fp32 ulps of Σ|x·w| (half rounding would be ~5e-4 of |y|)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5 * k ** 0.5)


def test_an_fp16_engine_returns_the_strided_fp32_output(monkeypatch):
    """Through the engine (the CPU runtime standing in): the last GEMM of an fp16 engine marked output_float32 as a
    CUDA build marks it, run by this tactic; the [4, 13] output, a view of 32-float rows, matches onnxruntime."""
    import onnxruntime as ort

    import kiln
    from kiln.builder.precision import write_float32_outputs
    from tests.unit.tactic_check import cuda_tactics_on_cpu
    from tests.unit.test_precision_float32_output import _two_gemms

    cuda_tactics_on_cpu(monkeypatch, lambda name: name == NAME)
    seen = []
    monkeypatch.setattr(float32_out, "mm_float32_into", _cpu_mm_float32_into(seen))
    proto, rng = _two_gemms(n_out=13)
    plain = kiln.build(proto, precision="fp16", tactics=["none"])
    write_float32_outputs(plain.plan.program, "fp16")
    last = plain.plan.program.steps[-1]
    assert last.attributes["output_float32"] == 1
    last.tactic, last.tactic_config = NAME, {}
    engine = kiln.Engine(plain.plan)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    for _ in range(2):
        x = rng.standard_normal((4, 16)).astype(np.float32)
        got = engine.run({"x": x})["y"]
        assert seen and got.dtype == np.float32 and got.shape == (4, 13)
        seen.clear()
        # fp16 weights and hidden activations, as test_precision_float32_output's engine
        np.testing.assert_allclose(got, session.run(None, {"x": x})[0], rtol=2e-2, atol=2e-2)
