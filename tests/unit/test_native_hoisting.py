"""Native segments with members reading several values (kiln's C kernels), and the steps that are not
native but sit between members: run before the segment when they depend on nothing it writes (an
exported mask's preparation), else the run ends there. Each program is checked against itself run
layer by layer (Program.with_kernels: no segments) and against numpy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln.kernels.cpu import transformer as kernels
from kiln.plan.spec import ProgramSpec, StepSpec
from kiln.runtime.native import Segment
from kiln.runtime.program import Program

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"kiln's C kernels: {kernels.reason()}")

N = 16


def layer_norm(name: str, x: str, out: str, size: list[int], residual: str = "", total: str = "") -> StepSpec:
    """`total`: the sum x + residual as a second output (a pre-LN block's residual stream)."""
    config = {"input_sizes": [[0, size]] + ([[3, size]] if residual else [])}
    return StepSpec("LayerNorm", name, [x, "scale", "bias", residual], [out] + ([total] if total else []),
                    {"epsilon": 1e-5}, domain="kiln", tactic="cpu.layernorm.native", tactic_config=config)


def add(name: str, a: str, b: str, out: str, size: list[int]) -> StepSpec:
    return StepSpec("Add", name, [a, b], [out], tactic="cpu.add.native",
                    tactic_config={"input_sizes": [[0, size], [1, size]]})


def program(steps: list[StepSpec], outputs: list[str]) -> Program:
    weights = {"scale": torch.randn(N), "bias": torch.randn(N)}
    return Program(ProgramSpec(["x", "y"], outputs, steps, {"scale": "scale", "bias": "bias"}), weights)


def numpy_ln(x: np.ndarray, scale: np.ndarray, bias: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5) * scale + bias


def test_an_independent_step_between_members_runs_before_the_segment():
    size = [3, N]
    steps = [layer_norm("ln0", "x", "a", size),
             StepSpec("Relu", "relu", ["y"], ["r"]),  # not native; reads only an input
             add("add", "a", "r", "s", size),
             layer_norm("ln1", "s", "z", size, residual="a")]
    p = program(steps, ["z"])
    assert [type(s.fn) for s in p.run_steps][1] is Segment and p.run_steps[0].ctx.op_type == "Relu"
    (segment,) = p.segments
    assert [m.ctx.name for m in segment.members] == ["ln0", "add", "ln1"]
    x, y = torch.randn(*size), torch.randn(*size)
    got = p.run([x, y])[0]
    alone = p.with_kernels(lambda i, fn: fn).run([x, y])[0]
    torch.testing.assert_close(got, alone, atol=1e-5, rtol=1e-5)
    # numpy: z = LN(LN(x) + relu(y) + LN(x))
    weights = [v.numpy() for v in p.template if isinstance(v, torch.Tensor)]  # scale, bias
    a = numpy_ln(x.numpy(), *weights)
    want = numpy_ln(a + np.maximum(y.numpy(), 0) + a, *weights)
    np.testing.assert_allclose(got.numpy(), want, atol=2e-5, rtol=1e-4)


def test_a_step_reading_the_run_ends_it():
    size = [2, N]
    steps = [layer_norm("ln0", "x", "a", size),
             StepSpec("Relu", "relu", ["a"], ["r"]),  # reads the run's value: the run ends before it
             add("add", "r", "y", "s", size),
             layer_norm("ln1", "s", "z", size)]
    p = program(steps, ["z"])
    assert not p.segments or all(len(s.members) < 3 for s in p.segments)
    assert [s.ctx.op_type for s in p.run_steps][:2] == ["LayerNorm", "Relu"]
    x, y = torch.randn(*size), torch.randn(*size)
    torch.testing.assert_close(p.run([x, y])[0], p.with_kernels(lambda i, fn: fn).run([x, y])[0])


def test_a_step_freeing_a_value_the_run_reads_is_not_moved():
    # relu is the last reader of x, which ln0 (a member before it) reads too: moving relu before the
    # segment would free x before ln0 reads it
    size = [2, N]
    steps = [layer_norm("ln0", "x", "a", size),
             StepSpec("Relu", "relu", ["x"], ["r"]),
             add("add", "a", "r", "z", size)]
    p = program(steps, ["z"])
    x, y = torch.randn(*size), torch.randn(*size)
    torch.testing.assert_close(p.run([x, y])[0], p.with_kernels(lambda i, fn: fn).run([x, y])[0])
    for s in p.run_steps:
        if isinstance(s.fn, Segment):
            assert "relu" not in [m.ctx.name for m in s.fn.members]


def test_members_of_other_sizes_bind_a_segment_of_their_own():
    size = [3, N]
    steps = [layer_norm("ln0", "x", "a", size), add("add", "a", "y", "s", size),
             layer_norm("ln1", "s", "z", size, residual="a")]
    p = program(steps, ["z"])
    (segment,) = p.segments
    for rows in (1, 5, 3):
        x, y = torch.randn(rows, N), torch.randn(rows, N)
        torch.testing.assert_close(p.run([x, y])[0], p.with_kernels(lambda i, fn: fn).run([x, y])[0])
    assert {key[0] for key, other in segment.resized.items() if other is not None} >= {(1, N), (5, N)}


def test_pre_ln_norms_with_the_sum_as_a_second_output_are_members():
    """Pre-LN blocks: s0 = x + y, a = LN(s0); s1 = s0 + a (the block's residual), z = LN(s1). Each norm
    writes both outputs; the sums are read by later members and s1 after the segment, at the tuned size
    and at others (views over the template's memory)."""
    size = [3, N]
    steps = [layer_norm("ln0", "x", "a", size, residual="y", total="s0"),
             add("add", "a", "s0", "b", size),
             layer_norm("ln1", "b", "z", size, residual="s0", total="s1")]
    p = program(steps, ["z", "s1"])
    (segment,) = p.segments
    assert [m.ctx.name for m in segment.members] == ["ln0", "add", "ln1"]
    weights = [v.numpy() for v in p.template if isinstance(v, torch.Tensor)]  # scale, bias
    for rows in (3, 1, 7, 3):
        x, y = torch.randn(rows, N), torch.randn(rows, N)
        z, s1 = p.run([x, y])
        alone = p.with_kernels(lambda i, fn: fn).run([x, y])
        torch.testing.assert_close(z, alone[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(s1, alone[1], atol=1e-5, rtol=1e-5)
        s0 = x.numpy() + y.numpy()
        a = numpy_ln(s0, *weights)
        want_s1 = a + s0 + s0
        np.testing.assert_allclose(s1.numpy(), want_s1, atol=2e-5, rtol=1e-4)
        np.testing.assert_allclose(z.numpy(), numpy_ln(want_s1, *weights), atol=2e-5, rtol=1e-4)
    assert set(segment.exits) == set(p.output_slots)
    assert all(other is not None for other in segment.resized.values()) and len(segment.resized) == 2  # 1, 7 rows
