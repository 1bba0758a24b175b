"""CPU convolution tactic on oneDNN's C API: primitives built once at load, NHWC activations.

    cpu.conv.onednn_direct   kiln::FusedConv as one oneDNN convolution primitive (bias, activation,
                             residual and final activation as post-ops), created and JIT-compiled when the engine
                             loads, weight reordered into the kernel's blocked layout then
    cpu.conv.onednn_silu     the same for a SiLU convolution without a residual, but the SiLU run by kiln's loop over
                             the output (kiln/kernels/cpu/conv_silu.py) instead of oneDNN's swish post-op: on AVX2
                             the post-op costs up to twice the loop; the autotuner picks per layer
    cpu.pool.onednn.<op>     MaxPool / AveragePool (ceil_mode 0 for an average, one output) as a oneDNN pooling
                             primitive on NHWC (torch's channels-last max_pool2d: ~3x slower)
    cpu.gap.onednn.<op>      GlobalAveragePool, and ReduceMean over H and W of a 4-D tensor (what
                             the dynamo exporter emits for it), as a whole-image average pooling

Why not torch's oneDNN entry points (kiln/tactics/cpu/torch_mkl.py): they build the primitive descriptor
on every call, 30-50 µs per convolution whatever its size; MobileNetV2's 52 convolutions then
spend more time in set-up than in arithmetic. Here a call costs ~1-2 µs of Python and ctypes
around `dnnl_primitive_execute` (kiln/kernels/cpu/onednn.py).

Layout: the activations stay NHWC, torch's channels_last. oneDNN's brgemm convolutions on
AVX-512 (and its depthwise kernel) run NHWC natively and, measured per layer here, as fast as
with the blocked nChw16c layout `format_tag any` would pick — so a blocked layout would buy
nothing and cost conversions, since every op between convolutions (MaxPool, Add, GlobalAveragePool)
is a torch op that must see an ordinary tensor. channels_last is an ordinary tensor to torch:
the tactic declares layout "channels_last", the autotuner times it on NHWC inputs, and a conv
stack converts once at its boundary, exactly as for the other NHWC tactics.

The residual: when the runtime says the residual's value dies at this layer (StepSpec.tactic_config
"dying_inputs", set by kiln/runtime/program.py at load) and, at run time, no other slot, view or
argument holds it, the convolution accumulates into the residual's memory (a sum post-op) instead
of reading it as a third stream (binary post-op): ~1 ms of ResNet-50's 16 residual convolutions.

Outputs are views of a few pooled buffers (kiln/kernels/cpu/onednn_primitives.py, _Arena), reused as soon as
no tensor references them, the most recently used first: the next layer's output lands in memory
that is still in cache, as in onnxruntime's arena (MobileNetV2 ~5% faster than on fresh allocations).

The tactics are optional: `available()` is false when libdnnl.so.3 (the `onednn-cpu-gomp` wheel)
cannot be loaded, or when it would bring its own OpenMP runtime next to torch's; an engine that
names them then runs the ops' registered implementations.
A primitive is built for the input size the layer was tuned at (tactic_config["input_size"]);
another input size builds and caches one more primitive on first sight, except inside a native segment at another
batch of the same images: there the tuned primitive runs over the batch in chunks (kiln/kernels/cpu/onednn_chunks.py),
so a segment's view at a new batch makes no primitive (only a one-image one per layer, once, for a remainder).
The linear layers' tactic (cpu.gemm.onednn_direct) is onednn_gemm.py's.
"""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

from kiln.kernels.cpu import conv_silu, onednn, onednn_ahead, onednn_chunks, onednn_primitives, se
from kiln.ops._util import ints
from kiln.ops.nn import _pool_geometry
from kiln.ops.registry import OpContext, lookup
from kiln.plan.spec import StepSpec
from kiln.tactics.registry import register
from kiln.tactics.tactic import (InputMeta, NativeStep, PlanRule, SizedPlan, Tactic, built_at, conv_geometry,
                                 conv_operands_refusal, resizable, same_primitive)
