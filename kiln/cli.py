"""The `kiln` command line: build | run | bench | inspect.

    kiln build model.onnx -o model.kiln [--opt-level N] [--shapes x:1x3x224x224] [--verbose]
    kiln run model.kiln [--inputs in.npz] [--outputs out.npz] [--shapes ...]
    kiln bench model.kiln [--against onnxruntime] [--onnx model.onnx] [--warmup N]
               [--iterations N | --duration S] [--shapes ...]
    kiln inspect model.kiln [--json]

A kiln error prints one line-led message on stderr and exits 1, never a traceback. `run`,
`bench` and `inspect` load engines through the lean runtime: only `build` imports the ONNX
frontend and the passes (and `bench --against onnxruntime` imports onnxruntime).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import kiln
from kiln.engine import format as engine_format
from kiln.engine.plan import Binding, EnginePlan
from kiln.errors import KilnError
from kiln.ir import dtypes
from kiln.runtime import profiler

# ---------------------------------------------------------------------------- helpers


def _console(stderr: bool = False):
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    # Pipes and captured output get a wide fixed width, so tables do not wrap names.
    width = None if stream.isatty() else 160
    return Console(stderr=stderr, width=width, highlight=False)


def _text(value: Any):
    from rich.text import Text

    return Text(str(value))  # never parsed as markup: shapes like "[batch, 3]" stay literal


def _fmt_bytes(n: int | float | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _fmt_shape(shape: list | None) -> str:
    if shape is None:
        return "?"
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


def _parse_shapes(specs: list[str] | None) -> dict[str, list[int]]:
    """`--shapes x:1x3x224x224,mask:1x128` (repeatable) -> {"x": [1, 3, 224, 224], ...}."""
    shapes: dict[str, list[int]] = {}
    for spec in specs or []:
        for item in filter(None, (s.strip() for s in spec.split(","))):
            name, sep, dims = item.rpartition(":")
            if not sep or not name:
                raise KilnError(f"--shapes {item!r}: expected NAME:DIMxDIMx..., e.g. input:1x3x224x224")
            try:
                shapes[name] = [int(d) for d in dims.lower().split("x")] if dims else []
            except ValueError:
                raise KilnError(
                    f"--shapes {item!r}: dimensions must be integers separated by 'x', e.g. {name}:1x3x224x224"
                ) from None
            if any(d < 0 for d in shapes[name]):
                raise KilnError(f"--shapes {item!r}: dimensions must not be negative")
    return shapes


def _concrete_shape(binding: Binding, given: dict[str, list[int]], defaults: dict[str, list[int]],
                    symbols: dict[str, int]) -> list[int]:
    """A binding's shape with every symbolic dim resolved: --shapes, then the build's shapes, then 1."""
    if binding.name in given:
        return given[binding.name]
    if binding.shape is None:
        if binding.name in defaults:
            return defaults[binding.name]
        raise KilnError(
            f"input {binding.name!r} has unknown rank; give its shape with --shapes {binding.name}:DIMxDIM..."
        )
    built = defaults.get(binding.name)
    if built is not None and len(built) != len(binding.shape):
        built = None
    shape = []
    for axis, dim in enumerate(binding.shape):
        if isinstance(dim, int):
            shape.append(dim)
        elif isinstance(dim, str):
            shape.append(symbols.get(dim, 1))
        else:  # an unnamed dynamic dim
            shape.append(built[axis] if built else 1)
    return shape


def _symbols_from(bindings: list[Binding], shapes: dict[str, list[int]]) -> dict[str, int]:
    """Symbol values implied by explicit shapes: --shapes x:4x3 on x: [batch, 3] sets batch=4."""
    symbols: dict[str, int] = {}
    for b in bindings:
        given = shapes.get(b.name)
        if given is None or b.shape is None or len(given) != len(b.shape):
            continue
        for dim, n in zip(b.shape, given):
            if isinstance(dim, str):
                symbols.setdefault(dim, n)
    return symbols


def _random_array(binding: Binding, shape: list[int], rng: np.random.Generator) -> np.ndarray:
    if binding.kind != "tensor":
        raise KilnError(
            f"input {binding.name!r} is a {binding.kind}; `kiln run` cannot make one up: pass --inputs"
        )
    name = binding.dtype or "float"
    dt = dtypes.BY_NAME[name]
    if name == "string":
        return np.array([f"kiln{i}" for i in range(int(np.prod(shape)))], dtype=object).reshape(shape)
    if name == "bool":
        return rng.random(shape) < 0.5
    if name.startswith("complex"):
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dt.numpy)
    if dt.is_float:
        return rng.standard_normal(shape).astype(np.float32).astype(dt.numpy)
    # Integers: small and non-negative, so they are valid indices, counts or token ids.
    return rng.integers(0, 4, size=shape).astype(dt.numpy)


def _make_inputs(plan: EnginePlan, args: argparse.Namespace) -> dict[str, Any]:
    bindings = plan.inputs
    if getattr(args, "inputs", None):
        path = Path(args.inputs)
        if not path.is_file():
            raise KilnError(f"--inputs {path}: no such file")
        try:
            with np.load(path, allow_pickle=False) as npz:
                return {k: npz[k] for k in npz.files}
        except (OSError, ValueError) as e:
            raise KilnError(f"--inputs {path}: not a readable .npz file ({e})") from None
    given = _parse_shapes(args.shapes)
    unknown = sorted(set(given) - {b.name for b in bindings})
    if unknown:
        raise KilnError(f"--shapes names {unknown}, but the engine's inputs are {[b.name for b in bindings]}")
    defaults = plan.header.get("build_config", {}).get("shapes", {}) or {}
    symbols = _symbols_from(bindings, defaults) | _symbols_from(bindings, given)  # --shapes wins
    rng = np.random.default_rng(args.seed)
    return {b.name: _random_array(b, _concrete_shape(b, given, defaults, symbols), rng) for b in bindings}


def _savable(value: Any) -> np.ndarray:
    array = np.asarray(value)
    if array.dtype == object:
        return array.astype(str)
    if array.dtype.type.__module__ != "numpy":  # ml_dtypes (bfloat16, float8, int4): npz cannot hold them
        return array.astype(np.float32 if dtypes.from_numpy(array.dtype).is_float else np.int8)
    return array


def _save_npz(path: Path, arrays: dict[str, Any]) -> None:
    """Write to a temporary file next to `path`, then rename: never a half-written file."""
    flat: dict[str, np.ndarray] = {}
    for name, value in arrays.items():
        if value is None:
            continue
        if isinstance(value, list):
            for i, item in enumerate(value):
                flat[f"{name}[{i}]"] = _savable(item)
        else:
            flat[name] = _savable(value)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **flat)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _describe_value(value: Any) -> tuple[str, str, str]:
    """(dtype, shape, first values) for the outputs table."""
    if value is None:
        return "none", "-", "(empty optional)"
    if isinstance(value, list):
        return "sequence", f"{len(value)} item(s)", ", ".join(_describe_value(v)[1] for v in value[:4])
    array = np.asarray(value)
    flat = array.reshape(-1)[:6]
    if array.dtype.kind == "f" or array.dtype.type.__module__ != "numpy":
        shown = ", ".join(f"{float(v):.6g}" for v in flat)
    else:
        shown = ", ".join(str(v) for v in flat.tolist())
    if array.size > 6:
        shown += ", ..."
    name = dtypes.from_numpy(array.dtype).name if array.dtype.kind not in "US" else "string"
    return name, _fmt_shape(list(array.shape)), shown


# ---------------------------------------------------------------------------- build


_BUILD_STAGES = ["importing", "optimizing", "lowering", "planning memory"]


def cmd_build(args: argparse.Namespace) -> int:
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    source = Path(args.model)
    if not source.is_file():
        raise KilnError(f"{source}: no such model file")
    output = Path(args.output) if args.output else source.with_suffix(".kiln")
    if output.resolve() == source.resolve():
        raise KilnError(f"-o {output}: the engine would overwrite the model; choose another path")
    if output.is_dir():
        raise KilnError(f"-o {output}: is a folder; give the engine file's path")
    options = {
        "opt_level": args.opt_level,
        "shapes": _parse_shapes(args.shapes),
        "verbose": args.verbose,
        "device": args.device,
        "precision": args.precision,
        "timing_cache": args.timing_cache,
        "layer_precision": {name: "fp32" for name in args.pin_fp32 or []},
    }
    err = _console(stderr=True)
    t0 = time.perf_counter()
    with Progress(SpinnerColumn(), TextColumn("{task.description}", markup=False), TimeElapsedColumn(),
                  console=err, transient=True, disable=not err.is_terminal) as progress:
        task = progress.add_task(f"building {source.name}", total=None)
        last = [t0, None]

        def on_stage(stage: str) -> None:
            now = time.perf_counter()
            if last[1] is not None and args.verbose:
                progress.console.print(_text(f"  {last[1]:<18} {1000 * (now - last[0]):9.1f} ms"))
            last[0], last[1] = now, (None if stage == "done" else stage)
            step = _BUILD_STAGES.index(stage) + 1 if stage in _BUILD_STAGES else None
            label = f"[{step}/{len(_BUILD_STAGES)}] " if step else ""
            progress.update(task, description=f"building {source.name}: {label}{stage}")

        engine = kiln.build(str(source), progress=on_stage, **options)
        on_stage(f"writing {output.name}")
        engine.save(output)
        on_stage("done")
    build_seconds = time.perf_counter() - t0
    _print_build_summary(engine.plan, output, build_seconds)
    return 0


def _print_build_summary(plan: EnginePlan, output: Path, seconds: float) -> None:
    from rich.table import Table

    header = plan.header
    memory = header.get("memory", {})
    peak, naive = memory.get("peak_bytes"), memory.get("naive_bytes")
    saving = f" ({naive / peak:.1f}x less)" if peak and naive and naive > peak else ""
    unknown = memory.get("unknown") or []
    activations = f"planned peak {_fmt_bytes(peak)} vs naive sum {_fmt_bytes(naive)}{saving}"
    if unknown:
        activations += f"; {len(unknown)} value(s) of unknown size not counted"
    table = Table(title=f"built {output}", show_header=False, box=None, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    rows = [
        ("engine", f"{output} ({_fmt_bytes(output.stat().st_size)})"),
        ("layers", str(len(plan.program.steps))),
        ("inputs", ", ".join(f"{b.name}: {b.describe()}" for b in plan.inputs)),
        ("outputs", ", ".join(f"{b.name}: {b.describe()}" for b in plan.outputs)),
        ("weights", _fmt_bytes(header.get("weights_bytes"))),
        ("activations", activations),
        ("device", header.get("device", {}).get("name", "?")),
        ("build time", f"{seconds:.2f} s"),
    ]
    for key, value in rows:
        table.add_row(key, _text(value))
    _console().print(table)


# ---------------------------------------------------------------------------- run


def cmd_run(args: argparse.Namespace) -> int:
    from rich.table import Table

    engine = kiln.load(args.engine)
    feeds = _make_inputs(engine.plan, args)
    t0 = time.perf_counter()
    outputs = engine.run(feeds)
    seconds = time.perf_counter() - t0
    out = _console()
    table = Table(title=f"{Path(args.engine).name}: {len(outputs)} output(s) in {1000 * seconds:.2f} ms",
                  title_justify="left")
    for column in ("output", "dtype", "shape", "values"):
        table.add_column(column)
    for name, value in outputs.items():
        table.add_row(_text(name), *map(_text, _describe_value(value)))
    out.print(table)
    if args.outputs:
        _save_npz(Path(args.outputs), outputs)
        out.print(_text(f"outputs written to {args.outputs}"))
    if args.save_inputs:
        _save_npz(Path(args.save_inputs), feeds)
        out.print(_text(f"inputs written to {args.save_inputs}"))
    return 0


# ---------------------------------------------------------------------------- bench


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


def cmd_bench(args: argparse.Namespace) -> int:
    from rich.table import Table

    if args.iterations is not None and args.iterations < 1:
        raise KilnError("--iterations must be at least 1")
    if args.duration is not None and args.duration <= 0:
        raise KilnError("--duration must be positive")
    engine = kiln.load(args.engine)
    feeds = _make_inputs(engine.plan, args)
    session = None
    if args.against == "onnxruntime":
        session = _onnxruntime_session(_source_onnx(engine.plan, args), engine.device.type)
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
    samples = profiler.time_runs(lambda: context.run(kiln_feeds), warmup=args.warmup,
                                 iterations=iterations, duration=duration, sync=sync)
    results.append(("kiln", profiler.LatencyStats.from_samples(samples), "-"))
    if session is not None:
        wanted = {i.name for i in session.get_inputs()}
        ort_feeds = {k: v for k, v in feeds.items() if k in wanted}
        ort_names = [o.name for o in session.get_outputs()]
        samples = profiler.time_runs(lambda: session.run(None, ort_feeds), warmup=args.warmup,
                                     iterations=iterations, duration=duration)
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
    out = _console()
    out.print(table)
    if engine.device.type == "cuda":
        out.print(_text(_transfer_split(context, feeds, kiln_feeds, args.warmup)))
    if args.json:
        doc = {name.split(" ")[0]: s.to_json() for name, s, _ in results}
        Path(args.json).write_text(json.dumps(doc, indent=2))
    # The program's own inputs: on the device, cast as the engine casts at its boundary.
    from kiln.runtime.engine import _to_runtime

    program_inputs = [_to_runtime(feeds[b.name], b, engine.device) for b in engine.inputs]
    internal = engine.internal_dtype
    program_inputs = [a.to(internal[b.dtype]) if b.dtype in internal else a
                      for a, b in zip(program_inputs, engine.inputs)]
    if args.dump_profile:
        profile = Table(title="per-layer profile (median ms, eager)", title_justify="left")
        for column in ("#", "layer", "op", "tactic", "ms", "%"):
            profile.add_column(column, justify="right" if column in ("#", "ms", "%") else "left")
        layers = profiler.profile_layers(engine.program, program_inputs)
        total = sum(layer["ms"] for layer in layers) or 1.0
        for i, layer in enumerate(layers):
            profile.add_row(str(i), _text(layer["name"]), _text(layer["op_type"]), _text(layer["tactic"]),
                            f"{layer['ms']:.3f}", f"{100 * layer['ms'] / total:.1f}")
        out.print(profile)
    if not args.no_overhead:
        per_layer = profiler.dispatch_overhead(engine.program, program_inputs)
        if per_layer is not None:
            layers = len(engine.plan.program.steps)
            out.print(_text(
                f"python dispatch overhead: ~{1e6 * per_layer:.1f} us per layer x {layers} layers "
                f"= ~{1000 * per_layer * layers:.3f} ms of the {1000 * base:.3f} ms mean"
            ))
    return 0


# ---------------------------------------------------------------------------- inspect


def _layers(plan: EnginePlan) -> list[dict]:
    types = plan.header.get("value_types", {})
    layers = []
    for i, step in enumerate(plan.program.steps):
        outputs = []
        for j, name in enumerate(step.outputs):
            if not name:
                continue
            vt = types.get(name, {})
            dtype = vt.get("dtype") or (step.output_dtypes[j] if j < len(step.output_dtypes) else None)
            outputs.append({"name": name, "dtype": dtype, "shape": vt.get("shape")})
        layer = {
            "index": i,
            "name": step.name,
            "op_type": f"{step.domain}::{step.op_type}" if step.domain else step.op_type,
            "inputs": list(step.inputs),
            "outputs": outputs,
        }
        if step.fused_from:
            layer["fused_from"] = list(step.fused_from)
        tuned = plan.header.get("tactics", {}).get("layers", {}).get(step.name)
        if tuned:  # chosen tactic, its time and the runner-up's (kiln/tactics/autotune.py)
            layer["tactic"] = {k: tuned.get(k) for k in ("tactic", "time_ms", "runner_up", "runner_up_ms", "cached")}
        layers.append(layer)
    return layers


def cmd_inspect(args: argparse.Namespace) -> int:
    from rich.table import Table

    plan = engine_format.load(args.engine)  # the plan only: inspecting needs no device
    header = plan.header
    layers = _layers(plan)
    if args.json:
        doc = {"header": header, "layers": layers}
        sys.stdout.write(json.dumps(doc, indent=2, default=str) + "\n")
        return 0
    out = _console()
    memory = header.get("memory", {})
    source = header.get("source") or {}
    overview = Table(title=f"engine {args.engine}", show_header=False, box=None, title_justify="left")
    overview.add_column(style="bold")
    overview.add_column()
    device = header.get("device", {})
    rows = [
        ("format version", header.get("format_version")),
        ("kiln version", header.get("kiln_version")),
        ("torch version", header.get("torch_version")),
        ("created", header.get("created")),
        ("producer", header.get("producer")),
        ("source", source.get("path") or source.get("name") or "?"),
        ("device", " ".join(str(v) for v in device.values())),
        ("build config", json.dumps(header.get("build_config", {}))),
        ("layers", len(layers)),
        ("weights", f"{_fmt_bytes(header.get('weights_bytes'))} in {len(plan.weights)} tensor(s)"),
        ("activations", f"planned peak {_fmt_bytes(memory.get('peak_bytes'))} vs naive sum "
                        f"{_fmt_bytes(memory.get('naive_bytes'))}"
                        + (f"; {len(memory['unknown'])} value(s) of unknown size" if memory.get("unknown") else "")),
    ]
    tactics = header.get("tactics") or {}
    if tactics:
        chosen = [v["tactic"] for v in tactics.get("layers", {}).values()]
        summary = tactics.get("skipped") or tactics.get("reverted") or (
            f"{len(chosen)} layer(s) tuned: " + ", ".join(f"{chosen.count(t)} {t}" for t in sorted(set(chosen))))
        cache = tactics.get("cache") or {}
        if cache.get("path"):
            summary += f"; timing cache {cache['path']}: {cache.get('hits', 0)} hit(s), {cache.get('misses', 0)} miss(es)"
        rows.append(("tactics", summary))
    for key, value in rows:
        overview.add_row(key, _text(value))
    out.print(overview)

    bindings = Table(title="bindings", title_justify="left")
    for column in ("direction", "name", "kind", "dtype", "shape"):
        bindings.add_column(column)
    for direction, items in (("input", plan.inputs), ("output", plan.outputs)):
        for b in items:
            bindings.add_row(direction, _text(b.name), b.kind, _text(b.dtype or "?"), _text(_fmt_shape(b.shape)))
    out.print(bindings)

    table = Table(title="layers", title_justify="left")
    tuned = any("tactic" in layer for layer in layers)
    for column in ("#", "name", "op", "outputs", "absorbed ONNX nodes") + (("tactic", "ms", "runner-up"),) * tuned:
        if isinstance(column, tuple):
            for c in column:
                table.add_column(c, justify="right" if c == "ms" else "left")
            continue
        table.add_column(column, justify="right" if column == "#" else "left")
    for layer in layers:
        outs = "; ".join(f"{o['name']}: {o['dtype'] or '?'}{_fmt_shape(o['shape'])}" for o in layer["outputs"])
        absorbed = ", ".join(layer.get("fused_from", []))
        cells = [str(layer["index"]), _text(layer["name"]), _text(layer["op_type"]), _text(outs), _text(absorbed)]
        if tuned:
            cells += _tactic_cells(layer.get("tactic"))
        table.add_row(*cells)
    out.print(table)
    if args.why_not:
        _print_why_not(out, args.why_not if args.why_not != "source" else source.get("path"))
    return 0


def _tactic_cells(tuned: dict | None) -> list:
    """Chosen tactic, its time, and the runner-up with its time (empty for untuned layers)."""
    if not tuned:
        return ["", "", ""]
    ms = "" if tuned.get("time_ms") is None else f"{tuned['time_ms']:.3f}"
    runner_up = "" if not tuned.get("runner_up") else f"{tuned['runner_up']} {tuned['runner_up_ms']:.3f}"
    return [_text(tuned["tactic"] + (" (cached)" if tuned.get("cached") else "")), ms, _text(runner_up)]


def _print_why_not(out, model_path: str | None) -> None:
    """Candidate fusions that did not fire, with each rule's reason (imports the passes)."""
    if not model_path:
        raise KilnError("--why-not needs the ONNX model: pass its path (the engine records none)")
    from kiln.frontend import onnx as onnx_frontend
    from kiln.passes import why_not

    reasons = why_not(onnx_frontend.load(model_path))
    out.print(f"\nfusions that did not fire ({len(reasons)}):")
    for line in reasons:
        out.print(f"  - {_text(line)}")


