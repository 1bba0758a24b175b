"""The Triton implicit-GEMM convolution and its tactics (interpreter, small shapes).

The kernel is judged against torch.nn.functional.conv2d in float64 on the same (rounded) inputs,
followed by kiln's torch epilogue in float64; the tactics the way the autotuner judges them,
against kiln's registered kiln::FusedConv through `mismatch`.

Tolerances (rtol, atol) against the float64 reference: the kernel multiplies fp16/bf16 inputs
exactly into an fp32 accumulator and rounds once, at the store, so its error is half an ulp of
the storage type (fp16 2⁻¹¹ ≈ 4.9e-4, bf16 2⁻⁸ ≈ 3.9e-3) plus fp32 noise: rtol twice that. fp32
("ieee" products) differs from float64 by the fp32 rounding of sums of up to ~600 products whose
magnitudes add to ~100: atol 1e-4.
"""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from kiln.kernels.cuda.triton import device_math as dm  # noqa: E402
from kiln.kernels.cuda.triton.conv import CONV_CONFIGS, ConvConfig, conv2d, pack_weight  # noqa: E402
from kiln.ops.fused import _epilogue  # noqa: E402
from kiln.plan.spec import StepSpec  # noqa: E402
from kiln.tactics import registry  # noqa: E402
from kiln.builder.accuracy import mismatch  # noqa: E402
from kiln.tactics.tactic import InputMeta  # noqa: E402
from tests.unit import tactic_check  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter evaluates masked-off lanes

TOLERANCE = {torch.float16: (1e-3, 1e-3), torch.bfloat16: (8e-3, 8e-3), torch.float32: (1e-5, 1e-4)}
CL = torch.channels_last
SMALL = ConvConfig(32, 16, 16, group_m=2)  # several row, column and K tiles even at interpreter sizes
CPU = torch.device("cpu")
# activation -> (alpha, beta) as kiln::FusedConv carries them
ALPHA_BETA = {"Clip": (-0.5, 0.7), "LeakyRelu": (0.1, 0.0), "HardSigmoid": (0.2, 0.5)}


def randn(*shape, dtype=torch.float32, scale=1.0, layout=CL):
    t = (torch.randn(*shape) * scale).to(dtype)
    return t.contiguous(memory_format=layout) if t.dim() == 4 else t


def reference(x, w, bias=None, residual=None, *, strides=(1, 1), pads=(0, 0, 0, 0), dilations=(1, 1),
              activation="", alpha=0.0, beta=0.0, after=False):
    """F.conv2d in float64 on explicitly padded x (ONNX pads: top, left, bottom, right), then kiln's epilogue."""
    top, left, bottom, right = pads
    xp = F.pad(x.double(), (left, right, top, bottom))
    y = F.conv2d(xp, w.double(), None if bias is None else bias.double(), stride=strides, dilation=dilations)
    return _epilogue(y, None if residual is None else residual.double(), activation, alpha, beta, after)


