"""A W8A16 layer (kiln::QConv of a float input quantized to 16 bits): split16's one pass over the float input, the two
int8 convolutions of onednn_int8.W8A16Conv2d, and, where the layer's output is 8-bit, a quantizing reorder; runnable
on tensors (`__call__`) and inside a native segment (`bind`: the calls in the segment's compiled loop, as a Winograd
layer's three, kiln/kernels/cpu/winograd.py).

Why a segment member: a step outside the segment splits it in two, and each part is entered and left through Python
(MobileNetV2 with 20 W8A16 layers: ~20 segments instead of one).
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import torch

from kiln.kernels.cpu import native_loop, onednn, onednn_int8, plan_member, split16


class W8A16Layer:
    """x float32 [N, C, H, W] channels-last -> act(conv(Q16(x), w)) float32, or requantized to y's 8 bits, NHWC."""

    def __init__(self, conv: onednn_int8.W8A16Conv2d, wide: torch.dtype, zero: int,
                 quantize: onednn_int8.ScaledReorder | None):
        self.conv, self.wide, self.zero, self.quantize = conv, wide, zero, quantize
        self.input_size, self.output_size = conv.input_size, conv.output_size
        self.out_dtype = torch.float32 if quantize is None else quantize.out_dtype
        self.what = f"w8a16 convolution {list(self.input_size)} -> {list(self.output_size)}"
        self._src_md = onednn_int8.memory_desc(list(self.input_size), torch.float32, onednn_int8.TAG_ACDB)
        self._lock = threading.Lock()
        self._alone: _Bound | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        r = self.conv(*split16.split(x, self.conv.x_scale, self.zero, self.wide))  # float32 channels-last
        return r if self.quantize is None else self.quantize(r)

    def bind(self, src: int, dst: int, residual: int | None = None) -> _Bound:
        """The layer's calls on memory objects of its own (a segment's planned addresses; 0: pointed at per run)."""
        return _Bound(self, src, dst)


class _Bound(plan_member.MemoriesMember):
    """A W8A16Layer's calls for one segment: split (kiln's C), high-byte convolution, low-byte convolution adding to
    it, [quantizing reorder]. The bytes (and a requantized layer's float result) in buffers of the binding's own."""

    def __init__(self, layer: W8A16Layer, src: int, dst: int):
        lib = onednn.load()
        kernels = split16.load()
        conv = layer.conv
        self.what = layer.what
        size = tuple(layer.input_size)
        cl = torch.channels_last
        self._hi = torch.empty(size, dtype=torch.uint8).contiguous(memory_format=cl)
        self._lo = torch.empty(size, dtype=torch.uint8).contiguous(memory_format=cl)
        self._memories = {"src": onednn._memory(layer._src_md.value, src)}
        quantize = layer.quantize
        if quantize is not None:  # the convolutions write float32 here, the reorder the 8-bit dst
            self._float = torch.empty(conv.output_size, dtype=torch.float32).contiguous(memory_format=cl)
            conv_dst = onednn._memory(conv.hi._dst_md.value, self._float.data_ptr())
            self._memories["dst"] = onednn._memory(quantize._dst_md.value, dst)
        else:
            conv_dst = self._memories["dst"] = onednn._memory(conv.hi._dst_md.value, dst)
        self._own = [conv_dst, onednn._memory(conv.hi._src_md.value, self._hi.data_ptr()),
                     onednn._memory(conv.lo._src_md.value, self._lo.data_ptr())]
        hi_mem, lo_mem = self._own[1], self._own[2]
        self._calls = []
        self._keep: list[Any] = []
        for primitive, first, second, fixed in (
                (conv.hi._prim, (onednn.ARG_SRC, hi_mem), (onednn.ARG_DST, conv_dst), conv.hi._fixed),
                (conv.lo._prim, (onednn.ARG_SRC, lo_mem), (onednn.ARG_DST, conv_dst), conv.lo._fixed),
                *(((quantize._prim, (onednn.ARG_FROM, self._own[0]), (onednn.ARG_TO, self._memories["dst"]),
                    quantize._fixed),) if quantize is not None else ())):
            args = [first, second] + list(fixed)
            array = (onednn._ExecArg * len(args))(*[onednn._ExecArg(a, m.value) for a, m in args])
            handle = onednn.own_primitive(primitive.value.value)  # its scratchpad its own: no other binding runs it
            self._keep += [array, handle]
            self._calls.append((None, handle.value.value, len(args), ctypes.addressof(array)))
        low = split16.RANGES[layer.wide][0]
        self._plan = split16.Plan(get_handle=ctypes.cast(lib.lib.dnnl_memory_get_data_handle, ctypes.c_void_p).value,
                                  src=self._memories["src"].value, hi=self._hi.data_ptr(), lo=self._lo.data_ptr(),
                                  n=self._hi.numel(), scale=conv.x_scale, zero=layer.zero, low=low,
                                  high=split16.RANGES[layer.wide][1])
        function = ctypes.cast(kernels.kiln_split16_call, ctypes.c_void_p).value
        self._calls.insert(0, (function, ctypes.addressof(self._plan), 0, 0))

    def calls(self) -> list[tuple[int | None, int, int, int]]:
        return list(self._calls)

