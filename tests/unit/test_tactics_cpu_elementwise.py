"""kiln::Elementwise programs and Concat in kiln's C (kiln/tactics/cpu/elementwise.py) against independent
oracles on fresh random inputs: float64 numpy for every op of a program, numpy for Concat (exact), and each
tactic against the op's registered implementation (torch, float32), as the autotuner checks it.

Tolerances: one float32 op rounds once (0.5 ulp); glibc's float expf/logf/tanhf/erff/sinf/cosf/powf are
within 1-2 ulp, and a composite (sigmoid, GELU) adds a few roundings: 4e-6 relative + 1e-6 absolute against
float64 for one op. Against torch's float32 kernels over chains of up to 6 lines, whose own (vectorised)
transcendentals differ from glibc's by a few ulp that later lines carry: 1e-5 relative, 2e-6 absolute."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import special

from kiln.kernels.cpu import elementwise as kernels
from kiln.kernels.cpu import transformer
from tests.unit.test_tactics_cpu_transformer import prepared, refusal, t

pytestmark = pytest.mark.skipif(not transformer.available(), reason=f"kiln's C kernels: {transformer.reason()}")

rng = np.random.default_rng()

FLOAT64 = {
    "Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Div": np.divide, "Pow": np.power,
    "Max": np.maximum, "Min": np.minimum, "Neg": np.negative, "Abs": np.abs, "Exp": np.exp, "Log": np.log,
    "Sqrt": np.sqrt, "Reciprocal": np.reciprocal, "Relu": lambda x: np.maximum(x, 0.0),
    "Sigmoid": lambda x: 1.0 / (1.0 + np.exp(-x)), "Tanh": np.tanh, "Erf": special.erf, "Sin": np.sin,
    "Cos": np.cos, "Floor": np.floor, "Ceil": np.ceil,
    "Gelu": lambda x: 0.5 * x * (1.0 + special.erf(x / math.sqrt(2.0))),
    "GeluTanh": lambda x: 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3))),
}
POSITIVE = {"Log", "Sqrt", "Pow", "Reciprocal", "Div"}  # drawn in [0.5, 2.5] (the domain, away from poles)


def draw(shape: tuple[int, ...], positive: bool) -> np.ndarray:
    x = rng.uniform(0.5, 2.5, shape) if positive else rng.standard_normal(shape) * 2
    return x.astype(np.float32)


def elementwise(code: list[str], inputs: list[np.ndarray], constants: set[int] = frozenset()) -> torch.Tensor:
    """The program through cpu.elementwise.native's launch, checked equal to its native (segment) call."""
    tensors = [t(x) for x in inputs]
    launch, _, ctx = prepared("cpu.elementwise.native", "Elementwise", "kiln", tensors, {"code": code}, set(constants))
    got = launch(ctx, *tensors, code=code)
    if hasattr(launch, "timed"):  # the autotuner's bound call: the plan a segment runs
        kept = launch.timed(*tensors)()
        torch.testing.assert_close(kept[1][0], got, rtol=0, atol=0, equal_nan=True)
    return got


@pytest.mark.parametrize("op", kernels.OPS)
def test_each_op_over_broadcast_operands_matches_float64(op):
    shapes = [(3, 1, 5, 37), (4, 1, 37)] if op not in kernels.UNARY else [(2, 3, 300)]
    inputs = [draw(s, op in POSITIVE) for s in shapes]
    args = " ".join(f"i{k}" for k in range(len(shapes)))
    got = elementwise([f"{op} {args}"], inputs).numpy()
    want = FLOAT64[op](*[x.astype(np.float64) for x in inputs])
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=4e-6, atol=1e-6, err_msg=op)


def test_nan_propagates_through_relu_max_and_min_as_torch_s():
    x = draw((2, 40), False)
    x[0, 3] = np.nan
    y = draw((2, 40), False)
    for op in ("Relu", "Max", "Min"):
        code = [f"{op} i0" if op == "Relu" else f"{op} i0 i1"]
        got = elementwise(code, [x] if op == "Relu" else [x, y]).numpy()
        assert np.isnan(got[0, 3]) and np.isfinite(np.delete(got.ravel(), 3)).all(), op


