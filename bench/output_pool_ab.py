"""A measurement, not a kiln change (session 27 h-touch1): what a decoder's first call at a new shape would save if
the memory of its returned logits came back to kiln when the caller drops them (a recycling pool, as CUDA's caching
allocator does), instead of glibc's fresh pages. llama_tiny's logits are the last view's exit (native_views
_Resized._run_bound's torch.empty_strided); B serves that call from a pool of blocks returned by a weakref.finalize
on the numpy array the tensor's storage holds (it fires when the last tensor or view over the storage is gone, so
a caller's slice keeps the block out of the pool). A = plain torch.empty_strided. Each new shape's first call, then
3 repeats (the least); minor faults of the thread and thread CPU µs. B's outputs must equal A's bit for bit (same
seed, same shapes): the script compares against a saved file when --check is given.

    python bench/output_pool_ab.py --engine /tmp/llama3/llama_tiny_wide.kiln --save a.npz
    python bench/output_pool_ab.py --engine /tmp/llama3/llama_tiny_wide.kiln --pool --ahead 2097152 --check a.npz
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import weakref
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ["KILN_PAD_FIRST_CALLS"] = "0"

import kiln  # noqa: E402,F401
import numpy as np  # noqa: E402
import torch  # noqa: E402

from first_call_direct import span_timer, warm_context  # noqa: E402
from first_touch import SHAPES, faults  # noqa: E402
from kiln.runtime import first_calls, native_views  # noqa: E402

POOLED_FROM = 1 << 18  # bytes: smaller exits (the segments' [b, s, 64] between them) stay torch's: the logits only


class _Pool:
    """Blocks (64-byte aligned uint8 numpy arrays) a dropped output gave back, reused by the next one that fits."""

    def __init__(self):
        self.free: list[np.ndarray] = []
        self.made = 0

    def empty_strided(self, size, strides, dtype=None, **k):
        dtype = dtype or torch.get_default_dtype()
        numel = int(np.prod(size)) if len(size) else 1
        item = torch.empty((), dtype=dtype).element_size()
        nbytes = numel * item
        contiguous = tuple(strides) == tuple(torch.empty(size, device="meta").stride())
        if nbytes < POOLED_FROM or not contiguous or k:
            return torch.empty_strided(size, strides, dtype=dtype, **k)
        fits = [j for j, b in enumerate(self.free) if b.nbytes >= nbytes]
        if fits:
            # (popped by index: list.remove's == on arrays is elementwise)
            block = self.free.pop(min(fits, key=lambda j: self.free[j].nbytes))
        else:
            raw = np.empty(nbytes + 64, np.uint8)
            offset = (-raw.ctypes.data) % 64
            block = raw[offset:offset + nbytes]
            self.made += 1
        held = block[:nbytes]  # a fresh array object: the storage's; its end returns the block
        weakref.finalize(held, self.free.append, block)
        return torch.from_numpy(held).view(dtype).view(size)


class _Torch:
    """native_views's `torch` with empty_strided from the pool."""

    def __init__(self, pool):
        self._pool = pool

    def __getattr__(self, name):
        return self._pool.empty_strided if name == "empty_strided" else getattr(torch, name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True)
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--pool", action="store_true", help="B: the last exits from the recycling pool")
    ap.add_argument("--save", default="")
    ap.add_argument("--check", default="")
    ap.add_argument("--ahead", type=int, default=0, help="B: one block of this many bytes made and touched before the "
                    "calls (the profile's largest logits: llama_tiny_wide 8x64x1024 float32 = 2097152)")
    args = ap.parse_args()
    pool = _Pool()
    if args.ahead:
        raw = np.empty(args.ahead + 64, np.uint8)
        raw.fill(0)
        offset = (-raw.ctypes.data) % 64
        pool.free.append(raw[offset:offset + args.ahead])
    if args.pool:
        native_views.torch = _Torch(pool)
    context = warm_context(args.engine)
    first_calls.primitives_made(120)
    spans, _ = span_timer()
    rng = np.random.default_rng(0)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    names = context.engine.input_names
    rows, outs = [], {}

    def call(feeds):
        spans.clear()
        f0, t0 = faults(), time.thread_time_ns()
        out = context.run(feeds)
        return faults() - f0, (time.thread_time_ns() - t0) / 1e3, spans.get("loop", 0.0), out

    for shape in shapes:
        feeds = {"input_ids": rng.integers(0, 1000, shape), "attention_mask": np.ones(shape, np.int64)}
        feeds = {k: v for k, v in feeds.items() if k in names}
        first = call(feeds)
        outs["x".join(map(str, shape))] = np.array(next(iter(first[3].values())))
        first = first[:3]
        repeats = []
        for _ in range(3):
            repeats.append(call(feeds)[:3])  # (each output dropped at once: its block back in B's pool)
        best = min(repeats, key=lambda r: r[1])
        rows.append((shape, first, best, sum(r[0] for r in repeats)))
    if args.save:
        np.savez(args.save, **outs)
    if args.check:
        saved = np.load(args.check)
        bad = [k for k in outs if not np.array_equal(saved[k], outs[k])]
        print(f"outputs against {args.check}: {'equal bit for bit' if not bad else 'DIFFER at ' + ', '.join(bad)}")
    later = rows[1:]
    med = lambda xs: statistics.median(xs)  # noqa: E731
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    side = f"B pool, ahead {args.ahead}" if args.pool else "A plain"
    print(f"# {side} {Path(args.engine).name}, 1 thread, {cpu}, load "
          f"{os.getloadavg()[0]:.1f}; blocks made {pool.made}, free {len(pool.free)}")
    print(f"later first calls ({len(later)}): faults median {med(r[1][0] for r in later):.0f} (sum "
          f"{sum(r[1][0] for r in later)}), repeats' faults sum {sum(r[3] for r in later)}; first µs "
          f"{med(r[1][1] for r in later):.0f}, loop µs {med(r[1][2] for r in later):.0f}; first - repeat "
          f"{med(r[1][1] - r[2][1] for r in later):.0f}; loop first - repeat "
          f"{med(r[1][2] - r[2][2] for r in later):.0f}")


if __name__ == "__main__":
    main()
