"""`kiln build`: import, check, optimise and plan an ONNX model, and write the engine (the one
verb that imports the ONNX frontend and the passes, through kiln.build)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import kiln
from kiln.cli.common import console, fmt_bytes, make_inputs, parse_profile, parse_shapes, text
from kiln.cli.inspect import in_context_summary, padding_summary, tactics_summary, whole_engine_check
from kiln.errors import KilnError
from kiln.plan.spec import EnginePlan
from kiln.runtime.rss import PeakMemory

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
        "shapes": parse_shapes(args.shapes),
        "profiles": [parse_profile(spec) for spec in args.profile or []],
        "pad_dims": [d.strip() for d in (args.pad_dims or "").split(",") if d.strip()],
        "verbose": args.verbose,
        "device": args.device,
        "precision": args.precision,
        "timing_cache": args.timing_cache,
        "compile_workers": args.compile_workers,
        "in_context": args.in_context,
        "layer_precision": {**{name: "weight_only" for name in args.pin_weight_only or []},
                            **{name: "w8a16" for name in args.pin_w8a16 or []},
                            **{name: "fp32" for name in args.pin_fp32 or []}},
        "calibration": args.calib,
        "calibrator": args.calibrator,
        "calibration_cache": args.calib_cache,
        "calibration_preprocessing": args.calib_preprocessing,
        "quantization": args.quantization,
        "accuracy_target": args.accuracy_target,
        "accuracy_metric": args.accuracy_metric,
        "accuracy_weight_only": args.accuracy_weight_only,
        "accuracy_margin": args.accuracy_margin,
        "accuracy_by_cost": args.accuracy_by_cost,
        "speed_check": args.speed_check,
        "smoothquant": args.smoothquant,
        "equalize": args.equalize,
        "gptq": args.gptq,
        "refittable": args.refittable,
        "remove_padding": args.remove_padding,
    }
    err = console(stderr=True)
    t0 = time.perf_counter()
    with Progress(SpinnerColumn(), TextColumn("{task.description}", markup=False), TimeElapsedColumn(),
                  console=err, transient=True, disable=not err.is_terminal) as progress:
        task = progress.add_task(f"building {source.name}", total=None)
        last = [t0, None]

        def on_stage(stage: str) -> None:
            now = time.perf_counter()
            if last[1] is not None and args.verbose:
                progress.console.print(text(f"  {last[1]:<18} {1000 * (now - last[0]):9.1f} ms"))
            last[0], last[1] = now, (None if stage == "done" else stage)
            step = _BUILD_STAGES.index(stage) + 1 if stage in _BUILD_STAGES else None
            label = f"[{step}/{len(_BUILD_STAGES)}] " if step else ""
            progress.update(task, description=f"building {source.name}: {label}{stage}")

        engine = kiln.build(str(source), progress=on_stage, **options)
        on_stage(f"writing {output.name}")
        engine.save(output)
        on_stage("done")
    build_seconds = time.perf_counter() - t0
    run_memory = _run_memory(engine) if args.verbose else None
    _print_build_summary(engine.plan, output, build_seconds, args.verbose, run_memory)
    return 0


def _run_memory(engine: kiln.Engine, runs: int = 2) -> str:
    """'peak RSS +X over the loaded engine during N runs ...': the engine run on random inputs of its build
    shapes (the first run binds its native segments and shape plans, so it is counted too)."""
    feeds = make_inputs(engine.plan, argparse.Namespace(inputs=None, shapes=None, seed=0))
    context = engine.create_execution_context()
    peak = PeakMemory.start()
    for _ in range(runs):
        context.run(feeds)
    lower_bound = ", a lower bound: ru_maxrss" if peak.method == "ru_maxrss" else ""
    return f"peak RSS +{fmt_bytes(peak.delta())} over the loaded engine during {runs} runs on random inputs{lower_bound}"


def _build_memory(header: dict) -> str | None:
    """'peak RSS +X during the build (N.Nx the model's Y of weights)', or None for an old engine."""
    memory = header.get("build_memory")
    if not memory:
        return None
    delta, weights = memory.get("peak_rss_delta_bytes"), memory.get("model_weight_bytes")
    ratio = f" ({delta / weights:.1f}x the model's {fmt_bytes(weights)} of weights)" if weights else ""
    lower_bound = ", a lower bound: ru_maxrss" if memory.get("measured_by") == "ru_maxrss" else ""
    return f"peak RSS +{fmt_bytes(delta)} during the build{ratio}{lower_bound}"


def _precision_row(layers: dict) -> list[tuple[str, str]]:
    """How many quantized layers run int8 kernels and how many their float layer (`kiln inspect`: why)."""
    if not layers:
        return []
    counts: dict[str, int] = {}
    for layer in layers.values():
        counts[layer["precision"]] = counts.get(layer["precision"], 0) + 1
    return [("  ran as", ", ".join(f"{n} {p}" for p, n in sorted(counts.items())) + " (kiln inspect: per layer, why)")]


