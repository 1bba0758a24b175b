"""kiln::RMSNormGemm: the rule (kiln/passes/fusion/rms_norm_gemm.py, structural and against onnxruntime on a
decoder whose norm scales are not ones) and its CUDA tactics (kiln/tactics/cuda/norm_gemm.py) on CPU tensors,
Triton under TRITON_INTERPRET=1, against the op's registered implementation (the norm then the GEMM)."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

import tests.kernels.conftest  # noqa: F401  TRITON_INTERPRET=1 before triton loads (jit reads it); interpreter shims

pytest.importorskip("triton")

from tests.unit.tactic_check import make_step, reason, run_against_reference  # noqa: E402
from tests.unit.test_tactics_cuda import needs_interpreter  # noqa: E402

FALLBACK = "cuda.rms_norm_gemm.norm_then_cublas"
TRITON = "cuda.rms_norm_gemm.triton.16x64x64"
TRITON_SWIGLU = "cuda.rms_norm_gemm.swiglu.triton.16x64x64"


def _step(n_inputs: int, activation: str = "", epsilon: float = 1e-5):
    return make_step("RMSNormGemm", "kiln", n_inputs, activation=activation, alpha=0.0, beta=0.0,
                     residual_after_activation=1, epsilon=epsilon)


def _args(lead, k, n, dtype, bias, residual, out=None):
    x = (torch.randn(*lead, k) * 3).to(dtype)  # rows far from unit RMS: the norm matters
    args = [x, (torch.randn(n, k) / k ** 0.5).to(dtype)]
    if bias or residual:
        args.append(torch.randn(n).to(dtype) if bias else None)
    if residual:
        args.append(torch.randn(*lead, out or n).to(dtype))
    return args


@needs_interpreter
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("name, dtype", [(TRITON, torch.float16), (FALLBACK, torch.float16), (FALLBACK, torch.float32)])
@pytest.mark.parametrize("activation, bias, residual", [("", False, False), ("Gelu", True, False), ("", True, True)])
def test_plain_layers_against_the_op(name, dtype, activation, bias, residual):
    args = _args((2, 5), 40, 72, dtype, bias, residual)  # K = 40, N = 72: partial tiles both ways
    got = run_against_reference(name, _step(len(args), activation), args, {1, 2} if bias else {1})
    assert got.shape == (2, 5, 72)


@needs_interpreter
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("name, dtype", [(TRITON_SWIGLU, torch.float16), (FALLBACK, torch.float16)])
@pytest.mark.parametrize("bias, residual", [(False, False), (True, True)])
def test_gated_layers_against_the_op(name, dtype, bias, residual):
    args = _args((3, 4), 48, 80, dtype, bias, residual, out=40)  # gate|up of H = 40
    got = run_against_reference(name, _step(len(args), "SwiGLU"), args, {1, 2} if bias else {1})
    assert got.shape == (3, 4, 40)


def test_refusals():
    x, w = torch.randn(4, 32).half(), torch.randn(48, 32).half()
    assert "SwiGLU" in reason(TRITON_SWIGLU, _step(2), [x, w], {1})
    assert "swiglu" in reason(TRITON, _step(2, "SwiGLU"), [x, w], {1})
    assert "padding" in reason("cuda.rms_norm_gemm.triton.128x128x64", _step(2), [x, w], {1})
    assert "equal height" in reason(FALLBACK, _step(2, "SwiGLU"), [x, torch.randn(47, 32).half()], {1})


# ---- the rule ------------------------------------------------------------------------------------

def _phi3_tiny_with_norm_scales(seed: int = 0) -> tuple[onnx.ModelProto, dict]:
    """phi3_tiny with random RMSNorm scales (transformers initialises them to ones: folding them would
    be invisible)."""
    from kiln import zoo

    exported = zoo.export("phi3_tiny")
    proto = onnx.load(str(exported.path))
    rng = np.random.default_rng(seed)
    for init in proto.graph.initializer:
        if init.name.endswith("layernorm.weight") or init.name.endswith("norm.weight"):
            value = numpy_helper.to_array(init)
            init.CopyFrom(numpy_helper.from_array((value * rng.uniform(0.5, 1.5, value.shape)).astype(value.dtype),
                                                  init.name))
    return proto, zoo.random_inputs("phi3_tiny", exported, seed=seed + 1)


def _cuda_shaped(monkeypatch):
    from kiln.builder import build as build_module
    from kiln.builder.config import BuildConfig

    options = build_module.pass_options(BuildConfig(device="cuda"))
    monkeypatch.setattr(build_module, "pass_options", lambda config: dataclasses.replace(options,
                                                                                       opt_level=config.opt_level))
    return options


def test_every_norm_of_phi3_folds_into_its_gemm_and_matches_onnxruntime(monkeypatch):
    import onnxruntime as ort

    import kiln
    from kiln.frontend import onnx as onnx_frontend
    from kiln.passes import PassReport, optimize

    proto, feeds = _phi3_tiny_with_norm_scales()
    assert any(n.name.endswith("norm.weight") for n in proto.graph.initializer)
    options = _cuda_shaped(monkeypatch)
    report = PassReport()
    model = optimize(onnx_frontend.load(proto), options, report)
    ops = [n.op_type for n in model.graph]
    assert report.fired["fuse_rms_norm_into_gemm"] == 5  # two per layer, and the final norm into the LM head
    assert "RMSNorm" not in ops and ops.count("RMSNormGemm") == 5
    engine = kiln.build(proto)  # CPU, the ops' own implementations for the fused layers
    want = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    np.testing.assert_allclose(next(iter(engine.run(feeds).values())), want[0], rtol=1e-4, atol=1e-4)  # fp32


def test_the_rule_is_for_cuda_builds_and_refuses_a_norm_read_elsewhere_or_a_shared_weight():
    from onnx import TensorProto, helper

    from kiln.frontend import onnx as onnx_frontend
    from kiln.passes import PassOptions, PassReport, optimize
    from tests.unit.test_passes_cleanup import make_model

    def model(norm_is_output: bool, shared: bool) -> onnx.ModelProto:
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])
        outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 6])]
        nodes = [helper.make_node("RMSNormalization", ["x", "g"], ["n"], axis=-1, epsilon=1e-5),
                 helper.make_node("FusedGemm", ["n", "w"], ["y"], domain="kiln")]  # w: [N, K]
        if norm_is_output:
            outs.append(helper.make_tensor_value_info("n", TensorProto.FLOAT, [2, 8]))
        if shared:  # another layer reads the same weight (fuse_gemm gives each ONNX Gemm a weight of its own)
            nodes.append(helper.make_node("FusedGemm", ["x", "w"], ["z"], domain="kiln"))
            outs.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 6]))
        rng = np.random.default_rng(0)
        inits = [("g", rng.standard_normal(8).astype(np.float32)), ("w", rng.standard_normal((6, 8)).astype(np.float32))]
        proto = make_model(nodes, [x], outs, inits, opset=23)
        proto.opset_import.append(helper.make_opsetid("kiln", 1))
        return proto

    def fired(proto, cuda=True):
        report = PassReport()
        optimize(onnx_frontend.load(proto), PassOptions(cuda_rules=cuda), report)
        return report.fired.get("fuse_rms_norm_into_gemm", 0), report.refused

    assert fired(model(False, False)) == (1, fired(model(False, False))[1])
    assert fired(model(False, False), cuda=False)[0] == 0  # a CPU build keeps RMSNorm for its segments
    count, refused = fired(model(True, False))
    assert count == 0 and any("graph output" in r for r in refused)
    count, refused = fired(model(False, True))
    assert count == 0 and any("of its own" in r for r in refused)
