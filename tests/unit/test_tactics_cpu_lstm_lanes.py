"""cpu.lstm.lanes's tiles (kiln/kernels/cpu/lstm_lanes.c: the batch in the vector lanes) against torch's LSTM:
each tile this CPU runs (the portable one and AVX-512's 6-unit tile on AVX2 instructions included). The
tactic as an engine against onnxruntime (directions, layouts, sequence_lens, a dynamic batch past the lanes,
threads, refusals): test_tactics_cpu_lstm.py.

Tolerance (fp32): as test_tactics_cpu_lstm.py (the same σ / tanh rational forms, the dot products summed
in another order than MLAS's, each step's rounding carried into the next): atol 2e-6 over 7 steps.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln.kernels.cpu import recurrent
from kiln.ops import recurrent_fused
from tests.unit.oracle import assert_close, case_rng
from tests.unit.test_tactics_cpu_lstm import inputs

TOLERANCE = {np.dtype(np.float32): (1e-5, 2e-6)}
pytestmark = pytest.mark.skipif(not recurrent.available(), reason=f"kiln's loop is not built: {recurrent.reason()}")


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
