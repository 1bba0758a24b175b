"""One QDQ MatMul (uint8 x, int8 per-channel W, uint8 y) in kiln (QGemm: oneDNN's int8 matmul) and onnxruntime
(QLinearMatMul: MLAS), at a QDQ BERT's GEMM shapes: is kiln's 8-bit GEMM the one that loses?

    python bench/qdq_gemm_vs_mlas.py --shapes 128x384x1536,128x1536x384,128x384x384 --clock thread

The model: Q(x float) -> DQ -> MatMul with DQ(W int8, per output channel) -> Q -> DQ, each engine built from it
(kiln.build; onnxruntime ORT_ENABLE_ALL), 1 thread by default. Both run the input's Quantize and the output's
Dequantize too (the same work on each side). Interleaved blocks, the order swapped each round; prints ms per run,
GOPS (2·M·K·N), kiln / onnxruntime, and the largest output difference (in output steps).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kiln  # noqa: E402
from kiln.builder.timing_cache import cpu_name  # noqa: E402

CLOCKS = {"wall": time.perf_counter_ns, "thread": time.thread_time_ns}
Y_SCALE = 0.2


def qdq_matmul(m: int, k: int, n: int, path: Path, rng: np.random.Generator) -> None:
    w = rng.integers(-64, 64, (k, n)).astype(np.int8)
    scalars = {"xs": np.float32(0.05), "xz": np.uint8(128), "ys": np.float32(Y_SCALE), "yz": np.uint8(120)}
    inits = [numpy_helper.from_array(w, "W"), numpy_helper.from_array(rng.random(n).astype(np.float32) * 0.01 + 0.001,
                                                                      "ws"),
             numpy_helper.from_array(np.zeros(n, np.int8), "wz")]
    inits += [numpy_helper.from_array(np.array(v), name) for name, v in scalars.items()]
    nodes = [helper.make_node("QuantizeLinear", ["xf", "xs", "xz"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["x"]),
             helper.make_node("DequantizeLinear", ["W", "ws", "wz"], ["w"], axis=1),
             helper.make_node("MatMul", ["x", "w"], ["y"]),
             helper.make_node("QuantizeLinear", ["y", "ys", "yz"], ["yq"]),
             helper.make_node("DequantizeLinear", ["yq", "ys", "yz"], ["out"])]
    graph = helper.make_graph(nodes, "qdq_matmul", [helper.make_tensor_value_info("xf", TensorProto.FLOAT, [m, k])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [m, n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    model.ir_version = 9
    onnx.save(model, str(path))


def main(argv: list[str] | None = None) -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="128x384x1536,128x1536x384,128x384x384")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="thread",
                        help="thread: the calling thread's CPU time (1 thread only)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = CLOCKS[args.clock]
    rng = np.random.default_rng(0)
    folder = Path(tempfile.mkdtemp(prefix="kiln-qgemm-"))
    print(f"# CPU {cpu_name()}, {args.threads} thread(s), {args.clock} clock, load {os.getloadavg()[0]:.2f}\n")
    print("| M x K x N | kiln ms | onnxruntime ms | kiln GOPS | onnxruntime GOPS | kiln / onnxruntime (rounds) | "
          "max diff (steps) | load |")
    print("|---|---|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        m, k, n = (int(v) for v in shape.split("x"))
        path = folder / f"{shape}.onnx"
        qdq_matmul(m, k, n, path, rng)
        engine = kiln.build(str(path))
        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = args.threads, 1
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        feed = {"xf": (rng.standard_normal((m, k)) * 3).astype(np.float32)}
        diff = np.abs(np.asarray(next(iter(engine.run(feed).values()))) - session.run(None, feed)[0]).max()
        runs = {"kiln": lambda: engine.run(feed), "onnxruntime": lambda: session.run(None, feed)}
        for run in runs.values():
            for _ in range(20):
                run()
        load = os.getloadavg()[0]
        times: dict[str, list[float]] = {p: [] for p in runs}
        for r in range(args.rounds):
            for peer in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
                samples = []
                for _ in range(args.calls):
                    start = clock()
                    runs[peer]()
                    samples.append((clock() - start) / 1e6)
                times[peer].append(statistics.median(samples))
        ratios = [a / b for a, b in zip(times["kiln"], times["onnxruntime"])]
        mk, mo = statistics.median(times["kiln"]), statistics.median(times["onnxruntime"])
        print(f"| {m} x {k} x {n} | {mk:.3f} | {mo:.3f} | {2 * m * k * n / mk / 1e6:.0f} | {2 * m * k * n / mo / 1e6:.0f} "
              f"| **{statistics.median(ratios):.2f}** ({min(ratios):.2f}-{max(ratios):.2f}) | {diff / Y_SCALE:.0f} | "
              f"{load:.1f}-{os.getloadavg()[0]:.1f} |", flush=True)


if __name__ == "__main__":
    main()
