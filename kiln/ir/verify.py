"""The IR verifier: structural invariants of an onnx_ir model, checked between passes in tests.

Every problem names the graph, the node's index, its name and op, its inputs, and what is wrong:

    - main graph, node #12 'node_Add_3' (Add; inputs x, w): input 'w' is defined by no graph
      input, initializer, earlier node or enclosing scope
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import onnx_ir as ir

from kiln.errors import KilnError

# The op registry as verify sees it: (op_type, domain) -> the op's entry (with .check(opset, attribute
# names) -> reason | None), or None when kiln has no implementation. kiln.ops.registry.lookup is one.
OpLookup = Callable[[str, str], Any]


class VerifyError(KilnError):
    """The IR broke an invariant (a pass bug, or a malformed model past the frontend)."""

    def __init__(self, stage: str, problems: list[str]):
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"IR verification failed {stage}: {len(problems)} problem(s):\n{lines}")


def _label(where: str, index: int, node: ir.Node) -> str:
    inputs = ", ".join(v.name if v is not None else "<none>" for v in node.inputs)
    op = f"{node.domain}::{node.op_type}" if node.domain else node.op_type
    return f"{where}, node #{index} {node.name or '<unnamed>'!r} ({op}; inputs {inputs})"


def _check_graph(graph: ir.Graph, outer: set[str], where: str, opsets: dict[str, int], require_order: bool,
                 lookup: OpLookup, problems: list[str]) -> None:
    defined = set(outer) | {v.name for v in graph.inputs} | set(graph.initializers)
    produced_anywhere: dict[str, int] = {}
    for i, node in enumerate(graph):
        for v in node.outputs:
            if not v.name:  # an optional output nobody asked for
                continue
            if v.name in produced_anywhere:
                problems.append(f"{_label(where, i, node)}: value {v.name!r} is also produced by node "
                                f"#{produced_anywhere[v.name]}")
            elif v.name in defined:
                problems.append(f"{_label(where, i, node)}: output {v.name!r} shadows a graph input or initializer")
            produced_anywhere[v.name] = i
            if v.producer() is not node:
                problems.append(f"{_label(where, i, node)}: output {v.name!r} does not name this node as producer")
    seen = set(defined)
    for i, node in enumerate(graph):
        for v in node.inputs:
            if v is None:
                continue
            if v.name in seen:
                continue
            if v.name in produced_anywhere:
                if require_order:
                    problems.append(f"{_label(where, i, node)}: input {v.name!r} is produced later, by node "
                                    f"#{produced_anywhere[v.name]} (not in topological order)")
            else:
                problems.append(f"{_label(where, i, node)}: input {v.name!r} is defined by no graph input, "
                                "initializer, earlier node or enclosing scope")
        spec = lookup(node.op_type, node.domain or "")
        if spec is None:
            problems.append(f"{_label(where, i, node)}: no kiln implementation of this op")
        else:
            reason = spec.check(opsets.get(node.domain or "", opsets.get("", 21)) or 21, list(node.attributes))
            if reason:
                problems.append(f"{_label(where, i, node)}: {reason}")
        for attr in node.attributes.values():
            subgraphs = [attr.value] if attr.type == ir.AttributeType.GRAPH else (
                list(attr.value) if attr.type == ir.AttributeType.GRAPHS else [])
            for sub in subgraphs:
                _check_graph(sub, seen | set(produced_anywhere), f"{where} / {node.name}.{attr.name}", opsets,
                             require_order, lookup, problems)
        seen |= {v.name for v in node.outputs}
    for v in graph.outputs:
        if v.name not in seen and v.name not in produced_anywhere:
            problems.append(f"{where}: graph output {v.name!r} is produced by no node and is no input or initializer")


def verify(model: ir.Model, lookup: OpLookup, stage: str = "", require_order: bool = True) -> None:
    """Raise VerifyError listing every broken invariant; `lookup` is the op registry every node must
    be found in (kiln.ops.registry.lookup); `require_order=False` between rewrites that append nodes
    out of order (the pipeline sorts topologically at its end)."""
    problems: list[str] = []
    _check_graph(model.graph, set(), "main graph", dict(model.opset_imports), require_order, lookup, problems)
    if problems:
        raise VerifyError(stage or "", problems)
