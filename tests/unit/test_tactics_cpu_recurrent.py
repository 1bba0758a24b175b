"""cpu.rnn.native and cpu.gru.native (kiln/kernels/cpu/recurrent.c) against onnxruntime: every direction and
layout, with and without bias and initial states, both GRU linear_before_reset values, hidden sizes that fill
and that do not fill the microkernel's unit blocks, batches past its row tile; sequence_lens at run time;
clip and the activations of the spec (with alpha / beta) for all three cells, LSTM peepholes and
input_forget; and what the tactics refuse (they say why in supports) running the op's own path.

Tolerance (fp32): kiln's GEMM and onnxruntime's MLAS sum each gate's dot products in their own orders,
and σ / tanh are rational approximations (~1e-7 from libm's); the recurrence carries each step's
rounding into the next: atol 2e-6 on outputs of order 1 over 7 steps (GRU, LSTM: observed < 7e-7). The
RNN has no gate between its pre-activation (a sum of H + I products, |·| up to ~5 here) and h, so each
step's rounding passes on undamped: atol 5e-6 (observed 2.5e-6 at H = 40). A Relu RNN's outputs are
unbounded (they grow to ~10 here): rtol 1e-5 covers them.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import helper

import kiln
from kiln.builder import autotune
from kiln.kernels.cpu import gemm_native, recurrent
from kiln.plan.spec import StepSpec
from kiln.tactics import registry
from kiln.tactics.tactic import InputMeta
from tests.unit.oracle import assert_close, case_rng, one_node_model, run_oracle

TOLERANCE = {np.dtype(np.float32): (1e-5, 2e-6)}
RNN_TOLERANCE = {np.dtype(np.float32): (1e-5, 5e-6)}
GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
STATES = {"RNN": ["initial_h"], "GRU": ["initial_h"], "LSTM": ["initial_h", "initial_c"]}
OUTPUTS = {"RNN": ["Y", "Y_h"], "GRU": ["Y", "Y_h"], "LSTM": ["Y", "Y_h", "Y_c"]}
INPUTS = ["X", "W", "R", "B", "sequence_lens", "initial_h", "initial_c", "P"]
CONSTANTS = ("W", "R", "B", "P")
pytestmark = pytest.mark.skipif(not recurrent.available(), reason=f"kiln's loop is not built: {recurrent.reason()}")


def tactic(cell: str) -> str:
    return f"cpu.{cell.lower()}.native"


def inputs(cell, rng, *, steps, batch, features, hidden, directions, layout, bias, initial, peepholes=False):
    gates = GATES[cell]
    x_shape = (batch, steps, features) if layout else (steps, batch, features)
    state_shape = (batch, directions, hidden) if layout else (directions, batch, hidden)
    values = {"X": rng.uniform(-1, 1, x_shape), "W": rng.uniform(-0.5, 0.5, (directions, gates * hidden, features)),
              "R": rng.uniform(-0.5, 0.5, (directions, gates * hidden, hidden))}
    if bias:
        values["B"] = rng.uniform(-0.5, 0.5, (directions, 2 * gates * hidden))
    if initial:
        for name in STATES[cell]:
            values[name] = rng.uniform(-1, 1, state_shape)
    if peepholes:
        values["P"] = rng.uniform(-0.5, 0.5, (directions, 3 * hidden))
    return {k: v.astype(np.float32) for k, v in values.items()}


def node(cell, values, attrs, hidden):
    names = [n if n in values else "" for n in INPUTS[:len(INPUTS) if cell == "LSTM" else 6]]
    while not names[-1]:
        names.pop()
    return helper.make_node(cell, names, OUTPUTS[cell], hidden_size=hidden, **attrs)


def oracle(cell, values, attrs, hidden, which="ort"):
    """onnxruntime's layer (it has no layout 1: its layout-0 kernel on the transposed inputs)."""
    layout = attrs.get("layout", 0)
    if layout:
        values = {k: np.swapaxes(v, 0, 1) if k in ("X", *STATES[cell]) else v for k, v in values.items()}
        attrs = {**attrs, "layout": 0}
    outputs = run_oracle(one_node_model(node(cell, values, attrs, hidden), values), values, which)
    if layout:  # Y [S, D, N, H] -> [N, S, D, H]; states [D, N, H] -> [N, D, H]
        outputs = [outputs[0].transpose(2, 0, 1, 3)] + [np.swapaxes(s, 0, 1) for s in outputs[1:]]
    return outputs


