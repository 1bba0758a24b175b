"""Reshape/Transpose chains fused into kiln::Relayout and run by kiln's C copy inside native segments (issue 11).

- The algebra (kiln/ops/relayout.py): strided_form / dims_and_perm recover random chains of reshapes and
  transposes exactly, and say None for tables no strided walk gives.
- The kernel (kiln/kernels/cpu/relayout.c) against torch's reshape/permute, 4-D values channels-last as in
  a segment, on random inputs.
- The rule (kiln/passes/fusion/relayout.py): MobileViT's unfold and fold (five nodes each) become one
  Relayout each on CPU builds only; the engine equals onnxruntime on fresh inputs and runs the convolutions,
  both relayouts and the GEMM between them as one native segment.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.frontend import onnx as onnx_frontend
from kiln.kernels.cpu import relayout
from kiln.ops.relayout import dims_and_perm, strided_form
from kiln.passes import PassOptions, PassReport, optimize
from kiln.runtime.native import Segment

pytestmark = [pytest.mark.skipif(not relayout.available(), reason=f"kiln's relayout kernel: {relayout.reason()}"),
              pytest.mark.usefixtures("native_tactics_win")]


def _random_chain(rng: np.random.Generator, shape: list[int]) -> tuple[np.ndarray, list]:
    """arange over `shape` through 1-4 random reshapes (splitting / merging dims) and transposes."""
    table = np.arange(int(np.prod(shape))).reshape(shape)
    ops = []
    for _ in range(rng.integers(1, 5)):
        if rng.random() < 0.5:
            perm = list(rng.permutation(table.ndim))
            table = table.transpose(perm)
            ops.append(("transpose", perm))
        else:
            new = []
            for d in table.shape:  # split each dim that has a small factor, sometimes
                f = next((f for f in (2, 3, 5) if d % f == 0 and d > f), None)
                new += [f, d // f] if f is not None and rng.random() < 0.5 else [d]
            if len(new) > 2 and rng.random() < 0.5:  # merge two neighbours
                k = int(rng.integers(0, len(new) - 1))
                new = new[:k] + [new[k] * new[k + 1]] + new[k + 2:]
            table = table.reshape(new)
            ops.append(("reshape", new))
    return table, ops


@pytest.mark.parametrize("seed", range(12))
def test_strided_form_recovers_random_chains(seed):
    rng = np.random.default_rng(seed)
    shape = [int(d) for d in rng.choice([1, 2, 3, 4, 6, 10], size=int(rng.integers(2, 5)))]
    table, ops = _random_chain(rng, shape)
    form = strided_form(table)
    assert form is not None, ops
    dims, perm = dims_and_perm(form, table.size)
    again = np.arange(table.size).reshape(dims).transpose(perm).reshape(table.shape)
    np.testing.assert_array_equal(again, table)


def test_strided_form_refuses_what_no_walk_gives():
    assert strided_form(np.array([0, 2, 1, 3, 5, 4])) is None  # a swap inside the second row only
    assert strided_form(np.array([1, 0])) is None  # a walk starts at its source's first element
    assert strided_form(np.array([0, 1, 2, 3])) == [(4, 1)]  # merged: one dim


@pytest.mark.parametrize("input_size, dims, perm, output_size", [
    ((1, 24, 8, 6), [24, 4, 2, 3, 2], [2, 4, 1, 3, 0], (4, 12, 24)),  # MobileViT's unfold, patch 2x2
    ((4, 12, 24), [2, 2, 4, 3, 24], [4, 2, 0, 3, 1], (1, 24, 8, 6)),  # its fold
    ((2, 5, 3, 7), [2, 5, 3, 7], [0, 2, 3, 1], (2, 3, 7, 5)),  # NCHW -> NHWC as a 4-D value
    ((6, 10), [6, 10], [1, 0], (10, 6)),  # a plain 2-D transpose: a strided gather
    ((3, 4, 5), [3, 4, 5], [1, 0, 2], (4, 3, 5)),
    # ShuffleNet's channel shuffle on NHWC memory, 2, 3 and 8 groups: small transposes per pixel (interleave)
    ((1, 116, 7, 5), [2, 58, 35], [1, 0, 2], (1, 116, 7, 5)),
    ((2, 24, 3, 4), [2, 3, 8, 12], [0, 2, 1, 3], (2, 24, 3, 4)),
    ((1, 64, 2, 3), [8, 8, 6], [1, 0, 2], (1, 64, 2, 3)),
    ((2, 10), [2, 10], [1, 0], (10, 2)),  # row-major: [2, 10] -> [10, 2], inner 2 over a run of 10
    ((3, 40), [3, 40], [1, 0], (40, 3)),
    ((8, 9), [8, 9], [1, 0], (9, 8)),  # inner 8 (INTERLEAVE_MAX) over a run of 9
    ((9, 8), [9, 8], [1, 0], (8, 9)),  # inner 9: the strided gather
])
def test_kernel_matches_torch(input_size, dims, perm, output_size):
    layer = relayout.Relayout(input_size, relayout.relayout_move(dims, perm, output_size))
    for seed in (1, 2):
        x = torch.randn(input_size, generator=torch.Generator().manual_seed(seed))
        want = x.reshape(dims).permute(perm).reshape(output_size)
        given = x.contiguous(memory_format=torch.channels_last) if x.dim() == 4 else x
        got = layer(given)
        assert got.shape == want.shape
        if got.dim() == 4:
            assert got.is_contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(got, want, rtol=0, atol=0)  # a copy: exact
        torch.testing.assert_close(layer(x.contiguous()), want, rtol=0, atol=0)  # row-major 4-D: laid out first


def unfold_fold_model(c: int = 24, h: int = 8, w: int = 6, d: int = 20, seed: int = 0) -> onnx.ModelProto:
    """Conv -> MobileViT's unfold (as the HF exporter writes it) -> MatMul over channels -> fold -> Conv."""
    rng = np.random.default_rng(seed)
    ph = pw = 2
    nh, nw = h // ph, w // pw
    inits = {
        "w0": rng.standard_normal((c, 3, 3, 3)).astype(np.float32) * 0.3,
        "w1": rng.standard_normal((c, c)).astype(np.float32) * 0.2,
        "w2": rng.standard_normal((d, c, 1, 1)).astype(np.float32) * 0.2,
        "s1": np.array([c * nh, ph, nw, pw], np.int64), "s2": np.array([1, c, nh * nw, ph * pw], np.int64),
        "s3": np.array([ph * pw, nh * nw, c], np.int64),
        "t1": np.array([1, ph * pw, nh * nw, c], np.int64), "t2": np.array([c * nh, nw, ph, pw], np.int64),
        "t3": np.array([1, c, h, w], np.int64),
    }
    nodes = [
        helper.make_node("Conv", ["x", "w0"], ["f"], pads=[1, 1, 1, 1], name="conv_in"),
        helper.make_node("Reshape", ["f", "s1"], ["u1"], name="view"),
        helper.make_node("Transpose", ["u1"], ["u2"], perm=[0, 2, 1, 3], name="transpose"),
        helper.make_node("Reshape", ["u2", "s2"], ["u3"], name="unsafe_view"),
        helper.make_node("Transpose", ["u3"], ["u4"], perm=[0, 3, 2, 1], name="transpose_1"),
        helper.make_node("Reshape", ["u4", "s3"], ["patches"], name="view_1"),
        helper.make_node("MatMul", ["patches", "w1"], ["mixed"], name="mix"),
        helper.make_node("Reshape", ["mixed", "t1"], ["v1"], name="view_2"),
        helper.make_node("Transpose", ["v1"], ["v2"], perm=[0, 3, 2, 1], name="transpose_2"),
        helper.make_node("Reshape", ["v2", "t2"], ["v3"], name="unsafe_view_1"),
        helper.make_node("Transpose", ["v3"], ["v4"], perm=[0, 2, 1, 3], name="transpose_3"),
        helper.make_node("Reshape", ["v4", "t3"], ["folded"], name="view_3"),
        helper.make_node("Conv", ["folded", "w2"], ["y"], name="conv_out"),
    ]
    graph = helper.make_graph(
        nodes, "unfold_fold", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, h, w])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, d, h, w])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    return onnx.shape_inference.infer_shapes(model, data_prop=True)


