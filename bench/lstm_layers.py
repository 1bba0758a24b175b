"""One ONNX LSTM layer on the CPU, each of kiln's loops against onnxruntime and torch, side by side, fp32.

    python bench/lstm_layers.py                       # inputs 16 and 128, batch 8, 96 steps, 128 units, 1 thread
    python bench/lstm_layers.py --inputs 128 --batch 1 --rounds 7
    python bench/lstm_layers.py --threads 2          # wall clock (each peer's pool on 2 threads)
    python bench/lstm_layers.py --threads 2 --avx2 --realtime   # AVX2 only (cpuid masked), at SCHED_FIFO (root)

Every peer runs the same forward layer (W, R, B random, no initial state) on one thread, timed by the CPU
time of the calling thread (time.thread_time: every peer computes on the calling thread at one thread; with
--threads > 1 the wall clock, which other work on a shared machine inflates), in interleaved rounds of blocks
(native, lanes..., fused..., torch, onnxruntime, native, ...), each after a SETTLE_S sleep (onnxruntime's workers
stop spinning), so a shared machine's drift lands on all alike; each output is checked against onnxruntime's first.
Prints, per loop, the median over rounds, GFLOP/s (2·S·N·(I+H)·4H) and each round's ms.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
if "--avx2" in sys.argv:  # before torch, onnxruntime or kiln read cpuid (bench/zoo_avx2.py checks MLAS obeys)
    import cpuid_avx2

    cpuid_avx2.enable()
    os.environ["KILN_CPU_ISA"] = "avx2"

import numpy as np  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
import kiln  # noqa: E402, F401  (first: KILN_CPU_ISA caps the libraries before their first kernel)
import onnxruntime as ort  # noqa: E402
import torch  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from kiln.builder.timing_cache import cpu_name  # noqa: E402
from kiln.kernels.cpu import recurrent  # noqa: E402
from kiln.zoo.timing import SETTLE_S  # noqa: E402


def ort_layer(w: np.ndarray, r: np.ndarray, b: np.ndarray, steps: int, batch: int, hidden: int, threads: int):
    inputs = w.shape[2]
    graph = helper.make_graph(
        [helper.make_node("LSTM", ["X", "W", "R", "B"], ["Y"], hidden_size=hidden)], "lstm",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [steps, batch, inputs])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(a, n) for a, n in ((w, "W"), (r, "R"), (b, "B"))])
    # IR 10: what every onnxruntime of the last years reads (the device's takes up to 13, onnx writes 14 now)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)], ir_version=10)
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def median_ms(fn, runs: int, clock, warmup: int = 3, settle: float = SETTLE_S) -> float:
    """The median of `runs` timed calls after `warmup`, `settle` seconds slept first: onnxruntime's pool spins for
    tens of ms after its calls, and at SCHED_FIFO a spinning worker keeps its core from kiln's second thread (the
    row split's slice 1 started 0.73 ms late right after onnxruntime's block, 0.03 ms after 0.2 s:
    bench/results/lstm-zen3-2026-12-07.md)."""
    time.sleep(settle)
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(runs):
        start = clock()
        fn()
        samples.append(clock() - start)
    return float(np.median(samples)) * 1e3


def peers(inputs: int, args) -> tuple[dict, np.ndarray, dict]:
    """(callable per peer, onnxruntime's Y, each kiln loop's output tensor) for one input size."""
    steps, batch, hidden = args.steps, args.batch, args.hidden
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((1, 4 * hidden, inputs)) * 0.1).astype(np.float32)
    r = (rng.standard_normal((1, 4 * hidden, hidden)) * 0.1).astype(np.float32)
    b = (rng.standard_normal((1, 8 * hidden)) * 0.1).astype(np.float32)
    x = rng.standard_normal((steps, batch, inputs)).astype(np.float32)
    session = ort_layer(w, r, b, steps, batch, hidden, args.threads)
    want = session.run(None, {"X": x})[0][:, 0]
    W, R, B, X = (torch.from_numpy(a) for a in (w, r, b, x))
    layers = {"native": recurrent.RecurrentDirection("LSTM", W[0], R[0], B[0])}
    for k in recurrent.lanes_kernels():
        if k.supported and not k.test_only and batch <= recurrent.lanes_batch():
            layers[f"lanes {k.name.split()[0]}"] = recurrent.LanesLSTMDirection(W[0], R[0], B[0], kernel=k)
    for k in recurrent.fused_kernels():
        if k.supported and not k.test_only:
            for split in (("rows", "blocks") if args.threads > 1 else (None,)):
                label = f"fused {k.name.split()[0]}" + (f" {split}" if split else "")
                layers[label] = recurrent.FusedLSTMDirection(W[0], R[0], B[0], kernel=k, split=split)
    outputs = {name: torch.empty(steps, batch, hidden) for name in layers}
    run = {name: (lambda layer, y: lambda: layer.run(X, y, None, None, None, None, reverse=False,
                                                     batch_major=False))(layer, outputs[name])
           for name, layer in layers.items()}
    order = torch.cat([torch.arange(0, hidden), torch.arange(2 * hidden, 4 * hidden), torch.arange(hidden, 2 * hidden)])
    weights = [W[0][order].contiguous(), R[0][order].contiguous(), B[0][:4 * hidden][order].contiguous(),
               B[0][4 * hidden:][order].contiguous()]  # ONNX i o f c -> torch i f c o
    zeros = torch.zeros(1, batch, hidden)

    def torch_lstm():
        with torch.inference_mode():
            return torch._VF.lstm(X, (zeros, zeros), weights, True, 1, 0.0, False, False, False)[0]

    run["torch"] = torch_lstm
    run["onnxruntime"] = lambda: session.run(None, {"X": x})
    return run, want, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", default="16,128", help="comma-separated input sizes I")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=96)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--runs", type=int, default=20, help="timed runs per block")
    parser.add_argument("--threads", type=int, default=1, help="threads of every peer (past 1: wall clock)")
    parser.add_argument("--avx2", action="store_true", help="kiln and onnxruntime on an AVX2-only CPU (cpuid masked)")
    parser.add_argument("--realtime", action="store_true", help="time the rounds at SCHED_FIFO priority (root)")
    args = parser.parse_args()
    from lstm_engine import realtime
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    print(f"{cpu_name()} ({platform.machine()}), load {os.getloadavg()[0]:.2f}, {args.threads} thread(s), "
          f"{'CPU time of the calling thread' if args.threads == 1 else 'wall clock'}, batch {args.batch}, "
          f"{args.steps} steps, {args.hidden} units{', AVX2 only' if args.avx2 else ''}"
          f"{', SCHED_FIFO' if args.realtime else ''}", flush=True)
    for inputs in (int(i) for i in args.inputs.split(",")):
        run, want, outputs = peers(inputs, args)
        for name, fn in run.items():
            fn()
            got = outputs[name].numpy() if name in outputs else \
                (fn().numpy() if name == "torch" else want)
            err = float(np.abs(got - want).max())
            if err > 1e-5:
                raise SystemExit(f"I={inputs} {name}: max |Y - Y_onnxruntime| = {err:.1e}")
        rounds = {name: [] for name in run}
        order = list(run.items())
        with realtime(args.realtime):
            for r in range(args.rounds):
                shift = r % len(order)  # each round starts at the next peer
                for name, fn in order[shift:] + order[:shift]:
                    rounds[name].append(median_ms(fn, args.runs, clock))
        flop = 2 * args.steps * args.batch * (inputs + args.hidden) * 4 * args.hidden
        for name, ms in rounds.items():
            median = float(np.median(ms))
            ratio = np.median([m / o for m, o in zip(ms, rounds["onnxruntime"])])
            print(f"I={inputs:<4} {name:<14} {median:7.3f} ms  {flop / median / 1e6:5.1f} GF/s  "
                  f"/ ort (median of rounds) {ratio:.2f}  rounds {' '.join(f'{m:.2f}' for m in ms)}", flush=True)


if __name__ == "__main__":
    main()
