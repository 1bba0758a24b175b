"""cpu.conv.depthwise_native: kiln's depthwise convolution (kiln/kernels/cpu/depthwise.c) (issue 11).

- The kernel against torch's conv2d in float64 on fresh random inputs: 3x3 and 5x5 (the specialised blocks),
  1x1 / 2x3 / 7x7 and stride 3 (the general path), strides 1 and 2, symmetric and asymmetric pads (TF-style "same"
  at stride 2) and none, widths below one pixel block, channel counts with a tail past the last whole vector, every
  epilogue (none, ReLU, Clip as ReLU6, SiLU), 1 and 2 threads (a map past PARALLEL_ELEMENTS for the parallel
  form), and a batch of 2.
- Wide maps (17-37 outputs: 3x3 stride-2 pairs under AVX-512, one row a pass under AVX2) at random odd shapes,
  strides 1 and 2, 3x3 and 5x5, in this process and in one under KILN_CPU_ISA=avx2.
- The tactic in an engine: MobileNetV2's inverted-residual blocks (stride 1 with the residual, stride 2) and an
  EfficientNet block (5x5 + SiLU, squeeze-excitation) built on it run as one native segment and equal
  onnxruntime, at the built batch and at others.
- What it refuses, in words.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.builder import autotune
from kiln.kernels.cpu import cpu_features, depthwise, onednn
from kiln.plan.spec import StepSpec
from kiln.runtime.native import Segment
from kiln.tactics.registry import get
from kiln.tactics.tactic import InputMeta
from tests.unit.test_squeeze_excite import onnxruntime_run

# float32 sums of at most 49 products (plus the bias) against float64, inputs and weights of unit scale: ~1e-6
# relative to the sum of |terms|; SiLU's exp polynomial adds ~3 ulp
RTOL, ATOL = 1e-5, 1e-5

pytestmark = pytest.mark.skipif(not depthwise.available(), reason="kiln's depthwise kernel is unavailable")


def _seed(*case) -> int:
    return zlib.crc32(repr(case).encode())


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, stride: int, pads: list[int],
               activation: str) -> torch.Tensor:
    """float64 torch: pads [top, left, bottom, right] applied explicitly (asymmetric ones too), then the epilogue."""
    top, left, bottom, right = pads
    padded = torch.nn.functional.pad(x.double(), (left, right, top, bottom))
    y = torch.nn.functional.conv2d(padded, w.double(), None if b is None else b.double(), stride, 0, 1, x.shape[1])
    if activation == "Relu":
        return y.relu()
    if activation == "Clip":
        return y.clamp(0.0, 6.0)
    if activation == "SiLU":
        return torch.nn.functional.silu(y)
    return y


# (batch, channels, height, width, kernel (h, w), stride, pads [t, l, b, r])
CASES = [
    (1, 32, 13, 11, (3, 3), 1, [1, 1, 1, 1]),
    (1, 48, 15, 17, (3, 3), 2, [1, 1, 1, 1]),
    (1, 24, 16, 16, (3, 3), 2, [0, 0, 1, 1]),    # TF "same" at stride 2: the padding below and right only
    (2, 40, 9, 10, (5, 5), 1, [2, 2, 2, 2]),
    (1, 72, 14, 13, (5, 5), 2, [2, 2, 2, 2]),
    (1, 64, 7, 7, (5, 5), 1, [2, 2, 2, 2]),      # 7 wide: a block of UMAX/2 (or UMAX) then single pixels
    (1, 32, 5, 3, (3, 3), 1, [1, 1, 1, 1]),      # narrower than any block
    (1, 16, 6, 6, (3, 3), 2, [0, 0, 0, 0]),      # no padding
    (1, 13, 9, 8, (3, 3), 2, [1, 1, 1, 1]),      # a channel tail: the general path
    (1, 37, 8, 9, (5, 5), 1, [2, 2, 2, 2]),
    (1, 20, 9, 9, (1, 1), 1, [0, 0, 0, 0]),      # kernels and strides without a specialised block
    (1, 24, 12, 11, (7, 7), 2, [3, 3, 3, 3]),
    (1, 16, 11, 10, (2, 3), 3, [0, 1, 1, 1]),
    (1, 96, 28, 28, (3, 3), 2, [1, 1, 1, 1]),     # 18,816 outputs, past PARALLEL_ELEMENTS: the parallel form
]


@pytest.mark.parametrize("activation", ["", "Relu", "Clip", "SiLU"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c[1:4])) + f"-k{c[4][0]}{c[4][1]}-s{c[5]}")
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_matches_float64_conv2d(case, activation, threads):
    n, c, h, wd, (kh, kw), stride, pads = case
    rng = np.random.default_rng(_seed(case, activation, threads))
    w = torch.from_numpy(rng.standard_normal((c, 1, kh, kw)).astype(np.float32))
    b = torch.from_numpy(rng.standard_normal(c).astype(np.float32)) if activation != "Relu" else None
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        layer = depthwise.DepthwiseConv(w, b, (n, c, h, wd), [stride, stride], pads, activation, 0.0, 6.0)
        for _ in range(2):  # a fresh input each call; the second reuses the per-call path's memory objects
            x = torch.from_numpy(rng.standard_normal((n, c, h, wd)).astype(np.float32) * 4)  # past ReLU6's 6
            want = _reference(x, w, b, stride, pads, activation)
            got = layer(x.contiguous(memory_format=torch.channels_last))
            assert tuple(got.shape) == tuple(want.shape) and got.is_contiguous(memory_format=torch.channels_last)
            scale = torch.nn.functional.conv2d(torch.nn.functional.pad(x.double().abs(), (pads[1], pads[3], pads[0],
                                               pads[2])), w.double().abs(), None, stride, 0, 1, c) + 1.0
            err = ((got.double() - want).abs() / scale).max().item()
            assert err < RTOL, f"{err:.2e} relative to the sum of |terms|"
            if activation == "Clip":
                assert (want == 6.0).any() and (want == 0.0).any()  # both bounds are exercised
            if activation == "SiLU":
                assert (want < -0.1).any()  # SiLU's negative side: a ReLU would fail
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("threads", [1, 2])
def test_silu_epilogue_within_ulps_of_float64_and_its_specials(threads):
    silu_epilogue_checks(threads)


def silu_epilogue_checks(threads: int) -> None:
    """A 1x1 layer of weight 1 and bias 0 hands x to the epilogue unchanged: exp_poly.h's KILN_VSILU_TABLE (AVX-512)
    or KILN_VSILU (AVX2: test_wide_maps_under_the_avx2_cap runs this there too) on whole channel vectors and
    silu_scalar on the 5 channels past them (37 channels), against test_conv_silu's checks."""
    from tests.unit.test_conv_silu import silu_checks

    c = 37
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)

    def run(x: np.ndarray) -> np.ndarray:
        pixels = -(-len(x) // c)
        flat = np.zeros(pixels * c, np.float32)
        flat[:len(x)] = x
        nhwc = torch.from_numpy(flat.reshape(1, 1, pixels, c))
        layer = depthwise.DepthwiseConv(torch.ones(c, 1, 1, 1), torch.zeros(c), (1, c, 1, pixels), [1, 1],
                                        [0, 0, 0, 0], "SiLU", 0.0, 6.0)
        got = layer(nhwc.permute(0, 3, 1, 2))  # NCHW view of NHWC memory: channels_last
        return got.permute(0, 2, 3, 1).contiguous().numpy().reshape(-1)[:len(x)]

    try:
        silu_checks(run, signed_zero=False)
    finally:
        torch.set_num_threads(saved)


def _random_case(k: int, size: int = 3) -> tuple:
    """A random size x size layer for the two-row pass (block2; 3x3 at stride 2 on maps up to 16 outputs wide (every
    width under AVX-512), 5x5 at strides 1 and 2): odd heights (the last row alone), a map of one or two output rows,
    asymmetric pads, a batch of 2 (a pair never spans two images), channel tails."""
    rng = np.random.default_rng(_seed("pairs", k) if size == 3 else _seed("pairs", size, k))
    stride = int(rng.integers(1, 3))
    pads = [int(p) for p in rng.integers(0, size, 4)]
    h, wd = int(rng.integers(1, 12)), int(rng.integers(1, 34))  # pairs need 4 (AVX2) or 8 (AVX-512) outputs a row
    h, wd = max(h, size - pads[0] - pads[2]), max(wd, size - pads[1] - pads[3])
    return int(rng.integers(1, 3)), int(rng.choice([8, 16, 24, 40, 19])), h, wd, stride, pads


# maps past PARALLEL_ELEMENTS with an odd number of output rows: at 2 threads a thread's run of rows ends in a row
# of its own, or a pair would straddle the split
_LARGE = {3: [(1, 40, 27, 29, 1, [1, 1, 1, 1]), (1, 96, 33, 29, 2, [1, 1, 1, 1]), (2, 24, 25, 30, 1, [0, 1, 2, 1])],
          5: [(1, 48, 27, 25, 1, [2, 2, 2, 2]), (1, 72, 37, 41, 2, [2, 2, 2, 2]), (2, 24, 25, 30, 1, [1, 2, 3, 2])]}


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("k", range(12 + 3))
@pytest.mark.parametrize("size", [3, 5])
def test_two_row_pass_matches_float64_conv2d_at_random_shapes(size, k, threads):
    n, c, h, wd, stride, pads = _random_case(k, size) if k < 12 else _LARGE[size][k - 12]
    activation = "Clip" if size == 3 else "SiLU"  # MobileNetV2's epilogue, EfficientNet-B0's
    rng = np.random.default_rng(_seed("pairs-data", k, threads) if size == 3 else _seed("pairs-data", size, k, threads))
    w = torch.from_numpy(rng.standard_normal((c, 1, size, size)).astype(np.float32))
    b = torch.from_numpy(rng.standard_normal(c).astype(np.float32))
    x = torch.from_numpy(rng.standard_normal((n, c, h, wd)).astype(np.float32) * 4)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        layer = depthwise.DepthwiseConv(w, b, (n, c, h, wd), [stride, stride], pads, activation, 0.0, 6.0)
        got = layer(x.contiguous(memory_format=torch.channels_last))
    finally:
        torch.set_num_threads(saved)
    want = _reference(x, w, b, stride, pads, activation)
    assert tuple(got.shape) == tuple(want.shape), (got.shape, want.shape)
    err = ((got.double() - want).abs() / (1 + want.abs())).max().item()
    assert err < 1e-5, f"{(n, c, h, wd, stride, pads)}: {err:.2e}"


def wide_cases() -> list[tuple]:
    """Random odd-sized maps 17 to 37 outputs wide (past PAIR_S2_MAX_OW: under AVX-512 a 3x3 stride-2 layer takes
    pairs of rows there, under AVX2 one row a pass), 3x3 and 5x5, strides 1 and 2, pads 0 to K - 1 a side, a batch
    of 1 or 2, channel counts with and without a tail, ReLU6 and SiLU: (n, c, h, w, k, stride, pads, activation)."""
    cases = []
    for k in range(8):
        rng = np.random.default_rng(_seed("wide", k))
        size, stride = (3, 5)[k % 4 == 3], 2 if k % 4 else 1
        pads = [int(p) for p in rng.integers(0, size, 4)]
        h, wd = (int(rng.integers(17, 38)) * stride | 1 for _ in range(2))
        cases.append((int(rng.integers(1, 3)), int(rng.choice([16, 24, 40, 19, 48])), h, wd, size, stride, pads,
                      ("Clip", "SiLU")[k % 2]))
    return cases


def wide_errors(threads: int) -> list[tuple[tuple, float]]:
    """(case, error) of every wide_cases() layer against float64 torch at `threads` OpenMP threads; error: |got -
    want| over the sum of |terms| + 1 (test_kernel_matches_float64_conv2d's measure). Run in this process and in one
    under KILN_CPU_ISA=avx2 (the x86-64-v3 build)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    found = []
    try:
        for case in wide_cases():
            n, c, h, wd, size, stride, pads, activation = case
            rng = np.random.default_rng(_seed("wide-data", case, threads))
            w = torch.from_numpy(rng.standard_normal((c, 1, size, size)).astype(np.float32))
            b = torch.from_numpy(rng.standard_normal(c).astype(np.float32))
            x = torch.from_numpy(rng.standard_normal((n, c, h, wd)).astype(np.float32) * 4)
            layer = depthwise.DepthwiseConv(w, b, (n, c, h, wd), [stride, stride], pads, activation, 0.0, 6.0)
            got = layer(x.contiguous(memory_format=torch.channels_last))
            want = _reference(x, w, b, stride, pads, activation)
            assert tuple(got.shape) == tuple(want.shape), (case, got.shape, want.shape)
            scale = torch.nn.functional.conv2d(torch.nn.functional.pad(x.double().abs(), (pads[1], pads[3], pads[0],
                                               pads[2])), w.double().abs(), None, stride, 0, 1, c) + 1.0
            found.append((case, ((got.double() - want).abs() / scale).max().item()))
    finally:
        torch.set_num_threads(saved)
    return found


@pytest.mark.parametrize("threads", [1, 2])
def test_wide_maps_match_float64_conv2d(threads):
    bad = [(case, err) for case, err in wide_errors(threads) if not err < RTOL]
    assert not bad, f"{len(bad)} of {len(wide_cases())} off (relative to the sum of |terms|): {bad[:3]}"


_UNDER_AVX2 = r"""
import json
from kiln.kernels.cpu import depthwise
from tests.unit.test_depthwise_native import wide_errors
assert depthwise.lanes() == 8, depthwise.lanes()
from tests.unit.test_depthwise_native import silu_epilogue_checks
silu_epilogue_checks(1)
silu_epilogue_checks(2)
print(json.dumps([[list(map(str, case)), err] for t in (1, 2) for case, err in wide_errors(t)]))
"""


def test_wide_maps_under_the_avx2_cap_match_float64_conv2d():
    """The same layers as an AVX2-only CPU runs them (a process under KILN_CPU_ISA=avx2: 8 lanes, one row a pass at
    stride 2 on these widths), 1 and 2 threads; and the SiLU epilogue's 8-lane form there (KILN_VSILU)."""
    if cpu_features.isa() not in ("avx2", "avx512"):
        pytest.skip("needs an x86 CPU with AVX2")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "KILN_CPU_ISA": "avx2", "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-c", _UNDER_AVX2], env=env, capture_output=True, text=True, timeout=600,
                          cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(rows) == 2 * len(wide_cases())
    bad = [row for row in rows if not row[1] < RTOL]
    assert not bad, f"{len(bad)} of {len(rows)} off: {bad[:3]}"


