"""One LSTM layer on lstm_fused.c, as checked in and as other versions of the file, beside onnxruntime's LSTM.

    python bench/recurrent_layer_ab.py --avx2                      # the checked-in kernel vs onnxruntime, AVX2 only
    python bench/recurrent_layer_ab.py --avx2 old.c new.c          # versions of lstm_fused.c side by side
    python bench/recurrent_layer_ab.py --threads 2 --batch 6       # AVX-512, two threads, another batch

Each lstm_fused.c given is compiled with the checked-in gemm.c, recurrent.c, lstm.c and lstm_lanes.c into a library
of its own (kiln's cache), so that versions of the kernel are timed in one process: a shared VM's load drifts more
between processes than between two versions of the cell (bench/results/lstmavx2-2026-12-05c.md). The layer is the
zoo LSTM forecaster's (96 steps, 128 units, batch 8) at inputs 16 (its first layer) and 128 (its second), its
weights packed once by the checked-in library (every version reads that layout). Every output is checked against
onnxruntime's first; then interleaved rounds at SCHED_FIFO (root; bench/lstm_engine.py), each a block of `--runs`
calls per runner after a SETTLE_S sleep (onnxruntime's workers stop spinning) and 5 warm-up, starting at the next
runner each round: the median over rounds of each block's median, by the calling thread's CPU time at one thread
(the honest measure beside other work), by the wall clock at two, and per round the ratio to onnxruntime's.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
if "--avx2" in sys.argv:  # before torch, onnxruntime or kiln read cpuid (bench/zoo_avx2.py checks MLAS obeys)
    import cpuid_avx2

    cpuid_avx2.enable()
    os.environ["KILN_CPU_ISA"] = "avx2"

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
import kiln  # noqa: E402, F401  (first: KILN_CPU_ISA caps the libraries before their first kernel)
from kiln.builder.timing_cache import cpu_name  # noqa: E402
from kiln.kernels.cpu import gemm_native, recurrent  # noqa: E402
from kiln.zoo.timing import SETTLE_S  # noqa: E402
from lstm_engine import blocks, realtime  # noqa: E402

STEPS, HIDDEN = 96, 128


def fused_entry(version: Path) -> Callable:
    """kiln_lstm_fused of a library built from `version` (an lstm_fused.c) and the checked-in files before it."""
    here = Path(recurrent.__file__).parent
    before = [(here / name).read_text() for name in ("recurrent.c", "lstm.c", "lstm_lanes.c")]
    source = "\n".join([gemm_native.SOURCE, *before, version.read_text()])
    lib = gemm_native.open_library(f"recurrent-ab-{version.stem}", source, False)
    if isinstance(lib, str):
        raise SystemExit(f"{version}: {lib}")
    lib.kiln_lstm_fused.restype = ctypes.c_int
    lib.kiln_lstm_fused.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    return lib.kiln_lstm_fused


def onnxruntime_layer(w: np.ndarray, r: np.ndarray, b: np.ndarray, batch: int, threads: int):
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [STEPS, batch, w.shape[1]])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    weights = [onnx.numpy_helper.from_array(a[None], n) for a, n in ((w, "W"), (r, "R"), (b, "B"))]
    graph = helper.make_graph([helper.make_node("LSTM", ["x", "W", "R", "B"], ["y"], hidden_size=HIDDEN)], "lstm",
                              [x], [y], weights)
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def runners(versions: list[Path], batch: int, threads: int) -> dict[str, Callable[[], object]]:
    import torch

    entries = {"kiln": None, **{v.stem: fused_entry(v) for v in versions}}
    kernel = next(k for k in recurrent.fused_kernels() if k.supported and not k.test_only)
    rng = np.random.default_rng(0)
    out: dict[str, Callable[[], object]] = {}
    for inputs in (16, 128):
        w, r = (rng.standard_normal((4 * HIDDEN, k)).astype(np.float32) * 0.1 for k in (inputs, HIDDEN))
        b = rng.standard_normal(8 * HIDDEN).astype(np.float32) * 0.1
        x = rng.standard_normal((STEPS, batch, inputs)).astype(np.float32)
        session = onnxruntime_layer(w, r, b, batch, threads)
        want = session.run(None, {"x": x})[0][:, 0]
        out[f"onnxruntime I={inputs}"] = lambda s=session, x=x: s.run(None, {"x": x})
        xt = torch.from_numpy(x)
        for label, entry in entries.items():
            layer = recurrent.FusedLSTMDirection(torch.from_numpy(w), torch.from_numpy(r), torch.from_numpy(b),
                                                 kernel=kernel)
            if entry is not None:
                layer._function = entry  # the version's loop on the checked-in packing (one layout)
            y = torch.empty(STEPS, batch, HIDDEN)

            def run(layer=layer, y=y) -> None:
                layer.run(xt, y, None, None, None, None, reverse=False, batch_major=False)

            run()
            error = float(np.abs(y.numpy() - want).max())
            if error > 1e-5:
                raise SystemExit(f"{label} I={inputs}: Y differs from onnxruntime's by {error:.2e}")
            out[f"{label} I={inputs}"] = run
    print(f"tile: {kernel.name}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("versions", nargs="*", type=Path, help="other lstm_fused.c files to time beside the checked-in one")
    ap.add_argument("--avx2", action="store_true", help="kiln and onnxruntime on an AVX2-only CPU (cpuid masked)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--runs", type=int, default=30, help="timed calls per block")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    calls = runners(args.versions, args.batch, args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    load = os.getloadavg()[0]
    with realtime(True):
        times: dict[str, list[float]] = blocks(calls, args.rounds, args.runs, clock=clock, settle=SETTLE_S)
    what = "calling thread's CPU" if args.threads == 1 else "wall"
    print(f"# One LSTM layer ({STEPS} steps, batch {args.batch}, {HIDDEN} units), {cpu_name()}, "
          f"{'AVX2 only' if args.avx2 else 'native ISA'}, {args.threads} thread(s), {what} ms, SCHED_FIFO, "
          f"1-min load {load:.2f} -> {os.getloadavg()[0]:.2f}\n")
    print("| runner | ms | / onnxruntime | by round |\n|---|---|---|---|")
    for label, values in times.items():
        ort_times = times[f"onnxruntime I={label.split('I=')[1]}"]
        ratios = [a / o for a, o in zip(values, ort_times)]
        print(f"| {label} | {statistics.median(values):.3f} | {statistics.median(ratios):.3f} | "
              f"{', '.join(f'{q:.2f}' for q in ratios)} |")


if __name__ == "__main__":
    main()
