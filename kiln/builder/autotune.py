"""Tactic search at build: every layer with several candidate kernels gets the fastest correct one.

    1. run the lowered program once on example inputs at the tuning shapes (config.shapes,
       symbolic dims 1), recording each tunable layer's real inputs and reference output — at one
       tuning point each layer is tuned (2, 3) as the run reaches it, so one layer's record is alive
       at a time; with a profile's other points too, every record is taken first;
    2. per layer: drop candidates that do not support it (with the reason), check each
       survivor against the op's registered implementation on those inputs — in float32 on
       float32 copies for a half-precision layer (the fp32 reference) — a wrong result drops it,
       with the error; time what is left together (or, with KILN_TUNE_TOURNAMENT=1, in a tournament: the
       best so far against the next, the loser's prepared state let go at once, two prepared at a time) —
       interleaved rounds after a warm-up, median of CUDA events over CUDA-graph replays, on the
       CPU the least of the rounds, of wall time or, where other work shares the CPUs, of the
       process's CPU time (measure.py; cpu_clock.py) — and keep the fastest by every candidate's
       times; a layer whose every candidate was dropped by the check runs its default, and the build
       log, the header (`fallback_layers`) and inspect say so (fallback_reason);
    3. the timing cache answers layers it has seen on this machine: nothing is timed, the same
       tactic is chosen (its result is still checked: where this layer's inputs fail it, the next fastest
       cached one that passes); on the CPU, a profile's mid and min shapes are checked and timed too, and
       the choice is the least summed ratio to each shape's best (_choose_over);
    4. on the CPU, a GEMM or conv layer whose chosen tactic had a native rival close to it alone is timed again
       in context, the two whole programs run as the engine runs them, and takes the faster there (in_context.py;
       the timing cache keeps that choice per network: a rebuild times nothing here either);
    5. the whole program runs once more with the chosen tactics and is judged against the error
       the default engine itself makes at its precision (accuracy.py): when it is worse, only the
       layers to blame go back to their default, and the header and the build log say which and why.

The choices land in the steps (`StepSpec.tactic`); chosen, runner-up and times per layer go
to the engine header for `kiln inspect`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from kiln.builder import in_context
from kiln.builder.accuracy import settle
from kiln.builder.cpu_clock import PROCESS_CPU, WALL, cpu_clock
from kiln.builder.layer_records import Recorded, record_layers, reference_check
from kiln.builder.measure import measure
from kiln.builder.precompile import CandidateKernels
from kiln.builder.timing_cache import TimingCache, environment, layer_signature, signature_key
from kiln.ir import dtypes
from kiln.kernels.cpu import hugepages
from kiln.plan.spec import Binding, ProgramSpec, StepSpec
from kiln.runtime.engine import place_weight
from kiln.runtime.program import Program
from kiln.runtime.rss import return_free_memory
from kiln.tactics import registry
from kiln.tactics.tactic import DEFAULT, InputMeta, Launch, Tactic

Progress = Callable[[str], None]


@dataclasses.dataclass
class LayerTuning:
    """What the search found for one layer (stored in the engine header, shown by inspect)."""

    tactic: str
    time_ms: float | None
    runner_up: str | None = None
    runner_up_ms: float | None = None
    candidates: dict[str, float | str] = dataclasses.field(default_factory=dict)  # ms, or why dropped
    cached: bool = False
    at: dict[str, dict[str, float]] | None = None  # ms at the profile's other points timed too ("mid", "min"; "max")
    clock: str | None = None  # on the CPU, what the ms are: WALL, or PROCESS_CPU where other work shared the CPUs

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---- example inputs ----------------------------------------------------------------------------

def example_inputs(bindings: list[Binding], shapes: dict[str, list[int]], seed: int = 0) -> list[Any]:
    """One input per binding at the tuning shape: floats random normal, integers and bools 1
    (a valid token id, mask value and index for the models kiln meets), symbolic dims 1."""
    generator = torch.Generator().manual_seed(seed)
    values = []
    for b in bindings:
        if b.kind != "tensor" or b.dtype is None or b.shape is None:
            raise ValueError(f"input {b.name!r} is a {b.kind} of {b.dtype}: no example input for it")
        shape = list(shapes.get(b.name) or [d if isinstance(d, int) else 1 for d in b.shape])
        dtype = dtypes.BY_NAME[b.dtype].torch
        if dtype is None:
            raise ValueError(f"input {b.name!r}: no torch dtype for {b.dtype}")
        if dtype.is_floating_point:
            values.append(torch.randn(shape, generator=generator).to(dtype))
        else:
            values.append(torch.ones(shape, dtype=dtype))
    return values


# ---- the search --------------------------------------------------------------------------------

class _TuningFailed(Exception):
    """Carries an error of the tactic search out of the example run it happened inside."""




def _candidates(step: StepSpec, device: torch.device, opt_level: int, allowed: list[str]) -> list[Tactic]:
    found = registry.candidates(step.op_type, step.domain, device.type, opt_level)
    if allowed:
        found = [t for t in found if any(t.name == a or t.name.startswith(a + ".") for a in allowed)]
    return found


def _usable(tactics: list[Tactic], step: StepSpec,
            metas: list[list[InputMeta]]) -> tuple[list[Tactic], dict[str, float | str]]:
    """The tactics that support the layer at every point's inputs, and why each other one does not."""
    notes: dict[str, float | str] = {}
    usable: list[Tactic] = []
    for t in tactics:
        ok = next((found for found in (t.check(step, m) for m in metas) if found is not True), True)
        if ok is True:
            usable.append(t)
        else:
            notes[t.name] = f"unsupported: {ok}"
    return usable, notes


