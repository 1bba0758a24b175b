"""Contexts of one CPU engine run at once on threads of their own, and answer as onnxruntime does (issue 14: two
BERT-base contexts on two threads answered up to 4.4 off). The cause: layers of one shape share a oneDNN primitive
at a row count (kiln/kernels/cpu/onednn_primitives.py _SHARED_PRIMITIVES), and a primitive handle's scratchpad is
written by each of its runs, so two runs of one handle at once (two layers, two threads) corrupted each other. Each
binding now runs a handle of its own (onednn.own_primitive); these tests fail with the shared handles back."""

import threading
import time

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.builder import autotune
from kiln.kernels.cpu import onednn, onednn_primitives

pytestmark = pytest.mark.skipif(not onednn.available(), reason="libdnnl.so.3 cannot be loaded")

WIDTH, SEQ, LAYERS = 768, 16, 4  # 768x768 weights: past OTHER_ROWS_WEIGHT, so other row counts run on inner products
SIZES = (1, 3, 5, 2, 7, 4, 8, 6)  # batches a context runs in turn ("different": each context from another one)
ROUNDS, SECONDS = 24, 20.0  # each thread's rounds at most, and the time they may take
FP32_TOLERANCE = 1e-4  # of the largest output value: the same sums in other blockings (768 products a dot)


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
