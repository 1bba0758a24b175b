"""kiln serve's HTTP codec on JSON tensors, old tree against new: decode_request (with the HeaderLayouts the infer
fast path keeps) and encode_response_pieces of an answer with the same tensor as a JSON output, per request, in a
fresh process per tree, rounds interleaved (A, B, A, B, ...). Each request carries fresh values (made before the
clock runs), as json.dumps writes them (tritonclient.http's body with binary_data=False). Prints each round's
us per request, the medians and the ratio to the first tree, and checks that every tree decoded the same arrays
and encoded the same bytes (crc32).

    python bench/serve_json_codec_ab.py --trees /tmp/base . --rounds 5

Shapes: FP32 [1, 4] (the empty model's, bench/serve_overhead.py), INT64 [1, 128] (a BERT's input ids) and FP32
[1, 3, 224, 224] (an image, 150,528 values: 3 MB of JSON).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r'''
import json, sys, time, zlib
import numpy as np
sys.path.insert(0, sys.argv[1])
from kiln.serve import http_codec
from kiln.serve.core import InferResponse
from kiln.serve.shared_memory import SharedMemoryRegistry

case, count = sys.argv[2], int(sys.argv[3])
shape, v2 = {"fp32-1x4": ([1, 4], "FP32"), "int64-1x128": ([1, 128], "INT64"),
             "fp32-1x3x224x224": ([1, 3, 224, 224], "FP32")}[case]
rng = np.random.default_rng(zlib.crc32(case.encode()))

def tensor():
    if v2 == "INT64":
        return rng.integers(0, 30522, shape, dtype=np.int64)
    return rng.standard_normal(shape).astype(np.float32)

tensors = [tensor() for _ in range(count + 20)]
bodies = [json.dumps({"inputs": [{"name": "x", "shape": shape, "datatype": v2, "data": t.reshape(-1).tolist()}],
                      "outputs": [{"name": "y", "parameters": {"binary_data": False}}]}).encode() for t in tensors]
registry = SharedMemoryRegistry()
layouts = http_codec.HeaderLayouts() if hasattr(http_codec, "HeaderLayouts") else None
crc = 0
t0 = None
for k, body in enumerate(bodies):
    if k == 20:
        t0 = time.thread_time()
    kwargs = {"layouts": layouts} if layouts is not None else {}
    request, options = http_codec.decode_request(body, None, "m", "1", registry, **kwargs)
    array = request.inputs["x"]
    pieces, _ = http_codec.encode_response_pieces(InferResponse("m", "1", "", [("y", array)]), options, True,
                                                  registry)
    if k < 20:
        crc = zlib.crc32(array.tobytes() + b"".join(bytes(p) for p in pieces), crc)
print("crc", crc)
print((time.thread_time() - t0) / count * 1e6)
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", nargs="+", required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cases", nargs="+", default=["fp32-1x4", "int64-1x128", "fp32-1x3x224x224"])
    args = parser.parse_args()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"CPU: {cpu} x {os.cpu_count()}")
    counts = {"fp32-1x4": 20000, "int64-1x128": 5000, "fp32-1x3x224x224": 20}
    rows = []
    for case in args.cases:
        by_tree: dict[str, list[float]] = {t: [] for t in args.trees}
        crcs = set()
        for r in range(args.rounds):
            for tree in args.trees:
                load = open("/proc/loadavg").read().split()[0]
                path = str(Path(tree).resolve())
                done = subprocess.run([sys.executable, "-c", CHILD, path, case, str(counts[case])],
                                      capture_output=True, text=True, cwd=path, env={**os.environ, "PYTHONPATH": (
                                          os.pathsep.join([path, os.environ.get("PYTHONPATH", "")]).rstrip(
                                              os.pathsep))})
                if done.returncode:
                    sys.exit(f"{tree}: {done.stderr[-2000:]}")
                crcs.add(done.stdout.split()[1])
                value = float(done.stdout.split()[-1])
                by_tree[tree].append(value)
                print(f"| {case} | {r} | {tree} | {value:.1f} us/req | load {load} |", flush=True)
        base = by_tree[args.trees[0]]
        for tree, values in by_tree.items():
            ratio = statistics.median(v / b for v, b in zip(values, base))
            rows.append(f"| {case} | {tree} | {statistics.median(values):.1f} | {ratio:.3f} | "
                        f"{'same' if len(crcs) == 1 else 'DIFFER: ' + str(crcs)} |")
    print("\n| case | tree | median us/req (decode + encode) | median ratio to the first tree | arrays and bytes |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
