"""A chain of Reshapes and Transposes -> one kiln::Relayout.

    t1 = Reshape(x, s1); t2 = Transpose(t1, p1); ...; y = Reshape(tk, sk)
      ->  y = Relayout(x, dims, perm, shape)       y = x.reshape(dims).permute(perm).reshape(shape)
      ->  y = Reshape(x, shape)                     when perm moves nothing (a Transpose of a size-1 dim)

A Reshape into or out of a 4-D shape whose NHWC memory (a segment's 4-D layout) differs from row-major is a
Relayout too, of an identity perm (Swin's [N, H*W, C] <-> [N, H, W, C] around its shifted windows): as a
copy in the segment's layouts it is a member, where the Reshape was a step of its own.

Every such chain moves x's elements by one strided walk: the pass runs the chain on an index table
(arange over x's shape) and reads dims and perm off the result (kiln/ops/relayout.py strided_form);
a chain whose table no strided walk gives is left alone. MobileViT's unfold and fold are five nodes each
([1, C, H, W] -> [4, H*W/4, C] and back): unfused, each Transpose is a step on torch that splits the
CPU's native segment in two; fused, one copy kernel inside it (kiln/kernels/cpu/relayout.py).
Only CPU builds ask for it (fusion.CPU_RULES); the chain must have a Transpose (or a 4-D end as above),
float32 values of static shapes, and each inner value read only by the next node. Two exceptions: a chain that
moves a recurrent layer's X or Y over one symbolic dim (a dynamic batch: the exporter's batch-first Transpose, a
bidirectional Y's merge), and a chain over a dynamic batch (x's first dim its only symbol) that moves each batch's
block alike (ConvNeXt's permutes to NHWC rows and back, a ViT's head split), are found at two sizes of that dim and
fused with -1 where they differ (dims and shape), which holds at every batch (kiln/tactics/cpu/relayout.py binds it
at each size a segment meets); flatten_channels_last_runs keeps the batch's symbol. Before, ConvNeXt-tiny at a
dynamic batch ran its 18 permutes on torch between 5 segments (bench/results/first-call-2026-12-06.md).
"""

from __future__ import annotations

import functools

import numpy as np
import onnx_ir as ir

from kiln.ops.relayout import TABLE_LIMIT, dims_and_perm, strided_form
from kiln.passes._rewrite import (
    KILN_DOMAIN,
    PassReport,
    attr,
    const,
    is_op,
    new_initializer,
    only_user,
    producer,
    replace_with,
    static_shape,
)
from kiln.passes.fusion.symbolic_shapes import RECURRENT as _RECURRENT
from kiln.passes.fusion.symbolic_shapes import symbolic_shape

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


def _keeps_order(size: list[int]) -> bool:
    """Whether a value of this size has one memory order row-major and in a native segment (4-D: NHWC)."""
    return len(size) != 4 or size[2] * size[3] == 1 or size[1] == 1


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
    if chain is None:
        return False
    x = chain[0].inputs[0]
    shape, out = static_shape(x), static_shape(node.outputs[0])
    if shape is None and any(n.op_type == "Transpose" for n in chain):
        if _around_recurrent(chain):
            return _fuse_at_symbolic_batch(chain, report)
        if _batch_first(x):
            return _fuse_at_symbolic_batch(chain, report, batch_outer=True)
    relaid = shape is not None and out is not None and not (_keeps_order(shape) and _keeps_order(out))
    if not any(n.op_type == "Transpose" for n in chain) and not relaid:
        return False  # Reshapes alone: a view, and inside a segment an alias
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
    # the chain moves no element: one Reshape (a view; in a segment, an alias)
    _replace_chain(node, chain, x, dims, perm, out, reshape=perm == sorted(perm) and not relaid)
    return True


def _replace_chain(node: ir.Node, chain: list, x: ir.Value, dims: list[int], perm: list[int], shape: list[int],
                   reshape: bool) -> None:
    """The chain ending at `node` as one Reshape of x to `shape` (reshape: it moves no element) or one Relayout."""
    if reshape:
        target = new_initializer(node.graph, f"{node.name}_shape", np.array(shape, dtype=np.int64))
        fused = ir.Node("", "Reshape", [x, target], name=f"{node.name}_reshape")
    else:
        fused = ir.Node(KILN_DOMAIN, "Relayout", [x],
                        [ir.AttrInt64s("dims", dims), ir.AttrInt64s("perm", perm), ir.AttrInt64s("shape", shape)],
                        name=f"{node.name}_relayout")
    replace_with(chain, fused, node.outputs[0], insert_before=chain[0])


# ---- a chain over one symbolic dim (a dynamic batch) ------------------------------------------------

PROBES = (3, 5)  # two sizes of the symbolic dim, both > 1: strided_form merges the same dims at either


def _around_recurrent(chain: list[ir.Node]) -> bool:
    """Whether the chain moves a recurrent layer's Y or X (the only chains fused at a symbolic dim so far: the
    exporter's batch-first Transposes and bidirectional merges; other models' dynamic chains stay as they were)."""
    reader = only_user(chain[-1].outputs[0])
    return is_op(producer(chain[0].inputs[0]), *_RECURRENT) or (
        is_op(reader, *_RECURRENT) and reader.inputs[0] is chain[-1].outputs[0])


