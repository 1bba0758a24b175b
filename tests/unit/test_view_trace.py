"""A native segment's view at new sizes from its template's traced walk (kiln/runtime/view_trace.py): on a traced path
the view is one call of a generated function of the entry dims, and it must be the view the walk makes at the same
sizes, byte for byte (plans, exits, call arrays), and run as it does, bit for bit, and as onnxruntime does, at fresh
random shapes; off every traced path (sizes whose checks or rules go another way) the walk binds, as before.

The engine: an MLP block with a residual and a LayerNorm ([batch, seq, 64], symbolic batch and sequence), every
member of its one segment a kiln kernel with a plan rule (two of kiln's packed GEMMs, kiln's LayerNorm), as
BERT-base's are. bert_tiny's segment has a Reshape alias (its key mask [B, S] -> [B, 1, 1, S]): its size rule
(cpu.alias.Reshape's plan_at) puts bert_tiny's views on a traced walk too, checked the same way; the rule itself
against the op at random sizes."""

from __future__ import annotations

import ctypes
import gc
import weakref

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.kernels.cpu import native_loop, onednn_ahead
from kiln.kernels.cpu import transformer as kernels
from kiln.kernels.cpu.form_choice import PARALLEL
from kiln.runtime import first_calls, view_trace


def _ahead_done() -> None:
    """Wait for the jobs a dynamic engine queues at build/load (first_calls.ahead_jobs: the plan rewrites). This
    file's engines are built without the load's view job (first_calls._trace_job, which grows the segment's template
    to the profile's largest sizes and traces walks in the background; tests/unit/test_views_ahead.py has it): these
    tests check views traced at the calls against the build's template, which must not grow under them."""
    assert onednn_ahead.AHEAD.wait(timeout=120), "the background jobs did not finish"


ORT_TOL = 1e-4  # kiln against onnxruntime: fp32, two GEMMs and a LayerNorm summed in other orders

pytestmark = pytest.mark.skipif(not kernels.available(), reason="kiln's transformer kernels are not built")


def _mlp(path, rng) -> None:
    """y = LayerNorm(x + Relu(x W1 + b1) W2 + b2), x [batch, seq, 64]."""
    def init(name, *shape):
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.1).astype(np.float32), name)

    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Add", ["h", "b1"], ["hb"]),
             helper.make_node("Relu", ["hb"], ["r"]), helper.make_node("MatMul", ["r", "w2"], ["o"]),
             helper.make_node("Add", ["o", "b2"], ["ob"]), helper.make_node("Add", ["ob", "x"], ["res"]),
             helper.make_node("LayerNormalization", ["res", "g", "beta"], ["y"], axis=-1, epsilon=1e-5)]
    graph = helper.make_graph(
        nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", 64])],
        [init("w1", 64, 128), init("b1", 128), init("w2", 128, 64), init("b2", 64), init("g", 64), init("beta", 64)])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    import onnxruntime as ort

    path = tmp_path_factory.mktemp("view_trace") / "mlp.onnx"
    _mlp(path, np.random.default_rng(0))
    return _mlp_engine(path), ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _mlp_engine(path):
    """The MLP's engine (its own segment: a test that changes the segment's state builds one of these instead of
    taking the module's)."""
    import kiln

    from kiln.tactics import registry

    # its GEMMs on kiln's (plan rules at every row count): a search under load that put one on oneDNN's inner
    # product left the segment with no plan rewrite (a CI run, 2 vCPUs), and these tests are about traced paths
    registry.load_device("cpu")
    allowed = [name for name, tactic in registry.all_tactics("cpu").items()
               if tactic.op_type != "FusedGemm" or name == "cpu.gemm.kiln_packed"]
    with pytest.MonkeyPatch.context() as patch:  # views traced at the calls, from the build's template
        patch.setattr(first_calls, "_trace_job", lambda program, profiles: None)
        engine = kiln.build(str(path), profiles=[{"x": "1x1x64,2x8x64,4x16x64"}], tactics=allowed)
    _ahead_done()
    return engine


def _x(rng, batch, seq):
    return {"x": rng.standard_normal((batch, seq, 64)).astype(np.float32)}


def _segment(engine):
    (segment,) = engine.program.segments
    return segment


