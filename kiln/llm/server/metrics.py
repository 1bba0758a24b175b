"""Prometheus metrics for `kiln llm serve`, named as vLLM names them (with kiln's prefix): gauges and
counters read from the engine at scrape time, latency histograms fed by the engine's observer."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kiln.llm.engine import LLMEngine

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)


class _EngineCollector:
    def __init__(self, engine: LLMEngine, model_name: str):
        self.engine = engine
        self.labels = {"model_name": model_name}

    def collect(self):
        engine, names, values = self.engine, list(self.labels), list(self.labels.values())

        def gauge(name, doc, value):
            family = GaugeMetricFamily(name, doc, labels=names)
            family.add_metric(values, value)
            return family

        def counter(name, doc, value):
            family = CounterMetricFamily(name, doc, labels=names)
            family.add_metric(values, value)
            return family

        blocks, stats = engine.block_manager, engine.stats
        yield gauge("kiln:num_requests_running", "Requests in the running batch", engine.num_running)
        yield gauge("kiln:num_requests_waiting", "Requests waiting to be scheduled", engine.num_waiting)
        yield gauge("kiln:kv_cache_usage_perc", "Fraction of KV-cache blocks held by requests (0-1)", blocks.usage)
        yield gauge("kiln:kv_cache_blocks", "KV-cache blocks (the budget, in blocks)", blocks.num_blocks - 1)
        yield counter("kiln:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", blocks.prefix_queries)
        yield counter("kiln:prefix_cache_hits", "Prompt tokens found in the prefix cache", blocks.prefix_hits)
        yield counter("kiln:prompt_tokens", "Prompt tokens of requests that produced a token", stats.prompt_tokens)
        yield counter("kiln:generation_tokens", "Tokens generated", stats.generation_tokens)
        yield counter("kiln:num_preemptions", "Requests preempted (recomputed later) for lack of blocks",
                      stats.num_preemptions)
        yield counter("kiln:spec_decode_num_draft_tokens", "Speculative draft tokens proposed", stats.draft_tokens)
        yield counter("kiln:spec_decode_num_accepted_tokens", "Speculative draft tokens accepted",
                      stats.accepted_draft_tokens)
        success = CounterMetricFamily("kiln:request_success", "Finished requests by finish reason",
                                      labels=names + ["finished_reason"])
        for reason, count in sorted(stats.finished.items()):
            success.add_metric(values + [reason], count)
        yield success


class LLMMetrics:
    def __init__(self, engine: LLMEngine, model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model_name))
        labels = ["model_name"]

        def histogram(name, doc):
            return Histogram(name, doc, labels, buckets=LATENCY_BUCKETS, registry=self.registry).labels(model_name)

        self.ttft = histogram("kiln:time_to_first_token_seconds", "Time to first token (arrival to first token)")
        self.itl = histogram("kiln:inter_token_latency_seconds", "Time between a request's consecutive tokens")
        self.tpot = histogram("kiln:request_time_per_output_token_seconds",
                              "Per request: (latency - TTFT) / (output tokens - 1)")
        self.e2e = histogram("kiln:e2e_request_latency_seconds", "Arrival to last token")

    def observe(self, event: str, fields: dict) -> None:
        """The engine's observer (called on the engine thread; prometheus_client is thread-safe)."""
        if event == "first_token":
            self.ttft.observe(fields["ttft"])
        elif event == "token":
            per_token = fields["itl"] / fields["count"]
            for _ in range(fields["count"]):
                self.itl.observe(per_token)
        elif event == "finished":
            self.e2e.observe(fields["e2e"])
            if fields["generation_tokens"] > 1:
                self.tpot.observe((fields["e2e"] - fields["ttft"]) / (fields["generation_tokens"] - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
