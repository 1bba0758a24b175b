"""ONNX RNN, GRU and LSTM layers as kiln's own C loop (recurrent.c, lstm.c): one call per direction,
weights packed once.

Why not torch's or oneDNN's kernels: at a forecaster's shapes (batch 8, hidden 128, 96 steps) oneDNN's
RNN primitive ran one LSTM layer in ~8 ms on an AVX2 EPYC, torch's `_VF.lstm` about the same, where
onnxruntime ran two layers in ~5 ms: the recurrent GEMM of a step is small ([8, 128] x [128, 512]), and
what decides is how little surrounds it. The C loop reuses gemm.c's microkernels (the input projection of
every step as one GEMM, then per step the recurrent GEMM of a block of hidden units and the cell of those
units, one barrier a step; the GRU with linear_before_reset=0 two). torch's kernels also cannot run
ONNX's default GRU (linear_before_reset=0), other activations, clip or peepholes: kiln/ops/rnn.py runs
those step by step in Python.

lstm_lanes.c and lstm_fused.c are two more loops for the LSTM with the default activations (the batch in
the vector lanes; the input projection, recurrent GEMM and cell of a step in one register tile); the
builder times them against lstm.c's.

Inside a native segment (kiln/runtime/native.py) a layer is a RecurrentLayer: one call of the segment loop into
kiln_recurrent_member, which reads its operands from oneDNN memory objects and runs each direction's loop, so that
the reshapes, the last-step Gather and the head around it run without Python (an LSTM launched from Python cost
~24 us above its kernel, and split the segment around it).

The library is gemm.c, recurrent.c, lstm.c, lstm_lanes.c and lstm_fused.c, compiled on first use as kiln's GEMM is
(kiln/kernels/cpu/native_loop.py: cached per source, CPU and flags); the microkernel is picked from
cpuid when a layer is built (AVX-512, AVX2, portable).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kiln.kernels.cpu import gemm_native, hugepages, onednn

_HERE = Path(__file__).parent
SOURCE = "\n".join([gemm_native.SOURCE, *((_HERE / name).read_text()
                                           for name in ("recurrent.c", "lstm.c", "lstm_lanes.c", "lstm_fused.c"))])

GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}  # gate blocks of W's rows, in ONNX's order (GRU z r h, LSTM i o f c)
# ONNX activation name (lower case) -> recurrent.c's RACT_* code
ACTIVATIONS = {"relu": 0, "tanh": 1, "sigmoid": 2, "affine": 3, "leakyrelu": 4, "thresholdedrelu": 5,
               "scaledtanh": 6, "hardsigmoid": 7, "elu": 8, "softsign": 9}
DEFAULT_ACTIVATIONS = {"RNN": ["tanh"], "GRU": ["sigmoid", "tanh"], "LSTM": ["sigmoid", "tanh", "tanh"]}

_LOADED: dict[bool, ctypes.CDLL] = {}
_REASON: dict[bool, str] = {}
_LOAD_LOCK = threading.Lock()


@dataclass(frozen=True)
class Activation:
    """One of the spec's f, g, h: an ONNX activation name (lower case) and its alpha, beta."""

    name: str
    alpha: float = 0.0
    beta: float = 0.0


class _Act(ctypes.Structure):  # recurrent_act in recurrent.c
    _fields_ = [("kind", ctypes.c_int), ("alpha", ctypes.c_float), ("beta", ctypes.c_float)]


class _Plan(ctypes.Structure):  # kiln_recurrent_plan in recurrent.c
    _fields_ = [("x", ctypes.c_void_p), ("y", ctypes.c_void_p), ("y_ts", ctypes.c_long), ("y_ns", ctypes.c_long),
                ("h0", ctypes.c_void_p), ("c0", ctypes.c_void_p), ("yh", ctypes.c_void_p), ("yc", ctypes.c_void_p),
                ("state_ns", ctypes.c_long), ("packed_w", ctypes.c_void_p), ("packed_r", ctypes.c_void_p),
                ("bias", ctypes.c_void_p), ("bias_rh", ctypes.c_void_p), ("peepholes", ctypes.c_void_p),
                ("lengths", ctypes.c_void_p), ("scratch", ctypes.c_void_p), ("S", ctypes.c_long),
                ("N", ctypes.c_long), ("I", ctypes.c_long), ("H", ctypes.c_long), ("kernel", ctypes.c_int),
                ("threads", ctypes.c_int), ("reverse", ctypes.c_int), ("batch_major", ctypes.c_int),
                ("gates", ctypes.c_int), ("linear_before_reset", ctypes.c_int), ("input_forget", ctypes.c_int),
                ("generic", ctypes.c_int), ("act", _Act * 3), ("clip", ctypes.c_float), ("stalled", ctypes.c_int),
                ("waited_ns", ctypes.c_long), ("loop_ns", ctypes.c_long), ("split", ctypes.c_int),
                ("row_slices", ctypes.c_int), ("ahead", ctypes.c_int),
                ("wide", ctypes.c_int)]


