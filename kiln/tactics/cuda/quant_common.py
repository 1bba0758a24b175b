"""What kiln's CUDA tactics for quantized layers share (quant_gemm.py, quant_conv.py, quant_add.py).

    check_layer(step, inputs, w_rank)   the contract's constants are constants, dtypes a kernel takes
    QuantizedLayer.of(step, constants)  the layer's parameters read once, at prepare, on the host
    integer_epilogue / real_epilogue    what the requantizing epilogue applies (kernels' qgemm.Epilogue)
    check_residual / Residual.of        a QConv's residual add (inputs 9-13, fusion/qdq_residual.py)

Every parameter of a quantized layer (scales, zero points, weights, bias) is a constant of the engine
(the Q/DQ fusion makes them so), so a launch reads none of them from the device: no host sync, and
the epilogue's per-channel vectors are built once. Triton is imported at prepare, not here.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from kiln.plan.spec import StepSpec
from kiln.tactics.tactic import InputMeta
from kiln.tactics.tactic import attribute as _attr
from kiln.tactics.tactic import tensor_input as _input

FP8 = torch.float8_e4m3fn
INT8_INPUTS = (torch.int8, torch.uint8)
QUANTIZED = (torch.int8, torch.uint8, FP8)
FLOAT_OUTPUTS = {1: torch.float32, 10: torch.float16, 16: torch.bfloat16}  # output_dtype (ONNX enum) -> torch
ACTIVATIONS = ("", "Relu", "Clip")
GEMM_ACTIVATIONS = ACTIVATIONS + ("Gelu", "GeluTanh")  # a QGemm's epilogue (no prescaled kernel there)
_CONSTANTS = ((1, "x_scale"), (2, "x_zero_point"), (3, "w"), (4, "w_scale"), (5, "w_zero_point"))


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def kernels(name: str) -> ModuleType:
    """kiln.kernels.cuda.triton.<name>, imported on first use (it imports triton)."""
    return importlib.import_module(f"kiln.kernels.cuda.triton.{name}")


def name_of(dtype: torch.dtype | None) -> str:
    return str(dtype).removeprefix("torch.")


def output_dtype(step: StepSpec, inputs: list[InputMeta]) -> torch.dtype | str:
    """The layer's output dtype: y_zero_point's when y_scale is given, else the float `output_dtype`."""
    y_scale, y_zero = _input(inputs, 6), _input(inputs, 7)
    if y_scale is not None:
        if not y_scale.constant or y_zero is None or not y_zero.constant:
            return "the output scale and zero point are not constants of the engine"
        if y_zero.dtype not in QUANTIZED:
            return f"output type {name_of(y_zero.dtype)}: the epilogue writes int8, uint8 or float8e4m3fn"
        return y_zero.dtype
    kind = int(_attr(step, "output_dtype", 1) or 1)
    if kind not in FLOAT_OUTPUTS:
        return f"float output type {kind} (ONNX enum): the epilogue writes float32, float16 or bfloat16"
    return FLOAT_OUTPUTS[kind]


def check_layer(step: StepSpec, inputs: list[InputMeta], w_rank: int,
                activations: tuple[str, ...] = ACTIVATIONS) -> bool | str:
    """What every CUDA kernel of a QConv (w_rank 4) / QGemm (w_rank 2, GEMM_ACTIVATIONS) needs."""
    for i, name in _CONSTANTS:
        if i >= len(inputs) or inputs[i].shape is None or not inputs[i].constant:
            return f"{name} is not a constant of the engine"
    x, x_scale, x_zero, w, w_scale = inputs[0], inputs[1], inputs[2], inputs[3], inputs[4]
    fp8 = x.dtype == FP8
    if w.dtype != (FP8 if fp8 else torch.int8):
        return f"{name_of(x.dtype)} activations with {name_of(w.dtype)} weights: the kernels multiply int8 by " \
               "int8 or float8e4m3fn by float8e4m3fn"
    if x_zero.dtype != x.dtype:
        return f"x's zero point is {name_of(x_zero.dtype)}, x is {name_of(x.dtype)}"
    if len(w.shape) != w_rank:
        return f"the weight is {len(w.shape)}-D, not {w_rank}-D"
    if _numel(x_scale.shape) != 1 or _numel(x_zero.shape) != 1:
        return "x is not quantized per tensor"
    if _numel(w_scale.shape) not in (1, w.shape[0]):
        return f"{_numel(w_scale.shape)} weight scales for {w.shape[0]} output channels"
    bias = _input(inputs, 8)
    if bias is not None and (not bias.constant or bias.dtype != torch.int32 or _numel(bias.shape) != w.shape[0]):
        return "the bias is not a constant int32 vector, one per output channel"
    out = output_dtype(step, inputs)
    if isinstance(out, str):
        return out
    if _attr(step, "activation", "") not in activations:
        return f"activation {_attr(step, 'activation', '')!r}"
    return True


def check_product(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    """What every CUDA tactic of a QGemm with its product quantized needs (True also when it is not): FP8
    operands, the product's scale and E4M3 zero point per-tensor constants, a constant float bias per column."""
    product_scale = _input(inputs, 9)
    if product_scale is None:
        return True
    product_zero = _input(inputs, 10)
    if inputs[0].dtype != FP8:
        return f"a quantized product (E4M3) after {name_of(inputs[0].dtype)} operands: the FP8 chain's only"
    if not product_scale.constant or product_zero is None or not product_zero.constant or \
            _numel(product_scale.shape) != 1 or _numel(product_zero.shape) != 1:
        return "the product's scale and zero point are not per-tensor constants of the engine"
    if product_zero.dtype != FP8:
        return f"the product is quantized to {name_of(product_zero.dtype)}: the epilogue rounds onto E4M3"
    bias = _input(inputs, 11)
    if bias is not None and (not bias.constant or bias.dtype not in FLOAT_OUTPUTS.values()
                             or _numel(bias.shape) != inputs[3].shape[0]):
        return "the product bias is not a constant float vector, one per output column"
    return True


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@dataclass(frozen=True)
class QuantizedLayer:
    """A QConv / QGemm's parameters as host numbers and device tensors, read once at prepare."""

    x_dtype: torch.dtype
    x_scale: float
    x_zero: int  # 0 for float8
    w: torch.Tensor  # int8 / float8 on the device, as the op stores it
    w_scale: torch.Tensor  # float64 [C] on the device (a per-tensor scale repeated)
    bias: torch.Tensor | None  # int32 [C] on the device
    out_dtype: torch.dtype
    y_scale: float
    y_zero: float
    activation: str
    alpha: float
    beta: float
    product_scale: float = 0.0  # a QGemm's quantized product (inputs 9-11), 0 when not quantized
    product_bias: torch.Tensor | None = None  # fp32 [N] on the device
    multiplier: float = 1.0

    @classmethod
    def of(cls, step: StepSpec, constants: list[Any], device: torch.device) -> QuantizedLayer:
        x_scale, x_zero, w, w_scale, w_zero = constants[1:6]
        if bool((w_zero.to(torch.float32) != 0).any()):
            raise ValueError(f"{step.name}: the weight's zero point is not 0 (the kernels take symmetric weights)")
        y_scale = constants[6] if len(constants) > 6 else None
        y_zero = constants[7] if len(constants) > 7 else None
        bias = constants[8] if len(constants) > 8 else None
        channels = w.shape[0]
        product = {}
        if step.op_type == "QGemm" and len(constants) > 9 and constants[9] is not None:
            product_bias = constants[11] if len(constants) > 11 else None
            product = dict(product_scale=float(constants[9].reshape(-1)[0]),
                           product_bias=None if product_bias is None else
                           product_bias.to(device=device, dtype=torch.float32).reshape(-1).contiguous(),
                           multiplier=float(_attr(step, "multiplier", 1.0)))
        if y_scale is not None:
            out = y_zero.dtype
        else:
            out = FLOAT_OUTPUTS[int(_attr(step, "output_dtype", 1) or 1)]
        return cls(
            x_dtype=x_zero.dtype, x_scale=float(x_scale.reshape(-1)[0]),
            x_zero=int(x_zero.reshape(-1)[0].to(torch.float32)), w=w.to(device),
            w_scale=w_scale.to(device=device, dtype=torch.float64).reshape(-1).expand(channels).contiguous(),
            bias=None if bias is None else bias.to(device).reshape(-1),
            out_dtype=out, y_scale=1.0 if y_scale is None else float(y_scale.reshape(-1)[0]),
            y_zero=0.0 if y_zero is None else float(y_zero.reshape(-1)[0].to(torch.float32)),
            activation=_attr(step, "activation", ""), alpha=float(_attr(step, "alpha", 0.0)),
            beta=float(_attr(step, "beta", 0.0)), **product)

    @property
    def quantized_product(self) -> bool:
        return self.product_scale > 0.0

    @property
    def fp8(self) -> bool:
        return self.x_dtype == FP8

    @property
    def channel_scale(self) -> torch.Tensor:
        """x_scale·w_scale[c] in float64, rounded once to fp32 (the reference's float64 product)."""
        return (self.w_scale * self.x_scale).to(torch.float32)

    def epilogue(self, scale: torch.Tensor, bias: torch.Tensor | None) -> Any:
        qgemm = kernels("qgemm")
        return qgemm.Epilogue(scale=scale.contiguous(), bias=bias, out_dtype=self.out_dtype, y_scale=self.y_scale,
                              y_zero=self.y_zero, activation=self.activation, alpha=self.alpha, beta=self.beta,
                              product_scale=self.product_scale, product_bias=self.product_bias,
                              multiplier=self.multiplier)

    def integer_epilogue(self) -> Any:
        """For kernels that multiply the 8-bit values themselves: int8 layers get the int32 bias with
        −x_zero·Σw folded in (the kernel sums x·w); FP8 layers the bias in fp32."""
        if self.fp8:
            bias = None if self.bias is None else self.bias.to(torch.float32)
        else:
            bias = kernels("qgemm").fold_zero_point(self.w, self.bias, self.x_zero, self.x_dtype)
            if self.bias is None and self.x_zero == (128 if self.x_dtype == torch.uint8 else 0):
                bias = None  # nothing to add: the kernel skips the load
        return self.epilogue(self.channel_scale, bias)

    def real_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """w·w_scale in `dtype` (the dequantized weight of a float layer), output channels first."""
        shape = (-1,) + (1,) * (self.w.dim() - 1)
        return (self.w.to(torch.float64) * self.w_scale.reshape(shape)).to(dtype)

    def real_epilogue(self) -> Any:
        """For a float layer on dequantized values: r is real already; the bias is added in fp32."""
        ones = torch.ones_like(self.w_scale, dtype=torch.float32)
        bias = None if self.bias is None else (self.bias.to(torch.float64) * self.w_scale * self.x_scale)
        return self.epilogue(ones, None if bias is None else bias.to(torch.float32))