def _batch_first(x: ir.Value) -> bool:
    """Whether x's only symbolic dim is its first (a dynamic batch, every other dim static)."""
    dims = symbolic_shape(x)
    return bool(dims) and isinstance(dims[0], str) and all(isinstance(d, int) for d in dims[1:])


def _table_at(chain: list[ir.Node], shape: list[int], probe: int) -> np.ndarray | str:
    """The chain run on arange over `shape` (the symbolic dim at `probe`): Reshapes by their constant target."""
    table = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
    for node in chain:
        if node.op_type == "Transpose":
            perm = attr(node, "perm")
            table = table.transpose(perm if perm is not None else list(range(table.ndim))[::-1])
            continue
        target = const(node.inputs[1]) if node.op_type == "Reshape" and len(node.inputs) > 1 else None
        if target is not None and not attr(node, "allowzero", 0):
            size = [table.shape[k] if int(d) == 0 else int(d) for k, d in enumerate(target.reshape(-1))]
        else:
            dims = symbolic_shape(node.outputs[0])
            if dims is None or any(not isinstance(d, int) and not isinstance(d, str) for d in dims):
                return f"{node.name!r}'s output shape is not known"
            size = [probe if isinstance(d, str) else d for d in dims]
        try:
            table = table.reshape(size)
        except ValueError:
            return f"{node.name!r}'s target {size} does not hold the input's {table.size} elements"
    return table


def _one_inferred(a: list[int], b: list[int]) -> list[int] | None:
    """Sizes at the two probes as one list with -1 (torch's and ONNX's inferred dim) where they differ, or None
    when more than one differs."""
    if len(a) != len(b):
        return None
    differ = [k for k in range(len(a)) if a[k] != b[k]]
    if len(differ) > 1:
        return None
    return [-1 if k in differ else a[k] for k in range(len(a))]


def _fuse_at_symbolic_batch(chain: list[ir.Node], report: PassReport, batch_outer: bool = False) -> bool:
    """`batch_outer`: a chain not around a recurrent layer over a dynamic batch (ConvNeXt's permutes to NHWC rows
    and back), fused only where it moves every batch's block alike (-1 the first of dims and shape, axis 0 kept
    first): then it holds at every batch, and an alias form's size rule is exact (tactics/cpu/relayout.py)."""
    # Transpose(Y [S, 2, batch, H], (0, 2, 1, 3)); Reshape(.., [S, 0, 2H]) -> Relayout(dims [S, 2, -1, H],
    #   perm (0, 2, 1, 3), shape [S, -1, 2H]): the walk found at two sizes of the symbolic dim, -1 where they differ
    node = chain[-1]
    x = chain[0].inputs[0]
    dims = symbolic_shape(x)
    symbols = {d for d in dims or () if not isinstance(d, int)}
    if dims is None or len(symbols) != 1 or None in symbols:
        report.refuse(RULE, node, "the chain's input shape is neither static nor of one named symbolic dim")
        return False
    found, outs = [], []
    for probe in PROBES:
        shape = [probe if isinstance(d, str) else d for d in dims]
        table = _table_at(chain, shape, probe)
        if isinstance(table, str):
            report.refuse(RULE, node, table)
            return False
        form = strided_form(table)
        walk = dims_and_perm(form, table.size) if form is not None else None
        if walk is None:
            report.refuse(RULE, node, "no strided walk of the input gives the chain's result")
            return False
        found.append(walk)
        outs.append(list(table.shape))
    (dims_a, perm_a), (dims_b, perm_b) = found
    walk_dims, shape = _one_inferred(dims_a, dims_b), _one_inferred(*outs)
    if perm_a != perm_b or walk_dims is None or shape is None:
        report.refuse(RULE, node, "the chain moves elements otherwise at different sizes of its symbolic dim")
        return False
    if batch_outer and not (walk_dims[0] == -1 and shape[0] == -1 and perm_a[0] == 0 and
                            -1 not in walk_dims[1:] and -1 not in shape[1:]):
        report.refuse(RULE, node, "a chain over a dynamic batch that moves elements across its batch")
        return False
    symbol = next(iter(symbols))
    node.outputs[0].shape = ir.Shape([symbol if a != b and a == PROBES[0] and b == PROBES[1] else
                                      (a if a == b else None) for a, b in zip(*outs)])
    # moves no element (a unidirectional Y's Transpose of its size-1 dim): one Reshape
    _replace_chain(node, chain, x, walk_dims, perm_a, shape, reshape=perm_a == sorted(perm_a))
    return True


# ---- channels-last runs: the values between NCHW -> NHWC and back as [N, H*W, C] -------------------

RULE_RUNS = "flatten_channels_last_runs"
# ops that act on the last axis only, each reading the run's value as input 0 and constants besides
_LAST_AXIS = {("", "LayerNormalization"), ("kiln", "LayerNorm"), ("kiln", "FusedGemm"), ("kiln", "Gelu")}


