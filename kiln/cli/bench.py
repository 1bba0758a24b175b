"""`kiln bench`: time an engine (trtexec-like latency statistics), optionally side by side with
onnxruntime on the same inputs; on CUDA also the H2D / compute / D2H split. Only --against
onnxruntime imports onnxruntime (and onnx, for an IR-version fallback)."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

import kiln
from kiln.cli.common import console, make_inputs, text
from kiln.errors import KilnError
from kiln.ir import dtypes
from kiln.plan.spec import EnginePlan
from kiln.runtime import profiler
from kiln.runtime.rss import PeakMemory


def _onnxruntime_session(onnx_path: Path, device_type: str):
    try:
        import onnxruntime as ort
    except ImportError:
        raise KilnError("--against onnxruntime: onnxruntime is not installed (pip install onnxruntime)") from None

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = torch.get_num_threads()  # same thread count as kiln's kernels
    options.log_severity_level = 3
    providers = ["CPUExecutionProvider"]
    if device_type == "cuda" and "CUDAExecutionProvider" in ort.get_available_providers():
        providers.insert(0, "CUDAExecutionProvider")
    try:
        return ort.InferenceSession(str(onnx_path), options, providers=providers)
    except Exception as e:  # noqa: BLE001  ORT raises its own exception types for bad models
        supported = re.search(r"max supported IR version: (\d+)", str(e))
        if supported is None:
            raise KilnError(f"onnxruntime cannot load {onnx_path}: {type(e).__name__}: {e}") from None
    # A newer onnx wrote the file than this onnxruntime reads. The IR bump seldom touches the
    # ops of a graph, so try once more with the IR version onnxruntime names, and say so.
    import onnx

    model = onnx.load(str(onnx_path))
    print(f"note: {onnx_path} has IR version {model.ir_version}; onnxruntime {ort.__version__} reads up to "
          f"{supported.group(1)}, so it runs a copy marked {supported.group(1)}", file=sys.stderr)
    model.ir_version = int(supported.group(1))
    try:
        return ort.InferenceSession(model.SerializeToString(), options, providers=providers)
    except Exception as e:  # noqa: BLE001
        raise KilnError(f"onnxruntime cannot load {onnx_path}: {type(e).__name__}: {e}") from None


def _source_onnx(plan: EnginePlan, args: argparse.Namespace) -> Path:
    if args.onnx:
        path = Path(args.onnx)
    else:
        recorded = (plan.header.get("source") or {}).get("path")
        if not recorded:
            raise KilnError("--against onnxruntime needs the ONNX model: the engine does not record "
                            "where it was built from, so pass --onnx model.onnx")
        path = Path(recorded)
    if not path.is_file():
        raise KilnError(f"--against onnxruntime: ONNX model {path} not found; pass --onnx model.onnx")
    return path


def _max_difference(a: dict[str, Any], b: dict[str, Any]) -> str:
    worst = 0.0
    for name, x in a.items():
        y = b.get(name)
        if y is None or isinstance(x, list) or np.asarray(x).dtype.kind not in "biuf":
            continue
        x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
        if x.shape != y.shape:
            return f"shape {list(x.shape)} vs {list(y.shape)}"
        if x.size:
            worst = max(worst, float(np.nanmax(np.abs(x - y))))
    return f"{worst:.3g}"


def _on_device(value: Any, device: torch.device) -> Any:
    converted = dtypes.numpy_to_torch(np.asarray(value))  # strings and int4 stay numpy
    return converted.to(device) if isinstance(converted, torch.Tensor) else converted


def _transfer_split(context, host_feeds: dict, device_feeds: dict, warmup: int, iterations: int = 50) -> str:
    """trtexec's H2D / GPU compute / D2H split: median ms of each, from pinned host buffers."""
    import statistics

    pinned = {k: torch.from_numpy(np.ascontiguousarray(v)).pin_memory() for k, v in host_feeds.items()
              if isinstance(v, np.ndarray) and v.dtype != object}
    outputs = context.run(device_feeds)

    def h2d():
        for v in pinned.values():
            v.to("cuda", non_blocking=True)

    def d2h():
        for v in outputs.values():
            if isinstance(v, torch.Tensor):
                v.to("cpu")

    medians = []
    for fn in (h2d, lambda: context.run(device_feeds), d2h):
        samples = profiler.time_runs(fn, warmup=warmup, iterations=iterations, duration=None,
                                     sync=torch.cuda.synchronize)
        medians.append(1000 * statistics.median(samples))
    return (f"median H2D {medians[0]:.3f} ms | GPU compute {medians[1]:.3f} ms | D2H {medians[2]:.3f} ms "
            "(pinned host buffers)")


