"""Constant folding with kiln's own op implementations.

A node whose inputs are all constants is run once at build time (through the very
implementation the runtime would call, so folding can never disagree with running) and
its outputs become initializers. `Shape` and `Size` of a value whose shape is fully static
fold too, which resolves the Shape -> Gather -> Concat -> Reshape chains exporters emit; so does a
GatherElements from a constant of one value throughout (its result is that value whatever the indices).

Never folded: QuantizeLinear/DequantizeLinear (they carry calibration a later pass reads),
random ops, nodes with subgraphs, and results much larger than their inputs (a folded
Expand/ConstantOfShape would only bloat the engine).

Never copied per use: a weight shared by many layers (ALBERT reuses one layer's weights in all
of them) may reach each layer through its own Transpose/Cast node. Nodes that compute the same
thing from the same constants fold once, and every later one reads that result; a large result
identical to an initializer already in the graph reads that initializer. Without this, folding
stored one copy of the transformed weight per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
import torch

from kiln.ir import dtypes
from kiln.ir.tensors import tensor_to_runtime
from kiln.ops.registry import OpContext, lookup
from kiln.passes._rewrite import (
    SHARE_MIN_ELEMENTS,
    PassReport,
    const,
    graphs_of,
    identical_initializer,
    is_op,
    shares_weights,
    static_shape,
)

NEVER_FOLD = {
    "QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear",
    "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial", "Bernoulli",
}
SIZE_LIMIT = 1 << 20  # elements: a folded output may always be this large, or as large as its inputs


def _attributes(node: ir.Node) -> dict | None:
    kwargs = {}
    for name, a in node.attributes.items():
        if a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS):
            return None
        if a.type == ir.AttributeType.TENSOR:
            kwargs[name] = tensor_to_runtime(a.value)
        elif a.type == ir.AttributeType.TENSORS:
            kwargs[name] = [tensor_to_runtime(t) for t in a.value]
        elif a.type in (ir.AttributeType.INTS, ir.AttributeType.FLOATS, ir.AttributeType.STRINGS):
            kwargs[name] = list(a.value)
        else:
            kwargs[name] = a.value
    return kwargs


def _static_shape_result(node: ir.Node) -> np.ndarray | None:
    """Shape/Size of a value whose shape is fully known, without running anything."""
    shape = static_shape(node.inputs[0])
    if shape is None:
        return None
    if node.op_type == "Size":
        return np.array(int(np.prod(shape)), dtype=np.int64)
    rank = len(shape)
    start = node.attributes.get_int("start", 0)
    end = node.attributes.get_int("end", rank)
    start, end = (max(0, min(rank, i + rank if i < 0 else i)) for i in (start, end))
    return np.array(shape[start:end], dtype=np.int64)


def evaluate(node: ir.Node, opset: int, tensors: list[ir.TensorProtocol | None] | None = None
             ) -> list[np.ndarray] | None:
    """The node's outputs computed by kiln's own op on `tensors` (default: its inputs' constant
    values), or None when the op cannot be evaluated here."""
    spec = lookup(node.op_type, node.domain)
    kwargs = _attributes(node)
    if spec is None or kwargs is None or spec.check(opset, list(kwargs)):
        return None
    if tensors is None:
        tensors = [None if v is None else v.const_value for v in node.inputs]
    inputs = [None if t is None else tensor_to_runtime(t) for t in tensors]
    ctx = OpContext(
        name=node.name or node.op_type, op_type=node.op_type, domain=node.domain, opset=opset,
        num_inputs=len(node.inputs), num_outputs=len(node.outputs),
        output_dtypes=[None if v.dtype is None else dtypes.from_onnx(int(v.dtype)) for v in node.outputs],
    )
    with torch.no_grad():
        result = spec.fn(ctx, *inputs, **kwargs)
    results = list(result) if isinstance(result, tuple) else [result]
    arrays = []
    for r in results:
        if isinstance(r, torch.Tensor):
            arrays.append(dtypes.torch_to_numpy(r))
        elif isinstance(r, np.ndarray) and r.dtype != object:
            arrays.append(r)
        else:  # sequences, optionals, strings: leave them to the runtime
            return None
    return arrays


def _static_dims_picked(node: ir.Node) -> np.ndarray | None:
    """Gather(Shape(x), i) (or Shape(x, start, end)) that picks only dims of x known at build time,
    though x's shape as a whole is dynamic: e.g. the hidden size of [batch, seq, 768]."""
    if node.op_type == "Shape":
        source, indices = node, None
    elif node.op_type == "Gather" and (source := node.inputs[0].producer()) is not None \
            and source.op_type == "Shape" and source.domain in ("", "ai.onnx") and node.attributes.get_int("axis", 0) == 0:
        indices = const(node.inputs[1])
        if indices is None:
            return None
    else:
        return None
    shape = source.inputs[0].shape
    if shape is None:
        return None
    rank = len(shape)
    start, end = (source.attributes.get_int(k, d) for k, d in (("start", 0), ("end", rank)))
    start, end = (max(0, min(rank, i + rank if i < 0 else i)) for i in (start, end))
    dims = list(shape)[start:end]
    picked = dims if indices is None else [dims[int(i)] if -len(dims) <= int(i) < len(dims) else None
                                           for i in indices.reshape(-1)]
    if not all(isinstance(d, int) for d in picked):
        return None
    array = np.array(picked, np.int64)
    return array if indices is None else array.reshape(indices.shape)


