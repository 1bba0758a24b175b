"""kiln/runtime/shape_corners.py: which shape-only tensors are the top-left corner of themselves at larger input dims,
and CornerCut, which serves them from the value at the largest dims met.

Oracle: onnx.reference runs each small graph (an input x of [b, s] read only for its shape) at several pairs of dims
d <= D drawn fresh: a tensor the analysis proves a corner must have the extents it names at d and equal
V(D)[:e_0(d), ...]; a refused graph that is no corner has a pair that shows it (the refusal was needed).
"""

from __future__ import annotations

import zlib

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from kiln.ops.registry import OpContext
from kiln.runtime import shape_corners
from kiln.runtime.shape_corners import Affine, CornerCut, corners
from kiln.runtime.step import BoundStep

I64, F = TensorProto.INT64, TensorProto.FLOAT
BIG = (1 << 63) - 1


def _node(op, inputs, output, **attrs):
    return helper.make_node(op, inputs, [output], name=output, **attrs)


def _i(name, *values):
    return numpy_helper.from_array(np.array(values, np.int64), name)


def _scalar(name, value, dtype=np.int64):
    return numpy_helper.from_array(np.array(value, dtype), name)


# the positions 0 .. s-1 and 0 .. b-1 and the batch-expanded positions [b, s] (an exported decoder's start)
_POSITIONS = [
    _node("Shape", ["x"], "b1", start=0, end=1), _node("Shape", ["x"], "s1", start=1, end=2),
    _node("Squeeze", ["b1", "zero_axis"], "b"), _node("Squeeze", ["s1", "zero_axis"], "s"),
    _node("Range", ["zero", "s", "one"], "pos"), _node("Range", ["zero", "b", "one"], "bpos"),
    _node("Unsqueeze", ["pos", "zero_axis"], "pos_row"),  # [1, s]
    _node("Concat", ["b1", "one_1d"], "b_by_1", axis=0),
    _node("Expand", ["pos_row", "b_by_1"], "pos_bs"),  # [b, s]
]
_CONSTANTS = [_scalar("zero", 0), _scalar("one", 1), _i("zero_axis", 0), _i("one_1d", 1), _i("last_axis", -1),
              _scalar("last", -1), _scalar("zero_f", 0.0, np.float32), _scalar("low_f", -3.0e38, np.float32)]

# the exported packed-sequence mask's chain (transformers' causal mask: bench/results/first-shape-2026-12-06.md)
_PACKED = [
    _node("Slice", ["pos_bs", "zero_1d", "one_1d", "one_1d"], "first"),  # [b, 1]
    _node("Sub", ["first", "one"], "before"),
    _node("Concat", ["before", "pos_bs"], "shifted", axis=-1),  # [b, s + 1]
    _node("Slice", ["shifted", "zero_1d", "s1", "last_axis"], "prev"),  # [b, s]
    _node("Add", ["s", "one"], "s_plus"), _node("Reshape", ["s_plus", "minus_1d"], "s_plus_1d"),
    _node("Slice", ["shifted", "one_1d", "s_plus_1d", "last_axis", "one_1d"], "cur"),  # [b, s]
    _node("Sub", ["cur", "prev"], "jump"), _node("Equal", ["jump", "one"], "steady"), _node("Not", ["steady"], "new"),
    _node("Cast", ["new"], "new_i", to=I64), _node("CumSum", ["new_i", "last"], "group"),
]


def _grid(data: str, out: str) -> list:
    """GatherND(data [b, s], the [b, s, s, 2] grid of (batch, query position)) -> [b, s, s] (as the export makes it)."""
    return [
        _node("Unsqueeze", ["bpos", "axes_12"], "bq"),  # [b, 1, 1]
        _node("Unsqueeze", ["pos", "axes_02"], "sq"),  # [1, s, 1]
        _node("Unsqueeze", ["pos", "axes_01"], "sk"),  # [1, 1, s]
        _node("Max", ["bq", "sq", "sk"], "grid_like"), _node("Shape", ["grid_like"], "grid_shape"),
        _node("Expand", ["bq", "grid_shape"], "g0"), _node("Unsqueeze", ["g0", "last_axis"], "g0u"),
        _node("Expand", ["sq", "grid_shape"], "g1"), _node("Unsqueeze", ["g1", "last_axis"], "g1u"),
        _node("Concat", ["g0u", "g1u"], "grid", axis=-1),
        _node("GatherND", [data, "grid"], out),
    ]


