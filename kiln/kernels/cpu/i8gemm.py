"""kiln::QGemm and 1x1 kiln::QConv in kiln's C on AVX2 without VNNI (i8gemm.c): 8-bit rows x [M, K] times an int8
weight [N, K], exact int32 sums (vpmaddubsw + vpmaddwd), the zero point, bias, scale, activation (Relu/Clip;
Gelu/GeluTanh by gemm.c's vector forms) and requantization fused on the sums (a 1x1 convolution: its NHWC rows,
kiln/tactics/cpu/qconv_kiln.py).

Why: on a Zen 3 without VNNI oneDNN's int8 matmul ran MiniLM's QDQ GEMMs 1.09-1.5x slower than onnxruntime's MLAS
(bench/results/qdq-avx2-2026-12-07.md). This kernel runs them at 92-95% of the core's u8s8 ceiling, 1.1-1.2x faster
than oneDNN's and ~2x fp32 (bench/results/int8-gemm-avx2-2026-12-07.md); a candidate the tuner times against oneDNN's
int8 matmul and the float layer (kiln/tactics/cpu/qgemm_kiln.py).

Exact where it is offered: every weight pair the kernel adds in int16 (k = 2j, 2j + 1 of one channel) has
|w1| + |w2| <= 128 (`worst_pair`; 7-bit weights, onnxruntime's reduce_range, always do), and every channel's
255·Σ|w| + |offset| fits int32 (`sum_bound`). A weight that fails either raises ValueError (the tuner drops the
candidate with the reason).

Runnable on tensors (`__call__`) and inside a native segment (`bind`: one C call in the segment's compiled loop).
"""

from __future__ import annotations

import copy
import ctypes
from pathlib import Path

import torch

from kiln.kernels.cpu import gemm_native, native_loop, onednn, onednn_int8, plan_member, requantize

SOURCE = Path(__file__).with_name("i8gemm.c").read_text()
ACTIVATIONS = {"": 0, "Relu": 1, "Clip": 4, "Gelu": 8, "GeluTanh": 8}  # i8gemm.c's ACT_* (8: gemm.c's, by its code)
OUTSIDE = 8  # ACT_GEMM: applied to each tile's floats by gemm.c's kiln_gemm_activate
OUTPUTS = {torch.float32: 0, torch.uint8: 1, torch.int8: 2, torch.int32: 3}  # OUT_*; int32: t itself (tests)
SOURCES = (torch.uint8, torch.int8)
PAIR_LIMIT = 128  # |w1| + |w2| of a pair: 255·128 = 32640 fits vpmaddubsw's int16 sum
INT32_MAX = 2**31 - 1
PARALLEL_MACS = 1 << 18  # below this many multiply-adds one thread: a parallel loop costs ~2-5 µs


class Plan(ctypes.Structure):  # i8_plan in i8gemm.c
    _fields_ = [("get_handle", ctypes.c_void_p), ("x", ctypes.c_void_p), ("y", ctypes.c_void_p),
                ("w", ctypes.c_void_p), ("offset", ctypes.c_void_p), ("scale", ctypes.c_void_p),
                ("scale_q", ctypes.c_void_p), ("M", ctypes.c_long), ("K", ctypes.c_long), ("N", ctypes.c_long),
                ("x_signed", ctypes.c_int),
                ("activation", ctypes.c_int), ("gemm_activation", ctypes.c_int), ("alpha", ctypes.c_float),
                ("beta", ctypes.c_float), ("alpha_q", ctypes.c_float), ("beta_q", ctypes.c_float),
                ("out", ctypes.c_int), ("y_scale", ctypes.c_float), ("y_zero", ctypes.c_long),
                ("threads", ctypes.c_int),
                *((name, ctypes.c_int) for name in ("bounded", "clamp_words", "lo_word", "hi_word"))]


def _setup(lib: ctypes.CDLL) -> None:
    lib.kiln_i8_panel.restype = lib.kiln_i8_isa.restype = ctypes.c_int
    lib.kiln_i8_panel.argtypes = lib.kiln_i8_isa.argtypes = []
    lib.kiln_i8_pack.restype = None
    lib.kiln_i8_pack.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long]
    lib.kiln_i8_run.restype = ctypes.c_int
    lib.kiln_i8_run.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    # its loops on the GEMM library's pool (pool.c), the workers every kiln kernel shares; else OpenMP's
    ctypes.c_void_p.in_dll(lib, "kiln_shared_parallel_for").value = gemm_native.parallel_for_address()
    gemm = gemm_native.load()  # GELU: gemm.c's vector forms (None without the GEMM library: GELU refused)
    ctypes.c_void_p.in_dll(lib, "kiln_gemm_activate").value = \
        None if gemm is None else ctypes.cast(gemm.kiln_gemm_activate, ctypes.c_void_p).value


def outside_activations() -> bool:
    """Whether GELU can be applied (gemm.c's kiln_gemm_activate was found when the kernel loaded)."""
    lib = load()
    return lib is not None and bool(ctypes.c_void_p.in_dll(lib, "kiln_gemm_activate").value)


