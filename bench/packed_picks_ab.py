"""A zoo model as the builder tunes it beside the same model with every GEMM pinned to one tactic (kiln_packed,
onednn_direct), and onnxruntime, in one process: whether the tuner's GEMM picks are the faster ones.

    python bench/packed_picks_ab.py [--models convnext_tiny] [--threads 2] [--realtime] [--build-realtime] [--avx2]
                                    [--tuned-only]

Why: on a loaded 2-vCPU Zen 4 the builds picked cpu.gemm.kiln_packed for most of ConvNeXt-tiny's 11 GEMMs where the
engine with every GEMM on cpu.gemm.onednn_direct ran faster (bench/results/small-zen4-2026-12-06.md). Each engine is
a fresh build (no timing cache); the pinned ones allow one GEMM tactic (BuildConfig.tactics: every other tactic
name, the other cpu.gemm.* left out). The tuned build's GEMM picks and its in-context stage are printed. Outputs are
checked against onnxruntime; then interleaved rounds of blocks (lstm_engine.blocks), wall clock; `--realtime`: the
rounds at SCHED_FIFO (root), `--build-realtime`: the tuned build too (the tuner then times by the wall clock,
cpu_clock.py's has_cores). `--base REV`: also the kiln_packed engine on gemm.c as it was at REV (bench/packed_small_k.py's
base_library, loaded beside the working tree's): the A/B of a kernel change in the network (`--base-rows`: at the
whole-K row rule of before too).
"""

from __future__ import annotations

import argparse
import os
from contextlib import nullcontext
import statistics
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
if "--avx2" in sys.argv:  # before torch, onnxruntime or kiln read cpuid (bench/zoo_avx2.py's caps)
    import cpuid_avx2  # noqa: E402  bench/cpuid_avx2.py: MLAS too sees an AVX2-only CPU

    cpuid_avx2.enable()
    os.environ["KILN_CPU_ISA"] = "avx2"


import kiln  # noqa: E402
from kiln import zoo  # noqa: E402
from kiln.builder.timing_cache import cpu_name  # noqa: E402
from kiln.tactics import registry  # noqa: E402
from lstm_engine import realtime  # noqa: E402
from relayout_alias_ab import rounds_against_onnxruntime  # noqa: E402  bench/relayout_alias_ab.py

PINNED = ("cpu.gemm.kiln_packed", "cpu.gemm.onednn_direct")


def only_gemm(tactic: str) -> list[str]:
    """Every CPU tactic name but the GEMM tactics other than `tactic`."""
    return [name for name in registry.all_tactics("cpu") if not name.startswith("cpu.gemm.") or name == tactic]


def gemm_picks(engine) -> str:
    layers = (engine.plan.header.get("tactics") or {}).get("layers", {})
    picks = Counter(v["tactic"] for v in layers.values() if v["tactic"].startswith("cpu.gemm."))
    return ", ".join(f"{n} {t.removeprefix('cpu.gemm.')}" for t, n in sorted(picks.items()))


def forms(engine) -> str:
    """Runs of each form over the engine's segments that choose one (kiln/kernels/cpu/form_choice.py)."""
    from kiln.kernels.cpu.form_choice import PARALLEL, SERIAL

    choosers = [s.chooser for s in engine.program.segments if getattr(s, "chooser", None) is not None]
    if not choosers:
        return "one form"
    return f"{sum(c.runs[PARALLEL] for c in choosers)} / {sum(c.runs[SERIAL] for c in choosers)}"


def measure(name: str, args) -> list[str]:
    import torch

    torch.set_num_threads(args.threads)
    exported = zoo.export(name)
    feeds = exported.inputs()
    with realtime(args.build_realtime):
        tuned = kiln.build(str(exported.path))
    engines = {"kiln, tuned": tuned}
    for tactic in () if args.tuned_only else PINNED:
        engines[f"kiln, GEMMs on {tactic.removeprefix('cpu.gemm.')}"] = kiln.build(str(exported.path),
                                                                                 tactics=only_gemm(tactic))
    if args.base:  # kiln's GEMM as gemm.c was at args.base, for that engine's build and load (its plans' library)
        from unittest import mock

        from kiln.kernels.cpu import gemm_native
        from packed_small_k import base_library

        lib, sha = base_library(args.base)
        # --base-rows: the base's plans at the whole-K / K-blocked switch of before the 8x48 tile's own (every tile at
        # WHOLE_K_ROW_BLOCKS), set as each layer is made
        rows = mock.patch.dict(gemm_native.WHOLE_K_ROW_BLOCKS_OF, {}, clear=True) if args.base_rows else nullcontext()
        with mock.patch.dict(gemm_native._LOADED, {False: lib}), rows:
            engines[f"kiln, GEMMs on kiln_packed, gemm.c at {sha}"] = kiln.build(
                str(exported.path), tactics=only_gemm("cpu.gemm.kiln_packed"))
    times, errors, load = rounds_against_onnxruntime(exported, feeds, engines, args)
    in_context = (tuned.plan.header.get("tactics") or {}).get("in_context", {})
    lines = [f"### {name}, {cpu_name()}, {args.threads} thread(s), wall ms, {args.rounds} rounds of {args.runs}"
             f"{', SCHED_FIFO' if args.realtime else ''}, tuned build {'at SCHED_FIFO' if args.build_realtime else 'as is'}"
             f", 1-min load {load:.2f} -> {os.getloadavg()[0]:.2f}", "",
             f"tuned build's in-context stage: { {k: v for k, v in in_context.items() if k != 'layers'} }", "",
             "| runner | GEMM tactics | segment runs (parallel / serial form) | ms | / onnxruntime | by round "
             "| max err vs ort |", "|---|---|---|---|---|---|---|"]
    for label, values in times.items():
        ratios = [a / o for a, o in zip(values, times["onnxruntime"])]
        picks = gemm_picks(engines[label]) if label in engines else ""
        error = f"{errors[label]:.1e}" if label in errors else ""
        lines.append(f"| {label} | {picks} | {forms(engines[label]) if label in engines else ''} "
                     f"| {statistics.median(values):.3f} | {statistics.median(ratios):.3f} | "
                     f"{', '.join(f'{q:.2f}' for q in ratios)} | {error} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="convnext_tiny")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--runs", type=int, default=100, help="timed calls per block")
    ap.add_argument("--realtime", action="store_true", help="time the rounds at SCHED_FIFO priority (root)")
    ap.add_argument("--build-realtime", action="store_true", help="build the tuned engine at SCHED_FIFO too")
    ap.add_argument("--base", default="", help="also every GEMM on kiln_packed with gemm.c as at this git revision")
    ap.add_argument("--base-rows", action="store_true",
                    help="the base engine's layers switch to the K-blocked loop past WHOLE_K_ROW_BLOCKS row blocks on "
                    "every tile (gemm_native's rule before WHOLE_K_ROW_BLOCKS_OF)")
    ap.add_argument("--avx2", action="store_true",
                    help="every library capped to AVX2 (bench/zoo_avx2.py's caps: KILN_CPU_ISA, cpuid masked for MLAS)")
    ap.add_argument("--tuned-only", action="store_true", help="no engines with every GEMM pinned to one tactic")
    args = ap.parse_args()
    if args.avx2:
        from kiln.kernels.cpu import cpu_features

        cpu_features.cap_libraries()  # oneDNN (and MKL, ATen) told before their first kernel
    for name in args.models.split(","):
        print("\n".join(measure(name.strip(), args)) + "\n", flush=True)


if __name__ == "__main__":
    main()
