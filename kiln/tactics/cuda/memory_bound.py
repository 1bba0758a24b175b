"""CUDA tactics for the memory-bound layers on kiln's Triton kernels: one pass over memory, fp32 math.

    cuda.elementwise.triton   kiln::Elementwise: the whole chain as one generated kernel
    cuda.layer_norm.triton    kiln::LayerNorm (+ residual, the sum as 2nd output); .onnx: LayerNormalization
    cuda.rms_norm.triton      kiln::RMSNorm, ai.onnx RMSNormalization
    cuda.softmax.triton       kiln::Softmax, ai.onnx Softmax / LogSoftmax over the last axis

Triton is imported when a tactic is prepared, not here (as in library.py). Under TRITON_INTERPRET=1 they run on
CPU tensors (tests/unit/test_tactics_cuda.py).
"""

from __future__ import annotations

from typing import Any

import torch

from kiln.ir import dtypes
from kiln.ops.fused import dequantized_inputs

from kiln.plan.spec import StepSpec
from kiln.tactics.cuda.library import _FLOAT, _broadcasts_to, _kernels, _same_dtype, triton_available
from kiln.tactics.registry import register
from kiln.tactics.tactic import InputMeta, Tactic
from kiln.tactics.tactic import attribute as _attr
from kiln.tactics.tactic import tensor_input as _input


def _float_inputs(inputs: list[InputMeta], fp8: set[int] = frozenset()) -> bool | str:
    """Float inputs only; those in `fp8` may also be E4M3 (an Elementwise's Dequantize operands)."""
    for k, x in enumerate(inputs):
        if x.shape is not None and x.dtype not in _FLOAT and not (k in fp8 and x.dtype == torch.float8_e4m3fn):
            dtype = str(x.dtype).removeprefix("torch.")
            return f"input {k} is {dtype}: the Triton kernel reads float16/bfloat16/float32"
    return True


# ---- elementwise chains ------------------------------------------------------------------------

def _elementwise_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    from kiln.kernels.cuda.triton.elementwise import parse_program
    floats = _float_inputs(inputs, dequantized_inputs(list(_attr(step, "code", []))))
    if floats is not True:
        return floats
    if any(x.shape is None for x in inputs):
        return "an input is not a tensor"
    try:
        parse_program(list(_attr(step, "code", [])), len(inputs))
    except ValueError as e:
        return str(e)
    return True


def _prepare_elementwise(step: StepSpec, constants: list[Any], device: torch.device):
    output_dtype = step.attributes.get("output_dtype")  # a program with Dequantize lines (its scales float32)
    kernel = _kernels().compile_elementwise(list(step.attributes["code"]), len(step.inputs),
                                            dtypes.from_onnx(output_dtype).torch if output_dtype else None)

    def launch(ctx, *inputs, **_attributes):
        return kernel(*inputs)  # one read of each input, one write, the chain in fp32 registers

    return launch


register(Tactic(
    # E4M3 too: a chain of one dequantized input (Gelu(DQ(q))) has it first; _elementwise_supports admits E4M3
    # only where a Dequantize line reads it
    name="cuda.elementwise.triton", op_type="Elementwise", domain="kiln", device="cuda",
    dtypes=_FLOAT + (torch.float8_e4m3fn,),
    supports=_elementwise_supports, prepare=_prepare_elementwise, available=triton_available,
    description="the elementwise chain as one generated Triton kernel (fp32 math, one pass over memory)",
))


# ---- normalisation and softmax -----------------------------------------------------------------

def _norm_axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


def _params_fit(inputs: list[InputMeta], indices: tuple[int, ...], shape: tuple[int, ...]) -> bool | str:
    """scale/bias must broadcast to the normalised dims alone (the kernel indexes them by column)."""
    for i in indices:
        p = _input(inputs, i)
        if p is None:
            continue
        if len(p.shape) > len(shape):
            return f"input {i} of shape {list(p.shape)} has more dims than the normalised {list(shape)}"
        if not _broadcasts_to(p.shape, shape):
            return f"input {i} of shape {list(p.shape)} does not broadcast to the normalised dims {list(shape)}"
    return True


def _first_of(*checks) -> bool | str:
    for check in checks:
        result = check()
        if result is not True:
            return result
    return True


def _layer_norm_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    x, residual = inputs[0], _input(inputs, 3)
    if not x.shape:
        return "x is a scalar"
    s_shape = tuple(x.shape)
    if residual is not None:
        try:
            s_shape = tuple(torch.broadcast_shapes(x.shape, residual.shape))
        except RuntimeError:
            return f"residual {list(residual.shape)} does not broadcast with x {list(x.shape)}"
    axis = _norm_axis(int(_attr(step, "axis", -1)), len(s_shape))
    return _first_of(lambda: _same_dtype(inputs, (1, 2, 3), "input"),
                     lambda: _params_fit(inputs, (1, 2), s_shape[axis:]))


