"""The timing cache: what the autotuner measured, on disk, so a rebuild times nothing.

One JSON file (`BuildConfig.timing_cache`, `kiln build --timing-cache`). An entry is keyed by
everything a timing depends on: the layer's op, opset, attributes, input shapes, dtypes and
which inputs are weights, the candidate tactics, and the environment (device name, compute
capability or CPU family/model and ISA, driver, thread count, torch/triton/kiln versions, a digest of kiln's kernel
sources). A key that matches means the same problem on the same machine and kernels: the
cached winner is taken without timing, so a rebuild is deterministic. Entries for other machines may share the file; they never match here.

A second table, `in_context`, holds the GEMM and conv tactics chosen in context (kiln/builder/in_context.py), keyed
by a whole network as it runs on this machine: a layer's cost there depends on its neighbours.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

import torch

from kiln.errors import KilnError
from kiln.kernels.cpu import cpu_features
from kiln.plan.spec import StepSpec
from kiln.tactics.tactic import InputMeta
from kiln.version import __version__

CACHE_VERSION = 1


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


@cache
def kernels_digest() -> str:
    """A digest of kiln's own kernels' sources (kiln/kernels: C and Python): a kernel changed between two builds
    of one kiln version times differently, so its old timings must not pick the winner (session 18: a cache
    written before the GEMM's new tile kept choosing oneDNN over it)."""
    root = Path(__file__).resolve().parent.parent / "kernels"
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".c", ".h", ".py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def environment(device: torch.device) -> dict[str, Any]:
    """The machine facts a timing depends on; part of every cache key."""
    env: dict[str, Any] = {
        "device_type": device.type,
        "kiln": __version__,
        "kernels": kernels_digest(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        env["device_name"] = torch.cuda.get_device_name(index)
        env["capability"] = list(torch.cuda.get_device_capability(index))
        env["driver"] = {"cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version()}
        # how autotune.measure times (2026-12-04: a candidate that syncs no longer sends the others to eager
        # timing): entries timed the old way, every INT8/FP8 layer's among them, are not read
        env["timing"] = "cuda graphs; a syncing candidate eagerly, alone"
    else:
        env["device_name"] = cpu_name()
        env["cpu"] = cpu_features.identity()  # the brand string alone may be 'AMD EPYC' on Zen 2, 3 or 4
        env["capability"] = None
        env["driver"] = {"onednn": torch.backends.mkldnn.is_available(), "mkl": bool(torch._C.has_mkl)}
        if (cap := cpu_features.isa_cap()) is not None:  # KILN_CPU_ISA: other kernels, other times
            env["isa_cap"] = cap
    return env


def attributes_json(attributes: dict[str, Any]) -> Any:
    """Attributes as the key sees them: weight references (layer-specific names) become a marker."""
    def clean(v: Any) -> Any:
        if isinstance(v, dict):
            return "<tensor>" if "$tensor" in v else {k: clean(x) for k, x in sorted(v.items())}
        if isinstance(v, list):
            return [clean(x) for x in v]
        return v

    return clean(attributes)


def layer_signature(step: StepSpec, inputs: list[InputMeta], candidates: list[str],
                    env: dict[str, Any]) -> dict[str, Any]:
    return {
        "op": f"{step.domain or 'ai.onnx'}::{step.op_type}",
        "opset": step.opset,
        "attributes": attributes_json(step.attributes),
        "inputs": [None if m.shape is None else
                   {"shape": list(m.shape), "dtype": str(m.dtype).removeprefix("torch."), "constant": m.constant}
                   for m in inputs],
        "candidates": sorted(candidates),
        "environment": env,
    }


def signature_key(signature: dict[str, Any]) -> str:
    text = json.dumps(signature, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class TimingCache:
    """An in-memory view of the cache file; `save()` writes it back atomically."""

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path) if path else None
        self.entries: dict[str, dict[str, Any]] = {}
        self.contexts: dict[str, Any] = {}  # network key -> the choice in context (in_context.py checks its fit)
        self.hits = 0
        self.misses = 0
        if self.path is not None and self.path.exists():
            self.entries, self.contexts = self._read(self.path)

    @staticmethod
    def _read(path: Path) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise KilnError(f"timing cache {path}: unreadable ({e}); delete it to start a new one") from None
        if not isinstance(doc, dict) or doc.get("kiln_timing_cache") != CACHE_VERSION:
            raise KilnError(
                f"timing cache {path}: not a kiln timing cache of version {CACHE_VERSION}; "
                "delete it (or point --timing-cache elsewhere) to start a new one"
            )
        contexts = doc.get("in_context", {})
        return dict(doc.get("entries", {})), dict(contexts) if isinstance(contexts, dict) else {}

    def get(self, key: str) -> dict[str, Any] | None:
        entry = self.entries.get(key)
        if entry is None:
            self.misses += 1
        else:
            self.hits += 1
        return entry

    def put(self, key: str, entry: dict[str, Any]) -> None:
        self.entries[key] = entry

    def save(self) -> None:
        if self.path is None:
            return
        if self.path.exists():  # another build may have added entries meanwhile: keep them
            entries, contexts = self._read(self.path)
            self.entries, self.contexts = {**entries, **self.entries}, {**contexts, **self.contexts}
        doc = {"kiln_timing_cache": CACHE_VERSION, "entries": self.entries, "in_context": self.contexts}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(doc, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
        except BaseException:
            os.unlink(tmp)
            raise
