"""A linear layer as oneDNN's matmul with a runtime row count: one primitive serves every M.

oneDNN's inner product (onednn_primitives.InnerProduct) is created and JIT-compiled for one row count, ~0.5-1 ms
a primitive here: a BERT-base bound at a new (batch, sequence) created one per distinct layer shape (shared by its
36 oneDNN layers) and spent 7.5 ms of its ~14 ms of binding on its oneDNN layers
(bench/results/first-calls-2026-12-02c.md).
oneDNN 3's matmul takes M as DNNL_RUNTIME_DIM_VAL: the primitive is created once, when the engine loads, and a
row count is then only two memory descriptors and a few memory objects of that size (tens of µs).

The kernel is another one. On oneDNN 3.2 only `gemm:jit:f32` takes a runtime M (its brgemm matmul does not), and
it reads the weight where it lies: ONNX's [N, K] row-major is matmul's [K, N] in tag `ba`, so the layer keeps no
packed copy. Measured against the fixed-M brgemm inner product at BERT-base's shapes (bench/onednn_rows.py,
bench/results/first-calls-2026-12-03.md): as fast at 1-2 rows and, on one thread, from ~256; 1.1-2.4x slower at
4-128 rows, where the jit GEMM's per-call packing of the weight is most of the work. kiln/tactics/cpu/onednn_gemm.py
picks it only where it measured as fast (RUNTIME_ROWS_* there).

No residual: a binary post-op's operand cannot have a runtime dimension (oneDNN 3.2 refuses it: "invalid
arguments"), and a sum post-op would need the residual copied into the output first, a call of its own in a
segment. A layer with a residual keeps an inner product per row count (kiln's BERT exports fold the residual into
the LayerNorm that follows, not into the GEMM).
"""

from __future__ import annotations

import ctypes
import functools
import threading
from dataclasses import dataclass

import torch

from kiln.kernels.cpu.onednn import (
    ARG_BIAS,
    ARG_DST,
    ARG_SRC,
    ARG_WEIGHTS,
    RUNTIME_DIM,
    TAG_AB,
    TAG_BA,
    Bound,
    Eltwise,
    OneDNNError,
    _check,
    _epilogue_attr,
    _Handle,
    _implementation,
    _memory,
    _primitive,
    load,
    memory_desc,
    row_major_desc,
)


@dataclass(frozen=True)
class _Shape:
    """What a runtime-M matmul primitive is made for: the layers of a transformer that share it."""

    n: int
    k: int
    eltwise: Eltwise | None
    bias: bool
    threads: int  # OpenMP's count at creation: the primitive forks that many whatever the count later


@dataclass
class _RuntimePrimitive:
    pd: _Handle
    primitive: _Handle
    implementation: str
    weight_md: _Handle
    bias_md: _Handle | None
    keep: tuple  # the other descriptors it was created from


@functools.lru_cache(maxsize=256)
def _runtime_primitive(shape: _Shape) -> _RuntimePrimitive:
    """The matmul [M, K] x [K, N] ('ba': ONNX's [N, K]) -> [M, N] for any M, the activation as a post-op.

    A primitive holds no weights (they are execution arguments), so every layer of one _Shape shares it:
    BERT-base's 36 oneDNN linear layers need three."""
    lib = load()
    src_md = memory_desc([RUNTIME_DIM, shape.k], TAG_AB)
    dst_md = memory_desc([RUNTIME_DIM, shape.n], TAG_AB)
    w_md = memory_desc([shape.k, shape.n], TAG_BA)
    b_md = memory_desc([1, shape.n], TAG_AB) if shape.bias else None
    attr, _ = _epilogue_attr(shape.eltwise, False, False, False, dst_md)
    pd = ctypes.c_void_p()
    status = lib.lib.dnnl_matmul_primitive_desc_create(ctypes.byref(pd), lib.engine, src_md.value, w_md.value,
                                                      b_md.value if b_md is not None else None, dst_md.value,
                                                      attr.value)
    _check(status, f"matmul [M, {shape.k}] x [{shape.k}, {shape.n}] with a runtime M")
    pd_h, prim = _primitive(pd, "matmul")
    return _RuntimePrimitive(pd_h, prim, _implementation(pd), w_md, b_md, (src_md, dst_md, attr))