from kiln.tactics.tactic import attribute as _attr

_CL = torch.channels_last
_CACHED_SHAPES = 8  # primitives kept per layer for input sizes other than the tuned one


def _built(primitives: dict, key, build, tuned: Callable[[Any], bool]):
    """primitives[key], built (build(key)) on first use; past _CACHED_SHAPES, the oldest one that is
    not for the tuned size (tuned(key)) makes room (tactic.built_at)."""
    return built_at(primitives, key, build, tuned, _CACHED_SHAPES)


def _in_chunks(size: tuple[int, ...], tuned: tuple[int, ...]) -> bool:
    """Whether a segment runs this layer at `size` as chunks of its tuned primitive (onednn_chunks.py): another
    batch of images of the tuned size, unless an exact bind of that batch asks for its own primitive
    (onednn_chunks.exact_batches)."""
    return (len(size) == 4 and size[0] != tuned[0] and size[0] > 0 and tuple(size[1:]) == tuple(tuned[1:])
            and onednn_chunks.available() and not onednn_chunks.exact())


_DEPTHWISE_KERNEL = "jit_dw:"  # any ISA's


def _eltwise(step: StepSpec, prefix: str = "") -> onednn.Eltwise | None | str:
    """The epilogue's activation (prefix "") or its final_activation ("final_") as a oneDNN post-op."""
    return onednn.eltwise_for(_attr(step, f"{prefix}activation", ""), _attr(step, f"{prefix}alpha", 0.0),
                              _attr(step, f"{prefix}beta", 0.0))


def _supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    if not onednn.available():
        return "libdnnl.so.3 cannot be loaded"
    x = inputs[0]
    w = inputs[1] if len(inputs) > 1 else None
    b = inputs[2] if len(inputs) > 2 else None
    residual = inputs[3] if len(inputs) > 3 else None
    if x.shape is None or len(x.shape) != 4:
        return "only 2-D convolutions (4-D input)"
    if w is None or not w.constant or w.shape is None or len(w.shape) != 4:
        return "the weight is not a constant 4-D tensor of the engine"
    if w.dtype != torch.float32:
        return f"weight dtype {w.dtype}, only float32"
    if b is not None and b.shape is not None and (not b.constant or b.dtype != torch.float32):
        return "the bias is not a float32 constant of the engine"
    if (refusal := conv_operands_refusal(step, x, w)) is not None:
        return refusal
    for eltwise in (_eltwise(step), _eltwise(step, "final_")):
        if isinstance(eltwise, str):
            return eltwise
    if residual is not None and residual.shape is not None:
        pads, strides, dilations = conv_geometry(step, w.shape)
        out = [x.shape[0], w.shape[0]] + [
            (x.shape[2 + i] + pads[i] + pads[2 + i] - dilations[i] * (w.shape[2 + i] - 1) - 1) // strides[i] + 1
            for i in range(2)]
        if list(residual.shape) != out:
            return f"residual shape {list(residual.shape)} is broadcast to the output {out}"
        if residual.dtype != torch.float32:
            return f"residual dtype {residual.dtype}, only float32"
    return True


def _configure(step: StepSpec, inputs: list[InputMeta]) -> dict[str, Any]:
    residual = inputs[3] if len(inputs) > 3 else None
    return {"input_size": list(inputs[0].shape), "residual": residual is not None and residual.shape is not None}


