"""The calibration cache: measured ranges on disk, so a rebuild skips the calibration data (TensorRT's
calibration cache). One JSON file: the calibrator, the quantized dtype and {tensor name: amax}; a
cache made with another calibrator or dtype, or missing a tensor the model quantizes, is not used."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from kiln.errors import KilnError

VERSION = 1


def load(path: str | os.PathLike | None, calibrator: str, dtype: str, needed: set[str]) -> dict[str, float] | None:
    """The cached ranges when the file exists and covers `needed` with this calibrator and dtype."""
    if not path or not Path(path).is_file():
        return None
    try:
        doc = json.loads(Path(path).read_text())
    except ValueError as e:
        raise KilnError(f"calibration cache {path}: not readable JSON ({e}); delete it to recalibrate") from None
    if doc.get("version") != VERSION or doc.get("calibrator") != calibrator or doc.get("dtype") != dtype:
        return None
    ranges = {k: float(v) for k, v in doc.get("ranges", {}).items()}
    return ranges if needed <= set(ranges) else None


def save(path: str | os.PathLike | None, calibrator: str, dtype: str, ranges: dict[str, float],
         batches: int) -> None:
    if not path:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"version": VERSION, "calibrator": calibrator, "dtype": dtype, "batches": batches,
           "ranges": dict(sorted(ranges.items()))}
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)
