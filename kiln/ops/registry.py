"""The op registry: ONNX (domain, op_type) -> implementation on torch tensors.

An implementation is a plain function `fn(ctx, *inputs, **attributes)`, written the way
`onnx/reference/ops/op_*.py` writes them: inputs positionally (None for a missing optional
input), attributes as keyword arguments whose Python defaults are the ONNX defaults. It
returns one value, or a tuple for several outputs (a Python list is a *sequence* value).
Version differences between opsets live inside the one function, keyed on `ctx.opset`.

Values are torch tensors; strings and sub-byte types (int4, float4) are numpy arrays;
sequences are Python lists; an empty optional is None.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Kernel = Callable[..., Any]


@dataclass
class OpContext:
    """What an implementation may need to know about the node it runs, fixed at build."""

    name: str
    op_type: str
    domain: str = ""
    opset: int = 21
    num_inputs: int = 0
    num_outputs: int = 1
    output_dtypes: list[Any] = field(default_factory=list)  # kiln.ir.dtypes.DType | None each
    capture_names: list[str] = field(default_factory=list)  # outer-scope values a subgraph reads

    def outer(self, captured: tuple) -> dict[str, Any]:
        """Outer-scope values for subgraphs, from the extra inputs the lowering appended."""
        return dict(zip(self.capture_names, captured))


@dataclass(frozen=True)
class OpSpec:
    op_type: str
    domain: str
    fn: Kernel
    min_opset: int
    attributes: frozenset[str] | None  # None: accepts any attribute (**kwargs)

    def check(self, opset: int, attributes: list[str]) -> str | None:
        """None when this implementation covers the node, else the reason it does not."""
        if opset < self.min_opset:
            return f"opset {opset} is older than the {self.min_opset} kiln implements"
        if self.attributes is not None:
            unknown = sorted(set(attributes) - self.attributes)
            if unknown:
                return f"attribute(s) {', '.join(unknown)} not implemented"
        return None


_REGISTRY: dict[tuple[str, str], OpSpec] = {}

DOMAIN_ALIASES = {"ai.onnx": ""}


def _normal_domain(domain: str) -> str:
    return DOMAIN_ALIASES.get(domain, domain)


def register(*op_types: str, domain: str = "", min_opset: int = 1) -> Callable[[Kernel], Kernel]:
    """Decorator: `@register("Add")` makes `fn` the implementation of ai.onnx Add."""

    def wrap(fn: Kernel) -> Kernel:
        params = list(inspect.signature(fn).parameters.values())
        if any(p.kind is p.VAR_KEYWORD for p in params):
            attrs = None
        else:
            attrs = frozenset(p.name for p in params if p.kind is p.KEYWORD_ONLY)
        for op_type in op_types:
            key = (_normal_domain(domain), op_type)
            if key in _REGISTRY:
                raise RuntimeError(f"{domain or 'ai.onnx'}::{op_type} is registered twice")
            _REGISTRY[key] = OpSpec(op_type, key[0], fn, min_opset, attrs)
        return fn

    return wrap


def lookup(op_type: str, domain: str = "") -> OpSpec | None:
    # Complete whenever this module can be imported: importing kiln.ops.registry imports the package
    # kiln.ops first, whose __init__ imports every op family (each registers its ops).
    return _REGISTRY.get((_normal_domain(domain), op_type))


def registered() -> dict[tuple[str, str], OpSpec]:
    return dict(_REGISTRY)
