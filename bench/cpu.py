"""CPU benchmark: kiln vs onnxruntime vs torch eager, side by side in one run, fp32.

    python bench/cpu.py                      # all four models, 2 threads
    python bench/cpu.py --models minilm --threads 1

Each model comes from the zoo (exported once, cached); every runtime gets the same input and the
same thread count; onnxruntime runs with all graph optimisations on. Prints a table and writes
bench/results/cpu-<date>.md (appended when it exists) with the CPU model, the commit and the versions.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing
import kiln  # noqa: E402
from kiln import zoo  # noqa: E402
from kiln.builder.timing_cache import cpu_name  # noqa: E402
from kiln.zoo.timing import SETTLE_S, Latency, peer_runners, time_runners, time_samples  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def _wait_policy() -> str:
    """How idle OpenMP threads wait (kiln and torch; onnxruntime has its own pool): set by kiln's import."""
    given = {k: os.environ[k] for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in os.environ}
    return "OpenMP idle threads: " + (", ".join(f"{k}={v}" for k, v in given.items()) or "libgomp default")
PEERS = ("kiln", "onnxruntime", "torch eager")


@dataclass(frozen=True)
class Case:
    label: str
    model: str  # zoo name
    batch: int
    seq: int | None = None


CASES = {c.model: c for c in [
    Case("ResNet-50", "resnet50", batch=1),
    Case("MobileNetV2", "mobilenet_v2", batch=1),
    Case("BERT-base", "bert_base", batch=1, seq=128),
    Case("MiniLM-L6", "minilm", batch=8, seq=128),
]}


def commit() -> str:
    """The tree's commit; KILN_COMMIT overrides it (the GPU machine's copy of the tree carries a stale .git)."""
    if os.environ.get("KILN_COMMIT"):
        return os.environ["KILN_COMMIT"]
    root = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha + ("-dirty" if dirty else "")


def shape_text(case: Case) -> str:
    if case.seq is None:
        return f"batch {case.batch}, 3x224x224"
    return f"batch {case.batch}, seq {case.seq}"