def test_kernel_rejects_what_it_cannot_run():
    w = torch.ones(8, 1, 3, 3)
    with pytest.raises(ValueError, match="not depthwise"):
        depthwise.DepthwiseConv(torch.ones(8, 2, 3, 3), None, (1, 16, 5, 5), [1, 1], [1, 1, 1, 1])
    with pytest.raises(ValueError, match="dilations"):
        depthwise.DepthwiseConv(w, None, (1, 8, 9, 9), [1, 1], [1, 1, 1, 1], dilations=[2, 2])
    with pytest.raises(ValueError, match="activation 'HardSwish'"):
        depthwise.DepthwiseConv(w, None, (1, 8, 9, 9), [1, 1], [1, 1, 1, 1], "HardSwish")
    with pytest.raises(ValueError, match="1 to 8 taps"):
        depthwise.DepthwiseConv(torch.ones(8, 1, 9, 9), None, (1, 8, 12, 12), [1, 1], [4, 4, 4, 4])
    layer = depthwise.DepthwiseConv(w, None, (1, 8, 9, 9), [1, 1], [1, 1, 1, 1])
    with pytest.raises(ValueError, match="channels-last float32 of the built size"):
        layer(torch.ones(1, 8, 9, 9))  # NCHW


# ---- in an engine --------------------------------------------------------------------------------------------

