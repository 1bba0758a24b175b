"""Does a 1x1 convolution's kernel split over 2 threads? oneDNN's convolution, oneDNN's inner product on the NHWC rows
and kiln's packed GEMM on the same rows, at 1 and 2 threads (issue 11: DenseNet-121 at 2 threads).

    python bench/conv_split.py [--shapes 28x128x128,...]   # HWxCxO, batch 1

OpenMP's waits are made passive here (OMP_WAIT_POLICY=PASSIVE, before libgomp loads): a thread waiting at a barrier
sleeps, so CPU time is work, not spin. Per kernel: the calling thread's CPU time a call at 1 and at 2 threads
(their ratio ~2: the other thread took half the work; ~1: the caller did it all) and the process's CPU time at 2 (all
threads: ~ the caller's when the other thread did nothing). Both clocks hold under load, where the wall clock of a
2-thread call measures the scheduler. Interleaved rounds (1 then 2 threads, every kernel), medians; each kernel is
made at the count it runs at (a oneDNN primitive forks the count it was created at, whatever OpenMP's count later).

KILN_SERIAL_SMALL_LAYERS=0 is the default here: a small layer's per-call path (under SERIAL_MACS, 2^25, in
onednn_primitives.py) otherwise keeps a one-thread twin and runs whichever form its FormChooser measured faster,
which on a loaded machine is the one-thread form: a first version of this script read that as "oneDNN's 1x1
convolution does not split" (caller 1.0x at DenseNet's 28x28-7x7 layers) where its parallel form splits as the
inner product does (bench/results/zoo-2threads-zen4-2026-12-07d.md). KILN_POOL=0 puts kiln's GEMM on OpenMP (its
pool leaves a late worker's items to the caller, which under load hides its split).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads libgomp
os.environ.setdefault("KILN_SERIAL_SMALL_LAYERS", "0")  # the layers' parallel forms only (see above)

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from kiln.kernels.cpu import gemm_native, onednn_primitives  # noqa: E402
from kiln.kernels.cpu.onednn import Eltwise  # noqa: E402

# DenseNet-121's 1x1 layers (128 outputs; its transitions halve the channels) and SqueezeNet 1.1's squeeze/expand
DENSENET = "56x64x128,56x128x128,56x256x128,28x128x128,28x256x128,28x512x128,14x256x128,14x512x128,14x1024x128," \
           "7x512x128,7x1024x128,56x256x128,28x512x256,14x1024x512"
SQUEEZENET = "55x64x16,55x16x64,27x128x32,27x32x128,13x256x48,13x48x192,13x384x64,13x64x256"


def timed(fn, calls: int) -> tuple[float, float]:
    """(calling thread's CPU µs, process CPU µs) a call."""
    fn()
    thread, process = time.thread_time_ns(), time.process_time_ns()
    for _ in range(calls):
        fn()
    return (time.thread_time_ns() - thread) / calls / 1e3, (time.process_time_ns() - process) / calls / 1e3


def kernels(hw: int, c: int, o: int) -> dict[int, dict[str, object]]:
    """Each kernel made at 1 and at 2 threads (a oneDNN primitive keeps the count it was created at)."""
    g = torch.Generator().manual_seed(hw * c + o)
    w, b = torch.randn(o, c, 1, 1, generator=g) * (2.0 / c) ** 0.5, torch.randn(o, generator=g)
    x = torch.randn(1, c, hw, hw, generator=g).contiguous(memory_format=torch.channels_last)
    rows = x.permute(0, 2, 3, 1).reshape(hw * hw, c)  # [H·W, C], a view of x's memory
    out = torch.empty(hw * hw, o)
    made = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        conv = onednn_primitives.Conv2d(w, b, [1, c, hw, hw], [1, 1], [0, 0, 0, 0], [1, 1], 1, Eltwise("relu"),
                                        False, True)
        inner = onednn_primitives.InnerProduct(w.reshape(o, c), b, hw * hw, Eltwise("relu"), False, True)
        gemm = gemm_native.PackedLinear(w.reshape(o, c), b, "Relu")
        made[threads] = {f"conv ({conv.implementation.split(':')[0]})": lambda conv=conv: conv(x),
                         "inner product on the rows": lambda inner=inner: inner(rows),
                         "kiln GEMM": lambda gemm=gemm: gemm(rows, None, out)}
    return made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=DENSENET, help=f"HWxCxO,... (SqueezeNet's: {SQUEEZENET})")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(f"OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']} KILN_SERIAL_SMALL_LAYERS="
          f"{os.environ['KILN_SERIAL_SMALL_LAYERS']} KILN_POOL={os.environ.get('KILN_POOL', '1')}; torch "
          f"{torch.__version__}; load {os.getloadavg()[0]:.1f}")
    print("| layer | kernel | caller µs @1 | caller µs @2 | @1/@2 | process µs @2 | load |")
    print("|---|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        hw, c, o = (int(v) for v in shape.split("x"))
        made = kernels(hw, c, o)
        calls = max(10, int(3e7 / (hw * hw * c * o)))
        samples = {(name, t): [] for t in (1, 2) for name in made[t]}
        for _ in range(args.rounds):
            for threads in (1, 2):
                torch.set_num_threads(threads)
                for name, fn in made[threads].items():
                    samples[(name, threads)].append(timed(fn, calls))
        for name in made[1]:
            one, two = ([statistics.median(s[i] for s in samples[(name, t)]) for i in (0, 1)] for t in (1, 2))
            print(f"| {hw}x{hw} {c}->{o} | {name} | {one[0]:.1f} | {two[0]:.1f} | **{one[0] / two[0]:.2f}** | "
                  f"{two[1]:.1f} | {os.getloadavg()[0]:.1f} |", flush=True)


if __name__ == "__main__":
    main()
