"""Cross-layer equalization (kiln/quant/equalize.py): which Conv -> Relu/ReLU6 -> Conv pairs qualify, the
equalized float graph computes what the original does (onnxruntime on both), and int8 PTQ of an inverted
residual block whose ReLU6 channels span orders of magnitude is closer to fp32 with it than without."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.builder.calibration import equalize_channels
from kiln.builder.config import BuildConfig
from kiln.builder.refit import RefitError
from kiln.errors import KilnError
from kiln.frontend import onnx as onnx_frontend
from kiln.passes import PassOptions, optimize
from kiln.quant import equalize

C, E, H = 8, 48, 12  # block width, expanded width, spatial size


def _block(seed: int = 0, spread: float = 100.0, relu6: bool = True, tap: bool = False) -> bytes:
    """MobileNetV2's inverted residual: 1x1 expand -> ReLU6 -> 3x3 depthwise -> ReLU6 -> 1x1 project, + x.
    The depthwise rows are scaled by log-uniform gains over [1/spread, 1] (so its ReLU6 channels span that
    ratio, as MobileNetV2's do) and the expand rows by a few large gains (channels that reach the clip at 6).
    relu6 False: Relu instead. tap: the expand's output is a graph output too (no pair may be formed there)."""
    rng = np.random.default_rng(seed)
    w1 = rng.standard_normal((E, C, 1, 1)) / np.sqrt(C) * rng.choice([1.0, 8.0], (E, 1, 1, 1), p=[0.8, 0.2])
    gains = np.exp(rng.uniform(-np.log(spread), 0, E))
    w2 = rng.standard_normal((E, 1, 3, 3)) / 3 * gains[:, None, None, None]
    w3 = rng.standard_normal((C, E, 1, 1)) / np.sqrt(E) / np.sqrt(gains)[None, :, None, None]
    inits = [numpy_helper.from_array(a.astype(np.float32), n) for a, n in
             [(w1, "w1"), (w2, "w2"), (w3, "w3"), (0.1 * rng.standard_normal(E), "b1"),
              (0.05 * rng.standard_normal(E), "b2"), (0.1 * rng.standard_normal(C), "b3"),
              (np.array(0.0), "zero"), (np.array(6.0), "six")]]
    n = helper.make_node

    def act(x, y, name):
        return n("Clip", [x, "zero", "six"], [y], name=name) if relu6 else n("Relu", [x], [y], name=name)
    nodes = [n("Conv", ["x", "w1", "b1"], ["e"], name="expand"), act("e", "ea", "expand_act"),
             n("Conv", ["ea", "w2", "b2"], ["d"], name="depthwise", group=E, pads=[1, 1, 1, 1]),
             act("d", "da", "depthwise_act"), n("Conv", ["da", "w3", "b3"], ["p"], name="project"),
             n("Add", ["x", "p"], ["y"], name="residual")]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, C, H, H])]
    if tap:
        outputs.append(helper.make_tensor_value_info("e", TensorProto.FLOAT, [1, E, H, H]))
    graph = helper.make_graph(nodes, "block", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, C, H, H])],
                              outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def _batches(n: int, seed: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((1, C, H, H)).astype(np.float32)} for _ in range(n)]


