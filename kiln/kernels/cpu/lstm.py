"""ONNX LSTM layers as kiln's own C loop (lstm.c): one call per direction, weights packed once.

Why not torch's or oneDNN's LSTM: at a forecaster's shapes (batch 8, hidden 128, 96 steps) oneDNN's
RNN primitive ran one layer in ~8 ms on an AVX2 EPYC, torch's `_VF.lstm` about the same, where
onnxruntime ran two layers in ~5 ms: the recurrent GEMM of a step is small ([8, 128] x [128, 512]), and
what decides is how little surrounds it. lstm.c reuses gemm.c's microkernels (the input projection of
every step as one GEMM, then per step the recurrent GEMM of a block of hidden units and the cell of
those units, one barrier a step).

The library is gemm.c followed by lstm.c, compiled on first use as kiln's GEMM is
(kiln/kernels/cpu/native_loop.py: cached per source, CPU and flags); the microkernel is picked from
cpuid when a layer is built (AVX-512, AVX2, portable).
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import torch

from kiln.kernels.cpu import gemm_native, hugepages

SOURCE = gemm_native.SOURCE + "\n" + Path(__file__).with_name("lstm.c").read_text()

_LOADED: dict[bool, ctypes.CDLL] = {}
_REASON: dict[bool, str] = {}
_LOAD_LOCK = threading.Lock()


class _Plan(ctypes.Structure):  # kiln_lstm_plan in lstm.c
    _fields_ = [("x", ctypes.c_void_p), ("y", ctypes.c_void_p), ("y_ts", ctypes.c_long), ("y_ns", ctypes.c_long),
                ("h0", ctypes.c_void_p), ("c0", ctypes.c_void_p), ("yh", ctypes.c_void_p), ("yc", ctypes.c_void_p),
                ("state_ns", ctypes.c_long), ("packed_w", ctypes.c_void_p), ("packed_r", ctypes.c_void_p),
                ("bias", ctypes.c_void_p), ("scratch", ctypes.c_void_p), ("S", ctypes.c_long), ("N", ctypes.c_long),
                ("I", ctypes.c_long), ("H", ctypes.c_long), ("kernel", ctypes.c_int), ("threads", ctypes.c_int),
                ("reverse", ctypes.c_int), ("batch_major", ctypes.c_int)]


def load(test_kernels: bool = False) -> ctypes.CDLL | None:
    """The compiled library (built on first use), or None: reason() says why. `test_kernels`: the build
    with gemm.c's test-only tiles (another ISA's tile shape on this CPU: kiln/kernels/cpu/gemm_native.py)."""
    with _LOAD_LOCK:
        if test_kernels in _LOADED or test_kernels in _REASON:
            return _LOADED.get(test_kernels)
        if gemm_native.load() is None:
            _REASON[test_kernels] = f"kiln's GEMM is not built: {gemm_native.reason()}"
            return None
        lib = gemm_native.open_library("lstm", SOURCE, test_kernels)
        if isinstance(lib, str):
            _REASON[test_kernels] = lib
            return None
        lib.kiln_lstm.restype = ctypes.c_int
        lib.kiln_lstm.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
        lib.kiln_lstm_gate_columns.restype = ctypes.c_long
        lib.kiln_lstm_gate_columns.argtypes = [ctypes.c_int, ctypes.c_long]
        lib.kiln_lstm_scratch_floats.restype = ctypes.c_long
        lib.kiln_lstm_scratch_floats.argtypes = [ctypes.c_int, ctypes.c_long, ctypes.c_long, ctypes.c_long]
        _LOADED[test_kernels] = lib
        return lib


def reason(test_kernels: bool = False) -> str | None:
    return _REASON.get(test_kernels)


def available() -> bool:
    return load() is not None


class LSTMDirection:
    """One direction of an LSTM layer: W [4H, I], R [4H, H] (ONNX's gate order i, o, f, c), B [8H] or None,
    packed once with the gate rows of each NR-unit block side by side (lstm.c)."""

    def __init__(self, w: torch.Tensor, r: torch.Tensor, b: torch.Tensor | None, kernel: gemm_native.Kernel | None = None):
        test_kernels = kernel is not None and kernel.test_only
        lib = load(test_kernels)
        if lib is None:
            raise RuntimeError(f"kiln's LSTM is not built: {reason(test_kernels)}")
        self._lib = lib
        self.kernel = kernel or gemm_native.best_kernel()
        if not self.kernel.supported:
            raise ValueError(f"kernel {self.kernel.name!r} does not run on this CPU")
        hidden, inputs = int(r.shape[1]), int(w.shape[1])
        self.hidden, self.inputs = hidden, inputs
        nr = self.kernel.nr
        columns = int(lib.kiln_lstm_gate_columns(self.kernel.index, hidden))
        # permuted row k of the packed matrices: unit block u, gate q, lane j -> ONNX row q*H + u*NR + j (or zeros)
        k = torch.arange(columns)
        u, q, j = k // (4 * nr), k // nr % 4, k % nr
        unit = u * nr + j
        source = torch.where(unit < hidden, q * hidden + unit, 4 * hidden)  # 4H: the zero row appended below

        def permuted(m: torch.Tensor) -> torch.Tensor:
            m = m.detach().to(torch.float32).reshape(4 * hidden, -1)
            return torch.cat([m, m.new_zeros((1, m.shape[1]))]).index_select(0, source).contiguous()

        bias = torch.zeros(4 * hidden) if b is None else \
            b.detach().to(torch.float32).reshape(2, 4 * hidden).sum(0)  # Wb + Rb: [4H]
        self._bias = permuted(bias.reshape(4 * hidden, 1)).reshape(columns)
        self._w = self._pack(permuted(w), columns, inputs)
        self._r = self._pack(permuted(r), columns, hidden)
        self.columns = columns
        self._scratch: dict[tuple[int, int], torch.Tensor] = {}
        self._lock = threading.Lock()

    def _pack(self, m: torch.Tensor, n: int, k: int) -> torch.Tensor:
        packed = hugepages.empty(self._lib.kiln_gemm_packed_floats(self.kernel.index, n, k))
        self._lib.kiln_gemm_pack_w(self.kernel.index, m.data_ptr(), n, k, packed.data_ptr())
        return packed

    def run(self, x: torch.Tensor, y: torch.Tensor | None, h0: torch.Tensor | None, c0: torch.Tensor | None,
            yh: torch.Tensor, yc: torch.Tensor, *, reverse: bool, batch_major: bool) -> None:
        """x: contiguous [S, N, I] (or [N, S, I] batch_major); y: where h of (t, n) goes, a [S, N, H] view
        whose last dim is contiguous (or [N, S, H] batch_major), or None; h0, c0, yh, yc: [N, H] views with
        contiguous rows, sharing one row stride."""
        if batch_major:
            batch, steps = x.shape[0], x.shape[1]
        else:
            steps, batch = x.shape[0], x.shape[1]
        if y is not None:
            y_ts, y_ns = (y.stride(1), y.stride(0)) if batch_major else (y.stride(0), y.stride(1))
        else:
            y_ts = y_ns = 0
        state_ns = yh.stride(0)
        for s in (h0, c0, yc):
            if s is not None and s.stride(0) != state_ns:
                raise ValueError("the LSTM's initial and final states must share one row stride")
        with self._lock:  # the scratch is this layer's: two contexts of one engine take turns
            key = (steps, batch)
            scratch = self._scratch.get(key)
            if scratch is None:
                if len(self._scratch) > 4:
                    self._scratch.pop(next(iter(self._scratch)))
                scratch = self._scratch[key] = torch.empty(
                    self._lib.kiln_lstm_scratch_floats(self.kernel.index, steps, batch, self.hidden))
            plan = _Plan(x=x.data_ptr(), y=y.data_ptr() if y is not None else None, y_ts=y_ts, y_ns=y_ns,
                         h0=h0.data_ptr() if h0 is not None else None, c0=c0.data_ptr() if c0 is not None else None,
                         yh=yh.data_ptr(), yc=yc.data_ptr(), state_ns=state_ns, packed_w=self._w.data_ptr(),
                         packed_r=self._r.data_ptr(), bias=self._bias.data_ptr(), scratch=scratch.data_ptr(),
                         S=steps, N=batch, I=self.inputs, H=self.hidden, kernel=self.kernel.index, threads=0,
                         reverse=int(reverse), batch_major=int(batch_major))
            status = self._lib.kiln_lstm(ctypes.byref(plan), None, 0, None)
        if status:
            raise RuntimeError(f"kiln LSTM [{steps}, {batch}, {self.inputs}] -> {self.hidden} failed ({status})")
