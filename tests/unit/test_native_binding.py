"""Binding a native segment at a new input size (issue 10: a first call costs little more than a repeat): every
fresh shape binds and matches onnxruntime, a size bound once reuses its kernels when bound again, and a kernel
derived from another size's (LayerNorm.at_size) computes what one built at that size does. A view's plans of kiln's
own kernels written by arithmetic (kiln/runtime/native_views.py _PlanRewrite) are byte for byte the plans replanning
makes, run bit for bit as those, and a rule that does not give back its template's plan is not used."""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import types
import weakref

import numpy as np
import pytest
import torch

from kiln.kernels.cpu import gemm_native, native_loop
from kiln.kernels.cpu import transformer as kernels
from kiln.kernels.cpu.form_choice import PARALLEL
from kiln.runtime import native, native_views
from kiln.tactics.tactic import SizedPlan

ORT_TOL = 1e-4  # kiln against onnxruntime: two fp32 implementations' rounding over 2 layers (test_first_calls.py)

pytestmark = pytest.mark.skipif(not kernels.available(), reason="kiln's transformer kernels are not built")


def _feeds(rng, batch, seq):
    mask = np.ones((batch, seq), np.int64)
    for row in range(batch):
        mask[row, rng.integers(1, seq + 1):] = 0
    return {"input_ids": rng.integers(0, 1024, (batch, seq), dtype=np.int64), "attention_mask": mask}


def _bound_views(engine) -> int:
    return sum(other is not None for s in engine.program.segments for other in s.resized.values())


def test_fresh_shapes_bind_and_match_onnxruntime(dynamic_bert_tiny):
    engine, session = dynamic_bert_tiny
    context = engine.create_execution_context(pad_first_calls=False)  # every new shape binds (none run padded)
    rng = np.random.default_rng()
    shapes = {(int(rng.integers(1, 5)), int(rng.integers(1, 49))) for _ in range(12)} | {(1, 1), (4, 48), (3, 47)}
    for batch, seq in sorted(shapes, key=lambda _: rng.random()):
        feeds = _feeds(rng, batch, seq)
        got = context.run(feeds)
        want = session.run(None, feeds)
        for g, w in zip(got.values(), want):
            np.testing.assert_allclose(g, w, rtol=ORT_TOL, atol=ORT_TOL, err_msg=f"{batch}x{seq}")
    assert _bound_views(engine) >= len(shapes - {(4, 32)}), "a shape ran without a bound segment view"
    assert not [k for s in engine.program.segments for k, other in s.resized.items() if other is None]


def test_a_second_binding_at_the_same_sizes_reuses_the_kernels(dynamic_bert_tiny):
    engine, session = dynamic_bert_tiny
    context = engine.create_execution_context(pad_first_calls=False)
    rng = np.random.default_rng()
    batch, seq = 4, 32
    while (batch, seq) == (4, 32):  # the tuned shape runs the segment itself: it has no view to bind again
        batch, seq = int(rng.integers(1, 5)), int(rng.integers(2, 49))
    feeds = _feeds(rng, batch, seq)
    first = context.run(feeds)
    segment = next(s for s in engine.program.segments if s.resized)
    key, view = next(reversed(segment.resized.items()))
    kernels_before = [n.primitive(False) for n in segment._natives_at(key).natives if n.primitive is not None]
    segment.resized.clear()  # the view is gone: the next call binds these sizes again
    again = context.run(feeds)
    assert key in segment.resized and segment.resized[key] is not view
    kernels_after = [n.primitive(False) for n in segment._natives_at(key).natives if n.primitive is not None]
    assert all(a is b for a, b in zip(kernels_before, kernels_after) if isinstance(a, kernels.NativeKernel)), \
        "a kernel at sizes bound before was built again"
    for a, b, w in zip(first.values(), again.values(), session.run(None, feeds)):
        np.testing.assert_array_equal(a, b)  # the same kernels on the same sizes: bit for bit
        np.testing.assert_allclose(b, w, rtol=ORT_TOL, atol=ORT_TOL)


