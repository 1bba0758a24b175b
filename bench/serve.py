"""Serving benchmark: kiln serve under a closed-loop load, with and without dynamic batching, over HTTP
(binary tensors) and gRPC, side by side in one run.

    python bench/serve.py                                   # empty model + MobileNetV2, CPU, c = 1 8 32 64
    python bench/serve.py --models bert_base --device cuda --concurrency 1 8 32 64 --window 5

For each model and batching mode, one `kiln serve` subprocess on 127.0.0.1 (free ports) serves a
repository written for the run; this process drives it with kiln.serve.perf (tritonclient's asyncio
clients). Besides the client's view (inferences/s, latency percentiles) the table shows the server's
own view from its statistics: mean time per request from arrival to answer, of it the engine's share,
and requests per engine call. "empty" is y = Identity(x): its latency is the server's (and the
client's) overhead. Prints a table and appends it to bench/results/serve-<date>.md with the machine,
the commit and the versions. The load generator shares the machine: on a small one its CPU time
lowers every number; read them as lower bounds.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
import kiln
from kiln.serve.perf import PerfOptions, PerfResult, sweep

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class Row:
    model: str
    batching: str
    protocol: str
    result: PerfResult
    server_us: float  # mean arrival -> answer inside the server
    engine_us: float  # mean engine time per request (its batch's compute)
    rows_per_call: float


def _empty_onnx(path: Path) -> None:
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "empty",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10), path)


def _model_onnx(name: str, folder: Path) -> Path:
    path = folder / f"{name}.onnx"
    if name == "empty":
        _empty_onnx(path)
        return path
    from kiln import zoo

    exported = zoo.export(name, dynamic=True)
    return exported.path


def _config(batching: bool, max_batch: int, delay_us: int, instances: int) -> str:
    text = f"max_batch_size: {max_batch}\ninstance_group [{{ count: {instances} }}]\n"
    if batching:
        text += f"dynamic_batching {{ max_queue_delay_microseconds: {delay_us} }}\n"
    return text


def _write_repository(root: Path, model: str, engine: Path, batching: bool, args) -> None:
    version = root / model / "1"
    version.mkdir(parents=True)
    shutil.copy(engine, version / "model.kiln")
    (root / model / "config.pbtxt").write_text(_config(batching, args.max_batch, args.delay_us, args.instances))


def _start(root: Path) -> tuple[subprocess.Popen, dict[str, int]]:
    process = subprocess.Popen(
        [sys.executable, "-m", "kiln", "serve", str(root), "--http-port", "0", "--grpc-port", "0",
         "--metrics-port", "-1", "--max-queue-size", "4096"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    ports, lines = {}, []
    for line in process.stdout:
        lines.append(line)
        found = re.match(r"kiln serve: (HTTP|gRPC) on [^:]+:(\d+)", line)
        if found:
            ports[found.group(1)] = int(found.group(2))
        if line.strip() == "kiln serve: ready":
            return process, ports
    process.kill()
    raise RuntimeError("kiln serve did not start:\n" + "".join(lines))


def _server_view(port: int, model: str) -> dict:
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
    stats = client.get_inference_statistics(model)["model_stats"][0]
    client.close()
    return stats


def _delta(after: dict, before: dict) -> tuple[float, float, float]:
    a, b = after["inference_stats"], before["inference_stats"]
    requests = a["success"]["count"] - b["success"]["count"]
    if not requests:
        return float("nan"), float("nan"), float("nan")
    server = (a["success"]["ns"] - b["success"]["ns"]) / requests / 1000
    engine = (a["compute_infer"]["ns"] - b["compute_infer"]["ns"]) / requests / 1000
    calls = after["execution_count"] - before["execution_count"]
    return server, engine, requests / calls if calls else float("nan")


def run(args) -> list[Row]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="kiln-bench-serve-") as tmp:
        tmp = Path(tmp)
        for model in args.models:
            onnx_path = _model_onnx(model, tmp)
            engine_path = tmp / f"{model}.kiln"
            print(f"building {model} ({args.device}, {args.precision}) ...", flush=True)
            profile = None
            if model != "empty" and model.startswith("bert"):
                profile = [{"input_ids": f"1x{args.seq},{args.max_batch}x{args.seq},{args.max_batch}x{args.seq}"}]
            options = {"device": args.device, "precision": args.precision}
            if profile:
                options["profiles"] = profile
            kiln.build(str(onnx_path), **options).save(engine_path)
            for batching in (True, False) if args.batching == "both" else (args.batching == "on",):
                root = tmp / f"repo-{model}-{batching}"
                _write_repository(root, model, engine_path, batching, args)
                process, ports = _start(root)
                try:
                    for protocol in args.protocols:
                        port = ports["HTTP"] if protocol == "http" else ports["gRPC"]
                        shapes = {"input_ids": [args.seq], "attention_mask": [args.seq]} if model.startswith("bert") \
                            else {}
                        for concurrency in args.concurrency:
                            before = _server_view(ports["HTTP"], model)
                            options = PerfOptions(model=model, url=f"127.0.0.1:{port}", protocol=protocol,
                                                  concurrency=[concurrency], shapes=shapes, warmup_s=args.warmup,
                                                  window_s=args.window)
                            (result,) = asyncio.run(sweep(options))
                            server_us, engine_us, per_call = _delta(_server_view(ports["HTTP"], model), before)
                            row = Row(model, "on" if batching else "off", protocol, result, server_us, engine_us,
                                      per_call)
                            rows.append(row)
                            print(_format(row), flush=True)
                finally:
                    process.terminate()
                    process.wait(60)
    return rows


HEADER = ("| model | batching | protocol | concurrency | infer/s | p50 ms | p90 ms | p99 ms | server us/req "
          "| engine us/req | requests/call | errors |")


def _format(row: Row) -> str:
    r = row.result
    return (f"| {row.model} | {row.batching} | {row.protocol} | {r.concurrency} | {r.throughput:.0f} "
            f"| {r.percentile(50) / 1000:.2f} | {r.percentile(90) / 1000:.2f} | {r.percentile(99) / 1000:.2f} "
            f"| {row.server_us:.0f} | {row.engine_us:.0f} | {row.rows_per_call:.1f} | {r.errors} |")


def _machine(args) -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                            check=False).stdout
    if args.device == "cuda":
        import torch

        device = torch.cuda.get_device_name()
    else:
        device = platform.processor() or platform.machine()
        try:
            with open("/proc/cpuinfo") as f:
                names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
            device = names[0] if names else device
        except OSError:
            pass
    import grpc
    import uvicorn

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"{datetime.datetime.now():%Y-%m-%d %H:%M}, {device}, {os.cpu_count()} CPUs (load {load:.1f} at the "
            f"end), commit {commit.strip()}, kiln {kiln.__version__}, python {platform.python_version()}, "
            f"grpcio {grpc.__version__}, uvicorn {uvicorn.__version__}; window {args.window} s, max_batch_size "
            f"{args.max_batch}, max_queue_delay {args.delay_us} us, {args.instances} instance(s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["empty", "mobilenet_v2"],
                        help="empty and/or zoo names (mobilenet_v2, bert_base, bert_tiny, resnet50...)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--protocols", nargs="+", default=["grpc", "http"], choices=["grpc", "http"])
    parser.add_argument("--batching", default="both", choices=["both", "on", "off"])
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--delay-us", type=int, default=0, help="max_queue_delay_microseconds (default 0)")
    parser.add_argument("--instances", type=int, default=1)
    parser.add_argument("--seq", type=int, default=128, help="BERT sequence length")
    parser.add_argument("--window", type=float, default=3.0, help="seconds measured per level")
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    print(HEADER)
    print("|---" * (HEADER.count("|") - 1) + "|")
    rows = run(args)
    machine = _machine(args)
    print(machine)
    if not args.no_save:
        RESULTS.mkdir(exist_ok=True)
        out = RESULTS / f"serve-{datetime.date.today():%Y-%m-%d}.md"
        with open(out, "a") as f:
            f.write(f"\n## kiln serve, {machine}\n\n{HEADER}\n" + "|---" * (HEADER.count("|") - 1) + "|\n")
            f.write("\n".join(_format(r) for r in rows) + "\n")
        print(f"written to {out}")


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