def feeds_of(values):
    return {k: v for k, v in values.items() if k not in CONSTANTS}


def engine(cell, values, attrs, hidden, monkeypatch):
    """The node with W, R, B, P as engine constants, built with the cell's native tactic made the fastest."""
    model = one_node_model(node(cell, values, attrs, hidden), feeds_of(values))
    model.graph.initializer.extend(onnx.numpy_helper.from_array(v, k) for k, v in values.items() if k in CONSTANTS)
    name = tactic(cell)
    monkeypatch.setattr(autotune, "measure", lambda fns, device, runs=10, **_: {k: 0.0 if k == name else 1.0
                                                                                for k in fns})
    return kiln.build(model, tactics=[name], timing_cache=None)


def check_runs(cell, built, values, attrs, hidden, rng, shape, *, bias, initial, runs=2, which="ort", lengths=None):
    for run in range(runs):  # fresh activations and states each run, the same weights
        fresh = {**values, **feeds_of(inputs(cell, rng, bias=bias, initial=initial, **shape))}
        if lengths is not None:
            fresh["sequence_lens"] = np.asarray(lengths[run % len(lengths)], np.int32)
        got = built.run(feeds_of(fresh))
        for name, want in zip(OUTPUTS[cell], oracle(cell, fresh, attrs, hidden, which)):
            assert_close(got[name], want, RNN_TOLERANCE if cell == "RNN" else TOLERANCE,
                         f"{cell} {attrs} run {run} {name}")


@pytest.mark.parametrize("cell, attrs", [("RNN", {}), ("GRU", {"linear_before_reset": 0}),
                                         ("GRU", {"linear_before_reset": 1})])
@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize("hidden, batch", [(16, 4), (20, 9), (40, 8)])  # one full block; a partial one; 3 blocks
@pytest.mark.parametrize("bias, initial", [(True, True), (False, False)])
def test_native_matches_onnxruntime(cell, attrs, direction, layout, hidden, batch, bias, initial, monkeypatch):
    rng = case_rng(f"{cell}-native-{attrs}-{direction}-{layout}-{hidden}-{batch}-{bias}-{initial}")
    attrs = {**attrs, "direction": direction, "layout": layout}
    shape = dict(steps=7, batch=batch, features=5, hidden=hidden, directions=2 if direction == "bidirectional" else 1,
                 layout=layout)
    values = inputs(cell, rng, bias=bias, initial=initial, **shape)
    built = engine(cell, values, attrs, hidden, monkeypatch)
    assert built.plan.program.steps[0].tactic == tactic(cell)
    check_runs(cell, built, values, attrs, hidden, rng, shape, bias=bias, initial=initial)


@pytest.mark.parametrize("cell, attrs", [("RNN", {}), ("GRU", {"linear_before_reset": 0}),
                                         ("GRU", {"linear_before_reset": 1})])
