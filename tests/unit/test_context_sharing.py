"""A second execution context's first calls find what the first context and the load made (issue 10/14).

Each CPU context runs a lane of its own (kiln/runtime/engine.py CpuLane): its native segments are bound anew over an
arena of its own (Segment.on_arena). Such a twin takes its origin's grown view template (the load's view job grew it
to the profile's largest sizes) as a template of its own at the same sizes, and makes its plan rewrite sharing the
origin's traced rules and traced walk (Segment._adopt, _PlanRewrite's `like`), so its first call at a shape of a
class already traced traces nothing (before: ~5 ms on bert_tiny where its repeat costs 0.1, bench/results/
first-shape-2026-12-06.md). These tests check what is shared and what is not (memory), that a twin's first calls
trace nothing (they fail with Segment.SHARE_VIEWS off), and that contexts at new shapes, alone and on threads of
their own at once, answer as onnxruntime does. Since session 26 (h-ctx3) the adoption is a background job queued at
the lane's creation (views_ahead.twins_job), which also binds the twin's views and direct-run records at the shapes
the first context ran: the last tests hold the job back, check what creation left to it, run it (alone, and on a
thread of its own while the second context calls), and check that it never raises."""

from __future__ import annotations

import threading
import zlib

import numpy as np
import pytest
import torch

from kiln.kernels.cpu import onednn, onednn_ahead
from kiln.kernels.cpu import transformer as kernels
from kiln.runtime import first_calls, native, view_trace, views_ahead
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
    assert onednn_ahead.AHEAD.wait(timeout=120), "the second lane's job (views_ahead.twins_job) did not finish"
    assert second.program is not first.program
    pairs = list(zip(_view_segments(first.program), _view_segments(second.program)))
    assert pairs, "bert_tiny's program has no segment with views"
    for origin, twin in pairs:
        assert twin._origin() is origin
        assert (twin._grown is None) == (origin._grown is None)
        if origin._grown is not None:  # the load's view job grew it to 4x48, over the program's arena (SHARE_ARENA)
            assert origin._grown.arena is origin.arena and origin._grown._lock is origin._lock
            assert origin._grown.buffers[0].data_ptr() == origin.buffers[0].data_ptr()
            assert twin._grown.entry_sizes == origin._grown.entry_sizes
            ours = {b.data_ptr() for b in twin._grown.buffers}
            assert not ours & {b.data_ptr() for b in origin._grown.buffers}, "the twin runs in the origin's memory"
        template, origin_template = twin._grown or twin, origin._grown or origin
        assert template._rewrite is not None and template._rewrite is not origin_template._rewrite
        assert template._rewrite._whole is origin_template._rewrite._whole
        assert {id(m[0]) for m in template._rewrite._members if m[0] is not None} \
            == {id(m[0]) for m in origin_template._rewrite._members if m[0] is not None}
    for shape in ((2, 7), (4, 32), (3, 45), (4, 32)):  # views and the planned 4x32 over one memory, in each context
        _check(second, session, "sharing", *shape)
        _check(first, session, "sharing", *shape)
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


class _Held:
    """onednn_ahead.AHEAD's stand-in: jobs queued are kept, not run (a test runs them when it chooses)."""

    def __init__(self):
        self.jobs: list[onednn_ahead.Job] = []

    def schedule(self, jobs, threads: int) -> int:
        jobs = list(jobs)
        self.jobs += jobs
        return len(jobs)

    def wait(self, timeout: float | None = None) -> bool:
        return True


def _held_lanes(engine, monkeypatch) -> _Held:
    """Background jobs held back, and the engine's lane pool as a fresh engine's: the first context takes the engine's
    own lane, the next ones new lanes (not lanes earlier tests' contexts gave back, already readied)."""
    assert onednn_ahead.AHEAD.wait(120), "earlier tests' background jobs did not finish"
    held = _Held()
    monkeypatch.setattr(onednn_ahead, "AHEAD", held)
    monkeypatch.setattr(engine, "_free_lanes", [None])
    return held


def _twin_jobs(held: _Held) -> list[onednn_ahead.Job]:
    return [job for job in held.jobs if job.key[0] == "twin views"]


class _Binds:
    """Counts the views a segment binds or assembles (Segment._bind_sizes) on the test's own thread while it is on:
    not those an earlier test's lane job binds on the background thread meanwhile (a starved job of a context an
    earlier test made may run late: CI counted one such bind here)."""

    def __init__(self, monkeypatch):
        self.count = 0
        self.keys: list = []
        original = native.Segment._bind_sizes
        caller = threading.get_ident()

        def counted(segment, key):
            if threading.get_ident() == caller:
                self.count += 1
                self.keys.append(key)
            return original(segment, key)
        monkeypatch.setattr(native.Segment, "_bind_sizes", counted)


