"""ExecutionContext.run() on bert_tiny before and after a refactor of kiln/runtime (the split of context.py and
native.py into modules): the same saved engines loaded by two source trees in alternating processes (two trees'
kiln cannot share one process), each timing run()'s CPU paths in calls of one thread.

    python bench/split_run_ab.py --before /tmp/split2-base            # the tree at the commit before the split
    python bench/split_run_ab.py --before /tmp/split2-base --rounds 8 --calls 3000

Paths (thread CPU µs a call, the median of --calls calls after --calls / 10 warm ones; numpy feeds unless said):
  direct    dynamic bert_tiny (profile 1x1..4x32..4x48) at a bound 2x16: _run_checked, then one call of the
            segment's compiled loop (kiln/runtime/direct_run.py)
  checked   the same, KILN_DIRECT_RUN=0: _run_checked, then the program
  static    bert_tiny of fixed shape 1x16: _run_static, the whole program one native segment (run_numpy)
  general   dynamic bert_tiny at 2x16 fed torch tensors: run()'s general path
Rounds alternate which tree goes first; the table gives each path's median over rounds and after/before.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATHS = ("direct", "checked", "static", "general")


def child(engines: dict[str, str], calls: int) -> None:
    """In a process of one tree: each path's median thread CPU µs a call, as JSON on stdout."""
    import time

    import kiln  # before torch: kiln sets OpenMP's wait policy
    import numpy as np
    import torch

    torch.set_num_threads(1)
    rng = np.random.default_rng(0)

    def feeds(batch: int, seq: int) -> dict[str, np.ndarray]:
        return {"input_ids": rng.integers(0, 1000, (batch, seq)), "attention_mask": np.ones((batch, seq), np.int64)}

    def median_us(run, x) -> float:
        for _ in range(max(calls // 10, 1)):
            run(x)
        times = []
        for _ in range(calls):
            start = time.thread_time_ns()
            run(x)
            times.append(time.thread_time_ns() - start)
        return statistics.median(times) / 1e3

    dynamic, static = kiln.load(engines["dynamic"]), kiln.load(engines["static"])
    x = feeds(2, 16)
    out = {}
    context = dynamic.create_execution_context(pad_first_calls=False)
    out["direct"] = median_us(context.run, x)
    os.environ["KILN_DIRECT_RUN"] = "0"  # read per context
    out["checked"] = median_us(dynamic.create_execution_context(pad_first_calls=False).run, x)
    del os.environ["KILN_DIRECT_RUN"]
    out["static"] = median_us(static.create_execution_context().run, feeds(1, 16))
    out["general"] = median_us(context.run, {k: torch.from_numpy(v) for k, v in x.items()})
    print(json.dumps(out))


def build(folder: Path) -> dict[str, str]:
    """bert_tiny's two engines (dynamic, fixed 1x16), built by this tree and saved in `folder`."""
    import kiln
    from kiln import zoo

    engines = {"dynamic": str(folder / "dynamic.kiln"), "static": str(folder / "static.kiln")}
    kiln.build(str(zoo.export("bert_tiny", dynamic=True).path),
               profiles=[{"input_ids": "1x1,4x32,4x48"}]).save(engines["dynamic"])
    kiln.build(str(zoo.export("bert_tiny", batch=1, seq=16).path)).save(engines["static"])
    return engines


def run_tree(tree: str, engines: dict[str, str], calls: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(engines),
                           "--calls", str(calls)], cwd=tree, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", help="the source tree before the change (e.g. git archive of its commit)")
    ap.add_argument("--after", default=str(ROOT), help="the source tree after it (default: this one)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(json.loads(args.child), args.calls)
        return
    sys.path.insert(0, str(ROOT))
    results: dict[str, dict[str, list[float]]] = {"before": {p: [] for p in PATHS}, "after": {p: [] for p in PATHS}}
    with tempfile.TemporaryDirectory() as folder:
        engines = build(Path(folder))
        for r in range(args.rounds):
            order = ("before", "after") if r % 2 == 0 else ("after", "before")
            for side in order:
                got = run_tree(getattr(args, side), engines, args.calls)
                for p in PATHS:
                    results[side][p].append(got[p])
            print(f"round {r + 1}: " + "  ".join(f"{s} {p} {results[s][p][-1]:.1f}" for s in order for p in PATHS),
                  flush=True)
    print(f"\n{'path':<10}{'before µs':>12}{'after µs':>12}{'after/before':>14}   (median over {args.rounds} rounds "
          f"of {args.calls} calls' medians, thread CPU, 1 thread)")
    for p in PATHS:
        before, after = statistics.median(results["before"][p]), statistics.median(results["after"][p])
        print(f"{p:<10}{before:>12.1f}{after:>12.1f}{after / before:>14.3f}")


if __name__ == "__main__":
    main()
