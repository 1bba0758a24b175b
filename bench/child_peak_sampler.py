"""Where a build peaks as bench/memory_ab.py measures it: bench/memory.py's build child, run the way memory_ab runs it
(`python -c`, output captured, PYTHONPATH the checkout), with a 5 ms VmRSS sampler prepended (the main thread's stack
at each new maximum; the frame let go at once). Prints the child's JSON line, the sampled maximum and its stack.

    TMPDIR=/dev/shm python bench/child_peak_sampler.py [CHECKOUT] [MODEL]      # CHECKOUT: this one by default

Why: builds in memory_ab's children land at 335-345 MiB for ResNet-50 where the same code run in-process by the other
benches lands at 280-320 (mem7, mem8). KILN_HUGE_PAGES=0 in the environment takes the child to ~304.
Results: bench/results/mem8-2026-12-06.md.
"""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import memory  # noqa: E402  bench/memory.py

SAMPLER = '''
import sys, threading, time, traceback, atexit
def _status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
_best, _start = [0, None], [None]
def _sample():
    main = threading.main_thread().ident
    while True:
        if _start[0] is not None:
            rss = _status("VmRSS") - _start[0]
            if rss > _best[0] + (1 << 20):
                frame = sys._current_frames().get(main)
                stack = traceback.extract_stack(frame)
                del frame  # held, it would keep the sampled stage's locals alive
                huge = sum(int(l.split()[1]) for l in open("/proc/self/smaps_rollup") if l.startswith("AnonHugePages"))
                _best[:] = [rss, [f"AnonHugePages {huge >> 10} MiB"] +
                            [f"{f.filename.split('kiln/')[-1]}:{f.lineno} {f.name}" for f in stack][-10:]]
        time.sleep(0.005)
threading.Thread(target=_sample, daemon=True).start()
import kiln.runtime.rss as _rss
_first = _rss.PeakMemory.start
def _start_hook():
    peak = _first()
    if _start[0] is None:  # the child's own measure begins: the sampler counts from there
        _start[0] = peak.start_rss
    return peak
_rss.PeakMemory.start = staticmethod(_start_hook)
atexit.register(lambda: print("SAMPLED", _best[0] >> 20, "|".join(_best[1] or []), file=sys.stderr))
'''


def main() -> None:
    root = Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else ROOT
    model = sys.argv[2] if len(sys.argv) > 2 else "resnet50"
    done = subprocess.run([sys.executable, "-c", SAMPLER + memory._CHILD, "build", model,
                           os.path.join(os.environ.get("TMPDIR", "/tmp"), f"{model}-sampled.kiln"), "1", "2"],
                          capture_output=True, text=True, cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
    print(done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-2000:])
    for line in done.stderr.splitlines():
        if line.startswith("SAMPLED"):
            _, peak, stack = line.split(" ", 2)
            print(f"sampled max +{peak} MiB at:")
            print("\n".join("   " + frame for frame in stack.split("|")))


if __name__ == "__main__":
    main()
