"""CUDA tactics on cuDNN's graph API (nvidia-cudnn-frontend): a fused layer as one cuDNN graph.

    cuda.conv.cudnn_fused   kiln::FusedConv: conv + bias + residual add + activation, one graph on NHWC tensors
    cuda.gemm.cudnn_fused   kiln::FusedGemm: matmul + bias + activation + residual, one graph (opt_level 3+)
    cuda.layer_norm.cudnn   kiln::LayerNorm: (x + residual) -> LayerNorm, one graph; the sum as 2nd output when asked
    cuda.rms_norm.cudnn     kiln::RMSNorm: cuDNN's RMSNorm node

Measured on the H200 at ResNet-50 layer shapes (batch 256, fp16, NHWC; shared/ANCHORS.md, "What fusion is
worth"), the fused cuDNN graph ran 1.9-2.4x faster than separate conv / add / ReLU kernels.

The graph is fixed to the layer's shapes: configure() records them at build, prepare() builds the graph for them
(kiln/kernels/cuda/cudnn_graph.py). A launch at another input shape (a dynamic batch) builds that shape's graph
on its first, eager run — the engine runs every new shape eagerly before capturing it — or, when cuDNN declines
that shape, runs the op's registered implementation.

supports() checks what can be said from the step, then asks cuDNN itself: the graph is built (once per process,
shared by layers of one shape) and a refusal comes back as the reason. So a candidate that passes supports() does
run, and the build-time check against the reference judges only its numbers.

available() is true only where `import cudnn` works and torch sees a GPU; the package is optional (the GPU
machine carries its wheel, imported with --no-deps).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch

from kiln.kernels.cuda.cudnn_graph import (
    IO_DTYPES,
    NORM_PHASES,
    CudnnGraphError,
    FusedPattern,
    activation_refusal,
    conv_output_dims,
    describe_conv,
    describe_gemm,
    describe_norm,
    fused_graph,
    import_cudnn,
    is_built,
)
from kiln.ops.fused import fused_conv, fused_gemm, layer_norm, rms_norm
from kiln.ops.nn import _conv_params
from kiln.plan.spec import StepSpec
from kiln.tactics.cuda.library import _epilogue_args as _epilogue
from kiln.tactics.registry import register
from kiln.tactics.tactic import InputMeta, Tactic
from kiln.tactics.tactic import attribute as _attr
from kiln.tactics.tactic import tensor_input as _input

_HALF = (torch.float16, torch.bfloat16)
_CL = torch.channels_last


def cudnn_available() -> bool:
    return import_cudnn() is not None


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


# ---- convolution ---------------------------------------------------------------------------------

def conv_geometry(step: StepSpec, x_shape: tuple[int, ...], w_shape: tuple[int, ...]) -> tuple[list[int], ...]:
    """(pads [top, left, bottom, right], strides, dilations) of a 2-D FusedConv at this input size (auto_pad too)."""
    kernel = list(_attr(step, "kernel_shape", list(w_shape[2:])))
    x = torch.empty(x_shape, device="meta")
    strides, dilations, pads = _conv_params(x, kernel, _attr(step, "auto_pad", "NOTSET"),
                                            step.attributes.get("dilations"), step.attributes.get("pads"),
                                            step.attributes.get("strides"))
    return [int(p) for p in pads], [int(s) for s in strides], [int(d) for d in dilations]


def conv_pattern(step: StepSpec, x_shape: tuple[int, ...], w_shape: tuple[int, ...], bias: bool, residual: bool,
                 dtype: torch.dtype) -> FusedPattern:
    """The cuDNN graph of this FusedConv step at this input size."""
    pads, strides, dilations = conv_geometry(step, x_shape, w_shape)
    return describe_conv(tuple(x_shape), tuple(w_shape), pads=tuple(pads), strides=tuple(strides),
                         dilations=tuple(dilations), bias=bias, residual=residual, dtype=IO_DTYPES[dtype],
                         **_epilogue(step, 0))


def conv_static_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    """What the step and its shapes say, before cuDNN is asked (pure: runs without a GPU)."""
    x, w, b, residual = inputs[0], _input(inputs, 1), _input(inputs, 2), _input(inputs, 3)
    if x.shape is None or len(x.shape) != 4:
        return "only 2-D convolutions (4-D input)"
    if w is None or not w.constant or len(w.shape) != 4:
        return "the weight is not a constant 4-D tensor of the engine"
    if x.dtype not in IO_DTYPES or w.dtype != x.dtype:
        return f"x {x.dtype} and weight {w.dtype}: the graph takes one float16/bfloat16 dtype"
    if int(_attr(step, "group", 1)) != 1:
        return f"group={_attr(step, 'group', 1)}: grouped / depthwise convolutions are not built as cuDNN graphs here"
    kernel = list(_attr(step, "kernel_shape", list(w.shape[2:])))
    if kernel != list(w.shape[2:]):
        return f"kernel_shape {kernel} differs from the weight's {list(w.shape[2:])}"
    if w.shape[1] != x.shape[1]:
        return f"weight {list(w.shape)} does not take x's {x.shape[1]} channels"
    pads, strides, dilations = conv_geometry(step, x.shape, w.shape)
    if any(d != 1 for d in dilations):
        return f"dilations {dilations}: dilated convolutions are not built as cuDNN graphs here (untested)"
    if any(p < 0 for p in pads):
        return f"negative pads {pads} (a crop)"
    if b is not None and (b.dtype != x.dtype or len(b.shape) != 1 or b.shape[0] != w.shape[0]):
        return f"bias {b.dtype}{list(b.shape)} is not one {x.dtype} value per output channel ({w.shape[0]})"
    epilogue = _epilogue(step, 0)
    refusal = activation_refusal(epilogue["activation"], epilogue["alpha"], epilogue["beta"])
    if refusal:
        return refusal
    out = conv_output_dims(tuple(x.shape), tuple(w.shape), tuple(pads), tuple(strides), tuple(dilations))
    if min(out) <= 0:
        return f"empty output {list(out)}"
    if residual is not None and (tuple(residual.shape) != out or residual.dtype != x.dtype):
        return f"residual {residual.dtype}{list(residual.shape)} is not the output's {x.dtype}{list(out)} " \
               "(the graph adds it element by element, no broadcast)"
    return True


def _conv_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    static = conv_static_supports(step, inputs)
    if static is not True:
        return static
    x, w = inputs[0], inputs[1]
    pattern = conv_pattern(step, x.shape, w.shape, _input(inputs, 2) is not None, _input(inputs, 3) is not None,
                           x.dtype)
    try:
        fused_graph(pattern, _device())
    except CudnnGraphError as e:
        return str(e)
    return True


def _conv_configure(step: StepSpec, inputs: list[InputMeta]) -> dict[str, Any]:
    return {"input_size": list(inputs[0].shape), "bias": _input(inputs, 2) is not None,
            "residual": _input(inputs, 3) is not None}


def _alternatives(found: FusedPattern | list[FusedPattern]) -> list[FusedPattern]:
    return list(found) if isinstance(found, (list, tuple)) else [found]


def _build_first(patterns: list[FusedPattern], device: torch.device):
    """The first of `patterns` (alternatives for one layer, best first) that cuDNN builds; when none does, a
    CudnnGraphError with every refusal. Through this module's `fused_graph`, which the unit tests replace."""
    reasons = []
    for pattern in patterns:
        try:
            return fused_graph(pattern, device)
        except CudnnGraphError as e:
            reasons.append(str(e))
    raise CudnnGraphError(" | ".join(reasons) if reasons else "no graph to build")