def _tune_layer(step: StepSpec, record: Recorded, fn: Launch, ctx, attrs: dict, constants: list[Any],
                tactics: list[Tactic], device: torch.device, cache: TimingCache, env: dict,
                runs: int, others: dict[str, Recorded] | None = None) -> tuple[LayerTuning, dict[str, Any]]:
    """(what was found, the chosen tactic's config) for one layer; `others`: its inputs at other points of
    the profile ("mid", "min"), where every candidate is also checked and timed (see _choose_over)."""
    labels = list(others or {})
    points = [record] + [others[label] for label in labels]
    metas = [[InputMeta.of(a, c is not None) for a, c in zip(r.args, constants)] for r in points]
    usable, notes = _usable(tactics, step, metas)
    if not usable:
        return LayerTuning(DEFAULT, None, candidates=notes), {}

    keys = [signature_key(layer_signature(step, m, [DEFAULT] + [t.name for t in usable], env)) for m in metas]
    cached = [cache.get(key) for key in keys]
    # A cache hit holds the measurements: the selection rule below is applied to them again, and
    # only the winner is prepared and checked (the next by that rule where the winner fails).
    names = {DEFAULT} | {t.name for t in usable}
    known = [{k: v for k, v in c["times_ms"].items() if k in names} if c is not None else {} for c in cached]
    hit = all(known)
    wanted = _choose_over(known) if hit else None
    if hit and not _native(wanted) and any(_native(k) for k in known[0]) \
            and not all(c.get("confirmed") for c in cached):
        hit, wanted = False, None  # an entry from before `confirmed`: a non-native win is timed again, once
        cache.hits, cache.misses = cache.hits - len(keys), cache.misses + len(keys)
    checks = [reference_check(fn, ctx, r, attrs) for r in points]
    # A tactic's own checker judges the layer, not the tactic: made once per point for every tactic that shares it
    # (the FP8 residual bound runs the reference twice over the layer's outputs: 2·10^8 of them at ResNet-50 b256,
    # and every CUDA QConv tactic, up to 22 on a layer at opt level 3, carries the same checker)
    own_checks: dict[tuple[Any, int], Callable[[Any], str | None] | None] = {}
    configs: dict[str, dict[str, Any]] = {}

    def admitted(t: Tactic) -> list[Callable[[], Any]] | None:
        """Prepare `t` and check it at every point: its timed calls (one per point), or None with why it is dropped
        noted."""
        config = configs[t.name] = t.configure(step, metas[0])
        calls: list[Callable[[], Any]] = []
        problem = None
        hugepages.new_chunk()  # its small packed weights in a chunk of their own: they go with it, not with a rival
        try:
            launch = t.prepare(dataclasses.replace(step, tactic=t.name, tactic_config=config), constants, device)
            for p, (r, check) in enumerate(zip(points, checks)):
                if t.checker is not None:  # a tactic whose arithmetic is not the op's says how it is judged
                    if (t.checker, p) not in own_checks:
                        own_checks[t.checker, p] = t.checker(fn, ctx, r.args, attrs)
                    check = own_checks[t.checker, p] or check  # None: as every tactic
                args = [t.to_layout(a) for a in r.args]
                with torch.inference_mode():
                    problem = check(launch(ctx, *args, **attrs))
                if problem:
                    break
                # a tactic that runs bound inside a native segment may say how to time it that way
                timed = getattr(launch, "timed", None)
                calls.append(timed(*args) if timed is not None else
                             lambda launch=launch, args=args: launch(ctx, *args, **attrs))
        except Exception as e:  # noqa: BLE001  a candidate that fails is dropped, with the reason
            problem = f"failed: {type(e).__name__}: {str(e)[:200]}"
        if problem:
            notes[t.name] = f"rejected: {problem}"
            return None
        return calls

    if hit:
        # The cached winner, checked on this layer's inputs; where it fails, the next by the same rule, down to the
        # default. An identical layer timed it and its data passed: FP8 fast accumulation is not within the bound
        # on every layer's data (ResNet-50 FP8 at batch 256, H200: node_Conv_896 took a fast-accumulation tile,
        # node_Conv_905, the same shape, rejected it and ran its default: 1.05 ms, the next candidate 0.033 ms)
        usable_by_name = {t.name: t for t in usable}
        while wanted != DEFAULT and admitted(usable_by_name[wanted]) is None:
            known = [{k: v for k, v in point.items() if k != wanted} for point in known]
            wanted = _choose_over(known) if all(known) else DEFAULT
        # every usable tactic's cached time but the rejected ones': a rival close to the winner is timed again in
        # context (in_context.py)
        found = _result(wanted, known, {**cached[0].get("notes", {}), **notes}, cached=True, labels=labels)
        found.clock = cached[0].get("clock", WALL if device.type == "cpu" else None)
        return found, configs.get(wanted, {})

    # one clock for every point of the layer: its times are compared with each other (_choose_over)
    clock = cpu_clock(torch.get_num_threads()) if device.type == "cpu" else None
    timing = tournament if TOURNAMENT else together
    times = timing(usable, admitted, [lambda r=r: fn(ctx, *r.args, **attrs) for r in points], device, runs, clock)
    for measured, key in zip(times, keys):
        cache.put(key, {"chosen": _choose(measured), "times_ms": measured, "notes": notes, "confirmed": True,
                        "layer": f"{step.domain or 'ai.onnx'}::{step.op_type}",
                        **({} if clock is None else {"clock": clock})})
    chosen = _choose_over(times)
    found = _result(chosen, times, notes, cached=False, labels=labels)
    found.clock = clock
    return found, configs.get(chosen, {})


