"""EnginePlan: everything needed to run a model, without the ONNX file.

`header` is JSON-able (versions, device, build config, bindings, memory plan, layer info),
`program` the top-level step list, `weights` the constants by name (torch tensors, or numpy
arrays for types torch cannot hold).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kiln.runtime.program import ProgramSpec

FORMAT_VERSION = 1


@dataclass
class Binding:
    """One engine input or output: name, element type and shape (int, symbol or None per dim)."""

    name: str
    dtype: str | None  # ONNX element type name, e.g. "float"; None when not a tensor
    shape: list[int | str | None] | None  # None: rank unknown
    kind: str = "tensor"  # tensor | sequence | optional

    def to_json(self) -> dict:
        return dict(self.__dict__)

    def describe(self) -> str:
        dims = "?" if self.shape is None else "[" + ", ".join("?" if d is None else str(d) for d in self.shape) + "]"
        kind = "" if self.kind == "tensor" else f"{self.kind} of "
        return f"{kind}{self.dtype or '?'}{dims}"


@dataclass
class EnginePlan:
    header: dict[str, Any]
    program: ProgramSpec
    weights: dict[str, Any] = field(default_factory=dict)

    @property
    def inputs(self) -> list[Binding]:
        return [Binding(**b) for b in self.header["inputs"]]

    @property
    def outputs(self) -> list[Binding]:
        return [Binding(**b) for b in self.header["outputs"]]