# ---- a QConv's residual add (kiln/ops/quantized.py: inputs 9-13) -------------------------------------

INT8_OUTPUTS = (torch.int8, torch.uint8)


def check_residual(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    """What every CUDA tactic of a QConv with a residual needs (True also when there is none): the residual
    of the output's rank, its and the convolution's own quantization per-tensor constants, an 8-bit sum with
    Relu or none; int8/uint8 throughout, or float8e4m3fn throughout for an FP8 layer."""
    residual = _input(inputs, 9)
    if residual is None:
        return True
    for i, name in ((10, "residual_scale"), (11, "residual_zero_point"), (12, "conv_scale"),
                    (13, "conv_zero_point")):
        if i >= len(inputs) or inputs[i].shape is None or not inputs[i].constant or _numel(inputs[i].shape) != 1:
            return f"{name} is not a per-tensor constant of the engine"
    if inputs[0].dtype == FP8:  # an FP8 layer: c, the residual and the sum all E4M3
        kinds = {"the residual": residual.dtype, "its zero point": inputs[11].dtype,
                 "the convolution's own result": inputs[13].dtype, "the sum": output_dtype(step, inputs)}
        wrong = [f"{what} {name_of(k) if isinstance(k, torch.dtype) else k}" for what, k in kinds.items() if k != FP8]
        if wrong:
            return f"an FP8 layer's residual add takes float8e4m3fn throughout; {', '.join(wrong)}"
    else:
        if residual.dtype not in INT8_OUTPUTS or inputs[11].dtype != residual.dtype:
            return f"the residual is {name_of(residual.dtype)} (zero point {name_of(inputs[11].dtype)}), not int8/uint8"
        if inputs[13].dtype not in INT8_OUTPUTS:
            return f"the convolution's own result is {name_of(inputs[13].dtype)}, not int8/uint8"
        if output_dtype(step, inputs) not in INT8_OUTPUTS:
            return "the sum is not quantized to int8/uint8"
    if _attr(step, "activation", "") not in ("", "Relu"):
        return f"activation {_attr(step, 'activation', '')!r} after a residual add (Relu or none)"
    if len(residual.shape) != len(inputs[0].shape):
        return f"the residual is {len(residual.shape)}-D, the layer's output {len(inputs[0].shape)}-D"
    return True


@dataclass(frozen=True)
class Residual:
    """A QConv's residual add as host numbers, read at prepare: the convolution's own 8-bit result (conv_*)
    plus the residual (residual_*), then the layer's activation and output quantization (QuantizedLayer)."""

    conv_dtype: torch.dtype
    conv_scale: float
    conv_zero: float
    residual_scale: float
    residual_zero: float

    @classmethod
    def of(cls, constants: list[Any]) -> Residual | None:
        if len(constants) <= 13 or constants[10] is None:  # the residual (9) is an activation: not among them
            return None
        r_scale, r_zero, c_scale, c_zero = constants[10:14]

        def number(t: torch.Tensor) -> float:
            return float(t.reshape(-1)[0].to(torch.float32))

        return cls(conv_dtype=c_zero.dtype, conv_scale=number(c_scale), conv_zero=number(c_zero),
                   residual_scale=number(r_scale), residual_zero=number(r_zero))

    def convolution(self, layer: QuantizedLayer) -> QuantizedLayer:
        """The layer without its add: writes the convolution's own 8-bit result, no activation."""
        return dataclasses.replace(layer, out_dtype=self.conv_dtype, y_scale=self.conv_scale, y_zero=self.conv_zero,
                                   activation="", alpha=0.0, beta=0.0)

    def add(self, layer: QuantizedLayer) -> Any:
        """The kernel's qresidual.ResidualAdd: c (conv_*) + residual, the layer's activation and output."""
        return kernels("qresidual").ResidualAdd(self.conv_scale, self.conv_zero, self.residual_scale,
                                                self.residual_zero, layer.out_dtype, layer.y_scale, layer.y_zero,
                                                activation=layer.activation)