_LIBRARY = native_loop.KernelLibrary(
    "i8gemm", SOURCE, ["kiln_i8_call"], setup=_setup,
    requires=(onednn.available,
              lambda: f"its operands are oneDNN memory objects, and oneDNN is unavailable: {onednn.reason()}"))
load, available, reason = _LIBRARY.load, _LIBRARY.available, _LIBRARY.reason  # built on first use


def vector_products() -> bool:
    """Whether the compiled kernel multiplies with AVX2 (else plain C: exact, but no candidate worth timing)."""
    lib = load()
    return lib is not None and lib.kiln_i8_isa() == 2


def worst_pair(w: torch.Tensor) -> int:
    """The largest |w[n, 2j]| + |w[n, 2j + 1]|: the pairs vpmaddubsw sums in int16 (exact while <= PAIR_LIMIT)."""
    a = w.to(torch.int32).abs()
    if a.shape[1] % 2:
        a = torch.nn.functional.pad(a, (0, 1))
    return int(a.reshape(a.shape[0], -1, 2).sum(dim=2).max()) if a.numel() else 0


def weight_refusal(w: torch.Tensor) -> str | None:
    """Why the kernel would not be exact on this weight (None: it is)."""
    worst = worst_pair(w)
    if worst > PAIR_LIMIT:
        return (f"a pair of adjacent weights of one output channel sums to {worst} in magnitude (> {PAIR_LIMIT}): "
                "vpmaddubsw's int16 sum could saturate (7-bit weights, reduce_range, always fit)")
    return None


def offsets(w: torch.Tensor, bias: torch.Tensor | None, x_zero: int) -> torch.Tensor:
    """bias[n] − x_zero·Σ_k w[n, k] as int64 [N] (x_zero: of the uint8 rows the kernel multiplies)."""
    o = -int(x_zero) * w.to(torch.int64).sum(dim=1)
    return o if bias is None else o + bias.to(torch.int64).reshape(-1)


