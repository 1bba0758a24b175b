"""kiln vs onnxruntime on kiln's own Q/DQ MobileNetV2 (issue 12): layer by layer, then end to end.

    python bench/quant_ort_layers.py int8 1,2,4,5        # dtype, held-out... image indices into photo_variants()

1. Layer by layer: every step of kiln's program (unfused: the Q/DQ graph as written; fused: kiln::QConv/QGemm)
   fed onnxruntime's values of its inputs (kiln.tools.accuracy.replay): how far each layer alone is.
2. End to end, per image: max |a - b| / max |b| of the logits between onnxruntime, onnxruntime with the input
   moved by one float32 ulp, kiln unfused, kiln fused, and kiln running the same graph in float64 (every float
   tensor float64: the graph's exact value); top-1 of each. If every pair differs alike, the graph amplifies any
   float rounding difference (chaos), and none of them is wrong.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import torch
from onnx import TensorProto, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kiln import zoo  # noqa: E402
from kiln.builder.calibration import quantize  # noqa: E402
from kiln.builder.config import BuildConfig  # noqa: E402
from kiln.builder.lower import lower  # noqa: E402
from kiln.frontend import onnx as onnx_frontend  # noqa: E402
from kiln.passes import PassOptions, optimize  # noqa: E402
from kiln.quant.data import photo_variants  # noqa: E402
from kiln.runtime.program import Program  # noqa: E402
from kiln.tools.accuracy import _all_outputs_model, replay  # noqa: E402


def session(proto: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # the Q/DQ as written
    options.log_severity_level = 3
    return ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])


def as_float64(proto: onnx.ModelProto) -> onnx.ModelProto:
    """The same graph with every float32 tensor (initializers, inputs, outputs, value infos) float64."""
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    for init in out.graph.initializer:
        if init.data_type == TensorProto.FLOAT:
            init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init).astype(np.float64), init.name))
    for v in [*out.graph.input, *out.graph.output, *out.graph.value_info]:
        if v.type.tensor_type.elem_type == TensorProto.FLOAT:
            v.type.tensor_type.elem_type = TensorProto.DOUBLE
    return out


def kiln_program(proto: onnx.ModelProto, fused: bool) -> Program:
    model = onnx_frontend.load(proto.SerializeToString())
    if fused:
        model = optimize(model, PassOptions(unsigned_activations=True, cpu_rules=False))
    program, weights, _, _ = lower(model)
    return Program(program, weights)


def steps_apart(got: torch.Tensor, want: torch.Tensor) -> tuple[float, int, str]:
    """(largest difference, elements that differ, unit): integer steps, or float error / max |want|."""
    if got.dtype in (torch.int8, torch.uint8):
        d = (got.to(torch.int64) - want.to(torch.int64)).abs()
        return float(d.max()), int((d > 0).sum()), "steps"
    if got.dtype == torch.float8_e4m3fn:
        from kiln.builder.accuracy import float8_ordinal
        d = (float8_ordinal(got) - float8_ordinal(want)).abs()
        return float(d.max()), int((d > 0).sum()), "fp8 steps"
    d = (got.double() - want.double()).abs()
    return float(d.max() / (want.double().abs().max() or 1.0)), int((d > 0).sum()), "relative"


def layer_by_layer(proto: onnx.ModelProto, x: np.ndarray) -> None:
    reference = dict(zip([o.name for o in session(_all_outputs_model(proto)).get_outputs()],
                         session(_all_outputs_model(proto)).run(None, {"pixel_values": x})))
    ops = {o: n.op_type for n in proto.graph.node for o in n.output}
    for fused in (False, True):
        program = kiln_program(proto, fused)
        kinds = {o: s.op_type for s in program.spec.steps for o in s.outputs}
        compared = replay(program, reference, [torch.from_numpy(x)])
        table: dict[tuple[str, str], list] = {}
        for name, (got, want) in compared.items():
            worst, differ, unit = steps_apart(got, want)
            row = table.setdefault((kinds.get(name, ops.get(name, "?")), unit), [0.0, 0, 0, 0])
            row[0], row[1], row[2], row[3] = max(row[0], worst), row[1] + differ, row[2] + got.numel(), row[3] + 1
        print(f"\n{'fused' if fused else 'unfused'}: each step fed onnxruntime's inputs")
        print("| op | unit | values | largest difference | elements that differ |\n|---|---|---|---|---|")
        for (op, unit), (worst, differ, total, count) in sorted(table.items()):
            print(f"| {op} | {unit} | {count} | {worst:.3g} | {differ}/{total} ({differ / total:.2%}) |")


def end_to_end(proto: onnx.ModelProto, images: list[np.ndarray], indices: list[int], fp32_path: str) -> None:
    ours, fused, exact = kiln_program(proto, False), kiln_program(proto, True), kiln_program(as_float64(proto), False)
    theirs, fp32 = session(proto), ort.InferenceSession(fp32_path, providers=["CPUExecutionProvider"])

    def kiln(program: Program, x: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return program.run([torch.from_numpy(x)])[0].double().numpy()

    runs = {"ort": lambda x: theirs.run(None, {"pixel_values": x})[0].astype(np.float64),
            "ort+1ulp": lambda x: theirs.run(None, {"pixel_values": np.nextafter(x, np.float32(np.inf))})[0]
            .astype(np.float64),
            "kiln": lambda x: kiln(ours, x), "kiln fused": lambda x: kiln(fused, x),
            "kiln float64": lambda x: kiln(exact, x.astype(np.float64))}
    names = list(runs)
    pairs = [(a, b) for i, a in enumerate(names) for b in names[i + 1:]]
    print("\n| image | fp32 top-1 | " + " | ".join(f"{n} top-1" for n in names) + " | " +
          " | ".join(f"{a} vs {b}" for a, b in pairs) + " |")
    print("|---" * (2 + len(names) + len(pairs)) + "|")
    for i in indices:
        x = images[i]
        out = {n: f(x) for n, f in runs.items()}
        diffs = [np.abs(out[a] - out[b]).max() / np.abs(out[b]).max() for a, b in pairs]
        print(f"| {i} | {fp32.run(None, {'pixel_values': x})[0].argmax()} | " +
              " | ".join(str(out[n].argmax()) for n in names) + " | " + " | ".join(f"{d:.3f}" for d in diffs) + " |")


def main() -> None:
    dtype = sys.argv[1]
    indices = [int(i) for i in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1, 2, 4, 5]
    images = photo_variants()
    calibration = [{"pixel_values": v} for v in images[::3]]
    path = str(zoo.mobilenet_v2())
    config = BuildConfig(precision=dtype, quantization="emulate", calibration=calibration, calibrator="percentile")
    model, _ = quantize(onnx_frontend.load(path), config, lambda _m: None)
    proto = ir.to_proto(model)
    layer_by_layer(proto, images[indices[0]])
    end_to_end(proto, images, indices, path)


if __name__ == "__main__":
    main()
