"""recurrent.c's step loop at two threads with each thread claiming its own slice of a step's items at once (the
default since 2026-12-06) and item by item (recurrent.set_whole_slices(False)): RNN, both GRUs, the LSTM's native
loop and lstm_fused.c's block split (cpu.lstm.fused_blocks), each against onnxruntime on fresh inputs, and bit-equal
to the same layer on one thread (each unit block one work item computed in one order, whoever claims it). An item
run twice (the LSTM's c and every h updated in place) or skipped (h of the step before left) changes the bits.
Then lstm_fused.c's block split with each thread's x parts computed ahead of the step's barrier and after it
(recurrent.set_fused_ahead), with reverse and sequence_lens, the same way.

Tolerance (fp32): test_tactics_cpu_recurrent.py's (GRU, LSTM atol 2e-6; RNN 5e-6).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln.kernels.cpu import recurrent
from tests.unit.oracle import assert_close, case_rng
from tests.unit.test_tactics_cpu_lstm import inputs as lstm_inputs
from tests.unit.test_tactics_cpu_lstm import oracle as lstm_oracle
from tests.unit.test_tactics_cpu_recurrent import RNN_TOLERANCE, TOLERANCE, inputs, oracle

STEPS, BATCH, FEATURES, HIDDEN = 9, 7, 6, 72  # 72 units: 4-9 unit blocks, 2-5 items a thread
pytestmark = pytest.mark.skipif(not recurrent.available(), reason=f"kiln's loop is not built: {recurrent.reason()}")


def layer_of(cell: str, t: dict[str, torch.Tensor], lbr: bool):
    if cell == "LSTM fused":
        return recurrent.FusedLSTMDirection(t["W"][0], t["R"][0], t["B"][0], split="blocks")
    return recurrent.RecurrentDirection(cell, t["W"][0], t["R"][0], t["B"][0], linear_before_reset=lbr)


@pytest.mark.parametrize("cell, lbr", [("RNN", False), ("GRU", False), ("GRU", True), ("LSTM", False),
                                       ("LSTM fused", False)])
def test_whole_slices_and_item_claims_match_onnxruntime_and_one_thread(cell, lbr):
    onnx_cell = cell.split()[0]
    rng = case_rng(f"stage-slices-{cell}-{lbr}")
    values = inputs(onnx_cell, rng, steps=STEPS, batch=BATCH, features=FEATURES, hidden=HIDDEN, directions=1,
                    layout=0, bias=True, initial=True)
    want = oracle(onnx_cell, values, {"linear_before_reset": 1} if lbr else {}, HIDDEN)
    t = {k: torch.from_numpy(v) for k, v in values.items()}
    layer = layer_of(cell, t, lbr)
    lstm = onnx_cell == "LSTM"

    def run(threads: int, whole: bool) -> list[torch.Tensor]:
        y, yh = torch.empty(STEPS, BATCH, HIDDEN), torch.empty(BATCH, HIDDEN)
        yc = torch.empty(BATCH, HIDDEN) if lstm else None
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        recurrent.set_whole_slices(whole)
        try:
            plan = layer.run(t["X"], y, t["initial_h"][0], t["initial_c"][0] if lstm else None, yh, yc,
                             reverse=False, batch_major=False)
        finally:
            recurrent.set_whole_slices(True)
            torch.set_num_threads(before)
        if cell == "LSTM fused":
            assert plan.row_slices == 1  # the block split ran, not the rows'
        return [y, yh] + ([yc] if lstm else [])

    one = run(1, True)
    tolerance = RNN_TOLERANCE if cell == "RNN" else TOLERANCE
    for whole in (True, False):
        got = run(2, whole)
        wants = [want[0][:, 0]] + [w[0] for w in want[1:]]  # Y [S, 1, N, H] -> [S, N, H]; states [1, N, H] -> [N, H]
        for name, g, w, o in zip(["Y", "Y_h", "Y_c"], got, wants, one):
            assert_close(g.numpy(), w, tolerance, f"{cell} whole slices {whole} {name}")
            assert torch.equal(g, o), f"{cell} whole slices {whole} {name}: not one thread's bits"


@pytest.mark.parametrize("batch, reverse, with_lengths", [(8, False, False), (7, True, True), (3, False, True)])
def test_fused_block_split_x_parts_ahead_match_onnxruntime_and_one_thread(batch, reverse, with_lengths):
    """lstm_fused.c's block split with each thread's x parts of a step computed before the step's barrier
    (recurrent.set_fused_ahead(True), the default) and after it: both against onnxruntime, both bit-equal to one
    thread's run (the same sums in the same order), and the plan says the ahead form ran (an item a block: 72 units
    are 5 blocks with AVX-512, 9 with AVX2, 18 with the portable tile)."""
    rng = case_rng(f"fused-ahead-{batch}-{reverse}-{with_lengths}")
    values = lstm_inputs(rng, steps=STEPS, batch=batch, features=FEATURES, hidden=HIDDEN, directions=1, layout=0,
                         bias=True, initial=True)
    lengths = rng.integers(0, STEPS + 1, batch).astype(np.int32) if with_lengths else None
    want = lstm_oracle(values | ({"sequence_lens": lengths} if with_lengths else {}),
                       {"direction": "reverse"} if reverse else {}, HIDDEN)
    wants = [want[0][:, 0], want[1][0], want[2][0]]
    t = {k: torch.from_numpy(v) for k, v in values.items()}
    layer = recurrent.FusedLSTMDirection(t["W"][0], t["R"][0], t["B"][0], split="blocks")

    def run(threads: int, ahead: bool) -> tuple[list[torch.Tensor], int]:
        y, yh, yc = torch.empty(STEPS, batch, HIDDEN), torch.empty(batch, HIDDEN), torch.empty(batch, HIDDEN)
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        recurrent.set_fused_ahead(ahead)
        try:
            plan = layer.run(t["X"], y, t["initial_h"][0], t["initial_c"][0], yh, yc, reverse=reverse,
                             batch_major=False, lengths=None if lengths is None else torch.from_numpy(lengths))
        finally:
            recurrent.set_fused_ahead(True)
            torch.set_num_threads(before)
        return [y, yh, yc], plan.ahead

    one, ran_ahead = run(1, True)
    assert ran_ahead == 0  # one thread: no barrier to work ahead of
    for ahead in (True, False):
        got, ran_ahead = run(2, ahead)
        assert ran_ahead == int(ahead), (ahead, ran_ahead)
        for name, g, w, o in zip(["Y", "Y_h", "Y_c"], got, wants, one):
            assert_close(g.numpy(), w, TOLERANCE, f"batch {batch} ahead {ahead} {name}")
            assert torch.equal(g, o), f"batch {batch} ahead {ahead} {name}: not one thread's bits"
