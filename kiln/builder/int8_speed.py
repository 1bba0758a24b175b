"""INT8 only where it is measured faster (issue 12: "on AVX2-only CPUs kiln keeps FP32 where INT8 is slower and says
so"): an int8 CPU build times its layers inside real engines on the build machine, keeps fp32 every layer or run of
layers whose int8 form (the quantize steps at its boundaries included) is not faster, and checks the whole engine
against the fp32 engine at the end.

Why engines and not kernels alone: on a Zen 3 without VNNI (bench/results/int8-accuracy-avx2-2026-12-07.md) the
int8 kernels alone summed to 4.4 ms against fp32's 9.3 for MobileNetV2, while the whole int8 engine ran 1.02x the
fp32 one and the 97% mixed engine 1.13x: in the engine the int8 depthwise layers are slower than kiln's own fp32
depthwise kernel, each residual Add + quantize is a step outside the native segments (0.07-0.28 ms where fp32 fuses
it into the convolution), the classifier's int8 GEMV is slower than fp32's, and every fp32 -> int8 boundary is a
quantize step. So:

    1. measure (build_no_slower): the fp32 engine and an engine with every layer int8 (the build's own calibration, no
       search), each step's time as the engine runs it (native segments' own per-layer clocks; steps outside them
       eager, plus their share of the loop's dispatch), summed per layer (`attribute`: a quantize step to the layer
       that reads it, an Add or Elementwise to the layer before it). The table (BuildConfig.layer_times) also holds
       the quantize steps' time per element, the boundary rate.
    2. choose (`speed_moves`, called by calibration.quantize before and after the accuracy search): from a plan,
       repeatedly move to fp32 the layer or the run of connected int8 layers whose move does not make the plan slower
       by that table (a layer's int8 time, plus a quantize of its input where a producer is float; fp32 time),
       the largest saving first. Before the search this keeps fp32 the layers int8 cannot speed up (the search then
       ranks only the others); after it, the int8 layers left isolated between float ones that their boundaries
       make slower.
    3. check (build_no_slower): the final engine timed against the fp32 engine, interleaved; unless it is faster by
       KEEP_BELOW (the median of the rounds' ratios), every layer fp32, and the record says both times.

A table given in BuildConfig.layer_times (a test's, or a previous build's `header["quantization"]["speed"]`) is used
as is: no engine is measured, no whole-engine check (deterministic plans).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import onnx_ir as ir
import torch

from kiln.builder.autotune import example_inputs
from kiln.builder.profiles import shapes_at
from kiln.errors import KilnError
from kiln.kernels.cpu import cpu_features
from kiln.runtime import profiler

SPEED_CHECKS = ("auto", "on", "off")
ROUNDS = 5  # interleaved rounds of the whole-engine check
# the mixed engine is kept where its time is at most this share of the fp32 engine's (median of the rounds' ratios):
# a level engine is no gain for int8's error, and two engines within ~2% swap places between rounds on a shared
# machine (MobileNetV2's 97% engine on Zen 3: rounds of 0.98-1.03, bench/results/int8-mixed-speed-2026-12-07.md)
KEEP_BELOW = 0.98
CALLS = 15  # timed runs per engine per round
PROFILE_RUNS = 10
MEASURE_ROUNDS = 3  # interleaved rounds of the two engines' per-step times
QUANTIZE_OPS = ("QuantizeLinear",)


def wanted(config) -> bool:
    """Whether this build measures its engines (step 1 and 3): an int8 CPU build with kernels, speed_check "on", or
    "auto" with an accuracy target on a CPU without int8 dot products (where int8 is not faster by default)."""
    if config.speed_check not in SPEED_CHECKS:
        raise KilnError(f"speed_check {config.speed_check!r}: one of {list(SPEED_CHECKS)}")
    if config.device != "cpu" or config.precision != "int8" or config.quantization != "auto":
        return False
    if config.speed_check == "off" or config.layer_times is not None:
        return False
    return config.speed_check == "on" or (config.accuracy_target is not None
                                          and not cpu_features.has_int8_dot_product())


# ---- 1. measure ---------------------------------------------------------------------------------------------------


def _clock() -> tuple[Callable[[], float], int]:
    """One thread: the thread's CPU time (a shared machine's waits left out); more: the wall clock."""
    if torch.get_num_threads() == 1:
        return time.thread_time, time.CLOCK_THREAD_CPUTIME_ID
    return time.perf_counter, time.CLOCK_MONOTONIC


def _inputs(engine) -> list[Any]:
    profiles = engine.plan.profiles
    shapes = shapes_at(profiles[0], "opt") if profiles else {}
    return example_inputs(engine.plan.inputs, shapes)


def whole_ms(engine, inputs: list[Any], calls: int = CALLS) -> float:
    """Median ms of `calls` runs of the engine (its own context), after 3 warm-ups."""
    clock, _ = _clock()
    context = engine.create_execution_context()
    feeds = dict(zip(engine.input_names, inputs))
    for _ in range(3):
        context.run(feeds)
    samples = []
    for _ in range(calls):
        start = clock()
        context.run(feeds)
        samples.append((clock() - start) * 1e3)
    return float(np.median(samples))


def step_times(engine, runs: int = PROFILE_RUNS) -> dict[str, float]:
    """{step name: ms} as the engine runs: native-segment members by their segment's own per-layer clock, the other
    steps eager (profiler.profile_layers), each of those plus an equal share of what the whole run costs beyond the
    steps' sum (the Python loop's dispatch, a segment's entry)."""
    inputs = _inputs(engine)
    program = engine.program
    _, clock_id = _clock()
    members = {m.ctx.name for segment in program.segments for m in segment.members}
    found: dict[str, float] = {}
    if members:
        for name, samples in profiler.profile_segments(program, inputs, runs, clock_id).items():
            found[name] = float(np.median(samples))
    for layer in profiler.profile_layers(program, inputs, runs):
        if layer["name"] not in members:
            found[layer["name"]] = found.get(layer["name"], 0.0) + float(layer["ms"])
    outside = [s.name for s in program.spec.steps if s.name not in members]
    if outside:
        extra = max(0.0, whole_ms(engine, inputs) - sum(found.values()))
        for name in outside:
            found[name] = found.get(name, 0.0) + extra / (len(outside) + len(program.segments))
    return found


