"""The fixed cost of one CPU engine call around its native loop (issue 11): each level of the call path timed alone,
from engine.run down to the compiled loop, beside onnxruntime's run and the loop's own layer times.

    python bench/call_overhead.py                                   # the four models, 1 thread, thread CPU time
    python bench/call_overhead.py --models resnet_tiny,relu16 --rounds 21 --engines /tmp/engines --profile
    python bench/call_overhead.py --models roberta_tiny_dynamic,bert_tiny_dynamic --rounds 9 --engines /tmp/engines
    python bench/call_overhead.py --models gpt2_dynamic --shape 4x64 --rounds 9 --min-block 2 --top --engines DIR

Models: resnet_tiny, regnet_tiny, roberta_tiny (the zoo's exports at their input shapes) and relu16 (one Relu on a
fixed [1, 16] float32: the path with nothing to compute). A zoo name with "_dynamic" is exported with symbolic
batch x sequence and fed --shape (the zoo's random inputs at that batch x sequence; default 2x16): built over the
profile input_ids 1x1, 2x16, 8x64, except gpt2 (GPT-2 small), built with kiln's default profile as
bench/results/zoo-cpu-zen4-2026-12-07.md built it (batch 1..64, sequence 1..1024, tuned at 1x128).
Each is built at the thread count (or loaded from
--engines DIR, built and saved there the first time), checked against onnxruntime, then every rung of its call path
runs in interleaved rounds (rung 1, rung 2, ..., onnxruntime, rung 1, ...): a block of calls per rung per round,
timed as one by the clock (the calling thread's CPU time by default: time waiting for a core on a shared machine is
not counted), the block sized to about --block-ms, 20 ms slept and 5 calls made before it; each round starts one rung
later than the one before. Per rung the median of its rounds' per-call times.

The rungs are what the context's call actually takes for this model (kiln/runtime/context.py, cpu_paths.py,
direct_run.py, native.py), each a strict part of the one above it, so a row's "above" is the cost of what it adds
over the row below: engine.run (the thread's context), context.run (the OpenMP governor around the call),
context._run (the path's dispatch, checks, conversions, outputs), then the path's own rungs down to the compiled
loop alone (its moving addresses written and one ctypes call on buffers made once; at 2 threads in the form the
segment's chooser holds best, OpenMP's count at 1 around a serial one). "layers" is the compiled loop's
own per-layer times summed (Segment.timed: one clock read per layer, counted in the layers). "overhead" is engine.run
less the compiled loop alone.

--micro: the pieces' warm costs alone (the loop's ctypes call through argtypes and bare, an array's address two ways,
numpy and torch conversions, a lock, the form chooser, one_openmp_thread, the OpenMP governor's begin and end).

--profile: cProfile of --profile-calls engine.run calls per model (its tottime per function; cProfile's own cost
inflates every Python function, so read the order and the counts, not the microseconds).
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import os
import pstats
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

MODELS = ("resnet_tiny", "regnet_tiny", "roberta_tiny", "relu16")
DYNAMIC = "_dynamic"  # a zoo model's name with it: exported with dynamic batch x sequence, built over DYNAMIC_PROFILE
DYNAMIC_PROFILE = {"input_ids": "1x1,2x16,8x64"}
DEFAULT_PROFILE = ("gpt2",)  # dynamic zoo models built at kiln's default profile (as bench/zoo.py's runs build them)
SETTLE_S = 0.02  # slept before each block: onnxruntime's workers spin on after its block (2 threads)
CLOCKS = {"thread": time.thread_time_ns, "process": time.process_time_ns, "wall": time.perf_counter_ns}


@dataclass
class Rung:
    """One level of the call path: `call` does what that level does, no more."""

    name: str
    call: Callable[[], Any]


def _relu16() -> tuple[bytes, dict[str, np.ndarray]]:
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu16",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    x = np.random.default_rng(0).standard_normal((1, 16)).astype(np.float32)
    return model.SerializeToString(), {"x": x}


def model_and_feeds(model: str, shape: tuple[int, int] = (2, 16)) -> tuple[Any, dict[str, np.ndarray]]:
    """(what kiln.build and onnxruntime take, the feeds as C-contiguous numpy arrays); a dynamic model's at `shape`
    (batch, sequence)."""
    if model == "relu16":
        return _relu16()
    from kiln import zoo
    from kiln.zoo.models import make_inputs

    dynamic = model.endswith(DYNAMIC)  # exported with dynamic batch x sequence (at 2 x 16), fed `shape`
    name = model.removesuffix(DYNAMIC)
    exported = zoo.export(name, **({"batch": 2, "seq": 16, "dynamic": True} if dynamic else {}))
    feeds = make_inputs(zoo.get(name), batch=shape[0], seq=shape[1], seed=0) if dynamic and shape != (2, 16) \
        else exported.inputs()
    return str(exported.path), {k: np.ascontiguousarray(v) for k, v in feeds.items()}


def engine_of(model: str, source: Any, folder: Path | None, threads: int):
    import kiln

    dynamic = model.endswith(DYNAMIC) and model.removesuffix(DYNAMIC) not in DEFAULT_PROFILE
    options = {"profiles": [DYNAMIC_PROFILE]} if dynamic else {}
    if folder is None:
        return kiln.build(source, **options)
    path = folder / f"{model}-{threads}t.kiln"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        kiln.build(source, **options).save(str(path))
    return kiln.load(str(path))


def _loop_alone(segment: Any, staged: bool, entries: list[int], exits: list[int], keep: Any) -> Callable[[], None]:
    """The segment's compiled loop on fixed entry and exit addresses, in the form its chooser holds best at each call
    (the serial one with OpenMP's count at 1 around it, set here by two ctypes calls: as the engine's path needs it,
    whichever way the checkout under test sets it); `keep`: what the addresses point into (held by the call)."""
    from kiln.kernels.cpu import onednn
    from kiln.kernels.cpu.form_choice import PARALLEL, SERIAL
    from kiln.runtime.native_members import _run_loop

    sources = {"entry": entries, "exit": exits}
    runs = {form: functools.partial(_run_loop, segment._c[staged, form], segment._stream, sources,
                                    segment._variants[staged, form][2])
            for form in (PARALLEL, SERIAL) if (staged, form) in segment._c}
    chooser = segment.chooser
    if chooser is None:
        run = runs[PARALLEL]
        run.keep = keep
        return run
    get_max, set_count = onednn._openmp_threads(onednn.load().lib)
    parallel, serial = runs[PARALLEL], runs[SERIAL]

    def run() -> None:
        if chooser.best() == SERIAL:
            before = get_max()
            set_count(1)
            serial()
            set_count(before)
        else:
            parallel()

    run.keep = keep
    return run


def rungs_of(engine: Any, feeds: dict[str, np.ndarray]) -> tuple[list[Rung], Any]:
    """The rungs of the path an engine.run(feeds) takes on this thread's context, and the segment whose layers are
    timed (None: no native segment)."""
    import torch

    from kiln.runtime.cpu_paths import inference_mode
    from kiln.runtime.direct_run import torch_signature
    from kiln.runtime.native import Segment

    engine.run(feeds)  # this thread's context, bound at these shapes
    engine.run(feeds)  # (a dynamic shape's first repeat measures what binding it cost: then its repeats' path)
    takes_signature = _takes_signature()
    context = engine._threads.context
    rungs = [Rung("engine.run", lambda: engine.run(feeds)), Rung("context.run", lambda: context.run(feeds)),
             Rung("context._run", lambda: context._run(feeds))]
    arrays = [feeds[n] for n in engine.input_names]
    whole = context._whole_segment if context._static is not None else None
    if whole is not None:  # a fixed-shape engine that is one native segment: numpy in, numpy out
        numpy_run = whole.run if hasattr(whole, "segment") else whole.run_numpy  # StaticRun (direct_run.py); before
        segment = whole.segment if hasattr(whole, "segment") else whole  # it, the Segment itself (run_numpy)
        staged = bool(segment._staged)
        exits = numpy_run(arrays)
        entries = list(whole.addresses) if hasattr(whole, "addresses") else [a.ctypes.data for a in arrays]
        for position, k in getattr(whole, "moving", ()):
            entries[position] = arrays[k].ctypes.data
        exit_addresses = [(e.base if e.base is not None else e).ctypes.data for e in exits]

        def run_fixed(exits: list[np.ndarray] = exits) -> None:  # (the exits held as long as the call)
            with segment._lock:
                segment._run(entries, exit_addresses, staged)

        rungs += [Rung("_run_static", lambda: context._run_static(feeds)),
                  Rung("the segment's numpy run", lambda: numpy_run(arrays)),
                  Rung("the segment's run, exits made once", run_fixed),
                  Rung("compiled loop alone", _loop_alone(segment, staged, entries, exit_addresses, exits))]
        return rungs, segment
    direct = context._direct
    if direct is not None:  # numpy feeds of a checked signature: one call of the segment's loop (direct_run.py)
        signature = torch_signature(arrays)
        record = direct.find(signature)
        view = record.view()
        addresses = list(record.addresses)
        for position, k in record.moving:
            addresses[position] = arrays[k].ctypes.data
        exits = [np.empty(size, dtype) for size, dtype in record.exits]
        exit_addresses = [e.ctypes.data for e in exits]
        segment = view if view is direct.segment else None
        rungs += [Rung("_run_checked", lambda: context._run_checked(feeds)),
                  Rung("_run_direct", lambda: context._run_direct(arrays, signature) if takes_signature
                       else context._run_direct(arrays)),  # (before 2026-12-07b: the signature found there)
                  Rung("DirectRun.run", lambda: record.run(arrays)),
                  Rung("view.run_at (exits made once)", lambda exits=exits: view.run_at(addresses, exit_addresses))]
        if segment is not None:
            rungs.append(Rung("compiled loop alone", _loop_alone(segment, False, addresses, exit_addresses, exits)))
        return rungs, segment
    # the general path: the program's steps in Python, torch in and out
    program = context.program
    args = [torch.from_numpy(a) for a in arrays]
    if context._static is not None:
        rungs.append(Rung("_run_static", lambda: context._run_static(feeds)))
    elif context._checked is not None:  # dynamic shapes: a checked signature, then the program (padded first calls)
        rungs.append(Rung("_run_checked", lambda: context._run_checked(feeds)))
        if context._first_calls is not None:
            def first_calls_run() -> None:
                with inference_mode():
                    context._first_calls.run(args)

            rungs.append(Rung("FirstCalls.run (torch in/out)", first_calls_run))

    def program_run() -> None:
        with inference_mode():
            program.run(args)

    rungs.append(Rung("Program.run (torch in/out)", program_run))
    if len(program.run_steps) != 1 or program.shape_plans is not None:
        return rungs, None
    step = program.run_steps[0]  # the program is one step: a native segment (its exits fresh tensors) or a layer
    env = list(program.template)
    for slot, value in zip(program.input_slots, args):
        env[slot] = value
    values = [env[s] for s in step.inputs]

    def one_step() -> None:
        with inference_mode():
            step.fn(step.ctx, *values, **step.attributes)

    segment = step.fn if isinstance(step.fn, Segment) else None
    rungs.append(Rung("the segment's call (torch)" if segment is not None else f"{step.ctx.op_type} kernel alone",
                      one_step))
    if segment is None or segment._staged:
        return rungs, None
    with inference_mode():
        exits = step.fn(step.ctx, *values)
    exits = [exits] if isinstance(exits, torch.Tensor) else list(exits)
    entries = [v.data_ptr() for v in values]
    exit_addresses = [e.data_ptr() for e in exits]
    rungs.append(Rung("compiled loop alone", _loop_alone(segment, False, entries, exit_addresses, (values, exits))))
    return rungs, segment


def _takes_signature() -> bool:
    """Whether the checkout's CpuPaths._run_direct takes the program's signature (found once per numpy signature)."""
    import inspect

    from kiln.runtime.cpu_paths import CpuPaths

    return "signature" in inspect.signature(CpuPaths._run_direct).parameters


def layer_times(segment: Any, run: Callable[[], Any], calls: int) -> float:
    """The median over `calls` runs of the segment's per-run sum of layer times (µs, the thread's CPU clock)."""
    sums = []
    with segment.timed(time.CLOCK_THREAD_CPUTIME_ID) as found:
        for _ in range(calls):
            run()
    per_run = zip(*found.values())
    for layers in per_run:
        sums.append(sum(layers) * 1e3)
    return statistics.median(sums)


def measure(model: str, args: argparse.Namespace) -> None:
    import onnxruntime as ort

    source, feeds = model_and_feeds(model, args.shape)
    engine = engine_of(model, source, args.engines, args.threads)
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = args.threads, 1
    session = ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    want = session.run(None, feeds)
    got = engine.run(feeds)
    for name, w in zip(names, want):
        err = float(np.abs(np.asarray(got[name], np.float64) - w).max() / (np.abs(w).max() + 1e-12))
        if err > 1e-4:
            raise SystemExit(f"{model}: output {name!r} is {err:.2e} of its max off onnxruntime's")
    rungs, segment = rungs_of(engine, feeds)
    if args.top:  # engine.run and onnxruntime alone (a large model: more rounds in the time)
        rungs, segment = rungs[:1], None
    rungs.append(Rung("onnxruntime run", lambda: session.run(None, feeds)))
    clock = CLOCKS[args.clock]
    blocks = {}
    for rung in rungs:  # calls per block: about block_ms of this rung
        for _ in range(min(20, args.min_block)):
            rung.call()
        t0 = time.perf_counter_ns()
        sized = 50 if args.min_block >= 20 else 2
        for _ in range(sized):
            rung.call()
        per_call = (time.perf_counter_ns() - t0) / sized
        blocks[rung.name] = max(args.min_block, int(args.block_ms * 1e6 / max(per_call, 1.0)))
    times: dict[str, list[float]] = {r.name: [] for r in rungs}
    loads = []
    for r in range(args.rounds):
        loads.append(os.getloadavg()[0])
        for rung in rungs[r % len(rungs):] + rungs[:r % len(rungs)]:  # each round starts one rung later
            n, call = blocks[rung.name], rung.call
            time.sleep(SETTLE_S)
            for _ in range(min(5, args.min_block)):
                call()
            t0 = clock()
            for _ in range(n):
                call()
            times[rung.name].append((clock() - t0) / n / 1e3)
    layers = layer_times(segment, rungs[0].call, args.layer_calls) if segment is not None and args.layer_calls \
        else None
    median = {name: statistics.median(v) for name, v in times.items()}
    ort_us = median["onnxruntime run"]
    bottom = [r.name for r in rungs if r.name != "onnxruntime run"][-1]
    shape = f" at {args.shape[0]}x{args.shape[1]}" if model.endswith(DYNAMIC) else ""
    print(f"\n{model}{shape}: {args.threads} thread(s), {args.clock} clock, {args.rounds} rounds, load "
          f"{min(loads):.2f}-{max(loads):.2f}")
    print("| rung | µs a call | rounds min-max | above the rung below | / onnxruntime |")
    print("|---|---|---|---|---|")
    kiln_rungs = [r.name for r in rungs if r.name != "onnxruntime run"]
    for k, name in enumerate(kiln_rungs):
        above = median[name] - median[kiln_rungs[k + 1]] if k + 1 < len(kiln_rungs) else None
        print(f"| {name} | {median[name]:.2f} | {min(times[name]):.2f}-{max(times[name]):.2f} | "
              f"{'' if above is None else f'{above:.2f}'} | {median[name] / ort_us:.3f} |")
    print(f"| onnxruntime run | {ort_us:.2f} | {min(times['onnxruntime run']):.2f}-"
          f"{max(times['onnxruntime run']):.2f} | | 1.000 |")
    if layers is not None:
        print(f"| layers (the loop's own times, summed) | {layers:.2f} | | | {layers / ort_us:.3f} |")
    print(f"overhead: engine.run - {bottom} = {median['engine.run'] - median[bottom]:.2f} µs a call; "
          f"engine.run / onnxruntime {median['engine.run'] / ort_us:.3f}")
    if args.profile:
        profile = cProfile.Profile()
        call = rungs[0].call
        profile.enable()
        for _ in range(args.profile_calls):
            call()
        profile.disable()
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(args.profile_rows)
        print(f"cProfile of {args.profile_calls} engine.run calls (tottime per function):")
        print("\n".join(line for line in out.getvalue().splitlines()[6:] if line.strip()))


def micro(args: argparse.Namespace) -> None:
    """Warm costs of the call path's pieces alone (ns a call, best of 5 blocks): what the ladder's rungs are made of,
    before a network's run cools the caches (in a call each costs more: the rungs in situ)."""
    import ctypes
    import threading

    import torch

    from kiln.kernels.cpu import native_loop, omp_governor, onednn
    from kiln.kernels.cpu.form_choice import FormChooser

    lib, dnnl = native_loop.load(), onednn.load()
    a = np.zeros((1, 3, 64, 64), np.float32)
    nothing = [(ctypes.c_void_p * 1)() for _ in range(5)]
    count, failed = (ctypes.c_int * 1)(), ctypes.c_int(-1)
    set_handle = ctypes.cast(dnnl.lib.dnnl_memory_set_data_handle, ctypes.c_void_p)
    loop_args = (nothing[0], set_handle, dnnl.stream, 0, nothing[1], nothing[2], 0, nothing[3], count, nothing[4])
    bare = getattr(lib, "kiln_run_segment_bare", None)
    chooser = FormChooser()
    tick = [0]

    def choose_and_record() -> None:
        form = chooser.choose()
        time.perf_counter()
        tick[0] += 1
        chooser.record(form, 1e-4 * (1.5 if form == "parallel" else 1.0) * (1 + (tick[0] % 7) * 1e-3))

    def serial_count() -> None:
        with onednn.one_openmp_thread():
            pass

    governor = omp_governor.governor()

    def governor_pair() -> None:
        governor.begin()
        governor.end()

    lock = threading.Lock()

    def locked() -> None:
        with lock:
            pass

    pieces = [("the loop's ctypes call, argtypes (11 conversions), no layer",
               lambda: lib.kiln_run_segment(*loop_args, ctypes.byref(failed))),
              ("array.ctypes.data", lambda: a.ctypes.data),
              ("ctypes.addressof(c_char.from_buffer(array))", lambda: ctypes.addressof(ctypes.c_char.from_buffer(a))),
              ("np.empty((1, 1000), float32)", lambda: np.empty((1, 1000), np.float32)),
              ("torch.from_numpy", lambda: torch.from_numpy(a)),
              ("tensor.numpy()", torch.from_numpy(a).numpy),
              ("torch._C._InferenceMode guard, entered and left", lambda: _entered(torch._C._InferenceMode(True))),
              ("a lock, entered and left", locked),
              ("FormChooser choose + perf_counter + record", choose_and_record),
              ("with one_openmp_thread()", serial_count),
              (f"governor begin + end ({args.threads} thread(s))", governor_pair)]
    if hasattr(governor, "idle"):  # what ExecutionContext.run asks first (since 2026-12-07)
        pieces.append((f"governor idle() ({args.threads} thread(s))", governor.idle))
    if bare is not None:
        pieces.insert(1, ("the loop's ctypes call, bare (kiln_run_segment_bare), no layer",
                          lambda: bare(*loop_args, ctypes.byref(failed))))
    print(f"\nwarm costs, {args.threads} thread(s), thread clock, load {os.getloadavg()[0]:.2f}")
    print("| piece | ns a call |\n|---|---|")
    for name, fn in pieces:
        for _ in range(2000):
            fn()
        best = float("inf")
        for _ in range(5):
            t0 = time.thread_time_ns()
            for _ in range(100_000):
                fn()
            best = min(best, (time.thread_time_ns() - t0) / 100_000)
        print(f"| {name} | {best:.0f} |")


