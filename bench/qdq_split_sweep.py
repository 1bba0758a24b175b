"""Where splitting a QDQ transformer's 8-bit Elementwise chains and LayerNormQuantize over kiln's pool pays: each
kernel alone at a sweep of sizes, on one thread against split over the pool (transformer.set_quantized_split past
the size, or 0).

    python bench/qdq_split_sweep.py --threads 2 --rounds 9
    python bench/qdq_split_sweep.py --between gemm      (a 2-thread torch GEMM before every call, as in an engine)
    python bench/qdq_split_sweep.py --clock thread      (the calling thread's CPU time: a loaded machine moves it less)

The kernels (kiln/kernels/cpu/elementwise.py, transformer.py) are the ones onnxruntime's QDQ BERT builds, with
random constants: `table` (DQ -> bias -> scale -> Q: one 8-bit value in and out, a lookup table from 64 rows on),
`gelu` (DQ -> bias -> Gelu -> Q, a table too), `dq_add` (DQ -> bias, float out: evaluated) and `lnq`
(LayerNormQuantize, float x + 8-bit residual, 8-bit y). `--between gemm` runs a [128, 256] x [256, 256] torch
matmul (OpenMP, like the engine's oneDNN int8 GEMMs) before each timed call, so the pool's worker has gone to
sleep and OpenMP's spins on the other core, as inside an engine run; `none` calls back to back (the worker still
polling from the call before). Wall clock (or the calling thread's CPU clock) of each call (the ctypes call on a
bound plan), the median of each block; blocks alternate serial / split, the order swapped every round. Prints µs
per call, split / serial per round, how many rounds the split won, and the ns per element of the serial side;
checks both sides' outputs are the same bits.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kiln.builder.timing_cache import cpu_name  # noqa: E402
from kiln.kernels.cpu import transformer  # noqa: E402
from kiln.kernels.cpu.elementwise import Elementwise  # noqa: E402

NEVER = 1 << 40  # kiln_quantized_split: no size splits
CLOCKS = {"wall": time.perf_counter_ns, "thread": time.thread_time_ns}
PROGRAMS = {
    "table": ["Dequantize i2 i3 i4", "Add t0 i0", "Mul t1 i1", "Quantize t2 i5 i6"],
    "gelu": ["Dequantize i1 i2 i3", "Add t0 i0", "Gelu t1", "Quantize t2 i4 i5"],
    "dq_add": ["Dequantize i1 i2 i3", "Add t0 i0"],
}


def _scalar(value: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.tensor(value, dtype=dtype)


def elementwise(kind: str, rows: int, n: int) -> tuple[Elementwise, dict[int, torch.Tensor]]:
    """The chain `kind` over [rows, n] uint8 (random), its constants random; (kernel, step inputs)."""
    g = torch.Generator().manual_seed(rows * 7 + n)
    bias = torch.randn(n, generator=g)
    x = torch.randint(0, 256, (rows, n), dtype=torch.uint8, generator=g)
    dq = [_scalar(0.05), _scalar(128, torch.uint8)]
    q = [_scalar(0.03), _scalar(120, torch.uint8)]
    if kind == "table":
        constants = {0: bias, 1: _scalar(0.25), 3: dq[0], 4: dq[1], 5: q[0], 6: q[1]}
        step = 2
    else:
        constants = {0: bias, 2: dq[0], 3: dq[1], **({4: q[0], 5: q[1]} if kind == "gelu" else {})}
        step = 1
    return Elementwise(PROGRAMS[kind], {step: (rows, n)}, constants, {step: torch.uint8}), {step: x}


def layer_norm_quantize(rows: int, n: int) -> tuple[transformer.LayerNormQuantize, dict[int, torch.Tensor]]:
    """LayerNormQuantize over [rows, n] float32 with a uint8 residual (random), as QDQ BERT's norms."""
    g = torch.Generator().manual_seed(rows * 11 + n)
    kernel = transformer.LayerNormQuantize((rows, n), torch.randn(n, generator=g), torch.randn(n, generator=g), 1e-12,
                                           (rows, n), (0.04, 128, torch.uint8), (0.05, 128, torch.uint8))
    return kernel, {0: torch.randn(rows, n, generator=g) * 3,
                    3: torch.randint(0, 256, (rows, n), dtype=torch.uint8, generator=g)}


