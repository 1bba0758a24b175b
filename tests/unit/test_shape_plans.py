"""Shape-only steps (kiln/runtime/shapes.py) run once per input-shape signature; data never is taken
for a shape: outputs stay right against onnxruntime when the same shapes carry other data."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import kiln
from kiln.runtime import program as program_module
from kiln.runtime.shapes import shape_only_steps
from tests.exported_encoder import bert_tiny_with_mask_machinery


def _session(model_bytes: bytes) -> ort.InferenceSession:
    return ort.InferenceSession(model_bytes, providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def bert():
    return bert_tiny_with_mask_machinery("1x1,2x16,4x32")


def test_the_mask_and_position_machinery_is_shape_only_the_data_is_not(bert):
    _, engine = bert
    spec = engine.plan.program
    steps, values = shape_only_steps(spec)
    ops = {spec.steps[i].op_type for i in steps}
    assert {"Shape", "Range", "Concat", "Unsqueeze"} <= ops
    for i, step in enumerate(spec.steps):
        reads_data = any(n in ("input_ids", "attention_mask") for n in step.inputs) and step.op_type != "Shape"
        if reads_data or step.op_type in ("FusedGemm", "Attention", "LayerNorm"):
            assert i not in steps, f"{step.name} ({step.op_type}) reads data but was taken for a shape step"


def test_a_known_signature_skips_the_shape_steps_and_gives_the_same_outputs(bert):
    exported, engine = bert
    program = engine.program
    rng = np.random.default_rng()
    session = _session(exported.path.read_bytes())
    assert len(program.lean_steps) < len(program.run_steps)
    for _ in range(3):  # first run records the signature's shape values, later runs reuse them
        ids = rng.integers(0, 1024, (3, 20), dtype=np.int64)
        mask = (rng.random((3, 20)) < 0.8).astype(np.int64)
        mask[:, 0] = 1
        feeds = {"input_ids": ids, "attention_mask": mask}
        np.testing.assert_allclose(next(iter(engine.run(feeds).values())), session.run(None, feeds)[0],
                                   rtol=1e-4, atol=1e-4)
    assert any(key[0][0] == (3, 20) for key in program.shape_plans)


def test_the_remembered_signatures_are_bounded(bert, monkeypatch):
    _, engine = bert
    monkeypatch.setattr(program_module, "SHAPE_PLANS", 3)
    rng = np.random.default_rng()
    for seq in range(1, 9):
        feeds = {"input_ids": rng.integers(0, 1024, (1, seq), dtype=np.int64),
                 "attention_mask": np.ones((1, seq), np.int64)}
        engine.run(feeds)
    assert len(engine.program.shape_plans) <= 3


def _nonzero_model() -> bytes:
    """y = zeros(count of nonzeros of x) + 1: the output's shape comes from x's data, through Shape."""
    nodes = [helper.make_node("NonZero", ["x"], ["nz"]),
             helper.make_node("Shape", ["nz"], ["s"], start=1),
             helper.make_node("ConstantOfShape", ["s"], ["z"],
                              value=helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])),
             helper.make_node("ReduceSum", ["z"], ["total"], keepdims=0)]
    graph = helper.make_graph(nodes, "nonzero", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, None),
                               helper.make_tensor_value_info("total", TensorProto.FLOAT, [])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def test_a_shape_that_depends_on_data_is_computed_every_run():
    model = _nonzero_model()
    engine = kiln.build(model, profiles=[{"x": "1,8,16"}])
    steps, _ = shape_only_steps(engine.plan.program)
    assert not steps  # NonZero's output shape comes from data: nothing downstream is shape-only
    session = _session(model)
    rng = np.random.default_rng()
    for _ in range(4):  # the same input shape, other numbers of nonzeros
        x = np.where(rng.random(12) < 0.5, 0.0, 1.0).astype(np.float32)
        got = engine.run({"x": x})
        z, total = session.run(None, {"x": x})
        np.testing.assert_array_equal(got["z"], z)
        assert float(got["total"]) == float(total) == float(np.count_nonzero(x))


def test_inspect_names_the_layers_that_keep_a_cuda_engine_from_graphs(tmp_path, capsys):
    from kiln.cli import main
    from kiln.plan import file as engine_file

    engine = kiln.build(_nonzero_model(), profiles=[{"x": "1,8,16"}])
    plan = engine.plan
    plan.header["device"] = {"type": "cuda", "name": "NVIDIA H200", "capability": [9, 0]}  # as built there
    path = tmp_path / "nonzero.kiln"
    engine_file.save(plan, path)
    assert main(["inspect", str(path)]) == 0  # inspect reads the plan only: no GPU needed
    out = capsys.readouterr().out
    assert "(NonZero) decides its output shape (or branch) from data and waits for the host" in out
    assert "Way out" in out