def _optimized(proto: onnx.ModelProto, cpu_rules: bool) -> tuple[list[tuple[str, str]], PassReport]:
    report = PassReport()
    model = optimize(onnx_frontend.load(proto), PassOptions(cpu_rules=cpu_rules), report)
    return [(n.domain, n.op_type) for n in model.graph], report


def test_rule_makes_unfold_and_fold_one_relayout_each_on_cpu_builds_only():
    proto = unfold_fold_model()
    nodes, report = _optimized(proto, cpu_rules=True)
    assert report.fired.get("fuse_relayout") == 2
    assert nodes == [("kiln", "FusedConv"), ("kiln", "Relayout"), ("kiln", "FusedGemm"), ("kiln", "Relayout"),
                     ("kiln", "FusedConv")], nodes
    nodes, report = _optimized(proto, cpu_rules=False)  # a CUDA build keeps the nodes
    assert "fuse_relayout" not in report.fired and ("", "Transpose") in nodes


def _onnxruntime(proto: onnx.ModelProto, feeds: dict) -> np.ndarray:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


@pytest.mark.parametrize("c, h, w", [(24, 8, 6), (17, 4, 10)])
def test_engine_matches_onnxruntime_with_unfold_and_fold_inside_one_segment(c, h, w):
    proto = unfold_fold_model(c=c, h=h, w=w)
    engine = kiln.build(proto.SerializeToString(), tactics=["cpu.conv.onednn_direct", "cpu.relayout.native",
                                                            "cpu.gemm.onednn_direct", "cpu.gemm.kiln_packed"])
    tactics = [s.tactic for s in engine.plan.program.steps]
    assert tactics.count("cpu.relayout.native") == 2, tactics
    segments = engine.program.segments
    assert len(segments) == 1 and len(segments[0].members) == 5, [len(s.members) for s in segments]
    assert isinstance(engine.program.run_steps[0].fn, Segment)
    for seed in (1, 2):
        x = np.random.default_rng(seed).standard_normal((1, 3, h, w)).astype(np.float32)
        # fp32: the convolutions and the GEMM sum in other orders than onnxruntime's; the copies are exact
        np.testing.assert_allclose(engine.run({"x": x})["y"], _onnxruntime(proto, {"x": x}), rtol=1e-5, atol=1e-5)


