"""ServerCore.infer's own CPU at concurrency 1, old tree against new, beside the engine call alone: each round runs
every tree in a fresh process of its own, in turn (A, B, A, B, ...). Each process loads the empty model (y =
Identity(x), FP32 [1, 4], batching on, answered inline) into a ServerCore and times, on the loop thread's CPU clock,
`await core.infer(request, model)` one request after another with the loop turning once between (as a server's
reads are), the loop's turn alone, and the engine call alone (ExecutionContext.run of the same inputs). Prints per
round each tree's us per request (the median of 5 windows), then the medians and core.infer less the engine call
less the loop's turn: the serve layer's own work. The answers are crc-compared between trees.

    python bench/serve_core_infer_ab.py --trees /tmp/base . --rounds 7 --requests 2000
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r'''
import asyncio, json, statistics, sys, tempfile, time, zlib
from pathlib import Path
import numpy as np
tree = Path(sys.argv[1]); sys.path.insert(0, str(tree)); sys.path.insert(0, str(tree / "bench"))
import serve_overhead as so
from kiln.serve.core import InferRequest, ServerCore
from kiln.serve.repository import ModelRepository

N = int(sys.argv[2])
repo = Path(tempfile.mkdtemp())
so._write_repository(repo, sys.executable, tree)
generator = np.random.default_rng(zlib.crc32(b"core-infer-ab"))
xs = [generator.standard_normal((1, 4)).astype(np.float32) for _ in range(N)]  # made before the clock runs
requests = [InferRequest("empty", inputs={"x": x}) for x in xs]

async def main():
    core = ServerCore(ModelRepository(repo))
    await core.start()
    model = core.model("empty")
    context = model.batcher.instances[0].context
    crc = 0
    for r in requests[:500]:
        await core.infer(r, model)
        await asyncio.sleep(0)

    async def infer():
        for r in requests:
            await core.infer(r, model)
            await asyncio.sleep(0)

    async def engine():
        for r in requests:
            context.run(r.inputs)
            await asyncio.sleep(0)

    async def turn():
        for r in requests:
            await asyncio.sleep(0)

    windows = {"infer": [], "engine": [], "turn": []}
    for _ in range(5):
        for name, f in (("infer", infer), ("engine", engine), ("turn", turn)):
            t0 = time.thread_time_ns()
            await f()
            windows[name].append((time.thread_time_ns() - t0) / N / 1e3)
    for r in requests[:64]:
        crc = zlib.crc32(np.ascontiguousarray((await core.infer(r, model)).outputs[0][1]).tobytes(), crc)
    print(json.dumps({"inline": model.batcher.instances[0].inline, "crc": crc,
                      **{k: statistics.median(v) for k, v in windows.items()}}))
    await core.close()

asyncio.run(main())
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", nargs="+", default=["."])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args()
    results: dict[str, list[dict]] = {t: [] for t in args.trees}
    for k in range(args.rounds):
        for tree in args.trees:
            env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve())}
            out = subprocess.run([sys.executable, "-c", CHILD, str(Path(tree).resolve()), str(args.requests)],
                                 env=env, check=True, capture_output=True, text=True).stdout
            row = json.loads(out.strip().splitlines()[-1])
            results[tree].append(row)
            with open("/proc/loadavg") as f:
                load = f.read().split()[0]
            print(f"round {k} {tree}: core.infer {row['infer']:.2f} engine {row['engine']:.2f} turn "
                  f"{row['turn']:.2f} us/req (inline {row['inline']}, crc {row['crc']:08x}, load {load})", flush=True)
    first = args.trees[0]
    print("\n| tree | core.infer us/req | engine call | loop turn | serve's own (infer - engine - turn) | ratio |")
    print("|---|---|---|---|---|---|")
    own0 = None
    for tree in args.trees:
        rows = results[tree]
        med = {k: statistics.median(r[k] for r in rows) for k in ("infer", "engine", "turn")}
        own = statistics.median(r["infer"] - r["engine"] - r["turn"] for r in rows)
        own0 = own if own0 is None else own0
        ratio = statistics.median(r["infer"] / b["infer"] for r, b in zip(rows, results[first]))
        print(f"| {tree} | {med['infer']:.2f} | {med['engine']:.2f} | {med['turn']:.2f} | {own:.2f} | {ratio:.3f} |")
    crcs = {r["crc"] for rows in results.values() for r in rows}
    print(f"answers' crc: {'the same' if len(crcs) == 1 else 'DIFFER ' + str(crcs)}")


if __name__ == "__main__":
    main()
