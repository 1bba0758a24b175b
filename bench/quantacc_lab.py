"""Where MobileNetV2's int8/fp8 error is, and what cross-layer equalization does to it, in bench/quant_lab.py's
torch fake-quant of kiln's scheme (issue 12; bench/results/quantacc-2026-12-05d.md).

    python bench/quantacc_lab.py groups                  # each layer group's activations / weights alone, int8
    python bench/quantacc_lab.py equalize weights int8,fp8    # the paper's factors √(r1/r2) on both pairs
    python bench/quantacc_lab.py equalize acts int8           # depthwise outputs grown to 6 (alpha 1)
    python bench/quantacc_lab.py equalize acts05 int8         # s = (a/A)^0.5 on both pairs (kiln's --equalize)
    python bench/quantacc_lab.py equalize none int8,fp8       # no equalization: the baseline
    python bench/quantacc_lab.py mse int8,fp8            # per-tensor ranges from kiln's mse calibrator

Each count is held-out images (of 74) whose top-1 equals fp32's; relerr the mean relative L2 logit error.
Equalization here rescales the folded torch network with an exact per-channel clamp (ReLU6's bound becomes
6/s_i), so the float network is unchanged; kiln's version (kiln/quant/equalize.py) keeps ReLU6 and grows only.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from quant_lab import Lab, act_quantizers, fq_fp8, fq_int, is_depthwise, set_weights  # noqa: E402

from kiln.quant import calibrators  # noqa: E402

torch.set_grad_enabled(False)


class PerChannelClip(nn.Module):
    """ReLU6 of a rescaled channel: min(max(x, 0), bound_c)."""

    def __init__(self, bound: torch.Tensor):
        super().__init__()
        self.bound = bound.view(1, -1, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.minimum(torch.relu(x), self.bound)


def score(lab: Lab, fns: list, tag: str) -> None:
    out = lab.run(fns)
    ref = lab.model_fp32_out
    count = int((out.argmax(1) == lab.reference).sum())
    relerr = float(((out - ref).norm(dim=1) / ref.norm(dim=1)).mean())
    print(f"{tag}: {count}/{len(ref)} held out, relerr {relerr:.4f}", flush=True)


def groups(lab: Lab) -> dict[str, list[int]]:
    layers = lab.layers
    dense = [i for i, m in enumerate(layers) if 0 < i < len(layers) - 1 and not is_depthwise(m)]
    return {"stem": [0], "classifier": [len(layers) - 1],
            "depthwise": [i for i, m in enumerate(layers) if is_depthwise(m)],
            "projection": [i for i in dense if lab.nonneg[i]], "expansion": [i for i in dense if not lab.nonneg[i]]}


def by_group(lab: Lab) -> None:
    acts = act_quantizers(lab, "int8", "percentile")
    none = [None] * len(lab.layers)
    lab.reset()
    score(lab, acts, "activations only, all")
    for name, idx in groups(lab).items():
        score(lab, [f if i in idx else None for i, f in enumerate(acts)], f"activations only, {name}")
    for name, idx in [("all", list(range(len(lab.layers))))] + list(groups(lab).items()):
        lab.reset()
        set_weights(lab, "int8", skip=set(range(len(lab.layers))) - set(idx))
        score(lab, none, f"weights only, {name}")
    set_weights(lab, "int8")
    score(lab, acts, "all")


def pairs(model: nn.Module) -> list[tuple[nn.Sequential, nn.Conv2d]]:
    """(Sequential(Conv_1, ReLU6), Conv_2) of every inverted residual block, BN folded."""
    found = []
    for block in model.features:
        if hasattr(block, "conv"):
            mods = list(block.conv)
            seqs = [m for m in mods if isinstance(m, nn.Sequential)]
            found += list(zip(seqs, [s[0] for s in seqs[1:]] + [mods[-1]]))
    return found


def equalize(lab: Lab, mode: str) -> None:
    """Rescale every pair (see the module docstring) and recapture the lab's float weights and inputs."""
    found = pairs(lab.model)
    maxima = {}
    hooks = [s[0].register_forward_hook(lambda m, a, o, k=k: maxima.__setitem__(k, o.amax((0, 2, 3))))
             for k, (s, _) in enumerate(found)]
    lab.model(lab.calib)
    for h in hooks:
        h.remove()
    for k, (seq, second) in enumerate(found):
        first = seq[0]
        if mode == "acts" and is_depthwise(first) is False:
            continue
        a = maxima[k].clamp(min=0, max=6)  # the ReLU6 output's channel maxima
        r1 = first.weight.abs().reshape(first.weight.shape[0], -1).amax(1)
        if mode == "weights":
            r2 = second.weight.abs().transpose(0, 1).reshape(second.weight.shape[1], -1).amax(1) \
                if not is_depthwise(second) else second.weight.abs().reshape(second.weight.shape[0], -1).amax(1)
            s = torch.sqrt(r1 / r2.clamp(min=1e-8))
        elif mode == "acts":
            s = torch.where(a < 6, (a / 6).clamp(min=1e-3), torch.ones_like(a))
        else:  # acts05: kiln's factors (kiln/quant/equalize.py)
            s = torch.where(a > 0, (a / a.max()) ** 0.5, torch.ones_like(a))
        s = torch.where(r1 > 0, s, torch.ones_like(s))
        first.weight.div_(s.view(-1, 1, 1, 1))
        first.bias.div_(s)
        second.weight.mul_(s.view(-1, 1, 1, 1) if is_depthwise(second) else s.view(1, -1, 1, 1))
        seq[1] = PerChannelClip(6.0 / s)
    lab.float_w = [m.weight.clone() for m in lab.layers]
    lab.float_b = [m.bias.clone() for m in lab.layers]
    lab.inputs = lab.capture(lab.calib)
    lab.nonneg = [bool(x.min() >= 0) for x in lab.inputs]


