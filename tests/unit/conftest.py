"""Fixtures several files of tests/unit share."""

from __future__ import annotations

import pytest
import torch

from kiln.runtime import direct_run


@pytest.fixture
def two_threads(monkeypatch):
    """OpenMP's count at 2, small layers measured (both forms bound: thread_forms binds a serial twin only on more
    than one thread): how a 2-thread deployment builds."""
    monkeypatch.delenv("KILN_SERIAL_SMALL_LAYERS", raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def counted(monkeypatch):
    """The input shapes of the runs that went through a DirectRun (kiln/runtime/direct_run.py), one tuple a run."""
    calls = []
    run = direct_run.DirectRun.run

    def counting(self, arrays):
        calls.append(tuple(a.shape for a in arrays))
        return run(self, arrays)

    monkeypatch.setattr(direct_run.DirectRun, "run", counting)
    return calls
