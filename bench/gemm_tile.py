"""One microkernel of kiln's GEMM (kiln/kernels/cpu/gemm.c) alone, A, B and C in L1/L2, against the same tile as
gemm.c was at a git revision: the A/B of a tile change without the memory system and the driver around it.

    python bench/gemm_tile.py [--base REV] [--tile avx2] [--rounds 7] [--cases 256:0,256:gelu,768:gelu]

Why: on the shared 2-vCPU machine the GEMM-level A/Bs (bench/packed_small_k.py) spread 0.7-1.3 by round at a load of
10-16, which hides a change of a few percent in the tile; a tile running on its own L1/L2-resident operands, timed by
its thread's CPU time, reads within ~1%. Each library is gemm.c (+ pool.c) compiled into a small C driver with the
flags kiln builds with (native_loop.compile_flags: `--tile avx2` under the AVX2 cap, x86-64-v3, as KILN_CPU_ISA=avx2
builds it). A case is `kb:epilogue`: the tile's full rows x full panel over kb steps of K (B kb x NR floats, in L1 up
to 32 KB, else L2), epilogue none or gelu (KILN_TILE_GELU). Per round, each library runs each case (best of 5 passes of
~20 ms); the table gives the median over rounds, % of one core's FMA peak (bench/gemm.py's chains) and the ratio to
the base by round.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

ROOT = Path(__file__).resolve().parents[1]
CPU = ROOT / "kiln" / "kernels" / "cpu"
TILES = {"avx2": ("avx2_direct", 6, 16), "avx512": ("avx512_8x48_direct", 8, 48)}  # function, rows, columns

DRIVER = r"""
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include "source.c"
static double now(void) { struct timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
/* argv: kb flags reps -> seconds per call, best of 5 passes */
int main(int argc, char **argv) {
    const long kb = atol(argv[1]); const int flags = atoi(argv[2]), reps = atoi(argv[3]);
    float *a = aligned_alloc(64, MR * kb * 4 + 64), *b = aligned_alloc(64, kb * NR * 4 + 64), *c = aligned_alloc(64, MR * NR * 4);
    for (long i = 0; i < MR * kb; ++i) a[i] = 1e-3f * (float)(i % 7);
    for (long i = 0; i < kb * NR; ++i) b[i] = 1e-3f * (float)(i % 5);
    double best = 1e9;
    for (int r = 0; r < 5; ++r) {
        const double t0 = now();
        for (int i = 0; i < reps; ++i) FN(MR, kb, a, kb, b, c, NR, NR, flags, NULL);
        const double t = now() - t0;
        if (t < best) best = t;
    }
    printf("%.9g %g\n", best / reps, (double)c[0]);
    return 0;
}
"""


def source_at(rev: str) -> str:
    """pool.c + gemm.c at `rev` ('' : the working tree), as kiln concatenates them (pool.c in front)."""
    if not rev:
        return "\n".join((CPU / name).read_text() for name in ("pool.c", "gemm.c"))
    return "\n".join(subprocess.run(["git", "show", f"{rev}:kiln/kernels/cpu/{name}"], cwd=ROOT, capture_output=True,
                                    text=True, check=True).stdout for name in ("pool.c", "gemm.c"))


def build(folder: Path, source: str, tile: str) -> Path:
    from kiln.kernels.cpu import native_loop

    fn, mr, nr = TILES[tile]
    (folder / "source.c").write_text(source)
    (folder / "driver.c").write_text(DRIVER)
    flags = list(native_loop.compile_flags()[0])
    if tile == "avx2" and native_loop.AVX2_DEFINE not in flags:  # the AVX2 cap's build
        flags = [f for f in flags if not f.startswith("-march")] + ["-march=x86-64-v3", "-mtune=native",
                                                                     native_loop.AVX2_DEFINE]
    out = folder / "tile"
    subprocess.run([native_loop.find_compiler(), *flags, f"-I{CPU}", f"-DFN={fn}", f"-DMR={mr}", f"-DNR={nr}",
                    "-o", str(out), str(folder / "driver.c"), "-lm"], check=True, capture_output=True, text=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="HEAD", help="git revision of the base tile (default HEAD)")
    ap.add_argument("--tile", choices=sorted(TILES), default="avx2")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--cases", default="256:none,256:gelu,768:none,768:gelu")
    args = ap.parse_args()
    from gemm import cpu_facts, measured_peak  # noqa: E402  bench/gemm.py

    cases = []
    for part in args.cases.split(","):
        kb, _, epilogue = part.partition(":")
        if epilogue not in ("none", "gelu"):
            ap.error(f"{part}: epilogue none or gelu")
        cases.append((int(kb), epilogue))
    _, mr, nr = TILES[args.tile]
    name, _, per_cycle = cpu_facts()
    peak = measured_peak(1, per_cycle, True)
    with tempfile.TemporaryDirectory() as tmp:
        libs = {}
        for label, rev in ((f"at {args.base}", args.base), ("working tree", "")):
            folder = Path(tmp) / label.replace(" ", "_")
            folder.mkdir()
            libs[label] = build(folder, source_at(rev), args.tile)
        times = {(label, case): [] for label in libs for case in cases}
        for r in range(args.rounds):
            labels = list(libs)[r % 2:] + list(libs)[:r % 2]
            for case in cases:
                kb, epilogue = case
                reps = max(10, int(0.02 * peak * 1e9 / (2 * mr * nr * kb)))
                for label in labels:
                    done = subprocess.run([str(libs[label]), str(kb), "2" if epilogue == "gelu" else "0", str(reps)],
                                          capture_output=True, text=True, check=True)
                    times[(label, case)].append(float(done.stdout.split()[0]))
    base = f"at {args.base}"
    print(f"# {name}, tile {args.tile} {mr}x{nr}, one core's FMA peak {peak:.0f} GFLOP/s (thread CPU time), "
          f"{args.rounds} rounds; load {os.getloadavg()[0]:.2f}")
    print("| kb | epilogue | tile | us per call | % peak | / base by round |\n|---|---|---|---|---|---|")
    for case in cases:
        kb, epilogue = case
        for label in libs:
            t = statistics.median(times[(label, case)])
            ratios = ", ".join(f"{a / b:.3f}" for a, b in zip(times[(label, case)], times[(base, case)]))
            print(f"| {kb} | {epilogue} | {label} | {1e6 * t:.2f} | {100 * 2 * mr * nr * kb / t / 1e9 / peak:.1f}% | "
                  f"{ratios} |")


if __name__ == "__main__":
    main()
