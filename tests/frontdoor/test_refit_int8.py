"""Refit of int8/fp8 engines quantized by kiln's calibration (precision="int8"), as TensorRT refits them:
the per-channel weight scales, int8 weights and int32 biases are derived from the new weights as the
builder's quantization derives them, the calibrated activation ranges stay; so a refit engine equals a
fresh build with the new weights that reads the same ranges from the calibration cache, bit for bit when
both run the same tactics. With recalibration it equals a fresh build calibrated on that data."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import safetensors.numpy
import torch
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.builder.refit import RefitError
from kiln.cli import main as cli_main


def _conv_weights(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "conv1.weight": rng.standard_normal((8, 3, 3, 3)).astype(np.float32) * 0.3,
        "conv1.bias": rng.standard_normal(8).astype(np.float32) * 0.1,
        "conv2.weight": rng.standard_normal((8, 8, 3, 3)).astype(np.float32) * 0.2,
        "conv2.bias": rng.standard_normal(8).astype(np.float32) * 0.1,
        "fc.weight": rng.standard_normal((5, 8)).astype(np.float32) * 0.3,  # Gemm transB=1
        "fc.bias": rng.standard_normal(5).astype(np.float32) * 0.1,
    }


def _conv_net(weights: dict[str, np.ndarray]) -> onnx.ModelProto:
    """Conv -> Relu -> Conv -> Relu -> GlobalAveragePool -> Flatten -> Gemm(transB=1)."""
    nodes = [
        helper.make_node("Conv", ["x", "conv1.weight", "conv1.bias"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "conv2.weight", "conv2.bias"], ["c2"], pads=[1, 1, 1, 1], name="conv2"),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("GlobalAveragePool", ["r2"], ["p"], name="pool"),
        helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "fc.weight", "fc.bias"], ["y"], transB=1, name="fc"),
    ]
    graph = helper.make_graph(nodes, "conv_net", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 5])],
                              initializer=[numpy_helper.from_array(v, k) for k, v in weights.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _block_weights(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "ln.weight": rng.uniform(0.5, 1.5, 32).astype(np.float32),
        "ln.bias": rng.standard_normal(32).astype(np.float32) * 0.1,
        "fc1.weight": rng.standard_normal((32, 64)).astype(np.float32) * 0.2,  # MatMul's [K, N]
        "fc1.bias": rng.standard_normal(64).astype(np.float32) * 0.1,
        "fc2.weight": rng.standard_normal((64, 32)).astype(np.float32) * 0.2,
        "fc2.bias": rng.standard_normal(32).astype(np.float32) * 0.1,
    }


def _mlp_block(weights: dict[str, np.ndarray]) -> onnx.ModelProto:
    """A transformer's MLP block: x + fc2(relu(fc1(LayerNorm(x)))), as exporters write it (MatMul, Add)."""
    nodes = [
        helper.make_node("LayerNormalization", ["x", "ln.weight", "ln.bias"], ["h"], axis=-1, epsilon=1e-5, name="ln"),
        helper.make_node("MatMul", ["h", "fc1.weight"], ["m1"], name="fc1"),
        helper.make_node("Add", ["m1", "fc1.bias"], ["a1"], name="fc1_bias"),
        helper.make_node("Relu", ["a1"], ["r"], name="relu"),
        helper.make_node("MatMul", ["r", "fc2.weight"], ["m2"], name="fc2"),
        helper.make_node("Add", ["m2", "fc2.bias"], ["a2"], name="fc2_bias"),
        helper.make_node("Add", ["x", "a2"], ["y"], name="residual"),
    ]
    graph = helper.make_graph(nodes, "mlp_block",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16, 32])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 16, 32])],
                              initializer=[numpy_helper.from_array(v, k) for k, v in weights.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


NETS = {
    "conv": (_conv_net, _conv_weights, (3, 8, 8), "1x3x8x8,2x3x8x8,4x3x8x8"),
    "block": (_mlp_block, _block_weights, (16, 32), "1x16x32,2x16x32,4x16x32"),
}


def _batches(net: str, seed: int, count: int) -> list[dict[str, np.ndarray]]:
    shape = NETS[net][2]
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((2, *shape)).astype(np.float32)} for _ in range(count)]


def _save(tmp_path, net: str) -> dict[int, str]:
    make, weights = NETS[net][:2]
    paths = {}
    for seed in (0, 1):
        paths[seed] = str(tmp_path / f"{net}{seed}.onnx")
        onnx.save(make(weights(seed)), paths[seed])
    return paths


