"""MobileNetV2 INT8 top-1 agreement beyond per-tensor ranges (issue 12, session 33): what each remedy of the brief buys,
one at a time, in bench/quant_lab.py's torch fake-quant of kiln's CPU scheme (percentile activations, uint8 ReLU6
outputs, per-channel depthwise inputs, per-channel weights 7-bit on an AVX2 CPU but 8-bit depthwise, bias correction,
GPTQ), on the 202 held-out images of bench/mnv2_w8a16.py (74 + photo_variants(8, seed=1)'s 128; 38 calibrate).

    python bench/int8_acc_lab.py [--vnni] [--only NAME,...] [--probes]

Variants (each adds one thing to "kiln today", or replaces one):
- "kiln today": percentile ranges, GPTQ on the float inputs' second moments, bias correction from the float inputs'
  means (what kiln's CPU build does).
- "output-MSE ranges": each activation's amax chosen on a grid (0.30-1.00 of its max, and the percentile's) by the
  squared error of the *layer's output* (its float weights) on the calibration images, not by the input's histogram;
  depthwise inputs per channel (each output channel reads one input channel).
- "empirical bias": the bias corrected by the mean output error per channel of the quantized layer on the inputs the
  quantized network gives it (layers in order), not only by its weights' rounding on the float inputs' means.
- "own-input ...": the same two with x̃ = x (the layer's own input rounding only, the float network's inputs: one
  calibration pass more, no pass per layer).
- "sequential GPTQ": each layer's weights rounded (GPTQ) towards W* = W E[x x̃ᵀ] E[x̃ x̃ᵀ]⁻¹, the weights that best map
  the input the quantized network gives it (x̃, quantized) onto the float layer's output on the float input x
  (the upstream error absorbed where it is linear), with x̃'s second moments; then the empirical bias.
Agreement: top-1 equal to fp32's; relerr: mean |logits - fp32| / |fp32| (L2).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from int8_avx2_lab import held_out_202  # noqa: E402
from quant_lab import Lab, fq_int, hessian, is_depthwise, percentile_amax, weight_scale  # noqa: E402

from kiln.quant import gptq  # noqa: E402

torch.set_grad_enabled(False)
GRID = np.linspace(0.30, 1.0, 36)


class Stop(Exception):
    pass


def quantizer(amax: torch.Tensor, nonneg: bool):
    """Fake-quant at amax (scalar or [1, C, 1, 1]): uint8 over [0, amax] or int8 symmetric."""
    if nonneg:
        s = amax / 255
        return lambda t, s=s: fq_int(t, s, 0, 255)
    s = amax / 127
    return lambda t, s=s: fq_int(t, s, -128, 127)


def layer_out(m: nn.Module, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(m, nn.Linear):
        return F.linear(x, w, b)
    return F.conv2d(x, w, b, m.stride, m.padding, m.dilation, m.groups)


def percentile_ranges(lab: Lab, i: int, x: torch.Tensor) -> torch.Tensor:
    """kiln's percentile amax (per channel for a depthwise input), capped at 6 for a ReLU6 output."""
    m = lab.layers[i]
    if is_depthwise(m):
        xs = x.transpose(0, 1).reshape(x.shape[1], -1)
        amax = torch.tensor([percentile_amax(c) for c in xs])
        amax = torch.where(amax > 0, amax, amax.max()).view(1, -1, 1, 1)
    else:
        amax = torch.tensor(percentile_amax(x))
    return amax.clamp(max=6.0) if lab.nonneg[i] and i > 0 else amax


