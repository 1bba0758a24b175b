"""int8/uint8 DequantizeLinear and QuantizeLinear fused into the CPU's native elementwise chains
(kiln/passes/fusion/elementwise_dequantize.py fuse_int8_*; kiln/kernels/cpu/elementwise.c's 8-bit reads and stores).

The kernel against kiln's reference op (torch) on fresh random 8-bit inputs: exact where the chain is exact arithmetic,
within one step where it has a Gelu (the C Gelu's erf is an approximation, torch's is libm's); a QDQ model built with
and without the rules: bit for bit the same engine outputs, and within one quantization step of onnxruntime running
the Q/DQ ops as written."""

from __future__ import annotations

import math
import zlib

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.builder.build import pass_options
from kiln.builder.config import BuildConfig
from kiln.frontend import onnx as onnx_frontend
from kiln.kernels.cpu import elementwise as kernels
from kiln.kernels.cpu import transformer
from kiln.ops.fused import elementwise as reference
from kiln.passes import fusion
from kiln.passes.pipeline import optimize

needs_kernels = pytest.mark.skipif(not transformer.available(), reason="kiln's C kernels are not built")
RULES = ("fuse_int8_dequantize_into_elementwise", "fuse_int8_quantize_into_elementwise")

# program, whether it has a Gelu (one step), the 8-bit inputs, the float inputs' shapes ([C]: a bias), the output
PROGRAMS = {
    "bias_gelu": (["Dequantize i1 i2 i3", "Add t0 i0", "Gelu t1", "Quantize t2 i4 i5"], True, [1], {0: "bias"}, True),
    "bias_scale": (["Dequantize i2 i3 i4", "Add t0 i0", "Mul t1 i1", "Quantize t2 i5 i6"], False, [2],
                   {0: "bias", 1: "scalar"}, True),
    "requantizing_add": (["Dequantize i0 i1 i2", "Dequantize i3 i4 i5", "Add t0 t1", "Quantize t2 i6 i7"], False,
                         [0, 3], {}, True),
    "dequantize_add": (["Dequantize i1 i2 i3", "Add t0 i0"], False, [1], {0: "activation"}, False),
    "add_quantize": (["Add i0 i1", "Quantize t0 i2 i3"], False, [], {0: "activation", 1: "bias"}, True),
}


