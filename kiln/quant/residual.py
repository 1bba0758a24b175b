"""Post-activation residual blocks quantized whole: Add -> Relu between quantized layers.

kiln's calibration quantizes the inputs of Conv/Gemm/MatMul (kiln/quant/qdq.py). In a ResNet bottleneck
that leaves the block's last convolution writing float32, the residual Add and its Relu in float32, and a
QuantizeLinear before the next block: on a VNNI CPU the int8 engine ran at 0.81x kiln's fp32 latency
where the same network as onnxruntime's QDQ model (whose Adds are quantized) ran at 0.35x
(bench/results/quant-cpu-speed-2026-12-02.md). Here each such Add gets a Q/DQ pair on both inputs (the
residual input reuses the pair its convolution reader already has), so the optimizer fuses

    Conv -> Q -> DQ ─┐
    x_q ──────── DQ ─┴─ Add -> Relu -> Q     into   QConv (8-bit output) and QAdd (kiln/passes/fusion/qdq_layers.py)

An Add qualifies when both inputs are float activations, a Relu is its only reader, and every reader of
the Relu's output is a layer being quantized (reading it as its activation) or another qualifying Add: the
sum is then rounded to 8 bits for its readers anyway, and quantizing the Add adds one rounding of each
input. The network's last block qualifies too when a global average pool is the Relu's only reader: its
sum gets a Q/DQ pair of its own (calibrated) and the pool averages the 8-bit values, as in onnxruntime's
QDQ ResNet; otherwise the last stage's three Adds stay float (each Add's Relu feeds the next Add) and its
convolutions write float32 (measured on a Zen 4 EPYC, 1 thread: bench/results/quant-cpu-epyc-2026-12-03.md). Adds without a Relu (MobileNetV2's linear bottlenecks, a transformer's residual stream feeding a
LayerNorm) stay float: there the rounding costs accuracy the speed does not buy back.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from kiln.quant import qdq

FLOATS = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


def _activation(value: ir.Value | None) -> bool:
    return value is not None and value.const_value is None and value.dtype in FLOATS


POOLS = ("GlobalAveragePool", "ReduceMean")


def _pool_reader(add: ir.Node) -> ir.Node | None:
    """The global average pool that is the only reader of this Add's Relu, if it is."""
    readers = add.outputs[0].uses()[0][0].outputs[0].uses()
    if len(readers) == 1 and readers[0][0].op_type in POOLS and readers[0][1] == 0:
        return readers[0][0]
    return None


def plan(graph: ir.Graph, exclude: set[str] = frozenset()) -> list[ir.Node]:
    """The Adds to quantize (see the module's docstring), on the float graph, before qdq.insert."""
    layers = {t.node for t in qdq.targets(graph, exclude)}
    outputs = set(graph.outputs)
    candidates = {}
    for node in graph:
        if (node.op_type == "Add" and node.domain in ("", "ai.onnx") and node.name not in exclude
                and len(node.inputs) == 2 and all(_activation(v) for v in node.inputs)):
            users = [u for u, _ in node.outputs[0].uses()]
            if len(users) == 1 and users[0].op_type == "Relu" and node.outputs[0] not in outputs:
                candidates[node] = users[0].outputs[0]
    changed = True
    while changed:
        changed = False
        for node, tail in list(candidates.items()):
            readers = tail.uses()
            fine = tail not in outputs and bool(readers) and (_pool_reader(node) is not None or all(
                (u in layers and index == 0) or u in candidates for u, index in readers))
            if not fine:
                del candidates[node]
                changed = True
    return list(candidates)


def activations(adds: list[ir.Node]) -> set[str]:
    """The tensors whose ranges the calibration must measure for these Adds (and a pooled Relu's output)."""
    pooled = {pool.inputs[0].name for pool in map(_pool_reader, adds) if pool is not None}
    return {v.name for node in adds for v in node.inputs} | pooled


def _existing_pair(value: ir.Value) -> ir.Value | None:
    """The per-tensor DQ(Q(value)) output qdq.insert made for value's quantized readers, if any."""
    for user, index in value.uses():
        if user.op_type != "QuantizeLinear" or index != 0 or user.inputs[1].const_value is None:
            continue
        if user.inputs[1].const_value.numpy().size != 1:
            return None  # per channel (a depthwise reader's): QAdd takes one scale per input
        for reader, _ in user.outputs[0].uses():
            if reader.op_type == "DequantizeLinear":
                return reader.outputs[0]
    return None


def _new_pair(graph: ir.Graph, node: ir.Node, value: ir.Value, amax: float, unsigned: bool) -> ir.Value:
    positive = unsigned and qdq.non_negative(value)
    scale = np.float32(amax / (255.0 if positive else qdq.INT8_MAX))
    base = value.name
    s = qdq._initializer(graph, qdq._scalar(f"{base}_qscale", float(scale)))
    z = qdq._initializer(graph, qdq._zero_point(f"{base}_qzero", "uint8" if positive else "int8"))
    return qdq.quantize_dequantize(graph, node, value, s, z)


def insert(model: ir.Model, adds: list[ir.Node], ranges: dict, unsigned: bool) -> list[str]:
    """Quantize both inputs of each planned Add (after qdq.insert, in place); returns the Adds quantized.
    An Add one of whose inputs has no usable range stays float."""
    graph = model.graph
    done = []
    for node in adds:
        pool = _pool_reader(node)
        values = list(node.inputs) + ([pool.inputs[0]] if pool is not None else [])
        amaxes = [np.asarray(ranges.get(v.name, np.nan), np.float64) for v in values]
        if any(a.ndim != 0 or not np.isfinite(a) or a <= 0 for a in amaxes):
            continue
        for i, (value, amax) in enumerate(zip(list(node.inputs), amaxes)):
            dq = _existing_pair(value) or _new_pair(graph, node, value, float(amax), unsigned)
            node.replace_input_with(i, dq)
        if pool is not None:
            pool.replace_input_with(0, _new_pair(graph, pool, pool.inputs[0], float(amaxes[-1]), unsigned))
        done.append(node.name)
    return done