class _ShapeGraphs:
    """The built graph per input shape of one layer; a shape cuDNN declines runs `default`, with one warning.

    `pattern_for(shape)` gives the layer's graph at that shape, or a list of alternatives, best first (a norm
    in inference phase, then in training phase): the first that cuDNN builds is used.
    """

    def __init__(self, name: str, pattern_for, default):
        self.name, self.pattern_for, self.default = name, pattern_for, default
        self.graphs: dict[tuple[int, ...], Any] = {}

    def get(self, shape: tuple[int, ...], device: torch.device):
        found = self.graphs.get(shape)
        if found is not None:
            return found
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        reasons = []
        for pattern in _alternatives(self.pattern_for(shape)):
            if capturing and not is_built(pattern, device):
                # Never build inside a capture (the default runs, this once, uncached); the engine runs each new
                # shape eagerly before it captures it, so this is reached only by a capture of an unseen shape.
                return self.default
            try:
                found = fused_graph(pattern, device)  # cached: a refusal is remembered, a built graph reused
                break
            except CudnnGraphError as e:
                reasons.append(str(e))
        else:
            warnings.warn(f"layer {self.name!r}: {' | '.join(reasons)}; this shape runs the default implementation",
                          stacklevel=2)
            found = self.default
        self.graphs[shape] = found
        return found


