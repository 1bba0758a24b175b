"""The build's small packed buffers and the chunks of huge pages they are carved from (kiln/kernels/cpu/hugepages.py).

The bump allocator never reuses a freed range: a chunk stays resident while any buffer carved from it lives, and
while it is the current chunk. What the tactic search packs for a layer's candidates, and what a rival program of
the in-context stage packs, dies with them; each starts a chunk of its own (hugepages.new_chunk) so that the chunk
goes too. Counted here: the bytes carved by those phases that still lie in a chunk alive once the phase is over
(before: the search's last chunk lived on as the current one under the engine's own buffers; the rival programs'
buffers shared the chosen program's chunk). Not RSS: the bytes themselves.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import weakref

import numpy as np
import pytest
import torch

from kiln.builder import autotune, in_context
from kiln.kernels.cpu import gemm_native, hugepages, native_loop, onednn
from kiln.runtime import program as program_module

from tests.unit.test_in_context import ONEDNN, PACKED, ROWS, WIDTH, _blocks, _build_one_thread, _ffn_model, _rivals

pytestmark = pytest.mark.skipif(
    not (hugepages.enabled() and onednn.available() and gemm_native.available() and native_loop.load()),
    reason="huge pages, oneDNN, kiln's GEMM or the compiled segment loop is not available")


@dataclasses.dataclass
class _Carved:
    mapping: weakref.ref  # the chunk's mapping: alive while any buffer carved from it is (or the chunk is current)
    nbytes: int
    phase: str


class _Tracker:
    """Every buffer carved from a shared chunk: its chunk (weakly), its bytes and the phase that asked for it."""

    def __init__(self, monkeypatch):
        self.carved: list[_Carved] = []
        self.phase = "other"
        empty = hugepages.empty

        def tracked(numel, dtype=torch.float32, own=False):
            buffer = empty(numel, dtype, own)
            chunk = hugepages._current
            if chunk is not None and chunk.bytes.data_ptr() <= buffer.data_ptr() < chunk.bytes.data_ptr() + chunk.size:
                self.carved.append(_Carved(weakref.ref(chunk.map), buffer.nbytes, self.phase))
            return buffer

        monkeypatch.setattr(hugepages, "empty", tracked)
        for module in (gemm_native, onednn):  # the kernels that pack a GEMM's weights import the module's function
            monkeypatch.setattr(module.hugepages, "empty", tracked)

    def during(self, phase: str, fn):
        def wrapped(*args, **kwargs):
            outer, self.phase = self.phase, phase
            try:
                return fn(*args, **kwargs)
            finally:
                self.phase = outer
        return wrapped

    def carved_bytes(self, phase: str) -> int:
        return sum(c.nbytes for c in self.carved if c.phase == phase)

    def alive_bytes(self, phase: str) -> int:
        """Bytes carved in `phase` that lie in a chunk still alive."""
        gc.collect()
        return sum(c.nbytes for c in self.carved if c.phase == phase and c.mapping() is not None)


@pytest.fixture
def tracker(monkeypatch) -> _Tracker:
    hugepages.new_chunk()  # no chunk of an earlier test
    return _Tracker(monkeypatch)


@contextlib.contextmanager
def _threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_new_chunk_lets_the_current_chunk_go_with_its_last_buffer():
    if not hugepages.enabled():
        pytest.skip("no MADV_HUGEPAGE")
    first = hugepages.empty(1000)
    chunk = weakref.ref(hugepages._current.map)
    hugepages.new_chunk()
    second = hugepages.empty(1000)
    assert second.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
    del first
    gc.collect()
    assert chunk() is None  # before: held as the current chunk until a request did not fit it
    second.fill_(2.0)
    assert bool((second == 2).all())


def test_the_search_candidates_buffers_leave_no_chunk_alive_and_the_engine_matches_onnxruntime(tracker,
                                                                                               monkeypatch):
    """Every layer's candidates (kiln's packed GEMM, oneDNN's inner product: 64 KiB weights, carved from a chunk)
    are packed and dropped; once the build is done none of their bytes lies in a live chunk (before: the search's
    chunk stayed the current one and the engine's own buffers were carved from it after)."""
    import onnxruntime as ort

    monkeypatch.setattr(autotune, "_tune_layer", tracker.during("search", autotune._tune_layer))
    model = _ffn_model()
    engine = _build_one_thread(model)
    assert tracker.carved_bytes("search") >= 4 * 64 * 256 * 4  # each layer's two candidates packed its weight
    assert tracker.carved_bytes("other") > 0  # the engine's own (in context, the check): alive, rightly
    assert tracker.alive_bytes("search") == 0
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    feed = np.random.default_rng().standard_normal((1, 64, 64), dtype=np.float32)
    np.testing.assert_allclose(engine.run({"x": feed})["y"], session.run(None, {"x": feed})[0], rtol=1e-4, atol=1e-4)


def test_a_rival_programs_buffers_leave_no_chunk_alive_after_the_in_context_stage(tracker, monkeypatch):
    """The chosen program's launches are kept (the build's `launches`, for the engine); each signature's rival
    program packs its layers and runs, then goes: none of what it carved lies in a live chunk after the stage
    (before: carved from the chosen program's chunk, kept alive by the chosen program's buffers)."""
    monkeypatch.setattr(in_context, "_time_group", tracker.during("rival", in_context._time_group))
    monkeypatch.setattr(program_module, "SHARE_MIN_ELEMENTS", 1)  # these weights count as large: their launches kept
    spec, weights = _blocks()
    launches: dict = {}
    with _threads(1):
        found = in_context.retime(spec, weights, torch.device("cpu"), [torch.randn(1, ROWS, WIDTH)], _rivals(spec),
                                  launches).found
    assert sorted(found) == [0, 1, 2, 3]
    assert {spec.steps[i].tactic for i in found} <= {PACKED, ONEDNN}
    assert tracker.carved_bytes("rival") > 0 and tracker.alive_bytes("other") > 0  # the chosen program's: kept
    assert tracker.alive_bytes("rival") == 0
