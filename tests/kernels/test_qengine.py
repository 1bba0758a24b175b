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
        CalibrationDataReader,
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    torch.manual_seed(0)
    fp32 = tmp_path / "net.onnx"
    torch.onnx.export(_Net().eval(), (torch.randn(1, 3, 8, 8),), str(fp32), dynamo=True, input_names=["x"],
                      output_names=["y"])
    rng = np.random.default_rng(0)
    feeds = [{"x": rng.standard_normal((1, 3, 8, 8), dtype=np.float32)} for _ in range(8)]

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.items = iter(feeds[:5])

        def get_next(self):
            return next(self.items, None)

    fp8 = activations == "fp8"
    kind = {"int8": QuantType.QInt8, "uint8": QuantType.QUInt8, "fp8": QuantType.QFLOAT8E4M3FN}[activations]
    path = tmp_path / f"net_{activations}.onnx"
    quantize_static(str(fp32), str(path), Reader(), quant_format=QuantFormat.QDQ, activation_type=kind,
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
