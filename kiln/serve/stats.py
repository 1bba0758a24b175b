"""Per-model statistics in Triton's shape: the /stats endpoint, gRPC ModelStatistics and /metrics read them.

kiln adds three keys to Triton's (gRPC's ModelStatistics has no field for any): "warm_up", what each CPU
instance's warm-up did at load (kiln/serve/instances.py; [] when none ran), "call_phases", where a batched
engine call's time goes on the host (CallPhases; issue 14), and "cuda_graphs", per CUDA instance the input shapes
its warm-up captured and its graph cache's counters now (Instance.graph_report; [] on the CPU).

Durations are cumulative nanoseconds with a count, as Triton keeps them: per request (success,
fail, queue, and the compute phases of the batch each request ran in) and per batch size (one
entry per engine call). Written from the event loop only, so no lock.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from kiln.runtime.engine import WarmUp


@dataclass
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, ns: int, count: int = 1) -> None:
        self.count += count
        self.ns += ns

    def to_json(self) -> dict:
        return {"count": self.count, "ns": self.ns}


@dataclass
class BatchStats:
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)


PHASES_PER_CALL = ("gather", "handoff", "merge", "engine", "engine_cpu", "gpu", "gpu_copy_out", "split", "return",
                   "answer")
PHASES_PER_REQUEST = ("queue", "respond", "respond_work", "send")
GRAPH_COUNTS = ("graph_calls", "graph_replays", "graph_captures", "graph_eager", "graph_splits")


@dataclass
class CallPhases:
    """Where the engine calls' time goes, phase by phase (cumulative ns with a count, like Triton's durations).

    Per call, in order: gather (the dispatch choosing the call's requests off the queue, on the event loop), handoff
    (the loop handing the batch to its instance's thread until the thread starts on it: a wake-up; 0 for a call run
    on the loop), merge (concatenating the requests' inputs, padding), engine (the engine call's wall time: on CUDA
    the copies in and out and the waits included), engine_cpu (the instance thread's CPU time in it), gpu (CUDA only:
    the call's span on its stream between two timing events, the copies included; counted only where measured;
    gpu_copy_out: of it, the outputs' copies to the host, where the instance makes them: cuda_sync pinned, blocking),
    split (the outputs cut back into each request's rows), return (the thread's result until the loop takes it: a
    wake-up; 0 for a call run on the loop) and answer (the loop setting the callers' futures).
    Per request: queue (arrival until its call starts), respond (its call answered until its response is built, or
    queued for its front end: the loop's other work in between included), respond_work (of it, the time building and
    queuing the response itself) and, with front ends (`--frontends N`), send: its share of the write that sent it
    (the answers of a loop turn pickled together and their tensors copied into the socket). Monotonic clocks: a few
    reads per call and per request.
    And, on CUDA, what each call's engine run did with the context's CUDA graphs (kiln/runtime/cuda_graphs.py
    GraphStats, read before and after it on the instance's own context): graph_calls (calls that counted them),
    graph_replays, graph_captures, graph_eager (runs of the network not from a graph), graph_splits (calls whose
    batch ran as bucket-sized chunks: kiln/runtime/buckets.py split), summed over those calls."""

    calls: int = 0
    requests: int = 0
    rows: int = 0
    gather: Duration = field(default_factory=Duration)
    handoff: Duration = field(default_factory=Duration)
    merge: Duration = field(default_factory=Duration)
    engine: Duration = field(default_factory=Duration)
    engine_cpu: Duration = field(default_factory=Duration)
    gpu: Duration = field(default_factory=Duration)
    gpu_copy_out: Duration = field(default_factory=Duration)
    split: Duration = field(default_factory=Duration)
    return_: Duration = field(default_factory=Duration)
    answer: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    respond: Duration = field(default_factory=Duration)
    respond_work: Duration = field(default_factory=Duration)
    send: Duration = field(default_factory=Duration)
    graph_calls: int = 0
    graph_replays: int = 0
    graph_captures: int = 0
    graph_eager: int = 0
    graph_splits: int = 0

    def to_json(self) -> dict:
        out = {"calls": self.calls, "requests": self.requests, "rows": self.rows}
        out.update({name: getattr(self, name) for name in GRAPH_COUNTS})
        for name in PHASES_PER_CALL + PHASES_PER_REQUEST:
            out[name] = getattr(self, "return_" if name == "return" else name).to_json()
        return out


@dataclass
class ModelStats:
    name: str
    version: str
    success: Duration = field(default_factory=Duration)  # whole request, arrival to response
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)
    inference_count: int = 0  # rows inferred (a batch-4 request counts 4)
    execution_count: int = 0  # engine calls
    last_inference_ms: int = 0
    batches: dict[int, BatchStats] = field(default_factory=dict)
    pending: int = 0  # requests queued now (a gauge)
    failures_by_reason: dict[str, int] = field(default_factory=dict)
    warm_up: list[WarmUp] = field(default_factory=list)  # per CPU instance that warmed up at load
    phases: CallPhases = field(default_factory=CallPhases)  # where the engine calls' time goes (kiln's own)
    graph_reports: Callable[[], list[dict]] | None = None  # CUDA: each instance's graph_report (set by the batcher)

    def record_batch(self, batch_size: int, requests: int, input_ns: int, infer_ns: int, output_ns: int) -> None:
        """One engine call over `requests` requests of `batch_size` rows in all."""
        b = self.batches.get(batch_size)
        if b is None:
            b = self.batches[batch_size] = BatchStats()
        b.compute_input.add(input_ns)
        b.compute_infer.add(infer_ns)
        b.compute_output.add(output_ns)
        self.compute_input.add(input_ns * requests, requests)
        self.compute_infer.add(infer_ns * requests, requests)
        self.compute_output.add(output_ns * requests, requests)
        self.inference_count += batch_size
        self.execution_count += 1
        self.last_inference_ms = int(time.time() * 1000)

    def record_phases(self, requests: int, rows: int, gather_ns: int, handoff_ns: int, merge_ns: int, engine_ns: int,
                      engine_cpu_ns: int, gpu_ns: int | None, split_ns: int, return_ns: int, answer_ns: int,
                      copy_out_ns: int | None = None, graphs: tuple[int, int, int, int] | None = None) -> None:
        """One engine call's phases (CallPhases); gpu_ns, copy_out_ns None where not measured; `graphs`: what the
        call did with CUDA graphs (instances.GraphCounts: replays, captures, eager runs, splits), None where none
        counted."""
        p = self.phases
        p.calls += 1
        p.requests += requests
        p.rows += rows
        p.gather.add(gather_ns)
        p.handoff.add(handoff_ns)
        p.merge.add(merge_ns)
        p.engine.add(engine_ns)
        p.engine_cpu.add(engine_cpu_ns)
        if gpu_ns is not None:
            p.gpu.add(gpu_ns)
        if copy_out_ns is not None:
            p.gpu_copy_out.add(copy_out_ns)
        p.split.add(split_ns)
        p.return_.add(return_ns)
        p.answer.add(answer_ns)
        if graphs is not None:
            p.graph_calls += 1
            p.graph_replays += graphs[0]
            p.graph_captures += graphs[1]
            p.graph_eager += graphs[2]
            p.graph_splits += graphs[3]

    def record_respond(self, respond_ns: int, work_ns: int) -> None:
        """A request answered from its call: since the call was answered, and of it building and sending its answer."""
        self.phases.respond.add(respond_ns)
        self.phases.respond_work.add(work_ns)

    def record_request(self, ok: bool, duration_ns: int, queue_ns: int | None, reason: str = "") -> None:
        (self.success if ok else self.fail).add(duration_ns)
        if queue_ns is not None:
            self.queue.add(queue_ns)
        if not ok:
            self.failures_by_reason[reason or "OTHER"] = self.failures_by_reason.get(reason or "OTHER", 0) + 1

    def to_json(self) -> dict:
        """Triton's ModelStatistics as JSON (the shape of /v2/models/{m}/stats entries)."""
        return {
            "name": self.name, "version": self.version, "last_inference": self.last_inference_ms,
            "inference_count": self.inference_count, "execution_count": self.execution_count,
            "inference_stats": {
                "success": self.success.to_json(), "fail": self.fail.to_json(), "queue": self.queue.to_json(),
                "compute_input": self.compute_input.to_json(), "compute_infer": self.compute_infer.to_json(),
                "compute_output": self.compute_output.to_json(),
                "cache_hit": Duration().to_json(), "cache_miss": Duration().to_json(),
            },
            "batch_stats": [
                {"batch_size": size, "compute_input": b.compute_input.to_json(),
                 "compute_infer": b.compute_infer.to_json(), "compute_output": b.compute_output.to_json()}
                for size, b in sorted(self.batches.items())
            ],
            "memory_usage": [],
            "warm_up": [{**asdict(w), "seconds": round(w.seconds, 4)} for w in self.warm_up],
            "call_phases": self.phases.to_json(),
            "cuda_graphs": self._graph_reports(),
        }

    def _graph_reports(self) -> list[dict]:
        if self.graph_reports is None:
            return []
        try:
            return self.graph_reports()
        except Exception:  # noqa: BLE001 - a statistic must never fail the stats endpoint
            return []