def _init(rng: np.random.Generator, name: str, shape: tuple[int, ...], scale: float) -> onnx.TensorProto:
    return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)


def mobilenet_v2_blocks(c: int = 16, expand: int = 6, batch: int | str = 1, image: int = 15) -> onnx.ModelProto:
    """Two inverted-residual blocks: (1x1 expand + BN + ReLU6, depthwise 3x3 stride 1 + BN + ReLU6, 1x1 project +
    BN) + x, then the same with a stride-2 depthwise and no residual. The BNs are folded by kiln's passes."""
    rng = np.random.default_rng(_seed("mobilenet_v2_blocks", c, expand, image))
    e = c * expand
    inits, nodes = [], []

    def bn(x: str, y: str, ch: int) -> None:
        names = [f"{y}_{k}" for k in ("g", "b", "m", "v")]
        inits.extend([_init(rng, names[0], (ch,), 0.3), _init(rng, names[1], (ch,), 0.3),
                      _init(rng, names[2], (ch,), 0.3),
                      numpy_helper.from_array((rng.uniform(0.5, 2.0, ch)).astype(np.float32), names[3])])
        nodes.append(helper.make_node("BatchNormalization", [x, *names], [y]))

    def relu6(x: str, y: str) -> None:
        nodes.append(helper.make_node("Clip", [x, "zero", "six"], [y]))

    inits += [numpy_helper.from_array(np.array(0, np.float32), "zero"),
              numpy_helper.from_array(np.array(6, np.float32), "six")]
    source = "x"
    for k, stride in enumerate((1, 2)):
        p = f"b{k}"
        inits += [_init(rng, f"{p}_ew", (e, c, 1, 1), 1 / np.sqrt(c)), _init(rng, f"{p}_dw", (e, 1, 3, 3), 1 / 3),
                  _init(rng, f"{p}_pw", (c, e, 1, 1), 1 / np.sqrt(e))]
        nodes.append(helper.make_node("Conv", [source, f"{p}_ew"], [f"{p}_e"]))
        bn(f"{p}_e", f"{p}_en", e)
        relu6(f"{p}_en", f"{p}_ea")
        nodes.append(helper.make_node("Conv", [f"{p}_ea", f"{p}_dw"], [f"{p}_d"], group=e, pads=[1, 1, 1, 1],
                                      strides=[stride, stride]))
        bn(f"{p}_d", f"{p}_dn", e)
        relu6(f"{p}_dn", f"{p}_da")
        nodes.append(helper.make_node("Conv", [f"{p}_da", f"{p}_pw"], [f"{p}_p"]))
        bn(f"{p}_p", f"{p}_pn", c)
        if stride == 1:
            nodes.append(helper.make_node("Add", [f"{p}_pn", source], [f"{p}_out"]))
            source = f"{p}_out"
        else:
            source = f"{p}_pn"
    nodes.append(helper.make_node("Identity", [source], ["y"]))
    out = -(-image // 2)
    graph = helper.make_graph(nodes, "mnv2_blocks",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, c, image, image])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, c, out, out])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def efficientnet_block_5x5(c: int = 8, expand: int = 6, r: int = 4, batch: int | str = 1,
                           image: int = 13) -> onnx.ModelProto:
    """1x1 expand + SiLU -> depthwise 5x5 stride 2 + SiLU -> SE -> 1x1 project (EfficientNet-B0's stage 3)."""
    rng = np.random.default_rng(_seed("efficientnet_block_5x5", c, image))
    e = c * expand
    inits = [_init(rng, "ew", (e, c, 1, 1), 1 / np.sqrt(c)), _init(rng, "eb", (e,), 0.3),
             _init(rng, "dw", (e, 1, 5, 5), 1 / 5), _init(rng, "db", (e,), 0.3),
             _init(rng, "w1", (r, e, 1, 1), 2 / np.sqrt(e)), _init(rng, "b1", (r,), 0.3),
             _init(rng, "w2", (e, r, 1, 1), 2 / np.sqrt(r)), _init(rng, "b2", (e,), 0.3),
             _init(rng, "pw", (c, e, 1, 1), 1 / np.sqrt(e))]

    def silu(x: str, y: str) -> list[onnx.NodeProto]:
        return [helper.make_node("Sigmoid", [x], [x + "_sig"]), helper.make_node("Mul", [x, x + "_sig"], [y])]

    nodes = [helper.make_node("Conv", ["x", "ew", "eb"], ["e"]), *silu("e", "ea"),
             helper.make_node("Conv", ["ea", "dw", "db"], ["d"], group=e, pads=[2, 2, 2, 2], strides=[2, 2]),
             *silu("d", "da"), helper.make_node("GlobalAveragePool", ["da"], ["s"]),
             helper.make_node("Conv", ["s", "w1", "b1"], ["q"]), *silu("q", "h"),
             helper.make_node("Conv", ["h", "w2", "b2"], ["g0"]), helper.make_node("Sigmoid", ["g0"], ["g"]),
             helper.make_node("Mul", ["da", "g"], ["scaled"]), helper.make_node("Conv", ["scaled", "pw"], ["y"])]
    out = -(-image // 2)
    graph = helper.make_graph(nodes, "b0_block", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                                [batch, c, image, image])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, c, out, out])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.fixture
