"""Fused layers as cuDNN operation graphs (cuDNN's graph API through nvidia-cudnn-frontend, `import cudnn`).

A kiln::FusedConv layer — convolution + bias + residual add + activation — becomes one cuDNN graph:

    y = act(conv(x, w) + b + r)      residual_after_activation = 0 (ResNet)
    y = act(conv(x, w) + b) + r      residual_after_activation = 1 (MobileNetV2)

and a kiln::FusedGemm layer the same with a matmul in place of the convolution. cuDNN's fusion engines
run the epilogue on the output tile in registers: the fp32 [N, K, P, Q] intermediate never touches memory,
which is the catalog TensorRT draws on for conv + bias + eltwise + activation.

A kiln::LayerNorm / kiln::RMSNorm layer becomes cuDNN's normalisation node over [rows, hidden] rows, with the
skip-LayerNorm's residual added by a pointwise node before it (cuDNN >= 9.14 fuses the add into the norm's
kernel and can write the sum out as a second output):

    s = x + r;  y = (s - mean(s)) / sqrt(var(s) + eps) * scale + bias      (LayerNorm, s = x without r)
    y = x / sqrt(mean(x^2) + eps) * scale                                    (RMSNorm)

Two steps, kept apart so that the first is testable without a GPU or the library:

    describe_conv / describe_gemm -> FusedPattern   pure: the graph's tensors (logical dims, strides) and
                                                    its node list, one NodeDesc per cudnn.pygraph call
    fused_graph(pattern, device) -> CudnnFusedGraph  the pattern built on cuDNN once per process and device
                                                    (heuristics A then FALLBACK, check_support, build_plans);
                                                    calling it executes on torch's current stream

Layout: cuDNN takes dims in logical order ([N, C, H, W]) and the memory order in the strides, so an NHWC
(torch channels_last) tensor is dims [N, C, H, W] with strides [H·W·C, 1, W·C, C]. I/O is fp16 or bf16;
the intermediates and the arithmetic are fp32 (compute and intermediate data type FLOAT).
"""

from __future__ import annotations

import functools
import math
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

# ---- the pattern: what the graph is, as plain data ---------------------------------------------


@dataclass(frozen=True)
class TensorDesc:
    """One tensor the caller binds: logical dims and element strides (cuDNN's convention)."""

    name: str
    dims: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str = ""  # "" = the pattern's I/O dtype; "float32" for a norm's statistics


@dataclass(frozen=True)
class NodeDesc:
    """One cudnn.pygraph call: `graph.<op>(*inputs, name=output, **params)`; its result is named `output`."""

    op: str  # the pygraph method: conv_fprop, matmul, bias, add, relu, swish, layernorm, rmsnorm, ...
    inputs: tuple[str, ...]  # tensor names, in the method's positional order; "" = an optional port left out
    output: str
    params: tuple[tuple[str, Any], ...] = ()  # keyword arguments; a tuple so that a pattern is hashable
    more_outputs: tuple[str, ...] = ()  # names of a multi-output node's further results (a norm's mean, inv_var)


@dataclass(frozen=True)
class FusedPattern:
    """A whole fused layer: the bound inputs in launch order, the output(s), the nodes between.

    `scalars` are fp32 values the graph binds itself, by value (a norm's epsilon): the caller never sees them.
    `more_outputs` come back after `output`, in order (the skip-LayerNorm's sum; statistics it discards).
    Hashable: built graphs are cached per (pattern, device), so layers of the same shape share one.
    """

    dtype: str  # I/O dtype: "float16" | "bfloat16"
    inputs: tuple[TensorDesc, ...]
    output: TensorDesc
    nodes: tuple[NodeDesc, ...]
    scalars: tuple[tuple[str, float], ...] = ()
    more_outputs: tuple[TensorDesc, ...] = ()

    def node_ops(self) -> list[str]:
        return [n.op for n in self.nodes]

    def outputs(self) -> tuple[TensorDesc, ...]:
        return (self.output, *self.more_outputs)

    def summary(self) -> str:
        """'add -> layernorm[INFERENCE]': the node chain for messages, with each norm's phase."""
        return " -> ".join(n.op + "".join(f"[{v}]" for k, v in n.params if k in _ENUM_PARAMS) for n in self.nodes)


