"""What each quantizable layer costs on this CPU in each precision the accuracy target can give it: int8, W8A16
(int8 weights, the input at 16 bits: two int8 convolutions on its bytes) and fp32, in ms at the build's shapes.

Why: the accuracy target moves layers up from int8 until the expected agreement is met (kiln/builder/sensitivity.py),
and which layers to move decides the engine's speed more than how many. MobileNetV2's 112x112 layers cost 3-6x its
7x7 ones (bench/results/quantacc4-2026-12-06.md), and W8A16 beats fp32 on the 1x1 layers from 56x56 down while it
loses on the 112x112 and most depthwise ones (bench/w8a16_conv.py). So the search ranks moves by accuracy gained per
millisecond, with these times.

Each is the layer's kernel alone on random inputs of its input's shape, one thread, the thread's CPU time (a
shared machine's waits left out), the fastest of a few calls (a loaded machine only adds time: the minimum moves
least between builds): the same kernels the engine's tactics run (onednn_int8.QConv2d, onednn_int8.W8A16Conv2d with
kiln's one-pass split, the oneDNN float convolution primitive cpu.conv.onednn_direct builds), writing into buffers
made once, as a native segment runs them (torch's eager convolution and a fresh output per call were 10-40% off the
engine's layers, bench/results/quantacc5-2026-12-06.md). A W8A16 or fp32 layer also pays for its output's
quantizing reorder: it writes float32, and an int8 reader needs a boundary step that an int8 layer's requantizing
output does not (oneDNN's int8 depthwise is no faster than its fp32 one, so without it a depthwise layer's move to
fp32 looked free while the engine paid the step and 4x the bytes). A 1x1 layer's W8A16 time is the faster of the split
path and the one-pass GEMM (cpu.qconv.w8a16_gemm, kiln/kernels/cpu/w16gemm.c), as the tuner picks between them in
the engine; the GEMM requantizes in its epilogue, so it pays no boundary step. Without VNNI (an AVX2-only CPU) the
split path is not run (split_refusal): a 1x1 layer's W8A16 time is the GEMM's alone, and any other layer's is its
fp32 time (moved up, it runs weight-only on the fp32 kernel), so the search keeps fp32 where the GEMM is slower. A
layer not a 2-D Conv (a classifier's Gemm) has no W8A16 kernel (weight-only: the fp32 kernel) and is costed alike in
every precision: it is small beside the convolutions, and its moves are ranked by accuracy alone.

Stable plans: the search's choice follows these times, and on a loaded machine they move 10-30% between builds
(bench/results/quantacc4-2026-12-06.md run 2: another plan, 3 points less held out). With a timing cache
(`BuildConfig.timing_cache`, `kiln build --timing-cache`) each layer's times are stored under its shape and the
machine's environment (kiln/builder/timing_cache.py) and read back by a rebuild: the same calibration data and cache
give the same plan.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable

import onnx_ir as ir
import torch

from kiln.builder.timing_cache import TimingCache, environment, signature_key
from kiln.kernels.cpu import onednn, onednn_int8, onednn_primitives, split16, w16gemm
from kiln.kernels.cpu.cpu_features import has_int8_dot_product
from kiln.quant import qdq

PRECISIONS = ("int8", "w8a16", "fp32")
CALLS = 7  # timed calls per kernel (after one warm-up); the fastest
COST_MODEL = 4  # how the times are taken (part of the cache key: times taken another way are not read)
# 4: a 1x1 layer's W8A16 time the faster of the split path and w16gemm's one pass (3: the split path only)


def available() -> str | None:
    """Why no W8A16 layer can run on this CPU (None: some can; `layer_refusal` says which): oneDNN, and either the
    split path (split_refusal) or the one-pass 1x1 GEMM (w16gemm: int16 products, exact without VNNI)."""
    if not onednn.available():
        return "libdnnl.so.3 cannot be loaded"
    if (split := split_refusal()) is None or w16gemm.available():
        return None
    return f"{split}; kiln's w16gemm kernel: {w16gemm.reason()}"


def split_refusal() -> str | None:
    """Why the split path (the input's two bytes through two int8 convolutions, any geometry) cannot run W8A16 layers
    on this CPU (None: it can): it needs VNNI (without it the two bytes' int8 kernels saturate on full-range weights)
    and kiln's split kernel. Without it only the 1x1 layers w16gemm runs are W8A16 (an AVX2-only CPU)."""
    if not has_int8_dot_product():
        return "no VNNI on this CPU (int8 kernels with full 8-bit weights would saturate)"
    if not split16.available():
        return f"kiln's split16 kernel: {split16.reason()}"
    return None


def layer_refusal(node: ir.Node) -> str | None:
    """Why the Conv `node` cannot be a W8A16 layer on this CPU (None: it can): every 2-D convolution where the split
    path runs, else the 1x1 ones of w16gemm.pointwise_refusal."""
    if (why := available()) is not None:
        return why
    if (split := split_refusal()) is None:
        return None
    w = node.inputs[1].const_value if len(node.inputs) > 1 and node.inputs[1] is not None else None
    if node.op_type != "Conv" or w is None or len(w.shape) != 4:
        return f"not a 2-D convolution of a constant weight (this CPU's W8A16 is w16gemm's 1x1 GEMM: {split})"
    refusal = w16gemm.pointwise_refusal(tuple(int(d) for d in w.shape[2:]), list(_attr(node, "strides", [1, 1])),
                                        list(_attr(node, "pads", [0, 0, 0, 0])),
                                        list(_attr(node, "dilations", [1, 1])), int(_attr(node, "group", 1)))
    return None if refusal is None else f"W8A16 on this CPU is {refusal} ({split})"


def _fastest_ms(fn: Callable[[], object]) -> float:
    fn()
    samples = []
    for _ in range(CALLS):
        start = time.thread_time()
        fn()
        samples.append((time.thread_time() - start) * 1e3)
    return float(min(samples))


def _attr(node: ir.Node, name: str, default):
    a = node.attributes.get(name)
    return default if a is None else a.value


def conv_geometry(target: qdq.Target) -> dict | None:
    """What one Conv target's times depend on (its input size, weight shape, strides, pads, dilations, groups), None
    where it is not a 2-D convolution of a static input shape."""
    node, shape = target.node, target.activation.shape
    w = target.weight.const_value
    if node.op_type != "Conv" or w is None or len(w.shape) != 4 or shape is None or len(shape) != 4 \
            or not all(isinstance(d, int) for d in shape) or _attr(node, "auto_pad", "NOTSET") not in ("NOTSET", ""):
        return None
    return {"input": [int(d) for d in shape], "weight": [int(d) for d in w.shape],
            "strides": [int(s) for s in _attr(node, "strides", [1, 1])],
            "pads": [int(p) for p in _attr(node, "pads", [0, 0, 0, 0])],
            "dilations": [int(d) for d in _attr(node, "dilations", [1, 1])], "groups": int(_attr(node, "group", 1))}


def conv_costs(geometry: dict) -> dict[str, float]:
    """{precision: ms} of a convolution of `geometry` (conv_geometry's), its kernels on random data."""
    size, groups, stride = geometry["input"], geometry["groups"], geometry["strides"]
    pads, dilation, shape = geometry["pads"], geometry["dilations"], tuple(geometry["weight"])
    generator = torch.Generator().manual_seed(zlib.crc32(repr(sorted(geometry.items())).encode()))
    x = torch.rand(size, generator=generator).contiguous(memory_format=torch.channels_last)  # [N, C, H, W] in [0, 1)
    w_q = torch.randint(-127, 128, shape, generator=generator, dtype=torch.int8)
    wf = (w_q.float() * 0.01).contiguous(memory_format=torch.channels_last)
    w_scale = torch.full((shape[0],), 0.01)
    int8 = onednn_int8.QConv2d(w_q, w_scale, None, size, stride, pads, dilation, groups, torch.uint8, 1 / 255, 0, None)
    x8 = torch.randint(0, 256, size, generator=generator, dtype=torch.uint8)
    x8 = x8.contiguous(memory_format=torch.channels_last)
    fp32 = onednn_primitives.Conv2d(wf, None, size, stride, pads, dilation, groups, None, False, False)
    out8 = torch.empty(int8.output_size, dtype=torch.float32).contiguous(memory_format=torch.channels_last)
    # a layer off int8 writes float32, which its int8 reader needs quantized: a boundary step of its own in the engine
    requantize = onednn_int8.ScaledReorder(list(int8.output_size), torch.float32, torch.uint8, 0.05, 0, True)
    out = torch.empty(int8.output_size, dtype=torch.float32).contiguous(memory_format=torch.channels_last)
    with torch.inference_mode():
        boundary = _fastest_ms(lambda: requantize(out))
        costs = {"int8": _fastest_ms(lambda: int8(x8, out8)), "fp32": _fastest_ms(lambda: fp32(x)) + boundary}
        gemm = _pointwise(geometry, w_q, w_scale)
        if split_refusal() is None:
            # as a native segment runs them: the outputs and the bytes in buffers of their own, not allocated per call
            wide = onednn_int8.W8A16Conv2d(w_q, w_scale, None, size, stride, pads, dilation, groups, 1 / 65535, False)
            hi, lo = split16.split(x, 1 / 65535, 0, torch.uint16)

            def w8a16() -> None:
                split16.split(x, 1 / 65535, 0, torch.uint16, (hi, lo))
                wide.lo(lo, out=wide.hi(hi, out))

            costs["w8a16"] = _fastest_ms(w8a16) + boundary
        else:  # no VNNI: the 1x1 GEMM alone; any other layer moved up runs weight-only, on the fp32 kernel
            costs["w8a16"] = costs["fp32"]
        if gemm is not None:  # the tuner's other W8A16 tactic (without VNNI the only one): the engine runs the faster
            alone = split_refusal() is not None
            costs["w8a16"] = _fastest_ms(gemm) if alone else min(costs["w8a16"], _fastest_ms(gemm))
        return {p: costs[p] for p in PRECISIONS}


def _pointwise(geometry: dict, w_q: torch.Tensor, w_scale: torch.Tensor) -> Callable[[], object] | None:
    """A call of the one-pass W8A16 GEMM on random data of the layer's input, writing uint8 (its epilogue's requantize:
    no boundary step), or None where the layer is not a 1x1 convolution it runs or the kernel is not built."""
    if w16gemm.pointwise_refusal(tuple(geometry["weight"][2:]), geometry["strides"], geometry["pads"],
                                 geometry["dilations"], geometry["groups"]) is not None or not w16gemm.available():
        return None
    size = geometry["input"]
    generator = torch.Generator().manual_seed(zlib.crc32(repr(("gemm", sorted(geometry.items()))).encode()))
    x = torch.rand(size, generator=generator).contiguous(memory_format=torch.channels_last)
    layer = w16gemm.W16Gemm(w_q, w_scale, None, size, 1 / 65535, torch.uint16, y=(torch.uint8, 0.05, 0),
                            activation="Clip", beta=6.0)
    out = torch.empty(layer.output_size, dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
    return lambda: layer(x, out)


def layer_costs(model: ir.Model, layers: list[str], say: Callable[[str], None],
                cache: TimingCache | None = None) -> dict[str, dict[str, float]]:
    """{layer: {precision: ms}} for `layers` (target names) at the model's shapes, one thread. cache: each
    convolution's times read from it where it holds them for this shape and machine, else measured and put there
    (the caller saves it)."""
    by_name = {t.node.name: t for t in qdq.targets(model.graph)}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    measured = reused = 0
    try:
        env = environment(torch.device("cpu"))  # threads 1: what these times are
        costs = {}
        for name in layers:
            geometry = conv_geometry(by_name[name]) if name in by_name else None
            if geometry is None:
                costs[name] = dict.fromkeys(PRECISIONS, 0.0)
                continue
            key = signature_key({"kind": "layer cost", "model": COST_MODEL, "op": "ai.onnx::Conv", **geometry,
                                 "precisions": PRECISIONS, "environment": env})
            entry = cache.get(key) if cache is not None else None
            if entry is not None and set(entry.get("times_ms", {})) == set(PRECISIONS):
                costs[name] = {p: float(entry["times_ms"][p]) for p in PRECISIONS}
                reused += 1
                continue
            costs[name] = conv_costs(geometry)
            measured += 1
            if cache is not None:
                cache.put(key, {"layer_cost": True, "times_ms": costs[name]})
    finally:
        torch.set_num_threads(threads)
    total = {p: sum(c[p] for c in costs.values()) for p in PRECISIONS}
    say("layer costs (ms, 1 thread): " + ", ".join(f"every layer {p} {total[p]:.2f}" for p in PRECISIONS)
        + (f"; {reused} layer(s) from the timing cache, {measured} measured" if cache is not None else ""))
    return costs
