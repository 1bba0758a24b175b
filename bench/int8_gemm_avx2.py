"""MiniLM's QDQ GEMM layers on an AVX2 CPU: kiln's own int8 GEMM (cpu.qgemm.kiln_i8, i8gemm.c) against oneDNN's int8
matmul (cpu.qgemm.onednn), fp32, and onnxruntime (MLAS), per layer, peers interleaved.

    python bench/int8_gemm_avx2.py --threads 1 --clock thread
    python bench/int8_gemm_avx2.py --threads 2 --clock wall --shapes 128x384x1536,512x384x1536

Two tables per shape list:

- **engines**: one QDQ MatMul model (Q(x) -> DQ -> MatMul(DQ(W int8 per channel)) -> Q -> DQ, bench/qdq_gemm_vs_mlas.py's)
  built by kiln with only one QGemm tactic allowed (kiln i8 / oneDNN int8; the quantize steps keep theirs), the float
  MatMul model (W dequantized) built by kiln (fp32: the tuner's GEMM), and both models in onnxruntime (ORT_ENABLE_ALL:
  QLinearMatMul on MLAS for the QDQ one). Each call is a whole engine run: the int8 rows include the input's
  quantize and output's dequantize, fp32 rows do not have them.
- **kernels**: the layers alone on the same operands (no engine, no Q/DQ): kiln's I8Gemm (uint8 in, uint8 out),
  oneDNN's int8 QMatMul (the same), kiln's fp32 packed GEMM (gemm.c) and oneDNN's fp32 inner product.

Rounds interleave the peers (the order rotated each round); each round a block of `--calls` calls per peer, its
median; the table shows the median over rounds and each peer's ratio to kiln i8 (median of per-round ratios, range).
Every kiln int8 output is checked against onnxruntime's (max difference in output steps).
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
X_SCALE, X_ZERO, Y_SCALE, Y_ZERO = 0.05, 128, 0.2, 120
QUANTIZE_TACTICS = ["cpu.quantize", "cpu.dequantize"]


def models(m: int, k: int, n: int, rng: np.random.Generator) -> tuple[onnx.ModelProto, onnx.ModelProto, dict]:
    """(the QDQ model, the float model with W dequantized, the operands)."""
    w = rng.integers(-64, 64, (k, n)).astype(np.int8)  # 7-bit, as reduce_range makes them
    ws = (rng.random(n) * 0.01 + 0.001).astype(np.float32)
    scalars = {"xs": np.float32(X_SCALE), "xz": np.uint8(X_ZERO), "ys": np.float32(Y_SCALE), "yz": np.uint8(Y_ZERO)}
    inits = [numpy_helper.from_array(w, "W"), numpy_helper.from_array(ws, "ws"),
             numpy_helper.from_array(np.zeros(n, np.int8), "wz")]
    inits += [numpy_helper.from_array(np.array(v), name) for name, v in scalars.items()]
    nodes = [helper.make_node("QuantizeLinear", ["xf", "xs", "xz"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["x"]),
             helper.make_node("DequantizeLinear", ["W", "ws", "wz"], ["w"], axis=1),
             helper.make_node("MatMul", ["x", "w"], ["y"]),
             helper.make_node("QuantizeLinear", ["y", "ys", "yz"], ["yq"]),
             helper.make_node("DequantizeLinear", ["yq", "ys", "yz"], ["out"])]
    io = ([helper.make_tensor_value_info("xf", TensorProto.FLOAT, [m, k])],
          [helper.make_tensor_value_info("out", TensorProto.FLOAT, [m, n])])
    qdq = helper.make_model(helper.make_graph(nodes, "qdq_matmul", *io, inits),
                            opset_imports=[helper.make_opsetid("", 19)])
    w_real = (w.astype(np.float32) * ws).astype(np.float32)
    fp32 = helper.make_model(helper.make_graph([helper.make_node("MatMul", ["xf", "Wf"], ["out"])], "matmul", *io,
                                               [numpy_helper.from_array(w_real, "Wf")]),
                             opset_imports=[helper.make_opsetid("", 19)])
    qdq.ir_version = fp32.ir_version = 9
    return qdq, fp32, {"w": w, "ws": ws, "w_real": w_real}


def ort_session(model: onnx.ModelProto, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def engine_peers(qdq, fp32, threads: int, folder: Path) -> tuple[dict, dict]:
    """{peer: (call(feed) -> output)} for the whole-model table, and the QGemm tactic each kiln int8 engine runs."""
    path = folder / "qdq.onnx"
    onnx.save(qdq, str(path))
    engines = {"kiln i8": kiln.build(str(path), tactics=["cpu.qgemm.kiln_i8", *QUANTIZE_TACTICS]),
               "kiln oneDNN int8": kiln.build(str(path), tactics=["cpu.qgemm.onednn", *QUANTIZE_TACTICS])}
    tactics = {name: next(s.tactic for s in e.plan.program.steps if s.op_type == "QGemm")
               for name, e in engines.items()}
    engines["kiln fp32"] = kiln.build(fp32)
    peers = {name: (lambda feed, e=e: next(iter(e.run(feed).values()))) for name, e in engines.items()}
    for name, model in (("ORT int8 (MLAS)", qdq), ("ORT fp32", fp32)):
        session = ort_session(model, threads)
        peers[name] = lambda feed, s=session: s.run(None, feed)[0]
    return peers, tactics


def kernel_peers(m: int, k: int, n: int, ops: dict, rng: np.random.Generator) -> dict:
    """{peer: call()} on the layers alone, their operands made here."""
    import torch

    from kiln.kernels.cpu import gemm_native, i8gemm, onednn_int8, onednn_primitives

    w = torch.from_numpy(ops["w"].T.copy())  # [N, K]
    ws = torch.from_numpy(ops["ws"])
    y = (torch.uint8, Y_SCALE, Y_ZERO)
    x8 = torch.from_numpy(rng.integers(0, 256, (m, k)).astype(np.uint8))
    xf = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
    w_real = torch.from_numpy(ops["w_real"].T.copy())
    i8 = i8gemm.I8Gemm(w, ws, None, m, torch.uint8, X_SCALE, X_ZERO, y)
    out8 = torch.empty(m, n, dtype=torch.uint8)
    dnnl8 = onednn_int8.QMatMul(w, ws, None, m, torch.uint8, X_SCALE, X_ZERO, y)
    packed = gemm_native.PackedLinear(w_real, None)
    outf = torch.empty(m, n)
    inner = onednn_primitives.InnerProduct(w_real, None, m, None, False, False)
    same = (i8(x8, out8).to(torch.int64) - dnnl8(x8).to(torch.int64)).abs().max()
    assert int(same) <= 1, f"kiln i8 and oneDNN int8 differ by {int(same)} steps"
    return {"kiln i8": lambda: i8(x8, out8), "oneDNN int8": lambda: dnnl8(x8),
            "kiln fp32 (gemm.c)": lambda: packed(xf, None, outf), "oneDNN fp32": lambda: inner(xf)}


def interleaved(peers: dict, rounds: int, calls: int, clock) -> dict[str, list[float]]:
    """{peer: the median ms of its block in each round}."""
    names = list(peers)
    times: dict[str, list[float]] = {p: [] for p in names}
    for r in range(rounds):
        for peer in names[r % len(names):] + names[:r % len(names)]:
            samples = []
            for _ in range(calls):
                start = clock()
                peers[peer]()
                samples.append((clock() - start) / 1e6)
            times[peer].append(statistics.median(samples))
    return times


def table(title: str, rows: list[tuple[str, dict, float, float, str]], base: str) -> None:
    print(f"\n### {title}\n")
    print(f"| M x K x N | peer | ms (median of rounds) | GOPS | / {base} (rounds) | load | note |")
    print("|---|---|---|---|---|---|---|")
    for shape, times, macs, load, note in rows:
        for peer, t in times.items():
            ratios = [a / b for a, b in zip(t, times[base])]
            ratio = "1" if peer == base else \
                f"**{statistics.median(ratios):.2f}** ({min(ratios):.2f}-{max(ratios):.2f})"
            print(f"| {shape} | {peer} | {statistics.median(t):.3f} | {2 * macs / statistics.median(t) / 1e6:.0f} | "
                  f"{ratio} | {load} | {note if peer == base else ''} |", flush=True)


def main(argv: list[str] | None = None) -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="128x384x384,128x384x1536,128x1536x384")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="wall",
                        help="thread: the calling thread's CPU time (1 thread only)")
    parser.add_argument("--only", choices=("engines", "kernels", "both"), default="both")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = CLOCKS[args.clock]
    rng = np.random.default_rng(0)
    folder = Path(tempfile.mkdtemp(prefix="kiln-i8gemm-"))
    print(f"# CPU {cpu_name()}, {args.threads} thread(s), {args.clock} clock, load {os.getloadavg()[0]:.2f}, "
          f"{args.rounds} rounds x {args.calls} calls")
    engine_rows, kernel_rows = [], []
    for shape in args.shapes.split(","):
        m, k, n = (int(v) for v in shape.split("x"))
        qdq, fp32, ops = models(m, k, n, rng)
        if args.only in ("engines", "both"):
            peers, tactics = engine_peers(qdq, fp32, args.threads, folder)
            feed = {"xf": (rng.standard_normal((m, k)) * 3).astype(np.float32)}
            want = peers["ORT int8 (MLAS)"](feed)
            steps = {p: float(np.abs(np.asarray(peers[p](feed)) - want).max() / Y_SCALE)
                     for p in ("kiln i8", "kiln oneDNN int8")}
            calls = {p: (lambda f=f: f(feed)) for p, f in peers.items()}
            for call in calls.values():
                for _ in range(10):
                    call()
            start = os.getloadavg()[0]
            times = interleaved(calls, args.rounds, args.calls, clock)
            note = f"tactics {tactics}; max diff vs ORT (steps) {steps}"
            engine_rows.append((shape, times, m * k * n, f"{start:.1f}-{os.getloadavg()[0]:.1f}", note))
        if args.only in ("kernels", "both"):
            calls = kernel_peers(m, k, n, ops, rng)
            for call in calls.values():
                for _ in range(10):
                    call()
            start = os.getloadavg()[0]
            times = interleaved(calls, args.rounds, args.calls, clock)
            kernel_rows.append((shape, times, m * k * n, f"{start:.1f}-{os.getloadavg()[0]:.1f}", ""))
    if engine_rows:
        table(f"engines, {args.threads} thread(s), {args.clock} clock", engine_rows, "kiln i8")
    if kernel_rows:
        table(f"kernels alone, {args.threads} thread(s), {args.clock} clock", kernel_rows, "kiln i8")


if __name__ == "__main__":
    main()
