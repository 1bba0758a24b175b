"""Tactic registry: tactic name -> Tactic, and the candidates of one op on one device.

Tactics are declared per device in kiln/tactics/cpu.py (and kiln/tactics/cuda.py when it
exists), filled in on first use, like the op registry. The runtime calls `launch_for` when it
loads an engine: a step that names a tactic gets that tactic's kernel, prepared on the step's
weights; a step without one runs the op's registered implementation.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

import torch

from kiln.errors import ExecutionError
from kiln.tactics.tactic import Launch, Tactic

if TYPE_CHECKING:
    from kiln.runtime.program import StepSpec

_TACTICS: dict[str, Tactic] = {}
# A module that is absent (an optional backend not written or not installed) is skipped.
_DEVICE_MODULES = ("kiln.tactics.cpu", "kiln.tactics.cpu_onednn", "kiln.tactics.cuda", "kiln.tactics.cuda_attention",
                   "kiln.tactics.cuda_pool", "kiln.tactics.cudnn", "kiln.tactics.cuda_conv")
_loaded = False


def register(tactic: Tactic) -> Tactic:
    if tactic.name in _TACTICS:
        raise RuntimeError(f"tactic {tactic.name!r} is registered twice")
    _TACTICS[tactic.name] = tactic
    return tactic


def unregister(name: str) -> None:
    """Remove a tactic (tests register throwaway ones)."""
    _TACTICS.pop(name, None)


def _load() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for module in _DEVICE_MODULES:
        if importlib.util.find_spec(module) is not None:
            importlib.import_module(module)


def get(name: str) -> Tactic | None:
    _load()
    return _TACTICS.get(name)


def all_tactics() -> dict[str, Tactic]:
    _load()
    return dict(_TACTICS)


def candidates(op_type: str, domain: str, device: str, opt_level: int = 5) -> list[Tactic]:
    """Tactics for `domain::op_type` on `device` tried at `opt_level`, in registration order."""
    _load()
    return [t for t in _TACTICS.values()
            if t.op_type == op_type and t.domain == domain and t.device == device and t.level <= opt_level]


def launch_for(step: StepSpec, default: Launch, constants: list[Any], device: torch.device | None) -> Launch:
    """The kernel `step` runs: its tactic, prepared once on its constant inputs (weights)."""
    tactic = get(step.tactic)
    if tactic is None:
        raise ExecutionError(
            f"layer {step.name!r} ({step.op_type}) names tactic {step.tactic!r}, which this kiln does not have; "
            "rebuild the engine with this kiln"
        )
    if not tactic.available():
        # Same device type, but this torch lacks the library (e.g. built without oneDNN): stay correct.
        return default
    try:
        return tactic.prepare(step, constants, device or torch.device("cpu"))
    except Exception as e:  # re-raised with the layer and tactic named; the cause is chained
        raise ExecutionError(
            f"layer {step.name!r} ({step.op_type}): preparing tactic {tactic.name!r} failed: {type(e).__name__}: {e}"
        ) from e