def depthwise_wins(monkeypatch):
    """Every depthwise layer on cpu.conv.depthwise_native whatever the timings (these tests are about the layer in
    a segment, not the tuner's choice): its measured time halved against the best."""
    measure = autotune.measure

    def favour(fns, device, *args, **kwargs):
        times = measure(fns, device, *args, **kwargs)
        if "cpu.conv.depthwise_native" in times:
            times["cpu.conv.depthwise_native"] = min(times.values()) / 2
        return times

    monkeypatch.setattr(autotune, "measure", favour)


TACTICS = ["cpu.conv.depthwise_native", "cpu.conv.onednn_direct", "cpu.squeeze_excite.native"]


@pytest.mark.skipif(not onednn.available(), reason="oneDNN is unavailable (the 1x1 convolutions)")
@pytest.mark.parametrize("model", ["mobilenet_v2", "efficientnet"])
def test_engine_blocks_in_one_segment_match_onnxruntime(model, depthwise_wins):
    def proto_at(batch):
        return mobilenet_v2_blocks(batch=batch) if model == "mobilenet_v2" else efficientnet_block_5x5(batch=batch)

    proto = proto_at("N")
    shape = [int(d.dim_value) or 2 for d in proto.graph.input[0].type.tensor_type.shape.dim]
    engine = kiln.build(proto.SerializeToString(), tactics=TACTICS, shapes={"x": shape})
    steps = engine.plan.program.steps
    depthwise_steps = [s for s in steps if s.op_type == "FusedConv" and int(s.attributes.get("group", 1)) > 1]
    assert len(depthwise_steps) == (2 if model == "mobilenet_v2" else 1)
    assert all(s.tactic == "cpu.conv.depthwise_native" for s in depthwise_steps)
    segments = engine.program.segments
    assert len(segments) == 1 and len(segments[0].members) == len(steps)
    assert isinstance(engine.program.run_steps[0].fn, Segment)
    for batch in (2, 3, 1):  # the built batch, then others (a kernel bound per size)
        x = np.random.default_rng(_seed(model, batch)).standard_normal((batch, *shape[1:])).astype(np.float32)
        want = onnxruntime_run(proto_at(batch), {"x": x})
        np.testing.assert_allclose(engine.run({"x": x})["y"], want, rtol=RTOL, atol=ATOL)