def _quantization_rows(q: dict) -> list[tuple[str, str]]:
    if not q:
        return []
    if q.get("mode") == "auto":
        return [("quantization", q.get("note", ""))]
    if "mode" not in q:  # an explicitly quantized model (Q/DQ): its layers as the fusion made them
        return [("quantization", f"explicit Q/DQ: {len(q.get('layers') or {})} quantized layer(s)")] + \
            _precision_row(q.get("layers") or {})
    kept = q.get("kept_float") or {}
    weight_only = q.get("weight_only") or {}
    calibration = q.get("calibration") or {}
    source = "the cache" if calibration.get("from_cache") else f"{calibration.get('batches', '?')} batch(es)"
    how = "emulated" if q.get("mode") == "emulate" else "kernels"
    rows = [("quantization", f"{q['dtype']} ({how}): {len(q.get('quantized', []))} layer(s) quantized, "
                             + (f"{len(weight_only) - len(q.get('w8a16') or ())} weight-only ({q['dtype']} "
                                "weights, float input), " if len(weight_only) > len(q.get('w8a16') or ()) else "")
                             + (f"{len(q['w8a16'])} w8a16 (int8 weights, 16-bit input), " if q.get("w8a16") else "")
                             + f"{len(kept)} kept float; ranges by {calibration.get('calibrator')} from {source}")]
    rows += _precision_row(q.get("layers") or {})
    accuracy = q.get("accuracy") or {}
    if accuracy.get("metric") == "top1":
        margin = f" = {accuracy['asked']:g} + margin {accuracy['margin']:g}" if "margin" in accuracy else ""
        plan = f"; {accuracy['chosen_plan']} plan, the fastest of {len(accuracy['plans'])} by layer ms" \
            if "chosen_plan" in accuracy else ""
        rows.append(("accuracy", f"expected top-1 agreement {accuracy['top1']:.4f} (target {accuracy['target']:g}"
                                 f"{margin}{plan}; "
                                 f"every layer quantized: {accuracy['top1_all_quantized']:.4f})"
                                 + ("" if accuracy.get("met", True) else ": NOT met")))
    elif accuracy:
        rows.append(("accuracy", f"output error {accuracy['error']:.3g} (target {accuracy['target']:g}; every "
                                 f"layer quantized: {accuracy['error_all_quantized']:.3g})"
                                 + ("" if accuracy.get("met", True) else ": NOT met")))
    rows += [("  weight-only", f"{name}: {why}") for name, why in weight_only.items()]
    rows += [("  kept float", f"{name}: {why}") for name, why in kept.items()]
    smoothing = q.get("smoothquant")
    if smoothing:
        spread = "; ".join(f"{name} channel spread {a:g}x -> {b:g}x" for name, (a, b) in smoothing["spread"].items())
        rows.append(("smoothquant", f"alpha {smoothing['alpha']:g}: {len(smoothing['smoothed'])} layer(s) smoothed, "
                                    f"{len(smoothing['skipped'])} not" + (f" ({spread})" if spread else "")))
        rows += [("  not smoothed", f"{name}: {why.removeprefix('not smoothed: ')}")
                 for name, why in smoothing["skipped"].items()]
    return rows


def _print_build_summary(plan: EnginePlan, output: Path, seconds: float, verbose: bool = False,
                         run_memory: str | None = None) -> None:
    from rich.table import Table

    header = plan.header
    memory = header.get("memory", {})
    peak, naive = memory.get("peak_bytes"), memory.get("naive_bytes")
    saving = f" ({naive / peak:.1f}x less)" if peak and naive and naive > peak else ""
    unknown = memory.get("unknown") or []
    activations = f"planned peak {fmt_bytes(peak)} vs naive sum {fmt_bytes(naive)}{saving}"
    if unknown:
        activations += f"; {len(unknown)} value(s) of unknown size not counted"
    table = Table(title=f"built {output}", show_header=False, box=None, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    rows = [
        ("engine", f"{output} ({fmt_bytes(output.stat().st_size)})"),
        ("layers", str(len(plan.program.steps))),
        ("inputs", ", ".join(f"{b.name}: {b.describe()}" for b in plan.inputs)),
        ("outputs", ", ".join(f"{b.name}: {b.describe()}" for b in plan.outputs)),
        *[(f"profile {k}", f"{p.describe()}  ({p.source})") for k, p in enumerate(plan.profiles)],
        *_quantization_rows(header.get("quantization") or {}),
        *[("remove padding", line) for line in [padding_summary(header)] if line],
        ("weights", fmt_bytes(header.get("weights_bytes"))),
        ("activations", activations),
        ("device", header.get("device", {}).get("name", "?")),
        ("build time", f"{seconds:.2f} s"),
    ]
    if verbose and (memory_row := _build_memory(header)) is not None:
        rows.append(("build memory", memory_row))
    if run_memory is not None:
        rows.append(("run memory", run_memory))
    tactics = header.get("tactics") or {}
    if tactics:  # what the tuner chose, and what its whole-engine check reverted and why
        rows.append(("tactics", tactics_summary(tactics)))
        rows += [("  in context", line) for line in [in_context_summary(tactics)] if line]
        rows += [("", line) for line in whole_engine_check(tactics)]
    if header.get("plain_tactics"):  # a padding-free engine's plain program (kiln/builder/padding_free.py)
        rows.append(("plain program tactics", tactics_summary(header["plain_tactics"])))
    for key, value in rows:
        table.add_row(key, text(value))
    console().print(table)
