"""The shape-only steps as one generated function (kiln/runtime/shape_function.py): at fresh random input
shapes it gives exactly what the steps give one by one, first calls match onnxruntime, and a shape at
which a step fails names that layer as the steps do."""

from __future__ import annotations

import re
import zlib

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

import kiln
from kiln import zoo
from kiln.errors import ExecutionError
from kiln.kernels.cpu import onednn_ahead
from kiln.ops.elementwise import max_
from kiln.runtime.shape_function import compile_shape_steps, computable_ahead
from kiln.runtime.step import call_step
from tests.exported_encoder import bert_tiny_with_mask_machinery


def _step_by_step(program, inputs: list[torch.Tensor]) -> list:
    """Every layer through the op dispatch (or its tactic's launch), in order, nothing freed: the oracle."""
    env = list(program.template)
    for s, v in zip(program.input_slots, inputs):
        env[s] = v
    for step in program.steps:
        result = call_step(step.fn, step.ctx, [env[s] if s >= 0 else None for s in step.inputs], step.attributes)
        outs = [result[0] if isinstance(result, tuple) else result] if len(step.outputs) == 1 else list(result)
        for s, v in zip(step.outputs, outs):
            if s >= 0:
                env[s] = v
    return env


def _assert_same_shape_values(program, inputs: list[torch.Tensor]) -> None:
    expected = _step_by_step(program, inputs)
    env = list(program.template)
    for s, v in zip(program.input_slots, inputs):
        env[s] = v
    program.shape_function(env)
    assert program.shape_function.slots, "no shape value is read after the shape steps"
    for s in program.shape_function.slots:
        got, want = env[s], expected[s]
        assert type(got) is type(want), (s, type(got), type(want))
        assert got.dtype == want.dtype and got.shape == want.shape, (s, got.dtype, want.dtype, got.shape, want.shape)
        assert torch.equal(got, want), (s, got, want)  # integers and gathered rows: exact
        assert got.stride() == want.stride(), (s, got.stride(), want.stride())  # a segment reads them as laid out