# Time a layer's candidates in a tournament (two prepared at a time) instead of all together. Off by default: on
# ResNet-50 (2-vCPU EPYC) it lowered the search's own peak (277 -> 244 MiB) but not the build's (the in-context stage
# sets it: 336 MiB both ways) and made the search 1.5-2x slower (37-54 -> 66-81 s); bench/results/mem8-2026-12-06.md.
TOURNAMENT = os.environ.get("KILN_TUNE_TOURNAMENT", "0") == "1"


def together(usable: list[Tactic], admitted: Callable[[Tactic], list[Callable[[], Any]] | None],
             default: list[Callable[[], Any]], device: torch.device, runs: int,
             clock: str | None) -> list[dict[str, float]]:
    """Per point of the layer, every candidate's ms, all admitted candidates prepared first and timed together in
    interleaved rounds (the default's first, then each admitted tactic's in `usable`'s order): the search as it was
    before `tournament`, and still the default."""
    prepared = {t.name: calls for t in usable if (calls := admitted(t)) is not None}
    return [_timed_together({DEFAULT: run_default} | {name: calls[p] for name, calls in prepared.items()},
                            device, runs, clock)
            for p, run_default in enumerate(default)]


def _timed_together(timed: dict[str, Callable[[], Any]], device: torch.device, runs: int,
                    clock: str | None) -> dict[str, float]:
    """One point's calls timed in interleaved rounds (measure), the close ones again on a shared CPU
    (contenders_again), a non-native winner confirmed against a native loser (confirmed): each one's ms."""
    clocked = {} if clock is None else {"clock": clock}
    with torch.inference_mode():
        measured = measure(timed, device, runs, **clocked)
        if clock == PROCESS_CPU:
            measured = contenders_again(measured, timed, device, runs, clock)
        return confirmed(measured, timed, device, runs, **clocked)