def attribute(steps: list[Any], times: dict[str, float], layers: set[str]) -> dict[str, float]:
    """{layer: ms}: each step's time given to the layer it belongs to. A step is a layer's where the layer is its name
    or one of the nodes fused into it; a quantize step is the layer's that reads it (it exists for that reader); any
    other step (a residual Add, an Elementwise add + quantize, a Reshape) the layer's whose output it reads, else the
    reader's. Steps of no layer (a pooling between none) are left out: they run in both precisions."""
    producer = {out: k for k, s in enumerate(steps) for out in s.outputs if out}
    readers: dict[str, list[int]] = {}
    for k, s in enumerate(steps):
        for value in s.inputs:
            if value:
                readers.setdefault(value, []).append(k)
    own: dict[int, str | None] = {}
    for k, s in enumerate(steps):
        nodes = [s.name, *(s.fused_from or ())]
        own[k] = next((n for n in nodes if n in layers), None)

    def downstream(k: int, seen: set[int]) -> str | None:
        for out in steps[k].outputs:
            for r in readers.get(out, ()):
                if r not in seen:
                    seen.add(r)
                    found = own[r] or downstream(r, seen)
                    if found:
                        return found
        return None

    def upstream(k: int, seen: set[int]) -> str | None:
        for value in steps[k].inputs:
            p = producer.get(value)
            if p is not None and p not in seen:
                seen.add(p)
                found = own[p] or upstream(p, seen)
                if found:
                    return found
        return None

    found: dict[str, float] = {}
    for k, s in enumerate(steps):
        owner = own[k]
        if owner is None:
            first, second = (downstream, upstream) if s.op_type in QUANTIZE_OPS else (upstream, downstream)
            owner = first(k, {k}) or second(k, {k})
        if owner is not None and s.name in times:
            found[owner] = found.get(owner, 0.0) + times[s.name]
    return found