def _moves_like(node: ir.Node, shape: list[int], perm: list[int]) -> bool:
    """Whether Relayout `node` of an input of `shape` moves its elements as Transpose(perm) does."""
    numel = int(np.prod(shape))
    want = np.arange(numel).reshape(shape).transpose(perm).reshape(-1)
    dims, order = attr(node, "dims", []), attr(node, "perm", [])
    return bool(np.array_equal(np.arange(numel).reshape(dims).transpose(order).reshape(-1), want))


def _shape_of(value: ir.Value, batch: str | None) -> list[int] | None:
    """value's static shape, or with `batch` (a dynamic batch's symbol) at PROBES[0] where it is its first dim."""
    if batch is None:
        return static_shape(value)
    dims = symbolic_shape(value)
    if not dims or dims[0] != batch or not all(isinstance(d, int) for d in dims[1:]):
        return static_shape(value)
    return [PROBES[0], *dims[1:]]


def _run_from(start: ir.Node, batch: str | None = None) -> tuple[list[ir.Node], list[ir.Node]] | str:
    """(the nodes of the run after `start`, the Relayouts that end it), or why there is no such run. `batch`: the
    run's dynamic batch symbol (its sizes then compared at PROBES[0])."""
    shape_of = functools.partial(_shape_of, batch=batch)
    inner: list[ir.Node] = []
    ends: list[ir.Node] = []
    values = [start.outputs[0]]
    while values:
        value = values.pop()
        if value.is_graph_output():
            return f"{value.name!r} is a graph output"
        for reader in dict.fromkeys(u.node for u in value.uses()):
            if reader in inner or reader in ends:
                continue
            shape = shape_of(reader.inputs[0]) if reader.inputs[0] is value else None
            if shape is None:
                return f"{reader.name!r} reads the run's value other than as its first input"
            if is_op(reader, "Relayout", domain=KILN_DOMAIN):
                back = shape_of(reader.outputs[0])
                if back != [shape[0], shape[3], shape[1], shape[2]] or not _moves_like(reader, shape, [0, 3, 1, 2]):
                    return f"{reader.name!r} moves the run's value otherwise than back to NCHW"
                ends.append(reader)
                continue
            if (reader.domain, reader.op_type) not in _LAST_AXIS:
                return f"{reader.name!r} ({reader.op_type}) is not an op over the last axis"
            if int(attr(reader, "axis", -1)) not in (-1, 3) or attr(reader, "residual_after_activation", 0):
                return f"{reader.name!r} is over another axis than the last"
            if any(v is not None and shape_of(v) is not None and len(shape_of(v)) > 2 and v is not value
                   for v in reader.inputs) or any(v is not None and v is not value and v.const_value is None
                                                  for v in reader.inputs):
                return f"{reader.name!r} reads another value than the run's and constants of rank <= 2"
            out = shape_of(reader.outputs[0])
            if len(reader.outputs) != 1 or out is None or len(out) != 4 or out[:3] != shape[:3]:
                return f"{reader.name!r}'s output is not [N, H, W, *] like its input"
            inner.append(reader)
            values.append(reader.outputs[0])
    return inner, ends


def flatten_channels_last_runs(node: ir.Node, report: PassReport) -> bool:
    # R1 = Relayout(x [N, C, H, W] -> [N, H, W, C]); ops over the last axis; Relayout(-> [N, C', H, W])
    #   -> every value from R1's output to the last op's as [N, H*W, *]
    # ConvNeXt's blocks (permute, LayerNorm, two Linears, permute back): a segment keeps 4-D values NHWC in
    # memory, which is exactly the row-major [N, H*W, C] the flattened run reads, so the two Relayouts are
    # plain copies and LayerNorm and the GEMMs run as members over rows (a 4-D [N, H, W, C] value inside a
    # segment would be laid out [N, W, C, H] and the run would leave it).
    if not is_op(node, "Relayout", domain=KILN_DOMAIN):
        return False
    batch = None
    if static_shape(node.inputs[0]) is None and _batch_first(node.inputs[0]):
        batch = symbolic_shape(node.inputs[0])[0]  # a dynamic batch: sizes at a probe, the symbol written back
    shape, out = _shape_of(node.inputs[0], batch), _shape_of(node.outputs[0], batch)
    if shape is None or len(shape) != 4 or out != [shape[0], shape[2], shape[3], shape[1]] \
            or not _moves_like(node, shape, [0, 2, 3, 1]):
        return False
    found = _run_from(node, batch)
    if isinstance(found, str):
        report.refuse(RULE_RUNS, node, found)
        return False
    inner, ends = found
    if not ends:
        report.refuse(RULE_RUNS, node, "the run does not end in a Relayout back to NCHW")
        return False
    n, h, w = out[0], out[1], out[2]
    node.attributes["shape"] = ir.AttrInt64s("shape", [n if batch is None else -1, h * w, out[3]])
    for value in [node.outputs[0], *(m.outputs[0] for m in inner)]:
        last = _shape_of(value, batch)[3]
        value.shape = ir.Shape([n if batch is None else batch, h * w, last])
    for m in inner:
        if "axis" in m.attributes:
            m.attributes["axis"] = ir.AttrInt64("axis", -1)
    return True
