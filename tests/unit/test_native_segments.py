"""Native segments (kiln/runtime/native.py): runs of oneDNN layers bound once to a memory plan.

Each program is checked against the same program on the ops' registered implementations (the
reference), on fresh random inputs, float32 against float64 within the fp32 tolerance; and
structurally: which layers formed a segment, what was accumulated in place, that values held
by the caller survive later runs, that other input sizes and two threads still give the
reference.
"""

from __future__ import annotations

import dataclasses
import threading
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kiln.kernels.cpu import native_loop, onednn
from kiln.plan.spec import ProgramSpec, StepSpec
from kiln.runtime.native import Segment
from kiln.runtime.program import Program

pytestmark = pytest.mark.skipif(not onednn.available(), reason="libdnnl.so.3 cannot be loaded")

CONV = "cpu.conv.onednn_direct"
CL = torch.channels_last


def _conv(name, x, w, out, size, *, b=None, residual=None, k=3, stride=1, act="Relu", after=0):
    pads = [k // 2] * 4
    inputs = [x, w, b or ""] + ([residual] if residual else [])
    return StepSpec("FusedConv", name, inputs, [out],
                    {"pads": pads, "strides": [stride, stride], "kernel_shape": [k, k], "activation": act,
                     "residual_after_activation": after}, domain="kiln", tactic=CONV,
                    tactic_config={"input_size": size, "residual": bool(residual)})


def _network(outputs=("out",)) -> tuple[ProgramSpec, dict]:
    """x [1,8,12,12] -> a = relu(conv3x3 x) -> c = relu(conv1x1 a + b) -> d = relu(conv3x3 c + a)
    (a dies here: accumulated) -> p = maxpool 3x3/2 d -> e = conv1x1/stride 1 p -> out = gap(e)."""
    g = torch.Generator().manual_seed(5)
    weights = {"w1": torch.randn(8, 8, 3, 3, generator=g) * 0.2, "w2": torch.randn(8, 8, 1, 1, generator=g) * 0.3,
               "b2": torch.randn(8, generator=g), "w3": torch.randn(8, 8, 3, 3, generator=g) * 0.2,
               "w4": torch.randn(16, 8, 1, 1, generator=g) * 0.3, "axes": torch.tensor([2, 3])}
    steps = [
        _conv("c1", "x", "w1", "a", [1, 8, 12, 12]),
        _conv("c2", "a", "w2", "c", [1, 8, 12, 12], b="b2", k=1),
        _conv("c3", "c", "w3", "d", [1, 8, 12, 12], residual="a"),
        StepSpec("MaxPool", "pool", ["d"], ["p"], {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},
                 tactic="cpu.pool.onednn.MaxPool", tactic_config={"input_size": [1, 8, 12, 12]}),
        _conv("c4", "p", "w4", "e", [1, 8, 6, 6], k=1, act=""),
        StepSpec("ReduceMean", "gap", ["e", "axes"], ["out"], {"keepdims": 1},
                 tactic="cpu.gap.onednn.ReduceMean", tactic_config={"input_size": [1, 16, 6, 6]}),
    ]
    return ProgramSpec(["x"], list(outputs), steps, {k: k for k in weights}), weights


RTOL, ATOL = 2e-5, 1e-6  # float32 results against the float64 reference, relative to the output's scale


def assert_close(got: torch.Tensor, want64: torch.Tensor) -> None:
    assert got.dtype == torch.float32 and got.shape == want64.shape
    scale = want64.abs().max().item()
    error = (got.double() - want64).abs().max().item()
    assert error <= ATOL + RTOL * scale, f"max abs error {error:.3g} at scale {scale:.3g}"


def _reference(spec: ProgramSpec) -> ProgramSpec:
    return dataclasses.replace(spec, steps=[dataclasses.replace(s, tactic="", tactic_config={}) for s in spec.steps])


def _run(spec, weights, x):
    with torch.inference_mode():
        return Program(spec, weights).run([x])


def _want(spec, weights, x) -> list[torch.Tensor]:
    """The registered ops in float64: the oracle."""
    double = {k: v.double() if v.is_floating_point() else v for k, v in weights.items()}
    return _run(_reference(spec), double, x.double())


def test_a_run_of_onednn_layers_is_one_segment_and_matches_the_reference():
    spec, weights = _network()
    program = Program(spec, weights)
    assert len(program.segments) == 1 and len(program.run_steps) == 1
    segment = program.segments[0]
    assert len(segment.members) == 6
    assert segment.accumulated == 1  # d accumulated over a: a dies at c3 and lives in a segment buffer
    # one arena by liveness: a and c live at once (d is written over a); p goes where c was, e
    # where a and d were: two [1, 8, 12, 12] float32 tensors' worth in all
    assert len(segment.buffers) == 1 and segment.planned_bytes == 2 * 8 * 12 * 12 * 4
    for seed in range(3):
        x = torch.randn(1, 8, 12, 12, generator=torch.Generator().manual_seed(seed))
        with torch.inference_mode():
            got = program.run([x])[0]
        assert_close(got, _want(spec, weights, x)[0])


def test_layer_by_layer_copy_sees_every_layer_and_agrees():
    spec, weights = _network()
    program = Program(spec, weights)
    seen = []
    traced = program.with_kernels(lambda i, fn: (lambda ctx, *a, **k: seen.append(i) or fn(ctx, *a, **k)))
    x = torch.randn(1, 8, 12, 12)
    with torch.inference_mode():
        got, whole = traced.run([x])[0], program.run([x])[0]
    assert seen == list(range(6))
    assert_close(got, _want(spec, weights, x)[0])
    assert_close(whole, _want(spec, weights, x)[0])


def test_values_read_after_the_segment_are_fresh_tensors_each_run():
    """'a' and 'e' leave the segment (program outputs): a second run must not write over what the
    first returned, and a value that leaves is not accumulated over."""
    spec, weights = _network(outputs=("out", "a", "e"))
    program = Program(spec, weights)
    assert program.segments[0].accumulated == 0  # 'a' is read after: c3 reads it with the binary post-op
    with torch.inference_mode():
        first = program.run([torch.randn(1, 8, 12, 12)])
        kept = [t.clone() for t in first]
        second = program.run([torch.randn(1, 8, 12, 12)])
    for a, b in zip(first, kept):
        assert torch.equal(a, b)
    assert not torch.allclose(second[0], kept[0])
    x = torch.randn(1, 8, 12, 12)
    for g, w in zip(_run(spec, weights, x), _want(spec, weights, x)):
        assert_close(g, w)


def test_other_input_sizes_run_layer_by_layer():
    spec, weights = _network()
    x = torch.randn(1, 8, 16, 16)  # planned for 12x12
    assert_close(_run(spec, weights, x)[0], _want(spec, weights, x)[0])


def test_inputs_in_either_layout_and_a_layer_between_segments():
    """A non-native layer (Relu) splits the run in two; the second segment reads a value of the
    first through it, and the first's input arrives NCHW or NHWC."""
    spec, weights = _network()
    steps = list(spec.steps)
    steps[2] = dataclasses.replace(steps[2], inputs=["cr", "w3", "", "a"])
    steps.insert(2, StepSpec("Relu", "between", ["c"], ["cr"]))
    spec = dataclasses.replace(spec, steps=steps)
    program = Program(spec, weights)
    assert [len(s.members) for s in program.segments] == [2, 4]
    assert program.segments[1].accumulated == 0  # 'a' is an entry of the second: never written over
    for layout in (torch.contiguous_format, CL):
        x = torch.randn(1, 8, 12, 12).contiguous(memory_format=layout)
        with torch.inference_mode():
            got = program.run([x])[0]
        assert_close(got, _want(spec, weights, x)[0])


def test_two_threads_share_one_program():
    spec, weights = _network()
    program = Program(spec, weights)
    inputs = [torch.randn(1, 8, 12, 12, generator=torch.Generator().manual_seed(s)) for s in range(8)]
    wants = [_run(_reference(spec), weights, x)[0] for x in inputs]
    assert _wrong_on_two_threads(program, inputs, 20, lambda got, k: torch.allclose(got, wants[k], rtol=1e-4,
                                                                                  atol=1e-5)) == []


def _wrong_on_two_threads(program: Program, inputs: list[torch.Tensor], rounds: int, right) -> list[int]:
    """Two threads running `program` at once, `rounds` times over their halves of `inputs` (alternate ones): the
    indices whose output `right(got, k)` rejected."""
    problems = []

    def work(offset):
        with torch.inference_mode():
            for _ in range(rounds):
                for k in range(offset, len(inputs), 2):
                    if not right(program.run([inputs[k]])[0], k):
                        problems.append(k)

    threads = [threading.Thread(target=work, args=(o,)) for o in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return problems


def _two_segments() -> tuple[ProgramSpec, dict]:
    """x -> a -> b -> c (3x3 convolutions) | Relu | cr -> d -> e -> out: two segments, each with two values that
    live and die inside it (a, b; d, e) and one it hands on."""
    g = torch.Generator().manual_seed(7)
    weights = {f"w{i}": torch.randn(8, 8, 3, 3, generator=g) * 0.2 for i in range(6)}
    chain = ["x", "a", "b", "c", "cr", "d", "e", "out"]
    steps = [_conv(f"c{i}", chain[i], f"w{i}", chain[i + 1], [1, 8, 12, 12]) for i in range(3)]
    steps.append(StepSpec("Relu", "between", ["c"], ["cr"]))
    steps += [_conv(f"c{i}", chain[i + 1], f"w{i}", chain[i + 2], [1, 8, 12, 12]) for i in range(3, 6)]
    return ProgramSpec(["x"], ["out"], steps, {k: k for k in weights}), weights


def test_the_segments_of_a_program_share_one_arena_and_one_lock():
    """The second segment plans its values into the memory the first planned its own into (the arena is as large
    as the larger plan, not the sum; kiln/runtime/native_arena.py), and two threads running the program at once
    still get the reference: the segments run one at a time."""
    spec, weights = _two_segments()
    program = Program(spec, weights)
    first, second = program.segments
    assert [len(s.members) for s in (first, second)] == [3, 3]
    value = 8 * 12 * 12 * 4
    assert first.planned_bytes == second.planned_bytes == 2 * value  # a and b; d and e
    assert first.buffers[0].data_ptr() == second.buffers[0].data_ptr() and first._lock is second._lock
    inputs = [torch.randn(1, 8, 12, 12, generator=torch.Generator().manual_seed(s)) for s in range(6)]
    wants = [_want(spec, weights, x)[0] for x in inputs]

    def right(got, k):
        return (got.double() - wants[k]).abs().max().item() <= ATOL + RTOL * wants[k].abs().max().item()

    assert _wrong_on_two_threads(program, inputs, 10, right) == []


def test_segments_whose_shared_arena_cannot_be_mapped_plan_arenas_of_their_own(monkeypatch):
    """A shared arena is as large as the most any one segment could need; where that much address space is refused,
    each segment gets its own (as large as its plan) and the program still gets the reference."""
    from kiln.runtime import native_arena

    def refused(numel, *args, **kwargs):
        raise RuntimeError(f"DefaultCPUAllocator: can't allocate memory: you tried to allocate {numel * 4} bytes")

    monkeypatch.setattr(native_arena, "hugepages", types.SimpleNamespace(empty=refused))  # the shared arena's only
    spec, weights = _two_segments()
    program = Program(spec, weights)
    first, second = program.segments
    assert first.buffers[0].data_ptr() != second.buffers[0].data_ptr() and first._lock is not second._lock
    x = torch.randn(1, 8, 12, 12)
    assert_close(_run(spec, weights, x)[0], _want(spec, weights, x)[0])


def test_segments_can_be_switched_off(monkeypatch):
    spec, weights = _network()
    monkeypatch.setenv("KILN_NATIVE_SEGMENTS", "0")
    program = Program(spec, weights)
    assert program.segments == [] and program.run_steps is program.steps


def test_a_shape_that_does_not_chain_ends_the_run():
    """c2 was built for another size than c1's output: no segment spans them."""
    spec, weights = _network()
    steps = list(spec.steps)
    steps[1] = dataclasses.replace(steps[1], tactic_config={"input_size": [1, 8, 16, 16], "residual": False})
    program = Program(dataclasses.replace(spec, steps=steps), weights)
    assert all(program.steps[1] not in s.members for s in program.segments)
    assert all(isinstance(s, Segment) for s in program.segments)


# ---- the classifier head: Reshape as an alias, FusedGemm as a oneDNN inner product ----------------

def _head(end: str) -> tuple[ProgramSpec, dict]:
    """_network's gap [1,16,1,1] -> Reshape [1,16] (an alias) -> FusedGemm [1,10]; end "gemm":
    the Gemm's result is the output; "alias": the Reshape's is (the Gemm is not there)."""
    spec, weights = _network()
    g = torch.Generator().manual_seed(9)
    weights |= {"shape": torch.tensor([1, 16]), "wg": torch.randn(10, 16, generator=g) * 0.3,
                "bg": torch.randn(10, generator=g)}
    steps = list(spec.steps) + [StepSpec("Reshape", "flat", ["out", "shape"], ["flat"], tactic="cpu.alias.Reshape",
                                         tactic_config={"input_size": [1, 16, 1, 1]})]
    outputs = ["flat"]
    if end == "gemm":
        steps.append(StepSpec("FusedGemm", "fc", ["flat", "wg", "bg"], ["logits"],
                              {"activation": "Sigmoid", "residual_after_activation": 1}, domain="kiln",
                              tactic="cpu.gemm.onednn_direct",
                              tactic_config={"input_size": [1, 16], "residual": False}))
        outputs = ["logits"]
    return ProgramSpec(["x"], outputs, steps, {k: k for k in weights}), weights


@pytest.mark.parametrize("end", ["gemm", "alias"])
def test_the_head_joins_the_segment(end):
    spec, weights = _head(end)
    program = Program(spec, weights)
    assert len(program.segments) == 1 and len(program.run_steps) == 1
    assert program.segments[0].aliased == 1
    for seed in range(2):
        x = torch.randn(1, 8, 12, 12, generator=torch.Generator().manual_seed(seed))
        with torch.inference_mode():
            first = program.run([x])[0]
            kept = first.clone()
            program.run([torch.randn(1, 8, 12, 12)])
        assert first.shape == ((1, 10) if end == "gemm" else (1, 16))
        assert torch.equal(first, kept)  # the output is the caller's: not written by the next run
        assert_close(first, _want(spec, weights, x)[0])


def test_an_alias_over_a_value_read_later_is_not_in_the_segment():
    """'out' is read by the Reshape and is also an engine output: a view of it cannot live in a
    segment buffer, so the Reshape runs as an ordinary step."""
    spec, weights = _head("gemm")
    spec = dataclasses.replace(spec, outputs=["logits", "out"])
    program = Program(spec, weights)
    assert [len(s.members) for s in program.segments] == [6]
    x = torch.randn(1, 8, 12, 12)
    for got, want in zip(_run(spec, weights, x), _want(spec, weights, x)):
        assert_close(got, want)


@pytest.mark.parametrize("grid", [[1, 3, 4, 16], [1, 12, 16]])
def test_rows_reshaped_to_4d_stay_rows(grid):
    """A row-major LayerNorm [1, 12, 16] reshaped to Swin's token grid [1, 3, 4, 16]: a segment lays a 4-D value
    out channels-last, so that Reshape is no alias there (the output keeps its rows); to 3-D it is."""
    g = torch.Generator().manual_seed(21)
    weights = {"scale": torch.randn(16, generator=g), "bias": torch.randn(16, generator=g),
               "grid": torch.tensor(grid), "w": torch.randn(16, 16, generator=g) * 0.3}
    steps = [StepSpec("FusedGemm", "fc", ["x", "w"], ["h"], {}, domain="kiln", tactic="cpu.gemm.kiln_packed",
                      tactic_config={"input_size": [1, 12, 16], "residual": False}),
             StepSpec("LayerNorm", "ln", ["h", "scale", "bias"], ["y"], {"epsilon": 1e-5}, domain="kiln",
                      tactic="cpu.layernorm.native", tactic_config={"input_sizes": [[0, [1, 12, 16]]]}),
             StepSpec("Reshape", "to_grid", ["y", "grid"], ["out"], tactic="cpu.alias.Reshape",
                      tactic_config={"input_size": [1, 12, 16]})]
    spec = ProgramSpec(["x"], ["out"], steps, {k: k for k in weights})
    program = Program(spec, weights)
    assert [s.aliased for s in program.segments] == [0 if len(grid) == 4 else 1]
    x = torch.randn(1, 12, 16, generator=g)
    with torch.inference_mode():
        got = program.run([x])[0]
    want = torch.nn.functional.layer_norm(x @ weights["w"].T, (16,), weights["scale"], weights["bias"], 1e-5)
    assert_close(got, want.reshape(grid))


@pytest.mark.parametrize("activation,after,residual", [("", 1, False), ("Relu", 1, True), ("Tanh", 0, True),
                                                       ("Gelu", 1, False)])
def test_inner_product_matches_float64(activation, after, residual):
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(24, 40, generator=g) * 0.2, torch.randn(24, generator=g)
    step = StepSpec("FusedGemm", "fc", ["x", "w", "b"] + (["r"] if residual else []), ["y"],
                    {"activation": activation, "residual_after_activation": after}, domain="kiln",
                    tactic="cpu.gemm.onednn_direct", tactic_config={"input_size": [3, 40], "residual": residual})
    spec = ProgramSpec(["x"] + (["r"] if residual else []), ["y"], [step], {"w": "w", "b": "b"})
    program = Program(spec, {"w": w, "b": b})
    for rows in (3, 5):  # the tuned row count, and another (built on first use)
        x = torch.randn(rows, 40, generator=g)
        inputs = [x] + ([torch.randn(rows, 24, generator=g)] if residual else [])
        with torch.inference_mode():
            got = program.run(inputs)[0]
        with torch.inference_mode():
            want = Program(_reference(spec), {"w": w.double(), "b": b.double()}).run([t.double() for t in inputs])[0]
        assert_close(got, want)


def test_alias_and_inner_product_refuse_what_they_cannot_run():
    from kiln.tactics import registry
    from kiln.tactics.tactic import InputMeta

    alias = registry.get("cpu.alias.Reshape")
    step = StepSpec("Reshape", "r", ["x", "shape"], ["y"])
    meta = lambda shape, constant=False: InputMeta(shape=shape, dtype=torch.float32, constant=constant)  # noqa: E731
    assert alias.check(step, [meta([1, 16, 1, 1]), meta([2], True)]) is True
    assert "channels-last" in alias.check(step, [meta([1, 16, 2, 2]), meta([2], True)])
    assert "constant" in alias.check(step, [meta([1, 16, 1, 1]), meta([2])])
    gemm = registry.get("cpu.gemm.onednn_direct")
    fc = StepSpec("FusedGemm", "fc", ["x", "w"], ["y"], {"activation": "SwiGLU"}, domain="kiln")
    assert "SwiGLU" in gemm.check(fc, [meta([2, 8]), meta([6, 8], True)])
    fc.attributes = {}
    assert gemm.check(fc, [meta([2, 3, 8]), meta([6, 8], True)]) is True  # a batch of rows: [B, S, K]
    assert "batch of rows" in gemm.check(fc, [meta([2, 3, 4, 8]), meta([6, 8], True)])
    assert gemm.check(fc, [meta([2, 8]), meta([6, 8], True)]) is True


# ---- the loop in C, and its fallback ------------------------------------------------------------

@pytest.mark.parametrize("compiled", [True, False])
def test_the_c_loop_and_the_python_loop_agree(compiled, monkeypatch):
    if compiled and native_loop.load() is None:
        pytest.skip(f"no compiled loop here: {native_loop.reason()}")
    if not compiled:
        monkeypatch.setattr(native_loop, "load", lambda: None)
    spec, weights = _head("gemm")
    program = Program(spec, weights)
    segment = program.segments[0]
    assert (segment._c is not None) == compiled
    for layout in (torch.contiguous_format, CL):  # NCHW: the reorder heads the loop; NHWC: read in place
        x = torch.randn(1, 8, 12, 12).contiguous(memory_format=layout)
        with torch.inference_mode():
            got = program.run([x])[0]
        assert_close(got, _want(spec, weights, x)[0])


@pytest.fixture
def fresh_loop(monkeypatch, tmp_path):
    """native_loop as in a new process, its cache in tmp_path: load() builds (or refuses) anew."""
    monkeypatch.setattr(native_loop, "_LOADED", None)
    monkeypatch.setattr(native_loop, "_REASON", None)
    monkeypatch.setenv("KILN_CACHE", str(tmp_path))
    return native_loop


needs_compiler = pytest.mark.skipif(native_loop.find_compiler() is None,
                                    reason="no C compiler on this machine: segments loop in Python")


def test_the_loop_is_not_built_when_switched_off(fresh_loop, monkeypatch):
    monkeypatch.setenv("KILN_NATIVE_LOOP", "0")
    assert fresh_loop.load() is None and fresh_loop.reason() == "KILN_NATIVE_LOOP=0"


@needs_compiler
def test_the_loop_compiles_into_the_cache(fresh_loop, tmp_path):
    assert fresh_loop.load() is not None, fresh_loop.reason()
    assert len(list((tmp_path / "native").glob("segment_loop-*.so"))) == 1


# ---- the engine's fast path for fixed-shape CPU engines ------------------------------------------

def test_engine_fast_path_agrees_and_bad_feeds_still_get_the_general_checks(tmp_path):
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    import kiln
    from kiln.errors import BindingError

    rng = np.random.default_rng(1)
    w = numpy_helper.from_array(rng.standard_normal((8, 4, 3, 3)).astype(np.float32) * 0.3, "w")
    graph = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
                               helper.make_node("Relu", ["c"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 6, 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 6, 6])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    engine = kiln.build(model.SerializeToString())
    context = engine.create_execution_context()
    assert context._static is not None
    x = rng.standard_normal((1, 4, 6, 6)).astype(np.float32)
    fast = engine.run({"x": x})["y"]
    context._static = None  # the general path
    general = context.run({"x": x})["y"]
    np.testing.assert_array_equal(fast, general)
    weight = torch.tensor(numpy_helper.to_array(w), dtype=torch.float64)
    want = np.maximum(torch.nn.functional.conv2d(torch.from_numpy(x).double(), weight, padding=1).numpy(), 0)
    assert np.abs(fast - want).max() <= 1e-5 * np.abs(want).max()
    np.testing.assert_allclose(engine.run({"x": x[:, :, :, ::-1].copy()[:, :, :, ::-1]})["y"], fast, rtol=1e-6)
    with pytest.raises(BindingError, match="expected dtype float"):
        engine.run({"x": x.astype(np.float64)})
    with pytest.raises(BindingError, match="axis 2 must be 6"):
        engine.run({"x": np.zeros((1, 4, 5, 6), np.float32)})
    with pytest.raises(BindingError, match="missing input"):
        engine.run({"y": x})


def test_an_engine_that_is_one_segment_runs_numpy_in_numpy_out(monkeypatch):
    """Conv -> Relu -> Conv: one segment from the input to the output (a 4-D NCHW-shaped numpy
    array over NHWC memory); results equal the torch path's and the float64 oracle, and belong to
    the caller."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    import kiln
    from kiln.builder import autotune

    rng = np.random.default_rng(4)
    w1 = rng.standard_normal((8, 4, 3, 3)).astype(np.float32) * 0.3
    w2 = rng.standard_normal((6, 8, 1, 1)).astype(np.float32) * 0.3
    graph = helper.make_graph([helper.make_node("Conv", ["x", "w1"], ["c"], pads=[1, 1, 1, 1]),
                               helper.make_node("Relu", ["c"], ["r"]),
                               helper.make_node("Conv", ["r", "w2"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 6, 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 6, 6, 6])],
                              [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    monkeypatch.setattr(autotune, "measure", lambda fns, device, runs=10, **_: {
        k: 0.0 if k == CONV else 1.0 for k in fns})
    engine = kiln.build(model.SerializeToString())
    context = engine.create_execution_context()
    assert context._whole_segment is not None
    x1, x2 = (rng.standard_normal((1, 4, 6, 6)).astype(np.float32) for _ in range(2))
    first = context.run({"x": x1})["y"]
    kept = first.copy()
    second = context.run({"x": x2})["y"]
    assert isinstance(first, np.ndarray) and first.shape == (1, 6, 6, 6) and first.dtype == np.float32
    np.testing.assert_array_equal(first, kept)
    whole, context._whole_segment = context._whole_segment, None
    np.testing.assert_array_equal(context.run({"x": x2})["y"], second)  # the torch path agrees
    context._whole_segment = whole
    c = F.conv2d(torch.from_numpy(x1).double(), torch.from_numpy(w1).double(), padding=1).relu()
    assert_close(torch.from_numpy(first), F.conv2d(c, torch.from_numpy(w2).double()))


@needs_compiler
def test_the_loop_builds_with_the_flags_the_compiler_takes(fresh_loop, monkeypatch, tmp_path):
    monkeypatch.setattr(native_loop, "FLAGS", (("--no-such-flag-kiln",), ("-O2",)))
    assert native_loop.load() is not None, native_loop.reason()
    monkeypatch.setattr(native_loop, "_LOADED", None)
    monkeypatch.setattr(native_loop, "FLAGS", (("--no-such-flag-kiln",),))
    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "other"))
    assert native_loop.load() is None and "failed" in native_loop.reason()


def test_a_transformer_ffn_runs_as_a_native_segment_of_two_inner_products():
    """[B, S, K] rows through FusedGemm(GELU) -> FusedGemm, both on oneDNN inner products bound in one
    segment, against onnxruntime at the tuned shape and at another sequence length."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    import kiln

    rng = np.random.default_rng()
    w1 = numpy_helper.from_array(rng.standard_normal((16, 32)).astype(np.float32) * 0.2, "w1")
    b1 = numpy_helper.from_array(rng.standard_normal(32).astype(np.float32), "b1")
    w2 = numpy_helper.from_array(rng.standard_normal((32, 16)).astype(np.float32) * 0.2, "w2")
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Add", ["h", "b1"], ["hb"]),
             helper.make_node("Relu", ["hb"], ["a"]), helper.make_node("MatMul", ["a", "w2"], ["y"])]
    graph = helper.make_graph(nodes, "ffn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "s", 16])], [w1, b1, w2])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    engine = kiln.build(model, profiles=[{"x": "1x1x16,2x8x16,4x32x16"}], tactics=["cpu.gemm.onednn_direct"])
    steps = engine.plan.program.steps
    if not all(s.tactic == "cpu.gemm.onednn_direct" for s in steps if s.op_type == "FusedGemm"):
        pytest.skip("the tuner kept a default GEMM on this machine (timed faster)")
    assert len(engine.program.segments) == 1
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    for shape in ((2, 8, 16), (3, 21, 16)):
        x = rng.standard_normal(shape, dtype=np.float32)
        np.testing.assert_allclose(engine.run({"x": x})["y"], session.run(None, {"x": x})[0], rtol=1e-4, atol=1e-4)
