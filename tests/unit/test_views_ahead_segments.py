"""A loaded CPU engine of several native segments readies each segment's views on the background thread
(issue 10, kiln/runtime/views_ahead.py): the segments' entry sizes at new shapes found on the host through the layers
between them (the shape function, the segments' exit sizes, the glue on meta tensors), an image segment's per-image
check and one-image view made, a token segment's template grown and its walk traced. Its first calls at fresh
batches then bind, check and trace nothing, and match onnxruntime.

The engine: two 3x3 convolutions (an image segment: other batches run as runs of it, the images left past the runs on
its one-image view), a Reshape to [batch, 8, 64] and a Sin (layers outside the segments, as Swin's window partitions
are), then two GEMMs on kiln's kernel (a token segment of 16 rows at the build's batch: views, plan rules)."""

from __future__ import annotations

import threading
import types
import zlib

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from kiln.kernels.cpu import onednn_ahead
from kiln.kernels.cpu import transformer as kernels
from kiln.plan.spec import Profile, ShapeRange
from kiln.runtime import first_calls, native, native_batches, view_trace, views_ahead
from kiln.tactics import traced_rules

from test_views_ahead import calls_racing_the_load  # tests/unit is on the path (pytest prepends it)

pytestmark = pytest.mark.skipif(not kernels.available(), reason="kiln's transformer kernels are not built")

PROFILE = "1x4x8x8,2x4x8x8,8x4x8x8"  # tuned at batch 2: odd batches leave an image past the runs
ORT_TOL = 1e-4  # fp32: two convolutions and two GEMMs summed in other orders than onnxruntime's


def _model(path, rng) -> None:
    """y = Relu(Sin(Reshape(Conv(Relu(Conv(x))), [b, 8, 64])) W1 + b1) W2, x [batch, 4, 8, 8]."""
    def init(name, *shape):
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.3).astype(np.float32), name)

    nodes = [helper.make_node("Conv", ["x", "wc", "bc"], ["c"], pads=[1, 1, 1, 1], kernel_shape=[3, 3]),
             helper.make_node("Relu", ["c"], ["cr"]),
             helper.make_node("Conv", ["cr", "wc2", "bc2"], ["c2"], pads=[1, 1, 1, 1], kernel_shape=[3, 3]),
             helper.make_node("Reshape", ["c2", "tokens"], ["t"]),  # [batch, 8, 64]
             helper.make_node("Sin", ["t"], ["s"]),  # no native kernel: the loop runs it between the segments
             helper.make_node("MatMul", ["s", "w1"], ["h"]), helper.make_node("Add", ["h", "b1"], ["hb"]),
             helper.make_node("Relu", ["hb"], ["r"]), helper.make_node("MatMul", ["r", "w2"], ["y"])]
    graph = helper.make_graph(
        nodes, "segments", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8, 16])],
        [init("wc", 8, 4, 3, 3), init("bc", 8), init("wc2", 8, 8, 3, 3), init("bc2", 8),
         numpy_helper.from_array(np.array([0, 8, 64], np.int64), "tokens"), init("w1", 64, 32), init("b1", 32),
         init("w2", 32, 16)])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(the saved engine's path, onnxruntime's session)."""
    import onnxruntime as ort

    import kiln
    from kiln.tactics import registry

    path = tmp_path_factory.mktemp("views_ahead_segments") / "model.onnx"
    _model(path, np.random.default_rng(zlib.crc32(b"views ahead segments")))
    registry.load_device("cpu")  # the GEMMs on kiln's kernel: plan rules at every row count (a token segment)
    allowed = [name for name, tactic in registry.all_tactics("cpu").items()
               if tactic.op_type != "FusedGemm" or name == "cpu.gemm.kiln_packed"]
    kiln.build(str(path), profiles=[{"x": PROFILE}], tactics=allowed).save(path.with_suffix(".kiln"))
    assert onednn_ahead.AHEAD.wait(timeout=120), "the background thread did not finish"
    return path.with_suffix(".kiln"), ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _segments(engine) -> tuple[native.Segment, native.Segment]:
    images, tokens = engine.program.segments
    assert images._planned_batch == 2 and tokens._planned_batch is None and tokens._views
    assert [s.ctx.op_type for s in engine.program.lean_steps if not isinstance(s.fn, native.Segment)] == \
        ["Reshape", "Sin"]
    return images, tokens


def _x(rng, batch: int) -> dict[str, np.ndarray]:
    return {"x": rng.standard_normal((batch, 4, 8, 8)).astype(np.float32)}


def _first_calls(engine, session, monkeypatch, batches: list[int]) -> tuple[list[str], list[int]]:
    """Run fresh batches on a new context (every new shape binds) against onnxruntime: (what was traced or checked
    at the calls, Segments made at the calls), counted on this thread only (a background job of another test's
    engine in the same process is not these calls' work)."""
    work: list[str] = []
    caller = threading.get_ident()

    def note(what: str, into: list) -> None:
        if threading.get_ident() == caller:
            into.append(what)

    for owner, name in ((traced_rules.TracedRule, "_trace"), (view_trace.ViewTrace, "learn")):
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, real=real, name=name: note(name, work) or real(*a))
    alone = native_batches.computes_each_image_alone
    monkeypatch.setattr(native_batches, "computes_each_image_alone",
                        lambda segment: note("per-image check", work) or alone(segment))
    made: list[str] = []
    real_segment = native.Segment.__init__
    monkeypatch.setattr(native.Segment, "__init__",
                        lambda self, *a, **k: note("segment", made) or real_segment(self, *a, **k))
    context = engine.create_execution_context(pad_first_calls=False)
    rng = np.random.default_rng(zlib.crc32(b"first new batches"))
    for batch in batches:
        feeds = _x(rng, batch)
        np.testing.assert_allclose(context.run(feeds)["y"], session.run(None, feeds)[0], rtol=ORT_TOL, atol=ORT_TOL,
                                   err_msg=f"batch {batch}")
    return work, made


