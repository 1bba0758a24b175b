"""The zoo rows kiln lost on the H200 (DCN, Phi-3), before and after this branch's CUDA fusions, in one process.

    python bench/zoo_gpu_ab.py --out /tmp/ab                 # every case below
    python bench/zoo_gpu_ab.py --cases dcn:256 --no-torch

For each case kiln builds the zoo's fp32 ONNX export twice for CUDA fp16:
  main    as main builds it: fuse_packed_rotary and fuse_split_swiglu left to CPU builds, a causal mask computed
          from position comparisons not recognised (8 x 512: too large to fold), the last GEMM's half output cast
          to the fp32 binding (no output_float32), and none of the tactics this branch adds (cuda.gemm.swiglu.*,
          cuda.embedding_concat.triton, cuda.gemm.cublas_padded)
  branch  this checkout as it is
Both are checked against torch eager fp32 and timed in interleaved rounds (CUDA events around context.run, the
way bench/zoo.py times kiln), beside the case's fastest PyTorch mode (bench/results/zoo-cuda-2026-12-02.md:
reduce-overhead at batch 1 and for DCN, torch.compile default at 8 x 512). Then, for the branch's engine, the
per-layer eager profile (kiln bench --dump-profile's) and a kernel trace of its CUDA-graph replay (torch.profiler:
GPU time per call and the kernels that take it), and the same trace of the PyTorch peer: where each spends it.
Rows go to <out>/zoo-ab.jsonl as they are measured; the table is printed last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import kiln  # noqa: E402
from gpu import time_cuda  # noqa: E402  bench/gpu.py
from kiln import zoo  # noqa: E402
from kiln.builder import build as build_module  # noqa: E402
from kiln.passes import fusion  # noqa: E402
from kiln.passes.fusion import attention_mask  # noqa: E402
from kiln.runtime.profiler import profile_layers  # noqa: E402
from kiln.tactics import registry  # noqa: E402
from zoo import as_list, relative_error_torch, tensors  # noqa: E402  bench/zoo.py

# case -> the PyTorch mode that was fastest there on 12-02 (None: no torch peer, kiln's A/B only)
CASES = {"dcn:256": "reduce-overhead", "phi3_small:1x128": "reduce-overhead", "phi3_small:8x512": "default",
         "qwen2_small:8x512": None}
NEW_RULES = {"fuse_packed_rotary", "fuse_split_swiglu"}  # CPU-only on main
COMPARISONS = {"Less", "LessOrEqual", "Greater", "GreaterOrEqual"}  # not seen through by main's broadcast_constant
NEW_TACTICS = ("cuda.gemm.swiglu.", "cuda.embedding_concat.triton", "cuda.gemm.cublas_padded")


def parse_case(case: str) -> tuple[str, int | None, int | None]:
    name, _, shape = case.partition(":")
    dims = [int(d) for d in shape.split("x")] if shape else []
    return name, dims[0] if dims else None, dims[1] if len(dims) > 1 else None


@contextmanager
def as_main():
    """Builds inside see main's rule set: the two rules CPU-only again, and a mask computed from position
    comparisons not seen through (attention_mask._ELEMENTWISE without them)."""
    saved, elementwise = set(fusion.CPU_RULES), attention_mask._ELEMENTWISE
    fusion.CPU_RULES |= NEW_RULES
    attention_mask._ELEMENTWISE = elementwise - COMPARISONS
    float32_outputs = build_module.write_float32_outputs
    build_module.write_float32_outputs = lambda *args, **kwargs: None  # main casts the half output at the boundary
    try:
        yield
    finally:
        build_module.write_float32_outputs = float32_outputs
        fusion.CPU_RULES.clear()
        fusion.CPU_RULES.update(saved)
        attention_mask._ELEMENTWISE = elementwise


def main_tactics() -> list[str]:
    return sorted(n for n, t in registry.all_tactics().items() if t.device == "cuda" and not n.startswith(NEW_TACTICS))


def build(path: Path, variant: str):
    start = time.perf_counter()
    if variant == "main":
        with as_main():
            engine = kiln.build(str(path), device="cuda", precision="fp16", tactics=main_tactics())
    else:
        engine = kiln.build(str(path), device="cuda", precision="fp16")
    return engine, time.perf_counter() - start


def tactic_counts(engine) -> dict[str, int]:
    counts: dict[str, int] = {}
    for s in engine.plan.program.steps:
        key = getattr(s, "tactic", "") or "default"
        counts[key] = counts.get(key, 0) + 1
    return counts


def kernel_trace(fn, calls: int = 10, top: int = 12) -> dict:
    """GPU kernel time per call and the kernels taking it (torch.profiler over `calls` calls, after warm-up)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / calls
    kernels = []
    for e in prof.key_averages():
        if e.device_type != DeviceType.CUDA:  # kernels and memcpys/memsets only (a CPU op's time would count twice)
            continue
        us = getattr(e, "self_device_time_total", None)
        us = getattr(e, "self_cuda_time_total", 0) if us is None else us
        kernels.append((e.key, us / calls, e.count / calls))
    kernels.sort(key=lambda k: -k[1])
    total = sum(k[1] for k in kernels)
    return {"gpu_us_per_call": total, "wall_us_per_call": 1e6 * wall, "kernels_per_call": sum(k[2] for k in kernels),
            "top": [(name[:90], round(us, 1), round(n, 1)) for name, us, n in kernels[:top]]}


def print_trace(label: str, trace: dict) -> None:
    print(f"  [{label}] kernels per call {trace['kernels_per_call']:.0f}, GPU {trace['gpu_us_per_call']:.0f} us "
          f"of {trace['wall_us_per_call']:.0f} us wall per call")
    for name, us, n in trace["top"]:
        print(f"      {us:8.1f} us  x{n:<5} {name}")


