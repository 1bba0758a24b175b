"""Remove padding: an encoder's per-token layers run on the real tokens only (opt-in, `remove_padding=True`).

As TensorRT's BERT varlen plugins and FasterTransformer do. With a padding mask m [B, S] (a graph input
named like `attention_mask`, integer or bool, nonzero: a real token), every layer of an encoder except
attention acts on each token alone, so the hidden state may be packed to [T, ...] (T = Σ(m ≠ 0)):

    index, scatter, cu_seqlens = TokenIndex(m, bucket)  # kiln/ops/tokens.py
    x_T = PackTokens(x, index)                          # [B, S, ...] -> [T, ...], where the region starts
    ... per-token layers on [T, ...]
    Attention(q, k, v, M(m)) -> PackedAttention(q_T, k_T, v_T, m, index, scatter, cu_seqlens)
        (or, `padded_attention`: PackTokens(Attention(UnpackTokens(q_T), ..., M(m)), index), a device's padded
        attention on q/k/v scattered back, memory ops only around it; the builder takes PackedAttention on every
        device: CUDA's varlen flash, the CPU's varlen C kernel)
    y = UnpackTokens(y_T, scatter, m)                   # [T, ...] -> [B, S, ...], zeros at padding

`bucket` is a graph input the pass adds (TOKEN_BUCKET, [token_bucket] uint8) that is no engine binding: the
runtime feeds it, shaped [T'] for a token bucket T' ≥ T, when it pads shapes to buckets (CUDA graphs), so the
packed shapes of a run are the bucket's; without it (the builder's runs, a CPU context) T' = T.

The contract:

- **Which layers.** The region is every layer downstream of an attention that reads the padding mask, up to
  the graph outputs (all of them must be per-token, or the model is refused: a layer mixing tokens after the
  last attention, a pooler, would see zeros where it saw the unpacked model's padding values), and, walking
  back from it, the per-token layers that feed only the region (the first layer's QKV GEMM; with `embeddings`, on
  CUDA, back to the embedding lookups: their ids are packed, and a [1, seq, ...] position embedding is packed for
  each token's position).
- **Per-token** (`per_token_reason`): a layer acting on the trailing dims only — elementwise ops whose other
  operands broadcast over the last dims (constants, of rank ≤ rank - 2 once leading 1s are dropped), GEMMs
  with a constant weight, LayerNorm/RMSNorm/Softmax over a trailing axis, activations, Transpose and Reshape
  that leave the batch and sequence axes alone. Anything else is refused with its name and reason.
- **Attention.** Every attention in the region must read the padding mask alone (a key hidden exactly where
  m = 0, for every query; checked numerically by evaluating the mask's subgraph on random masks at two
  shapes), not causal, and lay q/k/v and its output out as [B, S, ...] (its permutations keep the batch and
  sequence axes): it becomes PackedAttention, the same attributes applied to the unpacked tensors.
- **Semantics.** Outputs at real tokens equal the unpacked model's; outputs at padding positions are zero
  (not what the unpacked model computes there), which is why this is opt-in and said in the engine header.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import common

from kiln.errors import ModelError
from kiln.passes._rewrite import KILN_DOMAIN, attr, const, consumers, new_initializer
from kiln.passes.fold import evaluate
from kiln.plan.spec import MASK_NAMES

REMOVE_PADDING = "kiln.remove_padding"  # model.meta key: the PaddingRemoval's JSON, for the engine header
TOKENS = "tokens"  # the packed axis' symbol: T, the number of real tokens of a run
TOKEN_BUCKET = "kiln_token_bucket"  # the graph input whose shape [T'] is a run's token bucket (read for its shape)
MASKED = -1e30  # an additive mask entry at or below this hides its key (as kiln/passes/fusion/attention.py)

_UNARY = frozenset({"Relu", "Gelu", "Tanh", "Sigmoid", "Erf", "Exp", "Log", "Sqrt", "Neg", "Abs", "Reciprocal",
                    "Cast", "Identity", "Softplus", "Softsign", "Elu", "LeakyRelu", "HardSigmoid", "HardSwish",
                    "Mish", "Sin", "Cos", "Floor", "Ceil", "Round", "Sign", "Not", "IsNaN", "Clip"})
_BINARY = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Sum", "Mean", "Equal", "Less", "Greater",
                     "And", "Or", "Where", "PRelu"})
_KILN_PER_TOKEN = frozenset({"FusedGemm", "LayerNorm", "RMSNorm", "Gelu", "Softmax", "Elementwise"})
_TRAILING_AXIS = {("", "Softmax"): "axis", ("", "LogSoftmax"): "axis", ("", "LayerNormalization"): "axis",
                  ("kiln", "LayerNorm"): "axis", ("kiln", "RMSNorm"): "axis", ("kiln", "Softmax"): "axis",
                  ("", "RMSNormalization"): "axis"}


class PaddingRefused(ModelError):
    """The model cannot run padding-free; the message says which layer or input, and why."""


@dataclass
class PaddingRemoval:
    """What the rewrite did (the engine header's `remove_padding`, shown by `kiln inspect`)."""

    mask: str  # the padding mask input
    bucket_input: str  # the program input the runtime feeds a token bucket's shape through (no binding)
    layers: int  # layers that run on the packed tokens
    attentions: int  # of them, attentions
    attention: str  # "packed": PackedAttention over the real tokens; "padded": Attention on q/k/v scattered back
    packed: list[str] = field(default_factory=list)  # values packed where the region starts
    unpacked: list[str] = field(default_factory=list)  # values scattered back to [B, S, ...]

    def to_json(self) -> dict:
        return dict(self.__dict__)


# ---------------------------------------------------------------- which values and layers


def padding_mask_input(graph: ir.Graph) -> ir.Value | None:
    """The graph input that is a padding mask: rank 2 of symbolic [batch, seq], integer or bool, named like one."""
    for value in graph.inputs:
        shape, dtype = value.shape, value.dtype
        if shape is None or len(shape) != 2 or any(isinstance(d, int) or d.value is None for d in shape):
            continue
        if dtype in (ir.DataType.INT64, ir.DataType.INT32, ir.DataType.BOOL) and \
                any(m in (value.name or "").lower() for m in MASK_NAMES):
            return value
    return None


def _dims(value: ir.Value) -> list | None:
    return None if value is None or value.shape is None else [d if isinstance(d, int) else d.value for d in value.shape]


def is_token_value(value: ir.Value | None, batch: str, seq: str) -> bool:
    """value is [batch, seq, ...]: one row per position of the mask."""
    dims = _dims(value)
    return dims is not None and len(dims) >= 2 and dims[0] == batch and dims[1] == seq


def is_sequence_value(value: ir.Value | None, seq: str) -> bool:
    """value is [1, seq, ...]: one row per position of the sequence, the same for every row of the batch (BERT's
    position embeddings). A second dim of min(P, seq) is seq: the slice of a table of P positions, which a longer
    sequence could not run with."""
    dims = _dims(value)
    if dims is None or len(dims) < 2 or dims[0] != 1:
        return False
    return dims[1] == seq or re.fullmatch(rf"Min\(\d+, {re.escape(seq)}\)|Min\({re.escape(seq)}, \d+\)",
                                          str(dims[1])) is not None


def _broadcast_reason(value: ir.Value, rank: int) -> str | None:
    """None when `value` (not a token value) broadcasts over the trailing dims of a rank-`rank` token value
    only: rank ≤ rank - 2 once leading 1s are dropped (a constant's leading 1s are dropped by the rewrite)."""
    dims = _dims(value)
    if dims is None:
        return f"the operand {value.name!r} has an unknown shape"
    if const(value) is not None:
        while dims and dims[0] == 1:
            dims = dims[1:]
    if len(dims) > rank - 2:
        return f"the operand {value.name!r} of shape {dims} spans the batch or sequence axis"
    return None


def _trailing_axis(node: ir.Node, rank: int) -> bool:
    name = _TRAILING_AXIS.get((node.domain, node.op_type))
    if name is None:
        return True
    axis = attr(node, name, -1)
    return (axis >= 2) if axis >= 0 else (axis >= -(rank - 2))


def per_token_reason(node: ir.Node, batch: str, seq: str, embeddings: bool = False) -> str | None:
    """None when the node acts on the trailing dims of its [batch, seq, ...] inputs only, else why not.
    `embeddings`: a lookup of token ids in a constant table (Gather on axis 0) is per-token too, and so is an
    operand of one row per sequence position ([1, seq, ...], packed for each token's position)."""
    key = (node.domain, node.op_type)
    tokens = [v for v in node.inputs if is_token_value(v, batch, seq)]
    if not tokens:
        return "it reads no [batch, seq, ...] value"
    if any(not is_token_value(v, batch, seq) for v in node.outputs):
        return "an output is not [batch, seq, ...]"
    if embeddings and key == ("", "Gather"):
        table = const(node.inputs[0])
        if attr(node, "axis", 0) != 0 or table is None or table.ndim != 2 or node.inputs[1] not in tokens \
                or len(tokens[0].shape) != 2:
            return "a Gather that is not a lookup of [batch, seq] ids in a constant table"
        return None
    rank = len(tokens[0].shape)
    per_op = key in {("", op) for op in _UNARY | _BINARY} or key in {("kiln", op) for op in _KILN_PER_TOKEN} \
        or key in _TRAILING_AXIS
    if key == ("", "MatMul"):
        if node.inputs[0] not in tokens or const(node.inputs[1]) is None or len(node.inputs[1].shape) != 2:
            return "a MatMul whose right operand is not a constant matrix"
        return None
    if key == ("", "Transpose"):
        perm = attr(node, "perm")
        return None if perm is not None and perm[:2] == [0, 1] else "a Transpose that moves the batch or sequence axis"
    if key == ("", "Reshape"):
        shape = const(node.inputs[1])
        keeps = shape is not None and len(shape) >= 2 and list(shape[:2]) == [0, 0] and not attr(node, "allowzero", 0)
        return None if keeps else "a Reshape whose shape is not a constant that copies the batch and sequence axes"
    if not per_op:
        return "not a per-token layer (it may mix tokens)"
    if not _trailing_axis(node, rank):
        return "it normalizes or reduces over the batch or sequence axis"
    for i, value in enumerate(node.inputs):
        if value is None or value in tokens:
            continue
        if key == ("kiln", "FusedGemm") and i == 1:  # the weight [N, K]: not a broadcast operand
            if const(value) is None:
                return "a GEMM whose weight is not a constant"
            continue
        if embeddings and is_sequence_value(value, seq) and len(value.shape) == rank:
            continue
        if (reason := _broadcast_reason(value, rank)) is not None:
            return reason
    if any(len(v.shape) != rank for v in tokens):
        return "its [batch, seq, ...] operands differ in rank"
    return None


# ---------------------------------------------------------------- the attention's mask is the padding mask


def _ancestors(value: ir.Value) -> list[ir.Node]:
    """The nodes `value` is computed by, in graph order."""
    seen: dict[int, ir.Node] = {}
    stack = [value]
    while stack:
        node = stack.pop().producer()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        stack += [v for v in node.inputs if v is not None]
    graph = value.graph or next(iter(seen.values())).graph
    return [n for n in graph if id(n) in seen]


def _evaluate(value: ir.Value, feeds: dict[str, np.ndarray], opset: int) -> np.ndarray | None:
    """value computed from `feeds` (graph inputs by name) and constants by kiln's own ops; None if it cannot be."""
    known: dict[int, np.ndarray] = {}

    def array(v: ir.Value) -> np.ndarray | None:
        if id(v) in known:
            return known[id(v)]
        if v.name in feeds and v.is_graph_input():
            return feeds[v.name]
        return const(v)

    for node in _ancestors(value):
        args = [None if v is None else array(v) for v in node.inputs]
        if any(a is None for v, a in zip(node.inputs, args) if v is not None):
            return None
        results = evaluate(node, opset, [None if a is None else ir.tensor(np.ascontiguousarray(a).reshape(np.shape(a)))
                                         for a in args])
        if results is None:
            return None
        known.update({id(v): r for v, r in zip(node.outputs, results)})
    return known.get(id(value))


def _mask_reason(mask_value: ir.Value, mask: ir.Value, graph: ir.Graph) -> str | None:
    """None when the attention mask computed from `mask` hides key j of row b for every query exactly where
    mask[b, j] = 0 (evaluated on random masks, a fully padded row included, at two shapes); else why not.
    The other graph inputs it may read are read for their shapes only (they are fed zeros)."""
    opset = graph.opset_imports.get("", 21)
    rng = np.random.default_rng(0)
    batch, seq = (d.value for d in mask.shape)
    for b, s in ((3, 5), (2, 7)):
        m = (rng.random((b, s)) < 0.6).astype(mask.dtype.numpy())
        m[0, :] = 1
        m[-1, :] = 0
        feeds = {mask.name: m}
        for value in graph.inputs:
            if value is not mask and value.shape is not None:
                sizes = {batch: b, seq: s}
                dims = [d if isinstance(d, int) else sizes.get(d.value, 1) for d in value.shape]
                feeds[value.name] = np.zeros(dims, value.dtype.numpy() if value.dtype is not None else np.float32)
        got = _evaluate(mask_value, feeds, opset)
        if got is None:
            return "the attention's mask is not computed from the padding mask by ops kiln can evaluate at build"
        if got.ndim != 4:
            return f"the attention's mask is {got.ndim}-D, not [B, H|1, S, S]"
        want_hidden = np.broadcast_to((m == 0)[:, None, None, :], (b, 1, s, s))
        try:
            got = np.broadcast_to(got, (b, got.shape[1], s, s))
        except ValueError:
            return f"the attention's mask of shape {list(got.shape)} does not broadcast to [{b}, H, {s}, {s}]"
        hidden = ~got if got.dtype == np.bool_ else got <= MASKED
        kept = got if got.dtype == np.bool_ else got == 0
        if not (hidden | kept).all():
            return "the attention's mask holds values other than 0 and ≤ -1e30 (a bias, not a padding mask)"
        if not (hidden == want_hidden).all():
            return "the attention's mask hides other keys than the padding mask's (causal, or a different mask)"
    return None


def _attention_reason(node: ir.Node, batch: str, seq: str) -> str | None:
    """None when a kiln::Attention reads [batch, seq, ...] q/k/v and writes its output so, else why not."""
    if attr(node, "is_causal", 0):
        return "a causal attention"
    for name in ("q_perm", "k_perm", "v_perm"):
        perm = attr(node, name)  # [B, S, ...] -> [B, H, S, D]: axes 0 and 2 of the result are the input's 0 and 1
        if perm is not None and (perm[0] != 0 or perm[2] != 1):
            return f"its {name} {perm} does not read [batch, seq, ...]"
    perm = attr(node, "out_perm")
    if perm is None or perm[0] != 0 or perm[1] != 2:
        return f"its output (out_perm {perm}) is not [batch, seq, ...]"
    for value in node.inputs[:3]:
        if value is not None and not is_token_value(value, batch, seq):
            return f"its input {value.name!r} is not [batch, seq, ...]"
    return None


# ---------------------------------------------------------------- the region


def _mask_dependent(mask: ir.Value) -> set[int]:
    """ids of the values computed from the mask's data (its Shape alone does not count)."""
    seen, stack = {id(mask)}, [mask]
    while stack:
        for node in consumers(stack.pop()):
            if node.op_type in ("Shape", "Size") and node.domain == "":
                continue
            for out in node.outputs:
                if id(out) not in seen:
                    seen.add(id(out))
                    stack.append(out)
    return seen


def _is_attention(node: ir.Node) -> bool:
    return node.domain == KILN_DOMAIN and node.op_type == "Attention"


def _masked_attentions(graph: ir.Graph, mask: ir.Value) -> list[ir.Node]:
    """The kiln::Attention layers whose mask is computed from the padding mask, each checked (or refused)."""
    dependent = _mask_dependent(mask)
    batch, seq = (d.value for d in mask.shape)
    found = [n for n in graph if _is_attention(n) and len(n.inputs) > 3 and n.inputs[3] is not None
             and id(n.inputs[3]) in dependent]
    if not found:
        raise PaddingRefused(f"no fused attention reads the padding mask {mask.name!r} (nothing to pack around)")
    quantized = next((n for n in found if attr(n, "q_quant") or attr(n, "score_quant") or attr(n, "prob_quant")), None)
    if quantized is not None:
        raise PaddingRefused(f"the attention {quantized.name!r} is quantized: PackedAttention has no quantized form")
    for node in found:
        reason = _attention_reason(node, batch, seq) or _mask_reason(node.inputs[3], mask, graph)
        if reason is not None:
            raise PaddingRefused(f"attention {node.name!r}: {reason}")
    return found


def _downstream(attentions: list[ir.Node], batch: str, seq: str) -> dict[int, ir.Node]:
    """The attentions and every layer after them, each per-token (or the model is refused)."""
    region = {id(n): n for n in attentions}
    stack = [v for n in attentions for v in n.outputs]
    while stack:
        for node in consumers(stack.pop()):
            if id(node) in region:
                continue
            reason = "an attention that does not read the padding mask" if _is_attention(node) \
                else per_token_reason(node, batch, seq)
            if reason is not None:
                raise PaddingRefused(f"layer {node.name!r} ({node.op_type}) after an attention on the padding mask "
                                     f"is not per-token: {reason}")
            region[id(node)] = node
            stack += node.outputs
    return region


def _extend_upstream(region: dict[int, ir.Node], batch: str, seq: str, embeddings: bool) -> None:
    """Add the per-token layers feeding the region that feed nothing else (the first QKV GEMM, ...; with
    `embeddings`, back to the embedding lookups: per_token_reason)."""
    grown = True
    while grown:
        grown = False
        for node in list(region.values()):
            for i, value in enumerate(node.inputs):
                before = value.producer() if value is not None and not (_is_attention(node) and i == 3) else None
                if before is None or id(before) in region or _is_attention(before) \
                        or not is_token_value(value, batch, seq):
                    continue
                if any(v.is_graph_output() or any(id(u) not in region for u in consumers(v)) for v in before.outputs):
                    continue
                if per_token_reason(before, batch, seq, embeddings) is None:
                    region[id(before)] = before
                    grown = True


# ---------------------------------------------------------------- the rewrite


_NOT_BROADCAST = {("kiln", "FusedGemm"): 1, ("", "MatMul"): 1, ("", "Reshape"): 1, ("", "Gather"): 0}  # weights,
# shapes and tables


def _packed_shape(value: ir.Value) -> ir.Shape:
    return ir.Shape([TOKENS, *value.shape[2:]])


def _drop_leading_ones(node: ir.Node, i: int, rank: int) -> None:
    """A constant broadcast operand [1, 1, ..., d] of a rank-`rank` token layer: its leading 1s dropped, so it
    broadcasts over [T, ...] as it did over [B, S, ...]."""
    array = const(node.inputs[i])
    if array is None or array.ndim <= rank - 2 or _NOT_BROADCAST.get((node.domain, node.op_type)) == i:
        return
    trailing = array.reshape(array.shape[array.ndim - (rank - 2):]) if rank > 2 else array.reshape(())
    node.replace_input_with(i, new_initializer(node.graph, f"{node.inputs[i].name}_per_token", trailing))


def _repack_attributes(node: ir.Node, rank: int) -> None:
    """Axes and permutations of a [B, S, ...] layer rewritten for [T, ...]: one axis fewer."""
    if (node.domain, node.op_type) == ("", "Transpose"):
        perm = attr(node, "perm")
        node.attributes["perm"] = ir.AttrInt64s("perm", [0] + [p - 1 for p in perm[2:]])
    elif (node.domain, node.op_type) == ("", "Reshape"):
        shape = const(node.inputs[1])
        node.replace_input_with(1, new_initializer(node.graph, f"{node.inputs[1].name}_per_token",
                                                   np.concatenate([shape[:1], shape[2:]])))
    name = _TRAILING_AXIS.get((node.domain, node.op_type))
    if name is not None and name in node.attributes and attr(node, name) >= 0:
        node.attributes[name] = ir.AttrInt64(name, attr(node, name) - 1)


def _packed_attention(node: ir.Node, mask: ir.Value, index: ir.Value, scatter: ir.Value,
                      cu_seqlens: ir.Value) -> ir.Node:
    """Attention(q, k, v, M) -> PackedAttention(q, k, v, m, index, scatter, cu_seqlens), q/k/v and output packed."""
    attributes = [a for name, a in node.attributes.items() if name not in ("nan_to_zero", "is_causal")]
    packed = ir.Node(KILN_DOMAIN, "PackedAttention", [*node.inputs[:3], mask, index, scatter, cu_seqlens], attributes,
                     name=f"{node.name}_packed")
    out, old = packed.outputs[0], node.outputs[0]
    out.type, out.shape = old.type, old.shape  # packed already: [T, ...]
    node.graph.insert_before(node, packed)
    name = old.name
    ir.convenience.replace_all_uses_with(old, out, replace_graph_outputs=True)
    node.graph.remove(node, safe=True)
    old.name, out.name = f"{name}__unpacked", name
    return packed


def _padded_attention(node: ir.Node, mask: ir.Value, index: ir.Value, scatter: ir.Value) -> list[ir.Node]:
    """Attention(q_T, k_T, v_T, M) -> PackTokens(Attention(UnpackTokens(q_T), ..., M), index): the attention as it
    was, on q/k/v scattered back to [B, S, ...] (zeros at padding, hidden by M), its output gathered to [T, ...]:
    the device's own attention kernel runs; memory ops only around it. Returns the nodes
    that now stand where the attention stood."""
    graph, added = node.graph, []
    for i, value in enumerate(node.inputs[:3]):
        if value is None:
            continue
        unpack = _new_node(graph, node, "UnpackTokens", [value, scatter, mask], f"{node.name}_unpack_{i}")
        unpack.attributes["zero_padding"] = ir.AttrInt64("zero_padding", 0)  # the attention's mask hides them
        unpack.outputs[0].type, unpack.outputs[0].shape = value.type, ir.Shape([*mask.shape, *value.shape[1:]])
        node.replace_input_with(i, unpack.outputs[0])
        added.append(unpack)
    out = node.outputs[0]
    pack = ir.Node(KILN_DOMAIN, "PackTokens", [out, index], name=f"{node.name}_pack")
    packed = pack.outputs[0]
    packed.type, packed.shape = out.type, out.shape  # packed already: [T, ...]
    out.shape = ir.Shape([*mask.shape, *out.shape[1:]])
    graph.insert_after(node, pack)
    name = out.name
    for use in list(out.uses()):
        if use.node is not pack:
            use.node.replace_input_with(use.idx, packed)
    out.name, packed.name = f"{name}__padded", name
    return [*added, node, pack]


def _new_node(graph: ir.Graph, before: ir.Node, op_type: str, inputs: list[ir.Value], name: str,
              outputs: int = 1) -> ir.Node:
    node = ir.Node(KILN_DOMAIN, op_type, inputs, num_outputs=outputs, name=name)
    graph.insert_before(before, node)
    return node


def remove_padding(model: ir.Model, padded_attention: bool = False, embeddings: bool = False) -> PaddingRemoval:
    """Rewrite the model's encoder to run on its real tokens (the module docstring's contract), or raise
    PaddingRefused naming the input or layer that prevents it; the graph is unchanged when it refuses.
    `padded_attention`: each attention runs as it was on q/k/v scattered back to [B, S, ...] (`_padded_attention`)
    instead of PackedAttention (CUDA: varlen flash; CPU: kiln's varlen C attention). `embeddings`: the region starts
    at the embedding lookups (their ids packed, not the embedded rows): a run padded to a larger shape than its own
    (CUDA graphs of the profile's largest, kiln/runtime/buckets.py graph_rows) then embeds and normalizes only its
    token bucket's rows."""
    graph = model.graph
    mask = padding_mask_input(graph)
    if mask is None:
        names = ", ".join(f"{v.name} {_dims(v)}" for v in graph.inputs)
        raise PaddingRefused(f"no padding mask input: an int64/int32/bool input of shape [batch, seq] named like "
                             f"{' / '.join(MASK_NAMES)} (the model's inputs: {names})")
    batch, seq = (d.value for d in mask.shape)
    attentions = _masked_attentions(graph, mask)
    region = _downstream(attentions, batch, seq)
    _extend_upstream(region, batch, seq, embeddings)
    # Decided: from here on the graph changes.
    nodes = [n for n in graph if id(n) in region]
    inside = {id(v) for n in nodes for v in n.outputs}
    bucket = ir.Value(name=TOKEN_BUCKET, shape=ir.Shape([TOKENS]), type=ir.TensorType(ir.DataType.UINT8))
    graph.inputs.append(bucket)
    tokens = _new_node(graph, nodes[0], "TokenIndex", [mask, bucket], "remove_padding_token_index", outputs=3)
    index, scatter, cu_seqlens = tokens.outputs
    for value, name, dtype in ((index, "index", ir.DataType.INT64), (scatter, "scatter", ir.DataType.INT64),
                               (cu_seqlens, "cu_seqlens", ir.DataType.INT32)):
        value.name, value.type = f"remove_padding_{name}", ir.TensorType(dtype)
    index.shape, scatter.shape = ir.Shape([TOKENS]), ir.Shape([TOKENS])
    packed: dict[int, ir.Value] = {}
    report = PaddingRemoval(mask.name, TOKEN_BUCKET, len(nodes), len(attentions),
                            "padded" if padded_attention else "packed")
    for node in nodes:
        rank = len(node.outputs[0].shape)
        for i, value in enumerate(node.inputs):
            if value is None or id(value) in inside or (_is_attention(node) and i == 3):
                continue
            sequence = embeddings and is_sequence_value(value, seq)
            if is_token_value(value, batch, seq) or sequence:
                if id(value) not in packed:
                    pack = _new_node(graph, node, "PackTokens", [value, index], f"{value.name}_pack")
                    if sequence:  # [1, S, ...]: token b·S + s reads row s
                        pack.attributes["broadcast"] = ir.AttrInt64("broadcast", 1)
                    pack.outputs[0].name = f"{value.name}_packed"
                    pack.outputs[0].type, pack.outputs[0].shape = value.type, _packed_shape(value)
                    packed[id(value)] = pack.outputs[0]
                    report.packed.append(value.name)
                node.replace_input_with(i, packed[id(value)])
            else:
                _drop_leading_ones(node, i, rank)
        _repack_attributes(node, rank)
        for out in node.outputs:
            out.shape = _packed_shape(out)
    for node in attentions:
        del region[id(node)]
        if padded_attention:
            region.update((id(n), n) for n in _padded_attention(node, mask, index, scatter))
        else:
            new = _packed_attention(node, mask, index, scatter, cu_seqlens)
            region[id(new)] = new
    leaving = [v for n in graph if id(n) in region for v in n.outputs
               if v.is_graph_output() or any(id(u) not in region for u in consumers(v))]
    for value in leaving:
        report.unpacked.append(value.name)
        _unpack(graph, value, scatter, mask, region)
    common.TopologicalSortPass()(model)
    return report


def key_padding_mask(model: ir.Model, key_lengths: bool = False) -> int:
    """Every attention on the padding mask m whose mask is additive (float) reads it as a key mask made from m:
    [B, 1, 1, S], 0 at a real key and float32's minimum at padding, in place of the mask the model computes — the
    exported BERT's [B, 1, S, S], the same row for every query, as _masked_attentions checks. The same values once
    broadcast, S times less mask to read: a key vector in kiln's flash kernel instead of a [BM, BN] tile per step.
    For a padding-free engine's plain program (kiln/builder/padding_free.py), whose outputs are zero at padding
    anyway: a fully padded row's queries may come out otherwise than from the model's mask (the minimum instead of
    its value). `key_lengths`: each attention also reads the mask's per-sequence lengths ([B] int32, kiln::KeyLengths,
    -1 where a row's real tokens are not a prefix), with which CUDA's flash kernel stops each row's key loop at its
    length and reads no mask (kiln/kernels/cuda/triton/attention.py). Returns the attentions rewritten; 0 where the
    model has no such mask (the graph is unchanged)."""
    graph = model.graph
    mask = padding_mask_input(graph)
    if mask is None:
        return 0
    try:
        attentions = [n for n in _masked_attentions(graph, mask) if n.inputs[3].dtype.is_floating_point()]
    except PaddingRefused:
        return 0
    if not attentions:
        return 0
    batch, seq = (d.value for d in mask.shape)
    dtype = attentions[0].inputs[3].dtype
    padding = ir.node("Equal", [mask, new_initializer(graph, "key_mask_zero", np.zeros((), mask.dtype.numpy()))],
                      name="key_mask_padding")
    padding.outputs[0].type, padding.outputs[0].shape = ir.TensorType(ir.DataType.BOOL), ir.Shape([batch, seq])
    keys = ir.node("Where", [padding.outputs[0],
                             new_initializer(graph, "key_mask_hidden", np.array(np.finfo(np.float32).min,
                                                                                  dtype.numpy())),
                             new_initializer(graph, "key_mask_kept", np.zeros((), dtype.numpy()))], name="key_mask")
    keys.outputs[0].type, keys.outputs[0].shape = ir.TensorType(dtype), ir.Shape([batch, seq])
    rows = ir.node("Unsqueeze", [keys.outputs[0], new_initializer(graph, "key_mask_axes", np.array([1, 2], np.int64))],
                   name="key_mask_rows")
    key_mask = rows.outputs[0]
    key_mask.name, key_mask.type, key_mask.shape = "key_mask", ir.TensorType(dtype), ir.Shape([batch, 1, 1, seq])
    added = [padding, keys, rows]
    if key_lengths:
        lengths = ir.node("KeyLengths", [mask], domain=KILN_DOMAIN, name="key_lengths")
        lengths.outputs[0].name = "key_lengths"
        lengths.outputs[0].type, lengths.outputs[0].shape = ir.TensorType(ir.DataType.INT32), ir.Shape([batch])
        added.append(lengths)
    graph.insert_before(attentions[0], added)
    for node in attentions:
        node.replace_input_with(3, key_mask)  # [B, 1, 1, S]
        if key_lengths:
            node.resize_inputs(5)
            node.replace_input_with(4, lengths.outputs[0])  # [B]
    common.RemoveUnusedNodesPass()(model)  # the model's own mask subgraph
    return len(attentions)


def _unpack(graph: ir.Graph, value: ir.Value, scatter: ir.Value, mask: ir.Value, region: dict[int, ir.Node]) -> None:
    """value [T, ...] scattered back to [B, S, ...] for the layers outside the region and the graph outputs."""
    outside = [u for u in consumers(value) if id(u) not in region]
    node = ir.Node(KILN_DOMAIN, "UnpackTokens", [value, scatter, mask], name=f"{value.name}_unpack")
    out = node.outputs[0]
    out.type, out.shape = value.type, ir.Shape([*mask.shape, *value.shape[1:]])
    graph.insert_after(value.producer(), node)
    for user in outside:
        for i, v in enumerate(user.inputs):
            if v is value:
                user.replace_input_with(i, out)
    if value.is_graph_output():
        k = next(k for k, v in enumerate(graph.outputs) if v is value)
        name = value.name
        graph.outputs[k] = out
        value.name, out.name = f"{name}__packed", name
    else:
        out.name = f"{value.name}_unpacked"
