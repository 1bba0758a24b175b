"""Recurrent layers (RNN, GRU, LSTM) as members of a native segment (kiln/kernels/cpu/recurrent.py RecurrentLayer),
and a Gather by constant indices as a strided copy (cpu.gather.slice), against onnxruntime and onnx.reference.

The model is what an exported forecaster holds around its recurrent layer: X -> layer -> Reshape (drops the
direction axis: an alias) -> Gather of the last time step, Y_h (and Y_c) read after it. Each case asserts that the
layer ran inside the segment (or, with two directions or sequence_lens, that it stayed a step of its own), and
compares every output on fresh inputs: random weights, initial states absent, constants of the engine or graph
inputs, forward and reverse, each of kiln's LSTM loops and both GRU forms; a dynamic batch binds the segment at
other sizes.

Tolerance (fp32): as tests/unit/test_tactics_cpu_lstm.py's: kiln's GEMM and the oracles sum each gate's products in
their own orders, σ / tanh are rational approximations (~1e-7), and the recurrence carries each step's rounding into
the next: atol 2e-6 on outputs of order 1 over 7 steps.
"""

from __future__ import annotations

import threading

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.builder import autotune
from kiln.kernels.cpu import onednn, recurrent, relayout
from tests.unit.oracle import assert_close, case_rng, run_oracle

TOLERANCE = {np.dtype(np.float32): (1e-5, 2e-6)}
STEPS, BATCH, FEATURES, HIDDEN = 7, 5, 6, 20
GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
pytestmark = pytest.mark.skipif(not (recurrent.available() and onednn.available() and relayout.available()),
                                reason="kiln's recurrent loop, oneDNN or the relayout kernel is unavailable")

# (cell, tactic, attributes)
LAYERS = [("LSTM", "cpu.lstm.native", {}), ("LSTM", "cpu.lstm.lanes", {}), ("LSTM", "cpu.lstm.fused", {}),
          ("GRU", "cpu.gru.native", {"linear_before_reset": 0}), ("GRU", "cpu.gru.native", {"linear_before_reset": 1}),
          ("RNN", "cpu.rnn.native", {})]


def weights(rng, cell: str, directions: int) -> dict[str, np.ndarray]:
    g = GATES[cell]
    return {"W": rng.uniform(-0.5, 0.5, (directions, g * HIDDEN, FEATURES)).astype(np.float32),
            "R": rng.uniform(-0.5, 0.5, (directions, g * HIDDEN, HIDDEN)).astype(np.float32),
            "B": rng.uniform(-0.5, 0.5, (directions, 2 * g * HIDDEN)).astype(np.float32)}


def states(rng, cell: str, directions: int, batch: int) -> dict[str, np.ndarray]:
    names = ("initial_h", "initial_c") if cell == "LSTM" else ("initial_h",)
    return {n: rng.uniform(-1, 1, (directions, batch, HIDDEN)).astype(np.float32) for n in names}


