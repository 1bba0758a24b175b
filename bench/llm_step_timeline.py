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
import faulthandler
import gc
import os
import resource
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
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


def time_forwards(runner, into: list) -> None:
    """Replace runner.forward (the eager steps: the prefill) by one that appends (host time of the call, GPU start
    event, GPU end event) to `into`."""
    forward = runner.forward

    def timed(inputs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        called = time.perf_counter()
        start.record()
        logits = forward(inputs)
        end.record()
        into.append((called, start, end))
        return logits

    runner.forward = timed


def percentiles(values: list[float]) -> str:
    q = statistics.quantiles(values, n=20)
    return f"p50 {statistics.median(values):.3f}, p95 {q[-1]:.3f}, max {max(values):.3f}, sum {sum(values):.1f}"


def _timed_read(read, decode: LaunchedDecode, calls: list, log: list) -> list[int]:
    started = time.perf_counter()
    tokens = read(decode)
    calls.append(("token wait", len(log), time.perf_counter() - started))
    return tokens


@dataclass
class StepRecord:
    """One engine.step call: wall and thread-CPU ms, what getrusage counted inside it, the collector's ms."""

    replays: int  # decode replays launched when it returned
    wall_ms: float
    cpu_ms: float
    minor_faults: int
    major_faults: int
    voluntary_switches: int  # the thread gave up the CPU (waited: a lock, an event, I/O)
    involuntary_switches: int  # the kernel took the CPU away (preempted, or throttled)
    gc_ms: float = 0.0


class StepWatch:
    """Wraps engine.step: a StepRecord per call; during decode steps (a launched step is pending) a faulthandler
    watchdog dumps every thread's stack to `stacks` each `watchdog_s` the step runs past (cancelled when it returns).
    Collections are charged to the step they ran in through `collected`."""

    def __init__(self, engine, log: list, stacks, watchdog_s: float):
        self.engine, self.log, self.stacks, self.watchdog_s = engine, log, stacks, watchdog_s
        self.records: list[StepRecord] = []
        self.gc_ms = 0.0
        step = engine.step

        def watched():
            armed = engine._launched is not None
            if armed:
                faulthandler.dump_traceback_later(watchdog_s, repeat=True, file=stacks)
            before, self.gc_ms = resource.getrusage(resource.RUSAGE_THREAD), 0.0
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return step()
            finally:
                wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
                if armed:
                    faulthandler.cancel_dump_traceback_later()
                after = resource.getrusage(resource.RUSAGE_THREAD)
                self.records.append(StepRecord(
                    len(log), wall * 1e3, cpu * 1e3, after.ru_minflt - before.ru_minflt,
                    after.ru_majflt - before.ru_majflt, after.ru_nvcsw - before.ru_nvcsw,
                    after.ru_nivcsw - before.ru_nivcsw, self.gc_ms))

        engine.step = watched

    def collected(self, ms: float) -> None:
        self.gc_ms += ms


def _collections(log: list, into: list, watch: StepWatch) -> Callable[[str, dict], None]:
    """A gc callback: (replays so far, generation, ms, objects collected) per collection into `into`; the time is
    also charged to the step running."""
    started = [0.0]

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            ms = (time.perf_counter() - started[0]) * 1e3
            into.append((len(log), info["generation"], ms, info["collected"]))
            watch.collected(ms)

    return callback


def cgroup_cpu() -> dict[str, int]:
    """The container's CPU throttling counters (cgroup v2 cpu.stat, else v1's), {} where neither is readable."""
    for path in ("/sys/fs/cgroup/cpu.stat", "/sys/fs/cgroup/cpu/cpu.stat", "/sys/fs/cgroup/cpu,cpuacct/cpu.stat"):
        try:
            lines = Path(path).read_text().split("\n")
        except OSError:
            continue
        return {k: int(v) for k, v in (line.split() for line in lines if line.strip())}
    return {}


def cpu_limits() -> str:
    quota = "unknown"
    for path in ("/sys/fs/cgroup/cpu.max", "/sys/fs/cgroup/cpu/cpu.cfs_quota_us"):
        try:
            quota = Path(path).read_text().strip()
            break
        except OSError:
            continue
    return (f"{os.cpu_count()} CPUs, {len(os.sched_getaffinity(0))} in this process's affinity, cgroup quota "
            f"{quota}, load {os.getloadavg()[0]:.2f}, torch threads {torch.get_num_threads()}")


def print_stacks(path: str, limit: int = 3, lines: int = 30) -> None:
    """The watchdog's dumps: how often each innermost frame was seen, then the first `limit` dumps in full (every
    thread, most recent call first; `lines` lines each)."""
    dumps = [d.strip() for d in Path(path).read_text().split("Timeout (") if d.strip()]
    innermost = Counter(d.split("\n")[2].strip() for d in dumps if len(d.split("\n")) > 2)
    print(f"- watchdog dumps (a decode step past --watchdog-ms): {len(dumps)}; innermost frames: "
          + ", ".join(f"{n}x {frame}" for frame, n in innermost.most_common(6)))
    for dump in dumps[:limit]:
        print("  Timeout (" + "\n  ".join(dump.split("\n")[:lines]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--config", default="fp8", choices=["bf16", "fp8", "fp8-kv8"])
    parser.add_argument("--gc", default="on", choices=["on", "off"],
                        help="off: the timed generate runs with automatic garbage collection disabled")
    parser.add_argument("--watchdog-ms", type=float, default=60.0,
                        help="dump every thread's stack each time a decode engine.step runs this long")
    parser.add_argument("--stacks", default=None, help="the watchdog's file (default: a temporary file)")
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
    eager: list = []  # the prefill's forward
    time_forwards(engine.runner, eager)
    read_tokens = LaunchedDecode.token_ids
    LaunchedDecode.token_ids = lambda self: _timed_read(read_tokens, self, calls, log)
    # faulthandler writes to the file's descriptor until the run ends
    stacks = open(args.stacks, "w") if args.stacks else tempfile.NamedTemporaryFile("w", suffix=".stacks", delete=False)
    watch = StepWatch(engine, log, stacks, args.watchdog_ms / 1e3)
    collections: list[tuple[int, int, float, int]] = []
    gc.callbacks.append(_collections(log, collections, watch))
    print(f"- host: {cpu_limits()}; gc thresholds {gc.get_threshold()}, counts {gc.get_count()}, tracked objects "
          f"{len(gc.get_objects())}, frozen {gc.get_freeze_count()}, automatic collection {args.gc}")
    throttled = cgroup_cpu()
    if args.gc == "off":
        gc.disable()
    reference = torch.cuda.Event(enable_timing=True)
    reference.record()
    torch.cuda.synchronize()
    host_zero = time.perf_counter()  # the reference event's time on the host clock (within the sync's latency)
    started = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=args.output_len, **greedy))
    torch.cuda.synchronize()
    wall = time.perf_counter() - started
    gc.enable()
    stacks.close()
    throttled = {k: v - throttled.get(k, 0) for k, v in cgroup_cpu().items()}

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
    for called, start, end in eager:
        print(f"- eager step (the prefill): called {(called - started) * 1e3:.1f} ms after generate began (the host's "
              f"admission and inputs), GPU {start.elapsed_time(end):.1f} ms from {(on_host(start) - started) * 1e3:.1f}"
              f" ms; its end to the first replay's start {(first - on_host(end)) * 1e3:.2f} ms")
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
    by_generation = {g: [c for c in collections if c[1] == g] for g in range(3)}
    print("- garbage collections in the timed generate, by generation: " + ", ".join(
        f"gen {g}: {len(c)} ({sum(x[2] for x in c):.1f} ms, max {max((x[2] for x in c), default=0):.2f})"
        for g, c in by_generation.items()))
    print("- collections over 1 ms or of generation 2 (replays launched by then, generation, ms, collected): "
          + str([(r, g, round(ms, 2), n) for r, g, ms, n in collections if ms > 1 or g == 2]))
    decode_steps = [r for r in watch.records if r.replays > 0]
    print(f"- decode engine.step calls: {len(decode_steps)}; wall ms {percentiles([r.wall_ms for r in decode_steps])}"
          f"; thread CPU ms {percentiles([r.cpu_ms for r in decode_steps])}")
    print("- slowest engine.step calls (replays launched when it returned, wall ms, thread CPU ms, minor/major "
          "faults, voluntary/involuntary switches, gc ms):")
    for r in sorted(watch.records, key=lambda r: -r.wall_ms)[:6]:
        print(f"  {r.replays}: {r.wall_ms:.1f} wall, {r.cpu_ms:.1f} cpu, faults {r.minor_faults}/{r.major_faults}, "
              f"switches {r.voluntary_switches}/{r.involuntary_switches}, gc {r.gc_ms:.1f}")
    print(f"- cgroup CPU counters over the generate (deltas): {throttled or 'not readable'}")
    print_stacks(stacks.name)
    print(f"- replay alone at the end (20 back to back): {graphs.time_replay(args.batch):.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
