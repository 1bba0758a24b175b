"""What a loaded CPU engine of a dynamic profile makes for its views before any new shape meets them (issue 10,
kiln/runtime/first_calls.py _trace_job): the view template grown to the profile's largest sizes (Segment.grow_ahead)
and the view's walk traced at trace_shapes's shapes (Segment.trace_ahead), on the background thread. Its first
calls at fresh shapes then trace nothing (no rule run on symbols, no walk learned), answer from the traced walk, grow
nothing, and match onnxruntime; what is traced is what the walk finds (test_view_trace.py compares them byte for
byte). The engine: test_view_trace.py's MLP block, one segment whose every member has a plan rule."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from kiln.kernels.cpu import onednn_ahead
from kiln.kernels.cpu import transformer as kernels
from kiln.plan.spec import Profile, ShapeRange
from kiln.runtime import first_calls, native, view_trace
from kiln.tactics import traced_rules

from test_view_trace import ORT_TOL, _answers_counted, _mlp, _traced_views_are_the_walks, _x  # noqa: E402

pytestmark = pytest.mark.skipif(not kernels.available(), reason="kiln's transformer kernels are not built")

PROFILE = "1x1x64,2x8x64,4x16x64"  # opt 2 x 8: the build's arena holds no 4 x 16


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """(the MLP built with its GEMMs on kiln's kernel, saved and loaded, onnxruntime's session)."""
    import onnxruntime as ort

    import kiln
    from kiln.tactics import registry

    path = tmp_path_factory.mktemp("views_ahead") / "mlp.onnx"
    _mlp(path, np.random.default_rng(zlib.crc32(b"views ahead")))
    registry.load_device("cpu")
    allowed = [name for name, tactic in registry.all_tactics("cpu").items()
               if tactic.op_type != "FusedGemm" or name == "cpu.gemm.kiln_packed"]
    kiln.build(str(path), profiles=[{"x": PROFILE}], tactics=allowed).save(path.with_suffix(".kiln"))
    engine = kiln.load(path.with_suffix(".kiln"))
    return engine, ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]), path.with_suffix(".kiln")


def test_a_loaded_engines_first_new_shapes_trace_nothing_and_match_onnxruntime(loaded, monkeypatch):
    engine, session, _path = loaded
    assert onednn_ahead.AHEAD.wait(timeout=120), "the background thread did not finish"
    (segment,) = engine.program.segments
    grown = segment._grown
    assert grown is not None and grown.entry_sizes[0] == (4, 16, 64)  # grown at load: fails before
    assert grown._rewrite is not None and grown._rewrite._whole.paths > 0  # traced at load: fails before
    traced = []
    for owner, name in ((traced_rules.TracedRule, "_trace"), (view_trace.ViewTrace, "learn")):
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, real=real, name=name: traced.append(name) or real(*a))
    made = []
    real_segment = native.Segment.__init__
    monkeypatch.setattr(native.Segment, "__init__", lambda self, *a, **k: made.append(1) or real_segment(self, *a, **k))
    answered = _answers_counted(monkeypatch)
    context = engine.create_execution_context(pad_first_calls=False)  # every new shape binds
    rng = np.random.default_rng(zlib.crc32(b"first new shapes"))
    shapes = [(4, 16), (1, 1)] + [(int(rng.integers(1, 5)), int(rng.integers(1, 17))) for _ in range(10)]
    for batch, seq in dict.fromkeys(shapes):
        feeds = _x(rng, batch, seq)
        np.testing.assert_allclose(context.run(feeds)["y"], session.run(None, feeds)[0], rtol=ORT_TOL, atol=ORT_TOL,
                                   err_msg=f"{batch}x{seq}")
    assert traced == [], f"traced at a call: {traced}"  # each first shape traced its rules and walk before
    assert made == [] and segment._grown is grown  # no template grown at a call
    assert answered and all(answered), "a view off the paths traced at load"
    assert _traced_views_are_the_walks(segment, monkeypatch) >= 3


def test_trace_shapes_cover_each_dims_small_values_powers_of_two_and_largest():
    """Each dim's first TRACE_SMALL values from its min, the powers of two past them, its max; inputs sharing a
    dim position get the same sizes; smallest first."""
    profile = Profile({"ids": ShapeRange([1, 1], [8, 128], [8, 256]), "mask": ShapeRange([1, 1], [8, 128], [8, 256])})

    class Spec:
        inputs = ["ids", "mask"]

    class Program:
        spec = Spec()

    shapes = first_calls.trace_shapes(Program(), [profile])
    assert all(ids == mask for ids, mask in shapes)
    batches, seqs = sorted({ids[0] for ids, _ in shapes}), sorted({ids[1] for ids, _ in shapes})
    assert batches == list(range(1, 9))
    assert seqs == [*range(1, 9), 16, 32, 64, 128, 256]
    assert len(shapes) == len(batches) * len(seqs)
    sizes = [ids[0] * ids[1] for ids, _ in shapes]
    assert sizes == sorted(sizes) and shapes[0] == [(1, 1), (1, 1)]
    narrow = Profile({"ids": ShapeRange([2, 5], [2, 6], [2, 7]), "mask": ShapeRange([2, 5], [2, 6], [2, 7])})
    assert first_calls.trace_shapes(Program(), [narrow]) == [[(2, s), (2, s)] for s in (5, 6, 7)]
    assert first_calls.trace_shapes(Program(), [Profile({"ids": profile.inputs["ids"]})]) == []  # mask unnamed
    wide = Profile({"ids": ShapeRange([1, 1, 1], [2, 2, 2], [64, 512, 512]),
                    "mask": ShapeRange([1, 1, 1], [2, 2, 2], [64, 512, 512])})
    many = first_calls.trace_shapes(Program(), [wide])  # 15 x 18 x 18 combinations: the smallest kept
    assert len(many) == first_calls.TRACE_SHAPES and many[0] == [(1, 1, 1), (1, 1, 1)]


def test_the_view_job_is_queued_for_a_dynamic_profile_only_and_its_segment_is_held_weakly(loaded):
    engine, _session, _path = loaded
    views = lambda profiles: [j for j in first_calls.ahead_jobs(engine.program, profiles)  # noqa: E731
                              if j.key[0] == "view traces"]
    assert len(views(engine.profiles)) == 1
    one_shape = [Profile({name: ShapeRange(r.opt, r.opt, r.opt) for name, r in p.inputs.items()})
                 for p in engine.profiles]
    assert views(one_shape) == []
    (segment,) = engine.program.segments
    assert onednn_ahead.AHEAD.wait(timeout=120), "the background thread did not finish"  # the load's traces made
    assert first_calls.entry_key(engine.program, (engine.program.lean_steps[0].inputs[0],), [(3, 5, 64)]) \
        == ((3, 5, 64),)
    assert segment.trace_ahead(((3, 5, 64),)) is False  # on a path traced at load: nothing added


def calls_racing_the_load(path, session, calls: int, draw, tol: float) -> None:
    """The engine at `path` loaded anew (its jobs queued) and `calls` calls on each of two threads racing the jobs,
    each at draw(rng) -> (feeds, what they are): every output is onnxruntime's within tol (an error on a thread is
    raised on the test's), and the background thread finishes with no job failed."""
    import threading

    import kiln

    assert onednn_ahead.AHEAD.wait(timeout=120)
    failed = onednn_ahead.AHEAD.failed
    engine = kiln.load(path)  # its jobs queued: the calls below race them
    errors = []

    def run(seed: int) -> None:
        try:
            context = engine.create_execution_context(pad_first_calls=False)
            rng = np.random.default_rng(seed)
            for _ in range(calls):
                feeds, what = draw(rng)
                np.testing.assert_allclose(context.run(feeds)["y"], session.run(None, feeds)[0], rtol=tol, atol=tol,
                                           err_msg=what)
        except Exception as e:  # noqa: BLE001  raised again on the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(zlib.crc32(f"racing {k}".encode()),)) for k in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert onednn_ahead.AHEAD.wait(timeout=120) and onednn_ahead.AHEAD.failed == failed


