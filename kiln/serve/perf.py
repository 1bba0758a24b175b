"""A load generator in the spirit of Triton's perf_analyzer: closed-loop concurrency over HTTP or gRPC.

At concurrency N, N clients each keep one request outstanding (the next one leaves when the
previous answers) for a measurement window after a warm-up; every request's latency is kept.
Two clients (`client`):
- "wire" (the default): kiln/serve/perf_wire.py, requests encoded once and written on raw sockets, one
  epoll loop per process, every answer checked against its own request; a few tens of us of client
  CPU a request.
- "tritonclient": tritonclient's asyncio clients (the compatibility path, JSON tensors included), ~700-800
  us of client CPU a request: on a fast server the load generator is the limit.
Either runs on one loop here or, with `processes` > 1, spread over that many worker processes measuring the
same wall-clock window. Inputs are random, shaped from the model's metadata. Every client has its own
connection (gRPC channels too: grpc shares one connection between a process's channels to a target unless
told not to; the wire client's `streams` > 1 puts that many calls on a connection), so a server's
connections, and a `kiln serve --frontends N`'s processes, see the whole load.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import time
from collections.abc import Callable
from concurrent.futures import Executor, ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial

import numpy as np

from kiln.errors import KilnError
from kiln.serve.perf_wire import VARIANTS, Plan, make_plan, run_share

log = logging.getLogger("kiln.serve")


# a connection of its own per gRPC client (its own subchannel pool), with tritonclient's message size limits
GRPC_CHANNEL_ARGS = [("grpc.max_send_message_length", 2**31 - 1), ("grpc.max_receive_message_length", 2**31 - 1),
                     ("grpc.use_local_subchannel_pool", 1)]


@dataclass
class PerfOptions:
    model: str
    url: str = ""  # default localhost:8000 (http) / localhost:8001 (grpc)
    protocol: str = "http"  # http | grpc
    version: str = ""
    concurrency: list[int] = field(default_factory=lambda: [1])
    batch_size: int = 1
    shapes: dict[str, list[int]] = field(default_factory=dict)  # sizes for -1 dims past the batch axis
    binary: bool = True  # HTTP: binary tensor data (else JSON)
    warmup_s: float = 0.5
    window_s: float = 2.0
    max_requests: int | None = None  # per concurrency level (after warm-up): stop early
    seed: int = 0
    processes: int = 1  # client processes sharing each level's concurrency
    client: str = "wire"  # wire | tritonclient
    streams: int = 1  # wire, gRPC: calls in flight on one connection
    full_every: int = 8  # wire: every n-th answer checked in full (the others: sampled values)

    @property
    def address(self) -> str:
        return self.url or ("localhost:8000" if self.protocol == "http" else "localhost:8001")


@dataclass
class PerfResult:
    concurrency: int
    requests: int
    errors: int
    seconds: float
    latencies_us: list[float]
    batch_size: int = 1
    first_error: str = ""
    wrong: int = 0  # answers not matching their own request (the wire client's check)
    checked: int = 0  # answers checked
    client_cpu_s: float = float("nan")  # the client processes' CPU time over the window (wire client)

    @property
    def throughput(self) -> float:
        """Inferences (rows) per second."""
        return self.requests * self.batch_size / self.seconds if self.seconds else 0.0

    def percentile(self, q: float) -> float:
        return float(np.percentile(self.latencies_us, q)) if self.latencies_us else float("nan")

    def to_json(self) -> dict:
        return {"concurrency": self.concurrency, "requests": self.requests, "errors": self.errors,
                "seconds": self.seconds, "batch_size": self.batch_size, "throughput_infer_per_s": self.throughput,
                "wrong": self.wrong, "checked": self.checked, "client_cpu_s": self.client_cpu_s,
                **{f"p{q}_us": self.percentile(q) for q in (50, 90, 95, 99)},
                "mean_us": float(np.mean(self.latencies_us)) if self.latencies_us else float("nan")}


def _inputs(options: PerfOptions, metadata: dict, rng: np.random.Generator,
            batched: bool) -> list[tuple[str, str, np.ndarray]]:
    """A request's inputs (name, datatype, random values), shaped from the model's metadata and options.shapes."""
    inputs = []
    for tensor in metadata["inputs"]:
        shape = list(tensor["shape"])
        if batched:
            shape[0] = options.batch_size
        given = options.shapes.get(tensor["name"])
        rest = shape[1:] if batched else shape
        if given is not None:
            if len(given) != len(rest):
                raise KilnError(f"--shape {tensor['name']}: {len(given)} dims given, the input has {len(rest)} "
                                f"past the batch axis ({tensor['shape']})")
            rest = given
        rest = [1 if d < 0 else d for d in rest]
        shape = ([shape[0]] if batched else []) + rest
        inputs.append((tensor["name"], tensor["datatype"], _random(tensor["datatype"], shape, tensor["name"], rng)))
    return inputs


class _Client:
    """tritonclient's client with the request prepared once: `await infer()` sends it."""

    def __init__(self, options: PerfOptions, metadata: dict, rng: np.random.Generator, batched: bool):
        self.options = options
        self.inputs = []
        if options.protocol == "http":
            import tritonclient.http.aio as client_module
        else:
            import tritonclient.grpc.aio as client_module
        self.module = client_module
        if options.protocol == "http":
            self.client = client_module.InferenceServerClient(options.address)
        else:
            self.client = client_module.InferenceServerClient(options.address, channel_args=GRPC_CHANNEL_ARGS)
        for name, datatype, data in _inputs(options, metadata, rng, batched):
            tensor_input = client_module.InferInput(name, list(data.shape), datatype)
            if options.protocol == "http":
                tensor_input.set_data_from_numpy(data, binary_data=options.binary)
            else:
                tensor_input.set_data_from_numpy(data)
            self.inputs.append(tensor_input)

    async def infer(self) -> None:
        await self.client.infer(self.options.model, self.inputs, model_version=self.options.version)

    async def close(self) -> None:
        await self.client.close()


