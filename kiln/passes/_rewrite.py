"""Small graph-surgery helpers shared by the passes (onnx_ir underneath).

A rule in kiln is `match(node) -> Match | None` (None: this node is not a candidate),
`check(match) -> str | None` (a reason when it refuses) and `rewrite(match)`; `run_rule`
drives one rule over a graph and counts how often it fired. Nothing in the graph changes
before the rule has decided: a refused match leaves it exactly as it was. Refusals are kept
in a `PassReport` so that `why_not` can show them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx_ir as ir

FUSED_FROM = "kiln.fused_from"
KILN_DOMAIN = "kiln"


@dataclass
class PassReport:
    """What the pipeline did: how often each rule fired, and why candidates were refused."""

    fired: dict[str, int] = field(default_factory=dict)
    refused: list[str] = field(default_factory=list)

    def count(self, rule: str, n: int = 1) -> None:
        if n:
            self.fired[rule] = self.fired.get(rule, 0) + n

    def refuse(self, rule: str, node: ir.Node, reason: str) -> None:
        line = f"{rule} at node {node.name!r} ({node.op_type}): {reason}"
        if line not in self.refused:  # rules sweep the graph until nothing fires
            self.refused.append(line)


# ---------------------------------------------------------------- constants


def const(value: ir.Value | None) -> np.ndarray | None:
    """The value's constant contents, or None if it is computed at run time.

    An initializer that is also a graph input can be overridden by the caller, so it is
    not a constant.
    """
    if value is None or value.const_value is None or value.is_graph_input():
        return None
    return value.const_value.numpy()


def const_scalar(value: ir.Value | None) -> float | None:
    array = const(value)
    if array is None or array.size != 1:
        return None
    return float(array.reshape(-1)[0])


def is_const_close(value: ir.Value | None, target: float, rtol: float = 1e-3) -> bool:
    s = const_scalar(value)
    return s is not None and abs(s - target) <= rtol * abs(target)


def static_shape(value: ir.Value | None) -> list[int] | None:
    if value is None or value.shape is None:
        return None
    dims = list(value.shape)
    return dims if all(isinstance(d, int) for d in dims) else None


def dims_equal(a: list, b: list) -> bool:
    """True when two dim lists are equal dim by dim (ints by value, symbols by name)."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if isinstance(x, int) or isinstance(y, int):
            if x != y:
                return False
        elif x.value is None or x.value != y.value:
            return False
    return True


def same_shape(a: ir.Value, b: ir.Value) -> bool:
    """True when both shapes are known and equal dim by dim (symbols compared by name)."""
    return a.shape is not None and b.shape is not None and dims_equal(list(a.shape), list(b.shape))


def dtype_of(value: ir.Value | None) -> ir.DataType | None:
    if value is None or value.type is None or not isinstance(value.type, ir.TensorType):
        return None
    return value.type.dtype


# Weights at least this large (elements) are shared by content: a rewrite that would store a second
# copy of an existing initializer reads the existing one instead. Below it, sharing saves nothing
# worth having, and a small constant shared by two nodes could stop a rule that needs its only reader.
SHARE_MIN_ELEMENTS = 4096