def channel_shuffle_model(c: int, groups: int, h: int = 5, w: int = 4, seed: int = 0) -> onnx.ModelProto:
    """Conv -> ShuffleNet's channel shuffle as torch exports it (Reshape [N, g, C/g, H, W], Transpose 1<->2,
    Reshape [N, C, H, W]) -> Conv."""
    rng = np.random.default_rng(seed)
    inits = {"w0": rng.standard_normal((c, 3, 3, 3)).astype(np.float32) * 0.3,
             "w1": rng.standard_normal((6, c, 1, 1)).astype(np.float32) * 0.2,
             "s1": np.array([1, groups, c // groups, h, w], np.int64), "s2": np.array([1, c, h, w], np.int64)}
    nodes = [helper.make_node("Conv", ["x", "w0"], ["f"], pads=[1, 1, 1, 1], name="conv_in"),
             helper.make_node("Reshape", ["f", "s1"], ["g"], name="view"),
             helper.make_node("Transpose", ["g"], ["t"], perm=[0, 2, 1, 3, 4], name="transpose"),
             helper.make_node("Reshape", ["t", "s2"], ["shuffled"], name="unsafe_view"),
             helper.make_node("Conv", ["shuffled", "w1"], ["y"], name="conv_out")]
    graph = helper.make_graph(
        nodes, "shuffle", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, h, w])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 6, h, w])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize("c, groups", [(116, 2), (24, 3), (32, 8), (18, 9)])
def test_a_channel_shuffle_runs_inside_the_segment_and_matches_onnxruntime(c, groups):
    proto = channel_shuffle_model(c, groups)
    engine = kiln.build(proto.SerializeToString(), tactics=["cpu.conv.onednn_direct", "cpu.relayout.native"])
    assert [s.tactic for s in engine.plan.program.steps].count("cpu.relayout.native") == 1
    segments = engine.program.segments
    assert len(segments) == 1 and len(segments[0].members) == 3, [len(s.members) for s in segments]
    for seed in (1, 2):
        x = np.random.default_rng(seed).standard_normal((1, 3, 5, 4)).astype(np.float32)
        np.testing.assert_allclose(engine.run({"x": x})["y"], _onnxruntime(proto, {"x": x}), rtol=1e-5, atol=1e-5)


def test_a_transpose_over_a_dynamic_batch_is_one_relayout_that_runs_every_batch():
    """A Transpose that moves each batch's block alike at a symbolic batch is one Relayout of -1 the batch's dim
    (its attributes hold at every batch), bit for bit onnxruntime's at batches other than the tuned one."""
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=[0, 2, 3, 1], name="to_nhwc"),
             helper.make_node("Relu", ["t"], ["y"], name="relu")]
    graph = helper.make_graph(nodes, "dynamic", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 5, 3, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3, 4, 5])])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    engine = kiln.build(proto.SerializeToString(), shapes={"x": [2, 5, 3, 4]})
    (relayout_step,) = [s for s in engine.plan.program.steps if s.op_type == "Relayout"]
    assert relayout_step.attributes["dims"][0] == -1 and relayout_step.attributes["shape"][0] == -1
    for batch in (2, 3, 1, 6):
        x = np.random.default_rng(batch).standard_normal((batch, 5, 3, 4)).astype(np.float32)
        np.testing.assert_array_equal(engine.run({"x": x})["y"], _onnxruntime(proto, {"x": x}))


