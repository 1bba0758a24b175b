"""Errors kiln raises for people: each names the thing, expected vs given, and what to do."""

from __future__ import annotations


class KilnError(Exception):
    """Base class of every error kiln raises on purpose."""


class ModelError(KilnError):
    """The model file or proto cannot be imported (unreadable, malformed, inconsistent)."""


class UnsupportedModelError(ModelError):
    """The model uses ops (or op versions, attributes) kiln cannot run; every one is listed."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"kiln cannot run {len(problems)} node(s) of this model:\n{lines}")


class EngineFormatError(KilnError):
    """An engine file is truncated, corrupted, of another format version or for another device."""


class BindingError(KilnError, ValueError):
    """Inputs given to an engine do not match its bindings (name, dtype or shape)."""


class ExecutionError(KilnError):
    """A layer failed while running; the message names the layer and its op."""


class EngineRebuildWarning(UserWarning):
    """Inputs lay outside an engine's optimization profile, so kiln rebuilt it with the profile widened
    (kiln.InferenceSession, torch.compile(backend="kiln")); the message says how to build once."""
