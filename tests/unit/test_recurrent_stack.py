"""Two recurrent layers in a row inside a native segment, the lower one's Y the upper one's X
(kiln/kernels/cpu/recurrent_member.c's stack): at two threads side by side, the upper layer's step t waiting for the
lower one's; at one thread, or where the stack is not safe, one after the other. Against onnxruntime and
onnx.reference on fresh inputs.

The model: X -> lower layer (RNN, GRU of either form, or LSTM) -> Reshape (drops the direction axis: an alias) ->
upper LSTM -> Reshape -> Gather of the last step; the lower layer's Y rows, both layers' final states are outputs
too. Each case asserts whether the stack ran (the lower member's `stacked`) and every output.

Tolerance (fp32): tests/unit/test_recurrent_native.py's (each gate's sums in kiln's order, rational σ / tanh, the
recurrence carrying each step's rounding over 2 x 7 steps).
"""

from __future__ import annotations

import ctypes

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from kiln.kernels.cpu import onednn, recurrent
from tests.unit.oracle import assert_close, case_rng, run_oracle
from tests.unit.test_recurrent_native import build, some_lengths

TOLERANCE = {np.dtype(np.float32): (1e-5, 4e-6)}  # two layers: twice the one layer's atol
STEPS, BATCH, FEATURES, HIDDEN = 7, 5, 6, 20
GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
pytestmark = pytest.mark.skipif(not (recurrent.available() and onednn.available()),
                                reason="kiln's recurrent loop or oneDNN is unavailable")

# (lower cell, its tactic, its attributes); the upper layer is an LSTM on cpu.lstm.fused
LOWER = [("LSTM", "cpu.lstm.fused", {}), ("GRU", "cpu.gru.native", {"linear_before_reset": 0}),
         ("GRU", "cpu.gru.native", {"linear_before_reset": 1}), ("RNN", "cpu.rnn.native", {})]


def layer_constants(rng, cell: str, prefix: str, inputs: int, directions: int = 1) -> dict[str, np.ndarray]:
    g = GATES[cell]
    return {f"{prefix}W": rng.uniform(-0.5, 0.5, (directions, g * HIDDEN, inputs)).astype(np.float32),
            f"{prefix}R": rng.uniform(-0.5, 0.5, (directions, g * HIDDEN, HIDDEN)).astype(np.float32),
            f"{prefix}B": rng.uniform(-0.5, 0.5, (directions, 2 * g * HIDDEN)).astype(np.float32)}


