"""cpu.lstm.fused's tiles (kiln/kernels/cpu/lstm_fused.c: a step's input projection, recurrent GEMM and cell in
one register tile) against torch's LSTM in float64: each tile this CPU runs (AVX-512, AVX2, portable), and the
weights' shapes checked by name. The tactic as an engine against onnxruntime (directions, layouts, uneven row
groups, sequence_lens, a dynamic batch, threads, refusals): test_tactics_cpu_lstm.py.

Tolerance (fp32): as test_tactics_cpu_lstm.py (σ and tanh MLAS's rational forms, σ within 2.2e-7 of the exact
one on a grid of ±30, here with the divisions as a reciprocal estimate and one Newton step, ~2 ulp more; the dot
products summed in another order than MLAS's; each step's rounding carried into the next): atol 2e-6 over 7 steps. Against torch in float64 the same
bound covers fp32's own rounding over those steps (observed < 5e-7).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln.kernels.cpu import recurrent
from tests.unit.oracle import assert_close, case_rng
from tests.unit.test_tactics_cpu_lstm import inputs

TOLERANCE = {np.dtype(np.float32): (1e-5, 2e-6)}
pytestmark = pytest.mark.skipif(not recurrent.available(), reason=f"kiln's loop is not built: {recurrent.reason()}")


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
    # 40 = 2·16 + 8 (a partial AVX-512 block), 8 rows (AVX-512: the two-pass 8-row tile; else 4 + 4 or 3 + 3 + 2),
    # 3 rows; 13 units, 7 rows; 11 rows (two-pass: 6 + 5)
    for hidden, batch, steps, features in [(40, 8, 6, 7), (13, 7, 4, 3), (16, 3, 5, 16), (24, 11, 3, 5)]:
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


def test_wrong_weight_shapes_are_refused_by_name():
    with pytest.raises(ValueError, match="not \\[4·H, I\\]"):
        recurrent.FusedLSTMDirection(torch.zeros(30, 3), torch.zeros(32, 8), None)


def _kernel(prefix: str):
    return next(k for k in recurrent.fused_kernels() if k.name.split()[0] == prefix)


def test_avx2_kernel_runs_full_six_row_two_pass_tiles_then_one_pass_tiles():
    """AVX2's kernel (16 ymm): full 6-row two-pass tiles, the rest one-pass, as even as they go; the kernel before it
    (avx2onepass) and AVX-512's keep their even tiles (the tables do not depend on the CPU: no tile runs here)."""
    plan = recurrent.fused_tile_plan
    avx2 = _kernel("avx2")
    assert plan(avx2, 8) == [(6, True), (2, False)]
    assert plan(avx2, 6) == [(6, True)]
    assert plan(avx2, 4) == [(2, False), (2, False)]  # a 4-row two-pass tile (8 accumulators) lost to 2 + 2
    assert plan(avx2, 11) == [(6, True), (3, False), (2, False)]
    assert plan(avx2, 12) == [(6, True), (6, True)]
    assert plan(avx2, 1) == [(1, False)]
    assert plan(_kernel("avx2onepass"), 8) == [(3, False), (3, False), (2, False)]
    avx512 = _kernel("avx512")
    assert plan(avx512, 8) == [(8, True)]
    assert plan(avx512, 9) == [(5, True), (4, True)]
    assert plan(avx512, 6) == [(6, False)]
    for kernel in recurrent.fused_kernels():
        for rows in range(1, 20):
            assert sum(r for r, _ in plan(kernel, rows)) == rows, (kernel.name, rows)


class _Threads(recurrent.FusedLSTMDirection):
    """A layer whose calls run on `threads` threads (the plan's field; 0 would be OpenMP's count)."""

    threads = 1

    def plan(self, *args, **kwargs):
        found = super().plan(*args, **kwargs)
        found.threads = self.threads
        return found


@pytest.mark.skipif(not _kernel("avx2").supported, reason="no AVX2 on this CPU")
@pytest.mark.parametrize("split", ["rows", "blocks"])
def test_avx2_kernel_every_batch_and_thread_count_matches_onnxruntime(split):
    """Every batch 1-14 (6-row two-pass tiles with 0-8 rows of one-pass ones; a slice of each thread's rows under
    the row split), 1-3 threads, forward and reverse with initial states, against onnxruntime's LSTM on fresh
    random inputs."""
    from tests.unit.test_tactics_cpu_lstm import oracle

    rng = case_rng(f"lstm-fused-avx2-batches-{split}")
    hidden, steps, features = 20, 5, 6  # 20 = 2·8 + 4: a partial block
    for batch in range(1, 15):
        values = inputs(rng, steps=steps, batch=batch, features=features, hidden=hidden, directions=1, layout=0,
                        bias=True, initial=True)
        t = {k: torch.from_numpy(v) for k, v in values.items()}
        layer = _Threads(t["W"][0], t["R"][0], t["B"][0], kernel=_kernel("avx2"), split=split)
        for threads in (1, 2, 3):
            for reverse in (False, True):
                layer.threads = threads
                y = torch.full((steps, batch, hidden), float("nan"))
                yh, yc = torch.empty(batch, hidden), torch.empty(batch, hidden)
                layer.run(t["X"], y, t["initial_h"][0], t["initial_c"][0], yh, yc, reverse=reverse,
                          batch_major=False)
                want = oracle(values, {"direction": "reverse"} if reverse else {}, hidden)
                for name, got, w in zip(["Y", "Y_h", "Y_c"], [y[:, None], yh[None], yc[None]], want):
                    assert_close(got.numpy(), w, TOLERANCE,
                                 f"N {batch} {split} {threads} threads {'reverse' if reverse else 'forward'} {name}")
