"""The chain after an FP8 QGemm in its epilogue (issue 12: onnxruntime's FP8 QDQ BERT computes each linear as
y = Q(act(DQ(Q(x·W)) + b)·m); kiln/passes/fusion/qgemm_epilogue.py, kiln/ops/quantized.py inputs 9-11):

    the rule       on small QDQ graphs against onnx.reference (E4M3 outputs bit for bit where no Gelu rounds
                   differently; float outputs in float32 exactly), its refusals, and structurally on bert_tiny's
                   FP8 QDQ graph as a CUDA build optimizes it
    the tactics    Triton (plain and persistent), cuBLASLt + one pass (scaled_mm, scaled_mm_half) and the dequantized
                   layer under the Triton interpreter, judged by the unfused pair's tolerance
                   (kiln/tactics/cuda/quant_product_check.py), which a kernel missing the product's rounding fails
"""

from __future__ import annotations

import dataclasses
import os

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

pytest.importorskip("triton")

from kiln.frontend import onnx as onnx_frontend  # noqa: E402
from kiln.ops.quantized import qgemm  # noqa: E402
from kiln.ops.registry import OpContext  # noqa: E402
from kiln.passes._rewrite import PassReport, attr  # noqa: E402
from kiln.passes.pipeline import PassOptions, optimize  # noqa: E402
from kiln.tactics.cuda.quant_product_check import product_layer_checker  # noqa: E402
from tests.kernels.qlayers import FP8, product_layer, refusal, run_tactic  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter evaluates masked-off lanes

CUDA = PassOptions(cuda_rules=True, cpu_rules=False)  # a CUDA build at the default opt_level 2
# TRITON_INTERPRET=0 on a GPU machine (bench/gpu_fp8gemm.sh): the kernel tests on the device
DEVICE = torch.device("cuda" if os.environ.get("TRITON_INTERPRET") == "0" and torch.cuda.is_available() else "cpu")
K, N = 64, 48


