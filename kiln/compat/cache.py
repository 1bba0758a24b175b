"""The engine cache of kiln.InferenceSession: one .kiln file per (model, options, device, versions).

The key hashes the model's bytes (and its external data files), the build options, the device
(CPU model, or GPU name and compute capability) and the kiln and torch versions, so an engine is
reused only where a fresh build would make the same one. The cache lives in `$KILN_CACHE/engines`
(default `~/.cache/kiln/engines`) or where the TensorRT provider's `trt_engine_cache_path` or the
kiln provider's `cache_dir` says. Builds of one key are serialised by a file lock: parallel
processes build once and the others load the result.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import platform
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from kiln.version import __version__


def default_dir() -> Path:
    root = os.environ.get("KILN_CACHE")
    return Path(root) / "engines" if root else Path.home() / ".cache" / "kiln" / "engines"


def device_description(device: str) -> dict:
    if device == "cuda" and torch.cuda.is_available():
        return {"type": "cuda", "name": torch.cuda.get_device_name(),
                "capability": list(torch.cuda.get_device_capability())}
    return {"type": "cpu", "name": platform.processor() or platform.machine()}


def engine_key(model_digest: str, build_options: dict, device: str) -> str:
    payload = json.dumps({"model": model_digest, "options": build_options, "device": device_description(device),
                          "kiln": __version__, "torch": torch.__version__}, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:24]


def model_digest(data: bytes, external: list[Path]) -> str:
    digest = hashlib.sha256(data)
    for path in external:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


@contextmanager
def locked(folder: Path, key: str) -> Iterator[Path]:
    """The engine path of `key`, held under a lock while the caller builds or loads it."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f".{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield folder / f"{key}.kiln"


