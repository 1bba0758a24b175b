"""Winograd F(2x2, 3x3) convolution on the CPU: 3x3, stride 1, padding 1, NHWC, float32.

Each 2x2 block of outputs is computed from its 4x4 input patch with 16 multiplies per
(input, output) channel pair instead of 36: y = Aᵀ [ (G g Gᵀ) ⊙ (Bᵀ d B) ] A. kiln runs it as three
calls of one native segment (kiln/runtime/native.py): the input transform (C, both threads,
kiln/kernels/cpu/segment_loop.c) writes V[16][tiles][C], oneDNN's batched matmul multiplies each of
the 16 slices by the transformed weights U[16][C][K] (made once at load, in float64, from the
float32 weights), and the output transform adds bias and residual, applies the activation and
writes NHWC. The transforms' coefficients are 0, ±1 and ±1/2: the result differs from a direct
convolution by a few float32 roundings of the patch sums (checked against float64 in the tests and,
at build, by the autotuner's reference check).

At batch 1 the transformed weights (16/9 of the weights') are streamed once per run: the tactic
refuses layers whose transformed weights exceed WEIGHT_LIMIT, where that stream, not the arithmetic,
bounds the layer.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import torch

from kiln.kernels.cpu import hugepages, native_loop, onednn, plan_member

WEIGHT_LIMIT = 4 << 20  # bytes of transformed weights
ACTIVATIONS = {"": 0, "Relu": 1, "Clip": 2}

_G = torch.tensor([[1.0, 0.0, 0.0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0.0, 0.0, 1.0]], dtype=torch.float64)


class _Plan(ctypes.Structure):  # wino_plan in segment_loop.c
    _fields_ = [("get_handle", ctypes.c_void_p), ("src", ctypes.c_void_p), ("dst", ctypes.c_void_p),
                ("residual", ctypes.c_void_p), ("V", ctypes.c_void_p), ("M", ctypes.c_void_p),
                ("bias", ctypes.c_void_p), ("N", ctypes.c_long), ("H", ctypes.c_long), ("W", ctypes.c_long),
                ("C", ctypes.c_long), ("K", ctypes.c_long), ("TH", ctypes.c_long), ("TW", ctypes.c_long),
                ("activation", ctypes.c_int), ("lo", ctypes.c_float), ("hi", ctypes.c_float),
                ("residual_after", ctypes.c_int)]


def available() -> bool:
    return onednn.available() and native_loop.load() is not None


def transformed_weight_bytes(c: int, k: int) -> int:
    return 16 * c * k * 4


def transform_weights(w: torch.Tensor) -> torch.Tensor:
    """[K, C, 3, 3] -> U [16, C, K] float32, U[4a+b, c, k] = (G w[k, c] Gᵀ)[a, b], in float64."""
    u = _G @ w.detach().to(torch.float64) @ _G.T  # [K, C, 4, 4]
    return u.permute(2, 3, 1, 0).reshape(16, w.shape[1], w.shape[0]).to(torch.float32).contiguous()


class WinogradConv:
    """One layer at one input size. bind() gives a segment its three calls; __call__ runs it alone."""

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None, input_size: list[int] | tuple[int, ...],
                 activation: str, alpha: float, beta: float, residual: bool, residual_after: bool):
        code = native_loop.load()
        if code is None:
            raise onednn.OneDNNError(f"kiln's native code is not built: {native_loop.reason()}")
        if activation not in ACTIVATIONS:
            raise onednn.OneDNNError(f"activation {activation!r} is not one the output transform applies")
        lib = onednn.load()
        n, c, h, wd = (int(v) for v in input_size)
        k = int(w.shape[0])
        self.input_size, self.output_size = (n, c, h, wd), (n, k, h, wd)
        self.residual, self.residual_in_place = residual, False
        self._shape = dict(N=n, H=h, W=wd, C=c, K=k, TH=(h + 1) // 2, TW=(wd + 1) // 2)
        self._tiles = n * self._shape["TH"] * self._shape["TW"]
        self._epilogue = dict(activation=ACTIVATIONS[activation], lo=float(alpha) if activation == "Clip" else 0.0,
                              hi=float(beta) if activation == "Clip" else 0.0, residual_after=int(residual_after))
        self._bias = None if b is None else b.detach().to(torch.float32).contiguous()
        self._code = code
        self.implementation = "winograd F(2x2,3x3) + matmul"

        # the batched GEMM: M[16, T, K] = V[16, T, C] @ U[16, C, K], U in the layout its kernel wants
        t = self._tiles
        self._mds = (onednn.memory_desc([16, t, c], onednn.TAG_ABC), onednn.memory_desc([16, c, k], onednn.TAG_ANY),
                     onednn.memory_desc([16, t, k], onednn.TAG_ABC), onednn.memory_desc([16, c, k], onednn.TAG_ABC),
                     onednn.memory_desc([n, c, h, wd], onednn.TAG_ACDB),
                     onednn.memory_desc([n, k, h, wd], onednn.TAG_ACDB))
        src_md, w_any, dst_md, w_user = self._mds[:4]
        attr, _ = onednn._epilogue_attr(None, False, False, False, dst_md)
        pd = ctypes.c_void_p()
        onednn._check(lib.lib.dnnl_matmul_primitive_desc_create(ctypes.byref(pd), lib.engine, src_md.value,
                                                                 w_any.value, None, dst_md.value, attr.value),
                      f"winograd matmul [16, {t}, {c}] x [16, {c}, {k}]")
        self._pd, self._prim = onednn._primitive(pd, "winograd matmul")
        self.gemm_implementation = onednn._implementation(pd)
        self._weight, w_md = onednn.packed_weight(pd, w_user, transform_weights(w))
        self._w_mem = onednn._memory(w_md, self._weight.data_ptr())
        self._lock = threading.Lock()
        self._alone: _Bound | None = None

    @property
    def scratch_bytes(self) -> int:
        """A binding's scratch: V [16, tiles, C] then M [16, tiles, K], float32."""
        return 16 * self._tiles * (self._shape["C"] + self._shape["K"]) * 4

    binds_on_arena = True  # a segment's binding takes its scratch from the segment's arena (native_members.py)

    def bind(self, src: int, dst: int, residual: int | None = None, arena: Any = None) -> _Bound:
        """The layer's three calls on memory objects of its own; their scratch (V and M) its own too, or, with
        `arena` (the SharedArena whose lock every run of the binding holds), the arena's scratch, which every
        member bound over it shares (SharedArena.scratch): V and M live only within the layer's three calls."""
        return _Bound(self, src, dst, residual if self.residual else None, arena)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [N, C, H, W] channels-last float32 of the built size -> y [N, K, H, W] channels-last."""
        n, k, h, w = self.output_size
        y = torch.empty_strided(self.output_size, (k * h * w, 1, w * k, k), dtype=torch.float32)
        with self._lock:
            if self._alone is None:
                self._alone = self.bind(0, 0, 0 if self.residual else None)
            bound = self._alone
            bound.rebind("src", x.data_ptr())
            bound.rebind("dst", y.data_ptr())
            if self.residual:
                bound.rebind("residual", residual.data_ptr())
            bound.run()
        return y


class _Bound(plan_member.MemoriesMember):
    """A WinogradConv's calls for one segment (or for its own per-call path)."""

    def __init__(self, conv: WinogradConv, src: int, dst: int, residual: int | None, arena: Any = None):
        lib = onednn.load()
        c, k, t = conv._shape["C"], conv._shape["K"], conv._tiles
        self.what = f"winograd conv {list(conv.input_size)} -> {list(conv.output_size)}"
        self._conv = conv
        if arena is not None:  # V then M (64·t·c bytes: M starts on a cache line)
            scratch = arena.scratch(conv.scratch_bytes)
            self._v, self._m = scratch[:16 * t * c], scratch[16 * t * c:16 * t * (c + k)]
        else:  # scratch of its own: no other binding runs over it
            self._v = hugepages.empty(16 * t * c)
            self._m = hugepages.empty(16 * t * k)
        src_md, _, dst_md, _, x_md, y_md = conv._mds
        self._memories = {"src": onednn._memory(x_md.value, src), "dst": onednn._memory(y_md.value, dst)}
        if residual is not None:
            self._memories["residual"] = onednn._memory(y_md.value, residual)
        self._v_mem = onednn._memory(src_md.value, self._v.data_ptr())
        self._m_mem = onednn._memory(dst_md.value, self._m.data_ptr())
        args = [(onednn.ARG_SRC, self._v_mem), (onednn.ARG_WEIGHTS, conv._w_mem), (onednn.ARG_DST, self._m_mem)]
        self._args = (onednn._ExecArg * 3)(*[onednn._ExecArg(a, m.value) for a, m in args])
        self._primitive = onednn.own_primitive(conv._prim.value)  # its scratchpad too: no other binding runs it
        get_handle = ctypes.cast(lib.lib.dnnl_memory_get_data_handle, ctypes.c_void_p).value
        self._plan = _Plan(get_handle=get_handle, src=self._memories["src"].value, dst=self._memories["dst"].value,
                           residual=self._memories["residual"].value if residual is not None else None,
                           V=self._v.data_ptr(), M=self._m.data_ptr(),
                           bias=conv._bias.data_ptr() if conv._bias is not None else None,
                           **conv._shape, **conv._epilogue)
        code = conv._code
        self._functions = (ctypes.cast(code.kiln_wino_input, ctypes.c_void_p).value,
                           ctypes.cast(code.kiln_wino_output, ctypes.c_void_p).value)

    def calls(self) -> list[tuple[int | None, int, int, int]]:
        plan = ctypes.addressof(self._plan)
        return [(self._functions[0], plan, 0, 0),
                (None, self._primitive.value.value, 3, ctypes.cast(self._args, ctypes.c_void_p).value),
                (self._functions[1], plan, 0, 0)]

