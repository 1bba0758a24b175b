"""MobileNetV2 INT8/FP8 top-1 (issue 12): how far 74 held-out images can tell, wider formats for the worst layers,
mixed INT8/FP8 and AdaRound, in bench/quant_lab.py's torch fake-quant of kiln's scheme
(bench/results/quantacc3-2026-12-06.md).

    python bench/quantacc3_lab.py floor        # fp16 / bf16 end to end and random logit noise: the set's own floor
    python bench/quantacc3_lab.py wide         # int8, the k layers whose int8 input costs most at 16 bits (W8A16)
    python bench/quantacc3_lab.py mixed        # fp8, the k most sensitive layers int8 or fp16
    python bench/quantacc3_lab.py adaround     # AdaRound weights (int8), every input int8 / weights alone
    python bench/quantacc3_lab.py gptq         # GPTQ weights (int8), with the inputs int8 or 16-bit
    python bench/quantacc3_lab.py gptq-fp8     # GPTQ on E4M3's grid

Every count is on the 74 held-out images (held) and on 128 other crops of the same photographs (more:
photo_variants(8, seed=1), none calibrates), both against fp32's top-1; relerr: mean over the held-out images of
|logits - fp32| / |fp32| (L2). Layer rankings are measured on the 12 calibration images of the lowest margins.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from quant_lab import (Lab, act_quantizers, fq_int, gptq_weights, hessian, quantize_weight,  # noqa: E402
                       weight_scale)
from quantacc2_lab import RANK_IMAGES, names, relerr  # noqa: E402

from kiln.quant.data import photo_variants  # noqa: E402

torch.set_grad_enabled(False)

# per layer, what it computes in: weight format / input format
KINDS = {
    "float": (None, None),
    "fp16": ("fp16", "fp16"),
    "bf16": ("bf16", "bf16"),
    "int8": ("int8", "int8"),
    "fp8": ("fp8", "fp8"),
    "w8a16": ("int8", "int16"),  # int8 weights, 16-bit integer input (one scale per tensor, by max)
    "a8": (None, "int8"),  # the input alone int8 (rankings)
    "af8": (None, "fp8"),
    "int8w": ("int8", None),  # the weights alone int8
    "wf8a16": ("fp8", "fp16"),  # fp8 weights, fp16 inputs
}


def cast(t: torch.Tensor, kind: str) -> torch.Tensor:
    return t.to(torch.float16 if kind == "fp16" else torch.bfloat16).float()


class Mixed:
    """The lab's model with one KINDS entry per layer: quantized weights (bias-corrected, as kiln does) and the
    input quantizers, from the lab's calibration inputs."""

    def __init__(self, lab: Lab):
        self.lab = lab
        self.acts = {"int8": act_quantizers(lab, "int8", "percentile"), "fp8": act_quantizers(lab, "fp8", "minmax")}
        a16 = []
        for x in lab.inputs:  # int16 by max: 65535 steps leave no reason to clip
            s = x.abs().max().clamp_min(1e-12) / 32767
            a16.append(lambda t, s=s: fq_int(t, s, -32768, 32767))
        self.acts["int16"] = a16
        self.rounded: dict[str, list[torch.Tensor]] = {}  # weight format -> per-layer weights other than nearest

    def weight(self, i: int, fmt: str) -> torch.Tensor:
        w = self.lab.float_w[i]
        if fmt in ("fp16", "bf16"):
            return cast(w, fmt)
        if fmt in self.rounded:
            return self.rounded[fmt][i]
        return quantize_weight(w, fmt)

    def apply(self, plan: list[str]) -> list:
        lab = self.lab
        fns = []
        for i, (m, kind) in enumerate(zip(lab.layers, plan)):
            wf, af = KINDS[kind]
            w, b = lab.float_w[i], lab.float_b[i].clone()
            wq = w if wf is None else self.weight(i, wf)
            if wf is not None:  # bias correction (kiln/quant/qdq.py's _correct_bias), from the float inputs' means
                x = lab.inputs[i]
                if isinstance(m, nn.Linear):
                    b -= (wq - w) @ x.mean(0)
                else:
                    d = (wq - w).sum((2, 3)).reshape(m.groups, -1, w.shape[1])  # [g, O/g, C/g]
                    b -= (d * x.mean((0, 2, 3)).reshape(m.groups, 1, -1)).sum(-1).reshape(-1)
            m.weight.copy_(wq)
            m.bias.copy_(b)
            if af is None:
                fns.append(None)
            elif af in ("fp16", "bf16"):
                fns.append(lambda t, k=af: cast(t, k))
            else:
                fns.append(self.acts[af][i])
        return fns


