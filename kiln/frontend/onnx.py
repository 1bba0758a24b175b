"""ONNX import: bytes, file or ModelProto -> a checked onnx_ir.Model.

Every problem is collected and reported at once, by node name: unreadable bytes, missing
external-data files, undefined inputs, cycles, and every node kiln has no implementation for.
A file's large weights, and a model's external data, are read once into arrays of their own,
never through protobuf (onnx_file.py says why).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
from google.protobuf.message import DecodeError
from onnx import numpy_helper
from onnx_ir.passes import common as ir_passes

from kiln.errors import ModelError, UnsupportedModelError
from kiln.frontend import onnx_file
from kiln.ops.registry import lookup

ModelSource = str | os.PathLike | bytes | onnx.ModelProto
WEIGHT_BYTES = 1 << 16  # initializers this large: left in the file until read into their own arrays, and left
                        # out of the copy ONNX's shape inference makes


def _read_proto(source: ModelSource) -> tuple[onnx.ModelProto, Path | None, str | None]:
    """The parsed model, the folder its external data lies in, and the file's name where its large weights were
    left in it as external data (onnx_file.skeleton)."""
    if isinstance(source, onnx.ModelProto):
        return source, None, None
    own_file = None
    if isinstance(source, bytes):
        data, base, label = source, None, "the given bytes"
    else:
        path = Path(source)
        if not path.is_file():
            raise ModelError(f"{path}: no such model file")
        base, label = path.parent, str(path)
        in_place = onnx_file.skeleton(path, WEIGHT_BYTES)
        if in_place is not None:
            data, own_file = in_place.data, path.name
        else:
            data = path.read_bytes()
    if not data:
        raise ModelError(f"{label}: the file is empty, not an ONNX model")
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except (DecodeError, RuntimeWarning, ValueError) as e:
        raise ModelError(f"{label}: not a readable ONNX model (protobuf decode failed: {e}); "
                         "is the file truncated or of another format?") from None
    if not model.HasField("graph") or (not model.graph.node and not model.graph.output):
        raise ModelError(f"{label}: parsed, but holds no graph: not an ONNX model (or truncated)")
    if not model.opset_import:  # required since IR version 3; its absence means a cut-off file
        raise ModelError(f"{label}: the model declares no opset_import: not a complete ONNX model (truncated?)")
    return model, base, own_file


def _external_tensors(graph: onnx.GraphProto):
    for t in graph.initializer:
        yield t
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR:
                yield attr.t
            for g in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
                yield from _external_tensors(g)


def _location(t: onnx.TensorProto) -> str:
    return {e.key: e.value for e in t.external_data}.get("location", "")


def _load_external_data(model: onnx.ModelProto, base: Path | None, own_file: str | None) -> None:
    """Check that every external-data file is there, and read the small tensors' data into the message (shape
    inference reads small initializers' values); the large stay external until the import reads each into an array
    of its own (onnx_file.read_external), as do the weights left in the model file itself."""
    problems = []
    external = [t for t in _external_tensors(model.graph) if t.data_location == onnx.TensorProto.EXTERNAL
                and not (own_file is not None and _location(t) == own_file)]
    if not external:
        return
    if base is None:
        raise ModelError(
            f"{len(external)} tensor(s) keep their data in external files, but the model was "
            "given as bytes/proto: pass the .onnx path so kiln can find the data files"
        )
    for t in external:
        location = _location(t)
        if not (base / location).is_file():
            problems.append(f"initializer {t.name!r}: external data file {str(base / location)!r} is missing")
    if problems:
        raise ModelError("external data cannot be loaded:\n" + "\n".join(f"  - {p}" for p in problems))
    try:
        for t in external:
            if _tensor_bytes(t) < WEIGHT_BYTES:
                onnx.external_data_helper.load_external_data_for_tensor(t, str(base))
                t.data_location = onnx.TensorProto.DEFAULT
                del t.external_data[:]
    except (OSError, ValueError, onnx.checker.ValidationError) as e:  # onnx's: a location outside the folder
        raise ModelError(f"external data cannot be loaded from {base}: {e}") from None


def _tensor_bytes(t: onnx.TensorProto) -> int:
    length = {e.key: e.value for e in t.external_data}.get("length")
    if length is not None and length.isdigit():
        return int(length)
    itemsize = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize
    return itemsize * int(np.prod(t.dims, dtype=np.int64))


def _node_label(node: onnx.NodeProto, index: int, where: str) -> str:
    name = node.name or "<unnamed>"
    return f"node {name!r} (#{index} in {where}, {node.domain or 'ai.onnx'}::{node.op_type})"


def _check_graph(graph: onnx.GraphProto, outer: set[str], where: str, problems: list[str]) -> None:
    """Undefined inputs and cycles, recursively; also puts the nodes in topological order."""
    defined = set(outer) | {v.name for v in graph.input} | {t.name for t in graph.initializer}
    defined |= {t.values.name for t in graph.sparse_initializer}
    producer: dict[str, int] = {}
    for i, node in enumerate(graph.node):
        for out in node.output:
            if out:
                producer[out] = i
    deps: list[set[int]] = []
    for i, node in enumerate(graph.node):
        d = set()
        for name in node.input:
            if not name:
                continue
            if name in producer:
                d.add(producer[name])
            elif name not in defined:
                problems.append(f"{_node_label(node, i, where)}: input {name!r} is not defined by any "
                                "graph input, initializer or node output")
        for attr in node.attribute:
            for g in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
                inner_outer = defined | set(producer)
                _check_graph(g, inner_outer, f"{where}/{node.name or node.op_type}.{attr.name}", problems)
                d |= {producer[n] for n in _free_names(g) if n in producer}
        deps.append(d)
    # Kahn's algorithm, stable: nodes already in order keep it.
    order: list[int] = []
    indegree = [len(d) for d in deps]
    users: dict[int, list[int]] = {}
    for i, d in enumerate(deps):
        for j in d:
            users.setdefault(j, []).append(i)
    ready = [i for i, n in enumerate(indegree) if n == 0]
    import heapq

    heapq.heapify(ready)
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for u in users.get(i, []):
            indegree[u] -= 1
            if indegree[u] == 0:
                heapq.heappush(ready, u)
    if len(order) < len(graph.node):
        stuck = [i for i in range(len(graph.node)) if i not in set(order)]
        labels = ", ".join(_node_label(graph.node[i], i, where) for i in stuck[:10])
        problems.append(f"the graph has a cycle through {len(stuck)} node(s): {labels}")
        return
    for out in graph.output:
        if out.name not in defined and out.name not in producer:
            problems.append(f"graph output {out.name!r} of {where} is not produced by any node")
    if order != list(range(len(graph.node))):
        nodes = [graph.node[i] for i in order]
        del graph.node[:]
        graph.node.extend(nodes)


def _free_names(graph: onnx.GraphProto) -> set[str]:
    defined = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    used = set()
    for node in graph.node:
        used |= {n for n in node.input if n}
        for attr in node.attribute:
            for g in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
                used |= _free_names(g)
        defined |= set(node.output)
    return used - defined


def _densify_sparse_constants(graph: onnx.GraphProto) -> None:
    """Constant(sparse_value) -> Constant(value): onnx_ir cannot hold sparse attributes, and
    the op's output is dense anyway."""
    for node in graph.node:
        for attr in node.attribute:
            for g in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
                _densify_sparse_constants(g)
        if node.op_type != "Constant" or node.domain not in ("", "ai.onnx"):
            continue
        for attr in list(node.attribute):
            if attr.type != onnx.AttributeProto.SPARSE_TENSOR:
                continue
            sparse = attr.sparse_tensor
            values = numpy_helper.to_array(sparse.values)
            indices = numpy_helper.to_array(sparse.indices).astype("int64")
            dense = np.zeros(tuple(sparse.dims), dtype=values.dtype)
            if indices.ndim == 2:  # [NNZ, rank] coordinates
                dense[tuple(indices.T)] = values
            else:  # [NNZ] linear indices
                dense.reshape(-1)[indices] = values
            node.attribute.remove(attr)
            node.attribute.append(onnx.helper.make_attribute("value", numpy_helper.from_array(dense)))


