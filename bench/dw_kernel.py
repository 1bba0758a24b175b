"""MobileNetV2's and EfficientNet-B0's depthwise layers alone: kiln's depthwise.c (cpu.conv.depthwise_native) against
oneDNN's jit_dw (cpu.conv.onednn_direct's depthwise choice) and onnxruntime's MLAS, one process, interleaved rounds.

    python bench/dw_kernel.py --avx2 --threads 1     # both sides capped to AVX2 (bench/cpuid_avx2.py + KILN_CPU_ISA)
    python bench/dw_kernel.py --threads 2            # uncapped (AVX-512 where the CPU has it)

Each layer is the model's: its channels, input size, kernel, stride and epilogue (MobileNetV2: bias + ReLU6;
EfficientNet-B0: bias + SiLU), batch 1, NHWC for kiln's two kernels (a segment's layout). kiln's kernels are timed
as a segment calls them: their bound call through the native loop (the same ctypes call for both). onnxruntime
runs a model of the Conv and its activation; its time is the profiler's kernel time of the nodes other than its
NCHWc reorders (the Conv, fused with Clip, or the Conv and its SiLU: in a whole model onnxruntime keeps NCHWc between
layers, so the reorders are not the layer's). Wall time, medians of --rounds rounds of 30 calls (--stat p10: the
10th percentile of every call, for a loaded machine); the ratio is kiln / onnxruntime. Outputs are checked against
torch's conv2d (float64) first.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
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
from kiln.kernels.cpu import depthwise, native_loop, onednn, onednn_primitives  # noqa: E402

# (model, channels, input height = width, kernel, stride) at 224x224; MobileNetV2's 17 layers are 10 shapes
LAYERS = [("mnv2", 32, 112, 3, 1), ("mnv2", 96, 112, 3, 2), ("mnv2", 144, 56, 3, 1), ("mnv2", 144, 56, 3, 2),
          ("mnv2", 192, 28, 3, 1), ("mnv2", 192, 28, 3, 2), ("mnv2", 384, 14, 3, 1), ("mnv2", 576, 14, 3, 1),
          ("mnv2", 576, 14, 3, 2), ("mnv2", 960, 7, 3, 1),
          ("b0", 32, 112, 3, 1), ("b0", 96, 112, 3, 2), ("b0", 144, 56, 3, 1), ("b0", 144, 56, 5, 2),
          ("b0", 240, 28, 5, 1), ("b0", 240, 28, 3, 2), ("b0", 480, 14, 3, 1), ("b0", 480, 14, 5, 1),
          ("b0", 672, 14, 5, 1), ("b0", 672, 14, 5, 2), ("b0", 1152, 7, 5, 1), ("b0", 1152, 7, 3, 1)]


def ort_session(w: np.ndarray, b: np.ndarray, c: int, hw: int, k: int, s: int, silu: bool, threads: int,
                prefix: str) -> ort.InferenceSession:
    p = k // 2
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["z"], group=c, strides=[s, s], pads=[p] * 4,
                              kernel_shape=[k, k])]
    if silu:
        nodes += [helper.make_node("Sigmoid", ["z"], ["g"]), helper.make_node("Mul", ["z", "g"], ["y"])]
    else:
        nodes += [helper.make_node("Clip", ["z", "lo", "hi"], ["y"])]
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")]
    if not silu:
        inits += [numpy_helper.from_array(np.array(0, np.float32), "lo"),
                  numpy_helper.from_array(np.array(6, np.float32), "hi")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, hw, hw])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    options.enable_profiling = True
    options.profile_file_prefix = prefix
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def ort_layer_us(session: ort.InferenceSession, calls: int) -> tuple[list[float], list[str]]:
    """Per call, onnxruntime's kernel time of the nodes that are not reorders (us), and the op types it ran."""
    profile = Path(session.end_profiling())
    events = [e for e in json.loads(profile.read_text())
              if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    profile.unlink()
    ops = sorted({e["args"].get("op_name", "?") for e in events})
    layer = [e for e in events if not e["args"].get("op_name", "").startswith("Reorder")]
    per_call = len(layer) // calls if calls else 0
    sums = [sum(e["dur"] for e in layer[i * per_call:(i + 1) * per_call]) for i in range(calls)]
    return sums, ops


def looped(bound) -> Callable[[], None]:
    """The bound layer's calls through the native loop, its arrays built once (a segment's path)."""
    lib = onednn.load()
    loop = native_loop.load()
    calls = bound.calls()
    functions, objects, nargs, args = native_loop.call_arrays(calls)
    nothing = (ctypes.c_void_p * 1)()
    failed = ctypes.c_int(-1)
    set_handle = ctypes.cast(lib.lib.dnnl_memory_set_data_handle, ctypes.c_void_p)

    def run() -> None:
        assert bound is not None  # the plans the call arrays point at live as long as this closure
        status = loop.kiln_run_segment(functions, set_handle, lib.stream, 0, nothing, nothing, len(calls), objects,
                                       nargs, args, ctypes.byref(failed))
        if status:
            raise RuntimeError(f"status {status}")
    return run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--avx2", action="store_true")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--models", default="mnv2,b0")
    parser.add_argument("--layers", default="", help="comma-separated CxHW filters (e.g. 96x112,144x56)")
    parser.add_argument("--stat", choices=("median", "p10"), default="median",
                        help="per peer: the median of the rounds' medians, or the 10th percentile of every call (a "
                             "loaded machine: at 2 threads a descheduled worker stalls a call ~24 ms)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "?")
    print(f"CPU {cpu}, ATen {torch.backends.cpu.get_cpu_capability()}, "
          f"kiln depthwise.c {depthwise.lanes()} lanes, {args.threads} thread(s), {args.stat}, "
          f"load {os.getloadavg()[0]:.1f}")
    print("| model | layer | kiln us | oneDNN us (kernel) | ORT us | kiln/ORT | oneDNN/ORT | load |")
    print("|---|---|---|---|---|---|---|---|")
    ratios = []
    for model, c, hw, k, s in LAYERS:
        if model not in args.models.split(",") or (args.layers and f"{c}x{hw}" not in args.layers.split(",")):
            continue
        silu = model == "b0"
        p = k // 2
        x = rng.standard_normal((1, c, hw, hw), dtype=np.float32)
        w = rng.standard_normal((c, 1, k, k), dtype=np.float32) * 0.3
        b = rng.standard_normal(c, dtype=np.float32)
        xt, wt, bt = (torch.from_numpy(a) for a in (x, w, b))
        nhwc = xt.contiguous(memory_format=torch.channels_last)
        activation, alpha, beta = ("SiLU", 0.0, 0.0) if silu else ("Clip", 0.0, 6.0)
        kiln_dw = depthwise.DepthwiseConv(wt, bt, (1, c, hw, hw), [s, s], [p] * 4, activation, alpha, beta)
        eltwise = onednn.eltwise_for(activation, alpha, beta)
        dnnl = onednn_primitives.Conv2d(wt, bt, [1, c, hw, hw], [s, s], [p] * 4, [1, 1], c, eltwise, False, False,
                                        prefer="jit_dw:")
        ref = torch.nn.functional.conv2d(xt.double(), wt.double(), bt.double(), s, p, groups=c)
        ref = torch.nn.functional.silu(ref) if silu else ref.clamp(0, 6)
        out = {name: torch.empty_strided(kiln_dw.output_size, nhwc.new_empty(kiln_dw.output_size).contiguous(
            memory_format=torch.channels_last).stride(), dtype=torch.float32) for name in ("kiln", "onednn")}
        runs = {"kiln": looped(kiln_dw.bind(nhwc.data_ptr(), out["kiln"].data_ptr())),
                "onednn": looped(dnnl.bind(nhwc.data_ptr(), out["onednn"].data_ptr()))}
        for name, run in runs.items():
            run()
            err = ((out[name].double() - ref).abs() / (1 + ref.abs())).max().item()
            if err > 1e-4:
                raise SystemExit(f"{model} {c}x{hw} k{k} s{s}: {name} off by {err:.2e} from torch's conv2d")
        prefix = f"/tmp/ort_dwk_{os.getpid()}_{c}_{hw}_{k}_{s}"
        session = ort_session(w, b, c, hw, k, s, silu, args.threads, prefix)
        got = session.run(None, {"x": x})[0]
        if not np.allclose(got, ref.float().numpy(), atol=1e-4, rtol=1e-4):
            raise SystemExit(f"{model} {c}x{hw} k{k} s{s}: onnxruntime differs from torch's conv2d")
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
            kiln_med, dnnl_med = (float(np.percentile(calls[n], 10)) for n in ("kiln", "onednn"))
        else:
            ort_med = statistics.median(ort_us[1:])
            kiln_med, dnnl_med = (statistics.median(blocks[n]) for n in ("kiln", "onednn"))
        ratios.append((model, s, kiln_med / ort_med, dnnl_med / ort_med))
        print(f"| {model} | {c}x{hw}² k{k} s{s} | {kiln_med:.1f} | {dnnl_med:.1f} ({dnnl.implementation}) | "
              f"{ort_med:.1f} | {kiln_med / ort_med:.2f} | {dnnl_med / ort_med:.2f} | {os.getloadavg()[0]:.1f} |",
              flush=True)
    for model in args.models.split(","):
        for s in (1, 2):
            rows = [r for r in ratios if r[0] == model and r[1] == s]
            if rows:
                geo = lambda i: float(np.exp(np.mean([np.log(r[i]) for r in rows])))  # noqa: E731
                print(f"{model} stride {s}: kiln/ORT geomean {geo(2):.2f} (max {max(r[2] for r in rows):.2f}), "
                      f"oneDNN/ORT {geo(3):.2f} (max {max(r[3] for r in rows):.2f})")


if __name__ == "__main__":
    main()
