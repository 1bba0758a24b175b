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