def _answers_counted(monkeypatch) -> list[bool]:
    """Whether each view asked of a traced walk found a path (ViewTrace.__call__ wrapped)."""
    answered: list[bool] = []
    call = view_trace.ViewTrace.__call__

    def counting(self, key):
        found = call(self, key)
        answered.append(found is not None)
        return found

    monkeypatch.setattr(view_trace.ViewTrace, "__call__", counting)
    return answered


def _traced_views_are_the_walks(segment, monkeypatch) -> int:
    """Each view of `segment` on a traced path made again from the trace and by the walk: exits, entries, calls and
    plans byte for byte. Returns how many were compared."""
    template = segment._grown or segment
    rewrite = template._rewrite
    compared = 0
    for key, view in list(segment.resized.items()):
        if view is None or view.template is not template or rewrite._whole(key) is None:
            continue
        traced = rewrite.view(template, key)
        with monkeypatch.context() as walking:
            walking.setattr(view_trace.ViewTrace, "__call__", lambda self, key: None)
            walked = rewrite.view(template, key)
        assert traced is not None and walked is not None, key
        assert traced.exit_shapes == walked.exit_shapes and traced.entry_sizes == walked.entry_sizes, key
        assert _calls(traced) == _calls(walked), key
        plans_traced, plans_walked = traced._owned[0], walked._owned[0]  # the plans, then the calls' objects
        plans = rewrite._image.nbytes  # (the objects: addresses in each buffer, compared by _calls)
        assert ctypes.string_at(_address(plans_traced), plans) == \
            ctypes.string_at(_address(plans_walked), plans), f"{key}: the plans differ"
        compared += 1
    return compared


def _address(buffer) -> int:
    """A view's plan buffer's address: a numpy array, or a ctypes array (view_pack.PackedPlans.buffer_type)."""
    return np.frombuffer(buffer, np.int64).ctypes.data


def _calls(view) -> list[tuple[int, int]]:
    """(function, plan offset in the view's plan buffer) of each call of its loop."""
    c = view._c[PARALLEL]
    base = _address(view._owned[0])
    return [(c[1][i], c[8][i] - base) for i in range(c[7])]


def test_views_on_a_traced_walk_are_the_walks_byte_for_byte_and_runs_match_onnxruntime(mlp, monkeypatch):
    engine, session = mlp
    context = engine.create_execution_context(pad_first_calls=False)  # every new shape binds
    rng = np.random.default_rng()
    segment = _segment(engine)
    answered = _answers_counted(monkeypatch)
    context.run(_x(rng, 4, 16))  # the largest sizes first: the template grows to them once, the views fit it after
    shapes = {(int(rng.integers(1, 5)), int(rng.integers(1, 17))) for _ in range(14)} - {(4, 16)}
    for batch, seq in sorted(shapes, key=lambda _: rng.random()):
        feeds = _x(rng, batch, seq)
        got = context.run(feeds)["y"]
        np.testing.assert_allclose(got, session.run(None, feeds)[0], rtol=ORT_TOL, atol=ORT_TOL,
                                   err_msg=f"{batch}x{seq}")
    assert (segment._grown or segment)._rewrite._whole.paths > 0, "no path of the walk was traced"
    assert sum(answered) >= len(shapes) // 2, f"{sum(answered)} of {len(answered)} views from the traced walk"
    compared = _traced_views_are_the_walks(segment, monkeypatch)
    assert compared >= 3, f"{compared} views compared"


def test_a_traced_walks_runs_are_the_walks_bit_for_bit(mlp, monkeypatch):
    engine, session = mlp
    context = engine.create_execution_context(pad_first_calls=False)
    rng = np.random.default_rng()
    context.run(_x(rng, 4, 16))
    feeds = [_x(rng, int(rng.integers(1, 5)), int(rng.integers(1, 17))) for _ in range(8)]
    traced = [context.run(f)["y"] for f in feeds]
    segment = _segment(engine)
    assert (segment._grown or segment)._rewrite._whole.paths > 0
    segment.resized.clear()
    monkeypatch.setattr(view_trace.ViewTrace, "__call__", lambda self, key: None)  # the walk at every view
    for f, ours in zip(feeds, traced):
        theirs = context.run(f)["y"]
        np.testing.assert_array_equal(ours, theirs)
        np.testing.assert_allclose(ours, session.run(None, f)[0], rtol=ORT_TOL, atol=ORT_TOL)