def load(test_kernels: bool = False) -> ctypes.CDLL | None:
    """The compiled library (built on first use), or None: reason() says why. `test_kernels`: the build
    with gemm.c's test-only tiles (another ISA's tile shape on this CPU: kiln/kernels/cpu/gemm_native.py)."""
    with _LOAD_LOCK:
        if test_kernels in _LOADED or test_kernels in _REASON:
            return _LOADED.get(test_kernels)
        if gemm_native.load() is None:
            _REASON[test_kernels] = f"kiln's GEMM is not built: {gemm_native.reason()}"
            return None
        lib = gemm_native.open_library("recurrent", SOURCE, test_kernels)
        if isinstance(lib, str):
            _REASON[test_kernels] = lib
            return None
        for cell in ("kiln_rnn", "kiln_gru", "kiln_lstm"):
            fn = getattr(lib, cell)
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
        lib.kiln_recurrent_gate_columns.restype = ctypes.c_long
        lib.kiln_recurrent_gate_columns.argtypes = [ctypes.c_int, ctypes.c_long, ctypes.c_int]
        lib.kiln_recurrent_scratch_floats.restype = ctypes.c_long
        lib.kiln_recurrent_scratch_floats.argtypes = [ctypes.c_int, ctypes.c_long, ctypes.c_long, ctypes.c_long,
                                                      ctypes.c_long, ctypes.c_int]
        lib.kiln_lstm_lanes.restype = ctypes.c_int
        lib.kiln_lstm_lanes.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
        lib.kiln_lstm_lanes_kernel_name.restype = ctypes.c_char_p
        lib.kiln_lstm_lanes_packed_floats.restype = ctypes.c_long
        lib.kiln_lstm_lanes_packed_floats.argtypes = [ctypes.c_int, ctypes.c_long, ctypes.c_long]
        lib.kiln_lstm_lanes_pack.restype = None
        lib.kiln_lstm_lanes_pack.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_long,
                                             ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        lib.kiln_lstm_lanes_scratch_floats.restype = ctypes.c_long
        lib.kiln_lstm_lanes_scratch_floats.argtypes = [ctypes.c_int, ctypes.c_long, ctypes.c_long, ctypes.c_long]
        lib.kiln_lstm_fused.restype = ctypes.c_int
        lib.kiln_lstm_fused.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
        lib.kiln_lstm_fused_kernel_name.restype = ctypes.c_char_p
        lib.kiln_lstm_fused_packed_floats.restype = ctypes.c_long
        lib.kiln_lstm_fused_packed_floats.argtypes = [ctypes.c_int, ctypes.c_long, ctypes.c_long]
        lib.kiln_lstm_fused_pack.restype = None
        lib.kiln_lstm_fused_pack.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                             ctypes.c_long, ctypes.c_long, ctypes.c_void_p]
        lib.kiln_lstm_fused_scratch_floats.restype = ctypes.c_long
        lib.kiln_lstm_fused_tile_plan.restype = ctypes.c_long
        lib.kiln_lstm_fused_tile_plan.argtypes = [ctypes.c_int, ctypes.c_long, ctypes.c_int, ctypes.c_void_p,
                                                  ctypes.c_void_p,
                                                  ctypes.c_long]
        lib.kiln_lstm_fused_scratch_floats.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_long]
        lib.kiln_recurrent_member.restype = ctypes.c_int
        lib.kiln_recurrent_member.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
        _LOADED[test_kernels] = lib
        return lib


def set_directions_apart(apart: bool) -> None:
    """Whether a segment member's two directions may run one per thread (recurrent.c kiln_recurrent_member; the
    default). False: one after the other, as a benchmark's other side."""
    lib = load()
    if lib is not None:
        ctypes.c_int.in_dll(lib, "kiln_recurrent_directions_apart").value = int(apart)


def set_row_split(on: bool) -> None:
    """Whether lstm_fused.c splits the batch's rows between threads (each thread its rows through every step, no
    barrier; the default, where each thread gets two rows or more) or each step's unit blocks (a barrier a step), as
    a benchmark's other side."""
    lib = load()
    if lib is not None:
        ctypes.c_int.in_dll(lib, "kiln_lstm_fused_row_split").value = int(on)


