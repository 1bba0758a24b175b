"""Recurrent layers (RNN, GRU, LSTM) as members of a native segment (kiln/kernels/cpu/recurrent.py RecurrentLayer),
and a Gather by constant indices as a strided copy (cpu.gather.slice), against onnxruntime and onnx.reference.

The model is what an exported forecaster holds around its recurrent layer: X -> layer -> Reshape (drops the
direction axis: an alias) -> Gather of the last time step, Y_h (and Y_c) read after it. Each case asserts that the
layer ran inside the segment, and compares every output on fresh inputs: random weights, initial states absent,
constants of the engine or graph inputs, every direction, both layouts, sequence_lens absent, constant or read at
run time, each of kiln's LSTM loops and both GRU forms; a dynamic batch binds the segment at other sizes. The
exporter's moves around a bidirectional Y (Transpose + Reshape, a kiln Relayout) read it row-major inside the segment.

Tolerance (fp32): as tests/unit/test_tactics_cpu_lstm.py's: kiln's GEMM and the oracles sum each gate's products in
their own orders, σ / tanh are rational approximations (~1e-7), and the recurrence carries each step's rounding into
the next: atol 2e-6 on outputs of order 1 over 7 steps.
"""

from __future__ import annotations

import threading

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.builder import autotune
from kiln.cli.inspect import _native_segments
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


