"""The CPU's int8 attention kernel (kiln/kernels/cpu/attention.c, quantized q/k/v with score, probability and
output quantization) of a base tree against this tree: bit for bit over many cases, then timed alone.

    git archive <base> | tar -x -C /tmp/base
    python bench/quant_attention_ab.py --base /tmp/base --batch 1,4 --rounds 12

Session 27 (h-q8ln) merged the kernel's passes over the scores (s·scale; DQ(Q(·)); + mask and the row max -> one
pass; P = e·inv into the probabilities' DQ(Q(·))). Whole-model A/Bs of QDQ BERT-tiny (bench/quant_fuse_ab.py --base)
cannot see a change of a few percent of a third of the run on a loaded 2-vCPU VM, so this times the kernel alone at
BERT-tiny's attention shape (S = T = 128, 2 heads of 64, an additive padding mask), one thread, the calling
thread's CPU time: each tree in its own worker process (its own compiled kernels), the two run in alternation,
round after round. `--check` first: both trees' outputs on 504 random cases (sequence lengths with 16-, 8- and
1-lane tails, causal, every mask kind incl. a NaN and wholly hidden rows, each quantization on and off) must be
equal byte for byte.
"""

from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve()


def _attrs(causal: int, sq: int, pq: int, oq: int, scale: float = 0.7) -> dict:
    attrs = {"scale": scale, "q_perm": [0, 2, 1, 3], "k_perm": [0, 2, 1, 3], "v_perm": [0, 2, 1, 3],
             "out_perm": [0, 2, 1, 3], "nan_to_zero": 1, "is_causal": causal,
             "q_quant": [0.02, 120.0], "k_quant": [0.03, 131.0], "v_quant": [0.05, 127.0]}
    if sq:
        attrs["score_quant"] = [0.04, 140.0, 0.0, 255.0]
    if pq:
        attrs["prob_quant"] = [1 / 255, 0.0, 0.0, 255.0]
    if oq:
        attrs["out_quant"] = [0.03, 128.0, 0.0, 255.0]
    return attrs


