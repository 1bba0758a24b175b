"""MobileNetV2's 3x3 depthwise convolutions alone: oneDNN's jit_dw (kiln's cpu.conv.onednn_direct choice), oneDNN's
first choice (brdgmm_dw) and onnxruntime's MLAS, 1 thread, one process, interleaved rounds (issue 11's stride-2 gap).

    python bench/cpu_depthwise_avx2.py --avx2      # both sides capped to AVX2 (bench/cpuid_avx2.py + KILN_CPU_ISA)

kiln's primitives on NHWC input (channels_last), thread CPU time per call, medians of 7 rounds x 20 calls.
onnxruntime runs a one-Conv model, which its NCHWc transformer wraps in ReorderInput/ReorderOutput: its whole run
("mlas") includes them and session overhead, so the ratio is taken against its profiler's time of the Conv node
alone ("mlas conv node", whole microseconds). Outputs checked against torch's conv2d first (1e-4).
"""
import os, sys, statistics, time
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
if "--avx2" in sys.argv:
    import cpuid_avx2; cpuid_avx2.enable(); os.environ["KILN_CPU_ISA"] = "avx2"
import numpy as np, torch, onnx, onnxruntime as ort
from pathlib import Path
from onnx import helper, TensorProto, numpy_helper
import kiln
from kiln.kernels.cpu import onednn, onednn_primitives
torch.set_num_threads(1)
SHAPES = [(96, 112, 2), (144, 56, 2), (192, 28, 2), (576, 14, 2), (144, 56, 1), (192, 28, 1), (384, 14, 1), (960, 7, 1)]
rng = np.random.default_rng(0)
print(torch.backends.cpu.get_cpu_capability(), os.getloadavg()[0])
for c, hw, s in SHAPES:
    x = torch.from_numpy(rng.standard_normal((1, c, hw, hw), dtype=np.float32))
    w = torch.from_numpy(rng.standard_normal((c, 1, 3, 3), dtype=np.float32)); b = torch.randn(c)
    xl = x.contiguous(memory_format=torch.channels_last)
    runs = {}
    for name, prefer in (("jit_dw", "jit_dw:"), ("first", None)):
        conv = onednn_primitives.Conv2d(w, b, [1, c, hw, hw], [s, s], [1, 1, 1, 1], [1, 1], c, None, False, False, prefer=prefer)
        runs[f"{name} ({conv.implementation})"] = (lambda conv=conv: conv(xl))
    node = helper.make_node("Conv", ["x", "w", "b"], ["y"], group=c, strides=[s, s], pads=[1, 1, 1, 1], kernel_shape=[3, 3])
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, hw, hw])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(w.numpy(), "w"), numpy_helper.from_array(b.numpy(), "b")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    so = ort.SessionOptions(); so.intra_op_num_threads = 1; so.inter_op_num_threads = 1
    so.enable_profiling = True; so.profile_file_prefix = f"/tmp/ort_dw_{os.getpid()}_{c}_{hw}_{s}"
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    xn = x.numpy()
    runs["mlas"] = lambda: sess.run(None, {"x": xn})
    want = torch.nn.functional.conv2d(x, w, b, s, 1, groups=c)
    for n, r in runs.items():
        got = r(); got = torch.as_tensor(got[0]) if isinstance(got, list) else got
        assert torch.allclose(got, want, atol=1e-4), n
    blocks = {n: [] for n in runs}
    for rd in range(7):
        for n, r in runs.items():
            ts = []
            for _ in range(20):
                t0 = time.thread_time_ns(); r(); ts.append(time.thread_time_ns() - t0)
            blocks[n].append(statistics.median(ts) / 1e3)
    import json
    profile = Path(sess.end_profiling())
    ev = json.loads(profile.read_text())
    profile.unlink()
    convs = [e["dur"] for e in ev if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and "Conv" in e["args"].get("op_name", "")]
    ops = sorted({e["args"].get("op_name") for e in ev if e.get("cat") == "Node"})
    node = statistics.median(convs)
    med = {n: statistics.median(v) for n, v in blocks.items()}
    med["mlas conv node"] = node
    ratios2 = {n: med[n] / node for n in runs if n != "mlas"}
    ratios = {n: statistics.median([a / m for a, m in zip(blocks[n], blocks["mlas"])]) for n in runs if n != "mlas"}
    print(f"{c}x{hw}x{hw} s{s}: " + ", ".join(f"{n} {v:.1f}us" for n, v in med.items()) + " | / mlas: " +
          ", ".join(f"{n.split()[0]} {v:.2f}" for n, v in ratios2.items()), ops, f"load {os.getloadavg()[0]:.1f}", flush=True)
