"""split_as_slices: a Split no fused layer absorbed becomes one Slice per output on CPU builds, each a member
of the native segment (cpu.slice.native) where the Split was a torch step cutting it in two.

Structural checks (what fired, the ops left, one segment) and numerical ones against onnxruntime on the
unoptimized model, fresh random inputs: the slices are exact copies, the GEMMs and convolutions around them
sum in other orders than onnxruntime's (fp32: 1e-5 relative / 1e-5 absolute).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.frontend import onnx as onnx_frontend
from kiln.kernels.cpu import relayout
from kiln.passes import PassOptions, PassReport, optimize
from kiln.runtime.native import Segment

pytestmark = [pytest.mark.skipif(not relayout.available(), reason=f"kiln's relayout kernel: {relayout.reason()}"),
              pytest.mark.usefixtures("native_tactics_win")]
F = TensorProto.FLOAT


def randn(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def detr_projections(seq: int = 6, batch: int = 2, d: int = 16, seed: int = 0) -> onnx.ModelProto:
    """DETR's attention inputs: q and k project x + pos, v projects x; y = concat(k, v, q) (a native member
    that takes whole tensors, as the attention does). merge_parallel_gemms makes q|k one GEMM and a Split
    nothing absorbs."""
    rng = np.random.default_rng(seed)
    nodes = [helper.make_node("Add", ["x", "pos"], ["xp"])]
    inits = [numpy_helper.from_array(randn(rng, seq, batch, d), "pos")]
    for name, source in (("q", "xp"), ("k", "xp"), ("v", "x")):
        nodes += [helper.make_node("MatMul", [source, f"w{name}"], [f"{name}0"]),
                  helper.make_node("Add", [f"{name}0", f"b{name}"], [name])]
        inits += [numpy_helper.from_array(randn(rng, d, d) / 4, f"w{name}"),
                  numpy_helper.from_array(randn(rng, d), f"b{name}")]
    nodes.append(helper.make_node("Concat", ["k", "v", "q"], ["y"], axis=-1))
    graph = helper.make_graph(nodes, "detr_projections", [helper.make_tensor_value_info("x", F, [seq, batch, d])],
                              [helper.make_tensor_value_info("y", F, [seq, batch, 3 * d])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _optimized(proto: onnx.ModelProto, cpu_rules: bool):
    report = PassReport()
    model = optimize(onnx_frontend.load(proto), PassOptions(cpu_rules=cpu_rules), report)
    return [n.op_type for n in model.graph], report


def _onnxruntime(proto: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _assert_same_as_onnxruntime(engine, proto: onnx.ModelProto, shape: list[int]) -> None:
    for seed in (1, 2):
        feeds = {"x": randn(np.random.default_rng(seed), *shape)}
        got = engine.run(feeds)
        for out, want in zip(proto.graph.output, _onnxruntime(proto, feeds)):
            np.testing.assert_allclose(got[out.name], want, rtol=1e-5, atol=1e-5, err_msg=out.name)


def test_the_merged_q_k_split_becomes_two_slices_on_cpu_builds_only():
    proto = detr_projections()
    ops, report = _optimized(proto, cpu_rules=True)
    assert report.fired.get("merge_parallel_gemms") == 1 and report.fired.get("split_as_slices") == 1
    assert ops.count("Slice") == 2 and "Split" not in ops, ops
    ops, report = _optimized(proto, cpu_rules=False)  # CUDA keeps the Split: its outputs are views there
    assert "split_as_slices" not in report.fired and ops.count("Split") == 1, ops


def test_engine_runs_the_slices_inside_one_segment_and_matches_onnxruntime():
    proto = detr_projections()
    engine = kiln.build(proto.SerializeToString())
    tactics = [s.tactic for s in engine.plan.program.steps]
    assert tactics.count("cpu.slice.native") == 2, tactics
    assert len(engine.program.run_steps) == 1 and isinstance(engine.program.run_steps[0].fn, Segment), \
        [s.ctx.name for s in engine.program.run_steps]
    _assert_same_as_onnxruntime(engine, proto, [6, 2, 16])


def split_model(shape: list[int], axis: int, sizes: list[int] | None, outputs: int, opset: int = 18,
                read: tuple[int, ...] | None = None, seed: int = 0) -> onnx.ModelProto:
    """Relu(x) -> Split(axis, sizes: an input from opset 13, an attribute before, none: equal parts) -> each
    read output through Sigmoid; outputs not in `read` (default: all) are left unread."""
    read = tuple(range(outputs)) if read is None else read
    parts = [f"p{i}" for i in range(outputs)]
    inits = []
    if sizes is not None and opset >= 13:
        split = helper.make_node("Split", ["r", "sizes"], parts, axis=axis)
        inits.append(numpy_helper.from_array(np.array(sizes, np.int64), "sizes"))
    elif sizes is not None:
        split = helper.make_node("Split", ["r"], parts, axis=axis, split=sizes)
    else:
        split = helper.make_node("Split", ["r"], parts, axis=axis, **({"num_outputs": outputs} if opset >= 18 else {}))
    nodes = [helper.make_node("Relu", ["x"], ["r"]), split]
    nodes += [helper.make_node("Sigmoid", [parts[i]], [f"y{i}"]) for i in read]
    chunk = -(-shape[axis] // outputs)  # ONNX's equal parts: ceil-sized, a smaller last one
    widths = sizes or [min(chunk, shape[axis] - i * chunk) for i in range(outputs)]
    out_shapes = [[*shape[:axis], w, *shape[axis + 1:]] for w in widths]
    graph = helper.make_graph(nodes, "split", [helper.make_tensor_value_info("x", F, shape)],
                              [helper.make_tensor_value_info(f"y{i}", F, out_shapes[i]) for i in read], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


@pytest.mark.parametrize("shape, axis, sizes, outputs, opset, read", [
    ([2, 5, 24], -1, [8, 4, 12], 3, 18, None),  # sizes as an input, the last axis
    ([2, 5, 24], 2, [16, 8], 2, 11, None),  # sizes as an attribute (before opset 13)
    ([2, 5, 10], 2, None, 3, 18, None),  # num_outputs: ceil-sized parts 4, 4, 2
    ([2, 12, 3, 4], 1, [4, 8], 2, 18, None),  # a 4-D value's channels (NHWC inside a segment)
    ([3, 6, 8], 1, [2, 2, 2], 3, 18, (0, 2)),  # an unread output gets no slice
])
def test_every_form_of_split_becomes_slices_that_match_onnxruntime(shape, axis, sizes, outputs, opset, read):
    proto = split_model(shape, axis, sizes, outputs, opset, read)
    ops, report = _optimized(proto, cpu_rules=True)
    assert report.fired.get("split_as_slices") == 1 and "Split" not in ops, ops
    assert ops.count("Slice") == len(read or range(outputs)), ops
    _assert_same_as_onnxruntime(kiln.build(proto.SerializeToString()), proto, shape)


def test_a_split_along_a_dynamic_dim_is_left_alone():
    proto = split_model([2, 5, 24], 0, [1, 1], 2)
    proto.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "batch"
    for out in proto.graph.output:
        out.type.tensor_type.shape.dim[0].dim_value = 1
    ops, report = _optimized(proto, cpu_rules=True)
    assert "split_as_slices" not in report.fired and ops.count("Split") == 1, ops
    assert any("no static size" in line for line in report.refused), report.refused


@pytest.mark.slow
def test_detr_runs_as_one_segment_and_matches_onnxruntime():
    """kiln.zoo's DETR (ResNet backbone, 1 encoder + 2 decoder layers): its q|k and cross-attention k|v Splits
    were 4 torch steps between 5 pieces of segment; as slices the whole model is one segment."""
    from kiln import zoo

    exported = zoo.export("detr_tiny")
    engine = kiln.build(str(exported.path))
    assert [s.tactic for s in engine.plan.program.steps].count("cpu.slice.native") == 8
    assert len(engine.program.run_steps) == 1 and isinstance(engine.program.run_steps[0].fn, Segment)
    session = ort.InferenceSession(str(exported.path), providers=["CPUExecutionProvider"])
    for seed in (1, 2):
        feeds = {k: randn(np.random.default_rng(seed), *v.shape) for k, v in exported.inputs().items()}
        for name, want in zip(engine.output_names, session.run(None, feeds)):
            # fp32: a ResNet's convolutions and 3 transformer layers sum in other orders than onnxruntime's
            np.testing.assert_allclose(engine.run(feeds)[name], want, rtol=1e-4, atol=1e-4, err_msg=name)
