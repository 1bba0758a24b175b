"""A MaxPool with ceil_mode=1 between convolutions runs inside the native segment (cpu.pool.onednn.MaxPool, issue 11).

SqueezeNet's (and GoogLeNet's) max pools take ceil_mode; oneDNN's pooling primitive has no such mode, so they ran as
torch steps outside the segment, each splitting it (SqueezeNet 1.1: 3 pools, 4 segments). ceil_mode's tail is more
end padding to a max, with the reference's output size (a last window starts inside the input). Checked against
onnxruntime on fresh inputs over sizes with and without a tail, begin/end pads, the window that would start in the
padding, and another batch than tuned.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.kernels.cpu import onednn

pytestmark = [pytest.mark.skipif(not onednn.available(), reason="libdnnl.so.3 cannot be loaded"),
              pytest.mark.usefixtures("native_tactics_win")]

NATIVE = ["cpu.conv.onednn_direct", "cpu.pool.onednn.MaxPool", "cpu.pool.onednn.AveragePool"]


def pool_model(op: str, h: int, w: int, kernel: int, stride: int, pads: list[int], batch: int | str = 2,
               seed: int = 0):
    """x [N, 3, H, W] -> 3x3 Conv to 8 channels -> `op` (ceil_mode=1) -> 1x1 Conv to 5 channels."""
    rng = np.random.default_rng(seed)
    inits = {"w0": rng.standard_normal((8, 3, 3, 3)).astype(np.float32) * 0.3,
             "w1": rng.standard_normal((5, 8, 1, 1)).astype(np.float32) * 0.3}
    nodes = [helper.make_node("Conv", ["x", "w0"], ["c"], pads=[1, 1, 1, 1], name="conv_in"),
             helper.make_node(op, ["c"], ["p"], kernel_shape=[kernel, kernel], strides=[stride, stride], pads=pads,
                              ceil_mode=1, name="pool"),
             helper.make_node("Conv", ["p", "w1"], ["y"], name="conv_out")]
    graph = helper.make_graph(nodes, "pool", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, h, w])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def onnxruntime_run(proto, feeds: dict) -> np.ndarray:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(None,
                                                                                                          feeds)[0]


def assert_matches_onnxruntime(engine, proto, h: int, w: int, batch: int = 2) -> None:
    """The engine's output y on fresh [batch, 3, H, W] inputs x against onnxruntime's, shape and values."""
    for seed in (1, 2):
        x = np.random.default_rng(seed).standard_normal((batch, 3, h, w)).astype(np.float32)
        want = onnxruntime_run(proto, {"x": x})
        got = engine.run({"x": x})["y"]
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)  # the convolutions sum in other orders


@pytest.mark.parametrize("h, w, kernel, stride, pads", [
    (14, 14, 3, 2, [0, 0, 0, 0]),  # a tail on both axes (SqueezeNet's 3x3 / 2 pools at even sizes)
    (13, 10, 3, 2, [0, 0, 0, 0]),  # none on H, one on W
    (7, 9, 2, 2, [0, 0, 0, 0]),
    (15, 12, 3, 2, [1, 1, 1, 1]),
    (5, 5, 2, 2, [1, 1, 1, 1]),  # ceil would add a window starting in the end padding: the reference drops it
])
def test_a_ceil_mode_max_pool_runs_inside_the_segment_and_matches_onnxruntime(h, w, kernel, stride, pads):
    proto = pool_model("MaxPool", h, w, kernel, stride, pads)
    engine = kiln.build(proto.SerializeToString(), tactics=NATIVE)
    assert {s.op_type: s.tactic for s in engine.plan.program.steps}["MaxPool"] == "cpu.pool.onednn.MaxPool"
    segments = engine.program.segments
    assert len(segments) == 1 and len(segments[0].members) == 3, [len(s.members) for s in segments]
    assert_matches_onnxruntime(engine, proto, h, w)


def test_other_batch_sizes_than_tuned_give_onnxruntime_results():
    proto = pool_model("MaxPool", 14, 11, 3, 2, [0, 0, 0, 0], batch="N")
    engine = kiln.build(proto.SerializeToString(), tactics=NATIVE, shapes={"x": [2, 3, 14, 11]})
    assert {s.op_type: s.tactic for s in engine.plan.program.steps}["MaxPool"] == "cpu.pool.onednn.MaxPool"
    for batch in (2, 3, 1):
        x = np.random.default_rng(batch).standard_normal((batch, 3, 14, 11)).astype(np.float32)
        np.testing.assert_allclose(engine.run({"x": x})["y"], onnxruntime_run(proto, {"x": x}), rtol=1e-5, atol=1e-5)


def test_a_ceil_mode_average_pool_is_left_to_the_default():
    """An average's ceil_mode tail is no padding for its divisor: oneDNN's pads would be counted or excluded alike."""
    proto = pool_model("AveragePool", 14, 14, 3, 2, [0, 0, 0, 0])
    engine = kiln.build(proto.SerializeToString(), tactics=NATIVE)
    pool = next(s for s in engine.plan.program.steps if s.op_type == "AveragePool")
    assert pool.tactic != "cpu.pool.onednn.AveragePool"
    assert "ceil_mode" in str(engine.plan.header["tactics"]["layers"][pool.name]["candidates"])
    x = np.random.default_rng(4).standard_normal((2, 3, 14, 14)).astype(np.float32)
    np.testing.assert_allclose(engine.run({"x": x})["y"], onnxruntime_run(proto, {"x": x}), rtol=1e-5, atol=1e-5)
