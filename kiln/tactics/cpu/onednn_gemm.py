"""CPU linear-layer tactic on oneDNN's C API: cpu.gemm.onednn_direct, kiln::FusedGemm as one inner-product primitive
built at load (weight reordered once into the kernel's layout; bias, activation and residual as post-ops).

A primitive is built for the row count the layer was tuned at (tactic_config["input_size"]). Other row counts (a
profile's other shapes) bind without a new primitive where that measured as fast: small layers on kiln's packed
GEMM (OtherRows), large ones at few rows on one matmul primitive with a runtime row count made at load
(RuntimeRows, kiln/kernels/cpu/onednn_matmul.py); the rest on an inner product made for them, shared by the
layers of one shape (kiln/kernels/cpu/onednn_primitives.py). The rows on kiln's GEMM have a plan rule (NativeStep
.plan_at, kiln_rows_at): a native segment's view writes them into a kiln GEMM plan, and a walk of rules only is
traced (kiln/runtime/view_trace.py). The convolution, pooling and alias tactics are
onednn.py's.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any

import torch

from kiln.kernels.cpu import gemm_native, onednn, onednn_ahead, onednn_matmul, onednn_primitives
from kiln.plan.spec import StepSpec
from kiln.tactics.cpu.onednn import _CACHED_SHAPES, _built, _configure
from kiln.tactics.registry import register
from kiln.tactics.tactic import (InputMeta, NativeStep, PlanRule, PrimitiveRule, SizedPlan, SizedPrimitive, Tactic,
                                 gemm_operands_refusal, resizable, same_primitive)
from kiln.tactics.tactic import attribute as _attr


def _gemm_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    if not onednn.available():
        return "libdnnl.so.3 cannot be loaded"
    x = inputs[0]
    w = inputs[1] if len(inputs) > 1 else None
    b = inputs[2] if len(inputs) > 2 else None
    residual = inputs[3] if len(inputs) > 3 else None
    if x.shape is None or len(x.shape) not in (2, 3):
        return "only a matrix [M, K] or a batch of rows [B, S, K] (other ranks: cpu.gemm.*)"
    operands = gemm_operands_refusal(x, w, b)
    if operands is not None:
        return operands
    if _attr(step, "activation", "") == "SwiGLU":
        return "activation 'SwiGLU' halves the output: no post-op gates it"
    eltwise = onednn.eltwise_for(_attr(step, "activation", ""), _attr(step, "alpha", 0.0), _attr(step, "beta", 0.0))
    if isinstance(eltwise, str):
        return eltwise
    if residual is not None and residual.shape is not None:
        if list(residual.shape) != [*x.shape[:-1], w.shape[0]] or residual.dtype != torch.float32:
            return f"residual {list(residual.shape)} is not a float32 [..., N] like the output"
    return True


def _prepare_gemm(step: StepSpec, constants: list[Any], device: torch.device):
    """The inner product at the tuned row count; other row counts (a profile's other shapes) on kiln's
    packed GEMM (other_rows), which needs no primitive per row count, else on the runtime-M matmul where it
    measured as fast (RuntimeRows), else on an inner product made for them."""
    w = constants[1]
    b = constants[2] if len(constants) > 2 else None
    eltwise = onednn.eltwise_for(_attr(step, "activation", ""), _attr(step, "alpha", 0.0), _attr(step, "beta", 0.0))
    with_residual = bool(step.tactic_config.get("residual"))
    after = bool(_attr(step, "residual_after_activation", 1))
    tuned = tuple(step.tactic_config["input_size"])

    def rows_of(size: tuple[int, ...]) -> int:
        return math.prod(size[:-1])

    def build(rows: int) -> onednn_primitives.InnerProduct:
        # another row count reads the tuned primitive's packed weight when oneDNN takes its layout
        return onednn_primitives.InnerProduct(w, b, rows, eltwise, with_residual, after,
                                              weight_from=primitives.get(rows_of(tuned)))

    primitives: dict[int, onednn_primitives.InnerProduct] = {}
    primitives[rows_of(tuned)] = build(rows_of(tuned))
    n = int(w.shape[0])
    packed = other_rows(step, w, b, with_residual)
    # the runtime-M matmul was measured on large layers (BERT-base's 0.6-2.4 M weights); small ones: kiln's GEMM
    runtime = runtime_rows(w, b, eltwise) if w.numel() > OTHER_ROWS_WEIGHT and not with_residual else None

    def on_kiln_gemm(rows: int) -> bool:
        return packed is not None and rows != rows_of(tuned) and packed.takes(rows)

    def on_runtime_matmul(rows: int) -> bool:
        return runtime is not None and rows != rows_of(tuned) and runtime.takes(rows)

    def layer_at(rows: int) -> onednn_primitives.InnerProduct | onednn_matmul.MatmulRows:
        if on_runtime_matmul(rows):
            return runtime.rows(rows)
        return _built(primitives, rows, build, lambda r: r == rows_of(tuned))  # another row count: once

    def launch(ctx, x, w_=None, b_=None, residual=None, **_attributes):
        lead = x.shape[:-1]
        rows = rows_of(tuple(x.shape))
        if on_kiln_gemm(rows):
            return packed.linear()(x, residual if with_residual else None)  # x: [..., K] -> [..., N]
        layer = layer_at(rows)
        x_rows = x.reshape(rows, x.shape[-1]).contiguous()  # x: [..., K] -> rows [M, K]
        if residual is None:
            return layer(x_rows).reshape(*lead, n)  # [..., N]
        return layer(x_rows, residual.reshape(rows, n).contiguous()).reshape(*lead, n)

    @resizable

    def native_at(size: tuple[int, ...]) -> NativeStep:
        if len(size) not in (2, 3) or size[-1] != tuned[-1]:
            raise ValueError(f"inner product built for [..., {tuned[-1]}] inputs of rank 2 or 3, given {list(size)}")
        if on_kiln_gemm(rows_of(size)):
            bound = packed.rows(size)
            return NativeStep(size, bound.output_size, same_primitive(bound),
                              residual_input=3 if with_residual else None, primitive_at=primitive_at,
                              plan_at=kiln_rows_at)
        layer = layer_at(rows_of(size))
        return NativeStep(size, (*size[:-1], n), same_primitive(layer),
                          residual_input=3 if with_residual else None, primitive_at=primitive_at,
                          plan_at=kiln_rows_at)

    def sized_primitive(size: tuple[int, ...]) -> SizedPrimitive | None:
        """native_at(size)'s layer as a segment's view binds it (NativeStep.primitive_at), where it is an inner
        product on the tuned layer's packed weight layout; None where native_at takes another kernel or layout."""
        rows = rows_of(size)
        if len(size) not in (2, 3) or size[-1] != tuned[-1] or on_kiln_gemm(rows) or on_runtime_matmul(rows):
            return None
        arguments = primitives[rows_of(tuned)].arguments_at(rows)
        return None if arguments is None else SizedPrimitive((*size[:-1], n), arguments)

    # layers of one shape and epilogue, tuned at one row count, with the same other kernels, give the same answer
    primitive_at = PrimitiveRule(sized_primitive, ("inner product", tuple(w.shape), eltwise, with_residual, after,
                                                   b is not None, tuned, packed is not None,
                                                   None if runtime is None else runtime.key),
                                 primitives[rows_of(tuned)].fixed_arguments)

    def kiln_rows(size: tuple[int, ...]) -> SizedPlan:
        """native_at(size)'s plan fields where it runs on kiln's GEMM (OtherRows), without a BoundRows or the packed
        weight; ValueError at the rows oneDNN runs (primitive_at's, or native_at's own)."""
        if len(size) not in (2, 3) or size[-1] != tuned[-1]:
            raise ValueError(f"inner product built for [..., {tuned[-1]}] inputs of rank 2 or 3, given {list(size)}")
        rows = rows_of(size)
        if not on_kiln_gemm(rows):
            raise ValueError(f"{rows} rows run on oneDNN")
        return SizedPlan(((*size[:-1], n),), packed.row_fields(rows))

    # the rows on kiln's GEMM as a plan rule (a segment's view writes them into a kiln GEMM plan of the layer, and a
    # walk of rules only is traced, kiln/runtime/view_trace.py): its key has primitive_at's (layers that mirror
    # each other in a view take one answer of both) and what OtherRows.takes and row_fields follow
    kiln_rows_at = None if packed is None else \
        PlanRule(kiln_rows, ("kiln rows of oneDNN", primitive_at.key, packed.key), traceable=True)

    def ahead(scale: float) -> list[onednn_ahead.Job]:
        """What kiln/kernels/cpu/onednn_ahead.py makes before the row counts are met, up to AHEAD_ROWS and `scale` x
        the tuned one: the inner products of the row counts bound on one, the runtime-M matmul's first runs."""
        reach = math.ceil(rows_of(tuned) * scale)
        most = min(onednn_ahead.AHEAD_ROWS, reach)
        jobs = [] if runtime is None else runtime.warm_jobs(reach)
        return jobs + onednn_ahead.inner_product_jobs(
            primitives[rows_of(tuned)],
            [r for r in range(1, most + 1) if r != rows_of(tuned) and not on_kiln_gemm(r) and not on_runtime_matmul(r)])

    launch.native = native_at(tuned)
    launch.ahead = ahead
    return launch


# Which other row counts of a large oneDNN linear layer run on one matmul primitive with a runtime row count
# (kiln/kernels/cpu/onednn_matmul.py) rather than an inner product created for them (~0.5-2 ms each, shared by the
# layers of one shape: 7.5 ms of binding BERT-base at a new shape). On oneDNN 3.2 that matmul is `gemm:jit:f32`,
# measured against the brgemm inner product at BERT-base's four layer shapes (bench/onednn_rows.py; table in
# bench/results/first-calls-2026-12-03.md), matmul / inner product per call:
#   M 1-2:    0.87-1.07 at 1 thread; at 2, 0.95-1.10 on the 1.8-2.4 M-weight layers but 1.5-1.75 on 768x768
#             (27-32 µs against 47-48: the brgemm splits a small layer over both threads, the jit GEMM does not);
#   M 4-128:  0.98-2.4, mostly 1.1-2 (the jit GEMM packs the weight per call: most of the work at few rows);
#   M 256-512: 0.78-1.05 at 1 thread, 0.96-1.23 at 2.
# A row count bound is usually run many times and the primitive is created once, so the matmul takes only the
# row counts where it was as fast: at most RUNTIME_ROWS_AT_MOST (on several threads, only layers of at least
# RUNTIME_ROWS_PARALLEL_WEIGHT weights), and from RUNTIME_ROWS_FROM_SERIAL when its primitives run on one thread.
RUNTIME_ROWS_AT_MOST = 2
RUNTIME_ROWS_PARALLEL_WEIGHT = 1 << 20
RUNTIME_ROWS_FROM_SERIAL = 256


class RuntimeRows:
    """A large oneDNN linear layer at the row counts where a runtime-M matmul is as fast as an inner product
    made for them (RUNTIME_ROWS_*): its primitive is made once, here (shared by the layers of one shape,
    onednn_matmul), and a row count creates none (its descriptors are shared per size too). It reads the layer's
    weight where it lies, [N, K]: no other copy."""

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None, eltwise: onednn.Eltwise | None):
        self._layer = onednn_matmul.Matmul(w, b, eltwise)
        self._serial = torch.get_num_threads() == 1  # the primitive runs on the count it was created at
        self._few_rows = self._serial or w.numel() >= RUNTIME_ROWS_PARALLEL_WEIGHT
        self._rows: dict[int, onednn_matmul.MatmulRows] = {}
        self._lock = threading.Lock()

    @property
    def key(self) -> tuple[bool, bool]:
        """What takes() follows besides the rows."""
        return self._few_rows, self._serial

    def takes(self, rows: int) -> bool:
        return (self._few_rows and rows <= RUNTIME_ROWS_AT_MOST) or (self._serial and rows >= RUNTIME_ROWS_FROM_SERIAL)

    def warm_jobs(self, most: int) -> list[onednn_ahead.Job]:
        """One run at 1 row, 2 rows and, up to `most`, at RUNTIME_ROWS_FROM_SERIAL, where this layer takes them:
        oneDNN's jit GEMM compiles its kernels on a first execution (once per process), which a first call would pay
        (11-14 ms on BERT-base's first 1- or 2-row call)."""
        layer = self._layer

        def run(rows: int) -> Callable[[], bool]:
            def first_run() -> bool:
                layer.rows(rows)(torch.zeros(rows, layer.k))
                return True
            return first_run

        return [onednn_ahead.Job(("runtime matmul", layer.shape, rows), 0, run(rows))
                for rows in (1, 2, RUNTIME_ROWS_FROM_SERIAL) if rows <= max(most, 2) and self.takes(rows)]

    def rows(self, rows: int) -> onednn_matmul.MatmulRows:
        with self._lock:
            found = self._rows.get(rows)
            if found is None:
                if len(self._rows) >= _CACHED_SHAPES * 8:  # two descriptors each; the oldest out
                    self._rows.pop(next(iter(self._rows)))
                found = self._rows[rows] = self._layer.rows(rows)
            return found


