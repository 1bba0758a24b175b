"""What onnxruntime reports about a model: NodeArg (name, type, shape) and ModelMetadata.

Read from the ONNX proto itself, so they are there before any engine is built, and spelled as
onnxruntime spells them: 'tensor(float)', 'seq(tensor(int64))', symbolic dims as their names,
unknown dims as None. Output types come from ONNX shape inference where the graph leaves them
open, as onnxruntime's own inference fills them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx

from kiln.ir import dtypes

INT64_MAX = 2**63 - 1  # onnxruntime's model version when the model declares none


def type_string(t: onnx.TypeProto) -> str:
    kind = t.WhichOneof("value")
    if kind == "tensor_type":
        return f"tensor({dtypes.from_onnx(t.tensor_type.elem_type).name})" if t.tensor_type.elem_type else "tensor(undefined)"
    if kind == "sparse_tensor_type":
        return f"sparse_tensor({dtypes.from_onnx(t.sparse_tensor_type.elem_type).name})"
    if kind == "sequence_type":
        return f"seq({type_string(t.sequence_type.elem_type)})"
    if kind == "optional_type":
        return f"optional({type_string(t.optional_type.elem_type)})"
    if kind == "map_type":
        key = dtypes.from_onnx(t.map_type.key_type).name
        return f"map({key},{type_string(t.map_type.value_type)})"
    return "undefined"


def shape_list(t: onnx.TypeProto, inferred: bool = False) -> list[int | str | None]:
    """Dims as onnxruntime reports them; `inferred`: the names ONNX inference invents for dims it
    cannot name ("unk__0") are unknown dims (None) to onnxruntime."""
    if t.WhichOneof("value") != "tensor_type" or not t.tensor_type.HasField("shape"):
        return []
    dims: list[int | str | None] = []
    for d in t.tensor_type.shape.dim:
        kind = d.WhichOneof("value")
        if kind == "dim_param" and inferred and d.dim_param.startswith("unk__"):
            dims.append(None)
        else:
            dims.append(d.dim_value if kind == "dim_value" else d.dim_param if kind == "dim_param" else None)
    return dims


@dataclass(frozen=True)
class NodeArg:
    """onnxruntime.NodeArg: one input or output of the model."""

    name: str
    type: str
    shape: list[int | str | None]

    def __repr__(self) -> str:
        return f"NodeArg(name={self.name!r}, type={self.type!r}, shape={self.shape!r})"

    @classmethod
    def of(cls, value: onnx.ValueInfoProto, inferred: bool = False) -> NodeArg:
        return cls(value.name, type_string(value.type), shape_list(value.type, inferred))


@dataclass(frozen=True)
class ModelMetadata:
    """onnxruntime.ModelMetadata."""

    producer_name: str
    graph_name: str
    domain: str
    description: str
    graph_description: str
    version: int
    custom_metadata_map: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, model: onnx.ModelProto) -> ModelMetadata:
        return cls(
            producer_name=model.producer_name, graph_name=model.graph.name, domain=model.domain,
            description=model.doc_string, graph_description=model.graph.doc_string,
            version=model.model_version if model.HasField("model_version") else INT64_MAX,
            custom_metadata_map={p.key: p.value for p in model.metadata_props},
        )


@dataclass(frozen=True)
class Signature:
    """The model's runtime inputs, overridable initializers and outputs, as onnxruntime lists them."""

    inputs: list[NodeArg]
    initializers: list[NodeArg]  # graph inputs with an initializer (get_overridable_initializers)
    outputs: list[NodeArg]

    @classmethod
    def of(cls, model: onnx.ModelProto) -> Signature:
        graph = model.graph
        initialized = {t.name for t in graph.initializer}
        outputs = [NodeArg.of(v) for v in graph.output]
        if any(_open(v.type) for v in graph.output):
            # the graph declares less than inference knows: report what onnxruntime would
            inferred = _inferred_outputs(model)
            if inferred is not None:
                outputs = [NodeArg.of(i, inferred=True) if _open(v.type) else o
                           for v, i, o in zip(graph.output, inferred, outputs)]
        return cls(
            inputs=[NodeArg.of(v) for v in graph.input if v.name not in initialized],
            initializers=[NodeArg.of(v) for v in graph.input if v.name in initialized],
            outputs=outputs,
        )


def _open(t: onnx.TypeProto) -> bool:
    return t.WhichOneof("value") == "tensor_type" and (not t.tensor_type.elem_type or not t.tensor_type.HasField("shape"))


def _inferred_outputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto] | None:
    try:
        return list(onnx.shape_inference.infer_shapes(model, strict_mode=False).graph.output)
    except Exception:  # noqa: BLE001  inference is best-effort; the declared types stand
        return None
