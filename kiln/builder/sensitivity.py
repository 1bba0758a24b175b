"""Mixed precision on purpose: which quantized layers to keep in float so the engine meets an accuracy
target (`--accuracy-target`), measured on the evaluation batches (calibration data) against the float model.

metric "error" (the default): the target is the largest output error, max |error| / max |output|.

    1. every candidate layer quantized: if the error is within the target, done;
    2. each layer's sensitivity: the output error when it alone is quantized;
    3. the most sensitive layers go back to float one by one, the error re-measured each time, until
       the target is met.

metric "top1" (a classifier: the first output's last axis holds class scores): the target is the share of
inputs whose top-1 class must stay fp32's, estimated smoothly (expected_top1: the error as noise against each
input's top-1 margin). The largest error is the wrong thing to bound there: after one rounding flips, a
quantized network's error is a new draw of noise on every input (bench/results/quant-accuracy-2026-12-02b.md),
and whether a top-1 survives depends on that noise against the input's margin, not on the worst logit.

    1. every candidate layer quantized: if the expected agreement reaches the target, done;
    2. each layer's sensitivity: the softmax KL divergence from fp32 when it alone is quantized (what moves
       competing classes' probabilities, that is the top-1 margins, weighs; a large error on a class nobody
       picks does not);
    3. the fewest of the most sensitive layers kept float that reach the target, by bisection over how many.

The precision between (weight_only; BuildConfig.accuracy_weight_only, on by default): the layer's weights
quantized, its input not (qdq.insert's weight_only; on the CPU the fp32 kernel on int8-grid weights). Most of an
int8 layer's error on MobileNetV2 is its input's rounding (bench/results/quantacc3-2026-12-06.md: weights alone cost
relerr 0.02-0.04 of int8's 0.12).

    "top1": when every layer weight-only reaches the target, the fewest layers weight-only that reach it, ranked by
            the softmax KL with their input alone quantized (what going weight-only saves), by the same bisection;
            chosen unless the float search needs fewer layers (a weight-only layer runs the float kernel on the
            CPU: fewer layers away from int8 is the faster engine).
    "error": when every layer weight-only meets it, the most sensitive go weight-only one by one instead of float.

With layer costs (kiln/builder/layer_cost.py: ms per layer in int8, W8A16 and fp32 on this CPU; an int8 CPU build
whose kernels run W8A16), "top1" ranks moves by accuracy gained per millisecond instead (_cheapest_for_top1): each
layer's cheaper-per-gain move (to W8A16: its input sensitivity for the W8A16 time over int8's; to fp32: its
sensitivity for the fp32 time over int8's), the fewest of that ranking by the same bisection, the same for the float
ranking with each layer moved to its faster precision, and of the plans that reach the target (those two, the float
one, the weight-only one) the one of the fewest milliseconds. W8A16 is
measured as weight-only: its 16-bit input is 2^-16 of the range from the float one (2^-8 for int8).

One program serves every measurement: the model with every layer's Q/DQ, lowered without folding, run
with each layer's quantization switched on, weight-only or off (an off layer's Q/DQ pass values through and
its weight and bias are the float ones; a weight-only layer's input pair passes through). Each layer has its own
input pair (qdq.insert's private_pairs), so that one reader of a shared tensor can be switched alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx_ir as ir
import torch

from kiln.builder.lower import lower
from kiln.errors import KilnError
from kiln.ir import dtypes
from kiln.quant import qdq
from kiln.runtime.program import Program

METRICS = ("error", "top1")  # what --accuracy-target bounds: choose_float_layers
RANK_BATCHES = 8  # "top1": layers are ranked on the evaluation inputs of the lowest top-1 margins


@dataclass
class Switches:
    """The steps of one layer's quantization in the lowered program, and what runs when it is off."""

    activation: tuple[int, int]  # (QuantizeLinear step, DequantizeLinear step) of its input
    weight: int  # DequantizeLinear step of its weight
    float_weight: torch.Tensor
    layer: int  # the layer's own step (Conv/Gemm/MatMul)
    float_bias: torch.Tensor | None  # its bias before bias correction (zeros where it had none); None: no bias


def _copy(model: ir.Model) -> ir.Model:
    return ir.from_proto(ir.to_proto(model))