def runtime_rows(w: torch.Tensor, b: torch.Tensor | None, eltwise: onednn.Eltwise | None) -> RuntimeRows | None:
    """RuntimeRows for the layer, or None where this oneDNN makes no runtime-M matmul of it (then every other row
    count gets an inner product made for it, as before)."""
    try:
        return RuntimeRows(w, b, eltwise)
    except onednn.OneDNNError:
        return None


# Which other row counts of a oneDNN linear layer run on kiln's GEMM (OtherRows): creating and JIT-compiling
# a primitive costs ~0.2-0.6 ms whatever the layer's size (measured on BERT-base's and bert_tiny's layers),
# and where the tuner chose oneDNN it ran up to ~25% faster than kiln's GEMM (BERT-base at 1024 rows).
# - layers of at most OTHER_ROWS_WEIGHT elements: there the JIT is as much as the work (bert_tiny's layers
#   are 4-16 K elements: a first call at a new shape was a third primitives); past it (BERT-base's
#   0.6-2.4 M) the JIT is a few % of a call, and packing kiln's copy of the weight on first use cost a
#   small request ~0.2 s (and ~250 MB) for 36 layers: those keep a primitive per row count;
# - rows of less than ONEDNN_FROM_MACS multiply-adds: from ~1.5 ms of work on one core the primitive pays
#   for itself within the call.
OTHER_ROWS_WEIGHT = 1 << 18
ONEDNN_FROM_MACS = 32 << 20


