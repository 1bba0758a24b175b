"""A float tensor quantized to 16 bits and split into its high and low bytes in one pass (split16.c): the input of
kiln's W8A16 convolution (onednn_int8.W8A16Conv2d), whose two int8 convolutions read one byte each.

Why C: the same in torch ops (divide, round, clamp, shift, mask, two casts) is several passes over the tensor and
cost more than the convolutions themselves (bench/results/quantacc4-2026-12-06.md: 8.77 ms over MobileNetV2's 52
layers against 5.28 for the convolutions); this is one read of the float tensor and two byte writes."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kiln.kernels.cpu import native_loop

SOURCE = Path(__file__).with_name("split16.c").read_text()
RANGES = {torch.uint16: (0, 65535), torch.int16: (-32768, 32767)}  # the 16-bit types, ONNX's saturation bounds


class Plan(ctypes.Structure):  # split16_plan in split16.c
    _fields_ = [("get_handle", ctypes.c_void_p), ("src", ctypes.c_void_p), ("hi", ctypes.c_void_p),
                ("lo", ctypes.c_void_p), ("n", ctypes.c_long), ("scale", ctypes.c_float), ("zero", ctypes.c_long),
                ("low", ctypes.c_long), ("high", ctypes.c_long)]


def _declare(lib: ctypes.CDLL) -> None:
    lib.kiln_split16.restype = None
    lib.kiln_split16.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_float,
                                 ctypes.c_long, ctypes.c_long, ctypes.c_long]


_LIBRARY = native_loop.KernelLibrary("split16", SOURCE, ["kiln_split16_call"], setup=_declare)
load, available, reason = _LIBRARY.load, _LIBRARY.available, _LIBRARY.reason  # built on first use


def split(x: torch.Tensor, scale: float, zero: int, dtype: torch.dtype,
          out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 x (any layout; the bytes keep its memory order) -> (hi, lo) uint8 of x's size and strides:
    q = QuantizeLinear(x; scale, zero) to `dtype` (torch.uint16 / torch.int16), q - the type's lowest = 256·hi + lo.
    `out`: the two byte tensors to write (x's size and strides)."""
    lib = load()
    if lib is None:
        raise RuntimeError(f"kiln's split16 kernel: {reason()}")
    if x.dtype != torch.float32 or not (x.is_contiguous() or x.is_contiguous(memory_format=torch.channels_last)):
        raise ValueError(f"split16 takes a dense float32 tensor, given {x.dtype} of strides {x.stride()}")
    low, high = RANGES[dtype]
    if not low <= zero <= high:
        raise ValueError(f"zero point {zero} outside {dtype}'s [{low}, {high}]")
    if out is None:
        out = (torch.empty_strided(x.shape, x.stride(), dtype=torch.uint8),
               torch.empty_strided(x.shape, x.stride(), dtype=torch.uint8))
    hi, lo = out
    lib.kiln_split16(x.data_ptr(), hi.data_ptr(), lo.data_ptr(), x.numel(), float(scale), int(zero), low, high)
    return hi, lo