def _prepare_conv(step: StepSpec, constants: list[Any], device: torch.device):
    config = step.tactic_config
    w = constants[1]
    w_krsc = w.contiguous(memory_format=_CL)  # [K, C, R, S] stored KRSC, once
    has_bias = bool(config.get("bias", len(step.inputs) > 2 and step.inputs[2] != ""))
    has_residual = bool(config.get("residual", len(step.inputs) > 3 and step.inputs[3] != ""))
    attributes = dict(step.attributes)

    def pattern_for(shape: tuple[int, ...]) -> FusedPattern:
        return conv_pattern(step, shape, tuple(w.shape), has_bias, has_residual, w.dtype)

    def default(x, b, residual):
        return fused_conv(None, x, w_krsc, b, residual, **attributes)

    graphs = _ShapeGraphs(step.name, pattern_for, default)
    if config.get("input_size"):
        size = tuple(int(d) for d in config["input_size"])
        graphs.graphs[size] = fused_graph(pattern_for(size), device)  # built at load: a refusal fails loudly here

    def launch(ctx, x, w_=None, b=None, residual=None, **_attributes):
        graph = graphs.get(tuple(x.shape), device)
        x = x.contiguous(memory_format=_CL)  # x: [N, C, H, W] channels-last; no copy when it already is
        if residual is not None:
            residual = residual.contiguous(memory_format=_CL)  # [N, K, P, Q], as the graph reads it
        if graph is default:
            return default(x, b, residual)
        args = [x, w_krsc] + ([b.reshape(1, -1, 1, 1)] if has_bias else []) + ([residual] if has_residual else [])
        return graph(*args)  # y: [N, K, P, Q] channels-last

    return launch


register(Tactic(
    name="cuda.conv.cudnn_fused", op_type="FusedConv", domain="kiln", device="cuda", dtypes=_HALF,
    supports=_conv_supports, configure=_conv_configure, prepare=_prepare_conv, layout="channels_last",
    available=cudnn_available,
    description="conv + bias + residual + activation as one cuDNN graph (fp32 compute, NHWC, built per shape)",
))


# ---- matmul --------------------------------------------------------------------------------------

def gemm_pattern(step: StepSpec, rows: int, w_shape: tuple[int, ...], bias: bool, residual: bool,
                 dtype: torch.dtype) -> FusedPattern:
    n, k = w_shape
    return describe_gemm(rows, k, n, bias=bias, residual=residual, dtype=IO_DTYPES[dtype], **_epilogue(step, 1))


