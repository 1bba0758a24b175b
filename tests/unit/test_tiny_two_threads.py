"""A model too small for a second thread calls at 2 threads as at 1 (issue 11): a native segment whose estimated work
is under native_members.TINY_WORK runs its serial form alone, with no form chooser (Segment.only_form), and an
execution context whose every call is one such segment skips the OpenMP governor's begin / end
(cpu_paths._tiny_calls). Larger models keep both: resnet_tiny's segments choose their form per run and its context
governs OpenMP's wait. Outputs checked against onnxruntime on fresh random inputs; every test builds its own engines
at OpenMP's count of 2 (a serial form is bound only on more than one thread), so each passes alone and in any order."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln import zoo
from kiln.kernels.cpu import transformer as transformer_kernels
from kiln.kernels.cpu.form_choice import PARALLEL, SERIAL
from kiln.runtime.native_members import TINY_WORK, estimated_work

pytestmark = pytest.mark.skipif(not transformer_kernels.available(), reason="kiln's C kernels are not built")

TOL = 1e-6  # of the largest output: fp32 sums in another order than onnxruntime's (K = 27-72 products)


def _model(nodes: list, x_shape: list, y_shape: list, weights: dict[str, np.ndarray]) -> bytes:
    graph = helper.make_graph(nodes, "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, y_shape)],
                              [numpy_helper.from_array(v.astype(np.float32), k) for k, v in weights.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10).SerializeToString()


def _conv(channels_in: int, channels_out: int, size: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    return _model([helper.make_node("Conv", ["x", "w", "b"], ["y"], pads=[1, 1, 1, 1])],
                  [1, channels_in, size, size], [1, channels_out, size, size],
                  {"w": rng.standard_normal((channels_out, channels_in, 3, 3)), "b": rng.standard_normal(channels_out)})


def _close(got: np.ndarray, want: np.ndarray) -> None:
    np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL * float(np.abs(want).max()))


def _check_against_onnxruntime(engine: kiln.Engine | kiln.ExecutionContext, model: bytes, shapes: list[tuple[int, ...]],
                               seed: int) -> None:
    """`engine`'s runs (an engine's or one context's) against onnxruntime at each shape, on fresh inputs."""
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(seed)
    for shape in shapes:
        for _ in range(3):  # past the first calls (a chooser's warm-up, a batch's plan)
            x = rng.standard_normal(shape).astype(np.float32)
            _close(engine.run({"x": x})["y"], session.run(None, {"x": x})[0])


def test_a_tiny_convolution_runs_its_serial_form_without_chooser_or_governor(two_threads):
    model = _conv(3, 8, 32, seed=11)  # 221K multiply-adds: a oneDNN convolution small enough for a serial form
    engine = kiln.build(model)
    context = engine.create_execution_context()
    segment = context._whole_segment.segment
    assert segment.work >= 8 * 32 * 32 * 27 and segment.tiny()  # an upper estimate of its multiply-adds
    assert segment.only_form == SERIAL and segment.chooser is None
    assert context._whole_segment.bare is not None and segment.bare_loop(True).serial  # the bare loop, one thread
    assert context._omp is None
    _check_against_onnxruntime(engine, model, [(1, 3, 32, 32)], seed=12)
    rng = np.random.default_rng(13)
    x = rng.standard_normal((1, 3, 32, 32)).astype(np.float32)
    want = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    _close(context.run({"x": x})["y"], want)
    _close(context.run({"x": np.require(x, requirements="F")})["y"], want)  # (the general path: Program.run)
    assert torch.get_num_threads() == 2  # the serial runs' count of 1 restored (one_openmp_thread)


def test_a_convolution_past_the_bound_keeps_its_chooser_and_the_governor(two_threads):
    model = _conv(8, 32, 32, seed=21)  # 2.4M multiply-adds: small (a serial form) but not tiny
    engine = kiln.build(model)
    context = engine.create_execution_context()
    segment = context._whole_segment.segment
    assert segment.work >= TINY_WORK and not segment.tiny()
    assert segment.only_form == PARALLEL and segment.chooser is not None
    assert context._omp is not None
    _check_against_onnxruntime(context, model, [(1, 8, 32, 32)], seed=22)
    assert min(segment.chooser.runs.values()) >= 1  # both forms ran (the chooser's first runs take each in turn)


@pytest.mark.parametrize("name", ["relu", "gemm"])
def test_tiny_models_of_kilns_own_kernels_skip_the_governor(two_threads, name):
    rng = np.random.default_rng(31)
    node = helper.make_node
    model, shape = {
        "relu": (_model([node("Relu", ["x"], ["y"])], [1, 16], [1, 16], {}), (1, 16)),
        "gemm": (_model([node("Gemm", ["x", "w", "b"], ["y"])], [1, 64], [1, 8],
                        {"w": rng.standard_normal((64, 8)), "b": rng.standard_normal(8)}), (1, 64)),
    }[name]
    engine = kiln.build(model)
    context = engine.create_execution_context()
    segment = context._whole_segment.segment
    assert segment.only_form == PARALLEL and segment.chooser is None and segment.tiny()  # one form: kiln's C
    assert context._omp is None
    _check_against_onnxruntime(engine, model, [shape], seed=32)


def test_a_tiny_matmul_over_a_symbolic_batch_skips_the_governor_up_to_its_profiles_largest(two_threads):
    rng = np.random.default_rng(41)
    matmul = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "tiny",
                               [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64])],
                               [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 16])],
                               [numpy_helper.from_array(rng.standard_normal((64, 16)).astype(np.float32), "w")])
    model = helper.make_model(matmul, opset_imports=[helper.make_opsetid("", 17)], ir_version=10).SerializeToString()
    engine = kiln.build(model, profiles=[{"x": "1x64,4x64,32x64"}])
    assert engine.create_execution_context()._omp is None  # 32 rows x 64 x 16: still tiny
    _check_against_onnxruntime(engine, model, [(4, 64), (1, 64), (7, 64), (32, 64)], seed=42)
    wide = kiln.build(model, profiles=[{"x": "1x64,4x64,4096x64"}])  # its largest batch: 4M multiply-adds
    assert wide.create_execution_context()._omp is not None
    _check_against_onnxruntime(wide, model, [(4, 64), (300, 64)], seed=43)


def test_resnet_tiny_keeps_its_choosers_and_the_governor(two_threads):
    exported = zoo.export("resnet_tiny")
    engine = kiln.build(str(exported.path))
    context = engine.create_execution_context()
    segments = engine.program.segments
    assert segments and not all(s.tiny() for s in segments)
    assert any(s.chooser is not None for s in segments)
    assert context._omp is not None
    session = ort.InferenceSession(str(exported.path), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    for seed in (1, 2):
        feeds = zoo.random_inputs("resnet_tiny", exported, seed=seed)
        got = engine.run(feeds)
        for n, want in zip(names, session.run(None, feeds)):
            np.testing.assert_allclose(got[n], want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))


def test_the_estimate_bounds_a_layers_multiply_adds():
    """estimated_work from sizes alone: a Gemm's rows x K x N (its weights per output column) and what it moves."""

    class Native:
        input_size, output_size, reads = (5, 64), (5, 8), None

    class Member:
        inputs = [7, 0, 1]

    weights = {0: torch.zeros(64, 8), 1: torch.zeros(8)}
    work = estimated_work([Member()], [Native()], weights)
    assert 5 * 64 * 8 <= work <= 5 * 64 * 8 + 5 * 8 + 5 * 64 + 5 * 8 * 2
