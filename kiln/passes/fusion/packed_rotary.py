"""Rotary on a packed q|k|v: Split + Rotary(q) + Rotary(k) in front of an attention -> one kiln::Rotary.

A decoder's q, k and v come from one GEMM (merge_parallel_gemms) and are split before the rotary:

    q, k, v = Split(qkv, [H·D, Hkv·D, Hkv·D], axis=-1)
    Attention(Rotary(q, cos, sin, num_heads=H), Rotary(k, cos, sin, num_heads=Hkv), v, kv_num_heads=Hkv)
      ->
    Attention(Rotary(qkv, cos, sin, num_heads=H + 2·Hkv, rotate_heads=H + Hkv), qkv_split=[H·D, Hkv·D, Hkv·D],
              q_num_heads=H, kv_num_heads=Hkv)

The same numbers: qkv viewed as [B, S, H + 2·Hkv, D] rotates its first H + Hkv heads (q's, then k's)
with the cos/sin the two rotaries shared (one table for every head), and copies v's. Three steps of a
Split's three outputs become one of one output, which a native segment can run (its members have one
output each): the attention block of a Llama layer stays inside the segment loop.
CPU only: measured there (kiln/tactics/cpu/rotary.py); the GPU runs what it was measured on.
"""

from __future__ import annotations

import onnx_ir as ir

from kiln.passes._rewrite import KILN_DOMAIN, PassReport, attr, consumers, is_op, producer, replace_with

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


def fuse_packed_rotary(node: ir.Node, report: PassReport) -> bool:
    if not is_op(node, "Attention", domain=KILN_DOMAIN) or attr(node, "qkv_split") or attr(node, "q_num_heads"):
        return False
    inputs = list(node.inputs) + [None] * (3 - len(node.inputs))
    q, k = _rotary(inputs[0], node), _rotary(inputs[1], node)
    if q is None or k is None:
        return False
    (rq, heads), (rk, kv_heads) = q, k
    split = producer(rq.inputs[0], "Split")
    v = inputs[2]
    if split is None or len(split.outputs) != 3 or list(split.outputs) != [rq.inputs[0], rk.inputs[0], v]:
        report.refuse(RULE, node, "q, k and v are not the three outputs of one Split")
        return False
    packed = split.inputs[0]
    if packed.shape is None or len(packed.shape) != 3 or attr(split, "axis", 0) not in (-1, 2):
        report.refuse(RULE, node, "the Split is not of a 3-D qkv's last axis")
        return False
    if any(consumers(s) != [reader] or s.is_graph_output() for s, reader in zip(split.outputs, (rq, rk, node))):
        report.refuse(RULE, node, "a Split output is read by more than the rotary or the attention")
        return False
    if rq.inputs[1] is not rk.inputs[1] or rq.inputs[2] is not rk.inputs[2] \
            or not _shared_by_heads(rq.inputs[1]) or not _shared_by_heads(rq.inputs[2]):
        report.refuse(RULE, node, "q and k do not share one cos/sin table for every head")
        return False
    widths = [None if s.shape is None else s.shape[-1] for s in split.outputs]
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
    replace_with([node, rq, rk, split], fused, node.outputs[0], insert_before=node)
    return True
