"""W8A16 as an engine precision (issue 12): a convolution's input quantized to 16 bits (uint16 / int16 Q/DQ, opset 21)
with int8 weights, run on the CPU as two int8 convolutions of the input's bytes (kiln/tactics/cpu/w8a16.py), and the
accuracy target's search choosing it by milliseconds (kiln/builder/sensitivity.py _cheapest_for_top1).

Checked against onnx.reference: the one-pass split's 16-bit values are QuantizeLinear's exactly (ties to even,
saturation), a built W8A16 layer's output is the Q/DQ graph's within onnx.reference's float32 summation (1e-4 of the
largest output; 8-bit outputs within one step), the graph's 16-bit QuantizeLinear is folded into the layer (no
16-bit tensor stored); the search's choice follows the layer costs it is given."""

from __future__ import annotations

import zlib

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import kiln
from kiln.builder import layer_cost
from kiln.builder.calibration import quantize
from kiln.builder.config import BuildConfig
from kiln.builder.sensitivity import choose_float_layers, expected_top1
from kiln.builder.timing_cache import TimingCache
from kiln.kernels.cpu import split16
from kiln.kernels.cpu.cpu_features import has_int8_dot_product
from kiln.passes import PassOptions, optimize
from kiln.tactics.cpu import w8a16 as w8a16_tactics
from tests.unit.oracle import case_rng
from tests.unit.test_quant_sensitivity import LAYERS, _switched, net  # noqa: F401 - net: a fixture

pytestmark = pytest.mark.skipif(layer_cost.available() is not None, reason=f"W8A16: {layer_cost.available()}")


def _quantize_linear(x: np.ndarray, s: np.float32, wide: str) -> np.ndarray:
    """onnx.reference's QuantizeLinear of x to `wide` (zero point 0), as int64."""
    model = helper.make_model(helper.make_graph(
        [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"])], "q",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
        [helper.make_tensor_value_info("q", TensorProto.UINT16 if wide == "uint16" else TensorProto.INT16, x.shape)],
        [numpy_helper.from_array(np.array(s, np.float32), "s"), numpy_helper.from_array(np.array(0, wide), "z")]),
        opset_imports=[helper.make_opsetid("", 21)])
    return ReferenceEvaluator(model).run(None, {"x": x})[0].astype(np.int64)


@pytest.mark.parametrize("wide", ["uint16", "int16"])
def test_the_split_is_quantize_linear_exactly(wide):
    rng = case_rng(f"split {wide}")
    scale = np.float32(0.0123)
    x = rng.normal(0, 300, (2, 5, 7, 9)).astype(np.float32)
    ties = (rng.integers(-40000, 70000, 64) + 0.5).astype(np.float32) * scale  # x / scale near k + 1/2
    x.reshape(-1)[:64] = ties
    x.reshape(-1)[64:70] = [1e6, -1e6, 0.0, -0.0, 65535.6 * scale, -32768.6 * scale]  # saturation both ways
    want = _quantize_linear(x, scale, wide)
    t = torch.from_numpy(x).contiguous(memory_format=torch.channels_last)  # bytes in x's memory order
    hi, lo = split16.split(t, float(scale), 0, torch.uint16 if wide == "uint16" else torch.int16)
    assert hi.stride() == t.stride() and hi.dtype == lo.dtype == torch.uint8
    got = 256 * hi.numpy().astype(np.int64) + lo.numpy().astype(np.int64) - (32768 if wide == "int16" else 0)
    np.testing.assert_array_equal(got, want)
    assert (got == np.iinfo(wide).max).any() and (wide == "uint16" or (got == np.iinfo(wide).min).any())


def _layer_model(shape, out, kernel, stride, pads, group, wide, activation, requantize, rng) -> onnx.ModelProto:
    """x -> Q(uint16/int16) -> DQ -> Conv(DQ(w int8 per channel), b) [-> Relu | Clip] [-> Q(uint8) -> DQ] -> y."""
    c = shape[1]
    w = rng.normal(0, 0.5, (out, c // group, kernel, kernel)).astype(np.float32)
    w_scale = (np.abs(w).max(axis=(1, 2, 3)) / 127).astype(np.float32)
    w_q = np.clip(np.round(w / w_scale[:, None, None, None]), -127, 127).astype(np.int8)
    amax = 6.0 if wide == "uint16" else 4.0
    s = np.float32(amax / (65535 if wide == "uint16" else 32767))
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["xd"]),
             helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["w"], axis=0),
             helper.make_node("Conv", ["xd", "w", "b"], ["c"], name="layer", strides=stride, pads=pads, group=group)]
    out_name = "c"
    if activation:
        nodes.append(helper.make_node(activation, ["c", "lo", "hi"] if activation == "Clip" else ["c"], ["a"]))
        out_name = "a"
    if requantize:
        nodes += [helper.make_node("QuantizeLinear", [out_name, "ys", "yz"], ["yq"]),
                  helper.make_node("DequantizeLinear", ["yq", "ys", "yz"], ["y"])]
    else:
        nodes.append(helper.make_node("Identity", [out_name], ["y"]))
    inits = [numpy_helper.from_array(np.array(s), "s"), numpy_helper.from_array(np.array(0, np.dtype(wide)), "z"),
             numpy_helper.from_array(w_q, "wq"), numpy_helper.from_array(w_scale, "ws"),
             numpy_helper.from_array(np.zeros(out, np.int8), "wz"),
             numpy_helper.from_array(rng.normal(0, 0.2, out).astype(np.float32), "b"),
             numpy_helper.from_array(np.array(0.0, np.float32), "lo"),
             numpy_helper.from_array(np.array(6.0, np.float32), "hi"),
             numpy_helper.from_array(np.array(6.0 / 255, np.float32), "ys"),
             numpy_helper.from_array(np.array(0, np.uint8), "yz")]
    graph = helper.make_graph(nodes, "w8a16", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def _within_a_step(got: np.ndarray, want: np.ndarray, requantize: bool) -> None:
    """A layer's output against the Q/DQ graph's (onnx.reference's or onnxruntime's: float32 sums; the kernels' are
    exact in int32, then scaled in float32)."""
    if requantize:  # r / y_scale near a tie: a float32 sum in another order may round a step the other way
        assert np.abs(got - want).max() <= 6.0 / 255 * 1.0001
        assert (got != want).mean() < 0.01
    else:
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())


