"""Per-channel input scales of depthwise convolutions (folded into the weight scales by the fusion) and
bias correction (kiln/quant/qdq.py, kiln/passes/fusion/qdq_layers.py): structure and numbers against
onnxruntime running the same Q/DQ model, on fresh random data."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch

import kiln
from onnx import helper

from kiln.builder.calibration import quantize
from kiln.builder.config import BuildConfig
from kiln.builder.lower import lower
from kiln.kernels.cpu import onednn
from kiln.passes import PassOptions, optimize
from kiln.quant import calibrators
from kiln.runtime import profiler
from kiln.runtime.program import Program


def _model(rng: np.random.Generator) -> onnx.ModelProto:
    """Conv 3->8 + ReLU6 (channels scaled 0.01..3: ranges far apart) -> depthwise 3x3 + ReLU6 -> 1x1 conv 8->4."""
    w1 = rng.normal(size=(8, 3, 3, 3)).astype(np.float32) * np.geomspace(0.01, 3, 8, dtype=np.float32)[:, None, None,
                                                                                                          None]
    w2 = rng.normal(size=(8, 1, 3, 3)).astype(np.float32) * np.geomspace(20, 0.5, 8, dtype=np.float32)[:, None, None,
                                                                                                          None]
    w3 = rng.normal(size=(4, 8, 1, 1)).astype(np.float32)
    inits = [onnx.numpy_helper.from_array(a, n) for a, n in [
        (w1, "w1"), (rng.normal(size=8).astype(np.float32) * 0.1, "b1"), (w2, "w2"),
        (rng.normal(size=8).astype(np.float32), "b2"), (w3, "w3"), (np.array(0, np.float32), "lo"),
        (np.array(6, np.float32), "hi")]]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="stem", pads=[1, 1, 1, 1]),
             helper.make_node("Clip", ["c1", "lo", "hi"], ["r1"], name="relu6_1"),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], name="depthwise", group=8, pads=[1, 1, 1, 1]),
             helper.make_node("Clip", ["c2", "lo", "hi"], ["r2"], name="relu6_2"),
             helper.make_node("Conv", ["r2", "w3"], ["y"], name="project")]
    graph = helper.make_graph(nodes, "dw", [helper.make_tensor_value_info("x", 1, [1, 3, 12, 12])],
                              [helper.make_tensor_value_info("y", 1, [1, 4, 12, 12])], inits)
    return onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


def _quantized(proto: onnx.ModelProto, calibration, dtype: str, **options) -> tuple[ir.Model, dict]:
    config = BuildConfig(precision=dtype, quantization="emulate", calibration=calibration, calibrator="minmax",
                         **options)
    return quantize(ir.from_proto(proto), config, lambda _m: None)


def _run_fused(model: ir.Model, x: np.ndarray) -> tuple[np.ndarray, ir.Model]:
    fused = optimize(ir.from_proto(ir.to_proto(model)), PassOptions(unsigned_activations=True))
    program, weights, _, _ = lower(fused)
    with torch.inference_mode():
        return Program(program, weights).run([torch.from_numpy(x)])[0].float().numpy(), fused


def _run_ort(model: ir.Model, x: np.ndarray) -> np.ndarray:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # the Q/DQ as written
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_depthwise_input_is_quantized_per_channel_and_folded(dtype):
    rng = np.random.default_rng(7)
    proto = _model(rng)
    calibration = [{"x": rng.normal(size=(1, 3, 12, 12)).astype(np.float32)} for _ in range(6)]
    model, info = _quantized(proto, calibration, dtype, bias_correction=False)
    # structure: the depthwise input's Q/DQ run along the channels, the others per tensor
    q = {n.inputs[0].name: n for n in model.graph if n.op_type == "QuantizeLinear"}
    assert q["r1"].inputs[1].const_value.numpy().shape == (8,) and q["r1"].attributes["axis"].value == 1
    assert q["x"].inputs[1].const_value.numpy().shape == () and q["r2"].inputs[1].const_value.numpy().shape == ()
    assert info["calibration"]["per_channel"] == 1
    x = rng.normal(size=(1, 3, 12, 12)).astype(np.float32)  # fresh data
    got, fused = _run_fused(model, x)
    ops = collections.Counter(n.op_type for n in fused.graph)
    # every layer fused, the per-channel pair absorbed into the stem (output side) and the depthwise (input side)
    assert ops["QConv"] == 3 and ops["QuantizeLinear"] == 1 and ops["DequantizeLinear"] == 0, ops
    want = _run_ort(model, x)
    scale = float(np.abs(want).max())
    # onnxruntime computes each Q/DQ layer in float32 and kiln's reference exactly: a near-tie may round one
    # step apart and carry through the next layers, a few of the output's steps at most (int8: 1/255 of the
    # range per step; fp8: 1/16 relative)
    assert np.abs(got - want).max() <= (0.03 if dtype == "int8" else 0.15) * scale
    assert np.mean(np.abs(got - want)) <= (0.002 if dtype == "int8" else 0.02) * scale


def test_per_channel_scales_beat_one_scale_for_all():
    rng = np.random.default_rng(3)
    proto = _model(rng)
    calibration = [{"x": rng.normal(size=(1, 3, 12, 12)).astype(np.float32)} for _ in range(6)]
    x = rng.normal(size=(1, 3, 12, 12)).astype(np.float32)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    want = session.run(None, {"x": x})[0]
    errors = {}
    for per_channel in (False, True):
        model, _ = _quantized(proto, calibration, "int8", per_channel_depthwise=per_channel, bias_correction=False)
        got, _ = _run_fused(model, x)
        errors[per_channel] = float(np.abs(got - want).max() / np.abs(want).max())
    assert errors[True] < 0.75 * errors[False], errors  # measured 0.019 vs 0.033 (seed 3)


def test_bias_correction_moves_the_output_mean_back():
    rng = np.random.default_rng(11)
    proto = _model(rng)
    calibration = [{"x": rng.normal(size=(1, 3, 12, 12)).astype(np.float32)} for _ in range(8)]
    xs = [rng.normal(size=(1, 3, 12, 12)).astype(np.float32) for _ in range(6)]
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    want = np.concatenate([session.run(None, {"x": x})[0] for x in xs])
    shift = {}
    for corrected in (False, True):
        model, info = _quantized(proto, calibration, "fp8", bias_correction=corrected)
        assert info["bias_correction"] is corrected
        got = np.concatenate([_run_fused(model, x)[0] for x in xs])
        shift[corrected] = float(np.abs((got - want).mean(axis=(0, 2, 3))).mean())  # per output channel
    assert shift[True] < shift[False], shift


def test_per_channel_histograms_match_one_calibrator_per_channel():
    rng = np.random.default_rng(5)
    batches = [torch.from_numpy(rng.gamma(1.0, size=(2, 4, 6, 6)).astype(np.float32)
                                * np.array([0.01, 1, 10, 300], np.float32)[None, :, None, None]) for _ in range(3)]
    for name in ("percentile", "minmax"):
        together = calibrators.PerChannel(name)
        alone = [calibrators.make(name) for _ in range(4)]
        for b in batches:
            together.observe(b)
            for c, cal in enumerate(alone):
                cal.observe(b[:, c])
        np.testing.assert_allclose(together.amax(), [c.amax() for c in alone], rtol=1e-6)


@pytest.mark.parametrize("one_sided", [False, True])
def test_per_channel_entropy_is_the_tensors_threshold_capped_by_each_channels_maximum(one_sided):
    """The KL search runs once, on the whole tensor (a channel's own histogram is too sparse for it); each
    channel takes min(its maximum, that threshold)."""
    rng = np.random.default_rng(6)
    batches = [torch.from_numpy(rng.gamma(1.0, size=(2, 4, 16, 16)).astype(np.float32)
                                * np.array([0.01, 1, 2, 3], np.float32)[None, :, None, None]) for _ in range(3)]
    together = calibrators.PerChannel("entropy", one_sided)
    whole = calibrators.make("entropy", one_sided)
    for b in batches:
        together.observe(b)
        whole.observe(b)
    top = np.max([b.abs().amax(dim=(0, 2, 3)).numpy() for b in batches], axis=0).astype(np.float64)
    threshold = whole.amax()
    assert top[0] < threshold < top[-1]  # one channel below the threshold, one clipped by it
    np.testing.assert_allclose(together.amax(), np.minimum(top, threshold), rtol=1e-6)


def _fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x quantized to E4M3 at `scale` and back, by torch's own cast (saturating at 448), in float64."""
    return (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).double() * scale.double()


def test_fp8_emulation_equals_torch_float8_e4m3fn_casts():
    """The whole emulated FP8 pipeline (ranges -> scales amax/448, per-channel E4M3 weights, the per-channel
    depthwise input and its fold, the fused QConvs) against the same arithmetic written here with
    torch.float8_e4m3fn casts and float64 convolutions: an oracle that shares no kiln quantization code."""
    rng = np.random.default_rng(11)
    proto = _model(rng)
    calibration = [{"x": rng.normal(size=(1, 3, 12, 12)).astype(np.float32)} for _ in range(4)]
    model, info = _quantized(proto, calibration, "fp8", bias_correction=False)
    ranges = {k: np.asarray(v, np.float64) for k, v in info["ranges"].items()}
    w = {t.name: torch.from_numpy(onnx.numpy_helper.to_array(t).astype(np.float64)) for t in proto.graph.initializer}

    def scale(amax, cap=None) -> torch.Tensor:  # float32, as qdq.insert stores it
        amax = np.minimum(amax, cap) if cap is not None else amax
        s = (amax / 448.0).astype(np.float32)
        if cap is not None:
            s = np.where(s.astype(np.float64) * 448 > cap, np.nextafter(s, np.float32(0)), s)
        return torch.from_numpy(np.asarray(s, np.float64))

    def weight(name: str) -> torch.Tensor:
        v = w[name]
        s = torch.from_numpy((v.abs().amax(dim=(1, 2, 3)).numpy() / 448.0).astype(np.float32).astype(np.float64))
        return _fp8(v, s.reshape(-1, 1, 1, 1))

    x = rng.normal(size=(1, 3, 12, 12)).astype(np.float32)
    t = torch.from_numpy(x).double()
    t = _fp8(t, scale(ranges["x"]))
    t = torch.nn.functional.conv2d(t, weight("w1"), w["b1"], padding=1).clamp(0, 6)
    t = _fp8(t, scale(ranges["r1"], 6.0).reshape(1, -1, 1, 1))  # per channel: the depthwise conv's input
    t = torch.nn.functional.conv2d(t, weight("w2"), w["b2"], padding=1, groups=8).clamp(0, 6)
    t = _fp8(t, scale(ranges["r2"], 6.0))
    want = torch.nn.functional.conv2d(t, weight("w3")).numpy()
    got, fused = _run_fused(model, x)
    assert collections.Counter(n.op_type for n in fused.graph)["QConv"] == 3
    # the int32 biases (at s_x·s_w) and float32 scale products round where the oracle does not (a relative
    # 1e-7 of a value): an element of r2 sitting at an E4M3 rounding tie can land one step (1/16 of it) the
    # other way, which changes the 4 outputs at its position. Measured: 2 of 144 positions, the other 142 exact
    # to float32 rounding
    close = np.isclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max()).all(axis=1)  # [1, 12, 12] positions
    assert (~close).sum() <= 3, np.argwhere(~close).tolist()
    np.testing.assert_allclose(got, want, rtol=0, atol=np.abs(want).max() / 16)