def _memory_line(memory: dict[str, int], method: str) -> str:
    """Peak RSS growth per phase: a runtime's load (its packed weights and libraries) and its timed runs
    (above what it held loaded: activations, arenas, scratch). One process: a runtime's load also pays for
    the libraries it is the first to load; bench/memory.py measures each runtime in a process of its own."""
    parts = [f"{name} +{v / 2**20:.1f} MiB" for name, v in memory.items()]
    bound = " (ru_maxrss: lower bounds)" if method == "ru_maxrss" else ""
    return "peak RSS growth: " + ", ".join(parts) + bound


def cmd_bench(args: argparse.Namespace) -> int:
    from rich.table import Table

    if args.iterations is not None and args.iterations < 1:
        raise KilnError("--iterations must be at least 1")
    if args.duration is not None and args.duration <= 0:
        raise KilnError("--duration must be positive")
    memory: dict[str, int] = {}  # peak RSS growth of each phase (kiln/runtime/rss.py)
    phase = PeakMemory.start()
    engine = kiln.load(args.engine)
    memory["kiln load"] = phase.delta()
    if args.random_shapes or args.shapes_from:
        return _bench_stream(engine, args)
    feeds = make_inputs(engine.plan, args)
    session = None
    if args.against == "onnxruntime":
        phase = PeakMemory.start()
        session = _onnxruntime_session(_source_onnx(engine.plan, args), engine.device.type)
        memory["onnxruntime load"] = phase.delta()
    iterations, duration = args.iterations, args.duration
    if iterations is None and duration is None:
        iterations, duration = 10, 3.0  # trtexec's defaults: at least 10 runs and 3 seconds

    sync = profiler.device_sync(engine.device)
    if engine.device.type == "cuda":  # inputs already on the GPU: time the engine, not the copies
        kiln_feeds = {k: _on_device(v, engine.device) for k, v in feeds.items()}
    else:
        kiln_feeds = feeds
    context = engine.create_execution_context()
    results: list[tuple[str, profiler.LatencyStats, str]] = []
    phase = PeakMemory.start()
    samples = profiler.time_runs(lambda: context.run(kiln_feeds), warmup=args.warmup,
                                 iterations=iterations, duration=duration, sync=sync)
    memory["kiln runs"] = phase.delta()
    results.append(("kiln", profiler.LatencyStats.from_samples(samples), "-"))
    if session is not None:
        wanted = {i.name for i in session.get_inputs()}
        ort_feeds = {k: v for k, v in feeds.items() if k in wanted}
        ort_names = [o.name for o in session.get_outputs()]
        phase = PeakMemory.start()
        samples = profiler.time_runs(lambda: session.run(None, ort_feeds), warmup=args.warmup,
                                     iterations=iterations, duration=duration)
        memory["onnxruntime runs"] = phase.delta()
        reference = dict(zip(ort_names, session.run(None, ort_feeds)))
        difference = _max_difference(engine.run(feeds), reference)
        provider = session.get_providers()[0].removesuffix("ExecutionProvider")
        results.append((f"onnxruntime ({provider})", profiler.LatencyStats.from_samples(samples), difference))

    threads = torch.get_num_threads()
    table = Table(title=f"{Path(args.engine).name} on {engine.device} ({threads} threads); latency in ms",
                  title_justify="left")
    for column in ("runtime", "runs", "min", "mean", "median", "p90", "p95", "p99", "qps", "vs kiln",
                   "max |diff|"):
        table.add_column(column, justify="left" if column == "runtime" else "right")
    base = results[0][1].mean
    for name, s, difference in results:
        ms = [f"{1000 * v:.3f}" for v in (s.min, s.mean, s.median, s.p90, s.p95, s.p99)]
        table.add_row(name, str(s.count), *ms, f"{s.qps:.1f}", f"{s.mean / base:.2f}x", difference)
    out = console()
    out.print(table)
    out.print(text(_memory_line(memory, phase.method)))
    if engine.device.type == "cuda":
        out.print(text(_transfer_split(context, feeds, kiln_feeds, args.warmup)))
    if args.json:
        doc = {name.split(" ")[0]: s.to_json() for name, s, _ in results} | {"peak_rss_growth_bytes": memory}
        Path(args.json).write_text(json.dumps(doc, indent=2))
    program_inputs = engine.program_inputs(feeds)
    if args.dump_profile:
        profile = Table(title="per-layer profile (median ms, eager)", title_justify="left")
        for column in ("#", "layer", "op", "tactic", "ms", "%"):
            profile.add_column(column, justify="right" if column in ("#", "ms", "%") else "left")
        layers = profiler.profile_layers(engine.program, program_inputs)
        total = sum(layer["ms"] for layer in layers) or 1.0
        for i, layer in enumerate(layers):
            profile.add_row(str(i), text(layer["name"]), text(layer["op_type"]), text(layer["tactic"]),
                            f"{layer['ms']:.3f}", f"{100 * layer['ms'] / total:.1f}")
        out.print(profile)
    if not args.no_overhead:
        per_layer = profiler.dispatch_overhead(engine.program, program_inputs)
        if per_layer is not None:
            layers = len(engine.plan.program.steps)
            out.print(text(
                f"python dispatch overhead: ~{1e6 * per_layer:.1f} us per layer x {layers} layers "
                f"= ~{1000 * per_layer * layers:.3f} ms of the {1000 * base:.3f} ms mean"
            ))
    return 0


