"""w16gemm (kiln/kernels/cpu/w16gemm.c, tactic cpu.qconv.w8a16_gemm): a W8A16 1x1 convolution in one pass.

- its int32 sums Σ (q - offset)·w equal numpy's int64 ones exactly (q: onnx.reference's QuantizeLinear of the input
  to uint16 / int16), at odd channel counts and spatial sizes, saturated activations, K = 960;
- a weight whose sums could pass 2^31 is summed in exact chunks: float output within float32 rounding of a float64
  sum, and its int32 sums refused;
- outputs against onnxruntime running the same Q/DQ model: float32 within 1e-4 of the output's magnitude (onnxruntime
  sums in float32), requantized uint8 within one quantization step (ties), and a built engine that runs the layer
  as cpu.qconv.w8a16_gemm inside a native segment the same;
- the AVX2 (vpmaddwd) and plain C builds of the kernel (KILN_CPU_ISA=avx2, no -march) give the same sums, in a
  subprocess each (a kernel library is loaded once per process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

import kiln
from kiln.kernels.cpu import cpu_features, w16gemm
from kiln.tactics import registry
from kiln.tactics.cpu import w8a16 as w8a16_tactics
from tests.unit.oracle import case_rng
from tests.unit.test_w8a16_engine import _chain_engines, _chain_outputs, _layer_model, _quantize_linear, _within_a_step

pytestmark = pytest.mark.skipif(not w16gemm.available(), reason=f"w16gemm: {w16gemm.reason()}")
ROOT = Path(__file__).resolve().parents[2]
WIDE = {"uint16": torch.uint16, "int16": torch.int16}


def _inputs(shape, wide, rng, s):
    x = rng.normal(0, 20000, shape) if wide == "int16" else rng.uniform(-2000, 70000, shape)
    x = (x * s).astype(np.float32)
    edge = np.array([1e6, -1e6, 65535.5, -32768.5], np.float32) * s  # saturation both ways, a tie
    x.reshape(-1)[:min(4, x.size)] = edge[:x.size]
    return x


SUM_CASES = [  # (input NCHW, out channels, wide)
    ((1, 16, 9, 11), 24, "uint16"),
    ((2, 17, 5, 3), 33, "int16"),  # odd K (a zero pair half), O past a vector, odd rows
    ((1, 3, 1, 1), 1, "uint16"),  # one row, one channel
    ((1, 96, 7, 7), 160, "int16"),  # 49 rows: a partial row block
    ((1, 960, 3, 5), 40, "uint16"),  # K = 960
    ((3, 64, 4, 4), 65, "int16"),
]


@pytest.mark.parametrize("shape, out, wide", SUM_CASES)
def test_int32_sums_equal_numpy_int64(shape, out, wide):
    rng = case_rng(f"sums {shape} {out} {wide}")
    c = shape[1]
    # a weight whose sums cannot pass 2^31 (one chunk): Σ|w| <= 65535 per channel
    w = np.clip(rng.normal(0, min(60.0, 50000 / c), (out, c, 1, 1)), -127, 127).round().astype(np.int8)
    assert w16gemm.exact_chunk(torch.from_numpy(w)) == (c + 1) // 2
    s = np.float32(0.0173)
    x = _inputs(shape, wide, rng, s)
    q = _quantize_linear(x, s, wide)
    layer = w16gemm.W16Gemm(torch.from_numpy(w), torch.ones(out), None, list(shape), float(s), WIDE[wide],
                            y=(torch.int32, 1.0, 0))
    got = layer(torch.from_numpy(x).contiguous(memory_format=torch.channels_last))
    assert got.dtype == torch.int32 and got.is_contiguous(memory_format=torch.channels_last)
    offset = 32768 if wide == "uint16" else 0
    want = np.einsum("nchw,oc->nohw", q - offset, w.reshape(out, c).astype(np.int64))
    np.testing.assert_array_equal(got.numpy().astype(np.int64), want)
    if c >= 64:  # past float32's exact integers: a float sum would not be exact
        assert np.abs(want).max() > 2**24


def test_a_weight_that_can_pass_int32_is_summed_in_exact_chunks():
    """Every activation at its largest step and every weight 127 at K = 960: Σ q·w = 960·127·65535 ≈ 8e9 > 2^31."""
    shape, out = (1, 960, 2, 3), 20
    w = np.full((out, 960, 1, 1), 127, np.int8)
    w[1::2] = -127
    s = np.float32(1e-4)
    x = np.full(shape, 65535 * s, np.float32)
    x[..., 0, 0] = 1000 * s
    kc = w16gemm.exact_chunk(torch.from_numpy(w))
    assert kc == w16gemm.EXACT_CHUNK < 480
    w_scale = np.full(out, 0.01, np.float32)
    layer = w16gemm.W16Gemm(torch.from_numpy(w), torch.from_numpy(w_scale), None, list(shape), float(s),
                            torch.uint16)
    got = layer(torch.from_numpy(x).contiguous(memory_format=torch.channels_last)).numpy().astype(np.float64)
    q = _quantize_linear(x, s, "uint16").astype(np.float64)
    want = np.einsum("nchw,oc->nohw", q, w.reshape(out, 960).astype(np.float64)) * float(s) * w_scale[None, :, None,
                                                                                                        None]
    assert np.abs(want).max() / (float(s) * 0.01) > 2**31
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=0)
    with pytest.raises(ValueError, match="float chunks"):
        w16gemm.W16Gemm(torch.from_numpy(w), torch.ones(out), None, list(shape), float(s), torch.uint16,
                        y=(torch.int32, 1.0, 0))


def _onnxruntime(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    ort = pytest.importorskip("onnxruntime")
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # the Q/DQ ops as written
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


ORT_CASES = [  # (input NCHW, out channels, wide, activation, requantize)
    ((1, 16, 9, 11), 24, "uint16", "Clip", True),  # a projection of a ReLU6 output, 8-bit output
    ((2, 24, 5, 7), 37, "int16", "", False),  # the signed residual stream, odd O, float output
    ((1, 33, 3, 3), 48, "uint16", "Relu", False),
    ((1, 160, 7, 7), 96, "int16", "Clip", True),
]


@pytest.mark.parametrize("shape, out, wide, activation, requantize", ORT_CASES)
def test_the_engine_layer_equals_onnxruntime(monkeypatch, shape, out, wide, activation, requantize):
    """The Q/DQ model built by kiln with the split tactic taken away: the layer is cpu.qconv.w8a16_gemm, and its
    outputs are onnxruntime's within a quantization step."""
    rng = case_rng(f"ort {shape} {out} {wide} {activation} {requantize}")
    model = _layer_model(shape, out, 1, [1, 1], [0, 0, 0, 0], 1, wide, activation, requantize, rng)
    monkeypatch.delitem(registry._TACTICS, "cpu.qconv.w8a16")
    engine = kiln.build(model, device="cpu")
    layer = next(s for s in engine.plan.program.steps if s.name == "layer")
    assert layer.op_type == "QConv" and layer.tactic == "cpu.qconv.w8a16_gemm"
    context = engine.create_execution_context()
    for k in range(2):
        x = (rng.normal(0, 2, shape) if wide == "int16" else rng.uniform(-0.5, 6.5, shape)).astype(np.float32)
        _within_a_step(context.run({"x": x})["y"], _onnxruntime(model, x), requantize)