def _wide_model(rng: np.random.Generator) -> onnx.ModelProto:
    """_model's stem -> depthwise -> project at 32 channels and 40x40: large enough that a oneDNN reorder is the
    quantize the autotuner keeps."""
    c = 32
    scales = np.geomspace(0.01, 3, c, dtype=np.float32)[:, None, None, None]
    inits = [onnx.numpy_helper.from_array(a, n) for a, n in [
        (rng.normal(size=(c, 3, 3, 3)).astype(np.float32) * scales, "w1"),
        (rng.normal(size=c).astype(np.float32) * 0.1, "b1"),
        (rng.normal(size=(c, 1, 3, 3)).astype(np.float32) * scales[::-1], "w2"),
        (rng.normal(size=c).astype(np.float32), "b2"), (rng.normal(size=(8, c, 1, 1)).astype(np.float32), "w3"),
        (np.array(0, np.float32), "lo"), (np.array(6, np.float32), "hi")]]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="stem", pads=[1, 1, 1, 1]),
             helper.make_node("Clip", ["c1", "lo", "hi"], ["r1"], name="relu6_1"),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], name="depthwise", group=c, pads=[1, 1, 1, 1]),
             helper.make_node("Clip", ["c2", "lo", "hi"], ["r2"], name="relu6_2"),
             helper.make_node("Conv", ["r2", "w3"], ["y"], name="project")]
    graph = helper.make_graph(nodes, "dw", [helper.make_tensor_value_info("x", 1, [1, 3, 40, 40])],
                              [helper.make_tensor_value_info("y", 1, [1, 8, 40, 40])], inits)
    return onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


