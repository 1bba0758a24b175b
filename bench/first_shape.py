"""A saved engine's first calls at new shapes right after load (issue 10): the very first new shape pays what no
earlier call could have made (traces of the size rules and of the view's walk, per class of shapes), later new
shapes the view alone. One process per run (a first shape happens once a process): load, warm_up, the background
jobs done (first_calls.primitives_made), then first calls at --shapes in order, each then 3 repeats; thread CPU µs,
1 thread, first-call padding off (every new shape binds). onnxruntime's first call at the same shapes beside it
(its own session, 1 thread, made and warmed at the engine's build shape first).

    python bench/first_shape.py --engine /tmp/first/bert_base.kiln --onnx model.onnx [--no-views-ahead]
    python bench/first_shape.py --engine /tmp/first/bert_base.kiln --steady 2x16,1x8,3x5
    python bench/first_shape.py --engine /tmp/swin_tiny.kiln --onnx model.onnx --image 3x32x32 --shapes 3,5,1,4,7,16

--image CxHxW: an image model's pixel_values, --shapes then batches (onnxruntime warmed at batch --warm-batch).

--no-reshaped-shapes: a Shape of a Reshape's output is left to the loop (llama_tiny: plans_ahead False).
--no-plans-ahead: a program of several segments computes no shape plans at load (first_calls.plan_shapes empty).
--no-rewritten-launch: a kiln kernel's launch outside a segment builds its kernel at each new size (llama's Wheres).
--no-views-made-ahead: the load makes no segment's view at the shapes it plans (views_ahead.views_ahead_at).
--no-size-rules: kiln::Rotary, kiln::RMSNorm and the last-axis Slice without their size rules (llama_tiny: its segments walk at the call).
--no-gather-grids: a GatherND by an index grid (a decoder's causal mask) gathers by the grid made, not its parts.
--no-corners: a stored tensor proved a corner of itself at larger dims (a decoder's causal mask) made by its steps.
--no-packed-views: a view's plans and calls written by numpy's copy and stores (A of native_views.PACKED).
--plans-ahead N: first_calls.PLANS_AHEAD (shapes past a profile's N smallest compute their shape values at the call).
--execute: each call through execute() (TensorRT-style bound tensors): the inputs bound as torch tensors, the output
as a contiguous view of one buffer of the largest shape's output that the caller made and touched before the calls
(bindings made outside the timed call); --copy-outputs: execute() copies every bound output after the run (A of
ExecutionContext._outputs_into: the run's own fresh outputs, then bound.copy_). Rows beside: minor page faults of
the calling thread in the first call and its best repeat.
--no-memos: the view job's memo shapes off (first_calls.memo_shapes empty); --no-grid-rows: each grid corner a
copy. --no-views-ahead: the load's view jobs off (first_calls._trace_job and _segments_job: no template grown, no walk
traced, no segment readied at load), the tree before them otherwise. --steady: the hot path at shapes already seen,
the engine loaded twice in one process (one with the view jobs, one without; --b-first: that one first), calls
interleaved in shuffled order, median thread CPU ms per shape and ratio.

Rows: first - repeat; of it outside the loop's C call; spans of the parts (rule traces: TracedRule._trace; the
walk's trace: ViewTrace.learn; the view: Segment._bind_sizes).
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ["KILN_PAD_FIRST_CALLS"] = "0"

import kiln  # noqa: E402
import numpy as np  # noqa: E402

from first_call_direct import span_timer, warm_context  # noqa: E402
from kiln.runtime import first_calls, native, native_views, shape_function, view_trace  # noqa: E402
from kiln.tactics import traced_rules  # noqa: E402

PARTS = [
    (shape_function.ShapeFunction, "__call__", "shape function (a shape without a plan)"),
    (native.Segment, "_bind_sizes", "view (Segment._bind_sizes)"),
    (native_views._PlanRewrite, "view", "  its walk (_PlanRewrite.view)"),
    (traced_rules.TracedRule, "_trace", "    rule traces (TracedRule._trace)"),
    (view_trace.ViewTrace, "learn", "    walk's trace (ViewTrace.learn)"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True)
    ap.add_argument("--onnx", default="", help="the model's ONNX file: onnxruntime's first calls beside")
    ap.add_argument("--shapes", default="3x5,2x7,1x8,4x33,1x100,2x61,3x250")
    ap.add_argument("--label", default="")
    ap.add_argument("--no-views-ahead", action="store_true")
    ap.add_argument("--no-memos", action="store_true", help="the view job fills no shape-function memos (A of "
                    "first_calls.memo_shapes)")
    ap.add_argument("--no-grid-rows", action="store_true", help="index grids' corners cut by a copy each (A of "
                    "shape_function._GridBase's rows: GRID_ROWS_BYTES 0)")
    ap.add_argument("--no-plans-ahead", action="store_true", help="a program of several segments computes no shape "
                    "plans at load (A of first_calls.plan_shapes)")
    ap.add_argument("--no-reshaped-shapes", action="store_true", help="a Shape of a Reshape's output stays in the "
                    "loop (A of shape_function._reshaped_by: llama_tiny's shape function then leaves shape values to "
                    "the loop, plans_ahead False)")
    ap.add_argument("--no-size-rules", action="store_true", help="kiln::Rotary, kiln::RMSNorm and the last-axis "
                    "Slice without their size rules (A of their PlanRules: llama_tiny's segments walk at each new shape)")
    ap.add_argument("--no-rewritten-launch", action="store_true", help="a kiln kernel's launch outside a segment "
                    "builds its kernel at each new size (A of native_member.RewrittenLaunch: llama_tiny's mask Wheres)")
    ap.add_argument("--no-views-made-ahead", action="store_true", help="the load makes no segment's view at the "
                    "shapes it plans (A of views_ahead.views_ahead_at)")
    ap.add_argument("--no-gather-grids", action="store_true", help="a GatherND by an index grid gathers by the grid "
                    "made (A of shape_function._GatherGrid: a decoder's mask past the shapes planned at load)")
    ap.add_argument("--no-corners", action="store_true", help="a decoder's mask made by its steps at each shape past "
                    "the planned ones (A of shape_function.CORNERS: shape_corners.CornerCut)")
    ap.add_argument("--no-packed-views", action="store_true", help="a view's plans and calls written by numpy's "
                    "copy and stores (A of native_views.PACKED: view_pack.PackedPlans)")
    ap.add_argument("--plans-ahead", type=int, default=0, help="first_calls.PLANS_AHEAD (0: as it is)")
    ap.add_argument("--execute", action="store_true", help="calls through execute() on bound tensors")
    ap.add_argument("--copy-outputs", action="store_true", help="--execute: every bound output copied after the "
                    "run (A of ExecutionContext._outputs_into)")
    ap.add_argument("--steady", default="", help="shapes of the steady-state A/B (then no first calls)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--image", default="", help="CxHxW: pixel_values of an image model; --shapes are batches")
    ap.add_argument("--warm-batch", type=int, default=2, help="--image: onnxruntime's warm-up batch")
    ap.add_argument("--b-first", action="store_true", help="--steady: load B (views ahead on) first")
    args = ap.parse_args()
    if args.steady:
        return steady(args)
    if args.no_views_ahead:
        first_calls._trace_job = lambda program, profiles: None
        if hasattr(first_calls, "_segments_job"):  # (a tree before it has none)
            first_calls._segments_job = lambda program, profiles, dtypes: None
    if args.no_reshaped_shapes:
        shape_function._reshaped_by = lambda *a: None
    if args.no_plans_ahead and hasattr(first_calls, "plan_shapes"):
        first_calls.plan_shapes = lambda program, profiles: []
    if args.no_size_rules:
        from kiln.tactics.cpu import relayout, rotary, transformer
        relayout._last_axis_slice_rule = lambda *a: None
        for module in (rotary, transformer):
            def without(step, reads, build, *a, _real=module.prepared_native, **k):
                if step.op_type in ("Rotary", "RMSNorm"):
                    k.pop("plan_at", None)
                return _real(step, reads, build, *a, **k)
            module.prepared_native = without
    if args.no_rewritten_launch:
        from kiln.tactics.cpu import native_member
        native_member.RewrittenLaunch.of = classmethod(lambda cls, *a: None)
    if args.no_views_made_ahead:
        from kiln.runtime import views_ahead
        views_ahead.views_ahead_at = lambda *a: False
    if args.no_gather_grids:
        shape_function.GATHER_GRIDS = False
    if args.no_corners:
        shape_function.CORNERS = False
    if args.no_packed_views:
        native_views.PACKED = False
    if args.plans_ahead:
        first_calls.PLANS_AHEAD = args.plans_ahead
    if args.no_memos:
        first_calls.memo_shapes = lambda program, profiles: []
    if args.no_grid_rows:
        shape_function.GRID_ROWS_BYTES = 0
    if args.copy_outputs:
        from kiln.runtime.context import ExecutionContext
        ExecutionContext._outputs_into = lambda self: None
    rng = np.random.default_rng(0)
    if args.image:
        image = tuple(int(v) for v in args.image.split("x"))
        shapes = [(int(b),) for b in args.shapes.split(",")]
        feeds = {s: {"pixel_values": rng.standard_normal((*s, *image)).astype(np.float32)} for s in shapes}
        warm = {"pixel_values": rng.standard_normal((args.warm_batch, *image)).astype(np.float32)}
    else:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
        feeds = {s: {"input_ids": rng.integers(0, 1000, s), "attention_mask": np.ones(s, np.int64)} for s in shapes}
        warm = {"input_ids": rng.integers(0, 1000, (2, 16)), "attention_mask": np.ones((2, 16), np.int64)}
    context = warm_context(args.engine)
    first_calls.primitives_made(120)
    feeds = {s: {k: v for k, v in f.items() if k in context.engine.input_names} for s, f in feeds.items()}  # (GPT-2)
    spans, timed = span_timer()
    for owner, attribute, name in PARTS:
        setattr(owner, attribute, timed(getattr(owner, attribute), name))

    call = context.run
    if args.execute:  # the caller's one output buffer, of the largest shape's output, touched before the calls
        import torch
        output = context.engine.outputs[0]
        held = torch.zeros(max(math.prod(s) for s in shapes) * math.prod(output.shape[len(shapes[0]):]))

        def bind(f):
            for name, value in f.items():
                context.set_tensor_address(name, torch.from_numpy(value))
            size = (*next(iter(f.values())).shape, *output.shape[len(shapes[0]):])
            context.set_tensor_address(output.name, held[:math.prod(size)].view(size))
            return context.execute

    def run(f):
        spans.clear()
        go = bind(f) if args.execute else (lambda: call(f))
        faults, start = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt, time.thread_time_ns()
        out = go()
        spent = (time.thread_time_ns() - start) / 1e3
        return spent, {**spans, "faults": resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - faults}, out

    rows: dict[str, list[float]] = {}
    for shape in shapes:
        first, got, out = run(feeds[shape])
        repeats = [run(feeds[shape]) for _ in range(3)]
        best = min(repeats, key=lambda r: r[0])
        rows.setdefault("first - repeat", []).append(first - best[0])
        rows.setdefault("outside the loop", []).append(first - best[0] - got.get("loop", 0) + best[1].get("loop", 0))
        rows.setdefault("first call", []).append(first)
        rows.setdefault("best repeat", []).append(best[0])
        rows.setdefault("minor faults, first call", []).append(got["faults"])
        rows.setdefault("minor faults, best repeat", []).append(best[1]["faults"])
        for _, _, name in PARTS:
            rows.setdefault(name, []).append(got.get(name, 0.0))
    if args.onnx:
        import onnxruntime as ort
        options = ort.SessionOptions()
        options.intra_op_num_threads = options.inter_op_num_threads = 1
        session = ort.InferenceSession(args.onnx, options, providers=["CPUExecutionProvider"])
        names = [i.name for i in session.get_inputs()]
        for _ in range(3):
            session.run(None, {k: v for k, v in warm.items() if k in names})
        for shape in shapes:
            f = {k: v for k, v in feeds[shape].items() if k in names}
            start = time.thread_time_ns()
            session.run(None, f)
            first = (time.thread_time_ns() - start) / 1e3
            repeat = []
            for _ in range(3):
                start = time.thread_time_ns()
                session.run(None, f)
                repeat.append((time.thread_time_ns() - start) / 1e3)
            rows.setdefault("onnxruntime first - repeat", []).append(first - min(repeat))
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"# {args.label} {Path(args.engine).name}, 1 thread, {cpu}, load {os.getloadavg()[0]:.1f}, "
          f"ahead failed {first_calls.onednn_ahead.AHEAD.failed}")
    print("| µs | " + " | ".join("x".join(map(str, s)) for s in shapes) + " |")
    print("|---|" + "---|" * len(shapes))
    for name, values in rows.items():
        print(f"| {name} | " + " | ".join(f"{v:.0f}" for v in values) + " |")


def steady(args) -> None:
    """Views ahead on (B) and off (A) at shapes already seen: two loads of the engine in one process."""
    import statistics

    real, real_segments = first_calls._trace_job, getattr(first_calls, "_segments_job", None)

    def load(views_ahead: bool):
        first_calls._trace_job = real if views_ahead else (lambda program, profiles: None)
        if real_segments is not None:
            first_calls._segments_job = real_segments if views_ahead else (lambda program, profiles, dtypes: None)
        context = warm_context(args.engine)
        first_calls.primitives_made(120)
        return context

    if args.b_first:  # which engine a process loads first moves tiny calls by 10-25% (bench/image_batches.py)
        b = load(True)
        a = load(False)
    else:
        a = load(False)
        b = load(True)
    first_calls._trace_job = real
    if real_segments is not None:
        first_calls._segments_job = real_segments
    rng = np.random.default_rng(0)
    if args.image:
        image = tuple(int(v) for v in args.image.split("x"))
        shapes = [(int(v),) for v in args.steady.split(",")]
        feeds = {s: {"pixel_values": rng.standard_normal((*s, *image)).astype(np.float32)} for s in shapes}
    else:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.steady.split(",")]
        feeds = {s: {"input_ids": rng.integers(0, 1000, s), "attention_mask": np.ones(s, np.int64)} for s in shapes}
    times: dict[tuple, list[float]] = {}
    for shape in shapes:  # each bound once on both
        a.run(feeds[shape])
        b.run(feeds[shape])
    for _ in range(args.rounds):
        order = [(name, context, shape) for name, context in (("A", a), ("B", b)) for shape in shapes]
        rng.shuffle(order)
        for name, context, shape in order:
            start = time.thread_time_ns()
            context.run(feeds[shape])
            times.setdefault((name, shape), []).append((time.thread_time_ns() - start) / 1e6)
    print(f"# steady state, {Path(args.engine).name}, 1 thread, load {os.getloadavg()[0]:.1f}, {args.rounds} rounds: "
          f"A views ahead off, B on (ms, median; {'B' if args.b_first else 'A'} loaded first)")
    print("| shape | A | B | B / A |\n|---|---|---|---|")
    for shape in shapes:
        ma, mb = statistics.median(times["A", shape]), statistics.median(times["B", shape])
        print(f"| {'x'.join(map(str, shape))} | {ma:.2f} | {mb:.2f} | {mb / ma:.3f} |")


if __name__ == "__main__":
    main()
