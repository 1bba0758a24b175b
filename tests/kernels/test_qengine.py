"""An engine built from an onnxruntime quantize_static QDQ model, its quantized layers on kiln's CUDA tactics
(kiln/tactics/cuda/quant_*.py) registered as CPU ones for the test: the Triton kernels run under the
interpreter, so a CPU build exercises what a CUDA build does with them: the autotuner's check of each
candidate on the layer's recorded inputs, the runtime preparing the chosen tactic on the engine's weights
and calling it with the step's inputs, channels-last 8-bit activations flowing between layers. Forced onto
the CUDA kernels, the engine matches onnxruntime running the same Q/DQ graph, as the CPU engine does.

The same model on a GPU: tests/gpu/test_quant_cuda.py.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

pytest.importorskip("triton")

import kiln  # noqa: E402
from tests.unit.tactic_check import cuda_tactics_on_cpu  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter evaluates masked-off lanes

QUANTIZED_CUDA = ("cuda.qconv", "cuda.qgemm", "cuda.qadd")
KERNELS = ("cuda.qconv.triton_igemm.", "cuda.qgemm.int_mm", "cuda.qgemm.triton.", "cuda.qadd.triton")


class _Net(torch.nn.Module):
    """A residual block and a classifier: QConv (flat-K stem, tap loop), QAdd, QGemm after the quantization."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 48, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(48, 48, 3, padding=1)
        self.fc = torch.nn.Linear(48, 16)

    def forward(self, x):
        y = torch.relu(self.conv1(x))
        z = torch.relu(self.conv2(y) + y)
        return self.fc(z.mean(dim=(2, 3)))


def _qdq_model(tmp_path, activations: str) -> tuple[str, list[dict]]:
    from onnxruntime.quantization import (
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_static,
    )
    from tests.calibration import FeedsReader

    torch.manual_seed(0)
    fp32 = tmp_path / "net.onnx"
    torch.onnx.export(_Net().eval(), (torch.randn(1, 3, 8, 8),), str(fp32), dynamo=True, input_names=["x"],
                      output_names=["y"])
    rng = np.random.default_rng(0)
    feeds = [{"x": rng.standard_normal((1, 3, 8, 8), dtype=np.float32)} for _ in range(8)]

    fp8 = activations == "fp8"
    kind = {"int8": QuantType.QInt8, "uint8": QuantType.QUInt8, "fp8": QuantType.QFLOAT8E4M3FN}[activations]
    path = tmp_path / f"net_{activations}.onnx"
    quantize_static(str(fp32), str(path), FeedsReader(feeds[:5]), quant_format=QuantFormat.QDQ, activation_type=kind,
                    weight_type=QuantType.QFLOAT8E4M3FN if fp8 else QuantType.QInt8, per_channel=not fp8,
                    calibrate_method=CalibrationMethod.Distribution if fp8 else CalibrationMethod.MinMax)
    return str(path), feeds[5:]


@pytest.mark.slow
@pytest.mark.parametrize("activations", ["int8", "uint8", "fp8"])
def test_qdq_engine_on_the_cuda_kernels_matches_onnxruntime(tmp_path, monkeypatch, activations):
    cuda_tactics_on_cpu(monkeypatch, lambda name: name.startswith(QUANTIZED_CUDA))
    path, feeds = _qdq_model(tmp_path, activations)
    engine = kiln.build(path, device="cpu", tactics=list(QUANTIZED_CUDA), tuning_runs=2)
    layers = engine.plan.header["tactics"]["layers"]
    checked = {n for layer in layers.values() for n, note in layer["candidates"].items() if isinstance(note, float)}
    rejected = {n: note for layer in layers.values() for n, note in layer["candidates"].items()
                if isinstance(note, str) and "rejected" in note and n.startswith(KERNELS)}
    # the autotuner's own check (one step on the recorded inputs) passes the 8-bit kernels
    assert any(n.startswith("cuda.qconv.triton_igemm.") for n in checked), layers
    assert "cuda.qadd.triton" in checked and "cuda.qgemm.int_mm" in checked or activations == "fp8", layers
    assert not rejected, rejected

    # every quantized layer forced onto an 8-bit kernel (on the CPU the interpreter never wins the timing)
    forced = []
    for step in engine.plan.program.steps:
        candidates = layers.get(step.name, {}).get("candidates", {})
        kernel = next((n for n in candidates if n.startswith(KERNELS) and not str(candidates[n]).startswith(
            "unsupported")), None)
        if kernel is not None:
            step.tactic, step.tactic_config = kernel, {}
            forced.append(kernel)
    assert len(forced) >= 3, forced  # conv1, conv2, the residual add (and the classifier where int8)
    on_kernels = kiln.Engine(engine.plan)
    session_options = ort.SessionOptions()
    session_options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(path, session_options, providers=["CPUExecutionProvider"])
    for feed in feeds:
        want = session.run(None, feed)[0]
        got = on_kernels.run(feed)["y"]
        # a near-tie rounded the other way in one layer moves the logits by about one step of the last
        # activations through the classifier, and the logits are quantized themselves: one step of their
        # grid (FP8: 1/8 of the value; the CPU engine lands there too). A wrong zero point or scale is far out.
        bound = 0.05 * np.abs(want).max() + (0.125 * np.abs(want) if activations == "fp8" else 0.0) + 1e-3
        assert (np.abs(got - want) <= bound).all(), (forced, got, want)