_GRID_CONSTANTS = [_i("axes_12", 1, 2), _i("axes_02", 0, 2), _i("axes_01", 0, 1), _i("zero_1d", 0), _i("minus_1d", -1)]


def _graph(nodes: list, output: str, dtype=I64, extra=()) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", I64, ["b", "s"])],
        [helper.make_tensor_value_info(output, dtype, None)], [*_CONSTANTS, *_GRID_CONSTANTS, *extra])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _facts(model: onnx.ModelProto):
    """The graph as a program's slots and BoundSteps (the analysis reads only ops, attributes and constants)."""
    slots: dict[str, int] = {"x": 0}
    template: list = [None]
    for init in model.graph.initializer:
        slots[init.name] = len(template)
        template.append(torch.from_numpy(numpy_helper.to_array(init).copy()))

    def slot(name: str) -> int:
        if not name:
            return -1
        if name not in slots:
            slots[name] = len(template)
            template.append(None)
        return slots[name]
    steps = []
    for n in model.graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        steps.append(BoundStep(None, OpContext(n.name, n.op_type), [slot(i) for i in n.input],
                               [slot(o) for o in n.output], attrs, []))
    return corners(steps, list(range(len(steps))), template, [0]), slots


def _at(model: onnx.ModelProto, b: int, s: int) -> np.ndarray:
    return ReferenceEvaluator(model).run(None, {"x": np.zeros((b, s), np.int64)})[0]


def _extent(e: Affine, dims: tuple[int, int]) -> int:
    return e.offset if e.dim is None else dims[e.dim[1]] + e.offset