def _ort(model: bytes | ir.Model, feeds: dict) -> np.ndarray:
    proto = ir.to_proto(model).SerializeToString() if isinstance(model, ir.Model) else model
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(proto, options, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def _folded(model: bytes) -> ir.Model:
    """The graph calibration sees: constants folded, no fusion."""
    return optimize(onnx_frontend.load(model), PassOptions(fusions=False))


def _relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


# ---- the rewrite: structure, then the float model unchanged ------------------------------------

def test_pairs_are_conv_activation_conv_with_no_other_reader():
    pairs = equalize.find(_folded(_block()).graph)
    assert [(p.first.name, p.activation.name, [c.name for c in p.consumers]) for p in pairs] == \
        [("expand", "expand_act", ["depthwise"]), ("depthwise", "depthwise_act", ["project"])]
    # the expand's output also leaves the graph: dividing it by s would change that output
    assert [p.first.name for p in equalize.find(_folded(_block(tap=True)).graph)] == ["depthwise"]


def test_a_clip_with_a_nonzero_floor_is_not_homogeneous():
    model = _folded(_block())
    clip = next(n for n in model.graph if n.name == "depthwise_act")
    low = ir.Value(name="minus_one", const_value=ir.tensor(np.array(-1.0, np.float32), name="minus_one"))
    model.graph.register_initializer(low)
    clip.replace_input_with(1, low)
    assert [p.first.name for p in equalize.find(model.graph)] == ["expand"]


def test_factors_grow_narrow_channels_towards_the_widest_and_never_shrink_one():
    a = np.array([6.0, 1.5, 0.06, 0.0, 6.0])
    np.testing.assert_allclose(equalize.factors(a, 1.0), [1.0, 0.25, 0.01, 1.0, 1.0])
    np.testing.assert_allclose(equalize.factors(a, 0.5), [1.0, 0.5, 0.1, 1.0, 1.0])
    assert equalize.factors(np.zeros(3), 0.5).tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("alpha", [0.5, 1.0])
@pytest.mark.parametrize("relu6", [True, False])
def test_the_equalized_float_graph_computes_what_the_original_does(alpha, relu6):
    """onnxruntime on the original and on the equalized graph (factors from calibration statistics, down to
    ~1/100): the same outputs within float32 rounding (1e-5 of the output's scale) on the calibration inputs
    and on fresh ones within their range; with Relu (positively homogeneous) on any input. The ReLU6 channels
    that reached 6 keep their scale; a grown one is clipped at 6 / s_i >= its calibrated maximum (original
    units), so a fresh input beyond the calibrated range may differ there (seed 2: 9e-5 at full amplitude)."""
    original = _block(relu6=relu6)
    model = _folded(original)
    calibration = _batches(6, seed=1)
    record = equalize_channels(model, BuildConfig(precision="int8", calibration=calibration), alpha, lambda _m: None)
    assert record["pairs"] == 2
    before, after = record["spread"]["da"]
    assert after < before / 3  # the depthwise output's channels are evened out
    fresh = _batches(4, seed=2)
    within = [{"x": 0.5 * f["x"]} for f in fresh]
    for feeds in calibration[:2] + within + ([] if relu6 else fresh):
        assert _relative_error(_ort(model, feeds), _ort(original, feeds)) < 1e-5


def test_equalization_needs_calibration_data_and_checks_alpha():
    with pytest.raises(KilnError, match="cross-layer equalization"):
        equalize_channels(_folded(_block()), BuildConfig(precision="int8"), 0.5, lambda _m: None)
    for alpha in (0.0, 1.5, "0.5", True):
        with pytest.raises(KilnError, match="equalize="):
            equalize.check_alpha(alpha)


# ---- int8 accuracy on a block whose ReLU6 channels span two decades ---------------------------------

def _int8_error(model: bytes, options: dict, fp32, feeds: list[dict]) -> float:
    engine = kiln.build(model, precision="int8", quantization="emulate", calibration=_batches(8, seed=100),
                        calibrator="percentile", layer_precision={"expand": "fp32", "depthwise": "fp32"}, **options)
    assert engine.plan.header["quantization"]["quantized"] == ["project"]
    return float(np.mean([_relative_error(engine.run(f)["y"] - f["x"], fp32.run(f)["y"] - f["x"]) for f in feeds]))


def test_int8_with_equalization_quantizes_the_projection_input_more_finely():
    """The projection alone int8 (its uint8 input per tensor spends its 256 steps on the channels near 6;
    equalization grows the others), the block's branch y - x (the residual is exact in float) against the
    fp32 engine, relative to its scale, on the calibration inputs (measured: 0.023 without, 0.019 with).
    Not asserted on fresh random inputs beyond the calibrated range: there this toy gains nothing (0.036
    without, 0.047 with: a grown channel is clipped at 6 / s_i of the calibrated maximum's units, and 8 random
    batches estimate the channel maxima poorly); on MobileNetV2's held-out photographs see
    bench/results/quantacc-2026-12-05d.md."""
    model = _block(0)
    fp32 = kiln.build(model)
    feeds = _batches(8, seed=100)[:4]
    without = _int8_error(model, {}, fp32, feeds)
    with_eq = _int8_error(model, {"equalize": 0.5}, fp32, feeds)
    assert with_eq < 0.9 * without, (with_eq, without)


def test_an_equalized_engine_refits_only_with_recalibration(tmp_path):
    """The factors come from the activations' channel maxima at build, which the engine does not keep: a refit
    that keeps the recorded ranges would pair them with unequalized weights, so it is refused, naming the cure."""
    for seed in (0, 1):
        (tmp_path / f"block{seed}.onnx").write_bytes(_block(seed))
    engine = kiln.build(str(tmp_path / "block0.onnx"), precision="int8", quantization="emulate",
                        calibration=_batches(4, seed=100), calibrator="percentile", equalize=0.5)
    assert engine.plan.header["quantization"]["equalization"]["pairs"] == 2
    with pytest.raises(RefitError, match="cross-layer equalization .* recalibrate=DATA"):
        engine.refit(str(tmp_path / "block1.onnx"))
