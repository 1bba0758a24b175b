"""llama_tiny's first calls at new shapes after load: every native segment whose members all have size rules
answers a new shape from the walk traced at load (kiln/runtime/view_trace.py), never walking its members at the
call. Before kiln::Rotary and kiln::RMSNorm had size rules (PlanRule), the attention segments' rule was the kernel
built at the sizes (not traceable) and the norms had none: every later new shape walked all five segments at the
call, ~1-6 ms a shape (bench/results/first-shape-2026-12-06.md).

Oracles: the rules against the kernels' own fields (kernels.Rotary asks torch's expand for the tables' strides,
the rule works them out by arithmetic), at fresh random sizes; the engine's outputs against onnxruntime.
"""

from __future__ import annotations

import dataclasses
import threading
import zlib

import numpy as np
import pytest
import torch

import kiln
from kiln.kernels.cpu import transformer as kernels
from kiln.runtime import first_calls, native, native_views
from kiln.tactics import registry
from kiln.tactics.cpu import rotary, transformer  # noqa: F401  (their tactics registered)
from tests.unit.llama_engine import llama, llama_segments  # noqa: F401  (the fixtures)
from tests.unit.tactic_check import make_step

ort = pytest.importorskip("onnxruntime")
pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"kiln's kernels not built: {kernels.reason()}")


def _prepared(name: str, step, constants: list):
    return registry.get(name).prepare(step, constants, torch.device("cpu"))


def _as_ints(value):
    return tuple(value) if hasattr(value, "__len__") else int(value)


# x, num_heads, rotate_heads, table size ("B", "S": the batch's and sequence's; every broadcast form
# tests/unit/test_rotary_native.py runs)
ROTARY = [((2, 7, 24), 3, 0, ("S", 1, 8)), ((1, 5, 24), 4, 0, (1, "S", 1, 6)), ((2, 3, 4, 10), 0, 0, ("B", "S", 4, 10)),
          ((1, 9, 64), 16, 12, (1, "S", 1, 4)), ((3, 4, 10), 5, 2, (2,)), ((2, 6, 32), 2, 0, ("B", "S", 1, 16))]


@pytest.mark.parametrize("shape,num_heads,rotate_heads,table", ROTARY, ids=str)
def test_rotary_size_rule_gives_the_kernels_fields_at_new_sizes(shape, num_heads, rotate_heads, table):
    """The rule (traced at load, then answering every view) at other batches and sequences than the tuned one:
    its output size and fields are those of the kernel built there."""
    attributes = {"num_heads": num_heads} if num_heads else {}
    if rotate_heads:
        attributes["rotate_heads"] = rotate_heads
    tuned = [{"B": shape[0], "S": shape[1]}.get(d, d) for d in table]
    step = dataclasses.replace(make_step("Rotary", "kiln", 3, **attributes),
                               tactic_config={"input_sizes": [[0, list(shape)], [1, tuned], [2, tuned]]})
    launch = _prepared("cpu.rotary.native", step, [None, None, None])
    rule = launch.native.plan_at
    rng = np.random.default_rng(zlib.crc32(repr((shape, table)).encode()))
    for _ in range(5):
        b, s = int(rng.integers(1, 6)), int(rng.integers(1, 40))
        x = (b, s, *shape[2:])
        t = tuple({"B": b, "S": s}.get(d, d) for d in table)
        sizes = {0: x, 1: t, 2: t}
        sized = rule(sizes)
        step_at = launch.native.at(sizes)
        assert sized.output_sizes == (tuple(step_at.output_size),), sizes
        made = kernels.Rotary(*_view_of(x, num_heads, rotate_heads), t, t)
        assert {k: _as_ints(v) for k, v in sized.fields.items()} == \
            {k: _as_ints(made.fields[k]) for k in sized.fields}, sizes


def _view_of(x, num_heads, rotate_heads):
    return rotary.rotary_view(x, num_heads, rotate_heads)


def test_rotary_size_rule_refuses_tables_that_do_not_broadcast():
    step = dataclasses.replace(make_step("Rotary", "kiln", 3, num_heads=2),
                               tactic_config={"input_sizes": [[0, [1, 4, 16]], [1, [4, 1, 8]], [2, [4, 1, 8]]]})
    rule = _prepared("cpu.rotary.native", step, [None, None, None]).native.plan_at
    with pytest.raises(ValueError):
        rule({0: (1, 5, 16), 1: (4, 1, 8), 2: (4, 1, 8)})  # 4 positions for 5
    with pytest.raises(ValueError):
        rule({0: (1, 4, 16), 1: (4, 1, 6), 2: (4, 1, 6)})  # depth 6 for 8


