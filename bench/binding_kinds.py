"""Where binding a saved transformer engine at a new input shape goes, per segment member kind, in situ (issue 10).

    python bench/binding_kinds.py /tmp/bert_base.kiln           # 1 thread, three groups of fixed shapes

Padded first calls off (KILN_PAD_FIRST_CALLS=0): every new shape binds at its first call. Per shape: the first
call, then two repeats; "extra" = the first less the faster repeat. The members' `at` (their NativeStep at the new
sizes: kernels, primitives, plans) are timed by the kind of what they bind (InnerProduct: a oneDNN inner product
made for the row count; MatmulRows: the runtime-M matmul at it; BoundRows: kiln's GEMM...), and `_Resized` (the
members bound to the template's memory, the call arrays). Thread CPU time of the calling thread, median over a
group's shapes. The shapes (batch x sequence) are grouped by row count, which decides the oneDNN layers' path
(kiln/tactics/cpu/onednn_gemm.py, RuntimeRows); they must lie inside the engine's profile.
"""

from __future__ import annotations

import collections
import os
import statistics
import sys
import time
from pathlib import Path

os.environ["KILN_PAD_FIRST_CALLS"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kiln  # noqa: E402  (before torch: kiln sets OpenMP's wait policy)
import numpy as np  # noqa: E402
import torch  # noqa: E402

from kiln.runtime import native  # noqa: E402

GROUPS = {"rows <= 2": [(1, 1), (1, 2), (2, 1)],
          "rows 3-127": [(1, 7), (2, 13), (3, 21), (1, 50), (5, 9)],
          "rows >= 256": [(2, 128), (3, 111), (2, 150), (5, 77), (4, 100)]}
clock = time.thread_time_ns


def main() -> None:
    torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
    t0 = clock()
    engine = kiln.load(sys.argv[1])
    load_ms = (clock() - t0) / 1e6
    context = engine.create_execution_context()
    context.warm_up()
    spent = collections.Counter()  # kind -> ns, for the shape being bound
    natives_at, resized_init = native.Segment._natives_at, native._Resized.__init__

    def timed_natives_at(segment, key):
        sizes = dict(zip(segment.entries, key))
        natives, forms = [], {}
        for m, (at, reads, x) in zip(segment.members, segment._resizers):
            t = clock()
            step = at({i: sizes[slot] for i, slot in reads}) if reads is not None else at(sizes[x])
            spent["at:" + type(step.primitive(False)).__name__] += clock() - t
            for slot, _role, size, strides, dtype in native.writes_of(m, step):
                sizes[slot], forms[slot] = size, (size, strides, dtype)
            natives.append(step)
        return native._AtSizes(natives, forms)

    def timed_resized(resized, *args, **kwargs):
        t = clock()
        resized_init(resized, *args, **kwargs)
        spent["_Resized"] += clock() - t

    native.Segment._natives_at, native._Resized.__init__ = timed_natives_at, timed_resized
    rng = np.random.default_rng(0)
    print(f"# {sys.argv[1]}: load {load_ms:.0f} ms thread CPU, {torch.get_num_threads()} thread(s), load average "
          f"{os.getloadavg()[0]:.1f}")
    print("\n| shapes | first-call extra µs | repeat µs | binding by kind, µs (>= 50) |\n|---|---|---|---|")
    for group, shapes in GROUPS.items():
        kinds, extra, repeat = collections.defaultdict(list), [], []
        for batch, seq in shapes:
            feeds = {"input_ids": rng.integers(0, 30000, (batch, seq), dtype=np.int64),
                     "attention_mask": np.ones((batch, seq), np.int64)}
            feeds = {k: v for k, v in feeds.items() if k in engine.input_names}
            spent.clear()
            t0 = clock()
            context.run(feeds)
            t1 = clock()
            context.run(feeds)
            t2 = clock()
            context.run(feeds)
            t3 = clock()
            repeat.append(min(t2 - t1, t3 - t2) / 1e3)
            extra.append((t1 - t0) / 1e3 - repeat[-1])
            for kind, ns in spent.items():
                kinds[kind].append(ns / 1e3)
        by_kind = sorted(((statistics.median(v), k) for k, v in kinds.items()), reverse=True)
        print(f"| {group} | {statistics.median(extra):.0f} | {statistics.median(repeat):.0f} | "
              f"{', '.join(f'{k} {us:.0f}' for us, k in by_kind if us >= 50)} |", flush=True)
    print(f"\nload average {os.getloadavg()[0]:.1f} after")


if __name__ == "__main__":
    main()
