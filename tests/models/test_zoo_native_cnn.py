"""EfficientNet and MobileNetV2 from the zoo as one native segment on the CPU, against onnxruntime (issue 11).

With the squeeze-and-excitation blocks fused (kiln::SqueezeExcite, kiln's C kernel) and EfficientNet's
ceil-mode head pool read as a global mean, every layer of both networks has a tactic that runs inside a
native segment: the whole network is one call of the segment loop. Which tactic the tuner keeps is a
timing decision (on a loaded machine a sample can keep a layer on its default), so the tests give the
native tactics the win (tests/conftest.py's native_tactics_win) and check the structure that makes
possible, then the numbers against onnxruntime on fresh inputs. test_zoo.py checks both models with the
tuner's own choices.
"""

from __future__ import annotations

import pytest

import kiln
from kiln import zoo
from kiln.runtime.native import Segment
from tests.models.test_zoo import assert_matches_onnxruntime

NATIVE = ["cpu.conv.onednn_direct", "cpu.squeeze_excite.native", "cpu.gap", "cpu.pool", "cpu.alias",
          "cpu.gemm.onednn_direct", "cpu.gemm.kiln_packed"]

pytestmark = pytest.mark.usefixtures("native_tactics_win")


@pytest.mark.slow  # a build of each network with the search: 30-60 s on 2 shared cores
@pytest.mark.parametrize("name, blocks", [("efficientnet_tiny", 7), ("mobilenet_v2", 0)])
def test_whole_network_is_one_native_segment_and_matches_onnxruntime(name, blocks):
    exported = zoo.export(name)
    engine = kiln.build(str(exported.path), tactics=NATIVE)
    ops = [s.op_type for s in engine.plan.program.steps]
    assert ops.count("SqueezeExcite") == blocks and "Mul" not in ops and "AveragePool" not in ops
    run_steps = engine.program.run_steps
    assert len(run_steps) == 1 and isinstance(run_steps[0].fn, Segment), \
        [s.ctx.name for s in run_steps if not isinstance(s.fn, Segment)]
    assert len(run_steps[0].fn.members) == len(ops)
    assert_matches_onnxruntime(engine, name, exported)


def test_convnext_keeps_its_native_layers_and_matches_onnxruntime():
    """ConvNeXt's residual Add of two [N, C, H, W] values and its channel LayerNorms: kiln's C kernels take them
    (a segment's 4-D values are NHWC in memory: an Add reading them row-major inside one made the engine 0.036
    off although each layer was exact alone, and the build's check reverted 30 layers; now the Add is
    cpu.add.nhwc, which reads them as NHWC, and the LayerNorms run on [N, H*W, C] rows after
    flatten_channels_last_runs). With the native tactics given the win, nothing is reverted and the engine
    matches onnxruntime."""
    exported = zoo.export("convnext_tiny")
    engine = kiln.build(str(exported.path), timing_cache=None)
    tactics = engine.plan.header["tactics"]
    assert not tactics.get("reverted_layers"), list(tactics.get("reverted_layers", {}))
    chosen = [layer.get("tactic") for layer in tactics["layers"].values()]
    assert "cpu.add.nhwc" in chosen and "cpu.layernormalization.native" in chosen
    assert_matches_onnxruntime(engine, "convnext_tiny", exported)


TRANSFORMER_CNN = ["cpu.conv.onednn_direct", "cpu.relayout.native", "cpu.slice.native", "cpu.concat.nhwc",
                   "cpu.add.nhwc", "cpu.layernorm.native", "cpu.layernormalization.native", "cpu.attention.native",
                   "cpu.gemm.kiln_packed", "cpu.gemm.onednn_direct", "cpu.gap", "cpu.alias"]


@pytest.mark.slow  # a build of each network with the search: 20-60 s on 2 shared cores
@pytest.mark.parametrize("name", ["mobilevit_tiny", "convnext_tiny"])
def test_mobilevit_and_convnext_are_one_native_segment_and_match_onnxruntime(name):
    """MobileViT's unfold/fold and ConvNeXt's channels-last blocks as kiln::Relayout members (issue 11)."""
    exported = zoo.export(name)
    engine = kiln.build(str(exported.path), tactics=TRANSFORMER_CNN)
    ops = [s.op_type for s in engine.plan.program.steps]
    assert "Transpose" not in ops and "Relayout" in ops
    run_steps = engine.program.run_steps
    assert len(run_steps) == 1 and isinstance(run_steps[0].fn, Segment), \
        [(s.ctx.name, s.ctx.op_type) for s in run_steps if not isinstance(s.fn, Segment)]
    assert_matches_onnxruntime(engine, name, exported)