def quantize_rate(engine, times: dict[str, float]) -> float:
    """ms per element of the engine's quantize steps (the median over them): what a new fp32 -> int8 boundary
    costs per element of the value it quantizes. 0.0 where the engine has none."""
    types = engine.plan.header.get("value_types") or {}
    rates = []
    for s in engine.plan.program.steps:
        if s.op_type in QUANTIZE_OPS and s.name in times and s.outputs and s.outputs[0] in types:
            shape = types[s.outputs[0]].get("shape") or []
            if shape and all(isinstance(d, int) for d in shape):
                rates.append(times[s.name] / max(1, int(np.prod(shape))))
    return float(statistics.median(rates)) if rates else 0.0


def int8_quantize_owners(steps: list[Any], layers: set[str]) -> set[str]:
    """The layers whose input the every-layer int8 engine quantizes itself (a graph input, a float value): their
    int8 time already holds their boundary."""
    producer = {out: s for s in steps for out in s.outputs if out}
    owners = set()
    for s in steps:
        if s.name in layers or layers.intersection(s.fused_from or ()):
            p = producer.get(s.inputs[0]) if s.inputs else None
            if p is not None and p.op_type in QUANTIZE_OPS:
                owners.add(s.name if s.name in layers else next(n for n in s.fused_from if n in layers))
    return owners


def _fastest(rounds: list[dict[str, float]]) -> dict[str, float]:
    return {name: min(r.get(name, float("inf")) for r in rounds) for name in rounds[0]}


def measure(fp32_engine, int8_engine) -> dict:
    """The table BuildConfig.layer_times holds: per layer its ms in the fp32 and the every-layer int8 engine, the
    quantize steps' ms per element, which layers' int8 time holds their own input's quantize, and how it was taken."""
    record = int8_engine.plan.header.get("quantization") or {}
    layers = set(record.get("quantized") or ()) | set(record.get("kept_float") or {})
    # interleaved rounds, each step's fastest round: on a shared machine a round can catch another job (at 2 threads
    # a descheduled thread holds a layer's barrier: one 2-thread round timed MobileNetV2's int8 engine at 274 ms)
    fp32_rounds, int8_rounds = [], []
    for _ in range(MEASURE_ROUNDS):
        fp32_rounds.append(step_times(fp32_engine))
        int8_rounds.append(step_times(int8_engine))
    fp32_times, int8_times = _fastest(fp32_rounds), _fastest(int8_rounds)
    int8_steps = int8_engine.plan.program.steps
    return {"fp32": {k: round(v, 5) for k, v in attribute(fp32_engine.plan.program.steps, fp32_times, layers).items()},
            "int8": {k: round(v, 5) for k, v in attribute(int8_steps, int8_times, layers).items()},
            "int8_layers": sorted(record.get("quantized") or ()),
            "quantize_ms_per_element": quantize_rate(int8_engine, int8_times),
            "quantizes_own_input": sorted(int8_quantize_owners(int8_steps, layers)),
            "threads": torch.get_num_threads(), "clock": "thread CPU time" if torch.get_num_threads() == 1 else
            "wall clock", "cpu": cpu_features.describe()}


# ---- 2. choose ----------------------------------------------------------------------------------------------------


def layer_producers(graph: ir.Graph, layers: set[str]) -> dict[str, set[str]]:
    """{layer: the layers whose outputs reach its input through other nodes (Add, Relu, Reshape, pooling...); "" for
    a graph input}: where its int8 input comes from, so where a float producer makes a boundary."""
    by_name = {n.name: n for n in graph}
    memo: dict[int, set[str]] = {}

    def sources(value: ir.Value | None) -> set[str]:
        if value is None or value.const_value is not None:
            return set()
        node = value.producer()
        if node is None:
            return {""}
        if id(node) in memo:
            return memo[id(node)]
        memo[id(node)] = set()
        found = {node.name} if node.name in layers else set().union(*(sources(v) for v in node.inputs)) \
            if node.inputs else set()
        memo[id(node)] = found
        return found

    return {name: sources(by_name[name].inputs[0]) for name in layers if name in by_name}


