"""The export cache: each zoo model is exported to ONNX once per set of versions that made it.

An entry is a folder `<cache>/<name>-<key>/` holding `model.onnx`, `inputs.npz` (the deterministic
example input, one array per graph input) and `meta.json` (what the key was made of). The key
hashes the zoo version, the torch / transformers / onnx / onnxscript versions, the model's config
and the example input shapes, so a change to any of them exports afresh instead of reusing a
stale file. Exports are written to a temporary folder and renamed into place under a file lock,
so parallel test workers (pytest -n 2) neither export twice nor see half-written files.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# Bump when a model definition, an example input or the export settings change.
ZOO_VERSION = 1


def cache_dir() -> Path:
    """`$KILN_CACHE/zoo` when KILN_CACHE is set, else `~/.cache/kiln/zoo`."""
    root = os.environ.get("KILN_CACHE")
    return Path(root) / "zoo" if root else Path.home() / ".cache" / "kiln" / "zoo"


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def versions() -> dict[str, str | int]:
    return {
        "zoo": ZOO_VERSION,
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "onnx": _version("onnx"),
        "onnxscript": _version("onnxscript"),
    }


@dataclass(frozen=True)
class Export:
    """What one export made: the ONNX file, its example inputs and the recorded metadata."""

    name: str
    path: Path  # model.onnx
    folder: Path
    meta: dict

    def inputs(self) -> dict[str, np.ndarray]:
        with np.load(self.folder / "inputs.npz") as data:
            return {k: data[k] for k in data.files}


def cache_key(name: str, config: dict) -> str:
    payload = json.dumps({"name": name, "config": config, "versions": versions()}, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


Exporter = Callable[[Path], dict[str, np.ndarray]]  # writes model.onnx into the folder, returns inputs


def cached_export(name: str, config: dict, export: Exporter, *, refresh: bool = False) -> Export:
    """Return the cached export of `name` for `config`, running `export` first when there is none."""
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    key = cache_key(name, config)
    folder = root / f"{name}-{key}"
    with open(root / f".{name}-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one exporter per entry; the others wait and reuse it
        if refresh and folder.exists():
            shutil.rmtree(folder)
        if not (folder / "meta.json").exists():
            _export_into(folder, name, config, key, export)
    meta = json.loads((folder / "meta.json").read_text())
    return Export(name=name, path=folder / "model.onnx", folder=folder, meta=meta)


def _export_into(folder: Path, name: str, config: dict, key: str, export: Exporter) -> None:
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=folder.parent))
    try:
        start = time.perf_counter()
        inputs = export(staging)
        seconds = time.perf_counter() - start
        if not (staging / "model.onnx").exists():
            raise RuntimeError(f"zoo model {name!r}: the exporter wrote no model.onnx into {staging}")
        np.savez(staging / "inputs.npz", **inputs)
        meta = {
            "name": name, "key": key, "config": config, "versions": versions(),
            "inputs": {k: {"dtype": str(v.dtype), "shape": list(v.shape)} for k, v in inputs.items()},
            "export_seconds": round(seconds, 2),
        }
        (staging / "meta.json").write_text(json.dumps(meta, indent=2, default=str))
        if folder.exists():  # a partial folder left by a killed run
            shutil.rmtree(folder)
        staging.rename(folder)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
