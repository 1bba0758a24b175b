"""Scaled dot-product attention -> kiln::Attention (torch's scaled_dot_product_attention).

    O = softmax(Q·Kᵀ·s + M)·V

as exporters write it: MatMul(Q·a, Kᵀ·b) [·c or /c] [+ M] [·d] -> Softmax(-1) [-> Where(IsNaN(P), 0, P)]
-> MatMul(·, V), with s = a·b·c·d. A scale d applied after the mask scales the mask too
(M·d: still 0 / very negative). A boolean mask applied as Where(C, scores, f) with a fill
f ≤ -1e30 (or -inf) becomes the additive mask Where(C, 0, f), which SDPA takes directly.
A constant mask that is the causal lower triangle (0 / ≤ -1e30, or True / False) becomes
is_causal=1 with no mask tensor, so SDPA's causal path runs; no row is then fully masked,
so the NaN guard goes too. Around it, the head split/merge Transposes are absorbed
as permutations applied inside the op (views, no copies):

- Kᵀ: Transpose(K, p), or the torchlib form Reshape(Transpose(Reshape(K, [B·H, T, D]), [0,2,1]), [B,H,D,T]);
- K/V repeated for grouped-query attention, Reshape(Expand(Unsqueeze(k, 2))), becomes gqa=1 on the
  un-repeated k/v;
- Transpose on Q, K, V inputs and on the output.

The rule decides everything before it changes the graph, whether the mask is causal included
(the mask's `constant` is computed off the graph); the mask it reads is built only then.

An explicitly quantized attention (onnxruntime's QDQ BERT: every MatMul quantized, Q·Kᵀ and P·V included) is
taken whole, its Q/DQ as attributes the kernel applies exactly where the graph does:

    DQ(q8), DQ(k8ᵀ), DQ(v8)         -> q_quant, k_quant, v_quant: 8-bit inputs, (x - z)·s on load
    MatMul -> Q -> DQ -> [+ M]      -> score_quant: the scores through DQ(Q(·)) before the mask
    Softmax [-> NaN guard] -> Q -> DQ -> MatMul(·, V)    -> prob_quant
    MatMul(P, V) -> Q               -> out_quant: the output written 8-bit

The same holds for onnxruntime's FP8 QDQ model (E4M3FN activations, zero points 0): its Q/DQ become the same
attributes with `float8_quant` = 1 (the kernel rounds to E4M3 with saturation, as ONNX QuantizeLinear does). One
attention is quantized to one kind (8-bit integers or E4M3): a mix of the two is left as it is.

Without this the attention ran as some twenty separate steps (two float MatMuls, six Q/DQ, Softmax, the mask
Add, the NaN guard, head transposes of 8-bit tensors), most of them outside the CPU's native segments.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from kiln.passes._rewrite import (
    KILN_DOMAIN,
    PassReport,
    attr,
    const,
    const_scalar,
    consumers,
    dtype_of,
    is_op,
    new_initializer,
    only_user,
    other_input,
    producer,
    replace_with,
)
from kiln.passes.fusion.attention_mask import broadcast_constant, evaluate_on_constants
from kiln.passes.fusion.qdq_propagate import INT8_TYPES, QParams, dequantized, qparams, quantized_type

RULE = "fuse_attention"
# the 8-bit types of a quantized attention: integers (scale, zero point) and E4M3FN (scale; zero point 0, saturating)
FLOAT8 = ir.DataType.FLOAT8E4M3FN
QUANT_TYPES = (*INT8_TYPES, FLOAT8)
FLOAT8_MAX = 448.0  # E4M3FN's largest finite value: a saturating QuantizeLinear clamps there
MASKED = -1e30  # an additive mask entry at or below this hides its key (exp underflows to 0 exactly)


def _rank(value: ir.Value) -> int | None:
    return None if value is None or value.shape is None else len(value.shape)


def _strip_scale(value: ir.Value, nodes: list[ir.Node]) -> tuple[ir.Value, float]:
    """value = inner·s for scalar constants s (Mul or Div), along single-use edges."""
    scale = 1.0
    while (node := producer(value)) is not None and is_op(node, "Mul", "Div") and only_user(value):
        if node.op_type == "Div" and const_scalar(node.inputs[1]) is not None:
            scale, inner = scale / const_scalar(node.inputs[1]), node.inputs[0]
        elif node.op_type == "Mul" and (c := next((const_scalar(v) for v in node.inputs if const_scalar(v) is not None), None)) is not None:
            inner = node.inputs[1] if const_scalar(node.inputs[0]) is not None else node.inputs[0]
            scale *= c
        else:
            break
        nodes.append(node)
        value = inner
    return value, scale


def _absorb_transpose(value: ir.Value, perm: list[int] | None, nodes: list[ir.Node]) -> tuple[ir.Value, list[int] | None]:
    """value.permute(perm) == inner.permute(combined) when value = Transpose(inner, p)."""
    node = producer(value, "Transpose")
    if node is None or not only_user(value) or attr(node, "perm") is None or _rank(value) != 4:
        return value, perm
    p = attr(node, "perm")
    nodes.append(node)
    return node.inputs[0], p if perm is None else [p[i] for i in perm]


def _quant(p: QParams, dtype: ir.DataType) -> list[float]:
    """[scale, zero point, qmin, qmax] of a per-tensor 8-bit quantization (E4M3FN: [s, 0, -448, 448])."""
    if dtype == FLOAT8:
        return [float(p.scale.reshape(())), float(p.zero_point.astype(np.float32).reshape(())), -FLOAT8_MAX,
                FLOAT8_MAX]
    info = np.iinfo(dtype.numpy())
    return [float(p.scale.reshape(())), float(p.zero_point.reshape(())), float(info.min), float(info.max)]


def _dequantized_input(value: ir.Value) -> tuple[ir.Node, ir.Value, list[float]] | None:
    """value = DQ(x8; s, z) per tensor, read only here: (the DQ, x8, [s, z])."""
    found = dequantized(value)
    if found is None or not only_user(value) or not found[1].per_tensor:
        return None
    dq, p = found
    if quantized_type(dq.inputs[0]) not in QUANT_TYPES:
        return None
    return dq, dq.inputs[0], _quant(p, quantized_type(dq.inputs[0]))[:2]


def _output_quantize(value: ir.Value) -> tuple[ir.Node, list[float]] | None:
    """The per-tensor 8-bit QuantizeLinear alone reading `value`: (it, [s, z, qmin, qmax])."""
    q = only_user(value)
    p = qparams(q) if is_op(q, "QuantizeLinear") and not value.is_graph_output() else None
    if p is None or not p.per_tensor or attr(q, "saturate", 1) != 1:
        return None
    dtype = ir.DataType.from_numpy(p.zero_point.dtype)
    return (q, _quant(p, dtype)) if dtype in QUANT_TYPES else None


def _fake_quant_after(value: ir.Value) -> tuple[list[ir.Node], ir.Value, list[float]] | None:
    """value -> Q(s, z) -> DQ(s, z), each read once: ([Q, DQ], the DQ's output, [s, z, qmin, qmax])."""
    found = _output_quantize(value)
    dq = only_user(found[0].outputs[0]) if found is not None else None
    if not is_op(dq, "DequantizeLinear") or dq.inputs[0] is not found[0].outputs[0]:
        return None
    inner = qparams(dq)
    if inner is None or not inner.same(qparams(found[0])) or found[0].outputs[0].is_graph_output():
        return None
    return [found[0], dq], dq.outputs[0], found[1]


def _fake_quant_before(value: ir.Value) -> tuple[list[ir.Node], ir.Value, list[float]] | None:
    """value = DQ(Q(x; s, z); s, z), each read once: ([Q, DQ], x, [s, z, qmin, qmax])."""
    q = producer(producer(value, "DequantizeLinear").inputs[0], "QuantizeLinear") \
        if producer(value, "DequantizeLinear") is not None else None
    found = _fake_quant_after(q.inputs[0]) if q is not None else None
    return (found[0], q.inputs[0], found[2]) if found is not None and found[1] is value else None


def _quantized_kinds(nodes: list[ir.Node]) -> set[bool]:
    """For each Q/DQ among `nodes`: whether it quantizes to E4M3 (True) or to 8-bit integers (False)."""
    kinds = set()
    for node in nodes:
        if is_op(node, "QuantizeLinear"):
            kinds.add(quantized_type(node.outputs[0]) == FLOAT8)
        elif is_op(node, "DequantizeLinear"):
            kinds.add(quantized_type(node.inputs[0]) == FLOAT8)
    return kinds


def _unrepeat_kv(value: ir.Value, nodes: list[ir.Node]) -> tuple[ir.Value, bool]:
    """Reshape(Expand(Unsqueeze(x, 2), [B, Hkv, r, T, D]), [B, Hkv·r, T, D]) -> (x, True)."""
    expand = producer(value, "Expand")
    if expand is None or not only_user(value) or _rank(value) != 5:
        return value, False
    unsqueeze = producer(expand.inputs[0], "Unsqueeze")
    if unsqueeze is None or not only_user(expand.inputs[0]):
        return value, False
    axes = const(unsqueeze.inputs[1]) if len(unsqueeze.inputs) > 1 else attr(unsqueeze, "axes")
    if axes is None or [int(a) for a in list(axes.reshape(-1) if hasattr(axes, "reshape") else axes)] not in ([2], [-3]):
        return value, False
    nodes += [expand, unsqueeze]
    return unsqueeze.inputs[0], True


def _repeated_kv_read_elsewhere(value: ir.Value, reader: ir.Node) -> ir.Value | None:
    """x where value = Reshape(Expand(Unsqueeze(x, 2), [B, Hkv, r, T, D]), [B, Hkv·r, T, D]) and the Reshape's output
    is read by `reader` and otherwise by Shape nodes alone (a dynamic export's torchlib Kᵀ takes its targets from
    it), else None.

    The chain is left in the graph (the Shape still reads it); once the attention is fused its targets are dead and
    the pipeline's dead-code pass removes the Shape and the chain with them. The shapes are checked: x is
    [B, Hkv, T, D] and value [B, Hkv·r, T, D]."""
    reshape = producer(value, "Reshape")
    if reshape is None or _rank(value) != 4 or _rank(reshape.inputs[0]) != 5:
        return None
    others = [user for user in consumers(value) if user is not reader]
    if value.is_graph_output() or not others or not all(is_op(user, "Shape") for user in others):
        return None
    source, gqa = _unrepeat_kv(reshape.inputs[0], [])
    if not gqa or _rank(source) != 4:
        return None
    x, repeated, out = source.shape, reshape.inputs[0].shape, value.shape
    if not (isinstance(x[1], int) and isinstance(repeated[2], int) and isinstance(out[1], int)):
        return None
    if out[1] != x[1] * repeated[2] or list(out[2:]) != list(x[2:]) or out[0] != x[0]:
        return None
    return source


def _key(kt: ir.Value, nodes: list[ir.Node]) -> tuple[ir.Value, list[int] | None, bool]:
    """From Kᵀ ([B, H, D, T]) back to K and the permutation that makes it [B, H, T, D]."""
    outer = producer(kt, "Reshape")
    if outer is not None and only_user(kt):  # torchlib: Reshape(Transpose(Reshape(K, [BH,T,D]), [0,2,1]), [B,H,D,T])
        tr = producer(outer.inputs[0], "Transpose")
        inner = producer(tr.inputs[0], "Reshape") if tr is not None and only_user(outer.inputs[0]) else None
        if inner is not None and attr(tr, "perm") == [0, 2, 1] and only_user(tr.inputs[0]):
            source = inner.inputs[0]
            taken: list[ir.Node] = [outer, tr, inner]
            if _rank(source) == 5:
                source, gqa = _unrepeat_kv(source, taken)
                if not gqa:
                    source = None
            elif (unrepeated := _repeated_kv_read_elsewhere(source, inner)) is not None:  # Reshape -> [B, H, T, D] first
                nodes += taken  # the repeat stays (its Shape reads it) until the dead-code pass; so do x's producers
                return unrepeated, None, True
            else:
                gqa = False
            if source is not None and _rank(source) == 4:
                nodes += taken
                k, perm = _absorb_transpose(source, None, nodes)
                return k, perm, gqa
    tr = producer(kt, "Transpose")
    if tr is not None and only_user(kt) and attr(tr, "perm") is not None and _rank(kt) == 4:
        p = attr(tr, "perm")
        nodes.append(tr)
        return tr.inputs[0], p[:2] + [p[3], p[2]], False
    return kt, [0, 1, 3, 2], False


def _value_input(v: ir.Value, nodes: list[ir.Node]) -> tuple[ir.Value, list[int] | None, bool]:
    gqa = False
    reshape = producer(v, "Reshape")
    if reshape is not None and only_user(v) and _rank(reshape.inputs[0]) == 5:
        taken: list[ir.Node] = [reshape]
        source, gqa = _unrepeat_kv(reshape.inputs[0], taken)
        if gqa:
            nodes += taken
            v = source
    v, perm = _absorb_transpose(v, None, nodes)
    return v, perm, gqa


@dataclass
class _AddMask:
    """An additive mask M, times the scale d applied after it: M·d (d = 1: M as is).

    `constant` is what the mask holds (its pre-broadcast form), computed off the graph;
    `build` adds what computes it. The rule calls `build` only once it has decided to fuse.
    """

    mask: ir.Value
    scale: float = 1.0

    def _scaled(self, m: np.ndarray) -> np.ndarray:
        return (m * np.asarray(self.scale, m.dtype)).astype(m.dtype)

    def _factor(self) -> np.ndarray:
        dtype = dtype_of(self.mask)
        return np.array(self.scale, dtype.numpy() if dtype else np.float32)

    def constant(self, graph: ir.Graph) -> np.ndarray | None:
        """The built mask's `broadcast_constant` (None: it depends on an input)."""
        if self.scale == 1.0:
            return broadcast_constant(self.mask)
        if (m := const(self.mask)) is not None:
            return self._scaled(m)
        m = broadcast_constant(self.mask, depth=1)  # one level below the Mul that `build` adds
        if m is None:
            return None
        return evaluate_on_constants("Mul", [m, self._factor()], dtype_of(self.mask), graph.opset_imports.get("", 21))

    def build(self, before: ir.Node) -> ir.Value:
        """M·d: M itself, a new constant, or a Mul node inserted before `before`."""
        if self.scale == 1.0:
            return self.mask
        graph = before.graph
        if (m := const(self.mask)) is not None:
            return new_initializer(graph, f"{self.mask.name}_scaled", self._scaled(m))
        factor = new_initializer(graph, f"{self.mask.name}_scale", self._factor())
        mul = ir.Node("", "Mul", [self.mask, factor], name=f"{before.name}_mask_scale")
        mul.outputs[0].type, mul.outputs[0].shape = self.mask.type, self.mask.shape
        graph.insert_before(before, mul)
        return mul.outputs[0]


@dataclass
class _WhereMask:
    """A boolean Where(C, scores, f) as the additive mask Where(C, 0, f), with f scaled already.

    `constant` and `build` as for `_AddMask`.
    """

    where: ir.Node
    fill: float
    dtype: ir.DataType  # the scores'

    def _filled(self, cond: np.ndarray) -> np.ndarray:
        return np.where(cond, 0, self.fill).astype(self.dtype.numpy())

    def _zero_and_fill(self) -> list[np.ndarray]:
        return [np.array(0, self.dtype.numpy()), np.array(self.fill, self.dtype.numpy())]

    def constant(self, graph: ir.Graph) -> np.ndarray | None:
        cond = self.where.inputs[0]
        if const(cond) is not None:
            return self._filled(const(cond))
        c = broadcast_constant(cond, depth=1)  # one level below the Where that `build` adds
        if c is None:
            return None
        return evaluate_on_constants("Where", [c, *self._zero_and_fill()], self.dtype, graph.opset_imports.get("", 21))

    def build(self, before: ir.Node) -> ir.Value:
        """Where(C, 0, f): a new constant when C is one, else a Where node inserted before `before`."""
        graph, cond, name = before.graph, self.where.inputs[0], self.where.name
        if const(cond) is not None:
            return new_initializer(graph, f"{name}_mask", self._filled(const(cond)))
        zero, fill = self._zero_and_fill()
        inputs = [cond, new_initializer(graph, f"{name}_zero", zero), new_initializer(graph, f"{name}_fill", fill)]
        mask = ir.Node("", "Where", inputs, name=f"{name}_mask")
        mask.outputs[0].type = ir.TensorType(self.dtype)
        graph.insert_before(before, mask)
        return mask.outputs[0]


def _is_causal(m: np.ndarray | None) -> bool:
    """True for a constant mask that is exactly the top-left lower triangle over its last two axes.

    The mask may be computed at full size at run time from constants (too large to fold: GPT-2 at
    batch 8, seq 512 materialises [8, 1, 512, 512]); its pre-broadcast form `m` decides.
    """
    if m is None or m.ndim < 2 or m.shape[-2] < 2 or m.shape[-1] < 2:
        return False  # a broadcast row/column is not the triangle of the real [S, T]
    keep = np.tril(np.ones(m.shape[-2:], dtype=bool))  # [S, T]: query i sees keys 0..i
    if m.dtype == np.bool_:
        return bool((m == keep).all())
    return bool(((m == 0) == keep).all() and (m[..., ~keep] <= MASKED).all())


def _where_mask(where: ir.Node, scores: ir.Value, scale: float) -> _WhereMask | None:
    """Where(C, scores, f)·scale with f ≤ -1e30 -> the additive mask Where(C, 0, f·scale), or None."""
    fill = const_scalar(where.inputs[2])
    dtype = dtype_of(scores)
    if where.inputs[1] is not scores or fill is None or fill > MASKED or dtype is None:
        return None
    fill = float(np.asarray(fill * scale, dtype.numpy())) if scale > 0 else fill  # stays ≤ -1e30 or -inf
    return _WhereMask(where, fill, dtype)


def fuse_attention(node: ir.Node, report: PassReport) -> bool:
    if not (is_op(node, "Softmax") or is_op(node, "Softmax", domain="kiln")):
        return False
    scores = node.inputs[0]
    rank = _rank(scores)
    if rank != 4 or attr(node, "axis", -1) not in (-1, 3):
        return False  # not attention-shaped; nothing to say
    nodes: list[ir.Node] = [node]
    probs = node.outputs[0]
    # Output side: [Where(IsNaN(P), 0, P)] -> MatMul(P, V)
    nan_to_zero = 0
    users = consumers(probs)
    if len(users) == 2 and not probs.is_graph_output():
        isnan = next((n for n in users if is_op(n, "IsNaN")), None)
        where = next((n for n in users if is_op(n, "Where")), None)
        if isnan and where and where.inputs[0] is isnan.outputs[0] and where.inputs[2] is probs \
                and const_scalar(where.inputs[1]) == 0.0 and only_user(isnan.outputs[0]):
            nodes += [isnan, where]
            probs, nan_to_zero = where.outputs[0], 1
    quant: dict[str, list[float]] = {}
    if (found := _fake_quant_after(probs)) is not None:  # P -> Q -> DQ: the probabilities quantized
        nodes += found[0]
        probs, quant["prob_quant"] = found[1], found[2]
    pv = only_user(probs)
    if not is_op(pv, "MatMul") or pv.inputs[0] is not probs:
        report.refuse(RULE, node, "the softmax output does not feed exactly one MatMul with V")
        return False
    nodes.append(pv)
    # Input side: MatMul(Q·a, Kᵀ·b) [·c] [+ M]
    if not only_user(scores):
        report.refuse(RULE, node, "the attention scores are read by more than the Softmax")
        return False
    scores, outer_scale = _strip_scale(scores, nodes)  # a scale applied after the mask
    mask: _AddMask | _WhereMask | None = None
    add = producer(scores, "Add") if only_user(scores) else None
    where = producer(scores, "Where") if only_user(scores) else None
    if where is not None:
        inner, _ = _strip_scale(where.inputs[1], [])
        if not is_op(producer(inner), "MatMul") or not only_user(where.inputs[1]):
            report.refuse(RULE, node, "the Where before Softmax does not select from Q·Kᵀ")
            return False
        mask = _where_mask(where, where.inputs[1], outer_scale)  # the fill is scaled already
        if mask is None:
            report.refuse(RULE, node, "the Where before Softmax fills with a value above -1e30, not a mask")
            return False
        nodes.append(where)
        scores = where.inputs[1]
    elif add is not None:
        for candidate in add.inputs:
            inner, _ = _strip_scale(candidate, [])
            if (found := _fake_quant_before(inner)) is not None:  # the scores quantized before the mask
                inner, _ = _strip_scale(found[1], [])
            if is_op(producer(inner), "MatMul") and only_user(candidate):
                mask = _AddMask(other_input(add, candidate), outer_scale)
                nodes.append(add)
                scores = candidate
                break
        else:
            report.refuse(RULE, node, "the Add before Softmax has no Q·Kᵀ operand")
            return False
    if (found := _fake_quant_before(scores)) is not None and only_user(scores):  # MatMul [·c] -> Q -> DQ
        if outer_scale != 1.0 or producer(scores) is not found[0][1]:
            report.refuse(RULE, node, "a scale between the quantized scores and the Softmax")
            return False
        nodes += found[0]
        scores, quant["score_quant"] = found[1], found[2]
    scores, scale = _strip_scale(scores, nodes)
    scale *= outer_scale
    qk = producer(scores, "MatMul")
    if qk is None or not only_user(scores):
        report.refuse(RULE, node, "the Softmax input is not a (scaled) MatMul of Q and Kᵀ")
        return False
    nodes.append(qk)
    q, q_scale = _strip_scale(qk.inputs[0], nodes)
    kt, k_scale = _strip_scale(qk.inputs[1], nodes)
    if _rank(q) != 4 or _rank(kt) != 4 or _rank(pv.inputs[1]) not in (4, None):
        report.refuse(RULE, node, "Q, Kᵀ and V are not all 4-D [B, H, S, D]")
        return False
    v = pv.inputs[1]
    inputs_8bit = [_dequantized_input(x) for x in (q, kt, v)]
    if all(inputs_8bit):  # DQ(q8), DQ(k8ᵀ), DQ(v8): the kernel reads the 8-bit tensors (through their transposes)
        for name, (dq, x8, params) in zip(("q_quant", "k_quant", "v_quant"), inputs_8bit):
            nodes.append(dq)
            quant[name] = params
        (_, q, _), (_, kt, _), (_, v, _) = inputs_8bit
    k, k_perm, k_gqa = _key(kt, nodes)
    v, v_perm, v_gqa = _value_input(v, nodes)
    if k_gqa != v_gqa:
        report.refuse(RULE, node, "K is repeated for grouped-query attention but V is not (or the reverse)")
        return False
    q, q_perm = _absorb_transpose(q, None, nodes)
    out, out_perm = pv.outputs[0], None
    if "q_quant" in quant and (found := _output_quantize(out)) is not None:  # written 8-bit, as QLinearMatMul's
        nodes.append(found[0])
        out, quant["out_quant"] = found[0].outputs[0], found[1]
    tr = only_user(out)
    if is_op(tr, "Transpose") and attr(tr, "perm") is not None:
        nodes.append(tr)
        out, out_perm = tr.outputs[0], attr(tr, "perm")
    kinds = _quantized_kinds(nodes)
    if len(kinds) > 1:
        report.refuse(RULE, node, "its Q/DQ mix 8-bit integers and float8: the kernel takes one kind")
        return False
    causal = mask is not None and _is_causal(mask.constant(node.graph))
    if causal:
        mask, nan_to_zero = None, 0
    # Decided: from here on the graph changes.
    attrs = [ir.AttrFloat32("scale", scale * q_scale * k_scale),
             ir.AttrInt64("gqa", int(k_gqa)), ir.AttrInt64("nan_to_zero", nan_to_zero)]
    if causal:
        attrs.append(ir.AttrInt64("is_causal", 1))
    for name, perm in (("q_perm", q_perm), ("k_perm", k_perm), ("v_perm", v_perm), ("out_perm", out_perm)):
        if perm is not None and perm != [0, 1, 2, 3]:
            attrs.append(ir.AttrInt64s(name, perm))
    attrs += [ir.AttrFloat32s(name, values) for name, values in quant.items()]
    if quant and kinds == {True}:
        attrs.append(ir.AttrInt64("float8_quant", 1))
    inputs = [q, k, v] + ([mask.build(node)] if mask is not None else [])
    fused = ir.Node(KILN_DOMAIN, "Attention", inputs, attrs, name=pv.name)
    replace_with(nodes, fused, out)
    return True
