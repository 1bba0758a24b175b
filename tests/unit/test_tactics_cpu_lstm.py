"""cpu.lstm.native (kiln/kernels/cpu/lstm.c) against onnxruntime: every direction and layout, with and
without bias and initial states, hidden sizes that fill and that do not fill the microkernel's unit
blocks, batches past its row tile; sequence_lens given at run time; and the kernel on another ISA's tile
shape (AVX-512's 14x32, run with AVX2 instructions). Peepholes, clip, activations: test_tactics_cpu_recurrent.py.

Tolerance (fp32): kiln's GEMM and onnxruntime's MLAS sum each gate's dot products in their own orders,
and σ / tanh are rational approximations (~1e-7 from libm's); the recurrence carries each step's
rounding into the next: atol 2e-6 on outputs of order 1 over 7 steps (observed < 5e-7).
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
from kiln.ops import recurrent_fused
from tests.unit.oracle import assert_close, case_rng, one_node_model, run_oracle

NAME = "cpu.lstm.native"
TOLERANCE = {np.dtype(np.float32): (1e-5, 2e-6)}
pytestmark = pytest.mark.skipif(not recurrent.available(), reason=f"kiln's loop is not built: {recurrent.reason()}")


def inputs(rng, *, steps, batch, features, hidden, directions, layout, bias, initial):
    x_shape = (batch, steps, features) if layout else (steps, batch, features)
    state_shape = (batch, directions, hidden) if layout else (directions, batch, hidden)
    values = {"X": rng.uniform(-1, 1, x_shape), "W": rng.uniform(-0.5, 0.5, (directions, 4 * hidden, features)),
              "R": rng.uniform(-0.5, 0.5, (directions, 4 * hidden, hidden))}
    if bias:
        values["B"] = rng.uniform(-0.5, 0.5, (directions, 8 * hidden))
    if initial:
        values["initial_h"] = rng.uniform(-1, 1, state_shape)
        values["initial_c"] = rng.uniform(-1, 1, state_shape)
    return {k: v.astype(np.float32) for k, v in values.items()}


def node(values, attrs, hidden, outputs=("Y", "Y_h", "Y_c")):
    names = [n if n in values else "" for n in ("X", "W", "R", "B", "sequence_lens", "initial_h", "initial_c")]
    while not names[-1]:
        names.pop()
    return helper.make_node("LSTM", names, list(outputs), hidden_size=hidden, **attrs)


def oracle(values, attrs, hidden):
    """onnxruntime's LSTM (it has no layout 1: its layout-0 kernel on the transposed inputs)."""
    layout = attrs.get("layout", 0)
    if layout:
        values = {k: np.swapaxes(v, 0, 1) if k in ("X", "initial_h", "initial_c") else v for k, v in values.items()}
        attrs = {**attrs, "layout": 0}
    outputs = run_oracle(one_node_model(node(values, attrs, hidden), values), values, "ort")
    if layout:  # Y [S, D, N, H] -> [N, S, D, H]; states [D, N, H] -> [N, D, H]
        outputs = [outputs[0].transpose(2, 0, 1, 3)] + [np.swapaxes(s, 0, 1) for s in outputs[1:]]
    return outputs


def runs_match_onnxruntime(built, values, attrs, rng, shape, bias, initial, label):
    """Two runs of `built` with fresh activations and states (the same weights), every output against onnxruntime."""
    for run in range(2):
        fresh = inputs(rng, bias=bias, initial=initial, **shape)
        feeds = {k: v for k, v in fresh.items() if k in ("X", "initial_h", "initial_c")}
        got = built.run(feeds)
        for name, want in zip(["Y", "Y_h", "Y_c"], oracle({**values, **feeds}, attrs, shape["hidden"])):
            assert_close(got[name], want, TOLERANCE, f"{label} run {run} {name}")


def engine(values, attrs, hidden, monkeypatch, sequence_lens: bool = False):
    """The node with W, R, B as engine constants, built with cpu.lstm.native made the fastest."""
    feeds = {k: v for k, v in values.items() if k in ("X", "initial_h", "initial_c")}
    graph_values = dict(values)
    if sequence_lens:
        graph_values["sequence_lens"] = feeds["sequence_lens"] = np.full(values["X"].shape[1], 3, np.int32)  # layout 0: X [S, N, I]
    model = one_node_model(node(graph_values, attrs, hidden), feeds)
    model.graph.initializer.extend(onnx.numpy_helper.from_array(v, k) for k, v in values.items()
                                   if k in ("W", "R", "B"))
    monkeypatch.setattr(autotune, "measure", lambda fns, device, runs=10, **_: {k: 0.0 if k == NAME else 1.0
                                                                                for k in fns})
    return kiln.build(model, tactics=[NAME], timing_cache=None), feeds


