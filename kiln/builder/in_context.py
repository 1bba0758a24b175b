"""GEMM tactics timed in context: close contenders re-timed as the engine runs them, inside its native segments.

The search (autotune.py) times each candidate alone: a loop of its own calls on its own inputs, its weights
and activations warm in the caches and its threads awake. In the engine a layer runs after others that evicted
them, and where two tactics use different thread pools (kiln's GEMM on pool.c, oneDNN's inner product on
OpenMP) one's workers are asleep or spinning when the other starts. On the T5-small encoder (2 threads, quiet
Xeon) cpu.gemm.kiln_packed timed 2-5% faster than cpu.gemm.onednn_direct alone on the attention GEMMs and ~7%
slower in the network (bench/results/t5-cpu-2026-12-04d.md); on the same machine under load the tuner's
process CPU time put onednn_direct's out projection at 0.2 ms where the network's wall clock saw 16-18 ms
(a barrier waiting out a descheduled thread: bench/results/intune-cpu-2026-12-05.md).

So, on the CPU, after the search: every FusedGemm layer whose chosen tactic has a native rival within
CONTEXT_MARGIN of it alone (any, where CPU time timed several threads) is run in two whole programs, the chosen
tactics (A) and every such layer's rival swapped in (B), in interleaved rounds, each segment call timed by the
segment's own loop (Segment.timed). A layer's cost in context is its span: its own call and the calls after it up
to the next swapped layer (the layer reading its output pays for where it left it), by the wall clock (at one
thread, the thread's CPU time: context_clock); the layers of one signature (every block's QKV GEMM) are judged
together, by the median over rounds of their spans' sum. The rival is kept where that is faster. A chosen tactic
that is not native (MKL, torch's default: outside the segments, where its rival would join them) is compared by
whole runs instead, of a third program with only its signature swapped (on T5 at 2 threads and load 16, a build
whose search took MKL for 12 GEMMs by CPU time ran 3.1x onnxruntime). Cost: two programs bound, one more per
non-native signature, sharing every layer prepared alike (only the rivals' weights are packed again), and
CONTEXT_ROUNDS runs of each, at most CONTEXT_BUDGET_S beyond the first MIN_ROUNDS.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time
from typing import Any

import torch

from kiln.builder.cpu_clock import PROCESS_CPU
from kiln.plan.spec import ProgramSpec, StepSpec
from kiln.runtime.profiler import profile_segments
from kiln.runtime.program import Program
from kiln.tactics import registry
from kiln.tactics.tactic import DEFAULT, InputMeta

RETIMED_OPS = ("FusedGemm",)  # layers whose native tactics are re-timed in context
# A rival within this factor of the chosen tactic's time alone is re-timed; where the search timed several threads
# by the process's CPU time (a shared machine, cpu_clock.py) every native rival is: a wait at a barrier for a
# descheduled thread sleeps, uncounted, while a pool that does not wait for it (pool.c) counts its spinning. On
# the T5-small encoder at load ~14 on 2 vCPUs, oneDNN's inner products timed 0.6-1.0 ms by CPU time alone, 2.5x
# under kiln_packed's, and cost 24-28 ms each in the network, where kiln_packed's cost 1.7-4.8.
CONTEXT_MARGIN = 1.25
CONTEXT_ROUNDS = 12
MIN_ROUNDS = 5
CONTEXT_BUDGET_S = 2.0
WARMUP_RUNS = 2


@dataclasses.dataclass
class Rival:
    """The tactic a layer would run instead, with its config, both tactics' times alone, and the layers it is
    judged with (`group`: those of the same op, inputs and attributes, e.g. every block's QKV GEMM)."""

    tactic: str
    config: dict[str, Any]
    chosen_ms: float
    rival_ms: float
    group: str


def rival_of(step: StepSpec, found: Any, inputs: list[InputMeta], configure) -> Rival | None:
    """The closest native rival of a layer's chosen tactic within its margin alone, or None; `found`: the
    search's LayerTuning, `configure(tactic)` a tactic's config for this layer. The margin is CONTEXT_MARGIN, or none
    where several threads were timed by the process's CPU time."""
    chosen, candidates = found.tactic, found.candidates
    if step.op_type not in RETIMED_OPS or not isinstance(candidates.get(chosen), float):
        return None
    margin = math.inf if found.clock == PROCESS_CPU and torch.get_num_threads() > 1 else CONTEXT_MARGIN
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
    tactic = registry.get(name)
    return tactic is not None and tactic.native


def _spans(segments: list[Any], swapped: set[str]) -> dict[str, list[str]]:
    """Swapped layer -> the segment members it is charged with: itself and the members after it up to the next
    swapped one (in one segment)."""
    spans: dict[str, list[str]] = {}
    for segment in segments:
        current: list[str] | None = None
        for member in segment.members:
            name = member.ctx.name
            if name in swapped:
                current = spans[name] = [name]
            elif current is not None:
                current.append(name)
    return spans


def _span_ms(per_layer: dict[str, float], span: list[str]) -> float:
    return sum(per_layer.get(name, 0.0) for name in span)


def retime(spec: ProgramSpec, weights: dict[str, Any], device: torch.device, inputs: list[Any],
           rivals: dict[int, Rival]) -> dict[int, dict[str, float]]:
    """Step index -> {chosen tactic: ms in context, rival: ms in context} for the layers in `rivals` that could be
    compared; `spec`'s steps whose rival was faster take it (in place).

    A native chosen tactic is compared by spans (in the native segments of both programs); a chosen tactic that is
    not native runs outside the segments, and its rival would join them, so its signature is compared by whole runs
    of a program of its own with only that signature swapped (`ms`: the whole run's median, both sides)."""
    if not rivals:
        return {}
    names = {spec.steps[i].name: i for i in rivals}
    outside = {rivals[i].group for i in rivals if not _native(spec.steps[i].tactic)}
    swapped = _swapped(spec, rivals, {i for i in rivals if rivals[i].group not in outside})
    # the programs share every layer prepared alike (its tactic, configuration and weights: shared_launch_key), so
    # only the swapped layers' weights are packed again, not the whole network's once per program
    shared: dict[tuple, Any] = {}
    specs = [spec, swapped, *(_swapped(spec, rivals, {i for i in rivals if rivals[i].group == group})
                              for group in sorted(outside))]
    programs = [Program(s, weights, device, shared_launches=shared) for s in specs]
    spans = [_spans(p.segments, set(names)) for p in programs[:2]]
    groups: dict[str, list[str]] = {}
    for name, i in names.items():
        if rivals[i].group in outside or (name in spans[0] and spans[0][name] == spans[1].get(name)):
            groups.setdefault(rivals[i].group, []).append(name)
    if not groups:
        return {}
    samples = _rounds(programs, inputs, spans, {g: m for g, m in groups.items() if g not in outside})
    found = {}
    for group, members in groups.items():
        if group in outside:  # whole runs: A against this signature's own program
            k = 2 + sorted(outside).index(group)
            chosen_ms, rival_ms = (statistics.median(samples[j]["run"]) for j in (0, k))
        else:
            chosen_ms, rival_ms = (statistics.median(s[group]) / len(members) for s in samples[:2])
        for name in members:
            i = names[name]
            chosen, rival = spec.steps[i].tactic or DEFAULT, rivals[i].tactic
            found[i] = {chosen: round(chosen_ms, 4), rival: round(rival_ms, 4)}
            if rival_ms < chosen_ms:
                spec.steps[i].tactic, spec.steps[i].tactic_config = rival, rivals[i].config
    return found


def _swapped(spec: ProgramSpec, rivals: dict[int, Rival], which: set[int]) -> ProgramSpec:
    return dataclasses.replace(spec, steps=[
        dataclasses.replace(step, tactic=rivals[i].tactic, tactic_config=rivals[i].config) if i in which else step
        for i, step in enumerate(spec.steps)])


def _rounds(programs: list[Program], inputs: list[Any], spans: list[dict[str, list[str]]],
            groups: dict[str, list[str]]) -> list[dict[str, list[float]]]:
    """Per program, per round: each group's spans summed (the first two programs) and the whole run ("run"), ms,
    the programs in interleaved rounds, each round starting at the next one."""
    clock = context_clock(torch.get_num_threads())
    samples: list[dict[str, list[float]]] = [{"run": [], **{g: [] for g in groups}} for _ in programs]
    with torch.inference_mode():
        for program in programs:
            profile_segments(program, inputs, WARMUP_RUNS, clock)
        deadline = time.perf_counter() + CONTEXT_BUDGET_S
        for round_ in range(CONTEXT_ROUNDS):
            if round_ >= MIN_ROUNDS and time.perf_counter() > deadline:
                break
            shift = round_ % len(programs)  # what one run leaves behind falls on each program in turn
            for k in [*range(shift, len(programs)), *range(shift)]:
                start = time.clock_gettime(clock)
                per_layer = {name: ms[0] for name, ms in profile_segments(programs[k], inputs, 1, clock).items()}
                samples[k]["run"].append((time.clock_gettime(clock) - start) * 1e3)
                if k < 2:
                    for group, members in groups.items():
                        samples[k][group].append(sum(_span_ms(per_layer, spans[k][name]) for name in members))
    return samples