IO_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _finite(v: float) -> bool:
    return math.isfinite(v)


# kiln activation -> (pygraph op, its keyword arguments from alpha/beta). cuDNN's RELU_FWD with clips is
# min(max(x, lower), upper) when its lower slope is 0 (the default), which is ONNX Clip; swish with β = 1 is SiLU;
# "gelu" is the erf form, "gelu_approx_tanh" the tanh one. HardSigmoid / HardSwish have no one pointwise mode.
ACTIVATIONS: dict[str, Any] = {
    "Relu": lambda alpha, beta: ("relu", ()),
    "Clip": lambda alpha, beta: ("relu", (("lower_clip", alpha),) + ((("upper_clip", beta),) if _finite(beta) else ())),
    "LeakyRelu": lambda alpha, beta: ("leaky_relu", (("negative_slope", alpha),)),
    "Sigmoid": lambda alpha, beta: ("sigmoid", ()),
    "SiLU": lambda alpha, beta: ("swish", (("swish_beta", 1.0),)),
    "Tanh": lambda alpha, beta: ("tanh", ()),
    "Gelu": lambda alpha, beta: ("gelu", ()),
    "GeluTanh": lambda alpha, beta: ("gelu_approx_tanh", ()),
}


def activation_refusal(activation: str, alpha: float, beta: float) -> str | None:
    """None when the activation is one cuDNN pointwise node, else why not."""
    if activation == "":
        return None
    if activation not in ACTIVATIONS:
        return f"activation {activation!r} has no cuDNN pointwise mode (these do: {', '.join(ACTIVATIONS)})"
    if activation == "Clip" and not _finite(alpha):
        # RELU_FWD clamps at 0 when it is given no lower clip: an unbounded min cannot be said.
        return f"Clip with min {alpha}: cuDNN's clipped ReLU needs a finite lower bound"
    if activation == "Clip" and alpha > beta:
        return f"Clip with min {alpha} > max {beta}"
    return None


def _nhwc_strides(dims: tuple[int, ...]) -> tuple[int, ...]:
    n, c, h, w = dims
    return (h * w * c, 1, w * c, c)


def _epilogue(first: str, bias: TensorDesc | None, residual: TensorDesc | None, activation: str, alpha: float,
              beta: float, residual_after_activation: bool) -> list[NodeDesc]:
    """The nodes after the layer's own op: bias, then residual add and activation in the order asked."""
    nodes: list[NodeDesc] = []
    value = first

    def add(op: str, inputs: tuple[str, ...], out: str, params: tuple = ()) -> None:
        nonlocal value
        nodes.append(NodeDesc(op, inputs, out, params))
        value = out

    if bias is not None:
        add("bias", (value, bias.name), "biased")
    if residual is not None and not residual_after_activation:
        add("add", (value, residual.name), "summed")
    if activation:
        op, params = ACTIVATIONS[activation](float(alpha), float(beta))
        add(op, (value,), "activated", params)
    if residual is not None and residual_after_activation:
        add("add", (value, residual.name), "summed")
    return nodes


def _rename_last(nodes: list[NodeDesc], name: str) -> list[NodeDesc]:
    last = nodes[-1]
    return nodes[:-1] + [NodeDesc(last.op, last.inputs, name, last.params)]


def conv_output_dims(x_dims: tuple[int, ...], w_dims: tuple[int, ...], pads: tuple[int, ...],
                     strides: tuple[int, ...], dilations: tuple[int, ...]) -> tuple[int, int, int, int]:
    """[N, K, P, Q] of a 2-D convolution; pads are ONNX's [top, left, bottom, right]."""
    n, _c, h, w = x_dims
    k, _cg, r, s = w_dims
    p = (h + pads[0] + pads[2] - dilations[0] * (r - 1) - 1) // strides[0] + 1
    q = (w + pads[1] + pads[3] - dilations[1] * (s - 1) - 1) // strides[1] + 1
    return n, k, p, q