def _prepare(step: StepSpec, constants: list[Any], device: torch.device, kiln_silu: bool = False):
    """`kiln_silu`: the SiLU runs as se.c's loop after the convolution (conv_silu.ConvSiLU), not as oneDNN's
    swish post-op."""
    w = constants[1]
    b = constants[2] if len(constants) > 2 else None
    pads, strides, dilations = conv_geometry(step, tuple(w.shape))
    groups = int(_attr(step, "group", 1))
    eltwise = None if kiln_silu else _eltwise(step)
    after = bool(_attr(step, "residual_after_activation", 0))
    with_residual = bool(step.tactic_config.get("residual"))
    # The residual's value dies here (the runtime says so, kiln/runtime/program.py): the result may
    # be accumulated over it (a "sum" post-op), which saves reading it as a separate stream; in
    # ResNet-50 that is ~1 ms of its 16 residual convolutions.
    in_place = with_residual and 3 in step.tactic_config.get("dying_inputs", ())

    # Depthwise: oneDNN 3.2 picks its brgemm kernel first; its older direct kernel, at whatever ISA, ran MobileNetV2's
    # 17 depthwise layers 2-3% faster (whole engine, interleaved A/B, two runs) and EfficientNet-B0's 7 shapes 5-35%
    # faster on a Zen 4 core with AVX-512 and under the AVX2 cap (bench/results/zoo-cpu-2026-12-03b.md).
    depthwise = groups > 1 and groups == w.shape[0] and w.shape[1] == 1
    prefer = _DEPTHWISE_KERNEL if depthwise else None

    def build(input_size: tuple[int, ...], accumulate: bool, weight_of: onednn_primitives.Conv2d | None = None):
        conv = onednn_primitives.Conv2d(w, b, list(input_size), strides, pads, dilations, groups, eltwise, with_residual,
                                        after, residual_in_place=accumulate, share_weight_with=weight_of, prefer=prefer,
                                        final=_eltwise(step, "final_"))
        return conv_silu.ConvSiLU(conv) if kiln_silu else conv

    tuned = tuple(step.tactic_config["input_size"])
    primitives = {(tuned, in_place): build(tuned, in_place)}  # at load: the tuned size's primitive and weight
    # One primitive's memory objects are rebound on every call: calls from two threads into the
    # same layer (two ExecutionContexts of one engine) must not interleave.
    lock = threading.Lock()
    # What a dying residual's reference count is when only the runtime's slot holds it (measured by
    # the runtime through its own loop, kiln/runtime/program.py: sole_reference_counts).
    sole = step.tactic_config.get("sole_references") or {}

    made = threading.Lock()  # the dict's users: a run's thread and kiln/kernels/cpu/onednn_ahead.py's (ahead below)

    def primitive(shape: tuple[int, ...], accumulate: bool) -> onednn_primitives.Conv2d:
        # another input size, or the binary variant a shared residual needs: built once
        # its weight: the other variant's at this size, else the tuned primitive's, where the kernel lays it out
        # alike (Conv2d compares the layouts): a segment's runs of the tuned batch and its one-image view then read
        # one copy (all 17 of resnet_tiny's share it: bench/results/image-batches-2026-12-06.md)
        with made:
            return _built(primitives, (shape, accumulate),
                          lambda key: build(shape, accumulate, _conv(primitives.get((shape, not accumulate))
                                                                     or primitives.get((tuned, accumulate))
                                                                     or primitives.get((tuned, not accumulate)))),
                          lambda key: key[0] == tuned)

    def launch(ctx, x, w_=None, b_=None, residual=None, **_attributes):
        x = x.contiguous(memory_format=_CL)  # x: [N, C, H, W]; free when already channels-last
        if not with_residual:
            with lock:
                return primitive(tuple(x.shape), False)(x)  # [N, O, H', W'] channels-last
        # Over the residual only when nothing else can read it: its name dies here (in_place), no
        # other slot holds the same tensor (reference count) and no view shares its memory (storage
        # users: this tensor alone), and it is not the input being read.
        limit = sole.get("keywords" if _attributes else "plain")
        overwrite = (in_place and limit is not None and residual is not x and sys.getrefcount(residual) <= limit
                     and onednn_primitives.storage_users(residual) <= 1
                     and residual.is_contiguous(memory_format=_CL) and residual.dtype == torch.float32)
        with lock:
            if overwrite:
                return primitive(tuple(x.shape), True).accumulate(x, residual)
            return primitive(tuple(x.shape), False)(x, residual.contiguous(memory_format=_CL))

    one = (1, *tuned[1:])

    def chunks(size: tuple[int, ...], accumulate: bool) -> onednn_chunks.BatchChunks:
        # a new batch: the tuned primitive in runs of its batch, the one-image one for what is left
        return onednn_chunks.BatchChunks(primitive(tuned, accumulate),
                                         primitive(one, accumulate) if size[0] % tuned[0] else None, size[0])

    @resizable

    def native_at(size: tuple[int, ...]) -> NativeStep:
        residual_input = 3 if with_residual else None
        if not kiln_silu and _in_chunks(size, tuned):
            out = (size[0], *primitive(tuned, in_place).output_size[1:])
            return NativeStep(size, out, lambda accumulate: chunks(size, accumulate), residual_input=residual_input,
                              accumulate=in_place)
        return NativeStep(size, primitive(size, in_place).output_size, lambda accumulate: primitive(size, accumulate),
                          residual_input=residual_input, accumulate=in_place)

    launch.native = native_at(tuned)
    launch.ahead = _one_image_ahead(tuned, lambda: primitive(one, in_place) if not kiln_silu else None)
    return launch