def _build(path, tmp_path, net, quantization, **options):
    # one timing cache for every build of a test: the later builds meet the first one's timings and choose
    # the same tactics
    return kiln.build(path, precision="int8", quantization=quantization, calibrator="minmax",
                      timing_cache=str(tmp_path / "timing.json"), profiles=[{"x": NETS[net][3]}], **options)


def _tactics(engine) -> list:
    return [step.tactic for step in engine.plan.program.steps]


def _same_as_fresh(engine, fresh, net: str) -> None:
    same_tactics = _tactics(engine) == _tactics(fresh)
    for batch in _batches(net, 7, 2):
        got, want = engine.run(batch)["y"], fresh.run(batch)["y"]
        if same_tactics:
            np.testing.assert_array_equal(got, want)  # the same derived int8 weights, scales and int32 biases
        else:  # the accuracy check reverted a layer to its float tactic in one build: one quantization step
            np.testing.assert_allclose(got, want, rtol=0, atol=0.05 * np.abs(want).max())


@pytest.mark.parametrize("quantization", ["auto", "emulate"])
@pytest.mark.parametrize("net", ["conv", "block"])
def test_refit_keeps_the_calibrated_ranges_and_equals_a_fresh_build(tmp_path, net, quantization):
    paths = _save(tmp_path, net)
    cache = str(tmp_path / "ranges.json")
    engine = _build(paths[0], tmp_path, net, quantization, calibration=_batches(net, 0, 3), calibration_cache=cache)
    ranges = dict(engine.plan.header["quantization"]["ranges"])
    means = dict(engine.plan.header["quantization"]["channel_means"])
    if net == "conv":  # bias correction (on by default) formed from the inputs' channel means: refit forms it again
        assert engine.plan.header["quantization"]["bias_correction"] and set(means) == set(ranges)
    before = engine.run(_batches(net, 7, 1)[0])["y"]
    # the fresh build reads the first build's ranges from the calibration cache: no calibration data given
    fresh = _build(paths[1], tmp_path, net, quantization, calibration_cache=cache)
    assert fresh.plan.header["quantization"]["calibration"]["from_cache"]
    new = NETS[net][1](1)
    if net == "conv":
        safetensors.numpy.save_file(new, tmp_path / "new.safetensors")
        report = engine.refit(str(tmp_path / "new.safetensors"))
    else:  # a state_dict of torch tensors
        report = engine.refit({k: torch.from_numpy(v) for k, v in new.items()})
    assert report.activation_scales.startswith(f"kept: the {len(ranges)} activation range(s) calibrated")
    layers = {"conv": ["conv1", "conv2", "fc"], "block": ["fc1", "fc2"]}[net]
    assert report.requantized == layers
    assert engine.plan.header["quantization"]["ranges"] == ranges
    assert engine.plan.header["quantization"]["channel_means"] == means
    if quantization == "auto":  # kiln::QConv/QGemm: int8 weights, their scales and int32 biases changed
        assert {"QConv" if net == "conv" else "QGemm"} <= {s.op_type for s in engine.plan.program.steps}
        changed = set(report.changed)
        assert all(any(k.startswith(f"{layer}_bias_q") for k in changed) for layer in layers)
        assert all(any(k.startswith(f"{layer}_weight_scale") for k in changed) for layer in layers)
        assert not any(k.endswith("_qscale") for k in changed)  # activation scales kept
    _same_as_fresh(engine, fresh, net)
    assert not np.array_equal(before, engine.run(_batches(net, 7, 1)[0])["y"])


@pytest.mark.parametrize("net", ["conv", "block"])
def test_recalibrated_refit_equals_a_fresh_build_with_that_data(tmp_path, net):
    paths = _save(tmp_path, net)
    engine = _build(paths[0], tmp_path, net, "auto", calibration=_batches(net, 0, 3))
    old_ranges = dict(engine.plan.header["quantization"]["ranges"])
    data = _batches(net, 11, 4)
    report = engine.refit(paths[1], recalibrate=data)
    assert report.activation_scales.startswith("recalibrated on the new weights:")
    fresh = _build(paths[1], tmp_path, net, "auto", calibration=data)
    new_ranges = fresh.plan.header["quantization"]["ranges"]
    assert engine.plan.header["quantization"]["ranges"] == new_ranges != old_ranges
    assert any(k.endswith("_qscale") for k in report.changed)  # the activation scales moved too
    _same_as_fresh(engine, fresh, net)


