"""CPU tactic: a 1x1 convolution as oneDNN's inner product over its NHWC rows.

    cpu.conv.onednn_rows   kiln::FusedConv with a 1x1 kernel, stride 1, no padding, one group: the NHWC activation
                           [N, H, W, C] is the row-major matrix [N·H·W, C], so the layer is one inner-product
                           primitive [N·H·W, C] x [O, C]ᵀ (bias, activation and residual as post-ops), built at load,
                           runnable inside native segments

Why: at 2 threads oneDNN 3.2's convolution kernels (brgconv_1x1 and jit_1x1 alike) run most of DenseNet-121's 1x1
layers (128 outputs; 28x28 from 128 to 256 inputs, 14x14 and 7x7 at every width) on the calling thread alone: with
OpenMP's waits passive (a waiting thread sleeps, so CPU time is work) the caller's CPU time a call is the same at 1
and 2 threads and the process's equals it, the second thread did nothing; splitting the image into two images of
half its height changes nothing (the kernel chooses one thread, not too few work items). The inner product on the
same rows splits them over both threads (caller's CPU 1.6-1.9x less at 2 threads) for ~0-5% more CPU time at one
thread (bench/conv_rows_split.py, bench/results/zoo-2threads-zen4-2026-12-07d.md). The autotuner times it beside
cpu.conv.onednn_direct: by the wall clock where the build has the cores (it wins where the convolution stays on
one thread), by the process's CPU time where other work shares them (then the two cost about the same and either
may be kept).

Other input sizes (a profile's batches) get an inner product for their row count, on the tuned one's packed
weight where oneDNN takes its layout (onednn_primitives.InnerProduct weight_from), kept per layer like the
convolution's (_CACHED_SHAPES). No accumulating variant: a residual is read as a binary post-op.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from kiln.kernels.cpu import onednn, onednn_primitives
from kiln.plan.spec import StepSpec
from kiln.tactics.cpu.onednn import _built, _configure, _eltwise, _supports
from kiln.tactics.registry import register
from kiln.tactics.tactic import InputMeta, NativeStep, Tactic, conv_geometry, resizable, same_primitive
from kiln.tactics.tactic import attribute as _attr

_CL = torch.channels_last


def pointwise_refusal(step: StepSpec, w_shape: tuple[int, ...]) -> str | None:
    """Why the convolution is not a GEMM over its NHWC rows (1x1 kernel, stride 1, no padding, one group), or None."""
    if int(_attr(step, "group", 1)) != 1:
        return f"{int(_attr(step, 'group', 1))} groups: one group only (the rows' GEMM)"
    if tuple(w_shape[2:]) != (1, 1):
        return f"kernel {list(w_shape[2:])}: 1x1 only (the rows of an NHWC activation)"
    geometry = conv_geometry(step, w_shape)
    if isinstance(geometry, str):
        return geometry
    pads, strides, _dilations = geometry
    if list(strides) != [1, 1]:
        return f"strides {list(strides)}: stride 1 only"
    if any(pads):
        return f"pads {list(pads)}: no padding only"
    return None


def _supports_rows(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    ok = _supports(step, inputs)
    if ok is not True:
        return ok
    if (refusal := pointwise_refusal(step, tuple(inputs[1].shape))) is not None:
        return refusal
    if _attr(step, "final_activation", ""):
        return "a final activation after the residual: the inner product's epilogue has one activation"
    return True


def _prepare_rows(step: StepSpec, constants: list[Any], device: torch.device):
    w = constants[1]
    b = constants[2] if len(constants) > 2 else None
    o, c = int(w.shape[0]), int(w.shape[1])
    w_rows = w.reshape(o, c)  # [O, C, 1, 1] -> [O, C]
    eltwise = _eltwise(step)
    with_residual = bool(step.tactic_config.get("residual"))
    after = bool(_attr(step, "residual_after_activation", 0))
    tuned = tuple(step.tactic_config["input_size"])

    def rows_of(size: tuple[int, ...]) -> int:
        if len(size) != 4 or size[1] != c:
            raise ValueError(f"a 1x1 convolution of {c} input channels, given {list(size)}")
        return int(size[0]) * int(size[2]) * int(size[3])

    primitives: dict[int, onednn_primitives.InnerProduct] = {}
    lock = threading.Lock()  # one primitive's memory objects are rebound per call (two contexts of one engine)

    def build(rows: int) -> onednn_primitives.InnerProduct:
        # another row count reads the tuned layer's packed weight where oneDNN takes its layout
        return onednn_primitives.InnerProduct(w_rows, b, rows, eltwise, with_residual, after,
                                              weight_from=primitives.get(rows_of(tuned)))

    primitives[rows_of(tuned)] = build(rows_of(tuned))

    def layer_at(size: tuple[int, ...]) -> onednn_primitives.InnerProduct:
        with lock:
            return _built(primitives, rows_of(size), build, lambda rows: rows == rows_of(tuned))

    def launch(ctx, x, w_=None, b_=None, residual=None, **_attributes):
        n, _, h, wd = x.shape
        x_rows = x.contiguous(memory_format=_CL).permute(0, 2, 3, 1).reshape(n * h * wd, c)  # [N·H·W, C], a view
        layer = layer_at(tuple(x.shape))
        with lock:
            if with_residual:
                r_rows = residual.contiguous(memory_format=_CL).permute(0, 2, 3, 1).reshape(n * h * wd, o)
                y = layer(x_rows, r_rows)
            else:
                y = layer(x_rows)  # [N·H·W, O]
        return y.reshape(n, h, wd, o).permute(0, 3, 1, 2)  # [N, O, H, W] channels-last

    @resizable

    def native_at(size: tuple[int, ...]) -> NativeStep:  # NHWC in and out: the rows the inner product reads, writes
        return NativeStep(tuple(size), (size[0], o, size[2], size[3]), same_primitive(layer_at(tuple(size))),
                          residual_input=3 if with_residual else None)

    launch.native = native_at(tuned)
    return launch


register(Tactic(
    name="cpu.conv.onednn_rows", op_type="FusedConv", domain="kiln", device="cpu", dtypes=(torch.float32,),
    supports=_supports_rows, configure=_configure, prepare=_prepare_rows, layout="channels_last",
    available=onednn.available, native=True,
    description="1x1 convolution as oneDNN's inner product over the NHWC rows, built at load: splits over the "
                "threads where oneDNN's 1x1 convolution kernels keep one",
))
