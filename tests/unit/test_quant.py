"""Post-training quantization: calibrators, Q/DQ insertion, the build path, the calibration cache and
its errors. Quantized engines are checked against onnxruntime running the same Q/DQ graph."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.cli import main
from kiln.errors import KilnError
from kiln.frontend import onnx as onnx_frontend
from kiln.passes import PassOptions, optimize
from kiln.quant import qdq
from kiln.quant.calibrators import Entropy, MinMax, Percentile, make


def _cnn(seed: int = 0) -> bytes:
    """conv -> relu -> conv -> global pool -> flatten -> gemm: three quantizable layers."""
    rng = np.random.default_rng(seed)
    w1 = numpy_helper.from_array(rng.standard_normal((8, 3, 3, 3)).astype(np.float32) * 0.3, "w1")
    w2 = numpy_helper.from_array(rng.standard_normal((8, 8, 3, 3)).astype(np.float32) * 0.2, "w2")
    w3 = numpy_helper.from_array(rng.standard_normal((5, 8)).astype(np.float32), "w3")
    b3 = numpy_helper.from_array(rng.standard_normal(5).astype(np.float32), "b3")
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
             helper.make_node("GlobalAveragePool", ["c2"], ["p"], name="pool"),
             helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
             helper.make_node("Gemm", ["f", "w3", "b3"], ["y"], name="fc", transB=1)]
    graph = helper.make_graph(nodes, "cnn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 12, 12])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 5])], [w1, w2, w3, b3])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)]).SerializeToString()


def _batches(n: int, seed: int = 1) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((1, 3, 12, 12), dtype=np.float32)} for _ in range(n)]


# ---- calibrators -------------------------------------------------------------------------------

def test_minmax_is_the_largest_magnitude():
    c = MinMax()
    values = torch.randn(1000) * 3
    for chunk in values.split(100):
        c.observe(chunk)
    assert c.amax() == pytest.approx(float(values.abs().max()))


def test_percentile_matches_numpy_within_a_bin_after_the_range_grew():
    c = Percentile(99.0)
    values = torch.randn(50_000)
    c.observe(values[:100] * 0.01)  # a first batch far narrower than the rest: the histogram must widen
    for chunk in values.split(5000):
        c.observe(chunk)
    nonzero = np.abs(np.concatenate([values[:100].numpy() * 0.01, values.numpy()]))
    assert c.counts.sum() == pytest.approx(np.count_nonzero(nonzero))  # every value counted once
    want = np.percentile(nonzero, 99.0)
    assert abs(c.amax() - want) <= 2 * c.width


@pytest.mark.parametrize("scale", [1.0, 1e-3, 50.0])
def test_entropy_clips_a_gaussian_tail_but_not_its_body(scale):
    c = Entropy()
    values = torch.randn(200_000) * scale
    for chunk in values.split(20_000):
        c.observe(chunk)
    amax = c.amax() / scale
    assert 2.5 < amax < float(values.abs().max()) / scale  # ~3.7 sigma: the rare tail clipped


def test_entropy_is_not_pulled_in_by_a_relus_zeros():
    c = Entropy()
    values = torch.randn(200_000).clamp(min=0)  # half exactly 0
    for chunk in values.split(20_000):
        c.observe(chunk)
    assert c.amax() > 2.5


def test_entropy_of_a_one_sided_activation_searches_over_uint8s_256_levels():
    """A uint8 activation over [0, amax] has 256 codes, twice int8's positive half: the KL search quantizes
    each candidate range into 256 levels and starts at 256 bins (TensorRT's 128 assumes int8's symmetric
    grid). On a heavy tail (lognormal, sigma 2) KL wants the smallest range it may take: 128 bins for int8,
    256 and a few for uint8; both clip the tail."""
    values = torch.from_numpy(np.random.default_rng(3).lognormal(0.0, 2.0, 200_000).astype(np.float32))
    symmetric, one_sided = Entropy(), make("entropy", one_sided=True)
    assert (symmetric.levels, one_sided.levels) == (128, 256)
    for chunk in values.split(20_000):
        symmetric.observe(chunk)
        one_sided.observe(chunk)
    assert symmetric.width == one_sided.width  # the same histogram
    assert symmetric.amax() / symmetric.width == 128.5
    assert 256.5 <= one_sided.amax() / one_sided.width < 300 and one_sided.amax() < float(values.max())


@pytest.mark.parametrize("fp8", [False, True])
def test_mse_picks_the_range_whose_quantization_error_is_smallest(fp8):
    """Oracle: the squared error of the values themselves (not the histogram's bin centres) quantized with
    each of 400 ranges, by numpy (int8: round(x / s) clipped to 127, s = amax / 127; fp8: ml_dtypes' E4M3
    cast of x·448/amax), on a Gaussian: the range MSE picks is within 2% of the oracle's best error; for
    int8 it clips the sparse tail (minmax's range does not)."""
    import ml_dtypes

    rng = np.random.default_rng(11)
    values = rng.standard_normal(200_000).astype(np.float32)
    c = make("mse", fp8=fp8)
    for chunk in torch.from_numpy(values).split(20_000):
        c.observe(chunk)
    x = np.abs(values[values != 0]).astype(np.float64)

    def error(amax: float) -> float:
        if fp8:
            q = np.minimum(x * 448 / amax, 448).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
            return float(((q.astype(np.float64) * amax / 448 - x) ** 2).sum())
        return float(((np.minimum(np.round(x / amax * 127), 127) * amax / 127 - x) ** 2).sum())

    grid = np.linspace(x.max() / 100, x.max(), 400)
    best = min(error(a) for a in grid)
    assert error(c.amax()) <= 1.02 * best
    if not fp8:  # E4M3's steps grow with the value: its best range keeps the whole tail
        assert c.amax() < 0.95 * x.max() and error(c.amax()) < error(float(x.max()))


def test_an_unknown_calibrator_is_named():
    with pytest.raises(ValueError, match="no calibrator 'kl'; kiln has"):
        make("kl")


# ---- Q/DQ insertion ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype, stored", [("int8", ir.DataType.INT8), ("fp8", ir.DataType.FLOAT8E4M3FN)])
def test_insert_quantizes_conv_and_gemm_inputs_and_weights(dtype, stored):
    model = optimize(onnx_frontend.load(_cnn()), PassOptions(fusions=False))
    targets = qdq.targets(model.graph)
    assert [t.node.name for t in targets] == ["conv1", "conv2", "fc"]
    assert [t.channel_axis for t in targets] == [0, 0, 0]
    ranges = {t.activation.name: 2.0 for t in targets}
    skipped = qdq.insert(model, ranges, dtype)
    assert skipped == {}
    ops = [n.op_type for n in model.graph]
    assert ops.count("QuantizeLinear") == 3 and ops.count("DequantizeLinear") == 6  # 3 activations, 3 weights
    weights = [v for v in model.graph.initializers.values() if v.name.endswith("_weight_q")]
    assert len(weights) == 3 and all(v.const_value.dtype == stored for v in weights)


def test_a_layer_without_a_range_stays_float_and_says_why():
    model = optimize(onnx_frontend.load(_cnn()), PassOptions(fusions=False))
    targets = qdq.targets(model.graph)
    skipped = qdq.insert(model, {targets[0].activation.name: 1.0, targets[1].activation.name: 0.0}, "int8")
    assert skipped["conv2"] == f"its input {targets[1].activation.name!r} was 0.0 on every calibration batch"
    assert skipped["fc"].startswith("no range measured")


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_an_emulated_engine_computes_what_onnxruntime_computes_on_the_same_qdq_graph(dtype, tmp_path):
    """kiln's quantized build vs onnxruntime (no graph optimisation: it runs the Q/DQ ops as written)
    on the same Q/DQ model, fresh inputs: within one quantization step of the output."""
    from kiln.builder.calibration import quantize
    from kiln.builder.config import BuildConfig

    config = BuildConfig(precision=dtype, quantization="emulate", calibration=_batches(8), calibrator="minmax")
    model, record = quantize(onnx_frontend.load(_cnn()), config, lambda _msg: None)
    path = tmp_path / "q.onnx"
    onnx.save(ir.to_proto(model), path)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    engine = kiln.build(_cnn(), precision=dtype, quantization="emulate", calibration=_batches(8), calibrator="minmax")
    assert engine.plan.header["quantization"]["ranges"] == record["ranges"]
    step = record["ranges"]["f"] / (127 if dtype == "int8" else 448)  # the fc layer's input, one step
    for feeds in _batches(4, seed=7):
        got = engine.run(feeds)["y"]
        want = session.run(None, feeds)[0]
        # the fc input is one quantization step wide; an output moves by its weights' row sums at most
        np.testing.assert_allclose(got, want, atol=step * float(np.abs(numpy_helper.to_array(
            onnx.load_from_string(_cnn()).graph.initializer[2])).sum(1).max()) + 1e-4)


def _gelu_mlp(seed: int = 0) -> bytes:
    """x @ w1 -> Gelu -> @ w2 (a transformer's FFN): the second MatMul reads Gelu's output, >= -0.17."""
    rng = np.random.default_rng(seed)
    w1 = numpy_helper.from_array(rng.standard_normal((16, 64)).astype(np.float32) * 0.5, "w1")
    w2 = numpy_helper.from_array(rng.standard_normal((64, 8)).astype(np.float32) * 0.2, "w2")
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="up"),
             helper.make_node("Gelu", ["h"], ["g"], name="gelu"),
             helper.make_node("MatMul", ["g", "w2"], ["y"], name="down")]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])], [w1, w2])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]).SerializeToString()