def convnext_block_model(c: int = 12, h: int = 6, w: int = 5, seed: int = 0, residual: str = "x") -> onnx.ModelProto:
    """ConvNeXt's block as exported: depthwise conv, permute to NHWC, LayerNorm, Linear, Gelu, Linear,
    permute back, residual Add (of `residual`: the block's input x, or "d", the depthwise conv's output, which is
    then read past the first permute); then a 1x1 conv."""
    rng = np.random.default_rng(seed)
    inits = {
        "wd": rng.standard_normal((c, 1, 7, 7)).astype(np.float32) * 0.2,
        "g": (1 + 0.1 * rng.standard_normal(c)).astype(np.float32), "b": rng.standard_normal(c).astype(np.float32) * 0.1,
        "w1": rng.standard_normal((c, 4 * c)).astype(np.float32) * 0.2,
        "b1": rng.standard_normal(4 * c).astype(np.float32) * 0.1,
        "w2": rng.standard_normal((4 * c, c)).astype(np.float32) * 0.2,
        "wo": rng.standard_normal((5, c, 1, 1)).astype(np.float32) * 0.2,
    }
    nodes = [
        helper.make_node("Conv", ["x", "wd"], ["d"], pads=[3, 3, 3, 3], group=c, name="dwconv"),
        helper.make_node("Transpose", ["d"], ["p"], perm=[0, 2, 3, 1], name="permute"),
        helper.make_node("LayerNormalization", ["p", "g", "b"], ["n"], axis=-1, epsilon=1e-6, name="layer_norm"),
        helper.make_node("MatMul", ["n", "w1"], ["m1"], name="pwconv1"),
        helper.make_node("Add", ["m1", "b1"], ["a1"], name="bias1"),
        helper.make_node("Gelu", ["a1"], ["ge"], name="gelu"),
        helper.make_node("MatMul", ["ge", "w2"], ["m2"], name="pwconv2"),
        helper.make_node("Transpose", ["m2"], ["q"], perm=[0, 3, 1, 2], name="permute_back"),
        helper.make_node("Add", [residual, "q"], ["r"], name="residual"),
        helper.make_node("Conv", ["r", "wo"], ["y"], name="conv_out"),
    ]
    graph = helper.make_graph(
        nodes, "convnext_block", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, h, w])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 5, h, w])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    return onnx.shape_inference.infer_shapes(model)


def test_channels_last_run_is_flattened_to_rows():
    model = optimize(onnx_frontend.load(convnext_block_model()), PassOptions(cpu_rules=True), report := PassReport())
    assert report.fired.get("fuse_relayout") == 2 and report.fired.get("flatten_channels_last_runs") == 1
    shapes = {n.op_type: list(n.outputs[0].shape) for n in model.graph}
    assert shapes["LayerNormalization"] == [1, 30, 12] and shapes["FusedGemm"] == [1, 30, 12], shapes


@pytest.mark.parametrize("c, h, w", [(12, 6, 5), (7, 3, 9)])
def test_convnext_block_is_one_segment_and_matches_onnxruntime(c, h, w):
    proto = convnext_block_model(c=c, h=h, w=w)
    engine = kiln.build(proto.SerializeToString(), tactics=["cpu.conv.onednn_direct", "cpu.relayout.native",
                                                            "cpu.layernormalization.native", "cpu.gemm.kiln_packed",
                                                            "cpu.add.nhwc"])
    tactics = [s.tactic for s in engine.plan.program.steps]
    assert "" not in tactics and tactics.count("cpu.add.nhwc") == 1, tactics
    segments = engine.program.segments
    assert len(segments) == 1 and len(segments[0].members) == len(tactics), [len(s.members) for s in segments]
    # NCHW -> [1, H·W, C] and back are the same bytes as the segment lays the 4-D values out (NHWC): aliases
    relayouts = [m for m in segments[0].members if m.ctx.op_type == "Relayout"]
    assert segments[0].aliased == 2 and len(relayouts) == 2 and all(m.fn.native.alias for m in relayouts)
    for seed in (1, 2):
        x = np.random.default_rng(seed).standard_normal((1, c, h, w)).astype(np.float32)
        # fp32: LayerNorm, the GEMMs and the convolutions sum in other orders than onnxruntime's
        np.testing.assert_allclose(engine.run({"x": x})["y"], _onnxruntime(proto, {"x": x}), rtol=1e-4, atol=1e-5)


