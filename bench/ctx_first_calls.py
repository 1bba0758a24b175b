"""A second execution context's first calls (issue 10/14): at a shape the first context has run, and at a new one.

Each CPU context runs a lane of its own (kiln/runtime/engine.py CpuLane: its native segments bound anew over an
arena of its own, Program.with_own_arena). Before session 25's h-ctx2, a second lane's segments started without
the first's plan rewrite, traced walk, rules and grown template, so its first call at every shape paid the view's
whole first-call cost again (what the load's view job had done for the first lane only). One process per run
(--no-share: the sharing off, Segment.SHARE_VIEWS False), engine built in-process from the zoo's bert_tiny with
the tests' profile (1x1 / 4x32 / 4x48), background jobs waited for, 1 thread, KILN_PAD_FIRST_CALLS=0 (every new
shape binds). Thread CPU µs of each call (the first, then the median of 3 repeats); context creation's µs beside.
Session 26 (h-ctx3): --no-ahead (views_ahead.TWINS_AHEAD and Segment.SHARE_ARENA False: a new lane adopts its origin's
grown templates at its creation, in memory of their own, and binds its views at its first calls: the tree before) against the lane readied on the background thread
(views_ahead.twins_job: the adoption, the views at the first context's shapes and their direct-run records); and each
extra context's memory: RSS (VmRSS) growth at creation + its job, and after its calls; its arena's address space;
its grown templates' bytes (touched at adoption). --rounds N alternates processes (A = --no-ahead, B = ahead) and
prints the medians.
Session 27 (h-lanemem): --own-checks gives each context a checked-signatures dict of its own (the tree before: a second
context's first call checked its signature again), against the engine's, shared (Engine.checked_signatures);
--rounds N --a own-checks alternates A = --own-checks and B. --interleaved N: in one process, N rounds of two fresh
contexts each (A: checks of its own, B: the engine's), their order alternating, each one's first call at 2x7 (a
shape context 1 ran, its view and record made by the lane's job) and its repeat, a run of context 1 at 3x20 before
each call (caches as a server's would be); medians.

    python bench/ctx_first_calls.py [--no-share] [--no-ahead] [--own-checks] [--label X]
                                    [--rounds N [--a no-ahead|own-checks]]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ["KILN_PAD_FIRST_CALLS"] = "0"

import numpy as np  # noqa: E402
import torch  # noqa: E402

import kiln  # noqa: E402
from kiln import zoo  # noqa: E402
from kiln.kernels.cpu import onednn_ahead  # noqa: E402
from kiln.runtime import native, views_ahead  # noqa: E402
from kiln.runtime.rss import status_bytes  # noqa: E402


def feeds(engine, batch: int, seq: int) -> dict:
    rng = np.random.default_rng(zlib.crc32(f"{batch}x{seq}".encode()))
    out = {}
    for b in engine.inputs:
        if "mask" in b.name:
            out[b.name] = np.ones((batch, seq), np.int64)
        else:
            out[b.name] = rng.integers(0, 100, (batch, seq), dtype=np.int64)
    return out


def timed(context, f) -> float:
    t0 = time.thread_time_ns()
    context.run(f)
    return (time.thread_time_ns() - t0) / 1e3


def first_and_repeat(context, engine, shape) -> tuple[float, float]:
    f = feeds(engine, *shape)
    first = timed(context, f)
    return first, statistics.median(timed(context, f) for _ in range(3))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-share", action="store_true")
    ap.add_argument("--no-ahead", action="store_true")
    ap.add_argument("--own-checks", action="store_true")
    ap.add_argument("--label", default="")
    ap.add_argument("--rounds", type=int, default=0)
    ap.add_argument("--a", choices=("no-ahead", "own-checks"), default="no-ahead")
    ap.add_argument("--interleaved", type=int, default=0)
    args = ap.parse_args()
    if args.interleaved:
        return interleaved(args.interleaved)
    if args.rounds:
        return alternate(args.rounds, args.a)
    if args.no_share:
        native.Segment.SHARE_VIEWS = False
    if args.no_ahead:
        views_ahead.TWINS_AHEAD = False
        native.Segment.SHARE_ARENA = False
    torch.set_num_threads(1)
    exported = zoo.export("bert_tiny", dynamic=True)
    engine = kiln.build(str(exported.path), profiles=[{"input_ids": "1x1,4x32,4x48"}])
    assert onednn_ahead.AHEAD.wait(timeout=120)
    c1 = engine.create_execution_context()
    if args.own_checks:
        c1._checked = {}
    rows = []
    for shape in [(2, 7), (3, 20)]:
        rows.append(("ctx1 first ever", shape, *first_and_repeat(c1, engine, shape)))
    rss0 = status_bytes("VmRSS")
    t0 = time.thread_time_ns()
    c2 = engine.create_execution_context()
    made_us = (time.thread_time_ns() - t0) / 1e3
    if args.own_checks:
        c2._checked = {}
    assert onednn_ahead.AHEAD.wait(timeout=120)
    rss_made = status_bytes("VmRSS") - rss0
    for shape in [(2, 7), (3, 20)]:
        rows.append(("ctx2, seen by ctx1", shape, *first_and_repeat(c2, engine, shape)))
    for shape in [(1, 11), (4, 41)]:
        rows.append(("ctx2 first ever", shape, *first_and_repeat(c2, engine, shape)))
    for shape in [(1, 11), (4, 41)]:
        rows.append(("ctx1, seen by ctx2", shape, *first_and_repeat(c1, engine, shape)))
    for shape in [(2, 7), (3, 20)]:  # a seen shape's call after other shapes ran: what a warm engine's call costs
        rows.append(("ctx1, its own again", shape, *first_and_repeat(c1, engine, shape)))
    rss_called = status_bytes("VmRSS") - rss0
    label = args.label or ("sharing off" if args.no_share else "no ahead" if args.no_ahead else
                           "own checks" if args.own_checks else "ahead")
    print(f"# {label}; load {open('/proc/loadavg').read().split()[:3]}")
    grown = sum(b.numel() * b.element_size() for s in c2.program.segments if s._grown is not None
                for b in s._grown.buffers)
    arena = c2.program.segments[0].arena
    print(f"ctx2 creation: {made_us:.0f} us; its grown templates' memory after its calls: {grown / 2**20:.2f} MiB")
    print(f"ctx2 memory: arena address space {(arena.planned if arena else 0) / 2**20:.2f} MiB; RSS +"
          f"{rss_made / 2**20:.2f} MiB made (and its job), +{rss_called / 2**20:.2f} MiB after its calls")
    print("| call | shape | first us | repeat us | first - repeat |")
    print("|---|---|---|---|---|")
    for what, shape, first, rep in rows:
        print(f"| {what} | {shape[0]}x{shape[1]} | {first:.0f} | {rep:.0f} | {first - rep:.0f} |")


def interleaved(rounds: int) -> None:
    """A second context's very first call, own checks (A) against the engine's (B), fresh contexts in one process."""
    torch.set_num_threads(1)
    exported = zoo.export("bert_tiny", dynamic=True)
    engine = kiln.build(str(exported.path), profiles=[{"input_ids": "1x1,4x32,4x48"}])
    assert onednn_ahead.AHEAD.wait(timeout=120)
    c1 = engine.create_execution_context()
    for shape in [(2, 7), (3, 20), (1, 11)]:
        first_and_repeat(c1, engine, shape)
    between, seen = feeds(engine, 3, 20), feeds(engine, 2, 7)
    got: dict[str, dict[str, list[float]]] = {"A": {}, "B": {}}
    kept = []  # every context lives on: each round's are new lanes
    for r in range(rounds):
        made = {}
        for side in ("A", "B") if r % 2 == 0 else ("B", "A"):
            made[side] = engine.create_execution_context()
            if side == "A":
                made[side]._checked = {}
        kept += made.values()
        assert onednn_ahead.AHEAD.wait(timeout=120)
        for side, context in made.items():
            c1.run(between)
            first = timed(context, seen)
            c1.run(between)
            repeat = timed(context, seen)
            c1.run(between)
            ctx1 = timed(c1, seen)
            for key, value in (("first", first), ("repeat", repeat), ("first - repeat", first - repeat),
                               ("ctx1's seen call", ctx1)):
                got[side].setdefault(key, []).append(value)
    print(f"# bert_tiny, {rounds} rounds, load {open('/proc/loadavg').read().split()[:3]}")
    print("| µs (median) | A (own checks) | B (the engine's) |")
    print("|---|---|---|")
    for key in got["A"]:
        print(f"| {key} | {statistics.median(got['A'][key]):.1f} | {statistics.median(got['B'][key]):.1f} |")


def alternate(rounds: int, a: str = "no-ahead") -> None:
    """A (--no-ahead, or --own-checks) and B (this tree) in alternating processes, `rounds` each; the medians of each
    row's first - repeat and of the creation, with the load beside."""
    import re
    import subprocess
    got: dict[str, dict[str, list[float]]] = {"A": {}, "B": {}}
    loads = []
    for _ in range(rounds):
        for side, flags in (("A", [f"--{a}"]), ("B", [])):
            out = subprocess.run([sys.executable, __file__, *flags], capture_output=True, text=True, check=True).stdout
            loads.append(open("/proc/loadavg").read().split()[0])
            rows = got[side]
            rows.setdefault("creation", []).append(float(re.search(r"creation: (\d+) us", out).group(1)))
            for key, pattern in (("rss made", r"RSS \+([\d.]+) MiB made"), ("rss called", r"\+([\d.]+) MiB after")):
                rows.setdefault(key, []).append(float(re.search(pattern, out).group(1)))
            for line in out.splitlines():
                cells = [c.strip() for c in line.strip("|").split("|")]
                if len(cells) == 5 and cells[2].isdigit():
                    rows.setdefault(f"{cells[0]} {cells[1]} first", []).append(float(cells[2]))
                    rows.setdefault(f"{cells[0]} {cells[1]} first-repeat", []).append(float(cells[4]))
    print(f"# {rounds} rounds, loads after each process: {' '.join(loads)}")
    print(f"| row | A ({a}) | B |")
    print("|---|---|---|")
    for key in got["A"]:
        print(f"| {key} | {statistics.median(got['A'][key]):.2f} | {statistics.median(got['B'][key]):.2f} |")


if __name__ == "__main__":
    main()
