"""SiLU forms side by side (issue 11): bench/silu_ab.c built for this CPU (-march=native) and for AVX2
(-march=x86-64-v3), each run once: worst error against float64 by range of x, the specials, and ns an element,
the forms interleaved in one process. The load average is printed beside each build's run.

    python bench/silu_ab.py [--step 61]
"""

from __future__ import annotations

import argparse
import pathlib
import platform
import subprocess
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent


def cpu_name() -> str:
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step", type=int, default=61, help="every STEP-th float bit pattern (default 61)")
    args = parser.parse_args()
    print(f"CPU {cpu_name()}")
    with tempfile.TemporaryDirectory() as tmp:
        for march in ("native", "x86-64-v3"):
            binary = pathlib.Path(tmp) / f"silu_{march}"
            subprocess.run(["gcc", "-O3", f"-march={march}", "-I", str(ROOT / "kiln/kernels/cpu"), "-o", str(binary),
                            str(ROOT / "bench/silu_ab.c"), "-lm"], check=True)
            load = pathlib.Path("/proc/loadavg").read_text().split()[:3]
            print(f"\n-march={march}, load {' '.join(load)}")
            print(subprocess.run([str(binary), str(args.step)], check=True, capture_output=True, text=True).stdout)


if __name__ == "__main__":
    main()