def equalized(lab: Lab, mode: str, dtypes: list[str]) -> None:
    if mode != "none":  # none: the baseline, measured the same way
        equalize(lab, mode)
    change = float((lab.model(lab.held) - lab.model_fp32_out).abs().max())
    print(f"equalize {mode}: the float network's largest logit change {change:.2e}", flush=True)
    none = [None] * len(lab.layers)
    for dtype in dtypes:
        acts = act_quantizers(lab, dtype, "percentile" if dtype == "int8" else "minmax")
        lab.reset()
        score(lab, acts, f"{mode} {dtype} activations only")
        set_weights(lab, dtype)
        score(lab, none, f"{mode} {dtype} weights only")
        score(lab, acts, f"{mode} {dtype} all")


def mse_quantizers(lab: Lab, dtype: str) -> list:
    """act_quantizers' per-tensor ranges replaced by kiln's mse calibrator's (the amax minimising the tensor's
    own squared quantization error over its histogram; uint8's 255 steps for a ReLU6 output, E4M3's grid for
    fp8); the depthwise inputs keep their per-channel percentile (int8) / max (fp8) ranges."""
    fns = act_quantizers(lab, dtype, "percentile" if dtype == "int8" else "minmax")
    for i, (m, x) in enumerate(zip(lab.layers, lab.inputs)):
        if is_depthwise(m):
            continue
        one_sided = lab.nonneg[i] and dtype == "int8"
        observer = calibrators.make("mse", one_sided, dtype == "fp8")
        observer.observe(x)
        amax = observer.amax()
        if lab.nonneg[i] and i > 0:
            amax = min(amax, 6.0)
        if dtype == "fp8":
            fns[i] = lambda t, s=amax / 448: fq_fp8(t, s)
        elif one_sided:
            fns[i] = lambda t, s=amax / 255: fq_int(t, s, 0, 255)
        else:
            fns[i] = lambda t, s=amax / 127: fq_int(t, s, -128, 127)
    return fns


def mse_ranges(lab: Lab, dtypes: list[str]) -> None:
    for dtype in dtypes:
        acts = mse_quantizers(lab, dtype)
        lab.reset()
        score(lab, acts, f"mse {dtype} activations only")
        set_weights(lab, dtype)
        score(lab, acts, f"mse {dtype} all")


if __name__ == "__main__":
    lab = Lab()
    lab.model_fp32_out = lab.model(lab.held)
    if sys.argv[1] == "groups":
        by_group(lab)
    elif sys.argv[1] == "mse":
        mse_ranges(lab, sys.argv[2].split(","))
    else:
        equalized(lab, sys.argv[2], sys.argv[3].split(",") if len(sys.argv) > 3 else ["int8", "fp8"])