def test_calls_while_the_views_are_made_ahead_match_onnxruntime(loaded):
    """Calls at new shapes right after load, on two threads, while the background thread grows the template and
    traces the walk (each side under the locks it takes): every output matches onnxruntime, and the background
    thread finishes with no job failed."""
    def draw(rng):
        batch, seq = int(rng.integers(1, 5)), int(rng.integers(1, 17))
        return _x(rng, batch, seq), f"{batch}x{seq}"

    _engine, session, path = loaded
    calls_racing_the_load(path, session, 8, draw, ORT_TOL)


def test_a_call_off_the_loads_traced_paths_leaves_its_traces_to_the_background_thread(loaded, monkeypatch):
    """A class of sizes the load's traces did not meet (trace_shapes narrowed to one shape here; on BERT-base a call
    of such a class traced ~4 ms on the calling thread): its first call walks with the rules run plainly (no rule
    traced, no walk learned on the calling thread), matches onnxruntime, and queues the traces on the background
    thread (native_views._PlanRewrite._learn_later), after which the class's sizes are one call of the traced walk.
    Fails with the traces made on the calling thread (the tree before)."""
    import threading

    import kiln
    from kiln.runtime import native_views

    _engine, session, path = loaded
    assert onednn_ahead.AHEAD.wait(timeout=120)
    monkeypatch.setattr(first_calls, "trace_shapes", lambda program, profiles: [[(2, 8, 64)]])
    engine = kiln.load(path)
    assert onednn_ahead.AHEAD.wait(timeout=120), "the background thread did not finish"
    failed = onednn_ahead.AHEAD.failed
    (segment,) = engine.program.segments
    rewrite = (segment._grown or segment)._rewrite
    paths = rewrite._whole.paths
    assert paths >= 1
    traces: list[tuple[str, int]] = []  # (what, the thread it ran on)
    for owner, name in ((traced_rules.TracedRule, "_trace"), (view_trace.ViewTrace, "learn")):
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, real=real, name=name:
                            traces.append((name, threading.get_ident())) or real(*a))
    deferred: list[tuple] = []
    later = native_views._PlanRewrite._learn_later
    monkeypatch.setattr(native_views._PlanRewrite, "_learn_later",
                        lambda self, template, key: deferred.append(key) or later(self, template, key))
    context = engine.create_execution_context(pad_first_calls=False)  # every new shape binds
    rng = np.random.default_rng(zlib.crc32(b"off the traced paths"))
    shapes = [(1, 1), (1, 5), (3, 1), (4, 16), (3, 13)] + \
        [(int(rng.integers(1, 5)), int(rng.integers(1, 17))) for _ in range(8)]
    for batch, seq in dict.fromkeys(shapes):
        feeds = _x(rng, batch, seq)
        np.testing.assert_allclose(context.run(feeds)["y"], session.run(None, feeds)[0], rtol=ORT_TOL, atol=ORT_TOL,
                                   err_msg=f"{batch}x{seq}")
        assert [t for t in traces if t[1] == threading.get_ident()] == [], f"traced by the call at {batch}x{seq}"
    assert deferred, "no call met a class the load did not trace: the test shows nothing"
    assert onednn_ahead.AHEAD.wait(timeout=120) and onednn_ahead.AHEAD.failed == failed
    assert rewrite._whole.paths > paths and any(name == "learn" for name, _ in traces)  # traced on the thread
    assert all(rewrite._whole(key) is not None for key in deferred[:1])  # its class: one call of the traced walk
    for batch, seq in [(1, 7), (3, 2)]:  # again after the traces: still onnxruntime's answers
        feeds = _x(rng, batch, seq)
        np.testing.assert_allclose(context.run(feeds)["y"], session.run(None, feeds)[0], rtol=ORT_TOL, atol=ORT_TOL,
                                   err_msg=f"{batch}x{seq} after")


