"""Explicit quantization: models quantized by onnxruntime's own tool (quantize_static, QDQ format) run in
kiln exactly as onnxruntime runs the same Q/DQ graph (its graph optimisations off: the Q/DQ ops as
written; with them on, onnxruntime swaps in integer kernels whose rounding and, on AVX2, saturation
differ). Compared within one quantization step of the output."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

import kiln
from kiln import zoo
from tests.calibration import FeedsReader


def _batches(n: int, seed: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"pixel_values": rng.standard_normal((1, 3, 64, 64), dtype=np.float32)} for _ in range(n)]


@pytest.fixture(scope="module")
def fp32_model(tmp_path_factory):
    return zoo.export("resnet_tiny", batch=1).path


CASES = [(CalibrationMethod.MinMax, QuantType.QInt8, QuantType.QInt8),
         (CalibrationMethod.MinMax, QuantType.QUInt8, QuantType.QInt8),
         (CalibrationMethod.Entropy, QuantType.QUInt8, QuantType.QInt8),
         (CalibrationMethod.Percentile, QuantType.QInt8, QuantType.QInt8),
         (CalibrationMethod.Distribution, QuantType.QFLOAT8E4M3FN, QuantType.QFLOAT8E4M3FN)]  # ORT: fp8 only so


@pytest.mark.parametrize("method, activations, weights", CASES, ids=lambda c: getattr(c, "name", str(c)))
def test_kiln_runs_onnxruntimes_qdq_model_as_onnxruntime_does(fp32_model, tmp_path, method, activations, weights):
    path = tmp_path / "qdq.onnx"
    fp8 = activations == QuantType.QFLOAT8E4M3FN
    quantize_static(str(fp32_model), str(path), FeedsReader(_batches(6, seed=1)), quant_format=QuantFormat.QDQ,
                    activation_type=activations, weight_type=weights, per_channel=not fp8,
                    calibrate_method=method)
    model = onnx.load(str(path))
    assert sum(n.op_type == "QuantizeLinear" for n in model.graph.node) > 5
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    engine = kiln.build(str(path))
    # one step of the last quantized tensor before the classifier's output (its DequantizeLinear's scale)
    scales = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    last_dq = [n for n in model.graph.node if n.op_type == "DequantizeLinear"][-1]
    step = float(np.max(scales[last_dq.input[1]]))
    for feeds in _batches(3, seed=5):
        got = next(iter(engine.run(feeds).values()))
        want = session.run(None, feeds)[0]
        # a step of the last quantized tensor, times the classifier weights' row sums: how far one
        # flipped rounding upstream can move an output
        weights_ = [v for v in scales.values() if v.ndim == 2 and v.dtype == np.float32]  # the float classifier
        bound = step * (float(np.abs(weights_[-1]).sum(axis=-1).max()) if weights_ else 1.0) + 1e-3
        assert np.abs(got - want).max() <= bound, (np.abs(got - want).max(), bound)