class OtherRows:
    """A small oneDNN linear layer at row counts other than its tuned one, on kiln's packed GEMM
    (kiln/kernels/cpu/gemm_native.py) where the work is small (OTHER_ROWS_WEIGHT, ONEDNN_FROM_MACS): oneDNN's
    inner product is created and JIT-compiled per row count, kiln's GEMM runs any row count on one packed
    weight. That weight is packed on first use (one more copy of the layer's weight, at most 1 MiB, once),
    so an engine run only at its tuned shape never holds it. The two agree to fp32 rounding: different
    blockings of the same sums."""

    def __init__(self, step: StepSpec, w: torch.Tensor, b: torch.Tensor | None, with_residual: bool):
        self._args = (w, b, _attr(step, "activation", ""), float(_attr(step, "alpha", 0.0)),
                      float(_attr(step, "beta", 0.0)))
        self._residual = (with_residual, bool(_attr(step, "residual_after_activation", 1)))
        self._macs_per_row = int(w.shape[0]) * int(w.shape[1])
        # (k, gemm_n, small_m, pack_m, swiglu) as linear()'s PackedLinear sets them: its default kernel, no SwiGLU
        # (cpu.gemm.onednn_direct refuses it)
        k = int(w.shape[1])
        self._plan_constants = (k, int(w.shape[0]), gemm_native.small_rows(gemm_native.linear_kernel(), k),
                                gemm_native.NEVER, False)
        self._layer: gemm_native.PackedLinear | None = None
        self._bound: dict[int, gemm_native.BoundRows] = {}  # rows -> the last size bound at them
        self._lock = threading.Lock()

    def takes(self, rows: int) -> bool:
        """Whether `rows` rows run here rather than on a oneDNN primitive built for them."""
        return rows * self._macs_per_row < ONEDNN_FROM_MACS

    @property
    def key(self) -> tuple:
        """What takes() and row_fields() follow besides the rows."""
        return self._macs_per_row, self._plan_constants

    def row_fields(self, rows: int) -> dict[str, int]:
        """gemm_native.PackedLinear.row_fields of the layer linear() packs, without packing it (a view's size rule
        asks before any row count ran here)."""
        return gemm_native.row_fields(rows, *self._plan_constants)

    def linear(self) -> gemm_native.PackedLinear:
        with self._lock:
            if self._layer is None:
                w, b, activation, alpha, beta = self._args
                layer = gemm_native.PackedLinear(w, b, activation, alpha, beta, residual=self._residual[0],
                                                 residual_after_activation=self._residual[1])
                made = (layer.k, layer.gemm_n, layer.small_m, layer.pack_m, layer.swiglu)
                if made != self._plan_constants:  # row_fields() answered for another plan: a bug here
                    raise RuntimeError(f"kiln GEMM's plan constants {made} are not {self._plan_constants}")
                self._layer = layer
            return self._layer

    def rows(self, size: tuple[int, ...]) -> gemm_native.BoundRows:
        rows = math.prod(size[:-1])
        found = self._bound.get(rows)
        if found is None or found.input_size != size:
            if len(self._bound) >= _CACHED_SHAPES * 8:  # a plan's few fields each; the oldest out
                self._bound.pop(next(iter(self._bound)))
            found = self._bound[rows] = self.linear().rows(size)
        return found


def other_rows(step: StepSpec, w: torch.Tensor, b: torch.Tensor | None, with_residual: bool) -> OtherRows | None:
    """kiln's GEMM for the layer's other row counts, or None where it does not run this layer (not built, an
    activation it does not apply, a weight past OTHER_ROWS_WEIGHT): then oneDNN builds a primitive per row
    count, as before."""
    if not gemm_native.available() or _attr(step, "activation", "") not in gemm_native.ACTIVATIONS \
            or w.numel() > OTHER_ROWS_WEIGHT:
        return None
    return OtherRows(step, w, b, with_residual)


register(Tactic(
    name="cpu.gemm.onednn_direct", op_type="FusedGemm", domain="kiln", device="cpu", dtypes=(torch.float32,),
    supports=_gemm_supports, configure=_configure, prepare=_prepare_gemm, available=onednn.available, native=True,
    description="oneDNN C API inner product built at load (weight reordered once), epilogue as post-ops",
))
