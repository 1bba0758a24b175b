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

import os

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
# TRITON_INTERPRET=0 on a GPU machine (bench/gpu_qadd.sh): the kernel test on the device
DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") == "0" and torch.cuda.is_available() else "cpu"
CUDA = PassOptions(cuda_rules=True, cpu_rules=False)  # a CUDA build's rules at the default opt_level 2


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
    scale = torch.from_numpy(np.array(inputs["s"].const_value.numpy()))
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
    got = compile_elementwise(code, 3, out)(bias.to(DEVICE), q.to(DEVICE), scale.to(DEVICE)).cpu()
    dq = dequantize_linear(None, q, scale)  # float32, ONNX's DequantizeLinear
    assert got.dtype == out and got.shape == q.shape
    if out == torch.float32 and DEVICE == "cpu":
        assert torch.equal(got, torch.relu(dq + bias))  # the same fp32 operations in the same order
    elif out == torch.float32:  # the GPU's compiler contracts q·s + b into one FMA: one rounding fewer
        torch.testing.assert_close(got, torch.relu(dq + bias), rtol=2**-23, atol=2**-126)
    else:  # one rounding to fp16 of the fp32 result, where DQ -> fp16, Add in fp16 rounded twice: half an ulp
        want = torch.relu(dq + bias.float())
        torch.testing.assert_close(got.float(), want, rtol=2**-11, atol=2**-24)
    reference = elementwise(None, bias, q, scale, code=code, output_dtype=1 if out == torch.float32 else 10)
    assert reference.dtype == out  # kiln's op: the fp32 chain, one rounding at the end (bit for bit but the GPU's FMA)
    assert torch.equal(reference, got) if DEVICE == "cpu" else \
        torch.testing.assert_close(reference.float(), got.float(), rtol=2**-10, atol=2**-24) is None


