"""Post-training quantization at build: measure each quantized layer's input range on calibration
data, then insert Q/DQ pairs (kiln/quant/qdq.py) so the rest of the builder sees an explicitly
quantized model.

Calibration runs the model as folded so far (constants folded, BatchNorm folded into the convolutions,
no fusion yet: the ranges measured are those of the tensors the quantized layers read), lowered and
run by the runtime's own interpreter, every layer's output observed where a quantized layer reads it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import onnx_ir as ir
import torch

from kiln.builder import int8_speed, layer_cost
from kiln.builder.lower import lower
from kiln.builder.sensitivity import choose_float_layers
from kiln.builder.timing_cache import TimingCache
from kiln.errors import KilnError
from kiln.ir import dtypes
from kiln.kernels.cpu import cpu_features
from kiln.kernels.cpu.cpu_features import has_int8_dot_product
from kiln.passes import PassOptions, optimize
from kiln.quant import cache as calibration_cache
from kiln.quant import attention as fp8_attention
from kiln.quant import calibrators, data, equalize, gptq, qdq, residual, smoothquant
from kiln.runtime.program import Program

MAX_BATCHES = 512
EVALUATION_BATCHES = 4  # the first calibration batches also judge an accuracy target
TOP1_BATCHES = 64  # ... a top-1 target (accuracy_metric "top1"): up to this many


def _observe(model: ir.Model, source: Any, observers: dict, *, preprocessing: str, say: Callable[[str], None],
             keep: list | None, what: str) -> int:
    """Run the model on every calibration batch, each observed tensor's values handed to its observer
    (anything with `observe(tensor)`) where it is produced; the number of batches. The first
    EVALUATION_BATCHES batches are appended to `keep` when given."""
    program, weights, inputs, _ = lower(model)
    runner = Program(program, weights)
    watched = {i: [(k, n) for k, n in enumerate(step.outputs) if n in observers]
               for i, step in enumerate(program.steps)}

    def observing(i: int, fn):
        outputs = watched.get(i)
        if not outputs:
            return fn

        def call(ctx, *args, **attrs):
            result = fn(ctx, *args, **attrs)
            values = result if isinstance(result, tuple) else (result,)
            for k, name in outputs:
                observers[name].observe(values[k])
            return result
        return call

    recorder = runner.with_kernels(observing)
    names = [b.name for b in inputs]
    count = 0
    with torch.inference_mode():
        for batch in data.batches(source, names, preprocessing=preprocessing, limit=MAX_BATCHES):
            if keep is not None and len(keep) < EVALUATION_BATCHES:
                keep.append(batch)
            args = []
            for b in inputs:
                value = dtypes.numpy_to_torch(np.ascontiguousarray(batch[b.name]))
                if b.name in observers:
                    observers[b.name].observe(value)
                args.append(value)
            recorder.run(args)
            count += 1
            say(f"{what}: batch {count}")
    if count == 0:
        raise KilnError(f"{what}: the data gave no batch")
    return count


def _data_needed(dtype: str, cache_path: str | None, why_not_cached: str | None) -> KilnError:
    return KilnError(f"precision {dtype}: calibration data is needed (--calib DIR, or calibration=... in the API)"
                     + (f"; the cache {cache_path} does not cover this model" if cache_path else "")
                     + (f" ({why_not_cached})" if why_not_cached else ""))


def measure_ranges(model: ir.Model, source: Any, calibrator: str, dtype: str, *, exclude: set[str],
                   cache_path: str | None, preprocessing: str, say: Callable[[str], None],
                   keep: list | None = None, smoothquant: float | None = None,
                   channel_max: dict[str, np.ndarray] | None = None,
                   per_channel_depthwise: bool = True, unsigned: bool = False,
                   channel_means: dict[str, np.ndarray] | None = None,
                   lows: dict[str, float] | None = None,
                   moments: dict[str, np.ndarray] | None = None,
                   extra: set[str] = frozenset()) -> tuple[dict, dict]:
    """({tensor: amax}, a record for the engine header) for every quantized layer's activation input;
    the first EVALUATION_BATCHES batches are appended to `keep` when given. per_channel_depthwise: the
    inputs read only by depthwise convolutions get one amax per channel (an array; kiln/quant/qdq.py).
    unsigned: int8 activations that cannot be negative will be uint8 (qdq.insert's `unsigned`), which the
    entropy calibrator's search must know.
    channel_means: when given (bias correction), filled with each activation's mean per channel, measured
    on the same batches (left empty when the ranges come from the cache: then no correction). lows: when given
    (unsigned int8), filled with each per-tensor activation's smallest value (qdq.insert's `lows`; from the cache
    when it holds them). moments: when given (GPTQ), filled with each layer's E[x xᵀ] over its input rows
    ({layer name: [g, K, K]}, kiln/quant/gptq.py), measured on the same batches (left empty from the cache: the
    weights then round to nearest). smoothquant / channel_max:
    the strength the model was smoothed with and the statistics it was smoothed from, kept in the cache."""
    # extra: other activations to measure (the residual Adds' inputs, kiln/quant/residual.py)
    needed = {t.activation.name for t in qdq.targets(model.graph, exclude)} | set(extra)
    per_channel = qdq.per_channel_activations(model.graph, exclude) if per_channel_depthwise else set()
    cached = calibration_cache.load(cache_path, calibrator, dtype, needed, smoothquant, per_channel)
    if cached is not None:
        say(f"calibration: {len(needed)} ranges from the cache {cache_path}")
        if channel_means is not None:
            channel_means.update(calibration_cache.load_channel_mean(cache_path))
        if lows is not None:
            lows.update(calibration_cache.load_low(cache_path))
        return cached, {"calibrator": calibrator, "cache": cache_path, "from_cache": True, "tensors": len(needed)}
    why_not_cached = calibration_cache.mismatch(cache_path, calibrator, dtype, smoothquant)
    if source is None:
        raise _data_needed(dtype, cache_path, why_not_cached)
    if why_not_cached:
        say(f"calibration: not using the cache {cache_path}: {why_not_cached}")
    # a non-negative activation quantized to uint8 is one-sided: its histogram of |x| maps onto all 256 codes
    one_sided = {t.activation.name for t in qdq.targets(model.graph, exclude)
                 if unsigned and dtype == "int8" and qdq.non_negative(t.activation)}
    fp8 = dtype == "fp8"
    observers = {name: calibrators.PerChannel(calibrator, name in one_sided, fp8) if name in per_channel
                 else calibrators.make(calibrator, name in one_sided, fp8) for name in needed}
    means = {}
    if channel_means is not None:  # the axis a layer reduces: a Conv's channels, a Gemm/MatMul's last axis
        means = {t.activation.name: calibrators.ChannelMean(1 if t.node.op_type == "Conv" else -1)
                 for t in qdq.targets(model.graph, exclude)}
    low_seen = {name: calibrators.Low() for name in needed - per_channel} if lows is not None else {}
    second: dict[str, gptq.Moments] = {}
    if moments is not None:
        for t in qdq.targets(model.graph, exclude):
            try:
                layer = gptq.SecondMoment(t.node)
            except KilnError as e:  # a layer GPTQ cannot unfold (3-D, auto_pad) rounds to nearest
                say(str(e) + ": its weights round to nearest")
                continue
            second.setdefault(t.activation.name, gptq.Moments({})).layers[t.node.name] = layer
    watched = {name: calibrators.Together(obs, *[o[name] for o in (means, low_seen, second) if name in o])
               for name, obs in observers.items()}
    count = _observe(model, source, watched, preprocessing=preprocessing, say=say, keep=keep, what="calibration")
    ranges = {name: obs.amax() for name, obs in observers.items()}
    if channel_means is not None:
        channel_means.update({name: m.value() for name, m in means.items()})
    if lows is not None:
        lows.update({name: o.value() for name, o in low_seen.items() if o.value() is not None})
    if moments is not None:
        moments.update({layer: m.value() for group in second.values() for layer, m in group.layers.items()})
    calibration_cache.save(cache_path, calibrator, dtype, ranges, count, smoothquant, channel_max, channel_means,
                           lows)
    return ranges, {"calibrator": calibrator, "batches": count, "tensors": len(ranges), "cache": cache_path,
                    "per_channel": len(per_channel)}


def smooth(model: ir.Model, config, alpha: float, say: Callable[[str], None],
           keep: list | None = None) -> tuple[dict[str, np.ndarray], dict]:
    """SmoothQuant (kiln/quant/smoothquant.py), in place: every MatMul/Gemm input whose producer can fold a
    per-channel scale is smoothed from its per-channel maxima on the calibration data (or the cache);
    ({tensor: channel maxima}, the header record: per layer smoothed or why not)."""
    found = smoothquant.plan(model.graph)
    needed = {g.activation.name for g in found.groups}
    channel_max = calibration_cache.load_channel_max(config.calibration_cache, config.calibrator, config.precision,
                                                     alpha, needed) if needed else {}
    if channel_max is None:
        if config.calibration is None:
            raise _data_needed(config.precision, config.calibration_cache, calibration_cache.mismatch(
                config.calibration_cache, config.calibrator, config.precision, alpha))
        observers = {name: smoothquant.ChannelMax() for name in needed}
        _observe(model, config.calibration, observers, preprocessing=config.calibration_preprocessing, say=say,
                 keep=keep, what="smoothquant statistics")
        channel_max = {name: obs.value() for name, obs in observers.items()}
    record = smoothquant.smooth(model, found, channel_max, alpha)
    say(f"smoothquant (alpha {alpha:g}): {len(record['smoothed'])} layer(s) smoothed, "
        f"{len(record['skipped'])} not")
    return channel_max, record


def equalize_channels(model: ir.Model, config, alpha: float, say: Callable[[str], None],
                      keep: list | None = None) -> dict:
    """Cross-layer equalization (kiln/quant/equalize.py), in place: every Conv -> Relu/ReLU6 -> Conv pair's
    channels rescaled from the activation's per-channel maxima on the calibration data; the header record.
    The calibration cache is then neither read nor written (quantize): its ranges would be of another model."""
    pairs = equalize.find(model.graph)
    if not pairs:
        return {"alpha": alpha, "pairs": 0, "spread": {}}
    if config.calibration is None:  # the cache holds ranges of the equalized model, not these statistics
        raise _data_needed(config.precision, None, "cross-layer equalization measures the activations' "
                           "per-channel maxima on it")
    observers = {p.activation.outputs[0].name: equalize.ChannelMax() for p in pairs}
    _observe(model, config.calibration, observers, preprocessing=config.calibration_preprocessing, say=say,
             keep=keep, what="equalization statistics")
    record = equalize.equalize(model, pairs, {name: obs.value() for name, obs in observers.items()}, alpha)
    say(f"cross-layer equalization (alpha {alpha:g}): {len(pairs)} convolution pair(s)")
    return record


def per_tensor_fp8_weights(config) -> bool:
    """FP8 weights on CUDA: one scale per weight, so that cuBLASLt's FP8 GEMM applies x_scale·w_scale itself and
    writes fp16 (its row-wise scaling for per-channel scales writes bfloat16 only)."""
    return config.precision == "fp8" and config.device == "cuda"


def quantize(model: ir.Model, config, say: Callable[[str], None]) -> tuple[ir.Model, dict]:
    """The model with its quantized layers explicit (Q/DQ), and the header record of what was done.

    "auto" on the CPU: quantize every Conv/Gemm/MatMul for the device's int8 kernels (uint8 activations
    where they cannot be negative; 7-bit weights on a CPU without VNNI, whose kernels would otherwise
    saturate); the optimizer fuses each into a kiln::QConv/QGemm and the autotuner times its int8 kernel
    against its float layer (dequantize, float kernel, quantize), so a layer runs int8 only where that
    is faster; the header then says per layer what ran and why (`summarize`). "auto" on CUDA with fp8: the
    same for the FP8 kernels (cuBLASLt's FP8 GEMM, Triton), weights per tensor (qdq.insert); int8 on CUDA:
    no layer is quantized (cuBLASLt int8 is slower than fp16 at these shapes) and the record says so. "emulate": quantize every
    Conv/Gemm/MatMul and run it as its kernel would (quantized inputs, wide accumulation) on any
    device: the accuracy an INT8/FP8 deployment will have, measured here.

    config.smoothquant (alpha): before the ranges are measured, the inputs of MatMul/Gemm layers fed by a
    LayerNorm (or a MatMul/Gemm) are smoothed (kiln/quant/smoothquant.py), the float model unchanged.
    """
    dtype = config.precision
    # layer_precision: "fp32" pins a layer float, "weight_only" its weights quantized and its input float
    # (int8 CPU builds) "w8a16": its weights int8 and its input at 16 bits, on the CPU's two-byte int8 convolution
    pinned_wide = {name for name, p in config.layer_precision.items() if p == qdq.W8A16}
    pinned_weight_only = {name for name, p in config.layer_precision.items() if p == qdq.WEIGHT_ONLY} | pinned_wide
    exclude = set(config.layer_precision) - pinned_weight_only
    if config.quantization not in ("auto", "emulate"):
        raise KilnError(f"quantization {config.quantization!r}: 'auto' or 'emulate'")
    model = optimize(model, PassOptions(opt_level=config.opt_level, verify=config.verify, fusions=False))
    layers = [t.node.name for t in qdq.targets(model.graph, exclude)]
    cpu_kernels = config.quantization == "auto" and config.device == "cpu" and dtype == "int8"
    # CUDA's FP8 GEMMs (kiln/tactics/cuda/quant_gemm.py): every layer quantized, each timed against its fp16 layer
    kernels = cpu_kernels or (config.quantization == "auto" and config.device == "cuda" and dtype == "fp8")
    if config.quantization == "auto" and not kernels:
        kept = "fp16" if config.device == "cuda" else "fp32"
        note = (f"{dtype}: no {dtype} kernel on {config.device} in this kiln yet; the {len(layers)} quantizable "
                f"layer(s) stay {kept} (quantization='emulate' measures {dtype} accuracy)")
        say(note)
        return model, {"dtype": dtype, "mode": "auto", "quantized": [], "kept_float": layers, "note": note}
    evaluation: list = []
    alpha = smoothquant.check_alpha(config.smoothquant)
    channel_max, smoothing, equalization = None, None, None
    equalize_alpha = equalize.check_alpha(config.equalize)
    if (alpha is not None or equalize_alpha is not None or config.accuracy_metric == "top1") \
            and isinstance(config.calibration, Iterator):
        # read twice: statistics, then ranges of the smoothed model; ranges, then a top-1 target's TOP1_BATCHES
        config = dataclasses.replace(config, calibration=list(data.batches(
            config.calibration, [v.name for v in model.graph.inputs],
            preprocessing=config.calibration_preprocessing, limit=MAX_BATCHES)))
    if equalize_alpha is not None:
        equalization = equalize_channels(model, config, equalize_alpha, say, keep=evaluation)
    if alpha is not None:
        channel_max, smoothing = smooth(model, config, alpha, say, keep=evaluation)
    # int8 activations that cannot be negative (a Relu's, a ReLU6's) as uint8 over [0, amax]: what the CPU's
    # int8 kernels read (and CUDA's take), so what "emulate" measures too
    unsigned = dtype == "int8"
    # the CPU's int8 kernels: post-activation residual Adds between quantized layers are quantized too
    adds = residual.plan(model.graph, exclude) if cpu_kernels else []
    # FP8 on CUDA: each attention's q, kᵀ and v too, for the scale its E4M3 tactic may run at (kiln/quant/attention.py)
    attentions = fp8_attention.find(model.graph) if per_tensor_fp8_weights(config) else []
    say(f"calibrating {len(layers)} layer(s) for {dtype} ({config.calibrator})")
    channel_means: dict[str, np.ndarray] | None = {} if config.bias_correction else None
    # int8: the activations' smallest values, so that a mostly non-negative one (a Gelu's) is uint8 with a zero point
    lows: dict[str, float] | None = {} if unsigned else None
    # GPTQ (int8 per-channel weights): each layer's input second moments
    moments: dict[str, np.ndarray] | None = {} if config.gptq and dtype == "int8" else None
    ranges, record = measure_ranges(model, config.calibration, config.calibrator, dtype, exclude=exclude,
                                    cache_path=None if equalization else config.calibration_cache,
                                    preprocessing=config.calibration_preprocessing, say=say, keep=evaluation,
                                    smoothquant=alpha, channel_max=channel_max,
                                    per_channel_depthwise=config.per_channel_depthwise, unsigned=unsigned,
                                    channel_means=channel_means, lows=lows, moments=moments,
                                    extra=residual.activations(adds) | {n for a in attentions for n in a.activations})
    accuracy: dict = {}
    sensitive: set[str] = set()
    if config.accuracy_target is not None:
        # Mixed precision: the most sensitive layers stay float until the output error meets the target; a top-1
        # share is judged on more inputs (one input in four is 25 points)
        wanted = TOP1_BATCHES if config.accuracy_metric == "top1" else EVALUATION_BATCHES
        if len(evaluation) < wanted and config.calibration is not None:
            evaluation = list(data.batches(config.calibration, [v.name for v in model.graph.inputs],
                                           preprocessing=config.calibration_preprocessing, limit=wanted))
        if not evaluation:
            raise KilnError("--accuracy-target measures the error on calibration data: give it (--calib)")
    # the int8 kernels of a CPU without VNNI: 7-bit weights (any two products with a uint8 activation fit int16),
    # but for depthwise convolutions, whose kernel pairs no bytes (qdq.pairs_bytes)
    weight_max = 64.0 if cpu_kernels and not has_int8_dot_product() else None
    per_tensor_weights = per_tensor_fp8_weights(config)
    # layers between int8 and float (the accuracy target's) are W8A16 (int8 weights, the input at 16 bits: two int8
    # convolutions on its bytes) where the CPU's int8 kernels run it exactly (VNNI), and in an int8 emulation (what
    # such a CPU engine computes); else weight-only (the input float)
    no_kernel = layer_cost.available() if cpu_kernels else f"{config.device} {dtype} builds have no W8A16 kernel"
    no_wide = None if dtype == "int8" and config.quantization == "emulate" else no_kernel
    if pinned_wide and no_wide is not None:
        raise KilnError(f"layer_precision w8a16 for {sorted(pinned_wide)[:3]}: {no_wide}")
    # without VNNI (an AVX2-only CPU) the engine's W8A16 is w16gemm's one-pass 1x1 GEMM alone: the other layers the
    # search moves up run weight-only (their input float, the fp32 kernel), and say why
    narrow = {}
    if cpu_kernels and no_kernel is None and layer_cost.split_refusal() is not None:
        narrow = {t.node.name: why for t in qdq.targets(model.graph, exclude)
                  if (why := layer_cost.layer_refusal(t.node)) is not None}
    if pinned_wide & set(narrow):
        name = sorted(pinned_wide & set(narrow))[0]
        raise KilnError(f"layer_precision w8a16 for {name!r}: {narrow[name]}")
    # INT8 where measured faster (kiln/builder/int8_speed.py): with per-layer times of this machine's engines, the
    # layers whose int8 form is not faster (their quantize steps included) stay fp32 before the search ranks the others
    speed, slow, where = None, {}, ""
    if cpu_kernels and config.layer_times is not None:
        speed, where = _speed_model(model, config.layer_times)
        floats = set(exclude) | pinned_weight_only
        slow = int8_speed.speed_moves(speed, floats, where)
        say(f"int8 speed: {len(slow)} layer(s) kept fp32 before the search (int8 not faster here by the measured "
            f"times): every layer fp32 {speed.total(set(speed.int8)):.2f} ms, every layer int8 {speed.total(floats):.2f}"
            f" ms, this plan {speed.total(floats | set(slow)):.2f} ms")
    if config.accuracy_target is not None:
        top1 = config.accuracy_metric == "top1"
        # the search's expected agreement on the calibration images is optimistic on new ones (0.971 expected ->
        # 96.4% of 202 held out on MobileNetV2, bench/results/quantacc4-2026-12-06.md): it aims this much higher
        aim = min(config.accuracy_target + config.accuracy_margin, 1.0) if top1 else config.accuracy_target
        # an int8 CPU build chooses by milliseconds: each layer's kernels timed here in int8, W8A16 and fp32, or
        # read from the timing cache (a rebuild with the same data and cache then makes the same plan)
        costs = None
        if top1 and config.accuracy_weight_only and config.accuracy_by_cost and no_kernel is None:
            timings = TimingCache(config.timing_cache) if config.timing_cache else None
            costs = layer_cost.layer_costs(model, [t.node.name for t in qdq.targets(model.graph, exclude |
                                                                                         pinned_weight_only | set(slow))],
                                           say, timings)
            if timings is not None:
                timings.save()
            if speed is not None:  # the engines' measured times; W8A16's kernel alone scaled as fp32's is in the engine
                costs = {name: _measured_costs(c, speed, name) for name, c in costs.items()}
        # (a layer pinned weight-only is float in the search's measurements: not a candidate)
        sensitive, accuracy = choose_float_layers(model, ranges, dtype, evaluation, aim,
                                                  exclude | pinned_weight_only | set(slow), say,
                                                  metric=config.accuracy_metric,
                                                  unsigned=unsigned, weight_max=weight_max,
                                                  channel_means=channel_means, lows=lows,
                                                  moments=moments, weight_only=config.accuracy_weight_only,
                                                  costs=costs)
        if aim != config.accuracy_target:  # the margin moved it (a target of 1 is not raised)
            accuracy.update({"asked": config.accuracy_target, "margin": config.accuracy_margin})
    if config.bias_correction and not channel_means:
        say("bias correction: the ranges came from the cache, which holds no channel means: not corrected")
    if config.gptq and dtype != "int8":
        say(f"gptq: int8 weights only; the {dtype} weights round to nearest")
    elif config.gptq and not moments:
        say("gptq: the ranges came from the cache, which holds no second moments: weights rounded to nearest")
    # weight-only layers (the search's precision between): their weights quantized, their inputs float
    chosen_weight_only = {**{name: "pinned" for name in pinned_weight_only}, **(accuracy.get("weight_only") or {})}
    weight_only = set(chosen_weight_only)
    speed_record = None
    if speed is not None:
        # after the search: the int8 layers its float ones left where their boundaries make int8 no faster
        before = dict(slow)
        floats = set(exclude) | weight_only | sensitive | set(slow)
        slow.update(int8_speed.speed_moves(speed, floats, where))
        if len(slow) > len(before):
            say(f"int8 speed: {len(slow) - len(before)} more layer(s) kept fp32 after the search (their boundaries)")
        sensitive = sensitive | set(slow)
        final = set(exclude) | weight_only | sensitive
        speed_record = {"kept_fp32": slow, "before_search": sorted(before), "after_search": sorted(set(slow) - set(before)),
                        "plan_ms": round(speed.total(final), 4), "all_int8_ms": round(speed.total(set()), 4),
                        "all_fp32_ms": round(speed.total(set(speed.int8)), 4), "times": config.layer_times}
    convs = {t.node.name for t in qdq.targets(model.graph, exclude) if t.node.op_type == "Conv"}
    wide = pinned_wide | ({n for n in weight_only - pinned_weight_only if n in convs and n not in narrow}
                          if no_wide is None else set())
    if no_wide is None and (stayed := sorted(n for n in weight_only - pinned_weight_only if n in narrow)):
        for name in stayed:
            chosen_weight_only[name] += f"; weight-only, not W8A16: {narrow[name]}"
        say(f"w8a16: {len(stayed)} layer(s) moved up run weight-only (fp32 kernel), not W8A16: {narrow[stayed[0]]}")
    # readers kept float or weight-only (a float input): their Adds too
    adds = residual.plan(model.graph, exclude | sensitive | weight_only) if adds else []
    # the layers whose weights keep 8 bits where the others' are 7 (qdq.pairs_bytes)
    full_range = [t.node.name for t in qdq.targets(model.graph, exclude | sensitive)
                  if weight_max and not qdq.pairs_bytes(t.node)]
    skipped = qdq.insert(model, ranges, dtype, exclude | sensitive, unsigned=unsigned, weight_max=weight_max,
                         channel_means=channel_means, lows=lows, per_tensor_weights=per_tensor_weights,
                         moments=moments, weight_only=weight_only - wide, wide=wide)
    residual_adds = residual.insert(model, adds, ranges, unsigned)
    quantized = [name for name in layers if name not in skipped and name not in sensitive | weight_only]
    kept = {**skipped, **{name: "pinned" for name in exclude}, **(accuracy.get("kept_float") or {}), **slow}
    return model, {"dtype": dtype, "mode": "kernels" if kernels else "emulate", "calibration": record,
                   "quantized": quantized, "kept_float": kept, "accuracy": accuracy,
                   "weight_only": {name: why for name, why in chosen_weight_only.items() if name not in skipped},
                   # the weight-only layers whose input is 16-bit (W8A16, kiln/tactics/cpu/w8a16.py)
                   "w8a16": sorted(n for n in wide if n not in skipped),
                   "full_range_weights": sorted(set(full_range) - set(skipped)),
                   "weights": f"{'7' if weight_max else '8'}-bit per {'tensor' if per_tensor_weights else 'channel'}"
                   + (f", depthwise 8-bit (this CPU: {cpu_features.describe()})" if weight_max else ""),
                   "ranges": {k: np.asarray(v).tolist() for k, v in sorted(ranges.items())},
                   "bias_correction": bool(channel_means),
                   "gptq": bool(moments),
                   "residual_adds": residual_adds,
                   "attention_fp8_scales": fp8_attention.scales(attentions, ranges),
                   **({"speed": speed_record} if speed_record is not None else {}),
                   # what the correction was formed from: a refit forms it again from the new weights with these
                   # (kiln/builder/refit.py), as it keeps the ranges
                   "channel_means": {k: np.asarray(v).tolist() for k, v in sorted((channel_means or {}).items())},
                   "lows": {k: float(v) for k, v in sorted((lows or {}).items())},
                   **({"smoothquant": smoothing} if smoothing is not None else {}),
                   **({"equalization": equalization} if equalization is not None else {})}


def _speed_model(model: ir.Model, table: dict) -> tuple[int8_speed.SpeedModel, str]:
    """The measured (or given) per-layer times over the model's quantizable layers, and where they come from."""
    every = qdq.targets(model.graph)
    elements = {t.node.name: int(np.prod(t.activation.shape)) for t in every
                if t.activation.shape is not None and all(isinstance(d, int) for d in t.activation.shape)}
    producers = int8_speed.layer_producers(model.graph, {t.node.name for t in every})
    where = (f"; in this build's engines, {table['clock']} at {table['threads']} thread(s), {table['cpu']}"
             if "cpu" in table else "; by the given layer_times")
    return int8_speed.speed_model(table, producers, elements), where


def _measured_costs(kernels: dict[str, float], speed: int8_speed.SpeedModel, name: str) -> dict[str, float]:
    """A layer's search costs from the engines' times: int8 and fp32 as measured there; W8A16's kernel alone times
    the ratio of fp32's in the engine to fp32's alone."""
    if name not in speed.int8:
        return kernels
    scale = speed.fp32[name] / kernels["fp32"] if kernels.get("fp32") else 1.0
    return {"int8": speed.int8[name], "fp32": speed.fp32[name], "w8a16": kernels["w8a16"] * scale}


# the int8 kernels of the CPU's layers (oneDNN's; kiln's i8gemm.c for GEMMs and 1x1 convolutions, qdepthwise.c)
INT8_TACTICS = ("cpu.qconv.onednn", "cpu.qgemm.onednn", "cpu.qgemm.kiln_i8", "cpu.qconv.kiln_i8", "cpu.qconv.kiln_dw")


def _cpu_without_dot_products() -> str:
    """What a layer kept in fp32 for speed says about a CPU without int8 dot products (issue 12: "says so")."""
    return "" if has_int8_dot_product() else f" on this CPU ({cpu_features.describe()})"


def summarize(program, tactics: dict, quantization: dict | None = None,
              storage: str = "fp32") -> dict[str, dict[str, str]]:
    """Per quantized layer (kiln::QConv/QGemm): the precision it runs in and why, from the tactic the
    autotuner chose and the other candidates' times or refusals (header["quantization"]["layers"]);
    with SmoothQuant (the record's "smoothquant"), whether its input was smoothed or why not. `quantization`
    (quantize's record): the layers an accuracy target made weight-only or kept float (or layer_precision pinned
    weight-only), which run float kernels of the engine's `storage`, with the target's reason."""
    quantization = quantization or {}
    smoothing = quantization.get("smoothquant") or {}
    notes = {**smoothing.get("smoothed", {}), **smoothing.get("skipped", {})}
    tuned = tactics.get("layers", {})
    found: dict[str, dict[str, str]] = {}
    dtype = quantization.get("dtype", "int8")
    full_range = set(quantization.get("full_range_weights") or ())
    by_target = {**{name: (storage, f"accuracy target: {why}") for name, why in
                    ((quantization.get("accuracy") or {}).get("kept_float") or {}).items()},
                 **{name: (storage, why) for name, why in ((quantization.get("speed") or {}).get("kept_fp32")
                                                           or {}).items()},
                 **{name: (f"{dtype} weights, {storage} input", why if why == "pinned" else f"accuracy target: {why}")
                    for name, why in (quantization.get("weight_only") or {}).items()}}
    for name in quantization.get("w8a16") or ():  # W8A16: the 16-bit input on the int8 kernels
        why = (quantization.get("weight_only") or {}).get(name, "pinned")
        by_target[name] = ("w8a16 (int8 weights, 16-bit input)", why if why == "pinned" else f"accuracy target: {why}")
    for step in program.steps:
        layer_names = [step.name, *(step.fused_from or ())]
        chose = next((by_target[n] for n in layer_names if n in by_target), None)
        if chose is not None:  # a float kernel, by the accuracy target's choice
            found[step.name] = {"precision": chose[0], "tactic": (tuned.get(step.name) or {}).get(
                "tactic", step.tactic or "default"), "why": chose[1]}
            continue
        if step.domain != "kiln" or step.op_type not in ("QConv", "QGemm"):
            continue
        layer = tuned.get(step.name) or {}
        chosen = layer.get("tactic", step.tactic or "default")
        candidates = layer.get("candidates", {})
        # the fastest int8 kernel timed, else the first one's refusal
        timed = [candidates[t] for t in INT8_TACTICS if isinstance(candidates.get(t), (int, float))]
        int8 = min(timed) if timed else next((candidates.get(t) for t in INT8_TACTICS if t in candidates), None)
        if chosen in INT8_TACTICS:
            faster = layer.get("runner_up_ms")
            why = f"int8 kernel {layer.get('time_ms', 0):.3f} ms" + (f", next {layer.get('runner_up')} "
                                                                   f"{faster:.3f} ms" if faster else "")
            if step.name in full_range:
                why += "; 8-bit weights (depthwise: its kernel widens each product, no byte pairs to saturate)"
            found[step.name] = {"precision": "int8", "tactic": chosen, "why": why}
        elif layer.get("reverted"):  # the tuner's pick, sent back by the whole-engine check (builder/accuracy.py)
            found[step.name] = {"precision": "int8 (reference)" if chosen == "default" else "fp32", "tactic": chosen,
                                "why": f"reverted by the engine's accuracy check (was {layer['reverted']})"}
        elif isinstance(int8, str):
            found[step.name] = {"precision": "fp32", "tactic": chosen, "why": f"int8 kernel {int8}"}
        elif isinstance(int8, (int, float)):
            ms = layer.get("time_ms") or 0.0
            why = (f"int8 kernel slower: {int8:.3f} ms vs {ms:.3f} ms{_cpu_without_dot_products()}" if int8 > ms
                   else f"int8 kernel {int8:.3f} ms, {chosen} {ms:.3f} ms chosen")
            found[step.name] = {"precision": "fp32", "tactic": chosen, "why": why}
        elif chosen == "default" and step.name in (tactics.get("fallback_layers") or {}):
            found[step.name] = {"precision": "int8 (reference)", "tactic": chosen,
                                "why": tactics["fallback_layers"][step.name]}
        else:
            found[step.name] = {"precision": "fp32" if chosen != "default" else "int8 (reference)",
                                "tactic": chosen, "why": "no int8 kernel was timed for it"}
        if step.name in notes:
            found[step.name]["why"] += f"; {notes[step.name]}"
    return found