@pytest.mark.parametrize("seed", [0, 1, 2])  # each kept a view alive when views were dropped uncounted
def test_new_shapes_leave_no_garbage_for_the_collector_and_a_dropped_view_dies(dynamic_bert_tiny, seed):
    """Binding and running new shapes makes no reference cycle: with the collector off, a stream of fresh shapes
    leaves nothing for it to find, and an evicted view (its replanned calls with it) is freed by its reference
    count once the runtime has let it go. A cycle would wait for a full pass, which scans every object of the
    process (~110 ms with torch and BERT-base loaded, kiln/runtime/heap.py). The stream repeats its first shape:
    that call runs through the engine's direct run (kiln/runtime/direct_run.py), whose record refers to the view
    (weakly: nothing but the segment's LRU keeps it)."""
    engine, _ = dynamic_bert_tiny
    context = engine.create_execution_context(pad_first_calls=False)  # every new shape binds a view
    rng = np.random.default_rng(seed)
    shapes = [(int(rng.integers(1, 5)), int(rng.integers(1, 49))) for _ in range(8)]
    gc.collect()
    # what was there before the stream: an earlier test's objects the process lets go during it (a module's engines
    # torn down by pytest, a C-held last call) are not this stream's garbage
    before = {id(o) for o in gc.get_objects()}
    gc.disable()
    try:
        for batch, seq in shapes + shapes[:1]:
            context.run(_feeds(rng, batch, seq))
        views = [v for s in engine.program.segments for v in s.resized.values() if isinstance(v, native._Resized)]
        assert views, f"no shape bound a view: {[s.unbound for s in engine.program.segments]}"
        alive = [weakref.ref(v) for v in views] + [weakref.ref(b) for v in views for b in v._owned
                                                       if not isinstance(b, np.ndarray)]
        del views
        _evict_views(engine)
        left = [r() for r in alive if r() is not None]
        assert not left, f"evicted views or their calls still held: {_referrers(left)}"
        gc.set_debug(gc.DEBUG_SAVEALL)  # the collected objects kept in gc.garbage, to tell this stream's apart
        try:
            gc.collect()
            made = [type(o).__name__ for o in gc.garbage if id(o) not in before]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
        assert not made, ("binding or running a new shape left a reference cycle; sizes left unbound: "
                          f"{[s.unbound for s in engine.program.segments]}; {len(made)} objects: {made[:12]}")
    finally:
        gc.enable()


def _evict_views(engine) -> None:
    """Let every segment's views go as its LRU bound does (Segment._bind_sizes: counted in view_evictions); the
    engine's direct runs notice nothing first: their records hold views weakly."""
    for segment in engine.program.segments:
        segment.view_evictions += len(segment.resized)
        segment.resized.clear()


def _referrers(objects: list) -> list[str]:
    """'held <- holder' (type names) for what refers to each of `objects`, the list of them and frames aside."""
    return [f"{type(o).__name__} <- {type(r).__name__}" for o in objects for r in gc.get_referrers(o)
            if r is not objects and not isinstance(r, types.FrameType)]


@pytest.mark.parametrize("keep_sum", [False, True])
def test_layer_norm_at_another_size_is_the_kernel_built_there(keep_sum):
    torch.manual_seed(int(np.random.default_rng().integers(1 << 30)))
    n = 48
    scale, bias = torch.randn(n), torch.randn(n)
    template = kernels.LayerNorm((4, 32, n), scale, bias, 1e-5, (1, 32, n), keep_sum=keep_sum)
    for size, residual in (((3, 7, n), (1, 7, n)), ((1, 1, n), (1, 1, n)), ((5, 40, n), (5, 40, n))):
        derived = template.at_size(size, residual)
        built = kernels.LayerNorm(size, scale, bias, 1e-5, residual, keep_sum=keep_sum)
        assert derived.fields == built.fields and derived.output_size == built.output_size
        assert derived.more_outputs == built.more_outputs
        x, r = torch.randn(size), torch.randn(residual)
        got, want = derived({0: x, 3: r}), built({0: x, 3: r})
        got, want = (got, want) if keep_sum else ((got,), (want,))
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=0)  # one kernel, one plan: bit for bit
        reference = torch.nn.functional.layer_norm(x + r, (n,), scale, bias, 1e-5)
        torch.testing.assert_close(got[0], reference, rtol=1e-5, atol=1e-5)  # fp32 mean/var in another order
    with pytest.raises(ValueError):
        template.at_size((2, 3, n + 1), (1, 3, n + 1))


def test_add_size_fields_are_the_kernels_fields_and_say_which_side_is_larger():
    """Add.size_fields (the plan rule of kiln's Add in a view) against the kernel built at the sizes: the same output
    size and integer fields, the larger operand's side as the kernel's roles say; sizes that do not repeat refuse."""
    rng = np.random.default_rng()
    for _ in range(40):
        b, s, n = (int(x) for x in rng.integers(1, 9, 3) * (1, 8, 8))
        big = (b, s, n)
        small = [(b, s, n), (1, s, n), (s, n), (n,), (1, 1, n)][int(rng.integers(5))]
        a_size, b_size = (big, small) if rng.random() < 0.5 else (small, big)
        built = kernels.Add(a_size, b_size)
        swapped, out, fields = kernels.Add.size_fields(a_size, b_size)
        assert out == built.output_size and fields == built.integer_fields()
        assert swapped == (built.roles[1] == ("a",)) and built.roles[0] == (("b",) if swapped else ("a",))
    with pytest.raises(ValueError):
        kernels.Add.size_fields((2, 5, 8), (3, 8))


