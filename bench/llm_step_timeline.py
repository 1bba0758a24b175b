"""Where a large-batch 128/128 run's decode wall time goes: each decode graph replay timed on the GPU in place, and
the GPU's idle time between replays set against what the host was doing.

    python bench/llm_step_timeline.py [--batch 512] [--config fp8]

llm_throughput.py reports the wall time per decode step and the replay time of the decode graph timed alone at the
run's end (20 replays back to back); at batch 512 the first exceeded the second by 1.3-1.7 ms a step (llm4), read as
host time not hidden under the GPU's. This run tells the two causes apart: CUDA events recorded around every replay
(the engine's own launch path, async scheduling on) give each step's GPU time in place and the gap before it; a
reference event maps GPU times onto the host clock, so a gap whose replay started as soon as the host launched it
was the GPU waiting for the host. Same engine as llm_throughput.py's (Llama-3-8B shape, random weights made on
the GPU, CUDA graphs, decode GEMVs and fusion off). Prints per-step percentiles and the slowest steps.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from llm import write_checkpoint  # noqa: E402  bench/llm.py (it puts this checkout on the path)

from kiln.llm import LLM, SamplingParams  # noqa: E402
from kiln.llm.cuda_graphs import LaunchedDecode  # noqa: E402


class TimedGraph:
    """A captured graph whose replays record (host time of the call, GPU start event, GPU end event)."""

    def __init__(self, graph: torch.cuda.CUDAGraph, log: list):
        self.graph, self.log = graph, log

    def replay(self) -> None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        called = time.perf_counter()
        start.record()
        self.graph.replay()
        end.record()
        self.log.append((called, time.perf_counter(), start, end))


def time_calls(owner, name: str, calls: list, log: list) -> None:
    """Replace owner.name by a wrapper that appends (name, replays launched when it returns, host seconds) to
    `calls`."""
    method = getattr(owner, name)

    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            calls.append((name, len(log), time.perf_counter() - started))

    setattr(owner, name, timed)


def percentiles(values: list[float]) -> str:
    q = statistics.quantiles(values, n=20)
    return f"p50 {statistics.median(values):.3f}, p95 {q[-1]:.3f}, max {max(values):.3f}, sum {sum(values):.1f}"


def _timed_read(read, decode: LaunchedDecode, calls: list, log: list) -> list[int]:
    started = time.perf_counter()
    tokens = read(decode)
    calls.append(("token wait", len(log), time.perf_counter() - started))
    return tokens


def _collections(log: list, into: list) -> Callable[[str, dict], None]:
    """A gc callback that appends (replays so far, generation, ms) per full collection (generation 2)."""
    started = [0.0]

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        elif info["generation"] == 2:
            into.append((len(log), 2, (time.perf_counter() - started[0]) * 1e3))

    return callback


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--config", default="fp8", choices=["bf16", "fp8", "fp8-kv8"])
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp())
    write_checkpoint("llama3-8b", torch.bfloat16, folder, weights=False)
    options = {"bf16": {}, "fp8": {"quantization": "fp8"}, "fp8-kv8": {"quantization": "fp8", "kv_cache_dtype": "fp8"}}
    llm = LLM(folder, dtype="bfloat16", device="cuda", load_format="dummy", seed=0, kv_cache_memory="36GiB",
              max_num_seqs=args.batch, max_num_batched_tokens=args.input_len * args.batch, max_model_len=512,
              gemv="cublas", decode_fusion="off", **options[args.config])
    generator = torch.Generator().manual_seed(args.batch)
    vocab = llm.engine.model.config.vocab_size
    prompts = [torch.randint(3, vocab, (args.input_len,), generator=generator).tolist() for _ in range(args.batch)]
    greedy = dict(temperature=0, ignore_eos=True, detokenize=False)
    llm.generate(prompts, SamplingParams(max_tokens=4, **greedy))  # compile, warm up
    llm.engine.block_manager.reset_prefix_cache()

    engine = llm.engine
    graphs = engine.runner.graphs
    log: list = []
    graphs.forward_graphs = {b: TimedGraph(g, log) for b, g in graphs.forward_graphs.items()}
    calls: list[tuple[str, int, float]] = []  # the host's share of a step, by part
    for owner, name in ((engine, "step"), (engine.scheduler, "schedule"), (engine.runner, "launch"),
                        (engine.scheduler, "update"), (engine, "_outputs")):
        time_calls(owner, name, calls, log)
    read_tokens = LaunchedDecode.token_ids
    LaunchedDecode.token_ids = lambda self: _timed_read(read_tokens, self, calls, log)
    full_collections: list[tuple[int, int, float]] = []
    gc.callbacks.append(_collections(log, full_collections))
    reference = torch.cuda.Event(enable_timing=True)
    reference.record()
    torch.cuda.synchronize()
    host_zero = time.perf_counter()  # the reference event's time on the host clock (within the sync's latency)
    started = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=args.output_len, **greedy))
    torch.cuda.synchronize()
    wall = time.perf_counter() - started

    def on_host(event: torch.cuda.Event) -> float:
        return host_zero + reference.elapsed_time(event) / 1e3

    replay = [s.elapsed_time(e) for _, _, s, e in log]
    gaps = [(on_host(log[i][2]) - on_host(log[i - 1][3])) * 1e3 for i in range(1, len(log))]
    # a replay that started within 0.2 ms of its launch call: the GPU had nothing queued (it waited for the host)
    waited = [i for i in range(1, len(log)) if gaps[i - 1] > 0.05 and (on_host(log[i][2]) - log[i][0]) * 1e3 < 0.2]
    lead = [(on_host(log[i][2]) - log[i][1]) * 1e3 for i in range(len(log))]  # how long a launch sat in the queue
    first, last = on_host(log[0][2]), on_host(log[-1][3])
    print(f"{torch.cuda.get_device_name()}, {args.config}, batch {args.batch}, {args.input_len}/{args.output_len}: "
          f"generate {wall * 1e3:.0f} ms, {len(log)} decode replays from {(first - started) * 1e3:.0f} ms (the "
          f"prefill before) to {(last - started) * 1e3:.0f} ms; per step {(last - first) * 1e3 / len(log):.3f} ms")
    print(f"- GPU time of a replay in place (ms): {percentiles(replay)}")
    print(f"- GPU idle between replays (ms): {percentiles(gaps)}")
    print(f"- launch-to-start queue time (ms, < 0: started before the call returned): {percentiles(lead)}")
    print(f"- replays the GPU waited for (gap > 0.05 ms, started < 0.2 ms after the launch call): {len(waited)}, "
          f"{sum(gaps[i - 1] for i in waited):.1f} ms in all; steps {waited[:20]}")
    slowest = sorted(range(len(replay)), key=lambda i: -replay[i])[:8]
    print("- slowest replays (step: ms): " + ", ".join(f"{i}: {replay[i]:.2f}" for i in slowest))
    decode_calls = [c for c in calls if c[1] > 0]  # from the first replay's launch on: the prefill's are before
    host = defaultdict(float)
    for name, _, seconds in decode_calls:
        host[name] += seconds * 1e3 / len(log)
    host["step"] -= host["token wait"]
    print("- host ms per decode step (sums over the decode steps / replays; step: engine.step without the token "
          "wait): " + ", ".join(f"{name} {ms:.3f}" for name, ms in host.items()))
    longest = sorted((c for c in decode_calls if c[0] != "token wait"), key=lambda c: -c[2])[:8]
    print("- longest host calls (part, replays launched when it returned, ms): "
          + ", ".join(f"({name}, {at}, {seconds * 1e3:.1f})" for name, at, seconds in longest))
    print(f"- full garbage collections in the run (replays launched by then, generation, ms): {full_collections}")
    print(f"- replay alone at the end (20 back to back): {graphs.time_replay(args.batch):.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
