"""Decode GEMVs on the GPU (issue 15): kiln's Triton GEMV / skinny GEMM (kiln/llm/kernels/gemv.py), every
candidate config, side by side with cuBLAS, at Llama-3-8B's and Qwen2-7B's decode shapes.

    python3 bench/gemv.py [--models llama3-8b qwen2-7b] [--rows 1 2 4 8 16] [--dtypes bf16 fp8 int8]
                          [--budget 150] [--workers 12] [--quick] [--tiny]

Per (projection shape K x N, rows M, weight dtype): y[M, N] = x[M, K] · W[N, K]ᵀ with x in bf16 and W in
bf16, FP8 E4M3 or INT8 (per-channel fp32 scales, weight-only: dequantized in registers). Peers: cuBLAS's
bf16 F.linear on the same shape (the bf16 weight), and for fp8 the model's path today (per-token E4M3
activations from kiln's fused kernel + torch._scaled_mm), for int8 kiln's previous weight-only Triton GEMM
(kiln/llm/kernels/quant_gemm.py). Every kernel's output is first checked against torch in fp32 on the
dequantized weights (|y - ref| <= 1e-2·|ref| + 2e-3·max|ref|: bf16 output rounding is 2^-9 relative, the rest
is fp32 sums in another order: kiln.llm.decode_gemv.gemv_error, the engine's check; the scaled_mm path
against its own per-token-quantized activations); a config that fails is reported and never timed, and each
config is checked again after its timing replays (split-K's arrival counters).

Timing: each measurement is one CUDA graph of 24 back-to-back calls that rotate over copies of the weight
(at least 150 MB together, three times the H200's 50 MB L2, so the weights come from HBM), replayed 7 times
(CUDA events); the median replay / 24 is the call's time, kernel gaps of a captured decode step included.
Sweep: every candidate config at M = 1 and 16, the 6 best of those at the other rows; past --budget seconds
of timing, only each problem's best so far (rows marked budget_cut in the JSON). Before timing, the configs
are compiled by --workers processes at once (they fill Triton's on-disk cache).

Prints a table (best config per problem, its us and TB/s, the peers' us, speed-ups) and the engine shortlist
(kiln/llm/decode_gemv.py ENGINE_CONFIGS: every problem's winner, then by geometric-mean slowdown), and writes
them with every config's timing to $OUT/gemv.md, $OUT/gemv.json and the log to $OUT/gemv.log when OUT is set.
`--tiny` runs on the CPU under Triton's interpreter at tiny shapes (checks the script; times nothing real).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

TINY = "--tiny" in sys.argv
if TINY:  # before triton is imported: kernels run under the interpreter on the CPU
    os.environ["TRITON_INTERPRET"] = "1"
    from tests.kernels.conftest import _fix_interpreter_bf16_dot, _fix_interpreter_scalar_index  # noqa: E402

    _fix_interpreter_bf16_dot()
    _fix_interpreter_scalar_index()

from kiln.llm.decode_gemv import gemv_error, graph_time  # noqa: E402
from kiln.llm.kernels.gemv import GemvConfig, candidate_configs, gemv  # noqa: E402
from kiln.llm.quantization import FP8Weight, Int8Weight  # noqa: E402

# (projection, K, N) per model: fused q|k|v, o, fused gate|up, down; and the LM head (kept in bf16 when the
# projections are quantized, so timed in bf16 only)
MODELS = {
    "llama3-8b": [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096),
                  ("lm_head", 4096, 128256)],
    "qwen2-7b": [("qkv", 3584, 4608), ("o", 3584, 3584), ("gate_up", 3584, 37888), ("down", 18944, 3584),
                 ("lm_head", 3584, 152064)],
    "tiny": [("a", 96, 48), ("b", 200, 37)],
}
BF16_ONLY = {"lm_head"}
DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "int8": torch.int8}
L2_BYTES = 50 * 2**20
LAUNCHES, REPLAYS = 24, 7
DEVICE = "cpu" if TINY else "cuda"


def commit() -> str:
    """KILN_COMMIT, else git's HEAD (the GPU machine's copy of the tree may carry a stale .git: set KILN_COMMIT)."""
    if os.environ.get("KILN_COMMIT"):
        return os.environ["KILN_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


class Log:
    def __init__(self, out: Path | None):
        self.file = open(out / "gemv.log", "w") if out else None

    def __call__(self, *parts) -> None:
        line = " ".join(str(p) for p in parts)
        print(line, flush=True)
        if self.file:
            self.file.write(line + "\n")
            self.file.flush()


def quantize(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """bf16 master weight -> (stored weight, per-channel fp32 scale or None): kiln/llm/quantization.py's."""
    if dtype == torch.bfloat16:
        return w, None
    module = (Int8Weight if dtype == torch.int8 else FP8Weight).quantize(w)
    return module.q, module.scale