def describe_conv(x_dims: tuple[int, ...], w_dims: tuple[int, ...], *, pads: tuple[int, ...],
                  strides: tuple[int, ...], dilations: tuple[int, ...], bias: bool, residual: bool,
                  activation: str, alpha: float, beta: float, residual_after_activation: bool,
                  dtype: str) -> FusedPattern:
    """The cuDNN graph of one FusedConv layer (x NHWC, w KRSC, bias [1, K, 1, 1], residual and y NHWC)."""
    x_dims, w_dims = tuple(int(d) for d in x_dims), tuple(int(d) for d in w_dims)
    if len(x_dims) != 4 or len(w_dims) != 4:
        raise ValueError(f"a 2-D convolution takes 4-D x and w, given {list(x_dims)} and {list(w_dims)}")
    if w_dims[1] != x_dims[1]:
        raise ValueError(f"weight {list(w_dims)} does not take {x_dims[1]} input channels (groups are not supported)")
    refusal = activation_refusal(activation, alpha, beta)
    if refusal:
        raise ValueError(refusal)
    y_dims = conv_output_dims(x_dims, w_dims, pads, strides, dilations)
    if min(y_dims) <= 0:
        raise ValueError(f"the convolution of {list(x_dims)} by {list(w_dims)} has an empty output {list(y_dims)}")
    k = w_dims[0]
    x = TensorDesc("x", x_dims, _nhwc_strides(x_dims))
    w = TensorDesc("w", w_dims, _nhwc_strides(w_dims))  # [K, C, R, S] in KRSC memory order
    b = TensorDesc("b", (1, k, 1, 1), (k, 1, k, k)) if bias else None
    r = TensorDesc("residual", y_dims, _nhwc_strides(y_dims)) if residual else None
    y = TensorDesc("y", y_dims, _nhwc_strides(y_dims))
    conv = NodeDesc("conv_fprop", ("x", "w"), "conv", (
        ("pre_padding", (int(pads[0]), int(pads[1]))), ("post_padding", (int(pads[2]), int(pads[3]))),
        ("stride", tuple(int(s) for s in strides)), ("dilation", tuple(int(d) for d in dilations))))
    nodes = _rename_last([conv] + _epilogue("conv", b, r, activation, alpha, beta, residual_after_activation), "y")
    return FusedPattern(dtype, tuple(t for t in (x, w, b, r) if t is not None), y, tuple(nodes))


def describe_gemm(rows: int, k: int, n: int, *, bias: bool, residual: bool, activation: str, alpha: float,
                  beta: float, residual_after_activation: bool, dtype: str) -> FusedPattern:
    """The cuDNN graph of one FusedGemm layer on [rows, K] rows: y = x · wᵀ (+ b, act, residual).

    cuDNN's matmul is batched: x is [1, M, K] row-major; kiln stores w as [N, K], read as the [1, K, N]
    matrix wᵀ through its strides (no copy); bias is [1, 1, N]; the residual and y are [1, M, N] row-major.
    """
    refusal = activation_refusal(activation, alpha, beta)
    if refusal:
        raise ValueError(refusal)
    if min(rows, k, n) <= 0:
        raise ValueError(f"empty matmul: {rows} rows, K={k}, N={n}")
    x = TensorDesc("x", (1, rows, k), (rows * k, k, 1))
    w = TensorDesc("w", (1, k, n), (k * n, 1, k))  # wᵀ: element [k, n] at n·K + k of the [N, K] weight
    b = TensorDesc("b", (1, 1, n), (n, n, 1)) if bias else None
    r = TensorDesc("residual", (1, rows, n), (rows * n, n, 1)) if residual else None
    y = TensorDesc("y", (1, rows, n), (rows * n, n, 1))
    matmul = NodeDesc("matmul", ("x", "w"), "product")
    nodes = _rename_last([matmul] + _epilogue("product", b, r, activation, alpha, beta, residual_after_activation),
                         "y")
    return FusedPattern(dtype, tuple(t for t in (x, w, b, r) if t is not None), y, tuple(nodes))


NORM_PHASES = ("INFERENCE", "TRAINING")  # cudnn.norm_forward_phase, in the order they are tried


