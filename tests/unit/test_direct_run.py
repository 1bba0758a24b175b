"""Bound shapes of a one-segment CPU program run as one call of its compiled loop, numpy in and out
(kiln/runtime/direct_run.py): the same outputs as the general path bit for bit and onnxruntime's at fresh random
shapes, padded first calls through it as the unpadded runs, records let go with what they hold (a view at once), torch
inputs and threads."""

from __future__ import annotations

import threading
import weakref

import numpy as np
import pytest
import torch

from kiln.runtime import direct_run, first_calls
from kiln.runtime import program as kiln_program

ORT_TOL = 1e-4  # kiln against onnxruntime: two fp32 implementations' rounding over 2 layers (test_first_calls.py)
# Padded and unpadded runs differ only in the GEMMs' and attention's summation order over other shapes (fp32)
RTOL, ATOL = 1e-5, 2e-5


def _feeds(rng, batch, seq):
    mask = np.ones((batch, seq), np.int64)
    for row in range(batch):
        mask[row, rng.integers(1, seq + 1):] = 0
    return {"input_ids": rng.integers(0, 1024, (batch, seq), dtype=np.int64), "attention_mask": mask}


def _fresh(engine, pad: bool = True, budget_ms: float = 1e6):
    """A context over the engine's program with its padding and direct records started over (budget: by default
    pad any call that has a host; 0: none, every new shape binds)."""
    engine.first_calls = first_calls.FirstCalls(engine.program, engine.first_calls.buckets, engine.inputs)
    engine.first_calls.budget_ms = lambda: budget_ms  # whatever binding is measured to cost
    program = engine.program  # nothing bound: earlier tests' shapes are new again
    with program._plans_lock:
        program.shape_plans.clear()
        program._plan_sizes.clear()
        program.shape_plan_bytes = 0
    for segment in program.segments:
        with segment._resize_lock:
            segment.resized.clear()
    engine.direct_runs = direct_run.DirectRuns.of(engine.program)
    return engine.create_execution_context(pad_first_calls=pad)


def test_bert_tiny_once_its_shape_values_are_known_is_one_segment(dynamic_bert_tiny):
    engine, _ = dynamic_bert_tiny
    assert engine.direct_runs is not None and engine.direct_runs.segment is engine.program.lean_steps[0].fn
    assert engine.create_execution_context()._direct is engine.direct_runs


@pytest.mark.parametrize("pad", [True, False])
def test_bound_shapes_run_directly_bit_for_bit_as_the_general_path_and_match_onnxruntime(dynamic_bert_tiny,
                                                                                        counted, monkeypatch, pad):
    engine, session = dynamic_bert_tiny
    context = _fresh(engine, pad, budget_ms=0.0)
    monkeypatch.setenv("KILN_DIRECT_RUN", "0")
    general = engine.create_execution_context(pad_first_calls=False)
    assert general._direct is None
    rng = np.random.default_rng()
    shapes = {(int(rng.integers(1, 5)), int(rng.integers(1, 49))) for _ in range(6)} | {(1, 1), (4, 48), (4, 32)}
    for batch, seq in sorted(shapes):
        feeds = _feeds(rng, batch, seq)
        for _ in range(2):  # bound at the first call, its binding measured at the second
            context.run(feeds)
        before = len(counted)
        got = next(iter(context.run(feeds).values()))
        assert len(counted) == before + 1, f"{batch}x{seq} did not run directly"
        assert isinstance(got, np.ndarray) and got.shape == (batch, seq, 64) and got.flags.c_contiguous
        want = next(iter(general.run(feeds).values()))
        np.testing.assert_array_equal(got, want, err_msg=f"direct vs general path, {batch}x{seq}")
        np.testing.assert_allclose(got, session.run(None, feeds)[0], rtol=ORT_TOL, atol=ORT_TOL,
                                   err_msg=f"direct vs onnxruntime, {batch}x{seq}")
        again = _feeds(rng, batch, seq)  # other values at the same shape: the entries are this call's arrays
        np.testing.assert_array_equal(next(iter(context.run(again).values())),
                                      next(iter(general.run(again).values())))


