"""The network's first convolution (3 input channels) alone: kiln's stem.c (cpu.conv.stem_native) against oneDNN's
direct convolution (cpu.conv.onednn_direct) and onnxruntime's MLAS, one process, interleaved rounds.

    python bench/stem_kernel.py --threads 1
    python bench/stem_kernel.py --threads 2 --stat p10

Each layer is the model's stem: its input channels, size, kernel, stride, padding and epilogue (bias + ReLU;
MobileNetV2's ReLU6 as Clip); kiln's stem.c reads the image NCHW (as a segment's entry hands it), oneDNN NHWC (in
an engine the image is copied into NHWC first: not counted here); both write NHWC. kiln's kernels are timed as a segment
calls them: their bound call through the native loop (the same ctypes call for both). onnxruntime runs a model of the
Conv and its activation; its time is the profiler's kernel time of the nodes other than its NCHWc reorders. Wall
time, medians of --rounds rounds of 30 calls (--stat p10: the 10th percentile of every call); the ratio is kiln /
onnxruntime. Outputs are checked against torch's conv2d (float64) first.
"""

from __future__ import annotations

import argparse
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
from kiln.kernels.cpu import onednn, onednn_primitives, stem  # noqa: E402
from dw_kernel import looped, ort_layer_us  # noqa: E402  (the same onnxruntime profile and native-loop call)

# (model, batch, input channels, input height = width, output channels, kernel, stride, activation)
LAYERS = [("resnet_tiny", 1, 3, 64, 16, 7, 2, "Relu"), ("regnet_tiny", 2, 3, 64, 16, 3, 2, "Relu"),
          ("resnet50", 1, 3, 224, 64, 7, 2, "Relu"), ("mobilenet_v2", 1, 3, 224, 32, 3, 2, "Clip")]


def ort_session(w: np.ndarray, b: np.ndarray, n: int, c: int, hw: int, k: int, s: int, activation: str, threads: int,
                prefix: str) -> ort.InferenceSession:
    p = k // 2
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["z"], strides=[s, s], pads=[p] * 4, kernel_shape=[k, k])]
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")]
    if activation == "Relu":
        nodes += [helper.make_node("Relu", ["z"], ["y"])]
    else:
        nodes += [helper.make_node("Clip", ["z", "lo", "hi"], ["y"])]
        inits += [numpy_helper.from_array(np.array(0, np.float32), "lo"),
                  numpy_helper.from_array(np.array(6, np.float32), "hi")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n, c, hw, hw])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    options.enable_profiling = True
    options.profile_file_prefix = prefix
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--models", default=",".join(layer[0] for layer in LAYERS))
    parser.add_argument("--stat", choices=("median", "p10"), default="median",
                        help="per peer: the median of the rounds' medians, or the 10th percentile of every call")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "?")
    print(f"CPU {cpu}, ATen {torch.backends.cpu.get_cpu_capability()}, {args.threads} thread(s), {args.stat}, "
          f"load {os.getloadavg()[0]:.1f}")
    print("| model | layer | kiln stem.c us | oneDNN us (kernel) | ORT us | kiln/ORT | oneDNN/ORT | kiln/oneDNN "
          "| load |")
    print("|---|---|---|---|---|---|---|---|---|")
    for model, n, c, hw, o, k, s, activation in LAYERS:
        if model not in args.models.split(","):
            continue
        p = k // 2
        x = rng.standard_normal((n, c, hw, hw), dtype=np.float32)
        w = rng.standard_normal((o, c, k, k), dtype=np.float32) * 0.3
        b = rng.standard_normal(o, dtype=np.float32)
        xt, wt, bt = (torch.from_numpy(a) for a in (x, w, b))
        nhwc = xt.contiguous(memory_format=torch.channels_last)
        alpha, beta = (0.0, 6.0) if activation == "Clip" else (0.0, 0.0)
        kiln_stem = stem.StemConv(wt, bt, (n, c, hw, hw), [s, s], [p] * 4, activation, alpha, beta)
        eltwise = onednn.eltwise_for(activation, alpha, beta)
        dnnl = onednn_primitives.Conv2d(wt, bt, [n, c, hw, hw], [s, s], [p] * 4, [1, 1], 1, eltwise, False, False)
        ref = torch.nn.functional.conv2d(xt.double(), wt.double(), bt.double(), s, p)
        ref = ref.relu() if activation == "Relu" else ref.clamp(0, 6)
        out = {name: torch.empty(kiln_stem.output_size).contiguous(memory_format=torch.channels_last)
               for name in ("kiln", "onednn")}
        runs = {"kiln": looped(kiln_stem.bind(xt.data_ptr(), out["kiln"].data_ptr())),  # NCHW in
                "onednn": looped(dnnl.bind(nhwc.data_ptr(), out["onednn"].data_ptr()))}
        for name, run in runs.items():
            run()
            err = ((out[name].double() - ref).abs() / (1 + ref.abs())).max().item()
            if err > 1e-4:
                raise SystemExit(f"{model} {k}x{k}/{s}: {name} off by {err:.2e} from torch's conv2d")
        prefix = f"/tmp/ort_stem_{os.getpid()}_{model}"
        session = ort_session(w, b, n, c, hw, k, s, activation, args.threads, prefix)
        got = session.run(None, {"x": x})[0]
        if not np.allclose(got, ref.float().numpy(), atol=1e-4, rtol=1e-4):
            raise SystemExit(f"{model}: onnxruntime differs from torch's conv2d")
        runs["ort"] = lambda: session.run(None, {"x": x})
        blocks: dict[str, list[float]] = {name: [] for name in runs}
        calls: dict[str, list[float]] = {name: [] for name in runs}
        ort_calls = 1  # the check run above is profiled too
        for _ in range(args.rounds):
            for name, run in runs.items():
                for _ in range(3):
                    run()  # warm
                times = []
                for _ in range(30):
                    t0 = time.perf_counter_ns()
                    run()
                    times.append(time.perf_counter_ns() - t0)
                if name == "ort":
                    ort_calls += 33
                blocks[name].append(statistics.median(times) / 1e3)
                calls[name] += [t / 1e3 for t in times]
        ort_us, ops = ort_layer_us(session, ort_calls)
        if args.stat == "p10":
            ort_med = float(np.percentile(ort_us[1:], 10))
            kiln_med, dnnl_med = (float(np.percentile(calls[name], 10)) for name in ("kiln", "onednn"))
        else:
            ort_med = statistics.median(ort_us[1:])
            kiln_med, dnnl_med = (statistics.median(blocks[name]) for name in ("kiln", "onednn"))
        spread = max(blocks["kiln"]) - min(blocks["kiln"])
        print(f"| {model} | {n}x{c}x{hw}² -> {o}, {k}x{k}/{s} | {kiln_med:.1f} (spread {spread:.1f}) | {dnnl_med:.1f} "
              f"({dnnl.implementation}) | {ort_med:.1f} ({','.join(ops)}) | {kiln_med / ort_med:.2f} | "
              f"{dnnl_med / ort_med:.2f} | {kiln_med / dnnl_med:.2f} | {os.getloadavg()[0]:.1f} |", flush=True)


if __name__ == "__main__":
    main()
