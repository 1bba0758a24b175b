"""FP32 GEMM on the CPU, per transformer shape: GFLOP/s and % of the cores' FMA peak for each kernel
kiln can pick, side by side with onnxruntime's MLAS (a one-node MatMul + Add model), same threads.

    python bench/gemm.py [--threads 2] [--rounds 5]

Kernels: torch's F.linear (MKL), torch's oneDNN linear on a packed weight (kiln's cpu.gemm.onednn),
MKL's packed GEMM (cpu.gemm.mkl), and oneDNN's inner product through its C API with the weight in the
layout its kernel wants (cpu.gemm.onednn_direct). Peak = cores x GHz x FLOPs per cycle per core (2 FMA
units x vector lanes x 2: 32 on AVX2, 64 on AVX-512), from /proc/cpuinfo's flags and MHz. Timed in
interleaved rounds (a shared machine's drift lands on all alike), best of each round's median.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = [  # (M, K, N): BERT-base at 1 x 128 tokens
    (128, 768, 768),    # attention output projection
    (128, 768, 2304),   # fused QKV
    (128, 768, 3072),   # FFN up (GELU)
    (128, 3072, 768),   # FFN down
    (8, 768, 768),      # a short sequence
]


def cpu_facts() -> tuple[str, float, int]:
    """(model name, GHz, FP32 FLOPs per cycle per core)."""
    name, mhz, flags = "?", 0.0, set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and name == "?":
            name = value.strip()
        elif key == "cpu MHz" and not mhz:
            mhz = float(value)
        elif key == "flags" and not flags:
            flags = set(value.split())
    per_cycle = 64 if "avx512f" in flags else 32 if "fma" in flags else 16
    return name, mhz / 1000, per_cycle


def runners(m: int, k: int, n: int) -> dict:
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal((m, k), dtype=np.float32))
    w = torch.from_numpy(rng.standard_normal((n, k), dtype=np.float32))
    b = torch.from_numpy(rng.standard_normal(n, dtype=np.float32))
    out = {"torch F.linear (MKL)": lambda: F.linear(x, w, b)}
    from kiln.kernels.cpu import gemm, mkl_available, onednn_available

    from kiln.kernels.cpu.conv import post_op

    none = post_op("", 0.0, 0.0)
    if onednn_available():
        packed = gemm.pack_linear_onednn(w, m)
        out["torch oneDNN linear, packed (cpu.gemm.onednn)"] = lambda: gemm.linear_onednn(x, packed, b, None, none, True)
    if mkl_available():
        mkl = gemm.pack_linear_mkl(w, m)
        out["MKL packed GEMM (cpu.gemm.mkl)"] = lambda: gemm.linear_mkl(x, mkl, w, b, m, None, none, True)
    from kiln.kernels.cpu import onednn

    if onednn.available():
        from kiln.kernels.cpu.onednn_primitives import InnerProduct

        ip = InnerProduct(w, b, m, None, False, True)
        out[f"oneDNN inner product C API (cpu.gemm.onednn_direct, {ip.implementation})"] = lambda: ip(x)
    try:
        import onnx
        import onnxruntime as ort
        from onnx import TensorProto, helper, numpy_helper

        graph = helper.make_graph(
            [helper.make_node("MatMul", ["x", "wt"], ["xw"]), helper.make_node("Add", ["xw", "b"], ["y"])],
            "gemm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [m, k])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, n])],
            [numpy_helper.from_array(w.numpy().T.copy(), "wt"), numpy_helper.from_array(b.numpy(), "b")])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = min(model.ir_version, 10)
        options = ort.SessionOptions()
        options.intra_op_num_threads = torch.get_num_threads()
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        feeds = {"x": x.numpy()}
        out["onnxruntime MatMul+Add (MLAS)"] = lambda: session.run(None, feeds)
        del onnx
    except ImportError:
        pass
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=20, help="timed calls per round per kernel")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    name, ghz, per_cycle = cpu_facts()
    peak = args.threads * ghz * per_cycle  # GFLOP/s
    print(f"# FP32 GEMM, {name}, {args.threads} threads, peak {peak:.0f} GFLOP/s "
          f"({ghz:.2f} GHz x {per_cycle} FLOP/cycle/core); median of {args.rounds} interleaved rounds")
    print("\n| M x K x N | kernel | ms | GFLOP/s | % of peak |\n|---|---|---|---|---|")
    for m, k, n in SHAPES:
        fns = runners(m, k, n)
        samples: dict[str, list[float]] = {key: [] for key in fns}
        for fn in fns.values():
            for _ in range(3):
                fn()
        for _ in range(args.rounds):
            for key, fn in fns.items():
                times = []
                for _ in range(args.calls):
                    t0 = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - t0)
                samples[key].append(statistics.median(times))
        flops = 2 * m * k * n
        for key, s in sorted(samples.items(), key=lambda kv: min(kv[1])):
            seconds = statistics.median(s)
            gflops = flops / seconds / 1e9
            print(f"| {m} x {k} x {n} | {key} | {1000 * seconds:.3f} | {gflops:.1f} | {100 * gflops / peak:.0f}% |")


if __name__ == "__main__":
    main()