class SwitchedModel:
    """The model with every target layer's Q/DQ (as qdq.insert makes them for the build), lowered once,
    runnable with any subset of its layers quantized: `outputs(quantized, weight_only)`. Off, a layer reads its
    input unrounded, its float weight and its uncorrected bias: the float layer exactly. Weight-only, it reads
    its input unrounded with its quantized weight and corrected bias: the build's weight_only layer exactly."""

    def __init__(self, model: ir.Model, ranges: dict[str, float], dtype: str, exclude: set[str],
                 batches: list[dict[str, np.ndarray]], *, unsigned: bool = False, weight_max: float | None = None,
                 channel_means: dict[str, np.ndarray] | None = None, lows: dict[str, float] | None = None,
                 moments: dict[str, np.ndarray] | None = None):
        targets = {t.node.name: t for t in qdq.targets(model.graph, exclude)}
        originals = {name: t.weight.const_value.numpy().copy() for name, t in targets.items()}
        biases = {name: _bias(t.node) for name, t in targets.items()}
        trial = _copy(model)
        skipped = qdq.insert(trial, ranges, dtype, exclude, unsigned=unsigned, weight_max=weight_max,
                             channel_means=channel_means, lows=lows, moments=moments, private_pairs=True)
        self.layers = [name for name in originals if name not in skipped]
        program, weights, inputs, _ = lower(trial)  # no folding: every Q/DQ is a step that can be switched
        index = {s.name: i for i, s in enumerate(program.steps)}
        nodes = {n.name: n for n in trial.graph}
        self.switches: dict[str, Switches] = {}
        for name in self.layers:
            act = nodes[name].inputs[0].producer()  # the activation's DequantizeLinear
            quant = act.inputs[0].producer()
            bias = _bias(nodes[name])  # corrected, or the original; a corrected layer without one got one
            float_bias = None if bias is None else biases[name] if biases[name] is not None else np.zeros_like(bias)
            self.switches[name] = Switches((index[quant.name], index[act.name]), index[f"{name}_weight_dequantize"],
                                           torch.from_numpy(originals[name]), index[name],
                                           None if float_bias is None else torch.from_numpy(float_bias.copy()))
        self.runner = Program(program, weights)
        self.feeds = [[dtypes.numpy_to_torch(np.ascontiguousarray(b[i.name])) for i in inputs] for b in batches]
        with torch.inference_mode():
            self.reference = [Program(*lower(_copy(model))[:2]).run(f) for f in self.feeds]

    def outputs(self, quantized: set[str], batches: list[int] | None = None,
                weight_only: set[str] = frozenset(), input_only: set[str] = frozenset()) -> list[list[Any]]:
        """Per batch (those of index in `batches`; None: all), the model's outputs with exactly the layers in
        `quantized` quantized, those in `weight_only` with their weights alone quantized and those in `input_only`
        their input alone (float weight and bias: what weight-only would save)."""
        on_pairs = {self.switches[n].activation for n in set(quantized) | set(input_only)}
        off_steps = {i for s in self.switches.values() if s.activation not in on_pairs for i in s.activation}
        off = [s for n, s in self.switches.items() if n not in quantized and n not in weight_only]
        float_weights = {s.weight: s.float_weight for s in off}
        float_biases = {s.layer: s.float_bias for s in off if s.float_bias is not None}

        def wrap(i: int, fn):
            if i in off_steps:
                return lambda ctx, x, *rest, **attrs: x  # the value passes through in float
            if i in float_weights:
                return lambda ctx, *args, **attrs: float_weights[i]
            if i in float_biases:
                return lambda ctx, x, w, b, *rest, **attrs: fn(ctx, x, w, float_biases[i], *rest, **attrs)
            return fn

        switched = self.runner.with_kernels(wrap)
        with torch.inference_mode():
            return [switched.run(self.feeds[k]) for k in (range(len(self.feeds)) if batches is None else batches)]


def _bias(node: ir.Node) -> np.ndarray | None:
    """A Conv/Gemm's constant bias (input 2), or None."""
    if len(node.inputs) < 3 or node.inputs[2] is None or node.inputs[2].const_value is None:
        return None
    return node.inputs[2].const_value.numpy()


