"""Mixed precision on purpose: which quantized layers to keep in float so the engine meets an accuracy
target (`--accuracy-target`, the largest output error allowed, relative to the output's scale).

    1. every candidate layer quantized: if the output error on the evaluation batches is within the
       target, done;
    2. each layer's sensitivity: the output error when it alone is quantized;
    3. the most sensitive layers go back to float one by one, the error re-measured each time, until
       the target is met (the fewest layers in float, most sensitive first).

One program serves every measurement: the model with every layer's Q/DQ, lowered without folding, run
with each layer's quantization switched on or off (a switched-off layer's Q/DQ pass values through and
its weight is the float one). A Q/DQ pair shared by several layers (one tensor read by two convolutions)
is on while any of them is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx_ir as ir
import torch

from kiln.builder.lower import lower
from kiln.ir import dtypes
from kiln.quant import qdq
from kiln.runtime.program import Program


@dataclass
class Switches:
    """The steps of one layer's quantization in the lowered program."""

    activation: tuple[int, int]  # (QuantizeLinear step, DequantizeLinear step) of its input
    weight: int  # DequantizeLinear step of its weight
    float_weight: torch.Tensor


def _copy(model: ir.Model) -> ir.Model:
    return ir.from_proto(ir.to_proto(model))


def _error(got: list[Any], want: list[Any]) -> float:
    worst = 0.0
    for g, w in zip(got, want):
        if not isinstance(w, torch.Tensor) or not w.is_floating_point():
            continue
        scale = float(w.abs().max()) or 1.0
        worst = max(worst, float((g.float() - w.float()).abs().max()) / scale)
    return worst


def choose_float_layers(model: ir.Model, ranges: dict[str, float], dtype: str, batches: list[dict[str, np.ndarray]],
                        target: float, exclude: set[str], say: Callable[[str], None], *, unsigned: bool = False,
                        weight_max: float | None = None,
                        channel_means: dict[str, np.ndarray] | None = None,
                        lows: dict[str, float] | None = None) -> tuple[set[str], dict]:
    """(layer names to keep in float, the record for the header); unsigned, weight_max: as the build's
    qdq.insert will quantize (lows: its zero points). channel_means (bias correction) is for a caller that
    switches no layer off: a switched-off layer would keep its corrected bias with its float weight."""
    originals = {t.node.name: t.weight.const_value.numpy().copy() for t in qdq.targets(model.graph, exclude)}
    trial = _copy(model)
    skipped = qdq.insert(trial, ranges, dtype, exclude, unsigned=unsigned, weight_max=weight_max,
                         channel_means=channel_means, lows=lows)
    layers = [name for name in originals if name not in skipped]
    program, weights, inputs, _ = lower(trial)  # no folding: every Q/DQ is a step that can be switched
    spec_index = {s.name: i for i, s in enumerate(program.steps)}
    switches: dict[str, Switches] = {}
    for name in layers:
        base_w = f"{name}_weight_dequantize"
        node = next(n for n in trial.graph if n.name == name)
        act = node.inputs[0].producer()  # the activation's DequantizeLinear
        quant = act.inputs[0].producer()
        switches[name] = Switches((spec_index[quant.name], spec_index[act.name]), spec_index[base_w],
                                  torch.from_numpy(originals[name]))
    reference_program = Program(*lower(_copy(model))[:2])
    runner = Program(program, weights)
    feeds = [[dtypes.numpy_to_torch(np.ascontiguousarray(b[i.name])) for i in inputs] for b in batches]
    with torch.inference_mode():
        reference = [reference_program.run(f) for f in feeds]

    def error(quantized: set[str]) -> float:
        on_pairs = {switches[n].activation for n in quantized}
        off_q = {s.activation[0] for n, s in switches.items() if s.activation not in on_pairs}
        off_dq = {s.activation[1] for n, s in switches.items() if s.activation not in on_pairs}
        off_w = {s.weight: s.float_weight for n, s in switches.items() if n not in quantized}

        def wrap(i: int, fn):
            if i in off_q or i in off_dq:
                return lambda ctx, x, *rest, **attrs: x  # the value passes through in float
            if i in off_w:
                return lambda ctx, *args, **attrs: off_w[i]
            return fn

        switched = runner.with_kernels(wrap)
        with torch.inference_mode():
            return max(_error(switched.run(f), r) for f, r in zip(feeds, reference))

    all_on = error(set(layers))
    record: dict[str, Any] = {"target": target, "error_all_quantized": all_on}
    if all_on <= target:
        say(f"accuracy: every layer quantized gives {all_on:.3g} <= target {target:g}")
        return set(), {**record, "error": all_on, "kept_float": {}}
    say(f"accuracy: every layer quantized gives {all_on:.3g} > target {target:g}: measuring each layer")
    sensitivity = {name: error({name}) for name in layers}
    order = sorted(layers, key=lambda n: -sensitivity[n])
    kept: dict[str, str] = {}
    quantized = set(layers)
    current = all_on
    for name in order:
        if current <= target:
            break
        quantized.discard(name)
        current = error(quantized)
        kept[name] = f"sensitivity {sensitivity[name]:.3g} (output error with it alone quantized)"
        say(f"accuracy: {name} kept float -> error {current:.3g}")
    record.update({"error": current, "kept_float": kept, "met": current <= target,
                   "sensitivity": {k: round(v, 6) for k, v in sorted(sensitivity.items(), key=lambda kv: -kv[1])}})
    return set(kept), record
