"""Elementwise, activation and cast ops against an independent oracle, on fresh random inputs.

Each case builds a one-node ONNX model, runs it through `kiln.build(model).run(feeds)` and
through onnxruntime (CPU); where onnxruntime has no kernel for the op/type it falls back to
`onnx.reference.ReferenceEvaluator`. Tolerances are per dtype: integers, bools and strings
exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import kiln
from tests.unit.oracle import assert_close, case_rng, infer_outputs, one_node_model, run_oracle

# (rtol, atol) per output dtype; integers, bools and strings compare exactly.
TOLERANCE = {
    np.dtype(np.float64): (1e-12, 1e-12),
    np.dtype(np.float32): (1e-5, 1e-6),
    np.dtype(np.float16): (1e-3, 1e-3),
    np.dtype(ml_dtypes.bfloat16): (1e-2, 1e-2),  # 8-bit mantissa
}


@dataclass
class Case:
    id: str
    op: str
    inputs: list[tuple[str, tuple[int, ...], tuple[float, float]]]  # (dtype, shape, value range)
    attrs: dict[str, Any] = field(default_factory=dict)
    opset: int = 21
    specials: bool = False  # sprinkle nan/inf/ties into float inputs


F32, F16, I32, I64 = "float32", "float16", "int32", "int64"
S = (3, 4, 5)  # the usual shape
ANY = (-3.0, 3.0)
POS = (0.1, 5.0)
UNIT = (-0.99, 0.99)


def u(op, dtype=F32, rng=ANY, **kw):
    return Case(f"{op}-{dtype}-{kw.pop('tag', '')}", op, [(dtype, S, rng)], **kw)


def b(op, dtype=F32, rng=ANY, shape_b=(4, 5), rng_b=None, **kw):
    return Case(f"{op}-{dtype}-{kw.pop('tag', '')}", op, [(dtype, S, rng), (dtype, shape_b, rng_b or rng)], **kw)


CASES = [
    # arithmetic, broadcasting
    b("Add"), b("Sub", shape_b=(5,)), b("Mul", F16), b("Div", rng_b=POS),
    b("Add", I32, (-100, 100)), b("Add", "uint32", (0, 1000)), b("Sub", "uint64", (1000, 2000), rng_b=(0, 999)),
    b("Mul", "int8", (-10, 10)),
    b("Div", I32, (-50, 50), rng_b=(1, 7), tag="trunc"), b("Div", I64, (-50, 50), rng_b=(-7, -1), tag="neg"),
    b("Div", "uint16", (0, 500), rng_b=(1, 9)),
    b("Pow", F32, POS, rng_b=(-2, 2)), Case("Pow-f32-i64", "Pow", [(F32, S, ANY), (I64, (5,), (0, 3))]),
    Case("Pow-i32-f32", "Pow", [(I32, S, (0, 6)), (F32, (1,), (0, 2))]), b("Pow", I64, (-4, 4), rng_b=(0, 4)),
    b("Mod", I32, (-50, 50), rng_b=(1, 7), tag="py"), b("Mod", I64, (-50, 50), rng_b=(-7, -1), tag="pyneg"),
    b("Mod", I32, (-50, 50), rng_b=(1, 7), attrs={"fmod": 1}, tag="c"),
    b("Mod", F32, ANY, rng_b=POS, attrs={"fmod": 1}, tag="float"), b("Mod", "uint32", (0, 99), rng_b=(1, 9)),
    # variadic
    Case("Max-3", "Max", [(F32, S, ANY), (F32, (5,), ANY), (F32, (4, 1), ANY)]),
    Case("Min-3", "Min", [(I64, S, (-9, 9)), (I64, (1, 5), (-9, 9)), (I64, (), (-9, 9))]),
    Case("Max-1", "Max", [(F16, S, ANY)]), Case("Max-u64", "Max", [("uint64", S, (0, 99)), ("uint64", S, (0, 99))]),
    Case("Sum-3", "Sum", [(F32, S, ANY), (F32, (5,), ANY), (F32, S, ANY)]),
    Case("Mean-3", "Mean", [(F32, S, ANY), (F32, (4, 5), ANY), (F32, (1,), ANY)]),
    # unary math
    *[u(op) for op in ["Neg", "Abs", "Sign", "Exp", "Sin", "Cos", "Tan", "Atan", "Sinh", "Cosh", "Asinh",
                       "Ceil", "Floor", "Erf"]],
    *[u(op, rng=POS) for op in ["Sqrt", "Log", "Reciprocal"]],
    *[u(op, rng=UNIT) for op in ["Asin", "Acos", "Atanh"]],
    u("Acosh", rng=(1.0, 5.0)), u("Round", specials=True), u("Exp", F16), u("Abs", I32, (-99, 99)),
    u("Neg", "int8", (-99, 99)), u("Sign", I64, (-9, 9)),
    u("IsNaN", specials=True), u("IsInf", specials=True),
    u("IsInf", specials=True, attrs={"detect_negative": 0}, tag="pos"),
    u("IsInf", specials=True, attrs={"detect_positive": 0}, tag="neg"),
    # comparisons and logic
    *[b(op, tag="f") for op in ["Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual"]],
    *[b(op, I32, (-3, 3), tag="i") for op in ["Equal", "Less", "GreaterOrEqual"]],
    b("Less", "uint32", (0, 9)), b("Equal", "bool"),
    *[b(op, "bool") for op in ["And", "Or", "Xor"]], u("Not", "bool"),
    # bitwise
    *[b(op, dt, (0, 255)) for op in ["BitwiseAnd", "BitwiseOr", "BitwiseXor"] for dt in ["uint8", "int32", "uint64"]],
    u("BitwiseNot", "uint16", (0, 60000)), u("BitwiseNot", I32, (-99, 99)),
    *[b("BitShift", dt, (0, 200), rng_b=(0, 7), attrs={"direction": d}, tag=d)
      for dt in ["uint8", "uint32", "uint64"] for d in ["LEFT", "RIGHT"]],
    # Where, Clip
    Case("Where", "Where", [("bool", S, ANY), (F32, (4, 5), ANY), (F32, (3, 1, 1), ANY)]),
    Case("Where-i64", "Where", [("bool", (5,), ANY), (I64, S, (-9, 9)), (I64, (), (-9, 9))]),
    Case("Clip-11", "Clip", [(F32, S, ANY), (F32, (), (-1.5, -0.5)), (F32, (), (0.5, 1.5))], opset=13),
    Case("Clip-11-int", "Clip", [(I32, S, (-50, 50)), (I32, (), (-9, -1)), (I32, (), (1, 9))], opset=13),
    u("Clip", attrs={"min": -0.7, "max": 1.2}, opset=6, tag="attr"),
    u("Clip", opset=13, tag="nobounds"),
    # activations
    *[u(op) for op in ["Relu", "Sigmoid", "Tanh", "Softplus", "Softsign", "Mish", "HardSwish"]],
    u("Relu", F16), u("Sigmoid", F16), u("Tanh", F16),
    u("LeakyRelu", attrs={"alpha": 0.13}), u("Elu", attrs={"alpha": 0.7}), u("Selu"),
    u("Selu", attrs={"alpha": 1.5, "gamma": 0.9}, tag="attrs"), u("Celu", attrs={"alpha": 2.0}),
    u("Gelu", opset=20), u("Gelu", attrs={"approximate": "tanh"}, opset=20, tag="tanh"), u("Gelu", F16, opset=20),
    u("HardSigmoid", attrs={"alpha": 0.3, "beta": 0.4}), u("ThresholdedRelu", attrs={"alpha": 0.5}),
    u("Shrink", attrs={"bias": 0.3, "lambd": 0.8}), u("Shrink", "int8", (-9, 9), attrs={"bias": 1.0, "lambd": 2.0}),
    u("Swish", attrs={"alpha": 1.7}, opset=24),
    Case("PRelu", "PRelu", [(F32, S, ANY), (F32, (5,), (0.0, 0.5))], opset=16),
    Case("PRelu-i32", "PRelu", [(I32, S, (-9, 9)), (I32, (4, 1), (0, 3))], opset=16),
    Case("SwiGLU", "SwiGLU", [(F32, S, ANY), (F32, S, ANY)], attrs={"alpha": 1.3}, opset=28),
]

CAST_CASES = [
    (F32, TensorProto.FLOAT16, {}), (F32, TensorProto.DOUBLE, {}), (F32, TensorProto.INT32, {}),
    (F32, TensorProto.BOOL, {}), (F32, TensorProto.UINT8, {}), (F32, TensorProto.BFLOAT16, {}),
    (I64, TensorProto.FLOAT, {}), (I64, TensorProto.INT8, {}), (I32, TensorProto.UINT32, {}),
    ("bool", TensorProto.FLOAT, {}), ("float64", TensorProto.FLOAT16, {}),
    (F32, TensorProto.FLOAT8E4M3FN, {}), (F32, TensorProto.FLOAT8E5M2, {}),
    (F32, TensorProto.FLOAT8E4M3FN, {"saturate": 0}), (F16, TensorProto.FLOAT8E5M2FNUZ, {}),
    (F32, TensorProto.INT4, {}), (F32, TensorProto.UINT4, {}), (F32, TensorProto.FLOAT4E2M1, {}),
    (I32, TensorProto.STRING, {}), (F32, TensorProto.STRING, {}), ("float64", TensorProto.STRING, {}),
    ("bool", TensorProto.STRING, {}), ("string", TensorProto.FLOAT, {}), ("string", TensorProto.INT64, {}),
]


def _draw(rng: np.random.Generator, dtype: str, shape: tuple[int, ...], bounds, specials: bool) -> np.ndarray:
    low, high = bounds
    if dtype == "bool":
        return rng.random(shape) < 0.5
    if dtype == "string":
        return rng.integers(-99, 99, shape).astype(str).astype(object)
    np_dtype = np.dtype(dtype)
    if np_dtype.kind in "iu":
        return rng.integers(int(low), int(high), shape, endpoint=True).astype(np_dtype)
    x = rng.uniform(low, high, shape)
    if specials:  # nan, +-inf and round-half ties among the values
        flat = x.reshape(-1)
        flat[:6] = [np.nan, np.inf, -np.inf, 0.5, 2.5, -1.5]
        rng.shuffle(flat)
    return x.astype(np_dtype)


def _model(op: str, feeds: dict[str, np.ndarray], attrs: dict, opset: int) -> onnx.ModelProto:
    return infer_outputs(one_node_model(helper.make_node(op, list(feeds), ["y"], **attrs), feeds, opset=opset))


def _oracle(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    """onnxruntime where it has the kernel, else the ONNX reference evaluator."""
    try:
        return run_oracle(model, feeds, "ort")[0]
    except Exception:  # noqa: BLE001  (no ORT kernel for this op/type/opset, or no numpy type for
        # its output, e.g. bfloat16: the reference evaluator is the oracle then)
        return run_oracle(model, feeds, "ref")[0]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_op_matches_oracle(case: Case):
    rng = case_rng(case.id)
    feeds = {f"x{i}": _draw(rng, dt, shape, bounds, case.specials)
             for i, (dt, shape, bounds) in enumerate(case.inputs)}
    model = _model(case.op, feeds, case.attrs, case.opset)
    got = kiln.build(model).run(feeds)["y"]
    assert_close(got, _oracle(model, feeds), TOLERANCE, case.id)


@pytest.mark.parametrize("source,to,attrs", CAST_CASES,
                         ids=[f"{s}-{TensorProto.DataType.Name(t)}-{a}" for s, t, a in CAST_CASES])
def test_cast_matches_oracle(source: str, to: int, attrs: dict):
    rng = np.random.default_rng(to * 100 + len(source))
    bounds = (-20.0, 20.0) if source != F16 else (-600.0, 600.0)
    x = _draw(rng, source, (4, 6), bounds, specials=False)
    if source == F32 and to != TensorProto.INT32 and to != TensorProto.UINT8:
        x.reshape(-1)[:6] = [0.0, 1e6, -1e6, 0.5, np.inf, np.nan]  # overflow for float8, a tie
    feeds = {"x0": x}
    model = _model("Cast", feeds, {"to": to, **attrs}, 21)
    got = kiln.build(model).run(feeds)["y"]
    assert_close(got, _oracle(model, feeds), TOLERANCE, "Cast")
    like = helper.make_tensor("like", to, [0], [])
    feeds = {"x0": x, "like": onnx.numpy_helper.to_array(like)}
    model = _model("CastLike", feeds, attrs, 21)
    got = kiln.build(model).run(feeds)["y"]
    assert_close(got, _oracle(model, feeds), TOLERANCE, "CastLike")


@pytest.mark.parametrize("source,to", [(F32, TensorProto.INT32), (I64, TensorProto.DOUBLE),
                                       ("uint16", TensorProto.INT16), ("bool", TensorProto.UINT8)])
def test_bitcast_matches_reference(source: str, to: int):
    x = _draw(np.random.default_rng(to), source, (3, 4), (0, 100), specials=False)
    model = _model("BitCast", {"x0": x}, {"to": to}, 26)
    got = kiln.build(model).run({"x0": x})["y"]
    assert_close(got, run_oracle(model, {"x0": x}, "ref")[0], TOLERANCE, "BitCast")


def test_float8e8m0_round_modes():
    """e8m0 has no ORT kernel at every version: the reference's bit recipe is the oracle."""
    x = np.array([0.0, 0.124, 0.25, 0.5, 1.1, 1.5, 3.0, 2.0**127 * 1.5, np.inf, np.nan], np.float32)
    for mode in ["up", "nearest", "down"]:
        model = _model("Cast", {"x0": x}, {"to": TensorProto.FLOAT8E8M0, "round_mode": mode}, 25)
        got = kiln.build(model).run({"x0": x})["y"]
        want = onnx.numpy_helper.to_float8e8m0(x, True, mode)
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8), err_msg=mode)