def stacked_forecaster(lower: str, attrs: dict, constants: dict[str, np.ndarray], *, lengths: bool = False,
                       upper_initial: str = "none", lower_direction: str = "forward") -> onnx.ModelProto:
    """X [S, N, I] -> lower -> Y1 -> Reshape -> upper LSTM -> Y2 -> Reshape -> Gather(last). `upper_initial`: "none",
    "input" (graph inputs), "constant" (initializers in `constants`) or "lower" (an LSTM lower layer's Y_h and Y_c:
    what the stack must not overlap); `lengths`: one int32 sequence_lens input read by both layers."""
    directions = 2 if lower_direction == "bidirectional" else 1
    lower_finals = ["Y1_h", "Y1_c"] if lower == "LSTM" else ["Y1_h"]
    length_name = "sequence_lens" if lengths else ""
    upper_states = {"none": [], "lower": ["Y1_h", "Y1_c"]}.get(upper_initial, ["initial_h", "initial_c"])
    nodes = [helper.make_node(lower, ["X", "lW", "lR", "lB", length_name], ["Y1", *lower_finals], hidden_size=HIDDEN,
                              direction=lower_direction, **attrs),
             helper.make_node("Reshape", ["Y1", "rows1"], ["Y1_rows"]),
             helper.make_node("LSTM", ["Y1_rows", "uW", "uR", "uB", length_name, *upper_states], ["Y2", "Y2_h", "Y2_c"],
                              hidden_size=HIDDEN),
             helper.make_node("Reshape", ["Y2", "rows2"], ["Y2_rows"]),
             helper.make_node("Gather", ["Y2_rows", "last_step"], ["last"], axis=0)]
    inputs = [helper.make_tensor_value_info("X", TensorProto.FLOAT, [STEPS, BATCH, FEATURES])]
    if lengths:
        inputs.append(helper.make_tensor_value_info("sequence_lens", TensorProto.INT32, [BATCH]))
    if upper_initial == "input":
        inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, BATCH, HIDDEN]) for n in upper_states]
    initializers = [numpy_helper.from_array(v, k) for k, v in constants.items()]
    initializers += [numpy_helper.from_array(np.array([STEPS, -1, directions * HIDDEN], np.int64), "rows1"),
                     numpy_helper.from_array(np.array([STEPS, -1, HIDDEN], np.int64), "rows2"),
                     numpy_helper.from_array(np.array(-1, np.int64), "last_step")]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None)
               for n in ["last", "Y1_rows", *lower_finals, "Y2_h", "Y2_c"]]
    graph = helper.make_graph(nodes, "stacked", inputs, outputs, initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def recurrent_calls(engine) -> list[recurrent.RecurrentCall]:
    return [b for s in engine.program.segments for b in s.bound if isinstance(b, recurrent.RecurrentCall)]


def check_stack(model: onnx.ModelProto, tactics: list[str], feeds_of, threads: int, stacks: bool, label: str,
                monkeypatch, oracles: tuple[str, ...] = ("ort", "ref"), links: int = 1, mode: str = "always") -> None:
    """`model` built and run at `threads` with recurrent.set_stacking(mode): both layers members of one segment,
    `links` of them linked (0: a layer between them), the stack run where `stacks`, every output as each oracle's
    on three runs of fresh inputs."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    recurrent.set_stacking(mode)  # "always": the stack wherever it is safe (by default, the form measured faster)
    try:
        engine = build(model, [*tactics, "cpu.alias.Reshape", "cpu.gather.slice"], monkeypatch)
        calls = recurrent_calls(engine)
        assert len(calls) == 2, f"{label}: {len(calls)} recurrent members"
        assert sum(s.stacked for s in engine.program.segments) == links, f"{label}: links"
        for run in range(3):
            feeds = feeds_of(run)
            got = engine.run(dict(feeds))
            assert calls[0].stacked == stacks, f"{label} run {run}: stacked {calls[0].stacked}, expected {stacks}"
            for oracle in oracles:
                for output, want in zip(model.graph.output, run_oracle(model, feeds, oracle)):
                    assert_close(got[output.name], want, TOLERANCE, f"{label} run {run} {output.name} vs {oracle}")
    finally:
        torch.set_num_threads(before)
        recurrent.set_stacking("measured")


def x_of(rng) -> np.ndarray:
    return rng.uniform(-1, 1, (STEPS, BATCH, FEATURES)).astype(np.float32)


@pytest.mark.parametrize("variant", ["plain", "lengths and states", "constant states"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("lower, tactic, attrs", LOWER)
def test_stacked_layers_run_side_by_side_at_two_threads(lower, tactic, attrs, threads, variant, monkeypatch):
    rng = case_rng(f"stack-{lower}-{attrs}-{threads}-{variant}")
    constants = layer_constants(rng, lower, "l", FEATURES) | layer_constants(rng, "LSTM", "u", HIDDEN)
    extra = variant == "lengths and states"
    if variant == "constant states":
        constants |= {n: rng.uniform(-1, 1, (1, BATCH, HIDDEN)).astype(np.float32) for n in ("initial_h", "initial_c")}
    model = stacked_forecaster(lower, attrs, constants, lengths=extra,
                               upper_initial={"plain": "none", "lengths and states": "input"}.get(variant, "constant"))

    def feeds(run: int) -> dict[str, np.ndarray]:
        found = {"X": x_of(rng)}
        if extra:
            found["sequence_lens"] = some_lengths(rng, BATCH)
            found |= {n: rng.uniform(-1, 1, (1, BATCH, HIDDEN)).astype(np.float32) for n in ("initial_h", "initial_c")}
        return found

    oracles = ("ort",) if extra else ("ort", "ref")  # onnx.reference runs every row the whole sequence
    check_stack(model, sorted({tactic, "cpu.lstm.fused"}), feeds, threads, threads == 2, f"{lower} {attrs} {variant}",
                monkeypatch, oracles)


@pytest.mark.parametrize("case", ["upper states from the lower layer", "bidirectional lower layer",
                                  "reverse lower layer", "lanes"])
def test_what_the_stack_cannot_overlap_runs_in_turn(case, monkeypatch):
    """Run one after the other: the upper layer's initial states are the lower one's final states (written after its
    last step); the lanes loop (X read, Y written outside its loop over time); not even linked, a reverse lower layer
    (Y's first step written last) or one of two directions (and the Transpose between them is a layer)."""
    rng = case_rng(f"in-turn-{case}")
    directions = 2 if case == "bidirectional lower layer" else 1
    constants = layer_constants(rng, "LSTM", "l", FEATURES, directions)
    constants |= layer_constants(rng, "LSTM", "u", HIDDEN * directions)
    direction = {"bidirectional lower layer": "bidirectional", "reverse lower layer": "reverse"}.get(case, "forward")
    model = stacked_forecaster("LSTM", {}, constants, lower_direction=direction,
                               upper_initial="lower" if case == "upper states from the lower layer" else "none")
    if directions == 2:  # Y1 [S, 2, N, H] -> [S, N, 2H] needs the exporter's Transpose: the rows of one direction
        model = bidirectional_rows(model)
    tactic = "cpu.lstm.lanes" if case == "lanes" else "cpu.lstm.fused"
    check_stack(model, [tactic, "cpu.relayout.native"] if directions == 2 else [tactic],
                lambda run: {"X": x_of(rng)}, 2, False, case, monkeypatch, links=int(direction == "forward"))


def bidirectional_rows(model: onnx.ModelProto) -> onnx.ModelProto:
    """Y1 [S, 2, N, H] -> Transpose(0, 2, 1, 3) -> Reshape [S, N, 2H], as torch's exporter writes it."""
    graph = model.graph
    reshape = next(n for n in graph.node if n.output[0] == "Y1_rows")
    reshape.input[0] = "Y1_t"
    transpose = helper.make_node("Transpose", ["Y1"], ["Y1_t"], perm=[0, 2, 1, 3])
    nodes = [graph.node[0], transpose, *graph.node[1:]]
    del graph.node[:]
    graph.node.extend(nodes)
    return model


@pytest.mark.parametrize("threads", [1, 2])
def test_a_lower_layer_reading_a_value_of_the_segment(threads, monkeypatch):
    """X batch-first, transposed to [S, N, I] by a layer of the segment (as torch's exporter writes a batch_first
    forecaster): that value lives in the segment's memory, which the upper layer's Y may reuse once the lower layer,
    run in turn, is done with it; stacked, the segment keeps it live through the upper layer (NativeStep.overlaps_next)
    and the stack runs."""
    rng = case_rng(f"stack-entry-relayout-{threads}")
    constants = layer_constants(rng, "LSTM", "l", FEATURES) | layer_constants(rng, "LSTM", "u", HIDDEN)
    model = stacked_forecaster("LSTM", {}, constants)
    graph = model.graph
    graph.node[0].input[0] = "X_steps"
    nodes = [helper.make_node("Transpose", ["X"], ["X_steps"], perm=[1, 0, 2]), *graph.node]
    del graph.node[:]
    graph.node.extend(nodes)
    graph.input[0].type.tensor_type.shape.dim[0].dim_value, graph.input[0].type.tensor_type.shape.dim[1].dim_value = \
        BATCH, STEPS
    check_stack(model, ["cpu.lstm.fused", "cpu.relayout.native"],
                lambda run: {"X": rng.uniform(-1, 1, (BATCH, STEPS, FEATURES)).astype(np.float32)}, threads,
                threads == 2, f"X transposed in the segment, {threads} thread(s)", monkeypatch)


def test_measured_form_alternates_then_keeps_answers(monkeypatch):
    """The default ("measured"): the pair's first runs alternate between one after the other and the stack (each
    timed in the lower member's call), every run with onnxruntime's answers."""
    rng = case_rng("stack-measured")
    constants = layer_constants(rng, "LSTM", "l", FEATURES) | layer_constants(rng, "LSTM", "u", HIDDEN)
    model = stacked_forecaster("LSTM", {}, constants)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        engine = build(model, ["cpu.lstm.fused", "cpu.alias.Reshape", "cpu.gather.slice"], monkeypatch)
        lower = recurrent_calls(engine)[0]
        forms = []
        for run in range(6):
            feeds = {"X": x_of(rng)}
            got = engine.run(dict(feeds))
            forms.append(lower.stacked)
            for output, want in zip(model.graph.output, run_oracle(model, feeds, "ort")):
                assert_close(got[output.name], want, TOLERANCE, f"measured run {run} {output.name}")
        assert forms == [False, True] * 3
    finally:
        torch.set_num_threads(before)


def test_stack_choice_takes_the_faster_form_and_probes_the_other():
    """recurrent_member.c's stack_choice on made-up times: the forms alternate until each has three counted times
    (the first run of each not counted), then the lower median runs, the other every 16th run; faster probes move
    the choice once they move the median."""
    lib = recurrent.load()
    choice = recurrent._StackChoice()
    address = ctypes.addressof(choice)

    def run(times: dict[int, int]) -> int:
        form = lib.kiln_recurrent_stack_form(address)
        lib.kiln_recurrent_stack_record(address, form, times[form])
        return form

    slow_stack = {0: 1000, 1: 1500}
    assert [run(slow_stack) for _ in range(8)] == [0, 1] * 4  # warm-up pair, then three counted of each
    assert choice.best == 0
    later = [run(slow_stack) for _ in range(32)]
    assert later.count(1) == 2 and all(later[k] == 1 for k in range(32) if (8 + k) % 16 == 0)
    fast_stack = {0: 1000, 1: 600}  # the machine changed: the stack now wins at each probe
    forms = [run(fast_stack) for _ in range(48)]  # runs 40..87: the stack probed at 48 and 64
    assert forms[:25] == [0] * 8 + [1] + [0] * 15 + [1]  # the second probe moves the stack's median below in turn's
    assert forms[25:] == [1] * 15 + [0] + [1] * 7  # then in turn is the form probed (run 80)


def test_stack_never_runs_in_turn_with_the_same_answers(monkeypatch):
    """recurrent.set_stacking("never") (a benchmark's other side): the same engine, one layer after the other."""
    rng = case_rng("stack-off")
    constants = layer_constants(rng, "LSTM", "l", FEATURES) | layer_constants(rng, "LSTM", "u", HIDDEN)
    model = stacked_forecaster("LSTM", {}, constants)
    check_stack(model, ["cpu.lstm.fused"], lambda run: {"X": x_of(rng)}, 2, False, "stack never", monkeypatch,
                mode="never")