def _pairs(name: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    pairs = [((1, 1), (3, 4)), ((2, 3), (2, 3))]
    for _ in range(4):
        d = (int(rng.integers(1, 5)), int(rng.integers(1, 7)))
        pairs.append((d, (d[0] + int(rng.integers(0, 3)), d[1] + int(rng.integers(0, 4)))))
    return pairs


def _is_corner(model, fact, small, large) -> bool:
    v, big = _at(model, *small), _at(model, *large)
    extents = tuple(_extent(e, small) for e in fact.extents) if fact is not None else v.shape
    return v.shape == extents and big.ndim == v.ndim and all(n <= m for n, m in zip(v.shape, big.shape)) \
        and np.array_equal(big[tuple(slice(0, n) for n in v.shape)], v)


# name -> (nodes, output, its dtype, extra constants, its extents: b, s or a constant each)
PROVED = {
    "positions": (_POSITIONS, "pos_bs", I64, (), "bs"),
    "causal mask": (_POSITIONS + [
        _node("Unsqueeze", ["pos", "last_axis"], "q"),  # [s, 1]
        _node("LessOrEqual", ["pos_row", "q"], "seen"),
        _node("Where", ["seen", "zero_f", "low_f"], "mask")], "mask", F, (), "ss"),
    "packed-sequence group": (_POSITIONS + _PACKED, "group", I64, (), "bs"),
    "gathered by a grid": (_POSITIONS + _grid("pos_bs", "gathered"), "gathered", I64, (), "bss"),
    "mask of the groups": (_POSITIONS + _PACKED + _grid("group", "gathered") + [
        _node("Equal", ["gathered", "gathered"], "same"), _node("Cast", ["same"], "mask", to=F)], "mask", F, (),
        "bss"),
    "gather by positions": (_POSITIONS + [
        _node("Slice", ["pos_bs", "zero_1d", "one_1d", "zero_1d"], "row"),  # [1, s], bound s
        _node("Gather", ["pos_bs", "row"], "rows", axis=1)], "rows", I64, (), "b1s"),
}

REFUSED = {  # name -> (nodes, output, dtype, extra, whether it is no corner at all (a counterexample exists))
    "slice from the end": (_POSITIONS + [
        _node("Slice", ["pos", "minus2", "big"], "tail")], "tail", I64, (_i("minus2", -2), _i("big", BIG)), True),
    "reversed cumsum": (_POSITIONS + [
        _node("CumSum", ["pos", "zero"], "sums", reverse=1)], "sums", I64, (), True),
    "a dim's value in the data": (_POSITIONS + [_node("Sub", ["s", "pos"], "left")], "left", I64, (), True),
    "concat after a growing operand": (_POSITIONS + [
        _node("Concat", ["pos", "pos"], "twice", axis=0)], "twice", I64, (), True),
    "flattened": (_POSITIONS + [_node("Reshape", ["pos_bs", "minus_1d"], "flat")], "flat", I64, (), True),
    "a table past its rows": (_POSITIONS + [_node("Gather", ["table", "pos"], "rows")], "rows", F,
                              (numpy_helper.from_array(np.arange(24, dtype=np.float32).reshape(12, 2), "table"),),
                              False),  # (an error past 12 positions, not a wrong corner)
}


@pytest.mark.parametrize("name", list(PROVED))
def test_a_proved_corner_is_the_corner_of_its_value_at_larger_dims(name):
    nodes, output, dtype, extra, letters = PROVED[name]
    model = _graph(nodes, output, dtype, extra)
    facts, slots = _facts(model)
    fact = facts.corners.get(slots[output])
    assert fact is not None, name
    named = {Affine((0, 0), 0): "b", Affine((0, 1), 0): "s"}
    assert "".join(named.get(e, str(e.offset) if e.dim is None else "?") for e in fact.extents) == letters
    for small, large in _pairs(name):
        assert _is_corner(model, fact, small, large), (name, small, large)


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_refused_tensor_has_no_fact_and_where_it_is_no_corner_a_pair_shows_it(name):
    nodes, output, dtype, extra, wrong = REFUSED[name]
    model = _graph(nodes, output, dtype, extra)
    facts, slots = _facts(model)
    assert slots[output] not in facts.corners, name
    if wrong:
        pairs = _pairs(name) + [((1, 3), (1, 5)), ((2, 2), (2, 3))]
        assert not all(_is_corner(model, None, small, large) for small, large in pairs)


def test_the_ranks_a_shape_of_an_input_needs_are_named():
    facts, _ = _facts(_graph(_POSITIONS, "pos_bs"))
    assert facts.ranks == {0: 2} and facts.dims == {(0, 0), (0, 1)}


def test_corner_cut_serves_dims_within_its_base_only():
    cut = CornerCut()
    full = torch.randn(4, 1, 6, 6)
    assert cut((2, 3), (2, 1, 3, 3)) is None  # no base yet
    cut.keep((4, 6), full)
    got = cut((2, 3), (2, 1, 3, 3))
    assert torch.equal(got, full[:2, :, :3, :3]) and got.is_contiguous() and got.dtype == full.dtype
    assert cut((5, 3), (5, 1, 3, 3)) is None and cut((2, 7), (2, 1, 7, 7)) is None  # past the base
    assert cut((0, 3), (0, 1, 3, 3)) is None  # a 0 dim: the steps compute it
    cut.keep((3, 6), torch.zeros(3, 1, 6, 6))  # smaller in one dim: not the base
    assert cut.dims == (4, 6)
    cut.keep((4, 5), torch.zeros(4, 1, 5, 5))
    assert cut.dims == (4, 6)
    larger = torch.randn(5, 1, 7, 7)
    cut.keep((5, 7), larger)
    assert cut.dims == (5, 7) and torch.equal(cut((4, 6), (4, 1, 6, 6)), larger[:4, :, :6, :6])
    half = CornerCut()
    half.keep((2, 2), torch.randn(2, 2, dtype=torch.bfloat16))  # no numpy view: torch cuts it
    assert half((1, 2), (1, 2)).dtype == torch.bfloat16


def test_corner_cut_keeps_no_base_past_its_bytes(monkeypatch):
    monkeypatch.setattr(shape_corners, "CORNER_BYTES", 63)
    cut = CornerCut()
    cut.keep((4, 4), torch.zeros(4, 4))  # 64 bytes
    assert cut.dims is None and cut((1, 1), (1, 1)) is None
