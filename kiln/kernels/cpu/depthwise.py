"""Depthwise convolution in kiln's C (depthwise.c): a KxK layer with one filter per channel, its bias (a folded
BatchNorm) and activation (ReLU, ReLU6/Clip, SiLU) in one pass over NHWC memory, a native-segment member.

Why: MobileNetV2's and EfficientNet-B0's depthwise layers ran on oneDNN's jit_dw, measured behind onnxruntime's MLAS
at stride 2 under the AVX2 cap (bench/results/zoo-cpu-avx2-2026-12-06.md) and slow with EfficientNet's SiLU (its
swish post-op). depthwise.c vectorises over channels (NHWC needs no deinterleave at stride 2), blocks each output
row by pixels, and skips padding instead of materialising it: per layer it runs 0.6-0.75x oneDNN's time with SiLU
on large maps, and 0.8-1.2x with ReLU6 (bench/results/dw-avx2-2026-12-06.md). Which kernel a layer runs is the
autotuner's pick between this and oneDNN, timed on the machine (kiln/tactics/cpu/depthwise.py).

A DepthwiseConv is one layer at one input size (weights packed at build); `bind(src, dst)` gives a segment its
call on memory objects of its own, as oneDNN primitives do (kiln/kernels/cpu/onednn.py Bound), and `__call__`
runs it on a channels-last tensor. Built by native_loop.build with the machine's C compiler (AVX-512 where the
CPU has it and KILN_CPU_ISA does not cap it, else AVX2); `load()` is None without one.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kiln.kernels.cpu import native_loop, onednn, plan_member

SOURCE = Path(__file__).with_name("depthwise.c").read_text()

# depthwise.c's activation kinds (se.c's numbering; kiln/ops/fused.py names)
ACTIVATIONS = {"": 0, "Relu": 1, "SiLU": 2, "Clip": 4}
MAX_KERNEL = 8  # depthwise.c's rows[8]


class _Plan(ctypes.Structure):  # dw_plan in depthwise.c
    _fields_ = [("get_handle", ctypes.c_void_p), ("x", ctypes.c_void_p), ("y", ctypes.c_void_p),
                ("w", ctypes.c_void_p), ("b", ctypes.c_void_p), ("zeros", ctypes.c_void_p),
                *((name, ctypes.c_long) for name in ("N", "C", "Cp", "H", "W", "OH", "OW")),
                *((name, ctypes.c_int) for name in ("KH", "KW", "SH", "SW", "PT", "PL")),
                ("activation", ctypes.c_int), ("alpha", ctypes.c_float), ("beta", ctypes.c_float),
                ("threads", ctypes.c_int)]


def _setup(lib: ctypes.CDLL) -> None:
    lib.kiln_depthwise_lanes.restype = ctypes.c_int


_LIBRARY = native_loop.KernelLibrary("depthwise", SOURCE, ["kiln_depthwise", "kiln_depthwise_lanes"],
                                    requires=(onednn.available, "libdnnl.so.3 cannot be loaded (the kernel's operands "
                                                                "are oneDNN memory objects)"), setup=_setup)
load, available, reason = _LIBRARY.load, _LIBRARY.available, _LIBRARY.reason  # the library, built on first use


def lanes() -> int:
    """The vector width the library was built for (16: AVX-512, 8: AVX2)."""
    library = load()
    if library is None:
        raise onednn.OneDNNError(f"kiln's depthwise kernel is not built: {reason()}")
    return int(library.kiln_depthwise_lanes(None, None, 0, None))


def refusal(weight_shape: tuple[int, ...], input_size: tuple[int, ...], groups: int, pads: list[int],
            strides: list[int], dilations: list[int]) -> str | None:
    """Why depthwise.c cannot run this convolution, or None."""
    if len(input_size) != 4 or len(weight_shape) != 4:
        return "only 2-D convolutions (4-D input and weight)"
    c = int(input_size[1])
    if not (groups == c and weight_shape[0] == c and weight_shape[1] == 1):
        return (f"not depthwise: {groups} groups, weight {list(weight_shape)} on {c} channels "
                "(needs C groups, [C, 1, K, K])")
    if any(d != 1 for d in dilations):
        return f"dilations {list(dilations)}"
    if any(not 1 <= k <= MAX_KERNEL for k in weight_shape[2:]):
        return f"kernel {list(weight_shape[2:])}: 1 to {MAX_KERNEL} taps a side"
    if any(p < 0 for p in pads) or any(s < 1 for s in strides):
        return f"pads {list(pads)}, strides {list(strides)}"
    out = [(input_size[2 + i] + pads[i] + pads[2 + i] - weight_shape[2 + i]) // strides[i] + 1 for i in range(2)]
    if min(out) < 1:
        return f"an empty output {out}"
    return None


class DepthwiseConv(plan_member.ChannelsLastKernel):
    """y = act(depthwise(x, w) + b), x [N, C, H, W] channels-last float32, w [C, 1, KH, KW];
    pads [top, left, bottom, right], strides [sh, sw]; activation one of ACTIVATIONS (Clip: alpha = min,
    beta = max). `bind(src, dst)` reads and writes NHWC."""

    NO_RESIDUAL = "the depthwise kernel adds no residual"

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None, input_size: tuple[int, ...], strides: list[int],
                 pads: list[int], activation: str = "", alpha: float = 0.0, beta: float = 0.0,
                 dilations: list[int] | None = None):
        library = load()
        if library is None:
            raise onednn.OneDNNError(f"kiln's depthwise kernel is not built: {reason()}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r}: the kernel applies {sorted(ACTIVATIONS)}")
        n, c, h, wd = (int(d) for d in input_size)
        why = refusal(tuple(w.shape), (n, c, h, wd), c, list(pads), list(strides), list(dilations or [1, 1]))
        if why is not None:
            raise ValueError(f"depthwise kernel: {why}")
        kh, kw = int(w.shape[2]), int(w.shape[3])
        width = lanes()
        cp = -(-c // width) * width
        # [KH, KW, Cp]: a tap's weights for consecutive channels are one vector; zeros past C
        self._w = torch.zeros(kh, kw, cp, dtype=torch.float32)
        self._w[:, :, :c] = w.detach().to(torch.float32).reshape(c, kh, kw).permute(1, 2, 0)
        self._b = torch.zeros(cp, dtype=torch.float32)
        if b is not None:
            if b.numel() != c:
                raise ValueError(f"a bias of {b.numel()} values for a layer of {c} channels")
            self._b[:c] = b.detach().to(torch.float32).reshape(-1)
        self._zeros = torch.zeros(cp, dtype=torch.float32)  # what a padding column reads
        pt, pl, pb, pr = (int(p) for p in pads)
        sh, sw = (int(s) for s in strides)
        oh, ow = (h + pt + pb - kh) // sh + 1, (wd + pl + pr - kw) // sw + 1
        self.input_size, self.output_size = (n, c, h, wd), (n, c, oh, ow)
        self.library = library
        self.implementation = f"kiln depthwise.c ({width} lanes)"
        self.what = f"depthwise {kh}x{kw}/{sh} {list(self.input_size)} -> {list(self.output_size)}"
        self.fields = dict(w=self._w.data_ptr(), b=self._b.data_ptr(), zeros=self._zeros.data_ptr(),
                           N=n, C=c, Cp=cp, H=h, W=wd, OH=oh, OW=ow,
                           KH=kh, KW=kw, SH=sh, SW=sw, PT=pt, PL=pl, activation=ACTIVATIONS[activation],
                           alpha=float(alpha), beta=float(beta))
        self._own_calls()


class _Bound(plan_member.PlanMember):
    """A DepthwiseConv's call for one segment (or its own per-call path): a parallel form over output rows on
    OpenMP's count, and a serial one where the layer is small enough for the segment's chooser to time both
    (onednn_primitives.thread_forms, as the oneDNN layers around it)."""

    FUNCTION = "kiln_depthwise"

    def __init__(self, layer: DepthwiseConv, src: int, dst: int):
        super().__init__(layer, src, dst)
        n, c, oh, ow = layer.output_size
        elements = n * c * oh * ow
        threads, serial = plan_member.thread_counts(elements, elements * layer.fields["KH"] * layer.fields["KW"])
        base = self.plan_base()
        self._plans(_Plan(**base, threads=threads, **layer.fields),
                    _Plan(**base, threads=1, **layer.fields) if serial else None)


DepthwiseConv.MEMBER = _Bound
