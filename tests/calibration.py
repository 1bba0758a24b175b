"""The calibration data the tests hand onnxruntime's quantize_static when they make QDQ models."""

from __future__ import annotations

import numpy as np
from onnxruntime.quantization import CalibrationDataReader, CalibrationMethod, QuantFormat, QuantType, quantize_static


class FeedsReader(CalibrationDataReader):
    """The given feeds, one batch a get_next, then None: quantize_static's calibration input."""

    def __init__(self, feeds: list[dict[str, np.ndarray]]):
        self._items = iter(feeds)

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._items, None)


def quantize_fp8(fp32: str, qdq: str, feeds: list[dict[str, np.ndarray]], keep_activations: bool = True) -> None:
    """onnxruntime's FP8 QDQ model of `fp32` written to `qdq`: E4M3 activations and weights per tensor, calibrated on
    `feeds`; keep_activations: its QDQKeepRemovableActivations (without it an FP8 model loses every Relu:
    tests/unit/test_qdq_fp8_activations.py)."""
    quantize_static(fp32, qdq, FeedsReader(feeds), quant_format=QuantFormat.QDQ,
                    activation_type=QuantType.QFLOAT8E4M3FN, weight_type=QuantType.QFLOAT8E4M3FN, per_channel=False,
                    calibrate_method=CalibrationMethod.Distribution,  # the only one onnxruntime has for FP8
                    extra_options={"QDQKeepRemovableActivations": keep_activations})


def quantize_transformer(fp32: str, qdq: str, feeds: list[dict[str, np.ndarray]], kind: str) -> None:
    """onnxruntime's QDQ model of a transformer's GEMMs as bench/quant_gpu.py _ort_qdq makes it: `kind` int8
    (per-channel weights, MinMax) or fp8 (E4M3 per tensor, Distribution, removable activations kept)."""
    fp8 = kind == "fp8"
    qtype = QuantType.QFLOAT8E4M3FN if fp8 else QuantType.QInt8
    quantize_static(fp32, qdq, FeedsReader(feeds), quant_format=QuantFormat.QDQ, activation_type=qtype,
                    weight_type=qtype, per_channel=not fp8, op_types_to_quantize=["MatMul", "Gemm"],
                    calibrate_method=CalibrationMethod.Distribution if fp8 else CalibrationMethod.MinMax,
                    extra_options={"QDQKeepRemovableActivations": fp8})


def coarsest_scale(path: str) -> float:
    """The largest per-tensor scale of a QDQ model: one step of its coarsest quantized tensor."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(path)
    return max(float(numpy_helper.to_array(i).astype(np.float32).reshape(-1)[0]) for i in model.graph.initializer
               if i.name.endswith("_scale") and numpy_helper.to_array(i).size == 1)


def reference_session(path: str):
    """onnxruntime running a QDQ model as written (no graph optimisation fusing its Q/DQ pairs)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
