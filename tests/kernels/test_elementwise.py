"""The generated elementwise kernels against kiln's own torch evaluation of the same program
(kiln.ops.fused.elementwise, one torch call per line) on fp32 copies of the inputs."""

import math

import pytest
import torch

pytest.importorskip("triton")

from kiln.kernels.cuda.triton import compile_elementwise  # noqa: E402
from kiln.kernels.cuda.triton import elementwise as generator  # noqa: E402
from kiln.ops.fused import _ELEMENTWISE  # noqa: E402
from kiln.ops.fused import elementwise as torch_elementwise  # noqa: E402
from tests.kernels.tolerances import DTYPES, assert_close  # noqa: E402

# inputs drawn where each op is defined and well conditioned (log/sqrt/pow of positives, no 1/0)
DOMAIN = {"Log": (0.1, 4.0), "Sqrt": (0.0, 4.0), "Reciprocal": (0.5, 3.0), "Pow": (0.2, 3.0), "Div": (0.5, 3.0)}


def reference(code, inputs):
    """The program evaluated by torch in fp32, the oracle for every storage type."""
    return torch_elementwise(None, *[x.float() for x in inputs], code=code)


def draw(shape, dtype, low=-3.0, high=3.0, generator=None):
    return (torch.rand(shape, generator=generator) * (high - low) + low).to(dtype)


def test_every_kiln_elementwise_op_has_a_triton_form():
    assert set(generator.UNARY) | set(generator.BINARY) == set(_ELEMENTWISE)


@pytest.mark.parametrize("op", sorted(generator.UNARY))
def test_unary_op(op):
    x = draw((3, 85), torch.float32, *DOMAIN.get(op, (-4.0, 4.0)))  # 255 elements: a partial block
    code = [f"{op} i0"]
    assert_close(compile_elementwise(code, 1)(x), reference(code, [x]), torch.float32)


