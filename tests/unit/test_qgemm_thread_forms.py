"""A small int8 matmul has a one-thread form, and a QDQ engine's native segment chooses between its forms by their
measured times (kiln/kernels/cpu/form_choice.py), as segments of float small layers do: without it every step of
onnxruntime's QDQ BERT-tiny forked at 2 threads and waited on held cores (4.2x onnxruntime; bench/quant_threads_ab.py).
Both forms compute the same thing, which is onnxruntime's QDQ model within one quantization step."""

from __future__ import annotations

import zlib

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

import kiln
from kiln.kernels.cpu import onednn
from kiln.kernels.cpu.form_choice import PARALLEL, SERIAL
from kiln.runtime import native
from tests.calibration import FeedsReader

needs_onednn = pytest.mark.skipif(not onednn.available(), reason="needs oneDNN")


def _model(path, rng) -> np.ndarray:
    """x [1, 64, 32] @ W1 [32, 48] -> Relu -> @ W2 [48, 16]: two MatMuls onnxruntime quantizes. Returns W2."""
    w2_value = (rng.standard_normal((48, 16)) * 0.2).astype(np.float32)
    w1 = numpy_helper.from_array((rng.standard_normal((32, 48)) * 0.2).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(w2_value, "w2")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
         helper.make_node("MatMul", ["r", "w2"], ["y"])], "two_matmuls",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64, 16])], [w1, w2])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return w2_value


def _feeds(n: int, seed: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((1, 64, 32), dtype=np.float32)} for _ in range(n)]


