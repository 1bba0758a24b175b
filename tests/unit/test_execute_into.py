"""execute() with bound outputs on the CPU writes them in place (ExecutionContext._outputs_into, Program.run's `into`):
the native segment or kiln GEMM that computes a bound output writes the caller's tensor instead of a fresh one that
execute() then copied (the fresh one's pages faulted in at each new larger shape, ~2 µs a page: a decoder's logits,
bench/results/first-shape-2026-12-07.md). Outputs it cannot write (a view of another value, an op without `into`,
another dtype's op, a bound output sharing memory with a bound input) are copied as before.

Oracles: run()'s outputs at the same inputs (bit for bit) and onnxruntime; "in place" is seen as no copy into the
bound tensor (torch.Tensor.copy_ recorded where its destination is a bound output's memory), and the same test with
the in-place writes off copies them (so the count can fail).
"""

from __future__ import annotations

import zlib

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.runtime.context import ExecutionContext

ort = pytest.importorskip("onnxruntime")

# shapes of x [b, s, 16]: the profile's opt (planned), new ones inside it, its largest and smallest
SHAPES = [(2, 8), (3, 5), (4, 16), (1, 1), (3, 11), (2, 8)]


def _model() -> onnx.ModelProto:
    """y = x + relu(x W1 + b1) W2 + b2 and z = y W3 (one native segment of two exits: y is also read by z's layer);
    flat_z = Reshape(z) (a view of z), top = ArgMax(y) (int64, an op outside the segment)."""
    rng = np.random.default_rng(3)
    weights = [numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32) / 4, name) for name, shape in
               (("W1", (16, 32)), ("B1", (32,)), ("W2", (32, 16)), ("B2", (16,)), ("W3", (16, 16)))]
    weights.append(numpy_helper.from_array(np.array([0, -1], np.int64), "flat"))
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h1"]), helper.make_node("Add", ["h1", "B1"], ["h2"]),
             helper.make_node("Relu", ["h2"], ["a1"]), helper.make_node("MatMul", ["a1", "W2"], ["h3"]),
             helper.make_node("Add", ["h3", "B2"], ["h4"]), helper.make_node("Add", ["h4", "x"], ["y"]),
             helper.make_node("MatMul", ["y", "W3"], ["z"]), helper.make_node("Reshape", ["z", "flat"], ["flat_z"]),
             helper.make_node("ArgMax", ["y"], ["top"], axis=-1, keepdims=0)]
    info = helper.make_tensor_value_info
    outputs = [info("y", TensorProto.FLOAT, ["b", "s", 16]), info("z", TensorProto.FLOAT, ["b", "s", 16]),
               info("flat_z", TensorProto.FLOAT, ["b", None]), info("top", TensorProto.INT64, ["b", "s"])]
    graph = helper.make_graph(nodes, "kinds", [info("x", TensorProto.FLOAT, ["b", "s", 16])], outputs, weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


@pytest.fixture(scope="module")
def built():
    model = _model()
    engine = kiln.build(model, profiles=[{"x": "1x1x16,2x8x16,4x16x16"}])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return engine, session


def _copies_into(monkeypatch, tensors: dict[str, torch.Tensor]) -> list[str]:
    """Names of `tensors` that torch.Tensor.copy_ writes from now on (by destination memory)."""
    copied = []
    real = torch.Tensor.copy_
    where = {t.data_ptr(): name for name, t in tensors.items()}

    def copy_(self, *a, **k):
        if self.data_ptr() in where:
            copied.append(where[self.data_ptr()])
        return real(self, *a, **k)
    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    return copied


def _check_every_shape(engine, session, monkeypatch, bind: list[str], pad_first_calls: bool) -> list[str]:
    """execute() with x and the outputs `bind` bound, at each of SHAPES, against run() (bit for bit) and onnxruntime;
    the names execute() copied into (each shape's)."""
    context = engine.create_execution_context(pad_first_calls=pad_first_calls)
    rng = np.random.default_rng(zlib.crc32(repr(bind).encode()))
    copied = []
    for b, s in SHAPES:
        x = rng.standard_normal((b, s, 16)).astype(np.float32)
        want = context.run({"x": x})
        outputs = {name: torch.full(want[name].shape, -7, dtype=torch.from_numpy(want[name]).dtype) for name in bind}
        context.set_tensor_address("x", torch.from_numpy(x.copy()))
        for name, tensor in outputs.items():
            context.set_tensor_address(name, tensor)
        with monkeypatch.context() as patch:
            copies = _copies_into(patch, outputs)
            got = context.execute()
        copied += copies
        for name, tensor in outputs.items():
            assert got[name] is tensor
        for name, value in zip(engine.output_names, session.run(None, {"x": x})):
            np.testing.assert_array_equal(np.asarray(got[name]), want[name], err_msg=f"{name} at {b}x{s}")
            if value.dtype == np.float32:
                np.testing.assert_allclose(want[name], value, rtol=1e-4, atol=1e-4, err_msg=f"{name} at {b}x{s}")
        np.testing.assert_array_equal(want["top"], want["y"].argmax(-1))  # (near-ties of fp32 sums: not onnxruntime's)
    return copied


@pytest.mark.parametrize("pad_first_calls", [False, True], ids=["every shape binds", "first calls padded"])
def test_bound_segment_exits_are_written_in_place_and_equal_runs_outputs(built, monkeypatch, pad_first_calls):
    """y and z are the segment's exits (z also read by the Reshape after it, y by the ArgMax): written where the
    caller bound them, at the planned shape, views and the profile's ends; flat_z (a view of z) and top (int64,
    outside the segment) are copied. Where a first call runs padded inside a bound shape (its outputs crops of the
    host's), they are copied too, and equal all the same."""
    engine, session = built
    copied = _check_every_shape(engine, session, monkeypatch, ["y", "z", "flat_z", "top"], pad_first_calls)
    assert copied.count("flat_z") == copied.count("top") == len(SHAPES)
    if not pad_first_calls:
        assert "y" not in copied and "z" not in copied, copied
    else:
        assert copied.count("y") == copied.count("z") < len(SHAPES)  # the padded first calls' alone


def test_without_the_in_place_writes_every_bound_output_is_copied(built, monkeypatch):
    """The check above can fail: with ExecutionContext._outputs_into answering nothing, y and z are copied too."""
    engine, session = built
    monkeypatch.setattr(ExecutionContext, "_outputs_into", lambda self: None)
    copied = _check_every_shape(engine, session, monkeypatch, ["y", "z"], False)
    assert copied.count("y") == copied.count("z") == len(SHAPES)


def test_a_bound_output_sharing_memory_with_a_bound_input_is_copied_after_the_run(built):
    """y bound to x's own tensor (the segment reads x to its last layer): written after the run, from the input's
    values as they were; an output overlapping another bound output is copied too."""
    engine, session = built
    context = engine.create_execution_context(pad_first_calls=False)
    rng = np.random.default_rng(zlib.crc32(b"shared memory"))
    for b, s in ((3, 5), (2, 8)):
        x = rng.standard_normal((b, s, 16)).astype(np.float32)
        want = context.run({"x": x})
        shared = torch.from_numpy(x.copy())
        context.set_tensor_address("x", shared)
        context.set_tensor_address("y", shared)
        both = torch.empty(2 * b * s * 16)  # z and flat_z over one buffer: the same bytes, bound twice
        context.set_tensor_address("z", both[:b * s * 16].view(b, s, 16))
        context.set_tensor_address("flat_z", both[:b * s * 16].view(b, s * 16))
        assert context._outputs_into() is None
        got = context.execute()
        np.testing.assert_array_equal(shared.numpy(), want["y"])
        np.testing.assert_array_equal(got["z"].numpy(), want["z"])
        np.testing.assert_array_equal(got["flat_z"].numpy(), want["flat_z"])


def test_a_bound_output_of_another_shape_still_errors_and_names_it(built):
    engine, _ = built
    context = engine.create_execution_context(pad_first_calls=False)
    context.set_tensor_address("x", torch.randn(3, 5, 16))
    context.set_tensor_address("y", torch.zeros(2, 8, 16))  # the opt's shape, not this run's
    with pytest.raises(kiln.BindingError, match=r"output 'y': the run produced shape \[3, 5, 16\], the bound tensor "
                                                r"is \[2, 8, 16\]"):
        context.execute()


def test_runs_returned_arrays_are_never_written_by_a_later_run_or_execute(built):
    """run()'s outputs are the caller's: later runs at the same and other shapes, and execute() with bound outputs
    at the same shape, leave them as they were."""
    engine, _ = built
    context = engine.create_execution_context(pad_first_calls=False)
    rng = np.random.default_rng(zlib.crc32(b"kept outputs"))
    kept = []
    for b, s in ((3, 5), (3, 5), (2, 8), (4, 16), (3, 5)):
        x = rng.standard_normal((b, s, 16)).astype(np.float32)
        out = context.run({"x": x})
        kept.append((out, {name: value.copy() for name, value in out.items()}))
        context.set_tensor_address("x", torch.from_numpy(x))
        context.set_tensor_address("y", torch.empty(b, s, 16))
        context.set_tensor_address("z", torch.empty(b, s, 16))
        context.execute()
    for out, copy in kept:
        for name, value in out.items():
            np.testing.assert_array_equal(value, copy[name])
