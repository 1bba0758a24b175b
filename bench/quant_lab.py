"""A fast torch-only fake-quantization lab for MobileNetV2 on kiln's photo set (issue 12): the same
scheme as kiln's quantize (BN folded, per-channel symmetric weights, per-tensor activations at every
Conv/Linear input, uint8 for ReLU6 outputs, per-channel depthwise inputs, bias correction), written
independently in torch so that remedies can be measured in seconds instead of kiln's reference
interpreter's minutes. Numbers here guide; bench/quant_accuracy.py measures what kiln builds.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kiln.quant.data import photo_variants  # noqa: E402
from kiln.zoo.mobilenet import pretrained  # noqa: E402

torch.set_grad_enabled(False)


def fold(model: nn.Module) -> tuple[nn.Module, list[nn.Module]]:
    """BatchNorm folded into the convolution before it; the Conv/Linear layers in execution order."""
    def fold_seq(seq: nn.Sequential):
        mods = list(seq)
        out, i = [], 0
        while i < len(mods):
            m = mods[i]
            if isinstance(m, nn.Conv2d) and i + 1 < len(mods) and isinstance(mods[i + 1], nn.BatchNorm2d):
                bn = mods[i + 1]
                s = bn.weight / torch.sqrt(bn.running_var + bn.eps)
                conv = nn.Conv2d(m.in_channels, m.out_channels, m.kernel_size, m.stride, m.padding,
                                 groups=m.groups, bias=True)
                conv.weight.copy_(m.weight * s.view(-1, 1, 1, 1))
                conv.bias.copy_(bn.bias - bn.running_mean * s)
                out.append(conv)
                i += 2
            else:
                out.append(fold_seq(m) if isinstance(m, nn.Sequential) else fold(m))
                i += 1
        return nn.Sequential(*out)

    for name, child in list(model.named_children()):
        if isinstance(child, nn.Sequential):
            setattr(model, name, fold_seq(child))
        else:
            fold(child)
    return model


def layers_of(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]


# ---- quantizers -------------------------------------------------------------------------------------------

def fq_int(x, scale, lo, hi, zero=0.0):
    return (torch.round(x / scale + zero).clamp(lo, hi) - zero) * scale


def fq_fp8(x, scale):
    return (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale


def weight_scale(w: torch.Tensor, qmax: float) -> torch.Tensor:
    amax = w.abs().reshape(w.shape[0], -1).amax(1)
    return torch.where(amax > 0, amax / qmax, torch.ones_like(amax))


def quantize_weight(w: torch.Tensor, dtype: str, scale: torch.Tensor | None = None) -> torch.Tensor:
    shape = [-1] + [1] * (w.dim() - 1)
    if dtype == "int8":
        s = weight_scale(w, 127) if scale is None else scale
        return fq_int(w, s.view(shape), -127, 127)
    s = weight_scale(w, 448) if scale is None else scale
    return fq_fp8(w, s.view(shape))


def percentile_amax(x: torch.Tensor, p: float = 99.99) -> float:
    v = x.abs().reshape(-1)
    v = v[v > 0]
    if not v.numel():
        return 0.0
    k = max(1, int(np.ceil(p / 100 * v.numel())))
    return float(v.kthvalue(k).values) if v.numel() < 2**31 else float(v.max())


def main_images():
    images = photo_variants()
    calib = torch.from_numpy(np.concatenate(images[::3]))
    held = torch.from_numpy(np.concatenate([v for i, v in enumerate(images) if i % 3]))
    return calib, held


class Lab:
    def __init__(self):
        self.model = fold(pretrained())
        self.layers = layers_of(self.model)
        self.float_w = [m.weight.clone() for m in self.layers]
        self.float_b = [m.bias.clone() for m in self.layers]
        self.calib, self.held = main_images()
        self.reference = self.model(self.held).argmax(1)
        self.inputs = self.capture(self.calib)  # float inputs of every layer on the calibration set
        # which inputs are ReLU6 outputs (non-negative, <= 6): the first layer reads the image, the
        # classifier a pool of ReLU6, projections ReLU6, expansions read the block input (signed)
        self.nonneg = [bool(x.min() >= 0) for x in self.inputs]

    def capture(self, x):
        store = [None] * len(self.layers)
        hooks = [m.register_forward_pre_hook(lambda m, a, i=i: store.__setitem__(i, a[0].clone()))
                 for i, m in enumerate(self.layers)]
        self.model(x)
        for h in hooks:
            h.remove()
        return store

    def reset(self):
        for m, w, b in zip(self.layers, self.float_w, self.float_b):
            m.weight.copy_(w)
            m.bias.copy_(b)

    def run(self, act_fns: list, x=None) -> torch.Tensor:
        hooks = [m.register_forward_pre_hook(lambda m, a, f=f: (f(a[0]),)) for m, f in zip(self.layers, act_fns)
                 if f is not None]
        out = self.model(self.held if x is None else x)
        for h in hooks:
            h.remove()
        return out

    def agreement(self, act_fns) -> int:
        return int((self.run(act_fns).argmax(1) == self.reference).sum())


def is_depthwise(m):
    return isinstance(m, nn.Conv2d) and m.groups > 1 and m.groups == m.in_channels


def act_quantizers(lab: Lab, dtype: str, calibrator: str = "percentile", per_channel_dw: bool = True,
                   skip: set[int] = frozenset(), stem_bits: int = 8) -> list:
    fns = []
    for i, (m, x) in enumerate(zip(lab.layers, lab.inputs)):
        if i in skip:
            fns.append(None)
            continue
        nonneg = lab.nonneg[i]
        if per_channel_dw and is_depthwise(m):
            xs = x.transpose(0, 1).reshape(x.shape[1], -1)
            amax = torch.tensor([percentile_amax(c) if calibrator == "percentile" else float(c.abs().max())
                                 for c in xs])
            amax = torch.where(amax > 0, amax, amax.max()).view(1, -1, 1, 1)
        else:
            amax = torch.tensor(percentile_amax(x) if calibrator == "percentile" else float(x.abs().max()))
        if nonneg:
            amax = amax.clamp(max=6.0) if i > 0 else amax
        if dtype == "fp8":
            s = amax / 448
            fns.append(lambda t, s=s: fq_fp8(t, s))
        elif nonneg:
            s = amax / 255
            fns.append(lambda t, s=s: fq_int(t, s, 0, 255))
        else:
            qmax = 2 ** (stem_bits - 1) - 1 if i == 0 else 127
            s = amax / qmax
            fns.append(lambda t, s=s, q=qmax: fq_int(t, s, -q - 1, q))
    return fns


def set_weights(lab: Lab, dtype: str, bias_correction: bool = True, skip: set[int] = frozenset(),
                weights: list | None = None):
    """Quantized weights (weights[i] when given, else round to nearest), bias-corrected."""
    for i, m in enumerate(lab.layers):
        w = lab.float_w[i]
        if i in skip:
            m.weight.copy_(w)
            m.bias.copy_(lab.float_b[i])
            continue
        wq = weights[i] if weights is not None else quantize_weight(w, dtype)
        m.weight.copy_(wq)
        b = lab.float_b[i].clone()
        if bias_correction:
            x = lab.inputs[i]
            if isinstance(m, nn.Linear):
                b -= (wq - w) @ x.mean(0)
            else:
                mean = x.mean((0, 2, 3))  # [C]
                d = (wq - w).sum((2, 3))  # [O, C/g]
                g = m.groups
                d = d.reshape(g, -1, d.shape[1])
                b -= (d * mean.reshape(g, 1, -1)).sum(-1).reshape(-1)
        m.bias.copy_(b)


def hessian(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """2/N Σ x xᵀ over the layer's input patches: [1, K, K] (dense), [C, k·k, k·k] (depthwise)."""
    if isinstance(m, nn.Linear):
        rows = x.double()
        return (rows.T @ rows / rows.shape[0])[None]
    cols = nn.functional.unfold(x, m.kernel_size, padding=m.padding, stride=m.stride)  # [N, C·k·k, L]
    n, ck, l = cols.shape
    if is_depthwise(m):
        k = ck // m.in_channels
        c = cols.reshape(n, m.in_channels, k, l).permute(1, 0, 3, 2).reshape(m.in_channels, n * l, k).double()
        return c.transpose(1, 2) @ c / (n * l)
    rows = cols.transpose(1, 2).reshape(n * l, ck).double()
    return (rows.T @ rows / rows.shape[0])[None]


