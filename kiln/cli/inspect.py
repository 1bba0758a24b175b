"""`kiln inspect`: an engine's header, bindings, layers (with tuned tactics), weights and
activation memory, as tables or JSON. Reads the plan only: needs no device. --why-not imports
the frontend and the passes, to list candidate fusions that did not fire."""

from __future__ import annotations

import argparse
import json
import sys

from kiln.cli.common import console, fmt_bytes, fmt_shape, text
from kiln.errors import KilnError
from kiln.plan import file as engine_file
from kiln.plan.spec import EnginePlan
from kiln.runtime.shapes import DATA_DEPENDENT_SHAPES


def _layers(plan: EnginePlan) -> list[dict]:
    types = plan.header.get("value_types", {})
    quantized = (plan.header.get("quantization") or {}).get("layers") or {}
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
        if tuned:  # chosen tactic, its time and the runner-up's (kiln/builder/autotune.py), times in the network
            layer["tactic"] = {k: tuned.get(k) for k in ("tactic", "time_ms", "runner_up", "runner_up_ms", "cached")}
            if "in_network" in tuned:  # timed again in context (kiln/builder/in_context.py)
                layer["tactic"]["in_network"] = tuned["in_network"]
        precision = quantized.get(step.name)
        if precision:  # a quantized layer: int8 kernel or its float layer, and why (builder/calibration.py)
            layer["precision"] = precision
        layers.append(layer)
    return layers


def layout_conversions(plan: EnginePlan) -> dict[str, int]:
    """Layers whose tactic runs in a layout of its own, and the tensors that change layout on the way:
    each edge from a layer of one layout to a reader of another (graph inputs and outputs count as
    the default layout, as do weights, which tactics lay out once at load)."""
    from kiln.tactics import registry

    layout_of: dict[str, str] = {}  # value name -> layout its producer writes
    steps = plan.program.steps
    step_layout = []
    for step in steps:
        tactic = registry.get(step.tactic) if step.tactic else None
        layout = tactic.layout if tactic is not None else ""
        step_layout.append(layout)
        for name in step.outputs:
            layout_of[name] = layout
    conversions = 0
    for step, layout in zip(steps, step_layout):
        for name in step.inputs:
            if name in layout_of and layout_of[name] != layout:
                conversions += 1
    conversions += sum(1 for name in plan.program.outputs if layout_of.get(name, ""))
    conversions += sum(1 for step, layout in zip(steps, step_layout) if layout
                       for name in step.inputs[:1] if name in plan.program.inputs)
    return {"layers": sum(1 for layout in step_layout if layout), "conversions": conversions}


def _native_segments(plan) -> str:
    """What the CPU runtime makes of the plan at load (kiln/runtime/native.py): the runs of layers
    bound to one memory plan, and that plan's buffers. Loads the program on the CPU (weights packed
    as at load); says why not when it cannot."""
    try:
        from kiln.runtime.engine import Engine

        program = Engine(plan).program
    except Exception as e:  # noqa: BLE001  inspect reports; it does not fail on what it only describes
        return f"not loaded here ({type(e).__name__}: {str(e)[:120]})"
    segments = program.segments
    # layers whose tactic could have offered them to a segment and says why it did not (a recurrent layer whose
    # constant sequence_lens or states do not fit X, sequence_lens of another dtype than int32)
    left_out = "".join(f"; {step.ctx.name} ({step.ctx.op_type}) not a member: {step.fn.not_native}"
                       for step in program.steps if getattr(step.fn, "not_native", None))
    if not segments:
        return "none (no run of two or more layers with bound-primitive tactics)" + left_out
    layers = sum(len(s.members) for s in segments)
    arena = max(s.planned_bytes for s in segments)  # the segments share one arena (kiln/runtime/native_arena.py)
    return (f"{len(segments)} segment(s) run {layers} of {len(program.steps)} layers as bound primitives; "
            f"their activations in one arena of {fmt_bytes(arena)} reused by liveness "
            f"({sum(s.accumulated for s in segments)} residual(s) accumulated in place, "
            f"{sum(s.aliased for s in segments)} reshape(s) as aliases)" + left_out)


