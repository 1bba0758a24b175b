"""The activation after a residual block's sum joins the convolution's epilogue (kiln/passes/fusion/conv.py,
fuse_conv_final_activation): the rule fires once per TCN block (golden op counts and attributes), only for CPU
builds, says why where it cannot, and the engine matches onnxruntime on the unoptimized model, fresh inputs each
time, over kernel sizes, dilations, lengths and final activations."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import kiln
from kiln import zoo
from kiln.frontend import onnx as onnx_frontend
from kiln.passes import PassOptions, optimize
from kiln.passes._rewrite import PassReport
from kiln.runtime.native import Segment
from tests.unit.test_passes_cleanup import assert_same_as_onnxruntime, make_model

F = TensorProto.FLOAT
FEATURES, CHANNELS = 6, 8
rng = np.random.default_rng(17)


def randn(*shape):
    return rng.standard_normal(shape).astype(np.float32)


def tcn(steps: int = 20, kernel: int = 3, dilation: int = 1, final: str = "Relu") -> onnx.ModelProto:
    """x [2, steps, FEATURES] -> Transpose -> two TCN blocks (Bai, Kolter and Koltun 2018), the second at twice the
    dilation: h = relu(chomp(conv1(x))); y = final(relu(chomp(conv2(h))) + residual), the residual a 1x1 convolution
    where the width changes (block 1) or x itself (block 2). Causal as the reference code writes it: pads (k-1)·d on
    both sides and a Slice of the last (k-1)·d steps."""
    x = helper.make_tensor_value_info("x", F, [2, steps, FEATURES])
    y = helper.make_tensor_value_info("y", F, None)
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=[0, 2, 1])]
    inits = [("starts", np.array([0], np.int64)), ("axes", np.array([2], np.int64))]
    source, width = "t", FEATURES
    for i, d in enumerate((dilation, 2 * dilation)):
        pad = (kernel - 1) * d
        conv = dict(kernel_shape=[kernel], pads=[pad, pad], dilations=[d])
        nodes += [helper.make_node("Conv", [source, f"w1_{i}", f"b1_{i}"], [f"c1_{i}"], name=f"conv1_{i}", **conv),
                  helper.make_node("Slice", [f"c1_{i}", "starts", f"ends_{i}", "axes"], [f"s1_{i}"]),
                  helper.make_node("Relu", [f"s1_{i}"], [f"h_{i}"]),
                  helper.make_node("Conv", [f"h_{i}", f"w2_{i}", f"b2_{i}"], [f"c2_{i}"], name=f"conv2_{i}", **conv),
                  helper.make_node("Slice", [f"c2_{i}", "starts", f"ends_{i}", "axes"], [f"s2_{i}"]),
                  helper.make_node("Relu", [f"s2_{i}"], [f"g_{i}"])]
        residual = source
        if width != CHANNELS:
            residual = f"down_{i}"
            nodes.append(helper.make_node("Conv", [source, f"wd_{i}", f"bd_{i}"], [residual], name=f"down_{i}"))
            inits += [(f"wd_{i}", randn(CHANNELS, width, 1)), (f"bd_{i}", randn(CHANNELS))]
        nodes.append(helper.make_node("Add", [f"g_{i}", residual], [f"sum_{i}"]))
        out = "y" if i == 1 else f"block_{i}"
        nodes.append(helper.make_node(final, [f"sum_{i}"], [out], name=f"final_{i}",
                                      **({"alpha": 0.1} if final == "LeakyRelu" else {})))
        scale = (2.0 / (width * kernel)) ** 0.5
        inits += [(f"w1_{i}", randn(CHANNELS, width, kernel) * scale), (f"b1_{i}", randn(CHANNELS)),
                  (f"w2_{i}", randn(CHANNELS, CHANNELS, kernel) * scale), (f"b2_{i}", randn(CHANNELS)),
                  (f"ends_{i}", np.array([-pad], np.int64))]
        source, width = out, CHANNELS
    return make_model(nodes, [x], [y], inits)


def optimized(proto: onnx.ModelProto, cpu: bool = True):
    report = PassReport()
    model = optimize(onnx_frontend.load(proto), PassOptions(cpu_rules=cpu), report)
    ops = collections.Counter(f"{n.domain}::{n.op_type}" if n.domain else n.op_type for n in model.graph)
    return model, report, ops


def test_each_blocks_last_relu_joins_its_second_convolution():
    model, report, ops = optimized(tcn())
    assert report.fired["fuse_conv_final_activation"] == 2
    # nothing between the layers: the chomps are pads, the ReLUs epilogues, the 1-D layers 2-D ones end to end; the
    # Relayouts are the input's (Transpose + Unsqueeze, made once for conv1 and the downsample) and the output's
    assert ops == {"kiln::Relayout": 2, "kiln::FusedConv": 5}, ops
    convs = {n.name: n for n in model.graph if n.op_type == "FusedConv"}
    epilogues = {name: (n.attributes["activation"].value, n.attributes["residual_after_activation"].value,
                        n.attributes["final_activation"].value if "final_activation" in n.attributes else "")
                 for name, n in convs.items()}
    assert epilogues == {"conv1_0_2d": ("Relu", 0, ""), "down_0_2d": ("", 0, ""), "conv2_0_2d": ("Relu", 1, "Relu"),
                         "conv1_1_2d": ("Relu", 0, ""), "conv2_1_2d": ("Relu", 1, "Relu")}, epilogues
    assert convs["conv2_1_2d"].inputs[3] is convs["conv2_0_2d"].outputs[0]  # block 2's residual: block 1's output
    assert convs["conv1_0_2d"].inputs[0] is convs["down_0_2d"].inputs[0]  # block 1's input, one [N, C, 1, S] value


def test_the_rule_is_cpu_only():
    _, report, ops = optimized(tcn(), cpu=False)
    assert "fuse_conv_final_activation" not in report.fired
    assert ops["Relu"] == 2, ops  # each block's last ReLU, as the CUDA tactics were measured


@pytest.mark.parametrize("steps, kernel, dilation, final", [
    (20, 3, 1, "Relu"), (96, 3, 4, "Relu"), (7, 2, 8, "Relu"), (33, 5, 2, "LeakyRelu"), (20, 3, 2, "Sigmoid")])
def test_blocks_match_onnxruntime(steps, kernel, dilation, final):
    proto = tcn(steps, kernel, dilation, final)
    assert optimized(proto)[1].fired["fuse_conv_final_activation"] == 2
    for _ in range(2):  # fresh inputs each time
        assert_same_as_onnxruntime(proto, {"x": randn(2, steps, FEATURES)}, rtol=1e-4, atol=1e-4)


def test_an_activation_after_one_without_a_residual_is_left_and_says_why():
    """Conv -> Relu -> Sigmoid: the epilogue takes the ReLU; the Sigmoid stays a node of its own."""
    x = helper.make_tensor_value_info("x", F, [1, 4, 6, 6])
    y = helper.make_tensor_value_info("y", F, None)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], name="conv"),
             helper.make_node("Relu", ["c"], ["r"]), helper.make_node("Sigmoid", ["r"], ["y"])]
    proto = make_model(nodes, [x], [y], [("w", randn(4, 4, 3, 3))])
    _, report, ops = optimized(proto)
    assert ops == {"kiln::FusedConv": 1, "Sigmoid": 1}, ops
    assert any("fuse_conv_final_activation at node 'conv'" in r and "without a residual" in r
               for r in report.refused), report.refused
    assert_same_as_onnxruntime(proto, {"x": randn(1, 4, 6, 6)}, rtol=1e-4, atol=1e-5)


@pytest.mark.usefixtures("native_tactics_win")  # the structure, whatever a loaded machine times
def test_zoo_tcn_runs_as_one_native_segment_and_matches_onnxruntime():
    from tests.models.test_zoo import assert_fp32_close, onnxruntime_session

    exported = zoo.export("tcn")
    engine = kiln.build(str(exported.path))
    steps = engine.plan.program.steps
    assert sum(s.op_type == "FusedConv" for s in steps) == 9 and all(s.op_type != "Relu" for s in steps), \
        [(s.op_type, s.tactic) for s in steps]
    segments = [s.fn for s in engine.program.run_steps if isinstance(s.fn, Segment)]
    assert len(segments) == 1 and len(segments[0].members) == len(steps), [(s.op_type, s.tactic) for s in steps]
    session = onnxruntime_session(exported.path)
    for seed in (1, 2):
        feeds = zoo.random_inputs("tcn", exported, seed=seed)
        got = engine.run(feeds)
        for out, want in zip(session.get_outputs(), session.run(None, feeds)):
            assert_fp32_close(got[out.name], want, f"tcn {out.name} (seed {seed})")