def test_rmsnorm_size_rule_gives_the_kernels_fields_and_refuses_other_widths():
    scale = torch.randn(24)
    step = dataclasses.replace(make_step("RMSNorm", "kiln", 2, epsilon=1e-6),
                               tactic_config={"input_sizes": [[0, [2, 8, 24]], [1, [24]]]})
    launch = _prepared("cpu.rmsnorm.native", step, [None, scale])
    rule = launch.native.plan_at
    rng = np.random.default_rng(zlib.crc32(b"rmsnorm"))
    for _ in range(5):
        x = (int(rng.integers(1, 6)), int(rng.integers(1, 40)), 24)
        sized = rule({0: x})
        made = kernels.LayerNorm(x, scale, None, 1e-6, rms=True)
        assert sized.output_sizes == (x,)
        assert dict(sized.fields) == {k: made.fields[k] for k in sized.fields}
    with pytest.raises(ValueError):
        rule({0: (2, 8, 16)})


@pytest.mark.parametrize("x,axis_bounds", [((2, 8, 128), (0, 64)), ((2, 8, 128), (64, 96)), ((2, 8, 128), (96, 128)),
                                           ((6, 40), (3, 4)), ((3, 5, 12), (11, 12))], ids=str)
def test_last_axis_slice_size_rule_gives_the_walk_memory_walk_finds(x, axis_bounds):
    """cpu.slice.native's rule (a Slice of the last axis by constants) against the Relayout built at new leading
    sizes (memory_walk: torch's slice of an offsets table, strided_form's merge), one row and one column included."""
    from kiln.kernels.cpu import relayout as relayout_kernels
    from kiln.tactics.cpu import relayout
    start, end = axis_bounds
    constants = [None, np.array([start]), np.array([end]), np.array([-1]), np.array([1])]
    step = dataclasses.replace(make_step("Slice", "", 5), tactic_config={"input_size": list(x)})
    launch = _prepared("cpu.slice.native", step, constants)
    rule = launch.native.plan_at
    assert rule is not None
    move = relayout._slice_move(step, constants)
    rng = np.random.default_rng(zlib.crc32(repr((x, axis_bounds)).encode()))
    for lead in [(1,) * (len(x) - 1)] + [tuple(int(v) for v in rng.integers(1, 9, len(x) - 1)) for _ in range(5)]:
        size = (*lead, x[-1])
        made = relayout_kernels.Relayout(size, move, "slice")
        sized = rule(size)
        walk = [tuple(d) for d in made.walk]
        rest = (0,) * (relayout_kernels.MAX_DIMS - len(walk))
        assert sized.output_sizes == (tuple(made.output_size),)
        assert dict(sized.fields) == dict(base=made.base, rank=len(walk), size=(*(d[0] for d in walk), *rest),
                                          stride=(*(d[1] for d in walk), *rest)), size
    with pytest.raises(ValueError):
        rule((*x[:-1], x[-1] + 1))


