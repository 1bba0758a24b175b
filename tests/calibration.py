"""The calibration data the tests hand onnxruntime's quantize_static when they make QDQ models."""

from __future__ import annotations

import numpy as np
from onnxruntime.quantization import CalibrationDataReader


class FeedsReader(CalibrationDataReader):
    """The given feeds, one batch a get_next, then None: quantize_static's calibration input."""

    def __init__(self, feeds: list[dict[str, np.ndarray]]):
        self._items = iter(feeds)

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._items, None)