@pytest.mark.parametrize("op", sorted(generator.BINARY))
def test_binary_op_broadcasting(op):
    low, high = DOMAIN.get(op, (-4.0, 4.0))
    a, b = draw((5, 1, 7), torch.float32, low, high), draw((3, 1), torch.float32, *DOMAIN.get(op, (-4.0, 4.0)))
    if op == "Pow":  # integer and fractional exponents, negative bases with integer exponents
        a, b = draw((5, 1, 7), torch.float32, -3.0, 3.0), torch.tensor([[2.0], [3.0], [0.5]])
        a = torch.where(b.expand(5, 3, 7) == 0.5, a.abs(), a.expand(5, 3, 7))
    code = [f"{op} i0 i1"]
    out = compile_elementwise(code, 2)(a, b)
    assert out.shape == torch.broadcast_shapes(a.shape, b.shape)
    assert_close(out, reference(code, [a, b]), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bert_gelu_chain(dtype):
    """BERT's exported GELU after the dense layer's bias: 0.5·y·(1 + erf(y/√2)), y = x + bias."""
    x, bias = draw((2, 9, 48), dtype), draw((48,), dtype)
    sqrt2, one, half = torch.tensor(math.sqrt(2.0), dtype=dtype), torch.tensor(1.0, dtype=dtype), \
        torch.tensor(0.5, dtype=dtype)
    code = ["Add i0 i1", "Div t0 i2", "Erf t1", "Add t2 i3", "Mul t0 t3", "Mul t4 i4"]
    inputs = [x, bias, sqrt2, one, half]
    assert_close(compile_elementwise(code, 5)(*inputs), reference(code, inputs), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_op_in_one_chain(dtype):
    code = ["Mul i0 i1", "Add t0 i2", "Sigmoid t1", "Tanh i0", "Sub t2 t3", "Abs t4", "Sqrt t5", "Exp t6",
            "Log t7", "Pow t8 i2", "Max t9 i1", "Min t10 i0", "Neg t11", "Relu t12", "Gelu t13", "GeluTanh t14",
            "Sin t15", "Cos t16", "Erf t17", "Floor t18", "Ceil i1", "Add t19 t20", "Reciprocal t1", "Mul t21 t22"]
    inputs = [draw((4, 7, 9), dtype), draw((7, 1), dtype), draw((), dtype, 1.0, 2.0)]
    # 24 lines of fp32 rounding that differ in order from torch's compound up: 4x the tolerance.
    # Floor/Ceil are discontinuous; they act on erf(..) and on raw inputs, where a flip needs an
    # argument within fp32 noise of an integer (probability ~1e-6 per element).
    assert_close(compile_elementwise(code, 3)(*inputs), reference(code, inputs), dtype, scale=4.0)


@pytest.mark.parametrize("shapes", [
    [(), ()],                                   # every input a scalar: the result is broadcast to the block
    [(1,), (6, 5)],                             # one-element input
    [(4, 1, 6), (1, 5, 1)],                     # both inputs broadcast
    [(2, 3, 4, 5), (3, 1, 5), (5,)],            # mixed ranks
    [(2, 1, 2, 1, 2, 1, 2), (1, 2, 1, 2, 1, 2, 1)],  # 7 dims that cannot merge: the copy fallback
    [(0, 3), (3,)],                             # empty output
], ids=str)
def test_broadcasting(shapes):
    inputs = [draw(shape, torch.float32) for shape in shapes]
    code = ["Mul i0 i1"] + [f"Add t{k - 2} i{k}" for k in range(2, len(shapes))]
    out = compile_elementwise(code, len(shapes))(*inputs)
    assert out.shape == torch.broadcast_shapes(*shapes)
    assert_close(out, reference(code, inputs), torch.float32)


def test_non_contiguous_inputs():
    base = draw((8, 12), torch.float32)
    a = base.t()                  # transposed: [12, 8], strides (1, 12)
    b = draw((12, 16), torch.float32)[:, ::2]  # step-2 slice
    code = ["Sub i0 i1", "Tanh t0"]
    assert_close(compile_elementwise(code, 2)(a, b), reference(code, [a, b]), torch.float32)


def test_channels_last_stays_channels_last():
    x = draw((2, 6, 5, 3), torch.float16).to(memory_format=torch.channels_last)
    bias = draw((6, 1, 1), torch.float16)
    code = ["Add i0 i1", "Relu t0"]
    out = compile_elementwise(code, 2)(x, bias)
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert_close(out, reference(code, [x, bias]), torch.float16)


def test_dtype_promotion():
    half, single = draw((3, 4), torch.float16), draw((4,), torch.float32)
    assert compile_elementwise(["Add i0 i1"], 2)(half, single).dtype == torch.float32
    assert compile_elementwise(["Add i0 i1"], 2)(half, torch.tensor(2.0)).dtype == torch.float16  # 0-d: no vote


def test_special_values_match_torch():
    x = torch.tensor([0.0, -0.0, 1e-6, -1e-6, 0.15, 0.25, -0.3, 20.0, -20.0, 90.0, -90.0, float("inf"),
                      -float("inf"), float("nan")])
    for op in ("Relu", "Sigmoid", "Tanh", "Gelu", "GeluTanh", "Exp", "Erf", "Abs", "Neg"):
        out, expected = compile_elementwise([f"{op} i0"], 1)(x), reference([f"{op} i0"], [x])
        if op == "Gelu":  # torch's CPU kernel gives NaN for gelu(+inf); the limit, and the kernel, give +inf
            assert out[11] == float("inf")
            out, expected = out[:11], expected[:11]
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6, equal_nan=True, msg=op)
    base = torch.tensor([-2.0, -2.0, -2.0, 0.0, 0.0, 0.0, 1.0, 4.0, float("inf"), -1.5])
    exponent = torch.tensor([3.0, 2.0, 0.5, 2.0, -1.0, 0.0, float("nan"), 0.0, -1.0, 2.0])
    torch.testing.assert_close(compile_elementwise(["Pow i0 i1"], 2)(base, exponent), base.pow(exponent),
                               equal_nan=True)


def test_out_parameter():
    a, b = draw((5, 6), torch.float32), draw((6,), torch.float32)
    out = torch.empty(5, 6)
    assert compile_elementwise(["Max i0 i1"], 2)(a, b, out=out) is out
    assert_close(out, torch.maximum(a, b), torch.float32)


def test_generated_source_is_written_to_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("KILN_CACHE", str(tmp_path))
    code = ["Sub i0 i0", "Cos t0"]  # a program no other test compiles
    out = compile_elementwise(code, 1)(draw((9,), torch.float32))
    assert torch.equal(out, torch.ones(9))
    files = list((tmp_path / "triton").glob("elementwise_*.py"))
    assert len(files) == 1 and "tl.cos(t0)" in files[0].read_text()


@pytest.mark.parametrize("code, n_inputs, message", [
    (["Softplus i0"], 1, "no Triton form"),
    (["Add i0"], 1, "takes 2 operand"),
    (["Add i0 i2"], 2, "operand 'i2'"),
    (["Relu t0"], 1, "operand 't0'"),
    ([], 1, "empty program"),
])
def test_bad_programs_are_refused(code, n_inputs, message):
    with pytest.raises(ValueError, match=message):
        compile_elementwise(code, n_inputs)


def test_integer_inputs_are_refused():
    with pytest.raises(TypeError, match="int64"):
        compile_elementwise(["Add i0 i1"], 2)(torch.arange(4), torch.arange(4))