def _omp_wait() -> str:
    """How this process's OpenMP threads would wait in an engine call (kiln/kernels/cpu/omp_governor.py): the
    governor located and its decision for the cores free now, or why libgomp's own policy applies."""
    try:
        from kiln.kernels.cpu import omp_governor

        governor = omp_governor.governor()
        governor.begin()  # locates the count (once) and reads the free cores, as an engine call would
        governor.end()
        return governor.describe()
    except Exception as e:  # noqa: BLE001  inspect reports; it does not fail on what it only describes
        return f"unknown ({type(e).__name__}: {str(e)[:120]})"


def cmd_inspect(args: argparse.Namespace) -> int:
    from rich.table import Table

    plan = engine_file.load(args.engine)  # the plan only: inspecting needs no device
    header = plan.header
    layers = _layers(plan)
    if args.json:
        doc = {"header": header, "layers": layers}
        sys.stdout.write(json.dumps(doc, indent=2, default=str) + "\n")
        return 0
    out = console()
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
        ("weights", f"{fmt_bytes(header.get('weights_bytes'))} in {len(plan.weights)} tensor(s)"),
        ("activations", f"planned peak {fmt_bytes(memory.get('peak_bytes'))} vs naive sum "
                        f"{fmt_bytes(memory.get('naive_bytes'))}"
                        + (f"; {len(memory['unknown'])} value(s) of unknown size" if memory.get("unknown") else "")),
    ]
    if (padding := padding_summary(header)) is not None:
        rows.append(("remove padding", padding))
    tactics = header.get("tactics") or {}
    if tactics:
        summary = tactics_summary(tactics)
        cache = tactics.get("cache") or {}
        if cache.get("path"):
            summary += f"; timing cache {cache['path']}: {cache.get('hits', 0)} hit(s), {cache.get('misses', 0)} miss(es)"
        rows.append(("tactics", summary))
        rows += [("  in context", line) for line in [in_context_summary(tactics)] if line]
        if header.get("plain_tactics"):  # a padding-free engine's plain program (kiln/builder/padding_free.py)
            rows.append(("plain program tactics", tactics_summary(header["plain_tactics"])))
        layouts = layout_conversions(plan)
        if layouts["layers"]:
            rows.append(("layout", f"{layouts['layers']} layer(s) run channels-last; {layouts['conversions']} "
                                   "tensor(s) cross a layout boundary (stack inputs and outputs)"))
    if device.get("type") == "cpu":
        rows.append(("native segments", _native_segments(plan)))
        rows.append(("OpenMP wait", _omp_wait()))
    for key, value in rows:
        overview.add_row(key, text(value))
    out.print(overview)

    bindings = Table(title="bindings", title_justify="left")
    for column in ("direction", "name", "kind", "dtype", "shape"):
        bindings.add_column(column)
    for direction, items in (("input", plan.inputs), ("output", plan.outputs)):
        for b in items:
            bindings.add_row(direction, text(b.name), b.kind, text(b.dtype or "?"), text(fmt_shape(b.shape)))
    out.print(bindings)
    for k, profile in enumerate(plan.profiles):
        out.print(text(f"optimization profile {k}: {profile.describe()}"))
        out.print(text(f"  from {profile.source}"))
        for name, r in profile.inputs.items():
            out.print(text(f"  {name}: min {r.min}, opt {r.opt}, max {r.max}"))
    if device.get("type") == "cuda":
        for line in _graph_blockers(plan):
            out.print(text(line))
    checks = (header.get("tactics") or {}).get("profiles") or {}
    for line in checks.get("checked_at", []):
        out.print(text(f"  tactics checked at {line}"))
    for layer, why in (checks.get("reverted_layers") or {}).items():
        out.print(text(f"  layer {layer} runs its default: {why}"))
    for line in whole_engine_check(header.get("tactics") or {}):
        out.print(text(f"  {line}"))

    table = Table(title="layers", title_justify="left")
    tuned = any("tactic" in layer for layer in layers)
    precisions = any("precision" in layer for layer in layers)
    for column in ("#", "name", "op", "outputs", "absorbed ONNX nodes") + (("tactic", "ms", "runner-up"),) * tuned \
            + ("precision (why)",) * precisions:
        if isinstance(column, tuple):
            for c in column:
                table.add_column(c, justify="right" if c == "ms" else "left")
            continue
        table.add_column(column, justify="right" if column == "#" else "left")
    for layer in layers:
        outs = "; ".join(f"{o['name']}: {o['dtype'] or '?'}{fmt_shape(o['shape'])}" for o in layer["outputs"])
        absorbed = ", ".join(layer.get("fused_from", []))
        cells = [str(layer["index"]), text(layer["name"]), text(layer["op_type"]), text(outs), text(absorbed)]
        if tuned:
            cells += _tactic_cells(layer.get("tactic"))
        if precisions:
            p = layer.get("precision")
            cells.append(text(f"{p['precision']} ({p['why']})") if p else "")
        table.add_row(*cells)
    out.print(table)
    if args.why_not:
        _print_why_not(out, args.why_not if args.why_not != "source" else source.get("path"),
                       cpu=plan.header.get("device", {}).get("type", "cpu") == "cpu")
    return 0


