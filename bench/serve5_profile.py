"""Where kiln serve's host CPU goes per request (issue 14: the H200 host spent ~0.8-1.5 ms a request), by stage.

    python bench/serve5_profile.py                                # image model, gRPC and HTTP, c = 64, batching on
    python bench/serve5_profile.py --models empty image --top 25  # + the 25 costliest functions of each row

The server runs in this process (a ServerThread, one process: no front ends) on 127.0.0.1 and serves the models of
bench/serve_frontend_cost.py with dynamic batching (max batch 64, no queue delay): "empty" (y = Identity(x), FP32
[1, 4]) and "image" (y = x[:, :, 0, 0] of an FP16 [1, 3, 224, 224] image: MobileNetV2's 301 KB request, an engine call
of ~0), and "hidden" (y = x tiled to [1, 128, 768] FP32: a 3 KB request, BERT-base's 393 KB answer). Engine calls run on the instance's thread, as a CUDA instance's do (instances.INLINE_NS = 0). The load is
`kiln perf --client wire` in a subprocess (every answer checked), one level at --concurrency.

Per row: the requests answered, the server's CPU per request (its loop thread and its instance thread, from /proc,
unprofiled: a first window), then a second window with cProfile on the loop thread (timer: the thread's CPU time)
whose functions are summed into stages by where they are (`STAGES`): transport (h2/HTTP framing, socket writes),
decode (ModelInfer / the HTTP request's JSON and tensors), batcher (submit, dispatch, answer), encode (the answer's
message), loop (uvloop's own C, event callbacks), other. cProfile's own cost inflates the profiled window's
microseconds (~2x): read its stages as shares, the unprofiled /proc numbers as the CPU a request costs.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_frontend_cost import write_repository  # noqa: E402 - the empty and image models, batching on

# stage: substrings of a function's "file:function" (first match wins, in this order)
STAGES = [
    ("transport", ["h2_connection", "h2_frames", "grpc_h2.py", "http_fast", "http_protocol", "h11", "httptools",
                   "uvicorn", "socket", "transports", "writelines", "sendmsg", "send'", "recv"]),
    ("decode", ["grpc_wire", "grpc_call", "grpc_server.py", "http_codec", "http_server", "datatypes", "json",
                "frombuffer"]),
    ("batcher", ["batcher.py", "instances.py", "eager.py", "stats.py", "futures", "Future", "tasks.py"]),
    ("core", ["core.py"]),
    ("loop", ["base_events", "events.py", "runners.py", "uvloop", "_run_once", "run_forever", "selector"]),
]


def _stage(key: tuple[str, int, str]) -> str:
    where = f"{key[0]}:{key[2]}"
    for stage, marks in STAGES:
        if any(m in where for m in marks):
            return stage
    return "other"


def _thread_cpu_s(tid: int) -> float:
    """CPU seconds so far of one of this process's threads (its native id)."""
    with open(f"/proc/self/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _load(model: str, protocol: str, port: int, concurrency: int, window_s: float) -> int:
    """kiln perf --client wire at one concurrency level in a subprocess: the requests answered in its window."""
    out = Path(tempfile.mkdtemp(prefix="serve5-perf-")) / "perf.json"
    done = subprocess.run([sys.executable, "-m", "kiln", "perf", "-m", model, "-u", f"127.0.0.1:{port}", "-i", protocol,
                           "--concurrency", str(concurrency), "--measurement-interval", str(int(window_s * 1000)),
                           "--warmup", "0.5", "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    if done.returncode:
        raise RuntimeError(f"kiln perf failed:\n{done.stdout}\n{done.stderr}")
    import json

    result = json.loads(out.read_text())["results"][0]
    if result["wrong"] or result["errors"]:
        raise RuntimeError(f"kiln perf: {result['wrong']} wrong, {result['errors']} errors")
    return int(result["requests"])


def _answered(thread) -> int:
    """Requests the server answered so far (all its models)."""
    return sum(v.stats.success.count for v in thread.server.core.ready_versions())


def _row(thread, model: str, protocol: str, args) -> None:
    """The unprofiled run: CPU us per answered request (plans, warm-up and window together) of the loop and the
    instance thread; then the profiled one, by stage."""
    server = thread.server
    port = server.ports.grpc if protocol == "grpc" else server.ports.http
    version = next(v for v in server.core.ready_versions() if v.name == model)
    tids = [thread._thread.native_id] + [i.thread.native_id for i in version.batcher.instances]
    before, answered = [_thread_cpu_s(t) for t in tids], _answered(thread)
    window = _load(model, protocol, port, args.concurrency, args.window)
    used = [_thread_cpu_s(t) - b for t, b in zip(tids, before)]
    answered = _answered(thread) - answered
    loop_us, instance_us = 1e6 * used[0] / answered, 1e6 * sum(used[1:]) / answered
    print(f"{model} {protocol}: {answered} requests answered ({window} in the window: {window / args.window:.0f}/s); "
          f"server CPU us/request: loop {loop_us:.1f}, instance {instance_us:.1f}, both {loop_us + instance_us:.1f}",
          flush=True)
    if args.no_profile:
        return
    profiler = cProfile.Profile(time.thread_time_ns, 1e-9)
    thread.loop.call_soon_threadsafe(profiler.enable)
    answered = _answered(thread)
    _load(model, protocol, port, args.concurrency, args.window)
    profiled = _answered(thread) - answered
    finished = []
    thread.loop.call_soon_threadsafe(lambda: (profiler.disable(), finished.append(True)))
    while not finished:
        time.sleep(0.01)
    stats = pstats.Stats(profiler)
    if args.dump:
        stats.dump_stats(Path(args.dump) / f"{model}-{protocol}.prof")
    stages: dict[str, float] = {}
    for key, (_, _, tottime, _, _) in stats.stats.items():
        stages[_stage(key)] = stages.get(_stage(key), 0.0) + tottime
    total = sum(stages.values())
    print(f"| {model} | {protocol} | {profiled} | " + " | ".join(
        f"{100 * stages.get(s, 0.0) / total:.0f}%" for s, _ in STAGES + [("other", [])]) + f" | {total:.2f} |")
    if args.top:
        ranked = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:args.top]
        for (file, line, name), (_, calls, tottime, cumtime, _) in ranked:
            print(f"    {1e6 * tottime / profiled:8.2f} us/req  {calls / profiled:6.2f} calls/req  "
                  f"{_stage((file, line, name)):9s}  {Path(file).name}:{line}({name})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["image"], choices=["empty", "image", "hidden"])
    parser.add_argument("--protocols", nargs="+", default=["grpc", "http"], choices=["grpc", "http"])
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--window", type=float, default=3.0)
    parser.add_argument("--top", type=int, default=0, help="also print the N costliest functions of each row")
    parser.add_argument("--no-profile", action="store_true", help="the unprofiled run only (A/B of trees: run each "
                        "tree's copy of this script in turn)")
    parser.add_argument("--dump", help="a folder: each row's profile written there (MODEL-PROTOCOL.prof, pstats)")
    args = parser.parse_args()
    from kiln.serve import ServeOptions, ServerThread, instances

    instances.INLINE_NS = 0  # engine calls on the instance's thread, as on CUDA
    with open("/proc/loadavg") as f:
        print(f"load {f.read().split()[0]}, kiln at {ROOT}")
    for model in args.models:
        with tempfile.TemporaryDirectory(prefix="serve5-") as tmp:
            root = Path(tmp)
            write_repository(root, [model])
            thread = ServerThread(ServeOptions(repository=root, host="127.0.0.1", http_port=0, grpc_port=0,
                                               metrics_port=None))
            thread.start()
            try:
                print("| model | protocol | requests answered (profiled) | " + " | ".join(s for s, _ in STAGES) +
                      " | other | profiled CPU s |")
                for protocol in args.protocols:
                    _row(thread, model, protocol, args)
            finally:
                thread.stop()


if __name__ == "__main__":
    main()
