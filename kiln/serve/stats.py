"""Per-model statistics in Triton's shape: the /stats endpoint, gRPC ModelStatistics and /metrics read them.

kiln adds one key to Triton's: "warm_up", what each CPU instance's warm-up did at load (kiln/serve/instances.py;
[] when none ran); gRPC's ModelStatistics has no field for it.

Durations are cumulative nanoseconds with a count, as Triton keeps them: per request (success,
fail, queue, and the compute phases of the batch each request ran in) and per batch size (one
entry per engine call). Written from the event loop only, so no lock.
"""

from __future__ import annotations

import time
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
        }