def test_padded_first_calls_run_directly_in_their_host_as_unpadded_runs_do(dynamic_bert_tiny, counted):
    engine, session = dynamic_bert_tiny
    context = _fresh(engine)
    unpadded = engine.create_execution_context(pad_first_calls=False)
    rng = np.random.default_rng()
    context.run(_feeds(rng, 4, 48))  # bound, so a host with a DirectRun
    padding = engine.first_calls
    shapes = {(int(rng.integers(1, 5)), int(rng.integers(1, 48))) for _ in range(6)} | {(1, 1), (3, 47)}
    for batch, seq in sorted(shapes):
        feeds = _feeds(rng, batch, seq)
        padded_before, direct_before = padding.padded_runs, len(counted)
        got = next(iter(context.run(feeds).values()))
        assert padding.padded_runs == padded_before + 1 and len(counted) == direct_before + 1
        assert counted[-1] == ((4, 48), (4, 48)), "not run at the host's size"
        assert got.shape == (batch, seq, 64) and got.flags.c_contiguous
        np.testing.assert_allclose(got, next(iter(unpadded.run(feeds).values())), rtol=RTOL, atol=ATOL,
                                   err_msg=f"padded vs unpadded, {batch}x{seq}")
        np.testing.assert_allclose(got, session.run(None, feeds)[0], rtol=ORT_TOL, atol=ORT_TOL,
                                   err_msg=f"padded vs onnxruntime, {batch}x{seq}")


def _forget_bindings(program) -> None:
    """The program's shape plans and its segments' views dropped: every shape is new again."""
    with program._plans_lock:
        program.shape_plans.clear()
        program._plan_sizes.clear()
        program.shape_plan_bytes = 0
        program.plan_evictions += 1  # the records go too
    for segment in program.segments:
        with segment._resize_lock:
            segment.resized.clear()


def test_a_new_shapes_first_call_binds_without_a_run_and_runs_directly_bit_for_bit_as_the_general_path(
        dynamic_bert_tiny, counted, monkeypatch):
    """A first call at a shape never seen (numpy feeds, no padding) computes its shape values and binds its view
    without running the program (DirectRuns.bind), then runs as one call of the loop: the outputs the general path's
    first call gives at that shape (the same engine, its plans and views dropped, bound again by the general path),
    bit for bit, and onnxruntime's."""
    engine, session = dynamic_bert_tiny
    context = _fresh(engine, pad=False)
    monkeypatch.setenv("KILN_DIRECT_RUN", "0")
    general = engine.create_execution_context(pad_first_calls=False)
    rng = np.random.default_rng()
    shapes = {(int(rng.integers(1, 5)), int(rng.integers(1, 49))) for _ in range(6)} | {(1, 1), (4, 48), (3, 5)}
    program = engine.program
    assert program.shape_function.shapes_only  # bind hands it the numpy arrays, outside inference mode
    for batch, seq in sorted(shapes):
        feeds = _feeds(rng, batch, seq)
        signature = direct_run.torch_signature([feeds["input_ids"], feeds["attention_mask"]])
        assert signature not in program.shape_plans
        before = len(counted)
        got = next(iter(context.run(feeds).values()))
        assert len(counted) == before + 1, f"{batch}x{seq}: its first call did not run directly"
        assert signature in program.shape_plans and signature in engine.direct_runs._records
        assert isinstance(got, np.ndarray) and got.shape == (batch, seq, 64) and got.flags.c_contiguous
        _forget_bindings(program)
        want = next(iter(general.run(feeds).values()))  # the general path's first call, binding anew
        assert signature in program.shape_plans and len(counted) == before + 1
        np.testing.assert_array_equal(got, want, err_msg=f"first call, direct vs general path, {batch}x{seq}")
        np.testing.assert_allclose(got, session.run(None, feeds)[0], rtol=ORT_TOL, atol=ORT_TOL,
                                   err_msg=f"first call, direct vs onnxruntime, {batch}x{seq}")
        _forget_bindings(program)


def test_padding_first_calls_a_shape_without_a_host_binds_directly_and_is_recorded_as_bound(dynamic_bert_tiny,
                                                                                              counted):
    """Padding first calls, a new shape no bound shape hosts is bound through DirectRuns.bind (FirstCalls._bind_direct):
    one direct call, recorded as bound (its first run's time), its repeat measuring what binding cost, as a first
    exact run through the program is recorded; outputs as onnxruntime's."""
    engine, session = dynamic_bert_tiny
    context = _fresh(engine, pad=True, budget_ms=0.0)  # no padding: every new shape binds
    padding = engine.first_calls
    rng = np.random.default_rng()
    for batch, seq in sorted({(int(rng.integers(1, 5)), int(rng.integers(1, 49))) for _ in range(4)}):
        feeds = _feeds(rng, batch, seq)
        signature = direct_run.torch_signature([feeds["input_ids"], feeds["attention_mask"]])
        before, measured = len(counted), len(padding.bind_ms)
        got = next(iter(context.run(feeds).values()))
        assert len(counted) == before + 1, f"{batch}x{seq}: its first call did not run directly"
        assert padding.bound[signature].runs == 1 and padding.bound[signature].first_ms > 0
        np.testing.assert_allclose(got, session.run(None, feeds)[0], rtol=ORT_TOL, atol=ORT_TOL,
                                   err_msg=f"first call, direct vs onnxruntime, {batch}x{seq}")
        again = next(iter(context.run(feeds).values()))  # its repeat: binding's cost measured
        assert padding.bound[signature].runs == 2 and len(padding.bind_ms) == min(measured + 1, padding.bind_ms.maxlen)
        np.testing.assert_array_equal(got, again)