def _conv_step(**attributes) -> StepSpec:
    return StepSpec(name="node_dw", op_type="FusedConv", domain="kiln", inputs=[], outputs=["y"],
                    attributes={"group": 8, "kernel_shape": [3, 3], "pads": [1, 1, 1, 1], **attributes})


X = InputMeta((1, 8, 9, 9), torch.float32, False)
W = InputMeta((8, 1, 3, 3), torch.float32, True)
B = InputMeta((8,), torch.float32, True)


@pytest.mark.parametrize("attributes, inputs, why", [
    ({"activation": "Clip"}, [X, W, B, InputMeta((1, 8, 9, 9), torch.float32, False)],
     "a residual: the depthwise kernel adds none"),
    ({"activation": "Relu", "final_activation": "Relu"}, [X, W, B],
     "a final activation: the depthwise kernel applies one activation"),
    ({"activation": "HardSwish"}, [X, W, B], "activation 'HardSwish': the kernel applies ['', 'Clip', 'Relu', 'SiLU']"),
    ({"dilations": [2, 2]}, [X, W, B], "dilations [2, 2]"),
    ({"group": 1}, [X, InputMeta((8, 8, 3, 3), torch.float32, True), B],
     "not depthwise: 1 groups, weight [8, 8, 3, 3] on 8 channels (needs C groups, [C, 1, K, K])"),
    ({}, [X, InputMeta((8, 1, 3, 3), torch.float32, False), B],
     "the weight is not a constant float32 4-D tensor of the engine"),
])
def test_tactic_refuses_in_words(attributes, inputs, why):
    assert get("cpu.conv.depthwise_native").supports(_conv_step(**attributes), inputs) == why


def test_tactic_takes_a_depthwise_layer_with_its_epilogue():
    for activation in ("", "Relu", "Clip", "SiLU"):
        assert get("cpu.conv.depthwise_native").supports(_conv_step(activation=activation), [X, W, B]) is True