class Matmul:
    """y = act(x @ Wᵀ + b) for x [M, K] row-major at any M: `rows(M)` is the layer at M rows.

    Reads W [N, K] and b where they lie (kept referenced here): no packed copy."""

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None, eltwise: Eltwise | None):
        if w.dim() != 2 or (b is not None and tuple(b.shape) != (w.shape[0],)):
            raise OneDNNError(f"matmul: weight [N, K] and bias [N] wanted, given {list(w.shape)} and "
                              f"{None if b is None else list(b.shape)}")
        self.n, self.k = (int(d) for d in w.shape)
        self.shape = _Shape(self.n, self.k, eltwise, b is not None, torch.get_num_threads())
        self._made = _runtime_primitive(self.shape)
        self.implementation = self._made.implementation
        self._weight = w.detach().to(torch.float32).contiguous()  # [N, K]: the primitive's [K, N] 'ba'
        self._bias = None if b is None else b.detach().to(torch.float32).contiguous()
        self._w_mem = _memory(self._made.weight_md.value, self._weight.data_ptr())
        self._b_mem = None if b is None else _memory(self._made.bias_md.value, self._bias.data_ptr())

    def rows(self, rows: int) -> MatmulRows:
        if rows < 1:
            raise OneDNNError(f"matmul [M, {self.k}] x [{self.k}, {self.n}]: M must be at least 1, given {rows}")
        return MatmulRows(self, rows)

    def fixed(self) -> list[tuple[int, _Handle]]:
        """The execution arguments every row count shares: the weight and the bias."""
        return [(ARG_WEIGHTS, self._w_mem)] + ([(ARG_BIAS, self._b_mem)] if self._b_mem is not None else [])


class MatmulRows:
    """A Matmul at one row count: what a native segment binds (`bind` -> Bound) and the per-layer path calls,
    as InnerProduct offers them. Making one creates no primitive, and its two descriptors are shared by every
    layer at this row count (row_major_desc)."""

    def __init__(self, layer: Matmul, rows: int):
        self.layer = layer
        self.input_size, self.output_size = (rows, layer.k), (rows, layer.n)
        self.implementation = layer.implementation
        self._mds = (row_major_desc((rows, layer.k)), row_major_desc((rows, layer.n)))  # shared by every layer
        self._per_call: Bound | None = None
        self._lock = threading.Lock()

    def bind(self, src: int, dst: int, residual: int | None = None) -> Bound:
        """Arguments at fixed addresses (Bound), on the layer's one primitive."""
        if residual is not None:
            raise OneDNNError("a runtime-M matmul takes no residual (see the module's docstring)")
        src_md, dst_md = self._mds
        roles = {"src": (ARG_SRC, src_md.value, src), "dst": (ARG_DST, dst_md.value, dst)}
        what = f"matmul {list(self.input_size)} -> {list(self.output_size)} (runtime M)"
        return Bound(self.layer._made.primitive.value, roles, self.layer.fixed(), what, self)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] contiguous float32 of this row count -> y [M, N] (a new tensor)."""
        y = torch.empty(self.output_size, dtype=torch.float32)
        with self._lock:
            if self._per_call is None:
                self._per_call = self.bind(0, 0)
                self._per_call._owner = None  # ours: its reference back to us would make a cycle
            bound = self._per_call
            bound.rebind("src", x.data_ptr())
            bound.rebind("dst", y.data_ptr())
            lib = load()
            _check(lib.lib.dnnl_primitive_execute(bound.primitive, lib.stream, bound.nargs, bound.args), "matmul")
        return y
