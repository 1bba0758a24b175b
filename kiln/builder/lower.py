"""Lowering: an optimized onnx_ir graph -> ProgramSpec (plain steps) + weights.

Each node becomes one step naming its implementation; attributes become JSON values
(tensors go to the weights, subgraphs become nested ProgramSpecs); a subgraph's reads of
outer-scope values become explicit extra inputs of its node (`captures`), so liveness and
the runtime see every dependency.

Weights are stored once per content: two initializers (or tensor attributes) of at least
SHARE_MIN_ELEMENTS elements with the same dtype, shape and bytes become one engine weight that
both names point at (an exporter that folded a shared weight once per layer, or a model tying
weights under two names), except in a refittable build. Smaller ones stay apart: sharing them
saves nothing, and a tiny constant that must stay fp32 (Resize scales) must not drag an equal one
of a half-precision layer along.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import onnx_ir as ir
import torch

from kiln.ir import dtypes
from kiln.ir.tensors import tensor_to_runtime
from kiln.passes._rewrite import SHARE_MIN_ELEMENTS, shares_weights
from kiln.plan.spec import Binding, ProgramSpec, StepSpec

_A = ir.AttributeType


def _type_to_json(t: ir.TypeProtocol | None) -> dict | None:
    if t is None:
        return None
    if isinstance(t, ir.TensorType):
        return {"kind": "tensor", "dtype": dtypes.from_onnx(int(t.dtype)).name}
    if isinstance(t, ir.SequenceType):
        return {"kind": "sequence", "elem": _type_to_json(t.elem_type)}
    if isinstance(t, ir.OptionalType):
        return {"kind": "optional", "elem": _type_to_json(t.elem_type)}
    return {"kind": "unknown"}


def value_dtype_name(value: ir.Value) -> str | None:
    t = value.type
    while isinstance(t, (ir.SequenceType, ir.OptionalType)):
        t = t.elem_type
    if isinstance(t, ir.TensorType) and int(t.dtype) != 0:
        return dtypes.from_onnx(int(t.dtype)).name
    return None


def binding_of(value: ir.Value) -> Binding:
    kind = "tensor"
    if isinstance(value.type, ir.SequenceType):
        kind = "sequence"
    elif isinstance(value.type, ir.OptionalType):
        kind = "optional"
    shape = None
    if kind == "tensor" and value.shape is not None:
        shape = [d if isinstance(d, int) else d.value for d in value.shape]
    return Binding(name=value.name, dtype=value_dtype_name(value), shape=shape, kind=kind)


def _content_key(weight: Any) -> tuple | None:
    """(dtype, shape, digest of the bytes) of a large tensor; None for small ones and non-tensors."""
    if not isinstance(weight, torch.Tensor) or weight.numel() < SHARE_MIN_ELEMENTS:
        return None
    data = weight.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    return str(weight.dtype), tuple(weight.shape), hashlib.blake2b(data, digest_size=32).digest()


class Lowering:
    def __init__(self, model: ir.Model, copy_weights: bool = True):
        self.copy_weights = copy_weights
        self.opsets = dict(model.opset_imports)
        self.weights: dict[str, Any] = {}
        self.by_content: dict[tuple, str] = {}  # _content_key -> the key of the stored weight
        self.model = model
        self.share = shares_weights(model.graph)  # a refittable build keeps equal weights apart
        # a second lowering of the same graph rewritten (a padding-free engine's packed program after its plain one):
        # an initializer of a name stored already, with the same bytes, is that weight (kiln/builder/padding_free.py)
        self.reuse_names = False
        self.keys_by_name: dict[str, list[str]] = {}

    def _weight_key(self, name: str) -> str:
        key, n = name, 1
        while key in self.weights:
            n += 1
            key = f"{name}#{n}"
        return key

    def store(self, name: str, tensor: ir.TensorProtocol) -> str:
        """The weights key holding `tensor`: a new one, or the key of an identical large weight."""
        weight = tensor_to_runtime(tensor, copy=self.copy_weights)
        if self.reuse_names:
            for key in self.keys_by_name.get(name, []):
                if _same_bytes(self.weights[key], weight):
                    return key
        content = _content_key(weight) if self.share else None
        if content is not None and (key := self.by_content.get(content)) is not None:
            stored = self.weights[key]
            same = stored.reshape(-1).view(torch.uint8)
            if torch.equal(same, weight.contiguous().reshape(-1).view(torch.uint8)):
                return key
        key = self._weight_key(name)
        self.weights[key] = weight
        self.keys_by_name.setdefault(name, []).append(key)
        if content is not None:
            self.by_content.setdefault(content, key)
        return key

    def attribute(self, attr: ir.Attr, step_name: str) -> Any:
        t, v = attr.type, attr.value
        if t in (_A.INT, _A.FLOAT, _A.STRING):
            return v
        if t in (_A.INTS, _A.FLOATS, _A.STRINGS):
            return list(v)
        if t == _A.TENSOR:
            return {"$tensor": self.store(f"{step_name}.{attr.name}", v)}
        if t == _A.TENSORS:
            return [{"$tensor": self.store(f"{step_name}.{attr.name}.{i}", tensor)} for i, tensor in enumerate(v)]
        if t == _A.GRAPH:
            return {"$graph": self.graph(v).to_json()}
        if t == _A.GRAPHS:
            return {"$graphs": [self.graph(g).to_json() for g in v]}
        if t == _A.TYPE_PROTO:
            return {"$type": _type_to_json(v)}
        if t == _A.TYPE_PROTOS:
            return [{"$type": _type_to_json(x)} for x in v]
        raise NotImplementedError(f"attribute {attr.name!r} of type {t.name} on {step_name!r}")

    def graph(self, graph: ir.Graph) -> ProgramSpec:
        constants: dict[str, str] = {}
        for name, value in graph.initializers.items():
            constants[name] = self.store(name, value.const_value)
        input_names = [v.name for v in graph.inputs if v.name not in constants]
        steps = []
        for node in graph:
            name = node.name or f"{node.op_type}_{len(steps)}"
            attrs = {k: self.attribute(a, name) for k, a in node.attributes.items()}
            domain = node.domain or ""
            steps.append(
                StepSpec(
                    op_type=node.op_type,
                    name=name,
                    domain=domain,
                    opset=self.opsets.get(domain, self.opsets.get("ai.onnx", 21)) or 21,
                    inputs=[v.name if v is not None else "" for v in node.inputs],
                    outputs=[v.name if v is not None else "" for v in node.outputs],
                    attributes=attrs,
                    captures=_subgraph_captures(node),
                    output_dtypes=[value_dtype_name(v) for v in node.outputs],
                    fused_from=json.loads(node.metadata_props.get("kiln.fused_from", "[]")),
                )
            )
        return ProgramSpec(
            inputs=input_names,
            outputs=[v.name for v in graph.outputs],
            steps=steps,
            constants=constants,
            captures=_free_names(graph),
        )


def _subgraph_captures(node: ir.Node) -> list[str]:
    """The outer-scope names the node's graph attributes read, in first-use order."""
    names: list[str] = []
    for a in node.attributes.values():
        subs = [a.value] if a.type == _A.GRAPH else list(a.value) if a.type == _A.GRAPHS else []
        for sub in subs:
            for n in _free_names(sub):
                if n not in names:
                    names.append(n)
    return names