def worker_check(path: str) -> None:
    """Every case's output into the .npz at `path` (run inside the tree under test)."""
    import torch
    from kiln.kernels.cpu import transformer as kernels
    from kiln.tactics.cpu.attention import attention_plan

    assert kernels.available(), kernels.reason()
    out = {}
    for T, causal, mk, sq, pq, oq in itertools.product(
            (5, 8, 13, 16, 20, 24, 37, 64, 128), (0, 1), ("none", "add", "add_nan", "add_strided", "bool", "keys"),
            (1, 0), (1, 0), (1, 0)):
        if causal and mk != "none":
            continue
        case = f"{T} {causal} {mk} {sq} {pq} {oq}"
        rng = np.random.default_rng(zlib.crc32(case.encode()))
        B, H, D = 2, 3, 16 if T < 64 else 64
        q, k, v = (torch.from_numpy(rng.integers(0, 256, (B, T, H, D)).astype(np.uint8)) for _ in range(3))
        feeds = {0: q, 1: k, 2: v}
        mask_dtype, strides = None, None
        if mk in ("add", "add_nan"):
            m = rng.normal(0, 2, (B, H, T, T)).astype(np.float32)
            m[0, ..., T // 2:] = -np.inf
            m[1, 0, 0, :] = -np.inf  # a row that sees no key
            if mk == "add_nan":
                m[1, 1, 1, 2] = np.nan
            feeds[3], mask_dtype = torch.from_numpy(m), torch.float32
        elif mk == "add_strided":  # every other float of [B, H, T, 2T]: a key stride of 2
            feeds[3], mask_dtype = torch.from_numpy(rng.normal(0, 2, (B, H, T, 2 * T)).astype(np.float32)), torch.float32
            strides = (H * T * 2 * T, T * 2 * T, 2 * T, 2)
        elif mk == "bool":
            feeds[3], mask_dtype = torch.from_numpy(rng.random((B, 1, 1, T)) < 0.7), torch.bool
        elif mk == "keys":  # the key padding mask, int64 [B, T]
            feeds[3], mask_dtype = torch.from_numpy(np.zeros((B, 1, 1, T), np.float32)), torch.float32
        sizes = {i: tuple(x.shape) for i, x in feeds.items()}
        if mk == "add_strided":
            sizes[3] = (B, H, T, T)
        plan = attention_plan(_attrs(causal, sq, pq, oq), sizes, mask_dtype)
        assert not isinstance(plan, str), (case, plan)
        if strides:
            plan["mask"] = ("add", strides)
        if mk == "keys":
            real = (rng.random((B, T)) < 0.8).astype(np.int64)
            if T < 10:
                real[1, :] = 0
            feeds[3] = torch.from_numpy(real)
            plan["mask"] = ("keys", (T, 0, 0, 1))
        out[case] = kernels.Attention(**plan)(feeds).numpy().copy()
    np.savez(path, **out)


def worker_time(batch: int, blocks: int) -> None:
    """The kernel's median µs a call (thread CPU time) at BERT-tiny's attention, printed."""
    import torch
    from kiln.kernels.cpu import transformer as kernels
    from kiln.tactics.cpu.attention import attention_plan

    torch.set_num_threads(1)
    B, T, H, D = batch, 128, 2, 64
    rng = np.random.default_rng(1)
    q, k, v = (torch.from_numpy(rng.integers(0, 256, (B, T, H, D)).astype(np.uint8)) for _ in range(3))
    m = torch.zeros((B, 1, 1, T))
    m[..., 100:] = -10000.0
    feeds = {0: q, 1: k, 2: v, 3: m}
    plan = attention_plan(_attrs(0, 1, 1, 1, 0.125), {i: tuple(x.shape) for i, x in feeds.items()}, torch.float32)
    kernel = kernels.Attention(**plan)
    for _ in range(100):
        kernel(feeds)
    samples = []
    for _ in range(blocks):
        n, t0 = 200, time.thread_time()
        for _ in range(n):
            kernel(feeds)
        samples.append((time.thread_time() - t0) / n * 1e6)
    print(f"{np.median(samples):.3f}")


def in_tree(tree: Path, *args: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(HERE), "--worker", *args], cwd=tree, env=env, check=True,
                          capture_output=True, text=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="a checkout of the base commit")
    parser.add_argument("--batch", default="1,4")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--blocks", type=int, default=15)
    parser.add_argument("--no-check", action="store_true")
    parser.add_argument("--worker", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    trees = {"base": Path(args.base).resolve(), "branch": HERE.parents[1]}
    if not args.no_check:
        with tempfile.TemporaryDirectory() as tmp:
            found = {}
            for name, tree in trees.items():
                in_tree(tree, "check", f"{tmp}/{name}.npz")
                found[name] = np.load(f"{tmp}/{name}.npz")
            differ = [c for c in found["base"].files if found["base"][c].tobytes() != found["branch"][c].tobytes()]
            print(f"check: {len(found['base'].files)} cases, {len(differ)} differ {differ[:5]}")
    cpu = next((x.split(":", 1)[1].strip() for x in Path("/proc/cpuinfo").read_text().splitlines()
                if x.startswith("model name")), "?")
    print(f"\nint8 attention kernel, BERT-tiny's shape, 1 thread, thread CPU time, µs a call, CPU {cpu}\n")
    print("| batch | load (1-min) | base | branch | branch / base (median of rounds) | rounds |")
    print("|---|---|---|---|---|---|")
    for batch in (int(b) for b in args.batch.split(",")):
        rows, loads = [], []
        for r in range(args.rounds):
            order = list(trees.items())[:: 1 if r % 2 == 0 else -1]
            got = {name: float(in_tree(tree, "time", str(batch), str(args.blocks))) for name, tree in order}
            loads.append(os.getloadavg()[0])
            rows.append((got["base"], got["branch"]))
        a = np.array(rows)
        ratios = a[:, 1] / a[:, 0]
        print(f"| {batch} | {min(loads):.1f}-{max(loads):.1f} | {np.median(a[:, 0]):.1f} | {np.median(a[:, 1]):.1f} "
              f"| **{np.median(ratios):.2f}** | {', '.join(f'{x:.2f}' for x in ratios)} |")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        if sys.argv[2] == "check":
            worker_check(sys.argv[3])
        else:
            worker_time(int(sys.argv[3]), int(sys.argv[4]))
    else:
        main()
