"""kiln's CPU attention kernel on a padded batch: what the padded keys cost (issue 10's BERT-base stream: every row
at least half real, padded at the end, BERT's additive mask of the dtype's minimum broadcast over the queries).

    python bench/cpu_attention_padding.py                       # B x 512, 12 heads of 64, 1 thread
    python bench/cpu_attention_padding.py --shapes 8x512,32x256 --threads 2

One BERT-base attention layer (q, k, v side by side in the QKV GEMM's [B, S, 3·768] output, the output merged
[B, S, 768]), timed with four masks, calls interleaved (median thread CPU ms of --calls): every key real (the
layer's full work), the stream's padding (each row real for a random length in [S/2, S]) as BERT's extended mask
[B, 1, 1, S] and as the exported BERT's materialized [B, 1, S, S] (what kiln's engine of the zoo's export is fed:
the kernel leaves out keys hidden from every query only for the first), and, for scale, every row
at the batch's mean real length unpadded (about the least the padded layer could cost); torch's SDPA on the padded
mask beside them. kiln's padded output is checked against SDPA in float64 over the real rows first.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from dynamic import _cpu_name, commit  # noqa: E402

from kiln.ops.registry import OpContext  # noqa: E402
from kiln.plan.spec import StepSpec  # noqa: E402
from kiln.tactics import registry  # noqa: E402
from kiln.tactics.tactic import InputMeta  # noqa: E402

H, D = 12, 64
ATTRS = {"scale": D ** -0.5, "nan_to_zero": 1, "q_perm": [0, 2, 1, 3], "k_perm": [0, 2, 1, 3], "v_perm": [0, 2, 1, 3],
         "out_perm": [0, 2, 1, 3], "q_num_heads": H, "kv_num_heads": H, "out_merge_heads": 1,
         "qkv_split": [H * D] * 3}


def kiln_attention(qkv: torch.Tensor, mask: torch.Tensor):
    """The cpu.attention.native tactic's launch over one layer's inputs, and its call."""
    inputs = [qkv, None, None, mask]
    step = StepSpec("Attention", "layer", ["i0", "", "", "i3"], ["y"], dict(ATTRS), domain="kiln")
    metas = [InputMeta.of(v, False) for v in inputs]
    tactic = registry.get("cpu.attention.native")
    ok = tactic.check(step, metas)
    assert ok is True, ok
    step = StepSpec("Attention", "layer", step.inputs, step.outputs, dict(ATTRS), domain="kiln",
                    tactic=tactic.name, tactic_config=tactic.configure(step, metas))
    launch = tactic.prepare(step, [None] * 4, torch.device("cpu"))
    ctx = OpContext(name="layer", op_type="Attention", domain="kiln", opset=17, num_inputs=4, num_outputs=1)
    return lambda: launch(ctx, *inputs, **ATTRS)


def sdpa(qkv: torch.Tensor, mask: torch.Tensor):
    b, s, _ = qkv.shape
    q, k, v = qkv.view(b, s, 3, H, D).permute(2, 0, 3, 1, 4)
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, s, H * D)


def additive(keep: np.ndarray, per_query: bool = False) -> torch.Tensor:
    """[B, 1, 1, S]: 0 for a real key, float32's minimum for a pad (BERT's extended mask); `per_query`: [B, 1, S, S],
    -inf for a pad (as an exported SDPA mask is materialized: Where(padding & index grid, 0, -inf))."""
    if per_query:
        rows = np.broadcast_to(keep[:, None, None, :], (*keep.shape[:1], 1, keep.shape[1], keep.shape[1]))
        return torch.from_numpy(np.where(rows, 0.0, -np.inf).astype(np.float32))
    return torch.from_numpy(np.where(keep, 0.0, np.finfo(np.float32).min).astype(np.float32)[:, None, None, :])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1x512,8x512,16x384,32x128")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--calls", type=int, default=9)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(args.seed)
    rows = []
    for shape in args.shapes.split(","):
        b, s = map(int, shape.split("x"))
        qkv = torch.from_numpy(rng.standard_normal((b, s, 3 * H * D)).astype(np.float32))
        lengths = rng.integers(max(1, s // 2), s + 1, b)
        keep = np.arange(s)[None, :] < lengths[:, None]
        mean = int(round(lengths.mean()))
        cut = qkv[:, :mean].contiguous()
        runs = {"kiln, every key real": kiln_attention(qkv, additive(np.ones((b, s), bool))),
                "kiln, padded": kiln_attention(qkv, additive(keep)),
                "kiln, padded [B,1,S,S]": kiln_attention(qkv, additive(keep, per_query=True)),
                f"kiln, the mean real length ({mean}) unpadded": kiln_attention(cut, additive(np.ones((b, mean), bool))),
                "SDPA, padded": sdpa(qkv, additive(keep))}
        got = runs["kiln, padded"]().numpy()
        q, k, v = qkv.double().view(b, s, 3, H, D).permute(2, 0, 3, 1, 4)
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=additive(keep).double()).transpose(1, 2)
        err = float(np.abs(got - want.reshape(b, s, H * D).numpy())[keep].max())
        if err > 1e-4:
            raise SystemExit(f"{shape}: kiln's padded attention differs from SDPA (float64) by {err:.3g}")
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.calls):
            for name, run in runs.items():
                t0 = time.thread_time_ns()
                run()
                times[name].append((time.thread_time_ns() - t0) / 1e6)
        med = {name: statistics.median(v) for name, v in times.items()}
        rows.append((shape, float(1 - keep.mean()), med, err))
    print(f"\n# kiln's CPU attention on padded batches: {_cpu_name()}, commit {commit()}, {args.threads} thread(s), "
          f"load {os.getloadavg()[0]:.1f}; median thread CPU ms of {args.calls}")
    names = list(rows[0][2])
    print("| B x S | padded keys | " + " | ".join(n.split(" (")[0] for n in names) + " | padded / all real | max err |")
    print("|---|---|" + "---|" * len(names) + "---|---|")
    for shape, pads, med, err in rows:
        values = list(med.values())
        print(f"| {shape} | {pads:.0%} | " + " | ".join(f"{x:.2f}" for x in values)
              + f" | {values[1] / values[0]:.2f} | {err:.1e} |")


if __name__ == "__main__":
    main()