@dataclasses.dataclass
class SpeedModel:
    """A plan's time by the measured table: each int8 layer its int8 ms, plus, where one of its producers is not int8
    and its int8 time holds no quantize of its own, a quantize of its input (elements x the boundary rate); each other
    layer its fp32 ms."""

    int8: dict[str, float]
    fp32: dict[str, float]
    producers: dict[str, set[str]]
    boundary: dict[str, float]  # layer -> ms of quantizing its input
    own_quantize: set[str]

    def layer_ms(self, name: str, floats: set[str]) -> float:
        if name in floats:
            return self.fp32[name]
        crossing = any(p == "" or p in floats for p in self.producers.get(name, ()))
        return self.int8[name] + (self.boundary.get(name, 0.0) if crossing and name not in self.own_quantize else 0.0)

    def total(self, floats: set[str]) -> float:
        return sum(self.layer_ms(name, floats) for name in self.int8)


def speed_model(table: dict, producers: dict[str, set[str]], elements: dict[str, int]) -> SpeedModel:
    """The model of `table` (measure's) over the layers it times in both precisions."""
    both = sorted(set(table.get("int8") or {}) & set(table.get("fp32") or {}))
    rate = float(table.get("quantize_ms_per_element") or 0.0)
    return SpeedModel({n: float(table["int8"][n]) for n in both}, {n: float(table["fp32"][n]) for n in both},
                      {n: producers.get(n, set()) for n in both},
                      {n: rate * elements.get(n, 0) for n in both}, set(table.get("quantizes_own_input") or ()))


def _runs(model: SpeedModel, floats: set[str]) -> list[set[str]]:
    """The connected groups of int8 layers (a layer and its int8 producers)."""
    int8 = [n for n in model.int8 if n not in floats]
    parent = {n: n for n in int8}

    def root(n: str) -> str:
        while parent[n] != n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for n in int8:
        for p in model.producers.get(n, ()):
            if p in parent:
                parent[root(p)] = root(n)
    groups: dict[str, set[str]] = {}
    for n in int8:
        groups.setdefault(root(n), set()).add(n)
    return [g for g in groups.values() if len(g) > 1]


def _us(ms: float) -> str:
    return f"{1000 * ms:.0f} µs"


def speed_moves(model: SpeedModel, floats: set[str], where: str = "") -> dict[str, str]:
    """{layer: why} of the int8 layers to move to fp32 from the plan whose float layers are `floats`: repeatedly the
    move (one layer, a layer and one of its int8 producers, or a whole run of connected int8 layers) that saves the
    most by the model, taken while it saves anything or is level (int8 not faster: fp32 is the exact one), the
    boundaries it makes or removes counted."""
    floats = set(floats)
    moved: dict[str, str] = {}
    while True:
        now = model.total(floats)
        best: tuple[float, frozenset[str]] | None = None
        int8 = [n for n in model.int8 if n not in floats]
        # one layer, a layer with one of its int8 producers (moved alone, each would leave the other a boundary), or a
        # whole run of connected int8 layers
        candidates = [frozenset({n}) for n in int8] + \
            [frozenset({p, n}) for n in int8 for p in sorted(model.producers.get(n, ())) if p in model.int8
             and p not in floats] + [frozenset(r) for r in _runs(model, floats)]
        for move in candidates:
            delta = model.total(floats | move) - now
            if delta <= 1e-12 and (best is None or delta < best[0] - 1e-12):
                best = (delta, move)
        if best is None:
            return moved
        delta, move = best
        fp32 = sum(model.fp32[n] for n in move)
        int8 = fp32 - delta
        if len(move) == 1:
            why = f"int8 slower here: {_us(int8)} vs {_us(fp32)} fp32 (its quantize steps included{where})"
        else:
            names = sorted(move)
            named = ", ".join(names) if len(names) <= 4 else f"{', '.join(names[:3])}, ... {names[-1]}"
            why = (f"int8 slower here as a run of {len(move)} layers ({named}): {_us(int8)} vs "
                   f"{_us(fp32)} fp32 (its quantize steps included{where})")
        moved.update(dict.fromkeys(sorted(move), why))
        floats |= move


# ---- 3. check -----------------------------------------------------------------------------------------------------


def compare(engine, fp32_engine, rounds: int = ROUNDS) -> tuple[float, float, list[float]]:
    """(median ms of `engine`, of `fp32_engine`, per-round ratios), interleaved rounds on the same inputs."""
    inputs = _inputs(fp32_engine)
    mine, theirs, ratios = [], [], []
    for _ in range(rounds):
        a, b = whole_ms(engine, inputs), whole_ms(fp32_engine, inputs)
        mine.append(a)
        theirs.append(b)
        ratios.append(a / b)
    return float(np.median(mine)), float(np.median(theirs)), ratios


