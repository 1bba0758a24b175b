"""cpu.conv.onednn_direct (kiln/tactics/cpu/onednn.py) against independent oracles.

Per layer: a float64 torch convolution plus the epilogue written out here (not kiln's op), on
random inputs, over strides, pads (asymmetric too), dilations, groups and depthwise, every
activation the tactic maps to a oneDNN post-op, and a residual before or after it. Whole
engines: ResNet-tiny and MobileNetV2 built with this tactic on every convolution, against
onnxruntime.
"""

from __future__ import annotations

import dataclasses
import platform

import numpy as np
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln import zoo
from kiln.kernels.cpu import onednn, onednn_primitives
from kiln.ops.fused import fused_conv
from kiln.ops.registry import OpContext, lookup
from kiln.plan.spec import ProgramSpec, StepSpec
from kiln.runtime.program import Program
from kiln.builder import autotune
from kiln.tactics import registry
from kiln.tactics.tactic import InputMeta
from tests.unit.oracle import ACTIVATION_ORACLE

NAME = "cpu.conv.onednn_direct"
pytestmark = pytest.mark.skipif(not onednn.available(), reason="libdnnl.so.3 not installed (onednn-cpu-gomp)")

# fp32 kernel vs float64 oracle: |error| <= ATOL + RTOL * max|reference|. A K-long fp32 dot product
# (K = C/groups * kH * kW <= 576 here) rounds to ~1e-6 of its scale; 2e-5 leaves room, an O(1)
# mistake in any index or epilogue fails by orders of magnitude.
RTOL, ATOL = 2e-5, 1e-6



def oracle(x, w, b, r, pads, stride, dilation, group, activation, alpha, beta, after):
    x64 = F.pad(x.double(), [pads[1], pads[3], pads[0], pads[2]])  # ONNX pads: [top, left, bottom, right]
    y = F.conv2d(x64, w.double(), None if b is None else b.double(), stride, 0, dilation, group)
    if r is not None and not after:
        y = y + r.double()
    y = ACTIVATION_ORACLE[activation](y, alpha, beta)
    if r is not None and after:
        y = y + r.double()
    return y


def assert_close(got: torch.Tensor, want64: torch.Tensor) -> None:
    assert got.dtype == torch.float32 and got.shape == want64.shape
    scale = want64.abs().max().item()
    error = (got.double() - want64).abs().max().item()
    assert error <= ATOL + RTOL * scale, f"max abs error {error:.3g} at scale {scale:.3g}"


def prepare(step: StepSpec, inputs: list, constants: list):
    tactic = registry.get(NAME)
    metas = [InputMeta.of(v, c is not None) for v, c in zip(inputs, constants)]
    assert tactic.check(step, metas) is True
    step.tactic, step.tactic_config = NAME, tactic.configure(step, metas)
    return tactic.prepare(step, constants, torch.device("cpu"))