def channel_bounds(w: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """The largest |t| of each output channel: 255·Σ|w[n]| + |offset[n]| (int64 [N])."""
    return 255 * w.to(torch.int64).abs().sum(dim=1) + offset.abs()


def sum_bound(w: torch.Tensor, offset: torch.Tensor) -> int:
    """The largest |t| the kernel's int32 can meet, over the channels."""
    return int(channel_bounds(w, offset).max()) if w.numel() else 0


class I8Gemm:
    """x [M, K] uint8/int8 -> act(x_scale·w_scale·(Σ (x − x_zero)·w + bias)) [M, N], float32 or requantized per tensor
    to uint8/int8 (`y`: (dtype, scale, zero point)); int32 (`y` = (torch.int32, 1, 0)): Σ (x − x_zero)·w + bias
    exactly, for tests."""

    def __init__(self, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None, rows: int,
                 x_dtype: torch.dtype, x_scale: float, x_zero: int, y: tuple[torch.dtype, float, int] | None = None,
                 activation: str = "", alpha: float = 0.0, beta: float = 0.0, threads: int | None = None):
        """w: int8 [N, K], symmetric; w_scale: one per output channel (or one); bias: int32 [N] at x_scale·w_scale,
        or None; x_dtype: torch.uint8 / torch.int8 with its zero point x_zero. Other row counts: `at_rows` (the packed
        weight shared)."""
        lib = load()
        if lib is None:
            raise RuntimeError(f"kiln's i8gemm kernel: {reason()}")
        if w.dtype != torch.int8 or w.dim() != 2:
            raise ValueError(f"i8gemm takes an int8 [N, K] weight, given {w.dtype} {list(w.shape)}")
        if x_dtype not in SOURCES:
            raise ValueError(f"i8gemm takes uint8/int8 rows, given {x_dtype}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r}: i8gemm applies {sorted(ACTIVATIONS)} only")
        if ACTIVATIONS[activation] == OUTSIDE and not outside_activations():
            raise ValueError(f"activation {activation!r}: applied by kiln's GEMM library, which is unavailable: "
                             f"{gemm_native.reason()}")
        if (refusal := weight_refusal(w)) is not None:
            raise ValueError(refusal)
        n, k = (int(d) for d in w.shape)
        # an int8 source is flipped to uint8 (x ^ 0x80 = x + 128) as the kernel copies it: its zero point moves too
        u_zero = int(x_zero) + (128 if x_dtype == torch.int8 else 0)
        offset = offsets(w, bias, u_zero)
        if sum_bound(w, offset) > INT32_MAX:
            raise ValueError(f"i8gemm [{n}, {k}]: a channel's sums could pass int32 (K or the bias too large)")
        self.x_dtype, self.n, self.k = x_dtype, n, k
        self.out_dtype = torch.float32 if y is None else y[0]
        if self.out_dtype not in OUTPUTS:
            raise ValueError(f"output {self.out_dtype}: float32, uint8, int8 (or int32 sums) only")
        panel = lib.kiln_i8_panel()
        n_pad = -(-n // panel) * panel
        w = w.contiguous()
        self._w = torch.empty(n_pad * (-(-k // 4) * 4), dtype=torch.int8)
        lib.kiln_i8_pack(w.data_ptr(), self._w.data_ptr(), n, k)
        self._offset = torch.zeros(n_pad, dtype=torch.int32)
        self._offset[:n] = offset.to(torch.int32)
        y_dtype, y_scale, y_zero = (torch.float32, 1.0, 0) if y is None else y
        scales = onednn_int8.combined_scales(x_scale, w_scale).expand(n)  # float64
        self._scale = torch.zeros(n_pad, dtype=torch.float32)
        self._scale[:n] = scales.to(torch.float32)
        # an 8-bit output's one multiply: x_scale·w_scale / y_scale rounded once (onnxruntime's requantize scale)
        self._scale_q = torch.zeros(n_pad, dtype=torch.float32)
        self._scale_q[:n] = (scales / float(y_scale)).to(torch.float32)
        self.wanted_threads = torch.get_num_threads() if threads is None else int(threads)
        self.fields = dict(w=self._w.data_ptr(), offset=self._offset.data_ptr(), scale=self._scale.data_ptr(),
                           scale_q=self._scale_q.data_ptr(), K=k, N=n, x_signed=int(x_dtype == torch.int8),
                           activation=ACTIVATIONS[activation],
                           gemm_activation=gemm_native.ACTIVATIONS[activation] if ACTIVATIONS[activation] == OUTSIDE
                           else 0, alpha=float(alpha), beta=float(beta),
                           alpha_q=float(alpha) / float(y_scale), beta_q=float(beta) / float(y_scale),
                           out=OUTPUTS[y_dtype], y_scale=float(y_scale), y_zero=int(y_zero),
                           **requantize.word_fields(self._scale_q[:n], channel_bounds(w, offset), y_dtype,
                                                    int(y_zero), activation, float(alpha), float(beta),
                                                    float(y_scale)))
        self._at(int(rows))

    def row_fields(self, rows: int) -> dict[str, int]:
        """The plan fields that follow the row count (what a native segment's view at other sizes rewrites)."""
        threads = self.wanted_threads if rows * self.k * self.n >= PARALLEL_MACS else 1
        return {"M": int(rows), "threads": threads}

    def _at(self, rows: int) -> None:
        self.fields.update(self.row_fields(rows))
        self.threads = self.fields["threads"]
        self.input_size, self.output_size = (rows, self.k), (rows, self.n)
        self.what = f"i8gemm {list(self.input_size)} -> {list(self.output_size)}"
        self._plan = Plan(**self.fields)

    def at_rows(self, rows: int) -> I8Gemm:
        """The layer at another row count on the same packed weight, offsets and scales (no second copy)."""
        other = copy.copy(self)
        other.fields = dict(self.fields)
        other._at(int(rows))
        return other

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] of the built rows and dtype -> y [M, N]."""
        if x.dtype != self.x_dtype or tuple(x.shape) != self.input_size:
            raise ValueError(f"{self.what}: given {x.dtype} {tuple(x.shape)}, expected {self.x_dtype} "
                             f"{self.input_size}")
        x = x.contiguous()
        y = torch.empty(self.output_size, dtype=self.out_dtype) if out is None else out
        if load().kiln_i8_run(ctypes.addressof(self._plan), x.data_ptr(), y.data_ptr()):
            raise MemoryError(f"{self.what}: the rows' padded copy could not be allocated")
        return y

    def run_into(self, x_address: int, y_address: int) -> None:
        """The layer from the rows at x_address (the built [M, K] and dtype, row-major) into y_address's [M, N]: no
        checks, no tensors made (a 1x1 convolution's launch on its NHWC memory, kiln/tactics/cpu/qconv_kiln.py)."""
        if load().kiln_i8_run(ctypes.addressof(self._plan), x_address, y_address):
            raise MemoryError(f"{self.what}: the rows' padded copy could not be allocated")

    def bind(self, src: int, dst: int, residual: int | None = None) -> _Bound:
        """The layer's call on memory objects of its own (a segment's planned addresses; 0: pointed at per run)."""
        if residual is not None:
            raise ValueError(f"{self.what}: the kernel adds no residual")
        return _Bound(self, src, dst)


class _Bound(plan_member.FieldsMember):
    """An I8Gemm's one call for a native segment: the plan reads its input's and output's addresses from their
    dnnl memory objects at each run (the segment points them at each call's tensors)."""

    def __init__(self, layer: I8Gemm, src: int, dst: int):
        super().__init__(layer, src, dst,
                         onednn_int8.memory_desc(list(layer.input_size), layer.x_dtype, onednn_int8.TAG_AB),
                         onednn_int8.memory_desc(list(layer.output_size), layer.out_dtype, onednn_int8.TAG_AB),
                         Plan, load().kiln_i8_call)