def test_a_gelu_output_is_uint8_with_a_zero_point_and_computes_what_onnxruntime_computes(tmp_path, monkeypatch):
    """int8: an activation whose negative side is shorter than its positive one (Gelu's, >= -0.17) is
    quantized to uint8 over [min, amax] with a zero point (onnxruntime's QDQ activations), not int8 over
    [-amax, amax]: the zero point is round(-min / s), kiln's engine equals onnxruntime running the same Q/DQ
    graph within a step, and the error to fp32 is smaller than with the symmetric int8 grid."""
    from kiln.builder.calibration import quantize
    from kiln.builder.config import BuildConfig

    rng = np.random.default_rng(5)
    calibration = [{"x": rng.standard_normal((4, 16), dtype=np.float32) * 2} for _ in range(8)]
    config = BuildConfig(precision="int8", quantization="emulate", calibration=calibration, calibrator="minmax")
    model, record = quantize(onnx_frontend.load(_gelu_mlp()), config, lambda _msg: None)
    q = next(n for n in model.graph if n.op_type == "QuantizeLinear" and n.inputs[0].name == "g")
    scale, zero = q.inputs[1].const_value.numpy(), q.inputs[2].const_value.numpy()
    low = record["lows"]["g"]
    assert -0.2 < low < 0 and zero.dtype == np.uint8
    assert int(zero) == round(-low / float(scale)) and float(scale) == pytest.approx((record["ranges"]["g"] - low) / 255)
    path = tmp_path / "q.onnx"
    onnx.save(ir.to_proto(model), path)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    engine = kiln.build(_gelu_mlp(), precision="int8", quantization="emulate", calibration=calibration,
                        calibrator="minmax")
    # the error to fp32 with only the down projection quantized, its input on each grid
    down = {"precision": "int8", "quantization": "emulate", "calibration": calibration, "calibrator": "minmax",
            "layer_precision": {"up": "fp32"}}
    asymmetric = kiln.build(_gelu_mlp(), **down)
    monkeypatch.setattr(qdq, "ASYMMETRIC", -1.0)  # never: int8 over [-amax, amax] as before
    symmetric = kiln.build(_gelu_mlp(), **down)
    fp32 = kiln.build(_gelu_mlp())
    w2 = numpy_helper.to_array(onnx.load_from_string(_gelu_mlp()).graph.initializer[1])
    errors, symmetric_errors = [], []
    for feeds in [{"x": rng.standard_normal((4, 16), dtype=np.float32) * 2} for _ in range(4)]:
        got, want, exact = engine.run(feeds)["y"], session.run(None, feeds)[0], fp32.run(feeds)["y"]
        np.testing.assert_allclose(got, want, atol=float(scale) * np.abs(w2).sum(0).max() + 1e-4)
        errors.append(np.abs(asymmetric.run(feeds)["y"] - exact).mean())
        symmetric_errors.append(np.abs(symmetric.run(feeds)["y"] - exact).mean())
    assert np.mean(errors) < 0.8 * np.mean(symmetric_errors)  # measured 0.70 (weights are rounded in both)