@pytest.mark.parametrize("direction, layout", [("forward", 0), ("reverse", 1), ("bidirectional", 0)])
def test_sequence_lens_matches_onnxruntime(cell, attrs, direction, layout, monkeypatch):
    """Per-row lengths at run time (0 and full among them): Y zero past each length, Y_h the state at it."""
    rng = case_rng(f"{cell}-lens-{attrs}-{direction}-{layout}")
    attrs = {**attrs, "direction": direction, "layout": layout}
    shape = dict(steps=6, batch=5, features=4, hidden=20, directions=2 if direction == "bidirectional" else 1,
                 layout=layout)
    values = {**inputs(cell, rng, bias=True, initial=True, **shape), "sequence_lens": np.full(5, 6, np.int32)}
    built = engine(cell, values, attrs, 20, monkeypatch)
    assert built.plan.program.steps[0].tactic == tactic(cell)
    check_runs(cell, built, values, attrs, 20, rng, shape, bias=True, initial=True,
               lengths=[[6, 3, 0, 1, 5], [2, 2, 2, 2, 2], [6, 6, 6, 6, 6]], runs=3)


OPTIONS = [  # (cell, attributes, peepholes): what runs in the loop past the defaults
    ("RNN", {"activations": ["Relu"]}, False),
    ("RNN", {"activations": ["Sigmoid", "LeakyRelu"], "activation_alpha": [0.2], "direction": "bidirectional"},
     False),
    ("RNN", {"clip": 0.4}, False),
    ("GRU", {"activations": ["HardSigmoid", "Softsign"], "activation_alpha": [0.3], "activation_beta": [0.45]},
     False),
    ("GRU", {"activations": ["Sigmoid", "ScaledTanh"], "activation_alpha": [1.5], "activation_beta": [0.7],
             "linear_before_reset": 1}, False),
    ("GRU", {"clip": 0.3, "linear_before_reset": 1}, False),
    ("GRU", {"clip": 0.3}, False),
    ("LSTM", {"activations": ["Sigmoid", "Elu", "Affine"], "activation_alpha": [0.8, 0.5],
              "activation_beta": [0.1]}, False),
    ("LSTM", {"clip": 0.5}, False),
    ("LSTM", {}, True),
    ("LSTM", {"input_forget": 1, "direction": "bidirectional"}, True),
]


@pytest.mark.parametrize("cell, attrs, peepholes", OPTIONS, ids=[f"{c}-{a}-{p}" for c, a, p in OPTIONS])
def test_options_match_onnxruntime(cell, attrs, peepholes, monkeypatch):
    rng = case_rng(f"{cell}-options-{attrs}-{peepholes}")
    directions = 2 if attrs.get("direction") == "bidirectional" else 1
    shape = dict(steps=7, batch=9, features=5, hidden=20, directions=directions, layout=0)
    values = inputs(cell, rng, bias=True, initial=True, peepholes=peepholes, **shape)
    built = engine(cell, values, attrs, 20, monkeypatch)
    assert built.plan.program.steps[0].tactic == tactic(cell)
    check_runs(cell, built, values, attrs, 20, rng, shape, bias=True, initial=True, runs=1)


def meta(values, constant=CONSTANTS):
    return [InputMeta.of(torch.from_numpy(values[n]) if n in values else None, n in constant) for n in INPUTS]


@pytest.mark.parametrize("cell, attrs, constant, reason", [
    ("GRU", {"activations": ["Softplus", "Tanh"]}, CONSTANTS, "activations ['softplus']"),
    ("RNN", {"activations": ["Tanh", "Tanh"]}, CONSTANTS, "2 activations for 1 direction"),
    ("RNN", {}, ("R", "B"), "W and R are not constant"),
    ("GRU", {"clip": -1.0}, CONSTANTS, "clip=-1.0 is not positive"),
])
def test_refusals_say_why(cell, attrs, constant, reason):
    values = inputs(cell, case_rng(f"{cell}-refuse-{reason}"), steps=3, batch=2, features=4, hidden=8, directions=1,
                    layout=0, bias=True, initial=False)
    step = StepSpec(op_type=cell, name="layer", inputs=[n for n in INPUTS if n in values], outputs=OUTPUTS[cell],
                    attributes={"hidden_size": 8, **attrs})
    verdict = registry.get(tactic(cell)).supports(step, meta(values, constant))
    assert isinstance(verdict, str) and reason in verdict, verdict