def _case(name: str, dtype: torch.dtype, size: tuple[int, ...]):
    """The program's inputs (activations and constants by index) on fresh random values of the case's seed."""
    code, _, eight_bit, floats, _ = PROGRAMS[name]
    g = torch.Generator().manual_seed(zlib.crc32(f"{name} {dtype} {size}".encode()))
    info = torch.iinfo(dtype)
    activations, constants = {}, {}
    for k in eight_bit:
        activations[k] = torch.randint(info.min, info.max + 1, size, dtype=dtype, generator=g)
    for k, kind in floats.items():
        if kind == "activation":
            activations[k] = torch.randn(size, generator=g) * 3
        elif kind == "bias":
            constants[k] = torch.randn(size[-1], generator=g)
        else:
            constants[k] = torch.tensor(0.7)
    for line in code:  # scales and zero points: constant scalars
        op, *args = line.split()
        if op in ("Dequantize", "Quantize"):
            constants[int(args[1][1:])] = torch.rand((), generator=g) * 0.05 + 0.01
            constants[int(args[2][1:])] = torch.randint(info.min // 4, info.max // 4 + 1, (), dtype=dtype,
                                                        generator=g)
    return code, activations, constants


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8], ids=["uint8", "int8"])
@pytest.mark.parametrize("size", [(1, 32, 128), (3, 7, 37)], ids=["rows_of_128", "ragged_tails"])
@pytest.mark.parametrize("name", list(PROGRAMS))
def test_the_native_chain_reads_and_writes_8_bits_as_the_reference(name, size, dtype):
    code, activations, constants = _case(name, dtype, size)
    _, gelu, _, _, quantized_out = PROGRAMS[name]
    kernel = kernels.Elementwise(code, {k: tuple(v.shape) for k, v in activations.items()}, constants,
                                 {k: v.dtype for k, v in activations.items()})
    got = kernel(activations)
    inputs = [activations[k] if k in activations else constants[k] for k in range(len(activations) + len(constants))]
    output_dtype = 0
    if quantized_out:
        output_dtype = TensorProto.UINT8 if dtype == torch.uint8 else TensorProto.INT8
    want = reference(None, *inputs, code=code, output_dtype=output_dtype)
    assert got.dtype == want.dtype and got.shape == want.shape
    if not quantized_out:  # (q - z)·s + x: float32 arithmetic in one order, exact
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        return
    steps = (got.to(torch.int32) - want.to(torch.int32)).abs()
    # a Gelu: the C kernel's erf (relative error < 1.2e-7) may put a value on the other side of a rounding boundary
    assert int(steps.max()) <= (1 if gelu else 0), f"{int((steps > 0).sum())} of {steps.numel()} elements differ"
    assert int((steps > 0).sum()) <= (steps.numel() // 1000 if gelu else 0)


def test_the_kernel_refuses_what_it_cannot_run():
    scale, zero = torch.tensor(0.1), torch.tensor(3, dtype=torch.uint8)
    why = kernels.quantization(["Dequantize i0 i1 i2", "Quantize t0 i1 i2"], {0: torch.uint8},
                               {1: scale, 2: zero})
    assert isinstance(why, str) and "computed line" in why  # a requantization alone: no float line between
    why = kernels.quantization(["Dequantize i0 i1"], {0: torch.float8_e4m3fn}, {1: scale})
    assert isinstance(why, str) and "E4M3" in why
    why = kernels.quantization(["Dequantize i0 i1 i2", "Add t0 i0"], {0: torch.uint8}, {1: scale, 2: zero})
    assert isinstance(why, str) and "other lines" in why
    why = kernels.quantization(["Add i0 i0", "Quantize t0 i1 i2", "Relu t1"], {0: torch.float32},
                               {1: scale, 2: zero})
    assert isinstance(why, str) and "last line" in why


def _qdq_model(path, rng) -> dict[str, float]:
    """a, b float [1, 16, 40] -> Q/DQ each (uint8) -> a + bias -> Gelu (erf form) -> Q/DQ -> + b -> Q/DQ -> y: a bias
    Gelu chain and a residual add, as onnxruntime's QDQ transformers write them. Returns the scales."""
    scales = {"s_a": 0.031, "s_b": 0.027, "s_g": 0.019, "s_y": 0.041}
    zeros = {"z_a": 131, "z_b": 120, "z_g": 9, "z_y": 77}
    inits = [numpy_helper.from_array(np.array(v, np.float32), k) for k, v in scales.items()]
    inits += [numpy_helper.from_array(np.array(v, np.uint8), k) for k, v in zeros.items()]
    inits += [numpy_helper.from_array(rng.standard_normal(40).astype(np.float32), "bias"),
              numpy_helper.from_array(np.array(1 / math.sqrt(2), np.float32), "inv_sqrt2"),
              numpy_helper.from_array(np.array(1.0, np.float32), "one"),
              numpy_helper.from_array(np.array(0.5, np.float32), "half")]
    n = helper.make_node
    nodes = [n("QuantizeLinear", ["a", "s_a", "z_a"], ["a_q"]), n("DequantizeLinear", ["a_q", "s_a", "z_a"], ["a_f"]),
             n("QuantizeLinear", ["b", "s_b", "z_b"], ["b_q"]), n("DequantizeLinear", ["b_q", "s_b", "z_b"], ["b_f"]),
             n("Add", ["a_f", "bias"], ["h"]), n("Mul", ["h", "inv_sqrt2"], ["h_s"]), n("Erf", ["h_s"], ["e"]),
             n("Add", ["e", "one"], ["e1"]), n("Mul", ["h", "e1"], ["he"]), n("Mul", ["he", "half"], ["g"]),
             n("QuantizeLinear", ["g", "s_g", "z_g"], ["g_q"]), n("DequantizeLinear", ["g_q", "s_g", "z_g"], ["g_f"]),
             n("Add", ["g_f", "b_f"], ["r"]),
             n("QuantizeLinear", ["r", "s_y", "z_y"], ["y_q"]), n("DequantizeLinear", ["y_q", "s_y", "z_y"], ["y"])]
    graph = helper.make_graph(nodes, "qdq_chains", [helper.make_tensor_value_info(k, TensorProto.FLOAT, [1, 16, 40])
                                                    for k in ("a", "b")],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, 40])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return scales


