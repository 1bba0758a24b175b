"""A CPU engine's execution contexts run one at a time (Engine.cpu_runs): two BERT-base contexts running at once on
two threads answered up to 4.4 off (bench/two_contexts.py; issue 14's wrong answers under kiln serve with two
instances). The race itself is not yet found; these tests hold the contract that keeps answers right meanwhile."""

import threading
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.runtime.context import ExecutionContext


def _mlp() -> bytes:
    rng = np.random.default_rng()
    w = numpy_helper.from_array(rng.standard_normal((16, 16)).astype(np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])],
                              "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 16])], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def test_two_contexts_of_one_cpu_engine_never_run_at_once(monkeypatch):
    model = _mlp()
    engine = kiln.build(model)
    inside, most, lock = [0], [0], threading.Lock()
    real = ExecutionContext._run

    def counted(self, feeds):
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        time.sleep(0.002)  # long enough for the other thread to enter if nothing stops it
        try:
            return real(self, feeds)
        finally:
            with lock:
                inside[0] -= 1

    monkeypatch.setattr(ExecutionContext, "_run", counted)
    contexts = [engine.create_execution_context() for _ in range(2)]
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng()
    problems = []

    def work(context):
        for _ in range(20):
            x = rng.standard_normal((4, 16), dtype=np.float32)
            got, want = context.run({"x": x})["y"], session.run(None, {"x": x})[0]
            if not np.allclose(got, want, rtol=1e-4, atol=1e-4):
                problems.append(float(np.abs(got - want).max()))

    threads = [threading.Thread(target=work, args=(c,)) for c in contexts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most[0] == 1, f"{most[0]} runs of one CPU engine at once"
    assert not problems, problems


def test_a_context_may_run_inside_its_own_run_on_the_same_thread():
    """The lock is reentrant: execute() runs through run() on the same thread."""
    engine = kiln.build(_mlp())
    context = engine.create_execution_context()
    with engine.cpu_runs:  # held by this thread, as an outer run would
        out = context.run({"x": np.ones((4, 16), np.float32)})["y"]
    assert out.shape == (4, 16)
