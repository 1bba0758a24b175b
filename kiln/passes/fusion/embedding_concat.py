"""A recommender's per-field embedding lookups and their Concat -> one kiln::EmbeddingConcat.

    Concat(d, Gather(T_0, Gather(ids, 0, axis=1)), ..., Gather(T_25, Gather(ids, 25, axis=1)), axis=1)
      = EmbeddingConcat(ids, d, T_0, ..., T_25, fields=[-1, 0, ..., 25])

DCN / DLRM-style models exported from torch pick each sparse field's column of ids, look it up in that
field's table and concatenate the embeddings with the dense features: 2·F + 1 small steps (53 for 26
fields) whose cost is each step's dispatch, not the bytes it moves. As one step the lookups are one
loop over the fields. Only lookups from constant 2-D tables by a scalar column of one [N, F] ids
tensor are taken; the other Concat inputs go through as they are.

On the CPU a C loop runs it; on CUDA the tables are stacked at load and looked up in one call
(kiln/tactics/cuda/embedding.py; 53 launches become ~5 in the engine's CUDA graph).
"""

from __future__ import annotations

import onnx_ir as ir

from kiln.passes._rewrite import KILN_DOMAIN, PassReport, attr, const, is_op, only_user, producer, replace_with

RULE = "fuse_embedding_concat"


def _rank(value: ir.Value | None) -> int | None:
    return None if value is None or value.shape is None else len(value.shape)


def _lookup(value: ir.Value) -> tuple[ir.Value, ir.Value, int, list[ir.Node]] | None:
    """(ids, table, field, [table Gather, column Gather]) when value = Gather(table, Gather(ids, field, axis=1))."""
    outer = producer(value, "Gather")
    if outer is None or int(attr(outer, "axis", 0)) != 0:
        return None
    table = outer.inputs[0]
    array = const(table)
    if array is None or array.ndim != 2 or only_user(value) is None:
        return None
    inner = producer(outer.inputs[1], "Gather")
    if inner is None or int(attr(inner, "axis", 0)) % 2 != 1 or only_user(outer.inputs[1]) is not outer:
        return None
    ids, index = inner.inputs[0], const(inner.inputs[1])
    if _rank(ids) != 2 or index is None or index.ndim != 0 or index.dtype.kind not in "iu":
        return None
    field = int(index)
    columns = ids.shape[1]
    if isinstance(columns, int):
        field = field + columns if field < 0 else field
        if not 0 <= field < columns:
            return None
    elif field < 0:
        return None
    return ids, table, field, [outer, inner]


def fuse_embedding_concat(node: ir.Node, report: PassReport) -> bool:
    if not is_op(node, "Concat") or _rank(node.outputs[0]) != 2 or int(attr(node, "axis", 1)) % 2 != 1:
        return False
    lookups = [_lookup(v) if v is not None else None for v in node.inputs]
    found = [lk for lk in lookups if lk is not None]
    if len(found) < 2:
        return False
    ids = found[0][0]
    if any(lk[0] is not ids for lk in found):
        report.refuse(RULE, node, "the lookups read different ids tensors")
        return False
    tables = {const(lk[1]).dtype for lk in found}
    if len(tables) != 1:
        report.refuse(RULE, node, f"the tables' dtypes differ ({sorted(str(t) for t in tables)})")
        return False
    inputs, fields, absorbed = [ids], [], [node]
    for value, lk in zip(node.inputs, lookups):
        if lk is None:
            inputs.append(value)
            fields.append(-1)
        else:
            inputs.append(lk[1])
            fields.append(lk[2])
            absorbed += lk[3]
    fused = ir.Node(KILN_DOMAIN, "EmbeddingConcat", inputs, [ir.AttrInt64s("fields", fields)], name=node.name)
    replace_with(absorbed, fused, node.outputs[0])
    return True