def _without_rules(monkeypatch):
    monkeypatch.setattr(fusion, "RULES", [rule for rule in fusion.RULES if rule[0] not in RULES])


def test_the_rules_fuse_the_chains_and_only_the_chains(tmp_path, monkeypatch):
    path = tmp_path / "qdq.onnx"
    _qdq_model(path, np.random.default_rng(zlib.crc32(b"int8 chains structure")))
    graph = optimize(onnx_frontend.load(str(path)), pass_options(BuildConfig()))
    ops = [node.op_type for node in graph.graph]
    # left: the two input Qs (they read graph inputs) and the output's DQ (a graph output); the residual add is a QAdd
    # of its own (fuse_quantized_add), and a + bias -> Gelu one chain that reads and writes 8 bits
    assert sorted(ops) == ["DequantizeLinear", "Elementwise", "QAdd", "QuantizeLinear", "QuantizeLinear"], ops
    chain = next(node for node in graph.graph if node.op_type == "Elementwise")
    assert list(chain.attributes["code"].value) == ["Dequantize i1 i2 i3", "Add t0 i0", "Gelu t1", "Quantize t2 i4 i5"]
    assert chain.inputs[1].dtype == ir.DataType.UINT8 and chain.outputs[0].dtype == ir.DataType.UINT8
    _without_rules(monkeypatch)
    graph = optimize(onnx_frontend.load(str(path)), pass_options(BuildConfig()))
    ops = [node.op_type for node in graph.graph]
    assert ops.count("QuantizeLinear") == 3 and ops.count("DequantizeLinear") == 2, ops


@needs_kernels
def test_a_qdq_model_runs_the_same_fused_and_within_a_step_of_onnxruntime(tmp_path, monkeypatch):
    path = tmp_path / "qdq.onnx"
    scales = _qdq_model(path, np.random.default_rng(zlib.crc32(b"int8 chains numbers")))
    fused = kiln.build(str(path))
    with monkeypatch.context() as m:
        _without_rules(m)
        separate = kiln.build(str(path))
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # the Q/DQ ops as written
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(zlib.crc32(b"int8 chains feeds"))
    for _ in range(3):
        feed = {k: (rng.standard_normal((1, 16, 40)) * 2).astype(np.float32) for k in ("a", "b")}
        got, plain = np.asarray(fused.run(feed)["y"]), np.asarray(separate.run(feed)["y"])
        np.testing.assert_array_equal(got, plain)  # the fused steps compute what the separate ones did
        want = session.run(None, feed)[0]
        # one step of y, plus one flipped step of the Gelu's quantization (kiln's erf against libm's), through the add
        bound = scales["s_y"] + scales["s_g"] + 1e-6
        assert np.abs(got - want).max() <= bound


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8], ids=["uint8", "int8"])
@pytest.mark.parametrize("name,size", [("bias_gelu", (1, 128, 512)), ("bias_scale", (2, 64, 128)),
                                       ("bias_gelu", (1, 96, 40))], ids=["gelu", "scale", "gelu_40_columns"])
def test_a_lookup_table_is_the_evaluation_bit_for_bit(name, size, dtype):
    """One 8-bit activation and per-column constants, 8-bit out: the kernel looks each byte up in a [columns][256]
    table made by evaluating its own program on every byte value, exactly what evaluating it per element gives."""
    code, activations, constants = _case(name, dtype, size)
    sizes, dtypes = {k: tuple(v.shape) for k, v in activations.items()}, {k: v.dtype for k, v in activations.items()}
    table = kernels.Elementwise(code, sizes, constants, dtypes)
    evaluated = kernels.Elementwise(code, sizes, constants, dtypes, lookup=False)
    assert table._table is not None and evaluated._table is None
    assert torch.equal(table(activations), evaluated(activations))


@needs_kernels
def test_no_table_where_a_chunk_would_end_in_libms_gelu():
    """A Gelu over rows of 37: each row's last 5 elements take libm's erff, not the vector loop's (the table, made on
    [256, 37], would hold them too, but only rows of a multiple of 8 are taken: no element's path to depend on)."""
    code, activations, constants = _case("bias_gelu", torch.uint8, (1, 128, 37))
    kernel = kernels.Elementwise(code, {1: (1, 128, 37)}, constants, {1: torch.uint8})
    assert kernel._table is None