def test_sizes_off_every_traced_path_are_walked_and_a_walk_it_cannot_follow_is_never_traced(mlp, monkeypatch):
    engine, _ = mlp
    context = engine.create_execution_context(pad_first_calls=False)
    rng = np.random.default_rng()
    context.run(_x(rng, 4, 16))  # the template grows to the largest sizes (its plan rewrite made at the next view)
    context.run(_x(rng, 3, 5))
    segment = _segment(engine)
    template = segment._grown or segment  # read after both calls: run first in a worker, (4, 16) made the grown
    rewrite = template._rewrite  # template, whose rewrite only the call at (3, 5) made (a CI run, -n 2)
    key = next(reversed(segment.resized))
    assert rewrite._whole.paths > 0
    # a fresh trace whose every path is refused: views are still made (by the walk), none from a trace
    monkeypatch.setattr(rewrite, "_whole", view_trace.ViewTrace(template.entries, rewrite._whole._ranks))
    walk = view_trace.ViewTrace._walk
    monkeypatch.setattr(view_trace.ViewTrace, "_walk", lambda self, rewrite, dims: None)
    assert rewrite.view(template, key) is not None and rewrite._whole.paths == 0
    assert rewrite._whole._forms.traceable  # refused at these sizes, not for good
    # a member the trace cannot follow (no rule): never traced again
    monkeypatch.setattr(view_trace.ViewTrace, "_walk", walk)
    members = list(rewrite._members)
    monkeypatch.setattr(rewrite, "_members", [(None, *m[1:]) if k == 0 else m for k, m in enumerate(members)])
    assert rewrite._whole.learn(rewrite, key, [0] * rewrite._values, [(3, 5, 64)] * len(rewrite._exits)) is False
    assert not rewrite._whole._forms.traceable


def test_a_rewrite_with_traced_paths_dies_with_its_last_reference(tmp_path):
    """Its ViewTrace does not hold it back (no cycle): a template let go frees its rewrite at once, collector off.
    On an engine of its own: the module's would be left without the rewrite its other tests read."""
    _mlp(tmp_path / "mlp.onnx", np.random.default_rng(0))
    engine = _mlp_engine(tmp_path / "mlp.onnx")
    context = engine.create_execution_context(pad_first_calls=False)
    rng = np.random.default_rng()
    for batch, seq in ((4, 16), (2, 3), (3, 5)):
        context.run(_x(rng, batch, seq))
    segment = _segment(engine)
    template = segment._grown or segment
    assert template._rewrite._whole.paths > 0
    held = weakref.ref(template._rewrite)
    gc.disable()
    try:
        template._rewrite = None
        assert held() is None, "a reference cycle holds the rewrite"
    finally:
        gc.enable()


