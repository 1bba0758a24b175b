"""lstm_fused.c's wide tile (FUSED_WIDE: 4 rows, the gates i, c̃, f of a block, then the o gates of up to 3 blocks),
which runs a slice of 4 rows in the row split (the forecaster's 8 rows at 2 threads) and at one thread (AVX2: a rest
of 4 or 8 rows past the full 6-row tiles, 8 rows as 4 + 4; AVX-512: 4 rows). Both kernels (where the CPU has them)
against onnxruntime's LSTM and torch's in float64 on fresh random inputs: hidden sizes whose blocks group as 1 to
3 + 3 + 3 (partial blocks among them), batches 1 / 3 / 4 / 8 / 9 / 10 / 13 at 1 and 2 threads,
forward, reverse, sequence_lens, with and without initial states, both directions of a bidirectional layer; and
bit-equal to the tiles it replaces (set_wide_tiles(False): 2 + 2 one-pass), since each row's sums run in one order.

Tolerance (fp32): test_tactics_cpu_lstm_fused.py's (rational σ / tanh with a reciprocal estimate, 5 steps of
carried rounding).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln.kernels.cpu import recurrent
from tests.unit.oracle import assert_close, case_rng
from tests.unit.test_tactics_cpu_lstm import inputs, oracle
from tests.unit.test_tactics_cpu_lstm_fused import TOLERANCE, _kernel, _Threads, _torch_float64

STEPS, FEATURES = 5, 6
pytestmark = pytest.mark.skipif(not recurrent.available(), reason=f"kiln's loop is not built: {recurrent.reason()}")
WIDE = [isa for isa in ("avx2", "avx512") if recurrent.available() and _kernel(isa).supported]


def test_the_row_split_plans_the_wide_tile_for_a_rest_of_four_rows():
    plan, avx2 = recurrent.fused_tile_plan, _kernel("avx2")
    assert plan(avx2, 4, wide=True) == [(4, "wide")]
    assert plan(avx2, 10, wide=True) == [(6, True), (4, "wide")]
    assert plan(avx2, 8, wide=True) == [(4, "wide"), (4, "wide")]  # one thread's 8 rows: 4 + 4, not 6 + 2
    assert plan(avx2, 14, wide=True) == [(6, True), (4, "wide"), (4, "wide")]
    assert plan(avx2, 12, wide=True) == [(6, True), (6, True)]
    assert plan(avx2, 8, wide=1) == [(6, True), (2, False)]  # mode 1: a rest of 4 only
    assert plan(avx2, 4, wide=1) == [(4, "wide")]
    assert plan(avx2, 8, wide=0) == plan(avx2, 8) == [(6, True), (2, False)]
    assert plan(avx2, 5, wide=True) == [(3, False), (2, False)]
    assert plan(avx2, 2, wide=True) == [(2, False)]
    assert plan(avx2, 4) == [(2, False), (2, False)]  # the block split shares a step's blocks: no wide tile
    avx512 = _kernel("avx512")
    assert plan(avx512, 4, wide=True) == plan(avx512, 4, wide=1) == [(4, "wide")]
    assert plan(avx512, 4) == [(4, False)]
    assert plan(avx512, 8, wide=True) == [(8, True)]  # its 8-row two-pass tile reads each weight once already
    for kernel in recurrent.fused_kernels():
        if kernel.name.split()[0] not in ("avx2", "avx512"):
            assert all(kind != "wide" for rows in range(1, 20) for _, kind in plan(kernel, rows, wide=True))
        for mode in (0, 1, 2):
            for rows in range(1, 20):
                assert sum(r for r, _ in plan(kernel, rows, wide=mode)) == rows, (kernel.name, mode, rows)


def _run(layer, values, batch, hidden, *, threads, reverse, lengths, wide, direction=0):
    t = {k: torch.from_numpy(v) for k, v in values.items()}
    layer.threads = threads
    y = torch.full((STEPS, batch, hidden), float("nan"))
    yh, yc = torch.empty(batch, hidden), torch.empty(batch, hidden)
    recurrent.set_wide_tiles(wide)
    try:
        plan = layer.run(t["X"], y, t["initial_h"][direction] if "initial_h" in t else None,
                         t["initial_c"][direction] if "initial_c" in t else None, yh, yc, reverse=reverse,
                         batch_major=False, lengths=None if lengths is None else torch.from_numpy(lengths))
    finally:
        recurrent.set_wide_tiles(True)
    return [y.numpy(), yh.numpy(), yc.numpy()], plan


def _wide(isa: str, rows: int) -> bool:
    """Whether a slice of `rows` runs a wide tile (fused_tiles' plan in the default mode)."""
    return rows % 6 == 4 or rows % 6 == 2 and rows > 6 if isa == "avx2" else rows == 4


def _slices(batch: int, threads: int) -> list[int]:
    """The rows of each thread's slice in the row split (lstm_fused.c: two rows or more each)."""
    slices = min(max(batch // 2, 1), threads)
    return [batch * (q + 1) // slices - batch * q // slices for q in range(slices)]


@pytest.mark.parametrize("isa", WIDE)
@pytest.mark.parametrize("hidden", [8, 20, 40, 56, 72])  # AVX2 blocks 1, 3, 5, 7, 9; AVX-512 1 to 5 (partial ones)
def test_wide_tile_matches_onnxruntime_and_the_tiles_it_replaces(isa, hidden):
    rng = case_rng(f"lstm-wide-tile-{isa}-{hidden}")
    for batch in (1, 3, 4, 8, 9, 10, 13):
        for initial in (True, False):
            values = inputs(rng, steps=STEPS, batch=batch, features=FEATURES, hidden=hidden, directions=1, layout=0,
                            bias=True, initial=initial)
            t = {k: torch.from_numpy(v) for k, v in values.items()}
            layer = _Threads(t["W"][0], t["R"][0], t["B"][0], kernel=_kernel(isa), split="rows")
            for threads in (1, 2):
                for reverse, with_lengths in ((False, False), (True, False), (False, True), (True, True)):
                    lengths = rng.integers(0, STEPS + 1, batch).astype(np.int32) if with_lengths else None
                    label = f"H {hidden} N {batch} initial {initial} {threads} threads reverse {reverse} " \
                            f"lengths {lengths}"
                    got, plan = _run(layer, values, batch, hidden, threads=threads, reverse=reverse,
                                     lengths=lengths, wide=True)
                    assert plan.wide == int(any(_wide(isa, rows) for rows in _slices(batch, threads))), label
                    before, old = _run(layer, values, batch, hidden, threads=threads, reverse=reverse,
                                       lengths=lengths, wide=False)
                    assert old.wide == 0, label
                    feeds = values | ({"sequence_lens": lengths} if with_lengths else {})
                    want = oracle(feeds, {"direction": "reverse"} if reverse else {}, hidden)
                    want = [want[0][:, 0], want[1][0], want[2][0]]
                    for name, g, b, w in zip(["Y", "Y_h", "Y_c"], got, before, want):
                        assert_close(g, w, TOLERANCE, f"{label} {name}")
                        np.testing.assert_array_equal(g, b, err_msg=f"{label} {name}: not the one-pass tiles' bits")


@pytest.mark.parametrize("isa", WIDE)
@pytest.mark.parametrize("batch", [4, 8])
def test_wide_tile_matches_torch_float64(isa, batch):
    """Forward with initial states against torch.nn.LSTM in float64 (an oracle independent of onnxruntime)."""
    hidden = 40
    rng = case_rng(f"lstm-wide-torch-{isa}-{batch}")
    values = inputs(rng, steps=STEPS, batch=batch, features=FEATURES, hidden=hidden, directions=1, layout=0,
                    bias=True, initial=True)
    t = {k: torch.from_numpy(v) for k, v in values.items()}
    layer = _Threads(t["W"][0], t["R"][0], t["B"][0], kernel=_kernel(isa), split="rows")
    got, plan = _run(layer, values, batch, hidden, threads=2 if batch == 8 else 1, reverse=False, lengths=None,
                     wide=True)
    assert plan.wide == 1
    want = _torch_float64(values, STEPS, hidden)
    for name, g, w in zip(["Y", "Y_h", "Y_c"], got, want):
        assert_close(g, w.numpy().astype(np.float32), TOLERANCE, f"N {batch} {name}")


@pytest.mark.parametrize("isa", WIDE)
def test_wide_tile_runs_both_directions_of_a_bidirectional_layer(isa):
    """onnxruntime's bidirectional LSTM (sequence_lens, initial states): each direction a FusedLSTMDirection on the
    wide tile (8 rows at 2 threads: 4 + 4), Y's direction axis and the states' compared."""
    hidden, batch = 20, 8
    rng = case_rng(f"lstm-wide-bidirectional-{isa}")
    values = inputs(rng, steps=STEPS, batch=batch, features=FEATURES, hidden=hidden, directions=2, layout=0,
                    bias=True, initial=True)
    lengths = rng.integers(1, STEPS + 1, batch).astype(np.int32)
    want = oracle(values | {"sequence_lens": lengths}, {"direction": "bidirectional"}, hidden)
    t = {k: torch.from_numpy(v) for k, v in values.items()}
    for direction in (0, 1):
        layer = _Threads(t["W"][direction], t["R"][direction], t["B"][direction], kernel=_kernel(isa),
                         split="rows")
        got, plan = _run(layer, values, batch, hidden, threads=2, reverse=direction == 1, lengths=lengths, wide=True,
                         direction=direction)
        assert plan.wide == 1 and plan.row_slices == 2
        for name, g, w in zip(["Y", "Y_h", "Y_c"], got, [want[0][:, direction], want[1][direction],
                                                         want[2][direction]]):
            assert_close(g, w, TOLERANCE, f"direction {direction} {name}")