def tournament(usable: list[Tactic], admitted: Callable[[Tactic], list[Callable[[], Any]] | None],
               default: list[Callable[[], Any]], device: torch.device, runs: int,
               clock: str | None) -> list[dict[str, float]]:
    """Per point of the layer, every candidate's ms (the default's first, then each admitted tactic's in `usable`'s
    order), timed in a tournament: the best so far (the default to begin with) against the next candidate,
    prepared and checked (`admitted`: its timed call per point, or None where it is dropped), in interleaved
    rounds at every point, then the loser's prepared state let go at once. Each candidate keeps its least time
    over the matches it played (interference only ever adds time); the choice is made from these times by the
    same rule as ever (_choose_over), so the same times choose the same tactic.

    Why: held all at once while they were timed together, a layer's candidates' packed weights, frozen graphs
    and outputs set the build's peak (ResNet-50 on a 2-vCPU EPYC: +110-130 MiB above what the search holds at a
    3x3 512-channel layer, each of four candidates packing its 9.4 MiB weight, onednn_graph's freeze twice that;
    bench/results/mem8-2026-12-06.md). Now two candidates are prepared at a time. A match is timed as the whole
    layer was (measure; on a shared CPU contenders_again; a non-native winner confirmed against a native loser).
    Cost: N candidates take N-1 matches, each with its own warm-up, rounds and re-timing passes: ResNet-50's search
    took 66-81 s where timing all together took 37-54 (2 vCPUs, load 3-5)."""
    times: list[dict[str, float]] = [{} for _ in default]

    def play(sides: dict[str, list[Callable[[], Any]]]) -> None:
        for p, point in enumerate(times):
            measured = _timed_together({name: calls[p] for name, calls in sides.items()}, device, runs, clock)
            for name, ms in measured.items():
                point[name] = min(point.get(name, math.inf), ms)

    best: tuple[str, list[Callable[[], Any]]] = (DEFAULT, default)
    played = False
    for t in usable:
        calls = admitted(t)
        if calls is None:
            continue
        play({best[0]: best[1], t.name: calls})
        played = True
        pair = (best[0], t.name)
        if _choose_over([{k: point[k] for k in pair} for point in times]) == t.name:
            best = (t.name, calls)
        # the loser's launch, its packed weights and outputs go now (the heap's pages they touched serve the next
        # candidate; the search trims once per layer)
        del calls
    if not played:
        play({DEFAULT: default})  # nothing admitted: the default's time alone, for the header and the cache
    return times


# Where other work shares the CPUs, the candidates within this factor of the best are timed again ...
CONTENDERS = 2.0
CONTENDER_PASSES = 2  # ... this many more times, a pass of `runs` rounds each


def contenders_again(measured: dict[str, float], fns: dict[str, Callable[[], Any]], device: torch.device,
                     runs: int, clock: str) -> dict[str, float]:
    """`measured`, with every candidate within CONTENDERS of the best (after the native and layout credits)
    timed in CONTENDER_PASSES more passes, each keeping its least time.

    Why: on a shared machine a burst of other work (a build, a test suite starting) can last a whole pass of
    one layer's rounds, and even CPU time grows under it (caches evicted, workers polling for a descheduled
    caller). Passes later in time are unlikely to meet the same burst; only the candidates that could win
    are timed again, so a layer with a clear winner costs nothing more. An LSTM layer on a 2-vCPU VM with
    three busy loops beside: cpu.lstm.fused measured 1.7-5.4 ms (one pass of 10 rounds) across five builds."""
    for _ in range(CONTENDER_PASSES):
        best = min(_effective_ms(k, v) for k, v in measured.items())
        close = [k for k, v in measured.items() if _effective_ms(k, v) <= CONTENDERS * max(best, 1e-6)]
        if len(close) < 2:
            return measured
        again = measure({k: fns[k] for k in close}, device, runs, clock=clock)
        measured = {**measured, **{k: min(measured[k], again[k]) for k in again}}
    return measured


def confirmed(measured: dict[str, float], fns: dict[str, Callable[[], Any]], device: torch.device,
              runs: int, **clocked: str) -> dict[str, float]:
    """`measured`, with a tactic that is not native but won timed once more against the best native one,
    each keeping the faster of its two times (interference only ever adds time).

    Why: on a CPU shared with other work a burst can land on one candidate's samples, and a win by noise
    is kept in the timing cache for every later build. On a 2-core AMD EPYC (AVX-512) at load 4-6 the
    cache held torch's linear (MKL, whose AMD path runs at ~35% of a core's measured FMA peak where
    oneDNN's inner product runs at ~90%: bench/results/zoo-cpu-2026-12-02.md) as 4x faster than every
    oneDNN and kiln GEMM of a DCN layer; in the network it was the slowest of them, and it split the
    native segment."""
    chosen = _choose(measured)
    rivals = [k for k in measured if k != chosen and _native(k)]
    if _native(chosen) or not rivals:
        return measured
    rival = min(rivals, key=lambda k: _effective_ms(k, measured[k]))
    again = measure({k: fns[k] for k in (chosen, rival)}, device, runs, **clocked)  # by the same clock
    return {**measured, **{k: min(measured[k], again[k]) for k in again}}


def _native(name: str) -> bool:
    tactic = registry.get(name) if name != DEFAULT else None
    return tactic is not None and tactic.native


def _choose(times: dict[str, float]) -> str:
    """The least effective time; on a tie the default, then the first name in order: not the dict's order, which a
    timing makes (the default, then the registry's) and a timing cache read sorts (the file's keys are sorted), so
    that a rebuild from the cache takes the choice the timing made."""
    return min(times, key=lambda k: (_effective_ms(k, times[k]), k != DEFAULT, k))


