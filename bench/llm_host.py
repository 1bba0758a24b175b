"""The host's share of a kiln.llm decode step as the running batch grows: per-step CPU time by stage.

    python bench/llm_host.py                                         # this checkout, batch 64 128 256 512
    python bench/llm_host.py --trees /tmp/before . --rounds 3       # interleaved: A B A B ...

At 8B on an H200 a batch-256 decode step is ~15-25 ms of GPU time; whatever the host does between two
replays of the decode graph either hides under that or adds to it. This measures the host alone: the
engine (scheduler, block manager, runner, output processing) of the tree under test drives a model whose
device work is stubbed out: the decode graph of kiln/llm/cuda_graphs.py is built on the CPU, its replay
does nothing and its "sampled" tokens are fixed random ids; prefill steps return fixed random logits.
So every per-step stage the GPU run pays on the host runs as it would there (filling the graph's input
buffers, reading the tokens back, appending them, finishing requests, building outputs), and nothing else.

Each stage's time is exclusive (a stage's callees that are stages themselves are not counted in it) and is
the thread's CPU time (time.thread_time_ns), so a loaded machine moves it less than wall time (though still:
name the load); "step" is the whole of engine.step plus the driver's loop over its outputs (LLM.generate's),
from a second, uninstrumented run of the same workload (the stage timers cost ~1 us a call). Decode steps only (every request
one token), batch = requests running. Each tree runs in its own subprocess, rounds interleaved; the
table gives the median over rounds of each round's median step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_CHILD = r"""
import json, statistics, sys, tempfile, time
from collections import defaultdict
from pathlib import Path
import torch, transformers
from kiln.llm import LLM, SamplingParams
from kiln.llm.cuda_graphs import DecodeGraphs

batch, input_len, output_len, max_model_len = (int(a) for a in sys.argv[1:5])
stream = sys.argv[5] == "stream"
overlap, device_us = sys.argv[6], int(sys.argv[7])
torch.manual_seed(0)
VOCAB = 32000

class Profile:
    # exclusive thread CPU time per stage
    def __init__(self):
        self.times, self.stack, self.wrapped = defaultdict(int), [], []
    def unwrap(self):
        for owner, name in self.wrapped:
            delattr(owner, name)  # the instance attribute goes: the class's method shows through again
    def wrap(self, owner, name, stage):
        if not hasattr(owner, name):
            return
        fn = getattr(owner, name)
        self.wrapped.append((owner, name))
        def timed(*args, **kwargs):
            self.stack.append(0)
            start = time.thread_time_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.thread_time_ns() - start
                inner = self.stack.pop()
                self.times[stage] += spent - inner
                if self.stack:
                    self.stack[-1] += spent
        setattr(owner, name, timed)

class NoReplay:
    def replay(self): pass

folder = Path(tempfile.mkdtemp())
transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=max_model_len,
                         bos_token_id=1, eos_token_id=2).save_pretrained(folder)
blocks_per_request = -(-(input_len + output_len) // 16)
llm = LLM(folder, device="cpu", dtype="float32", load_format="dummy", num_kv_blocks=batch * blocks_per_request + 1,
          block_size=16, max_num_seqs=batch, max_num_batched_tokens=input_len * batch, max_model_len=max_model_len)
engine, runner = llm.engine, llm.engine.runner
# the device stubbed out: prefill logits fixed; decode through a CUDA-graph holder built on the CPU
logits = torch.randn(batch, VOCAB)
runner.forward = lambda inputs: logits[:len(inputs.row_owner)]
graphs = DecodeGraphs(runner.model, runner.kv_caches, runner.sampler, 16, max_model_len, batch, torch.device("cpu"))
for b in graphs.buckets:
    graphs.forward_graphs[b] = NoReplay()
    graphs.greedy_ids[b] = torch.randint(3, VOCAB, (b,))
runner.graphs = graphs
if overlap != "default":
    engine.async_scheduling = overlap == "on"

class SimulatedDevice:
    # a serial device: a decode step takes device_us from the later of its launch and the previous step's end
    def __init__(self, us):
        self.seconds, self.free_at = us / 1e6, 0.0
    def submit(self):
        self.free_at = max(time.perf_counter(), self.free_at) + self.seconds
        return self.free_at

def wait_until(t):
    while (left := t - time.perf_counter()) > 0:
        time.sleep(left)

class SimulatedEvent:
    def __init__(self, t):
        self.t = t
    def synchronize(self):
        wait_until(self.t)

if device_us:
    device = SimulatedDevice(device_us)
    graph_run = graphs.run
    def run_and_wait(items, sampling):  # the waiting engine reads the tokens at once: it waits for the step
        out = graph_run(items, sampling)
        wait_until(device.submit())
        return out
    graphs.run = run_and_wait
    if hasattr(graphs, "launch"):
        graph_launch = graphs.launch
        def launch_later(items, previous=None, sources=None):  # tokens there when the step ends
            out = graph_launch(items, previous, sources)
            out.event = SimulatedEvent(device.submit())
            return out
        graphs.launch = launch_later
profile = Profile()
profile.wrap(engine.scheduler, "schedule", "schedule")
profile.wrap(engine.scheduler, "update", "update")
profile.wrap(runner, "execute", "runner")
profile.wrap(runner, "prepare", "inputs")
profile.wrap(runner, "_finish", "sample")
profile.wrap(graphs, "run", "inputs")
profile.wrap(graphs, "stage", "inputs")
profile.wrap(engine, "_process", "outputs")
profile.wrap(engine, "_process_step", "outputs")

params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True, detokenize=False)
import inspect
final_only = {} if stream or "stream" not in inspect.signature(engine.add_request).parameters else {"stream": False}