def test_refused_layer_runs_the_ops_path(monkeypatch):
    """A Softplus GRU is left to kiln/ops/rnn.py's step loop, and matches onnxruntime."""
    rng = case_rng("gru-softplus")
    attrs = {"activations": ["Sigmoid", "Softplus"]}
    shape = dict(steps=5, batch=3, features=4, hidden=8, directions=1, layout=0)
    values = inputs("GRU", rng, bias=True, initial=True, **shape)
    built = engine("GRU", values, attrs, 8, monkeypatch)
    assert built.plan.program.steps[0].tactic in ("", None, "default")
    check_runs("GRU", built, values, attrs, 8, rng, shape, bias=True, initial=True, runs=1)


@pytest.mark.slow  # the test-kernel build compiles gemm.c's AVX-512 tile for AVX2: a minute, once
@pytest.mark.parametrize("cell, attrs", [("RNN", {}), ("GRU", {"linear_before_reset": 0}),
                                         ("GRU", {"linear_before_reset": 1})])
def test_avx512_tile_shape_on_this_cpu(cell, attrs):
    """The 14x32 tile (unit blocks of 32, rows in one chunk) against onnxruntime, on AVX2 instructions."""
    kernel = next((k for k in gemm_native.kernels(test_kernels=True) if k.test_only and k.supported), None)
    if kernel is None:
        pytest.skip("no test-only kernel runs on this CPU")
    rng = case_rng(f"{cell}-wide-tile-{attrs}")
    for hidden, batch, steps, features in [(40, 9, 6, 7), (64, 16, 4, 3)]:
        values = inputs(cell, rng, steps=steps, batch=batch, features=features, hidden=hidden, directions=1,
                        layout=0, bias=True, initial=True)
        t = {k: torch.from_numpy(v) for k, v in values.items()}
        layer = recurrent.RecurrentDirection(cell, t["W"][0], t["R"][0], t["B"][0], kernel=kernel,
                                             linear_before_reset=bool(attrs.get("linear_before_reset")))
        y, yh = torch.empty(steps, batch, hidden), torch.empty(batch, hidden)
        layer.run(t["X"], y, t["initial_h"][0], None, yh, None, reverse=False, batch_major=False)
        want = oracle(cell, values, attrs, hidden)
        tolerance = RNN_TOLERANCE if cell == "RNN" else TOLERANCE
        assert_close(y.numpy(), want[0][:, 0], tolerance, f"{kernel.name} H {hidden} N {batch} Y")
        assert_close(yh.numpy(), want[1][0], tolerance, f"{kernel.name} H {hidden} N {batch} Y_h")


@pytest.mark.parametrize("cell, lbr", [("RNN", False), ("GRU", False), ("GRU", True), ("LSTM", False)])
def test_one_thread_and_all_threads_agree_exactly(cell, lbr):
    """Each unit block is one work item computed by one thread in one order, whichever thread claims it (and a
    call whose helper stalled goes on alone): a call on one thread gives the very bits of a call on all."""
    rng = case_rng(f"{cell}-threads-{lbr}")
    values = inputs(cell, rng, steps=9, batch=7, features=6, hidden=40, directions=1, layout=0, bias=True,
                    initial=True)
    t = {k: torch.from_numpy(v) for k, v in values.items()}
    layer = recurrent.RecurrentDirection(cell, t["W"][0], t["R"][0], t["B"][0], linear_before_reset=lbr)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, max(2, threads)):
            torch.set_num_threads(n)
            y, yh = torch.empty(9, 7, 40), torch.empty(7, 40)
            yc = torch.empty(7, 40) if cell == "LSTM" else None
            c0 = t["initial_c"][0] if cell == "LSTM" else None
            layer.run(t["X"], y, t["initial_h"][0], c0, yh, yc, reverse=False, batch_major=False)
            results.append((y, yh))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
