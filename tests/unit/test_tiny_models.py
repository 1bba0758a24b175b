"""Models of one or a few layers (issue 11: they must call as fast as onnxruntime's) take the numpy-in, numpy-out paths
of a one-segment program: a program whose whole work is one native step is a segment of one member
(kiln/runtime/native_runs.py), a lone Relu / Sigmoid / Tanh and a last-axis Softmax are native members
(cpu.<op>.native), a one-form segment's loop is called on its bindings directly (Segment.bare_loop), and a one-layer
program over a symbolic batch runs DirectRuns (no shape values), at other batches on their view or their kept exact
bind. Checked against onnxruntime on fresh random inputs (exact where both compute the same float ops in the same
order), every call's outputs arrays of its own, and the bindings' errors unchanged once the paths are warm."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.errors import BindingError
from kiln.kernels.cpu import softmax as softmax_kernels
from kiln.kernels.cpu import transformer as transformer_kernels
from kiln.runtime import native_batches
from kiln.runtime.direct_run import StaticRun, torch_signature
from kiln.runtime.native import Segment

pytestmark = pytest.mark.skipif(not transformer_kernels.available(), reason="kiln's C kernels are not built")

# fp32 against onnxruntime where the summation orders differ (kiln's packed GEMM / oneDNN's conv against MLAS, over
# K = 27-64 products): a few ulps of the largest output; exp's polynomial (~2 ulp) in the softmax
GEMM_TOL = 1e-6


def _model(nodes: list, x_shape: list, y_shape: list, weights: dict[str, np.ndarray], opset: int = 17) -> bytes:
    graph = helper.make_graph(nodes, "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, y_shape)],
                              [numpy_helper.from_array(v.astype(np.float32), k) for k, v in weights.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10).SerializeToString()


def _models() -> dict[str, tuple[bytes, tuple[int, ...], bool]]:
    """name -> (model, input shape, exact against onnxruntime)."""
    rng = np.random.default_rng(0)
    node = helper.make_node
    return {
        "relu": (_model([node("Relu", ["x"], ["y"])], [1, 16], [1, 16], {}), (1, 16), True),
        "sigmoid": (_model([node("Sigmoid", ["x"], ["y"])], [3, 40], [3, 40], {}), (3, 40), False),
        "tanh": (_model([node("Tanh", ["x"], ["y"])], [2, 9], [2, 9], {}), (2, 9), False),
        "gemm": (_model([node("Gemm", ["x", "w", "b"], ["y"])], [1, 64], [1, 8],
                        {"w": rng.standard_normal((64, 8)), "b": rng.standard_normal(8)}), (1, 64), False),
        "normalise": (_model([node("Add", ["x", "shift"], ["t"]), node("Mul", ["t", "scale"], ["y"])], [1, 32],
                             [1, 32], {"shift": rng.standard_normal(32), "scale": rng.standard_normal(32)}),
                      (1, 32), True),
        "mlp": (_model([node("Gemm", ["x", "w1", "b1"], ["h"], transB=1), node("Relu", ["h"], ["r"]),
                        node("Gemm", ["r", "w2", "b2"], ["z"], transB=1), node("Softmax", ["z"], ["y"], axis=-1)],
                       [8, 32], [8, 4], {"w1": rng.standard_normal((64, 32)), "b1": rng.standard_normal(64),
                                         "w2": 0.3 * rng.standard_normal((4, 64)), "b2": rng.standard_normal(4)}),
                (8, 32), False),
        "conv": (_model([node("Conv", ["x", "w", "b"], ["y"], pads=[1, 1, 1, 1])], [1, 3, 16, 16], [1, 8, 16, 16],
                        {"w": rng.standard_normal((8, 3, 3, 3)), "b": rng.standard_normal(8)}), (1, 3, 16, 16), False),
    }


MODELS = _models()


@pytest.fixture(scope="module")
def built() -> dict[str, tuple[kiln.Engine, ort.InferenceSession]]:
    return {name: (kiln.build(model), ort.InferenceSession(model, providers=["CPUExecutionProvider"]))
            for name, (model, _, _) in MODELS.items()}


def _close(got: np.ndarray, want: np.ndarray, exact: bool) -> None:
    if exact:
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=GEMM_TOL, atol=GEMM_TOL * float(np.abs(want).max()))


@pytest.mark.parametrize("name", list(MODELS))
def test_a_tiny_model_is_one_segment_run_numpy_in_numpy_out(built, name):
    engine, session = built[name]
    _, shape, exact = MODELS[name]
    context = engine.create_execution_context()
    whole = context._whole_segment
    assert isinstance(whole, StaticRun)  # before: no segment (one layer), or a segment and a torch Softmax
    assert len(context.program.run_steps) == 1 and isinstance(context.program.run_steps[0].fn, Segment)
    if whole.segment.chooser is None:  # one form (a segment that may run serially too chooses per run: run_at)
        assert whole.bare is not None
    rng = np.random.default_rng(1)
    feeds = [{"x": rng.standard_normal(shape).astype(np.float32)} for _ in range(4)]
    outputs = [context.run(f)["y"] for f in feeds]
    for f, got in zip(feeds, outputs):  # (every call's outputs its own: the earlier ones still hold their values)
        _close(got, session.run(None, f)[0], exact)
    assert len({id(y) for y in outputs}) == len(outputs)
    y = engine.run(feeds[0])["y"]  # the thread's context takes the same path
    _close(y, session.run(None, feeds[0])[0], exact)


@pytest.mark.parametrize("name", ["relu", "mlp"])
def test_wrong_feeds_still_raise_the_bindings_errors(built, name):
    engine, _ = built[name]
    shape = MODELS[name][1]
    x = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
    for _ in range(3):
        engine.run({"x": x})  # warm
    wrong = (*shape[:-1], shape[-1] + 1)
    with pytest.raises(BindingError, match=r"'x'.*expected"):
        engine.run({"x": np.zeros(wrong, np.float32)})
    with pytest.raises(BindingError, match=r"'x': expected dtype float, given double"):
        engine.run({"x": x.astype(np.float64)})
    # an array the path does not take (Fortran order, read-only) runs the general path with the same outputs
    want = engine.run({"x": x})["y"]
    read_only = x.copy()
    read_only.flags.writeable = False
    np.testing.assert_array_equal(np.asarray(engine.run({"x": read_only})["y"]), want)


def test_a_lone_activation_keeps_nan_and_infinities_as_onnxruntime(built):
    for name in ("relu", "sigmoid", "tanh"):
        engine, session = built[name]
        x = np.random.default_rng(3).standard_normal(MODELS[name][1]).astype(np.float32)
        x.flat[:3] = [np.nan, np.inf, -np.inf]
        np.testing.assert_allclose(engine.run({"x": x})["y"], session.run(None, {"x": x})[0], rtol=GEMM_TOL,
                                   atol=GEMM_TOL)


@pytest.mark.parametrize("size", [(1, 1), (8, 4), (3, 17), (2, 5, 33), (4, 1000)])
def test_the_softmax_kernel_matches_torch(size):
    x = torch.randn(size) * 4
    y = softmax_kernels.Softmax(size)({0: x})
    torch.testing.assert_close(y, torch.softmax(x, -1), rtol=1e-6, atol=1e-7)  # exp's polynomial: ~2 ulp


def test_the_softmax_kernel_gives_nan_where_torch_does():
    x = torch.randn(5, 20)
    x[0, 3] = float("nan")
    x[1, 7] = float("inf")
    x[2, :] = float("-inf")
    x[3, 2] = float("-inf")  # finite elsewhere: exp(-inf) = 0 there
    y, want = softmax_kernels.Softmax((5, 20))({0: x}), torch.softmax(x, -1)
    assert torch.equal(torch.isnan(y), torch.isnan(want))
    torch.testing.assert_close(y[3:], want[3:], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("axis, opset, native", [(-1, 17, True), (1, 17, False), (2, 11, True), (1, 11, False)])
def test_softmax_is_native_along_the_last_axis_only(axis, opset, native):
    """Before opset 13 Softmax normalizes the input coerced to 2-D at `axis`: the last axis's rows only there."""
    model = _model([helper.make_node("Softmax", ["x"], ["y"], axis=axis)], [2, 3, 5], [2, 3, 5], {}, opset=opset)
    engine = kiln.build(model)
    assert (engine.plan.program.steps[-1].tactic == "cpu.softmax.native") == native
    x = np.random.default_rng(4).standard_normal((2, 3, 5)).astype(np.float32)
    want = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(engine.run({"x": x})["y"], want, rtol=GEMM_TOL, atol=GEMM_TOL)


