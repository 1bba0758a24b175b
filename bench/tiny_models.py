"""Small models as users deploy them (a logistic regression, a one-Gemm scorer, a feature normaliser, a tiny MLP, one
convolution, one MatMul over a symbolic batch): kiln's engine.run beside onnxruntime's run, in one process, 1 thread
by default (issue 11: a model of one or a few layers must call as fast as onnxruntime's).

    python bench/tiny_models.py                                  # every model, 1 thread, thread CPU time
    python bench/tiny_models.py --models relu16,gemm --rounds 21 --profile

Each model is built at the thread count, checked against onnxruntime (1e-5 of the output's largest magnitude), then
kiln's engine.run and onnxruntime's run are timed in interleaved rounds (kiln, onnxruntime, onnxruntime, kiln, ...):
a block of calls each, sized to about --block-ms, 5 calls made and 20 ms slept before it, timed as one by the clock
(the calling thread's CPU time by default: time waiting for a core on a shared machine is not counted). Per side the
median of its rounds' per-call times and the best round. A dynamic model runs at one batch (`@4`) and at batches
cycling 1, 7, 32 (`@1/7/32`, a new batch every call).

--profile: cProfile of --profile-calls engine.run calls per model (read the order and the counts: cProfile's own
cost inflates every Python frame). --path: which of the context's paths the call takes (kiln/runtime/context.py).
"""

from __future__ import annotations

import argparse
import cProfile
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

SETTLE_S = 0.02
CLOCKS = {"thread": time.thread_time_ns, "process": time.process_time_ns, "wall": time.perf_counter_ns}


@dataclass
class TinyModel:
    """An ONNX model, its feeds per call (cycled) and the profiles kiln builds it over (None: its fixed shapes)."""

    onnx: bytes
    feeds: list[dict[str, np.ndarray]]
    profiles: list[dict[str, str]] | None = None
    note: str = ""


