"""MobileNetV2 INT8 on a CPU without VNNI (issue 12): which layers' 7-bit weights cost the top-1 agreement, and what
the weight formats that the AVX2 kernels run exactly give, in bench/quant_lab.py's torch fake-quant of kiln's scheme
(percentile activations, per-channel depthwise inputs, bias correction; weights round to nearest or GPTQ).

    python bench/int8_avx2_lab.py formats      # every layer one weight format, 202 held-out images
    python bench/int8_avx2_lab.py layers       # 7-bit everywhere but one layer (8-bit): what each layer costs

Weight formats (per output channel, symmetric): "8-bit" max|w| -> 127 (a VNNI CPU's); "7-bit" max|w| -> 64 (kiln's
rule without VNNI: any two products of a channel with a uint8 input fit int16, vpmaddubsw); "7-bit, dw 8-bit": the
depthwise convolutions 8-bit (oneDNN's AVX2 depthwise int8 kernel widens each product to int32: no byte pairs).
Agreement: top-1 equal to fp32's on 202 held-out images (74 + photo_variants(8, seed=1)'s 128, none calibrates);
relerr: mean |logits - fp32| / |fp32| (L2).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from quant_lab import Lab, act_quantizers, hessian, is_depthwise, set_weights, weight_scale  # noqa: E402

from kiln.quant import gptq  # noqa: E402
from kiln.quant.data import photo_variants  # noqa: E402

torch.set_grad_enabled(False)
SEVEN_BIT, EIGHT_BIT = 64.0, 127.0


def held_out_202(lab: Lab) -> None:
    """The lab's 74 held-out images and 128 other crops (seed 1), fp32's top-1 and logits on them."""
    lab.held = torch.cat([lab.held, torch.from_numpy(np.concatenate(photo_variants(8, seed=1)))])
    lab.logits = lab.model(lab.held)
    lab.reference = lab.logits.argmax(1)


def weights(lab: Lab, qmax: list[float], moments: list | None) -> list[torch.Tensor]:
    """Each layer's weight on its grid (scale max|w| / qmax[i] per output channel), rounded to nearest or by GPTQ."""
    out = []
    for i, w in enumerate(lab.float_w):
        s = weight_scale(w, qmax[i])
        shape = [-1] + [1] * (w.dim() - 1)
        if moments is None:
            q = torch.round(w / s.view(shape)).clamp(-qmax[i], qmax[i])
        else:
            q = torch.from_numpy(gptq.round_weights(w.reshape(w.shape[0], -1).double().numpy(), moments[i],
                                                    s.double().numpy(), qmax[i])).float().reshape(w.shape)
        out.append(q * s.view(shape))
    return out


def judged(lab: Lab, acts: list, qmax: list[float], moments: list | None) -> tuple[int, float]:
    lab.reset()
    set_weights(lab, "int8", weights=weights(lab, qmax, moments))
    out = lab.run(acts)
    relerr = float(((out - lab.logits).norm(dim=1) / lab.logits.norm(dim=1)).mean())
    return int((out.argmax(1) == lab.reference).sum()), relerr


def main() -> None:
    what = sys.argv[1] if len(sys.argv) > 1 else "formats"
    start = time.time()
    lab = Lab()
    held_out_202(lab)
    acts = act_quantizers(lab, "int8", "percentile")
    moments = [hessian(m, x).numpy() for m, x in zip(lab.layers, lab.inputs)]
    n = len(lab.layers)
    dw = [is_depthwise(m) for m in lab.layers]
    print(f"setup {time.time() - start:.0f} s, {n} layers ({sum(dw)} depthwise), {len(lab.held)} held out", flush=True)
    formats = {"8-bit": [EIGHT_BIT] * n, "7-bit": [SEVEN_BIT] * n,
               "7-bit, dw 8-bit": [EIGHT_BIT if d else SEVEN_BIT for d in dw]}
    if what == "formats":
        print("| weights | nearest: agree / 202, relerr | GPTQ: agree / 202, relerr |\n|---|---|---|")
        for label, qmax in formats.items():
            cells = [judged(lab, acts, qmax, m) for m in (None, moments)]
            print(f"| {label} | " + " | ".join(f"{a}, {r:.4f}" for a, r in cells) + " |", flush=True)
    elif what == "layers":
        base = judged(lab, acts, formats["7-bit"], moments)
        print(f"7-bit everywhere (GPTQ): {base[0]}/202, relerr {base[1]:.4f}")
        rows = []
        for i, m in enumerate(lab.layers):
            qmax = list(formats["7-bit"])
            qmax[i] = EIGHT_BIT
            agree, relerr = judged(lab, acts, qmax, moments)
            kind = "depthwise" if dw[i] else type(m).__name__ + (f" {m.kernel_size[0]}x{m.kernel_size[1]}"
                                                                 if hasattr(m, "kernel_size") else "")
            rows.append((base[1] - relerr, i, kind, agree, relerr))
        print("| layer | kind | agree / 202 | relerr | relerr gained |\n|---|---|---|---|---|")
        for gain, i, kind, agree, relerr in sorted(rows, reverse=True):
            print(f"| {i} | {kind} | {agree} | {relerr:.4f} | {gain:+.4f} |")
    print(f"{time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