def cmd_compare(args: argparse.Namespace) -> int:
    from kiln.tools.compare import compare

    feeds = dict(np.load(args.inputs)) if args.inputs else None
    report = compare(args.model, precision=args.precision, device=args.device, opt_level=args.opt_level,
                     inputs=feeds, shapes=_parse_shapes(args.shapes), rtol=args.rtol, atol=args.atol,
                     mark_all=args.mark_all, seed=args.seed)
    print(report.render())
    return 0 if report.passed else 2


# ---------------------------------------------------------------------------- main


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kiln", description="Build ONNX models into kiln engines, run, benchmark and inspect them.")
    parser.add_argument("--version", action="version", version=f"kiln {kiln.__version__}")
    verbs = parser.add_subparsers(dest="verb", metavar="{build,run,bench,inspect,compare}", required=True)
    shapes_help = ("concrete input shapes NAME:DIMxDIM..., comma-separated or repeated "
                   "(symbolic dims default to the build shapes, else 1)")

    p = verbs.add_parser("build", help="import, check, optimise and plan an ONNX model; write the engine",
                         description="Import, check, optimise and plan an ONNX model, and write a .kiln engine.")
    p.add_argument("model", help="the .onnx model (external data files next to it)")
    p.add_argument("-o", "--output", help="engine file to write (default: the model's path with .kiln)")
    p.add_argument("--opt-level", type=int, default=2, choices=range(6), metavar="N",
                   help="0: import and run as is ... 5: every optimisation (default 2)")
    p.add_argument("--shapes", action="append", metavar="NAME:DIMS", help="shapes to plan memory for: " + shapes_help)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="target device (default cpu)")
    p.add_argument("--precision", default="fp32", choices=["fp32", "tf32", "fp16", "bf16", "int8", "fp8", "best"],
                   help="builder precision (default fp32)")
    for flag in ("fp16", "bf16", "tf32", "best"):  # trtexec's spelling: --fp16 is --precision fp16
        p.add_argument(f"--{flag}", dest="precision", action="store_const", const=flag,
                       help=f"same as --precision {flag}")
    p.add_argument("--pin-fp32", action="append", metavar="LAYER",
                   help="keep this layer (ONNX node name) in fp32 in a half-precision engine; repeatable")
    p.add_argument("--timing-cache", metavar="FILE.json",
                   help="tactic timings to reuse and extend: a rebuild with it times nothing (kiln/tactics)")
    p.add_argument("-v", "--verbose", action="store_true", help="print each build stage and its time")
    p.set_defaults(func=cmd_build)

    p = verbs.add_parser("run", help="run an engine once and print its outputs",
                         description="Run an engine once on given or random inputs and print its outputs.")
    p.add_argument("engine", help="the .kiln engine")
    p.add_argument("--inputs", metavar="IN.npz", help="input arrays by name (default: random of the right dtype/shape)")
    p.add_argument("--outputs", metavar="OUT.npz", help="write the outputs here")
    p.add_argument("--save-inputs", metavar="IN.npz", help="write the inputs used (e.g. the random ones) here")
    p.add_argument("--shapes", action="append", metavar="NAME:DIMS", help="random input shapes: " + shapes_help)
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    p.set_defaults(func=cmd_run)

    p = verbs.add_parser("bench", help="time an engine (optionally side by side with onnxruntime)",
                         description="Warm up, then time an engine: latency min/mean/median/p90/p95/p99 and qps.")
    p.add_argument("engine", help="the .kiln engine")
    p.add_argument("--against", choices=["onnxruntime"], help="also time this runtime on the same inputs")
    p.add_argument("--onnx", metavar="MODEL.onnx",
                   help="the ONNX model for --against (default: the source path recorded in the engine)")
    p.add_argument("--warmup", type=int, default=5, metavar="N", help="untimed runs first (default 5)")
    how_long = p.add_mutually_exclusive_group()
    how_long.add_argument("--iterations", type=int, metavar="N", help="timed runs (default: >= 10 runs and 3 s)")
    how_long.add_argument("--duration", type=float, metavar="S", help="time runs for S seconds")
    p.add_argument("--inputs", metavar="IN.npz", help="input arrays by name (default: random)")
    p.add_argument("--shapes", action="append", metavar="NAME:DIMS", help="random input shapes: " + shapes_help)
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    p.add_argument("--json", metavar="OUT.json", help="also write the statistics as JSON")
    p.add_argument("--no-overhead", action="store_true", help="skip the dispatch overhead estimate")
    p.add_argument("--dump-profile", action="store_true", help="also print each layer's median time (eager)")
    p.set_defaults(func=cmd_bench)

    p = verbs.add_parser("inspect", help="show an engine's header, bindings, layers and memory",
                         description="Show an engine's header, bindings, layers, weights and activation memory.")
    p.add_argument("engine", help="the .kiln engine")
    p.add_argument("--json", action="store_true", help="print the header and layer list as JSON")
    p.add_argument("--why-not", nargs="?", const="source", metavar="MODEL.onnx",
                   help="also list candidate fusions that did not fire and why (default: the engine's source model)")
    p.set_defaults(func=cmd_inspect)

    p = verbs.add_parser("compare", help="compare a build of a model against onnxruntime fp32 (Polygraphy-like)",
                         description="Build the model, run it and onnxruntime fp32 on the same inputs, and report "
                                     "per-output error statistics; --mark-all compares every layer and names the "
                                     "first one outside tolerance. Exit status 2 when outside tolerance.")
    p.add_argument("model", help="the .onnx model")
    p.add_argument("--precision", default="fp32", choices=["fp32", "tf32", "fp16", "bf16"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--opt-level", type=int, default=2, choices=range(6), metavar="N")
    p.add_argument("--mark-all", action="store_true", help="compare every intermediate value; name the first bad layer")
    p.add_argument("--rtol", type=float, help="relative tolerance (default by precision)")
    p.add_argument("--atol", type=float, help="absolute tolerance (default by precision)")
    p.add_argument("--inputs", metavar="IN.npz", help="input arrays by name (default: random)")
    p.add_argument("--shapes", action="append", metavar="NAME:DIMS", help="random input shapes: " + shapes_help)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_compare)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.func(args)
    except KilnError as e:
        print(f"kiln {args.verb}: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # unwritable output folder, full disk, unreadable file
        print(f"kiln {args.verb}: error: {e.strerror or e}: {e.filename or ''}".rstrip(": "), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"kiln {args.verb}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
