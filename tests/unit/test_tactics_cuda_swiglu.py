"""The gated MLP's CUDA tactics (kiln/tactics/cuda/swiglu.py) on CPU tensors, Triton under TRITON_INTERPRET=1,
against kiln::FusedGemm's registered implementation (itself tested against the two halves' formula and
onnxruntime: tests/unit/test_passes_swiglu.py), and against float64 for the Triton kernel itself.
The real sizes on the H200: tests/gpu/test_cuda_swiglu.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tests.kernels.conftest  # noqa: F401  TRITON_INTERPRET=1 before triton loads (jit reads it); interpreter shims

pytest.importorskip("triton")

from tests.unit.tactic_check import make_step, reason, run_against_reference  # noqa: E402
from tests.unit.test_tactics_cuda import needs_interpreter  # noqa: E402

pytestmark = [needs_interpreter, pytest.mark.filterwarnings("ignore::RuntimeWarning")]

CUBLAS = "cuda.gemm.swiglu.cublas_elementwise"
TRITON = "cuda.gemm.swiglu.triton.16x64x64"


def _swiglu_step(n_inputs: int):
    return make_step("FusedGemm", "kiln", n_inputs, activation="SwiGLU", alpha=0.0, beta=0.0,
                     residual_after_activation=1)


def _layer(lead, k, h, dtype, bias=True, residual=False):
    x = torch.randn(*lead, k).to(dtype)
    w = (torch.randn(2 * h, k) / k ** 0.5).to(dtype)  # [2H, K] = [W_gate; W_up]
    args = [x, w]
    if bias or residual:
        args.append(torch.randn(2 * h).to(dtype) if bias else None)
    if residual:
        args.append(torch.randn(*lead, h).to(dtype))
    return args


@pytest.mark.parametrize("name", [CUBLAS, TRITON])
@pytest.mark.parametrize("bias, residual", [(True, False), (False, False), (True, True), (False, True)])
def test_gated_mlp_against_the_op(name, bias, residual):
    dtype = torch.float16 if name == TRITON else torch.float32  # the Triton GEMM tactics are fp16/bf16 ones
    args = _layer((2, 5), 48, 40, dtype, bias, residual)  # H = 40: a partial 64-wide tile
    got = run_against_reference(name, _swiglu_step(len(args)), args, {1, 2} if bias else {1})
    assert got.shape == (2, 5, 40)


def test_triton_kernel_against_float64_with_odd_sizes():
    from kiln.kernels.cuda.triton import GemmConfig, swiglu_gemm

    for lead, k, h in [((7,), 33, 16), ((3, 4), 16, 9), ((1,), 70, 65)]:  # K and H not multiples of the tiles
        x, w, b = torch.randn(*lead, k), torch.randn(2 * h, k), torch.randn(2 * h)
        r = torch.randn(*lead, h)
        y = F.linear(x.double(), w.double(), b.double())
        want = F.silu(y[..., :h]) * y[..., h:] + r.double()
        got = swiglu_gemm(x, w, b, r, config=GemmConfig(16, 16, 16, num_warps=1, num_stages=1))
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)  # fp32 sums in another order


def test_a_broadcast_residual_and_bf16():
    args = _layer((3, 4), 32, 24, torch.bfloat16, bias=True)
    args.append(torch.randn(24).to(torch.bfloat16))  # one residual row for every token
    for name in (CUBLAS, TRITON):
        run_against_reference(name, _swiglu_step(4), args, {1, 2})


def test_refusals():
    x, w = torch.randn(4, 32).half(), torch.randn(48, 32).half()
    plain = make_step("FusedGemm", "kiln", 2, activation="Relu")
    for name in (CUBLAS, TRITON):
        assert "SwiGLU" in reason(name, plain, [x, w], {1})
        assert "equal height" in reason(name, _swiglu_step(2), [x, torch.randn(47, 32).half()], {1})
        assert "dtype" in reason(name, _swiglu_step(2), [x, w.float()], {1})
        assert "broadcast" in reason(name, _swiglu_step(4), [x, w, None, torch.randn(4, 48).half()], {1})
    wide = "cuda.gemm.swiglu.triton.128x64x64"
    assert "padding" in reason(wide, _swiglu_step(2), [x, w], {1})  # 4 rows in 128-row tiles


def test_phi3_tiny_shaped_as_a_cuda_build_runs_the_fused_layers_and_matches_onnxruntime(monkeypatch):
    """End to end: the graph a CUDA build makes of Phi-3 (pass options of device="cuda": its fused qkv's
    Slices + two Rotary layers one packed Rotary, its merged gate|up + Split + gating one SwiGLU GEMM), the
    CUDA tactics of those layers standing in as CPU ones (Triton under the interpreter), against onnxruntime."""
    import dataclasses

    import numpy as np
    import onnx
    import onnxruntime as ort

    import kiln
    from kiln import zoo
    from kiln.builder import build as build_module
    from kiln.builder.config import BuildConfig
    from tests.unit.tactic_check import cuda_tactics_on_cpu

    cuda_options = build_module.pass_options(BuildConfig(device="cuda"))
    monkeypatch.setattr(build_module, "pass_options",
                        lambda config: dataclasses.replace(cuda_options, opt_level=config.opt_level))
    fused = ["cuda.rotary.triton", CUBLAS]
    cuda_tactics_on_cpu(monkeypatch, lambda name: name in fused)
    exported = zoo.export("phi3_tiny")
    engine = kiln.build(str(exported.path), tactics=fused)
    steps = engine.plan.program.steps
    assert not [s.op_type for s in steps if s.op_type in ("Slice", "Split")]
    assert len([s for s in steps if s.op_type == "Rotary" and s.attributes.get("rotate_heads")]) == 2  # one a layer
    assert len([s for s in steps if s.attributes.get("activation") == "SwiGLU"]) == 2
    layers = engine.plan.header["tactics"]["layers"]
    checked = {n for layer in layers.values() for n, note in layer["candidates"].items() if isinstance(note, float)}
    assert set(fused) <= checked  # each passed the build's check against the op (then timed: the interpreter loses)
    for s in steps:  # run them, whatever the interpreter's timing chose
        if s.op_type == "Rotary" or s.attributes.get("activation") == "SwiGLU":
            s.tactic, s.tactic_config = "cuda.rotary.triton" if s.op_type == "Rotary" else CUBLAS, {}
    engine = kiln.Engine(engine.plan)
    proto = onnx.load(str(exported.path))
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = zoo.random_inputs("phi3_tiny", exported, seed=5)
    for out, want in zip(proto.graph.output, session.run(None, feeds)):
        np.testing.assert_allclose(np.asarray(engine.run(feeds)[out.name]), want, rtol=1e-4, atol=1e-4)  # fp32