def _unsupported(model: ir.Model) -> list[str]:
    problems = []
    opsets = dict(model.opset_imports)
    for graph in [model.graph, *model.graph.subgraphs()]:
        for i, node in enumerate(graph):
            domain = node.domain or ""
            opset = opsets.get(domain, opsets.get("ai.onnx", 0))
            spec = lookup(node.op_type, domain)
            where = "the main graph" if graph is model.graph else f"subgraph {graph.name!r}"
            label = f"node {node.name or '<unnamed>'!r} (#{i} in {where}): {domain or 'ai.onnx'}::{node.op_type} opset {opset}"
            if spec is None:
                problems.append(f"{label}: no kiln implementation of this op")
                continue
            reason = spec.check(opset, list(node.attributes))
            if reason:
                problems.append(f"{label}: {reason}")
    return problems


def _infer_shapes(proto: onnx.ModelProto) -> onnx.ModelProto:
    """`proto` with ONNX's inferred shapes and dtypes, inferred on a skeleton without its large weights.

    onnx.shape_inference serialises the model, parses it in C++ and returns a parsed copy: with the
    weights that is ~3x their bytes more at once (an ALBERT-base import peaked at ~3.5x its 42 MiB).
    Inference reads an initializer's dtype and dims, and the values of small ones only (shape tensors
    for data propagation), so it runs on a copy whose large initializers carry no bytes, and what it
    found (value_info, the outputs' types, subgraphs' annotations) is copied back. Best-effort: on
    failure the model is returned as it was (shapes are re-derived at run time)."""
    skeleton = onnx.ModelProto(ir_version=proto.ir_version)
    skeleton.opset_import.extend(proto.opset_import)
    skeleton.functions.extend(proto.functions)
    graph, source = skeleton.graph, proto.graph
    graph.name = source.name
    for field in ("node", "input", "output", "value_info"):
        getattr(graph, field).extend(getattr(source, field))
    for tensor in source.initializer:
        if tensor.HasField("raw_data") and len(tensor.raw_data) >= WEIGHT_BYTES:
            graph.initializer.add(name=tensor.name, data_type=tensor.data_type, dims=tensor.dims)
        else:
            graph.initializer.append(tensor)
    try:
        inferred = onnx.shape_inference.infer_shapes(skeleton, check_type=False, strict_mode=False, data_prop=True)
    except Exception:  # noqa: BLE001  inference is best-effort: kiln re-derives shapes at run time
        return proto
    found = inferred.graph
    if len(found.node) != len(source.node) or len(found.output) != len(source.output):
        return proto
    del source.value_info[:]
    source.value_info.extend(found.value_info)
    for mine, theirs in zip(source.output, found.output):
        mine.CopyFrom(theirs)
    for mine, theirs in zip(source.node, found.node):  # what inference wrote inside If/Loop/Scan bodies
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in mine.attribute):
            mine.CopyFrom(theirs)
    return proto