def output_error(got: list[list[Any]], want: list[list[Any]]) -> float:
    """max over batches and float outputs of max |got - want| / max |want|."""
    worst = 0.0
    for got_batch, want_batch in zip(got, want):
        for g, w in zip(got_batch, want_batch):
            if not isinstance(w, torch.Tensor) or not w.is_floating_point():
                continue
            scale = float(w.abs().max()) or 1.0
            worst = max(worst, float((g.float() - w.float()).abs().max()) / scale)
    return worst


def _logits(outputs: list[list[Any]]) -> torch.Tensor:
    """The first output of every batch as rows of class scores: [rows, classes] float64."""
    first = outputs[0][0]
    if not isinstance(first, torch.Tensor) or not first.is_floating_point() or first.dim() == 0 or first.shape[-1] < 2:
        shape = list(first.shape) if isinstance(first, torch.Tensor) else type(first).__name__
        raise KilnError(f"accuracy metric top1 reads the model's first output as class scores on its last axis; "
                        f"it is {shape}: use accuracy_metric='error'")
    return torch.cat([batch[0].double().reshape(-1, batch[0].shape[-1]) for batch in outputs])


def lowest_margins(outputs: list[list[Any]], count: int) -> list[int]:
    """The `count` batches whose first row's top-1 margin, relative to its scores' spread, is smallest."""
    def margin(batch: list[Any]) -> float:
        row = batch[0].double().reshape(-1)
        top2 = row.topk(2).values
        return float((top2[0] - top2[1]) / ((row.max() - row.min()) or 1.0))
    return sorted(range(len(outputs)), key=lambda k: margin(outputs[k]))[:count]


