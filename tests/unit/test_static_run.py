"""A fixed-shape CPU program that is one native segment reading the program's constants runs numpy in, numpy out
(kiln/runtime/direct_run.py StaticRun, the context's _run_static path): onnxruntime's outputs and the torch path's bit
for bit on fresh random inputs, every call's outputs arrays of its own, and the checks the binding makes still there
once the path is warm (a wrong dtype or shape raises BindingError naming the input, expected vs given; an array the
path does not take runs the general path)."""

from __future__ import annotations

import threading

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.errors import BindingError
from kiln.runtime.direct_run import StaticRun

ORT_TOL = 1e-5  # fp32 against onnxruntime: an add, a LayerNorm over 32 and a 32-deep GEMM


def _embedding_model() -> bytes:
    """Token ids [2, 8] -> embedding + positions -> LayerNorm -> MatMul + residual: one native segment whose entries
    are the ids and a constant (the positions)."""
    rng = np.random.default_rng(0)
    weights = {"table": rng.standard_normal((50, 32)), "pos": rng.standard_normal((1, 8, 32)),
               "scale": 1 + 0.1 * rng.standard_normal(32), "bias": 0.1 * rng.standard_normal(32),
               "w": 0.2 * rng.standard_normal((32, 32))}
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["e"]),
         helper.make_node("Add", ["e", "pos"], ["a"]),
         helper.make_node("LayerNormalization", ["a", "scale", "bias"], ["n"], axis=-1, epsilon=1e-5),
         helper.make_node("MatMul", ["n", "w"], ["m"]),
         helper.make_node("Add", ["m", "a"], ["y"])], "embedding",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8, 32])],
        [numpy_helper.from_array(v.astype(np.float32), k) for k, v in weights.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10).SerializeToString()


@pytest.fixture(scope="module")
def embedding():
    model = _embedding_model()
    return kiln.build(model), ort.InferenceSession(model, providers=["CPUExecutionProvider"])


def _ids(rng) -> np.ndarray:
    return rng.integers(0, 50, (2, 8), dtype=np.int64)


def test_a_segment_reading_constants_runs_numpy_in_numpy_out(embedding):
    engine, session = embedding
    context = engine.create_execution_context()
    whole = context._whole_segment
    assert isinstance(whole, StaticRun)  # None before: the segment's entries were not exactly the inputs
    assert [k for _, k in whole.moving] == [0] and whole.keep  # the ids move; constants (the positions) are fixed
    assert all(a for p, a in enumerate(whole.addresses) if p != whole.moving[0][0])
    rng = np.random.default_rng(1)
    feeds = [{"ids": _ids(rng)} for _ in range(3)]
    outputs = [context.run(f)["y"] for f in feeds]
    kept = [y.copy() for y in outputs]
    context.run({"ids": _ids(rng)})
    for f, y, was in zip(feeds, outputs, kept):
        assert isinstance(y, np.ndarray) and y.shape == (2, 8, 32) and y.dtype == np.float32
        np.testing.assert_array_equal(y, was)  # later calls wrote arrays of their own
        np.testing.assert_allclose(y, session.run(None, f)[0], rtol=ORT_TOL, atol=ORT_TOL)
    assert not any(np.shares_memory(a, b) for k, a in enumerate(outputs) for b in outputs[k + 1:])
    context._whole_segment = None  # the torch path (Program.run, the segment's torch call) agrees bit for bit
    np.testing.assert_array_equal(context.run(feeds[0])["y"], outputs[0])
    context._whole_segment = whole


def test_engine_run_takes_it(embedding, monkeypatch):
    engine, session = embedding
    ran = []
    run = StaticRun.run
    monkeypatch.setattr(StaticRun, "run", lambda self, arrays: ran.append(1) or run(self, arrays))
    ids = _ids(np.random.default_rng(2))
    y = engine.run({"ids": ids})["y"]
    assert ran == [1]
    np.testing.assert_allclose(y, session.run(None, {"ids": ids})[0], rtol=ORT_TOL, atol=ORT_TOL)


def test_a_wrong_input_still_raises_once_warm(embedding):
    engine, _ = embedding
    context = engine.create_execution_context()
    rng = np.random.default_rng(3)
    for _ in range(3):
        context.run({"ids": _ids(rng)})
    with pytest.raises(BindingError, match=r"'ids'.*expected dtype int64, given int32"):
        context.run({"ids": _ids(rng).astype(np.int32)})
    with pytest.raises(BindingError, match=r"'ids'.*expected shape int64\[2, 8\], given \[2, 9\]"):
        context.run({"ids": rng.integers(0, 50, (2, 9), dtype=np.int64)})
    with pytest.raises(BindingError, match=r"'ids'.*expected rank 2"):
        context.run({"ids": rng.integers(0, 50, (16,), dtype=np.int64)})


def test_arrays_it_does_not_take_run_the_general_path(embedding, monkeypatch):
    """A Fortran-ordered array, a read-only one and a strided view: _run_static hands them to the general path (its
    conversions), with the same results."""
    engine, session = embedding
    context = engine.create_execution_context()
    ran = []
    run = StaticRun.run
    monkeypatch.setattr(StaticRun, "run", lambda self, arrays: ran.append(1) or run(self, arrays))
    ids = _ids(np.random.default_rng(4))
    want = context.run({"ids": ids})["y"]
    assert ran == [1]
    readonly = ids.copy()
    readonly.flags.writeable = False
    wide = np.zeros((2, 16), np.int64)
    wide[:, ::2] = ids
    for other in (np.asfortranarray(ids), readonly, wide[:, ::2]):
        np.testing.assert_array_equal(context.run({"ids": other})["y"], want)
    assert ran == [1]


def test_threads_each_on_their_own_context(embedding):
    """engine.run from two threads at once (a context each, Engine.run): every output onnxruntime's for its own
    input, none written by the other thread's runs."""
    engine, session = embedding
    results: dict[int, list] = {0: [], 1: []}
    start = threading.Barrier(2)

    def work(k: int) -> None:
        rng = np.random.default_rng(10 + k)
        start.wait()
        for _ in range(150):
            ids = _ids(rng)
            results[k].append((ids, engine.run({"ids": ids})["y"]))

    threads = [threading.Thread(target=work, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k in (0, 1):
        assert len(results[k]) == 150
        for ids, y in results[k]:
            np.testing.assert_allclose(y, session.run(None, {"ids": ids})[0], rtol=ORT_TOL, atol=ORT_TOL)
    assert not any(np.shares_memory(y, z) for (_, y), (_, z) in zip(results[0], results[1]))