def padding_summary(header: dict) -> str | None:
    """What runs padding-free (kiln/passes/remove_padding.py), or None for an engine built without it."""
    removal = header.get("remove_padding")
    if not removal:
        return None
    return (f"on: {removal['layers']} layer(s) ({removal['attentions']} attention(s)) run on the real tokens of "
            f"{removal['mask']!r}; packed {', '.join(removal['packed'])}; unpacked {', '.join(removal['unpacked'])} "
            "(zeros at padding positions)" + _both_programs(removal))


def _both_programs(removal: dict) -> str:
    """Whether the engine holds the plain program too (kiln/builder/padding_free.py), and where each was tuned."""
    if not removal.get("plain_program"):
        return "; one program: a run that does not pack runs every position as a packed row (the identity packing)"
    tuned = removal.get("tuned_at") or {}
    at = f", tuned at {tuned['tokens']} packed rows" if tuned else ""
    return (f"; the engine holds both programs on one set of weights: packed ({removal['layers']} layers packed{at}) "
            f"for runs that pack, plain ({removal['plain_program']} steps, tuned as a plain build) for runs that do not")


def tactics_summary(tactics: dict) -> str:
    """One line: what the tuner chose, and how many layers the whole-engine check sent back to their default."""
    if tactics.get("skipped") or tactics.get("reverted"):
        return tactics.get("skipped") or tactics["reverted"]
    chosen = [v["tactic"] for v in tactics.get("layers", {}).values()]
    summary = f"{len(chosen)} layer(s) tuned: " + ", ".join(f"{chosen.count(t)} {t}" for t in sorted(set(chosen)))
    reverted = tactics.get("reverted_layers") or {}
    if reverted:
        summary += f"; {len(reverted)} reverted to their default by the whole-engine check: " + ", ".join(reverted)
    fallbacks = tactics.get("fallback_layers") or {}
    if fallbacks:
        summary += f"; {len(fallbacks)} on their default because every candidate failed its check: " + \
            ", ".join(fallbacks)
    return summary