def _random(datatype: str, shape: list[int], name: str, rng: np.random.Generator) -> np.ndarray:
    from tritonclient.utils import triton_to_np_dtype

    dtype = triton_to_np_dtype(datatype)
    if datatype == "BYTES":
        return np.array([b"kiln"] * int(np.prod(shape)), dtype=object).reshape(shape)
    if datatype == "BOOL":
        return rng.random(shape) < 0.5
    if np.dtype(dtype).kind in "iu":
        if "mask" in name.lower():
            return np.ones(shape, dtype)  # an attention mask keeps every token
        return rng.integers(0, 100, shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


async def _metadata(options: PerfOptions) -> tuple[dict, bool]:
    if options.protocol == "http":
        import tritonclient.http.aio as client_module
    else:
        import tritonclient.grpc.aio as client_module
    client = client_module.InferenceServerClient(options.address)
    try:
        if options.protocol == "http":
            metadata = await client.get_model_metadata(options.model, options.version)
            config = await client.get_model_config(options.model, options.version)
        else:
            metadata = await client.get_model_metadata(options.model, options.version, as_json=True)
            config = (await client.get_model_config(options.model, options.version, as_json=True))["config"]
    finally:
        await client.close()
    metadata["inputs"] = [{**t, "shape": [int(d) for d in t["shape"]]} for t in metadata["inputs"]]
    return metadata, int(config.get("max_batch_size", 0)) > 0


WindowHook = Callable[[str], None]  # called with "start" and "end" of each level's measured window


async def _level(options: PerfOptions, metadata: dict, batched: bool, concurrency: int,
                 begin_at: float | None = None, hook: WindowHook | None = None) -> PerfResult:
    """One level in this process; `begin_at` (time.time()): when the window starts (else after the warm-up)."""
    rng = np.random.default_rng(options.seed)
    clients = [_Client(options, metadata, rng, batched) for _ in range(concurrency)]
    latencies: list[float] = []
    errors = [0]
    first_error = [""]
    counting = [False]
    stop_at = [float("inf")]
    done = asyncio.Event()

    async def worker(client: _Client) -> None:
        while time.perf_counter() < stop_at[0] and not done.is_set():
            t0 = time.perf_counter()
            try:
                await client.infer()
            except Exception as e:  # noqa: BLE001 - counted and reported; the sweep goes on
                if counting[0]:
                    errors[0] += 1
                    first_error[0] = first_error[0] or str(e)
                continue
            if counting[0]:
                latencies.append((time.perf_counter() - t0) * 1e6)
                if options.max_requests and len(latencies) >= options.max_requests:
                    done.set()

    try:
        tasks = [asyncio.create_task(worker(c)) for c in clients]
        if begin_at is not None and time.time() > begin_at - options.warmup_s / 2:
            raise KilnError(f"a client process was ready {time.time() - begin_at + options.warmup_s:.1f} s after "
                            "its level's warm-up began (a busy machine?): use fewer --processes")
        await asyncio.sleep(options.warmup_s if begin_at is None else max(0.0, begin_at - time.time()))
        if hook is not None:
            hook("start")
        counting[0] = True
        start = time.perf_counter()
        stop_at[0] = start + options.window_s
        try:
            await asyncio.wait_for(done.wait(), options.window_s)
        except TimeoutError:
            pass
        counting[0] = False
        seconds = time.perf_counter() - start
        if hook is not None:
            hook("end")
        stop_at[0] = 0
        await asyncio.gather(*tasks)
    finally:
        for c in clients:
            await c.close()
    return PerfResult(concurrency, len(latencies), errors[0], seconds, latencies,
                      options.batch_size if batched else 1, first_error[0])


def _level_in_process(options: PerfOptions, metadata: dict, batched: bool, k: int, concurrency: int,
                      begin_at: float) -> PerfResult:
    """Worker k's share of a level: tritonclient's clients."""
    return asyncio.run(_level(replace(options, seed=options.seed + k), metadata, batched, concurrency, begin_at))


def _wire_share(plan: Plan, options: PerfOptions, batched: bool, level: int, k: int, concurrency: int,
                begin_at: float) -> PerfResult:
    """Worker k's share (`concurrency` of the level's `level` clients) of a level: the wire client."""
    limit = options.max_requests and -(-options.max_requests * concurrency // level)  # its share of max_requests
    share = run_share(plan, concurrency, begin_at, options.window_s, limit)
    return PerfResult(concurrency, share.requests, share.errors, share.seconds, share.latencies_us.tolist(),
                      options.batch_size if batched else 1, share.first_error, share.wrong, share.checked,
                      share.cpu_s)


def _get_ready(options: PerfOptions) -> None:
    """In each worker process, before the first level: the client modules imported."""
    if options.client == "wire":
        import tritonclient.grpc.service_pb2  # noqa: F401
    elif options.protocol == "http":
        import tritonclient.http.aio  # noqa: F401
    else:
        import tritonclient.grpc.aio  # noqa: F401
    time.sleep(0.5)  # held, so that each worker of the pool takes one of these


async def _spread_level(options: PerfOptions, concurrency: int, executor: Executor | None, processes: int,
                        hook: WindowHook | None, share: Callable[..., PerfResult]) -> PerfResult:
    """One level over workers (processes, or a thread here when `executor` is None): each takes a share of the
    clients, `share(k, clients, begin_at)`, all measure one window."""
    shares = [concurrency // processes + (k < concurrency % processes) for k in range(processes)]
    shares = [n for n in shares if n]
    begin_at = time.time() + options.warmup_s + 1.0  # + the workers' set-up (clients, connections)
    loop = asyncio.get_running_loop()
    futures = [loop.run_in_executor(executor, share, k, n, begin_at) for k, n in enumerate(shares)]
    if hook is not None:
        await asyncio.sleep(max(0.0, begin_at - time.time()))
        hook("start")
        await asyncio.sleep(options.window_s)
        hook("end")
    parts = await asyncio.gather(*futures)
    return PerfResult(concurrency, sum(p.requests for p in parts), sum(p.errors for p in parts),
                      max(p.seconds for p in parts), [x for p in parts for x in p.latencies_us],
                      parts[0].batch_size, next((p.first_error for p in parts if p.first_error), ""),
                      sum(p.wrong for p in parts), sum(p.checked for p in parts),
                      sum(p.client_cpu_s for p in parts))


async def _wire_plan(options: PerfOptions, metadata: dict, batched: bool) -> Plan:
    """The wire client's requests (VARIANTS of them, distinct random inputs) and their answers alone."""
    rng = np.random.default_rng(options.seed)
    inputs = [_inputs(options, metadata, rng, batched) for _ in range(VARIANTS)]
    plan = await asyncio.to_thread(make_plan, options.protocol, options.address, options.model, options.version,
                                   inputs, options.streams, options.full_every)
    for warning in plan.warnings:
        log.warning("kiln perf: %s", warning)
    return plan


async def sweep(options: PerfOptions, on_result=None, hook: WindowHook | None = None,
                executor: Executor | None = None) -> list[PerfResult]:
    """Measure every concurrency level in turn; `on_result(result)` as each finishes, `hook("start")` and
    `hook("end")` around each measured window. With options.processes > 1 the levels run in worker
    processes (`executor`, or a pool made for this sweep)."""
    if options.client not in ("wire", "tritonclient"):
        raise KilnError(f"client {options.client!r}: expected wire or tritonclient")
    if options.client == "wire" and options.protocol == "http" and not options.binary:
        raise KilnError("the wire client sends binary tensors: JSON tensors need --client tritonclient")
    metadata, batched = await _metadata(options)
    plan = await _wire_plan(options, metadata, batched) if options.client == "wire" else None
    own = None
    if options.processes > 1 and executor is None:
        executor = own = ProcessPoolExecutor(options.processes, mp_context=multiprocessing.get_context("spawn"))
    results = []
    try:
        if options.processes > 1:
            loop = asyncio.get_running_loop()
            await asyncio.gather(*[loop.run_in_executor(executor, _get_ready, options)
                                   for _ in range(options.processes)])
        for concurrency in options.concurrency:
            processes = min(options.processes, concurrency)
            if plan is not None:
                result = await _spread_level(options, concurrency, executor if processes > 1 else None, processes,
                                             hook, partial(_wire_share, plan, options, batched, concurrency))
            elif processes > 1:
                result = await _spread_level(options, concurrency, executor, processes, hook,
                                             partial(_level_in_process, options, metadata, batched))
            else:
                result = await _level(options, metadata, batched, concurrency, hook=hook)
            results.append(result)
            if on_result is not None:
                on_result(result)
    finally:
        if own is not None:
            own.shutdown()
    return results


def plot(results: list[PerfResult], path: str, title: str) -> None:
    """Throughput against p50/p99 latency, one point per concurrency level, as a PNG (Pillow)."""
    try:
        from PIL import Image, ImageDraw
    except ImportError:
        raise KilnError("--plot needs Pillow: pip install pillow") from None
    width, height, pad = 720, 480, 60
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    xs = [r.percentile(99) / 1000 for r in results] + [r.percentile(50) / 1000 for r in results]
    ys = [r.throughput for r in results]
    x_max = max(xs) * 1.1 if xs and max(xs) > 0 else 1.0
    y_max = max(ys) * 1.1 if ys and max(ys) > 0 else 1.0

    def at(x: float, y: float) -> tuple[float, float]:
        return pad + x / x_max * (width - 2 * pad), height - pad - y / y_max * (height - 2 * pad)

    draw.line([at(0, 0), at(x_max, 0)], fill="black")
    draw.line([at(0, 0), at(0, y_max)], fill="black")
    for k in range(5):
        x, y = x_max * k / 4, y_max * k / 4
        draw.text((at(x, 0)[0] - 10, height - pad + 8), f"{x:.1f}", fill="black")
        draw.text((4, at(0, y)[1] - 6), f"{y:.0f}", fill="black")
    draw.text((width / 2 - 60, height - 24), "latency (ms)", fill="black")
    draw.text((4, 8), f"{title}: inferences/s vs latency (blue p50, red p99)", fill="black")
    for key, color in ((50, "blue"), (99, "red")):
        points = [at(r.percentile(key) / 1000, r.throughput) for r in results]
        if len(points) > 1:
            draw.line(points, fill=color, width=2)
        for (x, y), r in zip(points, results):
            draw.ellipse([x - 3, y - 3, x + 3, y + 3], fill=color)
            draw.text((x + 5, y - 12), f"c={r.concurrency}", fill=color)
    image.save(path)
