"""The uint8/int8 QuantizeLinear after a LayerNorm and its residual's DequantizeLinear in kiln::LayerNormQuantize on
the CPU (kiln/passes/fusion/layernorm_quantize.py fuse_int8_*; transformer.c kiln_layer_norm_quantize).

The fused kernel against the unfused native steps (DequantizeLinear, LayerNorm, QuantizeLinear kernels) on fresh
random inputs: bit for bit; against kiln's reference op (torch's LayerNorm): within one step; a QDQ model of two
pre-quantized norms built with and without the rules: fewer steps, the same outputs bit for bit, and within a step
of onnxruntime running the Q/DQ ops as written."""

from __future__ import annotations

import zlib

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.builder.build import pass_options
from kiln.builder.config import BuildConfig
from kiln.frontend import onnx as onnx_frontend
from kiln.kernels.cpu import elementwise as elementwise_kernels
from kiln.kernels.cpu import transformer
from kiln.ops.quantized import layer_norm_quantize
from kiln.ops.registry import OpContext
from kiln.passes import fusion
from kiln.passes.pipeline import optimize

needs_kernels = pytest.mark.skipif(not transformer.available(), reason="kiln's C kernels are not built")
RULES = ("fuse_int8_layer_norm_quantize", "fuse_int8_dequantize_into_layer_norm_quantize")


_CTX = OpContext(name="layer_norm_quantize", op_type="LayerNormQuantize", domain="kiln", num_outputs=1)


def _case(size, residual: str, dtype: torch.dtype):
    g = torch.Generator().manual_seed(zlib.crc32(f"lnq8 {size} {residual} {dtype}".encode()))
    n = size[-1]
    info = torch.iinfo(dtype)
    x = torch.randn(size, generator=g) * 2 + 0.5
    gamma, beta = torch.rand(n, generator=g) + 0.5, torch.randn(n, generator=g) * 0.1
    y_quant = (float(torch.rand((), generator=g)) * 0.02 + 0.01, int(torch.randint(info.min // 4, info.max // 4 + 1,
                                                                                   (), generator=g)), dtype)
    r, r_quant = None, None
    r_size = size if residual != "repeated" else size[-2:]
    if residual == "float":
        r = torch.randn(r_size, generator=g)
    elif residual in ("8bit", "repeated"):
        r = torch.randint(info.min, info.max + 1, r_size, dtype=dtype, generator=g)
        r_quant = (float(torch.rand((), generator=g)) * 0.05 + 0.01,
                   int(torch.randint(info.min // 4, info.max // 4 + 1, (), generator=g)), dtype)
    return x, gamma, beta, r, y_quant, r_quant


def _unfused(x, gamma, beta, r, y_quant, r_quant):
    """The separate native steps: DequantizeLinear of r, LayerNorm, QuantizeLinear."""
    if r_quant is not None:
        r = elementwise_kernels.Quantize(tuple(r.shape), False, r_quant[0], r_quant[1], r_quant[2])({0: r})
    norm = transformer.LayerNorm(tuple(x.shape), gamma, beta, 1e-5, tuple(r.shape) if r is not None else None)
    y = norm({0: x, **({3: r} if r is not None else {})})
    return elementwise_kernels.Quantize(tuple(y.shape), True, y_quant[0], y_quant[1], y_quant[2])({0: y})


@needs_kernels
@pytest.mark.parametrize("narrow", [True, False], ids=["narrow_rows", "wide_loop"])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8], ids=["uint8", "int8"])
@pytest.mark.parametrize("residual", ["none", "float", "8bit", "repeated"])
@pytest.mark.parametrize("size", [(1, 32, 128), (3, 7, 40), (2, 5, 100), (1, 300, 24), (1, 3, 4100)],
                         ids=["128", "40", "100", "24", "4100"])  # (rows wider than the kernel's block buffers)
def test_the_fused_norm_is_the_unfused_steps_bit_for_bit(size, residual, dtype, narrow):
    x, gamma, beta, r, y_quant, r_quant = _case(size, residual, dtype)
    transformer.set_narrow_norm(narrow)
    try:
        fused = transformer.LayerNormQuantize(tuple(x.shape), gamma, beta, 1e-5,
                                              tuple(r.shape) if r is not None else None, y_quant, r_quant)
        got = fused({0: x, **({3: r} if r is not None else {})})
        want = _unfused(x, gamma, beta, r, y_quant, r_quant)
    finally:
        transformer.set_narrow_norm(True)
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(got, want), f"{int((got != want).sum())} of {got.numel()} elements differ"
    # the reference op (torch's LayerNorm, another summation order): one step at most, rarely
    extra = [torch.tensor(r_quant[0]), torch.tensor(r_quant[1], dtype=dtype)] if r_quant else []
    reference = layer_norm_quantize(_CTX, x, gamma, beta, r, torch.tensor(y_quant[0]),
                                    torch.tensor(y_quant[1], dtype=dtype), *extra, epsilon=1e-5)
    steps = (got.to(torch.int32) - reference.to(torch.int32)).abs()
    assert int(steps.max()) <= 1 and int((steps > 0).sum()) <= max(2, steps.numel() // 100)


@needs_kernels
@pytest.mark.parametrize("narrow", [True, False], ids=["narrow_rows", "wide_loop"])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8], ids=["uint8", "int8"])
@pytest.mark.parametrize("residual", ["8bit", "repeated"])
@pytest.mark.parametrize("size", [(1, 32, 128), (3, 7, 40), (2, 5, 100)], ids=["128", "40", "100"])
def test_the_8bit_residual_is_read_as_its_dequantize_wrote_it(size, residual, dtype, narrow):
    """The float y (no output quantization): each element the unfused DequantizeLinear -> LayerNorm's, bit for bit
    (a quantized y hides a last-bit difference of the norm's sum, unless it lands on a rounding boundary)."""
    x, gamma, beta, r, _, r_quant = _case(size, residual, dtype)
    transformer.set_narrow_norm(narrow)
    try:
        fused = transformer.LayerNormQuantize(tuple(x.shape), gamma, beta, 1e-5, tuple(r.shape), None, r_quant)
        got = fused({0: x, 3: r})
        r_f = elementwise_kernels.Quantize(tuple(r.shape), False, r_quant[0], r_quant[1], dtype)({0: r})
        want = transformer.LayerNorm(tuple(x.shape), gamma, beta, 1e-5, tuple(r.shape))({0: x, 3: r_f})
    finally:
        transformer.set_narrow_norm(True)
    assert got.dtype == torch.float32
    assert torch.equal(got, want), f"{int((got != want).sum())} of {got.numel()} elements differ"