def gemm_static_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    """What the step and its shapes say, before cuDNN is asked (pure: runs without a GPU)."""
    x, w, b, residual = inputs[0], _input(inputs, 1), _input(inputs, 2), _input(inputs, 3)
    if not x.shape:
        return "x is a scalar"
    if w is None or not w.constant or len(w.shape) != 2 or w.shape[1] != x.shape[-1]:
        return f"w is not a constant [N, K={x.shape[-1]}] matrix of the engine"
    if x.dtype not in IO_DTYPES or w.dtype != x.dtype:
        return f"x {x.dtype} and w {w.dtype}: the graph takes one float16/bfloat16 dtype"
    if b is not None and (b.dtype != x.dtype or math.prod(b.shape) != w.shape[0]):
        return f"bias {b.dtype}{list(b.shape)} is not one {x.dtype} value per output column ({w.shape[0]})"
    epilogue = _epilogue(step, 1)
    if epilogue["activation"] == "SwiGLU":
        return "activation 'SwiGLU' halves the output's last dim: the default implementation gates it"
    refusal = activation_refusal(epilogue["activation"], epilogue["alpha"], epilogue["beta"])
    if refusal:
        return refusal
    out = (*x.shape[:-1], w.shape[0])
    if math.prod(x.shape[:-1]) == 0:
        return "no rows"
    if residual is not None and (tuple(residual.shape) != out or residual.dtype != x.dtype):
        return f"residual {residual.dtype}{list(residual.shape)} is not the output's {x.dtype}{list(out)} " \
               "(the graph adds it element by element, no broadcast)"
    return True


def _gemm_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    static = gemm_static_supports(step, inputs)
    if static is not True:
        return static
    x, w = inputs[0], inputs[1]
    pattern = gemm_pattern(step, math.prod(x.shape[:-1]), w.shape, _input(inputs, 2) is not None,
                           _input(inputs, 3) is not None, x.dtype)
    try:
        fused_graph(pattern, _device())
    except CudnnGraphError as e:
        return str(e)
    return True


def _gemm_configure(step: StepSpec, inputs: list[InputMeta]) -> dict[str, Any]:
    return {"rows": math.prod(inputs[0].shape[:-1]), "bias": _input(inputs, 2) is not None,
            "residual": _input(inputs, 3) is not None}


def _prepare_gemm(step: StepSpec, constants: list[Any], device: torch.device):
    config = step.tactic_config
    w = constants[1].contiguous()  # [N, K]; the graph reads it as wᵀ [K, N] through its strides
    has_bias = bool(config.get("bias", len(step.inputs) > 2 and step.inputs[2] != ""))
    has_residual = bool(config.get("residual", len(step.inputs) > 3 and step.inputs[3] != ""))
    attributes = dict(step.attributes)

    def pattern_for(shape: tuple[int, ...]) -> FusedPattern:
        return gemm_pattern(step, shape[0], tuple(w.shape), has_bias, has_residual, w.dtype)

    def default(x, b, residual):
        return fused_gemm(None, x, w, b, residual, **attributes)

    graphs = _ShapeGraphs(step.name, pattern_for, default)
    if config.get("rows"):
        rows = int(config["rows"])
        graphs.graphs[(rows,)] = fused_graph(pattern_for((rows,)), device)

    def launch(ctx, x, w_=None, b=None, residual=None, **_attributes):
        rows = math.prod(x.shape[:-1])
        graph = graphs.get((rows,), device)
        if graph is default:
            return default(x, b, residual)
        x3 = x.reshape(1, rows, x.shape[-1]).contiguous()  # [..., K] -> [1, M, K] row-major (a view when it is)
        args = [x3, w.unsqueeze(0).transpose(1, 2)]  # wᵀ: [1, K, N] view of [N, K]
        if has_bias:
            args.append(b.reshape(1, 1, -1))
        if has_residual:
            args.append(residual.reshape(1, rows, -1).contiguous())
        return graph(*args).view(*x.shape[:-1], w.shape[0])  # [1, M, N] -> [..., N]

    return launch


register(Tactic(
    name="cuda.gemm.cudnn_fused", op_type="FusedGemm", domain="kiln", device="cuda", dtypes=_HALF,
    supports=_gemm_supports, configure=_gemm_configure, prepare=_prepare_gemm, available=cudnn_available,
    level=3,  # tried from opt_level 3 until the H200 says it beats cuBLAS + the Triton epilogue at default builds
    description="matmul + bias + activation + residual as one cuDNN graph (fp32 compute, built per row count)",
))


# ---- normalisation -------------------------------------------------------------------------------