def test_a_second_contexts_lane_is_readied_in_the_background(dynamic_bert_tiny, monkeypatch):
    """Creation leaves the adoption to the lane's job (its twins hold no grown template or rewrite yet: with
    views_ahead.TWINS_AHEAD off they do, and this fails); the job adopts, binds the twin's views at the first context's
    shapes and makes their direct-run records, so the second context's first calls there bind nothing (without the
    job's views each binds one: this fails) and answer as onnxruntime does, as do its calls at new shapes."""
    engine, session = dynamic_bert_tiny
    held = _held_lanes(engine, monkeypatch)
    first = engine.create_execution_context(pad_first_calls=False)
    seen = ((2, 9), (3, 20))
    for shape in seen:
        _check(first, session, "ahead", *shape)
    second = engine.create_execution_context(pad_first_calls=False)
    pairs = list(zip(_view_segments(first.program), _view_segments(second.program)))
    assert pairs and all(twin._origin() is origin for origin, twin in pairs)
    assert all(twin._grown is None and twin._rewrite is None for _origin, twin in pairs), \
        "the second context's creation adopted its origin's views (not left to its job)"
    jobs = _twin_jobs(held)
    assert len(jobs) == 1
    assert jobs[0].make()
    for origin, twin in pairs:
        assert (twin._grown is None) == (origin._grown is None)
        template, origin_template = twin._grown or twin, origin._grown or origin
        assert template._rewrite is not None and template._rewrite._whole is origin_template._rewrite._whole
        wanted = {key for key, view in origin.resized.items() if view is not None}
        assert wanted and wanted <= {key for key, view in twin.resized.items() if view is not None}
    if first._direct is not None:
        assert set(first._direct._records) <= set(second._direct._records)
    for _origin, twin in pairs:  # the grown template over the second context's arena: one memory (SHARE_ARENA)
        if twin._grown is not None and twin.buffers:
            assert twin._grown.arena is twin.arena and twin._grown._lock is twin._lock
            assert twin._grown.buffers[0].data_ptr() == twin.buffers[0].data_ptr()
    binds = _Binds(monkeypatch)
    for shape in seen:
        _check(second, session, "ahead", *shape)
    assert binds.count == 0, f"the second context's first calls at seen shapes bound {binds.count} views: {binds.keys}"
    for shape in ((1, 6), (4, 32), (4, 41), (4, 32), (2, 9)):  # new to both (4x41: past the build's 4x32), and the
        _check(second, session, "ahead new", *shape)  # planned 4x32 between views over the same memory
    _check(first, session, "ahead", 4, 41)


def test_a_second_contexts_job_runs_while_it_calls(dynamic_bert_tiny, monkeypatch):
    """The lane's job on a thread of its own while the second context calls at the first's shapes and at new ones
    (each view bound by whichever comes first, under the resize lock both take): every answer is onnxruntime's."""
    engine, session = dynamic_bert_tiny
    held = _held_lanes(engine, monkeypatch)
    first = engine.create_execution_context(pad_first_calls=False)
    for shape in ((1, 9), (2, 21), (3, 33)):
        _check(first, session, "racing", *shape)
    second = engine.create_execution_context(pad_first_calls=False)
    (job,) = _twin_jobs(held)
    together = threading.Barrier(2, timeout=60)
    raised: list[BaseException] = []

    def run_job() -> None:
        try:
            together.wait()
            job.make()
        except BaseException as e:  # noqa: BLE001  re-raised below, in the test's thread
            raised.append(e)

    thread = threading.Thread(target=run_job)
    thread.start()
    together.wait()
    for shape in ((4, 32), (3, 33), (4, 32), (1, 9), (4, 43), (4, 32), (2, 21)):  # 4x32: the planned segment, over
        _check(second, session, "racing", *shape)  # the arena whose pages the job touches for the grown template
    thread.join()
    if raised:
        raise raised[0]
    for shape in ((1, 9), (4, 43)):
        _check(second, session, "racing", *shape)