def _segment(engine):
    return max(engine.program.segments, key=lambda s: len(s.members))


def _calls(view: native._Resized) -> list[tuple[int, int] | None]:
    """(function, plan address) of each call of a view's loop; None for a oneDNN primitive's (it has arguments)."""
    c = view._c[PARALLEL]
    functions, objects, nargs = c[1], c[8], c[9]
    return [None if nargs[i] else (functions[i], objects[i]) for i in range(c[7])]


def test_rewritten_plans_are_the_replanned_plans_byte_for_byte(dynamic_bert_tiny):
    engine, _ = dynamic_bert_tiny
    context = engine.create_execution_context(pad_first_calls=False)
    rng = np.random.default_rng()
    segment = _segment(engine)
    shapes = {(int(rng.integers(1, 5)), int(rng.integers(1, 49))) for _ in range(10)} | {(1, 1), (4, 48)}
    compared = 0
    for batch, seq in sorted(shapes, key=lambda _: rng.random()):
        context.run(_feeds(rng, batch, seq))  # binds (growing the template where it must)
        key = next(reversed(segment.resized))
        template = segment._grown or segment
        rewritten = segment._rewritten(key)
        assert rewritten is not None, f"{batch}x{seq}: not rewritten"
        replanned = native._Resized.bound_at(template, segment._natives_at(key).natives)
        assert rewritten.exit_shapes == replanned.exit_shapes
        assert rewritten.entry_sizes == replanned.entry_sizes
        sizes = [ctypes.sizeof(owner._plan) if isinstance(owner, native_loop.Replanned) else None
                 for owner in replanned._owned]
        ours, theirs = _calls(rewritten), _calls(replanned)
        assert len(ours) == len(theirs) == len(sizes)
        for i, (a, b, size) in enumerate(zip(ours, theirs, sizes)):
            if size is None:  # bound anew (a oneDNN primitive): its own memory objects, compared by the outputs
                continue
            assert a[0] == b[0], f"{batch}x{seq}: call {i} runs another function"
            assert ctypes.string_at(a[1], size) == ctypes.string_at(b[1], size), f"{batch}x{seq}: call {i}'s plan"
            compared += 1
    assert compared > 0, "no plan was compared"


def test_rewritten_views_run_bit_for_bit_as_replanned_ones_and_match_onnxruntime(dynamic_bert_tiny, monkeypatch):
    engine, session = dynamic_bert_tiny
    context = engine.create_execution_context(pad_first_calls=False)
    rng = np.random.default_rng()
    shapes = {(int(rng.integers(1, 5)), int(rng.integers(1, 49))) for _ in range(6)} | {(1, 1), (3, 47)}
    feeds = [_feeds(rng, batch, seq) for batch, seq in shapes]
    rewritten = [context.run(f) for f in feeds]
    for segment in engine.program.segments:
        segment.resized.clear()
    monkeypatch.setattr(native.Segment, "_rewritten", lambda self, key: None)  # member by member, as before
    for f, ours in zip(feeds, rewritten):
        theirs = context.run(f)
        for a, b, w in zip(ours.values(), theirs.values(), session.run(None, f)):
            np.testing.assert_array_equal(a, b)
            np.testing.assert_allclose(a, w, rtol=ORT_TOL, atol=ORT_TOL)


def test_a_rule_that_does_not_give_back_the_template_plan_is_not_used(dynamic_bert_tiny):
    engine, _ = dynamic_bert_tiny
    segment = _segment(engine)
    sizes = dict(zip(segment.entries, segment.entry_sizes))
    for m, natives in zip(segment.members, segment._natives):  # the template's sizes, member by member
        if natives.plan_at is not None and m in [segment.members[k] for k in segment._bound_members]:
            break
        for slot, _role, size, _strides, _dtype in native.writes_of(m, natives):
            sizes[slot] = size
    else:
        pytest.fail("no member has a plan rule")
    k = segment.members.index(m)
    bound = segment.bound[segment._bound_members.index(k)]
    at, reads, x = segment._resizers[k]
    arg = {i: sizes[slot] for i, slot in reads} if reads is not None else sizes[x]
    assert native_views._plan_layout(natives, bound, arg) is not None

    def off_by_one(sizes_):
        sized = natives.plan_at(sizes_)
        name, value = next((n, v) for n, v in sized.fields.items() if not isinstance(v, tuple))
        return SizedPlan(sized.output_sizes, {**sized.fields, name: value + 1})

    assert native_views._plan_layout(dataclasses.replace(natives, plan_at=off_by_one), bound, arg) is None


