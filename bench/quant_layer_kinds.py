"""Where an INT8 CNN's time goes by layer kind: kiln's steps against onnxruntime's nodes on the same QDQ model.

    python bench/quant_layer_kinds.py --avx2                       # MobileNetV2, both capped to AVX2
    python bench/quant_layer_kinds.py --model resnet50 --runs 30

Builds kiln on onnxruntime's QDQ model (bench/quant.py's ort_qdq: MinMax, U8S8 per channel, reduce_range) and, with
--own, kiln's own PTQ; times every kiln step alone in eager runs (the calling thread's CPU time, median of --runs),
and takes onnxruntime's profiler node times on the same model (its own clock: wall, mean of the runs). Each
convolution is put in a kind by its weight: "stem" (<= 4 input channels), "depthwise kxk/s", "1x1 expand"
(more outputs than inputs), "1x1 project" (fewer), "kxk dense"; everything else by op type (Q/DQ glue, residual
adds, the classifier). Per kind: kiln ms, onnxruntime ms, their ratio, and kiln's tactics there.

Both clocks count one thread (--threads 1 only). kiln's eager steps each pay ~10-30 us of Python a step that a
native segment does not: read the kinds' ratios, not the totals, against bench/quant.py's end-to-end latencies.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quant  # noqa: E402  bench/quant.py (reads --avx2 from sys.argv before any library loads)

import kiln  # noqa: E402
from kiln import zoo  # noqa: E402
from kiln.kernels.cpu import cpu_features  # noqa: E402


def conv_kind(w_shape: list[int], group: int, stride: int) -> str:
    """A convolution's kind from its weight [O, C/g, kh, kw], groups and stride."""
    o, c_per_group, kh, kw = w_shape
    c = c_per_group * group
    if c <= 4:
        return f"stem {kh}x{kw}/{stride}"
    if group > 1 and group == c:
        return f"depthwise {kh}x{kw}/{stride}"
    if kh == kw == 1:
        return "1x1 expand" if o > c else "1x1 project"
    return f"{kh}x{kw} dense"


def kiln_steps(engine, feeds: dict, runs: int) -> list[tuple[str, str, str, float]]:
    """(name, kind, tactic, ms) of every step: the calling thread's CPU time of its kernel, median of `runs` eager
    runs."""
    import torch

    program = engine.program
    samples: list[list[float]] = [[] for _ in program.steps]

    def timed_kernel(i, fn):
        def call(ctx, *args, **kw):
            t0 = time.thread_time()
            result = fn(ctx, *args, **kw)
            samples[i].append(1000 * (time.thread_time() - t0))
            return result
        return call

    timed = program.with_kernels(timed_kernel)
    inputs = engine.program_inputs(feeds)
    with torch.inference_mode():
        timed.run(inputs)
        for s in samples:
            s.clear()
        for _ in range(runs):
            timed.run(inputs)
    weights, constants = engine.plan.weights, engine.plan.program.constants
    rows = []
    for spec, s in zip(program.spec.steps, samples):
        kind = spec.op_type
        if spec.op_type == "QConv":
            w = weights[constants[spec.inputs[3]]]
            kind = conv_kind(list(w.shape), int(spec.attributes.get("group", 1)),
                             int(spec.attributes.get("strides", [1, 1])[0]))
        rows.append((spec.name, kind, spec.tactic or "default", statistics.median(s) if s else 0.0))
    return rows