def dequantized(q: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    return q.float() if scale is None else q.float() * scale[:, None]


def time_calls(calls: list) -> float:
    """Microseconds per call: kiln.llm.decode_gemv's CUDA-graph timer (the engine's), LAUNCHES calls rotating
    over `calls`, median of REPLAYS replays. On the CPU: one call's wall time (checks the script only)."""
    if DEVICE == "cpu":
        started = time.perf_counter()
        calls[0]()
        return (time.perf_counter() - started) * 1e6
    return graph_time(calls, LAUNCHES, REPLAYS)


class Problem:
    """One (K, N, dtype) weight, its rotating copies on the device, and per-M inputs and references."""

    def __init__(self, name: str, k: int, n: int, dtype_name: str, seed: int):
        self.name, self.k, self.n, self.dtype_name = name, k, n, dtype_name
        self.dtype = DTYPES[dtype_name]
        g = torch.Generator(device=DEVICE).manual_seed(seed)
        master = (torch.randn((n, k), generator=g, device=DEVICE) * 0.02).to(torch.bfloat16)
        q, self.scale = quantize(master, self.dtype)
        self.bytes = q.numel() * q.element_size() + (self.scale.numel() * 4 if self.scale is not None else 0)
        copies = 1 if DEVICE == "cpu" else max(2, min(16, math.ceil(3 * L2_BYTES / self.bytes)))
        self.weights = [q] + [q.clone() for _ in range(copies - 1)]
        self.reference_weight = dequantized(q, self.scale)  # fp32 [N, K]
        self.bf16_weights = [master] + [master.clone() for _ in range(copies - 1)] if dtype_name != "bf16" else None
        self.generator = g

    def inputs(self, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn((m, self.k), generator=self.generator, device=DEVICE).to(torch.bfloat16)
        return x, x.float() @ self.reference_weight.T

    def tb_per_s(self, m: int, us: float) -> float:
        moved = self.bytes + m * (self.k + self.n) * 2
        return moved / (us * 1e-6) / 1e12


def peers(problem: Problem, x: torch.Tensor) -> dict[str, list]:
    """name -> rotating calls of the peers for this problem (each first checked by the caller)."""
    found = {}
    bf16 = problem.weights if problem.dtype_name == "bf16" else problem.bf16_weights
    found["cuBLAS bf16"] = [lambda w=w: F.linear(x, w) for w in bf16]
    if problem.dtype_name == "fp8" and DEVICE == "cuda" and torch.cuda.get_device_capability() >= (8, 9):
        from kiln.llm.kernels.fused import fp8_quantize_rows

        def scaled_mm(w):
            x_q, x_scale = fp8_quantize_rows(x, 448.0)
            return torch._scaled_mm(x_q, w.t(), scale_a=x_scale, scale_b=problem.scale[None, :],
                                    out_dtype=torch.bfloat16)
        found["scaled_mm path"] = [lambda w=w: scaled_mm(w) for w in problem.weights]
    if problem.dtype_name == "int8":
        from kiln.llm.kernels.quant_gemm import int8_gemm
        found["old Triton int8"] = [lambda w=w: int8_gemm(x, w, problem.scale) for w in problem.weights]
    return found


def peer_reference(problem: Problem, name: str, x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """What a peer computes, in fp32: cuBLAS bf16 multiplies the bf16 master weight; the fp8 scaled_mm path
    multiplies per-token E4M3 activations (kernels/fused.py's fp8_quantize_rows: s = max|x| / 448 per row)."""
    if name == "cuBLAS bf16" and problem.dtype_name != "bf16":
        return x.float() @ problem.bf16_weights[0].float().T
    if name == "scaled_mm path":
        x_scale = x.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 448.0
        x_q = (x.float() / x_scale).to(torch.float8_e4m3fn).float() * x_scale
        return x_q @ problem.reference_weight.T
    return ref


def measure(problem: Problem, m: int, configs: list[GemvConfig], log: Log, failures: list) -> dict:
    x, ref = problem.inputs(m)
    row = {"shape": problem.name, "k": problem.k, "n": problem.n, "m": m, "dtype": problem.dtype_name,
           "configs": {}, "peers": {}}
    for name, calls in peers(problem, x).items():
        try:
            bad = gemv_error(calls[0](), peer_reference(problem, name, x, ref))
            row["peers"][name] = time_calls(calls) if bad is None else None
            if bad:
                failures.append(f"{problem.name} M={m} {problem.dtype_name} {name}: WRONG {bad}")
        except Exception as error:  # a peer that does not run here (e.g. _scaled_mm's shape rules) is a row note
            row["peers"][name] = None
            failures.append(f"{problem.name} M={m} {problem.dtype_name} {name}: {type(error).__name__}: {error}")
    for config in configs:
        calls = [lambda w=w, c=config: gemv(x, w, problem.scale, None, c) for w in problem.weights]
        try:
            bad = gemv_error(calls[0](), ref)
        except Exception as error:  # a config that does not compile (shared memory) is reported, not timed
            failures.append(f"{problem.name} M={m} {problem.dtype_name} {config.name}: "
                            f"{type(error).__name__}: {str(error)[:200]}")
            continue
        if bad:
            failures.append(f"{problem.name} M={m} {problem.dtype_name} {config.name}: WRONG {bad}")
            continue
        us = time_calls(calls)
        bad = gemv_error(calls[-1](), ref)  # again after the replays: split-K's arrival counters still right
        if bad:
            failures.append(f"{problem.name} M={m} {problem.dtype_name} {config.name}: WRONG after timing {bad}")
            continue
        row["configs"][config.name] = us
    best = min(row["configs"], key=row["configs"].get, default=None)
    row["best"] = best
    if best:
        us = row["configs"][best]
        cublas = row["peers"].get("cuBLAS bf16")
        log(f"  {problem.name:8s} {problem.k}x{problem.n} M={m:2d} {problem.dtype_name:4s} best {best:28s} "
            f"{us:8.2f} us {problem.tb_per_s(m, us):5.2f} TB/s | cuBLAS bf16 {cublas or float('nan'):8.2f} us | "
            + " ".join(f"{k} {v or float('nan'):.2f} us" for k, v in row["peers"].items() if k != "cuBLAS bf16"))
    return row


def _compile_worker(jobs: list[tuple[str, int, int, str, dict]]) -> list[str]:
    """Runs each (dtype, K, N, config) once at M=1 so that Triton's on-disk cache holds its binary."""
    errors = []
    for dtype_name, k, n, _, config in jobs:
        config = GemvConfig(**config)
        try:
            dtype = DTYPES[dtype_name]
            w = torch.zeros((n, k), dtype=torch.bfloat16, device=DEVICE).to(dtype)
            scale = torch.ones(n, device=DEVICE) if dtype != torch.bfloat16 else None
            gemv(torch.zeros((1, k), dtype=torch.bfloat16, device=DEVICE), w, scale, None, config)
            if DEVICE == "cuda":
                torch.cuda.synchronize()
        except Exception as error:
            errors.append(f"{dtype_name} {k}x{n} {config.name}: {type(error).__name__}: {str(error)[:160]}")
    return errors


def precompile(jobs: list, workers: int, log: Log) -> None:
    started = time.perf_counter()
    chunks = [jobs[i::workers] for i in range(workers)]
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        errors = [e for part in pool.map(_compile_worker, chunks) for e in part]
    log(f"compiled {len(jobs)} (shape, dtype, config) launches in {workers} processes in "
        f"{time.perf_counter() - started:.1f} s; {len(errors)} failed (those configs fail again below)")
    for e in errors[:10]:
        log("  compile:", e)


def table(rows: list[dict]) -> list[str]:
    lines = ["| shape | K x N | M | dtype | best config | us | TB/s | cuBLAS bf16 us | speed-up vs cuBLAS bf16 | "
             "other peer | peer us | speed-up vs peer |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r["best"]:
            lines.append(f"| {r['shape']} | {r['k']}x{r['n']} | {r['m']} | {r['dtype']} | (none passed) |" + " |" * 7)
            continue
        us = r["configs"][r["best"]]
        moved = r["bytes"] + r["m"] * (r["k"] + r["n"]) * 2
        cublas = r["peers"].get("cuBLAS bf16")
        other = [(k, v) for k, v in r["peers"].items() if k != "cuBLAS bf16"]
        peer_name, peer_us = other[0] if other else ("", None)
        best = r["best"] + (" (budget cut: 1 config timed)" if r.get("budget_cut") else "")
        lines.append(f"| {r['shape']} | {r['k']}x{r['n']} | {r['m']} | {r['dtype']} | {best} | {us:.2f} | "
                     f"{moved / (us * 1e-6) / 1e12:.2f} | {'' if cublas is None else f'{cublas:.2f}'} | "
                     f"{'' if cublas is None else f'{cublas / us:.2f}x'} | {peer_name} | "
                     f"{'' if peer_us is None else f'{peer_us:.2f}'} | "
                     f"{'' if peer_us is None else f'{peer_us / us:.2f}x'} |")
    return lines


def shortlist(rows: list[dict], configs: dict[str, GemvConfig], size: int = 8) -> dict[str, list[GemvConfig]]:
    """Per weight element size ("2": bf16, "1": fp8 and int8), the configs the engine should time
    (kiln/llm/decode_gemv.py ENGINE_CONFIGS): every problem's winner, then the best by geometric-mean
    slowdown against each problem's best over the fully swept rows, up to `size`."""
    found = {}
    for element, dtypes in (("2", {"bf16"}), ("1", {"fp8", "int8"})):
        mine = [r for r in rows if r["dtype"] in dtypes and r["best"]]
        winners = list(dict.fromkeys(r["best"] for r in mine))
        logs: dict[str, list[float]] = {}
        full = [r for r in mine if not r.get("budget_cut") and len(r["configs"]) > 1]
        for r in full:
            best = min(r["configs"].values())
            for name, us in r["configs"].items():
                logs.setdefault(name, []).append(math.log(us / best))
        complete = [n for n, v in logs.items() if len(v) == max(map(len, logs.values()))]
        ranked = sorted(complete, key=lambda n: statistics.fmean(logs[n]))
        names = list(dict.fromkeys(winners + ranked))[:max(size, min(len(winners), 12))]
        found[element] = [configs[n] for n in names if n in configs]
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["llama3-8b", "qwen2-7b"], choices=list(MODELS))
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--budget", type=float, default=150.0,
                        help="seconds of timing (after compiling): past this only each problem's best config so "
                             "far is timed")
    parser.add_argument("--workers", type=int, default=None,
                        help="processes compiling configs before timing (default 12 on CUDA, 0 with --tiny)")
    parser.add_argument("--top", type=int, default=6, help="configs kept from M = 1 and 16 for the other rows")
    parser.add_argument("--quick", action="store_true", help="llama3-8b only, M 1 and 8")
    parser.add_argument("--tiny", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    args = parser.parse_args()
    started = time.perf_counter()
    if args.tiny:
        args.models, args.rows = ["tiny"], [1, 3]
        args.workers = 0 if args.workers is None else args.workers
    elif args.quick:
        args.models, args.rows = ["llama3-8b"], [1, 8]
    if args.workers is None:
        args.workers = 12
    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit("bench/gemv.py times CUDA kernels: no CUDA device here (--tiny runs the CPU check)")
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    log = Log(out)
    import triton

    device = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (Triton interpreter)"
    header = (f"bench/gemv.py {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC on {device}: "
              f"torch {torch.__version__}, triton {triton.__version__}, commit {commit()}")
    log(header)
    shapes = [(name, k, n) for model in args.models for name, k, n in MODELS[model]]
    shapes = list(dict.fromkeys(shapes))

    def configs_for(k, n, dtype):
        found = candidate_configs(n, k, DTYPES[dtype])
        if args.tiny:  # one of each variant, with and without split-K, small tiles
            found = [GemvConfig(v, bn, 32, s, 4, 1) for v, bn in (("dot", 16), ("dot_swap", 16), ("fma", 8))
                     for s in (1, 2)]
        return found

    if args.workers > 0:
        jobs = [(d, k, n, name, c.to_dict()) for name, k, n in shapes for d in args.dtypes
                if d == "bf16" or name not in BF16_ONLY
                for c in configs_for(k, n, d)]
        precompile(jobs, args.workers, log)
    sweep_started = time.perf_counter()
    rows, failures = [], []
    first = [m for m in args.rows if m in (1, 16)] or args.rows[:1]
    rest = [m for m in args.rows if m not in first]
    for index, (name, k, n) in enumerate(shapes):
        for d in args.dtypes:
            if d != "bf16" and name in BF16_ONLY:
                continue
            problem = Problem(name, k, n, d, seed=index)
            configs = configs_for(k, n, d)
            ranked: dict[str, float] = {}
            for m in first + rest:
                over = time.perf_counter() - sweep_started > args.budget
                if m in rest or over:
                    keep = sorted(ranked, key=ranked.get)[:1 if over else args.top]
                    todo = [c for c in configs if c.name in keep] or configs[:1]
                else:
                    todo = configs
                row = measure(problem, m, todo, log, failures)
                row["bytes"] = problem.bytes
                row["budget_cut"] = over
                rows.append(row)
                if m in first:
                    best = min(row["configs"].values(), default=None)
                    for c, us in row["configs"].items():  # rank by time relative to this M's best
                        ranked[c] = max(ranked.get(c, 0.0), us / best)
            del problem
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
    rows.sort(key=lambda r: (r["dtype"], r["shape"], r["k"], r["m"]))
    every = {c.name: c for name, k, n in shapes for d in args.dtypes for c in configs_for(k, n, d)}
    engine = shortlist(rows, every)
    lines = [header, "", f"x bf16, W as listed (per-channel scales), y bf16; TB/s = (W + scales + x + y bytes) / time; "
             f"{LAUNCHES} calls per CUDA graph rotating weight copies >= 150 MB, median of {REPLAYS} replays", ""]
    lines += table(rows)
    lines += ["", f"{len(failures)} configs or peers failed a check or did not run:"] + [f"- {f}" for f in failures[:60]]
    lines += [f"- ... and {len(failures) - 60} more" if len(failures) > 60 else ""]
    lines += ["", "engine shortlist (kiln/llm/decode_gemv.py ENGINE_CONFIGS: winners first, then by geometric-mean "
              "slowdown):"]
    for element, found in engine.items():
        lines.append(f"    {element}: [" + ",\n        ".join(f"GemvConfig(**{c.to_dict()})" for c in found) + "],")
    lines.append(f"total {time.perf_counter() - started:.0f} s")
    log("\n".join(lines))
    if out:
        (out / "gemv.md").write_text("\n".join(lines) + "\n")
        (out / "gemv.json").write_text(json.dumps({
            "header": header, "rows": rows, "failures": failures,
            "shortlist": {e: [c.to_dict() for c in found] for e, found in engine.items()}}, indent=1))
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except Exception:
        traceback.print_exc()
        raise
