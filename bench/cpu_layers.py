"""Per-layer CPU times of a zoo model: kiln's layers under several tactic sets, and onnxruntime's nodes.

    python bench/cpu_layers.py --model mobilenet_v2
    python bench/cpu_layers.py --model resnet50 --sets "cpu.conv.onednn_direct,cpu.gemm;cpu.conv.onednn_graph,cpu.gemm"

Each tactic set builds one engine (kiln.build(tactics=set): the autotuner chooses among the set's
tactics and each layer's default). The engines then run in interleaved rounds (A, B, A, B, ...)
with every step timed; a layer's time is the lower quartile of its samples, the steadier
estimate on a CPU shared with other work (interference only ever adds time). onnxruntime runs
afterwards in its own block (its worker threads keep spinning after a call and would slow the
engines timed next to it) with its profiler on, summed per ONNX op type.

The timing wrapper holds extra references to each layer's inputs, so cpu.conv.onednn_direct never
accumulates a residual in place here (it does only when nothing else holds it): its residual layers
show the binary post-op's time, ~0.05-0.1 ms more each on ResNet-50 than inside a plain engine run.

    python bench/cpu_layers.py --wins resnet50,mobilenet_v2,bert_base,minilm

    python bench/cpu_layers.py --model efficientnet_b0 --versus-ort
    python bench/cpu_layers.py --model bert_base --versus-ort --avx2     # both sides on an AVX2-only CPU

--versus-ort puts onnxruntime's profile beside kiln's layers: the default build and an onnxruntime session
(profiler on) run in interleaved blocks in one process, and each onnxruntime node's time is charged to the
kiln layer that computes the same ONNX value (a fused Conv+QuickGelu to the kiln convolution whose output is
the SiLU's, ReduceMean..Mul to the squeeze-excite; a relayout to the layer after it). Prints both per layer,
their ratio and onnxruntime's op types.

--wins builds each model once with every tactic (opt_level 5, the level-3 ones included) and no
timing cache, so every candidate is timed on this machine, and tallies the autotuner's own record
(the engine header's tactics.layers): per CPU tactic and model, the layers it was timed on, won
and came second on, and its time over the winner's. The evidence for retiring a tactic
(docs/retired-tactics.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing
if "--avx2" in sys.argv:  # both sides on an AVX2-only CPU (bench/zoo_avx2.py's caps), set before any library loads
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import cpuid_avx2  # noqa: E402

    cpuid_avx2.enable()
    os.environ["KILN_CPU_ISA"] = "avx2"
import kiln  # noqa: E402
from kiln import zoo  # noqa: E402

DEFAULT_SETS = ("cpu.conv.onednn_direct,cpu.pool,cpu.gap,cpu.gemm;"
                "cpu.conv.onednn_nhwc,cpu.conv.torch_nhwc,cpu.conv.onednn_graph,cpu.gemm")


def lower_quartile(samples: list[float]) -> float:
    return statistics.quantiles(samples, n=4, method="inclusive")[0] if len(samples) > 1 else samples[0]


def describe(step) -> str:
    if step.op_type != "FusedConv":
        return step.op_type
    a = step.attributes
    size = step.tactic_config.get("input_size", "")
    k = a.get("kernel_shape", "?")
    group = a.get("group", 1)
    return f"Conv {size} k{k} s{a.get('strides', [1, 1])} g{group} {a.get('activation', '')}" + \
        (" +res" if len(step.inputs) > 3 and step.inputs[3] else "")


def _timing(store: list[list[float]]):
    """A wrapper for Program.with_kernels: each call of step i appends its wall time in ms to store[i]."""
    def wrap(i, fn):
        def call(ctx, *args, **kw):
            t0 = time.perf_counter()
            result = fn(ctx, *args, **kw)
            store[i].append(1e3 * (time.perf_counter() - t0))
            return result
        return call
    return wrap


def time_engines(engines: dict[str, kiln.Engine], feeds: dict, rounds: int) -> dict[str, list[float]]:
    """label -> per-step lower-quartile ms, the engines run in interleaved rounds."""
    import torch

    samples = {label: [[] for _ in e.program.steps] for label, e in engines.items()}
    timed = {}
    for label, engine in engines.items():
        timed[label] = engine.program.with_kernels(_timing(samples[label]))
    inputs = {label: engine.program_inputs(feeds) for label, engine in engines.items()}
    with torch.inference_mode():
        for label, program in timed.items():  # warm-up, then drop its samples
            for _ in range(3):
                program.run(inputs[label])
            for s in samples[label]:
                s.clear()
        for _ in range(rounds):
            for label, program in timed.items():
                program.run(inputs[label])
    return {label: [lower_quartile(s) if s else 0.0 for s in steps] for label, steps in samples.items()}


def onnxruntime_profile(path: Path, feeds: dict, threads: int, runs: int) -> tuple[float, dict[str, float]]:
    """(lower-quartile ms of a whole run, ms per ONNX op type per run) under onnxruntime's profiler."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    plain = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    for _ in range(5):
        plain.run(None, feeds)
    whole = []
    for _ in range(runs):
        t0 = time.perf_counter()
        plain.run(None, feeds)
        whole.append(1e3 * (time.perf_counter() - t0))
    del plain
    with tempfile.TemporaryDirectory() as folder:
        options.enable_profiling = True
        options.profile_file_prefix = str(Path(folder) / "ort")
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        for _ in range(runs):
            session.run(None, feeds)
        events = json.loads(Path(session.end_profiling()).read_text())
    per_type: dict[str, float] = defaultdict(float)
    for e in events:
        if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time"):
            per_type[e["args"].get("op_name", "?")] += e["dur"] / 1e3 / (runs + 1)  # +1: the profiled warm-up
    return lower_quartile(whole), dict(per_type)