def _one_image_ahead(tuned: tuple[int, ...], make: Callable[[], Any]) -> Callable[[float], list[onednn_ahead.Job]]:
    """The layer's `ahead` (kiln/runtime/first_calls.py primitives_ahead): its one-image primitive (`make`), made on
    kiln/kernels/cpu/onednn_ahead.py's background thread where a profile reaches other batches than the tuned one
    (`scale` > 1): a segment's images past its runs of the tuned batch run on it (native.py _run_left), so the first
    odd batch finds it made instead of waiting ~0.5-1 ms a layer."""
    def ahead(scale: float) -> list[onednn_ahead.Job]:
        if scale <= 1 or len(tuned) != 4 or tuned[0] == 1 or not onednn_chunks.available():
            return []

        def job() -> bool:
            return make() is not None
        return [onednn_ahead.Job(("one-image primitive", id(make), tuned), 1, job)]
    return ahead


register(Tactic(
    name="cpu.conv.onednn_direct", op_type="FusedConv", domain="kiln", device="cpu", dtypes=(torch.float32,),
    supports=_supports, configure=_configure, prepare=_prepare, layout="channels_last",
    available=onednn.available, native=True,
    description="oneDNN C API convolution primitive built at load, epilogue as post-ops, NHWC activations",
))


def _conv(built: onednn_primitives.Conv2d | conv_silu.ConvSiLU | None) -> onednn_primitives.Conv2d | None:
    return built.conv if isinstance(built, conv_silu.ConvSiLU) else built


