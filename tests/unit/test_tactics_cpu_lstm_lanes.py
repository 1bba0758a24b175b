"""cpu.lstm.lanes (kiln/kernels/cpu/lstm_lanes.c: the batch in the vector lanes) against onnxruntime and
torch's LSTM: every direction and layout, with and without bias and initial states, hidden sizes that fill
and that do not fill a tile of units, batches of 1 to the lanes' 8; sequence_lens at run time (0 and full
among them); a dynamic batch past the lanes (the row loop takes it); each tile this CPU runs (the portable
one and AVX-512's 6-unit tile on AVX2 instructions included); one thread and two giving the same bits; and
what the tactic leaves to cpu.lstm.native.

Tolerance (fp32): as test_tactics_cpu_lstm.py (the same σ / tanh rational forms, the dot products summed
in another order than MLAS's, each step's rounding carried into the next): atol 2e-6 over 7 steps.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

import kiln
from kiln.builder import autotune
from kiln.kernels.cpu import recurrent
from kiln.ops import recurrent_fused
from kiln.plan.spec import StepSpec
from kiln.tactics import registry
from kiln.tactics.tactic import InputMeta
from tests.unit.oracle import assert_close, case_rng, one_node_model
from tests.unit.test_tactics_cpu_lstm import inputs, node, oracle, runs_match_onnxruntime

NAME = "cpu.lstm.lanes"
TOLERANCE = {np.dtype(np.float32): (1e-5, 2e-6)}
pytestmark = pytest.mark.skipif(not recurrent.available(), reason=f"kiln's loop is not built: {recurrent.reason()}")


def engine(values, attrs, hidden, monkeypatch, *, sequence_lens: bool = False, dynamic_batch: bool = False,
           name: str = NAME, max_batch: int = 12):
    """The node with W, R, B as engine constants, built with `name` (cpu.lstm.lanes) made the fastest; a dynamic
    batch is tuned at 3 rows and valid up to `max_batch`."""
    feeds = {k: v for k, v in values.items() if k in ("X", "initial_h", "initial_c")}
    graph_values = dict(values)
    if sequence_lens:
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
        d, hidden_ = values["initial_h"].shape[0], values["initial_h"].shape[2]
        top = max_batch
        profiles = [{"X": f"{steps}x1x{features},{steps}x3x{features},{steps}x{top}x{features}",
                     "initial_h": f"{d}x1x{hidden_},{d}x3x{hidden_},{d}x{top}x{hidden_}",
                     "initial_c": f"{d}x1x{hidden_},{d}x3x{hidden_},{d}x{top}x{hidden_}"}]
    return kiln.build(model, tactics=[name, "cpu.lstm.native"], timing_cache=None, profiles=profiles), feeds


@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize("hidden, batch", [(16, 4), (37, 8), (7, 1)])  # tiles full; a partial tile; H < a tile
@pytest.mark.parametrize("bias, initial", [(True, True), (False, False)])
def test_lanes_matches_onnxruntime(direction, layout, hidden, batch, bias, initial, monkeypatch):
    rng = case_rng(f"lstm-lanes-{direction}-{layout}-{hidden}-{batch}-{bias}-{initial}")
    directions = 2 if direction == "bidirectional" else 1
    attrs = {"direction": direction, "layout": layout}
    shape = dict(steps=7, batch=batch, features=5, hidden=hidden, directions=directions, layout=layout)
    values = inputs(rng, bias=bias, initial=initial, **shape)
    built, _ = engine(values, attrs, hidden, monkeypatch)
    assert built.plan.program.steps[0].tactic == NAME
    runs_match_onnxruntime(built, values, attrs, rng, shape, bias, initial, f"{direction} layout {layout}")


@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
def test_sequence_lens_in_the_lanes(direction, monkeypatch):
    """Per-row lengths at run time (0 and full among them): each lane keeps its state past its length and
    writes zeros to Y; Y_h / Y_c the state at the length (zeros for length 0, onnxruntime's answer)."""
    rng = case_rng(f"lstm-lanes-lens-{direction}")
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


def test_dynamic_batch_past_the_lanes_runs_the_row_loop(monkeypatch):
    rng = case_rng("lstm-lanes-dynamic")
    values = inputs(rng, steps=5, batch=3, features=6, hidden=24, directions=1, layout=0, bias=True, initial=True)
    built, _ = engine(values, {}, 24, monkeypatch, dynamic_batch=True)
    assert built.plan.program.steps[0].tactic == NAME
    for batch in (3, 11, 8, 11):  # lanes, rows (built on first use), lanes, rows again
        fresh = inputs(rng, steps=5, batch=batch, features=6, hidden=24, directions=1, layout=0, bias=True,
                       initial=True)
        feeds = {k: v for k, v in fresh.items() if k in ("X", "initial_h", "initial_c")}
        got = built.run(feeds)
        for name, want in zip(["Y", "Y_h", "Y_c"], oracle({**values, **feeds}, {}, 24)):
            assert_close(got[name], want, TOLERANCE, f"batch {batch} {name}")


def _torch_check(kernel, rng, label):
    for hidden, batch, steps, features in [(40, 8, 6, 7), (13, 3, 4, 3)]:  # 40 = 6·6 + 4: a partial tile
        values = inputs(rng, steps=steps, batch=batch, features=features, hidden=hidden, directions=1, layout=0,
                        bias=True, initial=True)
        t = {k: torch.from_numpy(v) for k, v in values.items()}
        layer = recurrent.LanesLSTMDirection(t["W"][0], t["R"][0], t["B"][0], kernel=kernel)
        y, yh, yc = torch.empty(steps, batch, hidden), torch.empty(batch, hidden), torch.empty(batch, hidden)
        layer.run(t["X"], y, t["initial_h"][0], t["initial_c"][0], yh, yc, reverse=False, batch_major=False)
        want = recurrent_fused.run_fused("LSTM", t["X"], t["W"], t["R"], t["B"], None, t["initial_h"],
                                         t["initial_c"], reverse=False, layout=0)
        for name, g, w in zip(["Y", "Y_h", "Y_c"], [y, yh, yc], [want[0][:, 0], want[1][0], want[2][0]]):
            assert_close(g.numpy(), w.numpy(), TOLERANCE, f"{label} H {hidden} N {batch} {name}")


def test_every_tile_this_cpu_runs_matches_torch():
    """AVX-512 (where the CPU has it), AVX2, and the portable tile every CPU runs, against torch's LSTM."""
    kernels = [k for k in recurrent.lanes_kernels() if k.supported and not k.test_only]
    assert any(k.name.startswith("generic") for k in kernels)
    for kernel in kernels:
        _torch_check(kernel, case_rng(f"lstm-lanes-{kernel.name}"), kernel.name)


@pytest.mark.slow  # the test-kernel build: a minute, once
def test_avx512_tiling_on_this_cpu():
    """AVX-512's 6-unit tile (its packing, partial tiles) run with AVX2 instructions."""
    kernel = next((k for k in recurrent.lanes_kernels(test_kernels=True) if k.test_only and k.supported), None)
    if kernel is None:
        pytest.skip("no test-only tile runs on this CPU")
    _torch_check(kernel, case_rng("lstm-lanes-wide"), kernel.name)


def test_one_thread_and_all_threads_agree_exactly():
    """A tile is computed by one thread in one order whichever claims it: the same bits on 1 and 2 threads."""
    rng = case_rng("lstm-lanes-threads")
    values = inputs(rng, steps=9, batch=7, features=6, hidden=40, directions=1, layout=0, bias=True, initial=True)
    t = {k: torch.from_numpy(v) for k, v in values.items()}
    layer = recurrent.LanesLSTMDirection(t["W"][0], t["R"][0], t["B"][0])
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, max(2, threads)):
            torch.set_num_threads(n)
            y, yh, yc = torch.empty(9, 7, 40), torch.empty(7, 40), torch.empty(7, 40)
            layer.run(t["X"], y, t["initial_h"][0], t["initial_c"][0], yh, yc, reverse=False, batch_major=False)
            results.append((y, yh, yc))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*results))