def bound_call(kernel, inputs: dict[int, torch.Tensor]):
    """(a call of the kernel's C function on its plan, the output tensor it writes)."""
    y = torch.empty(kernel.output_size, dtype=kernel.output_dtype)
    bound = kernel.bind_reads(y.data_ptr(), {k: v.data_ptr() for k, v in inputs.items()})
    function = getattr(kernel.library, kernel.FUNCTION)
    address = ctypes.addressof(bound.plan)

    def call(_alive=(bound, inputs)):  # the plan and the operands it points at live as long as the call
        return function(address, None, 0, None)

    return call, y


def block_us(call, between, calls: int, clock) -> float:
    samples = []
    for _ in range(calls):
        between()
        start = clock()
        call()
        samples.append((clock() - start) / 1e3)
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--kinds", default="table,gelu,dq_add,lnq")
    parser.add_argument("--rows", default="32,64,128,256,512")
    parser.add_argument("--widths", default="64,256,768")
    parser.add_argument("--between", choices=("none", "gemm"), default="none")
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="wall")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    a, b = torch.randn(128, 256), torch.randn(256, 256)
    between = (lambda: torch.mm(a, b)) if args.between == "gemm" else (lambda: None)
    sides = {"serial": NEVER, "split": 0}  # kiln_quantized_split of each side
    default = transformer.set_quantized_split(NEVER)
    print(f"# CPU {cpu_name()}, {args.threads} threads, between calls: {args.between}, {args.clock} clock, "
          f"{args.rounds} rounds of {args.calls} calls a side, load {os.getloadavg()[0]:.2f} at the start\n")
    print("| kernel | rows x n | elements | serial µs | split µs | split / serial | rounds split won | serial ns/elt "
          "| load |")
    print("|---|---|---|---|---|---|---|---|---|")
    for kind in args.kinds.split(","):
        for n in (int(w) for w in args.widths.split(",")):
            for rows in (int(r) for r in args.rows.split(",")):
                call, y = bound_call(*(layer_norm_quantize(rows, n) if kind == "lnq" else elementwise(kind, rows, n)))
                outputs = {}
                for side, split in sides.items():
                    transformer.set_quantized_split(split)
                    call()
                    outputs[side] = y.clone()
                if not torch.equal(outputs["serial"], outputs["split"]):
                    raise SystemExit(f"{kind} [{rows}, {n}]: the split's output differs from the serial one's")
                load = os.getloadavg()[0]
                times: dict[str, list[float]] = {side: [] for side in sides}
                for r in range(args.rounds):
                    for side in (("serial", "split") if r % 2 == 0 else ("split", "serial")):
                        transformer.set_quantized_split(sides[side])
                        times[side].append(block_us(call, between, args.calls, CLOCKS[args.clock]))
                ratios = [s / t for s, t in zip(times["split"], times["serial"])]
                serial, split = statistics.median(times["serial"]), statistics.median(times["split"])
                print(f"| {kind} | {rows} x {n} | {rows * n} | {serial:.1f} | {split:.1f} | "
                      f"**{statistics.median(ratios):.2f}** ({min(ratios):.2f}-{max(ratios):.2f}) | "
                      f"{sum(x < 1 for x in ratios)} of {len(ratios)} | {1e3 * serial / (rows * n):.2f} | "
                      f"{load:.1f}-{os.getloadavg()[0]:.1f} |", flush=True)
    transformer.set_quantized_split(default)

if __name__ == "__main__":
    main()