@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize("hidden, batch", [(16, 4), (20, 9), (40, 8)])  # one full block; a partial one; 3 blocks
@pytest.mark.parametrize("bias, initial", [(True, True), (False, False)])
def test_lstm_native_matches_onnxruntime(direction, layout, hidden, batch, bias, initial, monkeypatch):
    rng = case_rng(f"lstm-native-{direction}-{layout}-{hidden}-{batch}-{bias}-{initial}")
    directions = 2 if direction == "bidirectional" else 1
    attrs = {"direction": direction, "layout": layout}
    shape = dict(steps=7, batch=batch, features=5, hidden=hidden, directions=directions, layout=layout)
    values = inputs(rng, bias=bias, initial=initial, **shape)
    built, _ = engine(values, attrs, hidden, monkeypatch)
    assert built.plan.program.steps[0].tactic == NAME
    runs_match_onnxruntime(built, values, attrs, rng, shape, bias, initial, f"{direction} layout {layout}")


@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
def test_sequence_lens_runs_in_the_loop(direction, monkeypatch):
    """Per-row lengths given at run time (0 and full among them): Y zero past each length, Y_h / Y_c the
    state at it (zeros for length 0, onnxruntime's answer)."""
    rng = case_rng(f"lstm-lens-{direction}")
    directions = 2 if direction == "bidirectional" else 1
    values = inputs(rng, steps=6, batch=5, features=4, hidden=20, directions=directions, layout=0, bias=True,
                    initial=True)
    built, feeds = engine(values, {"direction": direction}, 20, monkeypatch, sequence_lens=True)
    assert built.plan.program.steps[0].tactic == NAME
    for lengths in ([6, 3, 0, 1, 5], [2, 2, 2, 2, 2]):
        feeds["sequence_lens"] = np.array(lengths, np.int32)
        got = built.run(feeds)
        want = oracle({**values, "sequence_lens": feeds["sequence_lens"]}, {"direction": direction}, 20)
        for name, w in zip(["Y", "Y_h", "Y_c"], want):
            assert_close(got[name], w, TOLERANCE, f"{direction} lengths {lengths} {name}")


@pytest.mark.slow  # the test-kernel build compiles gemm.c's AVX-512 tile for AVX2: a minute, once
def test_avx512_tile_shape_on_this_cpu():
    """The 14x32 tile (unit blocks of 32, rows in one chunk) against torch's LSTM, on AVX2 instructions."""
    kernel = next((k for k in gemm_native.kernels(test_kernels=True) if k.test_only and k.supported), None)
    if kernel is None:
        pytest.skip("no test-only kernel runs on this CPU")
    rng = case_rng("lstm-wide-tile")
    for hidden, batch, steps, features in [(40, 9, 6, 7), (64, 16, 4, 3)]:
        values = inputs(rng, steps=steps, batch=batch, features=features, hidden=hidden, directions=1, layout=0,
                        bias=True, initial=True)
        t = {k: torch.from_numpy(v) for k, v in values.items()}
        layer = recurrent.RecurrentDirection("LSTM", t["W"][0], t["R"][0], t["B"][0], kernel=kernel)
        y, yh, yc = torch.empty(steps, batch, hidden), torch.empty(batch, hidden), torch.empty(batch, hidden)
        layer.run(t["X"], y, t["initial_h"][0], t["initial_c"][0], yh, yc, reverse=False, batch_major=False)
        want = recurrent_fused.run_fused("LSTM", t["X"], t["W"], t["R"], t["B"], None, t["initial_h"], t["initial_c"],
                                         reverse=False, layout=0)
        for name, g, w in zip(["Y", "Y_h", "Y_c"], [y, yh, yc], [want[0][:, 0], want[1][0], want[2][0]]):
            assert_close(g.numpy(), w.numpy(), TOLERANCE, f"{kernel.name} H {hidden} N {batch} {name}")
