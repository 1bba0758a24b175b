"""A model's instances: execution contexts of one engine, each with its own thread and, on CUDA,
its own stream.

An instance's thread takes a batch from its queue, runs it and hands the result back to the event
loop with call_soon_threadsafe: one wake-up each way, no executor futures in between.

On CUDA each instance runs its context on its own `torch.cuda.Stream` (set as the thread's current
stream), so the instances of a model overlap on the GPU: one copies its inputs in while another
computes. An instance waits for its own stream before answering, so no request is answered before
its own work is done, and no instance waits for another's.

How it waits (cuda_sync: the model's parameter, else `kiln serve --cuda-sync`): "spin" (the default) lets the
runtime hand the outputs back as host arrays, a copy that waits for the stream, then synchronizes the stream; both
wait as CUDA schedules the process ("auto": spinning while the host has more cores than busy contexts). On the H200
(MobileNetV2, 8 front ends) the 2 instance threads so used ~1.1 cores while their calls kept the GPU busy: ~270-300
us of the host's CPU a request, a third of the server's (bench/results/serve5-2026-12-05c.md, section 3).
"blocking" feeds the runtime host tensors, so its outputs stay on the GPU; they are copied into pinned host memory
on the stream, and the thread sleeps on a torch.cuda.Event(blocking=True) recorded after the copies until the GPU
signals it: a wake-up's latency instead of a spinning core. The runtime's copies of the inputs to the GPU still wait
as CUDA schedules them (briefly: nothing else is queued on the stream then).
"pinned" makes blocking's copies and spin's wait (the stream synchronized): the runtime's copy of its outputs to the
host (spin) goes to pageable memory, which the driver stages through its own pinned buffer, a host copy that grows
with the batch (BERT-base's [64, 128, 768] FP32 answer: 25 MB a call); pinned, the copy is the GPU's DMA alone
(issue 14: bench/gpu_s30b.sh compares spin and pinned).
"staged" is spin's path (numpy in, numpy out, the runtime's copies) with the context's host staging on
(kiln/runtime/host_staging.py): the inputs and outputs cross through pinned buffers the context owns, with one
asynchronous copy each and one wait per call, the GIL released while waiting; the answers are arrays over pinned
blocks of torch's caching host allocator (host staging "pinned": the server copies them once more into its reply or
the front end's frame and drops them). Its "copy" mode, fresh pageable arrays as spin's, was slower than spin's own
copies on the H100 (BERT-base 12 rows 1.74 vs 1.52 ms a call: the fresh pages), "pinned" faster (1.21 ms; two
contexts at once 927-939 calls/s against spin's 573-651: bench/results/serve-overlap-2026-12-07.md).
Spin's pageable copies are what two instances were measured not to overlap through (H100, BERT-base: two contexts
together no faster than one, bench/results/serve-overlap-2026-12-07.md); bench/gpu_s31d.sh compares the two.

CUDA graphs and threads: the runtime captures a graph the second time a context meets an input
signature, and a capture (torch's default, global mode) forbids calls that may synchronize — a
cudaMalloc, a copy to the host — on every thread of the process while it lasts; another instance
running then would fail, or break the capture. So runs share the GPU through one gate per process:
a run that may capture runs alone; the others run side by side. At load, each CUDA instance runs
the profile's shape buckets (ExecutionContext.warm_up), alone, capturing their graphs; when that
covers every shape the engine takes (one profile, each dynamic dim bucketed or fixed), serving
captures nothing and every run is shared. Otherwise an instance's first two runs of an input
signature run alone, and so does every run after the runtime evicted a graph. Each instance's context captures on a
stream of its own (kiln/runtime/capture_streams.py): graphs captured by one thread on one stream share torch's cuBLAS
workspace, and two instances' graphs replayed side by side on one workspace corrupt each other's GEMMs (issue 14).

CPU warm-up: a CPU engine of dynamic shapes binds each new input shape (shape values, native segment
views) at its first calls, or runs it padded in a bound one (kiln/runtime/first_calls.py). Made with
`warm_up_s` seconds, a CPU instance binds the profile's host shapes (at most 25% padding per dim) before
its model is ready, smallest work first, for at most that long: a request at a new shape that fits a bound host
then runs padded in it (or bound), not binding; past the hosts the cap left unbound, shapes bind as before. `warmed_up` (ExecutionContext.WarmUp) says what it did; the model's stats and the
log ("kiln.serve", info) report it.

Tiny CPU calls: handing a batch to a thread and back costs two thread wake-ups and the loop's
polling for the answer (tens of microseconds of CPU, far more wall time on a loaded machine), and the
thread's Python competes with the event loop for the GIL. A CPU instance whose calls take less than
INLINE_NS of CPU time (a moving average, after INLINE_AFTER calls) runs its batches on the loop
itself; a slower call lifts the average and sends the instance back to its thread. On a 2-core VM
this halved the CPU time per request of an empty model at concurrency 1 (bench/serve_overhead.py
--inproc). A call inline holds the loop for its duration: at most about INLINE_NS.

What a call cost (the batcher's call phases, kiln/serve/stats.py CallPhases): after each call `cpu_ns` holds the
thread's CPU time in it and, on CUDA, `gpu_ns` its span on the instance's stream between two timing events recorded
before and after it (the copies in and out included; read once the stream is done, so it costs no wait); where this
thread copies the outputs to the host itself (pinned, blocking), `copy_out_ns` the span of those copies (a third
event between the network and them); and `graph_counts`, what the runtime's CUDA graph cache did in it (GraphCounts:
graphs replayed, captured, runs eager, batches split into bucket-sized chunks: its GraphStats read before and after
the call, on this instance's own context, so no other instance's runs count). `warm_up_graphs` lists the input
shapes whose graphs the CUDA warm-up left captured (graph_report: the stats' "cuda_graphs", issue 14).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch

from kiln import Engine
from kiln.ir import dtypes
from kiln.runtime.engine import WarmUp
from kiln.serve.config import CUDA_SYNC_DEFAULT

log = logging.getLogger("kiln.serve")

# CPU calls averaging less CPU time than this run on the event loop: about what a hand-off to the thread
# and back cost the process on a 2-core VM (in-process, an empty model: 360-440 us of CPU per request
# through the thread, 190-216 us inline), so an inline call costs no more CPU than the hand-off it saves
INLINE_NS = 200_000
INLINE_AFTER = 16  # calls measured first (the first calls of a shape bind and allocate: they are slow)


class GpuGate:
    """Runs side by side (shared) or one alone (exclusive), the exclusive ones first in line."""

    def __init__(self):
        self._lock = threading.Condition()
        self._running = 0
        self._alone = False
        self._waiting = 0  # exclusive runs waiting: shared ones hold back for them

    @contextlib.contextmanager
    def shared(self, wait: bool = True) -> Iterator[bool]:
        """Yields True inside a shared turn; with wait=False, False at once while an exclusive run holds
        or waits (the event loop reading GPU gauges must not stall behind a warm-up)."""
        with self._lock:
            entered = wait or not (self._alone or self._waiting)
            if entered:
                while self._alone or self._waiting:
                    self._lock.wait()
                self._running += 1
        try:
            yield entered
        finally:
            if entered:
                with self._lock:
                    self._running -= 1
                    if not self._running:
                        self._lock.notify_all()

    @contextlib.contextmanager
    def alone(self) -> Iterator[None]:
        with self._lock:
            self._waiting += 1
            while self._alone or self._running:
                self._lock.wait()
            self._waiting -= 1
            self._alone = True
        try:
            yield
        finally:
            with self._lock:
                self._alone = False
                self._lock.notify_all()


GATE = GpuGate()  # one per process: a capture constrains every thread of it


class GraphCounts(NamedTuple):
    """What a context's CUDA graph cache did over a span of its runs (GraphStats' counters, after minus before)."""

    replays: int = 0
    captures: int = 0
    eager: int = 0  # runs of the network not from a graph: a signature's first run, one that cannot be captured
    splits: int = 0  # runs whose batch ran as several bucket-sized chunks (each chunk a replay, or eager)

    @staticmethod
    def of(stats: Any) -> GraphCounts:
        return GraphCounts(stats.replays, stats.captures, stats.eager_runs, stats.split_runs)

    def since(self, before: GraphCounts) -> GraphCounts:
        return GraphCounts(self[0] - before[0], self[1] - before[1], self[2] - before[2], self[3] - before[3])


def _shape_label(key: tuple) -> str:
    """A graph cache key (GraphRunner._key: (shape, dtype) per input) as its inputs' shapes: "16x128,16x128"; a
    padding-free engine's plain program marked "plain:"."""
    parts, plain = [], False
    for item in key:
        if item == ("other program",):
            plain = True
        elif isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], tuple):
            parts.append("x".join(map(str, item[0])) or "scalar")
    return ("plain:" if plain else "") + ",".join(parts)