def _entered(guard: Any) -> None:
    with guard:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="thread")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--block-ms", type=float, default=20.0)
    parser.add_argument("--min-block", type=int, default=20, help="calls a block takes at least")
    parser.add_argument("--layer-calls", type=int, default=400, help="runs the layers' times are taken over (0: none)")
    parser.add_argument("--shape", type=lambda s: tuple(int(d) for d in s.split("x")), default=(2, 16),
                        help="a dynamic model's batch x sequence (default 2x16)")
    parser.add_argument("--engines", type=Path, default=None, help="build once into DIR, load from it after")
    parser.add_argument("--top", action="store_true", help="time engine.run and onnxruntime's run only")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--profile-calls", type=int, default=2000)
    parser.add_argument("--profile-rows", type=int, default=20)
    parser.add_argument("--micro", action="store_true", help="the pieces' warm costs alone, no model")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    import onnxruntime

    import kiln

    print(f"call overhead: {args.threads} thread(s), clock {args.clock}, torch {torch.__version__}, onnxruntime "
          f"{onnxruntime.__version__}, kiln {kiln.__version__}, load {os.getloadavg()[0]:.2f}")
    if args.micro:
        micro(args)
        return
    for model in args.models.split(","):
        measure(model, args)


if __name__ == "__main__":
    main()
