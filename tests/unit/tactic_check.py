"""What the autotuner does to a candidate tactic before timing it, as the tactic tests share it:
check the layer, prepare on the constants, launch on the tactic's layout, compare with the op's
registered implementation (kiln/builder/autotune.py `mismatch`, the dtype's tolerance)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

from kiln.ops.registry import OpContext, lookup
from kiln.plan.spec import StepSpec
from kiln.tactics import registry
from kiln.builder.accuracy import mismatch
from kiln.tactics.tactic import InputMeta

CPU = torch.device("cpu")


def make_step(op_type: str, domain: str, n_inputs: int, n_outputs: int = 1, opset: int = 21, **attributes) -> StepSpec:
    return StepSpec(op_type=op_type, name=f"{op_type.lower()}_0", inputs=[f"in{i}" for i in range(n_inputs)],
                    outputs=[f"out{i}" for i in range(n_outputs)], attributes=attributes, domain=domain, opset=opset)


def metas(args: list, constant: set[int] = frozenset()) -> list[InputMeta]:
    return [InputMeta.of(a, i in constant) for i, a in enumerate(args)]


def run_against_reference(name: str, step: StepSpec, args: list, constant: set[int] = frozenset()):
    """Check, prepare, launch, compare with the registered op; returns the tactic's output."""
    tactic = registry.get(name)
    assert tactic.check(step, metas(args, constant)) is True
    ctx = OpContext(name=step.name, op_type=step.op_type, domain=step.domain, opset=step.opset,
                    num_inputs=len(args), num_outputs=len(step.outputs))
    constants = [a if i in constant else None for i, a in enumerate(args)]
    launch = tactic.prepare(dataclasses.replace(step, tactic=name), constants, CPU)
    expected = lookup(step.op_type, step.domain).fn(
        ctx, *[a.clone() if isinstance(a, torch.Tensor) else a for a in args], **step.attributes)
    got = launch(ctx, *[tactic.to_layout(a) for a in args], **step.attributes)
    problem = mismatch(got, expected)
    assert problem is None, f"{name}: {problem}"
    return got


def reason(name: str, step: StepSpec, args: list, constant: set[int] = frozenset()) -> str:
    """Why the tactic refuses the layer (it must refuse)."""
    result = registry.get(name).check(step, metas(args, constant))
    assert isinstance(result, str), f"{name} accepted the layer"
    return result


def cuda_tactics_on_cpu(monkeypatch: pytest.MonkeyPatch, select: Callable[[str], bool]) -> None:
    """The selected CUDA tactics registered as CPU ones (their Triton kernels run in the interpreter),
    so a CPU build searches, checks and runs them end to end."""
    for name, tactic in registry.all_tactics().items():
        if tactic.device == "cuda" and select(name):
            monkeypatch.setitem(registry._TACTICS, name, dataclasses.replace(tactic, device="cpu"))


def tuned_candidates(engine) -> tuple[dict[str, float | str], set[str]]:
    """(every candidate the build tried -> ms or why it was dropped, the ones that passed the check);
    no candidate may have been rejected by the check."""
    layers = engine.plan.header["tactics"]["layers"]
    tried = {name: note for layer in layers.values() for name, note in layer["candidates"].items()}
    assert not [f"{n}: {note}" for n, note in tried.items() if isinstance(note, str) and "rejected" in note]
    return tried, {n for n, note in tried.items() if isinstance(note, float)}


def winning_test_tactics(monkeypatch, op_type: str, dtypes: tuple):
    """For a fixture: yields add(name, launch, layers=None), which registers a CPU test tactic for kiln::`op_type`
    (for the layers named, or all) that wins every timing (names start "cpu.test."); removed afterwards."""
    from kiln.builder import autotune
    from kiln.tactics import registry
    from kiln.tactics.tactic import Tactic

    names = []

    def add(name: str, launch, layers: set[str] | None = None):
        registry.register(Tactic(
            name=name, op_type=op_type, domain="kiln", device="cpu", dtypes=dtypes,
            supports=lambda step, inputs: layers is None or step.name in layers or f"not layer {step.name}",
            prepare=lambda step, constants, device: launch))
        names.append(name)

    monkeypatch.setattr(autotune, "measure", lambda fns, device, runs=10, **_: {
        k: 0.0 if k.startswith("cpu.test.") else 1.0 for k in fns})
    yield add
    for name in names:
        registry.unregister(name)
