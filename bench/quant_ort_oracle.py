"""kiln's QDQ model (kiln.builder.calibration.quantize, before fusion) run by onnxruntime: top-1 agreement on the held-out
photos, and optionally kiln's logits vs ORT's on the first N images.  python bench/quant_ort_oracle.py fp8 percentile [N]
"""
import sys, time, numpy as np, onnx_ir as ir, onnxruntime as ort
sys.path.insert(0, __import__("os").path.dirname(__file__))
from quant_accuracy import runner
from kiln import zoo
from kiln.builder.calibration import quantize
from kiln.builder.config import BuildConfig
from kiln.frontend import onnx as onnx_frontend
from kiln.quant.data import photo_variants
dtype, calibrator = sys.argv[1], sys.argv[2]
images = photo_variants()
calibration = [{"pixel_values": v} for v in images[::3]]
held = [v for i, v in enumerate(images) if i % 3]
path = str(zoo.mobilenet_v2())
fp32 = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
ref = [fp32.run(None, {"pixel_values": v})[0].argmax() for v in held]
config = BuildConfig(precision=dtype, quantization="emulate", calibration=calibration, calibrator=calibrator)
model, info = quantize(onnx_frontend.load(path), config, lambda m: None)
ir.save(model, f"/tmp/kiln_{dtype}_{calibrator}.onnx")
so = ort.SessionOptions(); so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
sess = ort.InferenceSession(f"/tmp/kiln_{dtype}_{calibrator}.onnx", so, providers=["CPUExecutionProvider"])
ort_out = [sess.run(None, {"pixel_values": v})[0] for v in held]
print(f"ORT running kiln's {dtype} QDQ model: top-1 agreement {sum(o.argmax() == r for o, r in zip(ort_out, ref))}/74", flush=True)
if len(sys.argv) > 3:
    engine, _ = runner(onnx_frontend.load(path), config)
    kout = [engine({"pixel_values": v}) for v in held[:int(sys.argv[3])]]
    for k, o in zip(kout, ort_out):
        d = np.abs(k - o).max() / np.abs(o).max()
        print(f"kiln vs ORT logits: max |diff| / max |logit| {d:.2e}; top-1 same {k.argmax() == o.argmax()}")
