"""A second execution context's first calls find what the first context and the load made (issue 10/14).

Each CPU context runs a lane of its own (kiln/runtime/engine.py CpuLane): its native segments are bound anew over an
arena of its own (Segment.on_arena). Such a twin takes its origin's grown view template (the load's view job grew it
to the profile's largest sizes) as a template of its own at the same sizes, and makes its plan rewrite sharing the
origin's traced rules and traced walk (Segment._adopt, _PlanRewrite's `like`), so its first call at a shape of a
class already traced traces nothing (before: ~5 ms on bert_tiny where its repeat costs 0.1, bench/results/
first-shape-2026-12-06.md). These tests check what is shared and what is not (memory), that a twin's first calls
trace nothing (they fail with Segment.SHARE_VIEWS off), and that contexts at new shapes, alone and on threads of
their own at once, answer as onnxruntime does."""

from __future__ import annotations

import threading
import zlib

import numpy as np
import pytest

from kiln.kernels.cpu import onednn
from kiln.kernels.cpu import transformer as kernels
from kiln.runtime import native, view_trace
from kiln.tactics import traced_rules

pytestmark = pytest.mark.skipif(not (kernels.available() and onednn.available()),
                                reason="kiln's transformer kernels or libdnnl.so.3 are not available")

ORT_TOL = 1e-4  # kiln against onnxruntime: two fp32 implementations' rounding over 2 layers (test_native_binding.py)


def _feeds(case: str, batch: int, seq: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(zlib.crc32(f"{case} {batch}x{seq}".encode()))
    mask = np.ones((batch, seq), np.int64)
    for row in range(batch):
        mask[row, rng.integers(1, seq + 1):] = 0  # each row keeps a real token
    return {"input_ids": rng.integers(0, 1024, (batch, seq), dtype=np.int64), "attention_mask": mask}


def _check(context, session, case: str, batch: int, seq: int) -> None:
    feeds = _feeds(case, batch, seq)
    got = context.run(feeds)
    for g, w in zip(got.values(), session.run(None, feeds)):
        np.testing.assert_allclose(g, w, rtol=ORT_TOL, atol=ORT_TOL, err_msg=f"{case}: {batch}x{seq}")


def _view_segments(program) -> list:
    return [s for s in program.segments if s._views]


class _Traces:
    """Counts the rule traces (TracedRule._trace) and walk traces (ViewTrace.learn) made while it is on."""

    def __init__(self, monkeypatch):
        self.count = 0
        for owner, name in ((traced_rules.TracedRule, "_trace"), (view_trace.ViewTrace, "learn")):
            original = getattr(owner, name)

            def counted(*args, _original=original, **kwargs):
                self.count += 1
                return _original(*args, **kwargs)
            monkeypatch.setattr(owner, name, counted)


def test_a_second_context_shares_the_traces_not_the_memory(dynamic_bert_tiny):
    """The twin's segments: their origin's grown template's sizes in memory of their own, the origin's traced walk
    and rules (the same objects), views of their own."""
    engine, session = dynamic_bert_tiny
    first = engine.create_execution_context(pad_first_calls=False)
    _check(first, session, "sharing", 2, 7)
    second = engine.create_execution_context(pad_first_calls=False)
    assert second.program is not first.program
    pairs = list(zip(_view_segments(first.program), _view_segments(second.program)))
    assert pairs, "bert_tiny's program has no segment with views"
    for origin, twin in pairs:
        assert twin._origin() is origin
        assert (twin._grown is None) == (origin._grown is None)
        if origin._grown is not None:  # the load's view job grew it to 4x48
            assert twin._grown.entry_sizes == origin._grown.entry_sizes
            ours = {b.data_ptr() for b in twin._grown.buffers}
            assert not ours & {b.data_ptr() for b in origin._grown.buffers}, "the twin runs in the origin's memory"
        template, origin_template = twin._grown or twin, origin._grown or origin
        assert template._rewrite is not None and template._rewrite is not origin_template._rewrite
        assert template._rewrite._whole is origin_template._rewrite._whole
        assert {id(m[0]) for m in template._rewrite._members if m[0] is not None} \
            == {id(m[0]) for m in origin_template._rewrite._members if m[0] is not None}
    _check(second, session, "sharing", 2, 7)
    for origin, twin in pairs:
        assert not set(map(id, twin.resized.values())) & set(map(id, origin.resized.values())) - {id(None)}


def test_a_second_contexts_first_calls_trace_nothing(dynamic_bert_tiny, monkeypatch):
    """A second context's first calls, at a shape the first context ran and at new shapes of classes the load
    traced, trace no rule and no walk, and answer as onnxruntime does (with Segment.SHARE_VIEWS off the twin makes
    its own rewrite, and its first view traces again: this fails)."""
    engine, session = dynamic_bert_tiny
    first = engine.create_execution_context(pad_first_calls=False)
    for shape in ((2, 9), (3, 20)):
        _check(first, session, "first", *shape)
    second = engine.create_execution_context(pad_first_calls=False)
    traces = _Traces(monkeypatch)
    for shape in ((2, 9), (3, 20), (2, 13), (4, 41), (3, 47)):  # seen by the first; then new (4x41: past 4x32)
        _check(second, session, "second", *shape)
    assert traces.count == 0, f"a second context's first calls traced {traces.count} rules or walks again"
    assert all(other is not None for s in _view_segments(second.program) for other in s.resized.values())


def test_twins_made_before_the_origin_grew_take_it_later(dynamic_bert_tiny):
    """A twin made while its origin had not grown (or rewritten) yet takes what the origin made since at its next
    new size (Segment._bind_sizes adopts), and answers as onnxruntime does."""
    engine, session = dynamic_bert_tiny
    first = engine.create_execution_context(pad_first_calls=False)
    second = engine.create_execution_context(pad_first_calls=False)
    origin, twin = _view_segments(first.program)[0], _view_segments(second.program)[0]
    with origin._resize_lock:  # as if made before the load's view job: nothing adopted
        twin._grown, grown = None, twin._grown
        twin._rewrite = None
    _check(second, session, "later", 1, 5)
    assert (twin._grown is None) == (origin._grown is None)
    assert twin._grown is not grown or grown is None
    assert (twin._grown or twin)._rewrite._whole is (origin._grown or origin)._rewrite._whole


def test_contexts_at_new_shapes_on_threads_at_once_match_onnxruntime(dynamic_bert_tiny):
    """Three contexts (two of them twins), each on a thread of its own, all at once at shapes none has run (each
    thread's own, some past the build's 4x32), each answer against onnxruntime's; a barrier starts each round
    together, so twins adopt and bind views while their origin binds its own."""
    engine, session = dynamic_bert_tiny
    contexts = [engine.create_execution_context(pad_first_calls=False) for _ in range(3)]
    shapes = [[(1, 3), (4, 37), (2, 29)], [(3, 3), (4, 44), (1, 29)], [(2, 3), (3, 39), (4, 29)]]
    together = threading.Barrier(3, timeout=60)
    raised: list[BaseException] = []

    def work(k: int) -> None:
        try:
            for shape in shapes[k]:
                together.wait()
                _check(contexts[k], session, f"threads {k}", *shape)
        except BaseException as e:  # noqa: BLE001  re-raised below, in the test's thread
            raised.append(e)
            together.abort()

    threads = [threading.Thread(target=work, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if raised:
        raise raised[0]
