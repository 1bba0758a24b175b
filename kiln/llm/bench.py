"""`kiln llm bench`: load an OpenAI-compatible server the way `vllm bench serve` does and report the
same numbers: random prompts of a given token length, requests at a Poisson rate (or all at once)
under an optional concurrency cap, each streamed from /v1/completions; per request TTFT, the gaps
between streamed chunks (ITL), TPOT = (latency - TTFT) / (output tokens - 1) and end-to-end latency;
overall request and token throughput and goodput (requests meeting every SLO given).

The client is a small HTTP/1.1 reader on asyncio streams (SSE over chunked transfer encoding), so the
benchmark needs nothing beyond the standard library and measures the server, not a client library.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from urllib.parse import urlparse

from kiln.llm.config import LLMError


@dataclass
class BenchConfig:
    url: str  # the server's base URL, e.g. http://127.0.0.1:8000
    model: str
    vocab_size: int  # random prompt ids are drawn from [special_ids, vocab_size)
    num_prompts: int = 100
    input_len: int = 128
    output_len: int = 128
    range_ratio: float = 0.0  # lengths uniform in [len*(1-r), len*(1+r)]
    request_rate: float = float("inf")  # requests per second (Poisson); inf: all at once
    max_concurrency: int | None = None
    seed: int = 0
    goodput: dict[str, float] = field(default_factory=dict)  # SLOs in ms: ttft, tpot, e2el
    first_token_id: int = 4  # skip the lowest ids (usually special tokens)


@dataclass
class RequestResult:
    ok: bool
    prompt_len: int
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


async def _stream_completion(host: str, port: int, path: str, body: dict) -> tuple[int, list[tuple[float, dict]]]:
    """POST `body`, read the SSE stream: (status, [(arrival time, event json)])."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        payload = json.dumps(body).encode()
        writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode() + payload)
        await writer.drain()
        status = int((await reader.readline()).split()[1])
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            key, _, value = line.decode().partition(":")
            headers[key.strip().lower()] = value.strip()
        events, buffer = [], b""

        def take_events(now: float):
            nonlocal buffer
            while b"\n\n" in buffer:
                raw, buffer = buffer.split(b"\n\n", 1)
                for line in raw.split(b"\n"):
                    if line.startswith(b"data: ") and line != b"data: [DONE]":
                        events.append((now, json.loads(line[6:])))

        if headers.get("transfer-encoding") == "chunked":
            while True:
                size = int((await reader.readline()).strip() or b"0", 16)
                if size == 0:
                    break
                buffer += await reader.readexactly(size)
                await reader.readexactly(2)
                take_events(time.perf_counter())
        else:
            buffer = await reader.read()
            if status != 200:
                return status, [(time.perf_counter(), json.loads(buffer or b"{}"))]
            take_events(time.perf_counter())
        return status, events
    finally:
        writer.close()


async def _one(config: BenchConfig, prompt: list[int], output_len: int) -> RequestResult:
    url = urlparse(config.url)
    body = {"model": config.model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    try:
        status, events = await _stream_completion(url.hostname, url.port or 80, url.path.rstrip("/") + "/v1/completions",
                                                  body)
    except (OSError, ValueError, asyncio.IncompleteReadError) as e:
        return RequestResult(False, len(prompt), error=f"{type(e).__name__}: {e}")
    if status != 200:
        return RequestResult(False, len(prompt), error=f"HTTP {status}: {events[0][1] if events else ''}")
    result = RequestResult(True, len(prompt))
    last = None
    for when, event in events:
        if "error" in event:
            return RequestResult(False, len(prompt), error=str(event["error"]))
        if event.get("usage"):
            result.output_tokens = event["usage"]["completion_tokens"]
        if any(c.get("text") for c in event.get("choices", [])):
            if last is None:
                result.ttft = when - start
            else:
                result.itl.append(when - last)
            last = when
    result.latency = (last or time.perf_counter()) - start
    return result


def _percentiles(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def at(q):
        return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))] * scale

    return {"mean": statistics.fmean(ordered) * scale, "median": statistics.median(ordered) * scale,
            "p90": at(90), "p99": at(99), "max": ordered[-1] * scale}


async def run_bench(config: BenchConfig) -> dict:
    rng = random.Random(config.seed)
    if config.vocab_size <= config.first_token_id:
        raise LLMError(f"vocab_size {config.vocab_size} is too small for random prompts")

    def length(n):
        low, high = int(n * (1 - config.range_ratio)), int(n * (1 + config.range_ratio))
        return max(1, rng.randint(low, high))

    work = [([rng.randrange(config.first_token_id, config.vocab_size) for _ in range(length(config.input_len))],
             length(config.output_len)) for _ in range(config.num_prompts)]
    gate = asyncio.Semaphore(config.max_concurrency or config.num_prompts)

    async def limited(prompt, output_len):
        async with gate:
            return await _one(config, prompt, output_len)

    tasks = []
    start = time.perf_counter()
    for prompt, output_len in work:
        tasks.append(asyncio.ensure_future(limited(prompt, output_len)))
        if config.request_rate != float("inf"):
            await asyncio.sleep(rng.expovariate(config.request_rate))
    results: list[RequestResult] = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    input_tokens = sum(r.prompt_len for r in ok)
    slo = config.goodput

    def good(r: RequestResult) -> bool:
        checks = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.latency}
        return all(checks[k] * 1000 <= v for k, v in slo.items())

    report = {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "input_tokens": input_tokens, "output_tokens": output_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "ttft_ms": _percentiles([r.ttft for r in ok]), "tpot_ms": _percentiles([r.tpot for r in ok if r.tpot]),
        "itl_ms": _percentiles([x for r in ok for x in r.itl]), "e2el_ms": _percentiles([r.latency for r in ok]),
        "errors": sorted({r.error for r in results if not r.ok})[:5], "config": {k: v for k, v in asdict(
            config).items() if k != "url"},
    }
    if slo:
        report["goodput"] = sum(1 for r in ok if good(r)) / duration
    return report


def format_report(report: dict) -> str:
    lines = [f"{'Successful requests:':<40}{report['completed']:>12}", f"{'Failed requests:':<40}{report['failed']:>12}",
             f"{'Benchmark duration (s):':<40}{report['duration_s']:>12.2f}",
             f"{'Total input tokens:':<40}{report['input_tokens']:>12}",
             f"{'Total generated tokens:':<40}{report['output_tokens']:>12}",
             f"{'Request throughput (req/s):':<40}{report['request_throughput']:>12.2f}",
             f"{'Output token throughput (tok/s):':<40}{report['output_throughput']:>12.2f}",
             f"{'Total token throughput (tok/s):':<40}{report['total_token_throughput']:>12.2f}"]
    if "goodput" in report:
        lines.append(f"{'Request goodput (req/s):':<40}{report['goodput']:>12.2f}")
    for key, title in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st token)"),
                       ("itl_ms", "Inter-token Latency"), ("e2el_ms", "End-to-end Latency")):
        lines.append(f"{'-' * 15}{title}{'-' * max(0, 37 - len(title))}")
        for stat, value in report[key].items():
            lines.append(f"{f'{stat.capitalize()} (ms):':<40}{value:>12.2f}")
    for error in report["errors"]:
        lines.append(f"error: {error}")
    return "\n".join(lines)
