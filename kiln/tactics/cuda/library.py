"""CUDA tactics: library kernels through torch (cuBLAS, cuDNN, SDPA), with kiln's Triton GEMM and epilogues.

    cuda.gemm.cublas_triton_epilogue      F.linear without bias, then bias + activation + residual in one kernel
    cuda.gemm.cublas_addmm_act            torch.addmm / torch._addmm_activation (cuBLASLt bias + ReLU/GELU epilogue)
    cuda.gemm.triton.<BMxBNxBK>           Triton GEMM with the epilogue fused, one tactic per tile config
    cuda.conv.channels_last               cuDNN conv on NHWC activations and weights, epilogue by torch in place
    cuda.conv.channels_last_triton_epilogue   the same conv without bias, epilogue in one Triton kernel
    cuda.conv.patchify_gemm               stride == kernel (ViT patch embedding): patches copied once, one GEMM
    cuda.attention.flash / .efficient / .cudnn   SDPA with its backend forced (torch.nn.attention.sdpa_kernel)

Triton is imported when a Triton tactic is prepared, not here: a CPU-only deployment without
the `triton` package still imports this module (the registry loads every device's tactics).
Nothing in a launch waits on the host (no .item(), no .cpu()): the engine captures CUDA graphs.
Under TRITON_INTERPRET=1 the Triton tactics run on CPU tensors (tests/unit/test_tactics_cuda.py).
The memory-bound layers' Triton tactics (elementwise chains, norms, softmax) are memory_bound.py's.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from kiln.ops.fused import _epilogue, attention, fused_conv
from kiln.plan.spec import StepSpec
from kiln.tactics.registry import register
from kiln.tactics.tactic import InputMeta, Tactic
from kiln.tactics.tactic import attribute as _attr
from kiln.tactics.tactic import tensor_input as _input

_HALF = (torch.float16, torch.bfloat16)
_FLOAT = (torch.float16, torch.bfloat16, torch.float32)
_CL = torch.channels_last
# The activations kiln's Triton epilogue evaluates (kiln/kernels/cuda/triton/device_math.py: ACTIVATIONS),
# listed here so that checking a layer does not import triton.
_TRITON_ACTIVATIONS = ("", "Relu", "Clip", "Sigmoid", "SiLU", "Tanh", "Gelu", "GeluTanh", "LeakyRelu",
                       "HardSigmoid", "HardSwish")


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def _kernels() -> ModuleType:
    """kiln.kernels.cuda.triton, imported on first use (it imports triton)."""
    return importlib.import_module("kiln.kernels.cuda.triton")


def _same_dtype(inputs: list[InputMeta], indices: tuple[int, ...], what: str) -> bool | str:
    """The reference promotes mixed dtypes (fp16 · fp32 -> fp32); the kernels store in x's dtype."""
    x = inputs[0]
    for i in indices:
        p = _input(inputs, i)
        if p is not None and p.dtype != x.dtype:
            return f"{what} {i} is {p.dtype}, x is {x.dtype} (the reference would promote)"
    return True