def random_program(inputs: int, lines: int) -> list[str]:
    """A chain over `inputs` inputs whose every input is read and whose last line reads the one before it;
    only ops defined everywhere (no Log, Sqrt, Pow, Div: their domain would need the values tracked)."""
    safe = [op for op in kernels.OPS if op not in POSITIVE]
    binary = [op for op in safe if op not in kernels.UNARY]
    unary = [op for op in safe if op in kernels.UNARY]
    code, unread = [], list(range(inputs))
    for n in range(lines):
        prev = f"t{n - 1}" if n else f"i{unread.pop(0)}"
        if unread or rng.random() < 0.5:
            other = f"i{unread.pop(0)}" if unread else f"i{rng.integers(inputs)}"
            code.append(f"{rng.choice(binary)} {prev} {other}")
        else:
            code.append(f"{rng.choice(unary)} {prev}")
    while unread:
        code.append(f"Add t{len(code) - 1} i{unread.pop(0)}")
    return code


@pytest.mark.parametrize("case", range(8))
def test_random_programs_with_constants_match_the_registered_op(case):
    out = tuple(int(d) for d in rng.integers(1, 9, size=int(rng.integers(1, 4))))
    inputs, constants = [], set()
    for k in range(int(rng.integers(1, 5))):
        shape = tuple(d if rng.random() < 0.6 else 1 for d in out)[int(rng.integers(0, len(out))):]
        inputs.append(draw(shape if k else out, False))  # input 0 has y's shape: the broadcast is y's
        if k and rng.random() < 0.5:
            constants.add(k)
    code = random_program(len(inputs), int(rng.integers(1, 7)))
    got = elementwise(code, inputs, constants)
    tensors = [t(x) for x in inputs]
    _, reference, ctx = prepared("cpu.elementwise.native", "Elementwise", "kiln", tensors, {"code": code}, constants)
    want = reference(ctx, *tensors, code=code)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6, msg=f"{code} over {[x.shape for x in inputs]}")


def test_a_dcn_cross_layer_on_two_threads_matches_one():
    """x0 * (W x + b) + x past the kernel's grain, shared among the threads, then on one thread: exact."""
    x0, h, x = (draw((1100, 1024), False) for _ in range(3))
    code = ["Mul i0 i1", "Add t0 i2"]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = elementwise(code, [x0, h, x])
        torch.set_num_threads(1)
        one = elementwise(code, [x0, h, x])
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(two, one, rtol=0, atol=0)
    np.testing.assert_allclose(two.numpy(), x0.astype(np.float64) * h + x, rtol=1e-6, atol=1e-6)


def test_dims_every_operand_walks_contiguously_are_merged():
    pad = (1,) * (kernels.MAX_DIMS - 3)
    same = [transformer.broadcast_strides(s, pad + (4, 5, 6)) for s in [(4, 5, 6), (4, 5, 6)]]
    assert kernels.merged_dims(pad + (4, 5, 6), same)[0] == (1,) * 5 + (120,)
    bias = [transformer.broadcast_strides(s, pad + (4, 5, 6)) for s in [(4, 5, 6), (6,)]]
    dims, strides = kernels.merged_dims(pad + (4, 5, 6), bias)
    assert dims == (1,) * 4 + (20, 6) and strides[1][-2:] == (0, 1)
    channel = [transformer.broadcast_strides(s, pad + (4, 5, 6)) for s in [(4, 5, 6), (4, 1, 1)]]
    assert kernels.merged_dims(pad + (4, 5, 6), channel)[0] == (1,) * 4 + (4, 30)


