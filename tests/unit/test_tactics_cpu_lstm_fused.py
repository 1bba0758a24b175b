"""cpu.lstm.fused (kiln/kernels/cpu/lstm_fused.c: a step's input projection, recurrent GEMM and cell in one
register tile) against onnxruntime and torch's LSTM in float64: every direction and layout, with and without
bias and initial states, hidden sizes that fill and that do not fill a block of units, batches of one row
group and of several (uneven ones among them); sequence_lens at run time (0 and full among them); a dynamic
batch; each tile this CPU runs (AVX-512, AVX2, portable); one thread and two giving the same bits; and what
the tactic leaves to cpu.lstm.native.

Tolerance (fp32): as test_tactics_cpu_lstm.py (the same σ / tanh rational forms, here with the divisions
as a reciprocal estimate and one Newton step, ~2 ulp; the dot products summed in another order than MLAS's;
each step's rounding carried into the next): atol 2e-6 over 7 steps. Against torch in float64 the same
bound covers fp32's own rounding over those steps (observed < 5e-7).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln.kernels.cpu import recurrent
from kiln.plan.spec import StepSpec
from kiln.tactics import registry
from kiln.tactics.tactic import InputMeta
from tests.unit.oracle import assert_close, case_rng
from tests.unit.test_tactics_cpu_lstm import inputs, oracle, runs_match_onnxruntime
from tests.unit.test_tactics_cpu_lstm_lanes import engine as lanes_engine

NAME = "cpu.lstm.fused"
TOLERANCE = {np.dtype(np.float32): (1e-5, 2e-6)}
pytestmark = pytest.mark.skipif(not recurrent.available(), reason=f"kiln's loop is not built: {recurrent.reason()}")


def engine(values, attrs, hidden, monkeypatch, **options):
    """The node with W, R, B as engine constants, built with cpu.lstm.fused made the fastest (a dynamic batch
    valid up to 20 rows)."""
    return lanes_engine(values, attrs, hidden, monkeypatch, name=NAME, max_batch=20, **options)


@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("layout", [0, 1])
# blocks full (AVX-512's 16 units); a partial block and 2 + 2 + 1 ... row groups; H below a block, 1 row
@pytest.mark.parametrize("hidden, batch", [(32, 4), (37, 13), (7, 1)])
@pytest.mark.parametrize("bias, initial", [(True, True), (False, False)])
def test_fused_matches_onnxruntime(direction, layout, hidden, batch, bias, initial, monkeypatch):
    rng = case_rng(f"lstm-fused-{direction}-{layout}-{hidden}-{batch}-{bias}-{initial}")
    directions = 2 if direction == "bidirectional" else 1
    attrs = {"direction": direction, "layout": layout}
    shape = dict(steps=7, batch=batch, features=5, hidden=hidden, directions=directions, layout=layout)
    values = inputs(rng, bias=bias, initial=initial, **shape)
    built, _ = engine(values, attrs, hidden, monkeypatch)
    assert built.plan.program.steps[0].tactic == NAME
    runs_match_onnxruntime(built, values, attrs, rng, shape, bias, initial, f"{direction} layout {layout}")


@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
def test_sequence_lens_in_the_tile(direction, monkeypatch):
    """Per-row lengths at run time (0 and full among them): each row keeps its state past its length and
    writes zeros to Y; Y_h / Y_c the state at the length (zeros for length 0, onnxruntime's answer)."""
    rng = case_rng(f"lstm-fused-lens-{direction}")
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


def test_dynamic_batch(monkeypatch):
    rng = case_rng("lstm-fused-dynamic")
    values = inputs(rng, steps=5, batch=3, features=6, hidden=24, directions=1, layout=0, bias=True, initial=True)
    built, _ = engine(values, {}, 24, monkeypatch, dynamic_batch=True)
    assert built.plan.program.steps[0].tactic == NAME
    for batch in (3, 17, 8, 1):
        fresh = inputs(rng, steps=5, batch=batch, features=6, hidden=24, directions=1, layout=0, bias=True,
                       initial=True)
        feeds = {k: v for k, v in fresh.items() if k in ("X", "initial_h", "initial_c")}
        got = built.run(feeds)
        for name, want in zip(["Y", "Y_h", "Y_c"], oracle({**values, **feeds}, {}, 24)):
            assert_close(got[name], want, TOLERANCE, f"batch {batch} {name}")


def _torch_float64(values, steps, hidden):
    """torch.nn.LSTM in float64 on the ONNX weights (gate order i, o, f, c -> torch's i, f, c, o)."""
    order = torch.cat([torch.arange(0, hidden), torch.arange(2 * hidden, 4 * hidden), torch.arange(hidden, 2 * hidden)])
    t = {k: torch.from_numpy(v).double() for k, v in values.items()}
    layer = torch.nn.LSTM(t["X"].shape[2], hidden).double()
    with torch.no_grad():
        layer.weight_ih_l0.copy_(t["W"][0][order])
        layer.weight_hh_l0.copy_(t["R"][0][order])
        layer.bias_ih_l0.copy_(t["B"][0][:4 * hidden][order])
        layer.bias_hh_l0.copy_(t["B"][0][4 * hidden:][order])
        y, (yh, yc) = layer(t["X"], (t["initial_h"], t["initial_c"]))
    return y, yh[0], yc[0]


@pytest.mark.parametrize("kernel", [k for k in recurrent.fused_kernels() if k.supported and not k.test_only],
                         ids=lambda k: k.name)
def test_every_tile_this_cpu_runs_matches_torch_float64(kernel):
    """AVX-512 (where the CPU has it), AVX2, and the portable tile every CPU runs."""
    rng = case_rng(f"lstm-fused-{kernel.name}")
    # 40 = 2·16 + 8 (a partial AVX-512 block), 8 rows = 4 + 4 (6-row tile), 3 rows; 13 units, 7 rows
    for hidden, batch, steps, features in [(40, 8, 6, 7), (13, 7, 4, 3), (16, 3, 5, 16)]:
        values = inputs(rng, steps=steps, batch=batch, features=features, hidden=hidden, directions=1, layout=0,
                        bias=True, initial=True)
        t = {k: torch.from_numpy(v) for k, v in values.items()}
        layer = recurrent.FusedLSTMDirection(t["W"][0], t["R"][0], t["B"][0], kernel=kernel)
        y, yh, yc = torch.empty(steps, batch, hidden), torch.empty(batch, hidden), torch.empty(batch, hidden)
        layer.run(t["X"], y, t["initial_h"][0], t["initial_c"][0], yh, yc, reverse=False, batch_major=False)
        for name, g, w in zip(["Y", "Y_h", "Y_c"], [y, yh, yc], _torch_float64(values, steps, hidden)):
            assert_close(g.numpy(), w.float().numpy(), TOLERANCE, f"{kernel.name} H {hidden} N {batch} {name}")


def test_the_tiles_are_the_ones_this_cpu_has():
    kernels = [k for k in recurrent.fused_kernels() if k.supported]
    assert any(k.name.startswith("generic") for k in kernels)
    assert all(k.units in (4, 8, 16) for k in kernels)


def test_one_thread_and_all_threads_agree_exactly():
    """A tile is computed by one thread in one order whichever claims it: the same bits on 1 and 2 threads."""
    rng = case_rng("lstm-fused-threads")
    values = inputs(rng, steps=9, batch=11, features=6, hidden=40, directions=1, layout=0, bias=True, initial=True)
    t = {k: torch.from_numpy(v) for k, v in values.items()}
    layer = recurrent.FusedLSTMDirection(t["W"][0], t["R"][0], t["B"][0])
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, max(2, threads)):
            torch.set_num_threads(n)
            y, yh, yc = torch.empty(9, 11, 40), torch.empty(11, 40), torch.empty(11, 40)
            layer.run(t["X"], y, t["initial_h"][0], t["initial_c"][0], yh, yc, reverse=False, batch_major=False)
            results.append((y, yh, yc))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_wrong_weight_shapes_are_refused_by_name():
    with pytest.raises(ValueError, match="not \\[4·H, I\\]"):
        recurrent.FusedLSTMDirection(torch.zeros(30, 3), torch.zeros(32, 8), None)


