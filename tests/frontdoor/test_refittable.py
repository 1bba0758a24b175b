"""A refittable build (kiln.build(..., refittable=True), kiln build --refittable) of a freshly initialised
model takes other weights by refit and then computes what a fresh build with those weights computes: bit
for bit where both run the same tactics. A freshly initialised transformer has every LayerNorm weight 1
and every bias 0; an ordinary build stores such equal weights once, so it refuses the trained ones."""

from __future__ import annotations

import contextlib
import io
import warnings

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln import zoo
from kiln.builder.refit import RefitError
from kiln.cli import main as cli_main


def _export(model: torch.nn.Module, inputs: dict[str, np.ndarray], path) -> set[str]:
    """torch.onnx.export without the exporter's optimizer, which stores equal initializers once (it would
    tie a fresh model's LayerNorm weights as kiln's own deduplication does); returns the initializer names."""
    kwargs = {k: torch.from_numpy(v) for k, v in inputs.items()}
    with torch.no_grad(), warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (), kwargs=kwargs, dynamo=True, optimize=False, verbose=False).save(str(path))
    return {i.name for i in onnx.load(str(path), load_external_data=False).graph.initializer}


def _trained(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Weights as training leaves them: no LayerNorm weight 1, no bias 0, BatchNorm statistics moved."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, value in model.state_dict().items():
            if not value.is_floating_point():
                continue
            noise = torch.randn(value.shape, generator=generator)
            if name.endswith("running_var"):
                value.mul_(0.5 + noise.abs().clamp(max=1.0))  # stays positive
            else:
                value.add_(0.05 * noise)
    return model


def _same_as_fresh(engine, fresh, feed) -> None:
    got, want = engine.run(feed), fresh.run(feed)
    same_tactics = [s.tactic for s in engine.plan.program.steps] == [s.tactic for s in fresh.plan.program.steps]
    for name, value in want.items():
        if same_tactics:
            np.testing.assert_array_equal(got[name], value)
        else:  # the accuracy check reverted a layer in one build only: same maths, other kernels
            np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bert_tiny", "gpt2_tiny", "resnet_tiny"])
def test_a_fresh_model_takes_trained_weights(tmp_path, name):
    spec = zoo.get(name)
    inputs = zoo.example_inputs(spec, batch=2, seq=16)
    fresh_model = zoo.torch_model(name)
    names = _export(fresh_model, inputs, tmp_path / "fresh.onnx")
    trained = _trained(zoo.torch_model(name), seed=1)
    _export(trained, inputs, tmp_path / "trained.onnx")
    weights = {k: v for k, v in trained.state_dict().items() if k in names}  # by the model's names, as saved
    options = {"refittable": True, "timing_cache": str(tmp_path / "timing.json")}
    engine = kiln.build(str(tmp_path / "fresh.onnx"), **options)
    assert engine.plan.header["build_config"]["refittable"] is True
    feed = zoo.make_inputs(spec, batch=2, seq=16, seed=5)
    before = engine.run(feed)
    report = engine.refit(weights)
    assert report.changed
    fresh = kiln.build(str(tmp_path / "trained.onnx"), **options)
    _same_as_fresh(engine, fresh, feed)
    assert any(not np.allclose(before[k], v, rtol=1e-3, atol=1e-3) for k, v in engine.run(feed).items())
    with torch.no_grad():  # and the trained module agrees
        want = trained(**{k: torch.from_numpy(v) for k, v in feed.items()})
    got = torch.from_numpy(next(iter(engine.run(feed).values())))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_an_ordinary_build_of_a_fresh_transformer_refuses_trained_weights(tmp_path):
    """Without refittable the equal LayerNorm weights and zero biases are one weight: refused, and the
    message says how to build instead; the same refit into a refittable engine fits."""
    spec = zoo.get("bert_tiny")
    inputs = zoo.example_inputs(spec, batch=2, seq=16)
    names = _export(zoo.torch_model("bert_tiny"), inputs, tmp_path / "fresh.onnx")
    weights = {k: v for k, v in _trained(zoo.torch_model("bert_tiny"), seed=1).state_dict().items() if k in names}
    engine = kiln.build(str(tmp_path / "fresh.onnx"))
    with pytest.raises(RefitError, match=r"stored differently.*refittable=True"):
        engine.refit(weights)
    refittable = kiln.build(str(tmp_path / "fresh.onnx"), refittable=True)
    assert len(refittable.plan.weights) > len(engine.plan.weights)  # nothing stored once for being equal
    refittable.refit(weights)


def _tied(w1: np.ndarray, w2: np.ndarray) -> onnx.ModelProto:
    """x @ w1 -> Tanh -> @ w2: two 64x64 weights, stored once by an ordinary build when they are equal."""
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Tanh", ["h"], ["t"]),
             helper.make_node("MatMul", ["t", "w2"], ["y"])]
    graph = helper.make_graph(nodes, "tied", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 64])],
                              initializer=[numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_cli_build_refittable_keeps_equal_weights_apart(tmp_path):
    rng = np.random.default_rng(2)
    w = rng.standard_normal((64, 64)).astype(np.float32)
    onnx.save(_tied(w, w.copy()), tmp_path / "tied.onnx")
    assert cli_main(["build", str(tmp_path / "tied.onnx"), "--refittable", "-o", str(tmp_path / "tied.kiln")]) == 0
    engine = kiln.load(tmp_path / "tied.kiln")
    assert engine.plan.header["build_config"]["refittable"] is True
    assert len(engine.plan.weights) == 2  # an ordinary build stores one (test_refit.py refuses its refit)
    other = rng.standard_normal((64, 64)).astype(np.float32)
    engine.refit({"w2": other})
    onnx.save(_tied(w, other), tmp_path / "new.onnx")
    feed = {"x": rng.standard_normal((2, 64)).astype(np.float32)}
    fresh = kiln.build(str(tmp_path / "new.onnx"), refittable=True)
    _same_as_fresh(engine, fresh, feed)
    np.testing.assert_allclose(engine.run(feed)["y"], np.tanh(feed["x"] @ w) @ other, rtol=1e-5, atol=1e-5)
