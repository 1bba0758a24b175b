"""cpu.conv.onednn_rows (kiln/tactics/cpu/conv_rows.py): a 1x1 convolution as oneDNN's inner product over its NHWC rows.

Per layer against a float64 torch convolution with the epilogue written out here (tests/unit/oracle.py), on fresh
random inputs, at 1 and 2 threads, other batch sizes and inputs in either layout; what it refuses, with the reason;
a DenseNet-style block built with it on every 1x1 convolution and run at 2 threads inside one native segment, against
onnxruntime.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kiln
from kiln.builder import autotune
from kiln.kernels.cpu import onednn
from kiln.ops.registry import OpContext
from kiln.plan.spec import StepSpec
from kiln.tactics import registry
from kiln.tactics.tactic import InputMeta
from tests.unit.oracle import ACTIVATION_ORACLE

NAME = "cpu.conv.onednn_rows"
pytestmark = pytest.mark.skipif(not onednn.available(), reason="libdnnl.so.3 not installed (onednn-cpu-gomp)")

# fp32 inner product vs float64: a C-long dot product (C <= 256 here) rounds to ~1e-6 of its scale; an index or
# epilogue mistake is O(1).
RTOL, ATOL = 2e-5, 1e-6


def oracle(x, w, b, r, activation, alpha, beta, after):
    y = F.conv2d(x.double(), w.double(), None if b is None else b.double())
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


CASES = [  # N, C, H, W, O, bias, activation, alpha, beta, residual, after
    (1, 128, 28, 28, 128, True, "Relu", 0.0, 0.0, False, 0),  # DenseNet's bottleneck (BN folded, ReLU)
    (1, 256, 7, 7, 128, True, "Relu", 0.0, 0.0, False, 0),
    (2, 48, 9, 11, 40, False, "", 0.0, 0.0, False, 0),  # no bias, odd sizes, a batch
    (1, 32, 14, 14, 24, True, "Clip", 0.0, 6.0, False, 0),
    (1, 16, 14, 14, 16, True, "Relu", 0.0, 0.0, True, 0),  # relu(conv + r)
    (1, 16, 14, 14, 16, True, "", 0.0, 0.0, True, 1),  # conv + r
    (1, 24, 10, 10, 16, True, "HardSwish", 0.0, 0.0, True, 1),  # act(conv) + r
    (1, 24, 10, 10, 16, True, "SiLU", 0.0, 0.0, False, 0),
]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}x{c[2]}x{c[3]}-{c[4]}-{c[6] or 'none'}"
                                                      f"-r{int(c[9])}{c[10]}")
def test_matches_float64_oracle(case, layout, threads):
    n, c, h, w_, o, bias, activation, alpha, beta, residual, after = case
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(sum(map(hash, map(str, case))) % 2**31 + threads)
        x = torch.randn(n, c, h, w_, generator=g)
        if layout == "nhwc":
            x = x.contiguous(memory_format=torch.channels_last)
        w = torch.randn(o, c, 1, 1, generator=g) * (2.0 / c) ** 0.5
        b = torch.randn(o, generator=g) if bias else None
        r = torch.randn(n, o, h, w_, generator=g) if residual else None
        attrs = dict(pads=[0, 0, 0, 0], strides=[1, 1], group=1, activation=activation, alpha=alpha, beta=beta,
                     residual_after_activation=after, kernel_shape=[1, 1])
        step = StepSpec("FusedConv", "conv", ["x", "w", "b" if bias else "", "r" if residual else ""], ["y"], attrs,
                        domain="kiln")
        launch = prepare(step, [x, w, b, r], [None, w, b, None])
        ctx = OpContext(name="conv", op_type="FusedConv", domain="kiln")
        got = launch(ctx, x, w, b, r, **attrs)
        assert got.is_contiguous(memory_format=torch.channels_last)  # a conv stack stays NHWC
        assert_close(got, oracle(x, w, b, r, activation, alpha, beta, after))
        # another batch: an inner product of its own row count, on the tuned one's weight
        x3 = torch.randn(3, c, h, w_, generator=g)
        r3 = torch.randn(3, o, h, w_, generator=g) if residual else None
        assert_close(launch(ctx, x3, w, b, r3, **attrs), oracle(x3, w, b, r3, activation, alpha, beta, after))
        assert_close(launch(ctx, x, w, b, r, **attrs), oracle(x, w, b, r, activation, alpha, beta, after))
    finally:
        torch.set_num_threads(before)


def test_refuses_what_is_not_a_gemm_over_the_rows():
    tactic = registry.get(NAME)
    x = InputMeta((1, 16, 8, 8), torch.float32, False)
    pointwise = InputMeta((8, 16, 1, 1), torch.float32, True)

    def check(attrs: dict, w: InputMeta = pointwise) -> bool | str:
        return tactic.check(StepSpec("FusedConv", "c", ["x", "w"], ["y"], attrs, domain="kiln"), [x, w])

    assert check({}) is True
    assert "1x1 only" in check({"pads": [1] * 4}, InputMeta((8, 16, 3, 3), torch.float32, True))
    assert "stride 1 only" in check({"strides": [2, 2]})
    assert "no padding only" in check({"pads": [1, 1, 1, 1]})
    assert "one group only" in check({"group": 2}, InputMeta((8, 8, 1, 1), torch.float32, True))
    assert "final activation" in check({"activation": "Relu", "final_activation": "Relu"})
    assert "no oneDNN" in check({"activation": "SwiGLU"})
    assert "constant" in check({}, InputMeta((8, 16, 1, 1), torch.float32, False))


class _DenseBlock(nn.Module):
    """Two DenseNet layers: BN-ReLU -> 1x1 conv (128) -> BN-ReLU -> 3x3 conv (32), concatenated to their input."""

    def __init__(self, channels: int):
        super().__init__()
        self.layers = nn.ModuleList()
        for i in range(2):
            inp = channels + 32 * i
            self.layers.append(nn.Sequential(nn.BatchNorm2d(inp), nn.ReLU(), nn.Conv2d(inp, 128, 1, bias=False),
                                             nn.BatchNorm2d(128), nn.ReLU(), nn.Conv2d(128, 32, 3, padding=1)))
        self.transition = nn.Sequential(nn.BatchNorm2d(channels + 64), nn.ReLU(), nn.Conv2d(channels + 64, 48, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.cat([x, layer(x)], 1)
        return self.transition(x)


def test_dense_block_at_two_threads_matches_onnxruntime(two_threads, monkeypatch, tmp_path):
    # The timings decide nothing here (a shared CPU makes them noisy): this tactic "wins" every layer it supports;
    # the autotuner still checks each layer and the whole engine against the reference before it keeps the choice.
    monkeypatch.setattr(autotune, "measure", lambda fns, device, runs=10, **_: {
        k: 0.0 if k.startswith(NAME) else 1.0 for k in fns})
    torch.manual_seed(5)
    model = _DenseBlock(64).eval()
    with torch.no_grad():  # BatchNorm statistics other than the identity's
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.running_mean.uniform_(-0.5, 0.5)
                module.running_var.uniform_(0.5, 2.0)
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(-0.2, 0.2)
    path = tmp_path / "dense.onnx"
    torch.onnx.export(model, (torch.randn(1, 64, 14, 14),), str(path), input_names=["x"], output_names=["y"],
                      dynamo=False)
    engine = kiln.build(str(path))
    assert "reverted" not in engine.plan.header["tactics"]
    pointwise = [s for s in engine.plan.program.steps
                 if s.op_type == "FusedConv" and tuple(s.attributes.get("kernel_shape", ())) == (1, 1)]
    assert len(pointwise) == 3 and all(s.tactic == NAME for s in pointwise), [(s.name, s.tactic) for s in pointwise]
    members = {m.ctx.name for segment in engine.program.segments for m in segment.members}
    assert {s.name for s in pointwise} <= members  # bound inside the native segment, not run one by one
    session = ort.InferenceSession(str(path), ort.SessionOptions(), providers=["CPUExecutionProvider"])
    for seed in (1, 2):
        x = np.random.default_rng(seed).standard_normal((1, 64, 14, 14), dtype=np.float32)
        got = np.asarray(engine.run({"x": x})["y"])
        want = session.run(None, {"x": x})[0]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