def test_a_second_contexts_job_never_raises(dynamic_bert_tiny, monkeypatch):
    """A job whose work fails returns (the background thread must never see it raise) and leaves the work to the
    calls: the second context still adopts at its first new size and answers as onnxruntime does."""
    engine, session = dynamic_bert_tiny
    held = _held_lanes(engine, monkeypatch)
    first = engine.create_execution_context(pad_first_calls=False)
    _check(first, session, "failing", 2, 5)
    second = engine.create_execution_context(pad_first_calls=False)

    def fails(segment, limit):
        raise RuntimeError("a view that cannot be bound")
    monkeypatch.setattr(native.Segment, "adopt_views", fails)
    (job,) = _twin_jobs(held)
    assert job.make() is False
    _check(second, session, "failing", 2, 5)
    _check(second, session, "failing", 3, 12)
    twin = _view_segments(second.program)[0]
    assert (twin._grown or twin)._rewrite is not None


def test_without_the_job_creation_adopts(dynamic_bert_tiny, monkeypatch):
    """views_ahead.TWINS_AHEAD off (or KILN_ONEDNN_AHEAD=0): a new lane adopts at its creation, as before, and queues
    no job."""
    engine, session = dynamic_bert_tiny
    held = _held_lanes(engine, monkeypatch)
    monkeypatch.setattr(views_ahead, "TWINS_AHEAD", False)
    first = engine.create_execution_context(pad_first_calls=False)
    _check(first, session, "at creation", 2, 6)
    second = engine.create_execution_context(pad_first_calls=False)
    assert not _twin_jobs(held)
    for origin, twin in zip(_view_segments(first.program), _view_segments(second.program)):
        assert (twin._grown is None) == (origin._grown is None)
        assert (twin._grown or twin)._rewrite is not None
    _check(second, session, "at creation", 2, 6)


def test_a_lane_given_back_is_readied_again(dynamic_bert_tiny, monkeypatch):
    """A context made on a lane a freed context gave back queues the lane's job again: it binds the views at the shapes
    the first context ran since, so the new context's first calls there bind nothing (without the job on reuse each
    binds one: this fails)."""
    engine, session = dynamic_bert_tiny
    held = _held_lanes(engine, monkeypatch)
    first = engine.create_execution_context(pad_first_calls=False)
    second = engine.create_execution_context(pad_first_calls=False)
    (job,) = _twin_jobs(held)
    job.make()
    lane_program = second.program
    del second  # its lane goes back to the pool (weakref.finalize)
    for shape in ((2, 17), (1, 23)):
        _check(first, session, "again", *shape)
    third = engine.create_execution_context(pad_first_calls=False)
    assert third.program is lane_program
    jobs = _twin_jobs(held)
    assert len(jobs) == 2
    jobs[1].make()
    binds = _Binds(monkeypatch)
    for shape in ((2, 17), (1, 23)):
        _check(third, session, "again", *shape)
    assert binds.count == 0, \
        f"the reused lane's first calls at the first context's shapes bound {binds.count} views: {binds.keys}"


def _extents_by_native_steps(template, key) -> list[tuple[int, int]]:
    """The oracle of Segment._extents: each arena value's bytes at `key` from the members' own NativeSteps
    (Segment._natives_at's forms), at its planned address, merged."""
    forms = template._natives_at(key).forms
    base = template.buffers[0].data_ptr()
    spans = sorted((template._address[s] - base, template._address[s] - base + int(np.prod(forms[s][0]))
                    * forms[s][2].itemsize) for s, _g in template._arena_slots)
    merged: list[list[int]] = []
    for start, stop in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], stop)
        elif stop > start:
            merged.append([start, stop])
    return [tuple(span) for span in merged]


def test_extents_by_rules_are_the_native_steps_sizes(dynamic_bert_tiny):
    """_PlanRewrite.arena_bytes_at (the rules' walk, no lock: what a new lane's job touches by) gives every arena
    value's bytes as the members' own NativeSteps at those sizes do, at fresh random shapes of the profile, on the
    grown template and on the planned segment."""
    engine, _session = dynamic_bert_tiny
    program = engine.program
    (segment,) = _view_segments(program)
    entries = tuple(program.lean_steps[0].inputs)
    rng = np.random.default_rng(zlib.crc32(b"extents by rules"))
    templates = [t for t in (segment._grown, segment) if t is not None and t._rewrite is not None]
    assert templates and templates[0] is segment._grown, "the load's view job did not grow bert_tiny's template"
    compared = 0
    for template in templates:
        for _ in range(12):
            batch, seq = int(rng.integers(1, 5)), int(rng.integers(1, 49))
            key = first_calls.entry_key(program, entries, [(batch, seq)] * len(program.input_slots))
            at = template._natives_at(key)
            if not template.fits(at.natives, at.forms):  # past the planned segment's arena: the grown one's only
                continue
            assert segment._extents(template, key) == _extents_by_native_steps(template, key), key
            assert template._rewrite.arena_bytes_at(template, key) is not None, key  # the rules answered it
            compared += 1
    assert compared >= 12


