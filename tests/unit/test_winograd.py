"""cpu.conv.winograd (kiln/kernels/cpu/winograd.py): Winograd F(2x2, 3x3) against float64 torch.

The transforms run in kiln's compiled native code (a C compiler at first use); without it the
tactic is unavailable and these tests skip, saying why.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F

from kiln.kernels.cpu import native_loop, winograd
from kiln.plan.spec import ProgramSpec, StepSpec
from kiln.runtime.program import Program
from kiln.tactics import registry
from kiln.tactics.tactic import InputMeta

pytestmark = pytest.mark.skipif(not winograd.available(), reason=f"no native code: {native_loop.reason()}")

NAME = "cpu.conv.winograd"
RTOL, ATOL = 2e-5, 1e-6  # float32 against float64, relative to the output's scale
CL = torch.channels_last


def assert_close(got: torch.Tensor, want64: torch.Tensor) -> None:
    assert got.dtype == torch.float32 and got.shape == want64.shape
    scale = want64.abs().max().item()
    error = (got.double() - want64).abs().max().item()
    assert error <= ATOL + RTOL * scale, f"max abs error {error:.3g} at scale {scale:.3g}"


def oracle(x, w, b, r, activation, alpha, beta, after):
    y = F.conv2d(x.double(), w.double(), None if b is None else b.double(), padding=1)
    if r is not None and not after:
        y = y + r.double()
    y = {"": y, "Relu": y.relu(), "Clip": y.clamp(alpha, beta)}[activation]
    return y + r.double() if r is not None and after else y


CASES = [  # (n, c, k, h, w, activation, bias, residual, after)
    (1, 8, 16, 6, 6, "Relu", True, False, False),
    (1, 64, 64, 14, 14, "Relu", True, True, True),  # ResNet's: relu(conv + b) + r would be after=1
    (2, 5, 7, 7, 9, "", False, False, False),  # odd sizes: the last tile row and column half outside
    (1, 70, 130, 5, 3, "Clip", True, True, False),  # channels not a multiple of the 64-wide blocks
    (1, 3, 4, 1, 1, "Relu", True, False, False),  # one pixel: all of the 4x4 patch but its centre is padding
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[1]}x{c[3]}x{c[4]}-{c[5] or 'none'}" for c in CASES])
def test_matches_float64_convolution(case):
    n, c, k, h, w, activation, bias, residual, after = case
    g = torch.Generator().manual_seed(7)
    wt = torch.randn(k, c, 3, 3, generator=g) / (9 * c) ** 0.5
    b = torch.randn(k, generator=g) if bias else None
    conv = winograd.WinogradConv(wt, b, [n, c, h, w], activation, 0.0, 0.5, residual, after)
    for _ in range(2):  # fresh inputs each time; the scratch is reused
        x = torch.randn(n, c, h, w, generator=g).contiguous(memory_format=CL)
        r = torch.randn(n, k, h, w, generator=g).contiguous(memory_format=CL) if residual else None
        got = conv(x, r)
        assert got.is_contiguous(memory_format=CL)
        assert_close(got, oracle(x, wt, b, r, activation, 0.0, 0.5, after))


def test_weight_transform_is_g_w_gt():
    w = torch.randn(3, 2, 3, 3, dtype=torch.float64)
    u = winograd.transform_weights(w)
    g = torch.tensor([[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]], dtype=torch.float64)
    for k in range(3):
        for c in range(2):
            want = (g @ w[k, c] @ g.T).reshape(16)
            torch.testing.assert_close(u[:, c, k].double(), want, rtol=1e-6, atol=1e-7)


def _step(attrs: dict, residual: bool = False) -> StepSpec:
    return StepSpec("FusedConv", "conv", ["x", "w", "b"] + (["r"] if residual else []), ["y"],
                    {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], **attrs}, domain="kiln")


def test_refuses_what_it_cannot_run():
    tactic = registry.get(NAME)

    def metas(c=16, k=16, kernel=3):
        return [InputMeta((1, c, 8, 8), torch.float32, False), InputMeta((k, c, kernel, kernel), torch.float32, True),
                InputMeta((k,), torch.float32, True)]

    assert tactic.check(_step({}), metas()) is True
    assert "stride 1" in tactic.check(_step({"strides": [2, 2]}), metas())
    assert "stride 1" in tactic.check(_step({"pads": [0, 0, 0, 0]}), metas())
    assert "stride 1" in tactic.check(_step({"kernel_shape": [5, 5], "pads": [2, 2, 2, 2]}), metas(kernel=5))
    assert "output transform" in tactic.check(_step({"activation": "Sigmoid"}), metas())
    assert "MiB" in tactic.check(_step({}), metas(c=512, k=512))  # 16 MiB of transformed weights


def test_in_a_program_alone_and_inside_a_native_segment():
    """conv3x3 (winograd) -> conv3x3 (winograd, + residual) -> conv1x1 (direct): one segment; the same
    program layer by layer; both against float64."""
    g = torch.Generator().manual_seed(3)
    weights = {"w1": torch.randn(16, 8, 3, 3, generator=g) * 0.2, "b1": torch.randn(16, generator=g),
               "w2": torch.randn(16, 16, 3, 3, generator=g) * 0.1, "w3": torch.randn(4, 16, 1, 1, generator=g) * 0.3}
    size1, size2 = [1, 8, 10, 10], [1, 16, 10, 10]
    steps = [
        StepSpec("FusedConv", "c1", ["x", "w1", "b1"], ["a"], {"pads": [1, 1, 1, 1], "kernel_shape": [3, 3],
                                                               "activation": "Relu"},
                 domain="kiln", tactic=NAME, tactic_config={"input_size": size1, "residual": False}),
        StepSpec("FusedConv", "c2", ["a", "w2", "", "a"], ["d"], {"pads": [1, 1, 1, 1], "kernel_shape": [3, 3],
                                                                 "activation": "Relu", "residual_after_activation": 1},
                 domain="kiln", tactic=NAME, tactic_config={"input_size": size2, "residual": True}),
        StepSpec("FusedConv", "c3", ["d", "w3"], ["y"], {"kernel_shape": [1, 1]}, domain="kiln",
                 tactic="cpu.conv.onednn_direct", tactic_config={"input_size": size2, "residual": False}),
    ]
    spec = ProgramSpec(["x"], ["y"], steps, {k: k for k in weights})
    program = Program(spec, weights)
    assert [len(s.members) for s in program.segments] == [3]
    layer_by_layer = program.with_kernels(lambda i, fn: fn)
    for seed in range(2):
        x = torch.randn(*size1, generator=torch.Generator().manual_seed(seed))
        a = F.conv2d(x.double(), weights["w1"].double(), weights["b1"].double(), padding=1).relu()
        d = F.conv2d(a, weights["w2"].double(), padding=1).relu() + a
        want = F.conv2d(d, weights["w3"].double())
        with torch.inference_mode():
            assert_close(program.run([x])[0], want)
            assert_close(layer_by_layer.run([x])[0], want)


def test_engine_with_winograd_layers_matches_onnxruntime(monkeypatch):
    """A small CNN whose 3x3 convs the autotuner is made to give to Winograd: the engine (one
    native segment) against onnxruntime."""
    from onnx import TensorProto, helper, numpy_helper

    import kiln
    from kiln.builder import autotune

    rng = np.random.default_rng(2)
    w1 = (rng.standard_normal((16, 3, 3, 3)) * 0.3).astype(np.float32)
    w2 = (rng.standard_normal((16, 16, 3, 3)) * 0.1).astype(np.float32)
    b2 = rng.standard_normal(16).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["c2", "r1"], ["s"]), helper.make_node("Relu", ["s"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 12, 12])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, 12, 12])],
                              [numpy_helper.from_array(a, n) for a, n in ((w1, "w1"), (w2, "w2"), (b2, "b2"))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    monkeypatch.setattr(autotune, "measure", lambda fns, device, runs=10, **_: {
        k: 0.0 if k == NAME else 1.0 for k in fns})
    engine = kiln.build(model.SerializeToString())
    assert [s.tactic for s in engine.plan.program.steps] == [NAME, NAME]
    assert len(engine.program.segments) == 1
    x = rng.standard_normal((1, 3, 12, 12)).astype(np.float32)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = engine.run({"x": x})["y"]
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max() + 1e-6


def _three_winograd_layers(seed: int = 5):
    """conv3x3 8->16 -> conv3x3 16->16 (+ residual) -> conv3x3 16->8, all Winograd, on 10x10: one segment whose
    members' scratch (V: 16·tiles·C, M: 16·tiles·K floats) are of three sizes, the second's the largest."""
    g = torch.Generator().manual_seed(seed)
    weights = {"w1": torch.randn(16, 8, 3, 3, generator=g) * 0.2, "b1": torch.randn(16, generator=g),
               "w2": torch.randn(16, 16, 3, 3, generator=g) * 0.1, "w3": torch.randn(8, 16, 3, 3, generator=g) * 0.1}
    size1, size2 = [1, 8, 10, 10], [1, 16, 10, 10]
    pads = {"pads": [1, 1, 1, 1], "kernel_shape": [3, 3]}
    steps = [
        StepSpec("FusedConv", "c1", ["x", "w1", "b1"], ["a"], {**pads, "activation": "Relu"}, domain="kiln",
                 tactic=NAME, tactic_config={"input_size": size1, "residual": False}),
        StepSpec("FusedConv", "c2", ["a", "w2", "", "a"], ["d"], {**pads, "activation": "Relu",
                                                                 "residual_after_activation": 1},
                 domain="kiln", tactic=NAME, tactic_config={"input_size": size2, "residual": True}),
        StepSpec("FusedConv", "c3", ["d", "w3"], ["y"], pads, domain="kiln", tactic=NAME,
                 tactic_config={"input_size": size2, "residual": False}),
    ]

    def want(x):
        a = F.conv2d(x.double(), weights["w1"].double(), weights["b1"].double(), padding=1).relu()
        d = F.conv2d(a, weights["w2"].double(), padding=1).relu() + a
        return F.conv2d(d, weights["w3"].double(), padding=1)

    return ProgramSpec(["x"], ["y"], steps, {k: k for k in weights}), weights, size1, want


def test_a_segments_winograd_layers_share_their_arenas_scratch():
    """Bound in a segment, every Winograd layer's V and M lie in its arena's scratch (SharedArena.scratch: they
    run one at a time under its lock), not in buffers of their own; a copy for another context
    (Program.with_own_arena) has a scratch of its own; the per-call path keeps its own. Outputs against float64,
    the two contexts running at once on two threads. The scratch (weakref) dies with the program."""
    spec, weights, size, want = _three_winograd_layers()
    program = Program(spec, weights)
    (segment,) = program.segments
    assert len(segment.bound) == 3
    scratch = segment.arena._scratch
    low, high = scratch.data_ptr(), scratch.data_ptr() + scratch.numel() * 4
    for b in segment.bound:
        for buffer in (b._v, b._m):
            assert low <= buffer.data_ptr() and buffer.data_ptr() + buffer.numel() * 4 <= high
    tiles = 25  # 5x5 tiles of 2x2 on 10x10
    assert scratch.numel() == 16 * tiles * (16 + 16)  # the largest member's V + M: c2's (16 -> 16)
    other = program.with_own_arena()
    (twin,) = other.segments
    assert twin.arena is not segment.arena and twin.arena._scratch.data_ptr() != scratch.data_ptr()

    inputs = [torch.randn(*size, generator=torch.Generator().manual_seed(k)) for k in range(6)]
    wanted = [want(x) for x in inputs]
    errors: list[BaseException] = []

    def runs(p):
        try:
            with torch.inference_mode():
                for _ in range(5):
                    for x, w in zip(inputs, wanted):
                        assert_close(p.run([x])[0], w)
        except BaseException as e:  # noqa: BLE001  raised in the main thread below
            errors.append(e)

    threads = [threading.Thread(target=runs, args=(p,)) for p in (program, other)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]

    convs = [b._conv for b in segment.bound]
    alone = program.with_kernels(lambda i, fn: fn)  # each layer's launch, alone: its per-call binding's scratch
    with torch.inference_mode():
        for x, w in zip(inputs[:2], wanted):  # the same arithmetic on scratch of their own: the same bits
            got = alone.run([x])[0]
            assert_close(got, w)
            assert torch.equal(got, program.run([x])[0])
    for conv in convs:
        assert conv._alone is not None and not low <= conv._alone._v.data_ptr() < high

    dead = weakref.ref(scratch)
    del scratch, segment, twin, program, other, alone, convs, conv, b, buffer, got  # no collection forced
    assert dead() is None