def _uniform_gather(node: ir.Node) -> np.ndarray | None:
    """GatherElements(data, indices) where data is a constant holding one value throughout and the indices'
    shape is static: that value at every index, whatever the indices (RoBERTa's token-type ids, a zero
    buffer gathered at the computed position ids). In-range indices are the op's contract; an out-of-range
    one is an error onnxruntime raises and this result hides."""
    data = const(node.inputs[0])
    shape = static_shape(node.inputs[1]) if len(node.inputs) > 1 else None
    if data is None or shape is None or data.size == 0 or const(node.inputs[1]) is not None:
        return None
    first = data.reshape(-1)[:1]
    if not np.array_equal(data, np.broadcast_to(first.reshape((1,) * data.ndim), data.shape)):
        return None
    return np.full(shape, first[0], dtype=data.dtype)


def _foldable(node: ir.Node) -> bool:
    if node.op_type in NEVER_FOLD or node.domain not in ("", "ai.onnx"):
        return False
    if node.op_type in ("Shape", "Size"):
        return True
    if node.op_type == "Gather" and node.inputs[0] is not None and is_op(node.inputs[0].producer(), "Shape"):
        return True  # a static dim of a dynamic shape
    if node.op_type == "GatherElements" and _uniform_gather(node) is not None:
        return True  # computed indices into a constant of one value throughout
    inputs = [v for v in node.inputs if v is not None]
    return bool(inputs) and all(const(v) is not None for v in inputs)


def _signature(node: ir.Node) -> tuple | None:
    """What a node computes from constants: op, attributes and the very input values; None when
    an attribute is a tensor or graph (not worth comparing: such nodes are rare and small)."""
    attributes = []
    for name, a in sorted(node.attributes.items()):
        if a.type in (ir.AttributeType.TENSOR, ir.AttributeType.TENSORS, ir.AttributeType.GRAPH,
                      ir.AttributeType.GRAPHS):
            return None
        attributes.append((name, tuple(a.value) if isinstance(a.value, (list, tuple)) else a.value))
    return (node.domain, node.op_type, node.overload, tuple(attributes), tuple(id(v) for v in node.inputs),
            len(node.outputs))


def _reuse(node: ir.Node, results: list[ir.Value]) -> None:
    """Point every reader of the node's outputs at `results` (values already folded) and drop it."""
    for out, result in zip(node.outputs, results):
        ir.convenience.replace_all_uses_with(out, result)
    node.graph.remove(node, safe=True)


@dataclass
class _Folded:
    """A node folded in this sweep: its inputs (held, so their ids cannot be reused) and results."""

    inputs: list[ir.Value | None]
    results: list[ir.Value]


def fold_node(node: ir.Node, opset: int, folded: dict[tuple, _Folded] | None = None) -> bool:
    """Fold one node into initializers. `folded` (by signature) remembers what this sweep folded,
    so a node computing the same from the same constants reads the earlier result."""
    signature = _signature(node) if folded is not None else None
    # A graph output keeps its own name, so it gets its own initializer.
    if signature in (folded or {}) and not any(out.is_graph_output() for out in node.outputs):
        _reuse(node, folded[signature].results)
        return True
    if node.op_type == "Gather" and const(node.inputs[0]) is None:
        picked = _static_dims_picked(node)
        if picked is None:
            return False
        arrays = [picked]
    elif node.op_type == "GatherElements" and const(node.inputs[1]) is None:
        arrays = [_uniform_gather(node)]
        if arrays[0] is None:
            return False
    elif node.op_type in ("Shape", "Size"):
        result = _static_shape_result(node)
        if result is None and node.op_type == "Shape":
            result = _static_dims_picked(node)  # Shape(x, start, end) of static dims only
        if result is None and const(node.inputs[0]) is None:
            return False
        arrays = [result] if result is not None else evaluate(node, opset)
    else:
        arrays = evaluate(node, opset)
    if arrays is None or len(arrays) != len(node.outputs):
        return False
    input_elements = sum(int(np.prod(v.const_value.shape)) for v in node.inputs if v is not None and v.const_value is not None)
    if any(a.size > max(SIZE_LIMIT, input_elements) for a in arrays):
        return False
    graph = node.graph
    replacements = []
    for out, array in zip(node.outputs, arrays):
        tensor = ir.tensor(np.ascontiguousarray(array).reshape(np.shape(array)), name=out.name)  # keep 0-d 0-d
        if out.dtype is not None and tensor.dtype != out.dtype:
            return False  # the implementation disagrees with the declared type: do not guess
        replacements.append((out, tensor))
    results = []
    for out, tensor in replacements:
        existing = None
        if tensor.size >= SHARE_MIN_ELEMENTS and not out.is_graph_output() and shares_weights(graph):
            existing = identical_initializer(graph, tensor.numpy())
        if existing is not None:  # e.g. Transpose(W) where W^T is already stored: read that one
            ir.convenience.replace_all_uses_with(out, existing)
            results.append(existing)
            continue
        name = out.name
        value = ir.Value(name=f"{name}__folding", shape=ir.Shape(tensor.shape), type=ir.TensorType(tensor.dtype),
                         const_value=tensor)
        out.name = f"{name}__folded"
        value.name = name
        graph.register_initializer(value)
        ir.convenience.replace_all_uses_with(out, value, replace_graph_outputs=True)
        results.append(value)
    graph.remove(node, safe=True)
    if signature is not None:
        folded[signature] = _Folded(list(node.inputs), results)
    return True


def fold_constants(model: ir.Model, report: PassReport) -> int:
    """Folds every foldable node, in graph order (so chains fold in one sweep)."""
    opset = dict(model.opset_imports).get("", 21)
    folded = 0
    for graph in graphs_of(model):
        results: dict[tuple, _Folded] = {}
        for node in list(graph):
            if _foldable(node) and fold_node(node, opset, results):
                folded += 1
    report.count("fold_constants", folded)
    return folded
