"""The one-node oracle harness the tests/unit/test_ops_*.py files share.

A case is one ONNX node on fresh random inputs (seeded per case). The model around it goes
through `kiln.build(model).run(feeds)` and through an independent oracle: onnxruntime's CPU
kernels ("ort") or `onnx.reference.ReferenceEvaluator` ("ref", where onnxruntime has no kernel
or rounds its own way). Each test file keeps its own case list and per-dtype tolerance table.
ACTIVATION_ORACLE: the fused activations in float64, for the kernel tests' epilogues.
"""

from __future__ import annotations

import warnings
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

import kiln

Feeds = Callable[[np.random.Generator], list[Any]]
Tolerance = dict[np.dtype, tuple[float, float]]  # (rtol, atol) per output dtype

# The fused activations' ONNX definitions in float64 torch, (y, alpha, beta) -> activation(y): the oracle of the
# kernels that apply them in an epilogue (written out here, not kiln's ops)
ACTIVATION_ORACLE: dict[str, Callable[[torch.Tensor, float, float], torch.Tensor]] = {
    "": lambda y, a, b: y,
    "Relu": lambda y, a, b: y.clamp_min(0),
    "LeakyRelu": lambda y, a, b: torch.where(y >= 0, y, a * y),
    "Clip": lambda y, a, b: y.clamp(a, b),
    "Sigmoid": lambda y, a, b: 1 / (1 + torch.exp(-y)),
    "Tanh": lambda y, a, b: torch.tanh(y),
    "SiLU": lambda y, a, b: y / (1 + torch.exp(-y)),
    "HardSwish": lambda y, a, b: y * (y / 6 + 0.5).clamp(0, 1),
    "HardSigmoid": lambda y, a, b: (a * y + b).clamp(0, 1),
    "Gelu": lambda y, a, b: 0.5 * y * (1 + torch.erf(y / 2 ** 0.5)),
    "GeluTanh": lambda y, a, b: 0.5 * y * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (y + 0.044715 * y ** 3))),
}


@dataclass
class Case:
    id: str
    op: str
    feeds: Feeds  # rng -> inputs in order (None: optional input left out)
    attrs: dict[str, Any] = field(default_factory=dict)
    opset: int = 21  # of the ai.onnx domain
    outputs: int | list[str] = 1  # a count, or output names with "" for outputs left out
    domain: str = ""
    oracle: str = "ort"  # "ref": the ONNX reference evaluator


def feeds(*makers) -> Feeds:
    return lambda rng: [m(rng) if m is not None else None for m in makers]


def const(value, dtype=np.float32):
    return lambda rng: np.asarray(value, dtype=dtype)


def case_rng(case_id: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(case_id.encode()))


def case_node(case: Case, inputs: list[Any]) -> tuple[onnx.NodeProto, dict[str, Any]]:
    """The case's node reading in0, in1, ... (a None input is left out) and its feeds by name."""
    names = [f"in{i}" if v is not None else "" for i, v in enumerate(inputs)]
    while names and not names[-1]:
        names.pop()
    outputs = case.outputs if isinstance(case.outputs, list) else [f"out{i}" for i in range(case.outputs)]
    node = helper.make_node(case.op, names, outputs, domain=case.domain, **case.attrs)
    return node, {n: v for n, v in zip(names, inputs) if n}


def _value_info(name: str, value: Any) -> onnx.ValueInfoProto:
    if isinstance(value, list):  # a sequence of tensors
        elem = helper.make_tensor_type_proto(helper.np_dtype_to_tensor_dtype(value[0].dtype), None)
        return helper.make_value_info(name, helper.make_sequence_type_proto(elem))
    dtype = TensorProto.STRING if value.dtype == object else helper.np_dtype_to_tensor_dtype(value.dtype)
    return helper.make_tensor_value_info(name, dtype, value.shape)


def one_node_model(node: onnx.NodeProto, inputs: dict[str, Any], *, opset: int = 21,
                   opsets: dict[str, int] | None = None) -> onnx.ModelProto:
    """`node` in a model whose inputs are typed from the values in `inputs` and whose outputs are
    left undeclared; the node's domain is imported at version 1 unless `opsets` names it."""
    graph = helper.make_graph(
        [node], node.op_type, [_value_info(n, v) for n, v in inputs.items()],
        [helper.make_value_info(n, onnx.TypeProto()) for n in node.output if n],
    )
    imports = {"": opset, **(opsets or {})}
    if node.domain:
        imports.setdefault(node.domain, 1)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in imports.items()])
    model.ir_version = 10
    return model


def infer_outputs(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with its outputs declared as ONNX shape inference gives them (type and shape)."""
    return onnx.shape_inference.infer_shapes(model, strict_mode=True)


def run_oracle(model: onnx.ModelProto, feeds: dict[str, Any], oracle: str = "ort") -> list[Any]:
    """Every output of `model` from onnxruntime's CPU kernels ("ort") or the reference evaluator ("ref")."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if oracle == "ort":
            session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
            return session.run(None, feeds)
        if oracle == "ref":
            return ReferenceEvaluator(model).run(None, feeds)
    raise ValueError(f"oracle {oracle!r}: expected 'ort' or 'ref'")


def check(model: onnx.ModelProto, feeds: dict[str, Any], tolerance: Tolerance, oracle: str = "ort",
          label: str = "") -> None:
    """kiln and the oracle agree on every output of `model`."""
    got = kiln.build(model).run(dict(feeds))
    want = run_oracle(model, feeds, oracle)
    for output, w in zip(model.graph.output, want):
        assert_close(got[output.name], w, tolerance, f"{label} output {output.name!r}")


def assert_close(got: Any, want: Any, tolerance: Tolerance, where: str) -> None:
    """Floats agree to tolerance[dtype]; integers, bools, strings and the ml_dtypes types
    (float8, int4, float4) exactly; sequences element by element."""
    if isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_close(g, w, tolerance, f"{where}[{i}]")
        return
    got, want = np.asarray(got), np.asarray(want)
    if want.dtype == np.uint8 and got.dtype.type.__module__ != "numpy" and got.dtype.itemsize == 1:
        want = want.view(got.dtype)  # onnxruntime hands float8 outputs back as their raw bytes
    assert got.shape == want.shape, f"{where}: shape {got.shape} != {want.shape}"
    if want.dtype == object or want.dtype.kind in "US":
        np.testing.assert_array_equal(got.astype(str), want.astype(str), err_msg=where)
        return
    assert got.dtype == want.dtype, f"{where}: dtype {got.dtype} != {want.dtype}"
    if want.dtype in tolerance:
        rtol, atol = tolerance[want.dtype]
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=rtol, atol=atol,
                                   err_msg=where)
    elif want.dtype.type.__module__ != "numpy":  # ml_dtypes: compare the values exactly
        np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32), err_msg=where)
    else:
        np.testing.assert_array_equal(got, want, err_msg=where)
