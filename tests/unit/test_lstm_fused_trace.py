"""lstm_fused.c's row-split trace (kiln_lstm_fused_tracing, for bench/lstm_timeline.py): off, a call writes nothing;
on, each row-split call writes one record whose slices lie inside the loop, each run once, by the caller or a worker;
the outputs are the same bits either way."""

from __future__ import annotations

import ctypes

import pytest
import torch

from kiln.kernels.cpu import recurrent

pytestmark = pytest.mark.skipif(not recurrent.available(), reason=f"kiln's loop is not built: {recurrent.reason()}")


class _Trace(ctypes.Structure):  # struct fused_trace in lstm_fused.c (bench/lstm_timeline.py reads the same)
    _fields_ = [("start", ctypes.c_long), ("end", ctypes.c_long), ("slices", ctypes.c_long),
                ("slice_start", ctypes.c_long * 8), ("slice_end", ctypes.c_long * 8), ("by_worker", ctypes.c_long * 8)]


class _TwoThreads(recurrent.FusedLSTMDirection):
    def plan(self, *args, **kwargs):
        found = super().plan(*args, **kwargs)
        found.threads = 2
        return found


def test_trace_records_each_row_split_call_only_when_on():
    lib = recurrent.load()
    tracing = ctypes.c_int.in_dll(lib, "kiln_lstm_fused_tracing")
    count = ctypes.c_long.in_dll(lib, "kiln_lstm_fused_trace_count")
    traces = (_Trace * 4096).in_dll(lib, "kiln_lstm_fused_traces")
    g = torch.Generator().manual_seed(11)
    steps, batch, inputs, hidden = 6, 8, 5, 20
    w, r = torch.rand(4 * hidden, inputs, generator=g) - 0.5, torch.rand(4 * hidden, hidden, generator=g) - 0.5
    b, x = torch.rand(8 * hidden, generator=g) - 0.5, torch.rand(steps, batch, inputs, generator=g) * 2 - 1
    layer = _TwoThreads(w, r, b, split="rows")

    def run():
        y = torch.empty(steps, batch, hidden)
        plan = layer.run(x, y, None, None, None, None, reverse=False, batch_major=False)
        return y, plan

    before = count.value
    plain, plan = run()
    assert plan.row_slices == 2 and count.value == before  # off: nothing written
    tracing.value = 1
    try:
        first = count.value
        traced = [run()[0] for _ in range(3)]
        assert count.value == first + 3
    finally:
        tracing.value = 0
    for y in traced:
        torch.testing.assert_close(y, plain, rtol=0, atol=0)
    for i in range(first, first + 3):
        t = traces[i % 4096]
        assert t.slices == 2 and t.start <= t.end
        for q in range(2):
            assert t.start <= t.slice_start[q] <= t.slice_end[q] <= t.end, (i, q)
            assert t.by_worker[q] in (0, 1)
