"""A W8A16 pointwise convolution in one pass (w16gemm.c): the float32 NHWC input quantized to 16 bits as it is read,
multiplied by the int8 weight widened to int16 with int32 sums (AVX-512 VNNI `vpdpwssd`; vpmaddwd + vpaddd on AVX2),
and the layer's epilogue (per-channel scale, bias, Relu/Clip, float32 or requantized uint8/int8) on the sums.

Why: the split path (split16.c, then onednn_int8.W8A16Conv2d's two int8 convolutions, each on one byte) costs two
int8 layers, a byte-split pass and a second pass over the float output (bench/results/quantacc5-2026-12-06.md:
0.59-0.87x fp32 on MobileNetV2's 1x1 layers, 1.21x at 112x112). This reads the float input once and writes the
output once. Only 1x1 convolutions of stride 1, no padding, one group (a GEMM over the NHWC rows): the layers where
the precision between int8 and float pays (the depthwise ones move to fp32).

Runnable on tensors (`__call__`) and inside a native segment (`bind`: one C call in the segment's compiled loop).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kiln.kernels.cpu import native_loop, onednn_int8, plan_member

SOURCE = Path(__file__).with_name("w16gemm.c").read_text()
RANGES = {torch.uint16: (0, 65535), torch.int16: (-32768, 32767)}  # ONNX's saturation bounds
OFFSETS = {torch.uint16: 32768, torch.int16: 0}  # what makes the 16-bit value an int16
ACTIVATIONS = {"": 0, "Relu": 1, "Clip": 4}  # w16gemm.c's ACT_*
OUTPUTS = {torch.float32: 0, torch.uint8: 1, torch.int8: 2, torch.int32: 3}  # OUT_*; int32: the raw sums (tests)
EXACT_CHUNK = 256  # k pairs a chunk can always hold: 512·127·32768 < 2^31
ISA_NAMES = {513: "avx512-vnni vpdpwssd", 512: "avx512bw vpmaddwd", 2: "avx2 vpmaddwd", 0: "plain C"}
PARALLEL_MACS = 1 << 18  # below this many multiply-adds one thread: a parallel region costs ~2-5 µs


class Plan(ctypes.Structure):  # w16_plan in w16gemm.c
    _fields_ = [("get_handle", ctypes.c_void_p), ("x", ctypes.c_void_p), ("y", ctypes.c_void_p),
                ("w", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("M", ctypes.c_long), ("K", ctypes.c_long), ("O", ctypes.c_long), ("kc", ctypes.c_long),
                ("x_scale", ctypes.c_float), ("low", ctypes.c_long), ("high", ctypes.c_long),
                ("offset", ctypes.c_long), ("activation", ctypes.c_int), ("alpha", ctypes.c_float),
                ("beta", ctypes.c_float), ("out", ctypes.c_int), ("y_scale", ctypes.c_float),
                ("y_zero", ctypes.c_long), ("threads", ctypes.c_int)]


def _declare(lib: ctypes.CDLL) -> None:
    lib.kiln_w16_lanes.restype = lib.kiln_w16_isa.restype = ctypes.c_int
    lib.kiln_w16_lanes.argtypes = lib.kiln_w16_isa.argtypes = []
    lib.kiln_w16_pack.restype = None
    lib.kiln_w16_pack.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long]
    lib.kiln_w16_run.restype = None
    lib.kiln_w16_run.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]


_LIBRARY = native_loop.KernelLibrary("w16gemm", SOURCE, ["kiln_w16_call"], setup=_declare)
load, available, reason = _LIBRARY.load, _LIBRARY.available, _LIBRARY.reason  # built on first use


def isa() -> str:
    """Which products the compiled kernel uses on this CPU (ISA_NAMES)."""
    lib = load()
    return "unavailable" if lib is None else ISA_NAMES.get(lib.kiln_w16_isa(), "?")


def exact_chunk(w: torch.Tensor) -> int:
    """k pairs per int32 chunk: all of K where no channel's Σ|w|·32768 can pass 2^31, else EXACT_CHUNK."""
    k = w.reshape(w.shape[0], -1).shape[1]
    worst = int(w.reshape(w.shape[0], -1).to(torch.int64).abs().sum(dim=1).max()) if w.numel() else 0
    return max((k + 1) // 2, 1) if worst * 32768 <= 2**31 - 1 else EXACT_CHUNK


def pointwise_refusal(kernel: tuple[int, ...], strides: list[int], pads: list[int], dilations: list[int],
                      groups: int) -> str | None:
    """Why a convolution is not this kernel's GEMM (None: it is)."""
    if tuple(kernel) != (1, 1) or list(strides) != [1, 1] or any(pads) or groups != 1:
        return "a 1x1 convolution of stride 1, no padding, one group only (the one-pass W8A16 GEMM)"
    return None


class W16Gemm:
    """x float32 [N, C, H, W] channels-last -> act(Σ Q16(x)·w·scale + bias) [N, O, H, W] channels-last, float32 or
    requantized per tensor to uint8/int8 (`y`: (dtype, scale, zero point)); int32 (`y` = (torch.int32, 1, 0)): the
    raw sums Σ (q - offset)·w, for tests."""

    def __init__(self, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None, input_size: list[int],
                 x_scale: float, wide: torch.dtype, y: tuple[torch.dtype, float, int] | None = None,
                 activation: str = "", alpha: float = 0.0, beta: float = 0.0, threads: int | None = None):
        """w: int8 [O, C, 1, 1] (or [O, C]), symmetric; w_scale: per output channel (or one); bias: float [O], real
        values, or None; wide: torch.uint16 / torch.int16, the input's 16-bit type (zero point 0)."""
        lib = load()
        if lib is None:
            raise RuntimeError(f"kiln's w16gemm kernel: {reason()}")
        if w.dtype != torch.int8:
            raise ValueError(f"w16gemm takes an int8 weight, given {w.dtype}")
        if wide not in RANGES:
            raise ValueError(f"a 16-bit input type (torch.uint16 / torch.int16), given {wide}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r}: w16gemm applies {sorted(ACTIVATIONS)} only")
        n, c, h, width = (int(d) for d in input_size)
        w2 = w.reshape(w.shape[0], -1).contiguous()
        if w2.shape[1] != c:
            raise ValueError(f"a 1x1 weight of {c} input channels, given {tuple(w.shape)}")
        o = int(w2.shape[0])
        self.input_size, self.output_size = (n, c, h, width), (n, o, h, width)
        self.wide, self.x_scale = wide, float(x_scale)
        self.out_dtype = torch.float32 if y is None else y[0]
        if self.out_dtype not in OUTPUTS:
            raise ValueError(f"output {self.out_dtype}: float32, uint8, int8 (or int32 sums) only")
        self.what = f"w16gemm {list(self.input_size)} -> {list(self.output_size)}"
        lanes = lib.kiln_w16_lanes()
        o_pad = -(-o // lanes) * lanes
        self._w = torch.empty(o_pad * ((c + 1) // 2) * 2, dtype=torch.int16)
        lib.kiln_w16_pack(w2.data_ptr(), self._w.data_ptr(), o, c)
        # r = (x_scale·w_scale)·Σ (q - offset)·w + bias + (x_scale·w_scale)·offset·Σ w: the offset's sum in float64
        scale64 = float(x_scale) * w_scale.detach().to(torch.float64).reshape(-1).expand(o)
        bias64 = torch.zeros(o, dtype=torch.float64) if bias is None else bias.detach().to(torch.float64).reshape(-1)
        bias64 = bias64 + scale64 * OFFSETS[wide] * w2.to(torch.float64).sum(dim=1)
        self._scale = torch.zeros(o_pad, dtype=torch.float32)
        self._bias = torch.zeros(o_pad, dtype=torch.float32)
        self._scale[:o], self._bias[:o] = scale64.float(), bias64.float()
        low, high = RANGES[wide]
        y_dtype, y_scale, y_zero = (torch.float32, 1.0, 0) if y is None else y
        macs = n * h * width * c * o
        self.threads = (torch.get_num_threads() if threads is None else threads) if macs >= PARALLEL_MACS else 1
        self.fields = dict(w=self._w.data_ptr(), scale=self._scale.data_ptr(), bias=self._bias.data_ptr(),
                           M=n * h * width, K=c, O=o, kc=exact_chunk(w2), x_scale=self.x_scale, low=low, high=high,
                           offset=OFFSETS[wide], activation=ACTIVATIONS[activation], alpha=float(alpha),
                           beta=float(beta), out=OUTPUTS[y_dtype], y_scale=float(y_scale), y_zero=int(y_zero),
                           threads=self.threads)
        self._plan = Plan(**self.fields)
        if y_dtype == torch.int32 and self.fields["kc"] < (c + 1) // 2:
            raise ValueError(f"{self.what}: int32 sums asked of a weight whose sums need float chunks")
        self._out_strides = (h * width * o, 1, width * o, o)  # channels-last

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [N, C, H, W] float32 channels-last (or contiguous NHWC memory) -> [N, O, H, W] channels-last."""
        if x.dtype != torch.float32 or tuple(x.shape) != self.input_size:
            raise ValueError(f"{self.what}: given {x.dtype} {tuple(x.shape)}")
        x = x.contiguous(memory_format=torch.channels_last)
        y = torch.empty_strided(self.output_size, self._out_strides, dtype=self.out_dtype) if out is None else out
        load().kiln_w16_run(ctypes.addressof(self._plan), x.data_ptr(), y.data_ptr())
        return y

    def bind(self, src: int, dst: int, residual: int | None = None) -> _Bound:
        """The layer's call on memory objects of its own (a segment's planned addresses; 0: pointed at per run)."""
        return _Bound(self, src, dst)


class _Bound(plan_member.FieldsMember):
    """A W16Gemm's one call for a native segment: the plan reads its input's and output's addresses from their
    dnnl memory objects at each run (the segment points them at each call's tensors)."""

    def __init__(self, layer: W16Gemm, src: int, dst: int):
        tag = onednn_int8.TAG_ACDB
        super().__init__(layer, src, dst, onednn_int8.memory_desc(list(layer.input_size), torch.float32, tag),
                         onednn_int8.memory_desc(list(layer.output_size), layer.out_dtype, tag),
                         Plan, load().kiln_w16_call)


