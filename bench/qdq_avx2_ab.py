"""kiln on onnxruntime's QDQ BERTs, one kiln tree against another (main before a change, a branch after) in fresh
processes that alternate A B A B, each timing its kiln engine and onnxruntime int8 interleaved in the same process.

    python bench/qdq_avx2_ab.py --before /work/main --after . --models minilm,bert_tiny --threads 1,2 --processes 4
    python bench/qdq_avx2_ab.py --threads 1 --clock thread     (the calling thread's CPU time: load moves it less)

The QDQ models are bench/quant.py's (onnxruntime quantize_static: uint8 activations, per-channel int8 weights,
reduce_range; MatMul/Gemm layers; calibrated on 8 inputs), made once into a folder both sides read with one feed
(batch 1, seq 128). Each process (`--child`) imports kiln from its side's tree (PYTHONPATH), builds the engine at its
thread count, warms both peers up, then runs `--rounds` rounds of a block of kiln calls and a block of onnxruntime
calls (order swapped each round): wall clock ms, the median of each block; the process reports the median of its
rounds. Prints each process's numbers and a table: per model and thread count, the medians over processes of kiln
before, kiln after and onnxruntime int8, after / before over the process pairs (A then B: one pair), kiln / onnxruntime
within each process, the 1-min load, the CPU; and checks both sides' outputs are the same bits.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def prepare(folder: Path, model: str) -> Path:
    """folder/<model>-qdq.onnx and its feed (made once)."""
    qdq = folder / f"{model}-qdq.onnx"
    if not qdq.exists():
        sys.path.insert(0, str(HERE))
        import quant  # bench/quant.py

        label, seq = quant.MODELS[model]
        exported = quant.zoo.export(model, batch=1, seq=seq)
        quant.ort_qdq(exported.path, quant.inputs_for(exported, 8, seed=1), qdq, True)
        np.savez(folder / f"{model}-feed.npz", **quant.inputs_for(exported, 1, seed=2)[0])
    return qdq


CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}


def block_ms(run, feed, iterations: int, clock=time.perf_counter) -> float:
    samples = []
    for _ in range(iterations):
        start = clock()
        run(feed)
        samples.append(1e3 * (clock() - start))
    return statistics.median(samples)


def child(folder: Path, model: str, threads: int, rounds: int, iterations: int, out: Path, clock: str) -> None:
    import onnxruntime as ort
    import torch

    import kiln

    torch.set_num_threads(threads)
    qdq = folder / f"{model}-qdq.onnx"
    feed = dict(np.load(folder / f"{model}-feed.npz"))
    engine = kiln.build(str(qdq))
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    session = ort.InferenceSession(str(qdq), options, providers=["CPUExecutionProvider"])
    runs = {"kiln": lambda f: engine.run(f), "onnxruntime": lambda f: session.run(None, f)}
    y = np.asarray(next(iter(engine.run(feed).values())))
    np.save(out.with_suffix(".npy"), y)
    for run in runs.values():
        for _ in range(10):
            run(feed)
    times: dict[str, list[float]] = {p: [] for p in runs}
    load = [os.getloadavg()[0]]
    for r in range(rounds):
        for peer in (("kiln", "onnxruntime") if r % 2 == 0 else ("onnxruntime", "kiln")):
            times[peer].append(block_ms(runs[peer], feed, iterations, CLOCKS[clock]))
    load.append(os.getloadavg()[0])
    out.write_text(json.dumps({p: statistics.median(t) for p, t in times.items()} | {"load": load,
                                                                                     "kiln_path": kiln.__file__}))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", default="/work/main")
    parser.add_argument("--after", default=str(HERE.parent))
    parser.add_argument("--models", default="minilm,bert_tiny")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--processes", type=int, default=4, help="per side (A B A B ...)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--folder", help="where the QDQ models are (made if missing)")
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="wall",
                        help="thread: the calling thread's CPU time (1 thread only: both peers compute on it there)")
    parser.add_argument("--child", nargs=5, metavar=("FOLDER", "MODEL", "THREADS", "OUT", "_"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        folder, model, threads, out, _ = args.child
        child(Path(folder), model, int(threads), args.rounds, args.iterations, Path(out), args.clock)
        return
    folder = Path(args.folder or tempfile.mkdtemp(prefix="kiln-qdqavx2-"))
    folder.mkdir(parents=True, exist_ok=True)
    sides = {"before": str(Path(args.before).resolve()), "after": str(Path(args.after).resolve())}
    commits = {s: subprocess.run(["git", "-C", p, "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True).stdout.strip() for s, p in sides.items()}
    from kiln.builder.timing_cache import cpu_name

    print(f"# CPU {cpu_name()}, {args.clock} clock, before {sides['before']} ({commits['before']}), after {sides['after']} "
          f"({commits['after']}), {args.processes} processes a side, {args.rounds} rounds of {args.iterations} calls\n")
    rows = []
    for model in args.models.split(","):
        prepare(folder, model)
        for threads in (int(t) for t in args.threads.split(",")):
            results: dict[str, list[dict]] = {s: [] for s in sides}
            outputs = {}
            for p in range(args.processes):
                for side in (("before", "after") if p % 2 == 0 else ("after", "before")):
                    out = folder / f"{model}-{threads}-{side}-{p}.json"
                    env = os.environ | {"PYTHONPATH": sides[side]}
                    subprocess.run([sys.executable, __file__, "--clock", args.clock, "--rounds", str(args.rounds),
                                    "--iterations",
                                    str(args.iterations), "--child", str(folder), model, str(threads), str(out), "-"],
                                   env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    result = json.loads(out.read_text())
                    if not result["kiln_path"].startswith(sides[side]):
                        raise SystemExit(f"{side}: kiln imported from {result['kiln_path']}, not {sides[side]}")
                    outputs[side] = np.load(out.with_suffix(".npy"))
                    results[side].append(result)
                    print(f"  {model} {threads} thr process {p} {side}: kiln {result['kiln']:.3f} ms, onnxruntime "
                          f"{result['onnxruntime']:.3f} ms, load {result['load'][0]:.1f}-{result['load'][1]:.1f}",
                          flush=True)
            same = np.array_equal(outputs["before"], outputs["after"])
            ratio = [a["kiln"] / b["kiln"] for a, b in zip(results["after"], results["before"])]
            vs_ort = {s: [r["kiln"] / r["onnxruntime"] for r in results[s]] for s in sides}
            loads = [x for s in sides for r in results[s] for x in r["load"]]
            med = {s: statistics.median(r["kiln"] for r in results[s]) for s in sides}
            ort_ms = statistics.median(r["onnxruntime"] for s in sides for r in results[s])
            rows.append(f"| {model} | {threads} | {min(loads):.1f}-{max(loads):.1f} | {med['before']:.3f} | "
                        f"{med['after']:.3f} | {ort_ms:.3f} | **{statistics.median(ratio):.3f}** "
                        f"({', '.join(f'{x:.2f}' for x in ratio)}) | {statistics.median(vs_ort['before']):.2f} | "
                        f"**{statistics.median(vs_ort['after']):.2f}** ({', '.join(f'{x:.2f}' for x in vs_ort['after'])})"
                        f" | {'yes' if same else 'NO'} |")
    print("\n| model | threads | load | kiln before ms | kiln after ms | onnxruntime int8 ms | after / before (pairs) | "
          "before / ORT | after / ORT (processes) | same bits |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
