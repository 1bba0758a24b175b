"""Weight-only layers (kiln/quant/qdq.py weight_only; kiln/builder/sensitivity.py): the precision between int8 and
float that an accuracy target tries first. Such a layer's weight is int8 (per output channel, the nearest step
of max|W_c| / 127) and its input is read unrounded. Checked: its integers against numpy's rounding of the float
weight (so its weight within half a step of the float one), the Q/DQ graph run by kiln against onnxruntime, the
CPU engine (kiln's int8 kernels beside the fp32 kernel of the weight-only layer) against onnxruntime, and the search:
the fewest most sensitive layers weight-only that reach a top-1 target, float layers only when weight-only
cannot reach it."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch

import kiln
from kiln.builder.calibration import measure_ranges, quantize
from kiln.builder.config import BuildConfig
from kiln.builder.lower import lower
from kiln.builder.sensitivity import choose_float_layers, expected_top1, output_error
from kiln.cli.build import _quantization_rows
from kiln.kernels.cpu.cpu_features import has_int8_dot_product
from kiln.passes import PassOptions, optimize
from kiln.tactics.cpu import w8a16 as w8a16_tactics
from kiln.quant import qdq
from kiln.runtime.program import Program
from tests.unit.test_quant_sensitivity import LAYERS, _switched, net  # noqa: F401 - net: a fixture
from tests.unit.test_quant_sensitivity import _ort as _ort_of_proto


def _ort(model: ir.Model, batches) -> np.ndarray:
    return _ort_of_proto(ir.to_proto(model), batches)  # the Q/DQ as written


def _quantized(net, weight_only: set[str]) -> ir.Model:
    proto, batches = net
    model = optimize(ir.from_proto(proto), PassOptions(fusions=False))
    ranges, _ = measure_ranges(model, batches, "minmax", "int8", exclude=set(), cache_path=None,
                               preprocessing="imagenet", say=lambda _m: None, unsigned=True)
    original = {n.name: n.inputs[1].const_value.numpy().copy() for n in model.graph if n.name in LAYERS}
    skipped = qdq.insert(model, ranges, "int8", unsigned=True, weight_only=weight_only)
    assert skipped == {}
    model.meta["original_weights"] = original
    return model


def test_a_weight_only_layer_reads_its_float_input_and_rounds_its_weight_to_nearest(net):
    model = _quantized(net, {"mid"})
    nodes = {n.name: n for n in model.graph}
    for name in LAYERS:
        x_producer = nodes[name].inputs[0].producer()
        if name == "mid":  # relu1's output itself, and a float constant for a weight (packed once by float kernels)
            assert x_producer.op_type == "Relu" and nodes[name].inputs[1].producer() is None
            continue
        w_dq = nodes[name].inputs[1].producer()
        assert w_dq.op_type == "DequantizeLinear" and w_dq.inputs[0].const_value.dtype == ir.DataType.INT8
        assert x_producer.op_type == "DequantizeLinear", name
    # numpy's per-channel nearest rounding, dequantized in float32: mid's weight exactly, within half a step of
    # the float weight
    w = model.meta["original_weights"]["mid"]
    scale = (np.abs(w).max(axis=(1, 2, 3)) / np.float32(127)).astype(np.float32)[:, None, None, None]
    ints = np.clip(np.round(w / scale), -127, 127)
    got = nodes["mid"].inputs[1].const_value.numpy()
    np.testing.assert_array_equal(got, (ints.astype(np.float32) * scale).astype(np.float32))
    assert np.all(np.abs(got.astype(np.float64) - w) <= scale.astype(np.float64) / 2 * (1 + 1e-6))
    assert not np.array_equal(got, w)


def test_the_weight_only_graph_run_by_kiln_is_onnxruntimes(net):
    _, batches = net
    model = _quantized(net, {"mid"})
    want = _ort(model, batches)
    program, weights, inputs, _ = lower(model)
    run = Program(program, weights)
    with torch.inference_mode():
        got = np.concatenate([run.run([torch.from_numpy(b["x"])])[0].numpy() for b in batches])
    # float32 layers after int8 ones: an input near a rounding tie of the next Q may land a step apart
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
    # and not the all-int8 graph's: mid's input rounding is gone (the outlier channel's scale was its error)
    all_int8 = _ort(_quantized(net, set()), batches)
    assert np.abs(all_int8 - want).max() > 100 * np.abs(got - want).max()


def test_a_top1_target_makes_the_fewest_most_sensitive_layers_weight_only(net):
    model, batches, ranges, means, lows, switched = _switched(net)
    all_on = expected_top1(switched.outputs(set(LAYERS)), switched.reference)
    every = expected_top1(switched.outputs(set(), weight_only=set(LAYERS)), switched.reference)
    assert all_on < every < 1.0
    target = (all_on + every) / 2  # reachable weight-only: no float layer
    kept, record = choose_float_layers(model, ranges, "int8", batches, target, set(), lambda _m: None,
                                       metric="top1", unsigned=True, channel_means=means, lows=lows, weight_only=True)
    order = list(record["sensitivity"])
    moved = set(record["weight_only"])
    assert kept == set() and record["kept_float"] == {} and record["met"] and record["top1"] >= target
    assert moved == set(order[:len(moved)]) and "mid" in moved
    assert record["measured_weight_only"][str(len(moved) - 1)] < target  # one layer fewer does not reach it
    assert expected_top1(switched.outputs(set(LAYERS) - moved, weight_only=moved), switched.reference) \
        == pytest.approx(record["top1"])
    # beyond what every layer weight-only keeps: float layers, as without weight-only
    beyond = (every + 1.0) / 2
    kept, record = choose_float_layers(model, ranges, "int8", batches, beyond, set(), lambda _m: None,
                                       metric="top1", unsigned=True, channel_means=means, lows=lows, weight_only=True)
    assert record["weight_only"] == {} and kept and record["top1"] >= beyond
    assert record["top1_all_weight_only"] == pytest.approx(every, abs=1e-6)


def test_an_error_target_goes_weight_only_before_float(net):
    model, batches, ranges, means, lows, switched = _switched(net)
    every = output_error(switched.outputs(set(), weight_only=set(LAYERS)), switched.reference)
    all_on = output_error(switched.outputs(set(LAYERS)), switched.reference)
    assert every < all_on
    kept, record = choose_float_layers(model, ranges, "int8", batches, (every + all_on) / 2, set(), lambda _m: None,
                                       unsigned=True, channel_means=means, lows=lows, weight_only=True)
    assert kept == set() and record["met"] and "mid" in record["weight_only"]
    assert record["error"] <= (every + all_on) / 2


@pytest.mark.skipif(not has_int8_dot_product(), reason="a VNNI CPU's W8A16 (8-bit weights): without VNNI the engine's "
                    "weights are 7-bit and the split path is refused, so the emulated probe's target is not this "
                    "build's; that case is test_w8a16_avx2.py's (measured on a Zen 3: the search keeps mid float)")
def test_the_cpu_engine_runs_the_weight_only_layer_as_w8a16_and_says_why(net):
    proto, batches = net
    # the fewest layers (not the fewest ms: this net's layers take microseconds, their order would be noise), no margin
    config = dict(precision="int8", calibration=batches, calibrator="minmax", accuracy_metric="top1",
                  accuracy_margin=0.0, accuracy_by_cost=False)
    # the build's own measure of every layer int8 and every layer weight-only (a target of 1: both measured)
    _, probe = quantize(ir.from_proto(proto), BuildConfig(quantization="emulate", accuracy_target=1.0, **config),
                        lambda _m: None)
    all_on, every = probe["accuracy"]["top1_all_quantized"], probe["accuracy"]["top1_all_weight_only"]
    assert all_on < every < 1.0
    target = (all_on + every) / 2
    engine = kiln.build(ir.from_proto(proto), accuracy_target=target, **config)
    q = engine.plan.header["quantization"]
    assert "mid" in q["weight_only"] and "mid" not in q["quantized"] and not q["kept_float"]
    # on this CPU (VNNI) a weight-only convolution is W8A16: int8 weights, its input at 16 bits
    assert q["w8a16"] == ["mid"]
    shown = {name: layer for name, layer in q["layers"].items()
             if layer["precision"] == "w8a16 (int8 weights, 16-bit input)"}
    assert set(shown) == {"mid"} and shown["mid"]["tactic"] in w8a16_tactics.TACTICS
    assert all(layer["why"].startswith("accuracy target: input sensitivity") for layer in shown.values())
    # the engine (oneDNN int8 kernels, mid's two-byte int8 kernel) against onnxruntime on the same Q/DQ graph (the
    # emulation's: mid's input through a uint16 pair too)
    model, info = quantize(ir.from_proto(proto), BuildConfig(quantization="emulate", accuracy_target=target, **config),
                           lambda _m: None)
    assert info["weight_only"].keys() == q["weight_only"].keys() and info["w8a16"] == ["mid"]
    assert next(n for n in model.graph if n.name == "mid").inputs[0].producer().inputs[0].producer().inputs[2] \
        .const_value.dtype == ir.DataType.UINT16
    want = _ort(model, batches)
    context = engine.create_execution_context()
    got = np.concatenate([context.run({"x": b["x"]})["y"] for b in batches])
    # per batch (one image each), the median: a near-tie of an int8 requantization after mid, rounded the other way,
    # moves one image's logits by that step (measured: 7 of 8 images 3e-4 off, one 0.056, at the 4x 16-bit range)
    off = float(np.median(np.abs(got - want).max(axis=1)))
    float_mid = float(np.median(np.abs(_ort(_float_weight(model, "mid", proto), batches) - want).max(axis=1)))
    print(f"engine off onnxruntime by {off:.3g}, mid's float weight by {float_mid:.3g}, of {np.abs(want).max():.3g}")
    # a near-tie requantized a step apart in an int8 layer moves what follows by that step; mid's float weights
    # instead of its int8 ones are off by more
    assert off < 0.25 * float_mid


def _float_weight(model: ir.Model, layer: str, proto) -> ir.Model:
    """A copy of the Q/DQ model with `layer` reading its original float weight (from `proto`) instead of DQ(W_q)."""
    copy = ir.from_proto(ir.to_proto(model))
    node = next(n for n in copy.graph if n.name == layer)
    weight = next(n for n in proto.graph.node if n.name == layer).input[1]
    original = next(t for t in proto.graph.initializer if t.name == weight)
    value = ir.Value(name=f"{weight}_float", const_value=ir.tensor(onnx.numpy_helper.to_array(original),
                                                                    name=f"{weight}_float"))
    copy.graph.register_initializer(value)
    node.replace_input_with(1, value)
    return copy


def test_a_layer_pinned_weight_only_and_the_build_summary_say_so(net):
    proto, batches = net
    model, info = quantize(ir.from_proto(proto), BuildConfig(precision="int8", quantization="emulate",
                                                             calibration=batches, calibrator="minmax",
                                                             layer_precision={"mid": "weight_only", "head": "fp32"}),
                           lambda _m: None)
    assert info["weight_only"] == {"mid": "pinned"} and "head" in info["kept_float"]
    assert sorted(info["quantized"]) == ["classifier", "stem"]
    nodes = {n.name: n for n in model.graph}
    assert nodes["mid"].inputs[0].producer().op_type == "Relu" and nodes["mid"].inputs[1].producer() is None
    rows = _quantization_rows(info)
    assert "1 weight-only (int8 weights, float input)" in rows[0][1]
    assert ("  weight-only", "mid: pinned") in rows