def test_a_relayout_whose_input_lives_on_copies_and_the_other_aliases():
    """The residual read from the depthwise conv's output: the first permute's input lives past it, so that relayout
    copies (an alias would have the LayerNorm's rows overwrite what the Add reads); the permute back still aliases.
    Both segments' forms against onnxruntime."""
    proto = convnext_block_model(c=12, h=6, w=5, residual="d")
    engine = kiln.build(proto.SerializeToString(), tactics=["cpu.conv.onednn_direct", "cpu.relayout.native",
                                                            "cpu.layernormalization.native", "cpu.gemm.kiln_packed",
                                                            "cpu.add.nhwc"])
    segments = engine.program.segments
    assert len(segments) == 1 and segments[0].aliased == 1, [(len(s.members), s.aliased) for s in segments]
    relayouts = [m for m in segments[0].members if m.ctx.op_type == "Relayout"]
    assert [m.fn.native.alias for m in relayouts] == [False, True], [m.ctx.name for m in relayouts]
    for seed in (3, 4):
        x = np.random.default_rng(seed).standard_normal((1, 12, 6, 5)).astype(np.float32)
        np.testing.assert_allclose(engine.run({"x": x})["y"], _onnxruntime(proto, {"x": x}), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("input_size, dims, perm, output_size, moves", [
    ((2, 5, 3, 4), [2, 5, 12], [0, 2, 1], (2, 12, 5), False),  # NHWC memory to [N, H·W, C] rows: the same bytes
    ((2, 12, 5), [2, 3, 4, 5], [0, 3, 1, 2], (2, 5, 3, 4), False),  # and back
    ((2, 5, 3, 4), [2, 5, 12], [0, 1, 2], (2, 5, 12), True),  # NHWC memory read as NCHW rows: a transpose
    ((3, 4), [3, 4], [1, 0], (4, 3), True),
])
def test_a_walk_that_moves_no_byte_is_known(input_size, dims, perm, output_size, moves):
    from kiln.kernels.cpu.relayout import Relayout, relayout_move

    walk = Relayout(input_size, relayout_move(dims, perm, output_size))
    assert walk.moves_nothing is (not moves), (walk.base, walk.walk)


def test_a_chain_that_moves_no_element_becomes_one_reshape():
    """An LSTM's output [S, 1, B, H] with its direction axis transposed away: a view, not a copy."""
    s1 = numpy_helper.from_array(np.array([6, 4, 5], np.int64), "s1")
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=[1, 0, 2, 3], name="swap_direction"),
             helper.make_node("Reshape", ["t", "s1"], ["r"], name="squeeze_direction"),
             helper.make_node("Relu", ["r"], ["y"], name="relu")]
    graph = helper.make_graph(nodes, "no_move", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [6, 1, 4, 5])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [6, 4, 5])], [s1])
    proto = onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    nodes, report = _optimized(proto, cpu_rules=True)
    assert report.fired.get("fuse_relayout") == 1 and nodes == [("", "Reshape"), ("", "Relu")], nodes
    engine = kiln.build(proto.SerializeToString())
    x = np.random.default_rng(3).standard_normal((6, 1, 4, 5)).astype(np.float32)
    np.testing.assert_array_equal(engine.run({"x": x})["y"], _onnxruntime(proto, {"x": x}))


def roll_model(axis: int, shift: int, c: int = 6, h: int = 7, w: int = 5, seed: int = 0) -> onnx.ModelProto:
    """Conv, then torch.roll as the exporter writes it (two Slices and a Concat along `axis`), then a Conv."""
    rng = np.random.default_rng(seed)
    size = (1, c, h, w)[axis]
    inits = {"w0": rng.standard_normal((c, 3, 3, 3)).astype(np.float32) * 0.3,
             "w1": rng.standard_normal((4, c, 3, 3)).astype(np.float32) * 0.2,
             "ax": np.array([axis], np.int64), "s0": np.array([size - shift], np.int64),
             "e0": np.array([size], np.int64), "s1": np.array([0], np.int64), "e1": np.array([size - shift], np.int64)}
    nodes = [helper.make_node("Conv", ["x", "w0"], ["f"], pads=[1, 1, 1, 1], name="conv_in"),
             helper.make_node("Slice", ["f", "s0", "e0", "ax"], ["tail"], name="slice_tail"),
             helper.make_node("Slice", ["f", "s1", "e1", "ax"], ["head"], name="slice_head"),
             helper.make_node("Concat", ["tail", "head"], ["rolled"], axis=axis, name="roll"),
             helper.make_node("Conv", ["rolled", "w1"], ["y"], pads=[1, 1, 1, 1], name="conv_out")]
    graph = helper.make_graph(nodes, "roll", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, h, w])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, h, w])],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))


