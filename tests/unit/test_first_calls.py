"""First calls at new shapes on the CPU, run padded inside a bound shape (kiln/runtime/first_calls.py): padded runs
give the unpadded result and onnxruntime's at fresh random shapes, a shape binds once its padded runs have cost
what binding would, a host is chosen by its estimated extra against the binding budget, a mask row with no real
token is never padded along the sequence, and the warm-up binds the host sizes, bounded and reported."""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest
import torch

from kiln.runtime import warm_up as kiln_warm_up
from kiln.runtime import first_calls

# Padded and unpadded runs differ only in the GEMMs' and attention's summation order over other shapes (fp32):
# well inside 1e-5 of the scale of BERT's LayerNorm'd outputs (test_buckets.py's tolerance)
RTOL, ATOL = 1e-5, 2e-5
ORT_TOL = 1e-4  # kiln against onnxruntime: two fp32 implementations' rounding over 2 layers


def _feeds(rng, batch, seq, empty_row=None):
    mask = np.ones((batch, seq), np.int64)
    for row in range(batch):
        mask[row, rng.integers(1, seq + 1):] = 0
    if empty_row is not None:
        mask[empty_row] = 0
    return {"input_ids": rng.integers(0, 1024, (batch, seq), dtype=np.int64), "attention_mask": mask}


def _fresh(engine, own_cost=False):
    """A context whose engine's padding starts over (nothing bound it knows of), with a budget that pads any call
    that has a host. Without `own_cost` a padded call's own cost is never sampled (FirstCalls.pad_ms keeps none):
    the budget is bind_ms' alone, which the tests of the extra rule pin."""
    engine.first_calls = first_calls.FirstCalls(engine.program, engine.first_calls.buckets, engine.inputs)
    engine.first_calls.bind_ms.append(1e6)
    if not own_cost:
        engine.first_calls.pad_ms = deque(maxlen=0)
    return engine.create_execution_context()


def _bind(context, feeds):
    """Run `feeds` at their own size (bound), whatever the budget, and once more (its binding measured)."""
    padding = context._first_calls
    budget = list(padding.bind_ms)
    padding.bind_ms.clear()
    padding.bind_ms.append(0.0)  # no host's extra is below it: run exactly
    context.run(feeds)
    context.run(feeds)
    padding.bind_ms.clear()
    padding.bind_ms.extend(budget)


def test_padded_first_calls_give_the_unpadded_result_and_onnxruntimes(dynamic_bert_tiny):
    engine, session = dynamic_bert_tiny
    context = _fresh(engine)
    plain = engine.create_execution_context(pad_first_calls=False)
    assert plain._first_calls is None and context._first_calls is engine.first_calls
    rng = np.random.default_rng()
    context.run(_feeds(rng, 4, 48))  # the host: bound at the profile's max
    padding = engine.first_calls
    shapes = {(int(rng.integers(1, 5)), int(rng.integers(1, 48))) for _ in range(8)} | {(1, 1), (3, 47)}
    for batch, seq in sorted(shapes):
        feeds = _feeds(rng, batch, seq)
        before = padding.padded_runs
        got = next(iter(context.run(feeds).values()))
        assert padding.padded_runs == before + 1, f"batch {batch} x seq {seq} was not padded"
        assert got.shape == (batch, seq, 64) and got.flags.c_contiguous  # cropped back, as a run at its size
        np.testing.assert_allclose(got, next(iter(plain.run(feeds).values())), rtol=RTOL, atol=ATOL,
                                   err_msg=f"padded vs unpadded, batch {batch} x seq {seq}")
        np.testing.assert_allclose(got, session.run(None, feeds)[0], rtol=ORT_TOL, atol=ORT_TOL,
                                   err_msg=f"padded vs onnxruntime, batch {batch} x seq {seq}")


def test_torch_inputs_are_padded_and_come_back_as_torch(dynamic_bert_tiny):
    engine, session = dynamic_bert_tiny
    context = _fresh(engine)
    rng = np.random.default_rng()
    context.run(_feeds(rng, 4, 48))
    batch, seq = int(rng.integers(1, 4)), int(rng.integers(2, 47))
    feeds = _feeds(rng, batch, seq)
    got = next(iter(context.run({k: torch.from_numpy(v) for k, v in feeds.items()}).values()))
    assert engine.first_calls.padded_runs == 1 and isinstance(got, torch.Tensor) and got.shape == (batch, seq, 64)
    np.testing.assert_allclose(got.numpy(), session.run(None, feeds)[0], rtol=ORT_TOL, atol=ORT_TOL)


