"""ResNeXt-50 32x4d's grouped 3x3 convolutions alone: each of oneDNN's candidate kernels and onnxruntime's MLAS, 1
thread, one process, interleaved rounds (issue 11: ResNeXt-50 on an AVX2 CPU).

    python bench/grouped_conv_avx2.py --avx2      # both sides capped to AVX2 (bench/cpuid_avx2.py + KILN_CPU_ISA)

kiln's kernels (onednn_primitives.Conv2d, `prefer` stepping to each of oneDNN's candidates in turn, and kiln's own
grouped.c where it is built) on NHWC input,
thread CPU time per call, medians of 7 rounds x 10 calls; onnxruntime's is its profiler's time of the Conv node alone
(its NCHWc reorders and session overhead left out, as bench/cpu_depthwise_avx2.py does). Outputs checked against
torch's conv2d first.
"""

from __future__ import annotations

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
import torch  # noqa: E402
from cpu_depthwise_avx2 import conv_node_us  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

import kiln  # noqa: E402,F401  (the library caps)
from kiln.kernels.cpu import grouped, onednn_primitives  # noqa: E402

GROUPS = 32
# (channels, input height = width, stride): ResNeXt-50 32x4d's grouped layers at 224x224, batch 1
SHAPES = [(128, 56, 1), (256, 56, 2), (256, 28, 1), (512, 28, 2), (512, 14, 1), (1024, 14, 2), (1024, 7, 1)]


def mlas_session(w: torch.Tensor, c: int, hw: int, s: int, batch: int):
    import onnxruntime as ort

    node = helper.make_node("Conv", ["x", "w"], ["y"], group=GROUPS, strides=[s, s], pads=[1, 1, 1, 1],
                            kernel_shape=[3, 3])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, c, hw, hw])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(w.numpy(), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    options.enable_profiling = True
    options.profile_file_prefix = f"/tmp/ort_gconv_{os.getpid()}_{c}_{hw}_{s}"
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def main() -> None:
    torch.set_num_threads(1)
    batch = int(os.environ.get("BATCH", "1"))
    rng = np.random.default_rng(0)
    print(f"ATen {torch.backends.cpu.get_cpu_capability()}, batch {batch}, load {os.getloadavg()[0]:.1f}")
    for c, hw, s in SHAPES:
        x = torch.from_numpy(rng.standard_normal((batch, c, hw, hw), dtype=np.float32))
        w = torch.from_numpy(rng.standard_normal((c, c // GROUPS, 3, 3), dtype=np.float32)) * 0.1
        nhwc = x.contiguous(memory_format=torch.channels_last)
        runs = {}
        for prefer in os.environ.get("PREFER", "first,brgconv,jit:avx2").split(","):
            conv = onednn_primitives.Conv2d(w, None, [batch, c, hw, hw], [s, s], [1, 1, 1, 1], [1, 1], GROUPS, None,
                                            False, False, prefer=None if prefer == "first" else prefer)
            if prefer == "first" or conv.implementation.startswith(prefer):
                runs[f"{prefer}={conv.implementation}"] = lambda conv=conv: conv(nhwc)
        if grouped.available():
            kernel = grouped.GroupedConv(w, None, (batch, c, hw, hw), [s, s], [1, 1, 1, 1])
            runs["kiln=grouped.c"] = lambda kernel=kernel: kernel(nhwc)
        session, xn = mlas_session(w, c, hw, s, batch), x.numpy()
        runs["mlas"] = lambda: torch.from_numpy(session.run(None, {"x": xn})[0])
        want = torch.nn.functional.conv2d(x, w, None, s, 1, groups=GROUPS)
        for name, run in runs.items():
            if not torch.allclose(run(), want, atol=1e-3, rtol=1e-4):
                raise SystemExit(f"{c}x{hw}x{hw} s{s}: {name} differs from torch's conv2d")
        blocks: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(7):
            for name, run in runs.items():
                times = []
                for _ in range(10):
                    t0 = time.thread_time_ns()
                    run()
                    times.append(time.thread_time_ns() - t0)
                blocks[name].append(statistics.median(times) / 1e3)
        node, ops = conv_node_us(session)
        med = {name: statistics.median(v) for name, v in blocks.items()}
        print(f"{c}x{hw}x{hw} s{s}: " + ", ".join(f"{n} {v:.0f}us" for n, v in med.items())
              + f", mlas conv node {node:.0f}us | / node: "
              + ", ".join(f"{n.split('=')[0]} {med[n] / node:.2f}" for n in runs if n != "mlas")
              + f" | ort {ops} | load {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
