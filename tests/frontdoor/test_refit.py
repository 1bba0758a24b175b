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
                               rtol=1e-6, atol=1e-6)  # tactics may differ between the two builds


def test_int8_engines_are_refused(models, tmp_path):
    calibration = [{"x": np.random.default_rng(k).standard_normal((2, 3, 8, 8)).astype(np.float32)} for k in range(2)]
    engine = kiln.build(str(models[0]), precision="int8", quantization="emulate", calibration=calibration,
                        calibrator="minmax", profiles=[{"x": "1x3x8x8,2x3x8x8,4x3x8x8"}])
    with pytest.raises(RefitError, match="calibrated on the old weights"):
        engine.refit(str(tmp_path / "new.safetensors"))


def test_an_engine_built_from_bytes_needs_its_model(models, tmp_path):
    engine = kiln.build(models[0].read_bytes())
    with pytest.raises(RefitError, match="does not record the ONNX model"):
        engine.refit(str(tmp_path / "new.safetensors"))
    engine.refit(str(tmp_path / "new.safetensors"), onnx=str(models[0]))
    want = kiln.build(models[1].read_bytes()).run(_x())["logits"]
    np.testing.assert_allclose(engine.run(_x())["logits"], want, rtol=1e-6, atol=1e-6)
