"""The head split/merge around kiln::Attention, taken into the op (views, no steps).

Exporters split heads with a Reshape before attention and merge them with one after:

    q = Reshape(x_q, [B, S, H, D])          ->  Attention(x_q, ..., q_num_heads=H)
    y = Reshape(Attention(...), [B, S, H·D]) ->  Attention(..., out_merge_heads=1)

and GPT-2 computes Q, K and V with one GEMM and splits them along the hidden axis:

    q, k, v = Split(qkv, [Wq, Wk, Wv], axis=-1)  ->  Attention(qkv, None, None, qkv_split=[Wq, Wk, Wv])

When the merged GEMM (merge_parallel_gemms) wrote the three in another order (Hugging Face's ViT/YOLOS
compute the key, the value, then the query), its weight rows and bias are permuted to q, k, v first:

    Split(x·[Wk; Wv; Wq]ᵀ + [bk; bv; bq]) read as (q, k, v)  ->  x·[Wq; Wk; Wv]ᵀ + [bq; bk; bv], qkv_split

A constant scalar multiplying q or k (Whisper scales the query by D^-1/2 after its projection) is the
attention's scale:

    Attention(q·c, k, v, scale=s)  ->  Attention(q, k, v, scale=c·s)         (softmax(c·q·kᵀ·s) = softmax(q·kᵀ·cs))

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
    const,
    const_scalar,
    consumers,
    dims_equal,
    is_op,
    new_initializer,
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


def _packed_split(inputs: list[ir.Value | None], readers: list[ir.Node]
                  ) -> tuple[ir.Node, list[int], list[int]] | None:
    """(the Split, widths, order) when q, k, v are the three outputs of one Split of the last axis, each
    read once by `readers` (the attention, or a head Reshape it absorbs): q, k, v = outputs order[0..2]."""
    split = producer(inputs[0], "Split")
    if split is None or len(split.outputs) != 3 or sorted(map(id, split.outputs)) != sorted(map(id, inputs[:3])):
        return None
    rank = None if split.inputs[0].shape is None else len(split.inputs[0].shape)
    if rank != 3 or attr(split, "axis", 0) not in (-1, rank - 1):
        return None
    if any(len(list(v.uses())) != 1 or consumers(v)[0] not in readers or v.is_graph_output() for v in split.outputs):
        return None
    widths = [None if v.shape is None else v.shape[-1] for v in split.outputs]
    if not all(isinstance(w, int) for w in widths):
        return None
    outputs = list(split.outputs)
    return split, widths, [outputs.index(v) for v in inputs[:3]]


def _reorder_packed_gemm(split: ir.Node, widths: list[int], order: list[int]) -> bool:
    """Permute the column blocks of the FusedGemm feeding `split` (read by nothing else) so that block j
    is the old block order[j]: its weight rows [N, K] and bias, new constants. False: not such a GEMM."""
    gemm = producer(split.inputs[0], "FusedGemm", KILN_DOMAIN)
    if gemm is None or only_user(split.inputs[0]) is not split or len(gemm.inputs) > 3:
        return False
    w = const(gemm.inputs[1])
    has_bias = len(gemm.inputs) > 2 and gemm.inputs[2] is not None
    b = const(gemm.inputs[2]) if has_bias else None
    if w is None or w.ndim != 2 or w.shape[0] != sum(widths) or (has_bias and (b is None or b.size != sum(widths))):
        return False
    starts = [sum(widths[:i]) for i in range(3)]
    rows = [i for j in order for i in range(starts[j], starts[j] + widths[j])]
    graph = gemm.graph
    gemm.replace_input_with(1, new_initializer(graph, f"{gemm.inputs[1].name}_qkv", w[rows]))
    if has_bias:
        gemm.replace_input_with(2, new_initializer(graph, f"{gemm.inputs[2].name}_qkv", b.reshape(-1)[rows]))
    return True


def _scalar_factor(value: ir.Value | None, readers: list[ir.Node]) -> tuple[ir.Node, ir.Value, float] | None:
    """(the Mul, x, c) when value = x · c for a constant scalar c, read only by one of `readers`."""
    mul = producer(value, "Mul")
    if mul is None or only_user(value) not in readers:
        return None
    for x, c in ((mul.inputs[0], mul.inputs[1]), (mul.inputs[1], mul.inputs[0])):
        factor = const_scalar(c)
        if factor is not None and x is not None and x.shape is not None and value.shape is not None \
                and dims_equal(list(x.shape), list(value.shape)) and x.type == value.type:
            return mul, x, factor
    return None


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

    def absorb_scalars() -> None:  # q·c or k·c: the attention's scale times c
        for i in (0, 1):
            if "qkv_split" not in attrs and (found := _scalar_factor(inputs[i], [node, *absorbed])) is not None:
                absorbed.append(found[0])
                inputs[i] = found[1]
                attrs["scale"] = ir.AttrFloat32("scale", float(attr(node, "scale", 1.0) if "scale" not in attrs
                                                               else attrs["scale"].value) * found[2])

    absorb_scalars()
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
    for i in (1, 2)[:max(0, len(inputs) - 1)]:  # k and v share one head count (a packed qkv_split has neither)
        found = _split_heads(inputs[i], [node, *absorbed])
        if found is not None and attr(node, "kv_num_heads", found[1]) == found[1] \
                and ("kv_num_heads" not in attrs or attrs["kv_num_heads"].value == found[1]):
            absorbed.append(found[0])
            inputs[i] = found[0].inputs[0]
            attrs["kv_num_heads"] = ir.AttrInt64("kv_num_heads", found[1])
    absorb_scalars()  # a scale applied before the head split
    if "qkv_split" not in attrs and "q_num_heads" in attrs and "kv_num_heads" in attrs \
            and (packed := _packed_split(inputs, [node, *absorbed])) is not None:
        split, widths, order = packed
        if order == [0, 1, 2] or _reorder_packed_gemm(split, widths, order):
            absorbed.append(split)
            inputs[:3] = [split.inputs[0], None, None]
            attrs["qkv_split"] = ir.AttrInt64s("qkv_split", [widths[j] for j in order])
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