@pytest.mark.skipif(not cpu_features.has_int8_dot_product(), reason="the split layer beside it is VNNI's (its "
                    "full-range int8 weights would saturate vpmaddubsw; test_w8a16_avx2.py covers that CPU)")
def test_in_a_native_segment_beside_the_split_layer(monkeypatch):
    """test_w8a16_engine's chain (int8 conv, W8A16 depthwise, W8A16 1x1 projection) with the split tactic refusing 1x1
    layers: the projection runs as cpu.qconv.w8a16_gemm bound into the same native segment as the split depthwise,
    equal to the engine without segments (its per-call path) and to the emulation within a 16-bit near-tie."""
    import dataclasses

    split = registry.get("cpu.qconv.w8a16")

    def not_pointwise(step, inputs):
        return "test: 1x1 is the GEMM's" if tuple(inputs[3].shape[2:]) == (1, 1) else split.supports(step, inputs)

    monkeypatch.setitem(registry._TACTICS, split.name, dataclasses.replace(split, supports=not_pointwise))
    rng = case_rng("chain gemm")
    engine, alone, emulation = _chain_engines(rng, monkeypatch, ("cpu.qconv.w8a16_gemm",))
    for k in range(3):
        got, want = _chain_outputs(engine, alone, emulation, rng.normal(0, 1, (1, 8, 12, 12)).astype(np.float32))
        assert np.abs(got - want).max() < 1e-3 * np.abs(want).max()


