"""kiln's Triton pooling kernels (kiln/kernels/cuda/triton/pool.py) and their tactics (kiln/tactics/cuda/pool.py),
under Triton's interpreter, against torch: F.max_pool2d / F.avg_pool2d / mean where torch expresses the
case, and a tap-by-tap loop on torch tensors where it does not (dilated averages, asymmetric pads).

The same kernels at ResNet-50 / MobileNetV2 sizes on the H200, with timings: tests/gpu/test_triton_pool.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.kernels.tolerances import DTYPES, assert_close
from tests.unit import tactic_check

triton = pytest.importorskip("triton")

from kiln.kernels.cuda.triton import pool  # noqa: E402
from kiln.ops.registry import OpContext, lookup  # noqa: E402
from kiln.plan.spec import StepSpec  # noqa: E402
from kiln.tactics import registry  # noqa: E402

CL = torch.channels_last
LAYOUTS = ["nhwc", "nchw"]


def make(shape, dtype, layout, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * scale).to(dtype)
    return x.contiguous(memory_format=CL) if layout == "nhwc" else x.contiguous()


def naive_pool(x, kernel, strides, pads, dilations, out_hw, mode, count_include_pad=False):
    """The ONNX definition tap by tap, in fp32 on torch: an oracle that shares no code with the kernel.

    pads = [h_begin, w_begin, h_end, w_end]; out_hw from the caller (what ONNX's shape rule gives).
    """
    n, c, h, w = x.shape
    (kh, kw), (sh, sw), (dh, dw) = kernel, strides, dilations
    oh, ow = out_hw
    xf = x.float()
    rows = torch.arange(oh) * sh - pads[0]
    cols = torch.arange(ow) * sw - pads[1]
    acc = torch.full((n, c, oh, ow), -torch.inf if mode == "max" else 0.0)
    count = torch.zeros(oh, ow)
    for i in range(kh):
        for j in range(kw):
            r, q = rows + i * dh, cols + j * dw
            valid = ((r >= 0) & (r < h))[:, None] & ((q >= 0) & (q < w))[None, :]
            tap = xf[:, :, r.clamp(0, h - 1)][:, :, :, q.clamp(0, w - 1)]
            if mode == "max":
                tap = torch.where(valid, tap, -torch.inf)
                acc = torch.where(torch.isnan(tap) | (tap > acc), tap, acc)
            else:
                acc = acc + torch.where(valid, tap, 0.0)
                if count_include_pad:
                    inside = (((r >= -pads[0]) & (r < h + pads[2]))[:, None]
                              & ((q >= -pads[1]) & (q < w + pads[3]))[None, :])
                else:
                    inside = valid
                count = count + inside.float()
    return acc if mode == "max" else acc / count


# ---- MaxPool -----------------------------------------------------------------------------------

# (shape, kernel, strides, symmetric pad, dilation, ceil_mode): torch's max_pool2d expresses all of them.
MAX_CASES = [
    ((2, 70, 11, 13), (3, 3), (2, 2), 1, 1, False),  # ResNet's stem pool, channel and pixel tails
    ((1, 16, 9, 9), (2, 2), (2, 2), 0, 1, False),
    ((2, 8, 10, 7), (3, 2), (1, 2), (1, 1), 1, False),  # non-square window, stride 1 x 2
    ((1, 24, 10, 10), (3, 3), (2, 2), 1, 1, True),  # ceil_mode: one more window, starting inside
    ((1, 5, 6, 6), (2, 2), (2, 2), 1, 1, True),  # ceil_mode where the extra window would start in padding
    ((2, 12, 12, 11), (3, 3), (2, 1), 1, 2, False),  # dilated
    ((1, 3, 5, 5), (5, 5), (1, 1), 2, 1, False),  # window larger than the remaining input
]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", MAX_CASES, ids=lambda c: f"{c[0]}k{c[1]}s{c[2]}p{c[3]}d{c[4]}{'c' if c[5] else ''}")
def test_max_pool_matches_torch(case, dtype, layout):
    shape, kernel, strides, pad, dilation, ceil = case
    pad2 = (pad, pad) if isinstance(pad, int) else pad
    x = make(shape, dtype, layout)
    y = pool.max_pool2d(x, kernel, strides, [*pad2, *pad2], [dilation] * 2, ceil_mode=ceil)
    expected = F.max_pool2d(x.float(), kernel, strides, pad2, dilation, ceil_mode=ceil)
    assert y.shape == expected.shape
    assert y.is_contiguous(memory_format=CL)
    assert torch.equal(y.float(), expected)  # a max is exact: each output is one of the inputs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_max_pool_asymmetric_pads_and_auto_pad(dtype):
    x = make((2, 9, 8, 11), dtype, "nhwc", seed=3)
    pads = [0, 2, 1, 0]  # h_begin, w_begin, h_end, w_end: torch's padding cannot say this
    y = pool.max_pool2d(x, (3, 3), (2, 2), pads)
    expected = naive_pool(x, (3, 3), (2, 2), pads, (1, 1), y.shape[2:], "max")
    assert y.shape[2:] == (4, 6)  # (8 + 0 + 1 - 3) // 2 + 1, (11 + 2 + 0 - 3) // 2 + 1
    assert torch.equal(y.float(), expected)
    # SAME_UPPER: output = ceil(in / stride), the odd pad at the end (kiln.ops.nn's rule).
    y = pool.max_pool2d(x, (3, 3), (2, 2), auto_pad="SAME_UPPER")
    ref = lookup("MaxPool", "").fn(OpContext("m", "MaxPool"), x.float(), auto_pad="SAME_UPPER", kernel_shape=[3, 3],
                                   strides=[2, 2])
    assert y.shape == ref.shape == (2, 9, 4, 6)
    assert torch.equal(y.float(), ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_max_pool_propagates_nan_and_infinities_like_torch(dtype):
    x = make((1, 20, 8, 8), dtype, "nhwc", seed=1)
    x[0, 3, 2, 2] = float("nan")
    x[0, 4, 0, 0] = float("inf")
    x[0, 5] = float("-inf")  # a whole channel of -inf: the max is -inf, not the padding's stand-in
    x[0, 6, 5, 5] = float("nan")
    x[0, 6, 5, 6] = float("inf")  # NaN next to +inf in one window: NaN wins in torch
    y = pool.max_pool2d(x, (3, 3), (2, 2), [1, 1, 1, 1])
    expected = F.max_pool2d(x.float(), 3, 2, 1)
    assert torch.isnan(expected).any() and torch.isinf(expected).any()
    torch.testing.assert_close(y.float(), expected, rtol=0, atol=0, equal_nan=True)


def test_max_pool_tile_configs_and_strided_input():
    """Small explicit tiles (many programs, tails on both axes) and a non-dense view as input."""
    base = make((2, 40, 14, 18), torch.float32, "nhwc", seed=5)
    x = base[:, 3:36, 1:, ::2]  # channels offset, cropped rows, every other column: no dense layout
    expected = F.max_pool2d(x, 3, 2, 1)
    for config in (pool.PoolConfig(16, 16), pool.PoolConfig(32, 8, num_warps=2), pool.PoolConfig(64, 64)):
        assert torch.equal(pool.max_pool2d(x, (3, 3), (2, 2), [1, 1, 1, 1], config=config), expected)


# ---- AveragePool -------------------------------------------------------------------------------

AVG_CASES = [  # (shape, kernel, strides, symmetric pad, ceil_mode, count_include_pad)
    ((2, 70, 11, 13), (3, 3), (2, 2), 1, False, False),
    ((2, 70, 11, 13), (3, 3), (2, 2), 1, False, True),
    ((1, 24, 10, 10), (3, 3), (2, 2), 1, True, False),  # ceil tail: never counted
    ((1, 24, 10, 10), (3, 3), (2, 2), 1, True, True),  # ceil tail with count_include_pad: pads counted, tail not
    ((1, 5, 7, 6), (2, 2), (2, 2), 0, True, True),
    ((3, 16, 7, 7), (7, 7), (1, 1), 0, False, False),  # a global pool written as AveragePool
    ((1, 8, 9, 9), (3, 2), (1, 1), (1, 1), False, True),
]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", AVG_CASES, ids=lambda c: f"{c[0]}k{c[1]}s{c[2]}p{c[3]}{'c' if c[4] else ''}"
                         f"{'i' if c[5] else ''}")
def test_avg_pool_matches_torch(case, dtype, layout):
    shape, kernel, strides, pad, ceil, include = case
    pad2 = (pad, pad) if isinstance(pad, int) else pad
    x = make(shape, dtype, layout, seed=2)
    y = pool.avg_pool2d(x, kernel, strides, [*pad2, *pad2], ceil_mode=ceil, count_include_pad=include)
    expected = F.avg_pool2d(x.float(), kernel, strides, pad2, ceil_mode=ceil, count_include_pad=include)
    assert y.shape == expected.shape and y.is_contiguous(memory_format=CL)
    assert_close(y, expected, dtype)


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_avg_pool_dilated_and_asymmetric(dtype, include):
    x = make((2, 11, 13, 12), dtype, "nhwc", seed=4)
    pads, dilations = [2, 0, 1, 3], (2, 3)
    y = pool.avg_pool2d(x, (3, 2), (2, 1), pads, dilations, count_include_pad=include)
    expected = naive_pool(x, (3, 2), (2, 1), pads, dilations, y.shape[2:], "avg", include)
    ref = lookup("AveragePool", "").fn(OpContext("a", "AveragePool"), x.float(), kernel_shape=[3, 2], strides=[2, 1],
                                       pads=pads, dilations=list(dilations), count_include_pad=int(include))
    assert y.shape == ref.shape
    assert_close(y, expected, dtype)
    torch.testing.assert_close(expected, ref, rtol=1e-6, atol=1e-6)  # the oracle and kiln's op agree


def test_avg_pool_propagates_nan():
    x = make((1, 4, 6, 6), torch.float16, "nhwc")
    x[0, 1, 3, 3] = float("nan")
    y = pool.avg_pool2d(x, (3, 3), (2, 2), [1, 1, 1, 1])
    expected = F.avg_pool2d(x.float(), 3, 2, 1, count_include_pad=False)
    assert torch.isnan(expected).sum() == torch.isnan(y).sum() > 0
    assert_close(y, expected, torch.float16, equal_nan=True)


# ---- the mean over H, W ------------------------------------------------------------------------

@pytest.mark.parametrize("keepdims", [True, False])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(2, 70, 7, 7), (3, 5, 1, 1), (1, 130, 9, 15), (2, 64, 1, 9)], ids=str)
def test_mean_hw_matches_torch(shape, dtype, layout, keepdims):
    x = make(shape, dtype, layout, seed=6, scale=3.0)
    y = pool.mean_hw(x, keepdims)
    expected = x.float().mean(dim=(2, 3), keepdim=keepdims)
    assert y.shape == expected.shape
    assert_close(y, expected, dtype)


def test_mean_hw_non_dense_view_and_nan():
    base = make((2, 48, 10, 12), torch.float32, "nhwc", seed=7)
    x = base[:, 5:40, ::3, 1:]  # rows strided: h and w cannot be walked as one flat index
    assert x.stride(2) != x.shape[3] * x.stride(3)
    torch.testing.assert_close(pool.mean_hw(x), x.mean(dim=(2, 3), keepdim=True), rtol=1e-5, atol=1e-6)
    x = base.clone()
    x[1, 7, 4, 4] = float("nan")
    y = pool.mean_hw(x, False)
    torch.testing.assert_close(y, x.mean(dim=(2, 3)), rtol=1e-5, atol=1e-6, equal_nan=True)
    assert torch.isnan(y[1, 7]) and torch.isnan(y).sum() == 1


def test_kernels_refuse_what_they_do_not_compute():
    with pytest.raises(ValueError, match="4-D"):
        pool.max_pool2d(torch.randn(2, 3, 8), (3,))
    with pytest.raises(TypeError, match="float16"):
        pool.mean_hw(torch.ones(1, 2, 3, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="empty spatial"):
        pool.mean_hw(torch.ones(1, 2, 0, 3))


# ---- the tactics -------------------------------------------------------------------------------

def make_step(op_type: str, n_inputs: int, n_outputs: int = 1, opset: int = 21, **attributes) -> StepSpec:
    return tactic_check.make_step(op_type, "", n_inputs, n_outputs, opset, **attributes)


run_tactic, reason = tactic_check.run_against_reference, tactic_check.reason


def test_pool_tactics_are_registered_channels_last():
    for name, op in (("cuda.pool.max.triton", "MaxPool"), ("cuda.pool.avg.triton", "AveragePool"),
                     ("cuda.reduce_mean_hw.triton", "ReduceMean"),
                     ("cuda.reduce_mean_hw.triton.global_average_pool", "GlobalAveragePool")):
        tactic = registry.get(name)
        assert tactic is not None and tactic.op_type == op and tactic.device == "cuda"
        assert tactic.layout == "channels_last"
        assert tactic in registry.candidates(op, "", "cuda", opt_level=2)


def test_importing_the_pool_tactics_does_not_import_triton():
    """The registry imports every device's tactics, also on a CPU-only deployment without triton."""
    code = "import sys, kiln.tactics.cuda.pool; assert 'triton' not in sys.modules, 'triton imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_max_pool_tactic(dtype):
    step = make_step("MaxPool", 1, kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], ceil_mode=0)
    y = run_tactic("cuda.pool.max.triton", step, [make((2, 20, 9, 9), dtype, "nchw")])
    assert y.is_contiguous(memory_format=CL)  # the next NHWC conv takes it as it is