@pytest.mark.skipif(not onednn.available(), reason="needs oneDNN")
def test_a_float_stem_feeding_an_int8_depthwise_stays_in_one_native_segment():
    """An accuracy target's boundary (the stem kept float, the depthwise int8, quantized per channel): the CPU
    engine quantizes per channel with cpu.quantize.onednn_per_channel, inside the native segment with the stem and
    the depthwise (before: cpu.quantize.torch_per_channel, torch ops that ended the segment), and its output is the
    emulated engine's within one output step (oneDNN multiplies by 1/s where ONNX divides: a near-tie of the
    depthwise input may round one step the other way, and is carried through two layers)."""
    rng = np.random.default_rng(21)
    proto = _wide_model(rng)
    calibration = [{"x": rng.uniform(-1, 1, size=(1, 3, 40, 40)).astype(np.float32)} for _ in range(4)]
    options = dict(precision="int8", calibration=calibration, calibrator="minmax", layer_precision={"stem": "fp32"},
                   tactics=["cpu.quantize.onednn_per_channel", "cpu.quantize.onednn", "cpu.qconv.onednn",
                            "cpu.conv.onednn_direct"])
    engine = kiln.build(ir.from_proto(proto), **options)
    emulated = kiln.build(ir.from_proto(proto), **{**options, "quantization": "emulate", "tactics": []})
    quantizes = [s for s in engine.program.spec.steps if s.op_type == "QuantizeLinear"
                 and int(dict(s.attributes).get("axis", 1)) == 1 and "per_channel" in (s.tactic or "")]
    assert [s.tactic for s in quantizes] == ["cpu.quantize.onednn_per_channel"]
    members = [m.ctx.name for segment in engine.program.segments for m in segment.members]
    assert quantizes[0].name in members and len(members) >= 3, members
    for _ in range(3):
        x = rng.uniform(-1, 1, size=(1, 3, 40, 40)).astype(np.float32)
        got = np.asarray(next(iter(engine.run({"x": x}).values())))
        want = np.asarray(next(iter(emulated.run({"x": x}).values())))
        spread = float(want.max() - want.min())
        assert np.abs(got - want).max() <= spread / 255 * 1.5, np.abs(got - want).max() / spread * 255