def describe_norm(rows: int, hidden: int, *, rms: bool, epsilon: float, residual: bool, sum_output: bool,
                  phase: str, dtype: str) -> FusedPattern:
    """The cuDNN graph of one LayerNorm (rms=False) or RMSNorm layer over `rows` rows of `hidden` values.

    The layout of cuDNN's norm samples: x is [rows, hidden, 1, 1] (row-major memory: the norm runs over every
    dim after the first), scale and bias [1, hidden, 1, 1]; epsilon is a pass-by-value fp32 scalar. LayerNorm
    always binds a bias (the tactic binds zeros when the layer has none); RMSNorm has none.

    `phase` INFERENCE computes y alone. TRAINING also writes the per-row statistics (fp32 [rows, 1, 1, 1]),
    which the tactic discards: it is the second choice, for a cuDNN that declines the inference graph (the
    frontend's add + LayerNorm sample is written in training phase).
    """
    if min(rows, hidden) <= 0:
        raise ValueError(f"empty normalisation: {rows} rows of {hidden}")
    if phase not in NORM_PHASES:
        raise ValueError(f"norm phase {phase!r} is not one of {NORM_PHASES}")
    if rms and residual:
        raise ValueError("kiln::RMSNorm has no residual input")
    if sum_output and not residual:
        raise ValueError("the sum is an output only when a residual is added")
    dims, strides = (rows, hidden, 1, 1), (hidden, 1, hidden, hidden)
    param_dims, param_strides = (1, hidden, 1, 1), (hidden, 1, hidden, hidden)
    x = TensorDesc("x", dims, strides)
    r = TensorDesc("residual", dims, strides) if residual else None
    scale = TensorDesc("scale", param_dims, param_strides)
    bias = None if rms else TensorDesc("bias", param_dims, param_strides)
    nodes = []
    source = "x"
    if residual:
        nodes.append(NodeDesc("add", ("x", "residual"), "sum"))
        source = "sum"
    stats = () if phase == "INFERENCE" else (("inv_var",) if rms else ("mean", "inv_var"))
    nodes.append(NodeDesc("rmsnorm" if rms else "layernorm", (source, "scale", "" if rms else "bias", "epsilon"), "y",
                          (("norm_forward_phase", phase),), stats))
    more = [TensorDesc("sum", dims, strides)] if sum_output else []
    more += [TensorDesc(name, (rows, 1, 1, 1), (1, 1, 1, 1), "float32") for name in stats]
    return FusedPattern(dtype, tuple(t for t in (x, scale, bias, r) if t is not None), TensorDesc("y", dims, strides),
                        tuple(nodes), scalars=(("epsilon", float(epsilon)),), more_outputs=tuple(more))


# ---- the library --------------------------------------------------------------------------------


_IMPORT_ERROR: list[str] = []  # why `import cudnn` failed, for messages


@functools.lru_cache(maxsize=1)
def import_cudnn() -> ModuleType | None:
    """The cudnn frontend module, or None when it (or the GPU it needs) is absent.

    torch is asked for its cuDNN first: that loads torch's own libcudnn.so.9, which the frontend's
    lazy dlopen then finds already in the process (one cuDNN, not two).
    """
    if not torch.cuda.is_available():
        _IMPORT_ERROR.append("torch sees no CUDA device")
        return None
    torch.backends.cudnn.version()
    try:
        import cudnn
    except (ImportError, OSError, RuntimeError, AssertionError) as e:  # its dlopen asserts one libcudnn found
        _IMPORT_ERROR.append(f"import cudnn failed: {type(e).__name__}: {e}")
        return None
    return cudnn


def versions() -> str:
    """'cudnn frontend X, backend Y' for logs and error messages."""
    cudnn = import_cudnn()
    if cudnn is None:
        return f"cudnn frontend unavailable ({'; '.join(_IMPORT_ERROR) or 'unknown reason'})"
    try:
        backend = cudnn.backend_version_string()
    except (RuntimeError, AttributeError) as e:  # the frontend imports without libcudnn; asking it then fails
        backend = f"unknown ({e})"
    return f"cudnn frontend {getattr(cudnn, '__version__', '?')}, backend {backend}, torch's cuDNN " \
           f"{torch.backends.cudnn.version()}"