def _reusable(model: Any) -> Any:
    """A model source that every build of this one can read again."""
    if isinstance(model, ir.Model):
        return ir.to_proto(model)
    return model


def build_no_slower(model: Any, config, say: Callable[[str], None], build_one: Callable[..., Any]):
    """Steps 1-3 of the module docstring around `build_one` (the builder's one build)."""
    source = _reusable(model)
    if isinstance(config.calibration, Iterator):  # read by three builds
        config = dataclasses.replace(config, calibration=list(config.calibration))
    quiet = dict(speed_check="off", layer_times=None)
    say("int8 speed: measuring the fp32 engine and an every-layer int8 engine on this machine")
    fp32_config = dataclasses.replace(config, precision="fp32", calibration=None, accuracy_target=None,
                                      layer_precision={}, smoothquant=None, equalize=None, gptq=False, **quiet)
    fp32_engine = build_one(source, fp32_config, None)
    # the every-layer engine is timed, not used: no GPTQ (its kernels and steps are the same either way)
    probe = build_one(source, dataclasses.replace(config, accuracy_target=None, gptq=False, **quiet), None)
    try:
        table = measure(fp32_engine, probe)
    except (ValueError, RuntimeError) as e:  # no example input for a binding, no compiled segment loop
        say(f"int8 speed: not measured ({e}): the int8 kernels wherever the tuner timed them faster alone")
        engine = build_one(source, dataclasses.replace(config, **quiet), say)
        engine.plan.header["quantization"]["speed"] = {"engine": f"not measured: {e}"}
        return engine
    del probe
    say(f"int8 speed: every layer fp32 {sum(table['fp32'].values()):.2f} ms, every layer int8 "
        f"{sum(table['int8'].values()):.2f} ms (per layer, in the engines)")
    engine = build_one(source, dataclasses.replace(config, layer_times=table, speed_check="off"), say)
    record = engine.plan.header["quantization"]
    int8_layers = [n for n, v in (record.get("layers") or {}).items() if v.get("precision") == "int8"]
    if not int8_layers:
        record.setdefault("speed", {})["engine"] = "no layer runs int8: the engine is fp32's"
        return engine
    mine, fp32_ms, ratios = compare(engine, fp32_engine)
    ratio = float(np.median(ratios))
    check = {"int8_engine_ms": round(mine, 4), "fp32_engine_ms": round(fp32_ms, 4), "ratio": round(ratio, 3),
             "ratios": [round(r, 3) for r in ratios], "keep_below": KEEP_BELOW, "threads": torch.get_num_threads()}
    say(f"int8 speed: this engine {mine:.2f} ms, the fp32 engine {fp32_ms:.2f} ms (ratio {ratio:.3f})")
    if ratio < KEEP_BELOW:
        record.setdefault("speed", {})["engine"] = check
        return engine
    # not faster as a whole: every layer fp32, said so
    layers = list(record.get("quantized") or ()) + list(record.get("kept_float") or {}) + \
        list(record.get("weight_only") or {})
    why = (f"int8 not faster here: the mixed engine ({len(int8_layers)} int8 layers) {mine:.2f} ms vs the fp32 engine "
           f"{fp32_ms:.2f} ms (ratio {ratio:.2f}, kept below {KEEP_BELOW:g}; {torch.get_num_threads()} thread(s), "
           f"{cpu_features.describe()})")
    say(f"int8 speed: {why}: every layer fp32")
    pins = {**dict.fromkeys(layers, "fp32"), **config.layer_precision}
    fallback = build_one(source, dataclasses.replace(config, accuracy_target=None, layer_precision=pins,
                                                     **quiet), say)
    header = fallback.plan.header["quantization"]
    header["kept_float"] = {n: (why if n not in config.layer_precision else "pinned") for n in header["kept_float"]}
    for name, layer in (header.get("layers") or {}).items():
        if name not in config.layer_precision:
            layer["why"] = why
    header["accuracy"] = {**(record.get("accuracy") or {}), "note": "the search's plan; the engine runs fp32"}
    header["speed"] = {**(record.get("speed") or {}), "engine": {**check, "fallback": why}}
    return fallback
