"""kiln's LSTM kernels as engines against onnxruntime: cpu.lstm.native (kiln/kernels/cpu/lstm.c, a GEMM per
step), cpu.lstm.lanes (lstm_lanes.c, the batch in the vector lanes) and cpu.lstm.fused (lstm_fused.c, a
step's input projection, recurrent GEMM and cell in one register tile): every direction and layout, with
and without bias and initial states, hidden sizes that fill and that do not fill each kernel's tiles,
batches past its row tile; sequence_lens given at run time; a dynamic batch; one thread and two giving the
same bits; what the fast kernels leave to cpu.lstm.native, and why; and cpu.lstm.native on another ISA's
tile shape (AVX-512's 14x32, run with AVX2 instructions). Each kernel's tiles against torch:
test_tactics_cpu_lstm_lanes.py, test_tactics_cpu_lstm_fused.py. Peepholes, clip, activations: test_tactics_cpu_recurrent.py.

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
from kiln.plan.spec import StepSpec
from kiln.tactics import registry
from kiln.tactics.tactic import InputMeta
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


def engine(values, attrs, hidden, monkeypatch, *, name: str = NAME, sequence_lens: bool = False,
           dynamic_batch: bool = False, max_batch: int = 12):
    """The node with W, R, B as engine constants, built with tactic `name` made the fastest (cpu.lstm.native
    the other candidate); a dynamic batch is tuned at 3 rows and valid up to `max_batch`."""
    feeds = {k: v for k, v in values.items() if k in ("X", "initial_h", "initial_c")}
    graph_values = dict(values)
    if sequence_lens:  # layout 0: X [S, N, I]
        graph_values["sequence_lens"] = feeds["sequence_lens"] = np.full(values["X"].shape[1], 3, np.int32)
    model = one_node_model(node(graph_values, attrs, hidden), feeds)
    if dynamic_batch:  # layout 0: X [S, N, I], states [D, N, H]
        for value in model.graph.input:
            dims = value.type.tensor_type.shape.dim
            dims[1 if value.name in ("X", "initial_h", "initial_c") else 0].dim_param = "N"
    model.graph.initializer.extend(onnx.numpy_helper.from_array(v, k) for k, v in values.items()
                                   if k in ("W", "R", "B"))
    monkeypatch.setattr(autotune, "measure", lambda fns, device, runs=10, **_: {k: 0.0 if k == name else 1.0
                                                                                for k in fns})
    profiles = None
    if dynamic_batch:
        steps, _, features = values["X"].shape
        d, h = values["initial_h"].shape[0], values["initial_h"].shape[2]
        profiles = [{"X": f"{steps}x1x{features},{steps}x3x{features},{steps}x{max_batch}x{features}",
                     "initial_h": f"{d}x1x{h},{d}x3x{h},{d}x{max_batch}x{h}",
                     "initial_c": f"{d}x1x{h},{d}x3x{h},{d}x{max_batch}x{h}"}]
    tactics = sorted({name, NAME})
    return kiln.build(model, tactics=tactics, timing_cache=None, profiles=profiles), feeds


# Each kernel's (hidden, batch) cases: its tiles full, a partial one, and H below a tile / several row groups.
# cpu.lstm.native: unit blocks of 16 (one full, a partial, 3 blocks), batches past its row tile; cpu.lstm.lanes:
# the batch in the vector lanes (up to 8); cpu.lstm.fused: AVX-512 blocks of 16 units, row groups of 1-6 (past 6
# rows the two-pass tile's groups of up to 8: 13 = 7 + 6).
KERNEL_CASES = [(NAME, 16, 4), (NAME, 20, 9), (NAME, 40, 8),
                ("cpu.lstm.lanes", 16, 4), ("cpu.lstm.lanes", 37, 8), ("cpu.lstm.lanes", 7, 1),
                ("cpu.lstm.fused", 32, 4), ("cpu.lstm.fused", 37, 13), ("cpu.lstm.fused", 7, 1),
                ("cpu.lstm.fused_blocks", 37, 13)]
KERNELS = [NAME, "cpu.lstm.lanes", "cpu.lstm.fused"]


@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize("tactic, hidden, batch", KERNEL_CASES)
@pytest.mark.parametrize("bias, initial", [(True, True), (False, False)])
def test_lstm_kernels_match_onnxruntime(tactic, direction, layout, hidden, batch, bias, initial, monkeypatch):
    rng = case_rng(f"{tactic}-{direction}-{layout}-{hidden}-{batch}-{bias}-{initial}")
    directions = 2 if direction == "bidirectional" else 1
    attrs = {"direction": direction, "layout": layout}
    shape = dict(steps=7, batch=batch, features=5, hidden=hidden, directions=directions, layout=layout)
    values = inputs(rng, bias=bias, initial=initial, **shape)
    built, _ = engine(values, attrs, hidden, monkeypatch, name=tactic)
    assert built.plan.program.steps[0].tactic == tactic
    runs_match_onnxruntime(built, values, attrs, rng, shape, bias, initial, f"{tactic} {direction} layout {layout}")


# per batch, lengths given at run time: 9 rows run cpu.lstm.fused's two-pass tile on AVX-512 and cpu.lstm.lanes's
# row loop
LENGTHS = {5: ([6, 3, 0, 1, 5], [2, 2, 2, 2, 2]), 9: ([6, 3, 0, 1, 5, 6, 2, 0, 4], [2] * 9)}


@pytest.mark.parametrize("tactic", KERNELS)
@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("batch", sorted(LENGTHS))
def test_sequence_lens_at_run_time(tactic, direction, batch, monkeypatch):
    """Per-row lengths given at run time (0 and full among them): Y zero past each length, each row's state
    kept past it; Y_h / Y_c the state at the length (zeros for length 0, onnxruntime's answer)."""
    rng = case_rng(f"{tactic}-lens-{direction}-{batch}")
    directions = 2 if direction == "bidirectional" else 1
    values = inputs(rng, steps=6, batch=batch, features=4, hidden=20, directions=directions, layout=0, bias=True,
                    initial=True)
    built, feeds = engine(values, {"direction": direction}, 20, monkeypatch, name=tactic, sequence_lens=True)
    assert built.plan.program.steps[0].tactic == tactic
    for lengths in LENGTHS[batch]:
        feeds["sequence_lens"] = np.array(lengths, np.int32)
        got = built.run(feeds)
        want = oracle({**values, "sequence_lens": feeds["sequence_lens"]}, {"direction": direction}, 20)
        for name, w in zip(["Y", "Y_h", "Y_c"], want):
            assert_close(got[name], w, TOLERANCE, f"{tactic} {direction} lengths {lengths} {name}")


# batches in the order run: cpu.lstm.lanes's 11 is past its lanes (the row loop, built on first use), then the
# lanes again and the rows again; cpu.lstm.fused's 17 is several row groups
@pytest.mark.parametrize("tactic, batches, max_batch", [("cpu.lstm.lanes", (3, 11, 8, 11), 12),
                                                       ("cpu.lstm.fused", (3, 17, 8, 1), 20)])
def test_dynamic_batch(tactic, batches, max_batch, monkeypatch):
    rng = case_rng(f"{tactic}-dynamic")
    values = inputs(rng, steps=5, batch=3, features=6, hidden=24, directions=1, layout=0, bias=True, initial=True)
    built, _ = engine(values, {}, 24, monkeypatch, name=tactic, dynamic_batch=True, max_batch=max_batch)
    assert built.plan.program.steps[0].tactic == tactic
    for batch in batches:
        fresh = inputs(rng, steps=5, batch=batch, features=6, hidden=24, directions=1, layout=0, bias=True,
                       initial=True)
        feeds = {k: v for k, v in fresh.items() if k in ("X", "initial_h", "initial_c")}
        got = built.run(feeds)
        for name, want in zip(["Y", "Y_h", "Y_c"], oracle({**values, **feeds}, {}, 24)):
            assert_close(got[name], want, TOLERANCE, f"{tactic} batch {batch} {name}")


@pytest.mark.parametrize("direction_class, batch", [("LanesLSTMDirection", 7), ("FusedLSTMDirection", 11)])
def test_one_thread_and_all_threads_agree_exactly(direction_class, batch):
    """A tile is computed by one thread in one order whichever claims it: the same bits on 1 and 2 threads."""
    rng = case_rng(f"lstm-threads-{direction_class}")
    values = inputs(rng, steps=9, batch=batch, features=6, hidden=40, directions=1, layout=0, bias=True,
                    initial=True)
    t = {k: torch.from_numpy(v) for k, v in values.items()}
    layer = getattr(recurrent, direction_class)(t["W"][0], t["R"][0], t["B"][0])
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, max(2, threads)):
            torch.set_num_threads(n)
            y, yh, yc = torch.empty(9, batch, 40), torch.empty(batch, 40), torch.empty(batch, 40)
            layer.run(t["X"], y, t["initial_h"][0], t["initial_c"][0], yh, yc, reverse=False, batch_major=False)
            results.append((y, yh, yc))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*results))


