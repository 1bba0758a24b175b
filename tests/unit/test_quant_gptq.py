"""GPTQ weight rounding (kiln/quant/gptq.py, BuildConfig.gptq): on one-layer models (a dense and a depthwise
Conv, a Gemm, a MatMul), kiln's int8 weights equal a plain numpy GPTQ (second moments from explicit patches,
the inverse Hessian downdated column by column as in Frantar et al.'s algorithm 1 before its Cholesky
rewrite), and the layer's output error on the calibration data is below round-to-nearest's."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch
from onnx import helper

from kiln.builder.calibration import quantize
from kiln.builder import refit
from kiln.builder.config import BuildConfig
from kiln.errors import KilnError
from kiln.quant import gptq


def _conv_model(rng, c_in: int, c_out: int, group: int, stride: int) -> tuple[onnx.ModelProto, np.ndarray]:
    w = rng.normal(size=(c_out, c_in // group, 3, 3)).astype(np.float32)
    b = rng.normal(size=c_out).astype(np.float32)
    node = helper.make_node("Conv", ["x", "w", "b"], ["y"], name="layer", pads=[1, 0, 2, 1], strides=[stride, stride],
                            group=group)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", 1, [2, c_in, 9, 9])],
                              [helper.make_tensor_value_info("y", 1, None)],
                              [onnx.numpy_helper.from_array(w, "w"), onnx.numpy_helper.from_array(b, "b")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), w


def _gemm_model(rng, k: int, n: int, op: str) -> tuple[onnx.ModelProto, np.ndarray]:
    if op == "Gemm":  # transB: the weight is [N, K]
        w = rng.normal(size=(n, k)).astype(np.float32)
        node = helper.make_node("Gemm", ["x", "w"], ["y"], name="layer", transB=1)
        shape = [6, k]
    else:
        w = rng.normal(size=(k, n)).astype(np.float32)
        node = helper.make_node("MatMul", ["x", "w"], ["y"], name="layer")
        shape = [2, 3, k]
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", 1, shape)],
                              [helper.make_tensor_value_info("y", 1, None)], [onnx.numpy_helper.from_array(w, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), w


def _correlated(rng, shape: tuple[int, ...], axis: int) -> np.ndarray:
    """Inputs whose channels (along axis) are correlated and of unequal size: where GPTQ's feedback matters."""
    c = shape[axis]
    mix = rng.normal(size=(c, c)) * np.geomspace(2.0, 0.2, c)[None, :] + np.eye(c)
    z = np.moveaxis(rng.normal(size=shape), axis, -1) @ mix
    return np.moveaxis(z, -1, axis).astype(np.float32)


def _smooth(x: np.ndarray) -> np.ndarray:
    """Neighbouring pixels correlated too (an image's): a depthwise kernel's nine taps read similar values."""
    return x + 0.9 * np.roll(x, 1, axis=-1) + 0.9 * np.roll(x, 1, axis=-2) + 0.8 * np.roll(x, (1, 1), axis=(-2, -1))


def _quantized_weight(proto: onnx.ModelProto, batches: list, use_gptq: bool) -> tuple[np.ndarray, np.ndarray, dict]:
    config = BuildConfig(precision="int8", quantization="emulate", calibration=batches, calibrator="minmax",
                         bias_correction=False, gptq=use_gptq)
    model, record = quantize(ir.from_proto(proto), config, lambda _m: None)
    dq = next(n for n in model.graph if n.op_type == "DequantizeLinear" and n.inputs[0].const_value is not None
              and n.inputs[0].const_value.dtype == ir.DataType.INT8)
    q = dq.inputs[0].const_value.numpy().astype(np.float64)
    scale = dq.inputs[1].const_value.numpy().astype(np.float64)
    shape = [1] * q.ndim
    shape[dq.attributes["axis"].value] = -1
    return q, q * scale.reshape(shape), record


