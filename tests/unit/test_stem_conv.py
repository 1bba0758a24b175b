"""cpu.conv.stem_native: kiln's convolution of <= 4 input channels (kiln/kernels/cpu/stem.c), a network's stem
(issue 11).

- The kernel against torch's conv2d in float64 on fresh random inputs: the zoo's stems (ResNet's 7x7/2 on RGB,
  RegNetY's and MobileNetV2's 3x3/2) and odd sizes: 1, 2 and 4 input channels, output channel counts with a tail
  past the last whole vector of 8 and odd group counts, asymmetric pads, pads as wide as the kernel, maps narrower
  than one block, strides 1 to 3, every epilogue (none, ReLU, Clip), 1 and 2 threads, a batch of 3.
- The tactic in an engine: a stem and the layers after it built on it run as one native segment whose entry is
  the NCHW image read where it lies (no staging copy), and equal onnxruntime, at the built batch and at others.
- What it refuses, in words.
"""

from __future__ import annotations

import zlib

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.builder import autotune
from kiln.kernels.cpu import onednn, stem
from kiln.plan.spec import StepSpec
from kiln.runtime.native import Segment
from kiln.tactics.registry import get
from kiln.tactics.tactic import InputMeta
from tests.unit.test_squeeze_excite import onnxruntime_run

# float32 sums of at most 4·11·11 products (plus the bias) against float64, inputs and weights of unit scale:
# ~1e-6 relative to the sum of |terms|, within 1e-4 relative of the output (the brief's fp32 tolerance)
RTOL, ATOL = 1e-5, 1e-4

pytestmark = pytest.mark.skipif(not stem.available(), reason="kiln's stem kernel is unavailable")


def _seed(*case) -> int:
    return zlib.crc32(repr(case).encode())


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, stride: int, pads: list[int],
               activation: str) -> torch.Tensor:
    """float64 torch: pads [top, left, bottom, right] applied explicitly (asymmetric ones too), then the epilogue."""
    top, left, bottom, right = pads
    padded = torch.nn.functional.pad(x.double(), (left, right, top, bottom))
    y = torch.nn.functional.conv2d(padded, w.double(), None if b is None else b.double(), stride)
    if activation == "Relu":
        return y.relu()
    if activation == "Clip":
        return y.clamp(0.0, 6.0)
    return y


# (batch, in channels, height, width, out channels, kernel (h, w), stride, pads [t, l, b, r])
CASES = [
    (1, 3, 64, 64, 16, (7, 7), 2, [3, 3, 3, 3]),   # ResNet-tiny's stem
    (2, 3, 64, 64, 16, (3, 3), 2, [1, 1, 1, 1]),   # RegNetY-tiny's (batch 2)
    (1, 3, 96, 80, 32, (3, 3), 2, [1, 1, 1, 1]),   # MobileNetV2's shape, smaller map
    (1, 3, 45, 51, 64, (7, 7), 2, [3, 3, 3, 3]),   # ResNet-50's, odd map: 8 groups
    (3, 3, 17, 23, 24, (5, 5), 1, [2, 2, 2, 2]),   # 3 groups: the last alone
    (1, 4, 19, 13, 13, (3, 3), 1, [1, 1, 1, 1]),   # 4 channels, an output tail of 5
    (1, 1, 11, 12, 8, (3, 3), 2, [0, 0, 1, 1]),    # TF "same" at stride 2: padding below and right only
    (1, 2, 9, 7, 20, (7, 7), 2, [3, 3, 3, 3]),     # a map narrower than one block of 6: sides only
    (1, 3, 10, 10, 16, (3, 3), 1, [3, 3, 3, 3]),   # pads wider than the kernel: rows of bias only
    (1, 3, 16, 21, 40, (2, 4), 3, [0, 1, 1, 2]),   # a rectangular kernel, stride 3
    (1, 3, 5, 6, 8, (7, 7), 2, [3, 3, 3, 3]),      # the image smaller than the kernel
    (1, 3, 33, 31, 16, (11, 11), 4, [2, 2, 2, 2]),  # AlexNet-like: the widest kernel and stride taken
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("activation", ["", "Relu", "Clip"])
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_matches_float64_conv2d(case, activation, threads):
    n, c, h, w, o, (kh, kw), s, pads = case
    g = torch.Generator().manual_seed(_seed(case, activation, threads))
    x = torch.randn(n, c, h, w, generator=g)
    weight = torch.randn(o, c, kh, kw, generator=g) * 0.3
    bias = torch.randn(o, generator=g) if activation != "" or o % 2 else None
    conv = stem.StemConv(weight, bias, (n, c, h, w), [s, s], pads, activation, 0.0, 6.0)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = conv(x.contiguous())
    finally:
        torch.set_num_threads(before)
    want = _reference(x, weight, bias, s, pads, activation)
    assert got.shape == want.shape and got.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(got.double(), want, rtol=RTOL, atol=ATOL)


def test_kernel_in_a_parallel_form_matches_float64_conv2d():
    """A map past PARALLEL_ELEMENTS outputs: the bound member's plan splits rows over OpenMP's threads."""
    g = torch.Generator().manual_seed(_seed("parallel"))
    x, weight, bias = torch.randn(1, 3, 130, 98, generator=g), torch.randn(24, 3, 7, 7, generator=g), torch.randn(24)
    conv = stem.StemConv(weight, bias, tuple(x.shape), [2, 2], [3, 3, 3, 3], "Relu")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = conv(x)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got.double(), _reference(x, weight, bias, 2, [3, 3, 3, 3], "Relu"), rtol=RTOL,
                               atol=ATOL)


