"""remove_symbolic_same_shape_reshape: a Reshape whose computed target names its input's own dims is removed.

Phi-3 exported with symbolic batch x sequence reshapes its attention output o [B, H, S, D] to
Concat(Shape(ids)[0], -1, Shape(ids)[1], D) before the head merge; a static export folds that Reshape away, a
symbolic one cannot. It hid the merge's Transpose from fuse_attention, and the merge ran as three torch steps
between native segments (phi3_tiny: 3 segments; now 1).

Oracles: onnxruntime on the same graph at fresh random sizes of the symbolic dims (exact: a removed Reshape moves
no value), and the graph's structure after the passes; the refusal (two dims traded) is in test_passes_refusals.py,
the whole dynamic Phi-3 as one native segment against onnxruntime in test_decoder_attention_dynamic.py.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln import zoo
from kiln.frontend import onnx as onnx_frontend
from kiln.passes._rewrite import PassReport, producer
from kiln.passes.pipeline import PassOptions, optimize

ort = pytest.importorskip("onnxruntime")


def reshape_to_own_dims(target: list[str | int], allowzero: int = 1) -> onnx.ModelProto:
    """x [N, 4, M, 8] -> Reshape(x, target) -> Transpose(0, 2, 1, 3) -> y; target entries "N"/"M" are Shape(x)'s
    dims (Slices of it), ints constants."""
    inits = [numpy_helper.from_array(np.array([v], np.int64), f"c{i}") for i, v in enumerate(range(4))]
    nodes = [helper.make_node("Shape", ["x"], ["sx"], name="shape"),
             helper.make_node("Slice", ["sx", "c0", "c1"], ["N"], name="slice_n"),
             helper.make_node("Slice", ["sx", "c2", "c3"], ["M"], name="slice_m")]
    parts = []
    for i, t in enumerate(target):
        if isinstance(t, str):
            parts.append(t)
        else:
            inits.append(numpy_helper.from_array(np.array([t], np.int64), f"t{i}"))
            parts.append(f"t{i}")
    nodes += [helper.make_node("Concat", parts, ["target"], name="concat", axis=0),
              helper.make_node("Reshape", ["x", "target"], ["r"], name="reshape", allowzero=allowzero),
              helper.make_node("Transpose", ["r"], ["y"], name="transpose", perm=[0, 2, 1, 3])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, "M", 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


CASES = {
    "minus_one_for_heads": ["N", -1, "M", 8],  # Phi-3's: batch, -1, sequence, head size
    "all_named": ["N", 4, "M", 8],
    "zero_copies": [0, -1, "M", 8],  # allowzero=0 below: the 0 copies x's N
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_reshape_to_its_own_dims_goes_and_the_output_equals_onnxruntime(case):
    allowzero = 0 if case == "zero_copies" else 1
    proto = reshape_to_own_dims(CASES[case], allowzero)
    report = PassReport()
    optimized = optimize(onnx_frontend.load(proto), PassOptions(cpu_rules=True), report)
    assert report.fired.get("remove_symbolic_same_shape_reshape") == 1, report.fired
    assert "Reshape" not in [n.op_type for n in optimized.graph]
    engine = kiln.build(proto)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng()
    for _ in range(3):
        x = rng.standard_normal((int(rng.integers(1, 5)), 4, int(rng.integers(1, 9)), 8)).astype(np.float32)
        np.testing.assert_array_equal(engine.run({"x": x})["y"], session.run(None, {"x": x})[0])


def test_a_reshape_with_a_literal_zero_under_allowzero_stays():
    """allowzero=1: a 0 in the target is a dim of size 0, not x's dim; the rule leaves it."""
    report = PassReport()
    optimized = optimize(onnx_frontend.load(reshape_to_own_dims([0, -1, "M", 8], allowzero=1)),
                         PassOptions(cpu_rules=True), report)
    assert "remove_symbolic_same_shape_reshape" not in report.fired
    assert "Reshape" in [n.op_type for n in optimized.graph]


def test_a_dynamic_phi3_attention_takes_its_head_merge():
    """Structure, phi3_tiny exported with symbolic batch x sequence: the Reshape before each head merge goes (2),
    each kiln::Attention takes the merge's Transpose (out_perm) and Reshape (out_merge_heads), and its output is
    read by the o-projection GEMM directly. Fails before (a Reshape, Transpose and Reshape after each attention)."""
    model = onnx_frontend.load(str(zoo.export("phi3_tiny", batch=2, seq=8, dynamic=True).path))
    report = PassReport()
    optimize(model, PassOptions(cpu_rules=True), report)
    assert report.fired.get("remove_symbolic_same_shape_reshape") == 2, report.fired
    attentions = [n for n in model.graph if n.op_type == "Attention"]
    assert len(attentions) == 2
    for node in attentions:
        assert list(node.attributes["out_perm"].value) == [0, 2, 1, 3]
        assert node.attributes["out_merge_heads"].value == 1
        readers = [u.op_type for u, _ in node.outputs[0].uses()]
        assert readers == ["FusedGemm"], readers
        assert producer(node.inputs[0], "Rotary", "kiln") is not None