CASES = [  # (input NCHW, out channels, kernel, stride, pads, group, wide, activation, output requantized)
    ((1, 16, 9, 11), 24, 1, [1, 1], [0, 0, 0, 0], 1, "uint16", "Clip", False),  # a projection of a ReLU6 output
    ((2, 24, 8, 8), 40, 1, [1, 1], [0, 0, 0, 0], 1, "int16", "", False),  # an expansion of the signed residual stream
    ((1, 32, 10, 10), 32, 3, [2, 2], [1, 1, 1, 1], 32, "uint16", "Clip", True),  # depthwise s2, 8-bit output
    ((1, 3, 17, 17), 8, 3, [2, 2], [1, 1, 1, 1], 1, "int16", "Relu", False),  # a stem on a normalised image
]


@pytest.mark.parametrize("shape, out, kernel, stride, pads, group, wide, activation, requantize", CASES)
def test_a_built_w8a16_layer_is_the_qdq_graph(shape, out, kernel, stride, pads, group, wide, activation, requantize):
    rng = case_rng(f"layer {shape} {group} {wide} {activation} {requantize}")
    model = _layer_model(shape, out, kernel, stride, pads, group, wide, activation, requantize, rng)
    engine = kiln.build(model, device="cpu")
    steps = engine.plan.program.steps
    layer = next(s for s in steps if s.name == "layer")
    # a depthwise split runs oneDNN's depthwise int8 kernel, which pairs no bytes: exact at full range without VNNI too
    if kernel == 1 or group > 1 or has_int8_dot_product():
        assert layer.op_type == "QConv" and layer.tactic in w8a16_tactics.TACTICS
    else:  # without VNNI a dense layer's split full-range int8 weights would saturate vpmaddubsw: not W8A16 there
        assert layer.op_type == "QConv" and layer.tactic not in w8a16_tactics.TACTICS
    assert not any(s.op_type == "QuantizeLinear" for s in steps)  # the 16-bit quantize folded into the layer
    context = engine.create_execution_context()
    reference = ReferenceEvaluator(model)
    for k in range(3):
        x = (rng.normal(0, 2, shape) if wide == "int16" else rng.uniform(-0.5, 6.5, shape)).astype(np.float32)
        _within_a_step(context.run({"x": x})["y"], reference.run(None, {"x": x})[0], requantize)