def _choose_over(points: list[dict[str, float]]) -> str:
    """The tactic for every shape of a profile, from its times at the opt shape and, when timed there,
    at smaller ones: the least summed ratio to each point's best, costs as _effective_ms counts them
    (made positive). A tactic 7% faster at 8 x 128 but three times slower at 3 x 11 (a GEMM packing its
    weight per call outside a segment) is not chosen; one a little slower everywhere is not either."""
    if len(points) == 1:
        return _choose(points[0])
    names = [k for k in points[0] if all(k in p for p in points[1:])]

    def cost(name: str, ms: float) -> float:
        return _effective_ms(name, ms) + NATIVE_CREDIT_MS  # > 0: a non-native tactic pays the credit instead

    best = [max(min(cost(k, p[k]) for k in names), 1e-6) for p in points]  # a zero timing is not a divisor
    return min(names, key=lambda k: (sum(cost(k, p[k]) / b for p, b in zip(points, best)), k != DEFAULT, k))


# A layer timed alone does not pay for leaving its neighbours' layout: the default conv is timed
# on NCHW input, but in a channels-last stack it is handed NHWC tensors and hands NHWC back, and
# every switch costs a reorder. So a layout tactic wins unless the default is clearly faster.
LAYOUT_PREFERENCE = 1.25

# Nor does it pay for its own Python path as it runs inside the network, where each layer finds
# the interpreter's and torch's dispatch code evicted by the layer before it: ~36 µs a layer
# (MobileNetV2 on 2 threads: 6.0 ms a run, 4.0 ms of it in oneDNN, 55 layers), and a layer
# that is not native splits a segment in two (an exit allocated, an entry bound). A tactic that
# runs inside a native segment (kiln/runtime/native.py) skips both.
NATIVE_CREDIT_MS = 0.05
# ... and a layer's time alone, on a CPU shared with other work, is no finer than ~10%: the GEMM tactics
# of a transformer ran within 10% of each other per core (bench/results/gemm-2026-12-01.md) while the
# tuner, timing them on two loaded cores, picked among them by noise (a ViT/YOLOS/Whisper engine took
# non-native GEMMs, MKL or torch's oneDNN linear, between native ones, each splitting a segment). Within
# that margin the native tactic wins.
NATIVE_PREFERENCE = 1.1


def _effective_ms(name: str, ms: float) -> float:
    tactic = registry.get(name) if name != DEFAULT else None
    if tactic is None:
        return ms
    ms = ms / tactic.preference
    ms = ms / LAYOUT_PREFERENCE if tactic.layout else ms
    return ms / NATIVE_PREFERENCE - NATIVE_CREDIT_MS if tactic.native else ms


def _result(chosen: str, points: list[dict[str, float]], notes: dict[str, float | str], cached: bool,
            labels: list[str] | None = None) -> LayerTuning:
    times = points[0]
    ranked = sorted(times, key=lambda k: times[k])
    others = [k for k in ranked if k != chosen]
    return LayerTuning(
        tactic=chosen, time_ms=times.get(chosen),
        runner_up=others[0] if others else None, runner_up_ms=times[others[0]] if others else None,
        candidates={**{k: round(v, 4) for k, v in times.items()}, **notes}, cached=cached,
        at={label: {k: round(v, 4) for k, v in p.items()} for label, p in zip(labels or [], points[1:])} or None,
    )