def in_context_summary(tactics: dict) -> str | None:
    """One line: how many GEMM and conv layers were timed again in the network (kiln/builder/in_context.py), how
    (rounds, or the timing cache), what it cost and which changed tactic; None where the stage did not run."""
    stage = tactics.get("in_context")
    if not stage:
        return None
    if "failed" in stage:
        return f"failed ({stage['failed']}): the choices made alone stand"
    how = "from the timing cache" if stage.get("cached") else f"{stage.get('rounds')} rounds ({stage.get('stopped')})"
    changed = stage.get("changed") or {}
    swaps = sorted(set(changed.values()))
    listed = "; ".join(f"{sum(v == swap for v in changed.values())} x {swap}" for swap in swaps)
    return (f"{stage.get('layers')} GEMM/conv layer(s) timed again in the network, {how}, {stage.get('seconds')} s; "
            f"{len(changed)} changed" + (f": {listed}" if listed else ""))


def whole_engine_check(tactics: dict) -> list[str]:
    """What the tuned engine was judged against and how close it came (kiln/builder/accuracy.py), and
    each layer the check reverted with why, and each layer on its default because every candidate failed the
    per-layer check (autotune.fallback_reason); `kiln build` prints the same lines."""
    accuracy = tactics.get("accuracy") or {}
    lines = []
    if accuracy.get("outputs"):
        def g(v) -> str:
            return f"{v:.3g}" if isinstance(v, (int, float)) else str(v)

        outputs = "; ".join(f"{name} max abs error {g(e['error'])} ("
                            + (f"against {e['against']}, " if e.get("against") else "")
                            + (f"the default engine's own {g(e['default_error'])}, " if e["default_error"] else "")
                            + f"allowed {g(e['allowed'])})" for name, e in accuracy["outputs"].items())
        lines.append(f"tactics judged against {accuracy.get('reference')}: {outputs}")
    for layer, why in (tactics.get("reverted_layers") or {}).items():
        lines.append(f"layer {layer} runs its default (whole-engine check): {why}")
    for layer, why in (tactics.get("fallback_layers") or {}).items():
        lines.append(f"WARNING layer {layer} runs its default (per-layer check): {why}")
    return lines


def _graph_blockers(plan: EnginePlan) -> list[str]:
    """Layers that decide output shapes from data (kiln/runtime/shapes.py): on CUDA they wait for the
    host, so an input signature whose run reaches one runs eagerly, without a CUDA graph."""
    lines = []
    for step in plan.program.steps:
        if step.op_type in DATA_DEPENDENT_SHAPES:
            lines.append(f"CUDA graph: layer {step.name!r} ({step.op_type}) decides its output shape (or branch) "
                         "from data and waits for the host: runs reaching it are eager. Way out: give it a fixed size "
                         "(TopK with a constant k, a max count padded to), or split the model before it")
    return lines


def _tactic_cells(tuned: dict | None) -> list:
    """Chosen tactic, its time, and the runner-up with its time (empty for untuned layers)."""
    if not tuned:
        return ["", "", ""]
    ms = "" if tuned.get("time_ms") is None else f"{tuned['time_ms']:.3f}"
    runner_up = "" if not tuned.get("runner_up") else f"{tuned['runner_up']} {tuned['runner_up_ms']:.3f}"
    # timed again in the network: kiln/builder/in_context.py
    notes = [note for note, on in (("cached", tuned.get("cached")), ("in network", tuned.get("in_network"))) if on]
    return [text(tuned["tactic"] + (f" ({', '.join(notes)})" if notes else "")), ms, text(runner_up)]


def _print_why_not(out, model_path: str | None, cpu: bool = True) -> None:
    """Candidate fusions that did not fire, with each rule's reason (imports the passes); `cpu`: the
    engine's device asked for the CPU-only rules (squeeze-and-excitation) too, as its build did."""
    if not model_path:
        raise KilnError("--why-not needs the ONNX model: pass its path (the engine records none)")
    from kiln.frontend import onnx as onnx_frontend
    from kiln.passes import PassOptions, why_not

    reasons = why_not(onnx_frontend.load(model_path), PassOptions(cpu_rules=cpu, cuda_rules=not cpu))
    out.print(f"\nfusions that did not fire ({len(reasons)}):")
    for line in reasons:
        out.print(f"  - {text(line)}")