@needs_onednn
def test_a_qdq_segment_runs_its_serial_form_and_both_forms_are_onnxruntimes_model(two_threads, tmp_path, monkeypatch):
    from kiln.kernels.cpu import i8gemm

    # oneDNN's int8 matmul, whose one-thread twin this is about: kiln's own AVX2 int8 GEMM (cpu.qgemm.kiln_i8) would
    # win these layers and picks one thread itself below i8gemm.PARALLEL_MACS (no form chooser to test)
    monkeypatch.setattr(i8gemm, "available", lambda: False)
    # a model this small runs its serial form alone (native_members.TINY_WORK): the chooser is what is tested here
    monkeypatch.setattr(native, "TINY_WORK", 0)
    rng = np.random.default_rng(zlib.crc32(b"qgemm thread forms"))
    fp32, qdq = tmp_path / "fp32.onnx", tmp_path / "qdq.onnx"
    w2 = _model(fp32, rng)
    quantize_static(str(fp32), str(qdq), FeedsReader(_feeds(6, seed=1)), quant_format=QuantFormat.QDQ,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8, per_channel=True,
                    reduce_range=True, calibrate_method=CalibrationMethod.MinMax)
    engine = kiln.build(str(qdq))  # 7-bit weights (reduce_range): the int8 matmuls run without VNNI too
    segments = engine.program.segments
    assert any(s.chooser is not None for s in segments), "no native segment of the QDQ engine has a serial form"

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # the Q/DQ ops as written
    session = ort.InferenceSession(str(qdq), options, providers=["CPUExecutionProvider"])
    model = onnx.load(str(qdq))
    scales = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    dq = [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
    # one step of the output, plus one flipped step of the hidden activation through W2 (its largest column sum)
    out_step = float(np.max(scales[dq[-1].input[1]]))
    hidden = [n for n in dq if n.input[0] not in scales and n is not dq[0] and n is not dq[-1]]
    hidden_step = max(float(np.max(scales[n.input[1]])) for n in hidden) if hidden else 0.0
    bound = out_step + hidden_step * float(np.abs(w2).sum(axis=0).max()) * 1.05 + 1e-5

    chooser = next(s.chooser for s in segments if s.chooser is not None)
    feeds = _feeds(4, seed=zlib.crc32(b"held out"))
    ran = {PARALLEL: [], SERIAL: []}
    for k in range(12):  # the chooser's start takes each form in turn: both run within these
        f = feeds[k % len(feeds)]
        form = chooser.choose()
        ran[form].append((k % len(feeds), next(iter(engine.run(f).values()))))
    assert chooser.runs[SERIAL] >= 3 and chooser.runs[PARALLEL] >= 3, chooser.runs
    for form, outputs in ran.items():
        for i, got in outputs:
            want = session.run(None, feeds[i])[0]
            diff = np.abs(np.asarray(got) - want)
            assert diff.max() <= bound, (form, diff.max(), bound)
            # past one output step only where a hidden rounding tie flipped: a handful of elements at most
            assert (diff > out_step + 1e-5).sum() <= max(2, diff.size // 100), (form, (diff > out_step).sum())
    # the two forms agree with each other exactly on the same input (int32 accumulation, the same requantization)
    by_input = {}
    for form, outputs in ran.items():
        for i, got in outputs:
            by_input.setdefault(i, {})[form] = np.asarray(got)
    both = [v for v in by_input.values() if len(v) == 2]
    assert both
    for v in both:
        np.testing.assert_array_equal(v[PARALLEL], v[SERIAL])


@needs_onednn
def test_the_int8_matmul_per_call_path_runs_both_forms_alike(two_threads):
    from kiln.kernels.cpu.onednn_int8 import QMatMul

    rng = np.random.default_rng(zlib.crc32(b"qmatmul per call"))
    w = torch.from_numpy(rng.integers(-64, 65, (24, 40)).astype(np.int8))
    mm = QMatMul(w, torch.rand(24) * 0.01 + 1e-3, torch.from_numpy(rng.integers(-900, 900, 24).astype(np.int32)),
                 rows=16, x_dtype=torch.uint8, x_scale=0.02, x_zero=17, y=(torch.uint8, 0.3, 9))
    assert mm._forms.chooser is not None and mm._per_call.serial_primitive is not None
    x = torch.from_numpy(rng.integers(0, 256, (16, 40)).astype(np.uint8))
    outputs = {PARALLEL: [], SERIAL: []}
    for _ in range(10):
        form = mm._forms.chooser.choose()
        outputs[form].append(mm(x).clone())
    assert outputs[PARALLEL] and outputs[SERIAL], mm._forms.chooser.runs
    for y in outputs[PARALLEL][1:] + outputs[SERIAL]:
        torch.testing.assert_close(y, outputs[PARALLEL][0], rtol=0, atol=0)


@needs_onednn
@pytest.mark.parametrize("groups", [1, 8])
def test_the_int8_convolution_per_call_path_runs_both_forms_alike(two_threads, groups):
    from kiln.kernels.cpu.onednn_int8 import QConv2d

    rng = np.random.default_rng(zlib.crc32(f"qconv per call {groups}".encode()))
    w = torch.from_numpy(rng.integers(-64, 65, (16, 16 // groups, 3, 3)).astype(np.int8))
    conv = QConv2d(w, torch.rand(16) * 0.01 + 1e-3, torch.from_numpy(rng.integers(-900, 900, 16).astype(np.int32)),
                   [1, 16, 12, 12], [1, 1], [1, 1, 1, 1], [1, 1], groups, torch.uint8, 0.02, 17,
                   (torch.uint8, 0.3, 9), "Relu")
    assert conv._forms.chooser is not None and conv._per_call.serial_primitive is not None
    x = torch.from_numpy(rng.integers(0, 256, (1, 16, 12, 12)).astype(np.uint8)).contiguous(
        memory_format=torch.channels_last)
    outputs = {PARALLEL: [], SERIAL: []}
    for _ in range(10):
        form = conv._forms.chooser.choose()
        outputs[form].append(conv(x).clone())
    assert outputs[PARALLEL] and outputs[SERIAL], conv._forms.chooser.runs
    for y in outputs[PARALLEL][1:] + outputs[SERIAL]:
        torch.testing.assert_close(y, outputs[PARALLEL][0], rtol=0, atol=0)
