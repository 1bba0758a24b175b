"""A second execution context on a saved engine (BERT-base): its creation, its memory, its first calls (issue 10/14).

Each CPU context runs a lane of its own (kiln/runtime/engine.py CpuLane): its native segments bound over an arena of
its own, and the engine's grown view template adopted as a template of its own (Segment._adopt). A = the tree before
session 26's h-ctx3 (--before: views_ahead.TWINS_AHEAD and Segment.SHARE_ARENA off: the adoption at creation, the
grown template in memory of its own, the views bound at the first calls); B = the lane readied on the background
thread (views_ahead.twins_job) and its grown template over the lane's arena. One process per run: the engine loaded,
its jobs waited for, 1 thread, KILN_PAD_FIRST_CALLS=0; context 1 runs 2x7, 3x20 and the profile's opt shape; context
2 is made (thread CPU µs; RSS growth right after and once its job is done) and runs the same shapes (thread CPU µs
of the first call and the median of 3 repeats), then RSS growth again. Context 1's calls' RSS growth too: in A the
engine's own grown template (touched at load) and its planned arena are two memories, in B one (Segment._grow_arena). --rounds N alternates A and B processes and
prints medians, with the load.

Session 27 (h-lanemem): a new lane's job touches only the pages its origin's runs reached (Segment.adopt_views: the
planned plan where the origin ran it, each view's values at the origin's latest sizes), not its adopted grown
template whole. --whole: that off (Segment.TOUCH_ADOPTED_WHOLE: the template zeroed at its adoption, session 26's B);
--small: context 1 runs 2x7 and 3x20 only (not the profile's opt shape); after its seen shapes context 2 runs a shape
new to both past the planned arena (3x250: pages the job did not touch, faulted in the loop). --rounds N --a whole
alternates A = --whole and B = this tree (--a before: A = --before, as session 26 ran it).

    python bench/ctx_memory.py ENGINE.kiln [--before | --whole] [--small] [--rounds N [--a whole|before]]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ["KILN_PAD_FIRST_CALLS"] = "0"

import torch  # noqa: E402

import kiln  # noqa: E402
from bench.ctx_first_calls import feeds, first_and_repeat  # noqa: E402
from kiln.kernels.cpu import onednn_ahead  # noqa: E402
from kiln.runtime import native, views_ahead  # noqa: E402
from kiln.runtime.rss import status_bytes  # noqa: E402

MIB = 2 ** 20


def one(path: str, before: bool, whole: bool = False, small: bool = False) -> None:
    if before:
        views_ahead.TWINS_AHEAD = False
        native.Segment.SHARE_ARENA = False
    native.Segment.TOUCH_ADOPTED_WHOLE = before or whole  # B: the lean touch (kiln's default is the whole touch)
    torch.set_num_threads(1)
    engine = kiln.load(path)
    assert onednn_ahead.AHEAD.wait(timeout=600)
    opt = tuple(engine.profiles[0].inputs[engine.inputs[0].name].opt)
    shapes = [(2, 7), (3, 20)] if small else [(2, 7), (3, 20), opt]
    c1 = engine.create_execution_context()
    rss1 = status_bytes("VmRSS")
    for shape in shapes:
        first_and_repeat(c1, engine, shape)
    rss0 = status_bytes("VmRSS")
    rss_c1 = rss0 - rss1
    t0 = time.thread_time_ns()
    c2 = engine.create_execution_context()
    made_us = (time.thread_time_ns() - t0) / 1e3
    rss_made = status_bytes("VmRSS") - rss0
    assert onednn_ahead.AHEAD.wait(timeout=600)
    rss_job = status_bytes("VmRSS") - rss0
    rows = [(shape, *first_and_repeat(c2, engine, shape)) for shape in shapes]
    rss_called = status_bytes("VmRSS") - rss0
    rows.append(((3, 250), *first_and_repeat(c2, engine, (3, 250))))  # new to both, past the planned arena
    rss_new = status_bytes("VmRSS") - rss0
    twin = next(s for s in c2.program.segments if s._views)
    grown = twin._grown.planned_bytes if twin._grown is not None else 0
    own = twin._grown is not None and twin._grown.arena is None
    side = "A (before)" if before else "A (whole)" if whole else "B"
    print(f"# {side}{' small' if small else ''}; load {open('/proc/loadavg').read().split()[:3]}")
    print(f"creation: {made_us:.0f} us; RSS +{rss_made / MIB:.1f} MiB made, +{rss_job / MIB:.1f} MiB with its job, "
          f"+{rss_called / MIB:.1f} MiB after its calls, +{rss_new / MIB:.1f} MiB after 3x250; "
          f"arena {twin.arena.nbytes / MIB:.1f} MiB of address space "
          f"(planned {twin.planned_bytes / MIB:.1f}), grown template {grown / MIB:.1f} MiB "
          f"({'its own memory' if own else 'over the arena'}); ctx1's calls: RSS +{rss_c1 / MIB:.1f} MiB")
    for shape, first, rep in rows:
        print(f"| ctx2 {shape[0]}x{shape[1]} | {first:.0f} | {rep:.0f} | {first - rep:.0f} |")


def alternate(path: str, rounds: int, a: str = "before", small: bool = False) -> None:
    got: dict[str, dict[str, list[float]]] = {"A": {}, "B": {}}
    loads = []
    extra = ["--small"] if small else []
    for _ in range(rounds):
        for side, flags in (("A", [f"--{a}"]), ("B", [])):
            out = subprocess.run([sys.executable, __file__, path, *flags, *extra], capture_output=True, text=True,
                                 check=True).stdout
            loads.append(open("/proc/loadavg").read().split()[0])
            rows = got[side]
            found = re.search(r"creation: (\d+) us; RSS \+([\d.]+) MiB made, \+([\d.]+) MiB with its job, "
                              r"\+([\d.]+) MiB after", out)
            for key, value in zip(("creation us", "RSS made MiB", "RSS with job MiB", "RSS after calls MiB"),
                                  found.groups()):
                rows.setdefault(key, []).append(float(value))
            rows.setdefault("RSS after 3x250 MiB", []).append(float(re.search(r"\+([\d.]+) MiB after 3x250",
                                                                              out).group(1)))
            rows.setdefault("ctx1's calls: RSS MiB", []).append(float(re.search(r"ctx1's calls: RSS \+([\d.]+)",
                                                                                  out).group(1)))
            for line in out.splitlines():
                cells = [c.strip() for c in line.strip("|").split("|")]
                if len(cells) == 4 and cells[0].startswith("ctx2"):
                    rows.setdefault(f"{cells[0]} first us", []).append(float(cells[1]))
                    rows.setdefault(f"{cells[0]} first - repeat us", []).append(float(cells[3]))
            print(out.splitlines()[1], file=sys.stderr)
    print(f"# {rounds} rounds{' (small)' if small else ''}; loads after each process: {' '.join(loads)}")
    print(f"| row | A ({a}) | B |")
    print("|---|---|---|")
    for key in got["A"]:
        print(f"| {key} | {statistics.median(got['A'][key]):.1f} | {statistics.median(got['B'][key]):.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("engine")
    ap.add_argument("--before", action="store_true")
    ap.add_argument("--whole", action="store_true")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--rounds", type=int, default=0)
    ap.add_argument("--a", choices=("before", "whole"), default="whole")
    args = ap.parse_args()
    if args.rounds:
        alternate(args.engine, args.rounds, args.a, args.small)
    else:
        one(args.engine, args.before, args.whole, args.small)


if __name__ == "__main__":
    main()