def exported_forecaster(cell: str, attrs: dict, direction: str, layout: int, initial: str, lengths: str,
                        constants: dict[str, np.ndarray], batch: int | str) -> onnx.ModelProto:
    """What torch.onnx.export writes around a (bidirectional) layer: layout 0, X [S, N, I] -> Y [S, D, N, H] ->
    Transpose(0, 2, 1, 3) -> Reshape [S, N, D·H] -> Gather of the last step (axis 0); layout 1, X [N, S, I] ->
    Y [N, S, D, H] -> Reshape [N, S, D·H] -> Gather(axis 1). kiln's passes make the moves a Relayout, which must
    read Y row-major. Y_rows (all of Y), Y_h (, Y_c) are outputs too. `initial`: "none", "constant" or "input"; `lengths`: "none",
    "constant" (an initializer) or "input" (an int32 graph input)."""
    directions = 2 if direction == "bidirectional" else 1
    state_names = ["initial_h", "initial_c"] if cell == "LSTM" else ["initial_h"]
    names = ["X", "W", "R", "B", "sequence_lens" if lengths != "none" else ""]
    names += state_names if initial != "none" else []
    finals = ["Y_h", "Y_c"] if cell == "LSTM" else ["Y_h"]
    nodes = [helper.make_node(cell, names, ["Y", *finals], hidden_size=HIDDEN, direction=direction, layout=layout,
                              **attrs)]
    if layout == 0:
        nodes += [helper.make_node("Transpose", ["Y"], ["Y_t"], perm=[0, 2, 1, 3]),
                  helper.make_node("Reshape", ["Y_t", "shape"], ["Y_rows"]),
                  helper.make_node("Gather", ["Y_rows", "last_step"], ["last"], axis=0)]
        shape = [STEPS, -1, directions * HIDDEN]
    else:
        nodes += [helper.make_node("Reshape", ["Y", "shape"], ["Y_rows"]),
                  helper.make_node("Gather", ["Y_rows", "last_step"], ["last"], axis=1)]
        shape = [-1, STEPS, directions * HIDDEN]
    x_shape = [STEPS, batch, FEATURES] if layout == 0 else [batch, STEPS, FEATURES]
    state_shape = [directions, batch, HIDDEN] if layout == 0 else [batch, directions, HIDDEN]
    inputs = [helper.make_tensor_value_info("X", TensorProto.FLOAT, x_shape)]
    if lengths == "input":
        inputs.append(helper.make_tensor_value_info("sequence_lens", TensorProto.INT32, [batch]))
    if initial == "input":
        inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, state_shape) for n in state_names]
    initializers = [numpy_helper.from_array(v, k) for k, v in constants.items()]
    initializers += [numpy_helper.from_array(np.array(shape, np.int64), "shape"),
                     numpy_helper.from_array(np.array(-1, np.int64), "last_step")]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ["last", "Y_rows", *finals]]
    graph = helper.make_graph(nodes, "forecaster", inputs, outputs, initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def some_lengths(rng, batch: int) -> np.ndarray:
    """Lengths in [0, STEPS], a full and an empty one among them where the batch has room."""
    found = rng.integers(0, STEPS + 1, batch).astype(np.int32)
    if batch > 2:
        found[:2] = [STEPS, 0]
    return found


def layout_0_twin(constants: dict[str, np.ndarray], feeds: dict[str, np.ndarray]
                  ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """A layout-1 case's constants and feeds as its layout-0 twin takes them (onnxruntime runs no layout 1): X
    [N, S, I] -> [S, N, I], states [N, D, H] -> [D, N, H]."""
    def moved(k: str, v: np.ndarray) -> np.ndarray:
        return v.transpose(1, 0, 2).copy() if k in ("X", "initial_h", "initial_c") else v
    return {k: moved(k, v) for k, v in constants.items()}, {k: moved(k, v) for k, v in feeds.items()}


def check_layouts(engine, model, twin_of, feeds_of, layout: int, label: str, oracles: tuple[str, ...]) -> None:
    """check_runs for both layouts: a layout-1 model's outputs against its layout-0 twin's (`twin_of(constants)`:
    the twin model) on onnxruntime, transposed back (Y_rows [S, N, D·H] -> [N, S, D·H], states [D, N, H] ->
    [N, D, H]); onnx.reference runs layout 1 itself."""
    if layout == 0:
        return check_runs(engine, model, feeds_of, label, oracles)
    for run in range(2):
        feeds = feeds_of(run)
        got = engine.run(dict(feeds))
        twin, twin_feeds = twin_of(feeds)
        wants = {"ort": [w if o.name == "last" else w.transpose(1, 0, 2)
                         for o, w in zip(model.graph.output, run_oracle(twin, twin_feeds, "ort"))]}
        if "ref" in oracles:
            wants["ref"] = run_oracle(model, feeds, "ref")
        for oracle, want_all in wants.items():
            for output, want in zip(model.graph.output, want_all):
                assert_close(got[output.name], want, TOLERANCE, f"{label} run {run} {output.name} vs {oracle}")


VARIANTS = [("LSTM", "cpu.lstm.fused", {}), ("GRU", "cpu.gru.native", {"linear_before_reset": 0}),
            ("RNN", "cpu.rnn.native", {})]
INITIALS = ["none", "constant", "input"]


@pytest.mark.parametrize("lengths", ["none", "constant", "input"])
@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("cell, tactic, attrs", VARIANTS)
def test_every_variant_runs_inside_the_segment(cell, tactic, attrs, direction, layout, lengths, monkeypatch):
    """Every direction, layout and source of sequence_lens, as a member of the segment with the moves around it (Y is
    written row-major: the Relayout after it reads it so), against onnxruntime (and onnx.reference without lengths:
    its recurrent ops run every row the whole sequence). Initial states (absent, constants, graph inputs) and the
    batch (1, 5) vary from case to case. Outputs past a row's length are zero, Y_h its last valid step's."""
    label = f"{cell}-{attrs}-{direction}-{layout}-{lengths}"
    rng = case_rng(label)
    case = VARIANTS.index((cell, tactic, attrs)) * 18 + ["forward", "reverse", "bidirectional"].index(direction) * 6 \
        + layout * 3 + ["none", "constant", "input"].index(lengths)
    initial, batch = INITIALS[case % 3], (1, BATCH)[case // 3 % 2]
    directions = 2 if direction == "bidirectional" else 1
    constants = weights(rng, cell, directions)

    def states_of(batch: int) -> dict[str, np.ndarray]:
        found = states(rng, cell, directions, batch)
        return {k: v.transpose(1, 0, 2).copy() for k, v in found.items()} if layout else found

    if initial == "constant":
        constants.update(states_of(batch))
    if lengths == "constant":
        constants["sequence_lens"] = some_lengths(rng, batch)
    model = exported_forecaster(cell, attrs, direction, layout, initial, lengths, constants, batch)
    engine = build(model, [tactic, "cpu.alias.Reshape", "cpu.gather.slice", "cpu.relayout.native"], monkeypatch)
    layer = next(s for s in engine.plan.program.steps if s.op_type == cell)
    assert layer.tactic == tactic
    members = segment_members(engine)
    assert layer.name in members and len(members) == len(engine.plan.program.steps), members

    def feeds(run: int) -> dict[str, np.ndarray]:
        x_shape = (STEPS, batch, FEATURES) if layout == 0 else (batch, STEPS, FEATURES)
        fresh = {"X": rng.uniform(-1, 1, x_shape).astype(np.float32)}
        if lengths == "input":
            fresh["sequence_lens"] = some_lengths(rng, batch)
        return fresh | (states_of(batch) if initial == "input" else {})

    def twin_of(feeds: dict[str, np.ndarray]):
        twin_constants, twin_feeds = layout_0_twin(constants, feeds)
        return exported_forecaster(cell, attrs, direction, 0, initial, lengths, twin_constants, batch), twin_feeds

    check_layouts(engine, model, twin_of, feeds, layout, f"{label} initial {initial} batch {batch}",
                  ("ort",) if lengths != "none" else ("ort", "ref"))


@pytest.mark.parametrize("cell, tactic, attrs", [LAYERS[0], LAYERS[1], LAYERS[4]])
def test_other_loops_run_two_directions_of_layout_1_with_lengths(cell, tactic, attrs, monkeypatch):
    """The LSTM's row and lane loops and the GRU's linear_before_reset=1 form, bidirectional in layout 1 with
    lengths and initial states read at run time, inside the segment, against onnxruntime."""
    rng = case_rng(f"others-{tactic}-{attrs}")
    constants = weights(rng, cell, 2)
    model = exported_forecaster(cell, attrs, "bidirectional", 1, "input", "input", constants, BATCH)
    engine = build(model, [tactic, "cpu.alias.Reshape", "cpu.gather.slice", "cpu.relayout.native"], monkeypatch)
    assert next(s.name for s in engine.plan.program.steps if s.op_type == cell) in segment_members(engine)

    def feeds(run: int) -> dict[str, np.ndarray]:
        fresh = {"X": rng.uniform(-1, 1, (BATCH, STEPS, FEATURES)).astype(np.float32),
                 "sequence_lens": some_lengths(rng, BATCH)}
        return fresh | {k: v.transpose(1, 0, 2).copy() for k, v in states(rng, cell, 2, BATCH).items()}

    def twin_of(feeds: dict[str, np.ndarray]):
        return exported_forecaster(cell, attrs, "bidirectional", 0, "input", "input", constants, BATCH), \
            layout_0_twin({}, feeds)[1]

    check_layouts(engine, model, twin_of, feeds, 1, f"bidirectional layout 1 {tactic} {attrs}", ("ort",))


ACTIVATIONS = [
    ("LSTM", {"activations": ["HardSigmoid", "Elu", "Softsign", "Sigmoid", "ScaledTanh", "LeakyRelu"],
              "activation_alpha": [0.3, 0.9, 0.0, 0.0, 0.8, 0.05], "activation_beta": [0.45, 0.0, 0.0, 0.0, 1.3, 0.0],
              "clip": 2.5}),
    ("GRU", {"activations": ["Sigmoid", "Affine", "HardSigmoid", "ThresholdedRelu"], "linear_before_reset": 0,
             "activation_alpha": [0.0, 0.7, 0.25, 0.1], "activation_beta": [0.0, 0.1, 0.5, 0.0]}),
    ("RNN", {"activations": ["Relu", "Tanh"], "clip": 1.5}),
]


@pytest.mark.parametrize("cell, attrs", ACTIVATIONS)
def test_other_activations_per_direction_inside_the_segment(cell, attrs, monkeypatch):
    """Activations of the spec other than the defaults, another set per direction, with their alpha / beta and
    clip, bidirectional with lengths read at run time: the row loop (cpu.<cell>.native) as a segment member, against
    onnxruntime."""
    tactic = f"cpu.{cell.lower()}.native"
    rng = case_rng(f"activations-{cell}")
    constants = weights(rng, cell, 2)
    model = exported_forecaster(cell, attrs, "bidirectional", 0, "input", "input", constants, BATCH)
    engine = build(model, [tactic, "cpu.alias.Reshape", "cpu.gather.slice", "cpu.relayout.native"], monkeypatch)
    assert next(s.tactic for s in engine.plan.program.steps if s.op_type == cell) == tactic
    assert "node" in segment_members(engine)

    def feeds(run: int) -> dict[str, np.ndarray]:
        return {"X": rng.uniform(-1, 1, (STEPS, BATCH, FEATURES)).astype(np.float32),
                "sequence_lens": some_lengths(rng, BATCH)} | states(rng, cell, 2, BATCH)

    check_runs(engine, model, feeds, f"{cell} {attrs['activations']}", ("ort",))


@pytest.mark.parametrize("threads", [1, 2])
def test_two_directions_on_one_and_two_threads(threads, monkeypatch):
    """kiln_recurrent_member runs two directions one per thread at two threads (each loop in order), one after the
    other at one: the same answers either way, lengths and initial states read at run time."""
    rng = case_rng(f"threads-{threads}")
    constants = weights(rng, "LSTM", 2)
    model = exported_forecaster("LSTM", {}, "bidirectional", 0, "input", "input", constants, BATCH)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        engine = build(model, ["cpu.lstm.fused", "cpu.alias.Reshape", "cpu.gather.slice", "cpu.relayout.native"],
                       monkeypatch)
        assert "node" in segment_members(engine)

        def feeds(run: int) -> dict[str, np.ndarray]:
            return {"X": rng.uniform(-1, 1, (STEPS, BATCH, FEATURES)).astype(np.float32),
                    "sequence_lens": some_lengths(rng, BATCH)} | states(rng, "LSTM", 2, BATCH)

        check_runs(engine, model, feeds, f"bidirectional at {threads} thread(s)", ("ort",))
    finally:
        torch.set_num_threads(before)


def test_what_a_segment_cannot_read_stays_a_step_and_inspect_says_why(monkeypatch):
    """sequence_lens as int64 (kiln's launch takes it; ONNX types it int32, which a segment reads): the layer runs as a
    step of its own, kiln inspect names it and why, and the answers are onnxruntime's on the int32 twin."""
    rng = case_rng("int64-lengths")
    constants = weights(rng, "LSTM", 2)
    model = exported_forecaster("LSTM", {}, "bidirectional", 0, "none", "input", constants, BATCH)
    model.graph.input[1].type.tensor_type.elem_type = TensorProto.INT64
    engine = build(model, ["cpu.lstm.fused", "cpu.alias.Reshape", "cpu.gather.slice", "cpu.relayout.native"],
                   monkeypatch)
    assert next(s.tactic for s in engine.plan.program.steps if s.op_type == "LSTM") == "cpu.lstm.fused"
    assert "node" not in segment_members(engine)
    assert "node (LSTM) not a member: sequence_lens is int64 at run time: a segment reads it as int32" \
        in _native_segments(engine.plan)  # what kiln inspect says
    twin = exported_forecaster("LSTM", {}, "bidirectional", 0, "none", "input", constants, BATCH)
    for run in range(2):
        feeds = {"X": rng.uniform(-1, 1, (STEPS, BATCH, FEATURES)).astype(np.float32),
                 "sequence_lens": some_lengths(rng, BATCH)}
        got = engine.run(feeds | {"sequence_lens": feeds["sequence_lens"].astype(np.int64)})
        for output, want in zip(twin.graph.output, run_oracle(twin, feeds, "ort")):
            assert_close(got[output.name], want, TOLERANCE, f"int64 lengths run {run} {output.name}")


def test_lengths_past_the_sequence_are_an_error_naming_the_node(monkeypatch):
    """sequence_lens read at run time with a length past X's time axis (or negative): the segment's call checks them
    and the error names the layer; a constant one fails the tactic's check at build (the op's own code then names it
    per run)."""
    rng = case_rng("bad-lengths")
    model = exported_forecaster("LSTM", {}, "bidirectional", 0, "none", "input", weights(rng, "LSTM", 2), BATCH)
    engine = build(model, ["cpu.lstm.fused", "cpu.alias.Reshape", "cpu.gather.slice", "cpu.relayout.native"],
                   monkeypatch)
    assert "node" in segment_members(engine)
    x = rng.uniform(-1, 1, (STEPS, BATCH, FEATURES)).astype(np.float32)
    for bad in ([STEPS + 1, 1, 2, 3, 4], [1, 2, -1, 3, 4]):
        with pytest.raises(Exception, match=r"'node'.*sequence_lens holds a length outside \[0, seq_length\]"):
            engine.run({"X": x, "sequence_lens": np.array(bad, np.int32)})
    constants = weights(rng, "LSTM", 2) | {"sequence_lens": np.array([STEPS + 2, 1, 2, 3, 4], np.int32)}
    model = exported_forecaster("LSTM", {}, "bidirectional", 0, "none", "constant", constants, BATCH)
    engine = build(model, ["cpu.lstm.fused", "cpu.alias.Reshape", "cpu.gather.slice", "cpu.relayout.native"],
                   monkeypatch)
    assert "node" not in segment_members(engine)
    with pytest.raises(Exception, match=rf"LSTM node 'node': sequence_lens must hold {BATCH} lengths in \[0, {STEPS}\]"):
        engine.run({"X": x})


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


def test_bidirectional_segment_at_other_batches(monkeypatch):
    """A dynamic batch with two directions, lengths and states read at run time, at several batches, with
    onnxruntime's answers. (The Transpose + Reshape after Y stay torch steps here: kiln's relayout pass takes static
    shapes only, so the layer is no segment member at a dynamic batch.)"""
    rng = case_rng("bidirectional-batches")
    constants = weights(rng, "LSTM", 2)
    model = exported_forecaster("LSTM", {}, "bidirectional", 0, "input", "input", constants, "N")
    shapes = {"X": f"{STEPS}x1x{FEATURES},{STEPS}x{BATCH}x{FEATURES},{STEPS}x12x{FEATURES}",
              "sequence_lens": "1,5,12",
              "initial_h": f"2x1x{HIDDEN},2x{BATCH}x{HIDDEN},2x12x{HIDDEN}",
              "initial_c": f"2x1x{HIDDEN},2x{BATCH}x{HIDDEN},2x12x{HIDDEN}"}
    engine = build(model, ["cpu.lstm.fused", "cpu.alias.Reshape", "cpu.gather.slice", "cpu.relayout.native"],
                   monkeypatch, profiles=[shapes])
    for batch in (3, BATCH, 12, 1, 3):
        feeds = {"X": rng.uniform(-1, 1, (STEPS, batch, FEATURES)).astype(np.float32),
                 "sequence_lens": some_lengths(rng, batch)} | states(rng, "LSTM", 2, batch)
        got = engine.run(dict(feeds))
        for output, want in zip(model.graph.output, run_oracle(model, feeds, "ort")):
            assert_close(got[output.name], want, TOLERANCE, f"bidirectional batch {batch} {output.name}")


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
