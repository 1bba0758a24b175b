"""An E4M3 DequantizeLinear fused into the elementwise chain that reads it (issue 12: onnxruntime's FP8 QDQ BERT
adds each GEMM's bias after a DequantizeLinear of its fp8 output; kiln/passes/fusion/elementwise_dequantize.py):

    the rule       structurally on bert_tiny's FP8 QDQ graph as a CUDA build optimizes it, and on a small graph
                   against onnx.reference
    the kernel     kiln/kernels/cuda/triton/elementwise.py reading fp8 under the Triton interpreter, against ONNX's
                   DequantizeLinear then the chain (fp32 exact; fp16 output one rounding where the unfused layers
                   made two)
    the engine     bert_tiny's FP8 QDQ model built for the CPU with the CUDA graph and the Triton Elementwise forced:
                   onnxruntime within the model's coarsest scale (slow)
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

pytest.importorskip("triton")

from kiln.frontend import onnx as onnx_frontend  # noqa: E402
from kiln.kernels.cuda.triton.elementwise import compile_elementwise  # noqa: E402
from kiln.ops.fused import elementwise  # noqa: E402
from kiln.passes.pipeline import PassOptions, optimize  # noqa: E402
from kiln.passes._rewrite import PassReport  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter evaluates masked-off lanes

FP8 = torch.float8_e4m3fn
CUDA = PassOptions(cuda_rules=True, cpu_rules=False)


def _bias_gelu_model(scale: float, other_reader: bool = False) -> onnx.ModelProto:
    """q (E4M3 [2, 5, 64]) -> DequantizeLinear(scale) -> Add(bias) -> Gelu -> y: a GEMM output's bias and FFN act."""
    nodes = [helper.make_node("DequantizeLinear", ["q", "s", "z"], ["x"], name="dq"),
             helper.make_node("Add", ["x", "bias"], ["t"], name="bias_add"),
             helper.make_node("Gelu", ["t"], ["y"], name="gelu")]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5, 64])]
    if other_reader:
        nodes.append(helper.make_node("Relu", ["x"], ["x_relu"], name="other"))
        outputs.append(helper.make_tensor_value_info("x_relu", TensorProto.FLOAT, [2, 5, 64]))
    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array(np.array(scale, np.float32), "s"),
             helper.make_tensor("z", TensorProto.FLOAT8E4M3FN, [], [0.0]),
             numpy_helper.from_array(rng.standard_normal(64).astype(np.float32), "bias")]
    graph = helper.make_graph(nodes, "dq_bias_gelu", [helper.make_tensor_value_info("q", TensorProto.FLOAT8E4M3FN,
                                                                                      [2, 5, 64])], outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def _fp8(shape, seed: int, spread: float = 3.0) -> torch.Tensor:
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * spread).to(FP8)


def test_the_rule_takes_the_dequantize_into_the_chain_and_keeps_its_values():
    model = _bias_gelu_model(0.043)
    report = PassReport()
    graph = optimize(onnx_frontend.load(model.SerializeToString()), CUDA, report).graph
    nodes = list(graph)
    assert [n.op_type for n in nodes] == ["Elementwise"], [n.op_type for n in nodes]
    code = [a.value for a in nodes[0].attributes.values() if a.name == "code"][0]
    assert list(code) == ["Dequantize i1 i2", "Add t0 i0", "Gelu t1"]
    q = _fp8((2, 5, 64), seed=11)
    want = ReferenceEvaluator(model).run(None, {"q": _as_onnx_fp8(q)})[0]
    inputs = {v.name: v for v in nodes[0].inputs}
    bias = torch.from_numpy(np.array(inputs["bias"].const_value.numpy()))
    scale = torch.from_numpy(np.asarray(inputs["s"].const_value.numpy()))
    got = elementwise(None, bias, q, scale, code=list(code), output_dtype=1)
    # Gelu's erf in float32 (torch) vs onnx.reference's float64-then-float32: a few fp32 ulps
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-6)


def _as_onnx_fp8(q: torch.Tensor) -> np.ndarray:
    """A torch E4M3 tensor as the array onnx.reference takes for FLOAT8E4M3FN (ml_dtypes')."""
    return q.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)