def run_case(case: Case, args) -> tuple[dict[str, Latency], float, dict, str]:
    import torch

    exported = zoo.export(case.model, batch=case.batch, seq=case.seq)
    torch.set_num_threads(args.threads)  # tactics are tuned at the thread count they will run with
    waited = [wait_for_quiet(args.quiet_wait)]
    start = time.perf_counter()
    engine = kiln.build(str(exported.path), timing_cache=args.timing_cache or None)
    build_s = time.perf_counter() - start
    print(f"  {case.label:<12} tactics: {tactic_summary(engine.plan.header)}", flush=True)
    runners = peer_runners(case.model, exported.path, exported.inputs(), threads=args.threads, engine=engine)
    # Rounds of blocks (kiln, onnxruntime, torch, kiln, ...): a shared host's speed drifts over
    # minutes, and one block each would hand the drift to whichever runtime ran in the slow part.
    # Blocks, not alternating calls: onnxruntime's workers spin after each call and would take
    # the cores from the runtime timed next.
    samples: dict[str, list[float]] = {p: [] for p in PEERS}
    by_round: list[dict[str, float]] = []
    for _ in range(args.rounds):
        medians = {}
        for peer in PEERS:  # each in its own block, after the machine has gone quiet (--quiet-wait)
            waited.append(wait_for_quiet(args.quiet_wait))
            block = time_samples(runners[peer], iterations=max(1, args.iterations // args.rounds),
                                 warmup=args.warmup, budget_s=args.budget / len(PEERS) / args.rounds, min_runs=5,
                                 settle_s=SETTLE_S)
            samples[peer] += block
            medians[peer] = float(np.median(block))
        by_round.append(medians)
    results = {p: Latency(float(np.median(v)), float(np.percentile(v, 90)), len(v)) for p, v in samples.items()}
    if args.quiet_wait and not all(waited):
        print(f"  {case.label:<12} the machine did not go quiet within {args.quiet_wait:.0f}s before every block",
              flush=True)
    for peer, r in results.items():
        print(f"  {case.label:<12} {peer:<12} median {r.median_ms:9.2f} ms (p90 {r.p90_ms:.2f}, {r.runs} runs)",
              flush=True)
    ratios = ", ".join(f"{m['kiln'] / m['onnxruntime']:.2f}" for m in by_round)
    print(f"  {case.label:<12} kiln / onnxruntime by round: {ratios}", flush=True)
    return results, build_s, engine.plan.header, ratios


def cpu_busy(interval_s: float = 1.0) -> float:
    """Fraction of the machine's CPU time spent busy over `interval_s` (Linux /proc/stat; 0 elsewhere)."""
    def sample() -> tuple[int, int]:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = fields[3] + fields[4]  # idle + iowait
        return sum(fields) - idle, sum(fields)
    try:
        busy0, total0 = sample()
        time.sleep(interval_s)
        busy1, total1 = sample()
    except OSError:
        return 0.0
    return (busy1 - busy0) / max(total1 - total0, 1)


def wait_for_quiet(max_s: float, threshold: float = 0.15) -> bool:
    """On a CPU shared with other work, wait (up to max_s) until it has been idle for 2 s in a row:
    OpenMP's spinning worker threads lose whole scheduler slices to other processes, which makes a
    contended run useless for comparing runtimes. True when it went quiet (or max_s is 0)."""
    deadline, quiet = time.perf_counter() + max_s, 0
    while max_s > 0 and time.perf_counter() < deadline:
        quiet = quiet + 1 if cpu_busy() < threshold else 0
        if quiet >= 2:
            return True
    return max_s <= 0


def tactic_summary(header: dict) -> str:
    tactics = header.get("tactics") or {}
    if "layers" not in tactics:
        return tactics.get("skipped", "none")
    chosen = [v["tactic"] for v in tactics["layers"].values()]
    text = ", ".join(f"{chosen.count(t)} {t}" for t in sorted(set(chosen)))
    cache = tactics.get("cache", {})
    return text + (f" (timing cache: {cache['hits']} hits, {cache['misses']} misses)" if cache.get("path") else "")


def step_overhead_us(steps: int = 1000) -> tuple[float, float]:
    """(µs per step of a 1000-Add engine, µs of the bare torch.add it runs): kiln's own cost per layer."""
    import torch
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Add", [f"t{i}" if i else "x", "one"], [f"t{i + 1}" if i < steps - 1 else "y"])
             for i in range(steps)]
    graph = helper.make_graph(nodes, "adds", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
                              [helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    engine = kiln.build(model.SerializeToString(), opt_level=0)
    x, one = torch.zeros(1), torch.ones(1)

    def bare():
        v = x
        for _ in range(steps):
            v = torch.add(v, one)

    samples = time_runners({"kiln": lambda: engine.run([x]), "bare": bare}, iterations=50, warmup=5,
                               budget_s=10.0)
    return samples["kiln"].median_ms * 1e3 / steps, samples["bare"].median_ms * 1e3 / steps


def table(rows: list[tuple[Case, dict[str, Latency], float, str]]) -> list[str]:
    header = ["model", "input", *(f"{p} ms" for p in PEERS), "kiln / ort", "kiln / torch", "kiln / ort by round",
              "kiln build s"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for case, r, build_s, ratios in rows:
        kiln_ms = r["kiln"].median_ms
        cells = [case.label, shape_text(case),
                 *(f"{r[p].median_ms:.2f} (p90 {r[p].p90_ms:.2f})" for p in PEERS),
                 f"{kiln_ms / r['onnxruntime'].median_ms:.2f}x", f"{kiln_ms / r['torch eager'].median_ms:.2f}x",
                 ratios, f"{build_s:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(CASES), help=f"comma-separated, from {list(CASES)}")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3,
                        help="blocks per runtime, interleaved (kiln, onnxruntime, torch, kiln, ...)")
    parser.add_argument("--budget", type=float, default=60.0,
                        help="seconds of timed rounds per model at most (at least 10 rounds are made)")
    parser.add_argument("--no-write", action="store_true", help="print only, write no results file")
    parser.add_argument("--quiet-wait", type=float, default=0.0,
                        help="before each build and each runtime's block, wait up to this many seconds for "
                             "the machine to go idle (a shared CPU); 0: do not wait")
    parser.add_argument("--timing-cache", default=str(zoo.cache_dir().parent / "timing-cache-cpu.json"),
                        help="kiln's tactic timing cache (rebuilds time nothing); '' for none")
    args = parser.parse_args()

    now = datetime.datetime.now(datetime.timezone.utc)
    versions = {p: importlib.metadata.version(p) for p in ("torch", "onnxruntime", "onnx", "transformers")}
    load_before = os.getloadavg()[0]
    print(f"kiln {kiln.__version__} CPU benchmark: {cpu_name()}, {args.threads} thread(s), fp32, median latency; "
          f"load average {load_before:.2f} on {os.cpu_count()} cores; {_wait_policy()}")
    rows = []
    headers: list[dict] = []  # each kiln engine's header: the tactics chosen
    for name in args.models.split(","):
        case = CASES[name.strip()]
        results, build_s, header, ratios = run_case(case, args)
        rows.append((case, results, build_s, ratios))
        headers.append(header)
    lines = table(rows)
    per_step, bare = step_overhead_us()
    overhead = (f"per-step overhead: {per_step:.2f} µs per layer in a 1000-Add engine, of which the bare "
                f"torch.add is {bare:.2f} µs: kiln's own cost {per_step - bare:.2f} µs per layer")
    lines += ["", overhead, ""] + [f"- {case.label} tactics: {tactic_summary(h)}"
                                   for (case, _, _, _), h in zip(rows, headers)]
    load_after = os.getloadavg()[0]
    print("\n" + "\n".join(lines))
    if args.no_write:
        return
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"cpu-{now:%Y-%m-%d}.md"
    contended = max(load_before, load_after) > args.threads + 0.5
    warning = (["**Contended run**: other processes shared the CPU (see the load below); the latencies are "
                "inflated, torch's OpenMP threads (kiln, torch eager) more than onnxruntime's pool. "
                "Re-run on an idle machine before drawing conclusions.", ""] if contended else [])
    if contended:
        print("\n" + warning[0])
    # One file per day; a later run of the same day is appended as its own section (the earlier
    # numbers stay for comparison).
    earlier = out.read_text() if out.exists() else ""
    out.write_text(earlier + ("\n---\n\n" if earlier else "") + "\n".join([
        f"{'##' if earlier else '#'} kiln CPU benchmark, {now:%Y-%m-%d %H:%M} UTC",
        "",
        *warning,
        f"- device: {cpu_name()} ({platform.machine()}), {args.threads} thread(s) for every runtime; {_wait_policy()}",
        f"- commit: {commit()}; kiln {kiln.__version__}; "
        + ", ".join(f"{k} {v}" for k, v in versions.items()),
        "- fp32, latency in ms: median (p90) of up to "
        f"{args.iterations} runs ({args.budget:.0f}s per model at most), timed in {args.rounds} rounds of blocks "
        f"(kiln, onnxruntime, torch eager, kiln, ...), each block after {args.warmup} warm-up runs; "
        "'by round': kiln / onnxruntime of each round's block medians",
        f"- machine load (1-min load average) {load_before:.2f} before, {load_after:.2f} after, "
        f"on {os.cpu_count()} cores: a load above the thread count means other work shared the CPU "
        "and the numbers are pessimistic for every runtime",
        "- onnxruntime: CPUExecutionProvider, ORT_ENABLE_ALL; torch eager: inference_mode; "
        f"kiln: kiln.build defaults, timing cache {args.timing_cache or 'none'}"
        + (f"; each block started after the machine was idle for 2 s (waited up to {args.quiet_wait:.0f}s)"
           if args.quiet_wait else ""),
        "- models: kiln.zoo exports (torch.onnx dynamo); ResNet-50 and BERT-base random weights, "
        "MobileNetV2 and MiniLM real weights",
        "",
        *lines,
        "",
        "Ratios < 1: kiln is faster.",
        "",
    ]))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
