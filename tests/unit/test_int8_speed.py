"""INT8 only where measured faster (kiln/builder/int8_speed.py, issue 12): the plan's choice on fake timing tables
(deterministic), the attribution of an engine's steps to its layers, and real CPU builds of a small classifier with
an injected table: the layer whose int8 form is slower runs fp32 and says why, the engine agrees with onnxruntime's
float model within int8's error, and the whole-engine check falls back to fp32 when the mixed engine is slower."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from onnx import helper

import kiln
from kiln.builder import int8_speed
from kiln.builder.config import BuildConfig
from kiln.cli.build import _quantization_rows
from kiln.errors import KilnError
from kiln.kernels.cpu import onednn

LAYERS = ("stem", "expand", "project", "classifier")


def _model(rng: np.random.Generator) -> onnx.ModelProto:
    """x [1, 3, 16, 16] -> stem 3x3 3->16 + Relu -> expand 1x1 16->32 + Relu -> project 1x1 32->16 -> + stem's (a
    residual) -> global pool -> classifier 16->10."""
    arrays = {"w1": rng.normal(size=(16, 3, 3, 3)).astype(np.float32) * 0.3,
              "b1": np.abs(rng.normal(size=16)).astype(np.float32),
              "w2": rng.normal(size=(32, 16, 1, 1)).astype(np.float32) * 0.3,
              "b2": rng.normal(size=32).astype(np.float32) * 0.1,
              "w3": rng.normal(size=(16, 32, 1, 1)).astype(np.float32) * 0.2,
              "wc": rng.normal(size=(10, 16)).astype(np.float32), "bc": rng.normal(size=10).astype(np.float32) * 0.1}
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="stem", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], name="expand"),
             helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
             helper.make_node("Conv", ["r2", "w3"], ["c3"], name="project"),
             helper.make_node("Add", ["c3", "r1"], ["s"], name="residual"),
             helper.make_node("GlobalAveragePool", ["s"], ["g"], name="pool"),
             helper.make_node("Flatten", ["g"], ["f"], name="flatten"),
             helper.make_node("Gemm", ["f", "wc", "bc"], ["y"], name="classifier", transB=1)]
    graph = helper.make_graph(nodes, "small", [helper.make_tensor_value_info("x", 1, [1, 3, 16, 16])],
                              [helper.make_tensor_value_info("y", 1, [1, 10])],
                              [onnx.numpy_helper.from_array(a, n) for n, a in arrays.items()])
    return onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


@pytest.fixture(scope="module")
def net():
    rng = np.random.default_rng(5)
    proto = _model(rng)
    batches = [{"x": rng.normal(size=(1, 3, 16, 16)).astype(np.float32)} for _ in range(6)]
    return proto, batches


def _chain(int8: dict[str, float], fp32: dict[str, float], boundary: float, own: set[str] = frozenset()):
    """a -> b -> c -> d (a reads the graph input)."""
    producers = {"a": {""}, "b": {"a"}, "c": {"b"}, "d": {"c"}}
    return int8_speed.SpeedModel(int8, fp32, producers, dict.fromkeys(int8, boundary), set(own))


# ---- the choice on fake tables ---------------------------------------------------------------------------------------

def test_a_layer_whose_int8_is_slower_goes_fp32_with_both_times():
    model = _chain({"a": 1.0, "b": 1.0, "c": 0.5, "d": 1.0}, {"a": 2.0, "b": 2.0, "c": 0.4, "d": 2.0}, 0.0, {"a"})
    moved = int8_speed.speed_moves(model, set())
    assert set(moved) == {"c"}
    assert moved["c"].startswith("int8 slower here: 500 µs vs 400 µs fp32")


def test_a_level_layer_goes_fp32_and_a_faster_one_stays():
    model = _chain({"a": 1.0, "b": 1.0, "c": 1.0, "d": 1.0}, {"a": 2.0, "b": 2.0, "c": 2.0, "d": 1.0}, 0.0, {"a"})
    assert set(int8_speed.speed_moves(model, set())) == {"d"}  # int8 not faster: the exact precision


def test_an_int8_layer_between_float_ones_pays_its_input_quantize():
    # b alone int8 between float a and c: 1.0 + its input's quantize against fp32's 1.2
    times = ({"a": 1.0, "b": 1.0, "c": 1.0, "d": 1.0}, {"a": 1.0, "b": 1.2, "c": 1.0, "d": 1.0})
    assert "b" in int8_speed.speed_moves(_chain(*times, boundary=0.3), {"a", "c", "d"})
    assert int8_speed.speed_moves(_chain(*times, boundary=0.1), {"a", "c", "d"}) == {}
    why = int8_speed.speed_moves(_chain(*times, boundary=0.3), {"a", "c", "d"})["b"]
    assert "1300 µs vs 1200 µs fp32" in why


def test_moving_a_layer_counts_the_quantize_its_int8_reader_then_needs():
    # a alone is 0.1 slower in int8, but with a float, b (int8, 1.0 faster) must quantize its input (0.5)
    model = _chain({"a": 1.1, "b": 1.0, "c": 1.0, "d": 1.0}, {"a": 1.0, "b": 2.0, "c": 2.0, "d": 2.0}, 0.5, {"a"})
    assert int8_speed.speed_moves(model, set()) == {}
    cheap = _chain({"a": 1.1, "b": 1.0, "c": 1.0, "d": 1.0}, {"a": 1.0, "b": 2.0, "c": 2.0, "d": 2.0}, 0.05, {"a"})
    assert set(int8_speed.speed_moves(cheap, set())) == {"a"}


def test_a_run_slower_together_moves_as_one():
    # b and c: each a little slower in int8; moved alone each makes its int8 neighbour quantize (0.5): only the
    # run of both (with d's boundary) saves
    model = _chain({"a": 1.0, "b": 1.3, "c": 1.3, "d": 0.2}, {"a": 2.0, "b": 1.0, "c": 1.0, "d": 1.0}, 0.5, {"a"})
    moved = int8_speed.speed_moves(model, set())
    assert {"b", "c"} <= set(moved)
    assert "as a run of" in moved["b"] or "as a run of" in moved["c"]
    assert model.total(set(moved)) < model.total(set())


def test_the_plan_time_never_grows():
    rng = np.random.default_rng(3)
    for _ in range(20):
        int8 = {k: float(rng.uniform(0.1, 2)) for k in "abcd"}
        fp32 = {k: float(rng.uniform(0.1, 2)) for k in "abcd"}
        model = _chain(int8, fp32, float(rng.uniform(0, 0.5)), {"a"})
        moved = int8_speed.speed_moves(model, set())
        assert model.total(set(moved)) <= model.total(set()) + 1e-12
        # and no single layer left int8 is level or slower than fp32 once moved
        for name in set(int8) - set(moved):
            assert model.total(set(moved) | {name}) > model.total(set(moved))


# ---- measurement pieces ----------------------------------------------------------------------------------------------

def _step(name, op, inputs, outputs, fused=()):
    return SimpleNamespace(name=name, op_type=op, inputs=list(inputs), outputs=list(outputs), fused_from=list(fused))


def test_steps_are_given_to_their_layers():
    steps = [_step("x_quantize", "QuantizeLinear", ["x"], ["xq"]), _step("conv1", "QConv", ["xq"], ["a"]),
             _step("conv2", "QConv", ["a"], ["b"]), _step("add", "Elementwise", ["b", "a"], ["c"], ["add", "add_q"]),
             _step("fused", "FusedConv", ["c"], ["d"], ["conv3", "add2"]), _step("pool", "GlobalAveragePool", ["d"],
                                                                                   ["e"])]
    times = {"x_quantize": 0.1, "conv1": 1.0, "conv2": 2.0, "add": 0.3, "fused": 4.0, "pool": 0.5}
    got = int8_speed.attribute(steps, times, {"conv1", "conv2", "conv3"})
    # the input's quantize is conv1's (its reader), the add conv2's (its input's layer), the pool conv3's (before it)
    assert got == pytest.approx({"conv1": 1.1, "conv2": 2.3, "conv3": 4.5})


def test_producers_walk_through_other_nodes(net):
    proto, _ = net
    model = ir.from_proto(proto)
    got = int8_speed.layer_producers(model.graph, set(LAYERS))
    assert got == {"stem": {""}, "expand": {"stem"}, "project": {"expand"}, "classifier": {"project", "stem"}}


def test_when_it_measures(monkeypatch):
    monkeypatch.setattr(int8_speed.cpu_features, "has_int8_dot_product", lambda: False)
    assert int8_speed.wanted(BuildConfig(precision="int8", accuracy_target=0.97))
    assert not int8_speed.wanted(BuildConfig(precision="int8"))  # no target: "auto" leaves it to the tuner
    assert int8_speed.wanted(BuildConfig(precision="int8", speed_check="on"))
    assert not int8_speed.wanted(BuildConfig(precision="int8", speed_check="on", layer_times={"int8": {}}))
    assert not int8_speed.wanted(BuildConfig(precision="fp32", speed_check="on"))
    monkeypatch.setattr(int8_speed.cpu_features, "has_int8_dot_product", lambda: True)
    assert not int8_speed.wanted(BuildConfig(precision="int8", accuracy_target=0.97))
    with pytest.raises(KilnError, match="speed_check"):
        int8_speed.wanted(BuildConfig(precision="int8", speed_check="sometimes"))


# ---- real builds with an injected table -------------------------------------------------------------------------------

needs_onednn = pytest.mark.skipif(not onednn.available(), reason="oneDNN's int8 kernels: libdnnl not loadable")

TABLE = {"int8": {"stem": 0.10, "expand": 0.30, "project": 0.05, "classifier": 0.02},
         "fp32": {"stem": 0.20, "expand": 0.20, "project": 0.10, "classifier": 0.03},
         "quantize_ms_per_element": 1e-10, "quantizes_own_input": ["stem"]}


def _ort(proto: onnx.ModelProto, batches) -> np.ndarray:
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return np.concatenate([session.run(None, b)[0] for b in batches])


def _run(engine, batches) -> np.ndarray:
    return np.concatenate([np.asarray(next(iter(engine.run(b).values()))) for b in batches])


@needs_onednn
def test_a_build_keeps_fp32_the_layer_the_table_times_slower_and_says_why(net):
    proto, batches = net
    engine = kiln.build(proto, precision="int8", calibration=batches, calibrator="minmax", layer_times=TABLE)
    q = engine.plan.header["quantization"]
    assert set(q["speed"]["kept_fp32"]) == {"expand"}
    assert q["kept_float"]["expand"].startswith("int8 slower here: 300 µs vs 200 µs fp32")
    assert q["layers"]["expand"]["precision"] == "fp32" and q["layers"]["expand"]["why"].startswith("int8 slower")
    steps = {s.name: s.op_type for s in engine.plan.program.steps}
    assert steps["expand"] != "QConv" and steps["project"] == "QConv"
    assert any(row[0] == "  kept float" and "int8 slower here" in row[1] for row in _quantization_rows(q))
    # int8's error against onnxruntime's float model: a few steps of the output's scale
    want, got = _ort(proto, batches), _run(engine, batches)
    assert np.abs(got - want).max() <= 0.05 * np.abs(want).max()


@needs_onednn
def test_the_search_ranks_only_the_layers_int8_speeds_up(net):
    proto, batches = net
    engine = kiln.build(proto, precision="int8", calibration=batches, calibrator="minmax", layer_times=TABLE,
                        accuracy_target=0.5, accuracy_metric="top1")
    q = engine.plan.header["quantization"]
    assert "expand" in q["speed"]["before_search"]
    assert "expand" not in (q["accuracy"].get("sensitivity") or {})  # not a candidate of the search
    assert q["kept_float"]["expand"].startswith("int8 slower here")


@needs_onednn
@pytest.mark.parametrize("faster", [True, False])
def test_the_engine_is_checked_against_fp32s(net, monkeypatch, faster):
    proto, batches = net
    monkeypatch.setattr(int8_speed, "measure", lambda fp32, probe: dict(TABLE))
    # level within KEEP_BELOW is not faster: fp32, the exact one
    monkeypatch.setattr(int8_speed, "compare", lambda engine, fp32: (1.0, 2.0, [0.5]) if faster else (0.99, 1.0, [0.99]))
    engine = kiln.build(proto, precision="int8", calibration=batches, calibrator="minmax", speed_check="on")
    q = engine.plan.header["quantization"]
    ops = {s.name: s.op_type for s in engine.plan.program.steps}
    if faster:
        assert q["speed"]["engine"]["int8_engine_ms"] == 1.0 and ops["project"] == "QConv"
        return
    assert "fallback" in q["speed"]["engine"]
    assert not any(op in ("QConv", "QGemm") for op in ops.values())
    assert all(why.startswith("int8 not faster here: the mixed engine") for why in q["kept_float"].values())
    want, got = _ort(proto, batches), _run(engine, batches)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)  # every layer fp32: float's rounding only


@needs_onednn
def test_a_refit_keeps_the_layers_the_check_kept_fp32(net, tmp_path):
    proto, batches = net
    onnx.save(proto, tmp_path / "small.onnx")
    engine = kiln.build(str(tmp_path / "small.onnx"), precision="int8", calibration=batches, calibrator="minmax", layer_times=TABLE,
                        refittable=True)
    rng = np.random.default_rng(9)
    new = {i.name: onnx.numpy_helper.to_array(i) * (1 + 0.05 * rng.standard_normal(i.dims)).astype(np.float32)
           for i in proto.graph.initializer}
    engine.refit({k: torch.from_numpy(v) for k, v in new.items()})
    fresh_proto = onnx.ModelProto()
    fresh_proto.CopyFrom(proto)
    for init in fresh_proto.graph.initializer:
        init.CopyFrom(onnx.numpy_helper.from_array(new[init.name], init.name))
    # the new weights' float model: int8's error only (the build's ranges kept)
    want = _ort(fresh_proto, batches)
    got = np.concatenate([np.asarray(next(iter(engine.create_execution_context().run(b).values()))) for b in batches])
    assert {s.name: s.op_type for s in engine.plan.program.steps}["expand"] != "QConv"
    assert np.abs(got - want).max() <= 0.05 * np.abs(want).max()


@needs_onednn
def test_a_build_whose_engines_cannot_be_measured_says_so(net, monkeypatch):
    proto, batches = net

    def cannot(fp32, probe):
        raise RuntimeError("a segment's per-layer times need kiln's compiled loop")

    monkeypatch.setattr(int8_speed, "measure", cannot)
    engine = kiln.build(proto, precision="int8", calibration=batches, calibrator="minmax", speed_check="on")
    q = engine.plan.header["quantization"]
    assert q["speed"]["engine"].startswith("not measured: a segment's per-layer times")
    assert {s.name: s.op_type for s in engine.plan.program.steps}["project"] == "QConv"
