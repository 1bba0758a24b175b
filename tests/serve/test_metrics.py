"""/metrics' GPU gauges (nv_gpu_memory_total_bytes, nv_gpu_memory_used_bytes, nv_gpu_utilization: Triton's names, one
sample per GPU labelled gpu_uuid) rendered on a machine without a GPU: torch.cuda's queries stand in for two cards,
and the text is read back by prometheus_client's own parser (what a Prometheus server scrapes), not by string
matching. The model metrics' names are checked against a live server in test_http.py."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from kiln.serve.instances import GATE
from kiln.serve.metrics import MetricsExporter
from kiln.serve.stats import ModelStats

GIB = 1 << 30
CARDS = {0: ("GPU-aaaa", 80 * GIB, 30 * GIB, 57), 1: ("GPU-bbbb", 141 * GIB, 140 * GIB, 3)}  # uuid, total, free, %


@pytest.fixture
def two_gpus(monkeypatch):
    """torch.cuda answering for two cards; card 1's utilization needs pynvml, which is missing."""
    def utilization(k):
        if k == 1:
            raise ModuleNotFoundError("pynvml")
        return CARDS[k][3]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(CARDS))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda k: SimpleNamespace(uuid=CARDS[k][0]))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda k: (CARDS[k][2], CARDS[k][1]))
    monkeypatch.setattr(torch.cuda, "utilization", utilization)


def _samples(text: bytes) -> dict[str, dict[str, float]]:
    """{family: {gpu_uuid (or ""): value}} as prometheus_client parses the exposition (by family name: the parser
    names a counter's samples NAME_total, Triton's and kiln's text has them without the suffix)."""
    found: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            found.setdefault(family.name, {})[sample.labels.get("gpu_uuid", "")] = sample.value
    return found


def test_gpu_memory_and_utilization_per_card(two_gpus):
    stats = ModelStats("m", "1")
    stats.success.add(1000)
    samples = _samples(MetricsExporter(lambda: [stats]).render())
    assert samples["nv_gpu_memory_total_bytes"] == {"GPU-aaaa": 80 * GIB, "GPU-bbbb": 141 * GIB}
    assert samples["nv_gpu_memory_used_bytes"] == {"GPU-aaaa": 50 * GIB, "GPU-bbbb": 1 * GIB}
    assert samples["nv_gpu_utilization"] == {"GPU-aaaa": pytest.approx(0.57)}  # card 1: no pynvml, no sample
    assert samples["nv_inference_request_success"] == {"": 1}
    assert 0.0 <= samples["nv_cpu_utilization"][""] <= 1.0
    assert samples["nv_cpu_memory_total_bytes"][""] >= samples["nv_cpu_memory_used_bytes"][""] > 0


def test_memory_gauges_skipped_not_waited_for_while_a_graph_is_captured(two_gpus):
    """While an instance captures a CUDA graph (GATE held alone) a scrape must not touch the device and must not wait
    for the capture either: it answers at once, without the memory gauges."""
    held, release = threading.Event(), threading.Event()

    def capture():
        with GATE.alone():
            held.set()
            release.wait(30)

    thread = threading.Thread(target=capture)
    thread.start()
    rendered: list[bytes] = []
    scrape = threading.Thread(target=lambda: rendered.append(MetricsExporter(lambda: []).render()))
    try:
        assert held.wait(30)
        scrape.start()
        scrape.join(10)
        assert rendered, "the scrape waited for the capture"
    finally:
        release.set()
        thread.join(30)
        scrape.join(30)
    samples = _samples(rendered[0])
    assert "nv_gpu_memory_total_bytes" not in samples and "nv_gpu_memory_used_bytes" not in samples
    assert samples["nv_gpu_utilization"] == {"GPU-aaaa": pytest.approx(0.57)}
    assert "nv_gpu_memory_used_bytes" in _samples(MetricsExporter(lambda: []).render())  # back once it is done


def test_no_gpu_no_gpu_gauges(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    samples = _samples(MetricsExporter(lambda: []).render())
    assert not [name for name in samples if name.startswith("nv_gpu_")]
