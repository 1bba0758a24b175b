"""MobileNetV2's 3x3 depthwise convolutions alone: oneDNN's jit_dw (kiln's cpu.conv.onednn_direct choice), oneDNN's
first choice (brdgmm_dw) and onnxruntime's MLAS, 1 thread, one process, interleaved rounds (issue 11's stride-2 gap).

    python bench/cpu_depthwise_avx2.py --avx2      # both sides capped to AVX2 (bench/cpuid_avx2.py + KILN_CPU_ISA)

kiln's primitives on NHWC input (channels_last), thread CPU time per call, medians of --rounds rounds x 20 calls.
onnxruntime runs a one-Conv model, which its NCHWc transformer wraps in ReorderInput/ReorderOutput: its whole run
("mlas") includes them and session overhead, so the ratio is taken against its profiler's time of the Conv node
alone ("mlas conv node", whole microseconds). Outputs checked against torch's conv2d first (1e-4).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

if __name__ == "__main__" and "--avx2" in sys.argv:
    import cpuid_avx2  # noqa: E402

    cpuid_avx2.enable()  # before torch, onnxruntime or kiln read cpuid
    os.environ["KILN_CPU_ISA"] = "avx2"

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402
import torch  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

import kiln  # noqa: E402,F401  (the library caps)
from kiln.kernels.cpu import onednn_primitives  # noqa: E402

# (channels, input height = width, stride): MobileNetV2's depthwise layers at 224x224
SHAPES = [(96, 112, 2), (144, 56, 2), (192, 28, 2), (576, 14, 2), (144, 56, 1), (192, 28, 1), (384, 14, 1), (960, 7, 1)]


def mlas_session(w: torch.Tensor, b: torch.Tensor, c: int, hw: int, s: int) -> ort.InferenceSession:
    """A one-Conv model on onnxruntime, 1 thread, its profiler on."""
    node = helper.make_node("Conv", ["x", "w", "b"], ["y"], group=c, strides=[s, s], pads=[1, 1, 1, 1],
                            kernel_shape=[3, 3])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, hw, hw])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(w.numpy(), "w"), numpy_helper.from_array(b.numpy(), "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    options.enable_profiling = True
    options.profile_file_prefix = f"/tmp/ort_dw_{os.getpid()}_{c}_{hw}_{s}"
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def conv_node_us(session: ort.InferenceSession) -> tuple[float, list[str]]:
    """(the median time of the profiled Conv node in us, the op types the session ran)."""
    profile = Path(session.end_profiling())
    events = [e for e in json.loads(profile.read_text()) if e.get("cat") == "Node"]
    profile.unlink()
    convs = [e["dur"] for e in events if e["name"].endswith("_kernel_time") and "Conv" in e["args"].get("op_name", "")]
    return statistics.median(convs), sorted({e["args"].get("op_name", "?") for e in events})


def main() -> None:
    rounds = 7
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    print(f"ATen {torch.backends.cpu.get_cpu_capability()}, load {os.getloadavg()[0]:.1f}")
    for c, hw, s in SHAPES:
        x = torch.from_numpy(rng.standard_normal((1, c, hw, hw), dtype=np.float32))
        w = torch.from_numpy(rng.standard_normal((c, 1, 3, 3), dtype=np.float32))
        b = torch.from_numpy(rng.standard_normal(c, dtype=np.float32))
        nhwc = x.contiguous(memory_format=torch.channels_last)
        runs = {}
        for name, prefer in (("jit_dw", "jit_dw:"), ("first", None)):
            conv = onednn_primitives.Conv2d(w, b, [1, c, hw, hw], [s, s], [1, 1, 1, 1], [1, 1], c, None, False, False,
                                            prefer=prefer)
            runs[f"{name} ({conv.implementation})"] = lambda conv=conv: conv(nhwc)
        session, xn = mlas_session(w, b, c, hw, s), x.numpy()
        runs["mlas"] = lambda: torch.from_numpy(session.run(None, {"x": xn})[0])
        want = torch.nn.functional.conv2d(x, w, b, s, 1, groups=c)
        for name, run in runs.items():
            if not torch.allclose(run(), want, atol=1e-4):
                raise SystemExit(f"{c}x{hw}x{hw} s{s}: {name} differs from torch's conv2d")
        blocks: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(rounds):
            for name, run in runs.items():
                times = []
                for _ in range(20):
                    t0 = time.thread_time_ns()
                    run()
                    times.append(time.thread_time_ns() - t0)
                blocks[name].append(statistics.median(times) / 1e3)
        node, ops = conv_node_us(session)
        med = {name: statistics.median(v) for name, v in blocks.items()}
        print(f"{c}x{hw}x{hw} s{s}: " + ", ".join(f"{n} {v:.1f}us" for n, v in med.items())
              + f", mlas conv node {node:.1f}us | / mlas conv node: "
              + ", ".join(f"{n.split()[0]} {med[n] / node:.2f}" for n in runs if n != "mlas")
              + f" | onnxruntime ran {ops} | load {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
