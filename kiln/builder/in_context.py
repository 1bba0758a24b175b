"""GEMM and conv tactics timed in context: close contenders re-timed as the engine runs them, in its native segments.

The search (autotune.py) times each candidate alone: a loop of its own calls on its own inputs, its weights
and activations warm in the caches and its threads awake. In the engine a layer runs after others that evicted
them, and where two tactics use different thread pools (kiln's GEMM on pool.c, oneDNN's inner product on
OpenMP) one's workers are asleep or spinning when the other starts. On the T5-small encoder (2 threads, quiet
Xeon) cpu.gemm.kiln_packed timed 2-5% faster than cpu.gemm.onednn_direct alone on the attention GEMMs and ~7%
slower in the network (bench/results/t5-cpu-2026-12-04d.md); on the same machine under load the tuner's
process CPU time put onednn_direct's out projection at 0.2 ms where the network's wall clock saw 16-18 ms
(a barrier waiting out a descheduled thread: bench/results/intune-cpu-2026-12-05.md).

So, on the CPU, after the search: every FusedGemm and FusedConv layer (RETIMED_OPS) whose chosen tactic has a
native rival within CONTEXT_MARGIN of it alone (any, where CPU time timed several threads) is judged with the
layers of its signature (every block's QKV GEMM), one signature at a time: two whole programs, the chosen
tactics (A) and that signature's rival swapped in (B), run in interleaved rounds, each segment call timed by the
segment's own loop (Segment.timed). A layer's cost in context is its span: its own call and the calls after it up
to the next compared layer (the layer reading its output pays for where it left it), by the wall clock (at one
thread, the thread's CPU time: context_clock); a signature's cost is the least over rounds of its layers' spans'
sum (other work only adds time: `least`). The rival is kept where that is faster. A chosen tactic that is not
native (MKL, torch's default: outside the segments, where its rival would join them) is compared by whole runs
instead (on T5 at 2 threads and load 16, a build whose search took MKL for 12 GEMMs by CPU time ran 3.1x
onnxruntime; MobileNetV2's three 1x1 convolutions on cpu.conv.onednn_graph at 2 threads, faster alone, made the
engine 1.12x slower than onednn_direct there).

Cost: A bound once; each B shares every launch of A it does not swap (shared_launches), A's activation arena and
every native segment of A it would bind alike (they run in turn: Program's turns_with; one arena and one set of
bound calls and scratch resident, not two), and is let go before the next is bound, so the stage holds the network's packed weights and one signature's rivals' (binding every rival
at once packed DeiT-small's 49 GEMMs twice: +175-183 MiB). One warm-up run of each program, then interleaved
rounds per signature: they stop after CLEAR_ROUNDS where the two programs' samples lie apart, else after
MIN_ROUNDS once CONTEXT_BUDGET_S has passed, at most CONTEXT_ROUNDS.
The choice goes to the timing cache, keyed by the whole network as it runs (network_key): a rebuild of the same
model on the same machine and threads times nothing here.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable
from typing import Any

import torch

from kiln.builder.cpu_clock import PROCESS_CPU
from kiln.builder.timing_cache import TimingCache, attributes_json, signature_key
from kiln.kernels.cpu import hugepages
from kiln.plan.spec import ProgramSpec, StepSpec
from kiln.runtime.profiler import profile_segments
from kiln.runtime.program import Program
from kiln.runtime.rss import return_free_memory
from kiln.tactics import registry
from kiln.tactics.tactic import DEFAULT, InputMeta

# layers whose native tactics are re-timed in context. FusedConv: MobileNetV2 (ANY_MARGIN_OUTSIDE says how). A conv's
# native rivals are few (onednn_direct, winograd on 3x3, onednn_silu on SiLU), so a network's conv signatures to
# judge are a handful, each bounded as a GEMM's (CONTEXT_BUDGET_S). Fresh builds at 2 threads, AVX2-capped Zen 4,
# load 3-8 (bench/ctxconv_ab.py, bench/results/zoo-cpu-avx2-2026-12-06.md): ResNet-50 4 signatures (12 3x3 layers,
# winograd vs onednn_direct), 8-9 s of a 25-43 s build; MobileNetV2 1 layer, 0.3 s, or 5 layers, 1.1 s with the
# three onednn_graph convolutions (the engine then 0.82x the one chosen alone); a rebuild 0 s
RETIMED_OPS = ("FusedGemm", "FusedConv")
# A rival within this factor of the chosen tactic's time alone is re-timed; where the search timed several threads
# by the process's CPU time (a shared machine, cpu_clock.py) every native rival is: a wait at a barrier for a
# descheduled thread sleeps, uncounted, while a pool that does not wait for it (pool.c) counts its spinning. On
# the T5-small encoder at load ~14 on 2 vCPUs, oneDNN's inner products timed 0.6-1.0 ms by CPU time alone, 2.5x
# under kiln_packed's, and cost 24-28 ms each in the network, where kiln_packed's cost 1.7-4.8.
CONTEXT_MARGIN = 1.25
# ops whose chosen tactic, where it is not native, has its closest native rival judged at any margin alone: such a
# convolution runs between native segments and splits the one its rival would join (a hand-off the search alone
# does not see). MobileNetV2's three 96 -> 576 1x1 convolutions at 2 threads took cpu.conv.onednn_graph at 0.120 ms
# alone, 1.74x under onednn_direct's 0.209, and the engine ran 1.12x slower than with onednn_direct there
# (bench/results/zoo-cpu-avx2-2026-12-06.md). Not FusedGemm: confirmed() (autotune.py) times a non-native GEMM
# winner again against the best native one, and MKL's GEMMs are many on an Intel machine (a whole-run comparison
# each). Also a convolution reading a network input (an image), whatever its tactic: oneDNN's stem reads the image
# laid out NHWC, a copy the segment makes at its entry, and kiln's stem kernel reads it as it lies; alone, neither
# pays for the copy (_spans charges it in context).
ANY_MARGIN_OUTSIDE = ("FusedConv",)
CONTEXT_ROUNDS = 12
MIN_ROUNDS = 5
CLEAR_ROUNDS = 3  # ... or this many, where the two programs' samples already lie apart (_apart)
CONTEXT_BUDGET_S = 2.0  # per signature
WARMUP_RUNS = 1
# how a choice in context is made: part of its timing cache key (a new method does not read the old one's choices)
CONTEXT_METHOD = ("one signature at a time; spans of native segments, entry reorders charged to their readers, "
                  "whole runs for a non-native winner; wall clock, thread CPU at 1 thread; the least round")


@dataclasses.dataclass
class Rival:
    """The tactic a layer would run instead, with its config, both tactics' times alone, and the layers it is
    judged with (`group`: those of the same op, inputs and attributes, e.g. every block's QKV GEMM)."""

    tactic: str
    config: dict[str, Any]
    chosen_ms: float
    rival_ms: float
    group: str


@dataclasses.dataclass
class InContext:
    """What the stage found: step index -> {tactic: ms in context} for each layer compared (the faster is kept),
    and how: `rounds` of the programs (over all signatures), why they `stopped` ("clear", "budget" or "rounds";
    the signatures' distinct reasons joined), or `cached`."""

    found: dict[int, dict[str, float]]
    rounds: int = 0
    stopped: str = ""
    cached: bool = False
    # the network's outputs on the stage's inputs, run by the stage's program that runs the tactics it leaves (the
    # chosen program where no signature took its rival, the rival program where one did), else None: the accuracy
    # check judges these instead of binding and running the same program again (accuracy.settle's `tuned_outputs`)
    outputs: list[Any] | None = None

    def to_entry(self, spec: ProgramSpec, seconds: float) -> dict[str, Any]:
        """The timing cache's entry: the layers by name, each with its times in context."""
        return {"layers": {spec.steps[i].name: times for i, times in self.found.items()}, "rounds": self.rounds,
                "stopped": self.stopped, "seconds": round(seconds, 2)}


def rival_of(step: StepSpec, found: Any, inputs: list[InputMeta], configure,
             reads_network_input: bool = False) -> Rival | None:
    """The closest native rival of a layer's chosen tactic within its margin alone, or None; `found`: the
    search's LayerTuning, `configure(tactic)` a tactic's config for this layer. The margin is CONTEXT_MARGIN, or none
    where several threads were timed by the process's CPU time, or for a conv whose chosen tactic is not native or
    that reads a network input (ANY_MARGIN_OUTSIDE; `reads_network_input`: its tactics may differ by the entry
    reorder the segment makes for them, which no time alone holds: _spans)."""
    chosen, candidates = found.tactic, found.candidates
    if step.op_type not in RETIMED_OPS or not isinstance(candidates.get(chosen), float):
        return None
    outside = step.op_type in ANY_MARGIN_OUTSIDE and (not _native(chosen) or reads_network_input)
    margin = math.inf if outside or (found.clock == PROCESS_CPU and torch.get_num_threads() > 1) else CONTEXT_MARGIN
    chosen_ms = candidates[chosen]
    rivals = [(ms, name) for name, ms in candidates.items()
              if name != chosen and isinstance(ms, float) and _native(name) and ms <= margin * chosen_ms]
    if not rivals:
        return None
    rival_ms, name = min(rivals)
    group = json.dumps([step.op_type, step.domain, chosen, name, step.attributes,
                        [(m.shape and list(m.shape), str(m.dtype), m.constant) for m in inputs]], default=str)
    return Rival(name, configure(name), chosen_ms, rival_ms, group)


def context_clock(threads: int) -> int:
    """The clock a layer's calls are timed by in context: at one thread the calling thread's CPU time (its latency
    on a core of its own, and what other work on the machine does not add to), at several the wall clock (what
    waits for the other threads cost: the process's CPU time leaves a sleeping wait out)."""
    return time.CLOCK_THREAD_CPUTIME_ID if threads == 1 else time.CLOCK_MONOTONIC


def _native(name: str) -> bool:
    tactic = registry.get(name) if name else None
    return tactic is not None and tactic.native


def _spans(segments: list[Any], swapped: set[str]) -> dict[str, list[str]]:
    """Swapped layer -> what it is charged with in its segment: itself and the members after it up to the next
    swapped one, and first the reorder of a segment entry it reads where the segment lays that entry out for its
    readers (Segment.entry_reorders: an NCHW image copied into NHWC for oneDNN's stem, which kiln's stem kernel,
    reading the image as it lies, does not need). Timed alone, a layer never pays for that copy: at 2 threads the
    search kept oneDNN's stem on ResNet-tiny and RegNetY-tiny, and the engine with the stem kernel ran faster
    (bench/results/stem-avx2-2026-12-07.md)."""
    spans: dict[str, list[str]] = {}
    for segment in segments:
        current: list[str] | None = None
        for member in segment.members:
            name = member.ctx.name
            if name in swapped:
                current = spans[name] = [name]
            elif current is not None:
                current.append(name)
        for reorder, readers in getattr(segment, "entry_reorders", {}).items():
            for name in readers:
                if name in spans:
                    spans[name].insert(0, reorder)
    return spans


def _same_members(a: list[str] | None, b: list[str] | None, reorders: set[str]) -> bool:
    """Whether two spans hold the same members (the entry reorders one program makes and the other not aside)."""
    return a is not None and b is not None and [n for n in a if n not in reorders] == \
        [n for n in b if n not in reorders]


def _span_ms(per_layer: dict[str, float], span: list[str]) -> float:
    return sum(per_layer.get(name, 0.0) for name in span)


def choose(spec: ProgramSpec, weights: dict[str, Any], device: torch.device, inputs: list[Any],
           rivals: dict[int, Rival], cache: TimingCache, env: dict[str, Any], say: Callable[[str], None],
           launches: dict[tuple, Any] | None = None, release: Callable[[], None] | None = None) -> InContext:
    """The layers in `rivals` timed in context (retime), or the timing cache's choice for this network on this
    machine: `spec`'s steps whose rival was faster there take it (in place). An entry that does not fit the network
    (a hand-edited or damaged file) is said and timed again. `launches`: the build's prepared launches, which the
    chosen program shares and adds to (the engine binds them: the network is packed once per build); `release`: called
    after each layer the programs pack (Program's after_packing: a build's mapped weights let go, spill.py)."""
    start = time.perf_counter()
    key = network_key(spec, weights, inputs, rivals, env)
    entry = cache.contexts.get(key)
    if entry is not None:
        try:
            found = InContext(_found_in(entry, spec, rivals), cached=True)
        except ValueError as e:
            say(f"tactics: WARNING the timing cache's choice in context {key} does not fit this network ({e}): "
                "ignored, timed again")
        else:
            _apply(spec, rivals, found.found)
            return found
    found = retime(spec, weights, device, inputs, rivals, launches, release)
    cache.contexts[key] = found.to_entry(spec, time.perf_counter() - start)
    return found


def network_key(spec: ProgramSpec, weights: dict[str, Any], inputs: list[Any], rivals: dict[int, Rival],
                env: dict[str, Any]) -> str:
    """The timing cache key of a network's choice in context: a layer's cost there depends on every layer around
    it, so the key holds them all as they run (op, attributes, the values read and written, tactic and config),
    the shapes and dtypes of the weights and inputs, each rival, the machine (env: threads among it) and the
    method. Weight values are not in it: they do not change a float GEMM's time."""
    def meta(value: Any) -> Any:
        return [list(value.shape), str(value.dtype)] if isinstance(value, torch.Tensor) else type(value).__name__

    network = {
        "method": CONTEXT_METHOD,
        "steps": [{**{k: v for k, v in step.to_json().items() if k != "fused_from"},
                   "attributes": attributes_json(step.attributes)} for step in spec.steps],
        "constants": {name: meta(weights.get(key)) for name, key in spec.constants.items()},
        "inputs": [meta(value) for value in inputs],
        "rivals": {spec.steps[i].name: [rival.tactic, rival.config] for i, rival in rivals.items()},
        "environment": env,
    }
    return signature_key(network)


def _found_in(entry: Any, spec: ProgramSpec, rivals: dict[int, Rival]) -> dict[int, dict[str, float]]:
    """A cache entry's times in context by step index; ValueError (why) where it does not fit: a layer that is not
    one of `rivals`, or times of other tactics than the layer's chosen one and its rival."""
    layers = entry.get("layers") if isinstance(entry, dict) else None
    if not isinstance(layers, dict):
        raise ValueError("no layers")
    index = {spec.steps[i].name: i for i in rivals}
    found = {}
    for name, times in layers.items():
        if name not in index:
            raise ValueError(f"layer {name!r} is not one compared here")
        i = index[name]
        pair = {spec.steps[i].tactic or DEFAULT, rivals[i].tactic}
        if not isinstance(times, dict) or set(times) != pair or \
                not all(isinstance(ms, (int, float)) and ms >= 0 for ms in times.values()):
            raise ValueError(f"layer {name!r}: times {times!r}, expected ms of {sorted(pair)}")
        found[i] = {tactic: float(ms) for tactic, ms in times.items()}
    return found


def _apply(spec: ProgramSpec, rivals: dict[int, Rival], found: dict[int, dict[str, float]]) -> None:
    """Each layer whose rival ran faster in context takes it."""
    for i, times in found.items():
        chosen, rival = spec.steps[i].tactic or DEFAULT, rivals[i].tactic
        if times[rival] < times[chosen]:
            spec.steps[i].tactic, spec.steps[i].tactic_config = rival, rivals[i].config


def retime(spec: ProgramSpec, weights: dict[str, Any], device: torch.device, inputs: list[Any],
           rivals: dict[int, Rival], launches: dict[tuple, Any] | None = None,
           release: Callable[[], None] | None = None) -> InContext:
    """Step index -> {chosen tactic: ms in context, rival: ms in context} for the layers in `rivals` that could be
    compared (`found`), and the rounds that timed them; `spec`'s steps whose rival was faster take it (in place).

    One signature at a time: its layers swapped to their rival in a program that shares every other launch of the
    chosen program, timed against it, then let go before the next signature's is bound, so the stage holds the
    network's packed weights and one signature's rivals' (DeiT-small: all 49 GEMMs were rivals, and binding them
    at once packed the network twice). A native chosen tactic is compared by spans (in the native segments of
    both programs); one that is not native runs outside the segments, and its rival would join them, so its
    signature is compared by whole runs (`ms`: the whole run's least round, both sides)."""
    if not rivals:
        return InContext({})
    release = _trimmed(release)
    network = _network(spec, weights, device, inputs, rivals, {} if launches is None else launches, release)
    groups: dict[str, list[int]] = {}
    for i in sorted(rivals):
        groups.setdefault(rivals[i].group, []).append(i)
    found: dict[int, dict[str, float]] = {}
    rounds, stops = 0, []
    ran_rivals: list[tuple[list[tuple[str, dict[str, Any]]], list[Any]]] = []  # a faster rival program's outputs
    for members in groups.values():
        hugepages.new_chunk()  # the rival program's small packed weights in chunks of their own: they go with it
        timed = _time_group(network, members)
        if timed is not None and timed.outputs is not None:
            ran_rivals.append(timed.outputs)
        hugepages.new_chunk()
        return_free_memory()  # the rival program's packed weights and outputs: before the next one is bound
        if timed is None:
            continue
        for i in timed.layers:
            found[i] = {spec.steps[i].tactic or DEFAULT: round(timed.chosen_ms, 4),
                        rivals[i].tactic: round(timed.rival_ms, 4)}
        rounds += timed.rounds
        stops += [timed.stopped] if timed.stopped not in stops else []
    _apply(spec, rivals, found)
    swapped = {i for i in found if spec.steps[i].tactic == rivals[i].tactic}
    _drop_replaced(network, swapped)
    # the tuned engine's outputs where one of the stage's programs runs exactly its tactics: the chosen one where no
    # signature took its rival, else the rival program of the one signature that did
    final = _tactics(spec)
    outputs = _outputs(network.program, inputs) if not swapped else \
        next((ran for tactics, ran in ran_rivals if tactics == final), None)
    return InContext(found, rounds=rounds, stopped=", ".join(stops), outputs=outputs)


def _tactics(spec: ProgramSpec) -> list[tuple[str, dict[str, Any]]]:
    return [(step.tactic, step.tactic_config) for step in spec.steps]


def _outputs(program: Program, inputs: list[Any]) -> list[Any]:
    """A program's outputs on the stage's inputs, copies of their own (a program's output may be a view of its
    arena, which would keep the arena alive). Why: the program that runs the tactics the stage leaves is the tuned
    engine the accuracy check judges (accuracy.py); bound and run again there, it cost ResNet-50 a third program's
    segments, arena, scratch and run temporaries (+35-43 MiB, the build's peak in some builds:
    bench/results/mem8-2026-12-06.md). It is warm here: one more run costs no memory."""
    with torch.inference_mode():
        outputs = program.run(inputs)
    return [value.clone() if isinstance(value, torch.Tensor) else value for value in outputs]


def _trimmed(release: Callable[[], None] | None) -> Callable[[], None]:
    """`release` (the build's mapped weights let go), then the C heap's free pages given back, after each layer the
    stage's programs pack. Packing passes through freed blocks (a reorder's temporaries, a candidate's copies), and
    the heap keeps the pages of free blocks it touched: ResNet-50's chosen program bound +177 MiB resident for
    +106 MiB of packed weights and arena, the rest free heap it had been handed back after the search."""
    def after_packing() -> None:
        if release is not None:
            release()
        return_free_memory()
    return after_packing


def _drop_replaced(network: _Network, swapped: set[int]) -> None:
    """The chosen program's launches of the layers that took their rival, out of the build's launches: the engine
    binds the rival, and held to the end of the build they were a signature's weights packed twice through the
    whole-network check and the engine's load (DeiT-small's FFN: 12 layers, 28 MiB). A launch that a layer not
    swapped also runs goes too (that layer packs it again)."""
    stale = {id(network.program.steps[i].fn) for i in swapped}
    for key in [key for key, fn in network.launches.items() if id(fn) in stale]:
        del network.launches[key]


@dataclasses.dataclass
class _Network:
    """The chosen program each signature's rival program is timed against: the launches it prepared (shared with
    the rival programs) and the spans of the compared layers in its segments."""

    spec: ProgramSpec
    weights: dict[str, Any]
    device: torch.device
    inputs: list[Any]
    rivals: dict[int, Rival]
    program: Program
    launches: dict[tuple, Any]
    release: Callable[[], None] | None
    compared: set[str]
    spans: dict[str, list[str]]


@dataclasses.dataclass
class _Timed:
    """One signature's layers compared (`layers`: step indices), the least cost per layer in context of the chosen
    tactic and of the rival, and the rounds that timed them."""

    layers: list[int]
    chosen_ms: float
    rival_ms: float
    rounds: int
    stopped: str
    # where the rival was faster: the rival program's tactics and its outputs on the stage's inputs (_outputs)
    outputs: tuple[list[tuple[str, dict[str, Any]]], list[Any]] | None = None


def _network(spec: ProgramSpec, weights: dict[str, Any], device: torch.device, inputs: list[Any],
             rivals: dict[int, Rival], launches: dict[tuple, Any], release: Callable[[], None] | None) -> _Network:
    """The chosen program bound (every launch it prepares kept in `launches` for the rival programs to share)
    and warmed up."""
    program = Program(spec, weights, device, after_packing=release, shared_launches=launches)
    compared = {spec.steps[i].name for i in rivals}
    with torch.inference_mode():
        profile_segments(program, inputs, WARMUP_RUNS, context_clock(torch.get_num_threads()))
    return _Network(spec, weights, device, inputs, rivals, program, launches, release, compared,
                    _spans(program.segments, compared))


def _time_group(network: _Network, members: list[int]) -> _Timed | None:
    """The signature of `members` (step indices) swapped to its rival in a program of its own, timed against the
    chosen program; None where no layer of it can be compared (a native layer whose span differs between the
    programs). The rival program packs only the swapped layers' weights (a copy of the chosen program's launches:
    what it adds goes with it)."""
    spec, rivals = network.spec, network.rivals
    swapped = Program(_swapped(spec, rivals, set(members)), network.weights, network.device,
                      after_packing=network.release, shared_launches=dict(network.launches),
                      turns_with=network.program)
    programs = [network.program, swapped]
    if not _native(spec.steps[members[0]].tactic):  # whole runs
        samples, stopped = _rounds(programs, network.inputs)
        chosen_ms, rival_ms = (least(s["run"]) for s in samples)
        layers = members
    else:
        names = {i: spec.steps[i].name for i in members}
        spans = [network.spans, _spans(swapped.segments, network.compared)]
        reorders = {name for program in programs for segment in program.segments
                    for name in getattr(segment, "entry_reorders", {})}
        layers = [i for i in members if _same_members(spans[0].get(names[i]), spans[1].get(names[i]), reorders)]
        if not layers:
            return None
        samples, stopped = _rounds(programs, network.inputs, [[side[names[i]] for i in layers] for side in spans])
        chosen_ms, rival_ms = (least(s["spans"]) / len(layers) for s in samples)
    # as retime rounds them: where the rival is kept, its program may be the tuned engine (retime's `outputs`)
    outputs = (_tactics(swapped.spec), _outputs(swapped, network.inputs)) \
        if round(rival_ms, 4) < round(chosen_ms, 4) else None
    return _Timed(layers, chosen_ms, rival_ms, len(samples[0]["run"]), stopped, outputs)


def least(samples: list[float]) -> float:
    """A program's cost in context: the least of its rounds. Other work on the machine only adds time (a thread
    descheduled mid-run, a barrier waiting it out), so the least round is the one closest to the network's own
    cost, as autotune.measure takes the least of a candidate's rounds. The median did not hold under load: a
    2-thread MobileNetV2 build at load 6 on the 2-vCPU Zen 4 (capped to AVX2) timed its whole runs at 50-230 ms
    (the network runs in ~6), and kept cpu.conv.onednn_graph for a 1x1 convolution on a median of 52 against
    onednn_direct's 94 ms; with the cores to itself (SCHED_FIFO) the build took onednn_direct everywhere and ran
    0.80x onnxruntime (bench/results/zoo-cpu-avx2-2026-12-06.md, session 22)."""
    return min(samples)


def _swapped(spec: ProgramSpec, rivals: dict[int, Rival], which: set[int]) -> ProgramSpec:
    return dataclasses.replace(spec, steps=[
        dataclasses.replace(step, tactic=rivals[i].tactic, tactic_config=rivals[i].config) if i in which else step
        for i, step in enumerate(spec.steps)])


def _rounds(programs: list[Program], inputs: list[Any], spans: list[list[list[str]]] | None = None
            ) -> tuple[list[dict[str, list[float]]], str]:
    """Per program (the chosen, then the rival), per round: the whole run ("run") and, with `spans` (per program,
    the compared layers' spans), the spans summed ("spans"), ms, in interleaved rounds, each round starting at
    the next program; and why the rounds stopped. The rival program is warmed up first (the chosen one was)."""
    clock = context_clock(torch.get_num_threads())
    key = "run" if spans is None else "spans"
    samples: list[dict[str, list[float]]] = [{"run": [], "spans": []} for _ in programs]
    with torch.inference_mode():
        profile_segments(programs[1], inputs, WARMUP_RUNS, clock)
        deadline = time.perf_counter() + CONTEXT_BUDGET_S
        for round_ in range(CONTEXT_ROUNDS):
            if round_ >= CLEAR_ROUNDS and _apart(samples[0][key], samples[1][key]):
                return samples, "clear"
            if round_ >= MIN_ROUNDS and time.perf_counter() > deadline:
                return samples, "budget"
            shift = round_ % len(programs)  # what one run leaves behind falls on each program in turn
            for k in [*range(shift, len(programs)), *range(shift)]:
                start = time.clock_gettime(clock)
                per_layer = {name: ms[0] for name, ms in profile_segments(programs[k], inputs, 1, clock).items()}
                samples[k]["run"].append((time.clock_gettime(clock) - start) * 1e3)
                if spans is not None:
                    samples[k]["spans"].append(sum(_span_ms(per_layer, span) for span in spans[k]))
    return samples, "rounds"


def _apart(a: list[float], b: list[float]) -> bool:
    """Whether the comparison is decided by any of its samples: the two programs' do not overlap (in 3 rounds of
    two equal costs, 1 in 10)."""
    return max(a) < min(b) or max(b) < min(a)