def _retime_in_context(program: ProgramSpec, placed: dict[str, Any], device: torch.device, examples: list[Any],
                       rivals: dict[int, in_context.Rival], layers: dict[str, dict[str, Any]], cache: TimingCache,
                       env: dict, say: Progress, launches: dict[tuple, Any],
                       release: Callable[[], None] | None) -> tuple[dict[str, Any], list[Any] | None]:
    """Close native contenders timed again as the engine runs them, or the timing cache's choice for this network
    (in_context.py); each layer's record says so (`in_network`: ms of each in the network) and takes the choice.
    Returns the header's record of the stage (what it cost and which layers changed: `kiln inspect` shows it), and the
    tuned network's outputs on `examples` where the stage ran it (InContext.outputs; else None)."""
    start = time.perf_counter()
    try:
        result = in_context.choose(program, placed, device, examples, rivals, cache, env, say, launches, release)
    except Exception as e:  # noqa: BLE001  a rival that cannot be bound or run (not checked on a cache hit): kept out
        say(f"tactics: timing {len(rivals)} layer(s) in context failed ({type(e).__name__}: {str(e)[:200]}); "
            "the choices made alone stand")
        return {"failed": f"{type(e).__name__}: {str(e)[:200]}"}, None
    changed: dict[str, str] = {}
    for i, in_network in result.found.items():
        step = program.steps[i]
        layer = layers[step.name]
        chosen = step.tactic or DEFAULT
        if chosen != layer["tactic"]:
            changed[step.name] = f"{layer['tactic']} -> {chosen}"
            layer.update(tactic=chosen, time_ms=rivals[i].rival_ms,
                         runner_up=layer["tactic"], runner_up_ms=rivals[i].chosen_ms)
        layer["in_network"] = in_network
    seconds = time.perf_counter() - start
    how = "from the timing cache" if result.cached else f"timed in {result.rounds} rounds ({result.stopped})"
    say(f"tactics: {len(result.found)} GEMM/conv layer(s) in context, {how}, {seconds:.1f} s: {len(changed)} took "
        "the tactic that was slower alone")
    for swap in sorted(set(changed.values())):
        names = [name for name, s in changed.items() if s == swap]
        say(f"tactics: in context {swap}: {len(names)} layer(s), e.g. {names[0]}")
    return {"layers": len(result.found), "changed": changed, "seconds": round(seconds, 2), "cached": result.cached,
            "rounds": result.rounds, "stopped": result.stopped}, result.outputs


def fallback_reason(found: LayerTuning) -> str | None:
    """Why a layer runs its default implementation although it has candidates, when none passed the
    per-layer check (None otherwise: the default won on time, or nothing supported the layer). The default of
    a fused or quantized layer is often its slow reference: a build that silently fell back cost ResNet-50
    int8 12x on the H200 (bench/results/qadd-2026-12-03.md), so the build log and inspect say it."""
    if found.tactic != DEFAULT:
        return None
    dropped = {name: note[len("rejected: "):] for name, note in found.candidates.items()
               if isinstance(note, str) and note.startswith("rejected: ")}
    timed = [name for name, ms in found.candidates.items() if name != DEFAULT and not isinstance(ms, str)]
    if not dropped or timed:
        return None
    reasons: dict[str, list[str]] = {}
    for name, why in dropped.items():
        reasons.setdefault(why, []).append(name)
    listed = "; ".join(f"{len(names)} x {why} (e.g. {names[0]})" for why, names in
                       sorted(reasons.items(), key=lambda item: -len(item[1]))[:3])
    return f"every candidate ({len(dropped)}) was rejected by the per-layer check against its reference: {listed}"


def _record_candidate_kernels(kernels: CandidateKernels, program: ProgramSpec, tunable: dict[int, list[Tactic]],
                              reference_program: Program, constants_of: Callable[[StepSpec], list[Any]],
                              examples: list[Any], cache: TimingCache, env: dict, device: torch.device,
                              say: Progress) -> None:
    """One run of the reference program; each distinct layer's candidates (what _tune_layer will prepare: all it
    supports, or the timing cache's choice) recorded and submitted to `kernels` as the run reaches the layer."""
    seen: set[str] = set()

    def record(i: int, recorded: Recorded) -> None:
        step, bound = program.steps[i], reference_program.steps[i]
        constants = constants_of(step)
        metas = [InputMeta.of(a, c is not None) for a, c in zip(recorded.args, constants)]
        usable, _ = _usable(tunable[i], step, [metas])
        key = signature_key(layer_signature(step, metas, [DEFAULT] + [t.name for t in usable], env))
        if key in seen:  # an identical layer: the timing cache answers it with the kernels of the first
            return
        seen.add(key)
        if (cached := cache.entries.get(key)) is not None:
            names = {DEFAULT} | {t.name for t in usable}
            known = {k: v for k, v in cached["times_ms"].items() if k in names}
            usable = [t for t in usable if known and t.name == _choose_over([known])]

        def prepare(t: Tactic) -> Launch:
            config = t.configure(step, metas)
            return t.prepare(dataclasses.replace(step, tactic=t.name, tactic_config=config), constants, device)

        kernels.record(i, usable, prepare, bound.ctx, recorded.args, bound.attributes)

    try:
        record_layers(reference_program, set(tunable), examples, on_record=record)
    except Exception as e:  # noqa: BLE001  the search's own example run says what failed; kernels compile on launch
        say(f"tactics: recording the candidates' kernels stopped ({type(e).__name__}: {str(e)[:200]})")


