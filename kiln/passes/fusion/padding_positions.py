"""RoBERTa's position ids -> one kiln::PaddingPositions.

    keep = Not(Equal(ids, p))
    Add(Mul(CumSum(keep, axis=-1), keep), o) = PaddingPositions(ids, padding_idx=p, offset=o)

(any integer Casts between: the exporter writes keep.int(), cumsum's int64, .type_as, .long()). transformers'
create_position_ids_from_input_ids (RoBERTa, XLM-R, CamemBERT, Longformer, ...): o = p + the past length.
As nine int steps run by torch each one was a dispatch, ~0.14 ms of roberta_tiny's 0.30 on a Zen 3 and more
than onnxruntime's whole model takes over the rest; as one step it is a C loop inside the encoder's segment.

Only Casts to int32 or int64 are looked through (a count along a row fits either), the CumSum must run
forwards and inclusively along the last axis, and the result must be int64 (what the fused op returns).
"""

from __future__ import annotations

import onnx_ir as ir

from kiln.passes._rewrite import KILN_DOMAIN, PassReport, attr, const, consumers, dtype_of, is_op, producer, \
    replace_with

RULE = "fuse_padding_positions"
_INTS = (ir.DataType.INT32, ir.DataType.INT64)


def _through_casts(value: ir.Value, casts: list[ir.Node]) -> ir.Value:
    """The value under any Casts to int32/int64 above `value` (each Cast appended to `casts`)."""
    while (cast := producer(value, "Cast")) is not None and int(attr(cast, "to", 0)) in (int(t) for t in _INTS):
        casts.append(cast)
        value = cast.inputs[0]
    return value


def _integer_scalar(value: ir.Value | None) -> int | None:
    array = const(value)
    if array is None or array.size != 1 or array.dtype.kind not in "iu":
        return None
    return int(array.reshape(-1)[0])


def _keep(value: ir.Value) -> tuple[ir.Value, int, list[ir.Node]] | None:
    """(ids, padding_idx, [Not, Equal]) when value = Not(Equal(ids, padding_idx))."""
    negation = producer(value, "Not")
    equal = producer(negation.inputs[0], "Equal") if negation is not None else None
    if equal is None:
        return None
    for ids, padding in (equal.inputs, reversed(equal.inputs)):
        pad = _integer_scalar(padding)
        if pad is not None and const(ids) is None and dtype_of(ids) in _INTS and ids.shape is not None \
                and len(ids.shape) >= 1:
            return ids, pad, [negation, equal]
    return None


def _match(node: ir.Node) -> tuple[ir.Value, int, int, list[ir.Node]] | str | None:
    """(ids, padding_idx, offset, the nodes it computes) for the Add of the pattern, a reason, or None."""
    if not is_op(node, "Add"):
        return None
    for x, o in (node.inputs, reversed(node.inputs)):
        offset = _integer_scalar(o)
        if offset is None:
            continue
        nodes = [node]
        product = producer(_through_casts(x, nodes), "Mul")
        if product is None:
            continue
        nodes.append(product)
        for counted, masked in (product.inputs, reversed(product.inputs)):
            mul_side: list[ir.Node] = []
            cumsum = producer(_through_casts(counted, mul_side), "CumSum")
            if cumsum is None:
                continue
            keep_casts: list[ir.Node] = []
            keep = _through_casts(masked, keep_casts)
            cumsum_casts: list[ir.Node] = []
            if _through_casts(cumsum.inputs[0], cumsum_casts) is not keep or dtype_of(keep) != ir.DataType.BOOL:
                continue
            found = _keep(keep)
            if found is None:
                continue
            ids, padding, keep_nodes = found
            rank = len(ids.shape)
            axis = _integer_scalar(cumsum.inputs[1])
            if axis is None or axis % rank != rank - 1:
                return "the CumSum does not run along the last axis"
            if int(attr(cumsum, "exclusive", 0)) or int(attr(cumsum, "reverse", 0)):
                return "an exclusive or reversed CumSum"
            if dtype_of(node.outputs[0]) != ir.DataType.INT64:
                return "the positions are not int64"
            nodes += mul_side + [cumsum] + cumsum_casts + keep_casts + keep_nodes
            return ids, padding, offset, list(dict.fromkeys(nodes))
    return None


def fuse_padding_positions(node: ir.Node, report: PassReport) -> bool:
    found = _match(node)
    if found is None:
        return False
    if isinstance(found, str):
        report.refuse(RULE, node, found)
        return False
    ids, padding, offset, nodes = found
    # a step whose result something else reads too stays, and so do the steps it reads (dead code goes after
    # the rule): absorbed, only the rest
    absorbed = set(nodes)
    while stays := [n for n in absorbed if n is not node and any(
            out.is_graph_output() or any(user not in absorbed for user in consumers(out)) for out in n.outputs)]:
        absorbed -= set(stays)
    fused = ir.Node(KILN_DOMAIN, "PaddingPositions", [ids],
                    [ir.AttrInt64("padding_idx", padding), ir.AttrInt64("offset", offset)], name=node.name)
    replace_with([n for n in nodes if n in absorbed], fused, node.outputs[0])
    return True