def print_profile(layers: list[dict], top: int = 14) -> None:
    total = sum(x["ms"] for x in layers)
    default = [x for x in layers if x["tactic"] == "default"]
    print(f"  [kiln per-layer, eager] {len(layers)} layers, {total:.3f} ms; {len(default)} default "
          f"({sum(x['ms'] for x in default):.3f} ms): " + ", ".join(sorted({x['op_type'] for x in default})))
    for x in sorted(layers, key=lambda x: -x["ms"])[:top]:
        print(f"      {x['ms']:7.4f} ms  {x['op_type']:<16} {x['tactic']:<40} {x['name'][:40]}")


def run_case(case: str, mode: str | None, args) -> dict:
    name, batch, seq = parse_case(case)
    exported = zoo.export(name, batch=batch, seq=seq)
    feeds = exported.inputs()
    module = zoo.torch_model(name).cuda()
    inputs32, inputs16 = tensors(feeds, "cuda", half=False), tensors(feeds, "cuda", half=True)
    with torch.inference_mode():
        ref32 = as_list(module(**inputs32))
    row = {"case": case, "inputs": {k: list(v.shape) for k, v in feeds.items()}}
    engines = {}
    for variant in ("main", "branch"):
        engine, seconds = build(exported.path, variant)
        context = engine.create_execution_context()
        got = context.run(inputs32)
        row[f"{variant}_err"] = relative_error_torch(as_list([got[n] for n in engine.output_names]), ref32)
        row[f"{variant}_build_s"] = round(seconds, 1)
        row[f"{variant}_layers"] = len(engine.plan.program.steps)
        row[f"{variant}_tactics"] = tactic_counts(engine)
        engines[variant] = (engine, context)
    samples = {v: [] for v in engines}
    for _ in range(args.rounds):  # interleaved: main, branch, main, ...
        for variant, (_, context) in engines.items():
            samples[variant] += time_cuda(lambda: context.run(inputs32), warmup=5, iters=args.iters)
    for variant in engines:
        row[f"{variant}_ms"] = statistics.median(samples[variant])
    print(f"{case}: main {row['main_ms']:.3f} ms ({row['main_layers']} layers), branch {row['branch_ms']:.3f} ms "
          f"({row['branch_layers']} layers); err vs fp32 {row['main_err']:.1e} / {row['branch_err']:.1e}", flush=True)
    engine, context = engines["branch"]
    if args.profile:
        layers = profile_layers(engine.program, engine.program_inputs(inputs32), runs=10)
        print_profile(layers)
        row["branch_trace"] = kernel_trace(lambda: context.run(inputs32))
        print_trace("kiln branch, graph replay", row["branch_trace"])
        main_context = engines["main"][1]
        row["main_trace"] = kernel_trace(lambda: main_context.run(inputs32))
        print_trace("kiln main, graph replay", row["main_trace"])
    del engines, engine, context
    torch.cuda.empty_cache()
    if mode and not args.no_torch:
        module = module.half()
        torch._dynamo.reset()
        start = time.perf_counter()
        compiled = torch.compile(module, mode=None if mode == "default" else mode)
        with torch.inference_mode():
            compiled(**inputs16)
            row["torch_compile_s"] = round(time.perf_counter() - start, 1)
            row["torch_ms"] = statistics.median(time_cuda(lambda: compiled(**inputs16), iters=args.iters))
            row["torch_mode"] = mode
            if args.profile:
                row["torch_trace"] = kernel_trace(lambda: compiled(**inputs16))
                print_trace(f"torch {mode}", row["torch_trace"])
        print(f"{case}: torch {mode} {row['torch_ms']:.3f} ms: branch {row['torch_ms'] / row['branch_ms']:.2f}x, "
              f"main {row['torch_ms'] / row['main_ms']:.2f}x", flush=True)
    return row


def table(rows: list[dict]) -> list[str]:
    lines = ["| case | torch mode | torch ms | kiln main ms | kiln branch ms | branch / main | branch vs torch | "
             "layers main -> branch | err main / branch |", "|" + "---|" * 9]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | failed: {r['error']} |" + " |" * 7)
            continue
        torch_ms = r.get("torch_ms")
        torch_cell = "—" if torch_ms is None else f"{torch_ms:.3f}"
        speedup = "—" if torch_ms is None else f"{torch_ms / r['branch_ms']:.2f}x"
        lines.append(f"| {r['case']} | {r.get('torch_mode', '—')} | {torch_cell} | {r['main_ms']:.3f} | "
                     f"{r['branch_ms']:.3f} | {r['branch_ms'] / r['main_ms']:.2f} | {speedup} | "
                     f"{r['main_layers']} -> {r['branch_layers']} | {r['main_err']:.1e} / {r['branch_err']:.1e} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help="name:batch[xseq], comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--no-profile", dest="profile", action="store_false")
    parser.add_argument("--out", type=Path, default=Path("/tmp/kiln-ab"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/zoo_gpu_ab.py needs a CUDA GPU")
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"kiln zoo A/B on {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    rows = []
    for case in args.cases.split(","):
        try:
            row = run_case(case, CASES.get(case), args)
        except Exception as e:  # noqa: BLE001  one failing case must not hide the others
            traceback.print_exc()
            row = {"case": case, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"}
        rows.append(row)
        with open(args.out / "zoo-ab.jsonl", "a") as f:
            f.write(json.dumps(row, default=str) + "\n")
        torch.cuda.empty_cache()
    print("\n" + "\n".join(table(rows)))


if __name__ == "__main__":
    main()
