"""lstm_fused.c at two threads: the batch's rows split between the threads (each slice through every step, no barrier)
where each gets two rows or more, else each step's unit blocks split (a barrier a step). Each form against
onnxruntime's LSTM on fresh inputs (every batch from 1 to 17 rows: slices of 1 to 9 rows, even and uneven, both
tiles; reverse, sequence_lens, initial states), and the two forms against each other; the row split's second thread
kept awake between back-to-back calls (pool.c's follow window).

Tolerance (fp32): test_tactics_cpu_lstm.py's (rational σ / tanh, sums in kiln's order, 7 steps of carried rounding).
"""

from __future__ import annotations

import ctypes
import time

import numpy as np
import pytest
import torch

from kiln.kernels.cpu import recurrent
from tests.unit.oracle import assert_close, case_rng
from tests.unit.test_tactics_cpu_lstm import inputs, oracle

TOLERANCE = {np.dtype(np.float32): (1e-5, 2e-6)}
STEPS, FEATURES, HIDDEN = 7, 6, 40  # 40 units: two whole AVX-512 blocks and a partial one
pytestmark = pytest.mark.skipif(not recurrent.available(), reason=f"kiln's loop is not built: {recurrent.reason()}")


def run_fused(values: dict[str, np.ndarray], batch: int, *, reverse: bool, lengths: np.ndarray | None,
              row_split: bool, split: str | None = None, slices: list[int] | None = None) -> list[np.ndarray]:
    """Y, Y_h, Y_c of one FusedLSTMDirection run at two threads, the library's default split set to rows or not
    (`row_split`), the layer's own `split` (None: that default); the row slices it ran appended to `slices`."""
    t = {k: torch.from_numpy(v) for k, v in values.items()}
    layer = recurrent.FusedLSTMDirection(t["W"][0], t["R"][0], t["B"][0], split=split)
    y, yh, yc = torch.empty(STEPS, batch, HIDDEN), torch.empty(batch, HIDDEN), torch.empty(batch, HIDDEN)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    recurrent.set_row_split(row_split)
    try:
        plan = layer.run(t["X"], y, t["initial_h"][0], t["initial_c"][0], yh, yc, reverse=reverse, batch_major=False,
                         lengths=None if lengths is None else torch.from_numpy(lengths))
    finally:
        recurrent.set_row_split(True)
        torch.set_num_threads(before)
    if slices is not None:
        slices.append(plan.row_slices)
    return [y.numpy(), yh.numpy(), yc.numpy()]


@pytest.mark.parametrize("reverse, with_lengths", [(False, False), (True, False), (False, True), (True, True)])
def test_rows_and_blocks_split_match_onnxruntime(reverse, with_lengths):
    rng = case_rng(f"fused-threads-{reverse}-{with_lengths}")
    for batch in range(1, 18):
        values = inputs(rng, steps=STEPS, batch=batch, features=FEATURES, hidden=HIDDEN, directions=1, layout=0,
                        bias=True, initial=True)
        lengths = rng.integers(0, STEPS + 1, batch).astype(np.int32) if with_lengths else None
        feeds = values | ({"sequence_lens": lengths} if with_lengths else {})
        wants = oracle(feeds, {"direction": "reverse"} if reverse else {}, HIDDEN)
        wants = [wants[0][:, 0], wants[1][0], wants[2][0]]  # Y [S, 1, N, H] -> [S, N, H]; states [1, N, H] -> [N, H]
        forms = {split: run_fused(values, batch, reverse=reverse, lengths=lengths, row_split=split)
                 for split in (True, False)}
        for split, got in forms.items():
            for name, g, w in zip(["Y", "Y_h", "Y_c"], got, wants):
                assert_close(g, w, TOLERANCE, f"batch {batch} rows split {split} {name}")
        for g, h in zip(forms[True], forms[False]):  # each row's sums in one order whichever thread runs them
            np.testing.assert_array_equal(g, h, err_msg=f"batch {batch}: the two splits differ")


