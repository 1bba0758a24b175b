"""Small models on a shared CPU: kiln and onnxruntime at 1 and 2 threads, as the machine is and with busy
loops added, side by side in one process (issue 11: "kiln on 2 threads loses to 1 thread by up to 20x on
small models when the machine is loaded").

    python bench/contention.py                                   # bert_tiny, resnet_tiny, cnn1d, lstm_forecaster
    python bench/contention.py --models bert_tiny --busy 2 --seconds 20

Per model: one kiln engine (built at 2 threads) run at 2 and at 1 thread (torch.set_num_threads), and
onnxruntime sessions of 2 and 1 intra-op threads; wall latency in interleaved rounds of blocks. Each condition
is timed twice: the machine as it is ("ambient": its 1-min load average printed beside), then with --busy
`while True: pass` processes started by this script for the condition's blocks and killed after (their PIDs).
Prints a table of medians and kiln / onnxruntime ratios (median over rounds).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import kiln  # noqa: E402  (before torch: kiln sets OpenMP's wait policy)
import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402
import torch  # noqa: E402
from cpu import commit  # noqa: E402  bench/cpu.py

from kiln import zoo  # noqa: E402
from kiln.builder.timing_cache import cpu_name  # noqa: E402

SHAPES = {"bert_tiny": dict(batch=1, seq=32), "resnet_tiny": dict(batch=1), "cnn1d": {}, "lstm_forecaster": {}}
PEERS = ("kiln 2", "kiln 1", "ort 2", "ort 1")


def runners(name: str) -> dict[str, callable]:
    exported = zoo.export(name, **SHAPES.get(name, {}))
    feeds = zoo.random_inputs(name, exported, seed=0)
    torch.set_num_threads(2)
    engine = kiln.build(str(exported.path))
    sessions = {}
    for threads in (2, 1):
        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
        sessions[threads] = ort.InferenceSession(str(exported.path), options, providers=["CPUExecutionProvider"])

    def kiln_at(threads: int):
        def run():
            torch.set_num_threads(threads)
            return engine.run(feeds)
        return run

    want = sessions[1].run(None, feeds)[0]
    got = next(iter(kiln_at(2)().values()))
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4, err_msg=name)
    return {"kiln 2": kiln_at(2), "kiln 1": kiln_at(1), "ort 2": lambda: sessions[2].run(None, feeds),
            "ort 1": lambda: sessions[1].run(None, feeds)}


def time_condition(peers: dict, rounds: int, seconds: float) -> dict[str, list[float]]:
    """Median ms of each peer's block, per round (blocks interleaved: kiln 2, kiln 1, ort 2, ort 1, ...)."""
    per_block = seconds / rounds / len(peers)
    out: dict[str, list[float]] = {p: [] for p in peers}
    for _ in range(rounds):
        for name, fn in peers.items():
            for _ in range(3):
                fn()
            samples, deadline = [], time.perf_counter() + per_block
            while len(samples) < 5 or (time.perf_counter() < deadline and len(samples) < 200):
                start = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - start) * 1e3)
            out[name].append(float(np.median(samples)))
    torch.set_num_threads(2)
    return out


def busy_loops(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(SHAPES))
    ap.add_argument("--busy", type=int, default=2, help="busy loops added for the loaded condition")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=20.0, help="per model and condition")
    args = ap.parse_args()
    print(f"kiln {kiln.__version__} contention bench: {cpu_name()}, {os.cpu_count()} CPUs, commit {commit()}; "
          f"OpenMP: " + (", ".join(f"{k}={os.environ[k]}" for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
                                   if k in os.environ) or "libgomp default"))
    header = ["model", "condition", "load", *(f"{p} ms" for p in PEERS), "kiln2/ort2", "kiln1/ort2", "kiln2/kiln1"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name in args.models.split(","):
        peers = runners(name)
        for condition in ("ambient", f"+{args.busy} busy"):
            loops = busy_loops(args.busy) if condition != "ambient" else []
            try:
                time.sleep(1.0 if loops else 0.0)
                load = os.getloadavg()[0]
                res = time_condition(peers, args.rounds, args.seconds)
            finally:
                for p in loops:
                    p.kill()
                    p.wait()

            def ratio(a: str, b: str) -> str:
                return f"{np.median([x / y for x, y in zip(res[a], res[b])]):.2f}"

            cells = [name, condition, f"{load:.2f}", *(f"{np.median(res[p]):.3f}" for p in PEERS),
                     ratio("kiln 2", "ort 2"), ratio("kiln 1", "ort 2"), ratio("kiln 2", "kiln 1")]
            lines.append("| " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
    print("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