@pytest.mark.skipif(not gemm_native.available(), reason="kiln's GEMM is not built")
def test_gemm_row_fields_are_the_plan_fields_and_refuse_rows_that_need_scratch():
    layer = gemm_native.PackedLinear(torch.randn(1024, 512), torch.randn(1024))  # 8+ rows: past PARALLEL_MACS
    rows = [r for r in (1, 3, 7, 8, 9, 200, layer.small_m) if r <= layer.small_m]
    for r in rows:
        plan, _ = layer.plan(r)
        assert layer.row_fields(r) == {"M": plan.M, "threads": plan.threads, "c_scratch": plan.c_scratch or 0}
    assert {layer.row_fields(r)["threads"] for r in rows} == {0, 1}, "the rows do not cross PARALLEL_MACS"
    swiglu = gemm_native.PackedLinear(torch.randn(64, 32), torch.randn(64), "SwiGLU")
    assert swiglu.row_fields(swiglu.small_m)["M"] == swiglu.small_m
    with pytest.raises(ValueError, match="needs scratch"):
        swiglu.row_fields(swiglu.small_m + 1)  # SwiGLU's C before the gating: plan() makes it
    # a plan past small_m rows holds C for its rows (c_rows): up to them, replans over its scratch keep that place
    # and differ from it by row_fields' fields alone
    rows = swiglu.small_m + 5
    plan, scratch = swiglu.plan(rows)
    assert swiglu.c_rows(rows) == rows and swiglu.c_rows(swiglu.small_m) == 0 and plan.c_scratch
    for r in (1, swiglu.small_m, rows - 1, rows):
        again, _ = swiglu.plan(r, scratch)
        fields = swiglu.row_fields(r, rows)
        assert fields == {"M": again.M, "threads": again.threads}, r
        for name, value in fields.items():
            setattr(plan, name, value)
        assert bytes(plan) == bytes(again), r
    with pytest.raises(ValueError, match="needs scratch"):
        swiglu.row_fields(rows + 1, rows)



def test_layers_that_mirror_an_earlier_one_take_its_answers_and_a_view_where_their_sizes_differ_is_bound_otherwise(
        dynamic_bert_tiny):
    """An encoder's second layer reads, by the template's wiring, what its first read: its members mirror those (a
    view copies their answers; their plans are the replanned ones byte for byte: the test above). A mirror whose
    checked sizes differ at a view (made so here) leaves the view to member-by-member binding, and the run still
    matches onnxruntime."""
    engine, session = dynamic_bert_tiny
    segment = _segment(engine)
    rng = np.random.default_rng()
    context = engine.create_execution_context(pad_first_calls=False)
    context.run(_feeds(rng, 2, 5))
    template = segment._grown or segment
    rewrite = template._rewrite
    mirrors = {k: mirror for k, _, mirror in rewrite._schedule if mirror is not None}
    assert len(mirrors) >= 5, f"{len(mirrors)} of {len(rewrite._schedule)} members mirror another"
    for k, mirror in mirrors.items():
        ours, theirs = rewrite._members[k], rewrite._members[mirror.of]
        assert mirror.of < k and (ours[0] or ours[9].rule).key == (theirs[0] or theirs[9].rule).key
    key = next(reversed(segment.resized))
    assert rewrite.view(template, key) is not None
    checked = next(mirror for mirror in mirrors.values() if mirror.checks)
    a, b = template.entries[:2]
    assert template.entry_sizes[0] != template.entry_sizes[1]
    unequal = native_views._Mirror(checked.of, ((a, b),), checked.outputs)
    rewrite._schedule = [(k, count, unequal if mirror is checked else mirror) for k, count, mirror in rewrite._schedule]
    rewrite._steps = native_views._mirror_runs(rewrite._schedule, rewrite._members)
    # the paths traced before (its linear layers' rows on kiln's GEMM have plan rules) forgotten: the view walks
    rewrite._whole = native_views.ViewTrace(template.entries, rewrite._whole.ranks)
    assert rewrite.view(template, key) is None
    feeds = _feeds(rng, 3, int(rng.integers(6, 40)))
    for got, want in zip(context.run(feeds).values(), session.run(None, feeds)):
        np.testing.assert_allclose(got, want, rtol=ORT_TOL, atol=ORT_TOL)
