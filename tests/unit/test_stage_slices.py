"""recurrent.c's step loop at two threads with each thread claiming its own slice of a step's items at once (the
default since 2026-12-06) and item by item (recurrent.set_whole_slices(False)): RNN, both GRUs, the LSTM's native
loop and lstm_fused.c's block split (cpu.lstm.fused_blocks), each against onnxruntime on fresh inputs, and bit-equal
to the same layer on one thread (each unit block one work item computed in one order, whoever claims it). An item
run twice (the LSTM's c and every h updated in place) or skipped (h of the step before left) changes the bits.

Tolerance (fp32): test_tactics_cpu_recurrent.py's (GRU, LSTM atol 2e-6; RNN 5e-6).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln.kernels.cpu import recurrent
from tests.unit.oracle import assert_close, case_rng
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