@pytest.mark.parametrize("axis, shift", [(2, 3), (3, 1), (1, 2)])
def test_slices_and_concat_of_a_roll_run_inside_the_segment_and_match_onnxruntime(axis, shift):
    proto = roll_model(axis, shift)
    engine = kiln.build(proto.SerializeToString(), tactics=["cpu.conv.onednn_direct", "cpu.slice.native",
                                                            "cpu.concat.nhwc"])
    tactics = [s.tactic for s in engine.plan.program.steps]
    assert tactics.count("cpu.slice.native") == 2 and tactics.count("cpu.concat.nhwc") == 1, tactics
    segments = engine.program.segments
    assert len(segments) == 1 and len(segments[0].members) == 5, [len(s.members) for s in segments]
    for seed in (1, 2):
        x = np.random.default_rng(seed).standard_normal((1, 3, 7, 5)).astype(np.float32)
        np.testing.assert_allclose(engine.run({"x": x})["y"], _onnxruntime(proto, {"x": x}), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("starts, ends, axes, steps", [([1], [4], [1], [1]), ([0, 1], [3, 5], [2, 3], [2, 2]),
                                                       ([-3], [100], [-1], [1])])
def test_slice_kernel_matches_torch(starts, ends, axes, steps):
    from kiln.ops.tensor import slice_
    from kiln.ops.registry import OpContext
    ctx = OpContext(name="s", op_type="Slice", domain="", opset=18, num_inputs=5, num_outputs=1)
    bounds = [torch.tensor(v) for v in (starts, ends, axes, steps)]
    move = lambda x: slice_(ctx, x, *bounds)  # noqa: E731
    x = torch.randn(2, 6, 5, 7, generator=torch.Generator().manual_seed(4))
    layer = relayout.Relayout(tuple(x.shape), move, "slice")
    torch.testing.assert_close(layer(x.contiguous(memory_format=torch.channels_last)), move(x), rtol=0, atol=0)
    rows = relayout.Relayout((12, 35), lambda t: t[3:9:2, 4:30], "slice")  # 2-D: row-major
    y = torch.randn(12, 35)
    torch.testing.assert_close(rows(y), y[3:9:2, 4:30], rtol=0, atol=0)


def test_a_classifier_heads_mean_without_keepdims_stays_in_the_segment():
    """MobileViT's head: ReduceMean over H, W with keepdims=0 into a Gemm; [N, C] is the NHWC [N, C, 1, 1]'s bytes."""
    rng = np.random.default_rng(5)
    inits = {"w0": rng.standard_normal((8, 3, 3, 3)).astype(np.float32) * 0.3,
             "axes": np.array([2, 3], np.int64), "wf": rng.standard_normal((8, 4)).astype(np.float32) * 0.3,
             "bf": rng.standard_normal(4).astype(np.float32)}
    nodes = [helper.make_node("Conv", ["x", "w0"], ["f"], pads=[1, 1, 1, 1], name="conv"),
             helper.make_node("ReduceMean", ["f", "axes"], ["m"], keepdims=0, name="mean"),
             helper.make_node("MatMul", ["m", "wf"], ["l"], name="classifier"),
             helper.make_node("Add", ["l", "bf"], ["y"], name="classifier_bias")]
    graph = helper.make_graph(nodes, "head", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 6, 5])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    proto = onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    engine = kiln.build(proto.SerializeToString(), tactics=["cpu.conv.onednn_direct", "cpu.gap", "cpu.gemm.kiln_packed"])
    assert [s.tactic for s in engine.plan.program.steps] == ["cpu.conv.onednn_direct", "cpu.gap.onednn.ReduceMean",
                                                             "cpu.gemm.kiln_packed"]
    assert len(engine.program.run_steps) == 1 and isinstance(engine.program.run_steps[0].fn, Segment)
    for seed in (1, 2):
        x = np.random.default_rng(seed).standard_normal((2, 3, 6, 5)).astype(np.float32)
        np.testing.assert_allclose(engine.run({"x": x})["y"], _onnxruntime(proto, {"x": x}), rtol=1e-5, atol=1e-5)