def _make(nodes: list, inputs: list, outputs: list, initializers: dict[str, np.ndarray]) -> bytes:
    from onnx import helper, numpy_helper

    graph = helper.make_graph(nodes, "tiny", inputs, outputs,
                              [numpy_helper.from_array(v, k) for k, v in initializers.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10).SerializeToString()


def _float(name: str, shape: list) -> Any:
    from onnx import TensorProto, helper

    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def tiny_models(seed: int = 0) -> dict[str, TinyModel]:
    """The bench's models, weights and feeds drawn from `seed`."""
    from onnx import helper

    rng = np.random.default_rng(seed)

    def normal(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    node = helper.make_node
    models = {
        "relu16": TinyModel(_make([node("Relu", ["x"], ["y"])], [_float("x", [1, 16])], [_float("y", [1, 16])], {}),
                            [{"x": normal(1, 16)}], note="one Relu, [1, 16]"),
        "gemm": TinyModel(_make([node("Gemm", ["x", "W", "b"], ["y"])], [_float("x", [1, 64])], [_float("y", [1, 8])],
                                {"W": normal(64, 8), "b": normal(8)}),
                          [{"x": normal(1, 64)}], note="one Gemm + bias, [1, 64] x [64, 8]"),
        "normalise": TinyModel(_make([node("Add", ["x", "shift"], ["t"]), node("Mul", ["t", "scale"], ["y"])],
                                     [_float("x", [1, 32])], [_float("y", [1, 32])],
                                     {"shift": normal(32), "scale": normal(32)}),
                               [{"x": normal(1, 32)}], note="(x + shift) * scale, [1, 32]"),
        "mlp": TinyModel(_make([node("Gemm", ["x", "W1", "b1"], ["h"], transB=1), node("Relu", ["h"], ["r"]),
                                node("Gemm", ["r", "W2", "b2"], ["z"], transB=1),
                                node("Softmax", ["z"], ["y"], axis=-1)],
                               [_float("x", [8, 32])], [_float("y", [8, 4])],
                               {"W1": normal(64, 32), "b1": normal(64), "W2": normal(4, 64), "b2": normal(4)}),
                         [{"x": normal(8, 32)}], note="[8, 32] -> 64 Relu -> 4 Softmax"),
        "conv": TinyModel(_make([node("Conv", ["x", "W", "b"], ["y"], pads=[1, 1, 1, 1])],
                                [_float("x", [1, 3, 32, 32])], [_float("y", [1, 8, 32, 32])],
                                {"W": normal(8, 3, 3, 3), "b": normal(8)}),
                          [{"x": normal(1, 3, 32, 32)}], note="one 3x3 Conv + bias, [1, 3, 32, 32] -> 8 channels"),
    }
    matmul = _make([node("MatMul", ["x", "W"], ["y"])], [_float("x", ["batch", 64])], [_float("y", ["batch", 16])],
                   {"W": normal(64, 16)})
    profiles = [{"x": "1x64,4x64,32x64"}]
    models["matmul_dyn@4"] = TinyModel(matmul, [{"x": normal(4, 64)}], profiles, note="MatMul [batch, 64] x [64, 16]")
    models["matmul_dyn@1/7/32"] = TinyModel(matmul, [{"x": normal(b, 64)} for b in (1, 7, 32)], profiles,
                                            note="the same, a new batch each call")
    return models


def which_path(engine: Any, feeds: dict[str, np.ndarray]) -> str:
    """The context's path for these feeds (what its _run tries first and takes)."""
    engine.run(feeds)
    context = engine._threads.context
    if context._static is not None:
        return "static: one native segment (StaticRun)" if context._whole_segment is not None else \
            "static: Program.run (torch in/out)"
    if context._direct is not None:
        from kiln.runtime.direct_run import torch_signature

        record = context._direct.find(torch_signature([feeds[n] for n in engine.input_names]))
        if record is not None:
            return "checked: one native segment (DirectRun)"
    return "checked: Program.run (torch in/out)" if context._checked is not None else "general"


def ort_session(model: TinyModel, threads: int) -> Any:
    """onnxruntime's session of `model` at `threads` intra-op threads (one inter-op), as the peer side."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    return ort.InferenceSession(model.onnx, options, providers=["CPUExecutionProvider"])


def check_against(session: Any, engines: list[Any], model: TinyModel, name: str) -> None:
    """Each engine's output on every feed of `model` within 1e-5 of the largest magnitude of onnxruntime's."""
    output = session.get_outputs()[0].name
    for feeds in model.feeds:
        want = session.run(None, feeds)[0]
        for engine in engines:
            got = engine.run(feeds)[output]
            err = float(np.abs(np.asarray(got, np.float64) - want).max() / (np.abs(want).max() + 1e-12))
            if err > 1e-5:
                raise SystemExit(f"{name}: {err:.2e} of the output's largest magnitude off onnxruntime's")


def interleaved(sides: dict[str, Callable[[int], None]], cycle: int,
                args: argparse.Namespace) -> tuple[dict[str, list[float]], list[float]]:
    """µs a call of each side (block(n): n calls over the feeds' cycle), timed in blocks of ~args.block_ms (whole
    cycles), the sides' order rotated every round, SETTLE_S slept and 5 calls before each block: (times per round,
    the load at each round)."""
    clock = CLOCKS[args.clock]
    blocks = {}
    for side, block in sides.items():
        block(200)
        t0 = time.perf_counter_ns()
        block(300)
        blocks[side] = max(3 * cycle, int(args.block_ms * 1e6 / max((time.perf_counter_ns() - t0) / 300, 1.0)))
        blocks[side] -= blocks[side] % cycle  # whole cycles
    times: dict[str, list[float]] = {side: [] for side in sides}
    loads = []
    order = list(sides)
    for r in range(args.rounds):
        loads.append(os.getloadavg()[0])
        for side in order[r % len(order):] + order[:r % len(order)]:
            time.sleep(SETTLE_S)
            sides[side](5)
            t0 = clock()
            sides[side](blocks[side])
            times[side].append((clock() - t0) / blocks[side] / 1e3)
    return times, loads


def measure(name: str, model: TinyModel, args: argparse.Namespace) -> dict[str, float]:
    import kiln

    engine = kiln.build(model.onnx, **({"profiles": model.profiles} if model.profiles else {}))
    session = ort_session(model, args.threads)
    check_against(session, [engine], model, name)
    cycle = model.feeds

    def kiln_block(n: int) -> None:
        run, k = engine.run, len(cycle)
        for i in range(n):
            run(cycle[i % k])

    def ort_block(n: int) -> None:
        run, k = session.run, len(cycle)
        for i in range(n):
            run(None, cycle[i % k])

    times, loads = interleaved({"kiln": kiln_block, "onnxruntime": ort_block}, len(cycle), args)
    path = which_path(engine, cycle[0])  # (after the timed calls: a new batch's path settles over its first calls)
    result = {side: statistics.median(v) for side, v in times.items()}
    best = {side: min(v) for side, v in times.items()}
    print(f"| {name} | {model.note} | {path} | {result['kiln']:.2f} | {result['onnxruntime']:.2f} | "
          f"**{result['kiln'] / result['onnxruntime']:.3f}** | {best['kiln']:.2f} / {best['onnxruntime']:.2f} | "
          f"{min(loads):.2f}-{max(loads):.2f} |", flush=True)
    if args.profile:
        profile = cProfile.Profile()
        profile.enable()
        kiln_block(args.profile_calls)
        profile.disable()
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(args.profile_rows)
        print(f"cProfile of {args.profile_calls} engine.run calls of {name} (tottime per function):")
        print("\n".join(line for line in out.getvalue().splitlines()[6:] if line.strip()))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=None, help="comma-separated (default: every model)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="thread")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--block-ms", type=float, default=20.0)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--profile-calls", type=int, default=20000)
    parser.add_argument("--profile-rows", type=int, default=25)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    import onnxruntime

    import kiln

    models = tiny_models()
    chosen = args.models.split(",") if args.models else list(models)
    print(f"tiny models: {args.threads} thread(s), {args.clock} clock, {args.rounds} rounds, "
          f"torch {torch.__version__}, onnxruntime {onnxruntime.__version__}, kiln {kiln.__version__}, "
          f"load {os.getloadavg()[0]:.2f}")
    print("| model | what | kiln's path | kiln µs | onnxruntime µs | kiln / ort | best round kiln / ort µs | load |")
    print("|---|---|---|---|---|---|---|---|")
    for name in chosen:
        measure(name, models[name], args)


if __name__ == "__main__":
    main()
