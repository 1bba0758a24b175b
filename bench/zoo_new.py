"""Models kiln was never tuned for (bench/zoo_new_models.py) beside onnxruntime, in one process (issue 11).

    python bench/zoo_new.py                                   # every model and batch, 1 thread, thread CPU time
    python bench/zoo_new.py --threads 2 --clock wall          # 2 threads, wall time (name the load)
    python bench/zoo_new.py --models unet,yolov5n@1 --profile # + kiln's and onnxruntime's per-op time
    python bench/zoo_new.py --avx2                            # both sides capped to AVX2 (bench/zoo_avx2.py)

Each model is exported once (kiln.zoo's cache, $KILN_CACHE/zoo), built by kiln at the thread count (fp32, kiln.build
defaults), checked against onnxruntime (ORT_ENABLE_ALL, the same threads) on a fresh random input, then both are
timed in interleaved rounds (kiln, onnxruntime, onnxruntime, kiln, ...: the order rotated each round), a block of
calls each sized to about --block-ms, SETTLE_S slept and one call made before it; per side the median of its rounds'
per-call times. 1 thread: the calling thread's CPU time (time waiting for a core on a shared machine is not counted);
2 threads: wall time, with the 1-min load beside each row.

--avx2: both sides on an AVX2-only CPU, emulated in this process as bench/zoo_avx2.py does (bench/cpuid_avx2.py's cpuid
mask and KILN_CPU_ISA=avx2, set on import, before any library reads cpuid), with its check, before and after the rows,
that onnxruntime's MLAS GEMM stays below what only its AVX-512 kernels reach.

--profile: kiln's time per op type inside its native segments (kiln/runtime/profiler.py: profile_segments, the
engine's own loop) and onnxruntime's per op type (its profiler), both summed per call, to find where a row loses.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))
if "--avx2" in sys.argv:  # before numpy, torch, onnxruntime or kiln read cpuid: argparse comes too late
    import zoo_avx2  # noqa: E402  caps this process to AVX2 on import
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402

CLOCKS = {"thread": time.thread_time_ns, "wall": time.perf_counter_ns}
TOLERANCE = 1e-3  # fp32: the largest |kiln - onnxruntime| over the largest |onnxruntime| of each output


def cases(spec: str | None) -> list[tuple[str, int]]:
    """(model, batch) rows: 'name' takes every batch of the model's, 'name@b' one."""
    from zoo_new_models import MODELS

    if not spec:
        return [(n, b) for n, m in MODELS.items() for b in m.batches]
    rows = []
    for item in spec.split(","):
        name, _, batch = item.strip().partition("@")
        if name not in MODELS:
            raise SystemExit(f"no model {name!r}; bench/zoo_new_models.py has {sorted(MODELS)}")
        rows += [(name, int(batch))] if batch else [(name, b) for b in MODELS[name].batches]
    return rows


def ort_session(path: Path, threads: int, profile: bool = False):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if profile:
        options.enable_profiling = True
        options.profile_file_prefix = str(Path(tempfile.mkdtemp()) / "ort")
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def relative_error(got: dict, session, feeds: dict) -> float:
    want = session.run(None, feeds)
    names = [o.name for o in session.get_outputs()]
    return max(float(np.abs(np.asarray(got[n], np.float64) - w).max() / max(np.abs(w).max(), 1e-12))
               for n, w in zip(names, want))


def interleaved(sides: dict, args) -> tuple[dict[str, list[float]], list[float]]:
    """ms a call of each side, per round; the 1-min load at each round."""
    clock = CLOCKS[args.clock]
    settle = 0.25 if args.threads > 1 else 0.02  # onnxruntime's pool spins after a call (kiln/zoo/timing.py)
    blocks = {}
    for side, call in sides.items():
        call()
        t0 = time.perf_counter_ns()
        call()
        blocks[side] = max(1, int(args.block_ms * 1e6 / (time.perf_counter_ns() - t0)))
    times: dict[str, list[float]] = {s: [] for s in sides}
    loads = []
    order = list(sides)
    for r in range(args.rounds):
        loads.append(os.getloadavg()[0])
        for side in (order if r % 2 == 0 else order[::-1]):
            time.sleep(settle)
            sides[side]()
            t0 = clock()
            for _ in range(blocks[side]):
                sides[side]()
            times[side].append((clock() - t0) / blocks[side] / 1e6)
    return times, loads


def kiln_profile(engine, feeds: dict, runs: int = 5) -> dict[str, float]:
    """ms per call by op type inside kiln's native segments, and the steps outside them by their op type."""
    from kiln.runtime.profiler import profile_layers, profile_segments

    program = engine.program
    inputs = engine.program_inputs(feeds)
    by_layer = profile_segments(program, inputs, runs=runs)
    kinds = {s.name: f"{s.op_type} [{getattr(s, 'tactic', '') or 'default'}]" for s in program.spec.steps}
    out: collections.Counter = collections.Counter()
    for name, ms in by_layer.items():
        out[kinds.get(name, name)] += statistics.median(ms)
    inside = set(by_layer)
    for layer in profile_layers(program, inputs, runs=runs):
        if layer["name"] not in inside:
            out[f"(outside) {layer['op_type']} [{layer['tactic']}]"] += layer["ms"]
    return dict(out)