def ort_nodes(model: Path, feeds: dict, runs: int, kinds: dict[str, str]) -> list[tuple[str, float]]:
    """(kind, ms) of every onnxruntime node: its profiler's kernel time, mean over `runs`. Its fused nodes keep the
    QDQ model's node names (node_Conv_809 -> node_Conv_809_token_1), as kiln's steps do: a convolution's kind is
    that of kiln's step of the same name (`kinds`; its weight is prepacked, the profile gives no shape)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = 1, 1
    options.enable_profiling = True
    options.profile_file_prefix = str(model.with_suffix(""))
    session = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
    for _ in range(runs):
        session.run(None, feeds)
    events = json.loads(Path(session.end_profiling()).read_text())
    rows = []
    for e in events:
        if e.get("cat") != "Node" or not e["name"].endswith("_kernel_time"):
            continue
        name = re.sub(r"(_token_\d+)?_kernel_time$", "", e["name"])
        kind = kinds.get(name, e["args"]["op_name"]) if e["args"]["op_name"] in ("QLinearConv", "Conv") \
            else e["args"]["op_name"]
        rows.append((kind, e["dur"] / 1e3 / runs))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="mobilenet_v2", choices=sorted(quant.MODELS))
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--own", action="store_true", help="kiln's own PTQ engine too (entropy, 8 crops)")
    parser.add_argument("--avx2", action="store_true", help="bench/quant.py's cap: every library on AVX2")
    parser.add_argument("--without", default="", help="tactics left out of every kiln build (comma-separated "
                        "names): the engines as they were before a tactic came")
    args = parser.parse_args(argv)
    for name in [t for t in args.without.split(",") if t]:
        from kiln.tactics import registry

        registry.load_device("cpu")
        if registry.get(name) is None:
            parser.error(f"--without {name}: no such tactic")
        registry.unregister(name)
    import torch

    torch.set_num_threads(1)
    label, seq = quant.MODELS[args.model]
    exported = zoo.export(args.model, seq=seq) if seq else zoo.export(args.model)
    calibration = quant.inputs_for(exported, 8, seed=1)
    feeds = quant.inputs_for(exported, 1, seed=2)[0]
    work = Path(tempfile.mkdtemp(prefix="kiln-qkinds-"))
    qdq = work / "qdq.onnx"
    quant.ort_qdq(exported.path, calibration, qdq, seq is not None)
    print(f"# {label}, 1 thread, {cpu_features.describe()}, load {os.getloadavg()[0]:.2f}")
    engines = {"kiln (ORT QDQ)": kiln.build(str(qdq))}
    if args.own:
        engines["kiln int8"] = kiln.build(str(exported.path), precision="int8", calibration=calibration)
    steps = {peer: kiln_steps(engine, feeds, args.runs) for peer, engine in engines.items()}
    ort_ms = collections.defaultdict(float)
    ort_count = collections.Counter()
    for kind, ms in ort_nodes(qdq, feeds, args.runs, {name: kind for name, kind, _, _ in steps["kiln (ORT QDQ)"]}):
        ort_ms[kind] += ms
        ort_count[kind] += 1
    for peer in engines:
        ms_by = collections.defaultdict(float)
        count = collections.Counter()
        tactics = collections.defaultdict(collections.Counter)
        for _name, kind, tactic, ms in steps[peer]:
            ms_by[kind] += ms
            count[kind] += 1
            tactics[kind][tactic.removeprefix("cpu.")] += 1
        kinds = sorted(set(ms_by) | set(ort_ms), key=lambda k: -(ms_by.get(k, 0) + ort_ms.get(k, 0)))
        print(f"\n## {peer} vs onnxruntime int8 (kiln: thread clock, eager steps; onnxruntime: its profiler), "
              f"load {os.getloadavg()[0]:.2f}\n")
        print("| kind | kiln steps | kiln ms | ORT nodes | ORT ms | kiln / ORT | kiln tactics |")
        print("|---|---|---|---|---|---|---|")
        for k in kinds:
            a, b = ms_by.get(k, 0.0), ort_ms.get(k, 0.0)
            ratio = f"{a / b:.2f}" if a and b else "-"
            used = ", ".join(f"{t} x{n}" for t, n in tactics[k].most_common())
            print(f"| {k} | {count[k]} | {a:.3f} | {ort_count[k] // args.runs} | {b:.3f} | {ratio} | {used} |")
        total_k, total_o = sum(ms_by.values()), sum(ort_ms.values())
        print(f"| total | {sum(count.values())} | {total_k:.3f} | {sum(ort_count.values()) // args.runs} | "
              f"{total_o:.3f} | {total_k / total_o:.2f} | |")


if __name__ == "__main__":
    main()
