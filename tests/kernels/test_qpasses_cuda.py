"""The one-pass CUDA kernels around the quantized layers of an engine, under the Triton interpreter, against
kiln's reference ops: QuantizeLinear / DequantizeLinear (kiln/tactics/cuda/quant_linear.py), QAdd of two
tensors in one layout (the residual Add's vectorised path), MaxPool on 8-bit NHWC tensors. Each was a
measured cost of the H200's ResNet-50 int8 engine (19.2 ms): MaxPool on the op's default 4.3 ms, the 16
QAdds 2.7 ms, the input's QuantizeLinear 0.64 ms. Integers and float8 exactly (the same IEEE division and
round half to even as the reference).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kiln.kernels.cuda.triton.pool import max_pool2d  # noqa: E402
from kiln.kernels.cuda.triton.qelementwise import qadd, quantize  # noqa: E402
from kiln.ops import quantized as qref  # noqa: E402
from kiln.ops.quantization import quantize_linear  # noqa: E402
from kiln.ops.registry import OpContext  # noqa: E402
from kiln.plan.spec import StepSpec  # noqa: E402
from kiln.tactics import registry  # noqa: E402
from kiln.tactics.tactic import InputMeta  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter evaluates masked-off lanes

FP8 = torch.float8_e4m3fn
CTX = OpContext("q", "QuantizeLinear")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8 else t


@pytest.mark.parametrize("out", [torch.int8, torch.uint8, FP8], ids=str)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.float16], ids=str)
def test_quantize_is_the_reference_bit_for_bit(out, x_dtype):
    scale = 0.05
    zero = {torch.int8: -3, torch.uint8: 130, FP8: 0}[out]
    x = torch.randn(2, 5, 7, 9) * 4
    x[0, 0, 0, :5] = torch.tensor([0.025, 0.075, -0.025, 1e4, -1e4])  # ties at 0.5, 1.5, -0.5 steps; saturation
    x = x.to(x_dtype).contiguous(memory_format=torch.channels_last)
    got = quantize(x, scale, zero, out)
    want = quantize_linear(CTX, x, torch.tensor(scale), torch.tensor(zero).to(out))
    assert got.stride() == x.stride()  # the layout it was given
    assert torch.equal(_bits(got.contiguous()), _bits(want.contiguous()))


def _step(op: str, inputs: list[str], **attributes) -> StepSpec:
    return StepSpec(op_type=op, name="layer", inputs=inputs, outputs=["y"], attributes=attributes)


@pytest.mark.parametrize("op, x, zero", [
    ("QuantizeLinear", torch.randn(3, 4, 5), torch.tensor(7, dtype=torch.int8)),
    ("QuantizeLinear", torch.randn(3, 4, 5), torch.tensor(0.0).to(FP8)),
    ("DequantizeLinear", torch.randint(0, 256, (3, 4, 5), dtype=torch.uint8), torch.tensor(131, dtype=torch.uint8)),
    ("DequantizeLinear", torch.randn(3, 4, 5).to(FP8), torch.tensor(0.0).to(FP8)),
], ids=["q-int8", "q-fp8", "dq-uint8", "dq-fp8"])
def test_the_quantize_tactics_are_the_ops_reference(op, x, zero):
    from kiln.ops.quantization import dequantize_linear
    name = "cuda.quantize.triton" if op == "QuantizeLinear" else "cuda.dequantize.triton"
    tactic = registry.all_tactics("cuda")[name]
    scale = torch.tensor(0.031, dtype=torch.float32)
    step = _step(op, ["x", "s", "z"])
    assert tactic.check(step, [InputMeta.of(x, False), InputMeta.of(scale, True), InputMeta.of(zero, True)]) is True
    got = tactic.prepare(step, [None, scale, zero], torch.device("cpu"))(CTX, x, scale, zero)
    reference = quantize_linear if op == "QuantizeLinear" else dequantize_linear
    want = reference(OpContext("q", op), x, scale, zero)
    assert got.dtype == want.dtype and torch.equal(_bits(got), _bits(want))
    per_channel = torch.full((4,), 0.031)
    assert "per channel" in tactic.check(step, [InputMeta.of(x, False), InputMeta.of(per_channel, True),
                                                InputMeta.of(zero, True)])


@pytest.mark.parametrize("out", [torch.int8, FP8, torch.float32], ids=str)
def test_qadd_of_two_tensors_in_one_layout_is_the_reference(out):
    shape = (2, 16, 5, 7)
    if out == FP8:
        a, b = torch.randn(shape).to(FP8), (torch.randn(shape) * 3).to(FP8)
        za = zb = torch.tensor(0.0).to(FP8)
    else:
        a, b = (torch.randint(-128, 128, shape, dtype=torch.int8) for _ in range(2))
        za, zb = torch.tensor(-5, dtype=torch.int8), torch.tensor(9, dtype=torch.int8)
    a, b = a.contiguous(memory_format=torch.channels_last), b.contiguous(memory_format=torch.channels_last)
    y_scale = torch.tensor(0.07)
    y_zero = {torch.float32: None, FP8: torch.tensor(0.0).to(FP8), torch.int8: torch.tensor(3, dtype=torch.int8)}[out]
    got = qadd(a, 0.05, float(za.float()), b, 0.02, float(zb.float()), out_dtype=out,
               y_scale=1.0 if y_zero is None else 0.07, y_zero=0.0 if y_zero is None else float(y_zero.float()),
               activation="Relu")
    want = qref.qadd(CTX, a, torch.tensor(0.05), za, b, torch.tensor(0.02), zb,
                     y_scale if y_zero is not None else None, y_zero, activation="Relu")
    assert got.stride() == a.stride()
    if out == torch.float32:
        torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=1e-6)  # fp32 sum vs the float64 reference
    else:  # the sum in fp32: a near-tie may round one step the other way, as every quantized kernel may. E4M3's
        # grid is coarse and a sum of grid values lands near its midpoints more often (CI: 2 of 1,120 in ~half the
        # draws): up to 1% of the outputs, each at most one step away
        diff = (got.float() - want.float()).abs()
        if out == FP8:
            step = torch.exp2(torch.floor(torch.log2(want.float().abs().clamp_min(2.0 ** -6))) - 3)
        else:
            step = torch.ones_like(diff)
        assert bool((diff <= step).all()), f"an output more than one step off: {float((diff / step).max())} steps"
        assert int((diff > 0).sum()) <= max(1, diff.numel() // 100)


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8], ids=str)
def test_max_pool_of_an_8bit_nhwc_tensor_is_the_max_of_its_values(dtype):
    low, high = (-128, 128) if dtype == torch.int8 else (0, 256)
    x = torch.randint(low, high, (2, 24, 9, 11), dtype=torch.int32)
    x[0, :, 0, 0] = low  # the smallest value beside the padding: padding must not win
    x = x.to(dtype).contiguous(memory_format=torch.channels_last)
    got = max_pool2d(x, [3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    want = torch.nn.functional.max_pool2d(x.float(), 3, 2, 1)
    assert got.dtype == dtype and got.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(got.float(), want)
    tactic = registry.all_tactics("cuda")["cuda.pool.max.triton"]
    step = _step("MaxPool", ["x"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    assert tactic.check(step, [InputMeta.of(x, False)]) is True


@pytest.mark.slow
@pytest.mark.parametrize("cuda_graph", [False, True], ids=["cpu-graph", "cuda-graph"])
def test_an_int8_resnet_block_on_these_kernels_is_onnxruntime(tmp_path, monkeypatch, cuda_graph):
    """onnxruntime's int8 QDQ model of a ResNet block (input QuantizeLinear, MaxPool on the 8-bit tensor, the
    residual QAdd of two NHWC tensors, the DequantizeLinear before the head), every step that has one of
    these CUDA kernels forced onto it: the engine matches onnxruntime running the same Q/DQ graph. cuda_graph:
    the graph a CUDA build makes (fusion.CUDA_RULES: the input's QuantizeLinear folded into the stem's QConv, which
    quantizes its float input itself; the residual add in its QConv)."""
    import dataclasses

    import numpy as np
    import onnxruntime as ort
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static
    from tests.calibration import FeedsReader

    import kiln
    from tests.unit.tactic_check import cuda_tactics_on_cpu
    from tests.resnet_block import Bottleneck

    selected = ("cuda.quantize.triton", "cuda.dequantize.triton", "cuda.pool.max.triton", "cuda.qadd.triton",
                "cuda.qconv.dequantized_fp32", "cuda.qgemm.dequantized")
    cuda_tactics_on_cpu(monkeypatch, lambda name: name in selected)
    if cuda_graph:
        from kiln.builder import build as build_module

        plain = build_module.pass_options
        monkeypatch.setattr(build_module, "pass_options",
                            lambda config: dataclasses.replace(plain(config), cuda_rules=True))
    torch.manual_seed(0)
    fp32, path = tmp_path / "block.onnx", tmp_path / "block_int8.onnx"
    torch.onnx.export(Bottleneck(stem=16, width=8, out=32).eval(), (torch.randn(2, 3, 16, 16),), str(fp32), dynamo=True, input_names=["x"],
                      output_names=["y"])
    rng = np.random.default_rng(0)
    feeds = [{"x": rng.standard_normal((2, 3, 16, 16), dtype=np.float32)} for _ in range(5)]

    quantize_static(str(fp32), str(path), FeedsReader(feeds[:3]), quant_format=QuantFormat.QDQ,
                    activation_type=QuantType.QInt8, weight_type=QuantType.QInt8, per_channel=True)
    engine = kiln.build(str(path), device="cpu", tactics=list(selected), tuning_runs=2, shapes={"x": [2, 3, 16, 16]})
    layers = engine.plan.header["tactics"]["layers"]
    forced = []
    for step in engine.plan.program.steps:
        candidates = layers.get(step.name, {}).get("candidates", {})
        kernel = next((n for n in selected if isinstance(candidates.get(n), float)), None)
        if kernel is not None:
            step.tactic, step.tactic_config = kernel, {}
            forced.append(kernel)
    if cuda_graph:  # the stem reads the float image: no QuantizeLinear step; its QConv on the kernel quantizing it
        steps = engine.plan.program.steps
        assert not any(s.op_type == "QuantizeLinear" and s.inputs[0] == "x" for s in steps), steps[0]
        assert steps[0].tactic == "cuda.qconv.dequantized_fp32" and steps[0].inputs[0] == "x"
        assert {"cuda.pool.max.triton", "cuda.qconv.dequantized_fp32"} <= set(forced), (forced, layers)
    else:
        assert {"cuda.quantize.triton", "cuda.pool.max.triton", "cuda.qadd.triton"} <= set(forced), (forced, layers)
    on_kernels = kiln.Engine(engine.plan)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    for feed in feeds[3:]:
        want = session.run(None, feed)[0]
        got = on_kernels.run(feed)["y"]
        # a near-tie rounded the other way moves the logits by about one step of the last activations
        assert np.abs(got - want).max() <= 0.05 * np.abs(want).max() + 1e-3, (forced, got, want)