def softmax_kl(got: list[list[Any]], want: list[list[Any]]) -> float:
    """Mean over rows of KL(softmax(want) || softmax(got)) of the first output's last axis (class scores): how
    far the quantized class distribution moved, most where classes compete (a low top-1 margin)."""
    p, q = torch.log_softmax(_logits(want), -1), torch.log_softmax(_logits(got), -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def expected_top1(got: list[list[Any]], want: list[list[Any]]) -> float:
    """The expected share of rows whose top-1 class stays the reference's, treating the quantized scores'
    error d = got - want as noise of its measured spread (one flipped rounding reshuffles every later rounding,
    so the error one set of inputs happens to get is one draw): with the reference's top-1 margin m = want[t] -
    want[r] (t its top-1, r its runner-up) and σ = std(d) over the classes, d[t] - d[r] ~ N(0, 2σ²) and

        P(top-1 kept) = Φ(m / (√2·σ))

    A smooth count: one realisation's agreement on a few dozen inputs moves by whole inputs with any
    perturbation, this moves with the noise level and the margins it meets."""
    reference = _logits(want)
    top2 = reference.topk(2, dim=-1).values
    margin = top2[:, 0] - top2[:, 1]
    sigma = (_logits(got) - reference).std(-1)
    kept = torch.where(sigma > 0, torch.special.ndtr(margin / (np.sqrt(2.0) * sigma.clamp_min(1e-30))),
                       torch.ones_like(margin))
    return float(kept.mean())


def choose_float_layers(model: ir.Model, ranges: dict[str, float], dtype: str, batches: list[dict[str, np.ndarray]],
                        target: float, exclude: set[str], say: Callable[[str], None], *, metric: str = "error",
                        unsigned: bool = False, weight_max: float | None = None,
                        channel_means: dict[str, np.ndarray] | None = None,
                        lows: dict[str, float] | None = None,
                        moments: dict[str, np.ndarray] | None = None,
                        weight_only: bool = False,
                        costs: dict[str, dict[str, float]] | None = None) -> tuple[set[str], dict]:
    """(layer names to keep in float, the record for the header); unsigned, weight_max, channel_means (bias
    correction), lows, moments (GPTQ): as the build's qdq.insert will quantize. metric (METRICS): "error", the
    target is the largest max |error| / max |output| on the batches; "top1", the target is the smallest expected share of
    batches whose top-1 class is fp32's (expected_top1), layers ranked by softmax_kl. weight_only: the most sensitive
    layers are first tried with their weights alone quantized (the record's "weight_only": {layer: why}); float
    layers only where every layer so still misses the target."""
    if metric not in METRICS:
        raise KilnError(f"accuracy metric {metric!r}: kiln knows {list(METRICS)}")
    switched = SwitchedModel(model, ranges, dtype, exclude, batches, unsigned=unsigned, weight_max=weight_max,
                             channel_means=channel_means, lows=lows, moments=moments)
    if metric == "top1" and costs is not None and weight_only:
        return _cheapest_for_top1(switched, target, say, costs)
    if metric == "top1":
        return _fewest_for_top1(switched, target, say, weight_only)
    return _greedy_for_error(switched, target, say, weight_only)


def _fewest(order: list[str], measure: Callable[[int], float], met: Callable[[float], bool],
            measured: dict[int, float], say: Callable[[str], None], what: str) -> int:
    """The smallest k with met(measure(k)), by bisection over k in (0, len(order)]: measure(k) with the k first
    layers of `order` moved up a precision grows with k. measured holds k = 0 (not met) and len(order) (met)."""
    low, high = 0, len(order)  # not met at low, met at high
    while high - low > 1:
        middle = (low + high) // 2
        measured[middle] = measure(middle)
        say(f"accuracy: the {middle} most sensitive layer(s) {what} -> {measured[middle]:.4g}")
        low, high = (low, middle) if met(measured[middle]) else (middle, high)
    return high


def _one_by_one(order: list[str], measure: Callable[[list[str]], float], error: float, target: float,
                say: Callable[[str], None], what: str) -> tuple[list[str], float]:
    """(the layers moved, the error then): the first layers of `order` moved up a precision one by one, the error
    (`error` with none moved) re-measured as measure(moved) after each, until it is within the target."""
    moved: list[str] = []
    for name in order:
        if error <= target:
            break
        moved.append(name)
        error = measure(moved)
        say(f"accuracy: {name} {what} -> error {error:.3g}")
    return moved, error


def _greedy_for_error(switched: SwitchedModel, target: float, say: Callable[[str], None],
                      weight_only: bool = False) -> tuple[set[str], dict]:
    """Each layer's sensitivity is the output error with it alone quantized; the most sensitive go float one by
    one, the error re-measured each time, until it is within the target. weight_only: first the same walk with
    each going weight-only, when every layer weight-only meets the target."""
    def error(quantized: set[str], weights: set[str] = frozenset()) -> float:
        return output_error(switched.outputs(quantized, weight_only=weights), switched.reference)

    layers = switched.layers
    all_on = error(set(layers))
    record: dict[str, Any] = {"metric": "error", "target": target, "error_all_quantized": all_on}
    if all_on <= target:
        say(f"accuracy: every layer quantized gives {all_on:.3g} <= target {target:g}")
        return set(), {**record, "error": all_on, "kept_float": {}, "weight_only": {}}
    say(f"accuracy: every layer quantized gives {all_on:.3g} > target {target:g}: measuring each layer")
    sensitivity = {name: error({name}) for name in layers}
    order = sorted(layers, key=lambda n: -sensitivity[n])
    record["sensitivity"] = {k: round(v, 6) for k, v in sorted(sensitivity.items(), key=lambda kv: -kv[1])}
    why = {name: f"sensitivity {sensitivity[name]:.3g} (output error with it alone quantized)" for name in order}
    if weight_only:
        every = error(set(), set(layers))
        record["error_all_weight_only"] = every
        if every <= target:
            moved, current = _one_by_one(order, lambda m: error(set(layers) - set(m), set(m)), all_on, target, say,
                                         "weight-only")
            return set(), {**record, "error": current, "kept_float": {}, "met": current <= target,
                           "weight_only": {name: why[name] for name in moved}}
        say(f"accuracy: every layer weight-only gives {every:.3g} > target {target:g}: layers go float")
    moved, current = _one_by_one(order, lambda m: error(set(layers) - set(m)), all_on, target, say, "kept float")
    kept = {name: why[name] for name in moved}
    record.update({"error": current, "kept_float": kept, "weight_only": {}, "met": current <= target})
    return set(kept), record


def _fewest_for_top1(switched: SwitchedModel, target: float, say: Callable[[str], None],
                     weight_only: bool = False) -> tuple[set[str], dict]:
    """Layers ranked by softmax_kl with each alone quantized (on the RANK_BATCHES inputs of the lowest top-1
    margins: 53 layers x 8 runs instead of x 38 for MobileNetV2; a layer's effect on a top-1 shows where the
    classes are close); the fewest of the top of that ranking kept float
    for expected_top1 >= target, found by bisection over how many (the agreement grows as layers go float, up
    to 1 with all of them: log2(layers) measurements instead of one per layer kept). weight_only: first the
    fewest of the top of that ranking weight-only, when every layer weight-only reaches the target."""
    def agreement(quantized: set[str], weights: set[str] = frozenset()) -> float:
        return expected_top1(switched.outputs(quantized, weight_only=weights), switched.reference)

    layers = switched.layers
    all_on = agreement(set(layers))
    record: dict[str, Any] = {"metric": "top1", "target": target, "top1_all_quantized": round(all_on, 6)}
    if all_on >= target:
        say(f"accuracy: every layer quantized keeps an expected {all_on:.4f} of top-1s >= target {target:g}")
        return set(), {**record, "top1": all_on, "kept_float": {}, "weight_only": {}}
    say(f"accuracy: every layer quantized keeps an expected {all_on:.4f} of top-1s < target {target:g}: "
        "measuring each layer")
    closest = lowest_margins(switched.reference, RANK_BATCHES)  # the inputs whose top-1 a layer can flip
    reference = [switched.reference[k] for k in closest]
    sensitivity = {name: softmax_kl(switched.outputs({name}, closest), reference) for name in layers}
    order = sorted(layers, key=lambda n: -sensitivity[n])
    record["sensitivity"] = {k: round(v, 8) for k, v in sorted(sensitivity.items(), key=lambda kv: -kv[1])}
    why = {name: f"sensitivity {sensitivity[name]:.3g} (softmax KL with it alone quantized)" for name in order}
    measured = {0: all_on, len(order): 1.0}  # every layer float: the reference itself
    count = _fewest(order, lambda k: agreement(set(order[k:])), lambda v: v >= target, measured, say,
                    "float: expected top-1")
    record.update({"top1": measured[count], "kept_float": {name: why[name] for name in order[:count]},
                   "weight_only": {}, "met": measured[count] >= target,
                   "measured": {str(k): round(v, 6) for k, v in sorted(measured.items())}})
    if not weight_only:
        return set(order[:count]), record
    every = agreement(set(), set(layers))
    record["top1_all_weight_only"] = round(every, 6)
    if every < target:
        say(f"accuracy: every layer weight-only keeps an expected {every:.4f} of top-1s < target {target:g}: "
            f"{count} layer(s) float")
        return set(order[:count]), record
    # what going weight-only saves is the input's rounding: ranked by that alone (a layer whose error is its
    # weights' gains nothing)
    inputs = {name: softmax_kl(switched.outputs(set(), closest, input_only={name}), reference) for name in layers}
    by_input = sorted(layers, key=lambda n: -inputs[n])
    record["input_sensitivity"] = {k: round(inputs[k], 8) for k in by_input}
    found = {0: all_on, len(by_input): every}
    moved = _fewest(by_input, lambda k: agreement(set(by_input[k:]), set(by_input[:k])), lambda v: v >= target,
                    found, say, "weight-only: expected top-1")
    record["measured_weight_only"] = {str(k): round(v, 6) for k, v in sorted(found.items())}
    if moved > count:  # float layers reach it with fewer layers away from int8: those (on the CPU, the same kernels)
        say(f"accuracy: {moved} layer(s) weight-only or {count} float: float")
        return set(order[:count]), record
    record.update({"top1": found[moved], "kept_float": {}, "met": True, "weight_only": {
        name: f"input sensitivity {inputs[name]:.3g} (softmax KL with its input alone quantized)"
        for name in by_input[:moved]}})
    return set(), record


MOVE_FLOOR_MS = 1e-3  # a move's extra time is at least this: a layer costed alike in every precision ranks by gain


def plan_ms(costs: dict[str, dict[str, float]], kept_float: set[str], wide: set[str]) -> float:
    """The layers' time in ms with `kept_float` fp32, `wide` W8A16 and the rest int8 (per-layer kernels alone)."""
    return sum(c["fp32"] if name in kept_float else c["w8a16"] if name in wide else c["int8"]
               for name, c in costs.items())


def _cheapest_for_top1(switched: SwitchedModel, target: float, say: Callable[[str], None],
                       costs: dict[str, dict[str, float]]) -> tuple[set[str], dict]:
    """The top-1 target by the fewest milliseconds away from int8 (module docstring). Each layer's move is the one
    of the larger gain per extra ms: to W8A16, gain = the softmax KL of its input alone quantized (what the 16-bit
    input saves), extra = w8a16 - int8 ms; to fp32, gain = the KL of the layer alone quantized, extra = fp32 - int8
    ms. Layers ranked by that ratio; the fewest of the top of that ranking moved that reach the target, by bisection.
    A second ranking: the float search's (by the KL of the layer alone quantized), each layer moved to the faster of
    W8A16 and fp32. The float-only and weight-only plans are searched as _fewest_for_top1 does, and of the plans that
    reach the target the fastest by `costs` is chosen (the record's "plans": each one's layers and ms)."""
    def agreement(quantized: set[str], weights: set[str] = frozenset()) -> float:
        return expected_top1(switched.outputs(quantized, weight_only=weights), switched.reference)

    layers = switched.layers
    costs = {name: costs.get(name) or {"int8": 0.0, "w8a16": 0.0, "fp32": 0.0} for name in layers}
    all_on = agreement(set(layers))
    record: dict[str, Any] = {"metric": "top1", "target": target, "top1_all_quantized": round(all_on, 6),
                              "search": "ms per accuracy", "layer_ms": {k: {p: round(v, 4) for p, v in c.items()}
                                                                        for k, c in costs.items()}}
    if all_on >= target:
        say(f"accuracy: every layer quantized keeps an expected {all_on:.4f} of top-1s >= target {target:g}")
        return set(), {**record, "top1": all_on, "kept_float": {}, "weight_only": {}}
    say(f"accuracy: every layer quantized keeps an expected {all_on:.4f} of top-1s < target {target:g}: "
        "measuring each layer")
    closest = lowest_margins(switched.reference, RANK_BATCHES)
    reference = [switched.reference[k] for k in closest]
    full = {name: softmax_kl(switched.outputs({name}, closest), reference) for name in layers}
    inputs = {name: softmax_kl(switched.outputs(set(), closest, input_only={name}), reference) for name in layers}
    record["sensitivity"] = {k: round(v, 8) for k, v in sorted(full.items(), key=lambda kv: -kv[1])}
    record["input_sensitivity"] = {k: round(v, 8) for k, v in sorted(inputs.items(), key=lambda kv: -kv[1])}
    move: dict[str, tuple[str, float]] = {}  # layer -> (precision, gain per ms)
    for name, c in costs.items():
        wide = inputs[name] / max(c["w8a16"] - c["int8"], MOVE_FLOOR_MS)
        whole = full[name] / max(c["fp32"] - c["int8"], MOVE_FLOOR_MS)
        move[name] = ("w8a16", wide) if wide > whole else ("fp32", whole)
    order = sorted(layers, key=lambda n: -move[n][1])

    def moved(k: int) -> tuple[set[str], set[str]]:
        """(float, W8A16) with the first k of `order` moved."""
        return ({n for n in order[:k] if move[n][0] == "fp32"}, {n for n in order[:k] if move[n][0] == "w8a16"})

    def measure(k: int) -> float:
        kept, wide = moved(k)
        return agreement(set(layers) - kept - wide, wide)

    every = agreement(set(), set(layers))  # every layer weight-only: what the ranking's end can reach at most
    found = {0: all_on}
    plans: dict[str, dict] = {}
    kept, wide = moved(len(order))
    found[len(order)] = agreement(set(layers) - kept - wide, wide)
    if found[len(order)] >= target:
        k = _fewest(order, measure, lambda v: v >= target, found, say, "moved by ms per accuracy: expected top-1")
        kept, wide = moved(k)
        plans["ms per accuracy"] = {"kept_float": kept, "w8a16": wide, "top1": found[k]}
    record["measured_cost_aware"] = {str(k): round(v, 6) for k, v in sorted(found.items())}
    by_full = sorted(layers, key=lambda n: -full[n])
    # the float ranking, each layer moved to its faster precision above int8: the layers that matter most first (the
    # gain-per-ms ranking moves many cheap layers of little gain before an expensive one that the target needs)
    faster = {n: "w8a16" if costs[n]["w8a16"] < costs[n]["fp32"] else "fp32" for n in layers}

    def ranked(k: int) -> tuple[set[str], set[str]]:
        return ({n for n in by_full[:k] if faster[n] == "fp32"}, {n for n in by_full[:k] if faster[n] == "w8a16"})

    kept, wide = ranked(len(by_full))
    tried = {0: all_on, len(by_full): agreement(set(layers) - kept - wide, wide)}
    if tried[len(by_full)] >= target:
        k = _fewest(by_full, lambda k: agreement(set(layers) - ranked(k)[0] - ranked(k)[1], ranked(k)[1]),
                    lambda v: v >= target, tried, say, "sensitive, each to its faster precision: expected top-1")
        kept, wide = ranked(k)
        plans["sensitivity, faster precision"] = {"kept_float": kept, "w8a16": wide, "top1": tried[k]}
    record["measured_faster_precision"] = {str(k): round(v, 6) for k, v in sorted(tried.items())}
    floats = {0: all_on, len(by_full): 1.0}
    count = _fewest(by_full, lambda k: agreement(set(by_full[k:])), lambda v: v >= target, floats, say,
                    "float: expected top-1")
    plans["float"] = {"kept_float": set(by_full[:count]), "w8a16": set(), "top1": floats[count]}
    record["measured"] = {str(k): round(v, 6) for k, v in sorted(floats.items())}
    record["top1_all_weight_only"] = round(every, 6)
    if every >= target:
        by_input = sorted(layers, key=lambda n: -inputs[n])
        weights = {0: all_on, len(by_input): every}
        count = _fewest(by_input, lambda k: agreement(set(by_input[k:]), set(by_input[:k])), lambda v: v >= target,
                        weights, say, "weight-only: expected top-1")
        plans["weight-only"] = {"kept_float": set(), "w8a16": set(by_input[:count]), "top1": weights[count]}
        record["measured_weight_only"] = {str(k): round(v, 6) for k, v in sorted(weights.items())}
    for plan in plans.values():
        plan["ms"] = plan_ms(costs, plan["kept_float"], plan["w8a16"])
    chosen = min(plans, key=lambda p: plans[p]["ms"])
    best = plans[chosen]
    say("accuracy: plans " + ", ".join(f"{p}: {len(v['kept_float'])} fp32 + {len(v['w8a16'])} w8a16, "
                                       f"{v['ms']:.2f} ms" for p, v in plans.items()) + f": {chosen}")
    record["plans"] = {p: {"kept_float": sorted(v["kept_float"]), "w8a16": sorted(v["w8a16"]),
                           "top1": round(v["top1"], 6), "ms": round(v["ms"], 4)} for p, v in plans.items()}
    record["plan_ms_all_int8"] = round(plan_ms(costs, set(), set()), 4)
    record["plan_ms_all_fp32"] = round(plan_ms(costs, set(layers), set()), 4)

    def why(name: str) -> str:
        c = costs[name]
        if name in best["w8a16"]:
            return (f"input sensitivity {inputs[name]:.3g} (softmax KL with its input alone quantized) for "
                    f"{c['w8a16'] - c['int8']:.3f} ms over int8 ({chosen} plan)")
        return (f"sensitivity {full[name]:.3g} (softmax KL with it alone quantized) for {c['fp32'] - c['int8']:.3f} "
                f"ms over int8 ({chosen} plan)")

    record.update({"top1": best["top1"], "met": True, "chosen_plan": chosen,
                   "kept_float": {n: why(n) for n in order if n in best["kept_float"]} if chosen != "float" else
                   {n: why(n) for n in by_full if n in best["kept_float"]},
                   "weight_only": {n: why(n) for n in layers if n in best["w8a16"]}})
    return set(best["kept_float"]), record
