"""kiln compare: error statistics and first-diverging-layer search, against onnxruntime."""

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper

from kiln.tools.accuracy import compare, error_stats


def _mlp(seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    w1 = helper.make_tensor("w1", TensorProto.FLOAT, [8, 16], rng.standard_normal((8, 16)).astype(np.float32).ravel())
    w2 = helper.make_tensor("w2", TensorProto.FLOAT, [16, 4], rng.standard_normal((16, 4)).astype(np.float32).ravel())
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="fc1"),
        helper.make_node("Relu", ["h"], ["a"], name="relu"),
        helper.make_node("MatMul", ["a", "w2"], ["y"], name="fc2"),
    ]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 4])], [w1, w2])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def test_error_stats_counts_elements_outside_tolerance():
    ref = np.array([1.0, 2.0, 3.0, 4.0], dtype=np.float32)
    got = ref + np.array([0.0, 0.0, 0.5, 0.0], dtype=np.float32)
    s = error_stats("v", got, ref, rtol=0.0, atol=0.1)
    assert not s.passed and s.mismatched == 0.25 and abs(s.max_abs - 0.5) < 1e-7


def test_fp32_engine_matches_onnxruntime_layer_by_layer():
    report = compare(_mlp(), mark_all=True, opt_level=0)
    assert report.passed and report.first_divergence is None
    assert {step for step, _, _ in report.layers} >= {"fc1", "relu", "fc2"}


def test_first_diverging_layer_is_named():
    # A tolerance no fp16 engine can meet: the first layer (fc1) is where it shows first.
    report = compare(_mlp(), precision="fp16", mark_all=True, opt_level=0, rtol=0.0, atol=1e-7)
    assert not report.passed
    assert report.first_divergence is not None and report.first_divergence[0] == "fc1"
    assert "first layer outside tolerance: 'fc1'" in report.render()


def test_cli_compare_and_inspect_why_not(tmp_path, capsys):
    from kiln.cli import main

    path = tmp_path / "mlp.onnx"
    onnx.save(_mlp(), path)
    assert main(["compare", str(path), "--mark-all"]) == 0
    assert "PASSED" in capsys.readouterr().out
    assert main(["compare", str(path), "--precision", "fp16", "--rtol", "0", "--atol", "1e-9", "--mark-all"]) == 2
    assert "first layer outside tolerance" in capsys.readouterr().out
    engine = tmp_path / "mlp.kiln"
    assert main(["build", str(path), "-o", str(engine)]) == 0
    capsys.readouterr()
    assert main(["inspect", str(engine), "--why-not"]) == 0
    assert "fusions that did not fire" in capsys.readouterr().out


def test_pinned_layer_stays_fp32_and_is_more_accurate():
    """--pin-fp32: the pinned layer runs in fp32 inside an fp16 engine (also when fused)."""
    import kiln

    model = _mlp()
    x = np.random.default_rng(3).standard_normal((3, 8)).astype(np.float32)
    exact = kiln.build(model).run({"x": x})["y"]
    half = kiln.build(model, precision="fp16").run({"x": x})["y"]
    engine = kiln.build(model, precision="fp16", layer_precision={"fc1": "fp32", "fc2": "fp32"})
    pinned_steps = [s for s in engine.plan.program.steps if s.precision == "fp32"]
    assert pinned_steps, "no step was pinned"
    pinned = engine.run({"x": x})["y"]
    assert np.abs(pinned - exact).max() <= np.abs(half - exact).max()
    # the pinned layers' weights were kept in fp32, not rounded to half first
    assert engine.plan.weights and all(w.dtype == torch.float32 for w in engine.plan.weights.values())
    # everything pinned: the engine computes exactly what the fp32 engine does (fp16 I/O casts aside)
    np.testing.assert_allclose(pinned, exact, rtol=2e-3, atol=2e-3)