@needs_kernels
def test_the_kernel_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="uint8/int8"):
        transformer.LayerNormQuantize((2, 8), None, None, 1e-5, None, (0.1, 0, torch.float16))
    with pytest.raises(ValueError, match="without a residual"):
        transformer.LayerNormQuantize((2, 8), None, None, 1e-5, None, (0.1, 0, torch.uint8), (0.1, 0, torch.uint8))


def _qdq_model(path, rng, width: int = 48, rows: int = 16) -> dict[str, float]:
    """Two pre-quantized norms as onnxruntime's QDQ BERT writes them, inputs [1, rows, width]: y1 = Q(LN(x + DQ(Q(r)))),
    y = DQ(Q(LN(a + DQ(y1)))), where y1 would also feed the next GEMMs (bench/layernorm_quantize_ab.py times it).
    Returns the scales."""
    scales = {"s_r": 0.023, "s_1": 0.029, "s_y": 0.031}
    zeros = {"z_r": 127, "z_1": 119, "z_y": 133}
    inits = [numpy_helper.from_array(np.array(v, np.float32), k) for k, v in scales.items()]
    inits += [numpy_helper.from_array(np.array(v, np.uint8), k) for k, v in zeros.items()]
    for k in ("1", "2"):
        inits += [numpy_helper.from_array((rng.random(width) + 0.5).astype(np.float32), f"gamma{k}"),
                  numpy_helper.from_array((rng.standard_normal(width) * 0.1).astype(np.float32), f"beta{k}")]
    n = helper.make_node
    nodes = [n("QuantizeLinear", ["r", "s_r", "z_r"], ["r_q"]), n("DequantizeLinear", ["r_q", "s_r", "z_r"], ["r_f"]),
             n("Add", ["x", "r_f"], ["h1"]),
             n("LayerNormalization", ["h1", "gamma1", "beta1"], ["n1"], axis=-1, epsilon=1e-12),
             n("QuantizeLinear", ["n1", "s_1", "z_1"], ["y1_q"]), n("DequantizeLinear", ["y1_q", "s_1", "z_1"], ["y1"]),
             n("Add", ["a", "y1"], ["h2"]),
             n("LayerNormalization", ["h2", "gamma2", "beta2"], ["n2"], axis=-1, epsilon=1e-12),
             n("QuantizeLinear", ["n2", "s_y", "z_y"], ["y_q"]), n("DequantizeLinear", ["y_q", "s_y", "z_y"], ["y"])]
    shape = [1, rows, width]
    graph = helper.make_graph(nodes, "qdq_norms", [helper.make_tensor_value_info(k, TensorProto.FLOAT, shape)
                                                   for k in ("x", "r", "a")],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return scales


def _without_rules(monkeypatch):
    monkeypatch.setattr(fusion, "RULES", [rule for rule in fusion.RULES if rule[0] not in RULES])


def test_the_rules_take_the_norms_quantize_and_residual_dequantize(tmp_path, monkeypatch):
    path = tmp_path / "qdq.onnx"
    _qdq_model(path, np.random.default_rng(zlib.crc32(b"lnq8 structure")))
    graph = optimize(onnx_frontend.load(str(path)), pass_options(BuildConfig()))
    ops = [node.op_type for node in graph.graph]
    # left: r's Q (a graph input) and the output's DQ (a graph output); each norm stores 8 bits, the second reads the
    # first's 8-bit output as its residual, the first reads r's
    assert sorted(ops) == ["DequantizeLinear", "LayerNormQuantize", "LayerNormQuantize", "QuantizeLinear"], ops
    for node in graph.graph:
        if node.op_type == "LayerNormQuantize":
            assert len(node.inputs) == 8 and node.inputs[3].dtype.name == "UINT8", node
    _without_rules(monkeypatch)
    graph = optimize(onnx_frontend.load(str(path)), pass_options(BuildConfig()))
    ops = [node.op_type for node in graph.graph]
    assert ops.count("QuantizeLinear") == 3 and ops.count("DequantizeLinear") == 3, ops


@needs_kernels
def test_a_qdq_model_runs_the_same_fused_and_within_a_step_of_onnxruntime(tmp_path, monkeypatch):
    path = tmp_path / "qdq.onnx"
    scales = _qdq_model(path, np.random.default_rng(zlib.crc32(b"lnq8 numbers")))
    fused = kiln.build(str(path))
    with monkeypatch.context() as m:
        _without_rules(m)
        separate = kiln.build(str(path))
    assert len(fused.program.steps) < len(separate.program.steps)
    # the native kernel kept (the build's check judges a LayerNormQuantize's engine as quantized: a near-tie of the
    # norm a step apart from torch's reference, not a reason to run the reference instead)
    assert [s.tactic for s in fused.plan.program.steps if s.op_type == "LayerNormQuantize"] == \
        ["cpu.layernormquantize.native"] * 2
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # the Q/DQ ops as written
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(zlib.crc32(b"lnq8 feeds"))
    for _ in range(3):
        feed = {k: (rng.standard_normal((1, 16, 48)) * 2).astype(np.float32) for k in ("x", "r", "a")}
        got, plain = np.asarray(fused.run(feed)["y"]), np.asarray(separate.run(feed)["y"])
        np.testing.assert_array_equal(got, plain)  # the fused steps compute what the separate ones did
        want = session.run(None, feed)[0]
        # one step of y (a LayerNorm's float rounding differs from onnxruntime's), where a flipped step of y1 may add
        # its own through the second norm (~s_1·γ/σ, σ ~ 2)
        assert np.abs(got - want).max() <= scales["s_y"] + scales["s_1"] + 1e-6


@needs_kernels
def test_new_sequence_lengths_run_the_fused_norm_as_the_separate_steps(tmp_path, monkeypatch):
    """A dynamic sequence axis: the fused norms' native step at sizes it was not built at (its size rule) gives what
    the separate steps give there."""
    path = tmp_path / "qdq.onnx"
    _qdq_model(path, np.random.default_rng(zlib.crc32(b"lnq8 dynamic")))
    m = onnx.load(str(path))
    for v in [*m.graph.input, *m.graph.output]:
        v.type.tensor_type.shape.dim[1].dim_param = "seq"
    onnx.save(m, str(path))
    config = {"profiles": [{k: "1x1x48,1x16x48,1x128x48" for k in ("x", "r", "a")}]}
    fused = kiln.build(str(path), BuildConfig(**config))
    with monkeypatch.context() as patch:
        _without_rules(patch)
        separate = kiln.build(str(path), BuildConfig(**config))
    assert [s.tactic for s in fused.plan.program.steps if s.op_type == "LayerNormQuantize"] == \
        ["cpu.layernormquantize.native"] * 2
    rng = np.random.default_rng(zlib.crc32(b"lnq8 dynamic feeds"))
    for seq in (16, 40, 7, 100):
        feed = {k: (rng.standard_normal((1, seq, 48)) * 2).astype(np.float32) for k in ("x", "r", "a")}
        np.testing.assert_array_equal(np.asarray(fused.run(feed)["y"]), np.asarray(separate.run(feed)["y"]))