def test_a_first_call_the_direct_path_cannot_take_runs_the_general_path(dynamic_bert_tiny, counted, monkeypatch):
    """Where the shape function cannot make a plan ahead (here: it raises), DirectRuns.bind makes no record and the
    first call runs the general path, with the same outputs; the next call at the shape runs directly."""
    engine, session = dynamic_bert_tiny
    context = _fresh(engine, pad=False)
    program = engine.program

    def failing(inputs, signature):
        return False

    monkeypatch.setattr(program, "plan_ahead", failing)
    feeds = _feeds(np.random.default_rng(), 2, 13)
    got = next(iter(context.run(feeds).values()))
    assert len(counted) == 0
    np.testing.assert_allclose(got, session.run(None, feeds)[0], rtol=ORT_TOL, atol=ORT_TOL)
    again = next(iter(context.run(feeds).values()))
    assert len(counted) == 1
    np.testing.assert_array_equal(got, again)


def _one_direct_record(engine, counted) -> tuple:
    """A fresh context, and a 3 x S request run once (its first call binds and runs directly): (context, feeds,
    signature)."""
    context = _fresh(engine, pad=False)
    rng = np.random.default_rng()
    feeds = _feeds(rng, 3, int(rng.integers(2, 40)))
    context.run(feeds)
    assert len(counted) == 1
    return context, feeds, direct_run.torch_signature([feeds["input_ids"], feeds["attention_mask"]])


def test_records_go_when_a_shape_plan_or_view_goes_and_the_shape_binds_again(dynamic_bert_tiny, counted):
    engine, session = dynamic_bert_tiny
    context, feeds, signature = _one_direct_record(engine, counted)
    direct = engine.direct_runs
    record = direct._records[signature]
    # the program lets the shape plan go (its LRU): the records go, the shape's plan is made again and its call runs
    # directly in a new record (DirectRuns.bind)
    program = engine.program
    with program._plans_lock:
        program.shape_plans.pop(signature)
        program.shape_plan_bytes -= program._plan_sizes.pop(signature)
        program.plan_evictions += 1
    got = next(iter(context.run(feeds).values()))
    assert len(counted) == 2 and signature in program.shape_plans and direct._records[signature] is not record
    np.testing.assert_allclose(got, session.run(None, feeds)[0], rtol=ORT_TOL, atol=ORT_TOL)
    record = direct._records[signature]
    context.run(feeds)
    assert len(counted) == 3 and direct._records[signature] is record
    # the segment lets a view go: the shape is bound again, in a new record
    segment = direct.segment
    with segment._resize_lock:
        segment.resized.pop(record.view_key)
        segment.view_evictions += 1
    assert signature not in direct._records  # its view was freed, the record with it
    context.run(feeds)
    assert len(counted) == 4 and direct._records[signature] is not record
    record = direct._records[signature]
    # the views cleared another way (no eviction counted): the record sees its view is not the segment's any more
    with segment._resize_lock:
        segment.resized.clear()
    got = next(iter(context.run(feeds).values()))
    assert len(counted) == 5 and direct._records[signature] is not record
    np.testing.assert_allclose(got, session.run(None, feeds)[0], rtol=ORT_TOL, atol=ORT_TOL)


