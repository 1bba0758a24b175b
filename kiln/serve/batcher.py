"""The dynamic batcher: a model's bounded queue, merged into engine calls on its instances.

Requests wait in one FIFO per model (bounded: a full queue refuses at once with QueueFull, the
caller's 429 / RESOURCE_EXHAUSTED). When an instance (one ExecutionContext, one thread) is idle,
the batcher takes the oldest request and the queued requests that can share its engine call:
the same shape past the batch axis, rows adding up to no more than the model's max batch and a
batch size some optimization profile holds. It waits for more only while the oldest has waited
less than max_queue_delay and the batch is short of the largest preferred size. A merged batch is
concatenated along axis 0, padded up to a size a profile holds when it falls between profiles
(the padding rows repeat the last real row, so they compute nothing unusual, and are dropped),
run, and split back by row offsets: each request gets exactly its own rows. A batch that fails
is rerun request by request, so one request's failure is never another's.

Phases: every call records where its time goes (kiln/serve/stats.py CallPhases: gather, handoff, merge, engine,
GPU span, split, return, answer; per request queue and respond), read back by /stats' "call_phases" and
bench/serve.py's phase table.

Timeouts: a request past its deadline is dropped from the queue (the frontend answers it);
closing stops intake and lets everything queued and running finish (graceful shutdown, unload).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from kiln import Engine
from kiln.serve.config import (BATCH_BUCKETS_DEFAULT, CUDA_SYNC_DEFAULT, WARM_UP_DEFAULT, ModelConfig,
                               batch_buckets_mode, cuda_sync_mode, warm_up_seconds)
from kiln.serve.errors import QueueFull, RequestTimeout, Unavailable
from kiln.serve.instances import Instance
from kiln.serve.stats import ModelStats

Signature = tuple[tuple[int, ...], ...]  # per input, in config order: the shape past the batch axis


class Pending:
    """One queued request: its inputs (by name), rows on the batch axis and the future it answers.
    (A plain class with slots: one is made per request, on the event loop.)"""

    __slots__ = ("inputs", "rows", "signature", "future", "arrival_ns", "deadline_ns", "queue_ns", "group", "sizes",
                 "done_ns")

    def __init__(self, inputs: dict[str, np.ndarray], rows: int, signature: Signature, future: asyncio.Future,
                 arrival_ns: int | None = None, deadline_ns: int | None = None):
        self.inputs = inputs
        self.rows = rows
        self.signature = signature
        self.future = future
        self.arrival_ns = time.monotonic_ns() if arrival_ns is None else arrival_ns
        self.deadline_ns = deadline_ns
        self.queue_ns: int | None = None  # set when its batch starts
        self.group: Signature = signature  # what must match to share a call (the signature, padded dims bucketed)
        self.sizes: dict[str, int] = _NO_SIZES  # its own size of each dim the batcher may pad (never mutated)
        self.done_ns = 0  # when its call was answered on the loop (monotonic; CallPhases' respond starts there)


_NO_SIZES: dict[str, int] = {}

STOP_TIMEOUT_S = 30.0  # close() waits this long at most for the instances' idle threads to end
HELD_COPY_BYTES = 1 << 20  # parts up to this size are copied with the GIL held (~0.1 ms each at most)
NUMPY_HELD_ELEMENTS = 500  # numpy copies a part of up to this many elements with the GIL held (its threshold)


def merge_rows(parts: list[np.ndarray]) -> np.ndarray:
    """np.concatenate(parts, axis=0), for the batch an instance merges on its thread. numpy lets the GIL go for
    each part's copy and must take it back after each: in an engine process whose event loop and other instances
    want the GIL, that wait is up to a switch interval per part (on the H200 host ~110-230 us per staged 301 KB
    image, so merging 12 took 2.8 ms, as long as the engine call). Parts up to HELD_COPY_BYTES are copied with the
    GIL held instead (memoryview assignment: a memcpy), larger ones by numpy; other dtypes (BYTES, bfloat16) and
    non-contiguous parts go to np.concatenate. So do batches of small parts (each of at most NUMPY_HELD_ELEMENTS, as
    BERT's token ids and masks): numpy copies those with the GIL held, in one call where the loop below costs ~1.5 us
    of Python a part (60 requests' [1, 128] int64: 94 vs 10 us on the 2-vCPU EPYC, bench/results/serve-callparts-
    2026-12-07.md)."""
    first = parts[0]
    if all(p.size <= NUMPY_HELD_ELEMENTS for p in parts):
        return np.concatenate(parts, axis=0)
    if first.dtype.kind not in "biuf" or any(p.dtype != first.dtype or p.shape[1:] != first.shape[1:]
                                             or not p.flags.c_contiguous for p in parts):
        return np.concatenate(parts, axis=0)
    merged = np.empty((sum(p.shape[0] for p in parts), *first.shape[1:]), first.dtype)
    flat = merged.reshape(-1).view(np.uint8)
    held = memoryview(flat)
    offset = 0
    for part in parts:
        end = offset + part.nbytes
        if part.nbytes <= HELD_COPY_BYTES:
            held[offset:end] = memoryview(part.reshape(-1).view(np.uint8))
        else:
            flat[offset:end] = part.reshape(-1).view(np.uint8)
        offset = end
    return merged


def writable(array: np.ndarray) -> np.ndarray:
    """A request's own array as an engine takes it: a read-only one (over its request buffer) copied, since engines
    may write their inputs."""
    return array if array.flags.writeable else array.copy()


class BatchShapes:
    """Which batch sizes the engine's profiles hold for a request shape (past the batch axis)."""

    def __init__(self, engine: Engine, config: ModelConfig):
        self.names = [t.name for t in config.inputs]
        self.max_batch_size = config.max_batch_size
        self.ranges = []  # per profile: (batch min, batch max, {input: (min dims, max dims) past axis 0})
        for p in engine.profiles:
            rs = [p.inputs[n] for n in self.names if n in p.inputs]
            if config.max_batch_size > 0 and rs:
                lo, hi = max(r.min[0] for r in rs), min(r.max[0] for r in rs)
                rest = {n: (r.min[1:], r.max[1:]) for n, r in p.inputs.items()}
            else:
                lo, hi, rest = 1, 1, {n: (r.min, r.max) for n, r in p.inputs.items()}
            self.ranges.append((lo, hi, rest))
        self._cache: dict[Signature, list[tuple[int, int]]] = {}

    def sizes(self, signature: Signature) -> list[tuple[int, int]]:
        """Batch-size intervals of the profiles holding this signature (no profiles: 1..max)."""
        found = self._cache.get(signature)
        if found is not None:
            return found
        if not self.ranges:
            found = [(1, max(1, self.max_batch_size))]
        else:
            found = []
            for lo, hi, rest in self.ranges:
                inside = all(
                    n not in rest or len(s) == len(rest[n][0])
                    and all(a <= d <= b for d, a, b in zip(s, *rest[n]))
                    for n, s in zip(self.names, signature))
                if inside:
                    found.append((lo, min(hi, self.max_batch_size) if self.max_batch_size else hi))
            found.sort()
        if len(self._cache) > 256:
            self._cache.clear()
        self._cache[signature] = found
        return found

    def limit(self, signature: Signature) -> int:
        return max((hi for _, hi in self.sizes(signature)), default=0)

    def padded(self, signature: Signature, rows: int) -> int | None:
        """The smallest batch size >= rows that a profile holds, or None."""
        for lo, hi in self.sizes(signature):
            if rows <= hi:
                return max(rows, lo)
        return None


def _flag(config: ModelConfig, name: str) -> bool | None:
    """A true/false parameter of the config; None when it is not set."""
    value = config.parameters.get(name)
    return None if value is None else value.strip().lower() not in ("false", "0", "no", "off")


class SequencePadding:
    """Dims past the batch axis that zero padding leaves exact (a sequence an attention mask covers,
    the engine's declared pad_dims), as the runtime's shape buckets find them: requests that differ
    only there share a call, padded to the longest and cropped back. Requests are grouped by the
    power-of-two bucket of each such size, so none is padded to more than about twice its own."""

    def __init__(self, engine: Engine, config: ModelConfig):
        self.pads: dict[str, list[tuple[int, str]]] = {}
        self.crops: dict[str, list[tuple[int, str]]] = {}
        self.floors: dict[str, int] = {}
        if _flag(config, "pad_to_merge") is False or config.max_batch_size <= 0 or len(engine.profiles) != 1:
            return
        plan = engine.create_execution_context(buckets=True).buckets
        if plan is None:
            return
        batch = {b.shape[0] for b in engine.inputs if b.shape}
        self.floors = {symbol: floor for symbol, floor in plan.symbols.items() if symbol not in batch}
        if not self.floors:
            return
        self.pads = {b.name: [(axis, d) for axis, d in pads if d in self.floors]
                     for b, pads in zip(engine.inputs, plan.pads)}
        self.crops = {b.name: [(axis, d) for axis, d in crops if d in self.floors]
                      for b, crops in zip(engine.outputs, plan.crops)}

    def group(self, inputs: dict[str, np.ndarray], signature: Signature) -> tuple[Signature, dict[str, int]]:
        if not self.floors:
            return signature, {}
        sizes: dict[str, int] = {}
        group = []
        for (name, array), dims in zip(inputs.items(), signature):
            dims = list(dims)
            for axis, symbol in self.pads.get(name, []):
                size = int(array.shape[axis])
                sizes[symbol] = size
                bucket = max(self.floors[symbol], 1 << max(0, size - 1).bit_length())
                dims[axis - 1] = -bucket  # axis past the batch axis; negative: "padded up to this bucket"
            group.append(tuple(dims))
        return tuple(group), sizes

    def pad(self, name: str, array: np.ndarray, targets: dict[str, int]) -> np.ndarray:
        widths = [(0, 0)] * array.ndim
        for axis, symbol in self.pads.get(name, []):
            widths[axis] = (0, targets[symbol] - array.shape[axis])
        if all(w == (0, 0) for w in widths):
            return array
        return np.pad(array, widths)  # zeros: token 0 under a mask of 0 is never attended

    def crop(self, name: str, array: np.ndarray, sizes: dict[str, int]) -> np.ndarray:
        index = [slice(None)] * array.ndim
        for axis, symbol in self.crops.get(name, []):
            index[axis] = slice(0, sizes[symbol])
        return array[tuple(index)]


@dataclass
class BatchResult:
    outputs: list[dict[str, np.ndarray] | BaseException]  # per request
    rows: int  # the engine call's batch size (padding included)
    input_ns: int = 0  # merge and padding
    infer_ns: int = 0  # the engine call
    output_ns: int = 0  # the split
    begin_ns: int = 0  # monotonic: the instance began the batch (the handoff's end)
    end_ns: int = 0  # monotonic: the result was ready (the return's start)
    cpu_ns: int = 0  # the instance thread's CPU time in the engine call
    gpu_ns: int | None = None  # CUDA: the call's span on its stream
    copy_out_ns: int | None = None  # CUDA, pinned or blocking: of it, the outputs' copies to the host
    graphs: tuple[int, int, int, int] | None = None  # CUDA: the call's graph replays, captures, eager runs, splits


class Batcher:
    """Everything runs on the event loop as plain callbacks: a submit schedules one dispatch for
    the loop's next turn (so requests that arrive together are seen together; a request that finds nothing
    queued and an instance idle that runs inline is dispatched at once: _alone_now; ServerCore.infer's such request
    runs in run_now, with no Pending or future at all); a dispatch hands
    batches to idle instances (or runs them right there, for an instance whose calls are tiny: see
    kiln/serve/instances.py), or sets a timer when the oldest request may still wait for company;
    an instance's result comes back as a callback that answers the futures and dispatches again."""

    def __init__(self, engine: Engine, config: ModelConfig, stats: ModelStats, max_queue_size: int,
                 warm_up: str = WARM_UP_DEFAULT, cuda_sync: str = CUDA_SYNC_DEFAULT,
                 batch_buckets: str = BATCH_BUCKETS_DEFAULT):
        self.config = config
        self.stats = stats
        self.shapes = BatchShapes(engine, config)
        self.batching = config.max_batch_size > 0 and config.dynamic_batching is not None
        self.padding = SequencePadding(engine, config) if self.batching else None
        batching = config.dynamic_batching
        self.delay_ns = batching.max_queue_delay_microseconds * 1000 if batching else 0
        self.preferred = sorted(batching.preferred_batch_size) if batching else []
        self.max_queue_size = config.queue_bound or max_queue_size
        warm_up_s = warm_up_seconds(config, warm_up)  # the model's warm_up parameter, else the server's default
        sync = cuda_sync_mode(config, cuda_sync)  # likewise
        steps = batch_buckets_mode(config, batch_buckets)  # likewise
        self.instances = [Instance(engine, config.name, k, self._run_batch, self._finish, _flag(config, "buckets"),
                                   warm_up=warm_up_s is not None or "warm_up" not in config.parameters,
                                   warm_up_s=warm_up_s, cuda_sync=sync, batch_buckets=steps)
                          for k in range(config.instance_count)]
        stats.warm_up = [i.warmed_up for i in self.instances if i.warmed_up is not None]
        if any(i.cuda for i in self.instances):
            stats.graph_reports = lambda: [r for r in (i.graph_report() for i in self.instances) if r is not None]
        self.idle = list(reversed(self.instances))
        self.pending: deque[Pending] = deque()
        self.closing = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self._scheduled = False
        self._ran_alone = False  # a request ran alone at submit in this turn of the loop (_alone_now)
        self._merging = False  # the last call started ran more than one request
        self._timer: asyncio.TimerHandle | None = None
        self._drained: asyncio.Event | None = None

    # ---- intake -----------------------------------------------------------------------------------

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._drained = asyncio.Event()

    def submit(self, inputs: dict[str, np.ndarray], rows: int, signature: Signature,
               deadline_ns: int | None) -> Pending:
        if self.closing:
            raise Unavailable(f"model {self.config.name!r} is unloading or the server is shutting down")
        if len(self.pending) >= self.max_queue_size:
            raise QueueFull(f"model {self.config.name!r}: the queue holds its maximum of {self.max_queue_size} "
                            "requests; retry later")
        request = Pending(inputs, rows, signature, self.loop.create_future(), deadline_ns=deadline_ns)
        if self.padding is not None and self.padding.floors:
            request.group, request.sizes = self.padding.group(inputs, signature)
        if not self.pending and self.idle and self.idle[-1].inline and self._alone_now():
            # nothing to merge it with and a tiny call: answered now, never queued, so the caller's await does not
            # wait for the loop's next turns (the dispatch, then the future's callback)
            self._start(self.idle.pop(), [request])
            return request
        self.pending.append(request)
        self.stats.pending = len(self.pending)
        self._schedule()
        return request

    def run_now(self, inputs: dict[str, np.ndarray], rows: int, signature: Signature
                ) -> dict[str, np.ndarray] | BaseException | None:
        """A request that submit would run alone at once (nothing queued, an inline instance idle, the first of its
        turn of the loop: _alone_now), run here on the calling thread: its outputs, or its error; None where it must
        go through submit. No Pending's future to make, set and await and no callbacks: ServerCore.infer's c = 1
        path, as Triton's direct path. Its call is the one _run_batch makes of a batch of one that needs no padding
        (its own arrays, read-only ones copied: engines may write their inputs), recorded alike (a queue time of 0:
        it never waited); a request its profiles hold only padded goes through submit."""
        if self.closing or self.pending or not self.idle or not self.idle[-1].inline:
            return None
        if self.config.max_batch_size > 0 and self.shapes.padded(signature, rows) != rows:
            return None
        if not self._alone_now():  # last: it marks this turn of the loop as having run one alone
            return None
        instance = self.idle.pop()
        self._merging = False
        t0 = time.perf_counter_ns()
        feeds = {name: writable(array) for name, array in inputs.items()}
        t1 = time.perf_counter_ns()
        try:
            outputs = instance.execute(feeds)
        except Exception as e:  # noqa: BLE001 - answered to the caller
            outputs = e
        t2 = time.perf_counter_ns()
        self.idle.append(instance)
        self.stats.record_batch(rows, 1, t1 - t0, t2 - t1, 0)  # no output work: the outputs are the call's
        self.stats.record_phases(1, rows, 0, 0, t1 - t0, t2 - t1, instance.cpu_ns, instance.gpu_ns, 0, 0, 0,
                                 instance.copy_out_ns, instance.graph_counts)
        self.stats.phases.queue.add(0)  # it never waited
        return outputs

    def _alone_now(self) -> bool:
        """Whether a request that finds the queue empty and an instance idle runs now, alone. Without dynamic
        batching, always. With it and no queue delay, the first such request of a turn of the loop, while requests
        come one at a time (the last call ran one request): as Triton's scheduler, an idle server does not hold a
        lone request back. The requests that arrive after it in the same turn (other connections' reads) wait for
        the turn's dispatch and share a call; once calls merge requests, every request waits for the dispatch
        (under load, one more call per turn would cost more than the loop's turn it saves)."""
        if not self.batching:
            return True
        if self.delay_ns or self._ran_alone or self._merging:
            return False
        self._ran_alone = True
        self.loop.call_soon(self._next_turn)
        return True

    def _next_turn(self) -> None:
        self._ran_alone = False

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            self.loop.call_soon(self._dispatch)

    async def close(self) -> None:
        """Stop intake; finish what is queued and running; stop the instances' threads and wait until they have
        ended (polled: the loop serves on meanwhile). Ended, not only told to: `kiln serve` exits right after, and a
        daemon thread still ending as the interpreter finalizes may be inside torch, which aborts the process
        (kiln/kernels/cpu/onednn_ahead.py's docstring; issue 14)."""
        self.closing = True
        if self.loop is not None:
            self._dispatch()
            while self.pending or len(self.idle) < len(self.instances):
                self._drained.clear()
                await self._drained.wait()
        for instance in self.instances:
            instance.stop()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while not all(instance.stopped for instance in self.instances) and time.monotonic() < deadline:
            await asyncio.sleep(0.001)  # idle threads: each ends as soon as it wakes

    # ---- dispatch ---------------------------------------------------------------------------------

    def _dispatch(self) -> None:
        self._scheduled = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self.idle:
            self._drop_finished()
            if not self.pending:
                break
            gather = time.monotonic_ns()
            batch = self._next_batch()
            if batch is None:  # the oldest may wait for more: come back when its delay is up
                wake = self.pending[0].arrival_ns + self.delay_ns
                self._timer = self.loop.call_later(max(0, wake - time.monotonic_ns()) / 1e9, self._dispatch)
                break
            self._start(self.idle.pop(), batch, gather)
        self.stats.pending = len(self.pending)
        if not self.pending and len(self.idle) == len(self.instances):
            self._drained.set()

    def _start(self, instance: Instance, batch: list[Pending], gather_ns: int | None = None) -> None:
        """The batch on this instance: run here and answered (an inline instance), or handed to its thread.
        `gather_ns`: when the dispatch began choosing it (monotonic; None: submit's request alone, no choice)."""
        start = time.monotonic_ns()
        waited = 0
        for r in batch:
            r.queue_ns = start - r.arrival_ns
            waited += r.queue_ns
        self.stats.phases.queue.add(waited, len(batch))
        self._merging = len(batch) > 1
        gathered = 0 if gather_ns is None else start - gather_ns
        if instance.inline:
            try:
                result = self._run_batch(instance, batch)
            except Exception as e:  # noqa: BLE001 - answered to the batch's callers
                result = e
            if isinstance(result, BatchResult):  # ran here: no handoff, no return
                result.begin_ns, result.end_ns = start, 0
            self._answer(instance, batch, result, gathered, start)
        else:
            instance.submit(self.loop, (batch, gathered, start))

    def _drop_finished(self) -> None:
        """Remove requests whose caller gave up (timeout, disconnect) or whose deadline passed."""
        for r in self.pending:
            if r.deadline_ns is not None or r.future.done():
                break
        else:  # none to drop (a loop, not all() over a generator: this runs at every dispatch)
            return
        now = time.monotonic_ns()
        kept = deque()
        for r in self.pending:
            if r.future.done():
                continue
            if r.deadline_ns is not None and now >= r.deadline_ns:
                r.future.set_exception(RequestTimeout(
                    f"model {self.config.name!r}: the request's timeout passed after "
                    f"{(now - r.arrival_ns) // 1000} us in the queue"))
                continue
            kept.append(r)
        self.pending = kept

    def _next_batch(self) -> list[Pending] | None:
        """The requests of the next engine call, taken off the queue; None: wait for more."""
        head = self.pending[0]
        if not self.batching:
            return [self.pending.popleft()]
        limit = self.shapes.limit(head.signature)
        chosen, rows = [], 0
        for r in self.pending:
            if r.group == head.group and rows + r.rows <= limit:
                chosen.append(r)
                rows += r.rows
                if rows == limit:
                    break
        target = max((p for p in self.preferred if p <= limit), default=limit)
        if rows < target and time.monotonic_ns() - head.arrival_ns < self.delay_ns and not self.closing:
            return None
        if self.preferred and rows > target:  # cut at the largest preferred size a prefix reaches
            total, cut = 0, len(chosen)
            for k, r in enumerate(chosen):
                total += r.rows
                if total in self.preferred:
                    cut = k + 1
            chosen = chosen[:cut]
        if len(chosen) == len(self.pending):
            self.pending.clear()
        elif len(chosen) == 1:
            self.pending.remove(chosen[0])
        else:
            taken = {id(r) for r in chosen}
            self.pending = deque(r for r in self.pending if id(r) not in taken)
        return chosen

    def _finish(self, instance: Instance, work: tuple[list[Pending], int, int],
                result: BatchResult | BaseException) -> None:
        """On the loop, from an instance's thread: answer the batch's callers and give the instance more work.
        `work`: what _start submitted (the batch, its gather time, when it was handed over)."""
        batch, gathered, start = work
        self._answer(instance, batch, result, gathered, start)
        self._dispatch()

    def _answer(self, instance: Instance, batch: list[Pending], result: BatchResult | BaseException,
                gathered: int = 0, start: int = 0) -> None:
        """Answer the batch's callers, record the call and its phases, and put the instance back among the idle
        ones. `gathered`: the dispatch's time choosing the batch; `start`: when _start handed it over (monotonic)."""
        answering = time.monotonic_ns()
        self.idle.append(instance)
        if isinstance(result, BaseException):
            result = BatchResult([result] * len(batch), sum(r.rows for r in batch))
        self.stats.record_batch(result.rows, len(batch), result.input_ns, result.infer_ns, result.output_ns)
        for r, out in zip(batch, result.outputs):
            r.done_ns = answering
            if r.future.done():
                continue
            if isinstance(out, BaseException):
                r.future.set_exception(out)
            else:
                r.future.set_result(out)
        if result.begin_ns:  # the call ran (a failure before it began records nothing more)
            self.stats.record_phases(len(batch), result.rows, gathered, result.begin_ns - start if start else 0,
                                     result.input_ns, result.infer_ns, result.cpu_ns, result.gpu_ns, result.output_ns,
                                     answering - result.end_ns if result.end_ns else 0,
                                     time.monotonic_ns() - answering, result.copy_out_ns, result.graphs)

    # ---- in an instance's thread ------------------------------------------------------------------

    def _run_batch(self, instance: Instance, batch: list[Pending]) -> BatchResult:
        """Merge, run, split (one request alone: no copy at all)."""
        t0 = time.monotonic_ns()
        rows = batch[0].rows if len(batch) == 1 else sum(r.rows for r in batch)
        padded = rows
        if self.config.max_batch_size > 0:
            padded = self.shapes.padded(batch[0].signature, rows) or rows
        targets: dict[str, int] = {}  # padded dims: the longest of the batch
        ragged = False  # one request alone is never padded to another's
        if len(batch) > 1:
            for r in batch:
                for symbol, size in r.sizes.items():
                    targets[symbol] = max(targets.get(symbol, 0), size)
            ragged = any(size != targets[symbol] for r in batch for symbol, size in r.sizes.items())
        feeds = {}
        for name in batch[0].inputs:
            parts = [r.inputs[name] for r in batch]
            if ragged:
                parts = [self.padding.pad(name, part, targets) for part in parts]
            if padded > rows:  # repeat the last real row up to a size a profile holds
                parts.append(np.repeat(parts[-1][-1:], padded - rows, axis=0))
            if len(parts) > 1:
                feeds[name] = merge_rows(parts)
            else:  # a request's own array: read-only over its request buffer (engines may write their inputs)
                feeds[name] = writable(parts[0])
        t1 = time.monotonic_ns()
        try:
            outputs = instance.execute(feeds)
        except Exception as e:  # noqa: BLE001 - a batch failing is rerun request by request below
            if len(batch) == 1:
                t2 = time.monotonic_ns()
                return BatchResult([e], padded, t1 - t0, t2 - t1, 0, t0, t2)
            return self._run_alone(instance, batch, padded, t0, t1)
        t2 = time.monotonic_ns()
        if len(batch) == 1 and padded == rows:
            t3 = time.monotonic_ns()
            return BatchResult([outputs], padded, t1 - t0, t2 - t1, t3 - t2, t0, t3, instance.cpu_ns, instance.gpu_ns,
                               instance.copy_out_ns, instance.graph_counts)
        split: list[dict[str, np.ndarray] | BaseException] = []
        offset = 0
        for r in batch:
            mine = {n: v[offset:offset + r.rows] for n, v in outputs.items()}
            if ragged:
                mine = {n: self.padding.crop(n, v, r.sizes) for n, v in mine.items()}
            split.append(mine)
            offset += r.rows
        t3 = time.monotonic_ns()
        return BatchResult(split, padded, t1 - t0, t2 - t1, t3 - t2, t0, t3, instance.cpu_ns, instance.gpu_ns,
                           instance.copy_out_ns, instance.graph_counts)

    def _run_alone(self, instance: Instance, batch: list[Pending], padded: int, t0: int, t1: int) -> BatchResult:
        """The batch's failed call (merged at t0, run from t1) rerun request by request; the reruns count as its
        engine time."""
        outputs: list[dict[str, np.ndarray] | BaseException] = []
        for r in batch:
            try:
                outputs.append(instance.execute({n: writable(a) for n, a in r.inputs.items()}))
            except Exception as e:  # noqa: BLE001 - this request's own error, answered to it alone
                outputs.append(e)
        t2 = time.monotonic_ns()
        return BatchResult(outputs, padded, t1 - t0, t2 - t1, 0, t0, t2)