def test_a_loaded_engines_segments_are_ready_and_its_first_new_batches_match_onnxruntime(saved, monkeypatch):
    import kiln

    path, session = saved
    engine = kiln.load(path)
    assert onednn_ahead.AHEAD.wait(timeout=120), "the background thread did not finish"
    images, tokens = _segments(engine)
    # made at load (each fails without the job): the image segment's per-image check and one-image view ...
    assert images._per_image is True and native_batches.one_image_key(images) == ((1, 4, 8, 8),)
    assert images.resized.get(((1, 4, 8, 8),)) is not None
    # ... the token segment's template grown to batch 8 and its walk traced (its entry behind the Reshape and Sin)
    grown = tokens._grown
    assert grown is not None and grown.entry_sizes == [(8, 8, 64)]
    assert grown._rewrite is not None and grown._rewrite._whole.paths > 0
    rng = np.random.default_rng(zlib.crc32(b"batches"))
    batches = [3, 1, 8, *(int(b) for b in rng.permutation(np.arange(4, 8)))]
    work, made = _first_calls(engine, session, monkeypatch, batches)
    assert work == [], f"traced or checked at a call: {work}"
    assert made == [] and tokens._grown is grown  # no template grown, no segment bound at a call


def test_without_the_job_the_first_new_batches_trace_and_check(saved, monkeypatch):
    """The same calls on an engine loaded without the job: the counters above see the work (they can fail)."""
    import kiln

    path, session = saved
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(first_calls, "_segments_job", lambda program, profiles, dtypes: None)
        engine = kiln.load(path)
    assert onednn_ahead.AHEAD.wait(timeout=120)
    images, tokens = _segments(engine)
    assert images._per_image is None and tokens._grown is None
    work, _made = _first_calls(engine, session, monkeypatch, [3, 5])
    assert "per-image check" in work and "_trace" in work


def test_segment_entries_are_the_sizes_the_calls_meet(saved):
    """The entry sizes found on the host at an input shape are those each segment is called at."""
    import kiln

    path, _session = saved
    engine = kiln.load(path)
    assert onednn_ahead.AHEAD.wait(timeout=120)
    met: list[tuple] = []
    real = native.Segment.__call__
    native.Segment.__call__ = lambda self, ctx, *values: met.append(tuple(tuple(v.shape) for v in values)) or \
        real(self, ctx, *values)
    try:
        context = engine.create_execution_context(pad_first_calls=False)
        rng = np.random.default_rng(zlib.crc32(b"entries"))
        for batch in (1, 5, 8):
            met.clear()
            context.run(_x(rng, batch))
            found = list(views_ahead.segment_entries(engine.program, [(batch, 4, 8, 8)], [torch.float32]))
            assert [key for _segment, key in found] == met == [((batch, 4, 8, 8),), ((batch, 8, 64),)]
            assert [segment for segment, _key in found] == engine.program.segments
    finally:
        native.Segment.__call__ = real
    images, tokens = engine.program.segments
    assert views_ahead.exit_sizes(images, ((3, 4, 8, 8),)) == [(3, 8, 8, 8)]  # another batch's runs
    assert views_ahead.exit_sizes(tokens, ((3, 8, 64),)) == [(3, 8, 16)]  # the view's walk by its rules
    template = tokens._grown or tokens
    rewrite, template._rewrite = template._rewrite, None
    try:  # no plan rewrite: the members' NativeSteps say
        assert views_ahead.exit_sizes(tokens, ((5, 8, 64),)) == [(5, 8, 16)]
    finally:
        template._rewrite = rewrite