def test_kernel_rejects_what_it_cannot_run():
    w = torch.randn(16, 3, 3, 3)
    with pytest.raises(ValueError, match="contiguous float32"):
        stem.StemConv(w, None, (1, 3, 8, 8), [1, 1], [1, 1, 1, 1])(
            torch.randn(1, 3, 8, 8).contiguous(memory_format=torch.channels_last))
    with pytest.raises(ValueError, match="5 input channels"):
        stem.StemConv(torch.randn(16, 5, 3, 3), None, (1, 5, 8, 8), [1, 1], [1, 1, 1, 1])
    with pytest.raises(ValueError, match="activation 'SiLU'"):
        stem.StemConv(w, None, (1, 3, 8, 8), [1, 1], [1, 1, 1, 1], "SiLU")
    with pytest.raises(ValueError, match="strides"):
        stem.StemConv(w, None, (1, 3, 8, 8), [5, 5], [1, 1, 1, 1])


def stem_block(batch: int | str = 2, image: int = 20) -> onnx.ModelProto:
    """A stem (7x7/2 on RGB, bias, ReLU), a max pool and a 3x3 convolution: the stem's input is the image."""
    rng = np.random.default_rng(7)

    def const(name, *shape, scale=0.2):
        return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)

    inits = [const("sw", 16, 3, 7, 7), const("sb", 16), const("cw", 8, 16, 3, 3), const("cb", 8)]
    nodes = [helper.make_node("Conv", ["x", "sw", "sb"], ["s"], pads=[3, 3, 3, 3], strides=[2, 2]),
             helper.make_node("Relu", ["s"], ["sr"]),
             helper.make_node("MaxPool", ["sr"], ["p"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("Conv", ["p", "cw", "cb"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["y"])]
    graph = helper.make_graph(nodes, "stem_block",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, image, image])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.fixture
def stem_wins(monkeypatch):
    """The stem on cpu.conv.stem_native whatever the timings (this test is about the layer in a segment, not the
    tuner's choice): its measured time halved against the best."""
    measure = autotune.measure

    def favour(fns, device, *args, **kwargs):
        times = measure(fns, device, *args, **kwargs)
        if "cpu.conv.stem_native" in times:
            times["cpu.conv.stem_native"] = min(times.values()) / 2
        return times

    monkeypatch.setattr(autotune, "measure", favour)


TACTICS = ["cpu.conv.stem_native", "cpu.conv.onednn_direct", "cpu.pool"]


@pytest.mark.skipif(not onednn.available(), reason="oneDNN is unavailable (the layers after the stem)")
def test_engine_stem_in_one_segment_reads_the_image_and_matches_onnxruntime(stem_wins):
    proto = stem_block(batch="N")
    engine = kiln.build(proto.SerializeToString(), tactics=TACTICS, shapes={"x": [2, 3, 20, 20]},
                        in_context=False)  # the in-network timing would re-pick by its own clock
    steps = engine.plan.program.steps
    assert steps[0].tactic == "cpu.conv.stem_native"
    segments = engine.program.segments
    assert len(segments) == 1 and len(segments[0].members) == len(steps)
    assert isinstance(engine.program.run_steps[0].fn, Segment)
    assert segments[0].entry_layouts == ["rows"]  # the NCHW image, read where it lies
    for batch in (2, 3, 1):  # the built batch, then others (a kernel bound per size)
        x = np.random.default_rng(_seed("engine", batch)).standard_normal((batch, 3, 20, 20)).astype(np.float32)
        want = onnxruntime_run(stem_block(batch=batch), {"x": x})
        np.testing.assert_allclose(engine.run({"x": x})["y"], want, rtol=RTOL, atol=ATOL)


def _conv_step(**attributes) -> StepSpec:
    return StepSpec(name="node_stem", op_type="FusedConv", domain="kiln", inputs=[], outputs=["y"],
                    attributes={"kernel_shape": [7, 7], "pads": [3, 3, 3, 3], "strides": [2, 2], **attributes})


X = InputMeta((1, 3, 32, 32), torch.float32, False)
W = InputMeta((16, 3, 7, 7), torch.float32, True)
B = InputMeta((16,), torch.float32, True)


@pytest.mark.parametrize("attributes, inputs, why", [
    ({"activation": "Relu"}, [X, W, B, InputMeta((1, 16, 16, 16), torch.float32, False)],
     "a residual: the stem kernel adds none"),
    ({"activation": "Relu", "final_activation": "Relu"}, [X, W, B],
     "a final activation: the stem kernel applies one activation"),
    ({"activation": "SiLU"}, [X, W, B], "activation 'SiLU': the kernel applies ['', 'Clip', 'Relu']"),
    ({"dilations": [2, 2]}, [X, W, B], "dilations [2, 2]"),
    ({}, [InputMeta((1, 8, 32, 32), torch.float32, False), InputMeta((16, 8, 7, 7), torch.float32, True), B],
     "8 input channels: the stem kernel takes at most 4"),
    ({"group": 3}, [X, InputMeta((15, 1, 7, 7), torch.float32, True), InputMeta((15,), torch.float32, True)],
     "3 groups, weight [15, 1, 7, 7] on 3 channels (needs one group)"),
    ({}, [X, InputMeta((16, 3, 7, 7), torch.float32, False), B],
     "the weight is not a constant float32 4-D tensor of the engine"),
])
def test_tactic_refuses_in_words(attributes, inputs, why):
    assert get("cpu.conv.stem_native").supports(_conv_step(**attributes), inputs) == why


def test_tactic_accepts_a_stem():
    assert get("cpu.conv.stem_native").supports(_conv_step(activation="Relu"), [X, W, B]) is True