def gptq(w: torch.Tensor, h: torch.Tensor, dtype: str, damp: float = 0.01) -> torch.Tensor:
    """GPTQ (Frantar et al. 2022): columns quantized in order, each one's rounding error spread over the
    columns not yet quantized through the inverse Hessian's Cholesky factor. w: [R, K]; h: [1 or R, K, K]."""
    w = w.double().clone()
    r, k = w.shape
    qmax = 127 if dtype == "int8" else 448
    scale = weight_scale(w.float(), qmax).double()  # [R]
    h = h.clone()
    dead = torch.diagonal(h, dim1=1, dim2=2) == 0
    idx = torch.arange(k)
    h[:, idx, idx] += damp * torch.diagonal(h, dim1=1, dim2=2).mean(1, keepdim=True) + dead.double()
    if h.shape[0] == 1:
        w[:, dead[0]] = 0
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)  # [B, K, K]
    q = torch.zeros_like(w)
    for j in range(k):
        col = w[:, j]
        if dtype == "int8":
            qc = torch.round(col / scale).clamp(-127, 127) * scale
        else:
            qc = (col / scale).clamp(-448, 448).float().to(torch.float8_e4m3fn).double() * scale
        q[:, j] = qc
        d = u[:, j, j]  # [B]
        err = (col - qc) / d  # [R]
        w[:, j + 1:] -= err[:, None] * u[:, j, j + 1:]
    return q


def gptq_weights(lab: Lab, dtype: str, damp: float = 0.01, inputs: list | None = None) -> list:
    out = []
    for i, m in enumerate(lab.layers):
        x = (inputs or lab.inputs)[i]
        h = hessian(m, x)
        w = lab.float_w[i]
        q = gptq(w.reshape(w.shape[0], -1), h, dtype, damp)
        out.append(q.float().reshape(w.shape))
    return out


if __name__ == "__main__":
    t0 = time.time()
    lab = Lab()
    print(f"setup {time.time() - t0:.1f} s, {len(lab.layers)} layers", flush=True)
    none = [None] * len(lab.layers)
    for dtype in ("int8", "fp8"):
        t0 = time.time()
        acts = act_quantizers(lab, dtype, "percentile" if dtype == "int8" else "minmax")
        print(f"{dtype} ranges {time.time() - t0:.1f} s", flush=True)
        for bc in (False, True):
            lab.reset(); set_weights(lab, dtype, bias_correction=bc)
            rtn_w, rtn = lab.agreement(none), lab.agreement(acts)
            t0 = time.time()
            qs = gptq_weights(lab, dtype)
            t1 = time.time() - t0
            lab.reset(); set_weights(lab, dtype, bias_correction=bc, weights=qs)
            g_w, g = lab.agreement(none), lab.agreement(acts)
            print(f"{dtype} bias_correction={bc}: nearest weights-only {rtn_w} all {rtn}; gptq ({t1:.0f} s) "
                  f"weights-only {g_w} all {g}", flush=True)