def test_a_shape_binds_once_its_padded_runs_have_cost_what_binding_would(dynamic_bert_tiny):
    engine, _ = dynamic_bert_tiny
    context = _fresh(engine)
    padding = engine.first_calls
    rng = np.random.default_rng()
    context.run(_feeds(rng, 4, 48))
    host = padding.bound[((4, 48), torch.int64), ((4, 48), torch.int64)]
    host.ms = 1e-3  # below any run's time: it stays the estimate's
    seq = int(rng.integers(2, 40))
    extra = host.ms * (1 - 2 * seq / (4 * 48))
    padding.bind_ms.clear()
    padding.bind_ms.append(2.5 * extra)  # two padded runs' extra are below it, three are not
    feeds = _feeds(rng, 2, seq)
    signature = ((feeds["input_ids"].shape, torch.int64),) * 2
    for call in (1, 2):
        context.run(feeds)
        assert padding.padded_runs == call and signature not in padding.bound
    context.run(feeds)  # the third: at its own size, which binds it
    assert padding.padded_runs == 2 and signature in padding.bound and signature in engine.program.shape_plans
    assert signature not in padding._paid
    context.run(feeds)  # the fourth: its repeat, which measures what binding cost
    assert padding.bound[signature].runs == 2 and len(padding.bind_ms) == 2


def test_a_bound_shapes_first_repeat_runs_directly_and_measures_binding(dynamic_bert_tiny, counted, monkeypatch):
    """A new numpy shape's first call binds it, its second (the repeat that measures what binding cost) and later
    ones run as one call of the loop too (a DirectRun each, never Program.run: the general path the repeat took
    before), matching onnxruntime at fresh random shapes, and each shape's repeat adds one binding sample."""
    engine, session = dynamic_bert_tiny
    context = _fresh(engine)
    padding = context._first_calls  # (its lane's: a later context of the engine may run a lane of its own)
    padding.bind_ms.clear()
    monkeypatch.setattr(first_calls.FirstCalls, "budget_ms", lambda self: 0.0)  # no host is cheaper: every shape binds
    monkeypatch.setattr(padding.program, "run", lambda *a, **k: pytest.fail("a call took the general path"))
    rng = np.random.default_rng()
    shapes = {(int(rng.integers(1, 5)), int(rng.integers(1, 49))) for _ in range(4)}
    for k, (batch, seq) in enumerate(sorted(shapes)):
        signature = (((batch, seq), torch.int64),) * 2
        for call in (1, 2, 3):
            feeds = _feeds(rng, batch, seq)
            got = next(iter(context.run(feeds).values()))
            np.testing.assert_allclose(got, session.run(None, feeds)[0], rtol=ORT_TOL, atol=ORT_TOL,
                                       err_msg=f"call {call} at batch {batch} x seq {seq} vs onnxruntime")
            assert counted[-1] == ((batch, seq), (batch, seq)), f"call {call} at {batch} x {seq} ran no DirectRun"
            assert padding.bound[signature].runs == min(call, 2)
        assert len(padding.bind_ms) == k + 1 and padding.bind_ms[-1] >= 0
    assert padding.padded_runs == 0 and len(counted) == 3 * len(shapes)


