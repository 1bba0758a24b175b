"""se.c's kernels (kiln_silu, kiln_squeeze_excite) at EfficientNet-B0's sizes: this tree's against another
revision's se.c and against torch, one thread, interleaved.

    python bench/se_kernels.py                  # against main's se.c
    python bench/se_kernels.py --base HEAD~1 --rounds 9
    python bench/se_kernels.py --engine b0.kiln --model efficientnet_b0   # a saved engine, whole runs

Both se.c builds are compiled by kiln's own build (native_loop.build: -O3 -march=native, or the AVX2 flags
under KILN_CPU_ISA=avx2) and called on the same tensors. Measure: CPU time of the calling thread
(time.thread_time) of blocks of calls; each round times every variant once (interleaved); the table gives
the least over rounds in µs per call and, for SiLU, ns per element. torch's peers: F.silu_ (in place), and
for SE the unfused ops on channels-last tensors (mean, two 1x1 convolutions as linear layers, sigmoid, mul).
Every variant's output is checked against torch in float64 first. With --engine, a saved engine of a zoo model
is loaded twice, its kernels bound to one build of se.c each (the same layers and tactics otherwise), and timed
whole against onnxruntime (one thread each, outputs checked against onnxruntime first).
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kiln  # noqa: E402
from kiln import zoo  # noqa: E402
from kiln.builder.timing_cache import cpu_name  # noqa: E402
from kiln.kernels.cpu import conv_silu, native_loop, onednn, se  # noqa: E402
from kiln.kernels.cpu.cpu_features import isa, isa_cap  # noqa: E402

# EfficientNet-B0's SiLU outputs (channels, side) and SE blocks (channels, side, reduced channels)
SILU_SIZES = [(32, 112), (96, 112), (96, 56), (144, 56), (240, 28), (480, 14), (1152, 7)]
SE_SIZES = [(32, 112, 8), (96, 56, 4), (144, 56, 6), (144, 28, 6), (240, 28, 10), (480, 14, 20), (672, 7, 28),
            (1152, 7, 48)]


def library_at(revision: str) -> ctypes.CDLL:
    source = subprocess.run(["git", "show", f"{revision}:kiln/kernels/cpu/se.c"], capture_output=True, text=True,
                            check=True, cwd=Path(__file__).resolve().parents[1]).stdout
    built = native_loop.build("se", source)
    if isinstance(built, str):
        raise SystemExit(f"se.c at {revision}: {built}")
    library = ctypes.CDLL(str(built))
    for function in (library.kiln_silu, library.kiln_squeeze_excite):
        function.restype, function.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                                             ctypes.c_void_p]
    return library


def silu_call(library: ctypes.CDLL, x: torch.Tensor):
    md = onednn.memory_desc([1], onednn.TAG_A)
    memory = onednn._memory(md.value, x.data_ptr())
    plan = conv_silu._Plan(get_handle=ctypes.cast(onednn.load().lib.dnnl_memory_get_data_handle,
                                                  ctypes.c_void_p).value, x=memory.value, n=x.numel(), threads=1)
    keep = (md, memory, plan)

    def call():
        assert library.kiln_silu(ctypes.addressof(keep[2]), None, 0, None) == 0
    return call


def least_per_call(calls: dict, rounds: int, target_s: float = 0.02) -> dict[str, float]:
    """least over rounds of (thread CPU time of a block of calls) / calls, in seconds; variants interleaved"""
    counts = {}
    for name, call in calls.items():
        call()
        start, n = time.thread_time(), 0
        while time.thread_time() - start < target_s / 4:
            call()
            n += 1
        counts[name] = max(4 * n, 3)
    best = {name: float("inf") for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            start = time.thread_time()
            for _ in range(counts[name]):
                call()
            best[name] = min(best[name], (time.thread_time() - start) / counts[name])
    return best


def silu_rows(base: ctypes.CDLL, here: ctypes.CDLL, rounds: int) -> list[str]:
    rows = []
    for c, side in SILU_SIZES:
        x0 = torch.randn(c * side * side) * 4
        want = torch.nn.functional.silu(x0.double())
        buffers = {name: x0.clone() for name in ("base", "here", "torch")}
        calls = {"base": silu_call(base, buffers["base"]), "here": silu_call(here, buffers["here"]),
                 "torch": lambda b=buffers["torch"]: torch.nn.functional.silu(b, inplace=True)}
        for name, call in calls.items():  # one call on the input, checked; later calls see SiLU(SiLU(...))
            call()
            error = ((buffers[name].double() - want).abs() / want.abs().clamp_min(1e-30)).max().item()
            if error > 4e-7:
                raise SystemExit(f"SiLU {name} at {c}x{side}x{side}: relative error {error:.2e}")
        t = least_per_call(calls, rounds)
        n = x0.numel()
        rows.append(f"| SiLU {c}x{side}x{side} | {t['base'] * 1e6:.1f} ({t['base'] / n * 1e9:.3f}) | "
                    f"{t['here'] * 1e6:.1f} ({t['here'] / n * 1e9:.3f}) | {t['torch'] * 1e6:.1f} "
                    f"({t['torch'] / n * 1e9:.3f}) | {t['base'] / t['here']:.2f} |")
    return rows


def se_rows(base: ctypes.CDLL, here: ctypes.CDLL, rounds: int) -> list[str]:
    rows = []
    for c, side, r in SE_SIZES:
        w1, b1, w2, b2 = torch.randn(r, c) / c ** 0.5, torch.randn(r), torch.randn(c, r) / r ** 0.5, torch.randn(c)
        x = torch.randn(1, c, side, side).contiguous(memory_format=torch.channels_last)
        x64 = x.double()
        hidden = torch.nn.functional.silu(x64.mean((2, 3)) @ w1.double().t() + b1.double())
        want = x64 * torch.sigmoid(hidden @ w2.double().t() + b2.double())[:, :, None, None]
        layers = {}
        for name, library in (("base", base), ("here", here)):
            layer = se.SqueezeExcite(w1, b1, w2, b2, tuple(x.shape), "SiLU", 0.0, 0.0, "Sigmoid", 0.0, 0.0)
            layer.library = library  # its calls go to this build of se.c
            layers[name] = layer

        def unfused():
            s = x.mean((2, 3))
            return x * torch.sigmoid(torch.nn.functional.linear(torch.nn.functional.silu(
                torch.nn.functional.linear(s, w1, b1)), w2, b2))[:, :, None, None]
        calls = {"base": lambda: layers["base"](x), "here": lambda: layers["here"](x), "torch": unfused}
        for name, call in calls.items():
            error = (call().double() - want).abs().max().item()
            if error > 1e-5:
                raise SystemExit(f"SE {name} at {c}x{side}x{side}: max error {error:.2e}")
        t = least_per_call(calls, rounds)
        rows.append(f"| SE {c}x{side}x{side} -> {r} | {t['base'] * 1e6:.1f} | {t['here'] * 1e6:.1f} | "
                    f"{t['torch'] * 1e6:.1f} | {t['base'] / t['here']:.2f} |")
    return rows


def engine_rows(model: str, path: str, base: ctypes.CDLL, here: ctypes.CDLL, rounds: int) -> list[str]:
    exported = zoo.export(model)
    feeds = exported.inputs()
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(exported.path), options, providers=["CPUExecutionProvider"])
    want = session.run(None, feeds)
    calls = {}
    saved = se.load
    for name, library in (("base", base), ("here", here)):
        se.load = lambda library=library: library  # the engine's SE and SiLU layers bind this build
        try:
            engine = kiln.load(path)
        finally:
            se.load = saved
        got = engine.run(feeds)
        error = max(float(np.max(np.abs(got[n] - w))) for n, w in zip(engine.output_names, want))
        if error > 1e-4:
            raise SystemExit(f"{path} on the {name} se.c: {error:.1e} from onnxruntime")
        calls[name] = lambda engine=engine: engine.run(feeds)
    calls["onnxruntime"] = lambda: session.run(None, feeds)
    t = least_per_call(calls, rounds, target_s=0.5)
    return [f"| {model} ({Path(path).name}) | {t['base'] * 1e3:.2f} | {t['here'] * 1e3:.2f} | "
            f"{t['onnxruntime'] * 1e3:.2f} | {t['base'] / t['here']:.2f} |"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", default="main", help="the revision whose se.c is the 'base' column")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--only", choices=("silu", "se", "engine"), help="one of the tables")
    parser.add_argument("--engine", help="a saved engine of --model, timed whole")
    parser.add_argument("--model", default="efficientnet_b0", help="the zoo model of --engine")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if not (onednn.available() and se.available()):
        raise SystemExit(f"kiln's SE kernel is unavailable: {se.reason()}")
    base, here = library_at(args.base), se.load()
    print(f"CPU: {cpu_name()}, ISA {isa()} (cap: {isa_cap()}), 1 thread, thread CPU time, "
          f"least of {args.rounds} rounds")
    if args.only in (None, "silu"):
        print(f"\n| layer | {args.base}'s se.c µs (ns/element) | this tree's | torch F.silu_ | speed-up |\n"
              "|---|---|---|---|---|")
        print("\n".join(silu_rows(base, here, args.rounds)))
    if args.only in (None, "se"):
        print(f"\n| layer | {args.base}'s se.c µs | this tree's | torch unfused | speed-up |\n|---|---|---|---|---|")
        print("\n".join(se_rows(base, here, args.rounds)))
    if args.engine:
        print(f"\n| model | {args.base}'s se.c ms | this tree's | onnxruntime | speed-up |\n|---|---|---|---|---|")
        print("\n".join(engine_rows(args.model, args.engine, base, here, args.rounds)))


if __name__ == "__main__":
    main()
