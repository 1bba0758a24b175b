"""Rotary on a packed q|k|v: Split + Rotary(q) + Rotary(k) in front of an attention -> one kiln::Rotary.

A decoder's q, k and v come from one GEMM (merge_parallel_gemms) and are split before the rotary:

    q, k, v = Split(qkv, [H·D, Hkv·D, Hkv·D], axis=-1)     (or three Slices of qkv's last axis, Phi-3's)
    Attention(Rotary(q, cos, sin, num_heads=H), Rotary(k, cos, sin, num_heads=Hkv), v, kv_num_heads=Hkv)
      ->
    Attention(Rotary(qkv, cos, sin, num_heads=H + 2·Hkv, rotate_heads=H + Hkv), qkv_split=[H·D, Hkv·D, Hkv·D],
              q_num_heads=H, kv_num_heads=Hkv)

The same numbers: qkv viewed as [B, S, H + 2·Hkv, D] rotates its first H + Hkv heads (q's, then k's)
with the cos/sin the two rotaries shared (one table for every head), and copies v's. Three steps of a
Split's three outputs become one of one output, which a native segment can run (its members have one
output each): the attention block of a Llama layer stays inside the segment loop.
Both devices: the CPU's cpu.rotary.native and CUDA's cuda.rotary.triton rotate a packed q|k|v's first
rotate_heads heads in one pass (on CUDA one kernel where the two Rotary layers were two), and the
attention reads q, k and v as column views of the result (qkv_split).
"""

from __future__ import annotations

import onnx_ir as ir

from kiln.passes._rewrite import KILN_DOMAIN, PassReport, attr, consumers, is_op, producer, replace_with
from kiln.passes.fusion.rotary import _last_axis_slice

RULE = "fuse_packed_rotary"


def _rotary(value: ir.Value | None, attention: ir.Node) -> tuple[ir.Node, int] | None:
    """(the Rotary, its heads) when value = Rotary(x 3-D, cos, sin, num_heads=h), read by `attention` only."""
    node = producer(value, "Rotary", KILN_DOMAIN)
    if node is None or consumers(value) != [attention] or value.is_graph_output():
        return None
    heads = attr(node, "num_heads", 0)
    x = node.inputs[0]
    if not heads or attr(node, "interleaved", 0) or attr(node, "rotate_heads", 0) or x.shape is None \
            or len(x.shape) != 3:
        return None
    return node, int(heads)


def _shared_by_heads(table: ir.Value) -> bool:
    """cos/sin the same for every head: [D], or a head axis of 1 ([.., S, 1, D]; x is [B, S, H, D])."""
    shape = table.shape
    return shape is not None and (len(shape) == 1 or (2 <= len(shape) <= 4 and shape[-2] == 1))


def _packed(parts: list[ir.Value]) -> tuple[ir.Value, list[ir.Node]] | None:
    """(qkv, the nodes that cut it) when q, k, v (`parts`) are, in order, the outputs of one Split of qkv
    or three Slices of its last axis that tile it."""
    split = producer(parts[0], "Split")
    if split is not None:
        if len(split.outputs) != 3 or list(split.outputs) != parts or \
                attr(split, "axis", 0) not in (-1, None if split.inputs[0].shape is None else len(split.inputs[0].shape) - 1):
            return None
        return split.inputs[0], [split]
    slices = [_last_axis_slice(v) for v in parts]
    if None in slices or any(x is not slices[0][0] for x, _, _ in slices):
        return None
    packed = slices[0][0]
    width = None if packed.shape is None else packed.shape[-1]
    bounds = [(start, min(end, width) if isinstance(width, int) else end) for _, start, end in slices]
    if not isinstance(width, int) or bounds[0][0] != 0 or bounds[-1][1] != width \
            or any(a[1] != b[0] for a, b in zip(bounds, bounds[1:])):
        return None
    return packed, [producer(v) for v in parts]


def fuse_packed_rotary(node: ir.Node, report: PassReport) -> bool:
    if not is_op(node, "Attention", domain=KILN_DOMAIN) or attr(node, "qkv_split") or attr(node, "q_num_heads"):
        return False
    inputs = list(node.inputs) + [None] * (3 - len(node.inputs))
    q, k = _rotary(inputs[0], node), _rotary(inputs[1], node)
    if q is None or k is None:
        return False
    (rq, heads), (rk, kv_heads) = q, k
    v = inputs[2]
    parts = [rq.inputs[0], rk.inputs[0], v]
    found = _packed(parts)
    if found is None:
        report.refuse(RULE, node, "q, k and v are not the outputs of one Split (or Slices) of a packed qkv's last axis")
        return False
    packed, cuts = found
    if packed.shape is None or len(packed.shape) != 3:
        report.refuse(RULE, node, "the packed qkv is not 3-D")
        return False
    if any(consumers(s) != [reader] or s.is_graph_output() for s, reader in zip(parts, (rq, rk, node))):
        report.refuse(RULE, node, "q, k or v is read by more than the rotary or the attention")
        return False
    if rq.inputs[1] is not rk.inputs[1] or rq.inputs[2] is not rk.inputs[2] \
            or not _shared_by_heads(rq.inputs[1]) or not _shared_by_heads(rq.inputs[2]):
        report.refuse(RULE, node, "q and k do not share one cos/sin table for every head")
        return False
    widths = [None if s.shape is None else s.shape[-1] for s in parts]
    if not all(isinstance(w, int) for w in widths) or attr(node, "kv_num_heads", 0) != kv_heads \
            or v.shape is None or len(v.shape) != 3:
        report.refuse(RULE, node, "v is not a 3-D value of the key heads")
        return False
    depth = widths[0] // heads
    if widths != [heads * depth, kv_heads * depth, kv_heads * depth]:
        report.refuse(RULE, node, f"q, k, v widths {widths} are not {heads}, {kv_heads}, {kv_heads} heads of one depth")
        return False
    # Decided: from here on the graph changes.
    graph = node.graph
    rotary = ir.Node(KILN_DOMAIN, "Rotary", [packed, rq.inputs[1], rq.inputs[2]],
                     [ir.AttrInt64("num_heads", heads + 2 * kv_heads), ir.AttrInt64("rotate_heads", heads + kv_heads)],
                     name=f"{rq.name}_packed")
    rotary.outputs[0].type = packed.type
    rotary.outputs[0].shape = packed.shape
    graph.insert_before(node, rotary)
    attrs = {name: a for name, a in node.attributes.items()}
    attrs["q_num_heads"] = ir.AttrInt64("q_num_heads", heads)
    attrs["qkv_split"] = ir.AttrInt64s("qkv_split", widths)
    fused = ir.Node(KILN_DOMAIN, "Attention", [rotary.outputs[0], None, None, *inputs[3:]], list(attrs.values()),
                    name=node.name)
    replace_with([node, rq, rk, *cuts], fused, node.outputs[0], insert_before=node)
    return True