def _patches(x: np.ndarray, group: int, stride: int) -> np.ndarray:
    """[g, rows, C/g·3·3] by explicit windows over x padded as the model pads (top 1, left 0, bottom 2, right 1)."""
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (1, 2), (0, 1)))
    win = np.lib.stride_tricks.sliding_window_view(xp, (3, 3), axis=(2, 3))[:, :, ::stride, ::stride]  # [N,C,H,W,3,3]
    n, c, h, w = win.shape[:4]
    win = win.reshape(n, group, c // group, h, w, 3, 3).transpose(1, 0, 3, 4, 2, 5, 6)
    return win.reshape(group, n * h * w, c // group * 9)


def _reference_gptq(w: np.ndarray, h: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """GPTQ without the Cholesky trick: H⁻¹ kept explicitly and downdated after each column (OBQ's update)."""
    w = w.astype(np.float64).copy()
    out = np.zeros_like(w)
    group_rows = w.shape[0] // h.shape[0]
    for g in range(h.shape[0]):
        hg = h[g].copy()
        dead = np.diag(hg) == 0
        hg[np.diag_indices_from(hg)] += 0.01 * np.mean(np.diag(hg)) + dead
        inv = np.linalg.inv(hg)
        rows = slice(g * group_rows, (g + 1) * group_rows)
        wg, sg = w[rows], scale[rows]
        for j in range(w.shape[1]):
            q = np.clip(np.round(wg[:, j] / sg), -127, 127)
            out[rows, j] = q
            err = (wg[:, j] - q * sg) / inv[j, j]
            wg[:, j + 1:] -= np.outer(err, inv[j, j + 1:])
            inv = inv - np.outer(inv[:, j], inv[j, :]) / inv[j, j]
    return out


def _scale(w2: np.ndarray) -> np.ndarray:
    amax = np.abs(w2).max(axis=1)
    return np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32).astype(np.float64)


@pytest.mark.parametrize("c_in,c_out,group,stride", [(6, 5, 1, 1), (6, 6, 6, 2), (6, 4, 2, 1)],
                         ids=["dense", "depthwise", "grouped"])
def test_conv_weights_equal_reference_and_beat_nearest(c_in, c_out, group, stride):
    rng = np.random.default_rng(20 + group)
    proto, w = _conv_model(rng, c_in, c_out, group, stride)
    batches = [{"x": _smooth(_correlated(rng, (2, c_in, 9, 9), 1))} for _ in range(4)]
    x = np.concatenate([b["x"] for b in batches])
    rows = _patches(x, group, stride)
    h = np.einsum("grk,grl->gkl", rows, rows) / rows.shape[1]
    # the observer's second moments: the explicit patches'
    moment = gptq.SecondMoment(ir.from_proto(proto).graph.node(0))
    for b in batches:
        moment.observe(torch.from_numpy(b["x"]))
    np.testing.assert_allclose(moment.value(), h, rtol=1e-9, atol=1e-9)
    q, w_gptq, record = _quantized_weight(proto, batches, True)
    assert record["gptq"] is True
    w2 = w.reshape(c_out, -1)
    want = _reference_gptq(w2, h, _scale(w2))
    assert np.array_equal(q.reshape(c_out, -1), want), np.argwhere(q.reshape(c_out, -1) != want)
    q_rtn, w_rtn, record = _quantized_weight(proto, batches, False)
    assert record["gptq"] is False and not np.array_equal(q, q_rtn)

    def error(wq):
        return float(np.sum((np.einsum("grk,gok->gro", rows, (wq - w).reshape(group, c_out // group, -1))) ** 2))
    # measured 0.49 (dense), 0.69 (depthwise), 0.84 (grouped) of round-to-nearest's
    assert error(w_gptq) < 0.9 * error(w_rtn), (error(w_gptq), error(w_rtn))


@pytest.mark.parametrize("op", ["Gemm", "MatMul"])
def test_gemm_weights_equal_reference_and_beat_nearest(op):
    rng = np.random.default_rng(31)
    k, n = 24, 10
    proto, w = _gemm_model(rng, k, n, op)
    shape = (6, k) if op == "Gemm" else (2, 3, k)
    batches = [{"x": _correlated(rng, shape, len(shape) - 1)} for _ in range(5)]
    rows = np.concatenate([b["x"].reshape(-1, k) for b in batches]).astype(np.float64)
    h = (rows.T @ rows / rows.shape[0])[None]
    w_nk = w if op == "Gemm" else w.T  # [N, K]: one row per output channel
    want = _reference_gptq(w_nk, h, _scale(w_nk))
    q, w_gptq, _ = _quantized_weight(proto, batches, True)
    assert np.array_equal(q if op == "Gemm" else q.T, want)
    _, w_rtn, _ = _quantized_weight(proto, batches, False)

    def error(wq):
        d = (wq - w) if op == "Gemm" else (wq - w).T
        return float(np.sum((rows @ d.T) ** 2))
    assert error(w_gptq) < 0.6 * error(w_rtn), (error(w_gptq), error(w_rtn))  # measured 0.30 (Gemm), 0.35 (MatMul)


def test_fp8_and_mismatched_moments():
    rng = np.random.default_rng(4)
    proto, _ = _gemm_model(rng, 8, 4, "Gemm")
    config = BuildConfig(precision="fp8", quantization="emulate", calibrator="minmax", gptq=True,
                         calibration=[{"x": rng.normal(size=(6, 8)).astype(np.float32)}])
    said = []
    _, record = quantize(ir.from_proto(proto), config, said.append)
    assert record["gptq"] is False and any("gptq: int8 weights only" in s for s in said)
    with pytest.raises(KilnError, match="second moments"):
        gptq.round_weights(np.ones((4, 8)), np.eye(6)[None], np.ones(4), 127)


def test_refit_from_recorded_ranges_refuses_gptq_weights():
    """The second moments are not in the engine: a refit without recalibration cannot round as the build did."""
    rng = np.random.default_rng(5)
    proto, _ = _gemm_model(rng, 8, 4, "Gemm")
    with pytest.raises(refit.RefitError, match="GPTQ"):
        refit._requantize(ir.from_proto(proto), BuildConfig(precision="int8", quantization="emulate", gptq=True),
                          {"mode": "emulate", "gptq": True, "ranges": {"x": 1.0}}, None)
