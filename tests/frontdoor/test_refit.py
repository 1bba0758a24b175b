"""Refit: an engine given new weights computes what a fresh build with those weights computes, bit
for bit when both run the same tactics; weights the builder folded (BatchNorm into the conv), laid out
again (Gemm's transposed B) or cast (fp16) are re-derived; what cannot be is refused with the reason."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import safetensors.numpy
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.builder.refit import RefitError
from kiln.cli import main as cli_main


def _weights(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "conv.weight": rng.standard_normal((8, 3, 3, 3)).astype(np.float32) * 0.3,
        "conv.bias": rng.standard_normal(8).astype(np.float32) * 0.1,
        "bn.weight": rng.uniform(0.5, 1.5, 8).astype(np.float32),
        "bn.bias": rng.standard_normal(8).astype(np.float32) * 0.1,
        "bn.running_mean": rng.standard_normal(8).astype(np.float32) * 0.2,
        "bn.running_var": rng.uniform(0.5, 2.0, 8).astype(np.float32),
        "fc.weight": rng.standard_normal((5, 8)).astype(np.float32) * 0.3,  # Gemm transB=1: stored transposed
        "fc.bias": rng.standard_normal(5).astype(np.float32) * 0.1,
    }


def _model(weights: dict[str, np.ndarray]) -> onnx.ModelProto:
    """Conv -> BatchNormalization -> Relu -> GlobalAveragePool -> Flatten -> Gemm(transB=1)."""
    nodes = [
        helper.make_node("Conv", ["x", "conv.weight", "conv.bias"], ["c"], pads=[1, 1, 1, 1], name="conv"),
        helper.make_node("BatchNormalization", ["c", "bn.weight", "bn.bias", "bn.running_mean", "bn.running_var"],
                         ["b"], epsilon=1e-5, name="bn"),
        helper.make_node("Relu", ["b"], ["r"], name="relu"),
        helper.make_node("GlobalAveragePool", ["r"], ["p"], name="pool"),
        helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "fc.weight", "fc.bias"], ["logits"], transB=1, name="fc"),
    ]
    graph = helper.make_graph(nodes, "net", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 5])],
                              initializer=[numpy_helper.from_array(v, k) for k, v in weights.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture
def models(tmp_path):
    paths = {}
    for seed in (0, 1):
        paths[seed] = tmp_path / f"net{seed}.onnx"
        onnx.save(_model(_weights(seed)), paths[seed])
    safetensors.numpy.save_file(_weights(1), tmp_path / "new.safetensors")
    return paths


def _x(seed=5):
    return {"x": np.random.default_rng(seed).standard_normal((3, 3, 8, 8)).astype(np.float32)}


def _build(path, tmp_path, precision):
    # one timing cache: the second build meets the first one's measurements and chooses the same tactics
    return kiln.build(str(path), precision=precision, timing_cache=str(tmp_path / "timing.json"),
                      profiles=[{"x": "1x3x8x8,3x3x8x8,4x3x8x8"}])


def _tactics(engine):
    return [step.tactic for step in engine.plan.program.steps]


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("given", ["safetensors", "onnx", "dict"])
def test_refit_equals_a_fresh_build(models, tmp_path, precision, given):
    engine = _build(models[0], tmp_path, precision)
    fresh = _build(models[1], tmp_path, precision)
    before = engine.run(_x())["logits"]
    weights = {"safetensors": str(tmp_path / "new.safetensors"), "onnx": str(models[1]), "dict": _weights(1)}[given]
    report = engine.refit(weights)
    # the folded conv weight and bias, the transposed fc weight and its bias changed; nothing was rebuilt
    assert len(report.changed) == 4 and any("fold" in k for k in report.changed)
    assert _tactics(engine) == _tactics(fresh)
    for seed in (5, 6):
        got, want = engine.run(_x(seed))["logits"], fresh.run(_x(seed))["logits"]
        np.testing.assert_array_equal(got, want)  # bit for bit: same tactics, same derived weights
    assert not np.array_equal(before, engine.run(_x())["logits"])
    assert engine.plan.header["refits"][0]["changed"] == report.changed


def test_refit_survives_save_and_load(models, tmp_path):
    engine = _build(models[0], tmp_path, "fp32")
    engine.save(tmp_path / "net.kiln")
    loaded = kiln.load(tmp_path / "net.kiln")  # weights mmapped from the file
    loaded.refit(str(tmp_path / "new.safetensors"))
    loaded.save(tmp_path / "net.kiln")  # in place, over the file its weights came from
    again = kiln.load(tmp_path / "net.kiln")
    want = _build(models[1], tmp_path, "fp32").run(_x())["logits"]
    np.testing.assert_array_equal(again.run(_x())["logits"], want)
    assert len(again.plan.header["refits"]) == 1


def test_cli_refit(models, tmp_path, capsys):
    _build(models[0], tmp_path, "fp32").save(tmp_path / "net.kiln")
    assert cli_main(["refit", str(tmp_path / "net.kiln"), "--weights", str(tmp_path / "new.safetensors"),
                     "-o", str(tmp_path / "refit.kiln")]) == 0
    assert "4 engine weight(s) changed" in capsys.readouterr().out
    want = _build(models[1], tmp_path, "fp32").run(_x())["logits"]
    np.testing.assert_array_equal(kiln.load(tmp_path / "refit.kiln").run(_x())["logits"], want)
    # in place by default; a refused refit exits 1 with the reason and leaves the file alone
    bad = tmp_path / "bad.safetensors"
    safetensors.numpy.save_file({"fc.weight": np.zeros((5, 9), np.float32)}, bad)
    before = (tmp_path / "net.kiln").read_bytes()
    assert cli_main(["refit", str(tmp_path / "net.kiln"), "--weights", str(bad)]) == 1
    assert "'fc.weight': the model holds float [5, 8], given float [5, 9]" in capsys.readouterr().err
    assert (tmp_path / "net.kiln").read_bytes() == before


@pytest.mark.parametrize("weights,message", [
    ({"fc.weights": np.zeros((5, 8), np.float32)}, r"no initializer named \['fc.weights'\]"),
    ({"fc.weight": np.zeros((8, 5), np.float32)}, r"'fc.weight': the model holds float \[5, 8\], given float \[8, 5\]"),
    ({"fc.weight": np.zeros((5, 8), np.float64)}, r"'fc.weight': the model holds float \[5, 8\], given double \[5, 8\]"),
])
def test_names_shapes_and_dtypes_are_checked(models, tmp_path, weights, message):
    engine = _build(models[0], tmp_path, "fp32")
    before = engine.run(_x())["logits"]
    with pytest.raises(RefitError, match=message):
        engine.refit(weights)
    np.testing.assert_array_equal(engine.run(_x())["logits"], before)  # untouched


def test_weights_that_change_the_structure_are_refused(tmp_path):
    """Two layers with identical weights are stored once; weights that differ cannot fit that engine."""
    rng = np.random.default_rng(2)
    shared = rng.standard_normal((64, 64)).astype(np.float32)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 64])

    def model(w1, w2):
        nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Tanh", ["h"], ["t"]),
                 helper.make_node("MatMul", ["t", "w2"], ["y"])]
        return helper.make_model(helper.make_graph(nodes, "twice", [x], [y], initializer=[
            numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")]),
            opset_imports=[helper.make_opsetid("", 17)])

    onnx.save(model(shared, shared.copy()), tmp_path / "tied.onnx")
    engine = kiln.build(str(tmp_path / "tied.onnx"))
    with pytest.raises(RefitError, match="change the engine's structure.*stored differently"):
        engine.refit({"w2": rng.standard_normal((64, 64)).astype(np.float32)})
    # weights that keep them equal refit fine
    other = rng.standard_normal((64, 64)).astype(np.float32)
    engine.refit({"w1": other, "w2": other.copy()})
    onnx.save(model(other, other.copy()), tmp_path / "tied2.onnx")
    feed = {"x": rng.standard_normal((2, 64)).astype(np.float32)}
    np.testing.assert_allclose(engine.run(feed)["y"], kiln.build(str(tmp_path / "tied2.onnx")).run(feed)["y"],
                               rtol=1e-5, atol=1e-5)  # the two builds may pick other GEMM tactics: 64-term fp32
    # sums in another order differ by a few ulps of |y| ~ 10 (2.6e-6 seen under load), not by 1e-6


def test_an_engine_built_from_bytes_needs_its_model(models, tmp_path):
    engine = kiln.build(models[0].read_bytes())
    with pytest.raises(RefitError, match="does not record the ONNX model"):
        engine.refit(str(tmp_path / "new.safetensors"))
    engine.refit(str(tmp_path / "new.safetensors"), onnx=str(models[0]))
    want = kiln.build(models[1].read_bytes()).run(_x())["logits"]
    np.testing.assert_allclose(engine.run(_x())["logits"], want, rtol=1e-6, atol=1e-6)


def _qdq_model(seed: int) -> onnx.ModelProto:
    """Explicit Q/DQ (as onnxruntime's quantizer writes it): int8 weights with per-channel scales."""
    rng = np.random.default_rng(seed)
    w = rng.integers(-127, 128, (16, 8)).astype(np.int8)
    inits = [numpy_helper.from_array(w, "w_q"),
             numpy_helper.from_array(rng.uniform(0.005, 0.02, 8).astype(np.float32), "w_scale"),
             numpy_helper.from_array(np.zeros(8, np.int8), "w_zero"),
             numpy_helper.from_array(np.array(rng.uniform(0.02, 0.05), np.float32), "x_scale"),
             numpy_helper.from_array(np.array(0, np.int8), "x_zero"),
             numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "bias")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "x_scale", "x_zero"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "x_scale", "x_zero"], ["xd"]),
             helper.make_node("DequantizeLinear", ["w_q", "w_scale", "w_zero"], ["wd"], axis=1),
             helper.make_node("MatMul", ["xd", "wd"], ["mm"]), helper.make_node("Add", ["mm", "bias"], ["y"])]
    graph = helper.make_graph(nodes, "qdq", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])


