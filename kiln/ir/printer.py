"""A readable text form of an onnx_ir model, one node per line (for `kiln build -v`, tests, debugging):

    graph main(x: float[N,3]) -> (y)
      initializers: w: float[3]
      #0  t: float[N,3] = Add(x, w)                      'add'
      #1  y: float[N,3] = Relu(t)                        'relu'
"""

from __future__ import annotations

import onnx_ir as ir


def _type(value: ir.Value) -> str:
    dtype = value.dtype.name.lower() if value.dtype is not None else "?"
    if value.shape is None:
        return dtype
    dims = ",".join(str(d) if isinstance(d, int) else (d.value or "?") for d in value.shape)
    return f"{dtype}[{dims}]"


def _attr(attr: ir.Attr) -> str:
    if attr.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS):
        return f"{attr.name}=<graph>"
    if attr.type == ir.AttributeType.TENSOR:
        return f"{attr.name}=<tensor {attr.value.dtype.name.lower()}{list(attr.value.shape)}>"
    value = attr.value
    text = repr(list(value) if isinstance(value, (list, tuple)) else value)
    return f"{attr.name}={text if len(text) <= 40 else text[:37] + '...'}"


def print_graph(graph: ir.Graph, indent: str = "", name: str = "main") -> str:
    ins = ", ".join(f"{v.name}: {_type(v)}" for v in graph.inputs)
    outs = ", ".join(v.name for v in graph.outputs)
    lines = [f"{indent}graph {name}({ins}) -> ({outs})"]
    if graph.initializers:
        inits = ", ".join(f"{n}: {_type(v)}" for n, v in list(graph.initializers.items())[:8])
        more = f" (+{len(graph.initializers) - 8} more)" if len(graph.initializers) > 8 else ""
        lines.append(f"{indent}  initializers: {inits}{more}")
    for i, node in enumerate(graph):
        outs = ", ".join(f"{v.name}: {_type(v)}" for v in node.outputs)
        op = f"{node.domain}::{node.op_type}" if node.domain else node.op_type
        args = ", ".join(v.name if v is not None else "" for v in node.inputs)
        attrs = ", ".join(_attr(a) for a in node.attributes.values())
        call = f"{op}({args}{'; ' + attrs if attrs else ''})"
        lines.append(f"{indent}  #{i:<3} {outs} = {call}    {node.name!r}")
        for attr in node.attributes.values():
            subs = [attr.value] if attr.type == ir.AttributeType.GRAPH else (
                list(attr.value) if attr.type == ir.AttributeType.GRAPHS else [])
            for j, sub in enumerate(subs):
                lines.append(print_graph(sub, indent + "      ", f"{node.name}.{attr.name}{'' if len(subs) == 1 else j}"))
    return "\n".join(lines)


def print_model(model: ir.Model) -> str:
    opsets = ", ".join(f"{d or 'ai.onnx'}:{v}" for d, v in model.opset_imports.items())
    return f"# opsets {opsets}\n" + print_graph(model.graph)