def test_an_8bit_layer_is_not_w8a16():
    """The mutation check: the same graph with an 8-bit input pair runs the int8 kernel, and is far from the 16-bit
    graph's result (so the comparison above can tell the two apart)."""
    rng = case_rng("8-bit")
    model = _layer_model((1, 16, 9, 11), 24, 1, [1, 1], [0, 0, 0, 0], 1, "uint16", "Clip", False, rng)
    eight = onnx.ModelProto()
    eight.CopyFrom(model)
    for t in eight.graph.initializer:
        if t.name == "s":
            t.CopyFrom(numpy_helper.from_array(np.array(6.0 / 255, np.float32), "s"))
        if t.name == "z":
            t.CopyFrom(numpy_helper.from_array(np.array(0, np.uint8), "z"))
    engine = kiln.build(eight, device="cpu")
    assert next(s for s in engine.plan.program.steps if s.name == "layer").tactic not in w8a16_tactics.TACTICS
    x = rng.uniform(0, 6, (1, 16, 9, 11)).astype(np.float32)
    got = engine.create_execution_context().run({"x": x})["y"]
    want = ReferenceEvaluator(model).run(None, {"x": x})[0]
    assert np.abs(got - want).max() > 20 * 1e-4 * np.abs(want).max()  # 8e-3 of it, measured


def _costs(w8a16: float, fp32: float) -> dict[str, dict[str, float]]:
    """Every layer 1 ms in int8, `w8a16` and `fp32` ms in the others."""
    return {name: {"int8": 1.0, "w8a16": w8a16, "fp32": fp32} for name in LAYERS}


def test_the_search_moves_layers_by_milliseconds(net):
    model, batches, ranges, means, lows, switched = _switched(net)
    all_on = expected_top1(switched.outputs(set(LAYERS)), switched.reference)
    every = expected_top1(switched.outputs(set(), weight_only=set(LAYERS)), switched.reference)
    target = (all_on + every) / 2  # reachable by W8A16 layers alone, and by float ones

    def search(costs):
        return choose_float_layers(model, ranges, "int8", batches, target, set(), lambda _m: None, metric="top1",
                                   unsigned=True, channel_means=means, lows=lows, weight_only=True, costs=costs)

    kept, record = search(_costs(w8a16=1.5, fp32=5.0))  # W8A16 cheap: no float layer
    wide = set(record["weight_only"])
    assert kept == set() and "mid" in wide and record["met"] and record["top1"] >= target
    assert record["plans"][record["chosen_plan"]]["ms"] == min(p["ms"] for p in record["plans"].values())
    assert expected_top1(switched.outputs(set(LAYERS) - wide, weight_only=wide), switched.reference) \
        == pytest.approx(record["top1"])
    kept, record = search(_costs(w8a16=5.0, fp32=1.5))  # float cheap: float layers, no W8A16
    assert record["weight_only"] == {} and "mid" in kept and record["top1"] >= target
    assert record["chosen_plan"] != "weight-only"
    # a layer costed far above the others is not moved where a cheaper one reaches the target
    costs = _costs(w8a16=1.5, fp32=5.0)
    costs["mid"] = {"int8": 1.0, "w8a16": 1000.0, "fp32": 1000.0}
    kept, record = search(costs)
    moved = kept | set(record["weight_only"])
    if "mid" in moved:  # only when no plan without it reaches the target
        assert all("mid" in set(p["kept_float"]) | set(p["w8a16"]) for p in record["plans"].values())