def _meta(shape, constant=False, dtype=torch.float32):
    return InputMeta(shape=tuple(shape), dtype=dtype, constant=constant)


@pytest.mark.parametrize("attrs, extra, batch, reason", [
    ({"activations": ["Sigmoid", "Tanh", "Relu"]}, {}, 4, "activations"),
    ({"clip": 2.0}, {}, 4, "clip"),
    ({}, {"P": (1, 24)}, 4, "peepholes"),
])
def test_refusals_say_why(attrs, extra, batch, reason):
    hidden = 8
    metas = [_meta((5, batch, 3)), _meta((1, 32, 3), True), _meta((1, 32, 8), True), _meta((1, 64), True)]
    if "P" in extra:
        metas += [InputMeta(None, None, False)] * 3 + [_meta(extra["P"], True)]
    step = StepSpec(op_type="LSTM", name="layer", inputs=[], outputs=[], attributes={"hidden_size": hidden, **attrs})
    answer = registry.get(NAME).supports(step, metas)
    assert answer is not True and reason in answer, answer


@pytest.mark.parametrize("batch", ["N", 4, 9])  # 9: past the lanes, where a call runs the row loop
def test_any_batch_is_supported(batch):
    metas = [_meta((5, batch, 3)), _meta((1, 32, 3), True), _meta((1, 32, 8), True)]
    step = StepSpec(op_type="LSTM", name="layer", inputs=[], outputs=[], attributes={"hidden_size": 8})
    assert registry.get(NAME).supports(step, metas) is True