def test_the_walk_stops_at_a_layer_it_cannot_follow_and_the_job_is_queued_for_a_dynamic_profile(saved, monkeypatch):
    """A layer between segments the walk does not know (the Sin, taken off SAME_SIZES), or whose op reads its input's
    values (the Reshape, made to), ends the walk: the segments past it get nothing ahead. The job: queued for a
    dynamic profile with the inputs' dtypes only."""
    import kiln

    path, _session = saved
    engine = kiln.load(path)
    assert onednn_ahead.AHEAD.wait(timeout=120)
    images, tokens = _segments(engine)
    every = [(images, ((3, 4, 8, 8),)), (tokens, ((3, 8, 64),))]
    assert list(views_ahead.segment_entries(engine.program, [(3, 4, 8, 8)], [torch.float32])) == every
    with monkeypatch.context() as patch:
        patch.setattr(views_ahead, "SAME_SIZES", frozenset())
        assert list(views_ahead.segment_entries(engine.program, [(3, 4, 8, 8)], [torch.float32])) == every[:1]
    with monkeypatch.context() as patch:
        patch.setattr(views_ahead, "lookup", lambda op_type, domain: types.SimpleNamespace(
            fn=lambda ctx, *args, **attributes: torch.from_numpy(args[0].numpy())))  # .numpy() of meta: raises
        patch.setattr(views_ahead, "_reshaped_on_meta", lambda args, attributes: None)  # (the op, not the rule)
        assert list(views_ahead.segment_entries(engine.program, [(3, 4, 8, 8)], [torch.float32])) == every[:1]

    def jobs(profiles, dtypes=(torch.float32,)):
        return [j for j in first_calls.ahead_jobs(engine.program, profiles, list(dtypes) if dtypes else None)
                if j.key[0] == "segment views"]
    assert len(jobs(engine.profiles)) == 1
    assert jobs(engine.profiles, None) == []
    one_shape = [Profile({"x": ShapeRange([2, 4, 8, 8], [2, 4, 8, 8], [2, 4, 8, 8])})]
    assert jobs(one_shape) == []


def test_calls_while_the_segments_are_readied_match_onnxruntime(saved):
    """Calls at new batches right after load on two threads, racing the job (each side under the segment's resize
    lock where it binds): every output matches onnxruntime, and the job fails nowhere."""
    def draw(rng):
        batch = int(rng.integers(1, 9))
        return _x(rng, batch), f"batch {batch}"

    path, session = saved
    calls_racing_the_load(path, session, 6, draw, ORT_TOL)


