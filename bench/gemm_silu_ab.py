"""kiln's GEMM SiLU and SwiGLU epilogues (kiln/kernels/cpu/gemm.c: activate's ACT_SILU, swiglu_epilogue) alone,
on one C tile in L1, against the same code at a git revision (issue 11: the epilogues moved onto exp_poly.h's
KILN_VSILU). The tile's GEMM is left out: bench/gemm_tile.py times the microkernel, and these epilogues run after it
on the tile while it is in L1, so their cost is what changed.

    python bench/gemm_silu_ab.py [--base REV] [--rounds 9]

Each library is pool.c + gemm.c compiled into a small C driver with kiln's flags, for this CPU (-march=native: the
AVX-512 path where the CPU has it) and under the AVX2 cap (x86-64-v3 + KILN_MAX_ISA_AVX2, as KILN_CPU_ISA=avx2
builds it). A case is the epilogue over one tile's rows: SiLU of MR rows of NR columns (activate, as epilogue()
calls it), SwiGLU of MR rows of an NR-column panel into NR/2 outputs with the bias (swiglu_epilogue). The tiles:
8x48 for the native build (AVX-512's linear kernel; SwiGLU's half panel is 24 columns, 16 + a masked 8) and 6x16
under the cap; also 14x32. The input is refreshed from a copy before each call (SiLU is in place; repeated it would
walk into subnormals), in both libraries alike. Per round, each library runs each case (best of 5 passes of ~20 ms
of thread CPU time), the order alternating by round; the table gives medians over rounds, ns per element and the
ratio to the base by round.
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

from gemm_tile import CPU, source_at  # noqa: E402  bench/gemm_tile.py

DRIVER = r"""
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include "source.c"
static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}
/* argv: case (silu | swiglu) MR NR reps -> seconds per call, best of 5 passes */
int main(int argc, char **argv) {
    const int swiglu = argv[1][1] == 'w', mr = atoi(argv[2]), nr = atoi(argv[3]), reps = atoi(argv[4]);
    float *src = aligned_alloc(64, 64 * 64 * 4), *c = aligned_alloc(64, 64 * 64 * 4);
    float *y = aligned_alloc(64, 64 * 64 * 4);
    float *bias = aligned_alloc(64, 64 * 4);
    unsigned s = 12345u;
    for (int i = 0; i < 64 * 64; ++i) {  /* uniform in [-8, 8): SiLU's curve and past it */
        s = s * 1664525u + 1013904223u;
        src[i] = ((float)(s >> 8) / 16777216.0f - 0.5f) * 16.0f;
    }
    for (int i = 0; i < 64; ++i) bias[i] = 0.01f * (float)(i % 9);
    kiln_gemm_plan p;
    memset(&p, 0, sizeof p);
    p.N = nr; p.out_n = nr / 2; p.bias = bias; p.activation = swiglu ? ACT_SWIGLU : ACT_SILU;
    double best = 1e9, sum = 0.0;
    for (int r = 0; r < 5; ++r) {
        const double t0 = now();
        for (int i = 0; i < reps; ++i) {
            memcpy(c, src, (size_t)mr * nr * sizeof(float));
            if (swiglu) swiglu_epilogue(&p, nr, c, nr, y, NULL, 0, 0, mr);
            else for (int row = 0; row < mr; ++row) activate(c + row * nr, nr, ACT_SILU, 0.0f, 0.0f);
            __asm__ volatile("" ::: "memory");
        }
        const double t = now() - t0;
        if (t < best) best = t;
    }
    for (int i = 0; i < mr * nr; ++i) sum += swiglu ? (i < mr * nr / 2 ? y[i] : 0.0f) : c[i];
    printf("%.9g %g\n", best / reps, sum);
    return 0;
}
"""

BUILDS = {"native": ((8, 48), (14, 32)), "avx2 cap": ((6, 16), (14, 32))}


def build(folder: Path, source: str, isa: str) -> Path:
    from kiln.kernels.cpu import native_loop

    (folder / "source.c").write_text(source)
    (folder / "driver.c").write_text(DRIVER)
    flags = [f for f in native_loop.FLAGS[0] if f != native_loop.AVX2_DEFINE]
    if isa == "avx2 cap":
        flags = [f for f in flags if not f.startswith("-march")] + ["-march=x86-64-v3", "-mtune=native",
                                                                     native_loop.AVX2_DEFINE]
    out = folder / "epilogue"
    subprocess.run([native_loop.find_compiler(), *flags, f"-I{CPU}", "-o", str(out), str(folder / "driver.c"), "-lm"],
                   check=True, capture_output=True, text=True)
    return out


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="HEAD", help="git revision of the base gemm.c (default HEAD)")
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    load0 = Path("/proc/loadavg").read_text().split()[:3]
    with tempfile.TemporaryDirectory() as tmp:
        libs = {}
        for isa in BUILDS:
            for label, rev in ((f"at {args.base}", args.base), ("working tree", "")):
                folder = Path(tmp) / f"{isa}_{label}".replace(" ", "_")
                folder.mkdir()
                libs[(isa, label)] = build(folder, source_at(rev), isa)
        labels = (f"at {args.base}", "working tree")
        cases = [(isa, kind, mr, nr) for isa, tiles in BUILDS.items() for mr, nr in tiles
                 for kind in ("silu", "swiglu")]
        times = {(case, label): [] for case in cases for label in labels}
        sums = {}
        for r in range(args.rounds):
            order = labels[r % 2:] + labels[:r % 2]
            for case in cases:
                isa, kind, mr, nr = case
                reps = max(100, int(0.02 / (mr * nr * 0.5e-9)))
                for label in order:
                    done = subprocess.run([str(libs[(isa, label)]), kind, str(mr), str(nr), str(reps)],
                                          capture_output=True, text=True, check=True)
                    t, total = done.stdout.split()
                    times[(case, label)].append(float(t))
                    sums[(case, label)] = float(total)
    load1 = Path("/proc/loadavg").read_text().split()[:3]
    print(f"# {cpu_name()}, {args.rounds} rounds, thread CPU time; load {' '.join(load0)} before, "
          f"{' '.join(load1)} after")
    print("| build | epilogue | tile | gemm.c | ns per call | ns per output | / base by round (median) | checksum |")
    print("|---|---|---|---|---|---|---|---|")
    for case in cases:
        isa, kind, mr, nr = case
        outputs = mr * (nr // 2 if kind == "swiglu" else nr)
        base = times[(case, labels[0])]
        for label in labels:
            t = times[(case, label)]
            ratios = [a / b for a, b in zip(t, base)]
            print(f"| {isa} | {kind} | {mr}x{nr} | {label} | {1e9 * statistics.median(t):.1f} | "
                  f"{1e9 * statistics.median(t) / outputs:.3f} | {statistics.median(ratios):.3f} "
                  f"({min(ratios):.2f}-{max(ratios):.2f}) | {sums[(case, label)]:.6g} |")


if __name__ == "__main__":
    main()