def load(source: ModelSource, check_ops: bool = True) -> ir.Model:
    """Read, check and import an ONNX model into onnx_ir, with shapes and dtypes inferred."""
    proto, base, own_file = _read_proto(source)
    if isinstance(source, onnx.ModelProto):
        proto = onnx.ModelProto.FromString(proto.SerializeToString())  # never mutate the caller's
    _load_external_data(proto, base, own_file)
    _densify_sparse_constants(proto.graph)
    problems: list[str] = []
    _check_graph(proto.graph, set(), "the main graph", problems)
    if problems:
        raise ModelError("the model is malformed:\n" + "\n".join(f"  - {p}" for p in problems))
    proto = _infer_shapes(proto)
    try:
        model = ir.serde.deserialize_model(proto)
    except Exception as e:  # noqa: BLE001  onnx_ir raises assorted errors on malformed protos
        raise ModelError(f"the model cannot be imported: {type(e).__name__}: {e}") from None
    del proto  # nothing large is left in it; the weights are read next, one at a time
    if base is not None:
        try:
            onnx_file.read_external(model, base, own_file)
        except (OSError, ValueError) as e:
            raise ModelError(f"external data cannot be loaded from {base}: {e}") from None
    if model.functions:
        ir_passes.InlinePass()(model)
    ir_passes.NameFixPass()(model)
    if check_ops:
        problems = _unsupported(model)
        if problems:
            raise UnsupportedModelError(problems)
    return model
