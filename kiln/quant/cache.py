"""The calibration cache: measured ranges on disk, so a rebuild skips the calibration data (TensorRT's
calibration cache). One JSON file: the calibrator, the quantized dtype, the SmoothQuant strength (null
when off), {tensor name: amax} (a list, one per channel, for a depthwise convolution's input) and, with SmoothQuant, {tensor name: [max |x| per channel]} of the
unsmoothed model, with bias correction {tensor name: [mean per channel]}, for int8 {tensor name: its smallest value} (zero points) (what the smoothing factors are formed from). A cache made with another calibrator, dtype
or SmoothQuant alpha, or missing a tensor the model quantizes, is not used, and `mismatch` says why."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np

from kiln.errors import KilnError

VERSION = 1


def _read(path: str | os.PathLike | None) -> dict | None:
    if not path or not Path(path).is_file():
        return None
    try:
        return json.loads(Path(path).read_text())
    except ValueError as e:
        raise KilnError(f"calibration cache {path}: not readable JSON ({e}); delete it to recalibrate") from None


def mismatch(path: str | os.PathLike | None, calibrator: str, dtype: str, smoothquant: float | None = None) -> str | None:
    """Why the cache at `path` was made for another build (None when it matches, or there is none)."""
    doc = _read(path)
    if doc is None:
        return None
    if doc.get("version") != VERSION:
        return f"it is of version {doc.get('version')}, this kiln writes {VERSION}"
    made = {"calibrator": doc.get("calibrator"), "dtype": doc.get("dtype"), "smoothquant": doc.get("smoothquant")}
    wanted = {"calibrator": calibrator, "dtype": dtype, "smoothquant": smoothquant}
    differ = [f"{k}={made[k]!r}, not {wanted[k]!r}" for k in made if made[k] != wanted[k]]
    return f"it was made with {', '.join(differ)}" if differ else None


def load(path: str | os.PathLike | None, calibrator: str, dtype: str, needed: set[str],
         smoothquant: float | None = None, per_channel: set[str] = frozenset()) -> dict | None:
    """The cached ranges when the file exists and covers `needed` with this calibrator, dtype and alpha,
    the tensors in `per_channel` with one range per channel (a list in the file) and the others with one."""
    doc = _read(path)
    if doc is None or mismatch(path, calibrator, dtype, smoothquant) is not None:
        return None
    ranges = {k: np.asarray(v, np.float64) if isinstance(v, list) else float(v)
              for k, v in doc.get("ranges", {}).items()}
    if not needed <= set(ranges) or any(isinstance(ranges[k], np.ndarray) != (k in per_channel) for k in needed):
        return None
    return ranges


def load_channel_max(path: str | os.PathLike | None, calibrator: str, dtype: str, smoothquant: float,
                     needed: set[str]) -> dict[str, np.ndarray] | None:
    """The cached per-channel maxima (SmoothQuant's statistics) when the file matches and covers `needed`."""
    doc = _read(path)
    if doc is None or mismatch(path, calibrator, dtype, smoothquant) is not None:
        return None
    found = {k: np.asarray(v, np.float32) for k, v in (doc.get("channel_max") or {}).items()}
    return found if needed <= set(found) else None


def load_channel_mean(path: str | os.PathLike | None) -> dict[str, np.ndarray]:
    """The cached per-channel means of the quantized layers' inputs (bias correction), {} when none."""
    doc = _read(path) or {}
    return {k: np.asarray(v, np.float64) for k, v in (doc.get("channel_mean") or {}).items()}


def load_low(path: str | os.PathLike | None) -> dict[str, float]:
    """The cached smallest values of the quantized layers' inputs (uint8 zero points), {} when none."""
    doc = _read(path) or {}
    return {k: float(v) for k, v in (doc.get("low") or {}).items()}


def save(path: str | os.PathLike | None, calibrator: str, dtype: str, ranges: dict[str, float],
         batches: int, smoothquant: float | None = None, channel_max: dict[str, np.ndarray] | None = None,
         channel_mean: dict[str, np.ndarray] | None = None, low: dict[str, float] | None = None) -> None:
    if not path:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"version": VERSION, "calibrator": calibrator, "dtype": dtype, "smoothquant": smoothquant,
           "batches": batches, "ranges": {k: np.asarray(v).tolist() for k, v in sorted(ranges.items())}}
    if channel_max:
        doc["channel_max"] = {k: [float(x) for x in v] for k, v in sorted(channel_max.items())}
    if channel_mean:
        doc["channel_mean"] = {k: [float(x) for x in v] for k, v in sorted(channel_mean.items())}
    if low:
        doc["low"] = {k: float(v) for k, v in sorted(low.items())}
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)