@pytest.mark.skipif(not onednn.available(), reason="needs oneDNN")
def test_a_segment_entered_by_8_bit_values_runs_its_native_loop():
    """The quantize left outside segments (cpu.quantize.torch_per_channel: channels of different zero points): the
    segment after it (depthwise, project) is entered by uint8 values and must run as one native loop. Before, a
    QConv's NativeStep read float32 by default, the segment's entry check refused the uint8 tensor on every call
    and the segment ran layer by layer (MobileNetV2's mixed engine: 68 of its 72 members)."""
    rng = np.random.default_rng(22)
    proto = _wide_model(rng)
    calibration = [{"x": rng.uniform(-1, 1, size=(1, 3, 40, 40)).astype(np.float32)} for _ in range(4)]
    options = dict(precision="int8", calibration=calibration, calibrator="minmax", layer_precision={"stem": "fp32"})
    engine = kiln.build(ir.from_proto(proto), **options, tactics=[
        "cpu.quantize.torch_per_channel", "cpu.quantize.onednn", "cpu.qconv.onednn", "cpu.conv.onednn_direct"])
    emulated = kiln.build(ir.from_proto(proto), **options, quantization="emulate")
    x = rng.uniform(-1, 1, size=(1, 3, 40, 40)).astype(np.float32)
    timed = profiler.profile_segments(engine.program, engine.program_inputs({"x": x}), runs=2)
    assert {"depthwise", "project"} <= set(timed), sorted(timed)  # ran inside the segment's own loop
    got = np.asarray(next(iter(engine.run({"x": x}).values())))
    want = np.asarray(next(iter(emulated.run({"x": x}).values())))
    assert np.abs(got - want).max() <= float(want.max() - want.min()) / 255 * 1.5  # torch's quantize is ONNX's