class Judge:
    def __init__(self, lab: Lab):
        self.lab = lab
        self.more = torch.from_numpy(np.concatenate(photo_variants(8, seed=1)))
        lab.reset()
        self.held_ref, self.calib_ref = lab.model(lab.held), lab.model(lab.calib)
        self.more_ref = lab.model(self.more).argmax(1)
        top2 = self.calib_ref.topk(2, dim=1).values
        self.closest = (top2[:, 0] - top2[:, 1]).argsort()[:RANK_IMAGES]

    def row(self, fns) -> str:
        lab = self.lab
        held = lab.run(fns)
        more = lab.run(fns, self.more)
        return (f"{int((held.argmax(1) == lab.reference).sum())}/74 | "
                f"{int((more.argmax(1) == self.more_ref).sum())}/{len(self.more)} | {relerr(held, self.held_ref):.4f}")

    def rank(self, mixed: Mixed, kind: str) -> list[tuple[float, int]]:
        """Each layer alone as `kind`, the rest float: relerr on the lowest-margin calibration images, largest first."""
        n = len(self.lab.layers)
        x, ref = self.lab.calib[self.closest], self.calib_ref[self.closest]
        rows = [(relerr(self.lab.run(mixed.apply(["float"] * i + [kind] + ["float"] * (n - i - 1)), x), ref), i)
                for i in range(n)]
        return sorted(rows, reverse=True)


HEADER = "| plan | held | more | relerr held |\n|---|---|---|---|"


def floor(lab: Lab, judge: Judge, mixed: Mixed) -> None:
    n = len(lab.layers)
    print(HEADER)
    print(f"| fp32 | 74/74 | {len(judge.more)}/{len(judge.more)} | 0 |")
    for kind in ("fp16", "bf16"):
        print(f"| every layer {kind} (weights and inputs) | {judge.row(mixed.apply([kind] * n))} |", flush=True)
    lab.reset()
    more_logits = lab.model(judge.more)
    print("\nrandom logit noise of a given relerr (20 draws): held-out count min / median / max; more likewise")
    for r in (0.005, 0.01, 0.02, 0.035, 0.05, 0.1):
        counts = {"held": [], "more": []}
        for seed in range(20):
            g = torch.Generator().manual_seed(seed)
            for key, logits, ref in (("held", judge.held_ref, lab.reference), ("more", more_logits, judge.more_ref)):
                noise = torch.randn(logits.shape, generator=g)
                noise *= logits.norm(dim=1, keepdim=True) * r / noise.norm(dim=1, keepdim=True)
                counts[key].append(int(((logits + noise).argmax(1) == ref).sum()))
        print(f"relerr {r}: held {min(counts['held'])} / {int(np.median(counts['held']))} / {max(counts['held'])}; "
              f"more {min(counts['more'])} / {int(np.median(counts['more']))} / {max(counts['more'])}", flush=True)
    top2 = judge.held_ref.topk(2, dim=1).values
    gap = ((top2[:, 0] - top2[:, 1]) / judge.held_ref.std(1)).sort().values
    print("held-out top-1 margins / the logits' std, lowest 6:", [round(float(v), 4) for v in gap[:6]])


def wide(lab: Lab, judge: Judge, mixed: Mixed) -> None:
    """int8 everywhere, the k layers whose int8 input alone costs most (calibration ranking) read it at 16 bits."""
    n, label = len(lab.layers), names(lab)
    order = [i for _, i in judge.rank(mixed, "a8")]
    print("int8 inputs, most costly first:", ", ".join(label[i].split()[1] for i in order[:12]))
    print(HEADER)
    for k in (0, 2, 4, 6, 8, 12, 16, 24, n):
        plan = ["int8"] * n
        for i in order[:k]:
            plan[i] = "w8a16"
        print(f"| int8, {k} widest inputs 16-bit | {judge.row(mixed.apply(plan))} |", flush=True)
    plan = ["w8a16"] * n
    print(f"| int8 weights, every input 16-bit | {judge.row(mixed.apply(plan))} |", flush=True)


def mixed_fp8(lab: Lab, judge: Judge, mixed: Mixed) -> None:
    n, label = len(lab.layers), names(lab)
    f8, i8 = judge.rank(mixed, "fp8"), dict((i, e) for e, i in judge.rank(mixed, "int8"))
    order = [i for _, i in f8]
    print("fp8 most costly first:", ", ".join(label[i].split()[1] for i in order[:12]))
    better = [i for e, i in f8 if i8[i] < e]
    print(f"int8 alone beats fp8 alone on {len(better)} of {n} layers")
    print(HEADER)
    for other in ("int8", "fp16"):
        for k in ((0,) if other == "int8" else ()) + (2, 4, 8, 16):
            plan = ["fp8"] * n
            for i in order[:k]:
                plan[i] = other
            print(f"| fp8, the {k} most costly {other} | {judge.row(mixed.apply(plan))} |", flush=True)
    plan = ["int8" if i in better else "fp8" for i in range(n)]
    print(f"| each layer the better of int8/fp8 alone ({len(better)} int8) | {judge.row(mixed.apply(plan))} |")
    print(f"| fp8 weights, fp16 inputs | {judge.row(mixed.apply(['wf8a16'] * n))} |", flush=True)