def test_a_padded_calls_own_cost_is_measured_and_taken_from_the_budget(dynamic_bert_tiny, monkeypatch):
    """A padded call samples its own cost (the host's search, the padding, the crops); a new shape is padded only
    where its extra plus that cost is below binding's, and where binding costs no more than that cost alone no host
    is searched: it binds. Each call matches onnxruntime."""
    engine, session = dynamic_bert_tiny
    context = _fresh(engine, own_cost=True)
    padding = engine.first_calls
    rng = np.random.default_rng()
    context.run(_feeds(rng, 4, 48))
    host = padding.bound[((4, 48), torch.int64), ((4, 48), torch.int64)]

    def call(batch, seq):
        feeds = _feeds(rng, batch, seq)
        got = next(iter(context.run(feeds).values()))
        np.testing.assert_allclose(got, session.run(None, feeds)[0], rtol=ORT_TOL, atol=ORT_TOL,
                                   err_msg=f"batch {batch} x seq {seq} vs onnxruntime")

    call(4, 47)  # bind_ms' 1e6: padded, its own cost sampled
    assert padding.padded_runs == 1 and len(padding.pad_ms) == 1 and padding.pad_ms[0] > 0
    own, seqs = 0.05, iter(rng.permutation(np.arange(2, 40)))
    for budget, padded in ((2.0, True), (0.5, False)):  # binding's cost: own + budget x the extra
        padding.pad_ms.clear()
        padding.pad_ms.append(own)
        host.ms = 1e-3  # below any run's time: it stays the estimate's
        seq = int(next(seqs))
        extra = host.ms * (1 - 2 * seq / (4 * 48))
        padding.bind_ms.clear()
        padding.bind_ms.append(own + budget * extra)
        before = padding.padded_runs
        call(2, seq)
        assert padding.padded_runs == before + padded, f"budget {budget} x the extra: padded {not padded}"
    padding.bind_ms.clear()
    padding.bind_ms.append(0.9 * padding.pad_overhead_ms())  # binding cheaper than a padded call's own work
    monkeypatch.setattr(first_calls.Hosts, "cheapest", lambda *a: pytest.fail("a host was searched"))
    before, bound = padding.padded_runs, len(padding.bound)
    call(2, int(next(seqs)))
    assert padding.padded_runs == before and len(padding.bound) == bound + 1


def test_the_host_is_the_one_of_least_estimated_extra_within_the_budget(dynamic_bert_tiny):
    engine, _ = dynamic_bert_tiny
    context = _fresh(engine)
    padding = engine.first_calls
    rng = np.random.default_rng()
    for batch, seq in ((4, 48), (2, 40), (4, 20)):
        _bind(context, _feeds(rng, batch, seq))
    padding.bound[((4, 48), torch.int64), ((4, 48), torch.int64)].ms = 4.0
    padding.bound[((2, 40), torch.int64), ((2, 40), torch.int64)].ms = 1.0
    padding.bound[((4, 20), torch.int64), ((4, 20), torch.int64)].ms = 1.0
    feeds = _feeds(rng, 2, 18)
    args = [torch.from_numpy(feeds[n]) for n in engine.input_names]
    signature = ((2, 18), torch.int64), ((2, 18), torch.int64)
    # extra = t_host * (1 - 36 / work_host): 4x48 3.25 ms, 2x40 0.55 ms, 4x20 0.55 ms -> the first of least
    assert padding._host(args, signature, (2, 18), paying=False).sizes in {(2, 40), (4, 20)}
    padding.bound[((4, 20), torch.int64), ((4, 20), torch.int64)].ms = 0.5  # extra 0.275 ms
    assert padding._host(args, signature, (2, 18), paying=False).sizes in {(2, 40), (4, 20)}  # the choice made
    for hosts in padding._groups.values():
        hosts._least.clear()  # as a shape bound or let go does
    assert padding._host(args, signature, (2, 18), paying=False).sizes == (4, 20)
    padding.bind_ms.clear()
    padding.bind_ms.append(0.5)
    assert padding._host(args, signature, (2, 18)).sizes == (4, 20)  # paid: 0.275 ms of the 0.5
    assert padding._host(args, signature, (2, 18)) is None  # the next 0.275 would pass it: bind
    padding.bind_ms.clear()
    padding.bind_ms.append(0.2)  # binding cheaper than any host's extra: none
    assert padding._host(args, (((2, 17), torch.int64),) * 2, (2, 17)) is None
    assert padding._host(args, (((5, 18), torch.int64),) * 2, (5, 18)) is None  # no bound shape holds 5 rows