def test_bert_tiny_fp8_qdq_keeps_only_the_residual_dequantizes_on_cuda(tmp_path, monkeypatch):
    """Per encoder layer onnxruntime's QDQ BERT left 8 DequantizeLinear, 4 QuantizeLinear and 4 bias Adds of their
    own on a CUDA build (bench/results/gpu-s21-2026-12-06.md section 5): 6 GEMM outputs' DQs now sit in the chains
    reading them, the 4 Qs at their ends; the 2 residual DQs (of LayerNormQuantize's 8-bit output, read by the next
    norm) stay."""
    from kiln import zoo
    from kiln.zoo.models import make_inputs
    from tests.calibration import quantize_transformer

    exported = zoo.export("bert_tiny", batch=2, seq=16, dynamic=True)
    calibration = [make_inputs(zoo.get("bert_tiny"), batch=4, seq=16, seed=s) for s in (1, 2)]
    path = str(tmp_path / "qdq.onnx")
    quantize_transformer(str(exported.path), path, calibration, "fp8")
    from kiln.passes import fusion  # these chains as they stand before the next rule takes them into their GEMMs
    later = ("fuse_elementwise_into_qgemm", "fuse_dequantize_into_layer_norm_quantize")  # test_qgemm_epilogue.py's
    monkeypatch.setattr(fusion, "RULES", [r for r in fusion.RULES if r[0] not in later])
    report = PassReport()
    graph = optimize(onnx_frontend.load(path), CUDA, report).graph
    ops = [n.op_type for n in graph]
    assert ops.count("DequantizeLinear") == 4, ops  # 2 layers x the 2 residuals
    assert ops.count("Add") == 1, ops  # the embeddings' sum only
    assert ops.count("QuantizeLinear") == 0, ops  # q (scaled), k (scaled), v, Gelu: each chain stores E4M3
    assert report.fired.get("fuse_quantize_into_elementwise") == 8, report.fired
    for node in graph:
        if node.op_type == "DequantizeLinear":
            assert {u.op_type for u, _ in node.outputs[0].uses()} <= {"LayerNormQuantize", "LayerNorm"}, node.name
    fused = [n for n in graph if n.op_type == "Elementwise"
             and any(line.startswith("Dequantize") for a in n.attributes.values() if a.name == "code"
                     for line in a.value)]
    assert len(fused) == 12 == report.fired.get("fuse_dequantize_into_elementwise"), (len(fused), report.fired)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_bert_tiny_fp8_qdq_engine_on_the_fused_chains_is_onnxruntime(tmp_path, monkeypatch, precision):
    """The CUDA build's graph (fusion.CUDA_RULES) built for the CPU with cuda.elementwise.triton registered there (the
    interpreter): the builder's check passes it on the chains that read E4M3, and the engine forced onto it is
    onnxruntime (its Q/DQ as written) within the model's coarsest per-tensor scale, as the CPU engine is
    (tests/models/test_qdq_bert_attention.py). fp16: the chains' scales stay float32, their output fp16; the fp16
    engine is itself 8 coarsest steps from onnxruntime's fp32 (0.081 vs 0.010, with or without the rule: the float
    layers' rounding), so it is held to the fp16 engine built without the rule, within the same step."""
    import dataclasses

    import kiln
    from kiln import zoo
    from kiln.builder import build as build_module
    from kiln.zoo.models import make_inputs
    from tests.calibration import assert_forced_steps_match, quantize_transformer
    from tests.unit.tactic_check import cuda_tactics_on_cpu

    name = "cuda.elementwise.triton"
    exported = zoo.export("bert_tiny", batch=2, seq=16, dynamic=True)
    calibration = [make_inputs(zoo.get("bert_tiny"), batch=4, seq=16, seed=s) for s in (1, 2)]
    path = str(tmp_path / "qdq.onnx")
    quantize_transformer(str(exported.path), path, calibration, "fp8")
    cuda_tactics_on_cpu(monkeypatch, lambda tactic: tactic == name)
    plain = build_module.pass_options
    monkeypatch.setattr(build_module, "pass_options", lambda config: dataclasses.replace(
        plain(config), cuda_rules=True, cpu_rules=False, unsigned_activations=False))  # a CUDA build's graph
    from kiln.passes import fusion
    # (the chains after the GEMMs stay chains here: tests/kernels/test_qgemm_epilogue.py takes them into the GEMMs)
    monkeypatch.setattr(fusion, "RULES", [r for r in fusion.RULES if r[0] != "fuse_elementwise_into_qgemm"])
    unfused_rules = [rule for rule in fusion.RULES
                     if rule[0] not in ("fuse_dequantize_into_elementwise", "fuse_quantize_into_elementwise")]
    with monkeypatch.context() as patch:
        patch.setattr(fusion, "RULES", unfused_rules)
        unfused = kiln.build(path, device="cpu", precision=precision, tuning_runs=2)
    assert not any(line.startswith("Dequantize") for s in unfused.plan.program.steps
                   for line in s.attributes.get("code", ()))
    engine = kiln.build(path, device="cpu", precision=precision, tuning_runs=2)
    fused = [s for s in engine.plan.program.steps if s.op_type == "Elementwise"
             and any(line.startswith(("Dequantize", "Quantize")) for line in s.attributes["code"])]
    assert len(fused) == 14
    assert_forced_steps_match(engine, fused, name, path, baseline=None if precision == "fp32" else unfused)