def set_wide_tiles(mode: bool | int) -> None:
    """Which rows lstm_fused.c's row split (and one thread) runs on AVX2's wide tile (4 rows, each weight read once a
    step), as a benchmark's other side: True or 2 (the default) a rest of 4 or 8 rows past the full 6-row two-pass
    tiles (8 rows: 4 + 4), 1 a rest of 4 only, False or 0 none (2 + 2 one-pass, 6 + 2: the form before 2026-12-06).
    The same bits every way (kiln_lstm_fused_wide in lstm_fused.c)."""
    for lib in _LOADED.values():
        if lib is not None:
            ctypes.c_int.in_dll(lib, "kiln_lstm_fused_wide").value = 2 if mode is True else int(mode)


def set_whole_slices(on: bool) -> None:
    """Whether a thread of recurrent.c's step loop (run_stages: cpu.lstm.fused_blocks, lanes, native; GRU, RNN) claims
    its own slice of a step's items at once (the default) or item by item (the form before 2026-12-06), as a
    benchmark's other side. Results are the same either way."""
    for lib in _LOADED.values():
        if lib is not None:
            ctypes.c_int.in_dll(lib, "kiln_stage_whole_slices").value = int(on)


def set_fused_ahead(on: bool) -> None:
    """Whether lstm_fused.c's block split computes each thread's x part of a step before the step's barrier (the
    default) or after it (the form before 2026-12-06), as a benchmark's other side. The same bits either way."""
    for lib in _LOADED.values():
        if lib is not None:
            ctypes.c_int.in_dll(lib, "kiln_lstm_fused_ahead").value = int(on)


def reason(test_kernels: bool = False) -> str | None:
    return _REASON.get(test_kernels)


def available() -> bool:
    return load() is not None


