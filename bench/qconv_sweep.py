"""Every distinct ResNet-50 convolution at batch 256 on the GPU: fp16 cuDNN against kiln's 8-bit convolutions
(issue 12: INT8/FP8 engines >= 1.6x kiln FP16 need the convolutions themselves faster than fp16 cuDNN).

    python3 bench/qconv_sweep.py [--out DIR] [--budget 190] [--shapes 3x3,1x1] [--families int8,fp8,old]
    TRITON_INTERPRET=1 python bench/qconv_sweep.py --dry-run      on the CPU at tiny shapes: checks the script

Per layer (NHWC, int8 out, Relu where ResNet has one):
  fp16        torch conv2d, channels_last fp16, cudnn.benchmark on (no bias/Relu: the fp16 layer's floor)
  dequant     kiln's `cuda.qconv.dequantized` path: dequantize x, cuDNN fp16, one requantize pass
  old         the Triton kernel kiln had at c7332ab (bench/qconv_old.py), its two default tiles
  int8 / fp8  kiln/kernels/cuda/triton/qconv.py with each config of INT8_CONFIGS / FP8_CONFIGS

Two phases. Checks: worker processes (compiles in parallel; one job per config and loop kind) run every
variant at batch 16 (the same kernel specialisation as 256) against a float64 torch reference: int8 within
one step on <= 1% of the outputs, fp8 within one E4M3 step on <= 1%; a variant that fails or does not
compile is not timed. Timing: this process, batch 256, 10 calls in one CUDA graph, median of 5 replays.
Prints one table (ms per layer; speed-ups against fp16) and the ResNet-50 total (layer ms x count), and
writes qconv_sweep.json and qconv_sweep.log under --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

FP8 = torch.float8_e4m3fn
CHECK_BATCH = 16  # M = 16·Ho·Wo stays a multiple of 16: the kernels compiled for the checks are the timed ones


@dataclass(frozen=True)
class ConvShape:
    cin: int
    cout: int
    size: int  # input H = W
    kernel: int
    stride: int
    count: int  # how many ResNet-50 layers have this shape
    relu: bool

    @property
    def pad(self) -> int:
        return self.kernel // 2

    @property
    def out_size(self) -> int:
        return (self.size + 2 * self.pad - self.kernel) // self.stride + 1

    @property
    def name(self) -> str:
        return f"{self.kernel}x{self.kernel} {self.cin}->{self.cout} @{self.size}" + \
            (f" s{self.stride}" if self.stride > 1 else "")

    @property
    def kind(self) -> str:
        """Shapes of one kind run the same compiled kernel for a config (one check job each)."""
        return "gemm" if self.kernel == 1 and self.stride == 1 else f"{self.kernel}x{self.kernel}s{self.stride}"

    def scaled(self, factor: int) -> ConvShape:
        """The dry run's tiny version."""
        return dataclasses.replace(self, cin=self.cin if self.cin < 16 else max(16, self.cin // factor), cout=max(16, self.cout // factor),
                                   size=max(3, self.size // factor))


STEM = ConvShape(3, 64, 224, 7, 2, 1, True)
RESNET50 = [  # torchvision / HF ResNet-50 v1.5 (stride on the 3x3); conv3 and the shortcut end without Relu
    ConvShape(64, 64, 56, 1, 1, 1, True), ConvShape(256, 64, 56, 1, 1, 2, True),
    ConvShape(64, 64, 56, 3, 1, 3, True), ConvShape(64, 256, 56, 1, 1, 4, False),
    ConvShape(256, 128, 56, 1, 1, 1, True), ConvShape(128, 128, 56, 3, 2, 1, True),
    ConvShape(512, 128, 28, 1, 1, 3, True), ConvShape(128, 128, 28, 3, 1, 3, True),
    ConvShape(128, 512, 28, 1, 1, 4, False), ConvShape(256, 512, 56, 1, 2, 1, False),
    ConvShape(512, 256, 28, 1, 1, 1, True), ConvShape(256, 256, 28, 3, 2, 1, True),
    ConvShape(1024, 256, 14, 1, 1, 5, True), ConvShape(256, 256, 14, 3, 1, 5, True),
    ConvShape(256, 1024, 14, 1, 1, 6, False), ConvShape(512, 1024, 28, 1, 2, 1, False),
    ConvShape(1024, 512, 14, 1, 1, 1, True), ConvShape(512, 512, 14, 3, 2, 1, True),
    ConvShape(2048, 512, 7, 1, 1, 2, True), ConvShape(512, 512, 7, 3, 1, 2, True),
    ConvShape(512, 2048, 7, 1, 1, 3, False), ConvShape(1024, 2048, 14, 1, 2, 1, False),
    STEM,
]


def _configs():
    """Run 2 (after the H200 run of 2026-12-02 22:49): every config prescaled (the IEEE division in the
    epilogue made the same tile 1.5-3x slower), two stages for the short-K layers (more CTAs per SM)."""
    from kiln.kernels.cuda.triton.qconv import QConvConfig as C

    def p(*tile, **options):
        return C(*tile, prescaled=True, **options)

    int8 = [p(128, 64, 64, num_warps=4, num_stages=2), p(128, 64, 64, num_warps=4, num_stages=4),
            p(256, 64, 64, num_warps=8, num_stages=3), p(128, 128, 64, num_warps=4, num_stages=2),
            p(128, 128, 64, num_warps=8, num_stages=3), p(128, 128, 128, num_warps=8, num_stages=3),
            p(128, 256, 64, num_warps=8, num_stages=2), p(128, 256, 128, num_warps=8, num_stages=3),
            p(128, 256, 128, num_warps=8, num_stages=4), p(256, 128, 128, num_warps=8, num_stages=3),
            # int8 storage, fp16 tensor cores: the only way Triton keeps the wgmma of an int8 layer in flight
            p(128, 128, 64, num_warps=4, num_stages=4, mma_f16=True), p(128, 256, 64, num_warps=8, num_stages=3, mma_f16=True),
            p(128, 64, 64, num_warps=4, num_stages=3, mma_f16=True),
            # 1x1 layers only: a fixed number of programs per SM walking the tiles (short K: loads of the
            # next tile overlap this tile's epilogue)
            p(128, 128, 64, num_warps=4, num_stages=3, persistent=2), p(128, 256, 64, num_warps=8, num_stages=3, persistent=1),
            p(128, 64, 64, num_warps=4, num_stages=3, persistent=3), p(128, 128, 128, num_warps=8, num_stages=3, persistent=1)]
    fp8 = [p(128, 64, 64, num_warps=4, num_stages=3), p(128, 128, 64, num_warps=4, num_stages=2),
           p(128, 128, 128, num_warps=8, num_stages=3), p(128, 256, 128, num_warps=8, num_stages=3),
           p(256, 128, 128, num_warps=8, num_stages=3),
           p(128, 256, 128, num_warps=8, num_stages=3, fp8_precise=False),
           p(128, 128, 128, num_warps=8, num_stages=3, fp8_precise=False),
           p(128, 128, 64, num_warps=4, num_stages=3, persistent=2)]
    return int8, fp8


def _old_configs():
    import qconv_old

    return [qconv_old.QConvConfig(64, 64, 64, num_warps=4, num_stages=4),
            qconv_old.QConvConfig(128, 128, 64, num_warps=8, num_stages=4)]


SHRINK = 1  # the dry run divides every tile by 4 (the interpreter at tiny shapes); workers keep 1


def variants() -> dict[str, list]:
    int8, fp8 = _configs()
    found = {"int8": int8, "fp8": fp8, "old": _old_configs()}
    if SHRINK == 1:
        return found
    return {family: [dataclasses.replace(c, block_m=max(16, c.block_m // SHRINK), block_n=max(16, c.block_n // SHRINK),
                                         block_k=max(16, c.block_k // SHRINK), group_m=2) for c in configs[-5:]]
            for family, configs in found.items()}


def label(family: str, config) -> str:
    if family == "old":
        return f"{config.name}w{config.num_warps}s{config.num_stages}"
    return config.label


def fits(shape: ConvShape, config) -> bool:
    """Tiles the shape fills: no 128-channel tile over 64 channels, BLOCK_K within Cin (the by-tap loop)
    except for the stem, whose 3 channels only the flat loop takes."""
    if config.block_n > max(shape.cout, 16):
        return False
    if getattr(config, "persistent", 0) and shape.kind != "gemm":
        return False  # the persistent loop is the 1x1 GEMM's only
    return shape.cin < 16 or config.block_k <= shape.cin


# ---- one layer: data, reference, the runners ---------------------------------------------------------

@dataclass
class Layer:
    shape: ConvShape
    x: torch.Tensor  # [N, Cin, H, W] channels-last, int8 or float8e4m3fn
    w: torch.Tensor  # [Cout, Cin, k, k]
    x_zero: int
    bias: torch.Tensor  # int32 (int8) / fp32 (fp8), as the layer has it
    epilogue: object  # qgemm.Epilogue: the kernels' (zero point folded into an int8 bias)
    x_scale: float

    @property
    def fp8(self) -> bool:
        return self.x.dtype == FP8


def make_layer(shape: ConvShape, batch: int, fp8: bool, device: str, seed: int = 0) -> Layer:
    from kiln.kernels.cuda.triton.qgemm import Epilogue, fold_zero_point

    g = torch.Generator(device=device).manual_seed(seed)
    n, c, s, k = batch, shape.cin, shape.size, shape.kernel
    terms = c * k * k
    base = torch.rand(shape.cout, generator=g, device=device) * 0.5 + 0.75  # per-channel scale spread
    if fp8:
        x = (torch.randn(n, c, s, s, generator=g, device=device) * 2).to(FP8)
        w = (torch.randn(shape.cout, c, k, k, generator=g, device=device) * 0.5).to(FP8)
        x_zero, bias = 0, torch.randn(shape.cout, generator=g, device=device) * math.sqrt(terms)
        scale = base * 1e-3
        y_scale, y_zero = 1e-3 * math.sqrt(terms) / 64, 0.0  # outputs ~ N(0, 64²) on the E4M3 grid
        kernel_bias, out = bias, FP8
    else:
        x = torch.randint(-128, 128, (n, c, s, s), generator=g, device=device, dtype=torch.int8)
        w = torch.randint(-127, 128, (shape.cout, c, k, k), generator=g, device=device, dtype=torch.int8)
        x_zero = -128 if shape.cin >= 16 else 3  # post-Relu activations sit at the bottom of int8
        bias = torch.randint(-3000, 3000, (shape.cout,), generator=g, device=device, dtype=torch.int32)
        scale = base * 1e-3
        y_scale = 1e-3 * math.sqrt(terms) * 10800 / 50  # r / y_scale ~ N(0, 50²): the int8 range well used
        y_zero = -128.0 if shape.relu else 5.0
        kernel_bias, out = fold_zero_point(w, bias, x_zero, torch.int8), torch.int8
    x = x.contiguous(memory_format=torch.channels_last)
    epilogue = Epilogue(scale.float().contiguous(), kernel_bias, out, y_scale=y_scale, y_zero=y_zero,
                        activation="Relu" if shape.relu else "")
    return Layer(shape, x, w, x_zero, bias, epilogue, x_scale=0.02)


def reference(layer: Layer) -> torch.Tensor:
    """The layer in float64: (x − z) ⊛ w + bias, ·scale, Relu, / y_scale, rounded half to even, saturated."""
    sh, ep = layer.shape, layer.epilogue
    acc = F.conv2d(layer.x.double() - layer.x_zero, layer.w.double(), None, sh.stride, sh.pad)
    r = (acc + layer.bias.double().view(1, -1, 1, 1)) * ep.scale.double().view(1, -1, 1, 1)
    if ep.activation == "Relu":
        r = r.relu()
    v = r / ep.y_scale
    if layer.fp8:
        return v.clamp(-448, 448).float().to(FP8)
    return (torch.round(v) + ep.y_zero).clamp(-128, 127).to(torch.int8)


def _ordinal(t: torch.Tensor) -> torch.Tensor:
    """E4M3 codes as integers in value order (adjacent values one apart; ±0 both 0), ints as themselves."""
    if t.dtype != FP8:
        return t.to(torch.int32)
    code = t.view(torch.uint8).to(torch.int32)
    magnitude = code & 0x7F
    return torch.where(code >= 128, -magnitude, magnitude)


def steps_off(got: torch.Tensor, want: torch.Tensor) -> tuple[int, float, float]:
    """(most grid steps apart, fraction of outputs off, largest |got − want| / max |want|)."""
    d = (_ordinal(got) - _ordinal(want)).abs()
    error = (got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30)
    return int(d.max()), float((d > 0).float().mean()), float(error)


# FP8: Hopper's tensor cores add a K step's products with ~14 bits, so an output near 0 (where E4M3's
# spacing is 2^-9) can be many grid steps from the float64 reference while |error| stays ~1e-4 of the
# layer's largest output (run 1: up to 22 steps, <= 0.5% of outputs). An FP8 output passes within one
# step, or within FP8_NOISE of the largest |output|.
FP8_NOISE = 1e-3


def passes(got: torch.Tensor, want: torch.Tensor) -> tuple[bool, dict]:
    worst, fraction, error = steps_off(got, want)
    if got.dtype == FP8:
        far = (_ordinal(got) - _ordinal(want)).abs() > 1
        noise = FP8_NOISE * float(want.double().abs().max())
        ok = bool(((got.double() - want.double()).abs()[far] <= noise).all()) and fraction <= 0.01
    else:
        ok = worst <= 1 and fraction <= 0.01
    return ok, {"max_steps": worst, "off": fraction, "max_rel_error": error}


def runner(family: str, config, layer: Layer):
    """A zero-argument call of the variant on the layer (its one-time work done here, as at prepare)."""
    from kiln.kernels.cuda.triton import qconv

    sh, k = layer.shape, layer.shape.kernel
    w_packed = qconv.pack_weight(layer.w, fp16=family == "int8" and config.mma_f16)
    geometry = dict(x_zero=layer.x_zero, strides=(sh.stride, sh.stride), pads=(sh.pad,) * 4)
    if family == "old":
        import qconv_old

        return lambda: qconv_old.qconv2d(layer.x, w_packed, (k, k), layer.epilogue, config=config, **geometry)
    epilogue = layer.epilogue.prescale() if config.prescaled else layer.epilogue
    padding = qconv.padding_row(layer.x.dtype, layer.x_zero, sh.cin, layer.x.device)
    return lambda: qconv.qconv2d(layer.x, w_packed, (k, k), epilogue, config=config, padding=padding, **geometry)


def fp16_runner(layer: Layer):
    sh = layer.shape
    x16 = (layer.x.float() - layer.x_zero).half().contiguous(memory_format=torch.channels_last)
    w16 = layer.w.half().contiguous(memory_format=torch.channels_last)
    return lambda: F.conv2d(x16, w16, None, sh.stride, sh.pad)


def dequantized_runner(layer: Layer):
    """kiln's cuda.qconv.dequantized (kiln/tactics/cuda/quant_conv.py): three kernels per call."""
    from kiln.kernels.cuda.triton import qelementwise
    from kiln.kernels.cuda.triton.qgemm import Epilogue

    sh, ep = layer.shape, layer.epilogue
    w_real = (layer.w.double() * 0.01).half().contiguous(memory_format=torch.channels_last)
    real = Epilogue(torch.ones_like(ep.scale), ep.scale.clone(), ep.out_dtype, y_scale=ep.y_scale,
                    y_zero=ep.y_zero, activation=ep.activation)
    return lambda: qelementwise.requantize(
        F.conv2d(qelementwise.dequantize(layer.x, layer.x_scale, layer.x_zero, torch.float16), w_real, None,
                 sh.stride, sh.pad), real, 1)


# ---- phase 1: checks, in parallel ---------------------------------------------------------------------

def check_job(job: tuple[str, int, str, list[ConvShape], str, int]) -> list[dict]:
    """One variant on every shape of one kind, at CHECK_BATCH, against the reference. Run in a worker."""
    family, index, kind, shapes, device, batch = job
    config = variants()[family][index]
    rows = []
    for shape in shapes:
        row = {"shape": shape.name, "family": family, "config": label(family, config)}
        start = time.perf_counter()
        try:
            layer = make_layer(shape, batch, family == "fp8", device, seed=1)
            got = runner(family, config, layer)()
            ok, numbers = passes(got, reference(layer))
            row |= numbers | {"ok": ok}
        except Exception as e:  # a config that does not compile or launch is reported, not timed
            row |= {"ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        row["check_s"] = round(time.perf_counter() - start, 2)
        rows.append(row)
    return rows


def jobs_for(shapes: list[ConvShape], families: list[str], device: str, batch: int) -> list[tuple]:
    jobs = []
    for family in families:
        for index, config in enumerate(variants()[family]):
            by_kind: dict[str, list[ConvShape]] = {}
            for shape in shapes:
                if fits(shape, config):
                    by_kind.setdefault(shape.kind, []).append(shape)
            jobs += [(family, index, kind, group, device, batch) for kind, group in by_kind.items()]
    return jobs


def run_checks(jobs: list[tuple], workers: int, deadline: float, log) -> list[dict]:
    """Every job's rows; jobs still compiling at the deadline are dropped (their variants are not timed)."""
    rows = []
    if workers <= 1:
        for job in jobs:
            rows += check_job(job)
    else:
        import multiprocessing
        from concurrent.futures import as_completed
        from concurrent.futures import TimeoutError as FuturesTimeout

        pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
        futures = {pool.submit(check_job, job): job for job in jobs}
        try:
            for future in as_completed(futures, timeout=max(1.0, deadline - time.monotonic())):
                rows += future.result()
        except FuturesTimeout:
            late = [f"{j[0]}:{label(j[0], variants()[j[0]][j[1]])} {j[2]}" for f, j in futures.items() if not f.done()]
            log(f"  check deadline: {len(late)} jobs dropped: {', '.join(late)}")
        pool.shutdown(wait=False, cancel_futures=True)
    for row in rows:
        if not row["ok"]:
            log(f"  check failed: {row['shape']} {row['family']} {row['config']}: "
                f"{row.get('error') or (row['max_steps'], row['off'], row['max_rel_error'])}")
    return rows


# ---- phase 2: timing ----------------------------------------------------------------------------------

def time_ms(fn, dry_run: bool) -> float:
    if dry_run:
        fn()
        return float("nan")
    from gpu import graph_ms  # bench/gpu.py: warm-up outside the capture, 10 calls per graph, median of replays

    return graph_ms(fn, calls=10, replays=5)


def sweep(shapes: list[ConvShape], families: list[str], passed: set[tuple[str, str, str]], batch: int,
          device: str, deadline: float, dry_run: bool, log) -> list[dict]:
    torch.backends.cudnn.benchmark = True
    all_variants = variants()
    results = []
    for shape in shapes:
        row: dict = {"shape": shape.name, "count": shape.count, "timings": {}}
        for fp8 in (False, True):
            wanted = [f for f in families if (f == "fp8") == fp8]
            if not wanted and fp8:
                continue
            layer = make_layer(shape, batch, fp8, device)
            calls = {} if fp8 else {"fp16": fp16_runner(layer), "dequant": dequantized_runner(layer)}
            for family in wanted:
                for config in all_variants[family]:
                    if (shape.name, family, label(family, config)) in passed:
                        calls[f"{family}:{label(family, config)}"] = runner(family, config, layer)
            for key, fn in calls.items():
                if time.monotonic() > deadline:
                    log(f"  budget spent: {shape.name} {key} not timed")
                    continue
                try:
                    row["timings"][key] = time_ms(fn, dry_run)
                except Exception as e:
                    log(f"  {shape.name} {key}: {type(e).__name__}: {str(e)[:200]}")
            del layer, calls
        results.append(row)
        log(f"  timed {shape.name}: " + ", ".join(f"{k} {v:.3f}" for k, v in sorted(row["timings"].items(),
                                                                                     key=lambda kv: kv[1])[:4]))
    return results


def best(timings: dict[str, float], prefix: str) -> tuple[float, str]:
    found = [(ms, key.split(":", 1)[1]) for key, ms in timings.items() if key.startswith(prefix + ":")]
    return min(found) if found else (float("nan"), "-")


def table(results: list[dict]) -> str:
    lines = ["| layer | n | fp16 ms | dequant ms | old int8 ms | new int8 ms (config) | x fp16 | new fp8 ms (config) "
             "| x fp16 |", "|---|---|---|---|---|---|---|---|---|"]
    totals = dict.fromkeys(("fp16", "dequant", "old", "int8", "fp8", "best8"), 0.0)
    for row in results:
        t = row["timings"]
        fp16, deq = t.get("fp16", float("nan")), t.get("dequant", float("nan"))
        old, _ = best(t, "old")
        int8, int8_config = best(t, "int8")
        fp8, fp8_config = best(t, "fp8")
        n = row["count"]
        for key, ms in (("fp16", fp16), ("dequant", deq), ("old", old), ("int8", int8), ("fp8", fp8),
                        ("best8", min(v for v in (deq, int8) if not math.isnan(v)) if not (math.isnan(deq) and
                                                                                        math.isnan(int8)) else
                         float("nan"))):
            totals[key] += n * ms
        lines.append(f"| {row['shape']} | {n} | {fp16:.3f} | {deq:.3f} | {old:.3f} | {int8:.3f} ({int8_config}) | "
                     f"{fp16 / int8:.2f}x | {fp8:.3f} ({fp8_config}) | {fp16 / fp8:.2f}x |")
    lines.append(f"| **ResNet-50 total (ms x n)** | 53 | {totals['fp16']:.2f} | {totals['dequant']:.2f} | "
                 f"{totals['old']:.2f} | {totals['int8']:.2f} | {totals['fp16'] / totals['int8']:.2f}x | "
                 f"{totals['fp8']:.2f} | {totals['fp16'] / totals['fp8']:.2f}x |")
    lines.append(f"best 8-bit per layer (min of dequant, new int8), summed: {totals['best8']:.2f} ms "
                 f"({totals['fp16'] / totals['best8']:.2f}x fp16)")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--budget", type=float, default=190.0, help="seconds for the whole run (timing stops then)")
    ap.add_argument("--check-budget", type=float, default=110.0, help="seconds for the compiles and checks")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--families", default="int8,fp8,old")
    ap.add_argument("--shapes", default="", help="substrings of layer names (default: every layer)")
    ap.add_argument("--workers", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)))
    ap.add_argument("--dry-run", action="store_true", help="CPU, TRITON_INTERPRET=1, tiny shapes, no timing")
    args = ap.parse_args()
    start = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_file = open(out / "qconv_sweep.log", "w")

    def log(line: str) -> None:
        line = f"[{time.monotonic() - start:6.1f}s] {line}"
        print(line, flush=True)
        log_file.write(line + "\n")

    families = [f for f in args.families.split(",") if f]
    shapes = [s for s in RESNET50 if not args.shapes or any(p in s.name for p in args.shapes.split(","))]
    device, batch, check_batch, workers = "cuda", args.batch, CHECK_BATCH, args.workers
    if args.dry_run:
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("--dry-run runs the kernels under the interpreter: set TRITON_INTERPRET=1")
        global SHRINK
        SHRINK = 4
        tiny = [RESNET50[i].scaled(2) for i in (2, 3, 5)] + [RESNET50[9].scaled(4), STEM.scaled(8)]
        shapes = [t for t in tiny if not args.shapes or any(p in t.name for p in args.shapes.split(","))]
        device, batch, check_batch, workers = "cpu", 1, 1, 1
    else:
        import triton

        log(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
            f"commit {os.environ.get('KILN_COMMIT', '?')}")
    jobs = jobs_for(shapes, families, device, check_batch)
    log(f"phase 1: {len(jobs)} check jobs on {workers} workers")
    checks = run_checks(jobs, workers, start + args.check_budget, log)
    passed = {(r["shape"], r["family"], r["config"]) for r in checks if r["ok"]}
    for family, config in sorted({(r["family"], r["config"]) for r in checks}):
        rows = [r for r in checks if (r["family"], r["config"]) == (family, config) and "off" in r]
        if rows:
            log(f"  accuracy {family} {config}: up to {max(r['max_steps'] for r in rows)} steps on <= "
                f"{max(r['off'] for r in rows):.2%} of the outputs, |error| <= "
                f"{max(r['max_rel_error'] for r in rows):.1e} of the largest; {sum(r['ok'] for r in rows)}/{len(rows)} pass")
    log(f"phase 1 done: {len(passed)}/{len(checks)} variants passed")
    results = sweep(shapes, families, passed, batch, device, start + args.budget, args.dry_run, log)
    text = table(results)
    (out / "qconv_sweep.json").write_text(json.dumps({"checks": checks, "results": results}, indent=1))
    log("done")
    print(text, flush=True)
    log_file.write(text + "\n")


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        sys.exit(1)