@pytest.mark.parametrize("weight_only", [False, True])
def test_the_layers_an_accuracy_target_kept_float_stay_float(tmp_path, weight_only):
    """Without recalibration the float (or weight-only) layers are the build's (the new weights' sensitivity is not
    measured: that needs calibration data), so the refit equals a fresh build with those layers pinned so."""
    paths = _save(tmp_path, "conv")
    cache = str(tmp_path / "ranges.json")
    engine = _build(paths[0], tmp_path, "conv", "emulate", calibration=_batches("conv", 0, 3), calibration_cache=cache,
                    accuracy_target=0.002, accuracy_weight_only=weight_only)
    quantization = engine.plan.header["quantization"]
    kept = quantization["weight_only"] if weight_only else quantization["accuracy"]["kept_float"]
    assert kept  # the target keeps some layers float (weight-only) on this net
    report = engine.refit(paths[1])
    # (a weight-only layer's weights are rounded again too, but it is not a quantized layer)
    assert report.requantized == [n for n in ("conv1", "conv2", "fc") if n not in kept]
    fresh = _build(paths[1], tmp_path, "conv", "emulate", calibration_cache=cache,
                   layer_precision={name: ("w8a16" if name in quantization.get("w8a16", ()) else "weight_only")
                                    if weight_only else "fp32" for name in kept})  # as the build: 16-bit inputs
    _same_as_fresh(engine, fresh, "conv")


def test_a_smoothquant_engine_refits_with_recalibration(tmp_path):
    """SmoothQuant's factors (1/s into the LayerNorm, s into fc1's rows) are formed from the new weights and
    the new data's channel maxima, as a fresh build with that data forms them."""
    paths = _save(tmp_path, "block")
    engine = _build(paths[0], tmp_path, "block", "auto", calibration=_batches("block", 0, 3), smoothquant=0.5)
    assert "fc1" in engine.plan.header["quantization"]["smoothquant"]["smoothed"]
    data = _batches("block", 11, 4)
    engine.refit(paths[1], recalibrate=data)
    fresh = _build(paths[1], tmp_path, "block", "auto", calibration=data, smoothquant=0.5)
    assert engine.plan.header["quantization"]["ranges"] == fresh.plan.header["quantization"]["ranges"]
    _same_as_fresh(engine, fresh, "block")


def test_cli_refit_of_an_int8_engine(tmp_path, capsys):
    paths = _save(tmp_path, "conv")
    cache = str(tmp_path / "ranges.json")
    _build(paths[0], tmp_path, "conv", "auto", calibration=_batches("conv", 0, 3),
           calibration_cache=cache).save(tmp_path / "net.kiln")
    safetensors.numpy.save_file(_conv_weights(1), tmp_path / "new.safetensors")
    assert cli_main(["refit", str(tmp_path / "net.kiln"), "--weights", str(tmp_path / "new.safetensors"),
                     "-o", str(tmp_path / "kept.kiln")]) == 0
    assert "activation scales: kept: the 3 activation range(s) calibrated at build" in capsys.readouterr().out
    _same_as_fresh(kiln.load(tmp_path / "kept.kiln"), _build(paths[1], tmp_path, "conv", "auto",
                                                              calibration_cache=cache), "conv")
    calib = tmp_path / "calib"
    calib.mkdir()
    data = _batches("conv", 11, 3)
    for k, batch in enumerate(data):
        np.save(calib / f"{k}.npy", batch["x"])
    assert cli_main(["refit", str(tmp_path / "net.kiln"), "--weights", str(tmp_path / "new.safetensors"),
                     "--calib", str(calib), "-o", str(tmp_path / "recalibrated.kiln")]) == 0
    assert "activation scales: recalibrated on the new weights: 3 activation range(s) measured on 3 batch(es)" \
        in capsys.readouterr().out
    _same_as_fresh(kiln.load(tmp_path / "recalibrated.kiln"),
                   _build(paths[1], tmp_path, "conv", "auto", calibration=data), "conv")


def test_wrong_names_shapes_and_dtypes_are_all_listed(tmp_path):
    paths = _save(tmp_path, "block")
    engine = _build(paths[0], tmp_path, "block", "auto", calibration=_batches("block", 0, 2))
    before = engine.run(_batches("block", 7, 1)[0])["y"]
    bad = {"fc1.weights": np.zeros((32, 64), np.float32),  # a name the model lacks
           "fc1.weight": np.zeros((64, 32), np.float32),  # transposed
           "fc2.bias": np.zeros(32, np.float64),  # double
           "ln.weight": "ones"}  # not a tensor
    with pytest.raises(RefitError) as refused:
        engine.refit(bad)
    message = str(refused.value)
    assert "no initializer named ['fc1.weights']" in message
    assert "'fc1.weight': the model holds float [32, 64], given float [64, 32]" in message
    assert "'fc2.bias': the model holds float [32], given double [32]" in message
    assert "weight 'ln.weight': a str, not a tensor" in message
    np.testing.assert_array_equal(engine.run(_batches("block", 7, 1)[0])["y"], before)  # untouched


