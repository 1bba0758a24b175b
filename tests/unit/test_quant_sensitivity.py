"""Mixed precision's sensitivity measures (kiln/builder/sensitivity.py): kiln's one switched program against
onnxruntime running a Q/DQ graph with that layer alone quantized (built separately, the others pinned float),
the smooth top-1 estimate against a Monte Carlo count, and a top-1 target met by the fewest layers float."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from onnx import helper
from scipy.special import log_softmax

from kiln.builder.calibration import measure_ranges, quantize
from kiln.builder.config import BuildConfig
from kiln.builder.sensitivity import SwitchedModel, choose_float_layers, expected_top1
from kiln.passes import PassOptions, optimize

LAYERS = ("stem", "mid", "head", "classifier")


def _classifier(rng: np.random.Generator) -> onnx.ModelProto:
    """stem 3x3 3->8 + Relu, whose channel 0 is 40x the others (an outlier channel) -> mid 3x3 8->8 + Relu, which
    barely reads channel 0 (its per-tensor int8 input scale, set by channel 0, is too coarse for what it does read:
    the sensitive layer) -> head 1x1 8->8 + Relu -> global pool -> classifier 8->10."""
    w1 = rng.normal(size=(8, 3, 3, 3)).astype(np.float32) * 0.3
    w1[0] *= 40
    w2 = rng.normal(size=(8, 8, 3, 3)).astype(np.float32) * 0.3
    w2[:, 0] /= 40
    arrays = {"w1": w1, "b1": np.abs(rng.normal(size=8)).astype(np.float32), "w2": w2,
              "b2": rng.normal(size=8).astype(np.float32) * 0.1,
              "w3": rng.normal(size=(8, 8, 1, 1)).astype(np.float32) * 0.5,
              "wc": rng.normal(size=(10, 8)).astype(np.float32), "bc": rng.normal(size=10).astype(np.float32) * 0.1}
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="stem", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], name="mid", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
             helper.make_node("Conv", ["r2", "w3"], ["c3"], name="head"),
             helper.make_node("Relu", ["c3"], ["r3"], name="relu3"),
             helper.make_node("GlobalAveragePool", ["r3"], ["g"], name="pool"),
             helper.make_node("Flatten", ["g"], ["f"], name="flatten"),
             helper.make_node("Gemm", ["f", "wc", "bc"], ["y"], name="classifier", transB=1)]
    graph = helper.make_graph(nodes, "classifier", [helper.make_tensor_value_info("x", 1, [1, 3, 10, 10])],
                              [helper.make_tensor_value_info("y", 1, [1, 10])],
                              [onnx.numpy_helper.from_array(a, n) for n, a in arrays.items()])
    return onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


@pytest.fixture(scope="module")
def net():
    rng = np.random.default_rng(21)
    proto = _classifier(rng)
    batches = [{"x": rng.normal(size=(1, 3, 10, 10)).astype(np.float32)} for _ in range(8)]
    return proto, batches


def _ort(proto: onnx.ModelProto, batches) -> np.ndarray:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # the Q/DQ as written
    session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return np.concatenate([session.run(None, b)[0] for b in batches])


def _kl(got: np.ndarray, want: np.ndarray) -> float:
    p, q = log_softmax(want.astype(np.float64), -1), log_softmax(got.astype(np.float64), -1)
    return float((np.exp(p) * (p - q)).sum(-1).mean())


def test_each_layers_softmax_kl_is_onnxruntimes_with_that_layer_alone_quantized(net):
    proto, batches = net
    config = BuildConfig(precision="int8", quantization="emulate", calibration=batches, calibrator="minmax",
                         accuracy_target=1.0, accuracy_metric="top1")  # unreachable: every layer is measured
    _, info = quantize(ir.from_proto(proto), config, lambda _m: None)
    sensitivity = info["accuracy"]["sensitivity"]
    assert set(sensitivity) == set(LAYERS)
    fp32 = _ort(proto, batches)
    oracle = {}
    for layer in LAYERS:
        alone = BuildConfig(precision="int8", quantization="emulate", calibration=batches, calibrator="minmax",
                            layer_precision={n: "fp32" for n in LAYERS if n != layer})
        model, _ = quantize(ir.from_proto(proto), alone, lambda _m: None)
        oracle[layer] = _kl(_ort(ir.to_proto(model), batches), fp32)
    # one layer's Q/DQ in float32 (onnxruntime) or as kiln runs it: a near-tie may round a step apart
    for layer in LAYERS:
        assert sensitivity[layer] == pytest.approx(oracle[layer], rel=0.02, abs=1e-7), (layer, sensitivity, oracle)
    assert max(oracle, key=oracle.get) == max(sensitivity, key=sensitivity.get) == "mid", oracle


def _switched(net):
    """The net unfused, its int8 minmax ranges (unsigned activations, per-channel means and lows) and its
    SwitchedModel: (model, batches, ranges, means, lows, switched)."""
    proto, batches = net
    model = optimize(ir.from_proto(proto), PassOptions(fusions=False))
    means, lows = {}, {}
    ranges, _ = measure_ranges(model, batches, "minmax", "int8", exclude=set(), cache_path=None,
                               preprocessing="imagenet", say=lambda _m: None, unsigned=True, channel_means=means,
                               lows=lows)
    switched = SwitchedModel(model, ranges, "int8", set(), batches, unsigned=True, channel_means=means, lows=lows)
    return model, batches, ranges, means, lows, switched


def test_a_switched_off_layer_is_the_float_layer_bias_correction_included(net):
    *_, switched = _switched(net)
    assert sorted(switched.layers) == sorted(LAYERS)
    assert all(s.float_bias is not None for s in switched.switches.values())  # corrected: each has a bias now
    for got, want in zip(switched.outputs(set()), switched.reference):
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)  # every layer off: the float model exactly
    quantized = switched.outputs(set(LAYERS))
    assert any(not torch.equal(g[0], w[0]) for g, w in zip(quantized, switched.reference))


def test_expected_top1_is_the_monte_carlo_share_under_gaussian_noise():
    rng = np.random.default_rng(5)
    rows, classes, sigma = 200, 50, 0.3
    want = rng.normal(size=(rows, classes)) * 0.2
    want[:, 0] += 3.0  # top-1 class 0; runner-up class 1 at a margin of 0..1, the rest far below
    want[:, 1] = want[:, 0] - rng.uniform(0, 1, rows)
    draws = 400
    noise = rng.normal(size=(draws, rows, classes)) * sigma
    monte_carlo = float(((want + noise).argmax(-1) == 0).mean())
    # d = got - want: one draw per row; its spread over the classes estimates sigma
    got = want + noise[0]
    estimate = expected_top1([[torch.from_numpy(got)]], [[torch.from_numpy(want)]])
    assert estimate == pytest.approx(monte_carlo, abs=0.03), (estimate, monte_carlo)
    assert expected_top1([[torch.from_numpy(want)]], [[torch.from_numpy(want)]]) == 1.0  # no error: every top-1


def test_a_top1_target_keeps_the_fewest_of_the_most_sensitive_layers_float(net):
    model, batches, ranges, means, lows, switched = _switched(net)
    all_on = expected_top1(switched.outputs(set(LAYERS)), switched.reference)
    target = (1.0 + all_on) / 2  # between every layer quantized and every layer float
    kept, record = choose_float_layers(model, ranges, "int8", batches, target, set(), lambda _m: None,
                                       metric="top1", unsigned=True, channel_means=means, lows=lows)
    order = list(record["sensitivity"])  # most sensitive first
    assert record["met"] and record["top1"] >= target
    assert kept == set(order[:len(kept)]) and "mid" in kept
    assert record["measured"][str(len(kept) - 1)] < target  # one layer fewer does not reach it
    assert expected_top1(switched.outputs(set(LAYERS) - kept), switched.reference) == pytest.approx(record["top1"])


def test_top1_on_an_output_without_classes_says_so():
    from kiln.errors import KilnError

    one = [[torch.zeros(1, 1)]]
    with pytest.raises(KilnError, match=r"class scores on its last axis; it is \[1, 1\]"):
        expected_top1(one, one)