def onnxruntime_node_values(path: Path, threads: int) -> dict[str, str]:
    """onnxruntime's optimized node name -> the ONNX value of the original model it computes, for the nodes that
    compute one: its NCHWc convolutions are named after their output (`getitem_nchwc`), its fusions after the
    original node (`node_silu/QuickGeluFusion/`); relayouts and renamed intermediates are left out."""
    import onnx
    import onnxruntime as ort

    produced = {node.name: node.output[0] for node in onnx.load(str(path), load_external_data=False).graph.node}
    values = set(produced.values())
    with tempfile.TemporaryDirectory() as folder:
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.optimized_model_filepath = str(Path(folder) / "optimized.onnx")
        ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        optimized = onnx.load(options.optimized_model_filepath, load_external_data=False)
    names = {}
    for node in optimized.graph.node:
        base = node.name.split("/")[0]
        if base in produced:
            names[node.name] = produced[base]
        elif node.name.endswith("_nchwc") and node.name[:-len("_nchwc")] in values:
            names[node.name] = node.name[:-len("_nchwc")]
        elif node.output[0] in values:
            names[node.name] = node.output[0]
    return names


def versus_onnxruntime(path: Path, engine: kiln.Engine, feeds: dict, threads: int, rounds: int,
                       block: int = 5) -> list[tuple[float, float, list[str]]]:
    """Per kiln step: (kiln lower-quartile ms, onnxruntime's ms for the nodes charged to it, their op types).
    kiln and onnxruntime run in interleaved blocks of `block` runs; onnxruntime's per-node time is the lower
    quartile over its runs of the node's summed kernel time in that run."""
    import onnxruntime as ort
    import torch

    node_values = onnxruntime_node_values(path, threads)
    step_of_value = {out: i for i, step in enumerate(engine.plan.program.steps) for out in step.outputs}
    kiln_samples: list[list[float]] = [[] for _ in engine.program.steps]

    timed = engine.program.with_kernels(_timing(kiln_samples))
    inputs = engine.program_inputs(feeds)
    with tempfile.TemporaryDirectory() as folder:
        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
        options.enable_profiling = True
        options.profile_file_prefix = str(Path(folder) / "ort")
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        with torch.inference_mode():
            for _ in range(3):
                timed.run(inputs)
                session.run(None, feeds)
            for s in kiln_samples:
                s.clear()
            for _ in range(rounds):
                for _ in range(block):
                    timed.run(inputs)
                for _ in range(block):
                    session.run(None, feeds)
        events = json.loads(Path(session.end_profiling()).read_text())
    # one run's node events lie between two "model_run" events; the first 3 runs are the warm-up
    runs: list[list[tuple[str, str, float]]] = []
    for e in events:
        if e.get("name") == "model_run":
            runs.append([])
        elif e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time") and runs:
            runs[-1].append((e["name"][:-len("_kernel_time")], e["args"].get("op_name", "?"), e["dur"] / 1e3))
    charged: list[list[list[float]]] = [[] for _ in engine.program.steps]  # step -> runs -> node times
    op_types: list[set[str]] = [set() for _ in engine.program.steps]
    for run in runs[3:]:
        per_step = [0.0] * len(charged)
        pending, pending_types = 0.0, set()
        for name, op, ms in run:
            pending += ms
            pending_types.add(op)
            step = step_of_value.get(node_values.get(name, ""))
            if step is not None:
                per_step[step] += pending
                op_types[step] |= pending_types
                pending, pending_types = 0.0, set()
        per_step[-1] += pending
        for step, ms in enumerate(per_step):
            charged[step].append(ms)
    return [(lower_quartile(k) if k else 0.0, lower_quartile(o) if o else 0.0, sorted(t))
            for k, o, t in zip(kiln_samples, charged, op_types)]