def test_the_job_imports_nothing_heavy(saved):
    """The walk runs no meta kernel written in Python: torch's elementwise references import torch._dynamo at their
    first call (~2 s of CPU, in a process that only runs engines; the job took 1.35 s of CPU here before the Sin went
    by its sizes). A process of its own: what this one imported is other tests' business."""
    import subprocess
    import sys

    path, _session = saved
    code = ("import sys, kiln; from kiln.kernels.cpu import onednn_ahead; from kiln.runtime import first_calls\n"
            f"engine = kiln.load({str(path)!r}); assert onednn_ahead.AHEAD.wait(timeout=120)\n"
            "assert engine.program.segments[1]._grown is not None  # the job ran\n"
            "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo'))[:3])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout


@pytest.mark.parametrize("op_type, domain, shapes, dtypes_in, attributes, refused", [
    ("Sin", "", [(3, 8, 64)], [torch.float32], {}, None),
    ("Softmax", "", [(3, 4, 8, 8)], [torch.float32], {"axis": -1}, None),
    ("Add", "", [(3, 1, 64), (8, 1)], [torch.float32, torch.float32], {}, [(3, 2, 64), (8, 1)]),
    ("Where", "", [(1, 8, 1), (3, 8, 64), ()], [torch.bool, torch.float32, torch.float32], {},
     [(1, 7, 1), (3, 8, 64), ()]),
    ("Less", "", [(3, 8, 64), (64,)], [torch.float32, torch.float32], {}, [(3, 8, 64), (63,)]),
    ("MatMul", "", [(2, 3, 8, 64), (3, 64, 16)], [torch.float32, torch.float32], {}, [(2, 3, 8, 64), (3, 60, 16)]),
    ("FusedGemm", "kiln", [(3, 8, 64), (32, 64)], [torch.float32, torch.float32], {"activation": "SwiGLU"},
     [(3, 8, 60), (32, 64)]),
    ("Transpose", "", [(3, 8, 64)], [torch.float32], {"perm": [0, 2, 1]}, None),
    ("Reshape", "", [(3, 8, 64), (3,)], [torch.float32, torch.int64], {}, [(3, 8, 60), (3,)]),
])
def test_the_glue_on_meta_has_the_sizes_and_dtypes_of_the_op_on_data(op_type, domain, shapes, dtypes_in, attributes,
                                                                     refused):
    """_on_meta's outputs (an op on meta tensors, or by its inputs' sizes) against the op's own implementation on
    fresh random data of those sizes; sizes that do not fit (`refused`) give None."""
    from kiln.ops.registry import OpContext, lookup

    rng = np.random.default_rng(zlib.crc32(op_type.encode()))

    def made(sizes, meta):
        out = []
        for s, d in zip(sizes, dtypes_in):
            if d == torch.int64:  # a Reshape's target: a value it reads, kept on the host
                out.append(torch.tensor([3, 16, 32] if s == (3,) else [0], dtype=torch.int64))
                continue
            t = torch.from_numpy(rng.standard_normal(s) > 0) if d == torch.bool else \
                torch.from_numpy(rng.standard_normal(s).astype(np.float32))
            out.append(t.to("meta") if meta else t)
        return out

    ctx = OpContext(name=op_type, op_type=op_type, domain=domain, opset=17, num_inputs=len(shapes), num_outputs=1,
                    output_dtypes=[None], capture_names=[])
    step = types.SimpleNamespace(ctx=ctx, outputs=[0], attributes=attributes)
    expected = lookup(op_type, domain).fn(ctx, *made(shapes, False), **attributes)
    got = views_ahead._on_meta(step, made(shapes, True))
    assert got is not None and [(tuple(g.shape), g.dtype) for g in got] == [(tuple(expected.shape), expected.dtype)]
    if refused is not None:
        assert views_ahead._on_meta(step, made(refused, True)) is None


def test_a_reshape_between_segments_is_followed_by_onnxs_rule_as_the_op_gives_it():
    """views_ahead._reshaped_on_meta (the Reshape's sizes by ONNX's rule, not torch's meta decomposition) against the
    op on real tensors, on fresh random sizes and targets (0s copied, one -1, allowzero), and None where the op
    refuses or the data is not a meta tensor."""
    from kiln.ops.registry import lookup
    op = lookup("Reshape", "")
    rng = np.random.default_rng(zlib.crc32(b"reshape on meta"))
    for _ in range(300):
        size = tuple(int(d) for d in rng.integers(0 if rng.random() < 0.1 else 1, 6, int(rng.integers(1, 5))))
        numel = int(np.prod(size))
        target = list(size) if rng.random() < 0.5 else [numel]
        if numel and rng.random() < 0.5:  # another factorization
            target = [d for d in (2, numel // 2) if numel % 2 == 0] if numel % 2 == 0 else [numel, 1]
        target = [(0 if j < len(size) and d == size[j] and rng.random() < 0.3 else d) for j, d in enumerate(target)]
        if rng.random() < 0.4:
            target[int(rng.integers(0, len(target)))] = -1
        if rng.random() < 0.1:
            target[0] += 1  # sizes that do not hold
        allowzero = int(rng.random() < 0.2)
        attributes = {"allowzero": allowzero}
        shape = torch.tensor(target, dtype=torch.int64)
        got = views_ahead._reshaped_on_meta([torch.empty(size, device="meta"), shape], attributes)
        try:
            want = op.fn(None, torch.empty(size), shape, **attributes)
        except (RuntimeError, ValueError):
            assert got is None, (size, target, allowzero)
            continue
        if got is not None:
            assert got.is_meta and tuple(got.shape) == tuple(want.shape), (size, target, allowzero)
    assert views_ahead._reshaped_on_meta([torch.empty(6), torch.tensor([2, 3])], {}) is None  # real data: the op's
