"""A/B of one CPU engine call (the empty model, Identity FP32 [1, 4], ExecutionContext.run with a numpy feed), thread CPU
time per call, inference mode entered through torch.inference_mode() (A) or its C guard (B: kiln/runtime/cpu_paths.py),
15 alternated rounds of 20,000 calls. python bench/engine_call_inference_guard.py"""
import os, statistics, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import numpy as np, torch, kiln  # noqa: E401
from onnx import TensorProto, helper
from kiln.runtime import cpu_paths
g = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "empty",
                      [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])])
engine = kiln.build(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=10).SerializeToString())
ctx = engine.create_execution_context()
x = np.random.default_rng(1).standard_normal((1, 4)).astype(np.float32)
for fn in (torch.inference_mode, cpu_paths.inference_mode):
    cpu_paths.inference_mode = fn
    assert np.array_equal(ctx.run({"x": x})["y"], x)
arms = {"A wrapper": torch.inference_mode, "B guard": cpu_paths.inference_mode}
res = {k: [] for k in arms}
for r in range(15):
    for k, fn in arms.items():
        cpu_paths.inference_mode = fn
        t0 = time.thread_time()
        for _ in range(20000):
            ctx.run({"x": x})
        res[k].append((time.thread_time() - t0) / 20000 * 1e6)
for k, v in res.items():
    print(f"{k}: median {statistics.median(v):.2f} us/call, min {min(v):.2f}")
print("A-B per round, median", round(statistics.median(a - b for a, b in zip(*res.values())), 2), "load", os.getloadavg()[0])
