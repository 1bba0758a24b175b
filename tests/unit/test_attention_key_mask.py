"""attention_key_mask (kiln/passes/fusion/attention_key_mask.py): a computed mask proved alike for every query
becomes its [B, 1, 1, T] key mask. Structural: the rule fires on the exporter's padding grid (BERT, DistilBERT,
RoBERTa, ALBERT, T5's cross-attention) and leaves causal, shifted, query-gathered and relative-position masks
alone; numerical: outputs equal onnxruntime's on the unoptimized model at several shapes, padded rows and
fully padded rows included."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import kiln
from kiln import zoo
from kiln.frontend import onnx as onnx_frontend
from kiln.passes import PassOptions, fusion, optimize
from kiln.passes._rewrite import PassReport
from kiln.passes.fusion.attention_key_mask import QueryFree

RULE = "attention_key_mask"
# fp32 attention and GEMMs against onnxruntime's: summation order only (the CPU kernel stops at a row's last real
# key once the mask is a key mask: the hidden keys' exp is exactly 0, only the sums' vector/tail split moves)
RTOL, ATOL = 1e-4, 1e-5


def _optimized(proto: onnx.ModelProto):
    report = PassReport()
    model = optimize(onnx_frontend.load(proto), PassOptions(opt_level=2), report)
    ops = collections.Counter(n.op_type for n in model.graph)
    masks = [n.inputs[3] if len(n.inputs) > 3 else None for n in model.graph if n.op_type == "Attention"]
    return model, report, ops, masks


def _padding(rng, batch: int, seq: int, empty_row: bool = False) -> np.ndarray:
    """Right padding of random lengths 1..seq per row (row 0 unpadded); `empty_row`: the last row all padding."""
    mask = np.ones((batch, seq), np.int64)
    for row in range(1, batch):
        mask[row, rng.integers(1, seq + 1):] = 0
    if empty_row:
        mask[-1] = 0
    return mask


def _compare(proto: onnx.ModelProto, engine, feeds: dict, rtol=RTOL, atol=ATOL, without_rule=None) -> None:
    """kiln's outputs against onnxruntime's on the unoptimized model, over the batch rows with a real token: where
    every key is hidden onnxruntime's softmax gives NaN and kiln's attention 0 (torch SDPA's convention, with or
    without this rule). Those rows are compared with `without_rule`, the engine built without it, NaN for NaN."""
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    want = session.run(None, feeds)
    got = engine.run(feeds)
    real = feeds["attention_mask"].any(axis=1)
    shapes = [list(v.shape) for v in feeds.values()]
    for out, expected in zip(proto.graph.output, want):
        np.testing.assert_allclose(np.asarray(got[out.name])[real], expected[real], rtol=rtol, atol=atol,
                                   err_msg=f"{out.name} at {shapes}")
    if without_rule is not None and not real.all():
        plain = without_rule.run(feeds)
        for out in proto.graph.output:
            np.testing.assert_allclose(np.asarray(got[out.name]), np.asarray(plain[out.name]), rtol=rtol, atol=atol,
                                       equal_nan=True, err_msg=f"{out.name} at {shapes}, against kiln without {RULE}")


def _build_without_rule(proto: onnx.ModelProto, monkeypatch, **options):
    with monkeypatch.context() as patch:
        patch.setattr(fusion, "RULES", [(name, rule) for name, rule in fusion.RULES if name != RULE])
        return kiln.build(proto, **options)


# ---------------------------------------------------------------- exported transformers models


PROFILE = [{"input_ids": "1x1,2x16,4x48"}]


@pytest.fixture(scope="module")
def bert():
    exported = zoo.export("bert_tiny", dynamic=True)
    proto = onnx.load(str(exported.path))
    with pytest.MonkeyPatch.context() as patch:
        without = _build_without_rule(proto, patch, profiles=PROFILE)
    return proto, kiln.build(proto, profiles=PROFILE), without


def test_exported_bert_mask_becomes_a_key_mask(bert):
    proto, _, _ = bert
    before = collections.Counter(n.op_type for n in proto.graph.node)
    assert before["GatherND"] == 1 and before["Range"] >= 2  # the exporter's index grids, there to be removed
    model, report, ops, masks = _optimized(proto)
    assert report.fired[RULE] == 1  # one mask, shared by both layers
    assert len(masks) == 2 and masks[0] is masks[1]
    assert [str(d) for d in masks[0].shape] == ["batch", "1", "1", "seq"]
    # Reshape(Where(Cast(attention_mask), 0, -inf), [0, 1, 1, -1]): the grids, the q_idx >= 0 term and the Ands gone,
    # the Where on [B, S] and a Reshape (an alias in the CPU's native segments) making it [B, 1, 1, S]
    assert not {"GatherND", "Range", "Max", "Expand", "Concat", "And", "GreaterOrEqual", "Unsqueeze"} & set(ops), ops
    reshape = masks[0].producer()
    assert reshape.op_type == "Reshape" and reshape.inputs[1].const_value.numpy().tolist() == [0, 1, 1, -1]
    where = reshape.inputs[0].producer()
    cast = where.inputs[0].producer()
    assert where.op_type == "Where" and cast.op_type == "Cast" and cast.inputs[0].name == "attention_mask"
    assert [str(d) for d in where.outputs[0].shape] == ["batch", "seq"]


@pytest.mark.parametrize("batch,seq,empty_row", [(1, 8, False), (3, 16, False), (4, 33, True), (2, 1, False),
                                                 (4, 48, True)])
def test_exported_bert_matches_onnxruntime(bert, batch, seq, empty_row):
    proto, engine, without = bert
    rng = np.random.default_rng(batch * 100 + seq)
    feeds = {"input_ids": rng.integers(0, 1024, (batch, seq), dtype=np.int64),
             "attention_mask": _padding(rng, batch, seq, empty_row)}
    _compare(proto, engine, feeds, without_rule=without)


@pytest.mark.parametrize("name,fired,key_masks,others", [
    ("distilbert_tiny", 1, 2, 0), ("roberta_tiny", 1, 2, 0), ("albert_tiny", 1, 4, 0),
    ("t5_tiny", 1, 2, 4),  # the cross-attention's padding mask; self-attention adds a relative-position bias
])
def test_exported_encoders_counts(name, fired, key_masks, others):
    proto = onnx.load(str(zoo.export(name, batch=2, seq=16, dynamic=True).path))
    _, report, _, masks = _optimized(proto)
    assert report.fired.get(RULE, 0) == fired
    shapes = [[str(d) for d in m.shape] for m in masks if m is not None]
    assert sum(s[-2] == "1" for s in shapes) == key_masks and sum(s[-2] != "1" for s in shapes) == others, shapes
    refused = [r for r in report.refused if r.startswith(RULE)]
    assert bool(refused) == bool(others) and all("query axis" in r for r in refused), refused


def test_exported_t5_matches_onnxruntime():
    exported = zoo.export("t5_tiny", batch=2, seq=16, dynamic=True)
    proto = onnx.load(str(exported.path))
    engine = kiln.build(proto, profiles=[{"input_ids": "1x1,2x16,3x24"}])
    rng = np.random.default_rng(7)
    for batch, seq in ((3, 11), (2, 24)):
        feeds = {"input_ids": rng.integers(0, 100, (batch, seq), dtype=np.int64),
                 "attention_mask": _padding(rng, batch, seq),
                 "decoder_input_ids": rng.integers(0, 100, (batch, seq), dtype=np.int64)}
        _compare(proto, engine, feeds, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- the exporter's mask, written out by hand


H, D = 2, 8
F, I64, BOOL = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL


def _c(name: str, value, dtype=np.int64) -> onnx.TensorProto:
    return onnx.numpy_helper.from_array(np.asarray(value, dtype), name)


def _masked_attention(kind: str) -> onnx.ModelProto:
    """softmax(q·kᵀ/√D + mask)·v, the mask built from attention_mask [B, S] as transformers' sdpa_mask exports it:
    Where(And(And(True, q_idx >= 0), padding[b_idx, kv_idx]), 0, -inf), with `kind` changing one term:
    "padding" (as exported), "causal" (And kv_idx <= q_idx), "shifted" (Or q_idx - 1 >= 0: query 0 sees its real keys,
    the others every key),
    "query_gather" (padding[b_idx, q_idx]: the mask varies by query), "expand" (the 4.4x form: Expand of
    attention_mask[:, None, None, :] to [B, 1, S, S], (1 - m)·min), "uniform" (q_idx >= 0 alone: hides nothing)."""
    n = helper.make_node
    nodes = [
        n("Shape", ["attention_mask"], ["b_shape"], start=0, end=1),
        n("Shape", ["attention_mask"], ["s_shape"], start=1, end=2),
        n("Squeeze", ["b_shape", "zero_axis"], ["b_n"]), n("Squeeze", ["s_shape", "zero_axis"], ["s_n"]),
        n("Range", ["zero", "b_n", "one"], ["b_idx"]), n("Range", ["zero", "s_n", "one"], ["s_idx"]),
        n("Unsqueeze", ["b_idx", "axes_123"], ["b4"]),    # [B, 1, 1, 1]
        n("Unsqueeze", ["s_idx", "axes_013"], ["q4"]),    # [1, 1, S, 1]
        n("Unsqueeze", ["s_idx", "axes_012"], ["kv4"]),   # [1, 1, 1, S]
        n("Cast", ["attention_mask"], ["m_bool"], to=BOOL),
    ]
    nodes += [n("GreaterOrEqual", ["q4", "zero"], ["ge"])]
    nodes += [n("And", ["true", "ge"], ["ones"])]
    key = "q4" if kind == "query_gather" else "kv4"
    nodes += [
        n("Max", ["b4", key], ["grid_like"]), n("Shape", ["grid_like"], ["grid_shape"]),
        n("Expand", ["b4", "grid_shape"], ["bg"]), n("Expand", [key, "grid_shape"], ["kg"]),
        n("Unsqueeze", ["bg", "last"], ["bg1"]), n("Unsqueeze", ["kg", "last"], ["kg1"]),
        n("Concat", ["bg1", "kg1"], ["grid"], axis=-1),
        n("GatherND", ["m_bool", "grid"], ["keys"]),
        n("And", ["ones", "keys"], ["allowed0"]),
    ]
    if kind == "causal":
        nodes += [n("LessOrEqual", ["kv4", "q4"], ["tri"]), n("And", ["allowed0", "tri"], ["allowed"])]
    elif kind == "uniform":
        nodes += [n("Identity", ["ones"], ["allowed"])]
    elif kind == "shifted":
        nodes += [n("Sub", ["q4", "one"], ["q_shift"]), n("GreaterOrEqual", ["q_shift", "zero"], ["later"]),
                  n("Or", ["allowed0", "later"], ["allowed"])]
    else:
        nodes += [n("Identity", ["allowed0"], ["allowed"])]
    if kind == "expand":
        nodes = nodes[:4] + [
            n("Unsqueeze", ["attention_mask", "axes_12"], ["m4"]),  # [B, 1, 1, S]
            n("Concat", ["b_shape", "one_1", "s_shape", "s_shape"], ["full"], axis=0),
            n("Expand", ["m4", "full"], ["m_full"]), n("Cast", ["m_full"], ["m_float"], to=F),
            n("Sub", ["one_f", "m_float"], ["inverted"]), n("Cast", ["inverted"], ["hidden"], to=BOOL),
            n("Where", ["hidden", "min_f", "inverted"], ["mask"]),
        ]
    else:
        nodes += [n("Where", ["allowed", "zero_f", "minus_inf"], ["mask"])]
    if kind == "bool":  # a fused attention handed the boolean mask itself
        nodes = [x for x in nodes if x.output[0] != "mask"]
        nodes.append(n("Attention", ["q", "k", "v", "allowed"], ["out"], domain="kiln", scale=float(D ** -0.5)))
    else:
        nodes += [
            n("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]), n("MatMul", ["q", "kt"], ["qk"]),
            n("Mul", ["qk", "scale"], ["scores0"]), n("Add", ["scores0", "mask"], ["scores"]),
            n("Softmax", ["scores"], ["p"], axis=-1), n("MatMul", ["p", "v"], ["out"]),
        ]
    inits = [_c("zero", 0), _c("one", 1), _c("zero_axis", [0]), _c("axes_123", [1, 2, 3]), _c("axes_013", [0, 1, 3]),
             _c("axes_012", [0, 1, 2]), _c("axes_12", [1, 2]), _c("last", [-1]), _c("one_1", [1]),
             _c("true", True, np.bool_), _c("zero_f", 0.0, np.float32), _c("minus_inf", -np.inf, np.float32),
             _c("one_f", 1.0, np.float32), _c("min_f", np.finfo(np.float32).min, np.float32),
             _c("scale", 1 / np.sqrt(D), np.float32)]
    qkv = [helper.make_tensor_value_info(x, F, ["batch", H, "seq", D]) for x in "qkv"]
    inputs = [*qkv, helper.make_tensor_value_info("attention_mask", I64, ["batch", "seq"])]
    graph = helper.make_graph(nodes, kind, inputs,
                              [helper.make_tensor_value_info("out", F, ["batch", H, "seq", D])], inits)
    opsets = [helper.make_opsetid("", 18)] + ([helper.make_opsetid("kiln", 1)] if kind == "bool" else [])
    return helper.make_model(graph, opset_imports=opsets)  # shapes: kiln's frontend infers


def _feeds(rng, batch: int, seq: int, empty_row: bool = False) -> dict:
    feeds = {x: rng.standard_normal((batch, H, seq, D)).astype(np.float32) for x in "qkv"}
    feeds["attention_mask"] = _padding(rng, batch, seq, empty_row)
    return feeds


@pytest.mark.parametrize("kind,fires", [("padding", True), ("expand", True), ("causal", False), ("shifted", False),
                                        ("query_gather", False)])
def test_written_out_masks(kind, fires, monkeypatch):
    proto = _masked_attention(kind)
    _, report, ops, masks = _optimized(proto)
    assert report.fired.get("fuse_attention") == 1 and len(masks) == 1
    assert report.fired.get(RULE, 0) == int(fires)
    shape = [str(d) for d in masks[0].shape]
    if fires:
        assert shape == ["batch", "1", "1", "seq"], shape
        assert not {"GatherND", "Range", "Expand"} & set(ops), ops
    else:
        assert shape[-2] != "1", shape
        assert any(r.startswith(RULE) and "query axis" in r for r in report.refused), report.refused
    profile = [{"q": f"1x{H}x1x{D},2x{H}x16x{D},4x{H}x40x{D}"}]
    engine = kiln.build(proto, profiles=profile)
    without = _build_without_rule(proto, monkeypatch, profiles=profile) if fires else None
    rng = np.random.default_rng(len(kind))
    for batch, seq, empty_row in ((1, 5, False), (3, 16, True), (4, 37, False), (2, 1, False)):
        _compare(proto, engine, _feeds(rng, batch, seq, empty_row), rtol=1e-5, atol=1e-6, without_rule=without)


def test_boolean_key_mask_unsqueezes_the_input(monkeypatch):
    # a bool mask has no float32 Reshape alias: Cast(Unsqueeze(attention_mask)), the Unsqueeze on the graph input
    # ahead of every layer; the same outputs as the engine without the rule (onnxruntime has no kiln::Attention)
    proto = _masked_attention("bool")
    model, report, ops, masks = _optimized(proto)
    assert report.fired[RULE] == 1 and not {"GatherND", "Range", "Expand", "And"} & set(ops), ops
    cast = masks[0].producer()
    assert cast.op_type == "Cast" and [str(d) for d in masks[0].shape] == ["batch", "1", "1", "seq"]
    unsqueeze = cast.inputs[0].producer()
    assert unsqueeze.op_type == "Unsqueeze" and unsqueeze.inputs[0].name == "attention_mask"
    assert list(model.graph).index(unsqueeze) == 0
    profile = [{"q": f"1x{H}x1x{D},2x{H}x16x{D},4x{H}x40x{D}"}]
    engine, without = kiln.build(proto, profiles=profile), _build_without_rule(proto, monkeypatch, profiles=profile)
    rng = np.random.default_rng(11)
    for batch, seq in ((1, 5), (3, 16), (4, 37)):
        feeds = _feeds(rng, batch, seq)
        np.testing.assert_allclose(engine.run(feeds)["out"], without.run(feeds)["out"], rtol=1e-5, atol=1e-6)


def test_uniform_mask_is_dropped():
    # q_idx >= 0 alone, from Range(0, S, 1): all True at every S, proved from the bounds: no mask at all
    proto = _masked_attention("uniform")
    _, report, ops, masks = _optimized(proto)
    assert report.fired[RULE] == 1 and report.fired["drop_empty_attention_mask"] == 1
    assert masks == [None] and "Range" not in ops
    engine = kiln.build(proto, profiles=[{"q": f"1x{H}x1x{D},2x{H}x16x{D},4x{H}x40x{D}"}])
    _compare(proto, engine, _feeds(np.random.default_rng(3), 2, 9), rtol=1e-5, atol=1e-6)


def test_per_query_mask_input_left_alone():
    # the graph's own [B, 1, S, S] mask input: nothing computed, nothing to prove
    n = helper.make_node
    nodes = [n("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]), n("MatMul", ["q", "kt"], ["qk"]),
             n("Add", ["qk", "mask"], ["scores"]), n("Softmax", ["scores"], ["p"], axis=-1),
             n("MatMul", ["p", "v"], ["out"])]
    inputs = [helper.make_tensor_value_info(x, F, ["batch", H, "seq", D]) for x in "qkv"]
    inputs.append(helper.make_tensor_value_info("mask", F, ["batch", 1, "seq", "seq"]))
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("out", F, ["batch", H, "seq", D])])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    _, report, _, masks = _optimized(proto)
    assert report.fired.get(RULE, 0) == 0 and masks[0].name == "mask"


# ---------------------------------------------------------------- the proof's pieces, on small graphs


def _values(nodes: list, inits: list) -> dict:
    """The kiln IR values of a graph over x [batch, seq] (float), by name."""
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, ["batch", "seq"])],
                              [helper.make_tensor_value_info(nodes[-1].output[0], TensorProto.UNDEFINED, None)], inits)
    model = onnx_frontend.load(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    return {v.name: v for n in model.graph for v in n.outputs}


def _aranges(start: int, delta: int = 1) -> tuple[list, list]:
    """r = Range(start, start + seq·delta, delta): start, start + delta, ..., seq of them (Range(0, seq, 1) as the
    exporter writes it for start 0, delta 1)."""
    n = helper.make_node
    nodes = [n("Shape", ["x"], ["s_shape"], start=1, end=2), n("Squeeze", ["s_shape", "zero_axis"], ["s_n"])]
    if (start, delta) == (0, 1):
        nodes.append(n("Range", ["start", "s_n", "delta"], ["r"]))
    else:
        nodes += [n("Mul", ["s_n", "delta"], ["length"]), n("Add", ["length", "start"], ["limit"]),
                  n("Range", ["start", "limit", "delta"], ["r"])]
    return nodes, [_c("zero_axis", [0]), _c("start", start), _c("delta", delta)]


@pytest.mark.parametrize("start,delta,op,than,decided", [
    (0, 1, "GreaterOrEqual", 0, True), (0, 1, "Less", 0, False), (0, 1, "Greater", 0, None),
    (1, 1, "Greater", 0, True), (1, 1, "GreaterOrEqual", 2, None), (-1, 1, "GreaterOrEqual", 0, None),
    (-3, 1, "Less", -3, False), (5, -1, "LessOrEqual", 5, True), (5, -1, "Less", 5, None),
    (1, 1, "LessOrEqual", 1, None), (2, 1, "LessOrEqual", 1, False), (0, 1, "Equal", -1, None),
])
def test_comparisons_decided_from_bounds(start, delta, op, than, decided):
    # Range(start, start + seq·delta, delta) OP than: all True / all False where the bounds decide it, else undecided
    nodes, inits = _aranges(start, delta)
    nodes.append(helper.make_node(op, ["r", "than"], ["out"]))
    values = _values(nodes, inits + [_c("than", than)])
    found = QueryFree(18).uniform(values["out"])
    assert (None if found is None else bool(found)) == decided


def test_sums_that_may_wrap_have_no_bounds():
    nodes, inits = _aranges(0)
    nodes += [helper.make_node("Add", ["r", "big"], ["near_max"]), helper.make_node("Sub", ["r", "one"], ["shifted"])]
    values = _values(nodes, inits + [_c("big", np.iinfo(np.int64).max - 5), _c("one", 1)])
    proof = QueryFree(18)
    assert proof.bounds(values["r"]) == (0, 2 ** 62 - 1)  # Range(0, a dim, 1): a dim is below 2^62
    assert proof.bounds(values["near_max"]) == (None, None)  # up to 2^62 + 2^63 - 6: the sum could wrap
    assert proof.bounds(values["shifted"]) == (-1, 2 ** 62 - 2)


@pytest.mark.parametrize("axes,expand_by,axis", [
    ([0, 1, 2], None, 3), ([1, 2, 3], None, 0), ([0, 2], None, 1), ([0, 1, 3], None, 2),
    ([[1], [0]], None, 1),    # Unsqueeze(Unsqueeze(r, [1]), [0]): [S, 1] then [1, S, 1]
    ([0, 1, 2], "rows", 3),   # [1, 1, 1, S] expanded by [S, 1, 1]'s shape: other axes, the arange stays on axis 3
    ([0, 1, 3], "rows", 2),   # [1, 1, S, 1] by [S, 1, 1] -> [1, S, S, 1]: axis 2 keeps its S
    ([0, 1, 2], "batch", None),  # [1, 1, 1, S] by an arange of batch on axis 3: S may be 1 and broadcast
])
def test_arange_axes(axes, expand_by, axis):
    n = helper.make_node
    nodes, inits = _aranges(0)
    if isinstance(axes[0], list):
        nodes += [n("Unsqueeze", ["r", "axes"], ["u0"]), n("Unsqueeze", ["u0", "axes2"], ["u"])]
        inits += [_c("axes", axes[0]), _c("axes2", axes[1])]
    else:
        nodes.append(n("Unsqueeze", ["r", "axes"], ["u"]))
        inits.append(_c("axes", axes))
    inits.append(_c("other_axes", [1, 2] if expand_by == "rows" else [0, 1, 2]))
    out = "u"
    if expand_by:
        if expand_by == "batch":
            nodes += [n("Shape", ["x"], ["b_shape"], start=0, end=1), n("Squeeze", ["b_shape", "zero_axis"], ["b_n"]),
                      n("Range", ["start", "b_n", "delta"], ["b"])]
        nodes += [n("Unsqueeze", ["b" if expand_by == "batch" else "r", "other_axes"], ["other"]),
                  n("Max", ["u", "other"], ["like"]), n("Shape", ["like"], ["to"]), n("Expand", ["u", "to"], ["e"])]
        out = "e"
    found = QueryFree(18).iota(_values(nodes, inits)[out])
    assert (None if found is None else found.axis) == axis
    if found is not None:
        assert str(found.length) == "seq"  # Range(0, Shape(x)[1], 1): as long as x's axis 1


@pytest.mark.parametrize("data,rows", [("x", True), ("wide", False), ("x_t", False), ("square", False)])
def test_gather_over_an_arange_grid_is_its_data(data, rows):
    # GatherND(data, [b_idx, kv_idx] over [B, 1, 1, S]) = Unsqueeze(data, [1, 2]) only where the aranges span data's
    # axes: not for data of 2·S columns (the grid reads its first S), nor for data [S, B] (the grid would transpose),
    # nor for data [S, S] read as [kv_idx, q_idx] (a transposed gather)
    n = helper.make_node
    square = data == "square"
    nodes = [n("Shape", ["x"], ["b_shape"], start=0, end=1), n("Shape", ["x"], ["s_shape"], start=1, end=2),
             n("Squeeze", ["b_shape", "zero_axis"], ["b_n"]), n("Squeeze", ["s_shape", "zero_axis"], ["s_n"]),
             n("Range", ["zero", "b_n", "one"], ["b_idx"]), n("Range", ["zero", "s_n", "one"], ["s_idx"]),
             n("Unsqueeze", ["s_idx" if square else "b_idx", "axes_123" if not square else "axes_013"], ["b4"]),
             n("Unsqueeze", ["s_idx", "axes_012"], ["kv4"]),
             n("Max", ["b4", "kv4"], ["like"]), n("Shape", ["like"], ["to"]),
             n("Expand", ["b4", "to"], ["bg"]), n("Expand", ["kv4", "to"], ["kg"]),
             n("Unsqueeze", ["bg", "last"], ["bg1"]), n("Unsqueeze", ["kg", "last"], ["kg1"]),
             n("Concat", ["kg1", "bg1"] if square else ["bg1", "kg1"], ["grid"], axis=-1),
             n("Transpose", ["x"], ["xt"], perm=[1, 0]), n("MatMul", ["xt", "x"], ["square"]),
             n("Concat", ["x", "x"], ["wide"], axis=1), n("Transpose", ["x"], ["x_t"], perm=[1, 0]),
             n("GatherND", [data, "grid"], ["keys"])]
    inits = [_c("zero", 0), _c("one", 1), _c("zero_axis", [0]), _c("axes_123", [1, 2, 3]), _c("axes_012", [0, 1, 2]),
             _c("axes_013", [0, 1, 3]), _c("last", [-1])]
    keys = _values(nodes, inits)["keys"]
    found = QueryFree(18)._rows(keys.producer())
    assert (found is not None) == rows
    if rows:
        assert found.axes == [1, 2] and [str(d) for d in found.shape] == ["batch", "1", "1", "seq"]