def test_llama_first_calls_after_load_answer_from_the_traced_walk_and_match_onnxruntime(llama, monkeypatch):
    exported, path = llama
    monkeypatch.setenv("KILN_PAD_FIRST_CALLS", "0")  # every new shape binds its own view
    context = kiln.load(str(path)).create_execution_context()
    context.warm_up()
    assert first_calls.primitives_made(120)
    segments = [step.fn for step in context.engine.program.lean_steps if isinstance(step.fn, native.Segment)]
    ruled = set()
    for segment in segments:
        template = segment._grown or segment
        rewrite = template._rewrite if segment._views else None
        assert rewrite is not None
        without = {template.members[k].ctx.op_type for k, m in enumerate(rewrite._members) if m[0] is None}
        assert not without, without  # the norms, rotaries and q|k|v's Slices have size rules
        assert rewrite._calls is not None  # every member's plan rewritten (a Slice's walk is a PlanMember's)
        ruled.add(id(rewrite))
    assert len(ruled) == 1  # the whole decoder: norms, q|k|v, packed rotary, attention, MLP, twice, and the head
    walked = []
    real = native_views._PlanRewrite._walk

    def walk(self, template, key, rules_only=False):
        if not rules_only and id(self) in ruled:
            walked.append(key)
        return real(self, template, key, rules_only)
    monkeypatch.setattr(native_views._PlanRewrite, "_walk", walk)
    session = ort.InferenceSession(str(exported.path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(zlib.crc32(b"llama first shapes"))
    for b, s in ((3, 5), (1, 7), (2, 13), (4, 3), (1, 15)):
        feeds = {"input_ids": rng.integers(0, 100, (b, s), dtype=np.int64),
                 "attention_mask": np.ones((b, s), np.int64)}
        feeds = {n: feeds[n] for n in context.engine.input_names}
        got = next(iter(context.run(feeds).values()))
        np.testing.assert_allclose(got, session.run(None, feeds)[0], rtol=1e-4, atol=1e-4)  # fp32 logits
    assert not walked, walked  # each such segment's view was one call of its traced walk


def _counted(monkeypatch, owner, name) -> list:
    """The calls of owner.name on this thread from now on (a background job of another engine under xdist, or this
    one's, is not a first call's)."""
    calls = []
    real = getattr(owner, name)
    caller = threading.get_ident()

    def counted(*a, **k):
        if threading.get_ident() == caller:
            calls.append(a[1:2])
        return real(*a, **k)
    monkeypatch.setattr(owner, name, counted)
    return calls


# later new shapes: a batch and a sequence of 1 among them (a broadcast's rule takes other paths there)
LATER = ((3, 5), (1, 7), (2, 13), (4, 3), (1, 1), (2, 1), (4, 16))


def _later_first_calls(llama, monkeypatch) -> tuple[list, list]:
    """(the views a first call made, the kernels it built) over first calls at LATER after load, each checked against
    onnxruntime (fp32 logits of two layers, 1e-4)."""
    exported, path = llama
    monkeypatch.setenv("KILN_PAD_FIRST_CALLS", "0")  # every new shape binds (or finds) its own view
    context = kiln.load(str(path)).create_execution_context()
    context.warm_up()
    assert first_calls.primitives_made(120)
    views = _counted(monkeypatch, native_views._PlanRewrite, "_assembled")
    built = _counted(monkeypatch, kernels.NativeKernel, "__init__")
    session = ort.InferenceSession(str(exported.path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(zlib.crc32(b"llama later shapes"))
    for b, s in LATER:
        feeds = {"input_ids": rng.integers(0, 100, (b, s), dtype=np.int64),
                 "attention_mask": np.ones((b, s), np.int64)}
        feeds = {n: feeds[n] for n in context.engine.input_names}
        got = next(iter(context.run(feeds).values()))
        np.testing.assert_allclose(got, session.run(None, feeds)[0], rtol=1e-4, atol=1e-4)
    return views, built


def test_llama_later_first_calls_find_their_views_made_ahead_and_build_no_kernel(llama_segments, monkeypatch):
    """The profile's 64 shapes (1x1..4x16) have their plans made at load (PLANS_AHEAD), and now each segment's view
    there (views_ahead.views_ahead_at: ~45 µs a segment of a first call otherwise), and the mask Wheres outside the
    segments rewrite their plan at a new size (native_member.RewrittenLaunch: a kernel and its memory objects built
    otherwise, ~90 µs each): a first call at a new shape makes no view and builds no kernel."""
    views, built = _later_first_calls(llama_segments, monkeypatch)
    assert not views, views
    assert not built, built


def test_llama_later_first_calls_without_views_ahead_or_the_rewrite_make_them(llama_segments, monkeypatch):
    """The checks above can fail: the load's views off, a view per segment at each first call; the rewrite off, the
    Wheres' kernels at each."""
    from kiln.runtime import views_ahead
    from kiln.tactics.cpu.native_member import RewrittenLaunch
    monkeypatch.setattr(views_ahead, "views_ahead_at", lambda *a: False)
    monkeypatch.setattr(RewrittenLaunch, "of", classmethod(lambda cls, *a: None))
    views, built = _later_first_calls(llama_segments, monkeypatch)
    assert len(views) == 5 * len(set(LATER)), len(views)
    assert {what.split(" of ")[0] for (what,) in built} == {"where"}, built


def test_llama_first_calls_past_the_planned_shapes_gather_the_mask_by_the_grids_parts(llama, monkeypatch):
    """Past the shapes planned at load (PLANS_AHEAD: here 4, as a profile of more shapes than 128 has), a first call
    computes its shape values, the causal mask among them: its four GatherNDs index by the grids' parts
    (shape_function._GatherGrid), the [b, 1, s, s, 2] grids never made (before: each made by _Grid, ~2 x 10 µs, and
    each GatherND ~55-95 µs). Outputs against onnxruntime (fp32 logits, 1e-4). The mask's corner cut off (CORNERS:
    the next test), so that its steps run at each such shape."""
    from kiln.runtime import shape_function as sf

    exported, path = llama
    monkeypatch.setenv("KILN_PAD_FIRST_CALLS", "0")
    monkeypatch.setattr(first_calls, "PLANS_AHEAD", 4)
    monkeypatch.setattr(sf, "CORNERS", False)
    context = kiln.load(str(path)).create_execution_context()
    context.warm_up()
    assert first_calls.primitives_made(120)
    program = context.engine.program
    assert "_gather_grid" in program.shape_function.source and "_grid" not in \
        program.shape_function.source.replace("_gather_grid", ""), program.shape_function.source
    grids = _counted(monkeypatch, sf._Grid, "__call__")
    gathers = _counted(monkeypatch, sf._GatherGrid, "__call__")
    session = ort.InferenceSession(str(exported.path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(zlib.crc32(b"llama past the planned shapes"))
    shapes = [(3, 13), (4, 16), (2, 11), (4, 9), (3, 16), (1, 16)]
    for b, s in shapes:
        assert not any(key[0][0] == (b, s) for key in program.shape_plans)  # a shape computed at the call
        feeds = {"input_ids": rng.integers(0, 100, (b, s), dtype=np.int64),
                 "attention_mask": np.ones((b, s), np.int64)}
        feeds = {n: feeds[n] for n in context.engine.input_names}
        got = next(iter(context.run(feeds).values()))
        np.testing.assert_allclose(got, session.run(None, feeds)[0], rtol=1e-4, atol=1e-4)
    assert len(gathers) == 4 * len(shapes), len(gathers)
    assert not grids, grids  # no grid made: each GatherND indexed by its parts


def test_llama_first_calls_past_the_planned_shapes_cut_the_mask_from_the_largest(llama, monkeypatch):
    """Past the shapes planned at load, the causal mask [b, 1, s, s] is proved a corner of itself at larger dims
    (kiln/runtime/shape_corners.py) and cut from its value at the profile's largest shape, which the load's segments
    job computes (views_ahead.segments_job): none of its ~20 steps runs at the call (no GatherND among them), and the
    outputs match onnxruntime (fp32 logits, 1e-4). The previous test (CORNERS off) runs the steps."""
    from kiln.runtime import shape_corners
    from kiln.runtime import shape_function as sf

    exported, path = llama
    monkeypatch.setenv("KILN_PAD_FIRST_CALLS", "0")
    monkeypatch.setattr(first_calls, "PLANS_AHEAD", 4)
    context = kiln.load(str(path)).create_execution_context()
    context.warm_up()
    assert first_calls.primitives_made(120)
    program = context.engine.program
    source = program.shape_function.source
    gathered = [line for line in source.splitlines() if "_gather_grid" in line]
    assert "_corner" in source and len(gathered) == 4 and all(line.startswith(" " * 8) for line in gathered), \
        source  # the mask's gathers only where the cut has no value
    cut = next(v for k, v in program.shape_function.fn.__globals__.items() if k.startswith("_corner"))
    assert cut.dims == (4, 16)  # the profile's largest, made at load
    served = []
    real = shape_corners.CornerCut.__call__

    def counted(self, dims, extents):
        found = real(self, dims, extents)
        if threading.get_ident() == caller:
            served.append(found is not None)
        return found
    caller = threading.get_ident()
    monkeypatch.setattr(shape_corners.CornerCut, "__call__", counted)
    gathers = _counted(monkeypatch, sf._GatherGrid, "__call__")
    session = ort.InferenceSession(str(exported.path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(zlib.crc32(b"llama mask corners"))
    shapes = [(3, 13), (4, 15), (2, 11), (4, 9), (1, 16), (3, 2), (3, 1)]
    for b, s in shapes:
        assert not any(key[0][0] == (b, s) for key in program.shape_plans)  # a shape computed at the call
        feeds = {"input_ids": rng.integers(0, 100, (b, s), dtype=np.int64),
                 "attention_mask": np.ones((b, s), np.int64)}
        feeds = {n: feeds[n] for n in context.engine.input_names}
        got = next(iter(context.run(feeds).values()))
        np.testing.assert_allclose(got, session.run(None, feeds)[0], rtol=1e-4, atol=1e-4)
    assert served == [True] * len(shapes), served
    assert not gathers, gathers  # the mask's steps never ran


def test_llama_views_past_the_planned_shapes_are_packed_as_the_stores_write_them(llama, monkeypatch):
    """Past the shapes planned at load, each of the 5 segments' views is assembled at the call; its plans and calls
    buffer is written by one struct pack (kiln/runtime/view_pack.py) rather than numpy's copy and stores. Each view
    made again the numpy way (the rewrite's pack taken away) is the same byte for byte: plans, call words less the
    buffer's address, exits; so is one whose pack refuses the values (the stores write its ctypes buffer). Outputs
    match onnxruntime (fp32 logits, 1e-4). Without the pack (PACKED off at load) the count of packed views fails."""
    from kiln.runtime import view_pack

    exported, path = llama
    monkeypatch.setenv("KILN_PAD_FIRST_CALLS", "0")
    monkeypatch.setattr(first_calls, "PLANS_AHEAD", 4)
    context = kiln.load(str(path)).create_execution_context()
    context.warm_up()
    assert first_calls.primitives_made(120)
    packed, compared, failures = [], [], []
    caller = threading.get_ident()
    real_into, real_assembled = view_pack.PackedPlans.into, native_views._PlanRewrite._assembled

    def into(self, buffer, base, values):
        done = real_into(self, buffer, base, values)
        if threading.get_ident() == caller:
            packed.append(done)
        return done

    def assembled(self, template, key, values, exits, strides=None):
        try:
            return checked(self, template, key, values, exits, strides)
        except Exception as error:  # (Segment._bind_sizes would take it for sizes the layers cannot bind)
            failures.append((key, repr(error)))
            raise

    def checked(self, template, key, values, exits, strides):
        view = real_assembled(self, template, key, values, exits, strides)
        if threading.get_ident() == caller and self._packed is not None:
            kept = self._packed
            refusing = type("Refusing", (), {"buffer_type": kept.buffer_type, "into": lambda *a: False})()
            try:
                self._packed = None
                stored = real_assembled(self, template, key, values, exits)
                self._packed = refusing  # a value the pack refuses: its buffer written by the stores
                refused = real_assembled(self, template, key, values, exits)
            finally:
                self._packed = kept
            assert type(stored._owned[-1]) is np.ndarray and type(view._owned[-1]) is kept.buffer_type
            b = np.frombuffer(stored._owned[-1], np.int64)
            plans = len(self._image)
            for other in (view, refused):
                a = np.frombuffer(other._owned[-1], np.int64)
                assert a.tobytes()[:plans * 8] == b.tobytes()[:plans * 8], key
                assert (a[plans:] - a.ctypes.data).tolist() == (b[plans:] - b.ctypes.data).tolist(), key
                assert other.exit_shapes == stored.exit_shapes and other.entry_sizes == stored.entry_sizes, key
            compared.append(key)
        return view
    monkeypatch.setattr(view_pack.PackedPlans, "into", into)
    monkeypatch.setattr(native_views._PlanRewrite, "_assembled", assembled)
    session = ort.InferenceSession(str(exported.path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(zlib.crc32(b"llama packed views"))
    shapes = [(3, 13), (4, 15), (2, 11), (1, 16), (3, 1)]
    for b, s in shapes:
        feeds = {"input_ids": rng.integers(0, 100, (b, s), dtype=np.int64),
                 "attention_mask": np.ones((b, s), np.int64)}
        feeds = {n: feeds[n] for n in context.engine.input_names}
        got = next(iter(context.run(feeds).values()))
        np.testing.assert_allclose(got, session.run(None, feeds)[0], rtol=1e-4, atol=1e-4)
    assert not failures, failures
    # (1 run in ~8, one view, 1x16's last segment's, was not assembled on this thread: made by the load's background
    # jobs before the call; so not an exact count: every view assembled here is compared and packed, and without the
    # pack none is compared)
    assert len(compared) >= len(shapes), "\n".join(map(str, compared))
    assert packed == [True] * len(compared), packed
