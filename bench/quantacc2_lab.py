"""Per-layer error shares, residual-stream equalization and the fewest float layers for MobileNetV2's int8/fp8
(issue 12; bench/results/quantacc2-2026-12-05.md), in bench/quant_lab.py's torch fake-quant of kiln's scheme.

    python bench/quantacc2_lab.py layers int8,fp8     # each layer quantized alone (input + weight), ranked
    python bench/quantacc2_lab.py float int8,fp8      # the k most sensitive layers kept float, k = 0..
    python bench/quantacc2_lab.py stream 0.5 int8,fp8 # residual-stream channel equalization through the Adds
    python bench/quantacc2_lab.py first fp8           # b1.dw's fp8 error split; stem + b1.dw int8, the rest fp8

Sensitivity is measured on the 38 calibration images (what a build may look at) and the counts on the 74
held-out ones; relerr is the mean over images of |logits - fp32 logits| / |fp32 logits| (L2).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from quant_lab import Lab, act_quantizers, is_depthwise, quantize_weight, set_weights  # noqa: E402

torch.set_grad_enabled(False)


def relerr(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float(((out - ref).norm(dim=1) / ref.norm(dim=1)).mean())


def names(lab: Lab) -> list[str]:
    """A short name per layer: stem, b<block>.<expand|dw|project>, last (the 1280-channel conv), fc."""
    out = []
    for i, m in enumerate(lab.layers):
        out.append(f"{i:2d}")
    blocks = [b for b in lab.model.features if hasattr(b, "conv")]
    k = 1
    out[0] = " 0 stem"
    for bi, b in enumerate(blocks):
        convs = [m for m in b.modules() if isinstance(m, nn.Conv2d)]
        for c in convs:
            role = "dw" if is_depthwise(c) else ("project" if c is convs[-1] else "expand")
            out[k] = f"{k:2d} b{bi + 1}.{role}{' (res)' if b.use_res_connect and role != 'dw' else ''}"
            k += 1
    out[k] = f"{k:2d} last 1x1 (1280)"
    out[k + 1] = f"{k + 1:2d} classifier"
    return out


RANK_IMAGES = 12  # the calibration images of the lowest top-1 margins that rank the layers (CPU time)


def quantized(lab: Lab, dtype: str, on: set[int], acts: list, x: torch.Tensor | None = None) -> torch.Tensor:
    """Logits (held-out images, or x) with exactly the layers in `on` quantized."""
    off = set(range(len(lab.layers))) - on
    lab.reset()
    set_weights(lab, dtype, skip=off)
    return lab.run([f if i in on else None for i, f in enumerate(acts)], x)


def ranking(lab: Lab, dtype: str, acts: list, show: bool = True) -> list[int]:
    label = names(lab)
    top2 = lab.calib_ref.topk(2, dim=1).values
    closest = (top2[:, 0] - top2[:, 1]).argsort()[:RANK_IMAGES]
    x, ref = lab.calib[closest], lab.calib_ref[closest]
    rows = []
    for i in range(len(lab.layers)):
        rows.append((relerr(quantized(lab, dtype, {i}, acts, x), ref), i))
    rows.sort(reverse=True)
    if show:
        total = sum(r[0] ** 2 for r in rows)
        print(f"\n{dtype}: each layer quantized alone (input + weight), most sensitive first; relerr on the "
              f"{RANK_IMAGES} calibration images of the lowest margins; share: relerr² / Σ relerr²")
        print("| layer | relerr | share |\n|---|---|---|")
        for c, i in rows:
            print(f"| {label[i]} | {c:.4f} | {c * c / total:.1%} |", flush=True)
    return [r[1] for r in rows]


def fewest_float(lab: Lab, dtype: str, acts: list, order: list[int]) -> None:
    label = names(lab)
    every = set(range(len(lab.layers)))
    print(f"\n{dtype}: the k most sensitive layers (calibration ranking) kept float\n"
          "| k | held-out count | relerr held out | layers kept float |\n|---|---|---|---|")
    for k in (0, 2, 4, 6, 8, 12, 16, 21):
        held = quantized(lab, dtype, every - set(order[:k]), acts)
        print(f"| {k} | {int((held.argmax(1) == lab.reference).sum())}/74 | {relerr(held, lab.held_ref):.4f} | "
              f"{', '.join(label[i].split()[1] for i in order[:k])} |", flush=True)


def stages(model: nn.Module) -> list[tuple[list[nn.Conv2d], list[nn.Conv2d]]]:
    """Per stretch of the residual stream (a stage's blocks of one width): (convolutions writing it: every
    block's projection, the first one's included; convolutions reading it: the residual blocks' expansions and
    the next block's first convolution)."""
    feats = list(model.features)
    out = []
    i = 1
    while i < len(feats):
        b = feats[i]
        if not hasattr(b, "conv"):
            break
        writers = [[m for m in b.modules() if isinstance(m, nn.Conv2d)][-1]]
        readers = []
        j = i + 1
        while j < len(feats) and getattr(feats[j], "use_res_connect", False):
            convs = [m for m in feats[j].modules() if isinstance(m, nn.Conv2d)]
            readers.append(convs[0])
            writers.append(convs[-1])
            j += 1
        if j < len(feats):
            readers.append([m for m in feats[j].modules() if isinstance(m, nn.Conv2d)][0])
        if len(writers) > 1 or readers:
            out.append((writers, readers))
        i = j
    return out


def stream_equalize(lab: Lab, alpha: float) -> None:
    """x' = x / s per channel of every stream stretch (exact: the stream is linear): writers' output rows divided
    by s, readers' input columns multiplied by s. s = (a / A)^alpha (a: the channel's max |x| over the stretch,
    A: the largest), growing narrow channels toward the tensor's range."""
    for writers, readers in stages(lab.model):
        seen = []
        hooks = [r.register_forward_pre_hook(lambda m, a: seen.append(a[0].abs().amax((0, 2, 3)))) for r in readers]
        lab.model(lab.calib)
        for h in hooks:
            h.remove()
        a = torch.stack(seen).amax(0)
        s = torch.where(a > 0, (a / a.max()) ** alpha, torch.ones_like(a))
        for w in writers:
            w.weight.div_(s.view(-1, 1, 1, 1))
            w.bias.div_(s)
        for r in readers:
            r.weight.mul_(s.view(1, -1, 1, 1))
    lab.float_w = [m.weight.clone() for m in lab.layers]
    lab.float_b = [m.bias.clone() for m in lab.layers]
    lab.inputs = lab.capture(lab.calib)
    lab.nonneg = [bool(x.min() >= 0) for x in lab.inputs]


def every_layer(lab: Lab, dtype: str, tag: str) -> None:
    acts = act_quantizers(lab, dtype, "percentile" if dtype == "int8" else "minmax")
    none = [None] * len(lab.layers)
    lab.reset()
    a = lab.run(acts)
    set_weights(lab, dtype)
    w, both = lab.run(none), lab.run(acts)
    count = lambda o: int((o.argmax(1) == lab.reference).sum())  # noqa: E731
    print(f"| {tag} | {dtype} | {count(a)}/74, {relerr(a, lab.held_ref):.4f} | {count(w)}/74, "
          f"{relerr(w, lab.held_ref):.4f} | **{count(both)}/74**, {relerr(both, lab.held_ref):.4f} |", flush=True)


def first_layers(lab: Lab) -> None:
    """FP8's largest share (b1.dw, layer 1): its input's and weight's error apart, how much its filters cancel
    over the stem's output, and fp8 everywhere but the stem and b1.dw in int8."""
    n = len(lab.layers)
    top2 = lab.calib_ref.topk(2, dim=1).values
    closest = (top2[:, 0] - top2[:, 1]).argsort()[:RANK_IMAGES]
    x, ref = lab.calib[closest], lab.calib_ref[closest]
    for dtype in ("int8", "fp8"):
        acts = act_quantizers(lab, dtype, "percentile" if dtype == "int8" else "minmax")
        for tag, weight, act in (("input", False, True), ("weight", True, False), ("both", True, True)):
            lab.reset()
            set_weights(lab, dtype, skip=set(range(n)) - ({1} if weight else set()))
            out = lab.run([acts[1] if act and i == 1 else None for i in range(n)], x)
            print(f"{dtype} b1.dw {tag} alone: relerr {relerr(out, ref):.4f}", flush=True)
    m, a = lab.layers[1], lab.inputs[1][closest]
    y = nn.functional.conv2d(a, m.weight, None, m.stride, m.padding, groups=m.groups)
    mag = nn.functional.conv2d(a.abs(), m.weight.abs(), None, m.stride, m.padding, groups=m.groups)
    print(f"b1.dw cancellation |Σ|w||x|| / |Σwx|: {float(mag.norm() / y.norm()):.1f} (norms), per output median "
          f"{float((mag / y.abs().clamp_min(1e-6)).median()):.1f}; stem output max {float(a.max()):.2f}, "
          f"zeros {float((a == 0).float().mean()):.2f}")
    a8, af = act_quantizers(lab, "int8", "percentile"), act_quantizers(lab, "fp8", "minmax")
    lab.reset()
    set_weights(lab, "fp8", skip={0, 1})
    for i in (0, 1):  # round to nearest int8, no bias correction for these two
        lab.layers[i].weight.copy_(quantize_weight(lab.float_w[i], "int8"))
    out = lab.run([a8[i] if i in (0, 1) else af[i] for i in range(n)])
    print(f"fp8 with the stem and b1.dw int8: {int((out.argmax(1) == lab.reference).sum())}/74, "
          f"relerr {relerr(out, lab.held_ref):.4f}", flush=True)


if __name__ == "__main__":
    torch.manual_seed(0)
    lab = Lab()
    lab.held_ref, lab.calib_ref = lab.model(lab.held), lab.model(lab.calib)
    dtypes = sys.argv[-1].split(",")
    if sys.argv[1] in ("layers", "float"):
        for dtype in dtypes:
            acts = act_quantizers(lab, dtype, "percentile" if dtype == "int8" else "minmax")
            order = ranking(lab, dtype, acts)
            if sys.argv[1] == "float":
                fewest_float(lab, dtype, acts, order)
    elif sys.argv[1] == "first":
        first_layers(lab)
    elif sys.argv[1] == "stream":
        print("| stream equalization | dtype | activations only | weights only | all |\n|---|---|---|---|---|")
        for dtype in dtypes:
            every_layer(lab, dtype, "none")
        for alpha in [float(a) for a in sys.argv[2].split(",")]:
            lab = Lab()
            lab.held_ref, lab.calib_ref = lab.model(lab.held), lab.model(lab.calib)
            stream_equalize(lab, alpha)
            change = float((lab.model(lab.held) - lab.held_ref).abs().max())
            for dtype in dtypes:
                every_layer(lab, dtype, f"alpha {alpha} (float change {change:.1e})")