def test_the_cuda_tactic_takes_e4m3_only_where_a_dequantize_reads_it():
    from kiln.plan.spec import StepSpec
    from kiln.tactics import registry
    from kiln.tactics.tactic import InputMeta

    tactic = registry.all_tactics("cuda")["cuda.elementwise.triton"]
    q, scale, bias = _fp8((2, 8), seed=1), torch.tensor(0.5), torch.randn(8)
    alone = StepSpec(op_type="Elementwise", domain="kiln", name="gelu", inputs=["q", "s"], outputs=["y"],
                     attributes={"code": ["Dequantize i0 i1", "Gelu t0"], "output_dtype": 1})
    assert tactic.check(alone, [InputMeta.of(q, False), InputMeta.of(scale, True)]) is True
    added = StepSpec(op_type="Elementwise", domain="kiln", name="add", inputs=["q", "b"], outputs=["y"],
                     attributes={"code": ["Add i0 i1"]})
    why = tactic.check(added, [InputMeta.of(q, False), InputMeta.of(bias, True)])
    assert isinstance(why, str) and "float8_e4m3fn" in why, why


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.float16], ids=str)
def test_the_kernel_quantizes_as_quantize_linear_bit_for_bit(x_dtype):
    """A chain ending in Quantize (Mul by a constant, then E4M3) against ONNX's QuantizeLinear of the chain's fp32
    result: ties of the E4M3 grid (to even), saturation past ±448, values rounding to ∓0, subnormals."""
    from kiln.ops.quantization import quantize_linear
    from kiln.ops.registry import OpContext

    scale = torch.tensor(0.0625)  # a power of two: the ties below stay ties after the division
    x = torch.randn(4, 9, 33, generator=torch.Generator().manual_seed(9)) * 8
    grid = torch.arange(0, 127, dtype=torch.uint8).view(FP8).float()  # E4M3 values 0 .. 448
    ties = (grid[1:] + grid[:-1]) / 2 * 0.0625  # x·2 / scale lands on each midpoint
    x.view(-1)[:ties.numel()] = ties / 2
    x.view(-1)[ties.numel():ties.numel() + 4] = torch.tensor([1e4, -1e4, -1e-9, 3e-4])
    x = x.to(x_dtype)
    two = torch.tensor(2.0, dtype=x_dtype)
    code = ["Mul i0 i1", "Quantize t0 i2"]
    got = compile_elementwise(code, 3, FP8)(x.to(DEVICE), two.to(DEVICE), scale.to(DEVICE)).cpu()
    want = quantize_linear(OpContext("q", "QuantizeLinear"), x.float() * 2, scale, torch.tensor(0.0).to(FP8))
    assert got.dtype == FP8 and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    reference = elementwise(None, x, two, scale, code=code, output_dtype=17)
    if x_dtype == torch.float32:  # kiln's op in fp32: the same
        assert torch.equal(reference.view(torch.uint8), got.view(torch.uint8))


def test_the_rule_ends_the_chain_in_quantize_and_keeps_its_values():
    """DQ -> Add(bias) -> Gelu -> Q(E4M3) as one Elementwise reading and writing E4M3, against onnx.reference."""
    model = _bias_gelu_model(0.043)
    graph = model.graph
    graph.node.append(helper.make_node("QuantizeLinear", ["y", "ys", "z"], ["yq"], name="q"))
    graph.initializer.append(numpy_helper.from_array(np.array(0.021, np.float32), "ys"))
    graph.output[0].CopyFrom(helper.make_tensor_value_info("yq", TensorProto.FLOAT8E4M3FN, [2, 5, 64]))
    report = PassReport()
    nodes = list(optimize(onnx_frontend.load(model.SerializeToString()), CUDA, report).graph)
    assert [n.op_type for n in nodes] == ["Elementwise"], [n.op_type for n in nodes]
    code = list(nodes[0].attributes["code"].value)
    assert code == ["Dequantize i1 i2", "Add t0 i0", "Gelu t1", "Quantize t2 i3"], code
    q = _fp8((2, 5, 64), seed=12)
    want = ReferenceEvaluator(model).run(None, {"q": _as_onnx_fp8(q)})[0]
    want = torch.from_numpy(np.ascontiguousarray(want).view(np.uint8))
    args = [torch.from_numpy(np.array(v.const_value.numpy())) if v.const_value is not None else q
            for v in nodes[0].inputs]
    got = compile_elementwise(code, 4, FP8)(*[a.to(DEVICE) for a in args]).cpu().view(torch.uint8)
    # Gelu's erf: fp32 (Triton) vs onnx.reference's float64 -> float32, a few ulps: a near-tie one E4M3 step apart
    apart = (got.to(torch.int32) - want.to(torch.int32)).abs()
    assert apart.max() <= 1 and (apart > 0).float().mean() <= 0.01, apart.max()