def test_one_int32_store_writes_the_plans_as_the_two_stores_did():
    """_PlanRewrite._plans writes a view's plan fields by one int32 gather and scatter (_int32_stores): each 64-bit
    field both halves of its value, each 32-bit field the low half (what an int64 -> int32 cast keeps). Against the
    two stores it replaced (a 64-bit and a 32-bit one, numpy's own casts), with values past int32's range, shared
    values (mirrors) and a remap, on fresh random layouts; it fails if a half is swapped or a field missed."""
    from kiln.runtime.native_views import _int32_stores

    rng = np.random.default_rng(7)
    for _ in range(100):
        image = rng.integers(-2**62, 2**62, int(rng.integers(4, 40)))  # the template's plans, int64 words
        where64 = rng.choice(len(image), int(rng.integers(1, len(image) // 2)), replace=False)
        taken = set((2 * where64).tolist()) | set((2 * where64 + 1).tolist())
        free = np.array([w for w in range(2 * len(image)) if w not in taken])
        where32 = rng.choice(free, int(rng.integers(0, min(6, len(free)))), replace=False)
        count = int(rng.integers(1, 20))
        remap = rng.permutation(count + 3)[:count]  # the walk's value of each field's value index
        value64, value32 = rng.integers(0, count, len(where64)), rng.integers(0, count, len(where32))
        values = [int(v) for v in rng.integers(-2**63, 2**63 - 1, count + 3, dtype=np.int64)]
        expected = image.copy()
        flat = np.array(values, np.int64)
        expected[where64] = flat[remap[value64]]
        expected.view(np.int32)[where32] = flat[remap[value32]]
        got = image.copy()
        where, halves = _int32_stores(where64, value64, where32, value32, remap)
        got.view(np.int32)[where] = np.array(values, np.int64).view(np.int32)[halves]
        assert np.array_equal(got, expected)


@pytest.fixture(scope="module")
def tiny_on_kiln_gemms():
    """bert_tiny (symbolic batch and sequence, profile 1x1..4x32..4x48 as tests/conftest.py's dynamic_bert_tiny) with
    its linear layers on kiln's GEMM (the other FusedGemm tactics left out of the search: a layer tuned on oneDNN
    binds its own rows, and such a walk is never traced), and an onnxruntime session of the same file. Its one
    segment: kiln's kernels, each with a plan rule, and the key mask's Reshape alias."""
    import onnxruntime as ort

    import kiln
    from kiln import zoo
    from kiln.tactics import registry

    registry.load_device("cpu")
    allowed = [name for name, tactic in registry.all_tactics("cpu").items()
               if tactic.op_type != "FusedGemm" or name == "cpu.gemm.kiln_packed"]
    exported = zoo.export("bert_tiny", dynamic=True)
    with pytest.MonkeyPatch.context() as patch:  # views traced at the calls, from the build's template
        patch.setattr(first_calls, "_trace_job", lambda program, profiles: None)
        engine = kiln.build(str(exported.path), profiles=[{"input_ids": "1x1,4x32,4x48"}], tactics=allowed)
    _ahead_done()
    return engine, ort.InferenceSession(str(exported.path), providers=["CPUExecutionProvider"])


def _tiny_feeds(rng, batch, seq):
    mask = np.ones((batch, seq), np.int64)
    for row in range(batch):
        mask[row, rng.integers(1, seq + 1):] = 0
    return {"input_ids": rng.integers(0, 1024, (batch, seq), dtype=np.int64), "attention_mask": mask}


def test_bert_tinys_views_with_a_reshape_alias_are_traced_and_are_the_walks(tiny_on_kiln_gemms, monkeypatch):
    """The alias's size rule makes every member bert_tiny's walk evaluates one with a rule: its views come from a
    traced walk (before the rule, never: the alias was evaluated by making its NativeStep), byte for byte the
    walk's, their runs bit for bit the walk's and within ORT_TOL of onnxruntime, at fresh shapes."""
    engine, session = tiny_on_kiln_gemms
    (segment,) = engine.program.segments
    template = segment._grown or segment
    aliases = [k for k, native in enumerate(template._natives) if native.alias]
    assert aliases, "bert_tiny's segment has no Reshape alias (the key mask's): this test checks nothing"
    context = engine.create_execution_context(pad_first_calls=False)  # every new shape binds
    rng = np.random.default_rng()
    answered = _answers_counted(monkeypatch)
    context.run(_tiny_feeds(rng, 4, 48))  # the largest first: the views fit the template after
    shapes = sorted({(int(rng.integers(1, 5)), int(rng.integers(2, 49))) for _ in range(12)} - {(4, 48)},
                    key=lambda _: rng.random())
    feeds = [_tiny_feeds(rng, batch, seq) for batch, seq in shapes]
    traced = []
    for f in feeds:
        traced.append(context.run(f))
        for got, want in zip(traced[-1].values(), session.run(None, f)):
            np.testing.assert_allclose(got, want, rtol=ORT_TOL, atol=ORT_TOL, err_msg=str(f["input_ids"].shape))
    template = segment._grown or segment
    rewrite = template._rewrite
    assert all(rewrite._members[k][0] is not None for k in aliases), "an alias without its size rule"
    assert rewrite._whole.paths > 0, "no path of bert_tiny's walk was traced"
    assert sum(answered) >= len(shapes) // 2, f"{sum(answered)} of {len(answered)} views from the traced walk"
    assert _traced_views_are_the_walks(segment, monkeypatch) >= 3
    segment.resized.clear()
    monkeypatch.setattr(view_trace.ViewTrace, "__call__", lambda self, key: None)  # the walk at every view
    for f, ours in zip(feeds, traced):
        for name, theirs in context.run(f).items():
            np.testing.assert_array_equal(ours[name], theirs)


@pytest.fixture(scope="module")
def tiny_on_onednn():
    """bert_tiny as tiny_on_kiln_gemms (profile 1x1..2x32..4x48), its linear layers on oneDNN (cpu.gemm.onednn_direct,
    the only FusedGemm tactic left in the search: what bert_tiny's default build chose for 4 of them): each runs its
    tuned 64 rows on an inner product, every other row count of this profile on kiln's GEMM (OtherRows). Its
    template is the build's (no test of the module grows it: test_a_grown_templates_... builds its own)."""
    return _tiny_on_onednn()


def _tiny_on_onednn():
    import onnxruntime as ort

    import kiln
    from kiln import zoo
    from kiln.tactics import registry

    registry.load_device("cpu")
    allowed = [name for name, tactic in registry.all_tactics("cpu").items()
               if tactic.op_type != "FusedGemm" or name == "cpu.gemm.onednn_direct"]
    exported = zoo.export("bert_tiny", dynamic=True)
    with pytest.MonkeyPatch.context() as patch:  # views traced at the calls, from the build's template
        patch.setattr(first_calls, "_trace_job", lambda program, profiles: None)
        engine = kiln.build(str(exported.path), profiles=[{"input_ids": "1x1,2x32,4x48"}], tactics=allowed)
    _ahead_done()
    return engine, ort.InferenceSession(str(exported.path), providers=["CPUExecutionProvider"])


def _runs_match(context, session, feeds) -> list[dict]:
    """Each feed's outputs, checked against onnxruntime within ORT_TOL."""
    outputs = []
    for f in feeds:
        outputs.append(context.run(f))
        for got, want in zip(outputs[-1].values(), session.run(None, f)):
            np.testing.assert_allclose(got, want, rtol=ORT_TOL, atol=ORT_TOL, err_msg=str(f["input_ids"].shape))
    return outputs


def _same_runs_bound_member_by_member(segment, context, feeds, ours, monkeypatch) -> None:
    """`feeds` run again with every view bound member by member (each layer's own BoundRows or primitive, replanned
    or bound anew, as before _PlanRewrite), bit for bit `ours`."""
    from kiln.runtime.native_views import _PlanRewrite

    with monkeypatch.context() as binding:
        binding.setattr(_PlanRewrite, "view", lambda self, template, key: None)
        binding.setattr(view_trace.ViewTrace, "__call__", lambda self, key: None)
        segment.resized.clear()
        for f, mine in zip(feeds, ours):
            for name, theirs in context.run(f).items():
                np.testing.assert_array_equal(mine[name], theirs, err_msg=f"bound, {f['input_ids'].shape}")


def _on_onednn(template, view) -> list[bool]:
    """Whether each member with a kiln GEMM plan and oneDNN arguments runs oneDNN's execute in `view`'s loop."""
    execute = native_loop.execute_function()
    call_of = {k: i for i, k in enumerate(template._bound_members)}
    functions = view._c[PARALLEL][1]
    return [functions[call_of[k]] == execute for k in sorted(template._rewrite._switches)]


def test_bert_tinys_oneDNN_layers_views_are_traced_and_run_as_bound_member_by_member(tiny_on_onednn, monkeypatch):
    """A oneDNN linear layer's rows on kiln's GEMM have a plan rule (cpu.gemm.onednn_direct's kiln_rows_at) and a
    kiln GEMM plan of their own in its template's views (_other_kernel_layout): bert_tiny with every linear layer on
    oneDNN has its views from a traced walk (before, never: such a layer was bound member by member at every view),
    byte for byte the walk's; their runs bit for bit the walk's and those of views bound member by member, and within
    ORT_TOL of onnxruntime, at fresh shapes. At 4x16 (the tuned 64 rows) the layers run their inner products."""
    engine, session = tiny_on_onednn
    (segment,) = engine.program.segments
    template = segment._grown or segment
    layers = [k for k, m in enumerate(template.members) if m.ctx.op_type == "FusedGemm"]
    assert layers and all(type(template._natives[k].primitive(False)).__name__ == "InnerProduct" for k in layers), \
        "bert_tiny's linear layers are not oneDNN inner products at the template: this test checks nothing"
    context = engine.create_execution_context(pad_first_calls=False)
    rng = np.random.default_rng()
    answered = _answers_counted(monkeypatch)
    shapes = sorted({(int(rng.integers(1, 3)), int(rng.integers(2, 33))) for _ in range(12)} - {(2, 32)},
                    key=lambda _: rng.random())  # within the template's sizes: no view grows it
    feeds = [_tiny_feeds(rng, batch, seq) for batch, seq in shapes] + [_tiny_feeds(rng, 4, 16)]
    traced = _runs_match(context, session, feeds)
    assert (segment._grown or segment) is template
    rewrite = template._rewrite
    assert all(rewrite._members[k][0] is not None and rewrite._members[k][6] is not None for k in layers), \
        "a oneDNN layer without its kiln-GEMM plan"
    assert rewrite._whole.paths > 0, "no path of bert_tiny's walk was traced"
    assert sum(answered) >= len(shapes) // 2, f"{sum(answered)} of {len(answered)} views from the traced walk"
    for key, view in segment.resized.items():
        on_onednn = _on_onednn(template, view)
        assert on_onednn and (all(on_onednn) if key[0] == (4, 16) else not any(on_onednn)), (key, on_onednn)
    assert _traced_views_are_the_walks(segment, monkeypatch) >= 3
    with monkeypatch.context() as walking:
        walking.setattr(view_trace.ViewTrace, "__call__", lambda self, key: None)  # the walk at every view
        segment.resized.clear()
        for f, ours in zip(feeds, traced):
            for name, theirs in context.run(f).items():
                np.testing.assert_array_equal(ours[name], theirs, err_msg=f"walked, {f['input_ids'].shape}")
    _same_runs_bound_member_by_member(segment, context, feeds, traced, monkeypatch)


def test_a_oneDNN_layers_kiln_gemm_plan_in_a_view_is_the_plan_its_layer_binds_there(tiny_on_onednn):
    """Each oneDNN layer's kiln GEMM plan in a view (its rule's fields written over _other_kernel_layout's plan) is,
    field by field, the plan its layer's BoundRows binds at the view's sizes (a view bound member by member: its
    GemmCall made anew), the memory objects each reads at the same addresses, at fresh shapes."""
    from kiln.kernels.cpu import gemm_native, onednn
    from kiln.runtime import native

    engine, _ = tiny_on_onednn
    (segment,) = engine.program.segments
    context = engine.create_execution_context(pad_first_calls=False)
    rng = np.random.default_rng()
    get_handle = onednn.load().lib.dnnl_memory_get_data_handle

    def address(memory: int | None) -> int | None:
        if not memory:
            return None
        handle = ctypes.c_void_p()
        assert get_handle(ctypes.c_void_p(memory), ctypes.byref(handle)) == 0
        return handle.value

    compared = 0
    for batch, seq in {(int(rng.integers(1, 3)), int(rng.integers(2, 33))) for _ in range(8)} - {(2, 32)}:
        context.run(_tiny_feeds(rng, batch, seq))
        template = segment._grown or segment
        key = next(k for k in segment.resized if k[0] == (batch, seq))
        view = segment.resized[key]
        bound = native._Resized.bound_at(template, segment._natives_at(key).natives)
        call_of = {k: i for i, k in enumerate(template._bound_members)}
        for k in sorted(template._rewrite._switches):
            i = call_of[k]
            ours = gemm_native._Plan.from_address(view._c[PARALLEL][8][i])
            theirs = gemm_native._Plan.from_address(bound._c[PARALLEL][8][i])
            assert view._c[PARALLEL][1][i] == bound._c[PARALLEL][1][i], f"{batch}x{seq}: call {i}'s function"
            for name, _kind in gemm_native._Plan._fields_:
                if name in ("src", "dst", "residual"):  # memory objects of their own, at the same place
                    assert address(getattr(ours, name)) == address(getattr(theirs, name)), (batch, seq, k, name)
                else:
                    assert getattr(ours, name) == getattr(theirs, name), (batch, seq, k, name)
            compared += 1
    assert compared >= 8, f"{compared} plans compared"


def test_a_grown_templates_kiln_gemm_rows_of_oneDNN_layers_are_plans_and_their_tuned_rows_arguments(monkeypatch):
    """Grown to 4x48 (192 rows: the template runs the layers on kiln's GEMM, their plans by the same rule as
    cpu.gemm.kiln_packed's), a view at the tuned 64 rows runs their inner products (the plan rule refuses those rows:
    primitive_at's arguments, the other members' plans written), other views kiln GEMM plans; each run bit for bit
    the view bound member by member and within ORT_TOL of onnxruntime."""
    engine, session = _tiny_on_onednn()  # its own: it grows the template the module's engine keeps at the build's
    (segment,) = engine.program.segments
    context = engine.create_execution_context(pad_first_calls=False)
    rng = np.random.default_rng()
    context.run(_tiny_feeds(rng, 4, 48))
    template = segment._grown or segment
    assert template.entry_sizes[0] == (4, 48), template.entry_sizes
    feeds = [_tiny_feeds(rng, batch, seq) for batch, seq in ((4, 16), (2, 16), (1, 40), (3, 7), (4, 16))]
    ours = _runs_match(context, session, feeds)
    assert template._rewrite._switches, "no member with a kiln GEMM plan and oneDNN arguments: this checks nothing"
    for key, view in segment.resized.items():
        if view.template is template:
            on_onednn = _on_onednn(template, view)
            assert all(on_onednn) if key[0] == (4, 16) else not any(on_onednn), (key, on_onednn)
    _same_runs_bound_member_by_member(segment, context, feeds, ours, monkeypatch)


@pytest.mark.parametrize("op_type, target, attributes", [
    ("Reshape", [0, 1, 1, -1], {}), ("Reshape", [-1, 4], {}), ("Reshape", [0, 0, 2, -1], {}),
    ("Reshape", [0, -1], {}), ("Reshape", [3, 0, -1], {}), ("Reshape", [2, 3, 4], {}),
    ("Reshape", [0, 1, 3, 1], {}), ("Flatten", None, {"axis": 1}), ("Flatten", None, {"axis": -1}),
    ("Flatten", None, {"axis": 0}),
])
def test_an_alias_size_rule_gives_the_ops_sizes_and_refuses_what_it_refuses(op_type, target, attributes):
    """cpu.alias.Reshape / Flatten's plan_at against the alias's own NativeStep (the op on a meta tensor, its
    layout check) at random sizes of ranks 2-4: the same output size, or ValueError where the step refuses; and
    its traced closed forms (TracedRule, as a view asks) the same, path by path."""
    import torch

    from kiln.plan.spec import StepSpec
    from kiln.tactics import registry
    from kiln.tactics.traced_rules import TracedRule

    registry.load_device("cpu")
    rng = np.random.default_rng()
    constants = [None] + ([torch.tensor(target)] if target is not None else [])
    checked = answered = 0
    for rank in [2] * 30 + [3] * 30 + [4] * 30:
        tuned = tuple(int(d) for d in rng.integers(1, 5, rank))
        inputs = ["x", "shape"] if target is not None else ["x"]
        step = StepSpec(op_type, "alias", inputs, ["y"], attributes, tactic=f"cpu.alias.{op_type}",
                        tactic_config={"input_size": list(tuned)})
        try:
            launch = registry.get(f"cpu.alias.{op_type}").prepare(step, constants, torch.device("cpu"))
        except RuntimeError:  # the op refuses the tuned size itself (a build never tunes it there)
            continue
        native = getattr(launch, "native", None)
        if native is None:
            continue  # refused at the tuned size: no segment member
        assert native.plan_at is not None, f"no size rule at {tuned}"
        rule, traced = native.plan_at, TracedRule(native.plan_at)
        checked += 1
        for _ in range(20):
            size = tuple(int(d) for d in rng.integers(1, 5, rank))
            try:
                want = tuple(native.at(size).output_size)
            except (ValueError, RuntimeError):
                with pytest.raises(ValueError):
                    rule(size)
                with pytest.raises(ValueError):
                    traced(size)
                continue
            assert rule(size).output_sizes == (want,), (size, want)
            assert traced(size).output_sizes == (want,) and traced(size).fields == {}, (size, want)
            answered += 1
    assert checked and answered, f"{checked} tuned sizes took the alias, {answered} sizes answered"