WIN_CASES = {"resnet50": {"batch": 1}, "mobilenet_v2": {"batch": 1},  # bench/cpu.py's shapes
             "bert_base": {"batch": 1, "seq": 128}, "minilm": {"batch": 8, "seq": 128}}


def tuned_layers(model: str, threads: int) -> dict[str, dict]:
    """The autotuner's record of `model` built with every tactic and no timing cache: layer -> {tactic,
    time_ms, runner_up, runner_up_ms, candidates: {name: ms or why not}}."""
    import torch

    torch.set_num_threads(threads)
    exported = zoo.export(model, **WIN_CASES.get(model, {}))
    engine = kiln.build(str(exported.path), opt_level=5, timing_cache=None)
    return engine.plan.header["tactics"].get("layers", {})


def win_table(layers_by_model: dict[str, dict[str, dict]], prefix: str = "cpu.") -> list[str]:
    """Lines of a table: per tactic (and the default) and model, the layers it won (the autotuner's choice,
    layout preference and native credit applied), the distinct layers it was measured on (a layer the build
    had already measured, same shapes and attributes, takes that choice unmeasured), how often it came second
    and had the lowest raw time there, and its time over the winner's where it lost (median, best)."""
    names = sorted({name for layers in layers_by_model.values() for layer in layers.values()
                    for name, v in layer["candidates"].items()
                    if isinstance(v, float) and (name.startswith(prefix) or name == "default")})
    lines = ["| tactic | model | won | measured on | second | fastest raw | time / winner's where it lost |",
             "|---|---|---|---|---|---|---|"]
    for name in names:
        for model, layers in layers_by_model.items():
            measured = [layer for layer in layers.values()
                        if not layer["cached"] and isinstance(layer["candidates"].get(name), float)]
            if not measured:
                continue
            won = sum(layer["tactic"] == name for layer in layers.values())
            second = sum(layer["runner_up"] == name for layer in measured)
            fastest = sum(min((v for v in layer["candidates"].values() if isinstance(v, float))) ==
                          layer["candidates"][name] for layer in measured)
            ratios = sorted(layer["candidates"][name] / layer["time_ms"] for layer in measured
                            if layer["tactic"] != name and layer["time_ms"])
            lost = f"median {statistics.median(ratios):.2f}x, best {ratios[0]:.2f}x" if ratios else "-"
            lines.append(f"| {name} | {model} | {won} | {len(measured)} | {second} | {fastest} | {lost} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mobilenet_v2")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--sets", default=DEFAULT_SETS, help="tactic sets separated by ';', tactics by ','")
    parser.add_argument("--wins", default="", help="models (comma-separated): count the layers each tactic wins")
    parser.add_argument("--versus-ort", action="store_true",
                        help="kiln's default build beside onnxruntime's profile, layer by layer")
    parser.add_argument("--wins-json", default="", help="with --wins: also write the per-layer records here")
    parser.add_argument("--timing-cache", default="", help="the builds' timing cache (default: kiln.build's)")
    parser.add_argument("--avx2", action="store_true", help="kiln (KILN_CPU_ISA=avx2) and every library "
                        "(onnxruntime's MLAS by bench/cpuid_avx2.py's cpuid mask) capped to AVX2")
    args = parser.parse_args()

    if args.wins:
        layers_by_model = {}
        for model in args.wins.split(","):
            start = time.perf_counter()
            layers_by_model[model] = tuned_layers(model, args.threads)
            print(f"{model}: {len(layers_by_model[model])} tuned layers in {time.perf_counter() - start:.0f} s "
                  f"(load average {os.getloadavg()[0]:.2f})", flush=True)
        if args.wins_json:
            Path(args.wins_json).write_text(json.dumps(layers_by_model, indent=1))
        print("\n".join(win_table(layers_by_model)))
        return

    import torch

    torch.set_num_threads(args.threads)
    exported = zoo.export(args.model, batch=args.batch)
    feeds = exported.inputs()
    cache = {"timing_cache": args.timing_cache} if args.timing_cache else {}
    if args.versus_ort:
        engine = kiln.build(str(exported.path), **cache)
        rows = versus_onnxruntime(exported.path, engine, feeds, args.threads, args.rounds)
        print(f"\n{args.model} batch {args.batch}, {args.threads} threads: per-layer lower-quartile ms, kiln and "
              f"onnxruntime in interleaved blocks ({args.rounds} rounds; load average {os.getloadavg()[0]:.2f})")
        print("    kiln | onnxruntime | kiln/ort | layer (kiln's tactic) | onnxruntime's nodes")
        for step, (k, o, types) in zip(engine.plan.program.steps, rows):
            ratio = f"{k / o:8.2f}" if o else "       -"
            print(f"{k:8.4f} | {o:11.4f} | {ratio} | {describe(step)} ({step.tactic or 'default'}) | {'+'.join(types)}")
        print(f"{sum(r[0] for r in rows):8.3f} | {sum(r[1] for r in rows):11.3f} | "
              f"{sum(r[0] for r in rows) / sum(r[1] for r in rows):8.2f} | sum of layers")
        return
    engines = {}
    for i, tactic_set in enumerate(args.sets.split(";")):
        tactics = [t for t in tactic_set.split(",") if t]
        engines[f"set{i}"] = kiln.build(str(exported.path), tactics=tactics, **cache)
        print(f"set{i}: {', '.join(tactics)}")
    times = time_engines(engines, feeds, args.rounds)
    labels = list(engines)
    first = engines[labels[0]]
    print(f"\n{args.model} batch {args.batch}, {args.threads} threads: per-layer lower-quartile ms "
          f"({args.rounds} interleaved rounds; load average {os.getloadavg()[0]:.2f})")
    print(" | ".join(f"{label:>8}" for label in labels) + " | layer (set0's tactic)")
    for i, step in enumerate(first.plan.program.steps):
        cells = [f"{times[label][i]:8.4f}" for label in labels]
        print(" | ".join(cells) + f" | {describe(step)} ({step.tactic or 'default'})")
    print(" | ".join(f"{sum(times[label]):8.3f}" for label in labels) + " | sum of layers")
    ort_ms, per_type = onnxruntime_profile(exported.path, feeds, args.threads, args.rounds)
    print(f"\nonnxruntime: {ort_ms:.3f} ms per run (lower quartile); kernel time per op type: "
          + ", ".join(f"{k} {v:.3f}" for k, v in sorted(per_type.items(), key=lambda kv: -kv[1])))


if __name__ == "__main__":
    main()