def bidirectional_lstm_at_a_symbolic_batch(seed: int = 0, hidden: int = 5, features: int = 3, steps: int = 7):
    """A batch-first bidirectional LSTM as torch.onnx.export writes it with dynamic_axes on batch: the batch-first
    Transpose, zero initial states Expand-ed to [2, N, H] from Shape(x), and Y's merge as Transpose(0, 2, 1, 3) +
    Reshape by shape arithmetic over Shape(t)."""
    rng = np.random.default_rng(seed)
    inits = {"w": rng.standard_normal((2, 4 * hidden, features)).astype(np.float32) * 0.4,
             "r": rng.standard_normal((2, 4 * hidden, hidden)).astype(np.float32) * 0.4,
             "b": rng.standard_normal((2, 8 * hidden)).astype(np.float32) * 0.1,
             "zero": np.zeros(1, np.float32), "two": np.array([2], np.int64), "h": np.array([hidden], np.int64),
             "i0": np.array([0], np.int64), "i1": np.array([1], np.int64), "i2": np.array([2], np.int64),
             "i3": np.array([3], np.int64), "i4": np.array([4], np.int64)}
    nodes = [helper.make_node("Shape", ["x"], ["sx"], start=0, end=1, name="batch_of_x"),
             helper.make_node("Concat", ["two", "sx", "h"], ["hs"], axis=0, name="state_shape"),
             helper.make_node("Expand", ["zero", "hs"], ["zeros"], name="zeros"),
             helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0, 2], name="time_first"),
             helper.make_node("LSTM", ["xt", "w", "r", "b", "", "zeros", "zeros"], ["y"], hidden_size=hidden,
                              direction="bidirectional", name="lstm"),
             helper.make_node("Transpose", ["y"], ["yt"], perm=[0, 2, 1, 3], name="directions_last"),
             helper.make_node("Shape", ["yt"], ["sy"], name="shape_of_yt"),
             *[helper.make_node("Slice", ["sy", f"i{k}", f"i{k + 1}"], [f"d{k}"], name=f"dim{k}") for k in range(4)],
             helper.make_node("Mul", ["d2", "d3"], ["d23"], name="merged"),
             helper.make_node("Concat", ["d0", "d1", "d23"], ["target"], axis=0, name="target"),
             helper.make_node("Reshape", ["yt", "target"], ["out"], name="merge_directions")]
    graph = helper.make_graph(nodes, "bilstm", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                                ["N", steps, features])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_a_bidirectional_lstm_at_a_symbolic_batch_becomes_relayout_lstm_relayout():
    """Structural: drop_zero_initial_states, constant_reshape_target and fuse_relayout at a symbolic dim leave
    Relayout -> LSTM (no initial states) -> Relayout, the Relayouts' batch dim -1."""
    report = PassReport()
    model = optimize(onnx_frontend.load(bidirectional_lstm_at_a_symbolic_batch()), PassOptions(cpu_rules=True), report)
    ops = [n.op_type for n in model.graph]
    assert ops == ["Relayout", "LSTM", "Relayout"], (ops, report.refused)
    first, lstm, last = list(model.graph)
    assert all(i is None for i in lstm.inputs[5:]), f"the zero initial states are still read: {lstm.inputs}"
    assert list(first.attributes["perm"].value) == [1, 0, 2] and -1 in first.attributes["dims"].value
    assert list(last.attributes["shape"].value) == [7, -1, 10] and list(last.attributes["perm"].value) == [0, 2, 1, 3]
    assert report.fired.get("drop_zero_initial_states") == 1 and report.fired.get("constant_reshape_target") == 1


def test_a_bidirectional_lstm_at_a_symbolic_batch_is_one_segment_at_every_batch():
    """Numerical: the engine equals onnxruntime at fresh batches (fp32: 7 steps of 5-wide sums, 1e-5), every step a
    member of one segment that binds each batch."""
    proto = bidirectional_lstm_at_a_symbolic_batch()
    engine = kiln.build(proto.SerializeToString(), profiles=[{"x": "1x7x3,4x7x3,9x7x3"}], timing_cache=None)
    (segment,) = engine.program.segments
    assert [m.ctx.name for m in segment.members] == [s.name for s in engine.plan.program.steps]
    context = engine.create_execution_context(pad_first_calls=False)
    rng = np.random.default_rng()
    for batch in (1, 2, 9, int(rng.integers(3, 9))):
        x = rng.standard_normal((batch, 7, 3)).astype(np.float32)
        np.testing.assert_allclose(next(iter(context.run({"x": x}).values())), _onnxruntime(proto, {"x": x}),
                                   rtol=1e-5, atol=1e-5, err_msg=f"batch {batch}")
        assert any(key[0][0] == batch and view is not None for key, view in segment.resized.items()) or batch == 4, \
            f"batch {batch} ran the layers one by one"


@pytest.mark.parametrize("input_size, dims, perm, shape", [
    ((2, 5, 3, 4), [-1, 5, 12], [0, 2, 1], [-1, 12, 5]),  # NHWC memory to [N, H·W, C] rows (ConvNeXt's permute)
    ((2, 12, 5), [-1, 3, 4, 5], [0, 3, 1, 2], [-1, 5, 3, 4]),  # and back
    ((3, 5, 3, 4), [-1, 5, 12], [0, 1, 2], [-1, 5, 12]),  # NHWC memory read as NCHW rows: moves bytes, no alias
    ((1, 4, 6), [-1, 6], [0, 1], [-1, 3, 2]),  # rows split: a block holds several of dims' and shape's rows
])
def test_a_relayout_aliass_size_rule_is_its_walk_at_every_batch(input_size, dims, perm, shape):
    """The alias form's size rule (NativeStep.plan_at, what a segment's traced view follows) and its NativeStep at
    other batches (NativeStep.at, which answers from the same batch blocks) against the walk the relayout kernel
    builds at each size, at random batches, in both forms (NHWC and rows input): the same output size where the
    walk aliases, a ValueError where it does not."""
    from kiln.plan.spec import StepSpec
    from kiln.tactics.cpu import relayout as tactic

    step = StepSpec(op_type="Relayout", name="relayout", inputs=["x"], outputs=["y"], domain="kiln",
                    attributes={"dims": dims, "perm": perm, "shape": shape}, tactic="cpu.relayout.native",
                    tactic_config={"input_size": list(input_size)})
    native = tactic._prepare(step, [None], torch.device("cpu")).native
    rng = np.random.default_rng(len(dims))
    checked = 0
    for form in (native, native.reading_rows() if native.reading_rows is not None else None):
        if form is None or form.aliasing is None:
            continue
        alias = form.aliasing()
        assert alias.alias and alias.plan_at is not None
        for batch in [*rng.integers(1, 40, 12), 1, input_size[0]]:
            size = (int(batch), *input_size[1:])
            walk = relayout.Relayout(size, relayout.relayout_move(dims, perm, shape), rows_input=form.rows_input)
            if not walk.moves_nothing:
                with pytest.raises(ValueError):
                    alias.plan_at(size)
                with pytest.raises(ValueError):
                    alias.at(size)
                continue
            expected = (tuple(walk.output_size),)
            assert alias.plan_at(size).output_sizes == expected and alias.plan_at(size).fields == {}
            at = alias.at(size)
            assert at.alias and (tuple(at.output_size),) == expected and at.plan_at is alias.plan_at
            checked += 1
    moves = relayout.Relayout(input_size, relayout.relayout_move(dims, perm, shape)).moves_nothing is False
    assert moves or checked


