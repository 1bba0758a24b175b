"""A new numpy signature's check from the signature alone (kiln/runtime/bindings.py NumpyCheck) against the context's
own check (ExecutionContext._check): on random signatures (dtypes, ranks, fixed and symbolic dims that agree or not,
shapes in and out of each of two overlapping profiles) it answers exactly where _check passes, with the profile
_check selects, and None wherever _check raises; and a context fed a bad signature still raises _check's error."""

from __future__ import annotations

import types

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import kiln
from kiln.errors import BindingError
from kiln.plan.spec import Binding, Profile, ShapeRange
from kiln.runtime.bindings import NumpyCheck
from kiln.runtime.context import ExecutionContext

BINDINGS = [Binding("ids", "int64", ["batch", "seq"]), Binding("mask", "int64", ["batch", "seq"]),
            Binding("scale", "float", [1, "seq", 4])]
PROFILES = [Profile({"ids": ShapeRange([1, 1], [2, 8], [2, 16]), "mask": ShapeRange([1, 1], [2, 8], [2, 16]),
                     "scale": ShapeRange([1, 1, 4], [1, 8, 4], [1, 16, 4])}),
            Profile({"ids": ShapeRange([1, 8], [4, 32], [8, 64]), "mask": ShapeRange([1, 8], [4, 32], [8, 64]),
                     "scale": ShapeRange([1, 8, 4], [1, 32, 4], [1, 64, 4])})]


def _checked_profile(feeds: dict) -> int | None:
    """ExecutionContext._check's answer on `feeds`: the profile it selects, or None where it raises."""
    engine = types.SimpleNamespace(inputs=BINDINGS, profiles=PROFILES)
    context = types.SimpleNamespace(engine=engine, profile=-1)
    context._select_profile = lambda f: ExecutionContext._select_profile(context, f)
    try:
        ExecutionContext._check(context, dict(feeds))
    except BindingError:
        return None
    return context.profile


def _random_feeds(rng) -> dict:
    batch, seq = int(rng.integers(1, 10)), int(rng.integers(1, 70))
    shapes = {"ids": [batch, seq], "mask": [batch, seq], "scale": [1, seq, 4]}
    name = str(rng.choice(list(shapes)))
    what = rng.integers(0, 5)  # one input made wrong now and then: a dim off, a rank, a dtype
    if what == 1:
        axis = int(rng.integers(0, len(shapes[name])))
        shapes[name][axis] += int(rng.choice([-1, 1])) if shapes[name][axis] > 1 else 1
    elif what == 2:
        shapes[name] = shapes[name] + [1]
    dtypes = {"ids": np.int64, "mask": np.int64, "scale": np.float32}
    if what == 3:
        dtypes[name] = np.float64 if name == "scale" else np.int32
    return {n: np.zeros(shapes[n], dtypes[n]) for n in shapes}


def test_the_signatures_check_answers_where_the_contexts_check_passes_with_its_profile():
    check = NumpyCheck.of(BINDINGS, PROFILES)
    assert check is not None
    rng = np.random.default_rng()
    outcomes = set()
    for _ in range(3000):
        feeds = _random_feeds(rng)
        key = tuple((a.dtype, a.shape) for a in feeds.values())
        want = _checked_profile(feeds)
        assert check(key) == want, {n: (a.dtype, a.shape) for n, a in feeds.items()}
        outcomes.add(want)
    assert outcomes == {None, 0, 1}, outcomes


def test_no_check_where_the_contexts_check_does_more():
    assert NumpyCheck.of(BINDINGS, []) is None  # no profile: _check keeps the last one
    assert NumpyCheck.of(BINDINGS + [Binding("state", None, None, kind="sequence")], PROFILES) is None


def test_a_context_still_raises_the_checks_error_for_a_bad_signature(tmp_path):
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])])
    path = tmp_path / "relu.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    engine = kiln.build(str(path), profiles=[{"x": "1x8,2x8,4x8"}])
    context = engine.create_execution_context()
    assert context._numpy_check is not None
    x = np.random.default_rng().standard_normal((3, 8)).astype(np.float32)
    np.testing.assert_array_equal(context.run({"x": x})["y"], np.maximum(x, 0))
    with pytest.raises(BindingError, match="outside every optimization profile"):
        context.run({"x": np.zeros((5, 8), np.float32)})
    with pytest.raises(BindingError, match="axis 1 must be 8"):
        context.run({"x": np.zeros((2, 7), np.float32)})
    with pytest.raises(BindingError, match="expected dtype"):
        context.run({"x": np.zeros((2, 8), np.float64)})