def test_the_build_aims_above_the_target_by_the_margin_and_records_w8a16(net):
    proto, batches = net
    config = BuildConfig(precision="int8", quantization="emulate", calibration=batches, calibrator="minmax",
                         accuracy_metric="top1", accuracy_target=0.9, accuracy_margin=0.05)
    model, info = quantize(ir.from_proto(proto), config, lambda _m: None)
    accuracy = info["accuracy"]
    assert accuracy["target"] == pytest.approx(0.95) and accuracy["asked"] == 0.9 and accuracy["margin"] == 0.05
    assert accuracy["top1"] >= 0.95
    # the emulation's weight-only convolutions read 16-bit inputs (what the CPU engine runs)
    convs = {n.name: n for n in model.graph if n.op_type == "Conv"}
    for name in info["w8a16"]:
        q = convs[name].inputs[0].producer().inputs[0].producer()
        assert q.op_type == "QuantizeLinear" and q.inputs[2].const_value.dtype in (ir.DataType.UINT16,
                                                                                  ir.DataType.INT16)
    assert set(info["w8a16"]) == set(info["weight_only"]) & set(convs)


def _chain(rng: np.random.Generator) -> ir.Model:
    """conv 3x3 8->16 + ReLU6 -> depthwise 3x3 -> 1x1 16->12: its input and weights, unquantized."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 12, 12])
    inits = [numpy_helper.from_array(rng.normal(0, 0.3, (16, 8, 3, 3)).astype(np.float32), "w1"),
             numpy_helper.from_array(rng.normal(0, 0.1, 16).astype(np.float32), "b1"),
             numpy_helper.from_array(rng.normal(0, 0.3, (16, 1, 3, 3)).astype(np.float32), "w2"),
             numpy_helper.from_array(rng.normal(0, 0.3, (12, 16, 1, 1)).astype(np.float32), "w3"),
             numpy_helper.from_array(np.array(0, np.float32), "lo"),
             numpy_helper.from_array(np.array(6, np.float32), "hi")]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="first", pads=[1, 1, 1, 1]),
             helper.make_node("Clip", ["c1", "lo", "hi"], ["r1"], name="relu6"),
             helper.make_node("Conv", ["r1", "w2"], ["c2"], name="dw", pads=[1, 1, 1, 1], group=16),
             helper.make_node("Conv", ["c2", "w3"], ["y"], name="project")]
    graph = helper.make_graph(nodes, "chain", [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return ir.from_proto(onnx.shape_inference.infer_shapes(helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17)])))


def _chain_engines(rng: np.random.Generator, monkeypatch, project_tactics: tuple[str, ...]) -> tuple:
    """_chain with its depthwise and projection W8A16 (qdq.insert), built: (the engine, its depthwise on the split
    tactic and its projection on one of `project_tactics`, the two in one native segment; the same engine without
    segments; the emulation: kiln's reference ops on the Q/DQ graph)."""
    from kiln.builder.lower import lower
    from kiln.quant import qdq
    from kiln.runtime.program import Program
    model = _chain(rng)
    qdq.insert(model, {"x": 3.0, "r1": 6.0, "c2": 20.0}, "int8", unsigned=True, wide={"dw", "project"})
    proto = ir.to_proto(model)
    engine = kiln.build(proto, device="cpu")
    tactics = {s.name: s.tactic for s in engine.plan.program.steps}
    assert tactics["dw"] == "cpu.qconv.w8a16" and tactics["project"] in project_tactics
    assert any({"dw", "project"} <= {m.ctx.name for m in s.members} for s in engine.program.segments)
    monkeypatch.setenv("KILN_NATIVE_SEGMENTS", "0")
    alone = kiln.build(proto, device="cpu")
    assert not alone.program.segments
    program, weights, _, _ = lower(ir.from_proto(proto))
    return engine, alone, Program(program, weights)


def _chain_outputs(engine, alone, emulation, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the engine's output, bit for bit the engine's without segments; the emulation's)."""
    got = engine.create_execution_context().run({"x": x})["y"]
    np.testing.assert_array_equal(got, alone.create_execution_context().run({"x": x})["y"])
    with torch.inference_mode():
        return got, emulation.run([torch.from_numpy(x)])[0].numpy()


@pytest.mark.skipif(not has_int8_dot_product(), reason="the depthwise layer's W8A16 is the split path's: VNNI only "
                    "(its full-range int8 weights would saturate vpmaddubsw; test_w8a16_avx2.py covers that CPU)")
def test_w8a16_layers_in_a_native_segment_are_the_emulation(monkeypatch):
    """int8 first layer, W8A16 depthwise (uint16 input) and projection (int16 input) from qdq.insert: the CPU engine
    runs both W8A16 layers inside one native segment, equal to the same engine layer by layer, and to the emulation
    (kiln's reference ops on the Q/DQ graph, 16-bit quantization included) within what a near-tie 16-bit rounding
    moves (the int8 layer's float output and the reference's differ in float32 summation order)."""
    from kiln.builder.lower import lower
    from kiln.quant import qdq
    from kiln.runtime.program import Program
    rng = case_rng("chain")
    engine, alone, emulation = _chain_engines(rng, monkeypatch, w8a16_tactics.TACTICS)
    eight = ir.from_proto(ir.to_proto(_chain(case_rng("chain"))))  # the same chain, every layer int8
    qdq.insert(eight, {"x": 3.0, "r1": 6.0, "c2": 20.0}, "int8", unsigned=True)
    program8, weights8, _, _ = lower(eight)
    all_int8 = Program(program8, weights8)
    for k in range(3):
        x = rng.normal(0, 1, (1, 8, 12, 12)).astype(np.float32)
        got, want = _chain_outputs(engine, alone, emulation, x)
        with torch.inference_mode():
            int8 = all_int8.run([torch.from_numpy(x)])[0].numpy()
        off, int8_off = np.abs(got - want).max(), np.abs(int8 - want).max()
        print(f"engine off the emulation by {off:.3g}, the int8 chain by {int8_off:.3g}, of {np.abs(want).max():.3g}")
        # project's int16 step is 4·20/32767 = 2.4e-3 (qdq.WIDE_HEADROOM): a near-tie rounded the other way moves y
        # by |w|·that; the int8 chain is ~100x further
        assert off < 1e-3 * np.abs(want).max() and off < int8_off / 30


def test_a_16bit_tensor_read_by_another_op_is_not_folded():
    """fold_wide_quantize_into_layer refuses where the 16-bit tensor has a reader besides QConv layers (here a
    DequantizeLinear -> Relu output): the QuantizeLinear stays a step, the layer reads its 16-bit output (the
    reference QConv then: no CPU kernel reads a stored 16-bit tensor), and the engine is still the graph."""
    from kiln.passes import PassOptions, optimize
    rng = case_rng("two readers")
    model = _layer_model((1, 8, 6, 6), 8, 1, [1, 1], [0, 0, 0, 0], 1, "uint16", "Clip", False, rng)
    graph = model.graph
    graph.node.extend([helper.make_node("DequantizeLinear", ["q", "s", "z"], ["xd2"]),
                       helper.make_node("Relu", ["xd2"], ["side"])])
    graph.output.append(helper.make_tensor_value_info("side", TensorProto.FLOAT, None))
    optimized = optimize(ir.from_proto(model), PassOptions(cpu_rules=True))
    layer = next(n for n in optimized.graph if n.name == "layer")
    assert layer.op_type == "QConv" and layer.inputs[0].producer().op_type == "QuantizeLinear"
    engine = kiln.build(model, device="cpu")
    x = rng.uniform(0, 6, (1, 8, 6, 6)).astype(np.float32)
    got = engine.create_execution_context().run({"x": x})
    want = ReferenceEvaluator(model).run(None, {"x": x})
    np.testing.assert_allclose(got["y"], want[0], rtol=0, atol=1e-4 * np.abs(want[0]).max())
    np.testing.assert_allclose(got["side"], want[1], rtol=0, atol=1e-6)


def test_a_rebuild_with_the_timing_cache_makes_the_same_plan(net, tmp_path, monkeypatch):
    """Stable plans: the search's layer times come from the timing cache on a rebuild, so the same calibration data
    and cache give the same W8A16/fp32 plan however the machine's load moves the timings. The times are made to move
    here (each measurement a new draw, 0.5x-2x): without the cache a rebuild's costs differ (the check can fail),
    with it nothing is measured and the plan and its costs are the first build's."""
    proto, batches = net
    draws = np.random.default_rng(zlib.crc32(b"noisy layer times"))
    measured = []

    def noisy(geometry):
        measured.append(geometry)
        base = {"int8": 1.0, "w8a16": 2.0, "fp32": 3.0}
        return {p: v * float(draws.uniform(0.5, 2.0)) for p, v in base.items()}

    monkeypatch.setattr(layer_cost, "conv_costs", noisy)
    model = optimize(ir.from_proto(proto), PassOptions(fusions=False))
    *_, switched = _switched(net)
    target = expected_top1(switched.outputs(set(LAYERS)), switched.reference)  # just above every layer int8
    cache = tmp_path / "timing.json"

    def build(timing_cache):
        config = BuildConfig(precision="int8", device="cpu", calibration=batches, calibrator="minmax",
                             accuracy_metric="top1", accuracy_target=min(target + 1e-3, 1.0), accuracy_margin=0.0,
                             timing_cache=timing_cache)
        _, info = quantize(ir.from_proto(proto), config, lambda _m: None)
        accuracy = info["accuracy"]
        return accuracy["layer_ms"], (sorted(accuracy["kept_float"]), sorted(info["w8a16"]))

    convs = sum(n.op_type == "Conv" for n in model.graph)
    first_ms, first_plan = build(str(cache))
    assert first_plan != ([], [])  # the target moves layers: a plan to keep
    assert len(measured) == convs and cache.exists()
    again_ms, again_plan = build(str(cache))
    assert len(measured) == convs  # every layer's times from the cache
    assert again_ms == first_ms and again_plan == first_plan
    names = [n.name for n in model.graph if n.op_type == "Conv"]
    uncached = layer_cost.layer_costs(model, names, lambda _m: None)
    assert len(measured) == 2 * convs and uncached != {n: first_ms[n] for n in names}  # measured anew: other times
    # the entries are keyed by the machine: another environment's are not read
    monkeypatch.setattr(layer_cost, "environment", lambda device: {"device_name": "another CPU"})
    layer_cost.layer_costs(model, names, lambda _m: None, TimingCache(cache))
    assert len(measured) == 3 * convs


def test_layer_costs_measure_each_precision_of_a_convolution():
    """The real kernels: every precision timed, in ms."""
    geometry = {"input": [1, 64, 28, 28], "weight": [64, 64, 1, 1], "strides": [1, 1], "pads": [0, 0, 0, 0],
                "dilations": [1, 1], "groups": 1}
    costs = layer_cost.conv_costs(geometry)
    assert set(costs) == set(layer_cost.PRECISIONS) and all(v > 0 for v in costs.values())


def test_a_pointwise_layer_is_costed_at_the_faster_w8a16_tactic(monkeypatch):
    """COST_MODEL 4: a 1x1 layer's W8A16 time is the faster of the split path and the one-pass GEMM (the tuner's two
    W8A16 tactics); a 3x3 layer has no GEMM."""
    pointwise = {"input": [1, 64, 28, 28], "weight": [96, 64, 1, 1], "strides": [1, 1], "pads": [0, 0, 0, 0],
                 "dilations": [1, 1], "groups": 1}  # 4.8M multiply-adds: ~0.05 ms either way
    full = dict(pointwise, weight=[96, 64, 3, 3], pads=[1, 1, 1, 1])
    w, s = torch.zeros(96, 64, 1, 1, dtype=torch.int8), torch.ones(96)
    assert layer_cost._pointwise(full, w, s) is None
    assert callable(layer_cost._pointwise(pointwise, w, s))
    slow = layer_cost.conv_costs(pointwise)
    calls = []
    monkeypatch.setattr(layer_cost, "_pointwise", lambda *_args: lambda: calls.append(1))  # a GEMM that costs nothing
    fast = layer_cost.conv_costs(pointwise)
    assert calls and fast["w8a16"] < 0.01 < slow["w8a16"]