def mse_ranges(lab: Lab, i: int, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The amax whose quantized input gives the layer's (float-weight) output nearest `target`; per channel for a
    depthwise layer (output channel c reads input channel c alone)."""
    m = lab.layers[i]
    w = lab.float_w[i]
    nonneg = lab.nonneg[i]
    base = percentile_ranges(lab, i, x)
    if is_depthwise(m):
        top = x.abs().amax((0, 2, 3)).view(1, -1, 1, 1)
        top = torch.where(top > 0, top, top.max())
        if nonneg and i > 0:
            top = top.clamp(max=6.0)
        candidates = [base] + [top * t for t in GRID]
        errors = torch.stack([((layer_out(m, quantizer(a, nonneg)(x), w) - target) ** 2).sum((0, 2, 3))
                              for a in candidates])  # [candidates, C]
        best = errors.argmin(0)
        stacked = torch.stack([a.reshape(-1).expand(x.shape[1]) for a in candidates])  # [candidates, C]
        return stacked.gather(0, best[None]).reshape(1, -1, 1, 1)
    top = float(x.abs().max())
    if nonneg and i > 0:
        top = min(top, 6.0)
    candidates = [float(base)] + [top * t for t in GRID]
    errors = [float(((layer_out(m, quantizer(torch.tensor(a), nonneg)(x), w) - target) ** 2).sum())
              for a in candidates]
    return torch.tensor(candidates[int(np.argmin(errors))])


def qmax_of(lab: Lab, vnni: bool) -> list[float]:
    return [127.0 if vnni or is_depthwise(m) else 64.0 for m in lab.layers]


def gptq_weight(lab: Lab, i: int, w: torch.Tensor, h: np.ndarray, qmax: float, damp: float = gptq.DAMP):
    """w rounded by GPTQ on its per-channel grid (scale max|w| / qmax), second moments h."""
    s = weight_scale(w, qmax)
    shape = [-1] + [1] * (w.dim() - 1)
    q = gptq.round_weights(w.reshape(w.shape[0], -1).double().numpy(), h, s.double().numpy(), qmax, damp)
    return torch.from_numpy(q).float().reshape(w.shape) * s.view(shape)


def rows(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The layer's input rows as [g, rows, K] (hessian()'s order)."""
    if isinstance(m, nn.Linear):
        return x[None].double()
    cols = F.unfold(x, m.kernel_size, padding=m.padding, stride=m.stride)  # [N, C·k·k, L]
    n, ck, length = cols.shape
    g = m.groups
    return cols.reshape(n, g, ck // g, length).permute(1, 0, 3, 2).reshape(g, n * length, ck // g).double()


def shifted_target(m: nn.Module, w: torch.Tensor, x: torch.Tensor, xq: torch.Tensor, damp: float):
    """W* = W E[x x̃ᵀ] (E[x̃ x̃ᵀ] + λ)⁻¹ per group, and E[x̃ x̃ᵀ]: the weights mapping x̃ best onto W x."""
    a, b = rows(m, x), rows(m, xq)  # [g, n, K]
    h = b.transpose(1, 2) @ b / b.shape[1]
    c = a.transpose(1, 2) @ b / b.shape[1]  # E[x x̃ᵀ]
    hd = h.clone()
    diag = torch.diagonal(hd, dim1=1, dim2=2)
    diag += damp * diag.mean(1, keepdim=True) + (diag == 0).double()
    g = m.groups if not isinstance(m, nn.Linear) else 1
    wr = w.reshape(g, w.shape[0] // g, -1).double()  # [g, R/g, K]
    # W* = W + W (E[x x̃ᵀ] - E[x̃ x̃ᵀ]) (E[x̃ x̃ᵀ] + λ)⁻¹: the damping on the correction alone (W C (H + λ)⁻¹ itself
    # shrinks W along the inputs' weak directions: 126 of 202 in this lab)
    star = wr + wr @ (c - h) @ torch.linalg.inv(hd)
    return star.reshape(w.shape).float(), h.numpy()


class Variant:
    def __init__(self, ranges: str = "percentile", bias: str = "analytic", weights: str = "gptq", damp: float = 0.01):
        self.ranges, self.bias, self.weights, self.damp = ranges, bias, weights, damp


def build(lab: Lab, v: Variant, qmax: list[float]) -> tuple[list, list, list]:
    """(activation quantizers, weights, biases) for every layer, in execution order."""
    n = len(lab.layers)
    acts: list = [None] * n
    ws = [w.clone() for w in lab.float_w]
    bs = [b.clone() for b in lab.float_b]
    sequential = v.bias == "empirical" or v.weights == "sequential"  # "own": x̃ = x, only its own rounding
    for i, m in enumerate(lab.layers):
        x = lab.inputs[i]  # the float network's input on the calibration images
        if sequential:  # the input the network quantized so far gives it
            lab.reset()
            for j in range(i):
                lab.layers[j].weight.copy_(ws[j]); lab.layers[j].bias.copy_(bs[j])
            store = {}

            def grab(mod, args, i=i):
                store["x"] = args[0].clone()
                raise Stop
            hooks = [lab.layers[j].register_forward_pre_hook(lambda mod, a, f=acts[j]: (f(a[0]),)) for j in range(i)]
            hooks.append(m.register_forward_pre_hook(grab))
            try:
                lab.model(lab.calib)
            except Stop:
                pass
            for h in hooks:
                h.remove()
            xt = store["x"]
        else:
            xt = x
        target = layer_out(m, x, lab.float_w[i])  # the float layer's output (no bias: mse_ranges' outputs have none)
        # ranges: kiln's calibration measures them on the float network
        amax = mse_ranges(lab, i, xt, target) if v.ranges == "mse" else percentile_ranges(lab, i, x)
        acts[i] = quantizer(amax, lab.nonneg[i])
        xq = acts[i](xt)
        w = lab.float_w[i]
        if v.weights == "nearest":
            s = weight_scale(w, qmax[i]).view([-1] + [1] * (w.dim() - 1))
            wq = torch.round(w / s).clamp(-qmax[i], qmax[i]) * s
        elif v.weights == "gptq":
            wq = gptq_weight(lab, i, w, hessian(m, x).numpy(), qmax[i])
        else:  # sequential / own: towards W*, on x̃'s moments (the classifier: 38 rows for 1280 columns, W itself)
            if isinstance(m, nn.Linear):
                wq = gptq_weight(lab, i, w, hessian(m, xq).numpy(), qmax[i])
            else:
                star, h = shifted_target(m, w, x, xq, v.damp)
                wq = gptq_weight(lab, i, star, h, qmax[i])
        ws[i] = wq
        b = lab.float_b[i].clone()
        if v.bias == "analytic":
            if isinstance(m, nn.Linear):
                b -= (wq - w) @ x.mean(0)
            else:
                mean = x.mean((0, 2, 3))
                d = (wq - w).sum((2, 3))
                g = m.groups
                b -= (d.reshape(g, -1, d.shape[1]) * mean.reshape(g, 1, -1)).sum(-1).reshape(-1)
        elif v.bias in ("empirical", "own"):
            err = layer_out(m, xq, wq) - layer_out(m, x, w)
            b -= err.mean(0) if isinstance(m, nn.Linear) else err.mean((0, 2, 3))
        bs[i] = b
    return acts, ws, bs


def judge(lab: Lab, acts, ws, bs) -> tuple[int, int, float]:
    lab.reset()
    for m, w, b in zip(lab.layers, ws, bs):
        m.weight.copy_(w); m.bias.copy_(b)
    out = lab.run(acts)
    agree = out.argmax(1) == lab.reference
    relerr = float(((out - lab.logits).norm(dim=1) / lab.logits.norm(dim=1)).mean())
    return int(agree[:74].sum()), int(agree.sum()), relerr


VARIANTS = {
    "kiln today": Variant(),
    "nearest weights": Variant(weights="nearest"),
    "output-MSE ranges": Variant(ranges="mse"),
    "empirical bias": Variant(bias="empirical"),
    "output-MSE + empirical bias": Variant(ranges="mse", bias="empirical"),
    "sequential GPTQ": Variant(weights="sequential", bias="empirical"),
    "sequential GPTQ + output-MSE": Variant(ranges="mse", weights="sequential", bias="empirical"),
    "sequential GPTQ damp 0.1": Variant(weights="sequential", bias="empirical", damp=0.1),
    "sequential GPTQ (analytic bias)": Variant(weights="sequential"),
    "own-input bias": Variant(bias="own"),
    "own-input GPTQ + bias": Variant(weights="own", bias="own"),
}


def probes(lab: Lab, qmax: list[float]) -> None:
    """kiln today's weights with other activation ranges: every signed (int8) input's or every ReLU6 (uint8) input's
    amax scaled (x 0.8, 1.25, 1.5; a ReLU6's capped at 6), and the signed 1x1 inputs (the residual stream the
    expansions read) per input channel, an upper bound of a kernel with per-input-channel scales."""
    acts, ws, bs = build(lab, Variant(), qmax)
    print("| probe | held 74 | all 202 | relerr |\n|---|---|---|---|")
    print("| kiln today | %d | %d | %.4f |" % judge(lab, acts, ws, bs), flush=True)
    amaxes = [percentile_ranges(lab, i, x) for i, x in enumerate(lab.inputs)]
    for unsigned, factors in ((False, (0.8, 1.25, 1.5)), (True, (0.8,))):
        for f in factors:
            scaled = []
            for i, a in enumerate(amaxes):
                if lab.nonneg[i] == unsigned:  # the stem's input (the image) counts as signed
                    a = a * f if not unsigned or i == 0 else (a * f).clamp(max=6.0)
                scaled.append(quantizer(a, lab.nonneg[i]))
            print(f"| {'ReLU6' if unsigned else 'signed'} inputs' amax x {f} | %d | %d | %.4f |"
                  % judge(lab, scaled, ws, bs), flush=True)
    signed = [i for i, m in enumerate(lab.layers) if i > 0 and not lab.nonneg[i] and isinstance(m, nn.Conv2d)]
    for label, pick in (("all signed 1x1", signed), ("the 160-ch stream's readers",
                                                    [i for i in signed if lab.layers[i].in_channels == 160])):
        per_channel = list(acts)
        for i in pick:
            xs = lab.inputs[i].transpose(0, 1).reshape(lab.inputs[i].shape[1], -1)
            a = torch.tensor([percentile_amax(c) for c in xs])
            per_channel[i] = quantizer(torch.where(a > 0, a, a.max()).view(1, -1, 1, 1), False)
        print(f"| per-channel inputs: {label} {pick} | %d | %d | %.4f |" % judge(lab, per_channel, ws, bs), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vnni", action="store_true", help="8-bit weights everywhere (a VNNI CPU's)")
    parser.add_argument("--only", default=None, help="variants to run, comma-separated")
    parser.add_argument("--probes", action="store_true", help="the range probes instead of the variants")
    args = parser.parse_args()
    start = time.time()
    lab = Lab()
    held_out_202(lab)
    qmax = qmax_of(lab, args.vnni)
    print(f"setup {time.time() - start:.0f} s, {len(lab.layers)} layers, {len(lab.held)} held out", flush=True)
    if args.probes:
        probes(lab, qmax)
        return
    print("| variant | held 74 | all 202 | relerr | s |\n|---|---|---|---|---|", flush=True)
    for name, v in VARIANTS.items():
        if args.only and name not in args.only.split(","):
            continue
        t = time.time()
        acts, ws, bs = build(lab, v, qmax)
        held, every, relerr = judge(lab, acts, ws, bs)
        print(f"| {name} | {held} | {every} | {relerr:.4f} | {time.time() - t:.0f} |", flush=True)


if __name__ == "__main__":
    main()