def _supports_kiln_silu(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    if _attr(step, "activation", "") != "SiLU":
        return f"activation {_attr(step, 'activation', '')!r}: this tactic applies SiLU only"
    if len(inputs) > 3 and inputs[3].shape is not None:
        return "a residual: kiln's SiLU follows the convolution, not its residual add"
    if _attr(step, "final_activation", ""):
        return "a final activation: kiln's SiLU is the last thing this tactic applies"
    if not se.available():
        return f"kiln's SiLU kernel is not built: {se.reason()}"
    return _supports(step, inputs)


register(Tactic(
    name="cpu.conv.onednn_silu", op_type="FusedConv", domain="kiln", device="cpu", dtypes=(torch.float32,),
    supports=_supports_kiln_silu, configure=_configure,
    prepare=lambda step, constants, device: _prepare(step, constants, device, kiln_silu=True),
    layout="channels_last", available=onednn.available, native=True,
    description="cpu.conv.onednn_direct without its swish post-op, SiLU by kiln's loop over the output (se.c): "
                "on AVX2 half the post-op's cost",
))


# ---- pooling -----------------------------------------------------------------------------------

def _pool_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    if not onednn.available():
        return "libdnnl.so.3 cannot be loaded"
    x = inputs[0]
    if x.shape is None or len(x.shape) != 4:
        return "only 2-D pooling (4-D input)"
    if len(step.outputs) > 1 and step.outputs[1]:
        return "the Indices output is asked for"
    if int(_attr(step, "ceil_mode", 0)) and step.op_type != "MaxPool":
        return "ceil_mode=1 on an average (its tail would count in the divisor)"
    if int(_attr(step, "storage_order", 0)):
        return "storage_order=1"
    auto_pad = _attr(step, "auto_pad", "NOTSET")
    if auto_pad not in ("NOTSET", "", "VALID"):
        return f"auto_pad={auto_pad} (pads depend on the input size)"
    kernel = list(_attr(step, "kernel_shape", []))
    if len(kernel) != 2:
        return f"kernel_shape {kernel} is not 2-D"
    pads = [0, 0, 0, 0] if auto_pad == "VALID" else list(_attr(step, "pads", [0, 0, 0, 0]))
    if any(p >= k for p, k in zip(pads, kernel + kernel)):
        return f"pads {pads} as large as the window {kernel}: a window could see only padding"
    return True


def _pool_kind(step: StepSpec) -> str:
    if step.op_type == "MaxPool":
        return "max"
    return "avg_include_padding" if int(_attr(step, "count_include_pad", 0)) else "avg_exclude_padding"


def _prepare_pool(step: StepSpec, constants: list[Any], device: torch.device):
    kernel = [int(k) for k in _attr(step, "kernel_shape", [])]
    pads = [0, 0, 0, 0] if _attr(step, "auto_pad", "NOTSET") == "VALID" else \
        [int(p) for p in _attr(step, "pads", [0, 0, 0, 0])]
    strides = [int(s) for s in _attr(step, "strides", [1, 1])]
    dilations = [int(d) for d in _attr(step, "dilations", [1, 1])]
    kind = _pool_kind(step)
    ceil_mode = int(_attr(step, "ceil_mode", 0))

    def pool(size: tuple[int, ...]) -> onednn_primitives.Pool2d:
        # the reference's geometry (kiln/ops/nn.py _pool_geometry). ceil_mode's tail (SqueezeNet's and GoogLeNet's
        # max pools; a last window starts inside the input) is more end padding, which a max never reads; without
        # ceil_mode the tail is 0
        _, begin, end, tail, _, _ = _pool_geometry(torch.empty(size, device="meta"), kernel, "NOTSET", ceil_mode,
                                                   dilations, pads, strides)
        return onednn_primitives.Pool2d(list(size), kind, kernel, strides, begin + [e + t for e, t in zip(end, tail)],
                                        dilations)

    return _shape_cached(step, pool)


def _gap_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    if not onednn.available():
        return "libdnnl.so.3 cannot be loaded"
    x = inputs[0]
    if x.shape is None or len(x.shape) != 4:
        return "only 4-D inputs"
    if step.op_type == "ReduceMean":
        if "axes" in step.attributes and step.attributes["axes"] is not None:
            if sorted(a % 4 for a in step.attributes["axes"]) != [2, 3]:
                return f"axes {step.attributes['axes']} are not the spatial axes"
        elif len(inputs) < 2 or inputs[1].shape is None or not inputs[1].constant:
            return "the axes are not a constant of the engine"  # their values are checked in prepare
    return True


def _prepare_gap(step: StepSpec, constants: list[Any], device: torch.device):
    if step.op_type == "ReduceMean" and not ("axes" in step.attributes and step.attributes["axes"] is not None):
        axes = constants[1]
        if axes is None or sorted(int(a) % 4 for a in axes.tolist()) != [2, 3]:
            raise ValueError(f"ReduceMean axes {None if axes is None else axes.tolist()} are not the spatial axes")
    # keepdims=0 (a classifier head's mean straight into its Gemm): [N, C] is the bytes of the NHWC [N, C, 1, 1]
    squeezed = step.op_type == "ReduceMean" and not int(_attr(step, "keepdims", 1))
    return _shape_cached(step, lambda size: onednn_primitives.Pool2d(list(size), "avg_exclude_padding", list(size[2:]),
                                                          [1, 1], [0, 0, 0, 0], [1, 1]), squeezed)


def _shape_cached(step: StepSpec, build, squeezed: bool = False):
    """launch(ctx, x, ...) running `build(x.shape)`'s primitive, built once per input shape
    (the tuned one at load); a lock keeps two threads off one primitive's memory objects.
    squeezed: the output [N, C, 1, 1] handed out as [N, C] (the same bytes)."""
    tuned = tuple(step.tactic_config["input_size"])
    primitives = {tuned: build(tuned)}
    lock = threading.Lock()

    def launch(ctx, x, *_inputs, **_attributes):
        x = x.contiguous(memory_format=_CL)  # [N, C, H, W]; free when already channels-last
        with made:
            primitive = _built(primitives, tuple(x.shape), build, lambda key: key == tuned)
        with lock:
            y = primitive(x)  # [N, C, H', W'] channels-last
        return y.reshape(y.shape[:2]) if squeezed else y

    one = (1, *tuned[1:])

    made = threading.Lock()  # the dict's users: a run's thread and kiln/kernels/cpu/onednn_ahead.py's

    def one_image() -> Any:
        with made:
            return _built(primitives, one, build, lambda key: key == tuned)

    def chunks(size: tuple[int, ...]) -> onednn_chunks.BatchChunks:
        # a new batch: the tuned primitive in runs of its batch (onednn_chunks.py), the one-image one for the rest
        return onednn_chunks.BatchChunks(primitives[tuned], one_image() if size[0] % tuned[0] else None, size[0])

    @resizable

    def native_at(size: tuple[int, ...]) -> NativeStep:
        if _in_chunks(size, tuned):
            out = (size[0], *primitives[tuned].output_size[1:])
            return NativeStep(size, out[:2] if squeezed else out, lambda _accumulate: chunks(size))
        with made:
            primitive = _built(primitives, size, build, lambda key: key == tuned)
        out = tuple(primitive.output_size)
        return NativeStep(size, out[:2] if squeezed else out, same_primitive(primitive))

    launch.native = native_at(tuned)
    launch.ahead = _one_image_ahead(tuned, one_image)
    return launch


def _input_size(step: StepSpec, inputs: list[InputMeta]) -> dict[str, Any]:
    return {"input_size": list(inputs[0].shape)}


for _op in ("MaxPool", "AveragePool"):
    register(Tactic(
        name=f"cpu.pool.onednn.{_op}", op_type=_op, domain="", device="cpu", dtypes=(torch.float32,),
        supports=_pool_supports, configure=_input_size, prepare=_prepare_pool, layout="channels_last",
        available=onednn.available, native=True, description=f"{_op} as a oneDNN pooling primitive built at load, NHWC",
    ))
for _op in ("GlobalAveragePool", "ReduceMean"):
    register(Tactic(
        name=f"cpu.gap.onednn.{_op}", op_type=_op, domain="", device="cpu", dtypes=(torch.float32,),
        supports=_gap_supports, configure=_input_size, prepare=_prepare_gap, layout="channels_last",
        available=onednn.available, native=True,
        description=f"{_op} over H, W as a oneDNN whole-image average pooling built at load, NHWC",
    ))


# ---- reshapes that move no byte ----------------------------------------------------------------

def _alias_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    x = inputs[0]
    if x.shape is None or x.dtype != torch.float32:
        return "the input's shape is not known, or it is not float32"
    if not keeps_order(tuple(x.shape)):
        return "a 4-D input is channels-last in a segment: only [N, C, 1, 1] or [N, 1, H, W] keep their order"
    if step.op_type == "Reshape" and (len(inputs) < 2 or not inputs[1].constant):
        return "the target shape is not a constant of the engine"
    return True


def _prepare_alias(step: StepSpec, constants: list[Any], device: torch.device):
    op = lookup(step.op_type, step.domain).fn
    size = tuple(step.tactic_config["input_size"])
    ctx = OpContext(name=step.name, op_type=step.op_type, domain=step.domain, opset=step.opset,
                    num_inputs=len(step.inputs), num_outputs=1)
    attributes = {k: v for k, v in step.attributes.items()}

    def op_size(in_size: tuple[int, ...]) -> tuple[int, ...]:
        """The op's own output size (run on a meta tensor)."""
        return tuple(op(ctx, torch.empty(in_size, device="meta"), *constants[1:], **attributes).shape)

    rule = _alias_rule(step, op_size, constants, attributes, size)

    @resizable
    def native_at(in_size: tuple[int, ...]) -> NativeStep:
        out = op_size(in_size)
        if not keeps_order(out):  # rows seen as a 4-D value would be read and handed out as NHWC
            raise ValueError(f"{step.name}: a 4-D output {list(out)} is channels-last in a segment")
        return NativeStep(in_size, out, None, alias=True, plan_at=rule)

    def launch(ctx, x, *inputs, **attrs):
        return op(ctx, x, *inputs, **attrs)

    try:
        launch.native = native_at(size)
    except ValueError:  # [B, S, C] -> [B, H, W, C] (Swin's token grid): a view outside segments
        pass
    return launch


def _alias_rule(step: StepSpec, op_size: Callable[[tuple[int, ...]], tuple[int, ...]], constants: list[Any],
                attributes: dict[str, Any], size: tuple[int, ...]) -> PlanRule | None:
    """The alias's output size at other input sizes as arithmetic on them (NativeStep.plan_at: a SizedPlan with no
    fields, the alias has no plan), or None where it does not give the op's own (`op_size`) at the tuned `size`.
    A native segment's view evaluates a member without a rule by making its NativeStep (the op run on a meta
    tensor), and a walk with such a member is never traced (kiln/runtime/view_trace.py): bert_tiny's key-mask
    Reshape kept its every view on the walk. Traceable: comparisons and products of the sizes only, so a view's
    traced walk follows it."""
    if step.op_type == "Flatten":
        axis = int(attributes.get("axis", 1))

        def out_size(in_size: tuple) -> tuple:
            at = axis + len(in_size) if axis < 0 else axis
            if not 0 <= at <= len(in_size):
                raise ValueError(f"{step.name}: Flatten's axis {axis} on a rank-{len(in_size)} input")
            return math.prod(in_size[:at]), math.prod(in_size[at:])
        key: tuple = ("alias", "Flatten", axis)
    else:
        if len(constants) > 1 and constants[1] is not None:
            target = ints(constants[1])
        else:
            target = [int(d) for d in attributes.get("shape") or []]
        allowzero = int(attributes.get("allowzero", 0))
        if target.count(-1) > 1 or any(d < -1 for d in target):
            return None

        def out_size(in_size: tuple) -> tuple:
            if not allowzero and len(target) > len(in_size) and 0 in target[len(in_size):]:
                raise ValueError(f"{step.name}: a 0 past the input's rank")
            out = [in_size[i] if d == 0 and not allowzero else d for i, d in enumerate(target)]
            total = math.prod(in_size)
            if -1 in target:
                i = target.index(-1)
                known = math.prod(out[:i]) * math.prod(out[i + 1:])
                if known == 0 or total % known != 0:
                    raise ValueError(f"{step.name}: {list(target)} does not divide an input of {total} elements")
                out[i] = total // known
            elif math.prod(out) != total:
                raise ValueError(f"{step.name}: {list(target)} does not hold an input of {total} elements")
            return tuple(out)
        key = ("alias", "Reshape", tuple(target), allowzero)

    def sized(in_size: tuple) -> SizedPlan:
        out = out_size(tuple(in_size))
        if not keeps_order(out):
            raise ValueError(f"{step.name}: a 4-D output is channels-last in a segment")
        return SizedPlan((out,), {})

    try:
        if sized(size).output_sizes != (op_size(size),):
            return None
    except (ValueError, RuntimeError):
        return None
    return PlanRule(sized, key, traceable=True)


def keeps_order(size: tuple[int, ...]) -> bool:
    """Whether a value of this size has the same memory order row-major and as a segment lays it out. The
    [N, 1, H, W] test first: on traced sizes (_alias_rule's rule in a view's traced walk) a [B, 1, 1, S] key mask
    then reads no dim (its 1 is the Reshape's constant), where H·W == 1 would compare S and tie the path to it."""
    return len(size) != 4 or size[1] == 1 or size[2] * size[3] == 1


for _op in ("Reshape", "Flatten"):
    register(Tactic(
        name=f"cpu.alias.{_op}", op_type=_op, domain="", device="cpu", dtypes=(torch.float32,),
        supports=_alias_supports, configure=_input_size, prepare=_prepare_alias, native=True,
        description=f"{_op} as a view: inside a native segment, the next layer reads the same memory",
    ))


# ---- Winograd F(2x2, 3x3) ----------------------------------------------------------------------

def _winograd_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    from kiln.kernels.cpu import winograd

    base = _supports(step, inputs)
    if base is not True:
        return base
    if not winograd.available():
        return "kiln's native code (a C compiler at first use) is not available"
    w = inputs[1]
    pads, strides, dilations = conv_geometry(step, w.shape)
    if list(w.shape[2:]) != [3, 3] or strides != [1, 1] or dilations != [1, 1] or pads != [1, 1, 1, 1]:
        return "only 3x3 convolutions of stride 1, dilation 1 and padding 1"
    if int(_attr(step, "group", 1)) != 1:
        return "grouped convolution"
    if _attr(step, "activation", "") not in winograd.ACTIVATIONS:
        return f"activation {_attr(step, 'activation', '')!r} is not one the output transform applies"
    if _attr(step, "final_activation", ""):
        return "a final activation: the output transform applies one activation"
    size = winograd.transformed_weight_bytes(int(w.shape[1]), int(w.shape[0]))
    if size > winograd.WEIGHT_LIMIT:
        return (f"transformed weights of {size >> 20} MiB: past {winograd.WEIGHT_LIMIT >> 20} MiB streaming them "
                "bounds the layer, not the arithmetic Winograd saves")
    return True


def _prepare_winograd(step: StepSpec, constants: list[Any], device: torch.device):
    from kiln.kernels.cpu import winograd

    w = constants[1]
    b = constants[2] if len(constants) > 2 else None
    activation = _attr(step, "activation", "")
    alpha, beta = float(_attr(step, "alpha", 0.0)), float(_attr(step, "beta", 0.0))
    with_residual = bool(step.tactic_config.get("residual"))
    after = bool(_attr(step, "residual_after_activation", 0))
    tuned = tuple(step.tactic_config["input_size"])

    def build(size):
        return winograd.WinogradConv(w, b, size, activation, alpha, beta, with_residual, after)

    primitives = {tuned: build(tuned)}

    def launch(ctx, x, w_=None, b_=None, residual=None, **_attributes):
        x = x.contiguous(memory_format=_CL)
        conv = _built(primitives, tuple(x.shape), build, lambda key: key == tuned)  # another input size: once
        return conv(x, residual.contiguous(memory_format=_CL) if with_residual else None)

    @resizable

    def native_at(size: tuple[int, ...]) -> NativeStep:
        conv = _built(primitives, size, build, lambda key: key == tuned)
        return NativeStep(size, conv.output_size, same_primitive(conv),
                          residual_input=3 if with_residual else None, scratch_bytes=conv.scratch_bytes)

    launch.native = native_at(tuned)
    return launch


register(Tactic(
    name="cpu.conv.winograd", op_type="FusedConv", domain="kiln", device="cpu", dtypes=(torch.float32,),
    supports=_winograd_supports, configure=_configure, prepare=_prepare_winograd, layout="channels_last",
    available=onednn.available, native=True,
    description="Winograd F(2x2,3x3): C transforms around oneDNN's batched matmul, epilogue in the output transform",
))
