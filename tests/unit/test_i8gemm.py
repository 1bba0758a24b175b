"""i8gemm (kiln/kernels/cpu/i8gemm.c, tactic cpu.qgemm.kiln_i8): kiln::QGemm on AVX2 vpmaddubsw pair sums.

- its int32 sums Σ (x − z_x)·w + bias equal numpy's int64 ones exactly: uint8 and int8 rows, zero points at both
  ends of their range, the largest activations against weights at the pair bound (|w1| + |w2| = 128, where
  vpmaddubsw's int16 sum reaches 32640), row counts off the 3-row tile, K off the 4-byte group, N off the 32-channel
  panel, 1 and 2 threads;
- a weight with one adjacent pair past the bound is refused (its sums would saturate), by the kernel and the tactic;
- requantized uint8/int8 and float32 outputs, none/Relu/Clip/Gelu/GeluTanh (GELU by gemm.c's vector forms), against
  kiln's reference QGemm (float64) within one quantization step (one float32 multiply by x_scale·w_scale/y_scale
  against the reference's exact product and division, at ties; GELU's float32 error ~2e-7 relative);
- a Q/DQ MatMul model built by kiln with the tactic allowed: the layer runs as cpu.qgemm.kiln_i8 inside a native
  segment, its output onnxruntime's (ORT_DISABLE_ALL, the same Q/DQ graph) within one output step; the tuner, left
  alone, times it beside oneDNN's int8 matmul and the float layer.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.kernels.cpu import i8gemm
from kiln.ops.registry import OpContext, lookup
from kiln.plan.spec import StepSpec
from kiln.tactics import registry
from kiln.tactics.tactic import InputMeta
from tests.unit.oracle import case_rng

pytestmark = pytest.mark.skipif(not i8gemm.available(), reason=f"i8gemm: {i8gemm.reason()}")
TACTIC = "cpu.qgemm.kiln_i8"
CONSTANT = {1, 2, 3, 4, 5, 6, 7, 8}


def _rows(rng, shape, dtype):
    lo, hi = (0, 256) if dtype == torch.uint8 else (-128, 128)
    x = rng.integers(lo, hi, shape)
    x.reshape(-1)[:4] = [lo, hi - 1, lo, hi - 1][:x.size]  # both ends of the range
    return torch.from_numpy(x).to(dtype)


def _pair_bound_weight(rng, n, k):
    """Random 7-bit weights, then whole channels at the bound: (64, 64), (-64, -64), (127, 1), (-128, 0) pairs."""
    w = rng.integers(-64, 65, (n, k))
    w[:, 1::2] = np.clip(w[:, 1::2], -128 + np.abs(w[:, 0:k - k % 2:2]), 128 - np.abs(w[:, 0:k - k % 2:2]))
    patterns = [(64, 64), (-64, -64), (127, 1), (-128, 0), (1, 127), (0, -128)]
    for c, (a, b) in zip(range(n), patterns):
        w[c, 0::2], w[c, 1::2] = a, b
    w = w.astype(np.int8)
    assert i8gemm.worst_pair(torch.from_numpy(w)) <= i8gemm.PAIR_LIMIT
    return torch.from_numpy(w)


SUM_CASES = [  # (rows, K, N, source dtype, zero point)
    (128, 384, 96, torch.uint8, 128),
    (7, 37, 45, torch.int8, -3),  # rows off the tile, K off 4 (a padded copy), N off the panel
    (1, 4, 1, torch.uint8, 255),
    (5, 1, 33, torch.int8, 127),
    (4, 1536, 70, torch.uint8, 0),
    (3, 64, 32, torch.int8, -128),
    (11, 130, 64, torch.uint8, 1),  # K even but not a multiple of 4
    (23, 24, 16, torch.uint8, 9),  # a 2-vector panel: 6-row tiles, 23 = 3 x 6 + 5
    (13, 144, 24, torch.int8, 3),  # a 3-vector panel: 4-row tiles, 13 = 3 x 4 + 1
    (9, 40, 40, torch.uint8, 200),  # a whole panel, then a 1-vector one (6-row tiles)
]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows, k, n, dtype, zero", SUM_CASES)
def test_int32_sums_equal_numpy_int64(rows, k, n, dtype, zero, threads):
    rng = case_rng(f"sums {rows} {k} {n} {dtype} {zero}")
    w = _pair_bound_weight(rng, n, k)
    x = _rows(rng, (rows, k), dtype)
    bias = torch.from_numpy(rng.integers(-20000, 20000, n).astype(np.int32))
    layer = i8gemm.I8Gemm(w, torch.rand(n), bias, rows, dtype, 0.02, zero, (torch.int32, 1.0, 0), threads=threads)
    got = layer(x).numpy().astype(np.int64)
    want = (x.numpy().astype(np.int64) - zero) @ w.numpy().astype(np.int64).T + bias.numpy()
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8])
def test_the_largest_sources_on_the_pair_bound_do_not_saturate(dtype):
    """Every activation at the top of its range (255 as the kernel's uint8) times pairs (64, 64) and (127, 1): each
    vpmaddubsw sum is 32640, one step of 128 below int16's limit; the sums are still numpy's."""
    k, n, rows = 256, 64, 6
    w = np.empty((n, k), np.int8)
    w[: n // 2], w[n // 2:, 0::2], w[n // 2:, 1::2] = 64, 127, 1
    w[1::2] *= -1  # negative channels too: (-64, -64) and (-127, -1)
    top = 255 if dtype == torch.uint8 else 127
    x = torch.full((rows, k), top, dtype=dtype if dtype == torch.int8 else torch.int32).to(dtype)
    zero = 0 if dtype == torch.uint8 else -128
    layer = i8gemm.I8Gemm(torch.from_numpy(w), torch.ones(n), None, rows, dtype, 1.0, zero, (torch.int32, 1.0, 0))
    got = layer(x).numpy().astype(np.int64)
    want = (x.numpy().astype(np.int64) - zero) @ w.astype(np.int64).T
    assert np.abs(want).max() == 255 * 128 * k // 2
    np.testing.assert_array_equal(got, want)


def test_no_rows_is_an_empty_output_and_other_row_counts_share_the_weight():
    rng = case_rng("rows")
    w = _pair_bound_weight(rng, 40, 37)
    layer = i8gemm.I8Gemm(w, torch.ones(40), None, 0, torch.int8, 0.1, 3, (torch.int32, 1.0, 0))
    assert layer(torch.empty(0, 37, dtype=torch.int8)).shape == (0, 40)
    other = layer.at_rows(5)
    assert other._w.data_ptr() == layer._w.data_ptr() and other.input_size == (5, 37)
    x = _rows(rng, (5, 37), torch.int8)
    want = (x.numpy().astype(np.int64) - 3) @ w.numpy().astype(np.int64).T
    np.testing.assert_array_equal(other(x).numpy(), want)
    with pytest.raises(ValueError, match="given"):
        other(torch.zeros(4, 37, dtype=torch.int8))


def test_a_pair_past_the_bound_is_refused():
    """(65, 64) in one channel: 255·129 > 32767 would saturate vpmaddubsw; the kernel and the tactic refuse it. The
    same two weights in different pairs (k = 1, 2) are fine: only the pairs the kernel forms count."""
    w = np.zeros((8, 16), np.int8)
    w[3, 1], w[3, 2] = 65, 64
    assert i8gemm.weight_refusal(torch.from_numpy(w)) is None
    w[3, 0] = 65
    w[3, 1] = 64
    why = i8gemm.weight_refusal(torch.from_numpy(w))
    assert why is not None and "129" in why
    with pytest.raises(ValueError, match="saturate"):
        i8gemm.I8Gemm(torch.from_numpy(w), torch.ones(8), None, 4, torch.uint8, 0.1, 0)
    args = _qgemm_args(case_rng("refused"), (4, 16), torch.from_numpy(w), True)
    with pytest.raises(ValueError, match="saturate"):
        _tactic_output(args, {"activation": ""})


def _qgemm_args(rng, shape, w, quantized_out, dtype=torch.uint8, y_dtype=torch.uint8):
    n = w.shape[0]
    x = _rows(rng, shape, dtype)
    x_zero = torch.tensor(int(rng.integers(0, 256) if dtype == torch.uint8 else rng.integers(-128, 128)), dtype=dtype)
    y_zero = torch.tensor(int(rng.integers(0, 40) if y_dtype == torch.uint8 else rng.integers(-20, 20)),
                          dtype=y_dtype)
    return [x, torch.tensor(0.02), x_zero, w, torch.from_numpy(rng.uniform(1e-3, 1e-2, n).astype(np.float32)),
            torch.zeros(n, dtype=torch.int8), torch.tensor(0.3) if quantized_out else None,
            y_zero if quantized_out else None, torch.from_numpy(rng.integers(-900, 900, n).astype(np.int32))]


def _ctx() -> OpContext:
    return OpContext(name="qgemm", op_type="QGemm", domain="kiln", num_inputs=9, num_outputs=1)


def _tactic_output(args: list, attrs: dict):
    """The autotuner's path for the candidate: check, configure, prepare on the constants, launch."""
    tactic = registry.get(TACTIC)
    step = StepSpec(op_type="QGemm", name="qgemm", inputs=[f"in{i}" for i in range(len(args))], outputs=["y"],
                    attributes=attrs, domain="kiln")
    metas = [InputMeta.of(a, i in CONSTANT) for i, a in enumerate(args)]
    ok = tactic.check(step, metas)
    assert ok is True, ok
    step = dataclasses.replace(step, tactic=TACTIC, tactic_config=tactic.configure(step, metas))
    launch = tactic.prepare(step, [a if i in CONSTANT else None for i, a in enumerate(args)], torch.device("cpu"))
    return launch(_ctx(), *args, **attrs)


def _within_one_step(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.is_floating_point():
        # float32 r = scale·float(t) against the reference's float64: one or two roundings of float32
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
        return
    diff = (got.to(torch.int64) - want.to(torch.int64)).abs()
    assert int(diff.max()) <= 1, int(diff.max())
    assert int((diff > 0).sum()) <= max(2, diff.numel() // 1000), int((diff > 0).sum())


OUTPUT_CASES = [  # (input shape, N, quantized output, source, output dtype)
    ((3, 40), 24, True, torch.uint8, torch.uint8),
    ((2, 7, 96), 64, True, torch.uint8, torch.int8),  # whole 32-channel panels: the one-vector byte store
    ((2, 7, 40), 45, False, torch.uint8, None),  # float output, a channel tail
    ((1, 40), 70, True, torch.int8, torch.uint8),
    ((17, 384), 96, True, torch.int8, torch.int8),
    ((5, 7, 32), 16, True, torch.uint8, torch.uint8),  # MobileNetV2's 16-channel projection: one 2-vector panel
    ((3, 11, 96), 24, True, torch.uint8, torch.int8),  # its 24-channel ones: 3 vectors, 16 + 8 channels a row
    ((2, 9, 24), 44, False, torch.uint8, None),  # float output on a 2-vector panel with a tail
    ((4, 5, 48), 24, False, torch.uint8, None),  # float output on 3-vector panels (fused 4 x 24 tiles), 20 rows
]


@pytest.mark.parametrize("activation", ["", "Relu", "Clip", "Gelu", "GeluTanh"])
@pytest.mark.parametrize("shape, n, quantized_out, dtype, y_dtype", OUTPUT_CASES)
def test_the_layer_is_the_reference_within_one_step(shape, n, quantized_out, dtype, y_dtype, activation):
    rng = case_rng(f"out {shape} {n} {quantized_out} {dtype} {y_dtype} {activation}")
    w = _pair_bound_weight(rng, n, shape[-1])
    args = _qgemm_args(rng, shape, w, quantized_out, dtype, y_dtype or torch.uint8)
    attrs = {"activation": activation, "alpha": -0.5 if activation == "Clip" else 0.0, "beta": 2.0}
    want = lookup("QGemm", "kiln").fn(_ctx(), *args, **attrs)
    _within_one_step(_tactic_output(args, attrs), want)


def test_what_it_cannot_run_is_refused_with_a_reason():
    from tests.unit.tactic_check import make_step, metas

    rng = case_rng("refusals")
    args = _qgemm_args(rng, (4, 32), torch.zeros(8, 32, dtype=torch.int8), True)
    tactic = registry.get(TACTIC)
    leaky = make_step("QGemm", "kiln", 9, activation="LeakyRelu")
    assert "LeakyRelu" in tactic.check(leaky, metas(args, CONSTANT))
    floats = [args[0].float()] + args[1:]
    assert "float32" in tactic.check(make_step("QGemm", "kiln", 9), metas(floats, CONSTANT))
    assert "constant" in tactic.check(make_step("QGemm", "kiln", 9), metas(args, CONSTANT - {3}))
    w_zero = list(args)
    w_zero[5] = torch.ones(8, dtype=torch.int8)
    with pytest.raises(ValueError, match="zero point"):
        _tactic_output(w_zero, {"activation": ""})


# ---- a built engine against onnxruntime --------------------------------------------------------

def _qdq_matmul(rng, shape, n, x_scale=0.05, x_zero=128, y_scale=0.2, y_zero=120) -> onnx.ModelProto:
    """Q(x) -> DQ -> MatMul with DQ(W int8, per output channel) -> Q -> DQ (bench/qdq_gemm_vs_mlas.py's model)."""
    k = shape[-1]
    w = rng.integers(-64, 64, (k, n)).astype(np.int8)
    inits = [numpy_helper.from_array(w, "W"),
             numpy_helper.from_array((rng.random(n) * 0.01 + 0.001).astype(np.float32), "ws"),
             numpy_helper.from_array(np.zeros(n, np.int8), "wz")]
    scalars = {"xs": np.float32(x_scale), "xz": np.uint8(x_zero), "ys": np.float32(y_scale), "yz": np.uint8(y_zero)}
    inits += [numpy_helper.from_array(np.array(v), name) for name, v in scalars.items()]
    nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
             helper.make_node("DequantizeLinear", ["W", "ws", "wz"], ["w"], axis=1),
             helper.make_node("MatMul", ["xd", "w"], ["y"]),
             helper.make_node("QuantizeLinear", ["y", "ys", "yz"], ["yq"]),
             helper.make_node("DequantizeLinear", ["yq", "ys", "yz"], ["out"])]
    graph = helper.make_graph(nodes, "qdq_matmul", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [*shape[:-1], n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    model.ir_version = 9
    return model


def _onnxruntime(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    ort = pytest.importorskip("onnxruntime")
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # the Q/DQ ops as written
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


@pytest.mark.parametrize("shape, n", [((2, 16, 96), 64), ((1, 9, 40), 45)])
def test_the_engine_layer_in_a_native_segment_equals_onnxruntime(shape, n):
    """The tactic allowed alone for QGemm (the quantize steps keep theirs): the layer is cpu.qgemm.kiln_i8, a member of
    a native segment, and the dequantized output is onnxruntime's within one output step (0.2), at most a few
    elements off by that step (ties of the float32 requantize)."""
    rng = case_rng(f"engine {shape} {n}")
    model = _qdq_matmul(rng, shape, n)
    engine = kiln.build(model, device="cpu", tactics=[TACTIC, "cpu.quantize", "cpu.dequantize"])
    (gemm,) = [s for s in engine.plan.program.steps if s.op_type == "QGemm"]
    assert gemm.tactic == TACTIC
    assert any(gemm.name in {m.ctx.name for m in s.members} for s in engine.program.segments)
    context = engine.create_execution_context()
    for _ in range(2):
        x = rng.normal(0, 3, shape).astype(np.float32)
        got, want = context.run({"x": x})["out"], _onnxruntime(model, x)
        steps = np.abs(got - want) / 0.2
        assert steps.max() <= 1.0 + 1e-4, steps.max()
        assert (steps > 0.5).sum() <= max(2, steps.size // 1000)


def test_an_engine_of_dynamic_rows_runs_every_size_of_its_profile():
    """[batch, seq, 96] inputs through a profile: the segment's other sizes run the layer's plan at their rows (the
    packed weight shared, NativeStep.plan_at), each equal to onnxruntime's within one output step."""
    rng = case_rng("dynamic")
    model = _qdq_matmul(rng, ["batch", "seq", 96], 64)
    engine = kiln.build(model, device="cpu", tactics=[TACTIC, "cpu.quantize", "cpu.dequantize"],
                        profiles=[{"x": "1x1x96,2x16x96,3x40x96"}])
    assert next(s for s in engine.plan.program.steps if s.op_type == "QGemm").tactic == TACTIC
    context = engine.create_execution_context()
    for shape in [(2, 16, 96), (1, 1, 96), (3, 40, 96), (1, 7, 96), (2, 16, 96), (3, 33, 96)]:
        x = rng.normal(0, 3, shape).astype(np.float32)
        got, want = context.run({"x": x})["out"], _onnxruntime(model, x)
        assert got.shape == (*shape[:-1], 64)
        steps = np.abs(got - want) / 0.2
        assert steps.max() <= 1.0 + 1e-4, (shape, steps.max())
        assert (steps > 0.5).sum() <= max(2, steps.size // 1000)


def test_the_tuner_times_it_beside_onednn_and_the_float_layer():
    rng = case_rng("tuner")
    engine = kiln.build(_qdq_matmul(rng, (1, 24, 128), 64), device="cpu")
    tried = next(layer for layer in engine.plan.header["tactics"]["layers"].values()
                 if TACTIC in layer.get("candidates", {}))
    assert isinstance(tried["candidates"][TACTIC], float), tried["candidates"][TACTIC]
    assert {"cpu.qgemm.onednn", "cpu.qgemm.dequantized"} <= set(tried["candidates"])


_PLAIN_BUILD = """
import json, numpy as np, torch
from kiln.kernels.cpu import native_loop
native_loop.compile_flags = lambda: (("-O2", "-fopenmp"),)
from kiln.kernels.cpu import i8gemm
rng = np.random.default_rng(7)
out = []
for rows, k, n, dtype, zero in [(7, 37, 45, torch.int8, -3), (5, 64, 33, torch.uint8, 200)]:
    w = rng.integers(-64, 65, (n, k)).astype(np.int8)
    lo, hi = (0, 256) if dtype == torch.uint8 else (-128, 128)
    x = torch.from_numpy(rng.integers(lo, hi, (rows, k))).to(dtype)
    layer = i8gemm.I8Gemm(torch.from_numpy(w), torch.ones(n), None, rows, dtype, 1.0, zero, (torch.int32, 1.0, 0))
    want = (x.numpy().astype(np.int64) - zero) @ w.astype(np.int64).T
    out.append(bool((layer(x).numpy() == want).all()))
print(json.dumps({"vector": i8gemm.vector_products(), "exact": out}))
"""


@pytest.mark.slow
def test_the_plain_c_build_gives_the_same_sums(tmp_path):
    """The kernel compiled without -march (no AVX2: the plain C loop) in a subprocess (a kernel library is loaded once
    per process), its own cache: the same int32 sums as numpy."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root), KILN_CACHE=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", _PLAIN_BUILD], env=env, capture_output=True, text=True, timeout=300,
                          cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"vector": False, "exact": [True, True]}


# ---- the activation on the packed words (requantize.word_fields) ---------------------------------

@pytest.mark.parametrize("y_dtype, y_zero", [(torch.uint8, 0), (torch.uint8, 17), (torch.int8, -9)])
@pytest.mark.parametrize("activation, alpha, beta, y_scale", [
    ("Relu", 0.0, 0.0, 0.05),
    ("Clip", -0.5, 2.0, 0.03),  # both bounds inside the 8-bit range: the words are clamped
    ("Clip", 0.0, 6.0, 6.0 / 255),  # ReLU6 into [0, 6]: the saturation is the clamp (none applied)
    ("", 0.0, 0.0, 0.05),
])
def test_the_clamp_on_packed_words_is_the_float_clamp(activation, alpha, beta, y_scale, y_dtype, y_zero):
    """The same layer with Relu/Clip on the rounded int16 words (bounded: the default here) and on the floats
    (bounded cleared in its plan): equal on every value, both rounding after one multiply by scale_q."""
    rng = case_rng(f"words {activation} {alpha} {beta} {y_scale} {y_dtype} {y_zero}")
    rows, k, n = 29, 48, 40  # a whole panel and a 1-vector one
    x, w = _rows(rng, (rows, k), torch.uint8), torch.from_numpy(rng.integers(-64, 64, (n, k)).astype(np.int8))
    w_scale = torch.from_numpy(rng.uniform(1e-3, 1e-2, n).astype(np.float32))
    bias = torch.from_numpy(rng.integers(-4000, 4000, n).astype(np.int32))
    layers = [i8gemm.I8Gemm(w, w_scale, bias, rows, torch.uint8, 0.02, 131, (y_dtype, y_scale, y_zero), activation,
                            alpha, beta) for _ in range(2)]
    assert layers[0].fields["bounded"] == 1
    low, high = (0, 255) if y_dtype == torch.uint8 else (-128, 127)
    lo, hi = round(alpha / y_scale) + y_zero, round(beta / y_scale) + y_zero  # Clip's bounds in steps
    expected_clamp = activation == "Relu" and y_zero > low or activation == "Clip" and (lo > low or hi < high)
    assert layers[0].fields["clamp_words"] == int(expected_clamp), layers[0].fields
    layers[1]._plan.bounded = 0
    words, floats = (layer(x) for layer in layers)
    assert torch.equal(words, floats)
    assert int(words.min()) >= low and int(words.max()) <= high and int(words.max()) > int(words.min())


def test_a_layer_whose_products_could_overflow_int32_keeps_the_float_clamps():
    """y_scale 1e-7: scale_q·t reaches past 2^30, so the plan is not bounded and the floats are clamped before the
    conversion (which would wrap to INT_MIN): every value saturates as numpy's int64 reference does."""
    rng = case_rng("unbounded")
    rows, k, n = 8, 64, 24
    x, w = _rows(rng, (rows, k), torch.uint8), torch.from_numpy(rng.integers(-64, 64, (n, k)).astype(np.int8))
    w_scale = torch.full((n,), 0.01)
    layer = i8gemm.I8Gemm(w, w_scale, None, rows, torch.uint8, 0.02, 128, (torch.uint8, 1e-7, 3))
    assert layer.fields["bounded"] == 0
    t = (x.numpy().astype(np.int64) - 128) @ w.numpy().astype(np.int64).T
    want = np.clip(np.rint(t * np.float64(np.float32(0.02 * 0.01)) / 1e-7) + 3, 0, 255)
    np.testing.assert_array_equal(layer(x).numpy(), want.astype(np.uint8))