def test_explicit_qdq_scales_and_int8_weights_refit(tmp_path):
    for seed in (0, 1):
        onnx.save(_qdq_model(seed), tmp_path / f"qdq{seed}.onnx")
    engine = kiln.build(str(tmp_path / "qdq0.onnx"))
    report = engine.refit(str(tmp_path / "qdq1.onnx"))
    assert report.changed  # the int8 weight, its scales, the activation scale, the bias
    feed = {"x": np.random.default_rng(9).standard_normal((4, 16)).astype(np.float32)}
    fresh = kiln.build(str(tmp_path / "qdq1.onnx"))
    if [s.tactic for s in engine.plan.program.steps] == [s.tactic for s in fresh.plan.program.steps]:
        np.testing.assert_array_equal(engine.run(feed)["y"], fresh.run(feed)["y"])
    import onnxruntime as ort  # and what onnxruntime computes for the new Q/DQ model
    want = ort.InferenceSession(str(tmp_path / "qdq1.onnx"), providers=["CPUExecutionProvider"]).run(None, feed)[0]
    # the fused layer (kiln::QGemm) holds the float bias as int32 at x_scale·w_scale, as QLinearMatMul-style
    # kernels do: up to half that step from onnxruntime's float Add of the bias
    inits = {i.name: numpy_helper.to_array(i) for i in onnx.load(str(tmp_path / "qdq1.onnx")).graph.initializer}
    step = float(inits["x_scale"]) * inits["w_scale"].max()
    np.testing.assert_allclose(engine.run(feed)["y"], want, rtol=1e-5, atol=0.5 * step + 1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_bert_refit_through_fused_attention_and_merged_gemms(tmp_path, precision):
    """BERT tiny exported twice with different (trained-looking) weights: LayerNorm folded, Q/K/V GEMMs
    merged into one, attention fused; the refit engine equals the fresh build of the second."""
    import torch

    from kiln import zoo
    from kiln.zoo.export import export_module
    from kiln.zoo.models import example_inputs

    spec = zoo.get("bert_tiny")
    for seed in (1, 2):
        model = zoo.torch_model("bert_tiny")
        torch.manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.02 * torch.randn_like(p))  # every LayerNorm weight differs from 1: none shared
        (tmp_path / f"m{seed}").mkdir()
        export_module(model, example_inputs(spec, batch=2, seq=16), tmp_path / f"m{seed}",
                      dynamic_axes={0: "batch", 1: "seq"})
    cache = str(tmp_path / "timing.json")
    engine = kiln.build(str(tmp_path / "m1" / "model.onnx"), precision=precision, timing_cache=cache)
    fresh = kiln.build(str(tmp_path / "m2" / "model.onnx"), precision=precision, timing_cache=cache)
    assert {"Attention", "FusedGemm"} <= {s.op_type for s in engine.plan.program.steps}
    engine.refit(str(tmp_path / "m2" / "model.onnx"))
    assert _tactics(engine) == _tactics(fresh)
    feed = {k: v for k, v in example_inputs(spec, batch=2, seq=16).items()}
    for name, value in engine.run(feed).items():
        np.testing.assert_array_equal(value, fresh.run(feed)[name])


def test_a_partial_refit_after_another_keeps_its_weights_or_is_refused(models, tmp_path):
    """The recorded model still holds what an earlier refit replaced: deriving through it with only other
    weights would silently put the old ones back, so those must come again (or the current model be given)."""
    engine = _build(models[0], tmp_path, "fp32")
    new = _weights(1)
    head = {k: v for k, v in new.items() if k.startswith("fc.")}
    body = {k: v for k, v in new.items() if not k.startswith("fc.")}
    assert engine.refit(head).initializers == ["fc.bias", "fc.weight"]
    with pytest.raises(RefitError, match=r"earlier refits replaced \['fc.bias', 'fc.weight'\].*give them again"):
        engine.refit(body)
    engine.refit({**body, "fc.weight": head["fc.weight"], "fc.bias": head["fc.bias"]})
    want = _build(models[1], tmp_path, "fp32").run(_x())["logits"]
    np.testing.assert_array_equal(engine.run(_x())["logits"], want)
    # after a whole model, a partial refit needs the model that holds the engine's weights now
    engine.refit(str(models[0]))
    with pytest.raises(RefitError, match="an earlier refit took a whole model"):
        engine.refit(head)
    engine.refit(head, onnx=str(models[0]))
