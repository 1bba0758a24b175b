"""A Split no fused layer absorbed -> one Slice per output (CPU builds).

    a, b = Split(x, [Da, Db], axis)   ->   a = Slice(x, [0], [Da], [axis]);  b = Slice(x, [Da], [Da + Db], [axis])

Why: a Split has no CPU tactic of its own, so it runs on torch as a step of its own (views, but a step) and cuts
the native segment around it in two. DETR's attention adds the position embedding to q and k but not to v:
merge_parallel_gemms makes q|k one GEMM and a Split that no attention absorbs (it absorbs a q|k|v Split); the
k and v of every cross-attention read the encoder's output, one GEMM and a Split too (DETR's decoder, T5's).
DETR-tiny ran 4 such Splits, 9 steps a run around them; as Slices of constant bounds they are members of one
segment (cpu.slice.native, one strided copy each: kiln/tactics/cpu/relayout.py). One thread, thread clock,
kiln / onnxruntime: detr_tiny 1.31 -> 0.89, t5_tiny 0.74 -> 0.59 (bench/results/zoo-cpu-all-2026-12-05c.md).

It runs after the rules that read a Split (swiglu, packed rotary, attention layouts): what is left is read by
layers that take whole tensors. Only float32 Splits of constant sizes along a static dim are rewritten (the
slice kernel's dtype); only CPU builds ask for it (fusion.CPU_RULES).
"""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir

from kiln.passes._rewrite import FUSED_FROM, PassReport, attr, const, fused_from, is_op, new_initializer

RULE = "split_as_slices"


def _sizes(node: ir.Node, dim: int) -> list[int] | None:
    """The Split's output sizes along its axis (its input from opset 13, its attribute before, else equal parts
    of `dim`, ONNX's ceil-sized chunks), or None when they are computed at run time."""
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        sizes = const(node.inputs[1])
        return None if sizes is None else [int(s) for s in sizes.reshape(-1)]
    if attr(node, "split"):
        return [int(s) for s in attr(node, "split")]
    n = len(node.outputs)
    chunk = -(-dim // n)
    return [min(chunk, max(dim - i * chunk, 0)) for i in range(n)]


def split_as_slices(node: ir.Node, report: PassReport) -> bool:
    if not is_op(node, "Split") or node.outputs[0].dtype != ir.DataType.FLOAT:
        return False
    x = node.inputs[0]
    rank = None if x.shape is None else len(x.shape)
    axis = attr(node, "axis", 0)
    dim = None if rank is None else x.shape[axis % rank]
    if not isinstance(dim, int):
        report.refuse(RULE, node, f"the split axis {axis} of {x.name!r} has no static size")
        return False
    sizes = _sizes(node, dim)
    if sizes is None or sum(sizes) != dim:
        report.refuse(RULE, node, f"the sizes {sizes} are not constant or do not add up to {dim}")
        return False
    graph = node.graph
    axes = new_initializer(graph, f"{node.name}_axes", np.array([axis], np.int64))
    starts = np.cumsum([0, *sizes])
    for k, (out, start, end) in enumerate(zip(list(node.outputs), starts[:-1], starts[1:])):
        if not out.uses() and not out.is_graph_output():
            continue
        bounds = [new_initializer(graph, f"{node.name}_{edge}", np.array([v], np.int64))
                  for edge, v in (("start", start), ("end", end))]
        piece = ir.Node("", "Slice", [x, *bounds, axes], name=f"{node.name}_{k}")
        piece.metadata_props[FUSED_FROM] = json.dumps(fused_from([node]))
        graph.insert_before(node, piece)
        name, sliced = out.name, piece.outputs[0]
        sliced.type, sliced.shape = out.type, out.shape
        ir.convenience.replace_all_uses_with(out, sliced, replace_graph_outputs=True)
        out.name = f"{name}__split"
        sliced.name = name
    graph.remove(node, safe=True)
    return True