def _bytes_equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Same dtype, shape and bytes (NaN payloads and -0.0 included); a strided sample first, so
    telling apart two different weights costs a few hundred elements, not their size."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    flat_a, flat_b = a.reshape(-1), b.reshape(-1)
    step = max(1, flat_a.size // 256)
    if flat_a[::step].tobytes() != flat_b[::step].tobytes():
        return False
    as_bytes = lambda x: np.ascontiguousarray(x).reshape(-1).view(np.uint8)  # noqa: E731
    return bool(np.array_equal(as_bytes(a), as_bytes(b)))


# Set on every graph of a model built refittable (PassOptions.refittable): no weight is shared with
# another because their values are equal, so new weights whose values differ fit the same engine.
WEIGHTS_APART = "kiln.weights_apart"


def shares_weights(graph: ir.Graph) -> bool:
    """Whether rewrites may store a result once for every equal weight (not in a refittable build)."""
    return not graph.meta.get(WEIGHTS_APART, False)


def identical_initializer(graph: ir.Graph, array: np.ndarray) -> ir.Value | None:
    """An initializer of `graph` holding exactly `array` (dtype, shape, bytes) that no caller can
    override (not also a graph input), or None. Strings and sub-byte types are never matched."""
    if array.dtype == object or array.dtype.kind in "SUV":
        return None
    try:
        dtype = ir.DataType.from_numpy(array.dtype)
    except TypeError:
        return None
    for value in graph.initializers.values():
        tensor = value.const_value
        if tensor is None or value.is_graph_input() or tensor.dtype != dtype or tuple(tensor.shape) != array.shape:
            continue
        if _bytes_equal(tensor.numpy(), array):
            return value
    return None


def new_initializer(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    """Registers `array` as a new initializer under a fresh name derived from `name`; a large
    array identical to an initializer the graph already holds returns that one instead, so a
    rewrite repeated over layers sharing one weight (ALBERT) stores its result once (except in a
    refittable build: there equal values are a coincidence new weights may undo)."""
    if array.size >= SHARE_MIN_ELEMENTS and shares_weights(graph) and \
            (same := identical_initializer(graph, np.asarray(array))) is not None:
        return same
    base, n = name, 1
    while name in graph.initializers:
        n += 1
        name = f"{base}_{n}"
    tensor = ir.tensor(np.ascontiguousarray(array).reshape(np.shape(array)), name=name)  # keep 0-d 0-d
    value = ir.Value(name=name, shape=ir.Shape(array.shape), type=ir.TensorType(tensor.dtype), const_value=tensor)
    graph.register_initializer(value)
    return value


# ---------------------------------------------------------------- uses


def consumers(value: ir.Value) -> list[ir.Node]:
    return list(dict.fromkeys(u.node for u in value.uses()))


def only_user(value: ir.Value | None) -> ir.Node | None:
    """The single node reading `value` (once), if the graph does not also output it."""
    if value is None or value.is_graph_output():
        return None
    uses = list(value.uses())
    return uses[0].node if len(uses) == 1 else None


def producer(value: ir.Value | None, op_type: str | None = None, domain: str = "") -> ir.Node | None:
    node = value.producer() if value is not None else None
    if node is None or (op_type is not None and (node.op_type != op_type or node.domain != domain)):
        return None
    return node


def other_input(node: ir.Node, value: ir.Value) -> ir.Value | None:
    """For a binary node reading `value`, its other operand."""
    a, b = node.inputs[0], node.inputs[1]
    return b if a is value else a


def attr(node: ir.Node, name: str, default: Any = None) -> Any:
    a = node.attributes.get(name)
    if a is None:
        return default
    v = a.value
    return list(v) if isinstance(v, tuple) else v


def is_op(node: ir.Node | None, *op_types: str, domain: str = "") -> bool:
    return node is not None and node.op_type in op_types and node.domain == domain


# ---------------------------------------------------------------- surgery


def fused_from(nodes: Iterable[ir.Node]) -> list[str]:
    """The ONNX node names a set of nodes stands for (inheriting earlier fusions)."""
    names: list[str] = []
    for node in nodes:
        inherited = node.metadata_props.get(FUSED_FROM)
        for name in json.loads(inherited) if inherited else [node.name or node.op_type]:
            if name not in names:
                names.append(name)
    return names


def replace_with(old_nodes: list[ir.Node], new_node: ir.Node, old_output: ir.Value,
                 insert_before: ir.Node | None = None) -> None:
    """Put `new_node` in place of `old_nodes`; its output 0 takes over `old_output`.

    The new output keeps the old output's name, type and shape (graph outputs keep their
    names), and the node records which ONNX nodes it absorbed in metadata.
    """
    graph = old_nodes[0].graph
    new_node.metadata_props[FUSED_FROM] = json.dumps(fused_from(old_nodes))
    if not new_node.name:
        new_node.name = old_output.producer().name
    out = new_node.outputs[0]
    out.type, out.shape = old_output.type, old_output.shape
    graph.insert_before(insert_before or old_output.producer(), new_node)
    name = old_output.name
    ir.convenience.replace_all_uses_with(old_output, out, replace_graph_outputs=True)
    graph.remove(old_nodes, safe=True)
    old_output.name = f"{name}__replaced"
    out.name = name


def bypass_refusal(node: ir.Node, replacement: ir.Value) -> str | None:
    """Why `bypass(node, replacement)` cannot be done, or None when it can (a check: changes nothing).

    A graph output keeps its name: when the node's output is a graph output, the
    replacement is renamed to it, which is only possible if the replacement is itself an
    intermediate value (not a graph input, initializer or another graph output).
    """
    out = node.outputs[0]
    if any(v.uses() or v.is_graph_output() for v in node.outputs[1:]):
        return "an output other than the first is read or is a graph output"
    if out.is_graph_output():
        if replacement.is_graph_input() or replacement.is_initializer() or replacement.is_graph_output():
            return f"the output {out.name!r} is a graph output and {replacement.name!r} cannot take its name"
        if replacement.graph is not node.graph and replacement.producer() is None:
            return f"the output {out.name!r} is a graph output and {replacement.name!r} is from an outer scope"
    return None


def bypass(node: ir.Node, replacement: ir.Value) -> bool:
    """Remove a node whose output 0 equals `replacement`; False (graph untouched) when
    `bypass_refusal` says it cannot be done."""
    if bypass_refusal(node, replacement) is not None:
        return False
    graph = node.graph
    out = node.outputs[0]
    name = out.name
    if replacement.shape is None:
        replacement.shape = out.shape
    ir.convenience.replace_all_uses_with(out, replacement, replace_graph_outputs=True)
    graph.remove(node, safe=True)
    if replacement.is_graph_output():
        out.name = f"{name}__removed"
        replacement.name = name
    return True


def graphs_of(model: ir.Model) -> list[ir.Graph]:
    return [model.graph, *model.graph.subgraphs()]


Rule = Callable[[ir.Node, PassReport], bool]


def run_rule(model: ir.Model, name: str, rule: Rule, report: PassReport, main_only: bool = True) -> int:
    """Applies `rule` to every node until it no longer fires; returns how often it fired."""
    fired = 0
    graphs = [model.graph] if main_only else graphs_of(model)
    for graph in graphs:
        changed = True
        while changed:
            changed = False
            for node in list(graph):
                if node.graph is not graph:  # removed by an earlier rewrite in this sweep
                    continue
                if rule(node, report):
                    fired += 1
                    changed = True
    report.count(name, fired)
    return fired


def reduce_axes(node: ir.Node) -> list[int] | None:
    """The axes of a Reduce* node (input 1 from opset 13/18 on, else the attribute); None if unknown."""
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        axes = const(node.inputs[1])
        return None if axes is None else [int(a) for a in axes.reshape(-1)]
    axes = attr(node, "axes")
    return None if axes is None else [int(a) for a in axes]


def trailing_axis(node: ir.Node, rank: int | None) -> int | None:
    """For a keepdims Reduce over the last dims (e.g. [-1] or [2, 3] of rank 4): the first axis."""
    axes = reduce_axes(node)
    if axes is None or rank is None or attr(node, "keepdims", 1) != 1:
        return None
    axes = sorted(a + rank if a < 0 else a for a in axes)
    return axes[0] - rank if axes == list(range(axes[0], rank)) else None


def record_absorbed(into: ir.Node, absorbed: list[ir.Node]) -> None:
    """Note on `into` that it now also computes what `absorbed` did (for fused_from)."""
    into.metadata_props[FUSED_FROM] = json.dumps(fused_from([into, *absorbed]))
