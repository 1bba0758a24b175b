"""A nearest Resize between convolutions as one strided copy inside the native segment (cpu.resize.nearest, issue 11).

A YOLO neck upsamples its deep features 2x (nearest) before concatenating them with a shallower map; the Resize ran
as torch's interpolate outside the segment, with NCHW copies around it. The walk comes from the op's own code on the
offsets, so it matches the reference or the tactic refuses (a scale no strided walk gives). Checked against
onnxruntime on fresh inputs over scales, sizes, coordinate modes and rounding, an integer downsample, and what it
leaves to the default.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.kernels.cpu import relayout
from kiln.runtime import native
from tests.unit.test_pool_ceil_mode import assert_matches_onnxruntime

pytestmark = [pytest.mark.skipif(not relayout.available(), reason=f"kiln's relayout kernel: {relayout.reason()}"),
              pytest.mark.usefixtures("native_tactics_win")]

NATIVE = ["cpu.conv.onednn_direct", "cpu.resize.nearest", "cpu.concat.nhwc"]


def neck_model(h: int, w: int, scales=None, sizes=None, mode: str = "nearest", coordinates: str = "asymmetric",
               nearest: str = "floor", seed: int = 0, batch: int | str = 2, axes=None):
    """x [2, 3, H, W] -> Conv to 6 channels -> Resize -> Concat with a Conv of the Resize's output (5 channels) ->
    1x1 Conv to 4 channels: a YOLO neck's upsample and its lateral join."""
    rng = np.random.default_rng(seed)
    inits = {"w0": rng.standard_normal((6, 3, 3, 3)).astype(np.float32) * 0.3,
             "w1": rng.standard_normal((5, 6, 1, 1)).astype(np.float32) * 0.3,
             "w2": rng.standard_normal((4, 11, 1, 1)).astype(np.float32) * 0.3}
    inputs = ["c", ""]
    if scales is not None:
        inits["scales"] = np.array(scales, np.float32)
        inputs.append("scales")
    else:
        inits["sizes"] = np.array(sizes, np.int64)
        inputs += ["", "sizes"]
    axes = {} if axes is None else {"axes": axes}
    nodes = [helper.make_node("Conv", ["x", "w0"], ["c"], pads=[1, 1, 1, 1], name="conv_in"),
             helper.make_node("Resize", inputs, ["up"], mode=mode, coordinate_transformation_mode=coordinates,
                              nearest_mode=nearest, name="resize", **axes),
             helper.make_node("Conv", ["up", "w1"], ["side"], name="conv_side"),
             helper.make_node("Concat", ["up", "side"], ["cat"], axis=1, name="cat"),
             helper.make_node("Conv", ["cat", "w2"], ["y"], name="conv_out")]
    graph = helper.make_graph(nodes, "neck", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, h, w])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize("h, w, scales, sizes, coordinates, nearest", [
    (5, 7, [1, 1, 2, 2], None, "asymmetric", "floor"),  # torch's upsample_nearest2d as the exporter writes it
    (4, 6, [1, 1, 2, 2], None, "half_pixel", "round_prefer_floor"),  # the ONNX defaults
    (3, 5, [1, 1, 3, 2], None, "asymmetric", "floor"),
    (4, 4, None, [2, 6, 8, 12], "asymmetric", "floor"),  # by sizes
    (8, 6, [1, 1, 0.5, 0.5], None, "asymmetric", "floor"),  # an integer downsample: every other row
])
def test_a_nearest_resize_runs_inside_the_segment_and_matches_onnxruntime(h, w, scales, sizes, coordinates, nearest):
    proto = neck_model(h, w, scales, sizes, coordinates=coordinates, nearest=nearest)
    engine = kiln.build(proto.SerializeToString(), tactics=NATIVE)
    assert {s.op_type: s.tactic for s in engine.plan.program.steps}["Resize"] == "cpu.resize.nearest"
    segments = engine.program.segments
    assert len(segments) == 1 and len(segments[0].members) == 5, [len(s.members) for s in segments]
    assert_matches_onnxruntime(engine, proto, h, w)


@pytest.mark.parametrize("scales, mode, why", [
    ([1, 1, 1.5, 1.5], "nearest", "no strided walk"),  # rows repeated 2, 1, 2, 1...: no walk gives it
    ([1, 1, 2, 2], "linear", "mode linear"),
])
def test_what_no_walk_gives_is_left_to_the_default(scales, mode, why):
    proto = neck_model(4, 6, scales, mode=mode)
    engine = kiln.build(proto.SerializeToString(), tactics=NATIVE)
    resize = next(s for s in engine.plan.program.steps if s.op_type == "Resize")
    assert resize.tactic != "cpu.resize.nearest"
    assert why in str(engine.plan.header["tactics"]["layers"][resize.name]["candidates"]["cpu.resize.nearest"])
    assert_matches_onnxruntime(engine, proto, 4, 6)


@pytest.mark.parametrize("scales, sizes, axes", [
    ([1, 1, 2, 2], None, None),  # a YOLO neck's upsample, exported with a dynamic batch
    ([2, 2], None, [2, 3]),  # opset 18's axes: the batch is not among them
    (None, [8, 10], [2, 3]),
])
def test_a_nearest_resize_binds_at_every_batch_of_its_profile(scales, sizes, axes, monkeypatch):
    """A dynamic batch: the Resize leaves axis 0 as it is, so its walk holds at other batches and the segment binds
    it there (before: only at the tuned batch; another ran the segment's layers one by one)."""
    proto = neck_model(4, 5, scales, sizes, batch="N", axes=axes)
    engine = kiln.build(proto.SerializeToString(), tactics=NATIVE, profiles=[{"x": "1x3x4x5,2x3x4x5,6x3x4x5"}])
    assert {s.op_type: s.tactic for s in engine.plan.program.steps}["Resize"] == "cpu.resize.nearest"
    assert len(engine.program.segments) == 1

    def layer_by_layer(self, values):
        raise AssertionError(f"the segment of {[m.ctx.name for m in self.members]} ran layer by layer")

    monkeypatch.setattr(native.Segment, "fallback", layer_by_layer)
    for batch in (3, 1, 6, 2, 3):
        assert_matches_onnxruntime(engine, proto, 4, 5, batch)


def test_sizes_over_every_axis_keep_the_walk_to_the_built_batch():
    """Sizes that name the batch fix it: no walk is promised at another (the rule refuses; the model is only valid
    at its sizes' batch anyway)."""
    from kiln.tactics.cpu.relayout import _resize_keeps_batch
    proto = neck_model(4, 4, None, [2, 6, 8, 12])
    engine = kiln.build(proto.SerializeToString(), tactics=NATIVE)
    step = next(s for s in engine.plan.program.steps if s.op_type == "Resize")
    constants = [None, None, None, np.array([2, 6, 8, 12], np.int64)]
    assert not _resize_keeps_batch(step, constants, 4)
    assert _resize_keeps_batch(step, [None, None, np.array([1, 1, 2, 2], np.float32), None], 4)
    assert not _resize_keeps_batch(step, [None, None, np.array([2, 1, 2, 2], np.float32), None], 4)
