"""Image segments at batches other than the tuned one (issue 10): runs of the planned segment over consecutive batches
(kiln/runtime/native_batches.py), the images left over on its one-image view, oneDNN image layers at another batch as
chunks of their tuned primitive (kiln/kernels/cpu/onednn_chunks.py). Outputs against onnxruntime and torch; that no
segment and no primitive is bound for a new batch is asserted from the segments' state and the primitives made, not
from time."""

from __future__ import annotations

import dataclasses
import gc
import threading
import time
import zlib
from collections import OrderedDict
from fractions import Fraction

import numpy as np
import onnxruntime as ort
import pytest
import torch

import kiln
from kiln import zoo
from kiln.kernels.cpu import native_loop, onednn, onednn_chunks, onednn_primitives
from kiln.runtime import native, native_batches
from kiln.runtime.native import Segment
from kiln.tactics.tactic import NativeStep

pytestmark = pytest.mark.skipif(not onednn_chunks.available(), reason="needs libdnnl and kiln's compiled loop")

# float32: a conv stack's sums in another order than onnxruntime's (its own kernels) differ by a few ulps per layer
RTOL = ATOL = 1e-4
_CL = torch.channels_last


@pytest.fixture(scope="module")
def resnet():
    exported = zoo.export("resnet_tiny", dynamic=True)
    engine = kiln.build(str(exported.path), profiles=[{"pixel_values": "1x3x64x64,2x3x64x64,12x3x64x64"}])
    session = ort.InferenceSession(str(exported.path), providers=["CPUExecutionProvider"])
    return engine, session


def _image_segment(engine) -> Segment:
    segments = [s for s in engine.program.segments if s._staged]
    assert segments, "the tuned engine has no segment reading the images"
    return segments[0]