def test_elementwise_refuses_what_it_cannot_run():
    x = t(draw((2, 3), False))
    assert "not one of kiln's C ops" in refusal("cpu.elementwise.native", "Elementwise", "kiln", [x],
                                                {"code": ["HardSigmoid i0"]}, set())
    assert "inputs" in refusal("cpu.elementwise.native", "Elementwise", "kiln", [x] * 9,
                               {"code": ["Add i0 i8"]}, set())
    assert "does not exist" in refusal("cpu.elementwise.native", "Elementwise", "kiln", [x],
                                       {"code": ["Add i0 t0"]}, set())
    ints = torch.ones(2, 3, dtype=torch.int64)
    assert refusal("cpu.elementwise.native", "Elementwise", "kiln", [x, ints], {"code": ["Add i0 i1"]}, set())


@pytest.mark.parametrize("axis", [0, 1, 2, -1])
@pytest.mark.parametrize("count", [1, 2, 8])
def test_concat_is_exact(axis, count):
    base = [int(d) for d in rng.integers(1, 7, size=3)]
    shapes = []
    for _ in range(count):
        s = list(base)
        s[axis] = int(rng.integers(1, 9))
        shapes.append(tuple(s))
    inputs = [t(draw(s, False)) for s in shapes]
    launch, reference, ctx = prepared("cpu.concat.native", "Concat", "", inputs, {"axis": axis}, set())
    got = launch(ctx, *inputs, axis=axis)
    np.testing.assert_array_equal(got.numpy(), np.concatenate([x.numpy() for x in inputs], axis=axis))
    torch.testing.assert_close(launch.timed(*inputs)()[1][0], got, rtol=0, atol=0)


def test_concat_refuses_what_it_cannot_run():
    x = t(draw((2, 3), False))
    assert "inputs" in refusal("cpu.concat.native", "Concat", "", [x] * (kernels.CONCAT_INPUTS + 1), {"axis": 1}, set())
    assert "constant" in refusal("cpu.concat.native", "Concat", "", [x, x], {"axis": 1}, {1})
    assert "differ off the axis" in refusal("cpu.concat.native", "Concat", "", [x, t(draw((3, 3), False))],
                                            {"axis": 1}, set())


def test_sigmoid_is_accurate_and_keeps_nan():
    """The vector σ (exp_poly's e^-x on 16 and 8 lanes, elementwise.c ew_sigmoid) against float64 over [-30, 30] at
    every tail length (n % 16, n % 8), relative to the value; NaN stays NaN, ±inf go to 1 and ~0 (below -87 e^-x is
    clamped: σ is 6e-39 there where float64's underflows, as gemm.c's σ epilogue)."""
    for n in (4003, 4000, 4008, 4015):
        x = np.linspace(-30, 30, n).astype(np.float32).reshape(1, -1)
        got = elementwise(["Sigmoid i0"], [x]).numpy().astype(np.float64)
        want = 1.0 / (1.0 + np.exp(-x.astype(np.float64)))
        np.testing.assert_allclose(got, want, rtol=3e-7, atol=0)
    edges = np.array([[np.nan, np.inf, -np.inf, -100.0, 100.0, 0.0, -87.5, 88.5] * 3], np.float32)
    got = elementwise(["Sigmoid i0"], [edges]).numpy()
    assert np.isnan(got[0, 0::8]).all() and (got[0, 1::8] == 1).all() and (got[0, 4::8] == 1).all()
    assert (got[0, 5::8] == 0.5).all() and (np.abs(got[0, [2, 3, 10, 11, 18, 19]]) < 1e-38).all()


def test_gelu_is_accurate_in_its_tails():
    """The vector Gelu (erfc form, elementwise.c ew_gelu) against float64 x·Φ(x) over [-12, 12], relative to the
    value itself, also where 0.5·x·(1 + erf(x/√2)) cancels (x < -4: torch's own float32 Gelu is 20% off at -5).
    2e-5: below -11 the exponent -z² is ~-65, whose float32 rounding (an ulp of 7.6e-6) is exp's relative error."""
    x = np.linspace(-12, 12, 4003).astype(np.float32).reshape(1, -1)
    got = elementwise(["Gelu i0"], [x]).numpy().astype(np.float64)
    xd = x.astype(np.float64)
    want = 0.5 * xd * special.erfc(-xd / math.sqrt(2.0))  # x·Φ(x), no cancellation
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-37)
    assert np.abs(got - want).max() < 2e-6
