"""Squeeze-and-excitation in kiln's C (se.c): kiln::SqueezeExcite as one call, a native-segment member.

Why: an SE block of EfficientNet/MobileNetV3/RegNetY is four layers in the unfused graph (global
average pool, two 1x1 convolutions on a 1x1 map, the channel scale), each a oneDNN primitive or a
torch op of a few microseconds of arithmetic; the scale (a Mul) has no oneDNN tactic, so every SE
block split EfficientNet-B0's native segment in two and ran its Mul through Python (16 blocks).
As one C kernel the whole block is one call of the segment loop, x is read twice instead of three
times, and the two GEMVs (at most 1152 x 48 in B0) are a few microseconds on one thread.

A SqueezeExcite is one layer at one input size (the weights, sizes and epilogue kinds);
`bind(src, dst)` gives a segment its call on memory objects and scratch of its own, as oneDNN
primitives do (kiln/kernels/cpu/onednn.py Bound), and `__call__` runs it on a channels-last tensor.
Built by native_loop.build with the machine's C compiler; `load()` is None without one.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kiln.kernels.cpu import native_loop, onednn, plan_member

SOURCE = Path(__file__).with_name("se.c").read_text()

# activation kinds of se.c: the hidden layer's and the gate's (kiln/ops/fused.py names)
ACTIVATIONS = {"": 0, "Relu": 1, "SiLU": 2, "HardSwish": 3, "Clip": 4, "LeakyRelu": 5, "Sigmoid": 6,
               "HardSigmoid": 7}
GATES = ("Sigmoid", "HardSigmoid")
FLAT = 512  # se.c's FLAT: floats of a flat run of rows



class _Plan(ctypes.Structure):  # se_plan in se.c
    _fields_ = [("get_handle", ctypes.c_void_p), ("x", ctypes.c_void_p), ("y", ctypes.c_void_p),
                ("w1", ctypes.c_void_p), ("b1", ctypes.c_void_p), ("w2t", ctypes.c_void_p), ("b2", ctypes.c_void_p),
                ("partial", ctypes.c_void_p), ("block", ctypes.c_void_p), ("gate", ctypes.c_void_p),
                ("hidden", ctypes.c_void_p), ("N", ctypes.c_long), ("HW", ctypes.c_long), ("C", ctypes.c_long),
                ("R", ctypes.c_long), ("activation", ctypes.c_int), ("alpha", ctypes.c_float),
                ("beta", ctypes.c_float), ("gate_kind", ctypes.c_int), ("gate_alpha", ctypes.c_float),
                ("gate_beta", ctypes.c_float), ("threads", ctypes.c_int)]


_LIBRARY = native_loop.KernelLibrary("se", SOURCE, ["kiln_squeeze_excite", "kiln_silu"],
                                    requires=(onednn.available, "libdnnl.so.3 cannot be loaded (the kernel's operands are oneDNN memory objects)"))
load, available, reason = _LIBRARY.load, _LIBRARY.available, _LIBRARY.reason  # the library, built on first use


def _vector(v: torch.Tensor | None) -> torch.Tensor | None:
    return None if v is None else v.detach().to(torch.float32).reshape(-1).contiguous()


class SqueezeExcite(plan_member.PlanKernel):
    """y = x · gate(W2 act(W1 mean_hw(x) + b1) + b2) per (image, channel), x [N, C, H, W] channels-last.
    w1 [R, C], w2 [C, R] (the 1x1 convolutions' weights, any trailing 1s). `bind(src, dst)` reads and writes
    NHWC."""

    NO_RESIDUAL = "a squeeze-excitation block has no residual"

    def __init__(self, w1: torch.Tensor, b1: torch.Tensor | None, w2: torch.Tensor, b2: torch.Tensor | None,
                 input_size: tuple[int, ...], activation: str, alpha: float, beta: float,
                 gate: str, gate_alpha: float, gate_beta: float):
        library = load()
        if library is None:
            raise onednn.OneDNNError(f"kiln's squeeze-excitation kernel is not built: {reason()}")
        if activation not in ACTIVATIONS or gate not in GATES:
            raise ValueError(f"activation {activation!r} / gate {gate!r}: the kernel applies {sorted(ACTIVATIONS)} "
                             f"and gates {GATES}")
        n, c, h, w = (int(d) for d in input_size)
        r = int(w1.shape[0])
        self._w1 = w1.detach().to(torch.float32).reshape(r, -1).contiguous()  # [R, C]
        self._w2t = w2.detach().to(torch.float32).reshape(-1, r).t().contiguous()  # [R, C]
        if self._w1.shape[1] != c or self._w2t.shape[1] != c:
            raise ValueError(f"weights {list(w1.shape)} and {list(w2.shape)} do not fit {c} channels")
        self._b1, self._b2 = _vector(b1), _vector(b2)
        for bias, want in ((self._b1, r), (self._b2, c)):
            if bias is not None and bias.numel() != want:
                raise ValueError(f"a bias of {bias.numel()} values for a layer of {want}")
        self.input_size = self.output_size = (n, c, h, w)
        self.library = library
        self.what = f"squeeze-excite {list(self.input_size)} through {r}"
        self.shape = dict(N=n, HW=h * w, C=c, R=r)
        self.epilogue = dict(activation=ACTIVATIONS[activation], alpha=float(alpha), beta=float(beta),
                             gate_kind=ACTIVATIONS[gate], gate_alpha=float(gate_alpha), gate_beta=float(gate_beta))
        self.weights = dict(w1=self._w1.data_ptr(), b1=self._b1.data_ptr() if self._b1 is not None else None,
                            w2t=self._w2t.data_ptr(), b2=self._b2.data_ptr() if self._b2 is not None else None)
        self._own_calls()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, C, H, W] channels-last float32 of the built size -> a new channels-last y."""
        n, c, h, w = self.output_size
        y = torch.empty_strided(self.output_size, (c * h * w, 1, w * c, c), dtype=torch.float32)
        self.run_into(x.data_ptr(), y.data_ptr())
        return y


class _Bound(plan_member.PlanMember):
    """A SqueezeExcite's call for one segment (or its own per-call path), on scratch of its own."""

    FUNCTION = "kiln_squeeze_excite"

    def __init__(self, layer: SqueezeExcite, src: int, dst: int):
        super().__init__(layer, src, dst)
        s = layer.shape
        elements = s["N"] * s["HW"] * s["C"]
        # one thread for a small map; a map the oneDNN layers around it call small has a serial form as they
        # do (onednn_primitives.thread_forms), the scratch shared: the two forms never run at once
        threads, serial = plan_member.thread_counts(elements)
        self._partial = torch.zeros(max(threads, 1) * s["N"] * s["C"], dtype=torch.float64)
        self._block = torch.empty(max(threads, 1) * max(s["C"], FLAT), dtype=torch.float32)
        self._gate = torch.empty(s["N"] * s["C"], dtype=torch.float32)
        self._hidden = torch.empty(s["N"] * s["R"], dtype=torch.float32)

        def plan(count: int) -> _Plan:
            return _Plan(**self.plan_base(), **layer.weights, partial=self._partial.data_ptr(),
                         block=self._block.data_ptr(), gate=self._gate.data_ptr(), hidden=self._hidden.data_ptr(),
                         **s, **layer.epilogue, threads=count)

        self._plans(plan(threads), plan(1) if serial else None)


SqueezeExcite.MEMBER = _Bound