class CudnnGraphError(RuntimeError):
    """cuDNN could not build (or declined) a fused graph; the message says which graph and why."""


_DEVICE_HANDLES: dict[int, tuple[Any, threading.Lock]] = {}
_HANDLES_LOCK = threading.Lock()


def _device_handle(index: int) -> tuple[Any, threading.Lock]:
    """One cuDNN handle per device, and the lock that keeps set_stream + execute together.

    The handle carries the stream its work goes to, so two threads executing on two streams through one
    handle must not interleave between setting the stream and launching.
    """
    with _HANDLES_LOCK:
        if index not in _DEVICE_HANDLES:
            cudnn = import_cudnn()
            with torch.cuda.device(index):
                _DEVICE_HANDLES[index] = (cudnn.create_handle(), threading.Lock())
        return _DEVICE_HANDLES[index]


_CUDNN_DTYPES = {"float16": "HALF", "bfloat16": "BFLOAT16", "float32": "FLOAT"}
_TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_ENUM_PARAMS = {"norm_forward_phase"}  # params whose value names a member of the cudnn enum of the same name


def _matches(t: torch.Tensor, desc: TensorDesc) -> bool:
    """Whether t has desc's dims and addresses memory as desc's strides say (size-1 dims address nothing)."""
    if tuple(t.shape) != desc.dims:
        return False
    return all(size == 1 or stride == want for size, stride, want in zip(t.shape, t.stride(), desc.strides))


def _dtype_of(desc: TensorDesc, pattern: FusedPattern) -> str:
    return desc.dtype or pattern.dtype


def to_pygraph(cudnn: ModuleType, pattern: FusedPattern, handle: Any) -> tuple[Any, dict[str, Any]]:
    """The pattern as a cudnn.pygraph (not yet validated or built) and its tensors by name.

    The frontend keeps the graph in Python until validate(), so this runs without a GPU: the unit tests
    check the node list it produces. A handle is always passed: without one the frontend looks for its
    default device through cuda-python, which the GPU machine need not have.
    """
    io = getattr(cudnn.data_type, _CUDNN_DTYPES[pattern.dtype])
    graph = cudnn.pygraph(io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=handle)
    tensors = {t.name: graph.tensor(name=t.name, dim=list(t.dims), stride=list(t.strides), data_type=io)
               for t in pattern.inputs}
    for name, _value in pattern.scalars:  # bound by value at execute, from a host fp32 tensor (as cuDNN's samples)
        tensors[name] = graph.tensor(name=name, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1],
                                     data_type=cudnn.data_type.FLOAT, is_pass_by_value=True)
    for node in pattern.nodes:
        params = {k: getattr(getattr(cudnn, k), v) if k in _ENUM_PARAMS else list(v) if isinstance(v, tuple) else v
                  for k, v in node.params}
        result = getattr(graph, node.op)(*(tensors[i] if i else None for i in node.inputs), name=node.output,
                                         **params)
        if isinstance(result, (list, tuple)):  # a multi-output node (a norm: Y, then its statistics or None)
            tensors[node.output] = result[0]
            for name, value in zip(node.more_outputs, result[1:]):
                if value is None:
                    raise ValueError(f"{node.op} gave no {name!r} output (phase {params.get('norm_forward_phase')})")
                tensors[name] = value
        else:
            tensors[node.output] = result
    for out in pattern.outputs():
        dtype = getattr(cudnn.data_type, _CUDNN_DTYPES[_dtype_of(out, pattern)])
        tensors[out.name].set_output(True).set_data_type(dtype).set_dim(list(out.dims)).set_stride(list(out.strides))
    return graph, tensors