@pytest.mark.parametrize("attributes", [
    {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "ceil_mode": 1, "count_include_pad": 1},
    {"kernel_shape": [2, 3], "strides": [1, 2], "pads": [0, 1, 1, 0], "dilations": [2, 1]},
    {"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "SAME_LOWER", "count_include_pad": 1},
], ids=["ceil_include", "dilated_asym", "same_lower"])
def test_avg_pool_tactic(attributes):
    run_tactic("cuda.pool.avg.triton", make_step("AveragePool", 1, opset=19, **attributes),
               [make((2, 20, 9, 10), torch.float16, "nchw")])


@pytest.mark.parametrize("keepdims", [0, 1])
def test_reduce_mean_tactic_axes_as_input_and_attribute(keepdims):
    x = make((2, 40, 7, 7), torch.float16, "nchw", scale=2.0)
    step = make_step("ReduceMean", 2, opset=18, keepdims=keepdims)
    run_tactic("cuda.reduce_mean_hw.triton", step, [x, torch.tensor([-2, -1])], constant={1})
    step = make_step("ReduceMean", 1, opset=13, axes=[3, 2], keepdims=keepdims)
    run_tactic("cuda.reduce_mean_hw.triton", step, [x])


def test_global_average_pool_tactic():
    x = make((3, 33, 5, 6), torch.bfloat16, "nchw")
    run_tactic("cuda.reduce_mean_hw.triton.global_average_pool", make_step("GlobalAveragePool", 1), [x])


def test_unsupported_layers_say_why():
    x3 = torch.randn(2, 8, 9)
    x4 = torch.randn(2, 8, 9, 9)
    max_step = make_step("MaxPool", 1, kernel_shape=[3, 3])
    assert "4-D" in reason("cuda.pool.max.triton", max_step, [x3])
    assert "Indices" in reason("cuda.pool.max.triton", make_step("MaxPool", 1, n_outputs=2, kernel_shape=[3, 3]),
                               [x4])
    assert "taps" in reason("cuda.pool.avg.triton", make_step("AveragePool", 1, kernel_shape=[9, 9]), [x4])
    assert "empty output" in reason("cuda.pool.max.triton", make_step("MaxPool", 1, kernel_shape=[11, 3]), [x4])
    assert "takes float16" in reason("cuda.pool.max.triton", max_step, [x4.to(torch.int32)])  # int8/uint8 run (8-bit max)
    mean = make_step("ReduceMean", 2, opset=18)
    assert "run time" in reason("cuda.reduce_mean_hw.triton", mean, [x4, torch.tensor([2, 3])])
    assert "two axes" in reason("cuda.reduce_mean_hw.triton", mean, [x4, torch.tensor([1, 2, 3])], constant={1})
    assert "not (2, 3)" in reason("cuda.reduce_mean_hw.triton", make_step("ReduceMean", 1, opset=13, axes=[1, 2]),
                                  [x4])
    assert "every axis" in reason("cuda.reduce_mean_hw.triton", make_step("ReduceMean", 1, opset=18), [x4])
    assert "empty spatial" in reason("cuda.reduce_mean_hw.triton.global_average_pool",
                                     make_step("GlobalAveragePool", 1), [torch.randn(1, 4, 0, 3)])
    # Axes values arrive with the weights: prepare refuses the wrong ones (the autotuner drops the candidate).
    with pytest.raises(ValueError, match="not \\(2, 3\\)"):
        registry.get("cuda.reduce_mean_hw.triton").prepare(mean, [None, torch.tensor([1, 3])], torch.device("cpu"))


# ---- inside an engine --------------------------------------------------------------------------

class _PoolNet(torch.nn.Module):
    """A ResNet-style stem and head: conv, MaxPool 3x3/2, conv, AveragePool (ceil), global mean, linear."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 16, 3, padding=1)
        self.pool1 = torch.nn.MaxPool2d(3, 2, 1)
        self.conv2 = torch.nn.Conv2d(16, 24, 3, padding=1)
        self.pool2 = torch.nn.AvgPool2d(3, 2, 1, ceil_mode=True, count_include_pad=False)
        self.head = torch.nn.Linear(24, 10)

    def forward(self, x):
        y = self.pool1(torch.relu(self.conv1(x)))
        y = self.pool2(torch.relu(self.conv2(y)))
        return self.head(torch.nn.functional.adaptive_avg_pool2d(y, 1).flatten(1))


def test_engine_with_pool_tactics_standing_in_for_cpu_ones(tmp_path, monkeypatch):
    """Build-time search and runtime, end to end, with the CUDA tactics as if this CPU were the device."""
    import onnxruntime as ort

    import kiln

    if type(pool._pool2d_kernel).__name__ != "InterpretedFunction":
        pytest.skip("kiln's Triton kernels were imported compiled (TRITON_INTERPRET unset at import)")
    tactic_check.cuda_tactics_on_cpu(monkeypatch, lambda name: not name.startswith("cuda.attention"))
    torch.manual_seed(0)
    path = tmp_path / "poolnet.onnx"
    torch.onnx.export(_PoolNet().eval(), (torch.randn(2, 3, 12, 12),), str(path), dynamo=True,
                      input_names=["x"], output_names=["y"])
    engine = kiln.build(str(path), device="cpu", tactics=["cuda"], tuning_runs=3)
    layers = engine.plan.header["tactics"]["layers"]
    _tried, checked = tactic_check.tuned_candidates(engine)  # checked: passed the check, then timed
    assert {"cuda.pool.max.triton", "cuda.pool.avg.triton", "cuda.reduce_mean_hw.triton"} <= checked

    # Force the pool tactics and the NHWC convs (on CPU the interpreter never wins the timing):
    # the layers hand each other channels-last tensors, as they will on the GPU.
    program = engine.plan.program
    forced = set()
    for step in program.steps:
        timed = [n for n, note in layers.get(step.name, {}).get("candidates", {}).items()
                 if n.startswith(("cuda.pool.", "cuda.reduce_mean_hw.", "cuda.conv.")) and isinstance(note, float)]
        if timed:
            step.tactic = timed[0]
            forced.add(timed[0])
    assert {"cuda.pool.max.triton", "cuda.pool.avg.triton", "cuda.reduce_mean_hw.triton"} <= forced
    x = np.random.default_rng(1).standard_normal((2, 3, 12, 12)).astype(np.float32)
    expected = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(kiln.Engine(engine.plan).run({"x": x})["y"], expected, rtol=1e-4, atol=1e-5)
