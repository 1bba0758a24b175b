"""The plan: the contract the builder writes and the runtime reads.

`StepSpec` is one layer (op, inputs and outputs by value name, JSON-able attributes, the tactic
the autotuner chose), `ProgramSpec` a (sub)graph's step list, `Binding` one engine input or
output, `EnginePlan` everything needed to run a model without the ONNX file: `header` (versions,
device, build config, bindings, memory plan, layer info; JSON-able), `program`, and `weights`
(the constants by name: torch tensors, or numpy arrays for types torch cannot hold).
Plain data only: nothing here runs a layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

FORMAT_VERSION = 1
# an input named like one of these, integer or bool [batch, seq], is a padding mask (nonzero: a real token):
# the runtime pads the sequence it covers (kiln/runtime/buckets.py), remove_padding packs its real tokens
MASK_NAMES = ("attention_mask", "mask", "input_mask")


@dataclass
class StepSpec:
    op_type: str
    name: str
    inputs: list[str]  # "" marks a missing optional input
    outputs: list[str]  # "" marks an output nobody asked for
    attributes: dict[str, Any] = field(default_factory=dict)  # JSON-able; see engine.plan
    domain: str = ""
    opset: int = 21
    captures: list[str] = field(default_factory=list)  # outer values its subgraphs read
    output_dtypes: list[str | None] = field(default_factory=list)
    fused_from: list[str] = field(default_factory=list)  # ONNX node names this step absorbed
    precision: str = ""  # "fp32": pinned to fp32 in a reduced-precision engine
    tactic: str = ""  # the kernel the autotuner chose (kiln/tactics); "": the op's registered implementation
    tactic_config: dict[str, Any] = field(default_factory=dict)  # JSON-able parameters of that tactic

    def to_json(self) -> dict:
        required = ("op_type", "name", "inputs", "outputs")
        return {k: v for k, v in self.__dict__.items() if k in required or v not in ([], {}, "")}

    @classmethod
    def from_json(cls, d: dict) -> StepSpec:
        return cls(**d)


@dataclass
class ProgramSpec:
    inputs: list[str]
    outputs: list[str]
    steps: list[StepSpec]
    constants: dict[str, str] = field(default_factory=dict)  # value name -> engine weight key
    captures: list[str] = field(default_factory=list)  # names read from the enclosing graph

    def to_json(self) -> dict:
        return {
            "inputs": self.inputs,
            "outputs": self.outputs,
            "constants": self.constants,
            "captures": self.captures,
            "steps": [s.to_json() for s in self.steps],
        }

    @classmethod
    def from_json(cls, d: dict) -> ProgramSpec:
        return cls(
            inputs=d["inputs"],
            outputs=d["outputs"],
            constants=d.get("constants", {}),
            captures=d.get("captures", []),
            steps=[StepSpec.from_json(s) for s in d["steps"]],
        )



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
    # a padding-free engine's plain program: the same model without remove_padding, on the same weights (keys of
    # `weights`), tuned as a plain build tunes it; the runtime runs it where a run would not pack its tokens
    plain: ProgramSpec | None = None
    # the loaded file's weight bytes (kiln/plan/file.py MappedWeights) when the weights are views of them
    mapped: Any = field(default=None, repr=False, compare=False)

    @property
    def inputs(self) -> list[Binding]:
        return [Binding(**b) for b in self.header["inputs"]]

    @property
    def outputs(self) -> list[Binding]:
        return [Binding(**b) for b in self.header["outputs"]]

    @property
    def profiles(self) -> list[Profile]:
        return [Profile.from_json(p) for p in self.header.get("profiles", [])]


@dataclass
class ShapeRange:
    """One input's shapes in a profile: the smallest, the one tactics are tuned at, the largest."""

    min: list[int]
    opt: list[int]
    max: list[int]

    def to_json(self) -> dict:
        return {"min": self.min, "opt": self.opt, "max": self.max}

    def describe(self) -> str:
        return "[" + ", ".join(str(lo) if lo == hi else f"{lo}..{hi}" for lo, hi in zip(self.min, self.max)) + "]"


@dataclass
class Profile:
    """An optimization profile (TensorRT's): the range of shapes each input may take in one run.

    An engine with symbolic dims carries one or more; a run's shapes must fall inside one of them
    (the first that fits is used). `source` says where it came from: the user, or kiln's defaults
    and why (shown by `kiln inspect`).
    """

    inputs: dict[str, ShapeRange]
    source: str = "user"

    def to_json(self) -> dict:
        return {"inputs": {k: v.to_json() for k, v in self.inputs.items()}, "source": self.source}

    @classmethod
    def from_json(cls, d: dict) -> Profile:
        return cls({k: ShapeRange(**v) for k, v in d["inputs"].items()}, d.get("source", "user"))

    def outside(self, shapes: dict[str, tuple[int, ...]]) -> str | None:
        """None when every input's shape lies inside this profile, else the first that does not."""
        for name, r in self.inputs.items():
            shape = shapes.get(name)
            if shape is None:
                continue
            if len(shape) != len(r.min) or any(not lo <= d <= hi for d, lo, hi in zip(shape, r.min, r.max)):
                return f"input {name!r} shape {list(shape)} is not inside {r.describe()}"
        return None

    def describe(self) -> str:
        return ", ".join(f"{name} {r.describe()}" for name, r in self.inputs.items())