def test_new_batches_run_the_planned_segment_and_bind_nothing(resnet, monkeypatch):
    engine, session = resnet
    segment = _image_segment(engine)
    assert segment._planned_batch == 2  # the profile's opt
    assert native_batches.BINDS.wait(60)  # no exact bind of another test's still making primitives
    monkeypatch.setattr(native_batches, "BIND_AFTER", 1 << 20)  # runs only (the exact binds: tests below)
    context = engine.create_execution_context(pad_first_calls=False)  # every batch runs as given (none padded)
    rng = np.random.default_rng()
    earlier = set(segment.resized)  # views an earlier test of the module made (the engine is shared)
    context.run({"pixel_values": rng.standard_normal((1, 3, 64, 64), dtype=np.float32)})  # the one-image view
    made, batch_runs = [], []
    real_init, real_runs = onednn_primitives.Conv2d.__init__, native_batches.run_batches

    def counting_init(self, w, b, input_size, *args, **kwargs):
        made.append(tuple(input_size))
        real_init(self, w, b, input_size, *args, **kwargs)

    def counting_runs(seg, values, plan):
        batch_runs.append((values[0].shape[0], plan.runs, plan.left))
        return real_runs(seg, values, plan)

    monkeypatch.setattr(onednn_primitives.Conv2d, "__init__", counting_init)
    monkeypatch.setattr(native_batches, "run_batches", counting_runs)
    views = dict(segment.resized)
    batches = [3, 12, *rng.choice(np.arange(4, 12), 3, replace=False).tolist()]
    for batch in batches:
        x = rng.standard_normal((batch, 3, 64, 64), dtype=np.float32)
        got = context.run({"pixel_values": x})
        np.testing.assert_allclose(next(iter(got.values())), session.run(None, {"pixel_values": x})[0], rtol=RTOL,
                                   atol=ATOL, err_msg=f"batch {batch}")
    assert segment._per_image is True
    assert sorted(b for b, _, _ in batch_runs) == sorted(batches)
    assert all(runs == b // 2 and left == b % 2 for b, runs, left in batch_runs)
    assert not made, f"primitives made at new batches: {made}"
    assert dict(segment.resized) == views and all(key[0][0] == 1 for key in set(views) - earlier)  # the one-image
    # view, no other


def test_the_tuned_batch_and_one_image_still_match(resnet):
    engine, session = resnet
    context = engine.create_execution_context(pad_first_calls=False)
    rng = np.random.default_rng()
    for batch in (2, 1, 2):
        x = rng.standard_normal((batch, 3, 64, 64), dtype=np.float32)
        np.testing.assert_allclose(next(iter(context.run({"pixel_values": x}).values())),
                                   session.run(None, {"pixel_values": x})[0], rtol=RTOL, atol=ATOL)


def test_a_segment_whose_layer_mixes_the_batch_is_not_run_in_batch_runs(resnet, monkeypatch):
    """A member whose output at twice the batch does not have twice the first dim (a reduction across the batch)
    makes the segment refuse batch runs: it then binds views, as before."""
    engine, _ = resnet
    segment = _image_segment(engine)
    at, reads, x = segment._resizers[-1]

    def across_the_batch(size):
        step = at(size)
        return NativeStep(step.input_size, (1, *step.output_size[1:]), step.primitive)

    monkeypatch.setattr(segment, "_resizers", [*segment._resizers[:-1], (across_the_batch, reads, x)])
    monkeypatch.setattr(segment, "_per_image", None)
    monkeypatch.setattr(segment, "_batch_plans", OrderedDict())  # none of an earlier test's batches
    assert native_batches.computes_each_image_alone(segment) is False
    assert segment._batch_runs(((6, 3, 64, 64),)) is None


@pytest.mark.parametrize("op_type, attributes", [("Concat", {"axis": 0}), ("Softmax", {"axis": -4}),
                                                  ("LSTM", {}), ("PackTokens", {})])
def test_a_member_along_the_first_dim_refuses_batch_runs(resnet, monkeypatch, op_type, attributes):
    """A Concat of two batches along dim 0 (or a recurrent layer, sequence-first) keeps its values' first dim
    proportional to the batch, so the size check alone would pass it: its op refuses (the runs would stack or cut
    what it computes across the first dim)."""
    engine, _ = resnet
    segment = _image_segment(engine)
    member = segment.members[0]
    monkeypatch.setattr(member, "attributes", {**member.attributes, **attributes})
    monkeypatch.setattr(member, "ctx", dataclasses.replace(member.ctx, op_type=op_type))
    assert native_batches.computes_each_image_alone(segment) is False
    monkeypatch.undo()
    assert native_batches.computes_each_image_alone(segment) is True


def _fresh_plans(segment, monkeypatch) -> None:
    """The segment without an earlier test's batch plans or bound batches (the module's engine is shared)."""
    monkeypatch.setattr(segment, "_batch_plans", OrderedDict())
    monkeypatch.setattr(segment, "_bound_batches", {})


def _check(context, session, rng, batch: int) -> None:
    x = rng.standard_normal((batch, 3, 64, 64), dtype=np.float32)
    np.testing.assert_allclose(next(iter(context.run({"pixel_values": x}).values())),
                               session.run(None, {"pixel_values": x})[0], rtol=RTOL, atol=ATOL,
                               err_msg=f"batch {batch}")


@pytest.mark.parametrize("keep_bound_at, kept", [(1.0, "bound"), (0.5, "runs kept")])
def test_a_batch_met_often_is_bound_exactly_and_swapped_in(resnet, monkeypatch, keep_bound_at, kept):
    """After BIND_AFTER calls in runs, a batch is bound on the background thread with primitives made for it, swapped
    into its plan, timed against the runs (a fake clock: every call 1 s, so the tie keeps the bound batch, and a
    ratio of 0.5 keeps the runs) and then served by whichever stayed; outputs against onnxruntime throughout."""
    engine, session = resnet
    segment = _image_segment(engine)
    _fresh_plans(segment, monkeypatch)
    ticks = iter(range(10**6))
    monkeypatch.setattr(native_batches, "_clock", lambda: float(next(ticks)))
    monkeypatch.setattr(native_batches, "KEEP_BOUND_AT", keep_bound_at)
    context = engine.create_execution_context(pad_first_calls=False)
    rng = np.random.default_rng()
    made = []
    real_init = onednn_primitives.Conv2d.__init__

    def counting_init(self, w, b, input_size, *args, **kwargs):
        made.append(tuple(input_size))
        real_init(self, w, b, input_size, *args, **kwargs)

    monkeypatch.setattr(onednn_primitives.Conv2d, "__init__", counting_init)
    batch, key = 5, ((5, 3, 64, 64),)
    for _ in range(native_batches.BIND_AFTER):
        _check(context, session, rng, batch)
    plan = segment._batch_plans[key]
    assert plan.state in ("binding", "trial")
    assert native_batches.BINDS.wait(60)
    assert plan.state == "trial" and isinstance(plan.bound, Segment)
    assert plan.bound._planned_key == key and plan.bound._planned_batch == 5
    # its oneDNN layers on primitives made for 5 images, none in chunks of the tuned one (the runs' views' form)
    assert not any(isinstance(b, onednn_chunks.ChunksBound) for b in plan.bound.bound)
    assert {size[0] for size in made} <= {1, 5}, made  # (1: the one-image view of the runs, where not made yet)
    assert segment._bound_batches == {key: plan}
    for _ in range(2 * native_batches.TRIAL + 1):  # one untimed call of the bound batch first
        _check(context, session, rng, batch)
    assert plan.state == kept
    assert (plan.bound is not None) == (kept == "bound")
    assert (key in segment._bound_batches) == (kept == "bound")
    served = []
    real_bound, real_runs = Segment._run_bound, native_batches.run_batches
    monkeypatch.setattr(Segment, "_run_bound",
                        lambda self, values, into=None: served.append("bound") or real_bound(self, values, into))
    monkeypatch.setattr(native_batches, "run_batches",
                        lambda seg, values, p: served.append("runs") or real_runs(seg, values, p))
    _check(context, session, rng, batch)
    assert served == (["bound"] if kept == "bound" else ["runs"])


def test_bound_batches_are_bounded_least_recently_used_out(resnet, monkeypatch):
    """At most BOUND_BATCHES bound batches per segment: a fresh one lets the least recently used go (its plan counts
    again, to bind after twice as many calls); a byte bound below one batch's arena keeps none."""
    engine, session = resnet
    segment = _image_segment(engine)
    _fresh_plans(segment, monkeypatch)
    monkeypatch.setattr(native_batches, "BOUND_BATCHES", 2)
    monkeypatch.setattr(native_batches, "BIND_AFTER", 1)
    context = engine.create_execution_context(pad_first_calls=False)
    rng = np.random.default_rng()
    for batch in (3, 4, 5):
        _check(context, session, rng, batch)
        assert native_batches.BINDS.wait(60)
    plans = {k[0][0]: p for k, p in segment._batch_plans.items()}
    assert sorted(k[0][0] for k in segment._bound_batches) == [4, 5]
    assert plans[3].state == "evicted" and plans[3].bound is None and plans[3].evictions == 1
    assert plans[4].state == plans[5].state == "trial"
    _check(context, session, rng, 3)  # 1 call of 2 needed now: not bound again yet
    assert plans[3].state == "evicted"
    monkeypatch.setattr(native_batches, "BOUND_BYTES", 1)
    _check(context, session, rng, 3)
    assert native_batches.BINDS.wait(60)
    assert segment._bound_batches == {} and all(p.bound is None for p in plans.values())
    _check(context, session, rng, 4)


def test_two_threads_call_while_the_batch_is_swapped_in(resnet, monkeypatch):
    """Two contexts of one engine call batches 3 and 5 from two threads while their exact binds are made and swapped
    in: every output matches onnxruntime, and the background thread stops by itself once nothing is queued."""
    engine, session = resnet
    segment = _image_segment(engine)
    _fresh_plans(segment, monkeypatch)
    monkeypatch.setattr(native_batches, "BIND_AFTER", 1)
    rng = np.random.default_rng()
    inputs = {b: rng.standard_normal((b, 3, 64, 64), dtype=np.float32) for b in (3, 5)}
    expected = {b: session.run(None, {"pixel_values": x})[0] for b, x in inputs.items()}
    errors = []
    contexts = [engine.create_execution_context(pad_first_calls=False) for _ in range(2)]
    segments = [_image_segment(c) for c in contexts]  # a second context's program may bind its segments anew
    for s in segments:
        _fresh_plans(s, monkeypatch)

    def calls(batch: int) -> None:
        context = contexts[batch == 5]
        try:
            for _ in range(12):
                for b in (batch, 8 - batch):
                    got = next(iter(context.run({"pixel_values": inputs[b]}).values()))
                    np.testing.assert_allclose(got, expected[b], rtol=RTOL, atol=ATOL)
        except Exception as e:  # noqa: BLE001  reported below
            errors.append(e)

    threads = [threading.Thread(target=calls, args=(b,)) for b in (3, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[0]
    assert native_batches.BINDS.wait(60)
    # stopped by itself: wait() may have made the last jobs while the thread queued for the making lock, and the
    # thread ends once it finds the queue empty (a moment after wait() returns)
    deadline = time.monotonic() + 30
    while native_batches.BINDS._thread is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert native_batches.BINDS._thread is None
    states = [p.state for s in set(segments) for p in s._batch_plans.values()]
    assert len(states) >= 2 and all(s in ("trial", "bound", "runs kept") for s in states), states


def _conv(n: int, w: torch.Tensor, b: torch.Tensor, residual: bool, in_place: bool = False,
          weight_of: onednn_primitives.Conv2d | None = None) -> onednn_primitives.Conv2d:
    return onednn_primitives.Conv2d(w, b, [n, w.shape[1], 9, 9], [1, 1], [1, 1, 1, 1], [1, 1], 1,
                                    onednn.eltwise_for("Relu", 0.0, 0.0), residual, False, residual_in_place=in_place,
                                    share_weight_with=weight_of)


@pytest.mark.parametrize("in_place", [False, True])
def test_batch_chunks_match_torch_and_the_primitive_made_for_the_batch(in_place):
    """A convolution with a residual (a binary post-op, or accumulated in place) tuned at 3 images, run over 8 in
    chunks (2 runs of 3, 2 of the one-image primitive) on fresh data: torch's convolution and the primitive made for
    8 images."""
    torch.manual_seed(int(np.random.default_rng().integers(1 << 31)))
    w, b = torch.randn(12, 5, 3, 3), torch.randn(12)
    x = torch.randn(8, 5, 9, 9).contiguous(memory_format=_CL)
    r = torch.randn(8, 12, 9, 9).contiguous(memory_format=_CL)
    expected = torch.relu(torch.nn.functional.conv2d(x, w, b, padding=1) + r)
    tuned = _conv(3, w, b, True, in_place)
    chunks = onednn_chunks.BatchChunks(tuned, _conv(1, w, b, True, in_place, tuned), 8)
    assert (chunks.count, chunks.count1) == (2, 2)
    results = []
    for layer in (chunks, _conv(8, w, b, True, in_place)):
        y = r.clone() if in_place else torch.empty_like(r)
        bound = layer.bind(x.data_ptr(), y.data_ptr()) if in_place else layer.bind(x.data_ptr(), y.data_ptr(),
                                                                                   r.data_ptr())
        assert native_loop.run_calls(bound.calls()) == (0, -1)
        results.append(y)
    torch.testing.assert_close(results[0], expected, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(results[0], results[1], rtol=1e-6, atol=1e-6)  # same kernel, same sums per pixel


def test_batch_chunks_leave_the_memory_objects_where_they_were():
    """A run moves the roles' memory objects chunk by chunk and puts them back: a second run reads the same data
    (a segment points only its entries and exits per run; the other roles are fixed arena places)."""
    w, b = torch.randn(4, 2, 3, 3), torch.randn(4)
    x = torch.randn(5, 2, 9, 9).contiguous(memory_format=_CL)
    tuned = _conv(2, w, b, False)
    bound = onednn_chunks.BatchChunks(tuned, _conv(1, w, b, False, weight_of=tuned), 5).bind(x.data_ptr(), 0)
    for _ in range(2):
        y = torch.empty(5, 4, 9, 9).contiguous(memory_format=_CL)
        onednn.load().lib.dnnl_memory_set_data_handle(bound.memory("dst"), y.data_ptr())
        assert native_loop.run_calls(bound.calls()) == (0, -1)
        torch.testing.assert_close(y, torch.relu(torch.nn.functional.conv2d(x, w, b, padding=1)), rtol=RTOL,
                                   atol=ATOL)


def test_batch_chunks_refuse_a_remainder_without_the_one_image_primitive():
    w, b = torch.randn(4, 2, 3, 3), torch.randn(4)
    with pytest.raises(ValueError, match="one-image primitive"):
        onednn_chunks.BatchChunks(_conv(2, w, b, False), None, 5)


@pytest.mark.slow  # a Swin build: ~15-30 s on 2 shared cores
def test_swin_runs_segments_at_other_batches_and_matches_onnxruntime(monkeypatch):
    """swin_tiny at a dynamic batch: its shifted windows (Slices off the batch axis, NHWC Concats) and window masks
    ([B·windows, ...] entries) bind at other batches, so its image segments run in batch runs and its token segments
    ([B, H·W, C] rows) as views; none layer by layer (before: several segments ran their layers one by one)."""
    exported = zoo.export("swin_tiny", dynamic=True)
    engine = kiln.build(str(exported.path), profiles=[{"pixel_values": "1x3x32x32,2x3x32x32,8x3x32x32"}])
    session = ort.InferenceSession(str(exported.path), providers=["CPUExecutionProvider"])
    context = engine.create_execution_context(pad_first_calls=False)
    rng = np.random.default_rng(zlib.crc32(b"swin at other batches"))
    segments = engine.program.segments

    def layer_by_layer(self, values):
        raise AssertionError(f"a segment of {[m.ctx.name for m in self.members][:3]}... ran layer by layer")

    monkeypatch.setattr(native.Segment, "fallback", layer_by_layer)
    for batch in (3, 8, 5):
        x = rng.standard_normal((batch, 3, 32, 32), dtype=np.float32)
        got = next(iter(context.run({"pixel_values": x}).values()))
        np.testing.assert_allclose(got, session.run(None, {"pixel_values": x})[0], rtol=RTOL, atol=ATOL)
        for s in segments:
            if s._planned_batch is not None:
                key = tuple((p[0] * batch // s._planned_batch, *p[1:]) for p in s._planned_key)
                assert s._batch_runs(key) is not None
            else:
                assert any(k[0][0] == batch and view is not None for k, view in s.resized.items())
    assert sum(s._planned_batch is not None for s in segments) >= len(segments) // 2
    # batch 3 met often: every segment binds it exactly (the token segments without batch runs too), all over one
    # arena of that batch (as an engine built at 3 plans its segments into one)
    assert native_batches.BINDS.wait(120)
    monkeypatch.setattr(native_batches, "BIND_AFTER", 1)
    x = rng.standard_normal((3, 3, 32, 32), dtype=np.float32)
    for _ in range(2):
        context.run({"pixel_values": x})
        assert native_batches.BINDS.wait(120)
    plans = [p for s in segments for k, p in s._batch_plans.items() if k[0][0] * 2 == 3 * s._planned_key[0][0]]
    assert len(plans) == len(segments) and all(isinstance(p.bound, native.Segment) for p in plans)
    assert len({id(p.bound.arena) for p in plans}) == 1 and plans[0].bound.arena is not engine.program.segments[0].arena
    np.testing.assert_allclose(next(iter(context.run({"pixel_values": x}).values())),
                               session.run(None, {"pixel_values": x})[0], rtol=RTOL, atol=ATOL)


def test_batch_plans_are_kept_least_recently_used_out(resnet, monkeypatch):
    """The segment's batch plans are bounded (PLANS) and a call moves its batch's plan to the back: a batch called
    all along keeps its plan (and with it its exact bind) while batches met once come and go; the plan let go is
    the least recently called one (before: the first made, however often it was called), and its bound batch goes
    with it."""
    engine, session = resnet
    segment = _image_segment(engine)
    _fresh_plans(segment, monkeypatch)
    assert native_batches.BINDS.wait(60)
    monkeypatch.setattr(native_batches, "PLANS", 3)
    monkeypatch.setattr(native, "PLANS", 3)
    monkeypatch.setattr(native_batches, "BIND_AFTER", 2)
    context = engine.create_execution_context(pad_first_calls=False)
    rng = np.random.default_rng(zlib.crc32(b"batch plans least recently used"))
    for batch in (3, 3, 4, 5):  # 3 met twice: bound exactly
        _check(context, session, rng, batch)
    assert native_batches.BINDS.wait(60)
    order = lambda: [k[0][0] for k in segment._batch_plans]  # noqa: E731
    assert order() == [3, 4, 5]
    three = segment._batch_plans[((3, 3, 64, 64),)]
    assert three.bound is not None and segment._bound_batches == {((3, 3, 64, 64),): three}
    _check(context, session, rng, 3)
    assert order() == [4, 5, 3]  # moved to the back by its call
    _check(context, session, rng, 6)
    assert order() == [5, 3, 6]  # 4, the least recently called, let go; FIFO would have let 3 go
    for batch in (7, 9):
        _check(context, session, rng, batch)
    assert order() == [6, 7, 9] and len(segment._batch_plans) == 3  # bounded
    assert three.bound is None and segment._bound_batches == {}  # 3's exact bind let go with its plan
    _check(context, session, rng, 3)  # a fresh plan, in runs again
    assert segment._batch_plans[((3, 3, 64, 64),)].state == "runs"


def test_exact_binds_of_one_batch_share_one_arena(resnet, monkeypatch):
    """The exact bind of a batch plans into the arena of that batch (native_batches.batch_arena), one per program
    arena and batch: the segment's memory is the start of that arena's buffer, its lock the arena's; another batch
    gets another arena, and an arena goes with the last segment bound over it."""
    engine, session = resnet
    segment = _image_segment(engine)
    _fresh_plans(segment, monkeypatch)
    assert native_batches.BINDS.wait(60)
    monkeypatch.setattr(native_batches, "BIND_AFTER", 1)
    context = engine.create_execution_context(pad_first_calls=False)
    rng = np.random.default_rng(zlib.crc32(b"exact binds share one arena"))
    for batch in (5, 7):
        _check(context, session, rng, batch)
        assert native_batches.BINDS.wait(60)
    arenas = segment.arena.batch_arenas
    for batch in (5, 7):
        bound = segment._batch_plans[((batch, 3, 64, 64),)].bound
        assert bound is not None
        arena = arenas[Fraction(batch, 2)]
        assert bound.arena is arena and bound._lock is arena.lock
        assert bound.buffers[0].data_ptr() == arena._buffer.data_ptr()
        assert arena.nbytes >= segment.arena.planned * batch // 2
    assert arenas[Fraction(5, 2)] is not arenas[Fraction(7, 2)]
    for batch in (5, 7):
        _check(context, session, rng, batch)  # still exact on the shared arena
    del bound, arena
    for key, plan in list(segment._batch_plans.items()):
        native_batches.forget(segment, key, plan)  # as the plans' LRU lets them go
    gc.collect()
    assert Fraction(5, 2) not in arenas and Fraction(7, 2) not in arenas


def test_a_segment_without_batch_runs_binds_a_batch_met_often(resnet, monkeypatch):
    """A segment that runs no batches in runs (planned_batch None: swin_tiny's last token stage, 128 rows at its tuned
    batch) serves a new batch on its view, and once the batch is met often binds it exactly on the background thread
    as image segments do (before: the view served it for good); a size that is no other batch (another image size)
    gets no plan."""
    engine, session = resnet
    segment = _image_segment(engine)
    _fresh_plans(segment, monkeypatch)
    assert native_batches.BINDS.wait(60)
    monkeypatch.setattr(segment, "_planned_batch", None)
    monkeypatch.setattr(native_batches, "BIND_AFTER", 2)
    monkeypatch.setattr(native_batches, "_clock", lambda: 0.0)  # a tie: the bound batch stays
    context = engine.create_execution_context(pad_first_calls=False)
    rng = np.random.default_rng(zlib.crc32(b"view segment binds a batch"))
    key = ((5, 3, 64, 64),)
    for _ in range(2):
        _check(context, session, rng, 5)
    plan = segment._batch_plans[key]
    assert plan.view == key and (plan.runs, plan.left) == (0, 0)
    assert key in segment.resized  # served by the view until bound
    assert native_batches.BINDS.wait(60)
    assert plan.state == "trial" and isinstance(plan.bound, Segment) and plan.bound._planned_key == key
    for _ in range(2 * native_batches.TRIAL + 1):  # one untimed call of the bound batch first
        _check(context, session, rng, 5)
    assert plan.state == "bound"
    served = []
    real_bound = Segment._run_bound
    monkeypatch.setattr(Segment, "_run_bound",
                        lambda self, values, into=None: served.append(self) or real_bound(self, values, into))
    _check(context, session, rng, 5)
    assert plan.bound in served
    assert segment._batch_runs(((5, 3, 32, 32),)) is None
    assert native_batches.another_batch(((2, 8), (32, 8)), ((3, 8), (48, 8)))  # a window mask scales alike
    assert not native_batches.another_batch(((2, 8), (32, 8)), ((3, 8), (32, 8)))
    # a scalar entry (a token segment's length beside its rows) scales with nothing: not a batch (it raised before)
    assert not native_batches.another_batch(((2, 8), ()), ((3, 8), ()))
    assert not native_batches.another_batch(((), (2, 8)), ((), (3, 8)))


def test_plans_let_go_while_binding_leave_no_bound_batch_behind(resnet, monkeypatch):
    """Two threads, each on its own context, call more batches than the plans keep (PLANS 2) with every batch bound at
    its first call: plans are let go while their exact binds are queued or in hand on the background thread. Every
    output matches onnxruntime, each segment keeps at most PLANS plans, and every bound batch it keeps is a plan it
    keeps (a bind finishing after its plan was let go is not swapped in)."""
    engine, session = resnet
    assert native_batches.BINDS.wait(60)
    monkeypatch.setattr(native_batches, "PLANS", 2)
    monkeypatch.setattr(native, "PLANS", 2)
    monkeypatch.setattr(native_batches, "BIND_AFTER", 1)
    contexts = [engine.create_execution_context(pad_first_calls=False) for _ in range(2)]
    segments = {id(s): s for c in contexts for s in c.program.segments}.values()
    for s in segments:
        _fresh_plans(s, monkeypatch)
    rng = np.random.default_rng(zlib.crc32(b"plans let go while binding"))
    batches = [3, 4, 5, 6, 7, 9, 3, 5]
    inputs = {b: rng.standard_normal((b, 3, 64, 64), dtype=np.float32) for b in set(batches)}
    expected = {b: session.run(None, {"pixel_values": x})[0] for b, x in inputs.items()}
    errors = []

    def calls(context, order: list[int]) -> None:
        try:
            for b in order:
                got = next(iter(context.run({"pixel_values": inputs[b]}).values()))
                np.testing.assert_allclose(got, expected[b], rtol=RTOL, atol=ATOL, err_msg=f"batch {b}")
        except Exception as e:  # noqa: BLE001  reported below
            errors.append(e)

    threads = [threading.Thread(target=calls, args=(c, order)) for c, order in zip(contexts, (batches, batches[::-1]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[0]
    assert native_batches.BINDS.wait(60)
    for s in segments:
        assert len(s._batch_plans) <= 2
        assert all(s._batch_plans.get(k) is p for k, p in s._bound_batches.items()), \
            (list(s._bound_batches), list(s._batch_plans))