# ---- the build path ------------------------------------------------------------------------------

def test_auto_on_the_cpu_quantizes_for_its_kernels_and_says_per_layer_what_ran():
    engine = kiln.build(_cnn(), precision="int8", calibration=_batches(6), calibrator="minmax")
    q = engine.plan.header["quantization"]
    assert q["mode"] == "kernels" and q["quantized"] == ["conv1", "conv2", "fc"]
    assert {s.op_type for s in engine.plan.program.steps} >= {"QConv", "QGemm"}
    assert set(q["layers"]) == {"conv1", "conv2", "fc"}
    for layer in q["layers"].values():  # the autotuner's choice: int8 where its kernel was faster
        assert layer["precision"] in ("int8", "fp32") and layer["why"]
    # the same arithmetic as quantization="emulate" up to one step of requantization per layer
    emulated = kiln.build(_cnn(), precision="int8", quantization="emulate", calibration=_batches(6),
                          calibrator="minmax")
    fp32 = kiln.build(_cnn())
    for feeds in _batches(3, seed=7):
        got, want, exact = engine.run(feeds)["y"], emulated.run(feeds)["y"], fp32.run(feeds)["y"]
        assert np.abs(got - exact).max() < 0.1 * np.abs(exact).max()
        assert np.abs(got - want).max() < 0.05 * np.abs(exact).max()  # u8 after ReLU, 7-bit weights: not identical
    with pytest.raises(KilnError, match="calibration data is needed"):
        kiln.build(_cnn(), precision="int8")


