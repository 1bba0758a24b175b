"""cpu.conv.grouped_native: kiln's AVX2 grouped convolution of few channels a group (kiln/kernels/cpu/grouped.c)
(issue 11: ResNeXt-50 on an AVX2 CPU).

The kernel is built for AVX2 only, so on an AVX-512 machine these tests run in a process under KILN_CPU_ISA=avx2
(test_the_grouped_tests_pass_under_the_avx2_cap); in a process where the kernel is not built for AVX2 the others
skip, and that one runs them.

- The kernel against torch's conv2d in float64 on fresh random inputs: 2, 4, 8, 16 and 32 channels a group (every
  row function), 3x3 / 1x1 / 5x5 / 2x3 kernels, strides 1 and 2, symmetric, asymmetric and no padding, maps narrower
  than one pixel block and wider, a batch of 2, no bias / bias, ReLU or none, 1 and 2 threads (a map past
  PARALLEL_ELEMENTS for the parallel form).
- The tactic in an engine: ResNeXt bottlenecks (1x1 -> grouped 3x3 + ReLU -> 1x1, residual; stride 1 and 2) built
  on it run as one native segment and equal onnxruntime, at the built batch and at others.
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
from kiln.kernels.cpu import grouped, onednn
from kiln.plan.spec import StepSpec
from kiln.runtime.native import Segment
from kiln.tactics.registry import get
from kiln.tactics.tactic import InputMeta
from tests.unit.test_squeeze_excite import onnxruntime_run
from tests.unit.test_tactics_cpu_transformer import assert_passes_under_the_avx2_cap

# float32 sums of at most 32 x 25 products (plus the bias) against float64, inputs and weights of unit scale:
# ~1e-6 relative to the sum of |terms|
RTOL, ATOL = 1e-5, 1e-5

needs_kernel = pytest.mark.skipif(not grouped.available(),
                                  reason="kiln's grouped kernel is not built for AVX2 in this process "
                                         "(test_the_grouped_tests_pass_under_the_avx2_cap runs these where it can)")


def _seed(*case) -> int:
    return zlib.crc32(repr(case).encode())


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, groups: int, stride: int,
               pads: list[int], activation: str) -> torch.Tensor:
    """float64 torch: pads [top, left, bottom, right] applied explicitly (asymmetric ones too), then the epilogue."""
    top, left, bottom, right = pads
    padded = torch.nn.functional.pad(x.double(), (left, right, top, bottom))
    y = torch.nn.functional.conv2d(padded, w.double(), None if b is None else b.double(), stride, 0, 1, groups)
    return y.relu() if activation == "Relu" else y


# (batch, channels, channels a group, height, width, kernel (h, w), stride, pads [t, l, b, r])
CASES = [
    (1, 16, 2, 9, 11, (3, 3), 1, [1, 1, 1, 1]),
    (1, 32, 4, 13, 14, (3, 3), 1, [1, 1, 1, 1]),
    (2, 24, 4, 10, 9, (3, 3), 2, [1, 1, 1, 1]),
    (1, 64, 8, 15, 17, (3, 3), 2, [1, 1, 1, 1]),
    (1, 32, 8, 12, 12, (3, 3), 2, [0, 0, 1, 1]),     # TF "same" at stride 2: the padding below and right only
    (1, 64, 16, 7, 7, (3, 3), 1, [1, 1, 1, 1]),
    (1, 64, 16, 11, 10, (5, 5), 2, [2, 2, 2, 2]),
    (1, 96, 32, 7, 9, (3, 3), 1, [1, 1, 1, 1]),
    (2, 64, 32, 6, 5, (3, 3), 2, [1, 1, 1, 1]),
    (1, 32, 4, 3, 2, (3, 3), 1, [1, 1, 1, 1]),       # narrower than any pixel block: every pixel an edge
    (1, 40, 8, 8, 9, (3, 3), 1, [0, 0, 0, 0]),       # no padding
    (1, 16, 4, 9, 9, (1, 1), 1, [0, 0, 0, 0]),
    (1, 32, 16, 11, 10, (2, 3), 2, [0, 1, 1, 1]),
    (1, 128, 4, 28, 28, (3, 3), 1, [1, 1, 1, 1]),    # 100,352 outputs, past PARALLEL_ELEMENTS: the parallel form
]


@needs_kernel
@pytest.mark.parametrize("activation", ["", "Relu"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[1]}g{c[2]}-{c[3]}x{c[4]}-k{c[5][0]}{c[5][1]}-s{c[6]}")
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_matches_float64_conv2d(case, activation, threads):
    n, c, g, h, wd, (kh, kw), stride, pads = case
    rng = np.random.default_rng(_seed(case, activation, threads))
    w = torch.from_numpy(rng.standard_normal((c, g, kh, kw)).astype(np.float32))
    b = torch.from_numpy(rng.standard_normal(c).astype(np.float32)) if activation != "Relu" or c % 3 else None
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        layer = grouped.GroupedConv(w, b, (n, c, h, wd), [stride, stride], pads, activation)
        for _ in range(2):  # a fresh input each call; the second reuses the per-call path's memory objects
            x = torch.from_numpy(rng.standard_normal((n, c, h, wd)).astype(np.float32))
            want = _reference(x, w, b, c // g, stride, pads, activation)
            got = layer(x.contiguous(memory_format=torch.channels_last))
            assert tuple(got.shape) == tuple(want.shape) and got.is_contiguous(memory_format=torch.channels_last)
            scale = torch.nn.functional.conv2d(torch.nn.functional.pad(x.double().abs(), (pads[1], pads[3], pads[0],
                                               pads[2])), w.double().abs(), None, stride, 0, 1, c // g) + 1.0
            err = ((got.double() - want).abs() / scale).max().item()
            assert err < RTOL, f"{err:.2e} relative to the sum of |terms|"
            if activation == "Relu":
                assert (want == 0).any() and (want > 0).any()
    finally:
        torch.set_num_threads(saved)


def _init(rng: np.random.Generator, name: str, shape: tuple[int, ...], scale: float) -> onnx.TensorProto:
    return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)


def resnext_blocks(c: int = 64, width: int = 64, groups: int = 16, image: int = 14,
                   batch: int | str = 1) -> onnx.ModelProto:
    """Two ResNeXt bottlenecks: stride 1 with the identity residual, then stride 2 with a strided 1x1 shortcut
    (1x1 + ReLU -> grouped 3x3 + ReLU -> 1x1, + shortcut, ReLU)."""
    rng = np.random.default_rng(_seed("resnext_blocks", c, width, groups, image))
    g = width // groups
    inits = []
    nodes = []
    x = "x"
    for i, stride in enumerate((1, 2)):
        inits += [_init(rng, f"a{i}", (width, c, 1, 1), 2 / np.sqrt(c)), _init(rng, f"ab{i}", (width,), 0.3),
                  _init(rng, f"g{i}", (width, g, 3, 3), 2 / np.sqrt(9 * g)), _init(rng, f"gb{i}", (width,), 0.3),
                  _init(rng, f"p{i}", (c, width, 1, 1), 1 / np.sqrt(width)), _init(rng, f"pb{i}", (c,), 0.3)]
        nodes += [helper.make_node("Conv", [x, f"a{i}", f"ab{i}"], [f"a{i}o"]),
                  helper.make_node("Relu", [f"a{i}o"], [f"a{i}r"]),
                  helper.make_node("Conv", [f"a{i}r", f"g{i}", f"gb{i}"], [f"g{i}o"], group=groups, pads=[1, 1, 1, 1],
                                   strides=[stride, stride]),
                  helper.make_node("Relu", [f"g{i}o"], [f"g{i}r"]),
                  helper.make_node("Conv", [f"g{i}r", f"p{i}", f"pb{i}"], [f"p{i}o"])]
        shortcut = x
        if stride != 1:
            inits.append(_init(rng, f"s{i}", (c, c, 1, 1), 1 / np.sqrt(c)))
            nodes.append(helper.make_node("Conv", [x, f"s{i}"], [f"s{i}o"], strides=[stride, stride]))
            shortcut = f"s{i}o"
        nodes += [helper.make_node("Add", [f"p{i}o", shortcut], [f"sum{i}"]),
                  helper.make_node("Relu", [f"sum{i}"], ["y" if i == 1 else f"out{i}"])]
        x = f"out{i}"
    out = -(-image // 2)
    graph = helper.make_graph(nodes, "resnext_blocks",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, c, image, image])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, c, out, out])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.fixture
def grouped_wins(monkeypatch):
    """Every grouped layer on cpu.conv.grouped_native whatever the timings (these tests are about the layer in a
    segment, not the tuner's choice): its measured time halved against the best."""
    measure = autotune.measure

    def favour(fns, device, *args, **kwargs):
        times = measure(fns, device, *args, **kwargs)
        if "cpu.conv.grouped_native" in times:
            times["cpu.conv.grouped_native"] = min(times.values()) / 2
        return times

    monkeypatch.setattr(autotune, "measure", favour)


TACTICS = ["cpu.conv.grouped_native", "cpu.conv.onednn_direct"]


@needs_kernel
@pytest.mark.skipif(not onednn.available(), reason="oneDNN is unavailable (the 1x1 convolutions)")
@pytest.mark.parametrize("groups", [16, 8])  # 4 and 8 channels a group
def test_engine_blocks_in_one_segment_match_onnxruntime(groups, grouped_wins):
    proto = resnext_blocks(groups=groups, batch="N")
    shape = [2, 64, 14, 14]
    engine = kiln.build(proto.SerializeToString(), tactics=TACTICS, shapes={"x": shape})
    steps = engine.plan.program.steps
    grouped_steps = [s for s in steps if s.op_type == "FusedConv" and int(s.attributes.get("group", 1)) > 1]
    assert len(grouped_steps) == 2
    assert all(s.tactic == "cpu.conv.grouped_native" for s in grouped_steps)
    segments = engine.program.segments
    assert len(segments) == 1 and len(segments[0].members) == len(steps)
    assert isinstance(engine.program.run_steps[0].fn, Segment)
    for batch in (2, 3, 1):  # the built batch, then others (a kernel bound per size)
        x = np.random.default_rng(_seed(groups, batch)).standard_normal((batch, *shape[1:])).astype(np.float32)
        want = onnxruntime_run(resnext_blocks(groups=groups, batch=batch), {"x": x})
        np.testing.assert_allclose(engine.run({"x": x})["y"], want, rtol=1e-4, atol=1e-4)


def _conv_step(**attributes) -> StepSpec:
    return StepSpec(name="node_grouped", op_type="FusedConv", domain="kiln", inputs=[], outputs=["y"],
                    attributes={"group": 4, "kernel_shape": [3, 3], "pads": [1, 1, 1, 1], **attributes})


X = InputMeta((1, 16, 9, 9), torch.float32, False)
W = InputMeta((16, 4, 3, 3), torch.float32, True)
B = InputMeta((16,), torch.float32, True)


@needs_kernel
@pytest.mark.parametrize("attributes, inputs, why", [
    ({"activation": "Relu"}, [X, W, B, InputMeta((1, 16, 9, 9), torch.float32, False)],
     "a residual: the grouped convolution kernel adds none"),
    ({"activation": "Relu", "final_activation": "Relu"}, [X, W, B],
     "a final activation: the grouped convolution kernel applies one activation"),
    ({"activation": "Clip"}, [X, W, B], "activation 'Clip': the kernel applies ['', 'Relu']"),
    ({"dilations": [2, 2]}, [X, W, B], "dilations [2, 2]"),
    ({"group": 16}, [X, InputMeta((16, 1, 3, 3), torch.float32, True), B],
     "1 channels a group (weight [16, 1, 3, 3]): the kernel takes [2, 4, 8, 16, 32]"),
    ({"group": 2}, [X, InputMeta((16, 8, 3, 3), torch.float32, True), B], True),
    ({"group": 1}, [X, InputMeta((16, 16, 3, 3), torch.float32, True), B],
     "1 groups of 16 input and 16 output channels: needs groups > 1 and as many in as out"),
    ({"group": 2}, [X, InputMeta((32, 8, 3, 3), torch.float32, True), InputMeta((32,), torch.float32, True)],
     "2 groups of 16 input and 32 output channels: needs groups > 1 and as many in as out"),
    ({"group": 3}, [InputMeta((1, 12, 9, 9), torch.float32, False), InputMeta((12, 4, 3, 3), torch.float32, True)],
     "12 channels: whole vectors of 8 only"),
    ({}, [X, InputMeta((16, 4, 3, 3), torch.float32, False), B],
     "the weight is not a constant float32 4-D tensor of the engine"),
])
def test_tactic_refuses_in_words(attributes, inputs, why):
    assert get("cpu.conv.grouped_native").supports(_conv_step(**attributes), inputs) == why


def test_the_tactic_is_refused_where_the_kernel_is_not_built_for_avx2():
    """An AVX-512 build keeps oneDNN's AVX-512 kernels: the tactic says so rather than failing at prepare."""
    if grouped.available():
        pytest.skip("the kernel is built for AVX2 in this process")
    why = get("cpu.conv.grouped_native").supports(_conv_step(activation="Relu"), [X, W, B])
    assert isinstance(why, str) and why.startswith("kiln's grouped convolution kernel is not built for AVX2 here")


def test_the_grouped_tests_pass_under_the_avx2_cap():
    """This file's tests again in a process under KILN_CPU_ISA=avx2 (the x86-64-v3 build the kernel is for), none
    skipped there."""
    assert_passes_under_the_avx2_cap(__file__, "not avx2_cap and not not_built", skips=False)
