"""Explicit quantization from measured ranges: Q/DQ pairs inserted into the graph, as TensorRT's
implicit INT8 mode and onnxruntime's QDQ format place them.

For every Conv, Gemm and MatMul with a constant weight (the layers INT8/FP8 kernels run):

    x ──Q(s_x)──DQ(s_x)──┐                      s_x = amax(x) / 127 (int8) or / 448 (FP8 E4M3),
    W_q ─────────DQ(s_w)──┴── Conv/Gemm/MatMul    per tensor, symmetric (zero point 0)
                                                s_w per output channel = max|W_c| / 127 (or / 448)

The weight is stored quantized (int8 / float8e4m3fn) with its scales; the bias stays float (a kernel
takes it as int32 at s_x·s_w).

The input of a depthwise convolution (group = C, one input channel per group) is quantized per channel
(axis 1, s_x[c] = amax(x_c) / 127) when depthwise convolutions are its only quantized readers: output
channel o reads input channel c = o·C/O alone, so x_c·s_x[c]·w_o·s_w[o] = x_c·w_o·(s_x[c]·s_w[o]) and
the per-channel input scale folds into the per-channel weight scale (kiln/passes/fusion/qdq_layers.py)
and the int8 kernel is unchanged. MobileNetV2's expanded activations have channels whose ranges differ
by orders of magnitude: one scale for all rounds the small ones to zero. One Q/DQ pair serves every consumer of a tensor. What runs then is
exactly what an INT8/FP8 kernel computes (quantized inputs, wide accumulation): constant folding turns
DQ(W_q) into the dequantized weight, and each activation pair quantizes on the way in.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np
import onnx_ir as ir

from kiln.errors import KilnError
from kiln.quant import gptq

QUANTIZABLE = ("Conv", "Gemm", "MatMul")
INT8_MAX = 127.0
FP8_MAX = 448.0  # float8e4m3fn
WEIGHT_ONLY = "weight_only"  # a layer_precision value: the layer's weights quantized, its input float (insert)
W8A16 = "w8a16"  # a layer_precision value (int8 CPU builds): int8 weights, the input quantized to 16 bits (insert)
WIDE_MAX = {"uint16": 65535.0, "int16": 32767.0}  # a W8A16 input's steps: [0, amax] unsigned, symmetric signed
# a W8A16 input's range: this times the calibrated amax (a Clip's bound at most). The calibrator's amax clips the
# outliers for int8's resolution (percentile: 99.99%); at 16 bits there is resolution to spare (4·amax/32767 is 64x
# finer than int8's step) and the clipping was the W8A16 layers' error: MobileNetV2, 12 fp32 + 25 W8A16 layers,
# 202 held out x 3 draws: at the percentile amax 195, 193, 195 (relerr 0.034); x4 199, 200, 200 (0.021); the same
# layers with float inputs 198 x 3 (0.021) (bench/results/quantacc4-2026-12-06.md, h-w8a16e)
WIDE_HEADROOM = 4.0
ASYMMETRIC = 0.5  # int8: an activation whose negative side reaches at most this fraction of amax is uint8 + zero point


@dataclass(frozen=True)
class Target:
    """A layer kiln quantizes: its node, the activation input and the constant weight input."""

    node: ir.Node
    activation: ir.Value
    weight: ir.Value
    channel_axis: int  # the weight's output-channel axis


def targets(graph: ir.Graph, exclude: set[str] = frozenset()) -> list[Target]:
    """Layers to quantize: Conv (weight axis 0), Gemm (B's N axis), MatMul with a constant 2-D B
    (axis 1); an already quantized input (a DequantizeLinear producer) or an excluded name is skipped."""
    found = []
    for node in graph:
        if node.op_type not in QUANTIZABLE or node.domain not in ("", "ai.onnx") or node.name in exclude:
            continue
        if len(node.inputs) < 2 or node.inputs[0] is None or node.inputs[1] is None:
            continue
        x, w = node.inputs[0], node.inputs[1]
        if w.const_value is None or x.const_value is not None:
            continue
        producer = x.producer()
        if producer is not None and producer.op_type == "DequantizeLinear":
            continue
        if node.op_type == "Conv":
            axis = 0
        elif node.op_type == "Gemm":
            if node.attributes.get("transA") is not None and node.attributes["transA"].value:
                continue
            trans_b = node.attributes.get("transB")
            axis = 0 if trans_b is not None and trans_b.value else 1
        else:  # MatMul: x [..., K] @ W [K, N]
            if len(w.shape or []) != 2:
                continue
            axis = 1
        found.append(Target(node, x, w, axis))
    return found


def pairs_bytes(node: ir.Node) -> bool:
    """Whether the CPU's int8 kernel of this layer multiplies u8·s8 byte pairs (vpmaddubsw without VNNI), which
    insert's weight_max keeps from saturating int16: every layer but a depthwise convolution of one output channel
    per group, whose kernel widens each product to int32 (kiln/kernels/cpu/onednn_int8.py pair_overflow_possible)."""
    return not (is_depthwise(node) and node.inputs[1].const_value.shape[0] == node.attributes["group"].value)


def is_depthwise(node: ir.Node) -> bool:
    """A Conv whose every group reads one input channel (group = C_in, weight [O, 1, *k])."""
    if node.op_type != "Conv" or node.inputs[1] is None or node.inputs[1].const_value is None:
        return False
    group = node.attributes.get("group")
    w_shape = node.inputs[1].const_value.shape
    return group is not None and group.value > 1 and w_shape[1] == 1 and w_shape[0] % group.value == 0


def per_channel_activations(graph: ir.Graph, exclude: set[str] = frozenset()) -> set[str]:
    """The activations to quantize per channel: those whose every quantized reader is a depthwise Conv."""
    readers: dict[str, list[ir.Node]] = {}
    for t in targets(graph, exclude):
        readers.setdefault(t.activation.name, []).append(t.node)
    return {name for name, nodes in readers.items() if all(is_depthwise(n) for n in nodes)}


def _scalar(name: str, value: float) -> ir.Value:
    return ir.Value(name=name, const_value=ir.tensor(np.array(value, np.float32), name=name))


def _clip_max(value: ir.Value) -> float | None:
    """The upper bound of the Clip producing `value` (ReLU6: 6), when constant."""
    node = value.producer()
    if node is None or node.op_type != "Clip" or node.domain not in ("", "ai.onnx") or len(node.inputs) < 3:
        return None
    high = node.inputs[2].const_value if node.inputs[2] is not None else None
    return None if high is None else float(high.numpy().reshape(-1)[0])


def _zero_point(name: str, dtype: str, shape: tuple[int, ...] = (), value: int = 0) -> ir.Value:
    if dtype in ("int8", "uint8", "int16", "uint16"):
        tensor = ir.tensor(np.full(shape, value, np.dtype(dtype)), name=name)
    else:
        tensor = ir.tensor(np.zeros(shape, ml_dtypes.float8_e4m3fn), name=name)
    return ir.Value(name=name, const_value=tensor)


def _initializer(graph: ir.Graph, value: ir.Value) -> ir.Value:
    graph.register_initializer(value)
    return value


def non_negative(value: ir.Value) -> bool:
    """The value is a Relu's output, or a Clip's with a constant lower bound >= 0 (MobileNet's ReLU6)."""
    node = value.producer()
    if node is None or node.domain not in ("", "ai.onnx"):
        return False
    if node.op_type == "Relu":
        return True
    if node.op_type == "Clip" and len(node.inputs) > 1 and node.inputs[1] is not None:
        low = node.inputs[1].const_value
        return low is not None and float(low.numpy().reshape(-1)[0]) >= 0.0
    return False


def insert(model: ir.Model, ranges: dict[str, float | np.ndarray], dtype: str, exclude: set[str] = frozenset(),
           unsigned: bool = False, weight_max: float | None = None,
           channel_means: dict[str, np.ndarray] | None = None,
           lows: dict[str, float] | None = None, per_tensor_weights: bool = False,
           moments: dict[str, np.ndarray] | None = None, weight_only: set[str] = frozenset(),
           private_pairs: bool = False, wide: set[str] = frozenset()) -> dict[str, str]:
    """Quantize every target layer whose activation has a measured range (in place). Returns
    {layer name: why it was left in float} for the targets it skipped.

    weight_only (layer names): those layers' weights are quantized (GPTQ and bias correction as for the others)
    but their input is not: the layer reads its float input, W8A32 on the CPU (the fp32 kernel on int8-grid
    weights), the precision between int8 and float that the accuracy-target search tries before a whole-float
    layer (kiln/builder/sensitivity.py). Its weight is stored dequantized (a float constant on the int8/E4M3 grid,
    _folded_weight), so that the float kernels pack it once.
    private_pairs: each layer its own activation Q/DQ pair even where several read one tensor (named
    <activation>_<layer>_q/_dq), so that each can be switched alone (the search's SwitchedModel); the values are
    those of one shared pair.
    wide (layer names; int8, Convs): W8A16, those layers' weights quantized as weight_only's but their input through a
    16-bit pair (opset 21's uint16/int16 QuantizeLinear; uint16 over [0, amax] for a non-negative input, else
    symmetric int16, zero point 0, one scale per tensor over WIDE_HEADROOM x the calibrated amax (outliers kept),
    and still finer than any per-channel int8 scale of MobileNetV2's depthwise inputs): what the CPU's two-byte int8
    convolution reads
    (kiln/tactics/cpu/w8a16.py), 2^-16 of the range from weight_only's float input. One pair per activation for
    its W8A16 readers, apart from its 8-bit pair. A layer in `wide` that is not a Conv is weight-only.

    unsigned (int8 only): an activation that cannot be negative (a Relu's, a ReLU6's) is quantized to
    uint8 with zero point 0, all 256 steps over [0, amax], instead of int8's 128. weight_max: the largest
    quantized weight magnitude of the layers whose kernels pair bytes (`pairs_bytes`; 64 keeps any two weights'
    products with a uint8 activation within int16: the int8 kernels of a CPU without VNNI,
    kiln/kernels/cpu/onednn_int8.py); a depthwise convolution's weights keep the full range. A range given as an
    array (one amax per channel, per_channel_activations) quantizes that activation along axis 1; a
    channel that was 0 on every batch gets the largest channel's scale (its values quantize to 0 either
    way). A range above a Clip's upper bound (a ReLU6's 6) is lowered to it: no value lies above.

    lows ({activation: the smallest value it took on the calibration data}; int8 with unsigned only): a
    per-tensor activation whose values are non-negative (an average of ReLU outputs) is uint8 over [0, amax]
    too, and one whose negative side is short (-low <= ASYMMETRIC·amax, half; a Gelu's output, >= -0.17
    against a positive range of several units) is uint8 over [low, amax] with a zero point, as onnxruntime's
    QDQ activations are: 255 steps over [low, amax] instead of int8's 254 over [-amax, amax], whose negative
    half a Gelu's output barely uses. Not for a roughly symmetric tensor: the gain is small there, and new
    data below the calibrated minimum would be clipped where int8's -amax leaves room (a LayerNorm output's
    error on fresh inputs grew so, tests/unit/test_smoothquant.py's block, at a threshold of 1). MiniLM's FFN down projections read Gelu: their input's rounding was
    most of the embedding's error (bench/results/quant-cpu-2026-12-02.md, h-quant3).

    channel_means ({activation: its mean per channel on the calibration data}): bias correction (Nagel et
    al. 2019, "Data-Free Quantization", section 4.2). Rounding the weights shifts each output channel's
    mean by Σ (W_q - W)·E[x]; the layer's bias absorbs minus that, so the quantized layer's output has the
    float layer's mean (exact for 1x1 convolutions and GEMMs, off only at the padded border for larger
    kernels).

    per_tensor_weights: one scale per weight (FP8 on CUDA): cuBLASLt's FP8 GEMM then applies x_scale·w_scale
    itself and writes fp16 (row-wise scales write bfloat16 only). E4M3's 3-bit mantissa is relative, so a
    channel 100x smaller than the largest still sits on normal values (4.5 of 448). The layers reading one
    activation (attention's Q, K and V projections) share the scale of their largest weight, so that they
    merge into one GEMM (kiln/passes/fusion/parallel_gemm.py).

    moments ({layer name: E[x xᵀ] of its input rows, [g, K, K]}; int8 per-channel weights only): the layer's
    weight integers are GPTQ's (kiln/quant/gptq.py) instead of the nearest, the scales unchanged."""
    if dtype not in ("int8", "fp8"):
        raise KilnError(f"quantization to {dtype!r}: kiln quantizes to int8 or fp8")
    if wide and dtype != "int8":
        raise KilnError(f"W8A16 layers {sorted(wide)[:3]} in a {dtype} build: 16-bit inputs go with int8 weights")
    graph = model.graph
    qmax = INT8_MAX if dtype == "int8" else FP8_MAX
    # E4M3 Q/DQ: opset 19; uint16/int16 (W8A16 inputs): 21
    model.opset_imports[""] = max(model.opset_imports.get("", 13), 19 if dtype == "fp8" else 21 if wide else 13)
    skipped: dict[str, str] = {}
    pairs: dict[str, ir.Value] = {}  # activation name -> its dequantized value
    shared_amax: dict[str, float] = {}  # per_tensor_weights: activation name -> the largest |w| of its readers
    for t in targets(graph, exclude) if per_tensor_weights else ():
        w_max = float(np.abs(t.weight.const_value.numpy()).max(initial=0.0))
        shared_amax[t.activation.name] = max(shared_amax.get(t.activation.name, 0.0), w_max)
    for t in targets(graph, exclude):
        amax = ranges.get(t.activation.name)
        if amax is None:
            skipped[t.node.name] = f"no range measured for its input {t.activation.name!r}"
            continue
        amax = np.asarray(amax, np.float64)
        if not np.all(np.isfinite(amax)) or amax.max(initial=0.0) <= 0:
            skipped[t.node.name] = f"its input {t.activation.name!r} was {amax.max(initial=0.0)} on every " \
                                   "calibration batch"
            continue
        if amax.ndim == 1 and not is_depthwise(t.node):
            skipped[t.node.name] = f"its input {t.activation.name!r} has per-channel ranges: only a depthwise " \
                                   "convolution folds them into its weight scales"
            continue
        if t.node.name in wide and t.node.op_type == "Conv":  # W8A16: a 16-bit pair (one per activation)
            dq = pairs.get(f"{t.activation.name}_w16") or _wide_pair(graph, t, amax, pairs)
        elif t.node.name in weight_only or t.node.name in wide:  # the float input: the weight alone quantized
            dq = t.activation
        else:
            dq = pairs.get(f"{t.activation.name}_{t.node.name}" if private_pairs else t.activation.name)
        if dq is None:
            base = f"{t.activation.name}_{t.node.name}" if private_pairs else t.activation.name
            high = _clip_max(t.activation)
            if high is not None and high > 0:
                amax = np.minimum(amax, high)
            amax = np.where(amax > 0, amax, amax.max())  # a channel 0 throughout: any scale quantizes it to 0
            positive = unsigned and dtype == "int8" and non_negative(t.activation)
            low = (lows or {}).get(t.activation.name) if unsigned and dtype == "int8" and amax.ndim == 0 else None
            zero_point = 0
            if low is not None and not positive and low >= 0:
                positive = True
            steps = 255.0 if positive else qmax
            s = (amax / steps).astype(np.float32)
            if low is not None and not positive and high is None and -low <= ASYMMETRIC * float(amax):
                positive = True  # uint8 with a zero point over [low, amax]
                s = np.asarray((float(amax) - low) / 255.0, np.float32)
                zero_point = int(np.clip(np.round(-low / float(s)), 1, 255))
            if high is not None and high > 0:  # float32 rounding may not put the top step above the Clip's bound
                s = np.where(s.astype(np.float64) * steps > high, np.nextafter(s, np.float32(0)), s)
            if amax.ndim == 0:
                scale = _initializer(graph, _scalar(f"{base}_qscale", float(s)))
                zero = _initializer(graph, _zero_point(f"{base}_qzero", "uint8" if positive else dtype,
                                                       value=zero_point))
                axis = {}
            else:
                scale = _initializer(graph, ir.Value(name=f"{base}_qscale", const_value=ir.tensor(
                    s, name=f"{base}_qscale")))
                zero = _initializer(graph, _zero_point(f"{base}_qzero", "uint8" if positive else dtype, amax.shape))
                axis = {"axis": 1}
            dq = pairs[base] = quantize_dequantize(graph, t.node, t.activation, scale, zero, axis, base)
        t.node.replace_input_with(0, dq)
        h = (moments or {}).get(t.node.name) if dtype == "int8" and not per_tensor_weights else None
        narrow = weight_max if weight_max and pairs_bytes(t.node) else qmax
        weight_dq = _quantized_weight(graph, t, dtype, narrow, shared_amax.get(t.activation.name), h)
        mean = (channel_means or {}).get(t.activation.name)
        if mean is not None:
            _correct_bias(graph, t, weight_dq, mean)
        if (t.node.name in weight_only or (t.node.name in wide and t.node.op_type != "Conv")) and not private_pairs:
            weight_dq = _folded_weight(graph, weight_dq)
        t.node.replace_input_with(1, weight_dq)
        if not t.weight.uses() and t.weight.name in graph.initializers:  # the float weight: no reader left
            graph.initializers.pop(t.weight.name)
    return skipped


def _wide_pair(graph: ir.Graph, t: Target, amax: np.ndarray, pairs: dict[str, ir.Value]) -> ir.Value:
    """The 16-bit pair of a W8A16 layer's input (insert's `wide`), registered in `pairs` as <activation>_w16."""
    base = f"{t.activation.name}_w16"
    amax = float(np.max(amax)) * WIDE_HEADROOM  # one scale per tensor: the kernel's
    high = _clip_max(t.activation)
    if high is not None and high > 0:
        amax = min(amax, high)
    wide = "uint16" if non_negative(t.activation) else "int16"
    s = np.float32(amax / WIDE_MAX[wide])
    if high is not None and high > 0 and float(s) * WIDE_MAX[wide] > high:  # the top step within the Clip's bound
        s = np.nextafter(s, np.float32(0))
    scale = _initializer(graph, _scalar(f"{base}_qscale", float(s)))
    zero = _initializer(graph, _zero_point(f"{base}_qzero", wide))
    pairs[base] = quantize_dequantize(graph, t.node, t.activation, scale, zero, {}, base)
    return pairs[base]


def quantize_dequantize(graph: ir.Graph, before: ir.Node, value: ir.Value, scale: ir.Value, zero: ir.Value,
                        axis: dict | None = None, base: str | None = None) -> ir.Value:
    """DQ(Q(value)) with these scale and zero point (initializers), inserted before `before`: the dequantized
    value, named after `base` (default: `value`'s name; <base>_q, <base>_dq)."""
    base, axis = base or value.name, axis or {}
    q = ir.node("QuantizeLinear", [value, scale, zero], attributes=axis, name=f"{base}_quantize", num_outputs=1)
    q.outputs[0].name = f"{base}_q"
    q.outputs[0].type = ir.TensorType(zero.const_value.dtype)
    q.outputs[0].shape = value.shape
    d = ir.node("DequantizeLinear", [q.outputs[0], scale, zero], attributes=axis, name=f"{base}_dequantize",
                num_outputs=1)
    d.outputs[0].name = f"{base}_dq"
    d.outputs[0].dtype = value.dtype
    d.outputs[0].shape = value.shape
    graph.insert_before(before, [q, d])
    return d.outputs[0]


def _quantized_weight(graph: ir.Graph, t: Target, dtype: str, qmax: float, tensor_amax: float | None = None,
                      moment: np.ndarray | None = None) -> ir.Value:
    """DQ(W_q, s_w per output channel, 0): the weight stored quantized; with `tensor_amax`, one scale
    tensor_amax / qmax for the whole weight; with `moment` (int8), W_q rounded by GPTQ on it."""
    w = t.weight.const_value.numpy().astype(np.float32)
    axes = tuple(a for a in range(w.ndim) if a != t.channel_axis)
    amax = np.abs(w).max(axis=axes) if tensor_amax is None else np.asarray(tensor_amax)  # per channel, or one
    scale = np.where(amax > 0, amax / qmax, 1.0).astype(np.float32)
    shape = [1] * w.ndim
    shape[t.channel_axis] = -1
    q = w / scale.reshape(shape)
    base = f"{t.node.name or t.weight.name}_weight"
    if dtype == "int8" and moment is not None and moment.size:
        rows = gptq.rows_of(w.astype(np.float64), t.node.op_type, t.channel_axis)
        ints = gptq.round_weights(rows, moment, scale.astype(np.float64), qmax)
        ints = ints.T if t.node.op_type != "Conv" and t.channel_axis == 1 else ints.reshape(w.shape)
        stored = ir.tensor(np.ascontiguousarray(ints).astype(np.int8), name=f"{base}_q")
    elif dtype == "int8":
        stored = ir.tensor(np.clip(np.round(q), -qmax, qmax).astype(np.int8), name=f"{base}_q")
    else:
        stored = ir.tensor(np.clip(q, -qmax, qmax).astype(ml_dtypes.float8_e4m3fn), name=f"{base}_q")
    w_q = _initializer(graph, ir.Value(name=f"{base}_q", const_value=stored))
    s = _initializer(graph, ir.Value(name=f"{base}_scale", const_value=ir.tensor(scale, name=f"{base}_scale")))
    zero = _initializer(graph, _zero_point(f"{base}_zero", dtype, scale.shape))
    d = ir.node("DequantizeLinear", [w_q, s, zero], attributes={"axis": t.channel_axis}, name=f"{base}_dequantize",
                num_outputs=1)
    d.outputs[0].name = f"{base}_dq"
    d.outputs[0].dtype = t.weight.dtype
    d.outputs[0].shape = t.weight.shape
    graph.insert_before(t.node, [d])
    return d.outputs[0]


def _folded_weight(graph: ir.Graph, weight_dq: ir.Value) -> ir.Value:
    """A weight-only layer's DQ(W_q) as a float constant, (W_q - 0)·s in float32 as DequantizeLinear computes it:
    constant folding keeps Q/DQ nodes for the quantized layers' fusion, and a Conv reading a DequantizeLinear
    step would run no packed float kernel (the weight recomputed and re-laid out every run)."""
    dq = weight_dq.producer()
    q, scale = dq.inputs[0].const_value.numpy(), dq.inputs[1].const_value.numpy()
    shape = [1] * q.ndim
    shape[dq.attributes["axis"].value] = -1
    w = (q.astype(np.float32) * scale.astype(np.float32).reshape(shape)).astype(np.float32)
    name = weight_dq.name.removesuffix("_dq") + "_int8grid" if q.dtype == np.int8 else \
        weight_dq.name.removesuffix("_dq") + "_fp8grid"
    value = _initializer(graph, ir.Value(name=name, const_value=ir.tensor(w, name=name)))
    value.dtype, value.shape = weight_dq.dtype, weight_dq.shape  # what the fusions read (a Conv's kernel size)
    graph.remove(dq, safe=False)
    for v in dq.inputs[:3]:
        if v is not None and not v.uses() and v.name in graph.initializers:
            graph.initializers.pop(v.name)
    return value


def _dequantized_weight(value: ir.Value) -> np.ndarray:
    """DQ(W_q; s, axis) of _quantized_weight, in float64."""
    dq = value.producer()
    q, scale = dq.inputs[0].const_value.numpy(), dq.inputs[1].const_value.numpy()
    shape = [1] * q.ndim
    shape[dq.attributes["axis"].value] = -1
    return q.astype(np.float64) * scale.astype(np.float64).reshape(shape)


def _correct_bias(graph: ir.Graph, t: Target, weight_dq: ir.Value, mean: np.ndarray) -> None:
    """bias -= Σ (W_q - W)·E[x] per output channel (insert's docstring); a Conv/Gemm without a bias gets one."""
    w = t.weight.const_value.numpy().astype(np.float64)
    delta = _dequantized_weight(weight_dq) - w
    if t.node.op_type == "Conv":  # [O, C/g, *k]; group gi's outputs read input channels gi·C/g ...
        groups = t.node.attributes["group"].value if "group" in t.node.attributes else 1
        per_group = delta.shape[1]
        if mean.size != groups * per_group:
            return
        m = mean.reshape(groups, 1, per_group)  # [g, 1, C/g]
        d = delta.sum(axis=tuple(range(2, delta.ndim))).reshape(groups, -1, per_group)  # [g, O/g, C/g]
        shift = (d * m).sum(-1).reshape(-1)  # [O]
        bias_index = 2
    elif t.node.op_type == "Gemm":
        d = delta.T if t.channel_axis == 0 else delta  # [K, N]
        if mean.size != d.shape[0]:
            return
        shift = mean @ d
        bias_index = 2
    else:  # MatMul: no bias input to adjust
        return
    has_bias = len(t.node.inputs) > bias_index and t.node.inputs[bias_index] is not None
    if has_bias:
        old = t.node.inputs[bias_index].const_value
        if old is None or old.numpy().size != shift.size:
            return
        bias = old.numpy().astype(np.float64).reshape(-1)
    else:
        bias = np.zeros(shift.size)
    name = f"{t.node.name or t.weight.name}_bias_corrected"
    value = _initializer(graph, ir.Value(name=name, const_value=ir.tensor((bias - shift).astype(np.float32),
                                                                          name=name)))
    if has_bias:
        t.node.replace_input_with(bias_index, value)
    elif t.node.op_type == "Conv" or len(t.node.inputs) == bias_index:
        t.node.resize_inputs(bias_index + 1)
        t.node.replace_input_with(bias_index, value)
