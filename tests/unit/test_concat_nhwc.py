"""A channel Concat of NHWC images between convolutions inside one native segment (cpu.concat.nhwc, issue 11).

MobileViT concatenates each stage's input with its transformer's output along channels before a 3x3
convolution; with the Concat a step of its own the segment split there and both images were laid out
row-major and back. Checked against onnxruntime on fresh inputs, odd channel counts, 2 and 3 inputs,
a segment entry among the inputs (an NCHW image the segment reorders itself), and other sizes than tuned.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.kernels.cpu import transformer
from kiln.runtime.native import Segment
from tests.unit.test_squeeze_excite import onnxruntime_run

pytestmark = [pytest.mark.skipif(not transformer.available(), reason=f"kiln's C kernels: {transformer.reason()}"),
              pytest.mark.usefixtures("native_tactics_win")]

NATIVE = ["cpu.conv.onednn_direct", "cpu.concat.nhwc"]


def concat_model(channels: list[int], with_input: bool, batch="2", h: int = 6, w: int = 5, seed: int = 0):
    """Convolutions of x (3 channels) with `channels` outputs, concatenated (x itself too when with_input),
    then a 3x3 convolution."""
    rng = np.random.default_rng(seed)
    inits, nodes, parts = {}, [], ["x"] if with_input else []
    for k, c in enumerate(channels):
        inits[f"w{k}"] = rng.standard_normal((c, 3, 3, 3)).astype(np.float32) * 0.3
        nodes.append(helper.make_node("Conv", ["x", f"w{k}"], [f"c{k}"], pads=[1, 1, 1, 1], name=f"conv{k}"))
        parts.append(f"c{k}")
    total = sum(channels) + (3 if with_input else 0)
    inits["wo"] = rng.standard_normal((7, total, 3, 3)).astype(np.float32) * 0.2
    nodes += [helper.make_node("Concat", parts, ["cat"], axis=1, name="cat"),
              helper.make_node("Conv", ["cat", "wo"], ["y"], pads=[1, 1, 1, 1], name="conv_out")]
    n = int(batch) if batch.isdigit() else batch
    graph = helper.make_graph(nodes, "concat", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n, 3, h, w])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [n, 7, h, w])],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize("channels, with_input", [([5, 11], False), ([4, 9, 13], False), ([6], True)])
def test_channel_concat_runs_inside_the_segment_and_matches_onnxruntime(channels, with_input):
    proto = concat_model(channels, with_input)
    engine = kiln.build(proto.SerializeToString(), tactics=NATIVE)
    chosen = {s.op_type: s.tactic for s in engine.plan.program.steps}
    assert chosen["Concat"] == "cpu.concat.nhwc", chosen
    segments = engine.program.segments
    assert len(segments) == 1 and len(segments[0].members) == len(channels) + 2, [len(s.members) for s in segments]
    assert isinstance(engine.program.run_steps[-1].fn, Segment)
    for seed in (1, 2):
        x = np.random.default_rng(seed).standard_normal((2, 3, 6, 5)).astype(np.float32)
        # fp32: oneDNN's convolutions sum in another order than onnxruntime's; the concat itself is a copy
        np.testing.assert_allclose(engine.run({"x": x})["y"], onnxruntime_run(proto, {"x": x}), rtol=1e-5, atol=1e-5)


def test_other_batch_sizes_than_tuned_give_onnxruntime_results():
    proto = concat_model([5, 8], False, batch="N")
    engine = kiln.build(proto.SerializeToString(), tactics=NATIVE, shapes={"x": [2, 3, 6, 5]})
    for batch in (2, 3, 1):
        x = np.random.default_rng(batch).standard_normal((batch, 3, 6, 5)).astype(np.float32)
        np.testing.assert_allclose(engine.run({"x": x})["y"], onnxruntime_run(proto, {"x": x}), rtol=1e-5, atol=1e-5)
