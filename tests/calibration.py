"""The calibration data the tests hand onnxruntime's quantize_static when they make QDQ models."""

from __future__ import annotations

import numpy as np
from onnxruntime.quantization import CalibrationDataReader, CalibrationMethod, QuantFormat, QuantType, quantize_static


class FeedsReader(CalibrationDataReader):
    """The given feeds, one batch a get_next, then None: quantize_static's calibration input."""

    def __init__(self, feeds: list[dict[str, np.ndarray]]):
        self._items = iter(feeds)

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._items, None)


def quantize_fp8(fp32: str, qdq: str, feeds: list[dict[str, np.ndarray]], keep_activations: bool = True) -> None:
    """onnxruntime's FP8 QDQ model of `fp32` written to `qdq`: E4M3 activations and weights per tensor, calibrated on
    `feeds`; keep_activations: its QDQKeepRemovableActivations (without it an FP8 model loses every Relu:
    tests/unit/test_qdq_fp8_activations.py)."""
    quantize_static(fp32, qdq, FeedsReader(feeds), quant_format=QuantFormat.QDQ,
                    activation_type=QuantType.QFLOAT8E4M3FN, weight_type=QuantType.QFLOAT8E4M3FN, per_channel=False,
                    calibrate_method=CalibrationMethod.Distribution,  # the only one onnxruntime has for FP8
                    extra_options={"QDQKeepRemovableActivations": keep_activations})


def quantize_transformer(fp32: str, qdq: str, feeds: list[dict[str, np.ndarray]], kind: str) -> None:
    """onnxruntime's QDQ model of a transformer's GEMMs as bench/quant_gpu.py _ort_qdq makes it: `kind` int8
    (per-channel weights, MinMax) or fp8 (E4M3 per tensor, Distribution, removable activations kept)."""
    fp8 = kind == "fp8"
    qtype = QuantType.QFLOAT8E4M3FN if fp8 else QuantType.QInt8
    quantize_static(fp32, qdq, FeedsReader(feeds), quant_format=QuantFormat.QDQ, activation_type=qtype,
                    weight_type=qtype, per_channel=not fp8, op_types_to_quantize=["MatMul", "Gemm"],
                    calibrate_method=CalibrationMethod.Distribution if fp8 else CalibrationMethod.MinMax,
                    extra_options={"QDQKeepRemovableActivations": fp8})


def coarsest_scale(path: str) -> float:
    """The largest per-tensor scale of a QDQ model: one step of its coarsest quantized tensor."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(path)
    return max(float(numpy_helper.to_array(i).astype(np.float32).reshape(-1)[0]) for i in model.graph.initializer
               if i.name.endswith("_scale") and numpy_helper.to_array(i).size == 1)


def reference_session(path: str):
    """onnxruntime running a QDQ model as written (no graph optimisation fusing its Q/DQ pairs)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def assert_forced_steps_match(engine, steps, tactic: str, path: str, baseline=None) -> None:
    """The builder's check rejected no candidate of `engine`; `steps` forced onto `tactic` (on the CPU the Triton
    interpreter never wins a timing), bert_tiny's output at 3 x 16 (seeds 7, 8) is onnxruntime's on the QDQ model
    at `path` — or `baseline`'s (an engine) where given — within the model's coarsest per-tensor scale."""
    import kiln
    from kiln import zoo
    from kiln.zoo.models import make_inputs

    layers = engine.plan.header["tactics"]["layers"]
    rejected = {n: note for layer in layers.values() for n, note in layer["candidates"].items()
                if isinstance(note, str) and "rejected" in note}
    assert not rejected, rejected
    for step in steps:
        step.tactic, step.tactic_config = tactic, {}
    on_kernel = kiln.Engine(engine.plan)
    coarsest = coarsest_scale(path)
    session = reference_session(path)
    for seed in (7, 8):
        feeds = make_inputs(zoo.get("bert_tiny"), batch=3, seq=16, seed=seed)
        output = session.get_outputs()[0].name
        want = session.run(None, feeds)[0] if baseline is None else \
            np.asarray(baseline.run(feeds)[output], dtype=np.float32)
        got = np.asarray(on_kernel.run(feeds)[output], dtype=np.float32)
        assert np.abs(got - want).max() <= coarsest, (np.abs(got - want).max(), coarsest)
        assert np.abs(want).max() > 10 * coarsest