def _prepare_layer_norm(step: StepSpec, constants: list[Any], device: torch.device):
    kernels = _kernels()
    axis, epsilon = int(_attr(step, "axis", -1)), float(_attr(step, "epsilon", 1e-5))

    def launch(ctx, x, scale=None, bias=None, residual=None, **_attributes):
        # skip-LayerNorm: s = x + residual formed in the kernel's pass over the row, also the 2nd output
        return kernels.layer_norm(x, scale, bias, epsilon, axis=axis, residual=residual,
                                  return_sum=ctx.num_outputs == 2)

    return launch


def _onnx_layer_norm_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    if len(step.outputs) != 1:
        return "Mean / InvStdDev outputs are asked for"
    if int(_attr(step, "stash_type", 1)) != 1:
        return "stash_type is not float32"
    x = inputs[0]
    if not x.shape:
        return "x is a scalar"
    axis = _norm_axis(int(_attr(step, "axis", -1)), len(x.shape))
    return _first_of(lambda: _same_dtype(inputs, (1, 2), "input"),
                     lambda: _params_fit(inputs, (1, 2), tuple(x.shape[axis:])))


def _prepare_onnx_layer_norm(step: StepSpec, constants: list[Any], device: torch.device):
    kernels = _kernels()
    axis, epsilon = int(_attr(step, "axis", -1)), float(_attr(step, "epsilon", 1e-5))

    def launch(ctx, x, scale, bias=None, **_attributes):
        return kernels.layer_norm(x, scale, bias, epsilon, axis=axis)

    return launch


def _rms_norm_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    if step.domain == "" and int(_attr(step, "stash_type", 1)) != 1:
        return "stash_type is not float32"
    x = inputs[0]
    if not x.shape:
        return "x is a scalar"
    axis = _norm_axis(int(_attr(step, "axis", -1)), len(x.shape))
    return _first_of(lambda: _same_dtype(inputs, (1,), "input"),
                     lambda: _params_fit(inputs, (1,), tuple(x.shape[axis:])))


def _prepare_rms_norm(step: StepSpec, constants: list[Any], device: torch.device):
    kernels = _kernels()
    axis = int(_attr(step, "axis", -1))
    epsilon = float(_attr(step, "epsilon", 1e-6 if step.domain == "kiln" else 1e-5))

    def launch(ctx, x, scale=None, **_attributes):
        return kernels.rms_norm(x, scale, epsilon, axis=axis)

    return launch


def _softmax_axis(step: StepSpec, rank: int) -> int:
    """The softmax axis; ai.onnx before opset 13 defaults to 1 and flattens from it (the same as
    a single-axis softmax when that axis is the last)."""
    axis = step.attributes.get("axis")
    if axis is None:
        axis = -1 if step.domain == "kiln" or step.opset >= 13 else 1
    return _norm_axis(int(axis), rank)


def _softmax_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    x = inputs[0]
    if not x.shape:
        return "x is a scalar"
    axis = _softmax_axis(step, len(x.shape))
    if axis != len(x.shape) - 1:
        return f"axis {axis} is not the last of rank {len(x.shape)} (the kernel walks rows)"
    return True


def _prepare_softmax(step: StepSpec, constants: list[Any], device: torch.device):
    kernels = _kernels()
    log = step.op_type == "LogSoftmax"

    def launch(ctx, x, **_attributes):
        return kernels.softmax(x, -1, log=log)

    return launch


for _op, _domain in (("LayerNorm", "kiln"), ("LayerNormalization", "")):
    register(Tactic(
        name="cuda.layer_norm.triton" + ("" if _domain else ".onnx"), op_type=_op, domain=_domain, device="cuda",
        dtypes=_FLOAT, available=triton_available,
        supports=_layer_norm_supports if _domain else _onnx_layer_norm_supports,
        prepare=_prepare_layer_norm if _domain else _prepare_onnx_layer_norm,
        description="one row per program, fp32 statistics, scale and bias applied before the one store",
    ))
for _op, _domain in (("RMSNorm", "kiln"), ("RMSNormalization", "")):
    register(Tactic(
        name="cuda.rms_norm.triton" + ("" if _domain else ".onnx"), op_type=_op, domain=_domain, device="cuda",
        dtypes=_FLOAT, supports=_rms_norm_supports, prepare=_prepare_rms_norm, available=triton_available,
        description="one row per program, fp32 statistics, scale applied before the one store",
    ))
for _op, _domain in (("Softmax", "kiln"), ("Softmax", ""), ("LogSoftmax", "")):
    register(Tactic(
        name="cuda.softmax.triton" + ("" if _domain else f".onnx_{_op.lower()}"), op_type=_op, domain=_domain,
        device="cuda", dtypes=_FLOAT, supports=_softmax_supports, prepare=_prepare_softmax,
        available=triton_available, description="one row per program (online max/sum for long rows), fp32 math",
    ))
