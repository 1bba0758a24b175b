"""A chain of Reshapes and Transposes -> one kiln::Relayout.

    t1 = Reshape(x, s1); t2 = Transpose(t1, p1); ...; y = Reshape(tk, sk)
      ->  y = Relayout(x, dims, perm, shape)       y = x.reshape(dims).permute(perm).reshape(shape)

Every such chain moves x's elements by one strided walk: the pass runs the chain on an index table
(arange over x's shape) and reads dims and perm off the result (kiln/ops/relayout.py strided_form);
a chain whose table no strided walk gives is left alone. MobileViT's unfold and fold are five nodes each
([1, C, H, W] -> [4, H*W/4, C] and back): unfused, each Transpose is a step on torch that splits the
CPU's native segment in two; fused, one copy kernel inside it (kiln/kernels/cpu/relayout.py).
Only CPU builds ask for it (fusion.CPU_RULES); the chain must have a Transpose (Reshapes alone move
no byte), float32 values of static shapes, and each inner value read only by the next node.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from kiln.ops.relayout import TABLE_LIMIT, dims_and_perm, strided_form
from kiln.passes._rewrite import KILN_DOMAIN, PassReport, attr, is_op, only_user, producer, replace_with, static_shape

RULE = "fuse_relayout"
MOVERS = ("Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze")


def _mover(node: ir.Node | None) -> bool:
    return is_op(node, *MOVERS) and node.outputs[0].dtype == ir.DataType.FLOAT


def _chain(node: ir.Node) -> list[ir.Node] | None:
    """The chain of movers ending at `node` (its output read by something else than a mover), first to last."""
    if not _mover(node):
        return None
    reader = only_user(node.outputs[0])
    if _mover(reader):
        return None  # not the end of its chain: the rule fires at the end
    chain = [node]
    while True:
        before = producer(chain[0].inputs[0])
        if not _mover(before) or only_user(before.outputs[0]) is not chain[0]:
            return chain
        chain.insert(0, before)


def _table(chain: list[ir.Node], shape: list[int]) -> np.ndarray | str:
    """The chain run on arange over its input's shape, or why it cannot be."""
    table = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
    for node in chain:
        if node.op_type == "Transpose":
            perm = attr(node, "perm")
            table = table.transpose(perm if perm is not None else list(range(table.ndim))[::-1])
        else:
            out = static_shape(node.outputs[0])
            if out is None:
                return f"{node.name!r}'s output shape is not static"
            table = table.reshape(out)
    return table


def fuse_relayout(node: ir.Node, report: PassReport) -> bool:
    chain = _chain(node)
    if chain is None or not any(n.op_type == "Transpose" for n in chain):
        return False
    x = chain[0].inputs[0]
    shape, out = static_shape(x), static_shape(node.outputs[0])
    if shape is None or out is None:
        report.refuse(RULE, node, "the chain's input or output shape is not static")
        return False
    numel = int(np.prod(shape))
    if numel == 0 or numel > TABLE_LIMIT:
        report.refuse(RULE, node, f"{numel} elements: 1 to {TABLE_LIMIT} (the index table is built at build)")
        return False
    table = _table(chain, shape)
    if isinstance(table, str):
        report.refuse(RULE, node, table)
        return False
    form = strided_form(table)
    found = dims_and_perm(form, numel) if form is not None else None
    if found is None:
        report.refuse(RULE, node, "no strided walk of the input gives the chain's result")
        return False
    dims, perm = found
    fused = ir.Node(KILN_DOMAIN, "Relayout", [x],
                    [ir.AttrInt64s("dims", dims), ir.AttrInt64s("perm", perm), ir.AttrInt64s("shape", out)],
                    name=f"{node.name}_relayout")
    replace_with(chain, fused, node.outputs[0], insert_before=chain[0])
    return True
