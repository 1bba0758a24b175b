"""kiln's CPU attention kernel (attention.c) against an earlier commit's and torch's SDPA, one process, interleaved.

    python bench/cpu_attention_avx2.py --avx2                 # both sides capped to AVX2 (issue 11)
    python bench/cpu_attention_avx2.py                        # the machine's ISA (AVX-512 here)
    python bench/cpu_attention_avx2.py --avx2 --ref 2fdf294 --cases bert128,bert384 --rounds 9

Each case is one kiln::Attention layer as kiln's optimizer hands it to the cpu.attention.native tactic (BERT's
q/k/v as column slices of the QKV GEMM's [B, S, 3·H·D] output, the output merged [B, S, H·D]; T5's heads with
its [1, H, S, S] position bias and no scaling; ViT/Whisper without a mask). Three runs of it: kiln's kernel built
from this checkout ("new"), the same kernel built from --ref's attention.c / transformer.c ("ref", a second
library in this process, the same plan), and the op itself (kiln/ops/fused.py attention: views + torch's SDPA,
what the tuner times as "default"). Outputs checked against SDPA in float64 first (exit 1 on a miss).

--avx2 masks cpuid (bench/cpuid_avx2.py) and sets KILN_CPU_ISA=avx2 before anything loads: kiln's C is compiled
for x86-64-v3 and ATen's SDPA dispatches to its AVX2 kernels (checked: torch.backends.cpu.get_cpu_capability()).

Timing: thread CPU time of one call (a loaded machine's other work not counted), --rounds rounds, each running
every variant's block of --calls calls in a rotated order; a variant's time is the median of its block medians,
and each ratio is the median of the per-round ratios (with their range). The table is printed last.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

if __name__ == "__main__" and "--avx2" in sys.argv:
    import cpuid_avx2  # noqa: E402

    cpuid_avx2.enable()  # before torch or kiln read cpuid
    os.environ["KILN_CPU_ISA"] = "avx2"

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import kiln  # noqa: E402,F401  (the library caps, kiln/__init__.py)
from kiln.kernels.cpu import native_loop  # noqa: E402
from kiln.kernels.cpu import transformer as kernels  # noqa: E402
from kiln.ops.fused import attention as attention_op  # noqa: E402
from kiln.tactics.cpu.attention import attention_plan  # noqa: E402

HEADS_LAST = [0, 2, 1, 3]
# name: (B, H, S, D, mask, scale): mask "" none, "qk" BERT's exported [B, 1, S, S] (all visible), "bias" T5's
# [1, H, S, S] position bias
CASES = {
    "bert128": (1, 12, 128, 64, "qk", None),
    "bert384": (1, 12, 384, 64, "qk", None),
    "bert128b8": (8, 12, 128, 64, "qk", None),
    "t5": (1, 8, 128, 64, "bias", 1.0),
    "deit": (1, 6, 197, 64, "", None),
    "whisper": (1, 8, 1500, 64, "", None),
    "odd": (2, 3, 77, 40, "qk", None),
}


def reference_library(rev: str) -> native_loop.KernelLibrary:
    """transformer.c + attention.c (+ the files compiled with them) as they were at `rev`, as a library of its own."""
    def show(path: str) -> str:
        return subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout

    source = "\n".join(show(f"kiln/kernels/cpu/{name}")
                       for name in ("transformer.c", "attention.c", "elementwise.c", "tokens.c"))
    # the header at rev inlined: its include guard keeps the checkout's copy out
    source = source.replace('#include "exp_poly.h"', show("kiln/kernels/cpu/exp_poly.h"), 1)
    return native_loop.KernelLibrary("transformer_ref", source, ("kiln_attention",))


def layer(case: str, rng: np.random.Generator):
    """(the op's attributes, its inputs, the step input sizes) of one case."""
    b, h, s, d, mask, scale = CASES[case]
    attrs = dict(scale=d ** -0.5 if scale is None else scale, q_perm=HEADS_LAST, k_perm=HEADS_LAST, v_perm=HEADS_LAST,
                 out_perm=HEADS_LAST, q_num_heads=h, kv_num_heads=h, out_merge_heads=1, qkv_split=[h * d] * 3,
                 nan_to_zero=1)
    inputs = [torch.from_numpy(rng.standard_normal((b, s, 3 * h * d), dtype=np.float32)), None, None]
    if mask == "qk":
        inputs.append(torch.zeros(b, 1, s, s))
    elif mask == "bias":
        inputs.append(torch.from_numpy(rng.standard_normal((1, h, s, s), dtype=np.float32)))
    sizes = {k: tuple(x.shape) for k, x in enumerate(inputs) if x is not None}
    return attrs, inputs, sizes


def float64_sdpa(attrs, inputs) -> torch.Tensor:
    x = [t.double() if t is not None else None for t in inputs]
    return attention_op(None, *x, **attrs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--avx2", action="store_true", help="cap both sides to AVX2 (cpuid mask + KILN_CPU_ISA)")
    ap.add_argument("--ref", default="2fdf294", help="the commit whose attention kernel is the reference")
    ap.add_argument("--cases", default="bert128,bert384,t5,deit")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--calls", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    capability = torch.backends.cpu.get_cpu_capability()
    if args.avx2 and capability != "AVX2":
        raise SystemExit(f"ATen dispatches to {capability} under the cap")
    ref_lib = reference_library(args.ref).load()
    if ref_lib is None:
        raise SystemExit("the reference kernel did not build")
    rng = np.random.default_rng(args.seed)
    rows, failed = [], False
    for case in args.cases.split(","):
        attrs, inputs, sizes = layer(case, rng)
        plan = attention_plan(attrs, sizes, torch.float32 if 3 in sizes else None)
        new, ref = kernels.Attention(**plan), kernels.Attention(**plan)
        ref.library = ref_lib  # the same plan, run by the reference's function (KernelBound.run)
        reads = {k: x for k, x in enumerate(inputs) if x is not None}
        runs = {"ref": lambda: ref(reads), "new": lambda: new(reads),
                "sdpa": lambda: attention_op(None, *inputs, **attrs)}
        want = float64_sdpa(attrs, inputs)
        errs = {}
        for name, run in runs.items():
            errs[name] = float((run().double() - want).abs().max())
            if errs[name] > 1e-4:  # fp32 against float64: outputs of |v| ~ 1, sums of up to 1500 terms
                print(f"FAIL {case} {name}: {errs[name]:.3g} from float64", flush=True)
                failed = True
        blocks: dict[str, list[float]] = {name: [] for name in runs}
        names = list(runs)
        load0 = os.getloadavg()[0]
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                run, times = runs[name], []
                run()
                for _ in range(args.calls):
                    t0 = time.thread_time_ns()
                    run()
                    times.append((time.thread_time_ns() - t0) / 1e6)
                blocks[name].append(statistics.median(times))
        ratio = {pair: [a / b for a, b in zip(blocks[pair[0]], blocks[pair[1]])]
                 for pair in (("new", "ref"), ("new", "sdpa"), ("ref", "sdpa"))}
        rows.append((case, {n: statistics.median(v) for n, v in blocks.items()},
                     {p: (statistics.median(v), min(v), max(v)) for p, v in ratio.items()}, errs,
                     (load0, os.getloadavg()[0])))
        print(case, rows[-1], flush=True)
    cpu = next((x.split(":", 1)[1].strip() for x in Path("/proc/cpuinfo").read_text().splitlines()
                if x.startswith("model name")), "?")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    print(f"\n# kiln CPU attention: {cpu}, {'capped to AVX2 (cpuid mask, KILN_CPU_ISA=avx2)' if args.avx2 else 'uncapped'}"
          f", ATen {capability}; new = checkout {head.strip()} (+ its working tree), ref = {args.ref}; {args.threads} "
          f"thread(s); thread CPU ms, median of {args.rounds} rounds x {args.calls} calls")
    print("| case (B, H, S, D, mask) | ref ms | new ms | SDPA op ms | new / ref (range) | new / SDPA (range) "
          "| ref / SDPA | max err new, ref, SDPA | load |")
    print("|---|---|---|---|---|---|---|---|---|")
    for case, med, ratio, errs, load in rows:
        b, h, s, d, mask, _ = CASES[case]
        f = ratio
        print(f"| {case} ({b}, {h}, {s}, {d}, {mask or '-'}) | {med['ref']:.3f} | {med['new']:.3f} | {med['sdpa']:.3f} | "
              f"**{f[('new', 'ref')][0]:.2f}** ({f[('new', 'ref')][1]:.2f}-{f[('new', 'ref')][2]:.2f}) | "
              f"**{f[('new', 'sdpa')][0]:.2f}** ({f[('new', 'sdpa')][1]:.2f}-{f[('new', 'sdpa')][2]:.2f}) | "
              f"{f[('ref', 'sdpa')][0]:.2f} | {errs['new']:.1e}, {errs['ref']:.1e}, {errs['sdpa']:.1e} | "
              f"{load[0]:.1f}-{load[1]:.1f} |")
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
