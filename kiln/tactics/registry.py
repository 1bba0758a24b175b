"""Tactic registry: tactic name -> Tactic, and the candidates of one op on one device.

Each device's tactics live in their own package, `kiln/tactics/<device>/`, and are loaded on
first use for that device only: a CPU engine never imports a CUDA or cuDNN tactic module (nor
triton), a CUDA engine no CPU-only one. A tactic's name starts with its device ("cpu.conv.…"),
so looking one up by name loads the right package. The runtime calls `launch_for` when it loads
an engine: a step that names a tactic gets that tactic's kernel, prepared on the step's weights;
a step without one runs the op's registered implementation.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from kiln.errors import ExecutionError
from kiln.plan.spec import StepSpec
from kiln.tactics.tactic import Launch, Tactic

DEVICES = ("cpu", "cuda")  # one package each under kiln/tactics/
_TACTICS: dict[str, Tactic] = {}
_loaded: set[str] = set()


def register(tactic: Tactic) -> Tactic:
    if tactic.name in _TACTICS:
        raise RuntimeError(f"tactic {tactic.name!r} is registered twice")
    if tactic.device not in DEVICES or not tactic.name.startswith(tactic.device + "."):
        raise RuntimeError(f"tactic {tactic.name!r}: its name must start with its device ({tactic.device!r})")
    _TACTICS[tactic.name] = tactic
    return tactic


def unregister(name: str) -> None:
    """Remove a tactic (tests register throwaway ones)."""
    _TACTICS.pop(name, None)


def load_device(device: str) -> None:
    """Import kiln/tactics/<device>/ (its modules register their tactics), once."""
    if device in _loaded or device not in DEVICES:
        return
    _loaded.add(device)
    importlib.import_module(f"kiln.tactics.{device}")


def get(name: str) -> Tactic | None:
    load_device(name.split(".", 1)[0])
    return _TACTICS.get(name)


def all_tactics(device: str | None = None) -> dict[str, Tactic]:
    """Every tactic of `device` (None: of every device)."""
    for d in DEVICES if device is None else (device,):
        load_device(d)
    return {n: t for n, t in _TACTICS.items() if device is None or t.device == device}


def candidates(op_type: str, domain: str, device: str, opt_level: int = 5) -> list[Tactic]:
    """Tactics for `domain::op_type` on `device` tried at `opt_level`, in registration order."""
    load_device(device)
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