def autotune(program: ProgramSpec, weights: dict[str, Any], inputs: list[Binding], *, device: torch.device,
             opt_level: int, shapes: dict[str, list[int]], timing_cache: str | None = None,
             allowed: list[str] | None = None, runs: int = 10, progress: Progress | None = None,
             io_casts: dict[str, str] | None = None,
             other_shapes: dict[str, dict[str, list[int]]] | None = None,
             examples: list[Any] | None = None, compile_workers: int | None = None,
             in_context_timing: bool = True, launches: dict[tuple, Any] | None = None,
             release: Callable[[], None] | None = None) -> dict[str, Any]:
    """Choose a tactic for every top-level layer of `program` (in place); returns the header record.
    `other_shapes`: a profile's other points ({"mid": shapes, "min": shapes}), where every candidate is
    also timed (_choose_over). `examples`: the program's inputs at the tuning point when they are not
    example_inputs(inputs, shapes) (a padding-free program's mask of fewer tokens and its token bucket,
    kiln/builder/padding_free.py); cast at the boundary as those are. `in_context_timing`: step 4 of the module
    docstring (in_context.py), on by default. `launches`: where the programs bound after the search (in context, the
    whole-network check) keep the launches they prepare (Program's shared_launches), for the engine to bind: on the
    CPU the network's weights are then packed once per build, not once per program (three times before).
    `release`: lets the pages of weights read since go (a build's mapped weights, spill.py), called after each layer
    tuned and each layer those programs pack."""
    say = progress or (lambda _msg: None)
    launches = {} if launches is None else launches
    if opt_level <= 1:
        return {"skipped": f"opt_level {opt_level}: every layer runs its default implementation"}
    tunable = {i: found for i, step in enumerate(program.steps)
               if (found := _candidates(step, device, opt_level, allowed or []))}
    if not tunable:
        return {"skipped": "no layer has more than its default implementation on this device"}
    placed = {k: place_weight(v, device) for k, v in weights.items()}
    try:
        examples = [v.to(device) for v in (example_inputs(inputs, shapes) if examples is None else examples)]
        # A half-precision engine takes its float inputs cast at the boundary (runtime/engine.py).
        casts = {k: dtypes.BY_NAME[v].torch for k, v in (io_casts or {}).items()}
        examples = [v.to(casts[b.dtype]) if b.dtype in casts else v for v, b in zip(examples, inputs)] \
            + examples[len(inputs):]
        reference_program = Program(program, placed, device)
        points = [(label, point) for label, point in (other_shapes or {}).items()
                  if {**shapes, **point} != shapes]  # the opt shape itself is no other point
        points = [(label, point) for k, (label, point) in enumerate(points)
                  if all({**shapes, **point} != {**shapes, **seen} for _, seen in points[:k])]  # nor one taken
    except Exception as e:  # noqa: BLE001  a model the search cannot feed still builds, untuned
        return {"skipped": f"the example run failed ({type(e).__name__}: {str(e)[:200]}); every layer "
                           "runs its default implementation"}

    cache = TimingCache(timing_cache)
    env = environment(device)
    layers: dict[str, dict[str, Any]] = {}
    fallbacks: dict[str, str] = {}  # layer -> why it runs its default although it had candidates
    order = {i: n for n, i in enumerate(sorted(tunable))}
    rivals: dict[int, in_context.Rival] = {}  # layers whose native rival was close alone: timed again in context

    def constants_of(step: StepSpec) -> list[Any]:
        return [placed[program.constants[name]] if name in program.constants else None for name in step.inputs]

    def tune(i: int, record: Recorded, others: dict[str, Recorded]) -> None:
        step = program.steps[i]
        bound = reference_program.steps[i]
        if kernels is not None:
            kernels.wait(i)
        constants = constants_of(step)
        found, config = _tune_layer(step, record, bound.fn, bound.ctx, bound.attributes, constants,
                                    tunable[i], device, cache, env, runs, others)
        # the candidates' packed weights and outputs are freed now, but the C heap keeps the pages of freed blocks
        # that are not at its top: given back per layer, the search's resident memory is what it holds, not the
        # heap's high-water mark over every layer's candidates; their small packed weights were carved from a chunk
        # of huge pages that stays resident while it is the current one: the next layer's go to a chunk of their own
        return_free_memory()
        hugepages.new_chunk()
        if release is not None:
            release()
        step.tactic = "" if found.tactic == DEFAULT else found.tactic
        step.tactic_config = config if step.tactic else {}
        layers[step.name] = found.to_json()
        if device.type == "cpu" and not points:
            metas = [InputMeta.of(a, c is not None) for a, c in zip(record.args, constants)]
            rival = in_context.rival_of(step, found, metas, lambda name: registry.get(name).configure(step, metas),
                                        reads_network_input=bool(step.inputs) and step.inputs[0] in program.inputs)
            if rival is not None:
                rivals[i] = rival
        say(f"tactics: {order[i] + 1}/{len(tunable)} {step.name}: {found.tactic}"
            + (f" {found.time_ms:.3f} ms" if found.time_ms is not None else "") + (" (cached)" if found.cached else ""))
        fallback = fallback_reason(found)
        if fallback is not None:
            fallbacks[step.name] = f"{step.op_type}: {fallback}"
            say(f"tactics: WARNING layer {step.name} ({step.op_type}) runs its default implementation: {fallback}")

    def tune_now(i: int, record: Recorded) -> None:
        try:
            tune(i, record, {})
        except Exception as e:  # the search's own failure, not the example run's: raised as it is below
            raise _TuningFailed() from e

    # Triton kernels compile in worker processes while the first layers are timed (kiln/builder/precompile.py)
    kernels = CandidateKernels.start(device, compile_workers)
    if kernels is not None:
        say(f"tactics: compiling the candidates' Triton kernels in {kernels.pool.workers} processes")
        _record_candidate_kernels(kernels, program, tunable, reference_program, constants_of, examples, cache, env,
                                  device, say)
    try:
        if not points:
            # One point: each layer is tuned as the example run reaches it, on a record no other holds.
            _, reference_outputs = record_layers(reference_program, set(tunable), examples, on_record=tune_now)
        else:
            records, reference_outputs = record_layers(reference_program, set(tunable), examples)
            others: dict[str, dict[int, Recorded]] = {}
            for label, point in points:
                point_examples = [v.to(device) for v in example_inputs(inputs, {**shapes, **point})]
                point_examples = [v.to(casts[b.dtype]) if b.dtype in casts else v
                                  for v, b in zip(point_examples, inputs)]
                others[label], _ = record_layers(reference_program, set(tunable), point_examples)
            for i in sorted(tunable):
                if i in records:  # else not reached (a branch not taken): stays default
                    # each layer's record is let go once tuned: its activations that no later layer's record
                    # reads are freed as the search walks the network, not all held to its end
                    tune(i, records.pop(i), {label: r.pop(i) for label, r in others.items() if i in r})
            records.clear()
            others.clear()
    except _TuningFailed as e:
        raise e.__cause__ from None
    except Exception as e:  # noqa: BLE001  a model the search cannot feed still builds, untuned
        for step in program.steps:
            step.tactic, step.tactic_config = "", {}
        return {"skipped": f"the example run failed ({type(e).__name__}: {str(e)[:200]}); every layer "
                           "runs its default implementation"}
    finally:
        if kernels is not None:
            kernels.close()
            say(f"tactics: {kernels.kernels} Triton kernels compiled in workers, {kernels.pool.seconds:.1f} s of "
                "compile summed")

    record: dict[str, Any] = {"layers": layers, "environment": env,
                              "cache": {"path": timing_cache, "hits": cache.hits, "misses": cache.misses}}
    tuned_outputs = None  # the tuned engine's outputs on `examples`, where the in-context stage ran it
    if rivals and in_context_timing:
        record["in_context"], tuned_outputs = _retime_in_context(program, placed, device, examples, rivals, layers,
                                                                 cache, env, say, launches, release)
    if kernels is not None:
        record["compile"] = {"workers": kernels.pool.workers, "kernels": kernels.kernels,
                             "seconds_summed": round(kernels.pool.seconds, 1)}
    if fallbacks:
        record["fallback_layers"] = fallbacks
        say(f"tactics: WARNING {len(fallbacks)} layer(s) run their default implementation because every candidate "
            "was rejected by the per-layer check: " + ", ".join(fallbacks))
    if any(step.tactic for step in program.steps):
        # Tactics checked one by one can still go wrong together: judge the whole engine against the
        # error the default engine itself makes at this precision; revert only the layers to blame.
        settled = settle(program, placed, device, examples, reference_program, reference_outputs, say, launches,
                         release, tuned_outputs)
        record["accuracy"] = settled.to_json()
        for name, why in settled.reverted.items():
            layer = layers[name]
            default_ms = layer["candidates"].get(DEFAULT)
            tactic = layer["tactic"]
            layers[name] = {**layer, "tactic": DEFAULT, "reverted": why,
                            "time_ms": default_ms if isinstance(default_ms, float) else None,
                            "runner_up": tactic, "runner_up_ms": layer["time_ms"]}
        if settled.reverted:
            record["reverted_layers"] = settled.reverted
            say(f"tactics: {len(settled.reverted)} layer(s) reverted to their default: " + ", ".join(settled.reverted))
        if settled.reverted and not any(step.tactic for step in program.steps):
            record["reverted"] = (f"every tuned layer ({len(settled.reverted)}) reverted to its default: the tuned "
                                  f"engine was off ({settled.first_problem}) and no smaller set of reverts fixed it")
            say(f"tactics: {record['reverted']}")
    cache.save()
    return record
