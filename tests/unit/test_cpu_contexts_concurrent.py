"""Contexts of one CPU engine run at once on threads of their own, and answer as onnxruntime does (issue 14: two
BERT-base contexts on two threads answered up to 4.4 off). The cause: layers of one shape share a oneDNN primitive
at a row count (kiln/kernels/cpu/onednn_primitives.py _SHARED_PRIMITIVES), and a primitive handle's scratchpad is
written by each of its runs, so two runs of one handle at once (two layers, two threads) corrupted each other. Each
binding now runs a handle of its own (onednn.own_primitive); these tests fail with the shared handles back.

Each context also runs its own lane of the engine (kiln/runtime/engine.py CpuLane): its native segments planned into an
activation arena of its own, so two contexts compute at once instead of taking turns under one arena's lock; a context
paused in the middle of a run while another runs whole tells the two apart (it fails with one arena: the other waits,
or, without the lock, writes over the paused run's values). Contexts at once answer as one context alone and as
onnxruntime on a CNN, BERT with a padding mask at several shapes and an LSTM."""

import itertools
import threading
import time

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln import zoo
from kiln.builder import autotune
from kiln.kernels.cpu import onednn, onednn_primitives

pytestmark = pytest.mark.skipif(not onednn.available(), reason="libdnnl.so.3 cannot be loaded")

WIDTH, SEQ, LAYERS = 768, 16, 4  # 768x768 weights: past OTHER_ROWS_WEIGHT, so other row counts run on inner products
SIZES = (1, 3, 5, 2, 7, 4, 8, 6)  # batches a context runs in turn ("different": each context from another one)
ROUNDS, SECONDS = 24, 20.0  # each thread's rounds at most, and the time they may take
FP32_TOLERANCE = 1e-4  # of the largest output value: the same sums in other blockings (768 products a dot)
# contexts at once against one alone: the same kernels, but each segment picks its small layers' form (serial or on
# OpenMP's count) by its own timings, and a first call may run padded in a bound shape: other blockings of fp32 sums
ALONE_TOLERANCE = 1e-5


def _at_once(work, count: int) -> None:
    """work(k) on `count` threads at once; a thread's exception is raised here, after they all end."""
    raised: list[BaseException] = []

    def guarded(k: int) -> None:
        try:
            work(k)
        except BaseException as e:  # noqa: BLE001  re-raised below, in the test's thread
            raised.append(e)

    threads = [threading.Thread(target=guarded, args=(k,)) for k in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if raised:
        raise raised[0]


def test_two_layers_sharing_an_inner_product_run_at_once():
    """The smallest form of the race: two layers of one shape at one row count (one primitive, shared), each called
    on a thread of its own; each answer against torch's."""
    rows = 96
    layers = []
    for _ in range(2):
        w, b = torch.randn(WIDTH, WIDTH) / WIDTH ** 0.5, torch.randn(WIDTH)
        tuned = onednn_primitives.InnerProduct(w, b, 512, None, False, True)
        layers.append((onednn_primitives.InnerProduct(w, b, rows, None, False, True, weight_from=tuned), w, b))
    assert layers[0][0]._made.primitive is layers[1][0]._made.primitive  # what made the race possible
    problems: list[str] = []
    together = threading.Barrier(2, timeout=SECONDS)  # each call starts with the other's: they overlap

    def work(k: int) -> None:
        layer, w, b = layers[k]
        for _ in range(200):
            x = torch.randn(rows, WIDTH)
            together.wait()
            off = float((layer(x) - torch.addmm(b, x, w.t())).abs().max())
            if off > 1e-3:  # values ~1: 1e-3 is 10x the fp32 rounding of 768 products
                problems.append(f"layer {k}: {off:.3g} off")

    _at_once(work, 2)
    assert not problems, problems[:4]


def _stack() -> bytes:
    """x [B, SEQ, WIDTH] through LAYERS linear layers of one shape (MatMul + bias): FusedGemms, a Relu between two
    (fused), a Sin (no native step) between the pairs: native segments of two layers each (the layers of two
    segments at once: two locks), or every layer on its own without segments."""
    rng = np.random.default_rng()
    nodes, weights, value = [], [], "x"
    for i in range(LAYERS):
        weights += [numpy_helper.from_array((rng.standard_normal((WIDTH, WIDTH)) / WIDTH ** 0.5).astype(np.float32),
                                            f"w{i}"),
                    numpy_helper.from_array(rng.standard_normal(WIDTH).astype(np.float32), f"b{i}")]
        nodes += [helper.make_node("MatMul", [value, f"w{i}"], [f"m{i}"]),
                  helper.make_node("Add", [f"m{i}", f"b{i}"], [f"a{i}"])]
        value = f"a{i}"
        if i < LAYERS - 1:
            nodes.append(helper.make_node("Relu" if i % 2 == 0 else "Sin", [value], [f"r{i}"]))
            value = f"r{i}"
    nodes.append(helper.make_node("Identity", [value], ["y"]))
    graph = helper.make_graph(nodes, "stack", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", SEQ, WIDTH])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", SEQ, WIDTH])], weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