def _fusing_the_residual(monkeypatch) -> None:
    """CPU builds as a CUDA build makes its graph: with fusion.CUDA_RULES (the residual QAdd into its QConv), the FP8
    one (an opt_level 3 rule) included."""
    import dataclasses

    from kiln.builder import build as build_module
    from kiln.passes import fusion

    monkeypatch.setattr(fusion, "LEVEL3_RULES", set())

    plain = build_module.pass_options
    monkeypatch.setattr(build_module, "pass_options", lambda config: dataclasses.replace(plain(config), cuda_rules=True))


def _forced(engine, prefixes: tuple[str, ...]) -> list[str]:
    """Every step with a candidate among `prefixes` that passed the autotuner's check forced onto it."""
    layers = engine.plan.header["tactics"]["layers"]
    forced = []
    for step in engine.plan.program.steps:
        candidates = layers.get(step.name, {}).get("candidates", {})
        kernel = next((n for n in candidates if n.startswith(prefixes) and isinstance(candidates[n], float)), None)
        if kernel is not None:
            step.tactic, step.tactic_config = kernel, {}
            forced.append(kernel)
    return forced


@pytest.mark.slow
@pytest.mark.parametrize("activations", ["int8", "uint8", "fp8"])
def test_residual_add_in_the_conv_epilogue_is_the_unfused_engine_and_onnxruntime(tmp_path, monkeypatch, activations):
    """relu(conv2(y) + y) as onnxruntime quantizes it: the CUDA build's graph has one QConv with the residual
    and no QAdd. On the reference ops the fused engine is the unfused one bit for bit (the op keeps the
    convolution's own rounding); on the Triton kernels (the add in the implicit GEMM's epilogue, and the
    dequantized fallback) it matches the unfused engine and onnxruntime within the bound of the test above."""
    cuda_tactics_on_cpu(monkeypatch, lambda name: name.startswith(QUANTIZED_CUDA))
    path, feeds = _qdq_model(tmp_path, activations)
    unfused = kiln.build(path, device="cpu", tactics=list(QUANTIZED_CUDA), tuning_runs=2)
    _fusing_the_residual(monkeypatch)
    fused = kiln.build(path, device="cpu", tactics=list(QUANTIZED_CUDA), tuning_runs=2)

    def ops(engine) -> list[str]:
        return [s.op_type for s in engine.plan.program.steps]

    assert ops(unfused).count("QAdd") == 1 and "QAdd" not in ops(fused), (ops(unfused), ops(fused))
    residual_steps = [s for s in fused.plan.program.steps if s.op_type == "QConv" and len(s.inputs) > 9]
    qadd = next(s for s in unfused.plan.program.steps if s.op_type == "QAdd")
    assert len(residual_steps) == 1  # the QAdd's activation (onnxruntime drops a Relu its Q's range clamps)
    assert residual_steps[0].attributes.get("activation", "") == qadd.attributes.get("activation", "")
    layers = fused.plan.header["tactics"]["layers"][residual_steps[0].name]["candidates"]
    checked = {n for n, note in layers.items() if isinstance(note, float)}
    # the autotuner's check (the unfused pair's tolerance on the recorded inputs: Tactic.checker) passes the
    # epilogue and the fallbacks
    assert {"cuda.qconv.dequantized", "cuda.qconv.dequantized_fp32"} <= checked, layers
    assert any(n.startswith("cuda.qconv.triton_igemm.") for n in checked), layers

    # the reference ops (no tactic): bit for bit
    reference = {}
    for name, engine in (("unfused", unfused), ("fused", fused)):
        plan = engine.plan
        for step in plan.program.steps:
            step.tactic, step.tactic_config = None, {}
        reference[name] = kiln.Engine(plan)
    for feed in feeds:
        assert np.array_equal(reference["fused"].run(feed)["y"], reference["unfused"].run(feed)["y"])

    session_options = ort.SessionOptions()
    session_options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(path, session_options, providers=["CPUExecutionProvider"])
    for kernel in ("cuda.qconv.triton_igemm.", "cuda.qconv.dequantized"):
        plans = {}
        for name, engine in (("unfused", unfused), ("fused", fused)):
            forced = _forced(engine, (kernel, "cuda.qadd.triton"))
            assert forced, name
            plans[name] = kiln.Engine(engine.plan)
        assert residual_steps[0].tactic.startswith(kernel)
        for feed in feeds:
            want = session.run(None, feed)[0]
            got, unfused_got = plans["fused"].run(feed)["y"], plans["unfused"].run(feed)["y"]
            # as the test above: a near-tie moves the logits one step (FP8: a step is 1/8 of the value)
            bound = 0.05 * np.abs(want).max() + (0.125 * np.abs(want) if activations == "fp8" else 0.0) + 1e-3
            assert (np.abs(got - want) <= bound).all(), (kernel, got, want)
            assert (np.abs(got - unfused_got) <= bound).all(), (kernel, got, unfused_got)
        # the whole-engine check's blame judges the fused layer by its tactic's rule too (accuracy.blame's
        # checkers), on the inputs its neighbours give it
        from kiln.builder import accuracy
        from kiln.tactics import registry
        tuned = plans["fused"]
        index = next(i for i, s in enumerate(tuned.plan.program.steps) if s.name == residual_steps[0].name)
        checker = registry.get(tuned.plan.program.steps[index].tactic).checker
        for feed in feeds:
            found = accuracy.blame(reference["fused"].program, tuned.program, {index}, tuned.program_inputs(feed),
                                   {index: checker})
            assert found[index].ratio <= 1, (kernel, found[index].problem)