def test_what_cannot_be_derived_is_refused(tmp_path):
    paths = _save(tmp_path, "conv")
    engine = _build(paths[0], tmp_path, "conv", "auto", calibration=_batches("conv", 0, 2))
    quantization = engine.plan.header["quantization"]
    # an engine that does not record its calibrated ranges (an older kiln's)
    ranges = quantization.pop("ranges")
    with pytest.raises(RefitError, match="does not record the activation ranges.*recalibrate=DATA"):
        engine.refit(paths[1])
    quantization["ranges"] = ranges
    # bias correction without the channel means it was formed from (an engine of an older kiln)
    means = quantization.pop("channel_means")
    with pytest.raises(RefitError, match="bias correction but does not record.*recalibrate=DATA"):
        engine.refit(paths[1])
    quantization["channel_means"] = means
    # built for another CPU's int8 kernels: 7-bit weights without VNNI, 8-bit with
    width = quantization["weights"]
    quantization["weights"] = "8-bit per channel" if width.startswith("7-bit") else "7-bit per channel (no VNNI)"
    with pytest.raises(RefitError, match="refit on a CPU like the one that built it"):
        engine.refit(paths[1])
    quantization["weights"] = width
    # SmoothQuant: its factors come from per-channel activation maxima the engine does not keep
    engine.plan.header["build_config"]["smoothquant"] = 0.5
    with pytest.raises(RefitError, match="SmoothQuant.*recalibrate=DATA"):
        engine.refit(paths[1])
    engine.plan.header["build_config"]["smoothquant"] = None
    # a float engine has nothing to recalibrate
    fp32 = kiln.build(paths[0])
    with pytest.raises(RefitError, match="the engine is fp32, nothing in it was calibrated"):
        fp32.refit(paths[1], recalibrate=_batches("conv", 0, 1))


def _qdq_layer(seed: int) -> onnx.ModelProto:
    """Explicit Q/DQ (onnxruntime's quantizer's format) followed by a float MatMul kiln's calibration quantizes."""
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array(rng.integers(-127, 128, (16, 8)).astype(np.int8), "w_q"),
             numpy_helper.from_array(rng.uniform(0.005, 0.02, 8).astype(np.float32), "w_scale"),
             numpy_helper.from_array(np.zeros(8, np.int8), "w_zero"),
             numpy_helper.from_array(np.array(rng.uniform(0.02, 0.05), np.float32), "x_scale"),
             numpy_helper.from_array(np.array(0, np.int8), "x_zero"),
             numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "bias"),
             numpy_helper.from_array(rng.standard_normal((8, 4)).astype(np.float32) * 0.3, "head")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "x_scale", "x_zero"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "x_scale", "x_zero"], ["xd"]),
             helper.make_node("DequantizeLinear", ["w_q", "w_scale", "w_zero"], ["wd"], axis=1),
             helper.make_node("MatMul", ["xd", "wd"], ["mm"], name="qdq_layer"),
             helper.make_node("Add", ["mm", "bias"], ["h"]),
             helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "head"], ["y"], name="head_layer")]
    graph = helper.make_graph(nodes, "qdq", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 4])], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])


def test_explicit_qdq_initializers_are_replaced_as_given_in_an_int8_build(tmp_path):
    """The explicit layer's int8 weights and scales come as given; the float layer kiln quantized is
    quantized again from its new weight with the calibrated range."""
    for seed in (0, 1):
        onnx.save(_qdq_layer(seed), tmp_path / f"qdq{seed}.onnx")
    data = [{"x": np.random.default_rng(k).standard_normal((4, 16)).astype(np.float32)} for k in range(2)]
    cache = str(tmp_path / "ranges.json")
    options = dict(precision="int8", calibrator="minmax", timing_cache=str(tmp_path / "timing.json"),
                   calibration_cache=cache)
    engine = kiln.build(str(tmp_path / "qdq0.onnx"), calibration=data, **options)
    assert engine.plan.header["quantization"]["quantized"] == ["head_layer"]
    report = engine.refit(str(tmp_path / "qdq1.onnx"))
    assert report.requantized == ["head_layer"]
    fresh = kiln.build(str(tmp_path / "qdq1.onnx"), **options)
    feed = {"x": np.random.default_rng(9).standard_normal((4, 16)).astype(np.float32)}
    if _tactics(engine) == _tactics(fresh):
        np.testing.assert_array_equal(engine.run(feed)["y"], fresh.run(feed)["y"])
    else:
        np.testing.assert_allclose(engine.run(feed)["y"], fresh.run(feed)["y"], rtol=1e-5, atol=1e-5)