def _linear_model(tail: str, seed: int = 0) -> onnx.ModelProto:
    """x (E4M3 [2, 5, K]) -> DQ -> MatMul(DQ(w)) -> Q(s_p) -> DQ -> Add(b) -> `tail` -> y, onnxruntime's QDQ linear.
    tail: "q" (Mul by c, then Q: a query projection), "gelu" (Gelu, then Q: an FFN up), "float" (y the float)."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((K, N)) * 2).astype(ml_dtypes.float8_e4m3fn)
    nodes = [helper.make_node("DequantizeLinear", ["x", "s_x", "zero"], ["xf"], name="dq_x"),
             helper.make_node("DequantizeLinear", ["w", "s_w", "zero"], ["wf"], name="dq_w"),
             helper.make_node("MatMul", ["xf", "wf"], ["mm"], name="matmul"),
             helper.make_node("QuantizeLinear", ["mm", "s_p", "zero"], ["p"], name="q_p"),
             helper.make_node("DequantizeLinear", ["p", "s_p", "zero"], ["pf"], name="dq_p"),
             helper.make_node("Add", ["pf", "b"], ["t"], name="bias_add")]
    if tail == "q":
        nodes += [helper.make_node("Mul", ["t", "c"], ["u"], name="mul"),
                  helper.make_node("QuantizeLinear", ["u", "s_y", "zero"], ["y"], name="q_y")]
    elif tail == "gelu":
        nodes += [helper.make_node("Gelu", ["t"], ["u"], name="gelu"),
                  helper.make_node("QuantizeLinear", ["u", "s_y", "zero"], ["y"], name="q_y")]
    else:
        nodes += [helper.make_node("Identity", ["t"], ["y"], name="out")]
    out_type = TensorProto.FLOAT if tail == "float" else TensorProto.FLOAT8E4M3FN
    inits = [numpy_helper.from_array(np.array(v, np.float32), name) for name, v in
             (("s_x", 0.031), ("s_w", 0.0123), ("s_p", 0.0047), ("s_y", 0.0029), ("c", 0.35355339))]
    inits += [helper.make_tensor("zero", TensorProto.FLOAT8E4M3FN, [], [0.0]),
              helper.make_tensor("w", TensorProto.FLOAT8E4M3FN, [K, N], w.astype(np.float32).reshape(-1).tolist()),
              numpy_helper.from_array((rng.standard_normal(N) * 0.3).astype(np.float32), "b")]
    graph = helper.make_graph(nodes, f"qdq_linear_{tail}",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT8E4M3FN, [2, 5, K])],
                              [helper.make_tensor_value_info("y", out_type, [2, 5, N])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def _fp8(shape, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-3, 4, shape, generator=gen).float())).to(FP8)


def _constant(v) -> torch.Tensor:
    array = np.array(v.const_value.numpy())
    if array.dtype == ml_dtypes.float8_e4m3fn:
        return torch.from_numpy(array.view(np.uint8)).view(FP8)
    return torch.from_numpy(array)


def _run_fused(node, x: torch.Tensor) -> torch.Tensor:
    """The fused QGemm through kiln's op (its reference) on the node's constant inputs."""
    args = [x] + [None if v is None else _constant(v) for v in node.inputs[1:]]
    attributes = {a.name: a.value for a in node.attributes.values()}
    ctx = OpContext(name=node.name, op_type="QGemm", domain="kiln", opset=1, num_inputs=len(args), num_outputs=1)
    return qgemm(ctx, *args, **attributes)


@pytest.mark.parametrize("tail", ["q", "gelu", "float"])
def test_the_rule_makes_one_qgemm_that_is_the_qdq_graph(tail):
    model = _linear_model(tail)
    report = PassReport()
    graph = optimize(onnx_frontend.load(model.SerializeToString()), CUDA, report).graph
    nodes = list(graph)
    assert [n.op_type for n in nodes] == ["QGemm"], [n.op_type for n in nodes]
    assert report.fired.get("fuse_elementwise_into_qgemm") == 1, report.fired
    node = nodes[0]
    attributes = {a.name: a.value for a in node.attributes.values()}
    assert attributes["activation"] == ("Gelu" if tail == "gelu" else "")
    assert attributes["multiplier"] == pytest.approx(0.35355339 if tail == "q" else 1.0, rel=1e-7)
    assert len(node.inputs) == 12 and (node.inputs[6] is None) == (tail == "float")
    for seed in (11, 12):
        x = _fp8((2, 5, K), seed)
        want = ReferenceEvaluator(model).run(None, {"x": x.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)})[0]
        got = _run_fused(node, x)
        if tail == "float":  # DQ, Add in float32 as onnx.reference: the same operations
            np.testing.assert_array_equal(got.numpy(), want)
            continue
        got_codes = got.view(torch.uint8).numpy()
        want_codes = want.view(np.uint8)
        if tail == "q":  # float32 DQ, Add, Mul and an IEEE division: bit for bit
            np.testing.assert_array_equal(got_codes, want_codes)
        else:  # Gelu's erf in float32 (torch) vs onnx.reference's float64: a near-tie may round the other way
            ordinal = lambda c: np.where(c >= 128, -(c.astype(np.int32) & 127), c.astype(np.int32))  # noqa: E731
            off = np.abs(ordinal(got_codes) - ordinal(want_codes))
            assert off.max() <= 1 and (off > 0).mean() < 0.01, (off.max(), (off > 0).mean())


def test_the_rule_refuses_what_the_epilogue_cannot_hold():
    model = _linear_model("q")
    model.graph.output.append(helper.make_tensor_value_info("p", TensorProto.FLOAT8E4M3FN, [2, 5, N]))  # p read
    report = PassReport()
    graph = optimize(onnx_frontend.load(model.SerializeToString()), CUDA, report).graph
    assert "Elementwise" in [n.op_type for n in graph]
    assert any("fuse_elementwise_into_qgemm" in why and "other readers" in why for why in report.refused), \
        report.refused
    cpu = optimize(onnx_frontend.load(_linear_model("q").SerializeToString()), PassOptions()).graph
    assert all(len(n.inputs) <= 9 for n in cpu if n.op_type == "QGemm")  # CUDA_RULES only
    level1 = optimize(onnx_frontend.load(_linear_model("q").SerializeToString()),
                      dataclasses.replace(CUDA, opt_level=1)).graph
    assert all(len(n.inputs) <= 9 for n in level1 if n.op_type == "QGemm")  # a fusion: from opt_level 2


def _key_model() -> onnx.ModelProto:
    """A key projection as the rules above leave it: QGemm (product quantized, float out) -> head Reshape ->
    Transpose -> Elementwise[Mul by the scale share, Quantize] (kiln ops, as onnx_frontend loads them)."""
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((N, K)) * 2).astype(ml_dtypes.float8_e4m3fn)
    nodes = [helper.make_node("QGemm", ["x", "s_x", "zero", "w", "s_w", "zero", "", "", "", "s_p", "zero", "b"], ["r"],
                              domain="kiln", name="gemm", activation="", output_dtype=1, multiplier=1.0),
             helper.make_node("Reshape", ["r", "shape"], ["heads"], name="split"),
             helper.make_node("Transpose", ["heads"], ["kt"], name="transpose", perm=[0, 2, 1, 3]),
             helper.make_node("Elementwise", ["kt", "c", "s_y"], ["k_q"], domain="kiln", name="scale_q",
                              code=["Mul i0 i1", "Quantize t0 i2"], output_dtype=17)]
    inits = [numpy_helper.from_array(np.array(v, np.float32), name) for name, v in
             (("s_x", 0.031), ("s_w", 0.0123), ("s_p", 0.0047), ("s_y", 0.0029), ("c", 0.35355339))]
    inits += [helper.make_tensor("zero", TensorProto.FLOAT8E4M3FN, [], [0.0]),
              helper.make_tensor("w", TensorProto.FLOAT8E4M3FN, [N, K], w.astype(np.float32).reshape(-1).tolist()),
              numpy_helper.from_array((rng.standard_normal(N) * 0.3).astype(np.float32), "b"),
              numpy_helper.from_array(np.array([2, 5, 4, N // 4], np.int64), "shape")]
    graph = helper.make_graph(nodes, "key", [helper.make_tensor_value_info("x", TensorProto.FLOAT8E4M3FN, [2, 5, K])],
                              [helper.make_tensor_value_info("k_q", TensorProto.FLOAT8E4M3FN, [2, 4, 5, N // 4])],
                              inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("kiln", 1)])


def test_the_key_s_scale_and_quantize_move_through_its_transpose_into_the_gemm():
    from kiln.ops.fused import elementwise
    from kiln.passes._rewrite import run_rule
    from kiln.passes.fusion.qgemm_epilogue import fuse_quantize_through_layout_into_qgemm

    model = onnx_frontend.load(_key_model())
    gemm = next(n for n in model.graph if n.op_type == "QGemm")
    chain = next(n for n in model.graph if n.op_type == "Elementwise")
    x = _fp8((2, 5, K), seed=21)
    # before: the float product chain, the head split, then the Mul and Quantize of the Elementwise
    t = _run_fused(gemm, x).reshape(2, 5, 4, N // 4).permute(0, 2, 1, 3)
    c, s_y = (torch.from_numpy(np.array(v.const_value.numpy())) for v in chain.inputs[1:])
    want = elementwise(None, t, c, s_y, code=["Mul i0 i1", "Quantize t0 i2"], output_dtype=17)
    report = PassReport()
    assert run_rule(model, "layout", fuse_quantize_through_layout_into_qgemm, report) == 1, report.refused
    assert [n.op_type for n in model.graph] == ["QGemm", "Reshape", "Transpose"]
    assert all(n.outputs[0].dtype == ir.DataType.FLOAT8E4M3FN for n in model.graph)
    fused = next(n for n in model.graph if n.op_type == "QGemm")
    got = _run_fused(fused, x).reshape(2, 5, 4, N // 4).permute(0, 2, 1, 3)
    # the same float32 operations on each value, moved before the layout ops: bit for bit
    assert torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8))


def test_bert_tiny_fp8_qdq_linears_are_one_qgemm_each(tmp_path):
    """Per encoder layer onnxruntime's QDQ BERT has 6 linears, each a QGemm writing E4M3 and the chain reading it
    (test_elementwise_dequantize.py): all 12 chains are in their GEMMs now, k's Mul and Quantize too (moved up
    through its head transpose, which the attention then reads as its k_perm). The norms read the previous norm's
    E4M3 output as their residual, not its DequantizeLinear."""
    from kiln import zoo
    from kiln.zoo.models import make_inputs
    from tests.calibration import quantize_transformer

    exported = zoo.export("bert_tiny", batch=2, seq=16, dynamic=True)
    calibration = [make_inputs(zoo.get("bert_tiny"), batch=4, seq=16, seed=s) for s in (1, 2)]
    path = str(tmp_path / "qdq.onnx")
    quantize_transformer(str(exported.path), path, calibration, "fp8")
    report = PassReport()
    graph = optimize(onnx_frontend.load(path), CUDA, report).graph
    gemms = [n for n in graph if n.op_type == "QGemm"]
    assert len(gemms) == 12 == report.fired.get("fuse_elementwise_into_qgemm"), (len(gemms), report.fired)
    assert all(len(n.inputs) > 9 and n.inputs[9] is not None for n in gemms)
    outputs = sorted(str(n.outputs[0].dtype) for n in gemms)
    assert outputs.count("FLOAT8E4M3FN") == 8 and outputs.count("FLOAT") == 4, outputs  # q, k, v, up / o, down
    assert report.fired.get("fuse_quantize_through_layout_into_qgemm") == 2, report.fired  # k's, past its transpose
    attention = [n for n in graph if n.op_type == "Attention"]
    assert all(n.inputs[1].producer().op_type == "QGemm" and attr(n, "k_perm") for n in attention)
    dequantized = [n for n in graph if n.op_type == "DequantizeLinear"]  # the final LayerNorm's residual alone: the
    assert len(dequantized) == 1, [n.name for n in dequantized]  # LayerNormQuantizes read theirs as E4M3
    assert report.fired.get("fuse_dequantize_into_layer_norm_quantize") == 3, report.fired
    assert not [n.name for n in graph if n.op_type in ("Elementwise", "Transpose", "QuantizeLinear")]


# ---- the tactics --------------------------------------------------------------------------------------

TACTICS = ["cuda.qgemm.triton.16x64x128", "cuda.qgemm.scaled_mm", "cuda.qgemm.scaled_mm_half",
           "cuda.qgemm.dequantized"]
CASES = [(FP8, "", 0.35355339), (FP8, "Gelu", 1.0), (torch.float16, "", 1.0), (torch.float32, "Relu", 1.0)]


def _judge(layer, got) -> str | None:
    return product_layer_checker(qgemm, layer.ctx, layer.args, layer.attributes)(got)


@pytest.mark.parametrize("out, activation, multiplier", CASES, ids=lambda v: str(v).removeprefix("torch."))
@pytest.mark.parametrize("name", TACTICS)
def test_tactics_take_the_quantized_product(name, out, activation, multiplier):
    layer = product_layer(out, activation=activation, multiplier=multiplier, per_channel=name.endswith("half"))
    got = run_tactic(name, layer.to(DEVICE), DEVICE).cpu()
    assert _judge(layer, got) is None
    if name.startswith("cuda.qgemm.triton") or name == "cuda.qgemm.scaled_mm":
        # fp32 sums of exact products (the interpreter's, the CPU's _scaled_mm; the GPU's promoted every K step) and
        # the reference's float32 chain: the same values but where the sum's order moves a product across an E4M3
        # tie (on the GPU the compiler's FMA of p·s + b rounds once fewer: a float output's last bit)
        want = layer.reference()
        differ = (got.view(torch.uint8) != want.view(torch.uint8)) if out == FP8 else \
            (got.double() - want.double()).abs() > (0.0 if DEVICE.type == "cpu" else 2.0**-20 * want.double().abs())
        assert float(differ.double().mean()) < 0.01


def test_the_persistent_kernel_takes_it():
    """The persistent TMA kernel, several tiles a program, E4M3 and fp16 outputs (a LayerNorm's input)."""
    name = "cuda.qgemm.triton_persistent.128x128x128.fast_accum"
    for out, activation, multiplier in ((FP8, "", 0.35355339), (torch.float16, "", 1.0), (FP8, "Gelu", 1.0)):
        layer = product_layer(out, activation=activation, multiplier=multiplier, lead=(3, 100), k=272, n=400,
                              seed=4)
        assert _judge(layer, run_tactic(name, layer.to(DEVICE), DEVICE).cpu()) is None, (out, activation)
    assert "multiples of 16" in refusal(name, product_layer(FP8, n=88))
    float32 = refusal(name, product_layer(torch.float32, lead=(3, 100), k=272, n=400))
    assert "float32" in float32 or "scaled_mm_direct" in float32, float32


def test_the_tactics_that_cannot_refuse_and_the_check_can_fail():
    layer = product_layer(torch.float16)
    assert "before the bias" in refusal("cuda.qgemm.scaled_mm_direct", layer)
    # (a kernel that skips the product's rounding stays inside the bound, as the unfused QGemm one step off would:
    # the bit-level comparison in test_tactics_take_the_quantized_product is what holds the Triton kernel to it)
    for out in (torch.float16, FP8):
        fused = product_layer(out, multiplier=0.35355339, seed=3)
        no_multiplier = dataclasses.replace(fused, attributes={**fused.attributes, "multiplier": 1.0}).reference()
        assert "beyond" in (_judge(fused, no_multiplier) or ""), out
        # and a bias wrong in one column by 30 of the product's steps near its scale
        bias = fused.args[11].clone()
        bias[3] += 30 * float(fused.args[9])
        shifted = dataclasses.replace(fused, args=fused.args[:11] + [bias]).reference()
        assert _judge(fused, shifted) is not None


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_bert_tiny_fp8_qdq_engine_on_the_fused_gemms_is_onnxruntime(tmp_path, monkeypatch, precision):
    """The CUDA build's graph built for the CPU with the Triton QGemm (and Elementwise) tactics registered there (the
    interpreter): the builder's check passes them on the 12 fused linears, and the engine forced onto them is
    onnxruntime (its Q/DQ as written) within the model's coarsest per-tensor scale, as the chains were
    (test_elementwise_dequantize.py). fp16 (the product bias and float outputs half, the product scale float32): held
    to the fp16 engine built without the session-22 rules within the same step (the fp16 engine is itself several
    coarsest steps from onnxruntime's fp32: its float layers' rounding)."""
    import kiln
    from kiln import zoo
    from kiln.builder import build as build_module
    from kiln.zoo.models import make_inputs
    from tests.calibration import assert_forced_steps_match, quantize_transformer
    from tests.unit.tactic_check import cuda_tactics_on_cpu

    gemm, chain = "cuda.qgemm.triton.16x64x128", "cuda.elementwise.triton"
    exported = zoo.export("bert_tiny", batch=2, seq=16, dynamic=True)
    calibration = [make_inputs(zoo.get("bert_tiny"), batch=4, seq=16, seed=s) for s in (1, 2)]
    path = str(tmp_path / "qdq.onnx")
    quantize_transformer(str(exported.path), path, calibration, "fp8")
    cuda_tactics_on_cpu(monkeypatch, lambda tactic: tactic in (gemm, chain))
    plain = build_module.pass_options
    monkeypatch.setattr(build_module, "pass_options", lambda config: dataclasses.replace(
        plain(config), cuda_rules=True, cpu_rules=False, unsigned_activations=False))
    from kiln.passes import fusion
    later = ("fuse_elementwise_into_qgemm", "fuse_quantize_through_layout_into_qgemm",
             "absorb_attention_reshapes_after_epilogue", "fuse_dequantize_into_layer_norm_quantize")
    with monkeypatch.context() as patch:
        patch.setattr(fusion, "RULES", [r for r in fusion.RULES if r[0] not in later])
        chains = kiln.build(path, device="cpu", precision=precision, tuning_runs=2) if precision == "fp16" else None
    engine = kiln.build(path, device="cpu", precision=precision, tuning_runs=2)
    fused = [s for s in engine.plan.program.steps if s.op_type == "QGemm" and len(s.inputs) > 9 and s.inputs[9]]
    assert len(fused) == 12
    assert_forced_steps_match(engine, fused, gemm, path, baseline=chains)


# ---- the LayerNorm reading the E4M3 residual (kiln/passes/fusion/layernorm_quantize.py) -------------------------

def _norm_model(other_reader: bool = False) -> onnx.ModelProto:
    """h (float [2, 5, 32]) + DQ(r_q E4M3; s_r) -> LayerNormalization -> Q(s_y): a transformer's residual norm."""
    rng = np.random.default_rng(5)
    nodes = [helper.make_node("DequantizeLinear", ["r_q", "s_r", "zero"], ["r"], name="dq_r"),
             helper.make_node("Add", ["h", "r"], ["s"], name="residual_add"),
             helper.make_node("LayerNormalization", ["s", "gamma", "beta"], ["n"], name="norm", epsilon=1e-5),
             helper.make_node("QuantizeLinear", ["n", "s_y", "zero"], ["y"], name="q_y")]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT8E4M3FN, [2, 5, 32])]
    if other_reader:
        nodes.append(helper.make_node("Relu", ["r"], ["r_relu"], name="other"))
        outputs.append(helper.make_tensor_value_info("r_relu", TensorProto.FLOAT, [2, 5, 32]))
    inits = [numpy_helper.from_array(np.array(0.043, np.float32), "s_r"),
             numpy_helper.from_array(np.array(4.0 / 448, np.float32), "s_y"),
             helper.make_tensor("zero", TensorProto.FLOAT8E4M3FN, [], [0.0]),
             numpy_helper.from_array((rng.random(32) + 0.5).astype(np.float32), "gamma"),
             numpy_helper.from_array((rng.standard_normal(32) * 0.1).astype(np.float32), "beta")]
    inputs = [helper.make_tensor_value_info("h", TensorProto.FLOAT, [2, 5, 32]),
              helper.make_tensor_value_info("r_q", TensorProto.FLOAT8E4M3FN, [2, 5, 32])]
    graph = helper.make_graph(nodes, "residual_norm", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def test_the_norm_reads_the_e4m3_residual_and_is_the_qdq_graph():
    from kiln.ops.quantized import layer_norm_quantize

    model = _norm_model()
    report = PassReport()
    nodes = list(optimize(onnx_frontend.load(model.SerializeToString()), CUDA, report).graph)
    assert [n.op_type for n in nodes] == ["LayerNormQuantize"], [n.op_type for n in nodes]
    assert report.fired.get("fuse_dequantize_into_layer_norm_quantize") == 1
    node = nodes[0]
    assert node.inputs[3].name == "r_q" and len(node.inputs) == 7
    consts = {v.name: _constant(v) for v in node.inputs if v is not None and v.const_value is not None}
    gen = torch.Generator().manual_seed(9)
    h = torch.randn(2, 5, 32, generator=gen) * 2
    r_q = _fp8((2, 5, 32), seed=10)
    args = [h, consts[node.inputs[1].name], consts[node.inputs[2].name], r_q, consts[node.inputs[4].name],
            consts[node.inputs[5].name], consts[node.inputs[6].name]]
    ctx = OpContext(name="norm", op_type="LayerNormQuantize", domain="kiln", opset=1, num_inputs=7, num_outputs=1)
    got = layer_norm_quantize(ctx, *args, epsilon=1e-5).view(torch.uint8).numpy()
    want = ReferenceEvaluator(model).run(None, {"h": h.numpy(), "r_q": r_q.view(torch.uint8).numpy().view(
        ml_dtypes.float8_e4m3fn)})[0].view(np.uint8)
    # torch's fp32 LayerNorm against onnx.reference's numpy one: the last bits of y, so a near-tie may round the
    # other way onto the E4M3 grid (the residual's DequantizeLinear and Add are float32 in both: exact)
    ordinal = lambda c: np.where(c >= 128, -(c.astype(np.int32) & 127), c.astype(np.int32))  # noqa: E731
    off = np.abs(ordinal(got) - ordinal(want))
    assert off.max() <= 1 and (off > 0).mean() < 0.02, (off.max(), (off > 0).mean())
    shared = PassReport()
    kept = optimize(onnx_frontend.load(_norm_model(other_reader=True).SerializeToString()), CUDA, shared).graph
    assert "DequantizeLinear" in [n.op_type for n in kept]
    assert any("other readers" in why for why in shared.refused), shared.refused


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.float16], ids=str)
def test_the_norm_kernel_dequantizes_the_residual_as_its_dequantize_linear(x_dtype):
    """The Triton LayerNormQuantize reading E4M3 and its scale is, bit for bit, the kernel given the residual its
    DequantizeLinear wrote (float32(r)·s in x's dtype), itself judged against the reference in test_fp8_encoder.py;
    and through the tactic the autotuner runs."""
    from kiln.kernels.cuda.triton.qnorm import layer_norm_quantize
    from kiln.plan.spec import StepSpec
    from kiln.tactics import registry
    from kiln.tactics.tactic import InputMeta

    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(3, 13, 96, generator=gen) * 3).to(x_dtype)
    r_q, s_r = _fp8((3, 13, 96), seed=3), 0.0371
    gamma, beta = (torch.rand(96, generator=gen) + 0.5).to(x_dtype), (torch.randn(96, generator=gen) * 0.1).to(x_dtype)
    x, r_q, gamma, beta = (t.to(DEVICE) for t in (x, r_q, gamma, beta))
    r = (r_q.to(torch.float32) * torch.tensor(s_r, dtype=torch.float32)).to(x_dtype)
    want_q, want_y = layer_norm_quantize(x, gamma, beta, 1e-5, 4.0 / 448, 0.0, FP8, residual=r)
    q, y = layer_norm_quantize(x, gamma, beta, 1e-5, 4.0 / 448, 0.0, FP8, residual=r_q, residual_scale=s_r)
    if DEVICE.type == "cuda" and x_dtype == torch.float32:
        # compiled for a GPU, x + float32(r)·s contracts into one FMA (the product is not rounded first): y within
        # 1e-5 (an ulp of h over the std), E4M3 at most one step off at a near-tie (H100, 2026-12-06; bit-exact
        # under the interpreter); fp16 rounds r to x's dtype first, so no contraction and bit for bit below
        torch.testing.assert_close(y, want_y, rtol=1e-5, atol=1e-5)
        step = (q.view(torch.uint8).to(torch.int32) - want_q.view(torch.uint8).to(torch.int32)).abs()
        assert step.max() <= 1 and (step > 0).float().mean() < 0.01, (step.max(), (step > 0).float().mean())
    else:
        assert torch.equal(y, want_y) and torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    with pytest.raises(ValueError, match="residual"):
        layer_norm_quantize(x, gamma, beta, 1e-5, 4.0 / 448, 0.0, FP8, residual=r_q)  # E4M3 without its scale
    tactic = registry.all_tactics("cuda")["cuda.layer_norm_quantize.triton"]
    args = [x, gamma, beta, r_q, torch.tensor(4.0 / 448), torch.zeros((), dtype=FP8), torch.tensor(s_r)]
    metas = [InputMeta.of(a, i in (1, 2, 4, 5, 6)) for i, a in enumerate(args)]
    step = StepSpec(op_type="LayerNormQuantize", domain="kiln", name="ln", inputs=[f"in{i}" for i in range(7)],
                    outputs=["q"], attributes={"epsilon": 1e-5})
    assert tactic.check(step, metas) is True
    launch = tactic.prepare(step, [None, gamma, beta, None, *args[4:]], DEVICE)
    ctx = OpContext(name="ln", op_type="LayerNormQuantize", domain="kiln", opset=1, num_inputs=7, num_outputs=1)
    assert torch.equal(launch(ctx, *args).view(torch.uint8), want_q.view(torch.uint8))
    float_residual = tactic.check(step, [*metas[:3], InputMeta.of(r, False), *metas[4:]])
    assert isinstance(float_residual, str) and "float8_e4m3fn" in float_residual
