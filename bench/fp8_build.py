"""What a CUDA build of ResNet-50 batch 256 in INT8 / FP8 tunes and compiles, counted on a machine without a GPU.

    python bench/fp8_build.py [--modes kiln_fp8,kiln_int8] [--opt-levels 2,3] [--compile kiln_fp8:3] [--workers 2]

Per (mode, opt level): the tunable layers, the distinct ones (the timing cache's key: identical layers are timed
once), the candidates the search prepares, checks and times (all layers / distinct layers), and the distinct Triton
kernels those candidates launch, recorded for sm_90 through Triton's own JIT (tests/kernels/compile_sm90.py's
stand-in driver and kiln/kernels/cuda/triton/precompile.py's recorded_launches: what a build on the H200 compiles).
--compile MODE:OPT compiles that row's kernels for sm_90 on this CPU, one at a time in this process (CPU seconds of
this process and its ptxas children, and wall), then with the build's CompilePool of --workers processes into a
fresh cache (wall). Models: kiln.zoo's resnet50 (random weights) through onnxruntime's quantize_static, as
bench/quant_gpu.py makes them, on one calibration batch (the counts do not depend on the ranges).
"""

from __future__ import annotations

import argparse
import collections
import os
import resource
import sys
import tempfile
import time
from concurrent.futures import wait
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # the real compiler
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

from kiln import zoo  # noqa: E402
from kiln.builder.autotune import _candidates, _usable, example_inputs  # noqa: E402
from kiln.builder.layer_records import record_layers  # noqa: E402
from kiln.builder.build import pass_options  # noqa: E402
from kiln.builder.config import BuildConfig  # noqa: E402
from kiln.builder.padding_free import lower_precision_of, optimize_and_lower  # noqa: E402
from kiln.builder.precision import write_float32_outputs  # noqa: E402
from kiln.builder.timing_cache import layer_signature, signature_key  # noqa: E402
from kiln.frontend import onnx as onnx_frontend  # noqa: E402
from kiln.kernels.cuda.triton.precompile import CompilePool, compile_kernel, recorded_launches  # noqa: E402
from kiln.runtime.engine import place_weight  # noqa: E402
from kiln.runtime.program import Program  # noqa: E402
from kiln.tactics.tactic import DEFAULT, InputMeta  # noqa: E402
from kiln.zoo.models import make_inputs  # noqa: E402
from tests.kernels.compile_sm90 import sm90_driver  # noqa: E402

BATCH, RECORDED = 256, 2  # the engine's batch; the batch the reference program runs at here (on the CPU)
CPU = torch.device("cpu")


def qdq_model(mode: str, folder: Path) -> str:
    from quant_gpu import _ort_qdq  # bench/quant_gpu.py: the QDQ models of its engine rows

    path = folder / f"resnet50_{mode}.onnx"
    if not path.exists():
        exported = zoo.export("resnet50", batch=RECORDED, dynamic=True)
        _ort_qdq(str(exported.path), str(path), [make_inputs(zoo.get("resnet50"), batch=RECORDED, seq=0, seed=1)],
                 mode, None)
    return str(path)