def test_the_walk_by_work_finds_the_host_of_least_extra_that_the_whole_loop_finds():
    """Hosts' walk stops where floor x (its work - work) reaches the best extra: at random hosts, times, sizes, fixed
    dims and kept plans it finds a host of the least extra the plain loop over every host finds (floor 0), and so
    does it with each host's time lowered below the floor's bound only where the floor is lowered too."""
    rng = np.random.default_rng()
    for _ in range(30):
        hosts, shapes, floor = first_calls.Hosts(), [], float("inf")
        for b, s in {(int(rng.integers(1, 9)), int(rng.integers(1, 129))) for _ in range(int(rng.integers(1, 120)))}:
            shape = first_calls.BoundShape(((b, s),), (b, s), b * s, 1.0, float(rng.uniform(0.01, 3.0)) * b * s / 100)
            shapes.append(shape)
            hosts.add(shape)
            floor = min(floor, shape.ms / shape.work)
        for gone in shapes[::7]:
            hosts.remove(gone)  # the floor stays: a bound still
        plans = {shape.signature for shape in hosts.shapes if rng.random() < 0.9}
        for _ in range(40):
            sizes = (int(rng.integers(1, 9)), int(rng.integers(1, 129)))
            fixed = [1] if rng.random() < 0.2 else []
            walked = hosts._search(sizes, fixed, plans, floor)
            looped = hosts._search(sizes, fixed, plans, 0.0)
            assert (walked is None) == (looped is None)
            if walked is not None:
                work = sizes[0] * sizes[1]
                assert walked.ms * (1 - work / walked.work) == looped.ms * (1 - work / looped.work)
                assert walked.signature in plans and all(h >= d for h, d in zip(walked.sizes, sizes))
    assert [s.work for s in hosts.shapes] == sorted(s.work for s in hosts.shapes)


def test_a_host_let_go_is_that_shape_among_those_of_equal_work():
    """Hosts.remove finds the shape by bisect over the works, then by identity among the shapes of its work: at
    random shapes (many of one work: 2 x 6, 3 x 4, 4 x 3 ...) removed in random order, the shapes left are exactly
    the others, still by work."""
    rng = np.random.default_rng()
    for _ in range(20):
        hosts = first_calls.Hosts()
        sizes = [(int(rng.integers(1, 9)), int(rng.integers(1, 25))) for _ in range(int(rng.integers(1, 60)))]
        shapes = [first_calls.BoundShape(((b, s), k), (b, s), b * s, 1.0, 1.0) for k, (b, s) in enumerate(sizes)]
        for shape in shapes:
            hosts.add(shape)
        kept = list(shapes)
        for shape in rng.permutation(len(shapes))[:int(rng.integers(0, len(shapes) + 1))]:
            hosts.remove(shapes[shape])
            kept.remove(shapes[shape])
            assert {id(h) for h in hosts.shapes} == {id(h) for h in kept}
            assert hosts._works == [h.work for h in hosts.shapes] == sorted(h.work for h in kept)


def test_every_row_kept_answers_as_the_rows_reduction():
    """_every_row_kept's one-column answer (a mask whose first or last column is all real tokens) and its reduction
    otherwise agree with each row's any() at random masks: padded at the end, at the start, with holes, with a row
    of no real token, of no positions, bool and int, numpy and torch."""
    rng = np.random.default_rng()
    seen = set()
    for _ in range(400):
        batch, seq = int(rng.integers(1, 6)), int(rng.integers(0, 9))
        mask = (rng.random((batch, seq)) < rng.choice([0.3, 0.9, 1.0])).astype(rng.choice([np.int64, np.bool_]))
        if seq and rng.random() < 0.5:  # one side real, the other padded
            lengths = rng.integers(0 if rng.random() < 0.2 else 1, seq + 1, batch)
            mask = (np.arange(seq)[None, :] < lengths[:, None]).astype(mask.dtype)
            if rng.random() < 0.5:
                mask = mask[:, ::-1].copy()
        want = bool(np.all([row.any() for row in mask])) if batch else True
        assert first_calls._every_row_kept(mask) == want, mask
        assert first_calls._every_row_kept(torch.from_numpy(mask)) == want
        seen.add(want)
    assert seen == {True, False}