def _bench_stream(engine, args: argparse.Namespace) -> int:
    """A stream of request shapes (bench_stream.py): every call timed, first calls included."""
    from rich.table import Table

    from kiln.cli import bench_stream

    stream = bench_stream.shape_stream(engine.inputs, random_shapes=args.random_shapes,
                                       shapes_from=args.shapes_from, requests=args.requests, seed=args.seed)
    rng = np.random.default_rng(args.seed)
    host = [bench_stream.request_inputs(engine.inputs, shapes, rng) for shapes in stream]
    context = engine.create_execution_context()
    cuda = engine.device.type == "cuda"
    on_device = [{k: _on_device(v, engine.device) for k, v in feeds.items()} for feeds in host] if cuda else host
    by_id = {id(s): f for s, f in zip(stream, on_device)}
    results = [("kiln", bench_stream.replay(context.run, stream, lambda shapes: by_id[id(shapes)], engine.device))]
    if args.against == "onnxruntime":
        session = _onnxruntime_session(_source_onnx(engine.plan, args), engine.device.type)
        wanted = {i.name for i in session.get_inputs()}
        host_by_id = {id(s): {k: v for k, v in f.items() if k in wanted} for s, f in zip(stream, host)}
        results.append(("onnxruntime", bench_stream.replay(lambda feeds: session.run(None, feeds), stream,
                                                           lambda shapes: host_by_id[id(shapes)], None)))
    table = Table(title=f"{Path(args.engine).name} on {engine.device}: {len(stream)} requests, "
                        f"{results[0][1].signatures} distinct shapes; latency in ms", title_justify="left")
    for column in ("runtime", "p50", "p99", "p99/p50", "p50 warm", "p99 warm", "p99/p50 warm", "first call",
                   "total s", "memory"):
        table.add_column(column, justify="left" if column in ("runtime", "memory") else "right")
    for name, r in results:
        a, w = r.all_calls, r.warm_calls or r.all_calls
        table.add_row(name, f"{1000 * a.median:.3f}", f"{1000 * a.p99:.3f}", f"{a.p99 / a.median:.2f}",
                      f"{1000 * w.median:.3f}", f"{1000 * w.p99:.3f}", f"{w.p99 / w.median:.2f}",
                      f"{r.first_call_ms:.3f}" if r.first_call_ms is not None else "-", f"{a.total:.2f}", r.memory)
    out = console()
    out.print(table)
    out.print(text("warm: the second half of the stream; first call: mean of the calls meeting a shape first"))
    if context.runner is not None:
        s = context.runner.stats
        out.print(text(f"CUDA graphs: {s.captures} captured, {s.replays} replays, {s.evictions} evicted, "
                       f"{s.eager_runs} eager runs; {s.graphs} held ({s.graph_bytes / 2**20:.0f} MiB, peak "
                       f"{s.peak_graph_bytes / 2**20:.0f} MiB)"))
        for signature, reason in list(s.eager_reasons.items())[:3]:
            out.print(text(f"  eager {signature}: {reason}"))
    if context.buckets is not None:
        out.print(text(f"shape buckets on: {', '.join(sorted(context.buckets.symbols))} padded"))
    if args.json:
        Path(args.json).write_text(json.dumps({n: r.to_json() for n, r in results}
                                              | ({"graphs": context.runner.stats.to_json()} if context.runner else {}),
                                              indent=2, default=str))
    return 0
