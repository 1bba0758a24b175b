"""kiln::QConv depthwise in kiln's C (qdepthwise.c): a KxK layer with one filter per channel on 8-bit NHWC
activations, its zero point, int32 bias, scale, Relu/Clip and requantization in one pass, a native-segment member.

Why: on AVX2 without VNNI oneDNN's int8 depthwise convolutions ran 1.27-1.89x its float ones (Zen 3,
bench/results/quant-cpu-2026-12-07.md): an int8 MobileNetV2 paid for its depthwise layers more than an fp32 one.
qdepthwise.c widens each input row once to int16 column pairs and runs two taps a vpmaddwd into int32 sums, exact for
any int8 weight, on a quarter of the float layer's input bytes. Which kernel a layer runs is the autotuner's pick
between this, oneDNN's int8 convolution and the float layer (kiln/tactics/cpu/qconv_kiln.py cpu.qconv.kiln_dw), timed
on the machine (bench/results/int8-mnv2-avx2-zen4-2026-12-07b.md).

Built by native_loop.build with the machine's C compiler (AVX-512 where the CPU has it and KILN_CPU_ISA does not cap
it, else AVX2; plain C without either); `load()` is None without a compiler.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kiln.kernels.cpu import depthwise, native_loop, onednn, onednn_int8, plan_member, requantize

SOURCE = Path(__file__).with_name("qdepthwise.c").read_text()
ACTIVATIONS = {"": 0, "Relu": 1, "Clip": 4}  # qdepthwise.c's ACT_* (i8gemm.c's numbering)
OUTPUTS = {torch.float32: 0, torch.uint8: 1, torch.int8: 2}  # OUT_*
SOURCES = (torch.uint8, torch.int8)
MAX_KERNEL = depthwise.MAX_KERNEL  # 8 taps a side (depthwise.c's)
INT32_MAX = 2**31 - 1


class _Plan(ctypes.Structure):  # qdw_plan in qdepthwise.c
    _fields_ = [("get_handle", ctypes.c_void_p), ("x", ctypes.c_void_p), ("y", ctypes.c_void_p),
                ("w", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("scale", ctypes.c_void_p),
                ("scale_q", ctypes.c_void_p), ("padding", ctypes.c_void_p),
                *((name, ctypes.c_long) for name in ("N", "C", "Cp", "H", "W", "OH", "OW")),
                *((name, ctypes.c_int) for name in ("KH", "KW", "SH", "SW", "PT", "PL", "KP", "G")),
                ("M", ctypes.c_long), ("x_signed", ctypes.c_int),
                ("activation", ctypes.c_int), ("alpha", ctypes.c_float), ("beta", ctypes.c_float),
                ("alpha_q", ctypes.c_float), ("beta_q", ctypes.c_float), ("out", ctypes.c_int),
                ("y_zero", ctypes.c_int),
                *((name, ctypes.c_int) for name in ("bounded", "clamp_words", "lo_word", "hi_word")),
                ("threads", ctypes.c_int), ("rings", ctypes.c_void_p), ("ring_elements", ctypes.c_long)]


_LIBRARY = native_loop.KernelLibrary("qdepthwise", SOURCE, ["kiln_qdepthwise", "kiln_qdepthwise_lanes"],
                                    requires=(onednn.available, "libdnnl.so.3 cannot be loaded (the kernel's operands "
                                                                "are oneDNN memory objects)"))
load, available, reason = _LIBRARY.load, _LIBRARY.available, _LIBRARY.reason  # the library, built on first use


def lanes() -> int:
    """The vector width the library was built for (16: AVX-512, 8: AVX2, 1: plain C)."""
    library = load()
    if library is None:
        raise onednn.OneDNNError(f"kiln's int8 depthwise kernel is not built: {reason()}")
    return int(library.kiln_qdepthwise_lanes(None, None, 0, None))


def refusal(weight_shape: tuple[int, ...], input_size: tuple[int, ...], groups: int, pads: list[int],
            strides: list[int], dilations: list[int]) -> str | None:
    """Why qdepthwise.c cannot run this convolution, or None: the float kernel's conditions (depthwise.c, the same
    MAX_KERNEL taps a side, which also keep these float sums exact) and strides up to 8."""
    if any(s > 8 for s in strides):
        return f"strides {list(strides)} (1 to 8)"
    return depthwise.refusal(weight_shape, input_size, groups, pads, strides, dilations)


class QDepthwiseConv(plan_member.PlanKernel):
    """y = requantize(act(x_scale·w_scale·(depthwise(x − z_x, w) + bias))), x [N, C, H, W] channels-last uint8/int8,
    w int8 [C, 1, KH, KW] (symmetric), bias int32 at x_scale·w_scale or None; y: (dtype, scale, zero point) of an
    8-bit output, None for float32. pads [top, left, bottom, right]. `bind(src, dst)` reads and writes NHWC."""

    NO_RESIDUAL = "the int8 depthwise kernel adds no residual"

    def __init__(self, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None, input_size: tuple[int, ...],
                 strides: list[int], pads: list[int], x_dtype: torch.dtype, x_scale: float, x_zero: int,
                 y: tuple[torch.dtype, float, int] | None, activation: str = "", alpha: float = 0.0,
                 beta: float = 0.0, dilations: list[int] | None = None):
        library = load()
        if library is None:
            raise onednn.OneDNNError(f"kiln's int8 depthwise kernel is not built: {reason()}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r}: the kernel applies {sorted(ACTIVATIONS)}")
        if x_dtype not in SOURCES or w.dtype != torch.int8:
            raise ValueError(f"the int8 depthwise kernel takes uint8/int8 sources and int8 weights, given {x_dtype}, "
                             f"{w.dtype}")
        n, c, h, wd = (int(d) for d in input_size)
        why = refusal(tuple(w.shape), (n, c, h, wd), c, list(pads), list(strides), list(dilations or [1, 1]))
        if why is not None:
            raise ValueError(f"int8 depthwise kernel: {why}")
        self.out_dtype = torch.float32 if y is None else y[0]
        if self.out_dtype not in OUTPUTS:
            raise ValueError(f"output {self.out_dtype}: float32, uint8, int8 only")
        kh, kw = int(w.shape[2]), int(w.shape[3])
        bias64 = torch.zeros(c, dtype=torch.int64) if bias is None else bias.detach().to(torch.int64).reshape(-1)
        if bias64.numel() != c:
            raise ValueError(f"a bias of {bias64.numel()} values for a layer of {c} channels")
        taps = w.detach().to(torch.int64).reshape(c, kh * kw)
        bias64 = bias64 - int(x_zero) * taps.sum(dim=1)  # the kernel sums x·w, a padding tap reading z_x
        sum_bound = bias64.abs() + taps.abs().sum(dim=1) * (255 if x_dtype == torch.uint8 else 128)  # [C]: max |t|
        if int(sum_bound.max()) > INT32_MAX:
            raise ValueError("int8 depthwise kernel: the bias could carry the int32 sums past their range")
        width = lanes()
        cp = -(-c // width) * width
        # [KH, KP, Cp, 2]: tap pairs (kw 2p, 2p + 1) side by side per channel, the vpmaddwd operand of qdepthwise.c;
        # zeros past KW and past C
        kp = -(-kw // 2)
        taps_khwc = torch.zeros(kh, 2 * kp, cp, dtype=torch.int16)
        taps_khwc[:, :kw, :c] = w.detach().to(torch.int16).reshape(c, kh, kw).permute(1, 2, 0)
        self._w = taps_khwc.reshape(kh, kp, 2, cp).permute(0, 1, 3, 2).contiguous()
        self._bias = torch.zeros(cp, dtype=torch.int32)
        self._bias[:c] = bias64.to(torch.int32)
        y_dtype, y_scale, y_zero = (torch.float32, 1.0, 0) if y is None else y
        scales = onednn_int8.combined_scales(x_scale, w_scale).expand(c)  # float64
        self._scale = torch.zeros(cp, dtype=torch.float32)
        self._scale[:c] = scales.to(torch.float32)
        # an 8-bit output's one multiply, x_scale·w_scale / y_scale rounded once (onnxruntime's requantize scale)
        self._scale_q = torch.zeros(cp, dtype=torch.float32)
        self._scale_q[:c] = (scales / float(y_scale)).to(torch.float32)
        pt, pl, pb, pr = (int(p) for p in pads)
        sh, sw = (int(s) for s in strides)
        oh, ow = (h + pt + pb - kh) // sh + 1, (wd + pl + pr - kw) // sw + 1
        self.input_size, self.output_size = (n, c, h, wd), (n, c, oh, ow)
        self.x_dtype = x_dtype
        self.library = library
        self.implementation = f"kiln qdepthwise.c ({width} lanes)"
        self.what = f"int8 depthwise {kh}x{kw}/{sh} {list(self.input_size)} -> {list(self.output_size)}"
        # each thread's ring of KH input rows widened to int16 column pairs, [M][Cp][2] a row (qdepthwise.c): a pair
        # starts at every column G (2 at even strides: only even columns start one, the stride-2 de-interleave)
        g = 2 if sw % 2 == 0 else 1
        pairs = ((ow - 1) * sw + 2 * (kp - 1)) // g + 1
        self.ring_elements = kh * pairs * cp * 2
        self._padding = torch.tensor([int(x_zero)] * c, dtype=x_dtype).view(torch.uint8)  # a padding column's bytes
        self._direct: _Plan | None = None  # __call__'s plan on raw addresses, made on first use
        self.fields = dict(w=self._w.data_ptr(), bias=self._bias.data_ptr(), scale=self._scale.data_ptr(),
                           scale_q=self._scale_q.data_ptr(), padding=self._padding.data_ptr(),
                           N=n, C=c, Cp=cp, H=h, W=wd, OH=oh, OW=ow, KH=kh, KW=kw, SH=sh, SW=sw, PT=pt, PL=pl,
                           KP=kp, G=g, M=pairs, x_signed=int(x_dtype == torch.int8),
                           activation=ACTIVATIONS[activation], alpha=float(alpha), beta=float(beta),
                           alpha_q=float(alpha) / float(y_scale), beta_q=float(beta) / float(y_scale),
                           out=OUTPUTS[y_dtype], y_zero=int(y_zero),
                           **requantize.word_fields(self._scale_q[:c], sum_bound, y_dtype, int(y_zero),
                                                    activation, float(alpha), float(beta), float(y_scale)))
        self._own_calls()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, C, H, W] channels-last of the built size and dtype -> a new channels-last y. Its own plan reads the
        tensors' addresses as they are (kiln_qdepthwise_address): no memory object to rebind a call, the launch the
        tuner times as cheap as oneDNN's."""
        if tuple(x.shape) != self.input_size or x.dtype != self.x_dtype or \
                not x.is_contiguous(memory_format=torch.channels_last):
            raise ValueError(f"{self.what}: given {x.dtype} {list(x.shape)} (channels-last {self.x_dtype} of the "
                             "built size)")
        n, c, h, w = self.output_size
        y = torch.empty_strided(self.output_size, (c * h * w, 1, w * c, c), dtype=self.out_dtype)
        with self._lock:
            if self._direct is None:
                threads = torch.get_num_threads() if n * c * h * w >= plan_member.PARALLEL_ELEMENTS else 1
                self._direct_rings = torch.empty(threads * self.ring_elements, dtype=torch.int16)
                address = ctypes.cast(self.library.kiln_qdepthwise_address, ctypes.c_void_p).value
                self._direct = _Plan(get_handle=address, x=0, y=0, threads=threads,
                                     rings=self._direct_rings.data_ptr(), ring_elements=self.ring_elements,
                                     **self.fields)
            self._direct.x, self._direct.y = x.data_ptr(), y.data_ptr()
            if self.library.kiln_qdepthwise(ctypes.addressof(self._direct), None, 0, None):
                raise onednn.OneDNNError(f"{self.what}: an operand's address is 0")
        return y


class _Bound(plan_member.PlanMember):
    """A QDepthwiseConv's call for one segment (or its own per-call path): a parallel form over output rows on
    OpenMP's count, and a serial one where the layer is small enough for the segment's chooser to time both
    (onednn_primitives.thread_forms), as depthwise.py's."""

    FUNCTION = "kiln_qdepthwise"

    def __init__(self, layer: QDepthwiseConv, src: int, dst: int):
        super().__init__(layer, src, dst)
        n, c, oh, ow = layer.output_size
        elements = n * c * oh * ow
        threads, serial = plan_member.thread_counts(elements, elements * layer.fields["KH"] * layer.fields["KW"])
        # a ring per thread, the serial form on the first (the two forms never run at once)
        self._rings = torch.empty(threads * layer.ring_elements, dtype=torch.int16)
        base = dict(self.plan_base(), rings=self._rings.data_ptr(), ring_elements=layer.ring_elements)
        self._plans(_Plan(**base, threads=threads, **layer.fields),
                    _Plan(**base, threads=1, **layer.fields) if serial else None)


QDepthwiseConv.MEMBER = _Bound