CASES = [  # N, C, H, W, O, k, stride, pads, dilation, group, bias, activation, alpha, beta, residual, after
    (1, 16, 14, 14, 32, 1, 1, [0, 0, 0, 0], 1, 1, True, "", 0.0, 0.0, False, 0),
    (2, 16, 14, 14, 32, 3, 1, [1, 1, 1, 1], 1, 1, True, "Relu", 0.0, 0.0, False, 0),
    (1, 16, 15, 15, 32, 3, 2, [1, 1, 1, 1], 1, 1, True, "Relu", 0.0, 0.0, False, 0),
    (1, 3, 32, 32, 16, 7, 2, [3, 3, 3, 3], 1, 1, True, "Relu", 0.0, 0.0, False, 0),  # ResNet stem
    (1, 32, 14, 14, 32, 3, 1, [1, 1, 1, 1], 1, 32, True, "Clip", 0.0, 6.0, False, 0),  # depthwise + ReLU6
    (1, 24, 16, 16, 24, 3, 2, [1, 1, 1, 1], 1, 24, True, "Clip", 0.0, 6.0, False, 0),  # depthwise, stride 2
    (1, 16, 14, 14, 16, 1, 1, [0, 0, 0, 0], 1, 1, True, "Relu", 0.0, 0.0, True, 0),  # ResNet: relu(conv + x)
    (1, 16, 14, 14, 16, 1, 1, [0, 0, 0, 0], 1, 1, True, "", 0.0, 0.0, True, 1),  # MobileNetV2: conv + x
    (1, 16, 14, 14, 16, 3, 1, [1, 1, 1, 1], 1, 1, True, "SiLU", 0.0, 0.0, True, 0),
    (1, 16, 14, 14, 16, 3, 1, [1, 1, 1, 1], 1, 1, True, "Gelu", 0.0, 0.0, True, 1),  # residual after act
    (1, 16, 14, 14, 16, 3, 1, [1, 1, 1, 1], 1, 4, True, "LeakyRelu", 0.1, 0.0, False, 0),  # grouped
    (1, 16, 14, 14, 16, 3, 1, [1, 1, 1, 1], 1, 1, False, "HardSwish", 0.0, 0.0, False, 0),  # no bias
    (1, 16, 14, 14, 16, 3, 1, [1, 1, 1, 1], 1, 1, True, "HardSigmoid", 0.2, 0.5, False, 0),
    (1, 16, 14, 14, 16, 3, 1, [1, 1, 1, 1], 1, 1, True, "Sigmoid", 0.0, 0.0, False, 0),
    (1, 16, 14, 14, 16, 3, 1, [1, 1, 1, 1], 1, 1, True, "Tanh", 0.0, 0.0, False, 0),
    (1, 16, 14, 14, 16, 3, 1, [1, 1, 1, 1], 1, 1, True, "GeluTanh", 0.0, 0.0, False, 0),
    (1, 16, 14, 14, 16, 3, 1, [2, 2, 2, 2], 2, 1, True, "Relu", 0.0, 0.0, False, 0),  # dilated
    (1, 16, 13, 14, 8, 3, 2, [0, 1, 1, 0], 1, 1, True, "Relu", 0.0, 0.0, False, 0),  # asymmetric pads
    (1, 64, 7, 7, 64, 3, 1, [1, 1, 1, 1], 1, 1, True, "Relu", 0.0, 0.0, True, 0),  # K = 576
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[5]}x{c[5]}s{c[6]}d{c[8]}g{c[9]}-{c[11] or 'none'}"
                                                      f"-r{int(c[14])}{c[15]}")
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_direct_conv_matches_float64_oracle_and_the_registered_op(case, layout):
    n, c, h, w_, o, k, stride, pads, dilation, group, bias, activation, alpha, beta, residual, after = case
    g = torch.Generator().manual_seed(sum(map(hash, map(str, case))) % 2**31)
    x = torch.randn(n, c, h, w_, generator=g)
    if layout == "nhwc":
        x = x.contiguous(memory_format=torch.channels_last)
    w = torch.randn(o, c // group, k, k, generator=g) * (2.0 / (c // group * k * k)) ** 0.5
    b = torch.randn(o, generator=g) if bias else None
    out_hw = [(size + pads[i] + pads[i + 2] - dilation * (k - 1) - 1) // stride + 1 for i, size in enumerate((h, w_))]
    r = torch.randn(n, o, *out_hw, generator=g) if residual else None
    attrs = dict(pads=pads, strides=[stride] * 2, dilations=[dilation] * 2, group=group, activation=activation,
                 alpha=alpha, beta=beta, residual_after_activation=after, kernel_shape=[k, k])
    step = StepSpec("FusedConv", "conv", ["x", "w", "b" if bias else "", "r" if residual else ""], ["y"], attrs,
                    domain="kiln")
    launch = prepare(step, [x, w, b, r], [None, w, b, None])
    ctx = OpContext(name="conv", op_type="FusedConv", domain="kiln")
    got = launch(ctx, x, w, b, r, **attrs)
    assert got.is_contiguous(memory_format=torch.channels_last)  # a conv stack stays NHWC
    assert_close(got, oracle(x, w, b, r, pads, [stride] * 2, [dilation] * 2, group, activation, alpha, beta, after))
    # and the registered op agrees (the autotuner's own check, at its tolerance)
    want = fused_conv(ctx, x, w, b, r, **attrs)
    assert (got - want).abs().max().item() <= 1e-5 + 1e-4 * want.abs().max().item()


def test_other_batch_sizes_and_strided_inputs_run_and_stay_correct():
    g = torch.Generator().manual_seed(7)
    w, b = torch.randn(24, 16, 3, 3, generator=g) * 0.1, torch.randn(24, generator=g)
    attrs = dict(pads=[1, 1, 1, 1], strides=[1, 1], activation="Relu", residual_after_activation=0)
    step = StepSpec("FusedConv", "conv", ["x", "w", "b", "r"], ["y"], attrs, domain="kiln")
    x1, r1 = torch.randn(1, 16, 10, 10, generator=g), torch.randn(1, 24, 10, 10, generator=g)
    launch = prepare(step, [x1, w, b, r1], [None, w, b, None])
    for n in (1, 3, 1):  # a new batch size builds a second primitive; the first is still there
        x = torch.randn(n, 16, 10, 10, generator=g)
        r = torch.randn(n, 24, 10, 10, generator=g)
        got = launch(None, x, w, b, r, **attrs)
        assert_close(got, oracle(x, w, b, r, [1] * 4, [1, 1], [1, 1], 1, "Relu", 0.0, 0.0, False))
    wide = torch.randn(1, 16, 10, 20, generator=g)[..., ::2]  # not contiguous in any layout
    assert_close(launch(None, wide, w, b, r1, **attrs),
                 oracle(wide, w, b, r1, [1] * 4, [1, 1], [1, 1], 1, "Relu", 0.0, 0.0, False))


def test_refuses_what_it_cannot_run():
    tactic = registry.get(NAME)
    x, w = InputMeta((1, 4, 8, 8), torch.float32, False), InputMeta((4, 4, 3, 3), torch.float32, True)
    step = StepSpec("FusedConv", "c", ["x", "w"], ["y"], {"auto_pad": "SAME_UPPER"}, domain="kiln")
    assert "auto_pad" in tactic.check(step, [x, w])
    step.attributes = {}
    assert "constant" in tactic.check(step, [x, InputMeta((4, 4, 3, 3), torch.float32, False)])
    assert "float16" in tactic.check(step, [InputMeta((1, 4, 8, 8), torch.float16, False), w])
    assert "2-D" in tactic.check(step, [InputMeta((1, 4, 8), torch.float32, False), w])
    assert "residual shape" in tactic.check(step, [x, w, InputMeta(None, None, False),
                                                  InputMeta((1, 4, 1, 1), torch.float32, False)])
    step.attributes = {"activation": "SwiGLU"}
    assert "no oneDNN" in tactic.check(step, [x, w])


FINAL_CASES = [  # activation, residual_after_activation, final activation, final alpha, final beta, dilation
    ("Relu", 1, "Relu", 0.0, 0.0, 1),  # a TCN block: relu(relu(conv2(h)) + x)
    ("Relu", 1, "Relu", 0.0, 0.0, 8),
    ("", 0, "LeakyRelu", 0.1, 0.0, 2),
    ("Tanh", 1, "Clip", -0.5, 0.5, 4),
]


@pytest.mark.parametrize("case", FINAL_CASES, ids=lambda c: f"{c[0] or 'none'}-r{c[1]}-{c[2]}-d{c[5]}")
@pytest.mark.parametrize("in_place", [False, True], ids=["binary", "accumulated"])
def test_final_activation_after_the_residual_matches_float64_oracle(case, in_place):
    """A causal dilated 1-D convolution as the segment runs it ([N, C, 1, S], left pads only), its epilogue's second
    activation after the residual add: the residual read as a binary post-op, or accumulated in its own memory (a sum
    post-op between the two eltwise ones)."""
    activation, after, final, alpha, beta, dilation = case
    g = torch.Generator().manual_seed(sum(map(hash, map(str, case))) % 2**31 + in_place)
    n, c, o, steps, k = 2, 24, 32, 37, 3
    pads = [0, (k - 1) * dilation, 0, 0]  # [top, left, bottom, right]: causal
    x = torch.randn(n, c, 1, steps, generator=g).contiguous(memory_format=torch.channels_last)
    w = torch.randn(o, c, 1, k, generator=g) * (2.0 / (c * k)) ** 0.5
    b = torch.randn(o, generator=g)
    r = torch.randn(n, o, 1, steps, generator=g).contiguous(memory_format=torch.channels_last)
    want = ACTIVATION_ORACLE[final](oracle(x, w, b, r, pads, [1, 1], [1, dilation], 1, activation, 0.0, 0.0, after),
                                    alpha, beta)
    attrs = dict(pads=pads, dilations=[1, dilation], activation=activation, residual_after_activation=after,
                 final_activation=final, final_alpha=alpha, final_beta=beta)
    if in_place:
        conv = onednn_primitives.Conv2d(w, b, [n, c, 1, steps], [1, 1], pads, [1, dilation], 1,
                                        onednn.eltwise_for(activation, 0.0, 0.0), True, bool(after),
                                        residual_in_place=True, final=onednn.eltwise_for(final, alpha, beta))
        got = conv.accumulate(x, r.clone())
    else:
        step = StepSpec("FusedConv", "conv", ["x", "w", "b", "r"], ["y"], attrs, domain="kiln")
        got = prepare(step, [x, w, b, r], [None, w, b, None])(None, x, w, b, r, **attrs)
    assert_close(got, want)
    ctx = OpContext(name="conv", op_type="FusedConv", domain="kiln")
    assert_close(fused_conv(ctx, x, w, b, r, **attrs), want)  # the registered op: the autotuner's reference


@pytest.mark.parametrize("name, activation, kernel", [
    ("cpu.conv.onednn_silu", "SiLU", 3), ("cpu.conv.winograd", "Relu", 3), ("cpu.conv.onednn_nhwc", "Relu", 3),
    ("cpu.conv.onednn_1x1", "Relu", 1), ("cpu.conv.onednn_graph", "Relu", 3)])
def test_tactics_with_one_activation_refuse_a_final_one(name, activation, kernel):
    """The FusedConv tactics whose kernels apply one activation say so, rather than drop the second."""
    tactic = registry.get(name)
    x, w = InputMeta((1, 16, 8, 8), torch.float32, False), InputMeta((16, 16, kernel, kernel), torch.float32, True)
    attrs = {"pads": [kernel // 2] * 4, "activation": activation, "residual_after_activation": 1}
    step = StepSpec("FusedConv", "c", ["x", "w"], ["y"], attrs, domain="kiln")
    if not tactic.available() or tactic.check(step, [x, w]) is not True:
        pytest.skip(f"{name} does not take this layer here even without a final activation")
    step.attributes["final_activation"] = "Relu"
    assert "final activation" in tactic.check(step, [x, w])


def test_engine_without_the_library_runs_the_registered_op(monkeypatch):
    """An engine naming the tactic, loaded where libdnnl is missing, still runs (the default op)."""
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(8, 4, 3, 3, generator=g), torch.randn(8, generator=g)
    attrs = dict(pads=[1, 1, 1, 1], activation="Relu")
    step = StepSpec("FusedConv", "conv", ["x", "w", "b"], ["y"], attrs, domain="kiln", tactic=NAME,
                    tactic_config={"input_size": [1, 4, 6, 6], "residual": False})
    tactic = registry.get(NAME)
    monkeypatch.setattr(onednn, "_LIBRARY", None)  # tactic.available is onednn.available: it reads these
    monkeypatch.setattr(onednn, "_LOAD_ERROR", "libdnnl.so.3 not found (simulated)")
    assert not onednn.available()
    assert "not available" in tactic.check(step, [InputMeta((1, 4, 6, 6), torch.float32, False),
                                                     InputMeta((8, 4, 3, 3), torch.float32, True)])
    launch = registry.launch_for(step, fused_conv, [None, w, b], torch.device("cpu"))
    assert launch is fused_conv


def _ort(path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("name", ["resnet_tiny", "mobilenet_v2"])
def test_whole_engine_on_direct_convolutions_matches_onnxruntime(name, monkeypatch):
    # The timings decide nothing here (a shared CPU makes them noisy): this tactic "wins" every
    # layer it supports; the autotuner still checks each layer and the whole engine against the
    # reference before it keeps the choice.
    ours = (NAME, "cpu.pool.onednn", "cpu.gap.onednn")
    monkeypatch.setattr(autotune, "measure", lambda fns, device, runs=10, **_: {
        k: 0.0 if k.startswith(ours) else 1.0 for k in fns})
    exported = zoo.export(name)
    engine = kiln.build(str(exported.path), tactics=list(ours))
    assert "reverted" not in engine.plan.header["tactics"]
    convs = [s for s in engine.plan.program.steps if s.op_type == "FusedConv"]
    assert convs and all(s.tactic == NAME for s in convs), \
        f"{sum(s.tactic == NAME for s in convs)} of {len(convs)} convolutions on {NAME}"
    pools = [s for s in engine.plan.program.steps if s.op_type in ("MaxPool", "GlobalAveragePool", "ReduceMean")]
    assert pools and all(s.tactic.startswith(ours[1:]) for s in pools), [(s.op_type, s.tactic) for s in pools]
    session = _ort(exported.path)
    for seed in (1, 2):
        feeds = zoo.random_inputs(name, exported, seed=seed)
        got = engine.run(feeds)
        for out, want in zip(session.get_outputs(), session.run(None, feeds)):
            value = np.asarray(got[out.name])
            scale = max(1.0, float(np.abs(want).max()))
            np.testing.assert_allclose(value, want, rtol=1e-3, atol=1e-4 * scale, err_msg=f"{name} {out.name}")


# ---- pooling -----------------------------------------------------------------------------------

POOL_CASES = [  # op, N, C, H, W, kernel, stride, pads, dilation, count_include_pad
    ("MaxPool", 1, 16, 56, 56, 3, 2, [1, 1, 1, 1], 1, 0),  # ResNet's stem pooling
    ("MaxPool", 2, 8, 13, 11, 2, 2, [0, 0, 0, 0], 1, 0),
    ("MaxPool", 1, 8, 12, 12, 3, 1, [0, 1, 1, 0], 2, 0),  # asymmetric pads, dilated
    ("AveragePool", 1, 16, 14, 14, 3, 1, [1, 1, 1, 1], 1, 0),  # padding not counted
    ("AveragePool", 1, 16, 14, 14, 3, 2, [1, 1, 1, 1], 1, 1),  # padding counted
    ("AveragePool", 1, 16, 7, 7, 7, 1, [0, 0, 0, 0], 1, 0),
]


def pool_oracle(op, x, kernel, stride, pads, dilation, count_include_pad):
    """Every window written out in float64 with the padding explicit (-inf for max, 0 for average)."""
    x64 = x.double()
    fill = float("-inf") if op == "MaxPool" else 0.0
    padded = F.pad(x64, [pads[1], pads[3], pads[0], pads[2]], value=fill)
    ones = F.pad(torch.ones_like(x64[:1, :1]), [pads[1], pads[3], pads[0], pads[2]])  # 1 inside, 0 in the padding
    span = dilation * (kernel - 1) + 1
    oh, ow = (padded.shape[2] - span) // stride + 1, (padded.shape[3] - span) // stride + 1
    out = torch.empty(x.shape[0], x.shape[1], oh, ow, dtype=torch.float64)
    for i in range(oh):
        for j in range(ow):
            rows = slice(i * stride, i * stride + span, dilation)
            cols = slice(j * stride, j * stride + span, dilation)
            window = padded[:, :, rows, cols]
            if op == "MaxPool":
                out[:, :, i, j] = window.amax(dim=(2, 3))
            else:
                count = kernel * kernel if count_include_pad else ones[:, :, rows, cols].sum()
                out[:, :, i, j] = window.sum(dim=(2, 3)) / count
    return out


@pytest.mark.parametrize("case", POOL_CASES, ids=lambda c: f"{c[0]}-k{c[5]}s{c[6]}d{c[8]}p{''.join(map(str, c[7]))}"
                                                           f"-inc{c[9]}")
def test_pooling_matches_float64_oracle_and_the_registered_op(case):
    op, n, c, h, w, kernel, stride, pads, dilation, count_include_pad = case
    g = torch.Generator().manual_seed(sum(map(hash, map(str, case))) % 2**31)
    x = torch.randn(n, c, h, w, generator=g).contiguous(memory_format=torch.channels_last)
    attrs = dict(kernel_shape=[kernel, kernel], strides=[stride] * 2, pads=pads, dilations=[dilation] * 2)
    if op == "AveragePool":
        attrs["count_include_pad"] = count_include_pad
    step = StepSpec(op, "pool", ["x"], ["y"], attrs)
    name = f"cpu.pool.onednn.{op}"
    tactic = registry.get(name)
    metas = [InputMeta.of(x, False)]
    assert tactic.check(step, metas) is True
    step.tactic, step.tactic_config = name, tactic.configure(step, metas)
    launch = tactic.prepare(step, [None], torch.device("cpu"))
    ctx = OpContext(name="pool", op_type=op, domain="", num_outputs=1)
    got = launch(ctx, x, **attrs)
    assert got.is_contiguous(memory_format=torch.channels_last)
    assert_close(got, pool_oracle(op, x, kernel, stride, pads, dilation, count_include_pad))
    want = lookup(op, "").fn(ctx, x, **attrs)
    assert (got - want).abs().max().item() <= 1e-6 * max(1.0, want.abs().max().item())
    assert_close(launch(ctx, x[:1].contiguous(), **attrs),  # another batch size, NCHW input
                 pool_oracle(op, x[:1], kernel, stride, pads, dilation, count_include_pad))


def test_pooling_refuses_what_it_cannot_run():
    tactic = registry.get("cpu.pool.onednn.MaxPool")
    x = [InputMeta((1, 4, 8, 8), torch.float32, False)]
    # ceil_mode runs for a max (its tail as more end padding: tests/unit/test_pool_ceil_mode.py), not for an average
    assert tactic.check(StepSpec("MaxPool", "p", ["x"], ["y"], {"kernel_shape": [3, 3], "strides": [2, 2],
                                                                 "ceil_mode": 1}), x) is True
    average = registry.get("cpu.pool.onednn.AveragePool")
    assert "ceil_mode" in average.check(StepSpec("AveragePool", "p", ["x"], ["y"], {"kernel_shape": [3, 3],
                                                                                     "strides": [2, 2],
                                                                                     "ceil_mode": 1}), x)
    assert "Indices" in tactic.check(StepSpec("MaxPool", "p", ["x"], ["y", "i"], {"kernel_shape": [2, 2]}), x)
    assert "2-D" in tactic.check(StepSpec("MaxPool", "p", ["x"], ["y"], {"kernel_shape": [2, 2, 2]}),
                                 [InputMeta((1, 4, 8, 8, 8), torch.float32, False)])


@pytest.mark.parametrize("op", ["GlobalAveragePool", "ReduceMean"])
def test_global_average_matches_float64_mean(op):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 40, 7, 9, generator=g).contiguous(memory_format=torch.channels_last)
    axes = torch.tensor([-2, -1])
    step = StepSpec(op, "gap", ["x", "axes"] if op == "ReduceMean" else ["x"], ["y"], {"keepdims": 1}
                    if op == "ReduceMean" else {})
    tactic = registry.get(f"cpu.gap.onednn.{op}")
    inputs, constants = ([x, axes], [None, axes]) if op == "ReduceMean" else ([x], [None])
    metas = [InputMeta.of(v, c is not None) for v, c in zip(inputs, constants)]
    assert tactic.check(step, metas) is True
    step.tactic_config = tactic.configure(step, metas)
    launch = tactic.prepare(step, constants, torch.device("cpu"))
    got = launch(None, *inputs, **step.attributes)
    assert_close(got, x.double().mean(dim=(2, 3), keepdim=True))
    if op == "ReduceMean":  # axes that are not H, W: the candidate fails to prepare (the autotuner drops it)
        with pytest.raises(ValueError, match="spatial"):
            tactic.prepare(step, [None, torch.tensor([1, 2])], torch.device("cpu"))
        step.attributes = {"keepdims": 0}  # a classifier head's mean: [N, C], the same bytes as [N, C, 1, 1]
        assert tactic.check(step, metas) is True
        launch = tactic.prepare(step, constants, torch.device("cpu"))
        assert launch.native.output_size == (2, 40)
        assert_close(launch(None, *inputs, **step.attributes), x.double().mean(dim=(2, 3)))


# ---- the residual accumulated in place -----------------------------------------------------------

def _residual_program(share: str) -> tuple[ProgramSpec, dict, torch.Tensor]:
    """x -> r = relu(x) -> [alias] -> y = relu(conv(x) + b + r) -> out, where r is afterwards
    "none": dead; "later": read again by a final Add; "alias": dead under its name, but an Identity
    made a second name for the same tensor, read by the final Add; "view": a Reshape view of r is
    read by the final Add."""
    g = torch.Generator().manual_seed(11)
    weights = {"w": torch.randn(8, 8, 3, 3, generator=g) * 0.2, "b": torch.randn(8, generator=g)}
    attrs = {"pads": [1, 1, 1, 1], "activation": "Relu", "kernel_shape": [3, 3]}
    steps = [StepSpec("Relu", "relu", ["x"], ["r"])]
    keep = {"none": "r", "later": "r", "alias": "r2", "view": "r2"}[share]
    if share == "alias":
        steps.append(StepSpec("Identity", "alias", ["r"], ["r2"]))
    if share == "view":
        steps.append(StepSpec("Reshape", "view", ["r", "shape"], ["r2"]))
        weights["shape"] = torch.tensor([1, 8, 6, 6])
    steps.append(StepSpec("FusedConv", "conv", ["x", "w", "b", "r"], ["y"], attrs, domain="kiln", tactic=NAME,
                          tactic_config={"input_size": [1, 8, 6, 6], "residual": True}))
    outputs = ["y"]
    if share != "none":
        steps.append(StepSpec("Add", "add", ["y", keep], ["out"]))
        outputs = ["out"]
    constants = {k: k for k in weights}
    return ProgramSpec(["x"], outputs, steps, constants), weights, torch.randn(1, 8, 6, 6, generator=g)


@pytest.mark.parametrize("share", ["none", "later", "alias", "view"])
def test_residual_is_overwritten_only_when_nothing_else_reads_it(share, monkeypatch):
    accumulated = []
    original = onednn_primitives.Conv2d.accumulate
    monkeypatch.setattr(onednn_primitives.Conv2d, "accumulate", lambda self, x, r: accumulated.append(1) or original(self, x, r))
    spec, weights, x = _residual_program(share)
    reference = ProgramSpec(spec.inputs, spec.outputs, [dataclasses.replace(s, tactic="", tactic_config={})
                                                       for s in spec.steps], spec.constants)
    x_nhwc = x.contiguous(memory_format=torch.channels_last)
    with torch.inference_mode():
        want = Program(reference, weights).run([x_nhwc.clone()])[0]
        got = Program(spec, weights).run([x_nhwc.clone()])[0]
    assert_close(got, want.double())
    assert accumulated == ([1] if share == "none" else []), "in place exactly when the residual is dead and unshared"


def test_a_second_openmp_runtime_makes_the_library_unavailable(monkeypatch):
    """libdnnl resolving libgomp to another file than torch's (CUDA wheels rename theirs) would run
    two OpenMP pools side by side: the tactics then stay off."""
    monkeypatch.setattr(onednn, "_LIBRARY", None)
    monkeypatch.setattr(onednn, "_LOAD_ERROR", None)
    monkeypatch.setattr(onednn, "_openmp_runtimes", lambda: ["/torch/lib/libgomp-a34b3233.so.1",
                                                             "/usr/lib/x86_64-linux-gnu/libgomp.so.1"])
    monkeypatch.setattr(onednn, "_openmp_file", lambda lib: "/usr/lib/x86_64-linux-gnu/libgomp.so.1"
                        if "dnnl" in str(lib._name) else "/torch/lib/libgomp-a34b3233.so.1")
    assert not onednn.available()
    with pytest.raises(onednn.OneDNNError, match="OpenMP runtime is not torch's"):
        onednn.load()


@pytest.mark.parametrize("channels", [8, 256])  # 256: 1 MiB buffers, each on a huge-page mapping of its own
def test_arena_reuses_a_buffer_only_once_nothing_references_it(channels):
    arena = onednn_primitives._Arena()
    shape, strides = (1, channels, 32, 32), (channels * 1024, 1, channels * 32, channels)
    a = arena.empty(shape, strides)
    b = arena.empty(shape, strides)
    assert a.data_ptr() != b.data_ptr()  # both alive: two buffers
    view = a.view(1, -1) if a.is_contiguous() else a.permute(0, 2, 3, 1).reshape(1, -1)
    address = a.data_ptr()
    del a
    c = arena.empty(shape, strides)
    assert c.data_ptr() not in (address, b.data_ptr())  # a's view still reads that memory
    del view
    d = arena.empty((1, 4, 2, 2), (16, 1, 8, 4))  # smaller: fits any free buffer
    assert d.data_ptr() == address
    assert arena.users(d) == 1 and arena.users(torch.zeros(3)) == 1
    e = d[:, :2]
    assert arena.users(d) == 2
    del e


@pytest.mark.parametrize("later", [False, True])
def test_residual_from_the_arena_is_overwritten_only_when_no_view_of_it_lives(later, monkeypatch):
    """r is a direct convolution's output (a view of a pooled buffer); with a Reshape view of it
    read after the residual convolution, the result must not be written over it."""
    accumulated = []
    original = onednn_primitives.Conv2d.accumulate
    monkeypatch.setattr(onednn_primitives.Conv2d, "accumulate", lambda self, x, r: accumulated.append(1) or original(self, x, r))
    g = torch.Generator().manual_seed(12)
    weights = {"w0": torch.randn(8, 8, 1, 1, generator=g) * 0.3, "w": torch.randn(8, 8, 3, 3, generator=g) * 0.2,
               "b": torch.randn(8, generator=g), "shape": torch.tensor([1, 8, 6, 6])}
    config = {"input_size": [1, 8, 6, 6], "residual": False}
    steps = [StepSpec("FusedConv", "conv0", ["x", "w0"], ["r"], {"kernel_shape": [1, 1]}, domain="kiln",
                      tactic=NAME, tactic_config=config)]
    if later:
        steps.append(StepSpec("Reshape", "view", ["r", "shape"], ["r2"]))
    steps.append(StepSpec("FusedConv", "conv", ["x", "w", "b", "r"], ["y"],
                          {"pads": [1, 1, 1, 1], "activation": "Relu", "kernel_shape": [3, 3]}, domain="kiln",
                          tactic=NAME, tactic_config={**config, "residual": True}))
    outputs = ["y"]
    if later:
        steps.append(StepSpec("Add", "add", ["y", "r2"], ["out"]))
        outputs = ["out"]
    spec = ProgramSpec(["x"], outputs, steps, {k: k for k in weights})
    reference = ProgramSpec(spec.inputs, spec.outputs, [dataclasses.replace(s, tactic="", tactic_config={})
                                                       for s in spec.steps], spec.constants)
    x = torch.randn(1, 8, 6, 6, generator=g).contiguous(memory_format=torch.channels_last)
    program = Program(spec, weights)
    with torch.inference_mode():
        want = Program(reference, weights).run([x.clone()])[0]
        got = program.run([x.clone()])[0]
        layer_by_layer = program.with_kernels(lambda i, fn: fn).run([x.clone()])[0]
    assert_close(got, want.double())
    assert_close(layer_by_layer, want.double())
    # layer by layer, the launch accumulates; without the Reshape between them the two
    # convolutions form a native segment (kiln/runtime/native.py), which writes y, the engine's
    # output, to a fresh tensor and reads r with the binary post-op
    assert accumulated == ([] if later else [1])
    assert [s.accumulated for s in program.segments] == ([] if later else [0])


def test_engine_outputs_held_by_the_caller_are_not_reused(monkeypatch, tmp_path):
    """A convolution's output that is the engine's output lives in the arena: a second run must not
    write over the arrays the first run returned."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((8, 4, 3, 3)).astype(np.float32) * 0.3, "w")
    graph = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])], "conv",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 6, 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 6, 6])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    monkeypatch.setattr(autotune, "measure", lambda fns, device, runs=10, **_: {
        k: 0.0 if k == NAME else 1.0 for k in fns})
    engine = kiln.build(model.SerializeToString(), tactics=[NAME])
    assert engine.plan.program.steps[0].tactic == NAME
    x1, x2 = (rng.standard_normal((1, 4, 6, 6)).astype(np.float32) for _ in range(2))
    first = engine.run({"x": x1})["y"]
    kept = np.array(first, copy=True)
    second = engine.run({"x": x2})["y"]
    np.testing.assert_array_equal(np.asarray(first), kept)
    assert not np.allclose(np.asarray(second), kept)


def test_a_preferred_kernel_is_used_when_onednn_has_it_else_its_first_choice():
    w, b = torch.randn(16, 1, 3, 3), torch.randn(16)
    default = onednn_primitives.Conv2d(w, b, [1, 16, 8, 8], [1, 1], [1] * 4, [1, 1], 16, None, False, False)
    missing = onednn_primitives.Conv2d(w, b, [1, 16, 8, 8], [1, 1], [1] * 4, [1, 1], 16, None, False, False, prefer="no:such")
    assert missing.implementation == default.implementation
    x = torch.randn(1, 16, 8, 8).contiguous(memory_format=torch.channels_last)
    want = F.conv2d(x.double(), w.double(), b.double(), 1, 1, 1, 16)
    for kernel in ("jit_dw:", default.implementation):  # a prefix: the direct depthwise kernel at any ISA
        conv = onednn_primitives.Conv2d(w, b, [1, 16, 8, 8], [1, 1], [1] * 4, [1, 1], 16, None, False, False, prefer=kernel)
        assert conv.implementation.startswith(kernel) or (
            conv.implementation == default.implementation and platform.machine() not in ("x86_64", "AMD64"))
        assert_close(conv(x), want)


def test_another_openmp_runtime_beside_torchs_leaves_the_library_available(tmp_path):
    """A second OpenMP runtime mapped by some other library (transformers' or onnxruntime's dependencies on a CUDA
    image) does not matter while libdnnl's OpenMP calls land in torch's runtime: the library stays available (the
    H200 host ran BERT-base's 43 LayerNorm/attention layers on default code for this). In a fresh process: a copy of
    torch's libgomp under another name is loaded first, then the library."""
    if onednn.reason() is not None:
        pytest.skip(f"oneDNN is unavailable here: {onednn.reason()}")
    import shutil
    import subprocess
    import sys

    runtime = next(f for f in onednn._openmp_runtimes() if "libgomp" in f)
    copy = tmp_path / "libgomp-other.so.1"
    shutil.copy(runtime, copy)
    script = (f"import ctypes, torch; ctypes.CDLL({str(copy)!r}); from kiln.kernels.cpu import onednn; "
              "print(len(onednn._openmp_runtimes()), onednn.reason())")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    count, reason = out.stdout.split(maxsplit=1)
    assert int(count) == 2, out.stdout  # the copy is mapped beside torch's
    assert reason.strip() == "None", out.stdout