class CudnnFusedGraph:
    """One FusedPattern built on cuDNN for one device; calling it runs the graph on torch's current stream.

    The plan is built once (here). A call binds the inputs, allocates the outputs and the workspace from torch's
    caching allocator on the current stream — so a CUDA-graph capture records them in its private pool and
    engines shared by several execution contexts never share a workspace — and launches: nothing in a call
    waits on the host. Pass-by-value scalars are host tensors kept here: cuDNN copies their value into the
    launch's parameters, so a captured launch replays with it.
    """

    def __init__(self, pattern: FusedPattern, device: torch.device):
        cudnn = import_cudnn()
        if cudnn is None:
            raise CudnnGraphError("the cudnn frontend (nvidia-cudnn-frontend) is not importable here")
        self.pattern, self.device = pattern, device
        index = device.index if device.index is not None else torch.cuda.current_device()
        self._handle, self._lock = _device_handle(index)
        with torch.cuda.device(index):
            graph, tensors = to_pygraph(cudnn, pattern, self._handle)
            graph.validate()
            graph.build_operation_graph()
            graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
            graph.check_support()
            graph.build_plans()
            self.workspace_size = int(graph.get_workspace_size())
        self._graph = graph
        self._inputs = [tensors[t.name] for t in pattern.inputs]
        self._outputs = [(tensors[t.name], t, _TORCH_DTYPES[_dtype_of(t, pattern)]) for t in pattern.outputs()]
        self._scalars = {tensors[name]: torch.full((1, 1, 1, 1), value, dtype=torch.float32)
                         for name, value in pattern.scalars}
        self._dtype = _TORCH_DTYPES[pattern.dtype]

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """The output(s) from the inputs in the pattern's order, each with its TensorDesc's dims and strides:
        y alone, or (y, *more_outputs) when the pattern has more."""
        bindings = dict(self._scalars)
        for desc, handle_tensor, value in zip(self.pattern.inputs, self._inputs, inputs):
            if not _matches(value, desc) or value.dtype != self._dtype:
                raise ValueError(f"cuDNN graph input {desc.name!r}: given {value.dtype}{list(value.shape)} strides "
                                 f"{list(value.stride())}, built for {self._dtype}{list(desc.dims)} strides "
                                 f"{list(desc.strides)}")
            if value.data_ptr() % 16:  # the plans assume 16-byte aligned operands (vector loads); views may not be
                value = value.clone()
            bindings[handle_tensor] = value
        results = []
        for handle_tensor, desc, dtype in self._outputs:
            out = torch.empty_strided(desc.dims, desc.strides, dtype=dtype, device=self.device)
            bindings[handle_tensor] = out
            results.append(out)
        workspace = torch.empty(self.workspace_size, dtype=torch.uint8, device=self.device) \
            if self.workspace_size else None
        cudnn = import_cudnn()
        stream = torch.cuda.current_stream(self.device).cuda_stream
        with self._lock:
            cudnn.set_stream(self._handle, stream)
            self._graph.execute(bindings, workspace, handle=self._handle)
        return results[0] if len(results) == 1 else tuple(results)


_BUILT: dict[tuple[FusedPattern, int], CudnnFusedGraph | str] = {}
_BUILT_LOCK = threading.Lock()


def fused_graph(pattern: FusedPattern, device: torch.device) -> CudnnFusedGraph:
    """The built graph of `pattern` on `device`, built on first use; a refusal is remembered and re-raised.

    Layers of one shape (ResNet-50 repeats its blocks) share one graph: building a runtime-fused plan
    compiles a kernel, which is the expensive part, and a built graph holds nothing per layer.
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (pattern, index)
    with _BUILT_LOCK:
        found = _BUILT.get(key)
        if found is None:
            try:
                found = CudnnFusedGraph(pattern, torch.device("cuda", index))
            except Exception as e:  # noqa: BLE001  any library failure is a refusal of this graph, said in full
                found = f"{type(e).__name__}: {e}"
            _BUILT[key] = found
    if isinstance(found, str):
        raise CudnnGraphError(f"cuDNN did not build the graph {pattern.summary()} for "
                              f"{', '.join(f'{t.name}{list(t.dims)}' for t in pattern.inputs)} "
                              f"({pattern.dtype}; {versions()}): {found}")
    return found


def is_built(pattern: FusedPattern, device: torch.device) -> bool:
    """Whether `pattern` was already built (or refused) on `device`: safe to ask for during CUDA-graph capture."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return (pattern, index) in _BUILT