def decode_steps(run):
    # per decode step: each stage's time (instrumented run) or the step's alone (plain run: no wrappers' cost)
    for i in range(batch):
        engine.add_request(torch.randint(3, VOCAB, (input_len,)).tolist(), params, request_id=f"{run}-{i}",
                           **final_only)
    steps, finished, graph_steps = [], 0, runner.num_graph_steps
    while engine.has_unfinished():
        decode = all(r.num_computed_tokens >= r.num_prompt_tokens for r in engine.scheduler.running) and \
            len(engine.scheduler.running) == batch  # (async scheduling: a token in flight is computed)
        profile.times.clear()
        start, start_wall = time.thread_time_ns(), time.perf_counter_ns()
        for out in engine.step():  # LLM.generate's loop
            if out.finished:
                finished += 1
        total, wall = time.thread_time_ns() - start, time.perf_counter_ns() - start_wall
        if decode:
            steps.append({**profile.times, "step": total, "wall": wall})
    assert finished == batch, finished
    assert runner.num_graph_steps - graph_steps >= output_len - 2, runner.num_graph_steps
    return steps[2:]  # warm-up

staged = decode_steps("staged")
profile.unwrap()
plain = decode_steps("plain")
result = {k: statistics.median(s.get(k, 0) for s in staged) / 1e3 for k in {k for s in staged for k in s}}
result["step"] = statistics.median(s["step"] for s in plain) / 1e3
result["wall"] = statistics.median(s["wall"] for s in plain) / 1e3
print(json.dumps(result))
"""

STAGES = ["schedule", "inputs", "runner", "sample", "update", "outputs", "step", "wall"]


def run_child(tree: Path, batch: int, mode: str, overlap: str, args) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _CHILD, str(batch), str(args.input_len), str(args.output_len),
                          str(args.max_model_len), mode, overlap, str(args.device_us)], env=env, capture_output=True,
                         text=True, cwd=tree)
    if out.returncode:
        raise SystemExit(f"{tree} batch {batch} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trees", nargs="+", default=[str(ROOT)])
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 128, 256, 512])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=4096, help="the decode graph's block-table width")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--modes", nargs="+", default=["stream", "generate"], choices=["stream", "generate"],
                        help="stream: an output per request per step (LLM.stream, the server); generate: outputs "
                             "only when requests finish (LLM.generate; trees without add_request(stream=) stream)")
    parser.add_argument("--overlap", nargs="+", default=["default"], choices=["default", "off", "on"],
                        help="async scheduling off / on (default: the tree's own; with the stub it is off)")
    parser.add_argument("--device-us", type=int, default=0,
                        help="a simulated serial device: each decode step takes this long from its launch (or the "
                             "previous step's end); the waiting engine waits for it every step, async scheduling "
                             "only when it reads the tokens. 'wall' then shows the host time not hidden")
    args = parser.parse_args()
    trees = [Path(t).resolve() for t in args.trees]
    results: dict[tuple[Path, str, str, int], list[dict]] = {}
    for _ in range(args.rounds):
        for batch in args.batch:
            for mode in args.modes:
                for overlap in args.overlap:
                    for tree in trees:
                        results.setdefault((tree, mode, overlap, batch), []).append(
                            run_child(tree, batch, mode, overlap, args))
    print(f"load: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f}; us of thread CPU time per decode step "
          f"(median; wall: wall-clock us), input {args.input_len}, output {args.output_len}, max_model_len "
          f"{args.max_model_len}, simulated device step {args.device_us} us")
    print("| tree | outputs | async | batch | " + " | ".join(STAGES) + " | step us/request |")
    print("|---|---|---|---|" + "---|" * (len(STAGES) + 1))
    for (tree, mode, overlap, batch), rows in sorted(results.items(), key=lambda kv: (kv[0][3], kv[0][1])):
        cells = [statistics.median(r.get(s, 0.0) for r in rows) for s in STAGES]
        print(f"| {tree.name} | {mode} | {overlap} | {batch} | " + " | ".join(f"{c:,.0f}" for c in cells)
              + f" | {cells[STAGES.index('step')] / batch:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