@pytest.mark.parametrize("batch", [4, 8, 13])
def test_a_layers_own_split_overrides_the_default(batch):
    """cpu.lstm.fused_blocks' layers (split="blocks") split the unit blocks whatever the library's default, and a
    split="rows" layer the rows: each bit-equal to the default set that way, and onnxruntime's answer."""
    rng = case_rng(f"fused-own-split-{batch}")
    values = inputs(rng, steps=STEPS, batch=batch, features=FEATURES, hidden=HIDDEN, directions=1, layout=0,
                    bias=True, initial=True)
    wants = oracle(values, {}, HIDDEN)
    wants = [wants[0][:, 0], wants[1][0], wants[2][0]]
    for split, row_split in (("blocks", True), ("rows", False)):
        slices: list[int] = []
        got = run_fused(values, batch, reverse=False, lengths=None, row_split=row_split, split=split, slices=slices)
        same = run_fused(values, batch, reverse=False, lengths=None, row_split=split == "rows", slices=slices)
        assert slices == ([1, 1] if split == "blocks" else [2, 2]), (split, slices)  # two threads, 2+ rows each
        for name, g, h, w in zip(["Y", "Y_h", "Y_c"], got, same, wants):
            assert_close(g, w, TOLERANCE, f"batch {batch} split {split} {name}")
            np.testing.assert_array_equal(g, h, err_msg=f"batch {batch} split {split} {name}: not the default's bits")


def test_an_unknown_split_is_refused():
    w, r = torch.zeros(4 * HIDDEN, FEATURES), torch.zeros(4 * HIDDEN, HIDDEN)
    with pytest.raises(ValueError, match="split 'columns'"):
        recurrent.FusedLSTMDirection(w, r, None, split="columns")


@pytest.fixture
def lstm_on_the_pool():
    """recurrent.c's loops on kiln's pool (pool.c; the default only on a busy machine: kiln/openmp.py)."""
    lib = recurrent.load()
    enabled, follow = ctypes.c_int.in_dll(lib, "kiln_pool_enabled"), ctypes.c_long.in_dll(lib, "kiln_pool_follow_ns")
    previous = enabled.value, follow.value
    enabled.value = 1
    yield lib
    enabled.value, follow.value = previous


def test_the_row_split_finds_its_worker_awake_between_back_to_back_calls(lstm_on_the_pool):
    """pool.c's workers keep polling through the gaps between loops that come back to back (kiln_pool_follow_ns), so
    that the next call's row split finds its second thread awake, and sleep on the futex once calls stop; with the
    follow off (0, the form before 2026-12-07) they sleep in every gap. Every call's outputs are onnxruntime's.
    Four gaps of 0.1 s come first: the window is then 0.2 s, so only a worker kept off its core that long would
    sleep in the 2 ms gaps counted. The step-aside off (kiln_pool_step_aside = 0): on a busy machine the worker may wake
    on the caller's CPU, where it would park at once by design (test_kernel_pool.py tests that); this is the window."""
    lib = lstm_on_the_pool
    step_aside = ctypes.c_int.in_dll(lib, "kiln_pool_step_aside")
    previous_step_aside, step_aside.value = step_aside.value, 0
    try:
        _follow_calls(lib)
    finally:
        step_aside.value = previous_step_aside


def _follow_calls(lib) -> None:
    rng = case_rng("fused-follow")
    values = inputs(rng, steps=STEPS, batch=8, features=FEATURES, hidden=HIDDEN, directions=1, layout=0, bias=True,
                    initial=True)
    wants = oracle(values, {}, HIDDEN)
    wants = [wants[0][:, 0], wants[1][0], wants[2][0]]

    def calls(gaps: list[float]) -> None:
        for gap in gaps:
            time.sleep(gap)
            slices: list[int] = []
            got = run_fused(values, 8, reverse=False, lengths=None, row_split=True, slices=slices)
            assert slices == [2]
            for name, g, w in zip(["Y", "Y_h", "Y_c"], got, wants):
                assert_close(g, w, TOLERANCE, f"gap {gap} s {name}")

    slept = {}
    for follow in (10**9, 0):
        ctypes.c_long.in_dll(lib, "kiln_pool_follow_ns").value = follow
        calls([0.0] + [0.1] * 4)
        parked = lib.kiln_pool_parks()
        calls([0.002] * 3)
        slept[follow] = lib.kiln_pool_parks() - parked
        if follow:  # calls stop: the worker sleeps after its window (0.2 s)
            deadline = time.monotonic() + 10
            while lib.kiln_pool_parks() == parked + slept[follow] and time.monotonic() < deadline:
                time.sleep(0.01)
            assert lib.kiln_pool_parks() > parked + slept[follow], "the worker never went to sleep"
    assert slept[10**9] <= 1 and slept[0] >= 2, slept
