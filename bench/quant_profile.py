"""Where an INT8 CPU engine's time goes: kiln per layer, oneDNN's kernels (ISA), onnxruntime per node.

    python bench/quant_profile.py --model resnet50 --threads 1
    python bench/quant_profile.py --model mobilenet_v2 --peers "kiln int8 (ORT QDQ)"

Builds the peers of bench/quant.py (same calibration, same onnxruntime QDQ model), then for each kiln engine:
the per-step profile (median ms of eager runs, summed by op type and tactic) and one run under oneDNN's verbose
mode (`dnnl_set_verbose(1)`: every executed primitive with its implementation, e.g. `brgconv:avx512_core_vnni`,
and its time), summed by primitive kind and implementation; for onnxruntime int8, its own profiler's node times
summed by op type. What the issue-12 CPU targets are missed by shows here, not in an end-to-end latency.

    python bench/quant_profile.py --gpu-log DIR/quant_gpu.log

The GPU engines' per-layer profiles are taken on the device by `bench/quant_gpu.py --profile` (its engine rows,
each in its own process, in DIR/quant_gpu.log); this prints them as per-layer tables against kiln fp16, the
largest loss first (quant_gpu.layer_gaps), and the 8-bit layers left on a float tactic with every candidate's
time or why it was dropped.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quant  # noqa: E402  bench/quant.py: the models, calibration and onnxruntime QDQ model

import kiln  # noqa: E402
from kiln import zoo  # noqa: E402
from kiln.kernels.cpu import onednn  # noqa: E402
from kiln.runtime import profiler  # noqa: E402


def summed(rows: list[tuple[str, float]]) -> list[str]:
    """`| key | calls | ms | % |` lines, largest first."""
    total = collections.defaultdict(float)
    count = collections.Counter()
    for key, ms in rows:
        total[key] += ms
        count[key] += 1
    grand = sum(total.values()) or 1.0
    lines = ["| what | calls | ms | % |", "|---|---|---|---|"]
    for key, ms in sorted(total.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {key} | {count[key]} | {ms:.3f} | {100 * ms / grand:.1f} |")
    return lines + [f"| total | {sum(count.values())} | {grand:.3f} | 100 |"]


def onednn_exec(run) -> list[tuple[str, float]]:
    """(kind implementation, ms) of every oneDNN primitive executed by `run()`, from verbose lines on stdout."""
    lib = onednn.load().lib
    sys.stdout.flush()
    with tempfile.TemporaryFile(mode="w+") as capture:
        saved = os.dup(1)
        os.dup2(capture.fileno(), 1)
        try:
            lib.dnnl_set_verbose(1)
            run()
        finally:
            lib.dnnl_set_verbose(0)
            os.dup2(saved, 1)
            os.close(saved)
        capture.seek(0)
        text = capture.read()
    rows = []
    for line in text.splitlines():
        fields = line.split(",")
        if not fields[0].startswith("onednn_verbose") or "exec" not in fields[1:3]:
            continue
        at = fields.index("exec")  # exec,cpu,<kind>,<implementation>,...,<ms>
        rows.append((f"{fields[at + 2]} {fields[at + 3]}", float(fields[-1])))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="resnet50", choices=sorted(quant.MODELS))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--batch", type=int, default=1, help="bench/quant.py's batch (1)")
    parser.add_argument("--peers", default="kiln int8,kiln int8 (ORT QDQ)")
    parser.add_argument("--calibrator", default="entropy")
    parser.add_argument("--avx2", action="store_true", help="bench/quant.py's: every library capped to AVX2 (read "
                        "from sys.argv when bench/quant.py is imported)")
    parser.add_argument("--gpu-log", help="a quant_gpu.log of GPU engine rows taken with --profile: print their "
                                          "per-layer gaps vs kiln fp16 and exit")
    args = parser.parse_args(argv)
    if args.gpu_log:
        import quant_gpu  # bench/quant_gpu.py
        quant_gpu.show_profiles(args.gpu_log)
        return
    import onnxruntime as ort
    import torch

    torch.set_num_threads(args.threads)
    onednn.load().lib.dnnl_set_verbose.argtypes = [ctypes.c_int]
    label, seq = quant.MODELS[args.model]
    exported = zoo.export(args.model, batch=args.batch, seq=seq) if seq else zoo.export(args.model, batch=args.batch)
    calibration = quant.inputs_for(exported, 8, seed=1)
    feeds = quant.inputs_for(exported, 1, seed=2)[0]
    work = Path(tempfile.mkdtemp(prefix="kiln-qprof-"))
    qdq = work / "qdq.onnx"
    quant.ort_qdq(exported.path, calibration, qdq, seq is not None)
    builds = {"kiln fp32": lambda: kiln.build(str(exported.path)),
              "kiln int8": lambda: kiln.build(str(exported.path), precision="int8", calibration=calibration,
                                              calibrator=args.calibrator),
              "kiln int8 (ORT QDQ)": lambda: kiln.build(str(qdq))}
    print(f"# {label} batch {args.batch}, {args.threads} thread(s), load {os.getloadavg()[0]:.2f}")
    for peer in [p for p in args.peers.split(",") if p]:
        engine = builds[peer]()
        inputs = engine.program_inputs(feeds)
        layers = profiler.profile_layers(engine.program, inputs, runs=args.runs)
        print(f"\n## {peer}: kiln steps (median of {args.runs} eager runs), by op type and tactic\n")
        print("\n".join(summed([(f"{x['op_type']} [{x['tactic']}]", x["ms"]) for x in layers])))
        print("\nslowest steps:\n")
        for x in sorted(layers, key=lambda x: -x["ms"])[:12]:
            print(f"- {x['ms']:.3f} ms {x['name']} {x['op_type']} [{x['tactic']}]")
        engine.run(feeds)
        print(f"\n## {peer}: oneDNN primitives executed in one run (verbose), by kind and implementation\n")
        print("\n".join(summed(onednn_exec(lambda: engine.run(feeds)))))
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = args.threads, 1
    options.enable_profiling = True
    options.profile_file_prefix = str(work / "ort")
    session = ort.InferenceSession(str(qdq), options, providers=["CPUExecutionProvider"])
    for _ in range(args.runs + 1):
        session.run(None, feeds)
    events = json.loads(Path(session.end_profiling()).read_text())
    nodes = [(e["args"]["op_name"], e["dur"] / 1e3 / (args.runs + 1)) for e in events
             if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    print(f"\n## onnxruntime int8 (its QDQ model): node time per run (mean of {args.runs + 1}), by op type\n")
    print("\n".join(summed(nodes)))
    print(f"\nload after {os.getloadavg()[0]:.2f}; median step ms: kiln sums above, onnxruntime means")


if __name__ == "__main__":
    main()