def _shape_model() -> bytes:
    """Shape arithmetic of every kind the generator emits (dims as ints, constants' axes read at load, the ops'
    own code on ints) and one it calls as is (ConstantOfShape), feeding data steps and outputs."""
    def const(name, values):
        return helper.make_node("Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64,
                                                                                  [len(values)], values))

    def scalar(name, value):
        return helper.make_node("Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64, [], [value]))

    nodes = [
        const("ax0", [0]), const("ax2", [2]), const("ax02", [0, 2]), scalar("one", 1), scalar("zero", 0),
        scalar("two", 2), const("idx", [-1, 0]), const("neg3", [-3]), const("big", [2**62]), const("col", [-1, 1]),
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Shape", ["x"], ["s0"], start=0, end=1),
        helper.make_node("Squeeze", ["s0"], ["n"]),  # no axes: every axis of size 1
        helper.make_node("Squeeze", ["s0", "ax0"], ["n2"]),
        helper.make_node("Gather", ["s", "one"], ["m"], axis=0),
        helper.make_node("Gather", ["s", "idx"], ["mn"], axis=0),  # [m, n], a negative index
        helper.make_node("Size", ["x"], ["size"]),
        helper.make_node("Mul", ["m", "two"], ["m2"]),
        helper.make_node("Sub", ["m2", "m"], ["m_again"]),
        helper.make_node("Add", ["m_again", "zero"], ["m3"]),
        helper.make_node("Add", ["mn", "one"], ["mn_plus"]),  # 1-D + 0-D
        helper.make_node("Unsqueeze", ["m3", "ax0"], ["m_1d"]),
        helper.make_node("Add", ["n", "n2"], ["n_twice"]),
        helper.make_node("Sub", ["n_twice", "n2"], ["n_back"]),
        helper.make_node("Unsqueeze", ["n_back", "ax0"], ["n_1d"]),
        helper.make_node("Concat", ["n_1d", "m_1d"], ["nm"], axis=0),
        helper.make_node("Cast", ["nm"], ["nm64"], to=TensorProto.INT64),
        helper.make_node("Range", ["zero", "m3", "one"], ["r"]),
        helper.make_node("Cast", ["r"], ["rf"], to=TensorProto.FLOAT),
        helper.make_node("Expand", ["rf", "nm64"], ["grid"]),
        helper.make_node("Unsqueeze", ["rf", "ax02"], ["rf3"]),  # [1, m, 1]
        helper.make_node("Squeeze", ["rf3", "ax2"], ["rf2"]),  # [1, m]
        helper.make_node("Slice", ["rf", "neg3", "big", "ax0"], ["tail"]),  # the last 3 (fewer when m < 3)
        helper.make_node("Reshape", ["r", "col"], ["r_col"]),  # [m, 1]
        helper.make_node("Cast", ["r_col"], ["r_colf"], to=TensorProto.FLOAT),
        helper.make_node("ConstantOfShape", ["nm"], ["ones"],
                         value=helper.make_tensor("v", TensorProto.FLOAT, [1], [1.5])),
        helper.make_node("Add", ["x", "grid"], ["y1"]),
        helper.make_node("Mul", ["x", "ones"], ["y2"]),
        helper.make_node("Add", ["y2", "rf2"], ["y3"]),
        helper.make_node("Reshape", ["x", "mn"], ["xt"]),  # [m, n]: a data step reading a shape value
        helper.make_node("Add", ["xt", "r_colf"], ["y4"]),
        helper.make_node("Add", ["mn_plus", "size"], ["dims"]),
        # gathers by indices known >= 0 (an arange, a constant's) and by a negative one (the op's own path)
        helper.make_node("Constant", [], ["table"], value=helper.make_tensor(
            "table", TensorProto.FLOAT, [20, 3], np.random.default_rng(0).standard_normal(60).tolist())),
        helper.make_node("Constant", [], ["ids"], value=helper.make_tensor("ids", TensorProto.INT64, [1, 30],
                                                                           list(range(29, -1, -1)))),
        helper.make_node("Gather", ["table", "r"], ["rows"], axis=0),  # [m, 3]
        helper.make_node("Gather", ["table", "idx"], ["last_first"], axis=0),  # rows -1 and 0
        helper.make_node("Unsqueeze", ["r", "ax0"], ["r_row"]),
        helper.make_node("GatherElements", ["ids", "r_row"], ["picked"], axis=1),  # [1, m]
        helper.make_node("Cast", ["picked"], ["pickedf"], to=TensorProto.FLOAT),
        helper.make_node("ReduceSum", ["rows", "ax0"], ["row_sums"], keepdims=0),
        helper.make_node("Add", ["row_sums", "last_first"], ["y5"]),  # [3] + [2, 3]
        helper.make_node("Add", ["y3", "pickedf"], ["y6"]),
        # rows of a table gathered by ids broadcast to [n, m] (an encoder's token types): gathered at [1, m], then
        # broadcast; a mask grid expanded to Shape(Max(a, b)), a Max only its Shape reads: no Max run
        helper.make_node("Expand", ["r_row", "nm64"], ["r_grid"]),  # [n, m]
        helper.make_node("Gather", ["table", "r_grid"], ["grid_rows"], axis=0),  # [n, m, 3]
        helper.make_node("Unsqueeze", ["x", "ax2"], ["x3"]),
        helper.make_node("Add", ["grid_rows", "x3"], ["y7"]),
        helper.make_node("Range", ["zero", "n", "one"], ["rn"]),
        helper.make_node("Unsqueeze", ["rn", "ax0"], ["rn_row"]),  # [1, n]
        helper.make_node("Max", ["r_col", "rn_row"], ["widest"]),  # [m, n]
        helper.make_node("Shape", ["widest"], ["widest_shape"]),
        helper.make_node("Expand", ["r_col", "widest_shape"], ["col_grid"]),
        helper.make_node("Cast", ["col_grid"], ["col_gridf"], to=TensorProto.FLOAT),
        helper.make_node("Transpose", ["col_gridf"], ["col_gridt"], perm=[1, 0]),
        helper.make_node("Add", ["col_gridt", "x"], ["y8"]),
    ]
    graph = helper.make_graph(nodes, "shapes", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", "m"])],
                              [helper.make_tensor_value_info(name, TensorProto.FLOAT, None)
                               for name in ("y1", "y3", "y4", "y5", "y6", "y7", "y8", "tail")]
                              + [helper.make_tensor_value_info("dims", TensorProto.INT64, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    path = tmp_path_factory.mktemp("shapes") / "shapes.onnx"
    path.write_bytes(_shape_model())
    engine = kiln.build(str(path), profiles=[{"x": "1x1,4x8,9x17"}])
    return engine, ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def test_the_shape_arithmetic_is_one_generated_function_without_the_dispatch_where_it_can(shapes):
    engine, _ = shapes
    program = engine.program
    assert program.shape_function is not None
    source = program.shape_function.source
    for emitted in ("_only(", "_at(", "_arith(", "_arange_int64(", "_expand_to(", "_unsqueeze_axes(",
                    "_squeeze_axes(", "_slice_ints(", "_reshape_to(", "_gather_nonneg(", "_gather_elements_nonneg("):
        assert emitted in source, f"{emitted} not generated:\n{source}"
    assert source.count("_one(") >= 1  # ConstantOfShape (and the float casts): their implementation, called as is
    # the gather by a negative constant index keeps the op's path; the one by ids broadcast to [n, m] gathers by the
    # [1, m] ids (kept per m), then broadcasts the rows; the Max whose Shape alone is read is its inputs' sizes
    assert source.count("_gather_nonneg(") == 2
    assert re.search(r"= _gather_nonneg\(ctx\d+, c\d+, v\d+, 0\)\n", source), source
    assert re.search(r"= _expand_to\(g\d+, \(\*v\d+, 3, \)\)\.contiguous\(\)", source), source
    assert "_broadcast_sizes(" in source
    assert not [v for v in program.shape_function.fn.__globals__.values() if v is max_], "the Max ran"


def test_the_generated_function_gives_what_the_steps_give_at_random_shapes(shapes):
    engine, _ = shapes
    rng = np.random.default_rng()
    for _ in range(25):
        n, m = int(rng.integers(1, 10)), int(rng.integers(1, 18))
        _assert_same_shape_values(engine.program, [torch.from_numpy(rng.standard_normal((n, m), dtype=np.float32))])


def test_first_calls_at_fresh_shapes_match_onnxruntime(shapes):
    engine, session = shapes
    rng = np.random.default_rng()
    seen = set()
    for _ in range(20):
        n, m = int(rng.integers(1, 10)), int(rng.integers(1, 18))
        first = (n, m) not in seen
        seen.add((n, m))
        x = rng.standard_normal((n, m), dtype=np.float32)
        got = engine.run({"x": x})
        want = dict(zip([o.name for o in session.get_outputs()], session.run(None, {"x": x})))
        for name, value in want.items():
            assert got[name].shape == value.shape, (name, n, m, first)
            if value.dtype == np.int64:
                np.testing.assert_array_equal(got[name], value)
            else:
                np.testing.assert_allclose(got[name], value, rtol=1e-6, atol=1e-6)  # one add or mul of floats


def _failing_model() -> bytes:
    """r = range(m) reshaped to [2, -1]: fine at an even m, a failing Reshape at an odd one."""
    nodes = [helper.make_node("Shape", ["x"], ["s"], start=1, end=2),
             helper.make_node("Squeeze", ["s"], ["m"]),
             helper.make_node("Constant", [], ["zero"], value=helper.make_tensor("z", TensorProto.INT64, [], [0])),
             helper.make_node("Constant", [], ["one"], value=helper.make_tensor("o", TensorProto.INT64, [], [1])),
             helper.make_node("Constant", [], ["halves"],
                              value=helper.make_tensor("h", TensorProto.INT64, [2], [2, -1])),
             helper.make_node("Range", ["zero", "m", "one"], ["r"]),
             helper.make_node("Reshape", ["r", "halves"], ["pairs"], name="the_pairs"),
             helper.make_node("Cast", ["pairs"], ["pf"], to=TensorProto.FLOAT),
             helper.make_node("ReduceSum", ["x"], ["total"], keepdims=1),
             helper.make_node("Add", ["pf", "total"], ["y"])]
    graph = helper.make_graph(nodes, "halves", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "m"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def test_a_shape_at_which_a_step_fails_names_its_layer(tmp_path):
    path = tmp_path / "halves.onnx"
    path.write_bytes(_failing_model())
    engine = kiln.build(str(path), profiles=[{"x": "1x2,1x8,1x16"}])
    assert engine.program.shape_function is not None
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x = np.random.default_rng().standard_normal((1, 6), dtype=np.float32)
    np.testing.assert_allclose(engine.run({"x": x})["y"], session.run(None, {"x": x})[0], rtol=1e-6, atol=1e-5)
    with pytest.raises(ExecutionError, match="the_pairs"):
        engine.run({"x": np.ones((1, 7), np.float32)})


@pytest.fixture(scope="module")
def bert():
    return bert_tiny_with_mask_machinery("1x1,4x32,8x64")


def test_an_exported_encoders_shape_values_match_the_steps_at_random_shapes(bert):
    _, engine = bert
    program = engine.program
    assert program.shape_function is not None
    assert "_arange_int64(" in program.shape_function.source  # the mask's index grids from dims kept as ints
    assert "_grid" in program.shape_function.source  # the [b, 1, 1, s, 2] grid a corner of a larger one (_Grid)
    rng = np.random.default_rng()
    for _ in range(20):
        b, s = int(rng.integers(1, 9)), int(rng.integers(1, 65))
        ids = torch.from_numpy(rng.integers(0, 1000, (b, s), dtype=np.int64))
        mask = torch.from_numpy((rng.random((b, s)) < 0.8).astype(np.int64))
        _assert_same_shape_values(program, [ids, mask])


def test_values_of_some_dims_are_kept_per_those_dims_and_equal_the_steps_at_shapes_that_reuse_them(bert, monkeypatch):
    """An encoder's position embeddings and mask grids follow the sequence length alone, the batch's aranges the batch
    alone: kept per those dims (bounded), so a new batch x sequence whose dims were seen computes only the rest; what
    the function then gives equals the steps at fresh shapes, on a miss and on a hit, and the memos stay bounded."""
    from kiln.runtime import shape_function as sf

    _, engine = bert
    program = engine.program
    source = program.shape_function.source
    assert len(program.shape_function.memos) == 2, source  # one per dim: batch alone, sequence alone
    assert "_memo" in source and ".put(" in source
    monkeypatch.setattr(sf, "MEMO_ENTRIES", 5)
    for memo in program.shape_function.memos:
        memo.clear()  # the module's engine: earlier tests filled them
    rng = np.random.default_rng()
    for b, s in [(2, 7), (3, 7), (3, 11), (2, 11), (5, 3), (5, 7)] + \
            [(int(rng.integers(1, 9)), int(rng.integers(1, 65))) for _ in range(16)]:
        ids = torch.from_numpy(rng.integers(0, 1000, (b, s), dtype=np.int64))
        mask = torch.from_numpy((rng.random((b, s)) < 0.8).astype(np.int64))
        _assert_same_shape_values(program, [ids, mask])
        assert all(len(m) <= 5 for m in program.shape_function.memos)
    assert all(len(m) >= 3 for m in program.shape_function.memos)


@pytest.mark.parametrize("name", ["gpt2_tiny", "llama_tiny"])
def test_decoders_shape_values_match_the_steps_and_first_calls_match_onnxruntime(name):
    """GPT-2's shape values all follow from the input shapes; Llama's include a Shape of a layer's output, a Reshape
    whose target is made of the inputs' dims and constants: its sizes are the target's values."""
    exported = zoo.export(name, batch=2, seq=8, dynamic=True)
    engine = kiln.build(str(exported.path), profiles=[{"input_ids": "1x1,2x8,4x16"}])
    program = engine.program
    assert program.shape_function is not None
    # Llama's Shape of a layer's output (repeat_kv's Reshape) follows from the Reshape's target (_reshaped_by)
    assert program.plans_ahead and len(program.first_steps) == len(program.lean_steps)
    session = ort.InferenceSession(str(exported.path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng()
    for _ in range(6):
        b, s = int(rng.integers(1, 5)), int(rng.integers(1, 17))
        feeds = {"input_ids": rng.integers(0, 100, (b, s), dtype=np.int64),
                 "attention_mask": np.ones((b, s), np.int64)}
        feeds = {n: feeds[n] for n in engine.input_names}
        _assert_same_shape_values(program, [torch.from_numpy(feeds[n]) for n in engine.input_names])
        got = next(iter(engine.run(feeds).values()))
        np.testing.assert_allclose(got, session.run(None, feeds)[0], rtol=1e-4, atol=1e-4)  # fp32 logits, ~1e-6 apart


def test_an_exported_encoders_first_calls_match_onnxruntime(bert):
    exported, engine = bert
    session = ort.InferenceSession(str(exported.path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng()
    for _ in range(12):
        b, s = int(rng.integers(1, 9)), int(rng.integers(1, 65))
        if any(key[0][0] == (b, s) for key in engine.program.shape_plans):
            continue  # a first call only
        ids = rng.integers(0, 1000, (b, s), dtype=np.int64)
        mask = np.ones((b, s), np.int64)
        for row in range(b):
            mask[row, rng.integers(max(1, s // 2), s + 1):] = 0
        feeds = {"input_ids": ids, "attention_mask": mask}
        got = next(iter(engine.run(feeds).values()))
        want = session.run(None, feeds)[0]
        real = mask.astype(bool)
        # fp32 through 2 encoder layers, kiln's GEMMs and attention against onnxruntime's: ~1e-6 apart
        np.testing.assert_allclose(got[real], want[real], rtol=1e-4, atol=1e-4)


def test_a_layer_pinned_to_fp32_is_called_through_its_kernel(shapes):
    """In a half-precision engine a layer pinned to fp32 runs inside pinned_fp32's casts: the generated
    function calls that kernel rather than the op's code on ints."""
    engine, _ = shapes
    program = engine.program
    spec = program.spec
    ahead = computable_ahead(program.steps, sorted(program.shape_steps), program.template, program.input_slots)
    expand = next(i for i in ahead if spec.steps[i].op_type == "Expand")
    function = compile_shape_steps(program.steps, ahead, program.template, program.input_slots,
                                   program.shape_function.slots, {expand})
    assert function.source.count("_expand_to(") == program.shape_function.source.count("_expand_to(") - 1
    rng = np.random.default_rng()
    for _ in range(5):
        x = torch.from_numpy(rng.standard_normal((int(rng.integers(1, 10)), int(rng.integers(1, 18))),
                                                 dtype=np.float32))
        envs = []
        for fn in (function, program.shape_function):
            env = list(program.template)
            env[program.input_slots[0]] = x
            fn(env)
            envs.append(env)
        for s in function.slots:
            assert torch.equal(envs[0][s], envs[1][s])


def _prefix_model(second_dim: bool = True) -> bytes:
    """Values that follow the second dim m alone as prefixes along it: a Slice [0, m) of a constant of 10 positions
    (clamped past m = 10), rows of a table gathered by it, an arange(0, m) unsqueezed, compared and cast (then
    expanded to [n, m]: that follows both dims; `second_dim` False: added to x as it is, [1, m], and no line reads
    n, as an exported encoder reads only its sequence length)."""
    def const(name, dims, values, kind=TensorProto.INT64):
        return helper.make_node("Constant", [], [name], value=helper.make_tensor(name, kind, dims, values))

    nodes = [
        const("positions", [1, 10], [(3 * i + 1) % 12 for i in range(10)]),
        const("table", [12, 4], np.random.default_rng(0).standard_normal(48).tolist(), TensorProto.FLOAT),
        const("zero", [1], [0]), const("one", [1], [1]), const("ax0", [1], [0]), const("two", [], [2]),
        const("zero0", [], [0]), const("one0", [], [1]),
        helper.make_node("Shape", ["x"], ["m1"], start=1, end=2),
        helper.make_node("Slice", ["positions", "zero", "m1", "one"], ["picked"]),  # [1, min(m, 10)]
        helper.make_node("Gather", ["table", "picked"], ["rows"], axis=0),  # [1, min(m, 10), 4]
        helper.make_node("Relu", ["rows"], ["y1"]),
        helper.make_node("Squeeze", ["m1", "ax0"], ["m"]),
        helper.make_node("Range", ["zero0", "m", "one0"], ["r"]),
        helper.make_node("Unsqueeze", ["r", "ax0"], ["r_row"]),  # [1, m]
        helper.make_node("GreaterOrEqual", ["r_row", "two"], ["late"]),
        helper.make_node("Cast", ["late"], ["latef"], to=TensorProto.FLOAT),
    ]
    if second_dim:
        nodes += [helper.make_node("Shape", ["x"], ["n1"], start=0, end=1),  # a second dim: the group of m is kept
                  helper.make_node("Concat", ["n1", "m1"], ["nm"], axis=0),
                  helper.make_node("Expand", ["latef", "nm"], ["late_grid"]),
                  helper.make_node("Add", ["x", "late_grid"], ["y2"])]
    else:
        nodes.append(helper.make_node("Add", ["x", "latef"], ["y2"]))
    graph = helper.make_graph(nodes, "prefixes", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", "m"])],
                              [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in ("y1", "y2")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


@pytest.mark.parametrize("second_dim", [True, False])
def test_values_that_are_prefixes_along_one_dim_are_narrowed_from_a_larger_one_and_equal_the_steps(tmp_path,
                                                                                                  second_dim):
    """The group following m is computed once at the Slice's constant's length (10) and narrowed at each new m:
    equal to the steps, strides included, at fresh m in any order and at m past 10 (the Slice clamps: computed, not
    narrowed); first calls equal onnxruntime. Also where m is the only dim any line reads (`second_dim` False: the
    group follows every dim read, yet a new n at a known m is another signature, and a new m narrows)."""
    path = tmp_path / "prefixes.onnx"
    path.write_bytes(_prefix_model(second_dim))
    engine = kiln.build(str(path), profiles=[{"x": "1x1,2x8,4x16"}])
    program = engine.program
    source = program.shape_function.source
    assert "_narrow(_b[" in source and "_prefix" in source, source
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng()
    for m in [5, 3, 10, 12, 7, 1, 15, 2, 9, 11, 4] + [int(v) for v in rng.integers(1, 17, 6)]:
        x = rng.standard_normal((int(rng.integers(1, 5)), m)).astype(np.float32)
        _assert_same_shape_values(program, [torch.from_numpy(x)])
        for memo in program.shape_function.memos:
            memo.clear()  # every m a miss: narrowed (or computed) again
        for got, want in zip(engine.run({"x": x}).values(), session.run(None, {"x": x})):
            np.testing.assert_array_equal(got, want)  # gathered rows and 0/1 added: exact


def _grid_model() -> bytes:
    """An exported mask's index grid over both dims of x [n, m]: aranges of n and m unsqueezed to [n, 1] and [1, m],
    each expanded to Shape(Max(a, b)), unsqueezed at -1 and concatenated ([n, m, 2] = (i, j)), then a GatherND of x
    by it (x itself) and the grid cast to float (both exact)."""
    def scalar(name, value):
        return helper.make_node("Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64, [], [value]))

    def axes(name, values):
        return helper.make_node("Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64,
                                                                                  [len(values)], values))

    nodes = [
        scalar("zero", 0), scalar("one", 1), axes("ax0", [0]), axes("ax1", [1]), axes("last", [-1]),
        helper.make_node("Shape", ["x"], ["n1"], start=0, end=1),
        helper.make_node("Shape", ["x"], ["m1"], start=1, end=2),
        helper.make_node("Squeeze", ["n1", "ax0"], ["n"]),
        helper.make_node("Squeeze", ["m1", "ax0"], ["m"]),
        helper.make_node("Range", ["zero", "n", "one"], ["rn"]),
        helper.make_node("Range", ["zero", "m", "one"], ["rm"]),
        helper.make_node("Unsqueeze", ["rn", "ax1"], ["a"]),  # [n, 1]
        helper.make_node("Unsqueeze", ["rm", "ax0"], ["b"]),  # [1, m]
        helper.make_node("Max", ["a", "b"], ["ab"]),
        helper.make_node("Shape", ["ab"], ["size"]),
        helper.make_node("Expand", ["a", "size"], ["ea"]),
        helper.make_node("Expand", ["b", "size"], ["eb"]),
        helper.make_node("Unsqueeze", ["ea", "last"], ["ua"]),
        helper.make_node("Unsqueeze", ["eb", "last"], ["ub"]),
        helper.make_node("Concat", ["ua", "ub"], ["grid"], axis=-1),  # [n, m, 2]
        helper.make_node("GatherND", ["x", "grid"], ["y1"]),
        helper.make_node("Cast", ["grid"], ["y2"], to=TensorProto.FLOAT),
    ]
    graph = helper.make_graph(nodes, "grid", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", "m"])],
                              [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in ("y1", "y2")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def test_an_index_grid_over_two_dims_is_a_corner_of_a_larger_one_and_equals_the_steps(tmp_path, monkeypatch):
    """The grid is made once at the largest dims seen (growing along either dim) and a new n x m's is its corner:
    equal to the steps, strides included, at fresh shapes in any order (smaller, larger along one dim and smaller
    along the other, 1s), whether a view of its row of corners (_GridBase) or a copy (GRID_ROWS_BYTES 0); past
    GRID_BYTES computed by the ops, equal too; first calls equal onnxruntime."""
    from kiln.runtime import shape_function as sf

    path = tmp_path / "grid.onnx"
    path.write_bytes(_grid_model())
    engine = kiln.build(str(path), profiles=[{"x": "1x1,4x8,8x16"}])
    # the load's background jobs done (first_calls.ahead_jobs: shape plans and views at the profile's shapes, its
    # largest 8 x 16 among them): one still running after `_base = None` below grew the grid to 8 x 16 (a CI run)
    assert onednn_ahead.AHEAD.wait(timeout=120), "the background jobs did not finish"
    program = engine.program
    source = program.shape_function.source
    assert "_grid" in source and "_expand_to(" not in source, source  # the Concat's grid a corner, no Expand left
    grids = [v for v in program.shape_function.fn.__globals__.values() if isinstance(v, sf._Grid)]
    assert len(grids) == 1
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng()
    shapes = [(2, 5), (3, 3), (1, 7), (4, 2), (1, 1), (3, 6), (5, 1), (2, 9)] + \
        [(int(rng.integers(1, 7)), int(rng.integers(1, 13))) for _ in range(8)]
    for limit, rows in ((sf.GRID_BYTES, sf.GRID_ROWS_BYTES), (sf.GRID_BYTES, 0), (64, sf.GRID_ROWS_BYTES)):
        monkeypatch.setattr(sf, "GRID_BYTES", limit)
        monkeypatch.setattr(sf, "GRID_ROWS_BYTES", rows)  # 0: each corner cut by a copy, no row of corners kept
        grids[0]._base = None
        for n, m in shapes:
            x = rng.standard_normal((n, m)).astype(np.float32)
            _assert_same_shape_values(program, [torch.from_numpy(x)])
            for memo in program.shape_function.memos:
                memo.clear()  # every dim a miss: the prefixes computed or narrowed again
            for got, want in zip(engine.run({"x": x}).values(), session.run(None, {"x": x})):
                np.testing.assert_array_equal(got, want)  # x gathered whole and the grid's integers: exact
        base = grids[0]._base
        if limit == 64:
            assert base is None or base.grid.numel() * 8 <= 64
        else:
            assert base is not None and base.sizes == (max(n for n, _ in shapes), max(m for _, m in shapes), 2)
            # the corners of each m at every n: views of one row per m (_GridBase), none past GRID_ROWS_BYTES
            assert (len(base._corners) > 0) == (rows > 0) and base._row_bytes <= rows


def _size_model() -> bytes:
    """y = x + Cast(Reshape(Range(0, Size(x), 1), Shape(x))): a shape value made from the input's Size."""
    nodes = [helper.make_node("Size", ["x"], ["n"]),
             helper.make_node("Constant", [], ["zero"], value=helper.make_tensor("z", TensorProto.INT64, [], [0])),
             helper.make_node("Constant", [], ["one"], value=helper.make_tensor("o", TensorProto.INT64, [], [1])),
             helper.make_node("Range", ["zero", "n", "one"], ["r"]),
             helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Reshape", ["r", "s"], ["grid"]),
             helper.make_node("Cast", ["grid"], ["gf"], to=TensorProto.FLOAT),
             helper.make_node("Add", ["x", "gf"], ["y"])]
    graph = helper.make_graph(nodes, "sizes", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", "m"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def test_a_function_reading_only_its_inputs_sizes_gives_the_steps_values_for_numpy_inputs(bert, tmp_path):
    """An exported encoder's function reads its inputs only as Shapes (`shapes_only`): given the numpy arrays
    themselves (as DirectRuns.bind gives them, without torch.from_numpy) it writes exactly the values the steps
    compute from the tensors, strides included, at fresh shapes. One that reads an input's Size (a tensor's
    numel) is not shapes_only, and first calls of its engine still match onnxruntime."""
    _, engine = bert
    program = engine.program
    assert program.shape_function.shapes_only, program.shape_function.source
    rng = np.random.default_rng()
    for _ in range(12):
        b, s = int(rng.integers(1, 9)), int(rng.integers(1, 65))
        arrays = [rng.integers(0, 1000, (b, s), dtype=np.int64), (rng.random((b, s)) < 0.8).astype(np.int64)]
        expected = _step_by_step(program, [torch.from_numpy(a) for a in arrays])
        env = list(program.template)
        for slot, a in zip(program.input_slots, arrays):
            env[slot] = a
        program.shape_function(env)
        for slot in program.shape_function.slots:
            got, want = env[slot], expected[slot]
            assert type(got) is type(want) and got.dtype == want.dtype and got.shape == want.shape, (slot, b, s)
            assert torch.equal(got, want) and got.stride() == want.stride(), (slot, b, s)
    path = tmp_path / "sizes.onnx"
    path.write_bytes(_size_model())
    sized = kiln.build(str(path), profiles=[{"x": "1x1,4x8,9x17"}])
    assert sized.program.shape_function is not None and "numel()" in sized.program.shape_function.source
    assert not sized.program.shape_function.shapes_only
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for n, m in ((3, 5), (7, 2), (3, 5)):
        x = rng.standard_normal((n, m), dtype=np.float32)
        np.testing.assert_array_equal(sized.run({"x": x})["y"], session.run(None, {"x": x})[0])  # one exact add


def test_a_memo_counts_each_storage_once_and_lets_it_go_with_its_last_entry(monkeypatch):
    """_Memo.held is the bytes of the distinct storages its entries keep alive: views of one base (a _Prefix's
    narrowed values at each sequence length) count the base once, however many entries hold them; a storage's bytes
    leave `held` when its last entry is evicted. Fails with each view's own bytes summed (BERT-base's 256 sequence
    lengths counted ~200 MB of two 1.5 MB bases, and MEMO_BYTES kept 5 of them)."""
    from kiln.runtime import shape_function as sf

    monkeypatch.setattr(sf, "MEMO_ENTRIES", 4)
    memo = sf._Memo()
    base = torch.zeros(1, 512, 64)
    for d in range(1, 4):
        memo.put((d,), (d, base[:, :d], None, base.as_strided((1, d, 64), base.stride())))
    assert len(memo) == 3 and memo.held == base.untyped_storage().nbytes()
    own = [torch.ones(10, 10) for _ in range(4)]
    for k, t in enumerate(own):
        memo.put((100 + k,), (t,))  # each its own storage; (1,), (2,), (3,) out by MEMO_ENTRIES, the base with them
    assert len(memo) == 4 and memo.held == 4 * own[0].untyped_storage().nbytes()
    assert memo.get((1,)) is None and memo.get((103,)) is not None
    memo.clear()
    assert memo.held == 0 and len(memo) == 0


def _reshape_shape_model(allowzero: int, middle: int) -> bytes:
    """y = Reshape(Cos(x), Shape(Reshape(Sin(x), [b, middle, s]))), x [b, s]: a Shape of a layer's output whose sizes
    follow from the Reshape's target where it has no -1 (and allowzero, its input dims possibly 0)."""
    nodes = [helper.make_node("Shape", ["x"], ["b"], start=0, end=1),
             helper.make_node("Shape", ["x"], ["s"], start=1, end=2),
             helper.make_node("Concat", ["b", "middle", "s"], ["target"], axis=0),
             helper.make_node("Sin", ["x"], ["sx"]),
             helper.make_node("Reshape", ["sx", "target"], ["r"], allowzero=allowzero),
             helper.make_node("Shape", ["r"], ["dims"]),
             helper.make_node("Cos", ["x"], ["cx"]),
             helper.make_node("Reshape", ["cx", "dims"], ["y0"]),
             helper.make_node("Add", ["y0", "r"], ["y"])]
    graph = helper.make_graph(nodes, "reshape_shape", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [helper.make_tensor("middle", TensorProto.INT64, [1], [middle])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def test_a_shape_of_a_reshapes_output_stays_in_the_loop_where_its_data_sets_it(tmp_path):
    """A -1 in the target (its size from the data's) keeps the Shape in the loop (_reshaped_by refuses; llama_tiny's
    repeat_kv above is the case it takes: allowzero, no -1; this graph's Shape without the -1 is folded at build);
    the values equal the steps' and the outputs onnxruntime's."""
    allowzero, middle, ahead = 1, -1, False
    path = tmp_path / "reshape_shape.onnx"
    path.write_bytes(_reshape_shape_model(allowzero, middle))
    engine = kiln.build(str(path), profiles=[{"x": "1x1,2x4,4x8"}])
    program = engine.program
    assert program.shape_function is not None
    assert program.plans_ahead == ahead
    assert (len(program.first_steps) == len(program.lean_steps)) == ahead
    assert "_reshaped_sizes(" not in program.shape_function.source
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(zlib.crc32(f"reshape shape {allowzero} {middle}".encode()))
    for b, s in [(1, 1), (3, 5), (4, 8), (2, 7)]:
        x = rng.standard_normal((b, s)).astype(np.float32)
        _assert_same_shape_values(program, [torch.from_numpy(x)])
        got = next(iter(engine.run({"x": x}).values()))
        np.testing.assert_allclose(got, session.run(None, {"x": x})[0], rtol=1e-6, atol=1e-6)  # Sin + Cos, fp32


def _gather_nd_reference(data: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """onnx.reference's GatherND (batch_dims 0): the independent oracle."""
    from onnx.reference import ReferenceEvaluator

    model = helper.make_model(helper.make_graph(
        [helper.make_node("GatherND", ["d", "g"], ["y"])], "g",
        [helper.make_tensor_value_info("d", TensorProto.INT64, None),
         helper.make_tensor_value_info("g", TensorProto.INT64, None)],
        [helper.make_tensor_value_info("y", TensorProto.INT64, None)]))
    return ReferenceEvaluator(model).run(None, {"d": data, "g": grid})[0]


# parts' shapes (each broadcast to their common shape S), data's trailing dims, and whether the parts hold negative
# indices (counted from the end): an exported mask's [b, 1, 1, 1] x [1, 1, s, 1] grids and others
GATHER_GRIDS = [(((3, 1, 1, 1), (1, 1, 5, 1)), (), False), (((4, 1), (1, 6)), (), True),
                (((2, 1, 1), (1, 3, 1), (1, 1, 4)), (), False), (((5,), (5,)), (3,), True),
                (((1, 1), (1, 1)), (2,), False), (((2, 1), (1, 7)), (4, 2), True)]


@pytest.mark.parametrize("shapes,trailing,negative", GATHER_GRIDS, ids=str)
def test_gather_nd_by_a_grids_parts_equals_onnx_reference(shapes, trailing, negative):
    """_GatherGrid: GatherND(data, Concat(Unsqueeze(Expand(P_i, S), -1)...)) as data[P_0, P_1, ...], the grid never
    made, equal (exactly, dtype, shape and a contiguous layout) to onnx.reference's GatherND of the grid the ops
    make; the ops' own path (the grid, then GatherND's kernel) gives the same."""
    from kiln.ops.indexing import gather_nd
    from kiln.ops.tensor import concat
    from kiln.runtime import shape_function as sf

    rng = np.random.default_rng(zlib.crc32(repr((shapes, trailing, negative)).encode()))
    shape = tuple(np.broadcast_shapes(*shapes))
    dims = [int(rng.integers(2, 9)) for _ in shapes]
    data = rng.integers(-1000, 1000, (*dims, *trailing), dtype=np.int64)
    made = sf._Grid(concat, None, {"axis": -1})
    gathered = sf._GatherGrid(made, gather_nd, None, {})
    for _ in range(4):
        parts = []
        for p, n in zip(shapes, dims):
            low = -n if negative else 0
            parts.append(torch.from_numpy(rng.integers(low, n, p, dtype=np.int64)))
        arguments = tuple((p, shape) for p in parts)
        grid = np.stack([np.broadcast_to(p.numpy(), shape) for p in parts], axis=-1)
        want = _gather_nd_reference(data, grid)
        got = gathered(torch.from_numpy(data), arguments)
        assert got.dtype == torch.int64 and got.is_contiguous() and tuple(got.shape) == want.shape
        np.testing.assert_array_equal(got.numpy(), want)
        ops = sf._one(gather_nd(None, torch.from_numpy(data), sf._Grid(concat, None, {"axis": -1})._made(arguments)))
        np.testing.assert_array_equal(ops.numpy(), want)


def test_gather_nd_by_a_grid_takes_the_ops_where_indexing_would_differ():
    """Where torch's indexing is not GatherND's (parts of other dtypes, a bool part being a mask to torch, parts that
    broadcast past S, more parts than data's rank), _GatherGrid makes the grid and calls the kernel: its answer is the
    ops'. An index past its axis raises (the shape function then falls back to the steps)."""
    from kiln.runtime import shape_function as sf

    made, calls = [], []

    def concat(ctx, *parts, axis):
        made.append(tuple(p.shape for p in parts))
        return torch.cat(parts, axis)

    def kernel(ctx, data, grid, **attributes):
        calls.append(tuple(grid.shape))
        return torch.zeros(1)

    gathered = sf._GatherGrid(sf._Grid(concat, None, {"axis": -1}), kernel, None, {})
    data = torch.arange(12).reshape(3, 4)
    i, j = torch.arange(3).reshape(3, 1), torch.arange(4).reshape(1, 4)
    assert torch.equal(gathered(data, ((i, (3, 4)), (j, (3, 4)))), data) and not made and not calls
    for parts in (((i.int(), (3, 4)), (j.int(), (3, 4))),  # int32: GatherND's kernel casts them
                  ((i.bool(), (3, 4)), (j, (3, 4))),  # a bool part: a mask to torch
                  ((i, (3, 4)), (j, (3, 5))),  # the Expands' shapes differ: the Concat raises
                  ((i, (3, 1)), (j, (3, 1))),  # j broadcasts past S: the Concat raises
                  ((i, (3, 4)), (j, (3, 4)), (j, (3, 4)))):  # three parts, data of rank 2
        made.clear()
        calls.clear()
        # a fresh grid each (a _Grid's base stands for one set of prefixes, as in the generated function)
        gathered = sf._GatherGrid(sf._Grid(concat, None, {"axis": -1}), kernel, None, {})
        try:
            got = gathered(data, parts)
        except (RuntimeError, ValueError, IndexError):
            pass  # the ops' own error (an Expand's, the Concat's): no answer made up by indexing
        else:
            assert made and calls and torch.equal(got, torch.zeros(1)), parts  # the ops' answer
    with pytest.raises(IndexError):
        gathered(data, ((i + 3, (3, 4)), (j, (3, 4))))


@pytest.mark.parametrize("start,end", [(-1, (1 << 63) - 1), (-2, -1), (-(1 << 63), -2), (0, 2), (1, 100), (-9, 2),
                                       (3, 1), (2, -7), (5, 9), (0, 0)])
def test_a_slice_of_a_shape_value_is_onnx_slice(start, end):
    """_slice_dims (a Slice of a 1-D shape value, as Python ints: an exported Llama's repeat_kv shapes) against
    onnx.reference's Slice, starts and ends past either end and negative."""
    from onnx.reference import ReferenceEvaluator

    from kiln.runtime.shape_function import _slice_dims
    dims = (5, 4, 33, 16)
    names = ["x", "starts", "ends", "axes", "steps"]
    graph = helper.make_graph([helper.make_node("Slice", names, ["y"])], "g",
                              [helper.make_tensor_value_info(n, TensorProto.INT64, None) for n in names],
                              [helper.make_tensor_value_info("y", TensorProto.INT64, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    values = [np.array(v, np.int64) for v in (dims, [start], [end], [0], [1])]
    want = ReferenceEvaluator(model).run(None, dict(zip(names, values)))[0]
    assert _slice_dims(dims, start, end) == tuple(int(v) for v in want)


def test_an_encoders_mask_parts_kept_per_dim_or_grids_are_not_cut_again(bert):
    """The corner cut (shape_corners) serves only values a signature's own lines make: an encoder's mask parts that
    follow the sequence alone are kept per sequence (_Memo) and its index grid is a _Grid's corner already, so its
    shape function has no cut (a cut of a memo's value once stored None, its lines left in the memo's group)."""
    _, engine = bert
    assert "_corner" not in engine.program.shape_function.source