def _at_a_dynamic_batch(proto: onnx.ModelProto) -> onnx.ModelProto:
    """`proto` with its input's and output's first dim the symbol N (value_info dropped: inferred anew)."""
    proto = onnx.ModelProto.FromString(proto.SerializeToString())
    for v in [*proto.graph.input, *proto.graph.output]:
        v.type.tensor_type.shape.dim[0].dim_param = "N"
    del proto.graph.value_info[:]
    return proto


_CONVNEXT_TACTICS = ["cpu.conv.onednn_direct", "cpu.relayout.native", "cpu.layernormalization.native",
                     "cpu.gemm.kiln_packed", "cpu.add.nhwc"]


def test_a_convnext_block_at_a_dynamic_batch_is_one_segment_of_aliases_bound_at_every_batch(tmp_path, monkeypatch):
    """ConvNeXt's block over a dynamic batch: its permutes fused at the symbol (-1 the batch's) and its run
    flattened, so the block is one segment with both relayouts as aliases (before: the Transposes ran on torch and
    split it), each with a size rule; at new batches the segment binds (its residual Add too) and runs bit for bit
    as the same engine whose aliases are the walks built at each batch (no rule), and near onnxruntime."""
    from kiln.tactics.cpu import relayout as tactic

    proto = _at_a_dynamic_batch(convnext_block_model(c=12, h=6, w=5))
    engine = kiln.build(proto.SerializeToString(), tactics=_CONVNEXT_TACTICS,
                        profiles=[{"x": "1x12x6x5,2x12x6x5,8x12x6x5"}])
    tactics = [s.tactic for s in engine.plan.program.steps]
    assert "" not in tactics and tactics.count("cpu.relayout.native") == 2, tactics
    (segment,) = engine.program.segments
    relayouts = [m.fn.native for m in segment.members if m.ctx.op_type == "Relayout"]
    assert segment.aliased == 2 and len(relayouts) == 2 and all(n.alias and n.plan_at for n in relayouts)
    engine.save(str(tmp_path / "block.kiln"))
    monkeypatch.setattr(tactic, "_alias_rule", lambda *args: None)  # the aliases' sizes from the walk at each batch
    walked = kiln.load(str(tmp_path / "block.kiln"))
    assert all(m.fn.native.plan_at is None for m in walked.program.segments[0].members
               if m.ctx.op_type == "Relayout")
    for batch in (3, 1, 5, 8):
        assert segment._bind_sizes(((batch, 12, 6, 5),)) is not None, batch  # bound, not layer by layer
        x = np.random.default_rng(batch).standard_normal((batch, 12, 6, 5)).astype(np.float32)
        ours = engine.run({"x": x})["y"]
        np.testing.assert_array_equal(ours, walked.run({"x": x})["y"])
        np.testing.assert_allclose(ours, _onnxruntime(proto, {"x": x}), rtol=1e-4, atol=1e-5)


def test_a_chain_over_a_dynamic_batch_that_moves_across_batches_is_left_alone():
    """Only a chain moving each batch's block alike is fused at a dynamic batch (outside recurrent layers): a
    Transpose of the batch with the channels stays a Transpose."""
    graph = helper.make_graph(
        [helper.make_node("Transpose", ["x"], ["t"], perm=[1, 0, 2, 3], name="across"),
         helper.make_node("Relu", ["t"], ["y"], name="relu")], "across",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 5, 3, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [5, "N", 3, 4])])
    proto = onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    model = optimize(onnx_frontend.load(proto), PassOptions(cpu_rules=True), report := PassReport())
    assert "Relayout" not in [n.op_type for n in model.graph] and not report.fired.get("fuse_relayout"), \
        report.refused
    assert any("across its batch" in line for line in report.refused), report.refused