def adaround(w: torch.Tensor, h: torch.Tensor, steps: int = 300, reg: float = 0.01, lr: float = 0.01,
             seed: int = 0) -> torch.Tensor:
    """AdaRound (Nagel et al. 2020) on the layer's input second moments h: each weight rounds down or up on its
    channel's int8 grid, chosen by a rectified-sigmoid relaxation minimising the layer's output error
    tr(ΔW H ΔWᵀ) plus a regulariser annealed towards hard 0/1 decisions. w: [R, K]; h: [1 or R, K, K]."""
    w = w.double()
    scale = weight_scale(w.float(), 127).double()[:, None]  # [R, 1]
    low = torch.floor(w / scale)
    frac = w / scale - low
    zeta, gamma = 1.1, -0.1
    v = torch.log((frac - gamma) / (zeta - frac)).clamp(-8, 8)  # h(v) = frac: start at the float weight
    hh = h / torch.diagonal(h, dim1=1, dim2=2).mean(1, keepdim=True)[..., None].clamp_min(1e-12)
    with torch.enable_grad():
        v = v.clone().requires_grad_(True)
        opt = torch.optim.Adam([v], lr=lr)
        for step in range(steps):
            soft = (torch.sigmoid(v) * (zeta - gamma) + gamma).clamp(0, 1)
            q = (low + soft).clamp(-127, 127) * scale
            d = q - w  # [R, K]
            # dense: one H for every row; depthwise: row r (channel r) has its own
            err = torch.einsum("rk,rkj,rj->", d, hh, d) if hh.shape[0] > 1 else torch.einsum("rk,kj,rj->", d, hh[0], d)
            beta = 20 - (20 - 2) * step / steps
            loss = err / (scale ** 2).sum() + reg * (1 - (2 * soft - 1).abs() ** beta).sum() / d.numel() \
                if step > steps // 5 else err / (scale ** 2).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
    up = (torch.sigmoid(v) * (zeta - gamma) + gamma).clamp(0, 1) >= 0.5
    return ((low + up.double()).clamp(-127, 127) * scale).float()


def adaround_weights(lab: Lab) -> list[torch.Tensor]:
    out = []
    for i, m in enumerate(lab.layers):
        w = lab.float_w[i]
        out.append(adaround(w.reshape(w.shape[0], -1), hessian(m, lab.inputs[i])).reshape(w.shape))
    return out


def adaround_main(lab: Lab, judge: Judge, mixed: Mixed) -> None:
    n = len(lab.layers)
    start = time.time()
    rounded = adaround_weights(lab)
    print(f"AdaRound: {time.time() - start:.0f} s for {n} layers")
    print(HEADER)
    rows = (("int8", ["int8"] * n), ("int8 weights only", ["int8w"] * n))
    for label, plan in rows:
        mixed.rounded.pop("int8", None)
        print(f"| {label}, nearest | {judge.row(mixed.apply(plan))} |", flush=True)
        mixed.rounded["int8"] = rounded
        print(f"| {label}, AdaRound | {judge.row(mixed.apply(plan))} |", flush=True)
    mixed.rounded.pop("int8", None)


def gptq_main(lab: Lab, judge: Judge, mixed: Mixed) -> None:
    """GPTQ weights (quant_lab.gptq: the same layer objective as AdaRound, errors spread over later columns)
    with the inputs int8, and with the widest 16 / every input at 16 bits (wide's order)."""
    n = len(lab.layers)
    order = [i for _, i in judge.rank(mixed, "a8")]
    start = time.time()
    rounded = gptq_weights(lab, "int8")
    print(f"GPTQ: {time.time() - start:.0f} s for {n} layers")
    print(HEADER)
    plans = [("int8", ["int8"] * n), ("int8 weights only", ["int8w"] * n)]
    plans += [(f"int8, {k} widest inputs 16-bit", ["w8a16" if i in order[:k] else "int8" for i in range(n)])
              for k in (4, 8, 12, 16)]
    plans.append(("int8 weights, every input 16-bit", ["w8a16"] * n))
    for label, plan in plans:
        mixed.rounded["int8"] = rounded
        print(f"| {label}, GPTQ | {judge.row(mixed.apply(plan))} |", flush=True)
    mixed.rounded.pop("int8", None)


def gptq_fp8(lab: Lab, judge: Judge, mixed: Mixed) -> None:
    """GPTQ on E4M3's grid: fp8 weights with fp16 inputs, every layer fp8, and the stem and b1.dw int8 (GPTQ too)."""
    n = len(lab.layers)
    mixed.rounded = {"fp8": gptq_weights(lab, "fp8"), "int8": gptq_weights(lab, "int8")}
    print(HEADER)
    plans = (("fp8 weights, every input fp16", ["wf8a16"] * n), ("fp8", ["fp8"] * n),
             ("stem and b1.dw int8, rest fp8", ["int8", "int8"] + ["fp8"] * (n - 2)))
    for label, plan in plans:
        print(f"| {label}, GPTQ | {judge.row(mixed.apply(plan))} |", flush=True)
    mixed.rounded = {}


if __name__ == "__main__":
    torch.manual_seed(0)
    lab = Lab()
    judge, mixed = Judge(lab), Mixed(lab)
    {"floor": floor, "wide": wide, "mixed": mixed_fp8, "adaround": adaround_main,
     "gptq": gptq_main, "gptq-fp8": gptq_fp8}[sys.argv[1]](lab, judge, mixed)
