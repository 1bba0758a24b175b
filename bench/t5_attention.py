"""T5-small's attention layer on one thread: kiln's native kernel (kiln/kernels/cpu/attention.c) against torch's
SDPA, the peer the autotuner times it against (issue 11).

    python bench/t5_attention.py [--rounds 7] [--calls 200]

The layer as kiln's optimizer hands it over: q, k, v [1, 128, 8·64] split into heads, no 1/sqrt(D) scaling, the
additive mask the relative position bias [1, 8, 128, 128] plus the key padding (summed once by the graph). The
kernel's output is compared with SDPA's first. Timing: the calling thread's CPU time of `calls` calls, the two
interleaved round by round, medians printed (the machine is shared).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kiln.kernels.cpu import transformer as kernels  # noqa: E402
from kiln.builder.timing_cache import cpu_name  # noqa: E402
from kiln.kernels.cpu.cpu_features import describe  # noqa: E402
from kiln.tactics.cpu.attention import attention_plan  # noqa: E402

B, H, S, D = 1, 8, 128, 64
PERM = [0, 2, 1, 3]
ATTRS = {"scale": 1.0, "q_perm": PERM, "k_perm": PERM, "v_perm": PERM, "out_perm": PERM, "q_num_heads": H,
         "kv_num_heads": H, "out_merge_heads": 1}


def thread_ms(fn, calls: int) -> float:
    fn()
    start = time.thread_time()
    for _ in range(calls):
        fn()
    return (time.thread_time() - start) / calls * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    q, k, v = (torch.randn(B, S, H * D) for _ in range(3))
    mask = torch.randn(1, H, S, S) * 3
    mask[..., S - 9:] = torch.finfo(torch.float32).min  # 9 padded keys
    sizes = {0: q.shape, 1: k.shape, 2: v.shape, 3: mask.shape}
    kernel = kernels.Attention(**attention_plan(ATTRS, sizes, torch.float32))
    heads = [x.view(B, S, H, D).transpose(1, 2) for x in (q, k, v)]

    def native():
        return kernel({0: q, 1: k, 2: v, 3: mask})

    def sdpa():
        return F.scaled_dot_product_attention(*heads, attn_mask=mask, scale=1.0).transpose(1, 2).reshape(B, S, H * D)

    error = (native() - sdpa()).abs().max().item()
    if error > 1e-4:
        print(f"FAIL: the kernel is {error:.2e} from SDPA")
        return 1
    times: dict[str, list[float]] = {"kiln native": [], "torch SDPA": []}
    for _ in range(args.rounds):
        for name, fn in (("kiln native", native), ("torch SDPA", sdpa)):
            times[name].append(thread_ms(fn, args.calls))
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    print(f"T5-small attention [1, 8 heads, 128, 64] + bias mask, 1 thread, {cpu_name()} ({describe()}), load {load}; "
          f"max |native - SDPA| {error:.1e}")
    print("| peer | ms (median thread CPU) | rounds |")
    print("|---|---|---|")
    for name, ms in times.items():
        print(f"| {name} | {statistics.median(ms):.3f} | {', '.join(f'{x:.3f}' for x in ms)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