def test_a_3x3_layer_is_refused_and_the_tuner_may_pick_either():
    """The mutation side: a 3x3 convolution is not the GEMM (the reason says so); a 1x1 layer's candidates include
    both W8A16 tactics, timed."""
    rng = case_rng("refusal")
    from tests.unit.tactic_check import metas, make_step
    step = make_step("QConv", "kiln", 9, kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    args = [torch.zeros(1, 8, 5, 5), torch.tensor(0.01), torch.tensor(0, dtype=torch.uint16),
            torch.zeros(4, 8, 3, 3, dtype=torch.int8), torch.full((4,), 0.01), torch.zeros(4, dtype=torch.int8),
            None, None, torch.zeros(4, dtype=torch.int32)]
    why = registry.get("cpu.qconv.w8a16_gemm").check(step, metas(args, {1, 2, 3, 4, 5, 8}))
    assert isinstance(why, str) and "1x1" in why
    engine = kiln.build(_layer_model((1, 16, 6, 6), 24, 1, [1, 1], [0, 0, 0, 0], 1, "uint16", "Clip", False, rng),
                        device="cpu")
    tried = next(layer for name, layer in engine.plan.header["tactics"]["layers"].items() if "layer" in name)
    assert {"cpu.qconv.w8a16", "cpu.qconv.w8a16_gemm"} <= set(tried["candidates"])
    assert next(s for s in engine.plan.program.steps if s.name == "layer").tactic in w8a16_tactics.TACTICS


def test_bad_input_is_a_clear_error():
    w = torch.zeros(4, 8, 1, 1, dtype=torch.int8)
    with pytest.raises(ValueError, match="int8 weight"):
        w16gemm.W16Gemm(w.float(), torch.ones(4), None, [1, 8, 2, 2], 0.1, torch.uint16)
    with pytest.raises(ValueError, match="16-bit"):
        w16gemm.W16Gemm(w, torch.ones(4), None, [1, 8, 2, 2], 0.1, torch.uint8)
    with pytest.raises(ValueError, match="input channels"):
        w16gemm.W16Gemm(w, torch.ones(4), None, [1, 6, 2, 2], 0.1, torch.uint16)
    with pytest.raises(ValueError, match="activation"):
        w16gemm.W16Gemm(w, torch.ones(4), None, [1, 8, 2, 2], 0.1, torch.uint16, activation="Sigmoid")
    layer = w16gemm.W16Gemm(w, torch.ones(4), None, [1, 8, 2, 2], 0.1, torch.uint16)
    with pytest.raises(ValueError, match="given"):
        layer(torch.zeros(1, 8, 3, 2))


_OTHER_BUILD = """
import json, sys, numpy as np, torch
from kiln.kernels.cpu import native_loop
if sys.argv[1] == "plain":
    native_loop.compile_flags = lambda: (("-O2", "-fopenmp"),)
from kiln.kernels.cpu import w16gemm
rng = np.random.default_rng(7)
out = []
for shape, o, wide in [((1, 17, 5, 3), 33, torch.int16), ((2, 40, 3, 3), 24, torch.uint16)]:
    w = rng.integers(-127, 128, (o, shape[1], 1, 1)).astype(np.int8)
    lo, hi = w16gemm.RANGES[wide]
    q = rng.integers(lo, hi + 1, shape)
    x = torch.from_numpy((q * 0.01).astype(np.float32))
    q = torch.round(x / torch.tensor(0.01)).clamp(lo, hi).long().numpy()
    layer = w16gemm.W16Gemm(torch.from_numpy(w), torch.ones(o), None, list(shape), 0.01, wide, y=(torch.int32, 1.0, 0))
    got = layer(x.contiguous(memory_format=torch.channels_last)).numpy()
    want = np.einsum("nchw,oc->nohw", q - w16gemm.OFFSETS[wide], w.reshape(o, -1).astype(np.int64))
    out.append(bool((got == want).all()))
print(json.dumps({"isa": w16gemm.isa(), "exact": out}))
"""


@pytest.mark.parametrize("build, isa", [("avx2", "avx2 vpmaddwd"),
                                        pytest.param("plain", "plain C", marks=pytest.mark.slow)])
def test_the_other_isa_builds_give_the_same_sums(build, isa):
    if build == "avx2" and "avx2" not in cpu_features.flags():
        pytest.skip("no AVX2 on this CPU")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if build == "avx2":
        env["KILN_CPU_ISA"] = "avx2"
    done = subprocess.run([sys.executable, "-c", _OTHER_BUILD, build], env=env, capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"isa": isa, "exact": [True, True]}