@pytest.fixture(scope="module", params=["segments", "layer by layer"])
def stack(request):
    model = _stack()
    with pytest.MonkeyPatch.context() as patch:
        # oneDNN's GEMM on every layer whatever one timing sample says (on a busy machine the op's own
        # implementation won a layer now and then, and its pair made no segment): this is about the runtime
        patch.setattr(autotune, "NATIVE_CREDIT_MS", 1e3)
        if request.param != "segments":
            patch.setenv("KILN_NATIVE_SEGMENTS", "0")
        engine = kiln.build(model, tactics=["cpu.gemm.onednn_direct"], tuning_runs=1,
                            profiles=[{"x": f"1x{SEQ}x{WIDTH},4x{SEQ}x{WIDTH},8x{SEQ}x{WIDTH}"}])
    assert len(engine.program.segments) == (2 if request.param == "segments" else 0), \
        [(s.op_type, s.tactic) for s in engine.program.spec.steps]
    return engine, ort.InferenceSession(model, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("contexts", [2, 4])
@pytest.mark.parametrize("shapes", ["same", "different"])
def test_contexts_of_one_engine_run_at_once(stack, contexts, shapes):
    """Contexts on threads of their own, each running batches at the same shape as the others or at shapes of its
    own (a run at a new shape binds a view while another context runs), every answer against onnxruntime's."""
    engine, session = stack
    assert {s.tactic for s in engine.program.spec.steps if s.op_type == "FusedGemm"} == {"cpu.gemm.onednn_direct"}
    made = [engine.create_execution_context() for _ in range(contexts)]
    # 6 rows: past the profile's opt, where each segment runs views over a template grown for them, each with a lock
    # of its own (kiln/runtime/native.py): the two segments' layers at once, at one row count
    batches = [[6] * 4 if shapes == "same" else [SIZES[(k + j) % len(SIZES)] for j in range(len(SIZES))]
               for k in range(contexts)]
    problems: list[str] = []
    runs = [0] * contexts
    deadline = time.monotonic() + SECONDS
    together = threading.Barrier(contexts, timeout=SECONDS)  # each run starts with the others': they overlap

    def work(k: int) -> None:
        rng = np.random.default_rng(k)
        for _ in range(ROUNDS):
            for batch in batches[k]:
                x = rng.standard_normal((batch, SEQ, WIDTH), dtype=np.float32)
                want = session.run(None, {"x": x})[0]
                try:
                    together.wait()
                except threading.BrokenBarrierError:  # another context's time is up
                    return
                got = made[k].run({"x": x})["y"]
                off = float(np.abs(got - want).max())
                if off > FP32_TOLERANCE * max(1.0, float(np.abs(want).max())):
                    problems.append(f"context {k}, batch {batch}: {off:.3g} off")
                runs[k] += 1
            if time.monotonic() > deadline:
                together.abort()
                return

    _at_once(work, contexts)
    assert not problems, f"{len(problems)} wrong answers of {sum(runs)}: {problems[:4]}"
    assert min(runs) >= 4, runs  # every context ran while the others did


def _segmented_stack() -> tuple[kiln.Engine, ort.InferenceSession]:
    model = _stack()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(autotune, "NATIVE_CREDIT_MS", 1e3)  # oneDNN's GEMM on every layer (as the stack fixture)
        engine = kiln.build(model, tactics=["cpu.gemm.onednn_direct"], tuning_runs=1,
                            profiles=[{"x": f"1x{SEQ}x{WIDTH},4x{SEQ}x{WIDTH},8x{SEQ}x{WIDTH}"}])
    assert len(engine.program.segments) == 2
    return engine, ort.InferenceSession(model, providers=["CPUExecutionProvider"])


def _paused(segment, at_call: int, paused: threading.Event, resume: threading.Event) -> None:
    """The segment's runs through its Python loop (one oneDNN execute a layer), each pausing before call `at_call`
    until `resume` is set (`paused` set meanwhile): the values the calls before it wrote wait in its arena."""
    execute, calls = segment._execute, itertools.count()
    segment._c = None  # the loop in Python: a hook between two layers

    def pausing(primitive, stream, nargs, args):
        if next(calls) == at_call:
            paused.set()
            if not resume.wait(SECONDS):
                raise TimeoutError("no other context ran while this one was paused mid-run")
        return execute(primitive, stream, nargs, args)

    segment._execute = pausing


def test_a_context_computes_while_another_is_paused_mid_run():
    """Context A paused between the two layers of its first segment (layer 1's output in its arena, read by layer
    2 after the pause) while context B runs whole at other inputs: B answers, then A does, both as onnxruntime. With
    one arena for both, B waits for A's lock and A's pause times out; without the lock, B writes over A's values."""
    engine, session = _segmented_stack()
    a, b = engine.create_execution_context(), engine.create_execution_context()
    assert a.program.segments[0] is not b.program.segments[0]
    paused, resumed = threading.Event(), threading.Event()
    _paused(a.program.segments[0], 1, paused, resumed)
    rng = np.random.default_rng()
    xa, xb = (rng.standard_normal((4, SEQ, WIDTH), dtype=np.float32) for _ in range(2))  # 4: the tuned batch
    got: dict[str, np.ndarray] = {}

    def run_a(_k: int) -> None:
        got["a"] = a.run({"x": xa})["y"]

    def run_b() -> None:
        assert paused.wait(SECONDS), "context A never reached its pause"
        try:
            got["b"] = b.run({"x": xb})["y"]
        finally:
            resumed.set()

    thread = threading.Thread(target=run_b)
    thread.start()
    try:
        _at_once(run_a, 1)
    finally:
        resumed.set()
        thread.join()
    for name, x in (("a", xa), ("b", xb)):
        want = session.run(None, {"x": x})[0]
        off = float(np.abs(got[name] - want).max())
        assert off <= FP32_TOLERANCE * max(1.0, float(np.abs(want).max())), f"context {name}: {off:.3g} off"


@pytest.fixture(scope="module")
def resnet():
    exported = zoo.export("resnet_tiny", dynamic=True)
    engine = kiln.build(str(exported.path), profiles=[{"pixel_values": "1x3x64x64,2x3x64x64,6x3x64x64"}])
    return engine, ort.InferenceSession(str(exported.path), providers=["CPUExecutionProvider"])


def test_each_context_plans_into_an_arena_of_its_own(resnet):
    """Two living contexts: the first runs the engine's program, the second a copy whose segments are bound anew
    over an arena of their own at the same offsets; layers (packed weights) and shape plans are the engine's. A
    freed context's lane goes to the next context made."""
    engine, _ = resnet
    a, b = engine.create_execution_context(), engine.create_execution_context()
    assert a.program is engine.program and b.program is not engine.program
    assert b.program.steps is engine.program.steps and b.program.shape_plans is engine.program.shape_plans
    assert b.program.segments and len(b.program.segments) == len(engine.program.segments)
    for ours, theirs in zip(engine.program.segments, b.program.segments):
        assert theirs is not ours and [m.fn for m in theirs.members] == [m.fn for m in ours.members]
        base, own = ours.buffers[0].data_ptr(), theirs.buffers[0].data_ptr()
        assert own != base and theirs.arena is not ours.arena and theirs._lock is not ours._lock
        assert {s: at - own for s, at in theirs._address.items()} == {s: at - base for s, at in ours._address.items()}
        assert theirs.planned_bytes == ours.planned_bytes
    copy = b.program
    del b
    assert engine.create_execution_context().program is copy  # its lane given back, lent again


def _bert_feeds(rng, batch: int, seq: int) -> dict[str, np.ndarray]:
    mask = np.ones((batch, seq), np.int64)
    for row in range(batch):
        mask[row, rng.integers(1, seq + 1):] = 0  # each row keeps a real token
    return {"input_ids": rng.integers(0, 1024, (batch, seq), dtype=np.int64), "attention_mask": mask}


BERT_SHAPES = ((1, 7), (2, 16), (4, 32), (3, 48), (4, 48), (2, 5))  # inside bert_tiny's profile 1x1..4x48


@pytest.fixture(scope="module", params=["resnet_tiny", "bert_tiny", "lstm_forecaster"])
def model(request, resnet, dynamic_bert_tiny):
    """(engine, onnxruntime session, draw(rng, k) -> the feeds of a context's k-th run): a CNN at batches of its
    profile, BERT with a padding mask at shapes of its profile, an LSTM forecaster (kiln's fused loop, one segment)."""
    if request.param == "resnet_tiny":
        engine, session = resnet
        return engine, session, lambda rng, k: {
            "pixel_values": rng.standard_normal(((1, 2, 6, 3)[k % 4], 3, 64, 64), dtype=np.float32)}
    if request.param == "bert_tiny":
        engine, session = dynamic_bert_tiny
        return engine, session, lambda rng, k: _bert_feeds(rng, *BERT_SHAPES[k % len(BERT_SHAPES)])
    exported = zoo.export("lstm_forecaster")
    with pytest.MonkeyPatch.context() as patch:  # kiln's fused LSTM loop, whatever one timing sample says
        patch.setattr(autotune, "measure", lambda fns, device, runs=10, **_: {
            k: 0.0 if k == "cpu.lstm.fused" else 1.0 for k in fns})
        engine = kiln.build(str(exported.path), timing_cache=None)
    assert engine.program.segments
    shape = next(iter(zoo.random_inputs("lstm_forecaster", exported, seed=0).values())).shape
    return engine, ort.InferenceSession(str(exported.path), providers=["CPUExecutionProvider"]), \
        lambda rng, k: {"x": rng.standard_normal(shape, dtype=np.float32)}


@pytest.mark.parametrize("contexts", [2, 3])
def test_contexts_at_once_agree_with_one_alone_and_with_onnxruntime(model, contexts):
    """`contexts` contexts on threads of their own, each run starting with the others' (a barrier), each on fresh
    inputs (its own shapes, rotating); afterwards every request again on one context alone: the answers agree with
    it and with onnxruntime's."""
    engine, session, draw = model
    made = [engine.create_execution_context() for _ in range(contexts)]
    assert len({id(c.program) for c in made}) == contexts  # a lane (arena) each
    rounds = 6
    requests = [[draw(np.random.default_rng(), k + j) for j in range(rounds)] for k in range(contexts)]
    answers: list[list] = [[] for _ in range(contexts)]
    together = threading.Barrier(contexts, timeout=4 * SECONDS)

    def work(k: int) -> None:
        for feeds in requests[k]:
            together.wait()
            answers[k].append(next(iter(made[k].run(feeds).values())))

    _at_once(work, contexts)
    del made
    alone = engine.create_execution_context()
    for k in range(contexts):
        for j, feeds in enumerate(requests[k]):
            want = session.run(None, feeds)[0]
            scale = max(1.0, float(np.abs(want).max()))
            got, single = answers[k][j], next(iter(alone.run(feeds).values()))
            shape = [list(v.shape) for v in feeds.values()]
            assert float(np.abs(got - single).max()) <= ALONE_TOLERANCE * scale, f"context {k}, run {j} {shape}: alone"
            assert float(np.abs(got - want).max()) <= FP32_TOLERANCE * scale, f"context {k}, run {j} {shape}: ort"