def ort_profile(path: Path, feeds: dict, threads: int, runs: int = 6) -> dict[str, float]:
    """ms per call by op type in onnxruntime's profiler: each node's median over `runs` runs (the first run's
    allocations left out that way), summed by op type."""
    session = ort_session(path, threads, profile=True)
    for _ in range(runs):
        session.run(None, feeds)
    trace = json.loads(Path(session.end_profiling()).read_text())
    per_node: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    for event in trace:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            per_node[(event["args"]["op_name"], event["name"])].append(event["dur"] / 1e3)
    out: collections.Counter = collections.Counter()
    for (op, _), ms in per_node.items():
        out[op] += statistics.median(ms)
    return dict(out)


def measure(name: str, batch: int, args) -> dict:
    import kiln
    from zoo_new_models import MODELS, export

    model = MODELS[name]
    exported = export(name, batch)
    t0 = time.perf_counter()
    engine = kiln.build(str(exported.path))
    build_s = time.perf_counter() - t0
    session = ort_session(exported.path, args.threads)
    feeds = model.inputs(batch, seed=1)  # not the exported example: a fresh input
    error = relative_error(engine.run(feeds), session, feeds)
    row = {"model": name, "batch": batch, "error": error, "build_s": build_s}
    if error > TOLERANCE:
        print(f"| {name} | {batch} | kiln off onnxruntime by {error:.1e} (> {TOLERANCE:g}) | | | | |", flush=True)
        row["failed"] = True
        return row
    times, loads = interleaved({"kiln": lambda: engine.run(feeds), "onnxruntime": lambda: session.run(None, feeds)},
                               args)
    k, o = statistics.median(times["kiln"]), statistics.median(times["onnxruntime"])
    ratios = [a / b for a, b in zip(times["kiln"], times["onnxruntime"])]
    row.update(kiln_ms=k, ort_ms=o, ratio=k / o, round_ratios=ratios, load=(min(loads), max(loads)))
    print(f"| {name} | {batch} | {k:.3f} | {o:.3f} | **{k / o:.3f}** | {min(ratios):.2f}-{max(ratios):.2f} | "
          f"{error:.1e} | {build_s:.0f} | {min(loads):.1f}-{max(loads):.1f} |", flush=True)
    if args.profile:
        kp, op = kiln_profile(engine, feeds), ort_profile(exported.path, feeds, args.threads)
        print(f"\nper-op ms per call (kiln total {sum(kp.values()):.2f}, onnxruntime total {sum(op.values()):.2f}):")
        for kind, ms in sorted(kp.items(), key=lambda kv: -kv[1])[:args.profile_rows]:
            print(f"  kiln  {ms:8.3f}  {kind}")
        for kind, ms in sorted(op.items(), key=lambda kv: -kv[1])[:args.profile_rows]:
            print(f"  ort   {ms:8.3f}  {kind}")
        print(flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=None, help="comma-separated name or name@batch (default: every row)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=tuple(CLOCKS), default=None, help="default: thread at 1 thread, else wall")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--block-ms", type=float, default=150.0)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--profile-rows", type=int, default=12)
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")
    parser.add_argument("--avx2", action="store_true", help="both sides capped to AVX2 (bench/zoo_avx2.py)")
    args = parser.parse_args()
    args.clock = args.clock or ("thread" if args.threads == 1 else "wall")
    import torch

    torch.set_num_threads(args.threads)  # kiln tunes its tactics at the thread count it will run with
    import onnxruntime

    import kiln
    from kiln.builder.timing_cache import cpu_name

    print(f"zoo_new: {cpu_name()} ({torch.backends.cpu.get_cpu_capability()}), {args.threads} thread(s), "
          f"{args.clock} clock, {args.rounds} rounds of ~{args.block_ms:g} ms blocks; torch {torch.__version__}, "
          f"onnxruntime {onnxruntime.__version__}, kiln {kiln.__version__}; load {os.getloadavg()[0]:.2f}")
    if args.avx2:
        zoo_avx2.checked("before")  # stops the run where MLAS's AVX-512 kernels still answer
    print("| model | batch | kiln ms | onnxruntime ms | kiln / ort | by round | max err | kiln build s | load |")
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    rows = [measure(name, batch, args) for name, batch in cases(args.models)]
    if args.avx2:
        zoo_avx2.checked("after")
    timed = [r for r in rows if "ratio" in r]
    if timed:
        ratios = [r["ratio"] for r in timed]
        worst = sorted(timed, key=lambda r: -r["ratio"])[:3]
        print(f"\ngeometric mean kiln / ort {np.exp(np.mean(np.log(ratios))):.3f} over {len(ratios)} rows; worst: "
              + ", ".join(f"{r['model']}@{r['batch']} {r['ratio']:.2f}" for r in worst))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