def forecaster(cell: str, attrs: dict, direction: str, initial: str, constants: dict[str, np.ndarray],
               batch: int | str = BATCH, lengths: bool = False) -> onnx.ModelProto:
    """X [S, N, I] -> cell -> Y [S, D, N, H] -> Reshape [S, N, D·H] (D = 1: an alias) -> Gather(-1) -> last [N, D·H];
    Y_h (, Y_c) outputs too. `initial`: "none", "constant" (initializers) or "input" (graph inputs); `lengths`:
    sequence_lens an int32 graph input."""
    directions = 2 if direction == "bidirectional" else 1
    state_names = ["initial_h", "initial_c"] if cell == "LSTM" else ["initial_h"]
    names = ["X", "W", "R", "B", "sequence_lens" if lengths else ""] + (state_names if initial != "none" else [])
    finals = ["Y_h", "Y_c"] if cell == "LSTM" else ["Y_h"]
    nodes = [helper.make_node(cell, names, ["Y", *finals], hidden_size=HIDDEN, direction=direction, **attrs),
             helper.make_node("Reshape", ["Y", "shape"], ["Y_rows"]),
             helper.make_node("Gather", ["Y_rows", "last_step"], ["last"], axis=0)]
    inputs = [helper.make_tensor_value_info("X", TensorProto.FLOAT, [STEPS, batch, FEATURES])]
    if lengths:
        inputs.append(helper.make_tensor_value_info("sequence_lens", TensorProto.INT32, [batch]))
    if initial == "input":
        inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, [directions, batch, HIDDEN])
                   for n in state_names]
    initializers = [numpy_helper.from_array(v, k) for k, v in constants.items()]
    initializers += [numpy_helper.from_array(np.array([STEPS, -1, directions * HIDDEN], np.int64), "shape"),
                     numpy_helper.from_array(np.array(-1, np.int64), "last_step")]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ["last", *finals]]
    graph = helper.make_graph(nodes, "forecaster", inputs, outputs, initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def build(model: onnx.ModelProto, tactics: list[str], monkeypatch, **options):
    """`model` with `tactics` made the fastest of their layers' candidates."""
    monkeypatch.setattr(autotune, "measure", lambda fns, device, runs=10, **_: {k: 0.0 if k in tactics else 1.0
                                                                                for k in fns})
    return kiln.build(model, tactics=tactics, timing_cache=None, **options)


def segment_members(engine) -> list[str]:
    return [m.ctx.name for segment in engine.program.segments for m in segment.members]


def check_runs(engine, model: onnx.ModelProto, feeds_of, label: str,
               oracles: tuple[str, ...] = ("ort", "ref")) -> None:
    """Two runs on fresh inputs, every output against each oracle (onnxruntime, onnx.reference)."""
    for run in range(2):
        feeds = feeds_of(run)
        got = engine.run(dict(feeds))
        for oracle in oracles:
            for output, want in zip(model.graph.output, run_oracle(model, feeds, oracle)):
                assert_close(got[output.name], want, TOLERANCE, f"{label} run {run} {output.name} vs {oracle}")


@pytest.mark.parametrize("initial", ["none", "constant", "input"])
@pytest.mark.parametrize("direction", ["forward", "reverse"])
@pytest.mark.parametrize("cell, tactic, attrs", LAYERS)
def test_recurrent_layer_runs_inside_the_segment(cell, tactic, attrs, direction, initial, monkeypatch):
    rng = case_rng(f"{cell}-{tactic}-{attrs}-{direction}-{initial}")
    constants = weights(rng, cell, 1)
    if initial == "constant":
        constants.update(states(rng, cell, 1, BATCH))
    model = forecaster(cell, attrs, direction, initial, constants)
    engine = build(model, [tactic, "cpu.alias.Reshape", "cpu.gather.slice"], monkeypatch)
    layer = next(s for s in engine.plan.program.steps if s.op_type == cell)
    assert layer.tactic == tactic
    assert layer.name in segment_members(engine), f"the {cell} is not a member: {segment_members(engine)}"

    def feeds(run: int) -> dict[str, np.ndarray]:
        fresh = {"X": rng.uniform(-1, 1, (STEPS, BATCH, FEATURES)).astype(np.float32)}
        return fresh | (states(rng, cell, 1, BATCH) if initial == "input" else {})

    check_runs(engine, model, feeds, f"{tactic} {attrs} {direction} initial {initial}")


@pytest.mark.parametrize("why", ["bidirectional", "sequence_lens"])
@pytest.mark.parametrize("cell, tactic, attrs", [LAYERS[2], LAYERS[3]])
def test_what_stays_a_step_of_its_own(cell, tactic, attrs, why, monkeypatch):
    """Two directions (Y [S, 2, N, H] is 4-D in another memory order than the segment's NHWC layers read) and lengths
    given at run time (the launch checks them) are not offered to the segment: the layer's launch runs it, with the
    same answers (rows of length 0 and of full length among them)."""
    rng = case_rng(f"{why}-{cell}-{attrs}")
    direction = "bidirectional" if why == "bidirectional" else "forward"
    directions = 2 if why == "bidirectional" else 1
    lengths = why == "sequence_lens"
    model = forecaster(cell, attrs, direction, "input", weights(rng, cell, directions), lengths=lengths)
    engine = build(model, [tactic, "cpu.alias.Reshape", "cpu.gather.slice"], monkeypatch)
    layer = next(s for s in engine.plan.program.steps if s.op_type == cell)
    assert layer.tactic == tactic and layer.name not in segment_members(engine)

    def feeds(run: int) -> dict[str, np.ndarray]:
        fresh = {"X": rng.uniform(-1, 1, (STEPS, BATCH, FEATURES)).astype(np.float32)}
        if lengths:
            fresh["sequence_lens"] = np.array([STEPS, 0, 3, 1, STEPS - run], np.int32)
        return fresh | states(rng, cell, directions, BATCH)

    # onnx.reference's recurrent ops run every row the whole sequence (sequence_lens unread): onnxruntime only there
    check_runs(engine, model, feeds, f"{why} {tactic}", ("ort",) if lengths else ("ort", "ref"))


@pytest.mark.parametrize("tactic", ["cpu.lstm.fused", "cpu.lstm.lanes"])
def test_other_batches_bind_the_layer_anew(tactic, monkeypatch):
    """A batch axis declared dynamic: the segment binds the layer at each batch met (kiln's lanes past their 8 rows
    run the row loop), initial states read as graph inputs of that batch."""
    rng = case_rng(f"batches-{tactic}")
    model = forecaster("LSTM", {}, "forward", "input", weights(rng, "LSTM", 1), batch="N")
    shapes = {"X": f"{STEPS}x1x{FEATURES},{STEPS}x{BATCH}x{FEATURES},{STEPS}x12x{FEATURES}",
              "initial_h": f"1x1x{HIDDEN},1x{BATCH}x{HIDDEN},1x12x{HIDDEN}",
              "initial_c": f"1x1x{HIDDEN},1x{BATCH}x{HIDDEN},1x12x{HIDDEN}"}
    engine = build(model, [tactic, "cpu.alias.Reshape", "cpu.gather.slice"], monkeypatch, profiles=[shapes])
    assert next(s.name for s in engine.plan.program.steps if s.op_type == "LSTM") in segment_members(engine)
    for batch in (3, 11, BATCH, 1, 11):
        feeds = {"X": rng.uniform(-1, 1, (STEPS, batch, FEATURES)).astype(np.float32)} | states(rng, "LSTM", 1, batch)
        got = engine.run(dict(feeds))
        for output, want in zip(model.graph.output, run_oracle(model, feeds, "ort")):
            assert_close(got[output.name], want, TOLERANCE, f"{tactic} batch {batch} {output.name}")


def test_saved_engine_runs_the_segment_from_several_contexts(tmp_path, monkeypatch):
    """An engine saved and loaded binds the layer into its segment again (from the step's config), and contexts on
    three threads share it: each bound call's scratch is its segment's, whose lock the runs take in turn."""
    rng = case_rng("contexts")
    model = forecaster("LSTM", {}, "forward", "input", weights(rng, "LSTM", 1))
    engine = build(model, ["cpu.lstm.fused", "cpu.alias.Reshape", "cpu.gather.slice"], monkeypatch)
    engine.save(str(tmp_path / "forecaster.kiln"))
    loaded = kiln.load(str(tmp_path / "forecaster.kiln"))
    assert next(s.name for s in loaded.plan.program.steps if s.op_type == "LSTM") in segment_members(loaded)
    cases = [{"X": rng.uniform(-1, 1, (STEPS, BATCH, FEATURES)).astype(np.float32)} | states(rng, "LSTM", 1, BATCH)
             for _ in range(6)]
    wants = [run_oracle(model, feeds, "ort") for feeds in cases]
    failures: list[str] = []

    def worker(offset: int) -> None:
        context = loaded.create_execution_context()
        for k in range(offset, offset + 40):
            feeds = cases[k % len(cases)]
            got = context.run(dict(feeds))
            for output, want in zip(model.graph.output, wants[k % len(cases)]):
                if not np.allclose(got[output.name], want, rtol=1e-5, atol=2e-6):  # TOLERANCE's float32 entry
                    failures.append(f"context {offset} case {k % len(cases)} {output.name}")

    threads = [threading.Thread(target=worker, args=(offset,)) for offset in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures[:5]


@pytest.mark.parametrize("indices, axis", [(np.array(-1), 0), (np.array(2), 1), (np.array([0, 2, 4]), 1),
                                           (np.array([[1], [3]]), 0), (np.array([0, 1, 3]), 2)])
def test_gather_by_constant_indices(indices, axis, monkeypatch):
    """Gather of an activation by constant indices as the relayout kernel's strided copy: scalar and evenly spaced
    indices (a walk; 2-D ones give a 4-D output), and indices that step unevenly ([0, 1, 3]: no walk, so the tactic
    fails its check and the op's own code runs), each inside a segment after an Add, against onnxruntime and
    onnx.reference."""
    rng = case_rng(f"gather-{indices.tolist()}-{axis}")
    nodes = [helper.make_node("Add", ["x", "bias"], ["t"]),
             helper.make_node("Gather", ["t", "indices"], ["y"], axis=axis)]
    graph = helper.make_graph(nodes, "gather", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [6, 5, 7])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(indices.astype(np.int64), "indices"),
                               numpy_helper.from_array(rng.standard_normal(7).astype(np.float32), "bias")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    engine = build(model, ["cpu.add.native", "cpu.gather.slice"], monkeypatch)
    gather = next(s for s in engine.plan.program.steps if s.op_type == "Gather")
    strided = indices.ndim == 0 or len(set(np.diff(indices.reshape(-1)))) == 1
    assert (gather.tactic == "cpu.gather.slice") == strided, gather.tactic
    assert (gather.name in segment_members(engine)) == strided
    for run in range(2):
        feeds = {"x": rng.standard_normal((6, 5, 7)).astype(np.float32)}
        got = engine.run(dict(feeds))["y"]
        for oracle in ("ort", "ref"):
            np.testing.assert_array_equal(got, run_oracle(model, feeds, oracle)[0])  # a copy: exact