def test_the_host_choice_is_remembered_until_a_shape_is_bound_or_let_go(dynamic_bert_tiny):
    engine, _ = dynamic_bert_tiny
    context = _fresh(engine)
    padding = engine.first_calls
    rng = np.random.default_rng()
    for batch, seq in ((4, 48), (2, 40)):
        _bind(context, _feeds(rng, batch, seq))
    big, small = (padding.bound[((b, s), torch.int64), ((b, s), torch.int64)] for b, s in ((4, 48), (2, 40)))
    big.ms, small.ms = 4.0, 1.0
    for hosts in padding._groups.values():
        hosts._least.clear()
    args = [torch.zeros(2, 18, dtype=torch.int64), torch.ones(2, 18, dtype=torch.int64)]
    signature = ((2, 18), torch.int64), ((2, 18), torch.int64)
    assert padding._host(args, signature, (2, 18), paying=False) is small
    small.ms = 100.0  # measured later: the remembered choice stands, its extra from the new time
    assert padding._host(args, signature, (2, 18), paying=False) is small
    _bind(context, _feeds(rng, 2, 20))  # a shape bound: the choice is made again
    assert padding._host(args, signature, (2, 18), paying=False).sizes == (2, 20)
    padding.bind_ms.clear()
    padding.bind_ms.append(1e-9)  # the least extra is over the budget: none
    assert padding._host(args, signature, (2, 18), paying=False) is None


def test_a_mask_row_without_a_real_token_is_not_padded_along_the_sequence(dynamic_bert_tiny):
    """Such a row attends to every key alike (BERT's additive mask of the dtype's minimum): padded keys would
    join in. Without the guard the padded result differs from onnxruntime's by ~1.6e-2 (measured), 160x the tolerance."""
    engine, session = dynamic_bert_tiny
    context = _fresh(engine)
    rng = np.random.default_rng()
    context.run(_feeds(rng, 4, 48))
    seq = int(rng.integers(2, 40))
    feeds = _feeds(rng, 2, seq, empty_row=1)
    got = next(iter(context.run(feeds).values()))
    assert engine.first_calls.padded_runs == 0
    np.testing.assert_allclose(got, session.run(None, feeds)[0], rtol=ORT_TOL, atol=ORT_TOL)
    _bind(context, _feeds(rng, 4, seq + 1))  # a host of another batch and the same sequence: padded along the batch
    padded = engine.first_calls.padded_runs
    again = _feeds(rng, 3, seq + 1, empty_row=0)
    got = next(iter(context.run(again).values()))
    assert engine.first_calls.padded_runs == padded + 1
    np.testing.assert_allclose(got, session.run(None, again)[0], rtol=ORT_TOL, atol=ORT_TOL)


def test_warm_up_binds_the_host_sizes_measures_binding_and_the_switch_turns_padding_off(dynamic_bert_tiny,
                                                                                       monkeypatch):
    engine, ort_session = dynamic_bert_tiny
    engine.first_calls = first_calls.FirstCalls(engine.program, engine.first_calls.buckets, engine.inputs)
    context = engine.create_execution_context()
    monkeypatch.setattr(kiln_warm_up, "HOSTS_UP_TO", 1e9)  # every shape, however long its run on a loaded machine
    # binding's cost fixed for the stop rule (it is still measured: bind_ms below): where this process already made
    # the layers' oneDNN primitives (another bert_tiny engine of an earlier module: the shared cache), most bindings
    # measure 0 and any run is "over HOSTS_UP_TO x binding" (3 of 8 fresh loads stopped after 21-62 shapes, load 14)
    monkeypatch.setattr(first_calls.FirstCalls, "budget_ms", lambda self: 1.0)
    batches, seqs = first_calls.host_sizes(1, 4), first_calls.host_sizes(1, 48)
    assert batches == [1, 2, 3, 4] and seqs == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48]
    shapes = len(batches) * len(seqs)
    # time enough that every shape, not the clock, ends it (0.5-1.4 s of WARM_UP_S's 2 at load 14: the time bound is
    # test_warm_up_is_bounded_in_shapes_and_in_time's)
    assert context.warm_up(seconds=600.0) == 2 * shapes  # each twice: bound (a host), timed, binding measured
    bound = {shape.sizes for shape in engine.first_calls.bound.values()}
    assert {(b, s) for b in batches for s in seqs} == bound
    assert all(shape.runs == 2 for shape in engine.first_calls.bound.values())
    assert len(engine.first_calls.bind_ms) == first_calls.BIND_SAMPLES and min(engine.first_calls.bind_ms) >= 0
    report = context.warmed_up
    assert (report.runs, report.shapes, report.bound, report.stopped) == (2 * shapes, shapes, shapes,
                                                                          "every shape run")
    assert report.seconds > 0 and "72 bound" in report.describe()
    # each host ready for numpy calls: its signature checked and its direct run made, so a stream's first numpy call
    # at it neither checks nor makes them (and runs as one loop call, matching onnxruntime)
    checked = {tuple(shape for _, shape in key) for key in context._checked}
    assert {((b, s), (b, s)) for b in batches for s in seqs} <= checked
    made = []
    original = context._direct._make
    monkeypatch.setattr(context._direct, "_make", lambda signature: made.append(signature) or original(signature))
    monkeypatch.setattr(context, "_check", lambda feeds: pytest.fail(f"{feeds} checked again"))
    rng = np.random.default_rng()
    for b, s in ((1, 1), (3, 14), (4, 48)):
        feeds = _feeds(rng, b, s)
        np.testing.assert_allclose(next(iter(context.run(feeds).values())), ort_session.run(None, feeds)[0],
                                   rtol=ORT_TOL, atol=ORT_TOL, err_msg=f"batch {b} x seq {s} vs onnxruntime")
    assert made == []
    monkeypatch.undo()
    monkeypatch.setenv("KILN_PAD_FIRST_CALLS", "0")
    assert engine.create_execution_context()._first_calls is None
    assert engine.create_execution_context(buckets=True)._first_calls is None  # buckets pad every call already