def _meta(shape, constant=False, dtype=torch.float32):
    return InputMeta(shape=tuple(shape), dtype=dtype, constant=constant)


REFUSALS = [({"activations": ["Sigmoid", "Tanh", "Relu"]}, {}, "activations"), ({"clip": 2.0}, {}, "clip"),
            ({}, {"P": (1, 24)}, "peepholes")]


@pytest.mark.parametrize("tactic, attrs, extra, reason",
                         [(t, *r) for t in ("cpu.lstm.lanes", "cpu.lstm.fused") for r in REFUSALS]
                         + [("cpu.lstm.fused", {"input_forget": 1}, {}, "input_forget")])
def test_what_the_fast_kernels_leave_to_native_says_why(tactic, attrs, extra, reason):
    metas = [_meta((5, 4, 3)), _meta((1, 32, 3), True), _meta((1, 32, 8), True), _meta((1, 64), True)]
    if "P" in extra:
        metas += [InputMeta(None, None, False)] * 3 + [_meta(extra["P"], True)]
    step = StepSpec(op_type="LSTM", name="layer", inputs=[], outputs=[], attributes={"hidden_size": 8, **attrs})
    answer = registry.get(tactic).supports(step, metas)
    assert answer is not True and reason in answer, answer


# cpu.lstm.lanes: 9 is past the lanes, where a call runs the row loop; cpu.lstm.fused: 33 several row groups
@pytest.mark.parametrize("tactic, batch", [(t, b) for t, bs in (("cpu.lstm.lanes", ("N", 4, 9)),
                                                                ("cpu.lstm.fused", ("N", 4, 33))) for b in bs])
def test_any_batch_is_supported(tactic, batch):
    metas = [_meta((5, batch, 3)), _meta((1, 32, 3), True), _meta((1, 32, 8), True)]
    step = StepSpec(op_type="LSTM", name="layer", inputs=[], outputs=[], attributes={"hidden_size": 8})
    assert registry.get(tactic).supports(step, metas) is True


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
