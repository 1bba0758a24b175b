"""lstm_fused.c's x parts first (fused_x_first): where a layer's input is wide (I >= 64), the row split (and one
thread on the wide tile) computes every step's bias + x·W of its rows in one pass, then the steps' wide tiles add only
h·R. Against onnxruntime's LSTM on fresh random inputs (I 64 / 100 / 130; hidden sizes whose blocks group as 1 to
3 + 3 + 3, partial blocks among them; batches 4 / 8 / 12 at 1 and 2 threads, forward, reverse, sequence_lens, with
and without initial states), bit-equal to the tiles computing the x parts themselves (set_x_first(False)), since the
sums run in one order; and taken exactly where every slice is wide tiles (plan.ahead == 2).

Tolerance (fp32): test_tactics_cpu_lstm_fused.py's (rational σ / tanh with a reciprocal estimate, steps of carried
rounding).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln.kernels.cpu import recurrent
from tests.unit.oracle import assert_close, case_rng
from tests.unit.test_lstm_wide_tile import _slices, _wide
from tests.unit.test_tactics_cpu_lstm import inputs, oracle
from tests.unit.test_tactics_cpu_lstm_fused import TOLERANCE, _kernel, _Threads

STEPS = 7
pytestmark = pytest.mark.skipif(not recurrent.available(), reason=f"kiln's loop is not built: {recurrent.reason()}")
WIDE = [isa for isa in ("avx2", "avx512") if recurrent.available() and _kernel(isa).supported]


def _run(layer, values, batch, hidden, *, threads, reverse, lengths, x_first):
    t = {k: torch.from_numpy(v) for k, v in values.items()}
    layer.threads = threads
    y = torch.full((STEPS, batch, hidden), float("nan"))
    yh, yc = torch.empty(batch, hidden), torch.empty(batch, hidden)
    recurrent.set_x_first(x_first)
    try:
        plan = layer.run(t["X"], y, t["initial_h"][0] if "initial_h" in t else None,
                         t["initial_c"][0] if "initial_c" in t else None, yh, yc, reverse=reverse, batch_major=False,
                         lengths=None if lengths is None else torch.from_numpy(lengths))
    finally:
        recurrent.set_x_first(True)
    return [y.numpy(), yh.numpy(), yc.numpy()], plan


def _all_wide(isa: str, batch: int, threads: int) -> bool:
    """Whether every slice of the row split runs wide tiles of 4 rows only (fused_tiles' default plan)."""
    if isa == "avx2":
        return all(rows in (4, 8) for rows in _slices(batch, threads))
    return all(rows == 4 for rows in _slices(batch, threads)) and _wide(isa, 4)


@pytest.mark.parametrize("isa", WIDE)
@pytest.mark.parametrize("features, hidden", [(64, 8), (100, 20), (130, 72), (64, 56)])
def test_x_first_matches_onnxruntime_and_the_tiles_bits(isa, features, hidden):
    rng = case_rng(f"lstm-x-first-{isa}-{features}-{hidden}")
    for batch in (4, 8, 12):
        for initial in (True, False):
            values = inputs(rng, steps=STEPS, batch=batch, features=features, hidden=hidden, directions=1, layout=0,
                            bias=True, initial=initial)
            t = {k: torch.from_numpy(v) for k, v in values.items()}
            layer = _Threads(t["W"][0], t["R"][0], t["B"][0], kernel=_kernel(isa), split="rows")
            for threads in (1, 2):
                for reverse, with_lengths in ((False, False), (True, False), (False, True), (True, True)):
                    lengths = rng.integers(0, STEPS + 1, batch).astype(np.int32) if with_lengths else None
                    label = f"I {features} H {hidden} N {batch} initial {initial} {threads} threads reverse " \
                            f"{reverse} lengths {lengths}"
                    got, plan = _run(layer, values, batch, hidden, threads=threads, reverse=reverse, lengths=lengths,
                                     x_first=True)
                    assert plan.ahead == (2 if _all_wide(isa, batch, threads) else 0), label
                    before, old = _run(layer, values, batch, hidden, threads=threads, reverse=reverse,
                                       lengths=lengths, x_first=False)
                    assert old.ahead == 0, label
                    feeds = values | ({"sequence_lens": lengths} if with_lengths else {})
                    want = oracle(feeds, {"direction": "reverse"} if reverse else {}, hidden)
                    want = [want[0][:, 0], want[1][0], want[2][0]]
                    for name, g, b, w in zip(["Y", "Y_h", "Y_c"], got, before, want):
                        assert_close(g, w, TOLERANCE, f"{label} {name}")
                        np.testing.assert_array_equal(g, b, err_msg=f"{label} {name}: not the wide tile's bits")


@pytest.mark.parametrize("isa", WIDE)
def test_x_first_stays_off_for_narrow_inputs(isa):
    """I < 64 (the forecaster's first layer, I = 16): each step's tile computes its x part, as before."""
    rng = case_rng(f"lstm-x-first-narrow-{isa}")
    values = inputs(rng, steps=STEPS, batch=8, features=16, hidden=20, directions=1, layout=0, bias=True,
                    initial=False)
    t = {k: torch.from_numpy(v) for k, v in values.items()}
    layer = _Threads(t["W"][0], t["R"][0], t["B"][0], kernel=_kernel(isa), split="rows")
    got, plan = _run(layer, values, 8, 20, threads=2, reverse=False, lengths=None, x_first=True)
    assert plan.ahead == 0 and plan.wide == 1
    want = oracle(values, {}, 20)
    assert_close(got[0], want[0][:, 0], TOLERANCE, "Y")