def _address(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _geometry(cell: str, x: torch.Tensor, y: torch.Tensor | None, states: tuple, lengths: torch.Tensor | None,
              batch_major: bool) -> tuple[int, int, int, int, int]:
    """(steps, batch, y's step and batch strides, the states' shared row stride) of a run's operands, checked."""
    steps, batch = (x.shape[1], x.shape[0]) if batch_major else (x.shape[0], x.shape[1])
    if y is not None:
        y_ts, y_ns = (y.stride(1), y.stride(0)) if batch_major else (y.stride(0), y.stride(1))
    else:
        y_ts = y_ns = 0
    given = [s for s in states if s is not None]
    state_ns = given[0].stride(0) if given else 0
    if any(s.stride(0) != state_ns for s in given):
        raise ValueError(f"the {cell}'s initial and final states must share one row stride")
    if lengths is not None and (lengths.dtype != torch.int32 or not lengths.is_contiguous()):
        raise ValueError("lengths must be a contiguous int32 tensor")
    return steps, batch, y_ts, y_ns, state_ns


def _scratch(cache: dict, key: Any, floats: Callable[[], int]) -> torch.Tensor:
    """A layer's scratch for one run geometry, the oldest of more than five dropped (caller holds the lock)."""
    scratch = cache.get(key)
    if scratch is None:
        if len(cache) > 4:
            cache.pop(next(iter(cache)))
        scratch = cache[key] = torch.empty(floats())
    return scratch


class _Direction:
    """What the loops' directions share: a run on tensors, and the plan a native segment's member runs
    (RecurrentLayer). Subclasses set `cell`, `what`, `hidden`, `inputs`, `_function` (their loop in the library),
    `_scratch` and `_lock`, and say how much scratch a run takes and which plan fields are theirs."""

    cell: str
    what: str
    hidden: int
    inputs: int

    def scratch_floats(self, steps: int, batch: int) -> int:
        raise NotImplementedError

    def plan(self, steps: int, batch: int, *, reverse: bool, batch_major: bool, scratch: torch.Tensor) -> _Plan:
        """The loop's plan over `scratch` at these sizes; its operands (x, y, states, lengths) and their strides are
        the caller's to set."""
        raise NotImplementedError

    def run(self, x: torch.Tensor, y: torch.Tensor | None, h0: torch.Tensor | None, c0: torch.Tensor | None,
            yh: torch.Tensor | None, yc: torch.Tensor | None, *, reverse: bool, batch_major: bool,
            lengths: torch.Tensor | None = None) -> _Plan:
        """x: contiguous [S, N, I] (or [N, S, I] batch_major); y: where h of (t, n) goes, a [S, N, H] view
        whose last dim is contiguous (or [N, S, H] batch_major), or None; h0, c0, yh, yc: [N, H] views with
        contiguous rows, sharing one row stride (c0, yc: the LSTM's only); lengths: contiguous int32 [N] in
        [0, S] (checked by the caller), or None. Returns the plan it ran: its out fields say how (stalled,
        waited_ns, loop_ns; row_slices and ahead on lstm_fused.c)."""
        steps, batch, y_ts, y_ns, state_ns = _geometry(self.cell, x, y, (h0, c0, yh, yc), lengths, batch_major)
        with self._lock:  # the scratch is this layer's: two contexts of one engine take turns
            scratch = _scratch(self._scratch, (steps, batch), lambda: self.scratch_floats(steps, batch))
            plan = self.plan(steps, batch, reverse=reverse, batch_major=batch_major, scratch=scratch)
            plan.x, plan.y, plan.y_ts, plan.y_ns, plan.state_ns = x.data_ptr(), _address(y), y_ts, y_ns, state_ns
            plan.h0, plan.c0, plan.yh, plan.yc = _address(h0), _address(c0), _address(yh), _address(yc)
            plan.lengths = _address(lengths)
            status = self._function(ctypes.byref(plan), None, 0, None)
        if status:
            raise RuntimeError(f"kiln {self.what} [{steps}, {batch}, {self.inputs}] -> {self.hidden} failed ({status})")
        return plan


class RecurrentDirection(_Direction):
    """One direction of an ONNX RNN / GRU / LSTM layer: W [G·H, I], R [G·H, H] (ONNX's gate order), B [2·G·H]
    or None, P [3·H] (LSTM peepholes i, o, f) or None, packed once with the gate rows of each NR-unit block
    side by side (recurrent.c). `activations`: the spec's f, g(, h) for this direction (None: the defaults);
    `clip`: None or the bound of every gate's pre-activation."""

    def __init__(self, cell: str, w: torch.Tensor, r: torch.Tensor, b: torch.Tensor | None, *,
                 peepholes: torch.Tensor | None = None, linear_before_reset: bool = False,
                 input_forget: bool = False, activations: list[Activation] | None = None,
                 clip: float | None = None, kernel: gemm_native.Kernel | None = None):
        if cell not in GATES:
            raise ValueError(f"unknown recurrent cell {cell!r}: one of {sorted(GATES)}")
        test_kernels = kernel is not None and kernel.test_only
        lib = load(test_kernels)
        if lib is None:
            raise RuntimeError(f"kiln's recurrent layers are not built: {reason(test_kernels)}")
        self._lib, self.cell = lib, cell
        self.kernel = kernel or gemm_native.best_kernel()
        if not self.kernel.supported:
            raise ValueError(f"kernel {self.kernel.name!r} does not run on this CPU")
        gates = self.gates = GATES[cell]
        hidden, inputs = int(r.shape[1]), int(w.shape[1])
        self.hidden, self.inputs = hidden, inputs
        nr = self.kernel.nr
        columns = int(lib.kiln_recurrent_gate_columns(self.kernel.index, hidden, gates))
        units = columns // gates  # blocks·NR
        # permuted row k of the packed matrices: unit block u, gate q, lane j -> ONNX row q*H + u*NR + j (or zeros)
        k = torch.arange(columns)
        u, q, j = k // (gates * nr), k // nr % gates, k % nr
        unit = u * nr + j
        source = torch.where(unit < hidden, q * hidden + unit, gates * hidden)  # G·H: the zero row appended below
        by_unit = torch.where(torch.arange(units) < hidden, torch.arange(units), hidden)  # [blocks·NR] -> unit

        def permuted(m: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:  # m [rows of ONNX, k] -> [len(rows), k]
            m = m.detach().to(torch.float32)
            return torch.cat([m, m.new_zeros((1, m.shape[1]))]).index_select(0, rows).contiguous()

        wb, rb = (torch.zeros(gates * hidden), torch.zeros(gates * hidden)) if b is None else \
            b.detach().to(torch.float32).reshape(2, gates * hidden).unbind(0)
        folded = wb + rb  # [G·H]: both biases in xw ...
        self._bias_rh = None
        if cell == "GRU" and linear_before_reset:  # ... but Rb_h, multiplied by r each step
            folded = torch.cat([folded[:2 * hidden], wb[2 * hidden:]])
            self._bias_rh = permuted(rb[2 * hidden:].reshape(hidden, 1), by_unit).reshape(units)
        self._bias = permuted(folded.reshape(gates * hidden, 1), source).reshape(columns)
        self._peepholes = None
        if peepholes is not None:  # [3·H] (i, o, f) -> [3, blocks·NR]
            p = peepholes.detach().to(torch.float32).reshape(3, hidden)
            self._peepholes = torch.stack([permuted(p[g].reshape(hidden, 1), by_unit).reshape(units)
                                           for g in range(3)]).contiguous()
        self._w = self._pack(permuted(w.reshape(gates * hidden, inputs), source), columns, inputs)
        self._r = self._pack(permuted(r.reshape(gates * hidden, hidden), source), columns, hidden)
        self.columns = columns
        names = activations or [Activation(a) for a in DEFAULT_ACTIVATIONS[cell]]
        if len(names) != len(DEFAULT_ACTIVATIONS[cell]) or any(a.name not in ACTIVATIONS for a in names):
            raise ValueError(f"{cell} takes {len(DEFAULT_ACTIVATIONS[cell])} activations of {sorted(ACTIVATIONS)}, "
                             f"given {[a.name for a in names]}")
        self._acts = (_Act * 3)(*[_Act(ACTIVATIONS[a.name], a.alpha, a.beta) for a in names])
        self._clip = 0.0 if clip is None else float(clip)
        if clip is not None and not clip > 0:
            raise ValueError(f"clip must be positive, given {clip}")
        self._linear_before_reset, self._input_forget = int(bool(linear_before_reset)), int(bool(input_forget))
        self._generic = int(cell == "LSTM" and ([a.name for a in names] != DEFAULT_ACTIVATIONS["LSTM"]
                                                or any(a.alpha or a.beta for a in names) or clip is not None
                                                or peepholes is not None or bool(input_forget)))
        self._function = getattr(lib, {"RNN": "kiln_rnn", "GRU": "kiln_gru", "LSTM": "kiln_lstm"}[cell])
        self.what = cell
        self._scratch: dict[tuple[int, int], torch.Tensor] = {}
        self._lock = threading.Lock()

    def _pack(self, m: torch.Tensor, n: int, k: int) -> torch.Tensor:
        packed = hugepages.empty(self._lib.kiln_gemm_packed_floats(self.kernel.index, n, k))
        self._lib.kiln_gemm_pack_w(self.kernel.index, m.data_ptr(), n, k, packed.data_ptr())
        return packed

    def scratch_floats(self, steps: int, batch: int) -> int:
        return self._lib.kiln_recurrent_scratch_floats(self.kernel.index, steps, batch, self.inputs, self.hidden,
                                                       self.gates)

    def plan(self, steps: int, batch: int, *, reverse: bool, batch_major: bool, scratch: torch.Tensor) -> _Plan:
        return _Plan(packed_w=self._w.data_ptr(), packed_r=self._r.data_ptr(), bias=self._bias.data_ptr(),
                     bias_rh=_address(self._bias_rh), peepholes=_address(self._peepholes), scratch=scratch.data_ptr(),
                     S=steps, N=batch, I=self.inputs, H=self.hidden, kernel=self.kernel.index, threads=0,
                     reverse=int(reverse), batch_major=int(batch_major), gates=self.gates,
                     linear_before_reset=self._linear_before_reset, input_forget=self._input_forget,
                     generic=self._generic, act=self._acts, clip=self._clip)


@dataclass(frozen=True)
class LanesKernel:
    """One of lstm_lanes.c's tiles: `units` hidden units (4·units gate rows) by LANES batch rows."""

    index: int
    name: str
    supported: bool
    test_only: bool


def lanes_kernels(test_kernels: bool = False) -> list[LanesKernel]:
    """lstm_lanes.c's tiles in kiln's order of preference (AVX-512, AVX2, portable)."""
    lib = load(test_kernels)
    if lib is None:
        return []
    return [LanesKernel(i, lib.kiln_lstm_lanes_kernel_name(i).decode(), bool(lib.kiln_lstm_lanes_kernel_supported(i)),
                        bool(lib.kiln_lstm_lanes_kernel_test_only(i)))
            for i in range(lib.kiln_lstm_lanes_kernel_count())]


def lanes_batch() -> int:
    """The most batch rows lstm_lanes.c runs (its vector lanes)."""
    lib = load()
    return 0 if lib is None else int(lib.kiln_lstm_lanes_batch())


class LanesLSTMDirection(_Direction):
    """One direction of an ONNX LSTM with the default activations (no clip, peepholes or input_forget) on
    lstm_lanes.c: the batch (up to lanes_batch() rows) in the vector lanes, the input projection inside the
    loop. W [4H, I], R [4H, H], B [8H] or None are packed once per tile of hidden units. run() takes what
    RecurrentDirection.run takes; a batch past the lanes is a ValueError (the caller runs the row loop)."""

    def __init__(self, w: torch.Tensor, r: torch.Tensor, b: torch.Tensor | None, *,
                 kernel: LanesKernel | None = None):
        test_kernels = kernel is not None and kernel.test_only
        lib = load(test_kernels)
        if lib is None:
            raise RuntimeError(f"kiln's recurrent layers are not built: {reason(test_kernels)}")
        self._lib, self.cell = lib, "LSTM"
        self.kernel = kernel or next(k for k in lanes_kernels() if k.supported and not k.test_only)
        if not self.kernel.supported:
            raise ValueError(f"kernel {self.kernel.name!r} does not run on this CPU")
        self.hidden, self.inputs, self.gates = int(r.shape[1]), int(w.shape[1]), 4
        self.lanes = int(lib.kiln_lstm_lanes_batch())
        hidden = self.hidden
        folded = torch.zeros(4 * hidden) if b is None else \
            b.detach().to(torch.float32).reshape(2, 4 * hidden).sum(0)  # Wb + Rb: [4H]
        self._w, self._bias = self._pack(w, self.inputs, folded)
        self._r, _ = self._pack(r, hidden, None)
        self._function, self.what = lib.kiln_lstm_lanes, "lane LSTM"
        self._scratch: dict[tuple[int, int], torch.Tensor] = {}
        self._lock = threading.Lock()

    def _pack(self, m: torch.Tensor, k: int, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        floats = self._lib.kiln_lstm_lanes_packed_floats(self.kernel.index, self.hidden, k)
        m = m.detach().to(torch.float32).reshape(4 * self.hidden, k).contiguous()
        packed = hugepages.empty(floats)
        out_bias = None if bias is None else torch.empty(floats // k)  # [tiles, 4·UT]
        self._lib.kiln_lstm_lanes_pack(self.kernel.index, m.data_ptr(), self.hidden, k, packed.data_ptr(),
                                       None if bias is None else bias.contiguous().data_ptr(),
                                       None if out_bias is None else out_bias.data_ptr())
        return packed, out_bias

    def scratch_floats(self, steps: int, batch: int) -> int:
        return self._lib.kiln_lstm_lanes_scratch_floats(self.kernel.index, steps, self.inputs, self.hidden)

    def plan(self, steps: int, batch: int, *, reverse: bool, batch_major: bool, scratch: torch.Tensor) -> _Plan:
        if batch > self.lanes:
            raise ValueError(f"batch {batch} is past the {self.lanes} lanes of kiln's lane LSTM")
        return _Plan(packed_w=self._w.data_ptr(), packed_r=self._r.data_ptr(), bias=self._bias.data_ptr(),
                     scratch=scratch.data_ptr(), S=steps, N=batch, I=self.inputs, H=self.hidden,
                     kernel=self.kernel.index, threads=0, reverse=int(reverse), batch_major=int(batch_major), gates=4)


@dataclass(frozen=True)
class FusedKernel:
    """One of lstm_fused.c's tiles: a block of `units` hidden units (4 gate vectors) by up to `rows` batch rows."""

    index: int
    name: str
    units: int
    supported: bool
    test_only: bool


def fused_kernels(test_kernels: bool = False) -> list[FusedKernel]:
    """lstm_fused.c's tiles in kiln's order of preference (AVX-512, AVX2, portable)."""
    lib = load(test_kernels)
    if lib is None:
        return []
    return [FusedKernel(i, lib.kiln_lstm_fused_kernel_name(i).decode(), int(lib.kiln_lstm_fused_kernel_units(i)),
                        bool(lib.kiln_lstm_fused_kernel_supported(i)), bool(lib.kiln_lstm_fused_kernel_test_only(i)))
            for i in range(lib.kiln_lstm_fused_kernel_count())]


def fused_tile_plan(kernel: FusedKernel, rows: int, *, wide: bool | int = False) -> list[tuple[int, bool | str]]:
    """The tiles lstm_fused.c runs a slice of `rows` batch rows on, in row order: (rows, two-pass) each. AVX2's
    kernel: full 6-row two-pass tiles, the rest one-pass (8 rows: 6 + 2); the others: tiles as even as they go.
    `wide`: the row split's plan (and one thread's) in set_wide_tiles' mode (True: the default), where a rest of
    AVX2's 4 or 8 rows runs on its wide tile: (4, "wide") each."""
    lib = load()  # the tables of both builds are one (test_only marks an entry, it does not add one)
    if lib is None:
        raise RuntimeError(f"kiln's recurrent layers are not built: {reason()}")
    most = max(int(rows), 1)
    found, two_pass = (ctypes.c_long * most)(), (ctypes.c_int * most)()
    count = lib.kiln_lstm_fused_tile_plan(kernel.index, int(rows), 2 if wide is True else int(wide), found, two_pass,
                                          most)
    return [(int(found[t]), "wide" if two_pass[t] == 2 else bool(two_pass[t])) for t in range(count)]


class FusedLSTMDirection(_Direction):
    """One direction of an ONNX LSTM with the default activations (no clip, peepholes or input_forget) on
    lstm_fused.c: per step and block of hidden units, the input projection, the recurrent GEMM and the cell
    in one register tile. W [4H, I], R [4H, H] are packed once side by side along K, B [8H] (or None) folded
    to Wb + Rb after them. run() takes what RecurrentDirection.run takes, any batch.

    `split`: how two threads and more share a call: "rows" (each thread a slice of the batch's rows through every
    step, where each gets two rows or more), "blocks" (each step's unit blocks, a barrier a step), or None: the
    library's default (set_row_split). Which is faster depends on the CPU (lstm_fused.c's note on
    kiln_lstm_fused_row_split): the builder times cpu.lstm.fused (rows) and cpu.lstm.fused_blocks."""

    SPLITS = {None: 0, "rows": 1, "blocks": 2}  # kiln_recurrent_plan.split

    def __init__(self, w: torch.Tensor, r: torch.Tensor, b: torch.Tensor | None, *,
                 kernel: FusedKernel | None = None, split: str | None = None):
        if split not in self.SPLITS:
            raise ValueError(f"split {split!r} is not one of {sorted(k for k in self.SPLITS if k)} or None")
        self.split = split
        test_kernels = kernel is not None and kernel.test_only
        lib = load(test_kernels)
        if lib is None:
            raise RuntimeError(f"kiln's recurrent layers are not built: {reason(test_kernels)}")
        self._lib, self.cell = lib, "LSTM"
        self.kernel = kernel or next(k for k in fused_kernels() if k.supported and not k.test_only)
        if not self.kernel.supported:
            raise ValueError(f"kernel {self.kernel.name!r} does not run on this CPU")
        self.hidden, self.inputs, self.gates = int(r.shape[1]), int(w.shape[1]), 4
        hidden, inputs = self.hidden, self.inputs
        if tuple(w.shape) != (4 * hidden, inputs) or tuple(r.shape) != (4 * hidden, hidden):
            raise ValueError(f"LSTM W {list(w.shape)} / R {list(r.shape)} are not [4·H, I] / [4·H, H]")
        folded = None if b is None else \
            b.detach().to(torch.float32).reshape(2, 4 * hidden).sum(0).contiguous()  # Wb + Rb: [4H]
        w = w.detach().to(torch.float32).contiguous()
        r = r.detach().to(torch.float32).contiguous()
        floats = lib.kiln_lstm_fused_packed_floats(self.kernel.index, hidden, inputs)
        self._packed = hugepages.empty(floats)  # [blocks][2][I + H][2·U], then the bias [blocks][4·U]
        lib.kiln_lstm_fused_pack(self.kernel.index, w.data_ptr(), r.data_ptr(), _address(folded), hidden, inputs,
                                 self._packed.data_ptr())
        blocks = -(-hidden // self.kernel.units)
        self._bias = self._packed[blocks * (inputs + hidden) * 4 * self.kernel.units:]
        self._function, self.what = lib.kiln_lstm_fused, "fused LSTM"
        self._scratch: dict[tuple[int, int], torch.Tensor] = {}
        self._lock = threading.Lock()

    def scratch_floats(self, steps: int, batch: int) -> int:
        return self._lib.kiln_lstm_fused_scratch_floats(steps, batch, self.hidden)

    def plan(self, steps: int, batch: int, *, reverse: bool, batch_major: bool, scratch: torch.Tensor) -> _Plan:
        return _Plan(packed_w=self._packed.data_ptr(), bias=self._bias.data_ptr(), scratch=scratch.data_ptr(),
                     S=steps, N=batch, I=self.inputs, H=self.hidden, kernel=self.kernel.index, threads=0,
                     reverse=int(reverse), batch_major=int(batch_major), gates=4, split=self.SPLITS[self.split])


class _MemberPlan(ctypes.Structure):  # recurrent_member_plan in recurrent.c
    _fields_ = [("get_handle", ctypes.c_void_p), ("x", ctypes.c_void_p), ("y", ctypes.c_void_p),
                ("h0", ctypes.c_void_p), ("c0", ctypes.c_void_p), ("yh", ctypes.c_void_p), ("yc", ctypes.c_void_p),
                ("plans", ctypes.c_void_p), ("loop", ctypes.c_void_p), ("directions", ctypes.c_long),
                ("y_direction", ctypes.c_long), ("state_direction", ctypes.c_long), ("lengths", ctypes.c_void_p)]


# the step inputs a layer reads as a native segment's member, by ONNX input index, and its outputs' roles past Y
X_INPUT, LENGTHS, INITIAL_H, INITIAL_C = 0, 4, 5, 6
FINAL_ROLES = ("dst1", "dst2")  # Y_h, Y_c


class RecurrentLayer:
    """An ONNX RNN / GRU / LSTM layer (every direction) at fixed sizes, as a member of a native segment
    (kiln/runtime/native.py) runs it: one call into kiln_recurrent_member, which reads X, Y, the initial states the
    segment computes and the final states from oneDNN memory objects, so the segment points them per run as it
    does for every other member, and runs each direction's loop on a plan made at bind time.

    `directions`: one loop per direction (ONNX's order: forward, then reverse); `steps`, `batch`: X's sizes;
    `initial`: the initial h and c when they are constants of the engine (contiguous [D, N, H], or [N, D, H]
    batch_major), else None (zeros, or read as the step inputs INITIAL_H, INITIAL_C where bind_reads is given
    them); `finals`: the final states it may write (1 RNN / GRU, 2 LSTM); `lengths`: sequence_lens when a constant
    of the engine (contiguous int32 [N] in [0, steps], checked by the caller), else None (every row runs every step,
    or read as the step input LENGTHS, int32 [N], where bind_reads is given it: kiln_recurrent_member checks it)."""

    def __init__(self, directions: list[_Direction], steps: int, batch: int, *, batch_major: bool, reverse_only: bool,
                 initial: tuple[torch.Tensor | None, torch.Tensor | None], finals: int,
                 lengths: torch.Tensor | None = None):
        count = len(directions)
        hidden, inputs = directions[0].hidden, directions[0].inputs
        self.directions, self.steps, self.batch = directions, steps, batch
        self.batch_major, self.reverse_only, self.initial, self.lengths = batch_major, reverse_only, initial, lengths
        self.what = f"{directions[0].cell} [{steps}, {batch}, {inputs}] -> {hidden}"
        self.input_size = (batch, steps, inputs) if batch_major else (steps, batch, inputs)
        self.output_size = (batch, steps, count, hidden) if batch_major else (steps, count, batch, hidden)  # Y
        self.state_size = (batch, count, hidden) if batch_major else (count, batch, hidden)
        self.more_outputs = ((self.state_size, torch.float32),) * finals
        # floats from one direction's Y / state to the next's, and the strides of a direction's rows in them
        self.y_direction, self.state_direction = (hidden, hidden) if batch_major else (batch * hidden, batch * hidden)
        self.y_ts, self.y_ns = (count * hidden, steps * count * hidden) if batch_major else \
            (count * batch * hidden, hidden)
        self.state_ns = count * hidden if batch_major else hidden
        self._lib = load()

    def bind_reads(self, dst: int, reads: dict[object, int]) -> RecurrentCall:
        """The layer's call writing Y at dst and reading each role (X_INPUT, LENGTHS, INITIAL_H, INITIAL_C; "dst1",
        "dst2": the final states) at its address (0: pointed per run)."""
        return RecurrentCall(self, {"dst": dst, **reads})


class RecurrentCall:
    """One bound call of a RecurrentLayer: its memory objects, plans and scratch (each call its own: a segment's
    lock serializes the runs of its calls, and two segments never share one)."""

    def __init__(self, layer: RecurrentLayer, addresses: dict[object, int]):
        lib = onednn.load()
        self.what = layer.what
        self._md = onednn.memory_desc([1], onednn.TAG_A)  # only the handle matters to kiln_recurrent_member
        self._memories = {role: onednn._memory(self._md.value, address) for role, address in addresses.items()}
        steps, batch = layer.steps, layer.batch
        self._scratch = [torch.empty(d.scratch_floats(steps, batch)) for d in layer.directions]
        plans = []
        for k, (direction, scratch) in enumerate(zip(layer.directions, self._scratch)):
            plan = direction.plan(steps, batch, reverse=layer.reverse_only or k == 1, batch_major=layer.batch_major,
                                  scratch=scratch)
            plan.y_ts, plan.y_ns, plan.state_ns = layer.y_ts, layer.y_ns, layer.state_ns
            plan.h0, plan.c0 = (None if s is None else s.data_ptr() + 4 * k * layer.state_direction
                                for s in layer.initial)
            plan.lengths = _address(layer.lengths)
            plans.append(plan)
        self._plans = (_Plan * len(plans))(*plans)
        self._layer = layer  # the constant initial states and the packed weights the plans point at

        def memory(role: object) -> int | None:
            found = self._memories.get(role)
            return None if found is None else found.value

        self._plan = _MemberPlan(
            get_handle=ctypes.cast(lib.lib.dnnl_memory_get_data_handle, ctypes.c_void_p).value,
            x=memory(X_INPUT), y=memory("dst"), h0=memory(INITIAL_H), c0=memory(INITIAL_C), yh=memory(FINAL_ROLES[0]),
            yc=memory(FINAL_ROLES[1]), plans=ctypes.addressof(self._plans),
            loop=ctypes.cast(layer.directions[0]._function, ctypes.c_void_p).value, directions=len(plans),
            y_direction=layer.y_direction, state_direction=layer.state_direction, lengths=memory(LENGTHS))
        self._function = ctypes.cast(layer._lib.kiln_recurrent_member, ctypes.c_void_p).value

    def calls(self) -> list[tuple[int | None, int, int, int]]:
        return [(self._function, ctypes.addressof(self._plan), 0, 0)]

    def memory(self, role: object) -> int:
        return self._memories[role].value

    def run(self) -> None:
        """The call on the addresses its memory objects hold (a segment's loop makes it; this is for tests)."""
        status = self._layer._lib.kiln_recurrent_member(ctypes.addressof(self._plan), None, 0, None)
        if status:
            raise RuntimeError(f"kiln {self.what} failed ({status})")