@pytest.mark.parametrize("pad", [True, False])
def test_a_stream_past_the_shape_plans_bound_binds_directly_and_forgets_only_the_evicted_records(
        dynamic_bert_tiny, counted, monkeypatch, pad):
    """Past SHAPE_PLANS (here 6) each new shape's plan lets the least recent one go: that plan's record goes with
    it, the others stay, and every new shape's first call still binds and runs directly (before, any eviction made
    DirectRuns.bind decline until a find() had cleared every record: padding first calls, each new shape past the
    bound ran the general path). Outputs as onnxruntime's; the records' view of the evictions matches the plans'."""
    engine, session = dynamic_bert_tiny
    monkeypatch.setattr(kiln_program, "SHAPE_PLANS", 6)
    context = _fresh(engine, pad, budget_ms=0.0)  # no padding: every new shape binds
    program, direct = engine.program, engine.direct_runs
    rng = np.random.default_rng()
    evictions = program.plan_evictions
    signatures = []
    for k in rng.permutation(4 * 48)[:16]:
        feeds = _feeds(rng, int(k) // 48 + 1, int(k) % 48 + 1)
        signatures.append(direct_run.torch_signature([feeds["input_ids"], feeds["attention_mask"]]))
        before = len(counted)
        got = next(iter(context.run(feeds).values()))
        assert len(counted) == before + 1, f"new shape {len(signatures)}: its first call did not run directly"
        np.testing.assert_allclose(got, session.run(None, feeds)[0], rtol=ORT_TOL, atol=ORT_TOL)
        assert list(program.shape_plans) == signatures[-6:]
        # every kept plan's record; of the let-go ones, only the plan this call let go (its record goes at the next
        # look, find or bind)
        assert set(signatures[-6:]) <= set(direct._records) <= set(signatures[-7:]), "a record kept or let go wrongly"
    assert program.plan_evictions == evictions + 10
    program.plan_evictions += 1  # counted without its entry (set by hand): every record goes at the next look
    assert direct.find(signatures[-1]) is not None and set(direct._records) == {signatures[-1]}


def test_an_evicted_view_is_freed_at_once_and_its_record_with_it(dynamic_bert_tiny, counted):
    """A record holds its view weakly: when the segment's LRU lets the view go, the view is freed there and then, not
    kept alive by the record until the next direct-run look-up notices the eviction."""
    engine, session = dynamic_bert_tiny
    context, feeds, signature = _one_direct_record(engine, counted)
    direct, segment = engine.direct_runs, engine.direct_runs.segment
    key = direct._records[signature].view_key
    assert key != segment._planned_key, "the shape ran on the template, not a view"
    view = weakref.ref(segment.resized[key])
    with segment._resize_lock:  # as Segment._bind_sizes lets its least recently used view go
        segment.resized.pop(key)
        segment.view_evictions += 1
    assert view() is None, "the evicted view is still held"
    assert signature not in direct._records
    got = next(iter(context.run(feeds).values()))  # bound again (DirectRuns.bind), run directly
    assert len(counted) == 2 and segment.resized[key] is not None
    np.testing.assert_allclose(got, session.run(None, feeds)[0], rtol=ORT_TOL, atol=ORT_TOL)


def test_a_direct_run_marks_its_shape_used_in_the_plans_and_views(dynamic_bert_tiny):
    engine, _ = dynamic_bert_tiny
    context = _fresh(engine, pad=False)
    rng = np.random.default_rng()
    first, second = _feeds(rng, 2, 9), _feeds(rng, 2, 11)
    for feeds in (first, second, first, second):
        context.run(feeds)
    context.run(first)  # direct: first is now the most recently used
    signature = direct_run.torch_signature([first["input_ids"], first["attention_mask"]])
    assert next(reversed(engine.program.shape_plans)) == signature
    assert next(reversed(engine.direct_runs.segment.resized)) == engine.direct_runs._records[signature].view_key


def test_torch_inputs_and_threads(dynamic_bert_tiny, counted):
    engine, session = dynamic_bert_tiny
    _fresh(engine, budget_ms=0.0)  # every shape binds at its first call
    rng = np.random.default_rng()
    requests = [_feeds(rng, int(rng.integers(1, 5)), int(rng.integers(1, 49))) for _ in range(4)]
    warm = engine.create_execution_context()
    for feeds in requests:
        warm.run(feeds)
        warm.run(feeds)  # its binding measured: direct from now on
    want = [session.run(None, feeds)[0] for feeds in requests]
    tensor_out = warm.run({k: torch.from_numpy(v) for k, v in requests[0].items()})
    assert isinstance(next(iter(tensor_out.values())), torch.Tensor)  # torch in: the general path, torch out
    counted.clear()  # the threads' runs only (a shape drawn twice above ran directly at its third and fourth call)
    errors = []

    def worker(seed):
        context = engine.create_execution_context()
        order = np.random.default_rng(seed).permutation(len(requests))
        for _ in range(10):
            for k in order:
                got = next(iter(context.run(requests[k]).values()))
                if np.abs(got - want[k]).max() > ORT_TOL:
                    errors.append((seed, k, float(np.abs(got - want[k]).max())))

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    # each thread's context runs a lane of its own (its own arena and views, Engine.lend_lane): it binds each shape at
    # its first calls (its binding measured at the second), then runs it directly
    assert len(counted) >= 3 * (10 - 2) * len(requests)