def test_the_load_fills_the_shape_functions_memos_and_first_calls_find_them(dynamic_bert_tiny, monkeypatch):
    """The view job runs the shape function at every value of each dim (first_calls.memo_shapes): bert_tiny's
    sequence memo holds every sequence 1-48 of its profile, their bytes each storage once
    (the sequence's values are views of one base), and first calls at fresh shapes compute no group's values (no
    memo put), make no row of a mask grid's corners (shape_function._GridBase; this export has none) and match
    onnxruntime. Fails without the memo shapes (puts at new sequences; 11 sequences kept)."""
    from kiln.runtime import shape_function as sf

    engine, session = dynamic_bert_tiny
    assert onednn_ahead.AHEAD.wait(timeout=120)
    memos = engine.program.shape_function.memos
    assert memos and max(len(m) for m in memos) == 48  # the sequence's (a batch's, where the export has one: 4)
    assert all(0 < m.held <= sf.MEMO_BYTES for m in memos)
    shapes = first_calls.memo_shapes(engine.program, engine.profiles)
    assert len(shapes) == 4 + 48 - 1 and [(1, 1), (1, 1)] in shapes and [(4, 1), (4, 1)] in shapes \
        and [(1, 48), (1, 48)] in shapes
    puts, rows = [], []  # this program's only (another engine's background job in this process is not this test's)
    grids = [g for g in engine.program.shape_function.fn.__globals__.values() if isinstance(g, sf._Grid)]
    real = sf._Memo.put
    monkeypatch.setattr(sf._Memo, "put", lambda self, key, values: (any(self is m for m in memos) and puts.append(key))
                        or real(self, key, values))
    row = sf._GridBase._row
    monkeypatch.setattr(sf._GridBase, "_row", lambda self, shape: (any(self is g._base for g in grids)
                                                                  and rows.append(shape)) or row(self, shape))
    context = engine.create_execution_context(pad_first_calls=False)
    rng = np.random.default_rng(zlib.crc32(b"memos filled at load"))
    for _ in range(10):
        batch, seq = int(rng.integers(1, 5)), int(rng.integers(1, 49))
        mask = np.ones((batch, seq), np.int64)
        for row in range(batch):
            mask[row, rng.integers(1, seq + 1):] = 0
        feeds = {"input_ids": rng.integers(0, 1024, (batch, seq), dtype=np.int64), "attention_mask": mask}
        np.testing.assert_allclose(next(iter(context.run(feeds).values())), session.run(None, feeds)[0],
                                   rtol=ORT_TOL, atol=ORT_TOL, err_msg=f"{batch}x{seq}")
    assert puts == [], f"group values computed at a call: {puts}"
    assert rows == [], f"a mask grid's row of corners made at a call: {rows}"  # each sequence's at load (where the
    # export has an index grid: this bert_tiny's mask has none; test_shape_function.py's grid model checks the rows)