def _free_names(graph: ir.Graph) -> list[str]:
    """The names the graph reads but neither takes as input nor defines, in first-use order."""
    defined = {v.name for v in graph.inputs} | set(graph.initializers)
    free: list[str] = []
    for node in graph:
        for n in [*(v.name for v in node.inputs if v is not None), *_subgraph_captures(node)]:
            if n not in defined and n not in free:
                free.append(n)
        defined |= {v.name for v in node.outputs}
    for v in graph.outputs:
        if v.name not in defined and v.name not in free:
            free.append(v.name)
    return free


def _same_bytes(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
            a.detach().contiguous().reshape(-1).view(torch.uint8), b.detach().contiguous().reshape(-1).view(torch.uint8))
    return type(a) is type(b) and getattr(a, "dtype", None) == getattr(b, "dtype", None) and \
        getattr(a, "shape", None) == getattr(b, "shape", None) and bool((a == b).all())


def bindings(model: ir.Model, program: ProgramSpec) -> tuple[list[Binding], list[Binding]]:
    """The engine's input and output bindings of a lowered graph."""
    inputs = [binding_of(v) for v in model.graph.inputs if v.name in program.inputs]
    return inputs, [binding_of(v) for v in model.graph.outputs]


def lower(model: ir.Model, copy_weights: bool = True) -> tuple[ProgramSpec, dict[str, Any], list[Binding], list[Binding]]:
    """`copy_weights=False`: the engine's weights share the graph's arrays where they can (a graph the build
    made itself, never the caller's: one copy of the weights instead of two while both live)."""
    lowering = Lowering(model, copy_weights)
    program = lowering.graph(model.graph)
    inputs, outputs = bindings(model, program)
    return program, lowering.weights, inputs, outputs