def check(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    rtol, atol = TOLERANCE[dtype]
    assert out.dtype == dtype
    assert out.shape == expected.shape
    assert out.is_contiguous(memory_format=CL), f"output strides {out.stride()} are not NHWC"
    torch.testing.assert_close(out.double(), expected, rtol=rtol, atol=atol)


def run(x, w, bias=None, residual=None, *, config=SMALL, **geometry_and_epilogue):
    kernel = tuple(w.shape[2:])
    epilogue = {k: v for k, v in geometry_and_epilogue.items() if k in ("activation", "alpha", "beta")}
    after = geometry_and_epilogue.get("after", False)
    geometry = {k: v for k, v in geometry_and_epilogue.items() if k in ("strides", "pads", "dilations")}
    out = conv2d(x, pack_weight(w), kernel, bias, residual, config=config, residual_after_activation=after,
                 **geometry, **epilogue)
    return out, reference(x, w, bias, residual, **geometry_and_epilogue)


# ---- geometry ------------------------------------------------------------------------------------

GEOMETRIES = {  # name -> (N, Cin, H, W, Cout, KH, KW, strides, pads, dilations)
    "1x1": (2, 24, 5, 7, 20, 1, 1, (1, 1), (0, 0, 0, 0), (1, 1)),
    "3x3 pad 1": (2, 16, 7, 6, 24, 3, 3, (1, 1), (1, 1, 1, 1), (1, 1)),
    "3x3 stride 2": (2, 20, 9, 8, 16, 3, 3, (2, 2), (1, 1, 1, 1), (1, 1)),
    "7x7 stride 2 pad 3 Cin 3": (2, 3, 16, 13, 20, 7, 7, (2, 2), (3, 3, 3, 3), (1, 1)),
    "asymmetric pads, 2x3 kernel": (1, 18, 7, 9, 12, 2, 3, (1, 2), (0, 2, 1, 0), (1, 1)),
    "dilation 2": (2, 17, 9, 9, 18, 3, 3, (1, 1), (2, 2, 2, 2), (2, 2)),
    "dilation 2x1, stride 1x2, flat K": (1, 5, 10, 11, 9, 3, 2, (1, 2), (1, 0, 2, 1), (2, 1)),
}


@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_geometry_against_float64_conv2d(name, dtype):
    """M, Cout and Cin·KH·KW are none a multiple of SMALL's 32x16x16 tiles (tails on every axis)."""
    torch.manual_seed(zlib.crc32(name.encode()))
    n, cin, h, w_, cout, kh, kw, strides, pads, dilations = GEOMETRIES[name]
    x, w, bias = randn(n, cin, h, w_, dtype=dtype), randn(cout, cin, kh, kw, dtype=dtype, scale=0.3), \
        randn(cout, dtype=dtype)
    out, expected = run(x, w, bias, strides=strides, pads=pads, dilations=dilations, activation="Relu")
    check(out, expected, dtype)


@pytest.mark.parametrize("config", [SMALL, ConvConfig(16, 32, 32, group_m=1), ConvConfig(64, 64, 64)],
                         ids=lambda c: c.name)
def test_tap_loop_and_flat_k_agree_across_configs(config):
    """Cin = 16: the tap loop for BLOCK_K 16, flat K for BLOCK_K 32 and 64 (several taps per tile)."""
    torch.manual_seed(2)
    x, w = randn(2, 16, 6, 5, dtype=torch.float16), randn(24, 16, 3, 3, dtype=torch.float16, scale=0.3)
    out, expected = run(x, w, pads=(1, 1, 1, 1), config=config)
    check(out, expected, torch.float16)


def test_default_config_and_nchw_input():
    """x in NCHW (channels strided by H·W) is read in place; the output is still NHWC."""
    torch.manual_seed(3)
    x = randn(1, 8, 6, 6, dtype=torch.float16, layout=torch.contiguous_format)
    w = randn(8, 8, 3, 3, dtype=torch.float16, scale=0.3)
    out = conv2d(x, pack_weight(w), (3, 3), pads=(1, 1, 1, 1))
    check(out, reference(x, w, pads=(1, 1, 1, 1)), torch.float16)
    assert all(c.block_k >= 16 and c.block_m * c.block_n <= 256 * 128 for c in CONV_CONFIGS)


# ---- the epilogue --------------------------------------------------------------------------------

@pytest.mark.parametrize("after", [False, True], ids=["residual_before", "residual_after"])
@pytest.mark.parametrize("activation", dm.ACTIVATIONS, ids=lambda a: a or "none")
def test_every_activation_with_residual_before_and_after(activation, after):
    torch.manual_seed(4)
    alpha, beta = ALPHA_BETA.get(activation, (0.0, 0.0))
    x, w = randn(1, 16, 5, 5, dtype=torch.float16), randn(16, 16, 3, 3, dtype=torch.float16, scale=0.3)
    bias, residual = randn(16, dtype=torch.float16), randn(1, 16, 5, 5, dtype=torch.float16)
    out, expected = run(x, w, bias, residual, pads=(1, 1, 1, 1), activation=activation, alpha=alpha, beta=beta,
                        after=after)
    check(out, expected, torch.float16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_residual_in_other_layouts_and_broadcast(dtype):
    """A residual in NCHW, and one broadcast from [Cout, 1, 1], read through their strides (no copy)."""
    torch.manual_seed(5)
    x, w = randn(2, 12, 6, 7, dtype=dtype), randn(20, 12, 1, 1, dtype=dtype, scale=0.3)
    nchw = randn(2, 20, 6, 7, dtype=dtype, layout=torch.contiguous_format)
    out, expected = run(x, w, None, nchw, activation="Relu")
    check(out, expected, dtype)
    per_channel = randn(20, 1, 1, dtype=dtype)
    out, expected = run(x, w, randn(20, dtype=dtype), per_channel, activation="SiLU", after=True)
    check(out, expected, dtype)


def test_empty_batch_and_empty_reduction():
    w = randn(4, 3, 3, 3)
    assert conv2d(randn(0, 3, 5, 5), pack_weight(w), (3, 3)).shape == (0, 4, 3, 3)
    bias = randn(4)
    out = conv2d(randn(1, 0, 4, 4), pack_weight(randn(4, 0, 1, 1)), (1, 1), bias, activation="Sigmoid")
    torch.testing.assert_close(out, torch.sigmoid(bias).view(1, 4, 1, 1).expand(1, 4, 4, 4))


def test_refusals():
    x, w = randn(1, 4, 5, 5), randn(6, 4, 3, 3)
    with pytest.raises(ValueError, match="unknown activation"):
        conv2d(x, pack_weight(w), (3, 3), activation="Swish")
    with pytest.raises(TypeError, match="share"):
        conv2d(x, pack_weight(w).half(), (3, 3))
    with pytest.raises(ValueError, match=r"packed weight as a contiguous \[36, Cout\]"):
        conv2d(x, w.reshape(6, 36), (3, 3))
    with pytest.raises(ValueError, match="does not fit"):
        conv2d(randn(1, 4, 2, 2), pack_weight(w), (3, 3))


# ---- the tactics, as the autotuner checks them ------------------------------------------------------

TACTIC = "cuda.conv.triton_igemm.64x64x64"


WEIGHT = {1}  # the weight is a constant of the engine


def make_step(n_inputs: int, **attributes) -> StepSpec:
    return tactic_check.make_step("FusedConv", "kiln", n_inputs, **attributes)


def metas(args: list) -> list[InputMeta]:
    return tactic_check.metas(args, WEIGHT)


def run_against_the_op(name: str, step: StepSpec, args: list) -> torch.Tensor:
    """check, prepare on the weight, launch on NHWC input, compare with kiln's op: what the autotuner does."""
    got = tactic_check.run_against_reference(name, step, args, WEIGHT)
    assert got.is_contiguous(memory_format=CL)
    return got


def test_tactics_are_registered_with_levels():
    def names(level):
        return [t.name for t in registry.candidates("FusedConv", "kiln", "cuda", opt_level=level)
                if t.name.startswith("cuda.conv.triton_igemm.")]

    assert names(2) == []
    assert names(3) == ["cuda.conv.triton_igemm.128x128x64", "cuda.conv.triton_igemm.128x64x64", TACTIC]
    assert len(names(5)) == len(CONV_CONFIGS) == 5
    assert all(registry.get(n).layout == "channels_last" for n in names(5))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_tactic_bottleneck_1x1_with_residual_and_relu(dtype):
    """ResNet's block end: relu(conv1x1(x) + b + residual), residual before the activation (FusedConv's default)."""
    torch.manual_seed(6)
    step = make_step(4, activation="Relu", kernel_shape=[1, 1], pads=[0, 0, 0, 0], strides=[1, 1])
    args = [randn(1, 40, 9, 9, dtype=dtype), randn(72, 40, 1, 1, dtype=dtype, scale=0.2), randn(72, dtype=dtype),
            randn(1, 72, 9, 9, dtype=dtype)]
    run_against_the_op(TACTIC, step, args)


def test_tactic_3x3_stride_2_auto_pad_and_clip():
    torch.manual_seed(7)
    step = make_step(3, activation="Clip", alpha=0.0, beta=6.0, auto_pad="SAME_UPPER", strides=[2, 2])
    args = [randn(2, 24, 12, 11, dtype=torch.float16), randn(48, 24, 3, 3, dtype=torch.float16, scale=0.2),
            randn(48, dtype=torch.float16)]
    out = run_against_the_op(TACTIC, step, args)
    assert out.shape == (2, 48, 6, 6)


def test_tactic_stem_7x7_asymmetric_pads_residual_after():
    torch.manual_seed(8)
    step = make_step(4, activation="LeakyRelu", alpha=0.2, pads=[3, 2, 2, 3], strides=[2, 2],
                     residual_after_activation=1)
    x = randn(1, 3, 17, 16, dtype=torch.float16)
    out_shape = (1, 40, (17 + 5 - 7) // 2 + 1, (16 + 5 - 7) // 2 + 1)
    args = [x, randn(40, 3, 7, 7, dtype=torch.float16, scale=0.2), None, randn(*out_shape, dtype=torch.float16)]
    run_against_the_op(TACTIC, step, args)


def test_tactic_refusals_say_why():
    x, w = randn(1, 8, 9, 9, dtype=torch.float16), randn(16, 8, 3, 3, dtype=torch.float16)

    def reason(step, args, name=TACTIC):
        result = registry.get(name).check(step, metas(args))
        assert isinstance(result, str), f"{name} accepted the layer"
        return result

    assert "float16, bfloat16" in reason(make_step(2), [x.float(), w.float()])
    assert "group 2" in reason(make_step(2, group=2), [x, randn(16, 4, 3, 3, dtype=torch.float16)])
    assert "4-D input" in reason(make_step(2), [randn(1, 8, 9, dtype=torch.float16), randn(16, 8, 3,
                                                                                          dtype=torch.float16)])
    assert "residual input 3" in reason(make_step(4), [x, w, None, randn(1, 16, 7, 7)])
    assert "does not broadcast" in reason(make_step(4), [x, w, None, randn(1, 16, 9, 9, dtype=torch.float16)])
    assert "constant" in registry.get(TACTIC).check(make_step(2), [InputMeta.of(x, False), InputMeta.of(w, False)])
    assert "mostly padding" in reason(make_step(2), [x, w], name="cuda.conv.triton_igemm.128x128x64")  # M = 49
    assert "output channels: mostly padding" in reason(make_step(2, pads=[1, 1, 1, 1]),
                                                       [randn(2, 8, 9, 9, dtype=torch.float16), w],
                                                       name="cuda.conv.triton_igemm.128x128x64")
    assert "channels" in reason(make_step(2), [x, randn(16, 6, 3, 3, dtype=torch.float16)])
    assert "64-channel tiles for 16 output channels" in reason(make_step(2), [x, w])
    assert registry.get(TACTIC).check(make_step(2), metas([x, randn(40, 8, 3, 3, dtype=torch.float16)])) is True


# ---- the tactics inside an engine ------------------------------------------------------------------

class _Bottleneck(torch.nn.Module):
    """A ResNet block in miniature: 3x3 conv + BN + ReLU, 1x1 conv + BN, + identity, ReLU (stem 7x7 before it)."""

    def __init__(self, channels: int = 40):
        super().__init__()
        self.stem = torch.nn.Conv2d(3, channels, 7, stride=2, padding=3)
        self.conv1, self.bn1 = torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False), \
            torch.nn.BatchNorm2d(channels)
        self.conv2, self.bn2 = torch.nn.Conv2d(channels, channels, 1, bias=False), torch.nn.BatchNorm2d(channels)
        for bn in (self.bn1, self.bn2):  # non-trivial folded scales and shifts
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
            bn.weight.data.uniform_(0.5, 1.5)
            bn.bias.data.uniform_(-0.5, 0.5)

    def forward(self, x):
        x = torch.relu(self.stem(x))
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + x)


def test_engine_runs_the_tactic_on_every_conv_of_a_block(tmp_path, monkeypatch):
    """Build (fp16, opt_level 3) with the igemm tactics standing in for CPU ones: the optimizer folds BN and fuses
    bias/ReLU/residual into kiln::FusedConv, the autotuner checks the tactic against the op before timing it;
    then every conv forced onto the tactic (prepared from the engine's stored weights) against onnxruntime fp32."""
    import numpy as np
    import onnxruntime as ort

    import kiln

    tactic_check.cuda_tactics_on_cpu(monkeypatch, lambda name: name.startswith("cuda.conv.triton_igemm."))
    torch.manual_seed(14)
    path = tmp_path / "block.onnx"
    torch.onnx.export(_Bottleneck().eval(), (torch.randn(1, 3, 20, 18),), str(path), dynamo=True,
                      input_names=["x"], output_names=["y"])
    engine = kiln.build(str(path), device="cpu", precision="fp16", opt_level=3, tactics=["cuda.conv.triton_igemm"],
                        tuning_runs=3)
    convs = [s for s in engine.plan.program.steps if s.op_type == "FusedConv"]
    assert len(convs) == 3
    assert any(s.inputs[3:] and s.inputs[3] for s in convs), "the residual Add was not fused into a conv"
    for conv in convs:
        notes = engine.plan.header["tactics"]["layers"][conv.name]["candidates"]
        assert isinstance(notes[TACTIC], float), notes  # passed the check against the op, then timed
        conv.tactic = TACTIC  # on CPU the interpreter never wins the timing: force it
    forced = kiln.Engine(engine.plan)
    x = np.random.default_rng(3).standard_normal((1, 3, 20, 18)).astype(np.float32)
    expected = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    # fp16 storage of x, the weights and every activation over three layers: a few fp16 ulps of outputs ~1..4
    np.testing.assert_allclose(forced.run({"x": x})["y"], expected, rtol=1e-2, atol=2e-2)