def test_the_rule_on_the_cpu_build_and_with_other_readers_refuses():
    cpu = optimize(onnx_frontend.load(_bias_gelu_model(0.043).SerializeToString()), PassOptions()).graph
    assert "DequantizeLinear" in [n.op_type for n in cpu]  # CUDA_RULES only: the CPU's native chain reads float32
    report = PassReport()
    shared = optimize(onnx_frontend.load(_bias_gelu_model(0.043, other_reader=True).SerializeToString()), CUDA,
                      report).graph
    assert "DequantizeLinear" in [n.op_type for n in shared]
    assert any("fuse_dequantize_into_elementwise" in why and "other readers" in why for why in report.refused), \
        report.refused


@pytest.mark.parametrize("out", [torch.float32, torch.float16], ids=str)
def test_the_kernel_reads_e4m3_and_is_dequantize_then_the_chain(out):
    from kiln.ops.quantization import dequantize_linear

    q = _fp8((3, 7, 40), seed=5)
    q.view(torch.uint8)[0, 0, :4] = torch.tensor([0x7E, 0xFE, 0x01, 0x80], dtype=torch.uint8)  # ±448, subnormal, -0
    scale = torch.tensor(0.0291)
    bias = torch.randn(40, generator=torch.Generator().manual_seed(6)).to(out)
    code = ["Dequantize i1 i2", "Add t0 i0", "Relu t1"]
    got = compile_elementwise(code, 3, out)(bias, q, scale)
    dq = dequantize_linear(None, q, scale)  # float32, ONNX's DequantizeLinear
    assert got.dtype == out and got.shape == q.shape
    if out == torch.float32:
        assert torch.equal(got, torch.relu(dq + bias))  # the same fp32 operations in the same order
    else:  # one rounding to fp16 of the fp32 result, where DQ -> fp16, Add in fp16 rounded twice: half an ulp
        want = torch.relu(dq + bias.float())
        torch.testing.assert_close(got.float(), want, rtol=2**-11, atol=2**-24)
    reference = elementwise(None, bias, q, scale, code=code, output_dtype=1 if out == torch.float32 else 10)
    assert reference.dtype == out and torch.equal(reference, got)  # kiln's op: fp32 chain, one rounding at the end


def test_bert_tiny_fp8_qdq_keeps_only_the_residual_dequantizes_on_cuda(tmp_path):
    """Per encoder layer onnxruntime's QDQ BERT left 8 DequantizeLinear and 4 bias Adds of their own on a CUDA build
    (bench/results/gpu-s21-2026-12-06.md section 5): 6 GEMM outputs' DQs now sit in the chains reading them; the
    2 residual DQs (of LayerNormQuantize's 8-bit output, read by the next norm) stay."""
    from kiln import zoo
    from kiln.zoo.models import make_inputs
    from tests.calibration import quantize_transformer

    exported = zoo.export("bert_tiny", batch=2, seq=16, dynamic=True)
    calibration = [make_inputs(zoo.get("bert_tiny"), batch=4, seq=16, seed=s) for s in (1, 2)]
    path = str(tmp_path / "qdq.onnx")
    quantize_transformer(str(exported.path), path, calibration, "fp8")
    report = PassReport()
    graph = optimize(onnx_frontend.load(path), CUDA, report).graph
    ops = [n.op_type for n in graph]
    assert ops.count("DequantizeLinear") == 4, ops  # 2 layers x the 2 residuals
    assert ops.count("Add") == 1, ops  # the embeddings' sum only
    for node in graph:
        if node.op_type == "DequantizeLinear":
            assert {u.op_type for u, _ in node.outputs[0].uses()} <= {"LayerNormQuantize", "LayerNorm"}, node.name
    fused = [n for n in graph if n.op_type == "Elementwise"
             and any(line.startswith("Dequantize") for a in n.attributes.values() if a.name == "code"
                     for line in a.value)]
    assert len(fused) == 12 == report.fired.get("fuse_dequantize_into_elementwise"), (len(fused), report.fired)