@pytest.fixture(scope="module")
def matmul():
    w = np.random.default_rng(5).standard_normal((64, 16))
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "matmul",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 16])],
                              [numpy_helper.from_array(w.astype(np.float32), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10).SerializeToString()
    return kiln.build(model, profiles=[{"x": "1x64,4x64,32x64"}]), \
        ort.InferenceSession(model, providers=["CPUExecutionProvider"])


def _signature(x: np.ndarray) -> tuple:
    return torch_signature([x])


def test_one_layer_over_a_symbolic_batch_runs_directly_at_its_batches(matmul, monkeypatch):
    """A program without shape values is one call of its segment's loop at the tuned batch, and, once its batch plan
    settles (binds off here: the view, as the batch's calls run it), at the others; onnxruntime's outputs at each."""
    monkeypatch.setenv("KILN_BIND_BATCHES", "0")
    engine, session = matmul
    # (no first call padded into a batch bound before: which batches an earlier test bound is not this test's)
    context = engine.create_execution_context(pad_first_calls=False)
    assert context._direct is not None and context.program.shape_plans is None
    rng = np.random.default_rng(6)
    for batch in (4, 1, 7, 32, 4, 7, 1, 32, 4, 1, 7, 32):
        x = rng.standard_normal((batch, 64)).astype(np.float32)
        np.testing.assert_allclose(context.run({"x": x})["y"], session.run(None, {"x": x})[0], rtol=GEMM_TOL,
                                   atol=GEMM_TOL * 30)
    for batch in (4, 1, 7, 32):
        record = context._direct.find(_signature(np.zeros((batch, 64), np.float32)))
        assert record is not None, batch
        if batch == 4:
            assert record.view() is context._direct.segment
    outputs = [context.run({"x": x})["y"] for x in [rng.standard_normal((7, 64)).astype(np.float32)] * 2]
    assert outputs[0] is not outputs[1]
    with pytest.raises(BindingError, match="outside every optimization profile"):
        context.run({"x": np.zeros((33, 64), np.float32)})
    with pytest.raises(BindingError, match=r"'x': expected dtype float, given double"):
        context.run({"x": np.zeros((4, 64), np.float64)})


def test_a_batch_bound_exactly_and_kept_runs_directly_on_its_bind(matmul, monkeypatch):
    monkeypatch.setattr(native_batches, "_clock", lambda: 0.0)  # the trial ties: the exact bind is kept
    engine, session = matmul
    context = engine.create_execution_context(pad_first_calls=False)
    assert native_batches.BINDS.wait(60)
    rng = np.random.default_rng(7)
    signature = _signature(np.zeros((12, 64), np.float32))
    segment = context._direct.segment
    record = None
    for _ in range(40):
        x = rng.standard_normal((12, 64)).astype(np.float32)
        np.testing.assert_allclose(context.run({"x": x})["y"], session.run(None, {"x": x})[0], rtol=GEMM_TOL,
                                   atol=GEMM_TOL * 30)
        assert native_batches.BINDS.wait(60)
        plan = segment._batch_plans.get(((12, 64),))
        if plan is not None and plan.state == "bound":
            record = context._direct.find(signature)
            if record is not None:
                break
    assert record is not None and record.batch_bound and record.view() is plan.bound
    x = rng.standard_normal((12, 64)).astype(np.float32)
    np.testing.assert_allclose(context.run({"x": x})["y"], session.run(None, {"x": x})[0], rtol=GEMM_TOL,
                               atol=GEMM_TOL * 30)
    native_batches._let_go(plan, "evicted")  # its bind let go: the record goes with it (the calls' path again)
    assert context._direct.find(signature) is None
    np.testing.assert_allclose(context.run({"x": x})["y"], session.run(None, {"x": x})[0], rtol=GEMM_TOL,
                               atol=GEMM_TOL * 30)


@pytest.mark.parametrize("state, view, binds, expected", [
    ("bound", True, True, "bound"), ("runs kept", True, True, "view"), ("failed", True, True, "view"),
    ("runs", True, True, "pending"), ("binding", True, True, "pending"), ("trial", True, True, "pending"),
    ("runs", True, False, "view"), ("runs kept", False, True, None), ("bound", False, True, "bound")])
def test_direct_view_follows_the_batch_plans_state(state, view, binds, expected, monkeypatch):
    monkeypatch.setenv("KILN_BIND_BATCHES", "1" if binds else "0")
    bound = object()
    plan = native_batches.BatchPlan(0, 0, [], [], [], [], [], None, ((3, 8),) if view else None)
    plan.state, plan.bound = state, bound if state in ("bound", "trial") else None
    found = native_batches.direct_view(plan)
    assert found is {"bound": bound, "view": native_batches.ON_VIEW, "pending": native_batches.PENDING,
                     None: None}[expected]