class Instance:
    """One execution context and the thread (and CUDA stream) that runs it."""

    def __init__(self, engine: Engine, name: str, index: int, run: Callable, finish: Callable,
                 buckets: bool | None = None, warm_up: bool = True, warm_up_s: float | None = None,
                 cuda_sync: str = CUDA_SYNC_DEFAULT, batch_buckets: str | None = None):
        self.index = index
        self.cuda = engine.device.type == "cuda"
        # cuda_sync "staged": spin's numpy calls, their copies through pinned buffers, the answers pinned arrays
        # (the other modes "off", as measured: spin's pageable copies, pinned/blocking's own copy to pinned memory)
        staging = "pinned" if self.cuda and cuda_sync == "staged" else "off"
        # batch_buckets: the batch's buckets where the context pads (kiln/runtime/buckets.py; None: the runtime's default)
        self.context = engine.create_execution_context(buckets=buckets, batch_buckets=batch_buckets,
                                                       host_staging=staging)
        self.stream = torch.cuda.Stream(device=engine.device) if self.cuda else None
        # cuda_sync "blocking": the event this instance's thread sleeps on (None: spin, or a CPU instance)
        self.done = torch.cuda.Event(blocking=True) if self.cuda and cuda_sync == "blocking" else None
        self.pinned = self.cuda and cuda_sync in ("pinned", "blocking")  # outputs copied to pinned host memory
        self.calls = 0  # engine calls run (tests: which instances served)
        self._seen: dict[tuple, int] = {}  # CUDA: runs per input signature (captures happen in the first two)
        self._evictions = 0
        self.captured_all = False  # CUDA: warm-up captured a graph for every shape the engine takes
        self._call_ns = float(INLINE_NS)  # CPU: moving average of a call's CPU time (this thread's)
        self.cpu_ns = 0  # the last call's CPU time on its thread
        self.gpu_ns: int | None = None  # CUDA: the last call's span on the stream (None: not measured)
        self.copy_out_ns: int | None = None  # CUDA, pinned or blocking: of it, the outputs' copies to the host
        self.graph_counts: GraphCounts | None = None  # CUDA: what the last call's graph cache did (None: no runner)
        self.warm_up_graphs: list[str] = []  # CUDA: the input shapes whose graphs warm-up left captured
        self.warm_up_eager: dict[str, str] = {}  # CUDA: shapes warm-up ran that stay eager, and why
        # timing events: the call's start, its outputs ready on the GPU (pinned, blocking), its end
        self._span = tuple(torch.cuda.Event(enable_timing=True) for _ in range(3)) if self.cuda else None
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._run, self._finish = run, finish
        self.warmed_up: WarmUp | None = None  # what the CPU warm-up did (None: none ran)
        if self.cuda and warm_up:
            self.warm_up()
        elif not self.cuda and warm_up and warm_up_s is not None:
            self.warm_up_cpu(name, warm_up_s)
        self.thread = threading.Thread(target=self._serve, name=f"kiln-{name}-{index}", daemon=True)
        self.thread.start()

    @property
    def inline(self) -> bool:
        """Run this instance's next batch on the event loop (a CPU engine whose calls are tiny)."""
        return not self.cuda and self.calls > INLINE_AFTER and self._call_ns < INLINE_NS

    def warm_up(self) -> None:
        """CUDA: capture the graphs of the profile's shape buckets now, alone, on this instance's stream."""
        with GATE.alone(), torch.cuda.stream(self.stream):
            try:
                self.context.warm_up()
                self.context.warm_up()  # replays, or captures what the first pass left (the runtime's choice)
                self.captured_all = self._covers_every_shape()
            except Exception as e:  # noqa: BLE001 - serving still works; first requests then capture
                log.warning("instance %d: warm-up failed (%s: %s); graphs are captured on first requests",
                            self.index, type(e).__name__, str(e).splitlines()[0][:200])
            self.stream.synchronize()
        runner = self.context.runner
        self._evictions = runner.stats.evictions if runner is not None else 0
        if runner is not None:
            self.warm_up_graphs = [_shape_label(k) for k, e in runner.entries.items() if e.graph is not None]
            self.warm_up_eager = {_shape_label(k): e.reason for k, e in runner.entries.items() if e.graph is None}
            log.info("instance %d: warm-up captured %d graph(s) (%s)%s%s", self.index, len(self.warm_up_graphs),
                     " ".join(self.warm_up_graphs), "; eager: " + "; ".join(
                         f"{k}: {r}" for k, r in self.warm_up_eager.items()) if self.warm_up_eager else "",
                     "" if self.captured_all else "; not every shape the engine takes (runs capture while serving)")

    def graph_report(self) -> dict | None:
        """CUDA: what warm-up captured and the context's graph cache now (the model stats' "cuda_graphs"); None for
        an instance without a graph runner. Read from the event loop while the thread runs: plain ints."""
        runner = self.context.runner if self.cuda else None
        if runner is None:
            return None
        s = runner.stats
        return {"instance": self.index, "use_graphs": bool(runner.use_graphs), "captured_all": self.captured_all,
                "warm_up_captured": list(self.warm_up_graphs), "warm_up_eager": dict(self.warm_up_eager),
                "graphs": s.graphs, "graph_bytes": s.graph_bytes, "captures": s.captures, "replays": s.replays,
                "eager_runs": s.eager_runs, "split_runs": s.split_runs, "evictions": s.evictions}

    def warm_up_cpu(self, name: str, seconds: float) -> None:
        """CPU: bind the profile's host shapes now, for at most `seconds` (ExecutionContext.warm_up)."""
        try:
            self.context.warm_up(seconds=seconds)
        except Exception as e:  # noqa: BLE001 - serving still works; first requests then bind
            log.warning("model %r instance %d: warm-up failed (%s: %s); new shapes bind at their first requests",
                        name, self.index, type(e).__name__, str(e).splitlines()[0][:200])
            return
        self.warmed_up = self.context.warmed_up
        if self.warmed_up is not None:
            log.info("model %r instance %d: %s", name, self.index, self.warmed_up.describe())

    def _covers_every_shape(self) -> bool:
        """Whether warm_up() ran every shape the engine takes: one profile, whose every dynamic dim is
        bucketed (warm_up ran each bucket) or fixed (min = max), with CUDA graphs on."""
        engine, runner, buckets = self.context.engine, self.context.runner, self.context.buckets
        if runner is None or not runner.use_graphs or len(engine.profiles) != 1:
            return False
        profile = engine.profiles[0]
        for b in engine.inputs:
            r = profile.inputs.get(b.name)
            for axis, d in enumerate(b.shape or []):
                if isinstance(d, str) and not (buckets is not None and d in buckets.symbols) \
                        and (r is None or r.min[axis] != r.max[axis]):
                    return False
        return True

    def execute(self, feeds: dict[str, Any]) -> dict[str, Any]:
        """One engine call in the calling thread; on CUDA, on this instance's stream and done when it returns."""
        self.calls += 1
        if not self.cuda:
            start = time.thread_time_ns()  # CPU time: a call preempted on a busy machine is not a slow call
            outputs = self.context.run(feeds)
            self.cpu_ns = time.thread_time_ns() - start
            self._call_ns += (self.cpu_ns - self._call_ns) / 8
            return outputs
        start = time.thread_time_ns()
        key, seen = None, 2
        if not self.captured_all:
            key = tuple((tuple(v.shape), str(v.dtype)) for v in feeds.values())
            seen = self._seen.get(key, 0)
        self.gpu_ns = self.copy_out_ns = self.graph_counts = None
        runner = self.context.runner
        before = GraphCounts.of(runner.stats) if runner is not None else None
        with GATE.alone() if seen < 2 else GATE.shared(), torch.cuda.stream(self.stream):
            self._span[0].record(self.stream)
            outputs = self._run_pinned(feeds) if self.pinned else self._run_spinning(feeds)
            self.gpu_ns = self._span_ns(0, 2)
            if self.pinned:
                self.copy_out_ns = self._span_ns(1, 2)
        self.cpu_ns = time.thread_time_ns() - start
        self.graph_counts = GraphCounts.of(runner.stats).since(before) if runner is not None else None
        if runner is not None and runner.stats.evictions != self._evictions:
            self._evictions = runner.stats.evictions
            self.captured_all = False  # an evicted signature captures again: run alone until seen twice more
            self._seen.clear()
        elif seen < 2:
            if len(self._seen) >= 4096:
                self._seen.clear()
            self._seen[key] = seen + 1
        return outputs

    def _span_ns(self, first: int, last: int) -> int | None:
        """The last call's span on the stream between two of its timing events (done: the call waited for its
        stream); None where the events cannot say."""
        try:
            return int(self._span[first].elapsed_time(self._span[last]) * 1e6)
        except RuntimeError:
            return None

    def _run_spinning(self, feeds: dict[str, Any]) -> dict[str, Any]:
        outputs = self.context.run(feeds)  # host arrays in, host arrays out: the runtime waits for the copies
        self._span[2].record(self.stream)
        self.stream.synchronize()
        return outputs

    def _run_pinned(self, feeds: dict[str, Any]) -> dict[str, Any]:
        """The call's outputs left on the GPU, copied to pinned host memory on the stream (torch's caching host
        allocator: blocks come back once no answer's array views them), waited for asleep (blocking) or by
        synchronizing the stream (pinned)."""
        outputs = self.context.run({name: dtypes.numpy_to_torch(array) for name, array in feeds.items()})
        self._span[1].record(self.stream)
        host = {name: tensor.to("cpu", non_blocking=True) for name, tensor in outputs.items()}  # pinned
        self._span[2].record(self.stream)
        if self.done is not None:
            self.done.record(self.stream)
            self.done.synchronize()
        else:
            self.stream.synchronize()
        return {name: dtypes.torch_to_numpy(tensor) for name, tensor in host.items()}

    def submit(self, loop: asyncio.AbstractEventLoop, work: tuple) -> None:
        """`work`: the batch first, then what its `finish` callback wants back with it."""
        self._work.put((loop, work))

    def stop(self) -> None:
        """Tell the thread to end (after the batches submitted before); `stopped` says when it has."""
        self._work.put(None)

    @property
    def stopped(self) -> bool:
        return not self.thread.is_alive()

    def _serve(self) -> None:
        if self.cuda:
            torch.cuda.set_stream(self.stream)
        while (item := self._work.get()) is not None:
            loop, work = item
            try:
                result = self._run(self, work[0])
            except BaseException as e:  # noqa: BLE001 - handed to every waiting caller
                result = e
            try:
                loop.call_soon_threadsafe(self._finish, self, work, result)
            except RuntimeError:  # the loop is closed: nobody waits any more
                return
            # the batch and its outputs are the loop's now: held here they would stay alive until the next batch, and
            # the last batch's would be freed as this thread ends, perhaps inside torch while the interpreter finalizes
            # (kiln/kernels/cpu/onednn_ahead.py's docstring: that aborts the process)
            item = loop = work = result = None