def _broadcasts_to(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """Whether `shape` broadcasts to `target` as it is (without growing it)."""
    try:
        return tuple(torch.broadcast_shapes(shape, target)) == tuple(target)
    except RuntimeError:
        return False


# ---- linear layers -----------------------------------------------------------------------------

def _gemm_supports(step: StepSpec, inputs: list[InputMeta], activations: tuple[str, ...] | None) -> bool | str:
    x, w, b, residual = inputs[0], _input(inputs, 1), _input(inputs, 2), _input(inputs, 3)
    if not x.shape:
        return "x is a scalar"
    if w is None or len(w.shape) != 2 or w.shape[1] != x.shape[-1]:
        return f"w is not an [N, K={x.shape[-1]}] matrix"
    if w.dtype != x.dtype or (b is not None and b.dtype != x.dtype):
        return "x, w and bias do not share one dtype"
    if b is not None and math.prod(b.shape) != w.shape[0]:
        return f"bias of shape {list(b.shape)} is not one value per output column ({w.shape[0]})"
    activation = _attr(step, "activation", "")
    if activation == "SwiGLU":
        return "activation 'SwiGLU' halves the output's last dim: the default implementation gates it"
    if activations is not None and activation not in activations:
        return f"activation {activation!r} is not one the epilogue kernel applies"
    if residual is not None:
        out = (*x.shape[:-1], w.shape[0])
        if not _broadcasts_to(residual.shape, out):
            return f"residual of shape {list(residual.shape)} does not broadcast to the output {list(out)}"
    return True


def _epilogue_args(step: StepSpec, residual_after_default: int) -> dict[str, Any]:
    return {"activation": _attr(step, "activation", ""), "alpha": float(_attr(step, "alpha", 0.0)),
            "beta": float(_attr(step, "beta", 0.0)),
            "residual_after_activation": bool(_attr(step, "residual_after_activation", residual_after_default))}


def _prepare_gemm_cublas_triton_epilogue(step: StepSpec, constants: list[Any], device: torch.device):
    bias_activation = _kernels().bias_activation
    epilogue = _epilogue_args(step, 1)

    def launch(ctx, x, w, b=None, residual=None, **_attributes):
        y = F.linear(x, w)  # x: [..., K], w: [N, K] -> y: [..., N], a fresh dense tensor
        if b is None and residual is None and not epilogue["activation"]:
            return y
        return bias_activation(y, b, residual, axis=-1, inplace=True, **epilogue)

    return launch


def _prepare_gemm_addmm(step: StepSpec, constants: list[Any], device: torch.device):
    epilogue = _epilogue_args(step, 1)
    activation, after = epilogue["activation"], epilogue["residual_after_activation"]
    # cuBLASLt's GELU epilogue is the tanh approximation (torch CUDA too); torch CPU applies exact GELU.
    fused = {"Relu": False, **({"GeluTanh": True} if device.type == "cuda" else {})}
    # In fp16/bf16 the exact (erf) GELU may take it too: the two forms differ by at most 4.7e-4 (at
    # x = 2.70, where y = 2.69 and half an fp16 ulp is 1.3e-3), below the storage's own rounding.
    # Without it the GELU of BERT's FFN runs as a pass of its own (1.2 ms of BERT-base b64 on an H200).
    half_fused = {**fused, **({"Gelu": True} if device.type == "cuda" else {})}
    # A layer without bias (GPT-2's are zero at init and folded away) still takes the epilogue, on zeros.
    w = constants[1] if len(constants) > 1 else None
    zeros = torch.zeros(w.shape[0], dtype=w.dtype, device=device) if isinstance(w, torch.Tensor) else None

    if _attr(step, "output_float32", 0):
        def launch_float32(ctx, x, w, b=None, residual=None, **_attributes):
            # cuBLAS's half GEMM storing its fp32 accumulator (aten::mm.dtype), the epilogue in fp32 after it
            y2 = torch.mm(x.reshape(-1, x.shape[-1]), w.t(), out_dtype=torch.float32)  # [M, N] fp32
            if b is not None:
                y2 += b.reshape(-1)
            y = y2.view(*x.shape[:-1], w.shape[0])
            return _epilogue(y, residual, activation, epilogue["alpha"], epilogue["beta"], after)

        return launch_float32

    def launch(ctx, x, w, b=None, residual=None, **_attributes):
        x2 = x.reshape(-1, x.shape[-1])  # x2: [M, K]
        wt = w.t()  # [K, N], a view: cuBLAS reads it transposed
        act = activation
        fusable = half_fused if x.dtype in _HALF else fused
        if b is None and act in fusable and zeros is not None and zeros.dtype == x.dtype:
            b = zeros
        if b is not None and act in fusable and (residual is None or after):
            y2 = torch._addmm_activation(b.reshape(-1), x2, wt, use_gelu=fusable[act])  # act(x·wᵀ + b), one call
            act = ""
        elif b is not None:
            y2 = torch.addmm(b.reshape(-1), x2, wt)
        else:
            y2 = torch.mm(x2, wt)
        y = y2.view(*x.shape[:-1], w.shape[0])  # [..., N]
        return _epilogue(y, residual, act, epilogue["alpha"], epilogue["beta"], after)

    return launch


def mm_stores_float32() -> bool:
    """Whether this torch has aten::mm.dtype (a half GEMM storing fp32: CUDA, torch >= 2.8)."""
    return "dtype" in torch.ops.aten.mm.overloads()


def _addmm_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    if _attr(step, "output_float32", 0) and not mm_stores_float32():
        return "this torch has no aten::mm.dtype: cuBLAS cannot store the fp32 output directly"
    return _gemm_supports(step, inputs, None)


def padded_tile(block: int, size: int) -> bool:
    """A tile more than twice the next power of two above `size` (and past 16) is mostly padding: the Triton
    tactics of GEMMs, gated GEMMs, convolutions and their quantized forms refuse such a tile."""
    return block > max(16, 1 << max(size - 1, 0).bit_length())


def _gemm_rows(inputs: list[InputMeta]) -> int:
    return math.prod(inputs[0].shape[:-1])  # x: [..., K] -> M rows


def _triton_gemm_tactic(block_m: int, block_n: int, block_k: int, num_warps: int, num_stages: int, level: int):
    name = f"cuda.gemm.triton.{block_m}x{block_n}x{block_k}"

    def supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
        common = _gemm_supports(step, inputs, _TRITON_ACTIVATIONS)
        if common is not True:
            return common
        rows = _gemm_rows(inputs)
        if padded_tile(block_m, rows):
            return f"{block_m}-row tiles for {rows} rows: mostly padding"
        return True

    def prepare(step: StepSpec, constants: list[Any], device: torch.device):
        kernels = _kernels()
        config = kernels.GemmConfig(block_m, block_n, block_k, num_warps=num_warps, num_stages=num_stages)
        epilogue = _epilogue_args(step, 1)
        out_dtype = torch.float32 if _attr(step, "output_float32", 0) else None

        def launch(ctx, x, w, b=None, residual=None, **_attributes):
            # [..., N], epilogue in registers
            return kernels.gemm(x, w, b, residual, config=config, out_dtype=out_dtype, **epilogue)

        return launch

    return Tactic(
        name=name, op_type="FusedGemm", domain="kiln", device="cuda", dtypes=_HALF, supports=supports,
        prepare=prepare, level=level, available=triton_available, float32_output=True,
        description=f"Triton GEMM, {block_m}x{block_n}x{block_k} tiles, {num_warps} warps, {num_stages} stages, "
                    "bias/activation/residual applied to the tile before its one store",
    )


register(Tactic(
    name="cuda.gemm.cublas_triton_epilogue", op_type="FusedGemm", domain="kiln", device="cuda", dtypes=_FLOAT,
    supports=lambda step, inputs: _gemm_supports(step, inputs, _TRITON_ACTIVATIONS),
    prepare=_prepare_gemm_cublas_triton_epilogue, available=triton_available,
    description="cuBLAS GEMM without bias, then bias + activation + residual as one Triton kernel in place",
))
register(Tactic(
    name="cuda.gemm.cublas_addmm_act", op_type="FusedGemm", domain="kiln", device="cuda", dtypes=_FLOAT,
    supports=_addmm_supports, prepare=_prepare_gemm_addmm, float32_output=True,
    description="torch.addmm (bias in the GEMM); ReLU / tanh-GELU through torch._addmm_activation's cuBLASLt "
                "epilogue; any other epilogue in place after it",
))
# A modest candidate list (the full GEMM_CONFIGS at opt_level 3): large tiles for big M, a
# middle one, and 16-row tiles for batch-1 and decode-sized M.
for _config, _level in (((128, 128, 64, 8, 3), 2), ((64, 128, 32, 4, 4), 2), ((16, 64, 64, 2, 4), 2),
                        ((128, 256, 64, 8, 3), 3)):
    register(_triton_gemm_tactic(*_config, level=_level))


# ---- convolution -------------------------------------------------------------------------------

_CONV_ATTRIBUTES = ("auto_pad", "dilations", "group", "kernel_shape", "pads", "strides")


def _conv_only(step: StepSpec) -> dict[str, Any]:
    """The convolution's own attributes (no epilogue), as fused_conv takes them."""
    return {k: step.attributes[k] for k in _CONV_ATTRIBUTES if step.attributes.get(k) is not None}


def _conv_supports(step: StepSpec, inputs: list[InputMeta], epilogue_kernel: bool) -> bool | str:
    x, w, b, residual = inputs[0], _input(inputs, 1), _input(inputs, 2), _input(inputs, 3)
    if x.shape is None or len(x.shape) != 4:
        return "only 2-D convolutions (4-D input) have a channels-last layout"
    if w is None or not w.constant or len(w.shape) != 4:
        return "the weight is not a constant 4-D tensor of the engine"
    if w.dtype != x.dtype:
        return f"weight dtype {w.dtype} differs from input dtype {x.dtype}"
    if not epilogue_kernel:
        return True
    if b is not None and (b.dtype != x.dtype or math.prod(b.shape) != w.shape[0]):
        return f"bias {b.dtype}{list(b.shape)} is not one {x.dtype} value per output channel ({w.shape[0]})"
    if _attr(step, "activation", "") not in _TRITON_ACTIVATIONS:
        return f"activation {_attr(step, 'activation', '')!r} is not one the epilogue kernel applies"
    if residual is not None:
        meta = [torch.empty(s.shape, device="meta", dtype=s.dtype) for s in (x, w)]
        out = tuple(fused_conv(None, *meta, **_conv_only(step)).shape)  # shape inference only
        if not _broadcasts_to(residual.shape, out):
            return f"residual of shape {list(residual.shape)} does not broadcast to the output {list(out)}"
    return True


def _prepare_conv_channels_last(step: StepSpec, constants: list[Any], device: torch.device):
    w_cl = constants[1].contiguous(memory_format=_CL)  # [Cout, Cin/g, kh, kw] in NHWC order, once

    def launch(ctx, x, w=None, b=None, residual=None, **attributes):
        x = x.contiguous(memory_format=_CL)  # x: [N, C, H, W] channels-last; no copy when it already is
        return fused_conv(ctx, x, w_cl, b, residual, **attributes)

    return launch


def _prepare_conv_triton_epilogue(step: StepSpec, constants: list[Any], device: torch.device):
    bias_activation = _kernels().bias_activation
    w_cl = constants[1].contiguous(memory_format=_CL)
    conv, epilogue = _conv_only(step), _epilogue_args(step, 0)

    def launch(ctx, x, w=None, b=None, residual=None, **_attributes):
        y = fused_conv(ctx, x.contiguous(memory_format=_CL), w_cl, None, None, **conv)  # [N, Cout, H', W'] NHWC
        if b is None and residual is None and not epilogue["activation"]:
            return y
        return bias_activation(y, b, residual, axis=1, inplace=True, **epilogue)

    return launch


register(Tactic(
    name="cuda.conv.channels_last", op_type="FusedConv", domain="kiln", device="cuda", dtypes=_FLOAT,
    supports=lambda step, inputs: _conv_supports(step, inputs, epilogue_kernel=False),
    prepare=_prepare_conv_channels_last, layout="channels_last",
    description="cuDNN convolution on channels-last activations and weights, epilogue by torch in place",
))
register(Tactic(
    name="cuda.conv.channels_last_triton_epilogue", op_type="FusedConv", domain="kiln", device="cuda",
    dtypes=_FLOAT, supports=lambda step, inputs: _conv_supports(step, inputs, epilogue_kernel=True),
    prepare=_prepare_conv_triton_epilogue, layout="channels_last", available=triton_available,
    description="cuDNN convolution (channels-last, no bias), then bias + residual + activation as one Triton kernel",
))


def _patchify_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    x, w = inputs[0], _input(inputs, 1)
    if x.shape is None or len(x.shape) != 4 or w is None or not w.constant or len(w.shape) != 4:
        return "not a 2-D convolution with a constant weight"
    if w.dtype != x.dtype:
        return f"weight dtype {w.dtype} differs from input dtype {x.dtype}"
    kernel = list(_attr(step, "kernel_shape", w.shape[2:]))
    strides = list(_attr(step, "strides", [1, 1]))
    if strides != kernel:
        return f"strides {strides} differ from the kernel {kernel}: the windows overlap or skip"
    if any(d != 1 for d in _attr(step, "dilations", [1, 1])) or int(_attr(step, "group", 1)) != 1:
        return "dilated or grouped"
    if any(_attr(step, "pads", [0, 0, 0, 0])) or _attr(step, "auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
        return "padded"
    if _attr(step, "activation", "") not in ("", "Relu", "Gelu", "GeluTanh", "Sigmoid", "SiLU", "Tanh"):
        return f"activation {_attr(step, 'activation', '')!r}"
    residual = _input(inputs, 3)
    out = (x.shape[0], w.shape[0], x.shape[2] // kernel[0], x.shape[3] // kernel[1])
    if residual is not None and tuple(residual.shape) != out:
        return f"residual {list(residual.shape)} is not the output's shape {list(out)}"
    return True


def _prepare_patchify(step: StepSpec, constants: list[Any], device: torch.device):
    w = constants[1]
    cout, cin, kh, kw = w.shape
    w2t = w.reshape(cout, cin * kh * kw).t()  # [C·kh·kw, Cout] as a view: cuBLAS reads it transposed
    epilogue = _epilogue_args(step, 0)

    def launch(ctx, x, w=None, b=None, residual=None, **_attributes):
        n, c, h, wd = x.shape
        ho, wo = h // kh, wd // kw
        x = x[:, :, :ho * kh, :wo * kw]  # a trailing partial window is not convolved
        patches = x.reshape(n, c, ho, kh, wo, kw).permute(0, 2, 4, 1, 3, 5).reshape(n * ho * wo, c * kh * kw)
        y2 = torch.addmm(b.reshape(-1), patches, w2t) if b is not None else torch.mm(patches, w2t)
        y = y2.view(n, ho, wo, cout).permute(0, 3, 1, 2)  # [N, Cout, Ho, Wo], channels-last strides: no copy
        return _epilogue(y, residual, epilogue["activation"], epilogue["alpha"], epilogue["beta"],
                         epilogue["residual_after_activation"])

    return launch


register(Tactic(
    name="cuda.conv.patchify_gemm", op_type="FusedConv", domain="kiln", device="cuda", dtypes=_FLOAT,
    supports=_patchify_supports, prepare=_prepare_patchify,
    description="a convolution whose stride equals its kernel (ViT's patch embedding) as one copy of the patches "
                "and one cuBLAS GEMM with the bias; the output is channels-last",
))


# ---- attention ---------------------------------------------------------------------------------

def _attention_layout(step: StepSpec, inputs: list[InputMeta]) -> tuple[torch.Tensor, ...]:
    """q, k, v as SDPA sees them ([B, H, S, D], meta tensors): kiln::Attention's layout handling."""
    meta = [torch.empty(x.shape, device="meta", dtype=x.dtype) if x.shape is not None else None
            for x in inputs[:3]] + [None] * (3 - min(len(inputs), 3))
    q, k, v = meta
    qkv_split = _attr(step, "qkv_split", None)
    if qkv_split:
        q, k, v = torch.split(q, list(qkv_split), dim=-1)
    q_heads, kv_heads = int(_attr(step, "q_num_heads", 0)), int(_attr(step, "kv_num_heads", 0))
    q = q.unflatten(-1, (q_heads, -1)) if q_heads and q.dim() == 3 else q
    k = k.unflatten(-1, (kv_heads, -1)) if kv_heads and k.dim() == 3 else k
    v = v.unflatten(-1, (kv_heads, -1)) if kv_heads and v.dim() == 3 else v
    q, k, v = (t.permute(list(p)) if (p := _attr(step, name, None)) else t
               for t, name in ((q, "q_perm"), (k, "k_perm"), (v, "v_perm")))
    return q, k, v


_QUANT_ATTRIBUTES = ("q_quant", "k_quant", "v_quant", "score_quant", "prob_quant", "out_quant")


def _sdpa_supports(backend: str):
    def supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
        if any(_attr(step, name, None) for name in _QUANT_ATTRIBUTES):
            return "a quantized attention (8-bit inputs or quantized scores): SDPA has no such form"
        if any(_input(inputs, i) is None for i in range(1 if _attr(step, "qkv_split", None) else 3)):
            return "q, k or v is not a tensor"
        try:
            q, k, v = _attention_layout(step, inputs)
        except (RuntimeError, ValueError, TypeError, IndexError) as e:
            return f"q/k/v layout does not resolve: {e}"
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
            return f"q/k/v are not [B, H, S, D] after the layout (ranks {q.dim()}, {k.dim()}, {v.dim()})"
        mask = _input(inputs, 3)
        head_dim = q.shape[-1]
        if backend == "flash" and mask is not None:
            return "flash attention takes no mask tensor"
        if backend == "cudnn" and mask is not None and not mask.dtype.is_floating_point:
            return f"cuDNN attention takes an additive float mask, given {mask.dtype}"
        if backend in ("flash", "cudnn"):
            if head_dim % 8 or head_dim > (256 if backend == "flash" else 128) or v.shape[-1] != head_dim:
                return f"head dim {head_dim} (v {v.shape[-1]}): {backend} wants equal dims, a multiple of 8, " \
                       f"at most {256 if backend == 'flash' else 128}"
            if _attr(step, "is_causal", 0) and mask is None and q.shape[-2] != k.shape[-2]:
                return f"causal with {q.shape[-2]} queries and {k.shape[-2]} keys: {backend} aligns the " \
                       "triangle bottom-right, kiln top-left"
        if backend == "efficient" and head_dim % 8 and q.dtype != torch.float32:
            return f"head dim {head_dim} is not a multiple of 8"
        return True  # anything torch still refuses fails the build-time check, with its message

    return supports


def _prepare_sdpa(backend: Any):
    def prepare(step: StepSpec, constants: list[Any], device: torch.device):
        from torch.nn.attention import sdpa_kernel

        def launch(ctx, *inputs, **attributes):
            with sdpa_kernel([backend]):  # a thread-local switch, nothing launched: safe in capture
                return attention(ctx, *inputs, **attributes)

        return launch

    return prepare


def _sdpa_backend(name: str) -> Any:
    from torch.nn.attention import SDPBackend
    return getattr(SDPBackend, name, None)


for _short, _backend, _dtypes in (("flash", "FLASH_ATTENTION", _HALF), ("efficient", "EFFICIENT_ATTENTION", _FLOAT),
                                  ("cudnn", "CUDNN_ATTENTION", _HALF)):
    register(Tactic(
        name=f"cuda.attention.{_short}", op_type="Attention", domain="kiln", device="cuda", dtypes=_dtypes,
        supports=_sdpa_supports(_short), prepare=_prepare_sdpa(_sdpa_backend(_backend)),
        available=lambda _b=_backend: _sdpa_backend(_b) is not None,
        description=f"torch SDPA with the {_backend} backend forced",
    ))
