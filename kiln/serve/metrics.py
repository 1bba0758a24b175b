"""Prometheus /metrics with Triton's metric names, so dashboards built for Triton read kiln.

Written as the text exposition format directly: Triton's counters carry no `_total` suffix,
which prometheus_client's own counters would add. Per model version (labels model, version):

    nv_inference_request_success / _failure{reason}      requests answered / failed
    nv_inference_count / nv_inference_exec_count         rows inferred / engine calls
    nv_inference_request_duration_us                     cumulative, arrival to response
    nv_inference_queue_duration_us                       cumulative time queued
    nv_inference_compute_{input,infer,output}_duration_us
    nv_inference_pending_request_count                   a gauge: queued now

and for the machine: nv_cpu_utilization, nv_cpu_memory_{total,used}_bytes, and on CUDA
nv_gpu_utilization, nv_gpu_memory_{total,used}_bytes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

from kiln.serve.instances import GATE
from kiln.serve.stats import ModelStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_MODEL_METRICS: list[tuple[str, str, str, Callable[[ModelStats], float]]] = [
    ("nv_inference_request_success", "counter", "Number of successful inference requests, all batch sizes",
     lambda s: s.success.count),
    ("nv_inference_count", "counter", "Number of inferences performed (does not include cached requests)",
     lambda s: s.inference_count),
    ("nv_inference_exec_count", "counter", "Number of model executions performed (does not include cached requests)",
     lambda s: s.execution_count),
    ("nv_inference_request_duration_us", "counter", "Cumulative inference request duration in microseconds",
     lambda s: (s.success.ns + s.fail.ns) // 1000),
    ("nv_inference_queue_duration_us", "counter", "Cumulative inference queuing duration in microseconds",
     lambda s: s.queue.ns // 1000),
    ("nv_inference_compute_input_duration_us", "counter", "Cumulative compute input duration in microseconds",
     lambda s: s.compute_input.ns // 1000),
    ("nv_inference_compute_infer_duration_us", "counter", "Cumulative compute inference duration in microseconds",
     lambda s: s.compute_infer.ns // 1000),
    ("nv_inference_compute_output_duration_us", "counter", "Cumulative inference compute output duration in microseconds",
     lambda s: s.compute_output.ns // 1000),
    ("nv_inference_pending_request_count", "gauge", "Instantaneous number of pending requests awaiting execution",
     lambda s: s.pending),
]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: dict[str, str]) -> str:
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}"


def _family(lines: list[str], name: str, kind: str, help_text: str,
            samples: Iterable[tuple[dict[str, str], float]]) -> None:
    lines.append(f"# HELP {name} {help_text}")
    lines.append(f"# TYPE {name} {kind}")
    for labels, value in samples:
        lines.append(f"{name}{_labels(labels)} {value:g}" if isinstance(value, float) else f"{name}{_labels(labels)} {value}")


class MetricsExporter:
    """Renders the current statistics of every served model version, and the machine's gauges."""

    def __init__(self, versions: Callable[[], list[ModelStats]]):
        self.versions = versions
        self._cpu_last: tuple[int, int] | None = None

    async def scrape(self) -> bytes:
        """render()'s text, as the /metrics routes ask for it (a front-end process's exporter asks the engine's)."""
        return self.render()

    def render(self) -> bytes:
        stats = self.versions()
        lines: list[str] = []
        for name, kind, help_text, read in _MODEL_METRICS[:1]:
            _family(lines, name, kind, help_text, ((_model_labels(s), read(s)) for s in stats))
        _family(lines, "nv_inference_request_failure", "counter",
                "Number of failed inference requests, all batch sizes",
                [({**_model_labels(s), "reason": reason}, count)
                 for s in stats for reason, count in sorted(s.failures_by_reason.items())])
        for name, kind, help_text, read in _MODEL_METRICS[1:]:
            _family(lines, name, kind, help_text, ((_model_labels(s), read(s)) for s in stats))
        self._machine(lines)
        return ("\n".join(lines) + "\n").encode()

    def _machine(self, lines: list[str]) -> None:
        memory = _meminfo()
        if memory:
            total, available = memory
            _family(lines, "nv_cpu_memory_total_bytes", "gauge", "CPU total memory (RAM), in bytes", [({}, total)])
            _family(lines, "nv_cpu_memory_used_bytes", "gauge", "CPU used memory (RAM), in bytes",
                    [({}, total - available)])
        busy = self._cpu_utilization()
        if busy is not None:
            _family(lines, "nv_cpu_utilization", "gauge", "CPU utilization rate [0.0 - 1.0]", [({}, float(busy))])
        try:
            import torch
        except ImportError:  # pragma: no cover - kiln needs torch; kept for a server without it
            return
        if torch.cuda.is_available():
            gpus = [(torch.cuda.get_device_properties(k), k) for k in range(torch.cuda.device_count())]
            with GATE.shared(wait=False) as safe:  # not while an instance captures a CUDA graph (instances.py)
                memory = [(p, torch.cuda.mem_get_info(k)) for p, k in gpus] if safe else []
            if memory:
                _family(lines, "nv_gpu_memory_total_bytes", "gauge", "GPU total memory, in bytes",
                        [({"gpu_uuid": str(p.uuid)}, total) for p, (_, total) in memory])
                _family(lines, "nv_gpu_memory_used_bytes", "gauge", "GPU used memory, in bytes",
                        [({"gpu_uuid": str(p.uuid)}, total - free) for p, (free, total) in memory])
            utilization = []
            for p, k in gpus:
                try:
                    utilization.append(({"gpu_uuid": str(p.uuid)}, torch.cuda.utilization(k) / 100.0))
                except (RuntimeError, ModuleNotFoundError):  # needs pynvml / amdsmi
                    pass
            if utilization:
                _family(lines, "nv_gpu_utilization", "gauge", "GPU utilization rate [0.0 - 1.0)", utilization)

    def _cpu_utilization(self) -> float | None:
        """Busy share of all cores since the previous scrape (/proc/stat), as Triton reports it."""
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle, total = fields[3] + (fields[4] if len(fields) > 4 else 0), sum(fields)
        last, self._cpu_last = self._cpu_last, (idle, total)
        if last is None or total == last[1]:
            return 0.0
        return 1.0 - (idle - last[0]) / (total - last[1])


def _model_labels(s: ModelStats) -> dict[str, str]:
    return {"model": s.name, "version": s.version}


def _meminfo() -> tuple[int, int] | None:
    if not os.path.exists("/proc/meminfo"):
        return None
    values = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            values[key] = int(rest.split()[0]) * 1024
    if "MemTotal" not in values or "MemAvailable" not in values:
        return None
    return values["MemTotal"], values["MemAvailable"]
