"""The head split/merge around kiln::Attention, taken into the op (views, no steps).

Exporters split heads with a Reshape before attention and merge them with one after:

    q = Reshape(x_q, [B, S, H, D])          ->  Attention(x_q, ..., q_num_heads=H)
    y = Reshape(Attention(...), [B, S, H·D]) ->  Attention(..., out_merge_heads=1)

and GPT-2 computes Q, K and V with one GEMM and splits them along the hidden axis:

    q, k, v = Split(qkv, [Wq, Wk, Wv], axis=-1)  ->  Attention(qkv, None, None, qkv_split=[Wq, Wk, Wv])

A head transpose the attention fusion left in front of an input (BERT's exported key: Reshape, then
Transpose to [B, H, S, D], read as is) becomes the input's permutation, composed with any it had:

    Attention(Transpose(x, P), .., k_perm=Q)  ->  Attention(x, .., k_perm=[P[Q[0]], .., P[Q[3]]])

Unflattening the last axis and slicing it are views in torch, so the op does the same work
as before in fewer steps; on the GPU the merge is the one copy the output Reshape made anyway.
"""

from __future__ import annotations

import onnx_ir as ir

from kiln.passes._rewrite import (
    KILN_DOMAIN,
    PassReport,
    attr,
    consumers,
    dims_equal,
    is_op,
    only_user,
    producer,
    replace_with,
)

RULE = "absorb_attention_reshapes"


def _split_heads(value: ir.Value | None, readers: ir.Node | list[ir.Node]) -> tuple[ir.Node, int] | None:
    """(the Reshape, H) when value = Reshape(x, [B, S, H, D]) of a 3-D x = [B, S, H·D], read only by
    `readers` (one of them: the attention, or a transpose it absorbs)."""
    readers = readers if isinstance(readers, list) else [readers]
    reshape = producer(value, "Reshape")
    if reshape is None or only_user(value) not in readers or value.shape is None or len(value.shape) != 4:
        return None
    source = reshape.inputs[0].shape
    heads, depth = value.shape[2], value.shape[3]
    if source is None or len(source) != 3 or not all(isinstance(d, int) for d in (heads, depth, source[2])):
        return None
    if heads * depth != source[2] or not dims_equal(list(source)[:2], list(value.shape)[:2]):
        return None
    return reshape, heads


def _merge_heads(value: ir.Value) -> ir.Node | None:
    """The Reshape reading value = [B, S, H, D] to give [B, S, H·D], if it is value's only reader."""
    reshape = only_user(value)
    if not is_op(reshape, "Reshape") or value.shape is None or len(value.shape) != 4:
        return None
    target = reshape.outputs[0].shape
    heads, depth = value.shape[2], value.shape[3]
    if target is None or len(target) != 3 or not all(isinstance(d, int) for d in (heads, depth, target[2])):
        return None
    if heads * depth != target[2] or not dims_equal(list(target)[:2], list(value.shape)[:2]):
        return None
    return reshape


def _packed_split(inputs: list[ir.Value | None], readers: list[ir.Node]) -> tuple[ir.Node, list[int]] | None:
    """(the Split, widths) when q, k, v are the three outputs of one Split of the last axis, each read
    once by `readers` (the attention, or a head Reshape it absorbs)."""
    split = producer(inputs[0], "Split")
    if split is None or len(split.outputs) != 3 or list(split.outputs) != inputs[:3]:
        return None
    rank = None if split.inputs[0].shape is None else len(split.inputs[0].shape)
    if rank != 3 or attr(split, "axis", 0) not in (-1, rank - 1):
        return None
    if any(len(list(v.uses())) != 1 or consumers(v)[0] not in readers or v.is_graph_output() for v in split.outputs):
        return None
    widths = [None if v.shape is None else v.shape[-1] for v in split.outputs]
    if not all(isinstance(w, int) for w in widths):
        return None
    return split, widths


def _head_transpose(value: ir.Value | None, node: ir.Node) -> ir.Node | None:
    """The 4-D Transpose giving `value`, if `node` is its only reader."""
    transpose = producer(value, "Transpose")
    if transpose is None or only_user(value) is not node or value.shape is None or len(value.shape) != 4:
        return None
    perm = attr(transpose, "perm")
    return transpose if perm is not None and sorted(perm) == [0, 1, 2, 3] else None


def absorb_attention_reshapes(node: ir.Node, report: PassReport) -> bool:
    if not is_op(node, "Attention", domain=KILN_DOMAIN):
        return False
    inputs = list(node.inputs)
    attrs = {name: a for name, a in node.attributes.items()}
    absorbed: list[ir.Node] = []
    if "qkv_split" not in attrs:
        for i, name in enumerate(("q_perm", "k_perm", "v_perm")):
            if (transpose := _head_transpose(inputs[i], node)) is None:
                continue
            outer = attr(transpose, "perm")
            inner = list(attrs[name].value) if name in attrs else [0, 1, 2, 3]
            absorbed.append(transpose)
            inputs[i] = transpose.inputs[0]
            attrs[name] = ir.AttrInt64s(name, [outer[j] for j in inner])  # x.permute(outer).permute(inner)
    if (found := _split_heads(inputs[0], [node, *absorbed])) is not None:
        absorbed.append(found[0])
        inputs[0] = found[0].inputs[0]
        attrs["q_num_heads"] = ir.AttrInt64("q_num_heads", found[1])
    for i in (1, 2):  # k and v share one head count
        found = _split_heads(inputs[i], [node, *absorbed])
        if found is not None and attr(node, "kv_num_heads", found[1]) == found[1] \
                and ("kv_num_heads" not in attrs or attrs["kv_num_heads"].value == found[1]):
            absorbed.append(found[0])
            inputs[i] = found[0].inputs[0]
            attrs["kv_num_heads"] = ir.AttrInt64("kv_num_heads", found[1])
    if "qkv_split" not in attrs and "q_num_heads" in attrs and "kv_num_heads" in attrs \
            and (packed := _packed_split(inputs, [node, *absorbed])) is not None:
        absorbed.append(packed[0])
        inputs[:3] = [packed[0].inputs[0], None, None]
        attrs["qkv_split"] = ir.AttrInt64s("qkv_split", packed[1])
    out = node.outputs[0]
    if "out_merge_heads" not in attrs and (merge := _merge_heads(out)) is not None:
        absorbed.append(merge)
        out = merge.outputs[0]
        attrs["out_merge_heads"] = ir.AttrInt64("out_merge_heads", 1)
    if not absorbed:
        return False
    fused = ir.Node(KILN_DOMAIN, "Attention", inputs, list(attrs.values()), name=node.name)
    replace_with([node, *absorbed], fused, out, insert_before=node)
    return True