def test_the_calibration_cache_lets_a_rebuild_skip_the_data(tmp_path):
    cache = tmp_path / "calib.json"
    first = kiln.build(_cnn(), precision="int8", quantization="emulate", calibration=_batches(6),
                       calibration_cache=str(cache))
    doc = json.loads(cache.read_text())
    assert doc["calibrator"] == "entropy" and doc["dtype"] == "int8" and doc["batches"] == 6
    assert set(doc["low"]) == set(doc["ranges"])  # int8: each input's smallest value (its zero point) kept too
    again = kiln.build(_cnn(), precision="int8", quantization="emulate", calibration_cache=str(cache))
    assert again.plan.header["quantization"]["calibration"]["from_cache"]
    feeds = _batches(1, seed=3)[0]
    np.testing.assert_array_equal(first.run(feeds)["y"], again.run(feeds)["y"])
    # another calibrator's cache is not used: the data is needed again
    with pytest.raises(KilnError, match="calibration data is needed"):
        kiln.build(_cnn(), precision="int8", quantization="emulate", calibrator="minmax",
                   calibration_cache=str(cache))


def test_calibration_from_a_folder_of_npz(tmp_path):
    for k, batch in enumerate(_batches(3)):
        np.savez(tmp_path / f"batch{k}.npz", **batch)
    engine = kiln.build(_cnn(), precision="int8", quantization="emulate", calibration=str(tmp_path))
    assert engine.plan.header["quantization"]["calibration"]["batches"] == 3


@pytest.mark.parametrize("options, message", [
    ({"quantization": "emulate"}, "precision int8: calibration data is needed"),
    ({"quantization": "emulate", "calibration": "/nonexistent/folder"}, "no such folder"),
    ({"quantization": "emulate", "calibration": [{"input": np.zeros(3)}]}, r"lacks input\(s\) \['x'\]"),
    ({"quantization": "sometimes"}, "quantization 'sometimes': 'auto' or 'emulate'"),
])
def test_calibration_errors_are_clear(options, message):
    with pytest.raises(KilnError, match=message):
        kiln.build(_cnn(), precision="int8", **options)


def _cli_inputs(tmp_path):
    """The small CNN as an .onnx file and a folder of three .npy calibration batches: (model, folder)."""
    data = tmp_path / "calib"
    data.mkdir()
    for k, batch in enumerate(_batches(3)):
        np.save(data / f"b{k}.npy", batch["x"])
    model = tmp_path / "cnn.onnx"
    model.write_bytes(_cnn())
    return model, data


def test_cli_builds_an_emulated_int8_engine_from_a_folder(tmp_path, capsys):
    model, data = _cli_inputs(tmp_path)
    out = tmp_path / "cnn.kiln"
    assert main(["build", str(model), "-o", str(out), "--int8", "--calib", str(data), "--quantization", "emulate",
                 "--calibrator", "minmax"]) == 0
    text = capsys.readouterr().out
    assert "int8 (emulated): 3 layer(s) quantized, 0 kept float; ranges by minmax from 3 batch(es)" in text


def test_cli_builds_to_a_top1_target(tmp_path, capsys):
    """--accuracy-metric top1 reaches the build and its summary (this net's top-1 margins are wide against its
    int8 noise: every layer stays int8 even at a target of 1; tests/unit/test_quant_sensitivity.py has a net
    where they do not)."""
    model, data = _cli_inputs(tmp_path)
    assert main(["build", str(model), "-o", str(tmp_path / "cnn.kiln"), "--int8", "--calib", str(data),
                 "--quantization", "emulate", "--calibrator", "minmax", "--accuracy-metric", "top1",
                 "--accuracy-target", "1"]) == 0
    text = capsys.readouterr().out
    assert "3 layer(s) quantized, 0 kept float" in text
    assert "expected top-1 agreement 1.0000 (target 1; every layer quantized: 1.0000)" in text


def test_compare_per_layer_names_the_layers_an_int8_engine_loses_the_most_in(tmp_path, capsys):
    data = tmp_path / "calib"
    data.mkdir()
    for k, batch in enumerate(_batches(4)):
        np.savez(data / f"b{k}.npz", **batch)
    model = tmp_path / "cnn.onnx"
    model.write_bytes(_cnn())
    main(["compare", str(model), "--precision", "int8", "--calib", str(data), "--per-layer"])
    text = capsys.readouterr().out
    assert "kiln (int8) vs onnxruntime fp32" in text
    assert "layers by max |err| / max |ref|" in text
    ranked = text.split("layers by max |err| / max |ref|:")[1]
    assert "conv" in ranked  # quantized layers are named with their error