def test_a_second_contexts_job_touches_only_what_its_origin_ran(dynamic_bert_tiny, monkeypatch):
    """The lane's job leaves its adopted grown template's pages untouched except where a run of the first context's
    shapes reaches (each view's values at their planned places, as the members' NativeSteps size them), and the
    planned plan's pages only where the first context ran its planned sizes: a context that runs small shapes does
    not hold the profile's largest plan (BERT-base: 36 MiB a context, bench/results/first-shape-2026-12-06.md).
    Before, the adoption zeroed the grown template whole (every one of its pages: this fails). Its calls answer as
    onnxruntime does and bind nothing at the seen shapes."""
    engine, session = dynamic_bert_tiny
    assert onednn_ahead.AHEAD.wait(timeout=120)  # earlier tests' lanes' jobs done: none touches while this records
    held = _held_lanes(engine, monkeypatch)
    monkeypatch.setattr(native.Segment, "TOUCH_ADOPTED_WHOLE", False)  # the lean touch (off by default: see native.py)
    monkeypatch.setattr(views_ahead, "TWIN_VIEWS", 2)  # the job binds (and touches for) this test's two shapes only
    first = engine.create_execution_context(pad_first_calls=False)
    seen = ((2, 9), (1, 5))
    for shape in seen:
        _check(first, session, "touch", *shape)
    origin = _view_segments(first.program)[0]
    touched: list[tuple] = []
    original = native.Segment._touch
    twin = None

    def recorded(template, extents):
        if twin is not None and template in (twin, twin._grown):  # (this lane's only)
            touched.append((template, list(extents)))
        original(template, extents)
    monkeypatch.setattr(native.Segment, "_touch", staticmethod(recorded))
    zeroed: list[tuple[int, int]] = []  # (address, bytes) of every tensor zeroed while the job runs
    zero = torch.Tensor.zero_

    def zero_recorded(tensor):
        zeroed.append((tensor.data_ptr(), tensor.numel() * tensor.element_size()))
        return zero(tensor)
    kept = []  # each round's context lives on: the next one's lane is a new one (not this one's, given back)
    for ran_planned in (False, True):
        monkeypatch.setattr(origin, "ran_planned", ran_planned)
        second = engine.create_execution_context(pad_first_calls=False)
        kept.append(second)
        twin = _view_segments(second.program)[0]
        (job,) = _twin_jobs(held)[-1:]
        touched.clear()
        zeroed.clear()
        with monkeypatch.context() as patched:
            patched.setattr(torch.Tensor, "zero_", zero_recorded)
            assert job.make()
        grown = twin._grown
        assert grown is not None and grown.arena is twin.arena
        grown_bytes = sum(b.numel() * b.element_size() for b in grown.buffers)
        base = grown.buffers[0].data_ptr()
        pages = {page for address, nbytes in zeroed for page in range((address - base) // 4096,
                                                                     (address - base + nbytes - 1) // 4096 + 1)
                 if 0 <= page * 4096 < grown_bytes}
        planned_pages = -(-twin.planned_bytes // 4096) if ran_planned else 0
        assert len(pages - set(range(planned_pages))) * 4096 < grown_bytes / 2, \
            f"the job touched {len(pages)} pages of the second context's grown template ({grown_bytes} bytes)"
        keys = [key for key, view in origin.resized.items() if view is not None][-2:]
        assert {key[0] for key in keys} == set(seen)
        wanted = [(grown, _extents_by_native_steps(grown, key)) for key in keys]
        if ran_planned:
            wanted.insert(0, (twin, [(0, twin.planned_bytes)]))
        assert [(id(t), e) for t, e in touched] == [(id(t), e) for t, e in wanted]
        assert pages >= {page for _t, extents in touched for start, stop in extents
                         for page in range(start // 4096, (stop - 1) // 4096 + 1)}
        binds = _Binds(monkeypatch)
        for shape in seen:
            _check(second, session, "touch", *shape)
        assert binds.count == 0
        for shape in ((4, 32), (4, 45), (3, 17)):  # the planned sizes, past them (the grown template's far pages), new
            _check(second, session, f"touch {ran_planned}", *shape)
        assert twin.ran_planned  # its run at the planned 4x32 (a lane given back touches no planned page again)