def test_warm_up_stops_at_the_first_shape_whose_run_costs_more_than_binding_would(dynamic_bert_tiny, monkeypatch):
    engine, _ = dynamic_bert_tiny
    engine.first_calls = first_calls.FirstCalls(engine.program, engine.first_calls.buckets, engine.inputs)
    monkeypatch.setattr(kiln_warm_up, "HOSTS_UP_TO", 0.0)  # any run costs more: as soon as binding is measured
    context = engine.create_execution_context()
    assert context.warm_up() == 2 * kiln_warm_up.BUDGET_FROM  # the smallest shapes, each binding measured
    assert [shape.sizes for shape in engine.first_calls.bound.values()] == [(1, 1), (1, 2), (2, 1)]
    assert "HOSTS_UP_TO" in context.warmed_up.stopped


def test_warm_up_is_bounded_in_shapes_and_in_time(dynamic_bert_tiny, monkeypatch):
    engine, _ = dynamic_bert_tiny
    monkeypatch.setattr(kiln_warm_up, "HOSTS_UP_TO", 1e9)
    monkeypatch.setattr(kiln_warm_up, "WARM_UP_HOSTS", 5)
    # binding's cost fixed: since the load's background job traces the views ahead, a first call may be no slower than
    # its repeat (a measured cost of 0, and any run is then "over HOSTS_UP_TO x binding": CI stopped after 3 hosts)
    monkeypatch.setattr(first_calls.FirstCalls, "budget_ms", lambda self: 1.0)
    engine.first_calls = first_calls.FirstCalls(engine.program, engine.first_calls.buckets, engine.inputs)
    context = engine.create_execution_context()
    # time enough that the host count, not the clock, stops it (a loaded CI machine ran out of WARM_UP_S after 3)
    assert context.warm_up(seconds=600.0) == 2 * 5 and len(engine.first_calls.bound) == 5
    assert "WARM_UP_HOSTS" in context.warmed_up.stopped
    engine.first_calls = first_calls.FirstCalls(engine.program, engine.first_calls.buckets, engine.inputs)
    context = engine.create_execution_context()
    assert context.warm_up(seconds=0.0) == 0 and len(engine.first_calls.bound) == 0
    assert context.warmed_up.stopped == "out of time"


@pytest.mark.parametrize("low, high", [(1, 8), (1, 128), (3, 48), (1, 512), (7, 7), (1, 1), (5, 300), (9, 100)])
def test_host_sizes_pad_at_most_a_quarter_along_a_dim(low, high):
    sizes = first_calls.host_sizes(low, high)
    assert sizes == sorted(set(sizes)) and sizes[0] >= low and sizes[-1] == high
    assert [s for s in sizes if s <= first_calls.EVERY_SIZE_TO] == list(range(low, min(high, 4) + 1))
    for size in range(low, high + 1):
        host = next(s for s in sizes if s >= size)
        assert host <= size * 1.25, f"{size} pads to {host}"