def count(path: str, opt_level: int) -> dict:
    """The layers, candidates and sm_90 kernels of a CUDA build of `path` at BATCH (see the module docstring)."""
    config = BuildConfig(device="cuda", opt_level=opt_level)
    _, lowered = optimize_and_lower(onnx_frontend.load(path), pass_options(config))
    lower_precision_of(lowered, "fp16", set())
    write_float32_outputs(lowered.program, "fp16", set())
    program = lowered.program
    tunable = {i: found for i, step in enumerate(program.steps)
               if (found := _candidates(step, torch.device("cuda"), opt_level, []))}
    placed = {k: place_weight(v, CPU) for k, v in lowered.weights.items()}
    reference = Program(program, placed, CPU)
    examples = [v.half() if v.is_floating_point() else v
                for v in example_inputs(lowered.inputs, {"pixel_values": [RECORDED, 3, 224, 224]})]
    records, _ = record_layers(reference, set(tunable), examples)
    seen: set[str] = set()
    kernels: dict[str, object] = {}
    layers = candidates = distinct_candidates = 0
    for i, tactics in sorted(tunable.items()):
        step, bound = program.steps[i], reference.steps[i]
        constants = [placed[program.constants[n]] if n in program.constants else None for n in step.inputs]
        args = [a if c is not None or not isinstance(a, torch.Tensor) else  # activations at BATCH, as meta tensors
                torch.empty((BATCH, *a.shape[1:]) if a.dim() and a.shape[0] == RECORDED else a.shape, dtype=a.dtype,
                            device="meta") for a, c in zip(records[i].args, constants)]
        metas = [InputMeta.of(a, c is not None) for a, c in zip(args, constants)]
        usable, _ = _usable(tactics, step, [metas])
        layers += 1
        candidates += len(usable)
        key = signature_key(layer_signature(step, metas, [DEFAULT] + [t.name for t in usable], {}))
        if key in seen:
            continue
        seen.add(key)
        distinct_candidates += len(usable)
        for tactic in usable:
            launch = tactic.prepare(step, constants, CPU)
            with sm90_driver(), recorded_launches() as found, torch.inference_mode():
                launch(bound.ctx, *[tactic.to_layout(a) for a in args], **bound.attributes)
            kernels.update((k.key, k) for k in found)
    return {"layers": layers, "distinct": len(seen), "candidates": candidates,
            "distinct_candidates": distinct_candidates, "kernels": list(kernels.values())}


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def compile_costs(kernels: list, workers: int) -> dict:
    """sm_90 compile of every kernel: one at a time here (CPU and wall seconds per kernel name), then a pool's wall."""
    by_name: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0])
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TRITON_CACHE_DIR"] = cache
        for kernel in kernels:
            cpu, wall = _cpu_seconds(), time.perf_counter()
            compile_kernel(kernel)
            row = by_name[kernel.name]
            row[0] += 1
            row[1] += _cpu_seconds() - cpu
            row[2] += time.perf_counter() - wall
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TRITON_CACHE_DIR"] = cache
        pool = CompilePool(workers)
        start = time.perf_counter()
        wait(pool.submit(kernels))
        pool_wall = time.perf_counter() - start
        pool.close()
    return {"by_name": dict(by_name), "pool_wall": pool_wall, "workers": workers}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="kiln_fp8,kiln_int8")
    ap.add_argument("--opt-levels", default="2,3")
    ap.add_argument("--compile", default="", help="MODE:OPT whose kernels to compile for sm_90 here (slow)")
    ap.add_argument("--workers", type=int, default=2, help="the compile pool's processes for --compile")
    ap.add_argument("--models", default=str(Path(tempfile.gettempdir()) / "kiln-fp8-build"))
    args = ap.parse_args()
    folder = Path(args.models)
    folder.mkdir(parents=True, exist_ok=True)
    table = ["| mode | opt | tunable layers | distinct | candidates (distinct layers) | sm_90 kernels (QConv) |",
             "|---|---|---|---|---|---|"]
    counted = {}
    for mode in args.modes.split(","):
        path = qdq_model(mode, folder)
        for opt in map(int, args.opt_levels.split(",")):
            found = counted[f"{mode}:{opt}"] = count(path, opt)
            qconv = sum(k.name.startswith("_qconv") for k in found["kernels"])
            table.append(f"| {mode} | {opt} | {found['layers']} | {found['distinct']} | {found['candidates']} "
                         f"({found['distinct_candidates']}) | {len(found['kernels'])} ({qconv}) |")
            print(table[-1], flush=True)
    print("\n" + "\n".join(table))
    if args.compile:
        kernels = counted[args.compile]["kernels"]
        costs = compile_costs(kernels, args.workers)
        print(f"\nsm_90 compile of {args.compile}'s {len(kernels)} kernels on this CPU "
              f"({os.uname().nodename}, load {os.getloadavg()[0]:.1f}):\n")
        print("| kernel | count | CPU s (ptxas included) | wall s, one at a time |\n|---|---|---|---|")
        for name, (n, cpu, wall) in sorted(costs["by_name"].items(), key=lambda item: -item[1][1]):
            print(f"| {name} | {n} | {cpu:.1f} | {wall:.1f} |")
        total = [sum(row[k] for row in costs["by_name"].values()) for k in (1, 2)]
        print(f"| total | {len(kernels)} | {total[0]:.1f} | {total[1]:.1f} |")
        print(f"\nCompilePool of {costs['workers']} processes: {costs['pool_wall']:.1f} s wall")


if __name__ == "__main__":
    main()
