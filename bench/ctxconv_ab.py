"""Conv layers judged in context (kiln/builder/in_context.py, RETIMED_OPS with FusedConv): what the stage adds to a
build, whether a rebuild from the timing cache times nothing, and the engine it leaves against the one the search
chose alone, in one process.

    python bench/ctxconv_ab.py --avx2 --threads 2 --models mobilenet_v2,resnet50 --rounds 9
    python bench/ctxconv_ab.py --avx2 --threads 2 --models mobilenet_v2 --force cpu.conv.onednn_graph@576x96x1x1

--force TACTIC@OxCxKhxKw: the search's choice alone for every FusedConv layer of that weight shape made TACTIC (its
times alone as measured), in every build of the run: the case session 21's zoo met where the search took
cpu.conv.onednn_graph for MobileNetV2's three 96 -> 576 1x1 convolutions at 2 threads (0.120 ms alone against
onednn_direct's 0.209) and the engine ran 1.12x slower than with onednn_direct there; a search that does not pick it
again on a quieter machine still shows what the stage does with it.

Per model: a build with a fresh timing cache (the stage on: its seconds, layers compared, layers changed), a rebuild
from that cache (the stage's seconds there: a cache hit), and a build from the same cache with the stage off (the
choices made alone). The two engines then run in interleaved rounds (A = alone, B = in context, then B, A, ...), each
round `--runs` runs, timed by the wall clock and the process's CPU time; medians of the rounds' medians and the
per-round B / A ratios. Prints the load average beside every block.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
if "--avx2" in sys.argv:  # both sides on an AVX2-only CPU (bench/zoo_avx2.py's caps), set before any library loads
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import cpuid_avx2  # noqa: E402

    cpuid_avx2.enable()
    os.environ["KILN_CPU_ISA"] = "avx2"
import kiln  # noqa: E402
from kiln import zoo  # noqa: E402
import torch  # noqa: E402


def load() -> str:
    return Path("/proc/loadavg").read_text().split()[0]


def conv_tactics(engine) -> dict[str, int]:
    counts: dict[str, int] = {}
    for step in engine.plan.program.steps:
        if step.op_type == "FusedConv":
            counts[step.tactic or "default"] = counts.get(step.tactic or "default", 0) + 1
    return counts


def force(tactic: str, shape: str) -> None:
    """Every build's search takes `tactic` alone for the FusedConv layers whose weight is `shape` (where it was a
    candidate), as a search under load did."""
    from kiln.builder import autotune
    from kiln.tactics import registry
    from kiln.tactics.tactic import InputMeta

    want = [int(v) for v in shape.split("x")]
    tune = autotune._tune_layer

    def forced(step, record, fn, ctx, attrs, constants, *args, **kwargs):
        found, config = tune(step, record, fn, ctx, attrs, constants, *args, **kwargs)
        w = constants[1] if step.op_type == "FusedConv" and len(constants) > 1 else None
        if w is not None and list(w.shape) == want and isinstance(found.candidates.get(tactic), float):
            metas = [InputMeta.of(a, c is not None) for a, c in zip(record.args, constants)]
            found.tactic, found.time_ms = tactic, found.candidates[tactic]
            config = registry.get(tactic).configure(step, metas)
            print(f"  forced {step.name}: {tactic} alone ({found.candidates})", flush=True)
        return found, config

    autotune._tune_layer = forced


def build(path: str, cache: str, in_context: bool) -> tuple[object, float, dict]:
    start = time.perf_counter()
    engine = kiln.build(path, timing_cache=cache, in_context=in_context)
    seconds = time.perf_counter() - start
    return engine, seconds, engine.plan.header["tactics"].get("in_context", {})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="mobilenet_v2,resnet50")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--avx2", action="store_true")
    parser.add_argument("--no-ab", action="store_true", help="builds only")
    parser.add_argument("--seed-cache", default="", help="a timing cache the first build starts from (a copy): its "
                        "per-layer choices alone, e.g. a zoo run's; the stage's own entries are keyed anew")
    parser.add_argument("--force", default="", help="TACTIC@OxCxKhxKw: that weight shape's convs chosen TACTIC alone")
    args = parser.parse_args()
    if args.force:
        force(*args.force.split("@"))
    torch.set_num_threads(args.threads)
    rows = []
    for name in args.models.split(","):
        exported = zoo.export(name)
        feeds = exported.inputs()
        with tempfile.TemporaryDirectory() as tmp:
            cache = str(Path(tmp) / "tc.json")
            if args.seed_cache:
                shutil.copy(args.seed_cache, cache)
            l0 = load()
            tuned, first_s, stage = build(str(exported.path), cache, True)
            again, again_s, stage_again = build(str(exported.path), cache, True)
            alone, alone_s, _ = build(str(exported.path), cache, False)
        print(f"{name}: load {l0} -> {load()}; build {first_s:.1f} s, in-context stage {stage.get('seconds')} s, "
              f"{stage.get('layers')} layers ({stage.get('rounds')} rounds, {stage.get('stopped')}), changed "
              f"{stage.get('changed')}; rebuild {again_s:.1f} s, stage cached={stage_again.get('cached')} "
              f"{stage_again.get('seconds')} s; build with the stage off (same cache) {alone_s:.1f} s", flush=True)
        print(f"  convs in context: {conv_tactics(tuned)}; alone: {conv_tactics(alone)}", flush=True)
        same = conv_tactics(tuned) == conv_tactics(alone) and \
            [s.tactic for s in tuned.plan.program.steps] == [s.tactic for s in alone.plan.program.steps]
        if args.no_ab or same:
            rows.append((name, first_s, stage.get("seconds"), stage.get("layers"), len(stage.get("changed") or {}),
                         None, None, None, load()))
            continue
        outs = [e.run(feeds) for e in (alone, tuned)]
        err = max(float(abs(a - b).max()) for a, b in zip(outs[0].values(), outs[1].values()))
        samples = {"A": {"wall": [], "cpu": []}, "B": {"wall": [], "cpu": []}}
        la = load()
        for r in range(args.rounds):
            order = [("A", alone), ("B", tuned)] if r % 2 == 0 else [("B", tuned), ("A", alone)]
            for key, engine in order:
                for _ in range(3):
                    engine.run(feeds)
                wall, cpu = [], []
                for _ in range(args.runs):
                    w0, c0 = time.perf_counter(), time.process_time()
                    engine.run(feeds)
                    wall.append((time.perf_counter() - w0) * 1e3)
                    cpu.append((time.process_time() - c0) * 1e3)
                samples[key]["wall"].append(statistics.median(wall))
                samples[key]["cpu"].append(statistics.median(cpu))
        ratios = [b / a for a, b in zip(samples["A"]["wall"], samples["B"]["wall"])]
        a_ms, b_ms = statistics.median(samples["A"]["wall"]), statistics.median(samples["B"]["wall"])
        cpu_ratio = statistics.median(samples["B"]["cpu"]) / statistics.median(samples["A"]["cpu"])
        print(f"  A/B ({args.rounds} rounds of {args.runs} runs, load {la} -> {load()}): A (alone) {a_ms:.2f} ms, "
              f"B (in context) {b_ms:.2f} ms, B/A wall {b_ms / a_ms:.3f} (rounds {min(ratios):.2f}-{max(ratios):.2f}, "
              f"{sum(x < 1 for x in ratios)}/{len(ratios)} below 1), B/A process CPU {cpu_ratio:.3f}; "
              f"max |A-B| {err:.2g}", flush=True)
        rows.append((name, first_s, stage.get("seconds"), stage.get("layers"), len(stage.get("changed") or {}),
                     a_ms, b_ms, b_ms / a_ms, load()))
    print(f"\n{os.uname().machine}, {args.threads} threads, avx2 cap {args.avx2}")
    print("| model | build s | stage s | layers in context | changed | A alone ms | B in context ms | B/A | load |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join("-" if v is None else (f"{v:.3g}" if isinstance(v, float) else str(v)) for v in row)
              + " |")


if __name__ == "__main__":
    main()
