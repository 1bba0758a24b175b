"""A QDQ transformer's 8-bit Elementwise chains (one uint8 in, one uint8 out: DQ -> bias [-> scale | -> Gelu] -> Q)
evaluated, or looked up in their per-column tables by the kernel before (row by row, a byte at a time on AVX2) and by
the blocked, gathered one (elementwise.c table_columns): each kernel alone, A/B/C interleaved in one process.

    python bench/qdq_table_ab.py --rounds 9
    python bench/qdq_table_ab.py --shapes 128x1536,128x3072 --kinds gelu --x uniform --clock thread

The kernels are kiln/kernels/cpu/elementwise.py's Elementwise with random constants at the sizes onnxruntime's
quantize_static BERTs give them at batch 1 x seq 128 (BERT-tiny 128/512 columns, MiniLM 384/1536, BERT-base
768/3072). `--x normal` (the default): x drawn around its zero point with a spread of 20 steps, as a GEMM's quantized
output is; `uniform`: every byte alike (the table's worst case: each row touches a random 64-byte line of every
column). One thread, the layer's split off (kiln_quantized_split: never), wall clock of each ctypes call on a bound
plan, the median of a block of calls; blocks rotate their order every round. Prints µs per call and ns per element
of each side, the ratios per round (median, range), and checks every side's output is the same bits.
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
from kiln.kernels.cpu import elementwise, transformer  # noqa: E402

NEVER = 1 << 40  # kiln_quantized_split: no size splits
PROGRAMS = {  # (code, the 8-bit input's index)
    "scale": (["Dequantize i2 i3 i4", "Add t0 i0", "Mul t1 i1", "Quantize t2 i5 i6"], 2),
    "dq_add_q": (["Dequantize i1 i2 i3", "Add t0 i0", "Quantize t1 i4 i5"], 1),
    "gelu": (["Dequantize i1 i2 i3", "Add t0 i0", "Gelu t1", "Quantize t2 i4 i5"], 1),
}
SIDES = ("evaluated", "table, byte loop (before)", "table, blocked + gather")


def _scalar(value: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.tensor(value, dtype=dtype)


def kernel(kind: str, rows: int, n: int, x_kind: str, lookup: bool, max_columns: int):
    """(Elementwise of `kind` over [rows, n] uint8, its step inputs); lookup tables up to max_columns wide."""
    g = torch.Generator().manual_seed(rows * 7 + n)
    code, step = PROGRAMS[kind]
    bias = torch.randn(n, generator=g)
    if x_kind == "uniform":
        x = torch.randint(0, 256, (rows, n), dtype=torch.uint8, generator=g)
    else:
        x = (torch.randn(rows, n, generator=g) * 20 + 128).round().clamp(0, 255).to(torch.uint8)
    dq, q = [_scalar(0.05), _scalar(128, torch.uint8)], [_scalar(0.03), _scalar(120, torch.uint8)]
    constants = {0: bias, step + 1: dq[0], step + 2: dq[1], step + 3: q[0], step + 4: q[1]}
    if kind == "scale":
        constants[1] = _scalar(0.25)
    saved = elementwise.TABLE_MAX_COLUMNS, elementwise.TABLE_CHEAP_COLUMNS
    elementwise.TABLE_MAX_COLUMNS = elementwise.TABLE_CHEAP_COLUMNS = max_columns  # a table wherever it can be
    try:
        k = elementwise.Elementwise(code, {step: (rows, n)}, constants, {step: torch.uint8}, lookup=lookup)
    finally:
        elementwise.TABLE_MAX_COLUMNS, elementwise.TABLE_CHEAP_COLUMNS = saved
    if lookup and k._table is None:
        raise SystemExit(f"{kind} [{rows}, {n}]: no table")
    return k, {step: x}


def bound_call(k, inputs: dict[int, torch.Tensor]):
    y = torch.empty(k.output_size, dtype=k.output_dtype)
    bound = k.bind_reads(y.data_ptr(), {i: v.data_ptr() for i, v in inputs.items()})
    function, address = getattr(k.library, k.FUNCTION), ctypes.addressof(bound.plan)

    def call(_alive=(k, bound, inputs, y)):  # the kernel, its plan and its operands live as long as the call
        return function(address, None, 0, None)

    return call, y


CLOCKS = {"wall": time.perf_counter_ns, "thread": time.thread_time_ns}


def block_us(call, calls: int, clock=time.perf_counter_ns) -> float:
    samples = []
    for _ in range(calls):
        start = clock()
        call()
        samples.append((clock() - start) / 1e3)
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--kinds", default="scale,dq_add_q,gelu")
    parser.add_argument("--shapes", default="128x128,128x512,128x384,128x1536,128x768,128x3072")
    parser.add_argument("--x", choices=("normal", "uniform"), default="normal")
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="wall", help="thread: the calling thread's CPU time")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    default_split = transformer.set_quantized_split(NEVER)
    default_lookup = transformer.set_table_lookup(1)
    modes = {SIDES[1]: 0, SIDES[2]: 1}  # kiln_table_lookup of the table sides
    print(f"# CPU {cpu_name()}, 1 thread, {args.clock} clock, x {args.x}, {args.rounds} rounds of {args.calls} calls a side, "
          f"load {os.getloadavg()[0]:.2f} at the start\n")
    print("| kernel | rows x n | evaluated µs | table before µs | table gathered µs | gathered / before | "
          "gathered / evaluated | ns/elt (eval, before, gathered) | load |")
    print("|---|---|---|---|---|---|---|---|---|")
    for kind in args.kinds.split(","):
        for shape in args.shapes.split(","):
            rows, n = (int(v) for v in shape.split("x"))
            calls, outputs = {}, {}
            for side in SIDES:
                k, inputs = kernel(kind, rows, n, args.x, side != SIDES[0], max_columns=1 << 20)
                calls[side], y = bound_call(k, inputs)
                transformer.set_table_lookup(modes.get(side, 1))
                calls[side]()
                outputs[side] = y.clone()
            if any(not torch.equal(outputs[side], outputs[SIDES[0]]) for side in SIDES):
                raise SystemExit(f"{kind} [{rows}, {n}]: a side's output differs from the evaluated one's")
            load = os.getloadavg()[0]
            times: dict[str, list[float]] = {side: [] for side in SIDES}
            for r in range(args.rounds):
                order = SIDES[r % 3:] + SIDES[:r % 3]
                for side in order:
                    transformer.set_table_lookup(modes.get(side, 1))
                    times[side].append(block_us(calls[side], args.calls, CLOCKS[args.clock]))
            med = {side: statistics.median(t) for side, t in times.items()}
            vs_before = [c / b for c, b in zip(times[SIDES[2]], times[SIDES[1]])]
            vs_eval = [c / e for c, e in zip(times[SIDES[2]], times[SIDES[0]])]
            per = ", ".join(f"{1e3 * med[s] / (rows * n):.2f}" for s in SIDES)
            print(f"| {kind} | {rows} x {n} | {med[SIDES[0]]:.1f} | {med[SIDES[1]]:.1f} | {med[SIDES[2]]:.1f} | "
                  f"**{statistics.median(vs_before):.2f}** ({min(vs_before):.2f}-{max(vs_before):.2f}) | "
                  f"**{statistics.median(vs_eval):.2f}** ({min(vs_eval):.2f}-{max(vs_eval):.2f}) | {per} | "
                  f"{load:.1f}-{os.getloadavg()[0]:.1f} |", flush=True)
    transformer.set_quantized_split(default_split)
    transformer.set_table_lookup(default_lookup)


if __name__ == "__main__":
    main()