_NORM_EPSILON = {"LayerNorm": 1e-5, "RMSNorm": 1e-6}  # the registered ops' defaults (kiln/ops/fused.py)


def _norm_params(step: StepSpec) -> tuple[bool, float]:
    """(is RMSNorm, epsilon) of a kiln::LayerNorm / kiln::RMSNorm step."""
    rms = step.op_type == "RMSNorm"
    return rms, float(_attr(step, "epsilon", _NORM_EPSILON[step.op_type]))


def norm_patterns(step: StepSpec, rows: int, hidden: int, residual: bool, dtype: torch.dtype) -> list[FusedPattern]:
    """The layer's cuDNN graph in each norm phase, in the order they are tried (inference, then training).

    A skip-LayerNorm whose sum is not asked for is also offered with the sum written out (and discarded) last:
    that is the form of cuDNN's add + LayerNorm sample, should the library fuse the add only with it."""
    rms, epsilon = _norm_params(step)
    sum_output = residual and len(step.outputs) == 2
    forms = [(phase, sum_output) for phase in NORM_PHASES]
    if residual and not sum_output:
        forms += [(phase, True) for phase in NORM_PHASES]
    return [describe_norm(rows, hidden, rms=rms, epsilon=epsilon, residual=residual, sum_output=with_sum,
                          phase=phase, dtype=IO_DTYPES[dtype]) for phase, with_sum in forms]


def norm_static_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    """What the step and its shapes say, before cuDNN is asked (pure: runs without a GPU)."""
    rms = step.op_type == "RMSNorm"
    x = inputs[0]
    if not x.shape:
        return "x is a scalar"
    if x.dtype not in IO_DTYPES:
        return f"x is {x.dtype}: the graph takes float16/bfloat16"
    rank, axis = len(x.shape), int(_attr(step, "axis", -1))
    if not -rank <= axis < rank:
        return f"axis {axis} is out of range for rank {rank}"
    if axis % rank != rank - 1:
        return f"axis {axis} is not the last of rank {rank}: the graph normalises rows of the last dim"
    hidden, rows = x.shape[-1], math.prod(x.shape[:-1])
    if hidden == 0 or rows == 0:
        return f"empty input {list(x.shape)}"
    names = ((1, "scale"),) if rms else ((1, "scale"), (2, "bias"))
    for i, name in names:
        p = _input(inputs, i)
        if p is None:
            continue
        if p.dtype != x.dtype:
            return f"{name} is {p.dtype}, x is {x.dtype}: the graph takes one dtype"
        if math.prod(p.shape) != hidden or (p.shape and p.shape[-1] != hidden):
            return f"{name} {list(p.shape)} is not one value per column of the last dim ({hidden})"
    residual = None if rms else _input(inputs, 3)
    if residual is not None and (tuple(residual.shape) != tuple(x.shape) or residual.dtype != x.dtype):
        return f"residual {residual.dtype}{list(residual.shape)} is not x's {x.dtype}{list(x.shape)} " \
               "(the graph adds it element by element, no broadcast)"
    most = 1 if rms else 2
    if len(step.outputs) > most:
        return f"{len(step.outputs)} outputs asked for; {step.op_type} gives at most {most}"
    return True


def _norm_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    static = norm_static_supports(step, inputs)
    if static is not True:
        return static
    x = inputs[0]
    residual = step.op_type == "LayerNorm" and _input(inputs, 3) is not None
    try:
        _build_first(norm_patterns(step, math.prod(x.shape[:-1]), x.shape[-1], residual, x.dtype), _device())
    except CudnnGraphError as e:
        return str(e)
    return True


def _norm_configure(step: StepSpec, inputs: list[InputMeta]) -> dict[str, Any]:
    x = inputs[0]
    return {"rows": math.prod(x.shape[:-1]), "hidden": x.shape[-1], "dtype": IO_DTYPES[x.dtype],
            "residual": step.op_type == "LayerNorm" and _input(inputs, 3) is not None}