def _meta(shape, constant=False, dtype=torch.float32):
    return InputMeta(shape=tuple(shape), dtype=dtype, constant=constant)


@pytest.mark.parametrize("attrs, extra, reason", [
    ({"activations": ["Sigmoid", "Tanh", "Relu"]}, {}, "activations"),
    ({"clip": 2.0}, {}, "clip"),
    ({"input_forget": 1}, {}, "input_forget"),
    ({}, {"P": (1, 24)}, "peepholes"),
])
def test_refusals_say_why(attrs, extra, reason):
    metas = [_meta((5, 4, 3)), _meta((1, 32, 3), True), _meta((1, 32, 8), True), _meta((1, 64), True)]
    if "P" in extra:
        metas += [InputMeta(None, None, False)] * 3 + [_meta(extra["P"], True)]
    step = StepSpec(op_type="LSTM", name="layer", inputs=[], outputs=[], attributes={"hidden_size": 8, **attrs})
    answer = registry.get(NAME).supports(step, metas)
    assert answer is not True and reason in answer, answer


@pytest.mark.parametrize("batch", ["N", 4, 33])
def test_any_batch_is_supported(batch):
    metas = [_meta((5, batch, 3)), _meta((1, 32, 3), True), _meta((1, 32, 8), True)]
    step = StepSpec(op_type="LSTM", name="layer", inputs=[], outputs=[], attributes={"hidden_size": 8})
    assert registry.get(NAME).supports(step, metas) is True