@pytest.mark.skipif(not onednn.available(), reason="needs oneDNN")
def test_without_int8_dot_products_the_depthwise_weights_keep_8_bits(monkeypatch):
    """A CPU build without VNNI (this Zen 3; KILN_CPU_ISA=avx2 makes any x86 one): the dense convolutions' weights
    7-bit (their kernels pair bytes), the depthwise one's 8-bit, run by the int8 depthwise kernel (which widens each
    product: tests/unit/test_quant_kernels.py checks it exact at 127), and the record says which and why. The engine
    against kiln's reference interpreter on the same Q/DQ model (the kernels' exact integer definition)."""
    monkeypatch.setenv("KILN_CPU_ISA", "avx2")
    rng = np.random.default_rng(5)
    proto = _model(rng)
    calibration = [{"x": rng.normal(size=(1, 3, 12, 12)).astype(np.float32)} for _ in range(4)]
    config = BuildConfig(precision="int8", calibration=calibration, calibrator="minmax")
    model, record = quantize(ir.from_proto(proto), config, lambda _m: None)
    assert record["weights"].startswith("7-bit per channel, depthwise 8-bit (this CPU: ")
    assert record["full_range_weights"] == ["depthwise"]
    widest = {name: int(np.abs(model.graph.initializers[f"{name}_weight_q"].const_value.numpy()).max())
              for name in ("stem", "depthwise", "project")}
    assert widest == {"stem": 64, "depthwise": 127, "project": 64}
    engine = kiln.build(proto, precision="int8", calibration=calibration, calibrator="minmax")
    layer = engine.plan.header["quantization"]["layers"]["depthwise"]
    assert layer["precision"] == "int8" and "8-bit weights (depthwise" in layer["why"], layer
    x = rng.normal(size=(1, 3, 12, 12)).astype(np.float32)
    want, _ = _run_fused(model, x)
    got = next(iter(engine.run({"x": x}).values()))
    # one uint8 step of the depthwise output on a near-tie (oneDNN rounds r·(1/s) in float32) moves the float
    # projection by |w3| times that step: a few thousandths of the output's range
    assert np.abs(got - want).max() <= 0.01 * np.abs(want).max()