_DTYPES_BY_NAME = {name: dtype for dtype, name in IO_DTYPES.items()}


def _prepare_norm(step: StepSpec, constants: list[Any], device: torch.device):
    config = step.tactic_config
    rms = step.op_type == "RMSNorm"
    has_residual = not rms and bool(config.get("residual", len(step.inputs) > 3 and step.inputs[3] != ""))
    two_outputs = len(step.outputs) == 2
    attributes = dict(step.attributes)
    fills: dict[tuple[float, torch.dtype, int], torch.Tensor] = {}

    def fill(value: float, dtype: torch.dtype, hidden: int) -> torch.Tensor:
        """The scale (ones) or bias (zeros) of a layer that has none: cuDNN's LayerNorm binds both."""
        key = (value, dtype, hidden)
        if key not in fills:
            fills[key] = torch.full((1, hidden, 1, 1), value, dtype=dtype, device=device)
        return fills[key]

    def pattern_for(shape: tuple[int, ...], dtype: torch.dtype) -> list[FusedPattern]:
        return norm_patterns(step, shape[0], shape[1], has_residual, dtype)

    def default(ctx, x, scale, bias, residual):
        if rms:
            return rms_norm(ctx, x, scale, **attributes)
        return layer_norm(ctx, x, scale, bias, residual, **attributes)

    graphs_by_dtype: dict[torch.dtype, _ShapeGraphs] = {}

    def graphs_for(dtype: torch.dtype) -> _ShapeGraphs:
        if dtype not in graphs_by_dtype:
            graphs_by_dtype[dtype] = _ShapeGraphs(step.name, lambda shape: pattern_for(shape, dtype), default)
        return graphs_by_dtype[dtype]

    if config.get("rows") and config.get("dtype") in _DTYPES_BY_NAME:
        dtype, rows, hidden = _DTYPES_BY_NAME[config["dtype"]], int(config["rows"]), int(config["hidden"])
        # built at load: a refusal fails loudly here; the fills are made now, not inside a later capture
        graphs_for(dtype).graphs[(rows, hidden)] = _build_first(pattern_for((rows, hidden), dtype), device)
        fill(1.0, dtype, hidden)
        if not rms:
            fill(0.0, dtype, hidden)

    def launch(ctx, x, scale=None, bias=None, residual=None, **_attributes):
        hidden = x.shape[-1]
        rows = x.numel() // hidden
        graph = graphs_for(x.dtype).get((rows, hidden), device)
        if graph is default:
            return default(ctx, x, scale, bias, residual)
        args = [x.contiguous().view(rows, hidden, 1, 1),  # [..., H] -> [rows, H, 1, 1]: a view when contiguous
                (scale if scale is not None else fill(1.0, x.dtype, hidden)).reshape(1, hidden, 1, 1)]
        if not rms:
            args.append((bias if bias is not None else fill(0.0, x.dtype, hidden)).reshape(1, hidden, 1, 1))
        if has_residual:
            args.append(residual.contiguous().view(rows, hidden, 1, 1))
        found = graph(*args)
        outs = found if isinstance(found, tuple) else (found,)  # (y, [sum], [statistics, discarded])
        y = outs[0].view(x.shape)
        if not two_outputs:
            return y
        return y, (outs[1].view(x.shape) if has_residual else x)  # without a residual the "sum" is x itself

    return launch


for _op, _name, _what in (("LayerNorm", "cuda.layer_norm.cudnn", "(x + residual) -> LayerNorm, the sum as 2nd output"),
                          ("RMSNorm", "cuda.rms_norm.cudnn", "RMSNorm")):
    register(Tactic(
        name=_name, op_type=_op, domain="kiln", device="cuda", dtypes=_HALF,
        supports=_norm_supports, configure=_norm_configure, prepare=_prepare_norm, available=cudnn_available,
        level=3,  # tried from opt_level 3 until the H200 says it beats the Triton kernel at default builds
        description=f"{_what} as one cuDNN graph over [rows, hidden] (fp32 statistics, built per row count)",
    ))
