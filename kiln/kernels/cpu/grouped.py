"""Grouped convolution with few channels a group in kiln's C (grouped.c): a KxK layer of G = 2, 4, 8, 16 or 32 input
and output channels a group (ResNeXt's, RegNet's), its bias (a folded BatchNorm) and ReLU in one pass over NHWC
memory, AVX2, a native-segment member.

Why: under the AVX2 cap oneDNN runs ResNeXt-50 32x4d's 4-channel groups as an im2col GEMM (x64:gemm:jit) at 2.3x
onnxruntime's MLAS and its 8-channel ones on jit:avx2 at 1.1-2.1x (bench/grouped_conv_avx2.py,
bench/results/zoo-new-avx2-zen4-2026-12-07d.md). Which kernel a layer runs is the autotuner's pick between this and
oneDNN, timed on the machine (kiln/tactics/cpu/grouped.py). Built for AVX2 only: on an AVX-512 build (`lanes()` 16)
oneDNN's AVX-512 kernels keep the layer and no tactic is offered.

A GroupedConv is one layer at one input size (weights packed at build); `bind(src, dst)` gives a segment its call
(plan_member.PlanMember), `__call__` runs it on a channels-last tensor.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kiln.kernels.cpu import native_loop, onednn, plan_member

SOURCE = Path(__file__).with_name("grouped.c").read_text()

ACTIVATIONS = {"": 0, "Relu": 1}  # grouped.c's (se.c's numbering; kiln/ops/fused.py names)
GROUP_CHANNELS = (2, 4, 8, 16, 32)  # grouped.c's row functions
MAX_KERNEL = 7


class _Plan(ctypes.Structure):  # gc_plan in grouped.c
    _fields_ = [("get_handle", ctypes.c_void_p), ("x", ctypes.c_void_p), ("y", ctypes.c_void_p),
                ("w", ctypes.c_void_p), ("b", ctypes.c_void_p),
                *((name, ctypes.c_long) for name in ("N", "C", "H", "W", "OH", "OW")),
                *((name, ctypes.c_int) for name in ("KH", "KW", "SH", "SW", "PT", "PL", "G", "activation",
                                                    "threads"))]


def _setup(lib: ctypes.CDLL) -> None:
    lib.kiln_grouped_conv_lanes.restype = ctypes.c_int
    lib.kiln_grouped_conv_vectors.restype = ctypes.c_int


_LIBRARY = native_loop.KernelLibrary("grouped", SOURCE,
                                    ["kiln_grouped_conv", "kiln_grouped_conv_lanes", "kiln_grouped_conv_vectors"],
                                    requires=(onednn.available, "libdnnl.so.3 cannot be loaded (the kernel's operands "
                                                                "are oneDNN memory objects)"), setup=_setup)
load, reason = _LIBRARY.load, _LIBRARY.reason  # the library, built on first use


def available() -> bool:
    """Built, and built for AVX2 (the kernel's only vectors)."""
    library = load()
    return library is not None and int(library.kiln_grouped_conv_lanes(None, None, 0, None)) == 8


def refusal(weight_shape: tuple[int, ...], input_size: tuple[int, ...], groups: int, pads: list[int],
            strides: list[int], dilations: list[int]) -> str | None:
    """Why grouped.c cannot run this convolution, or None."""
    if len(input_size) != 4 or len(weight_shape) != 4:
        return "only 2-D convolutions (4-D input and weight)"
    c, o = int(input_size[1]), int(weight_shape[0])
    if groups <= 1 or o != c or c % groups:
        return f"{groups} groups of {c} input and {o} output channels: needs groups > 1 and as many in as out"
    g = c // groups
    if g not in GROUP_CHANNELS or weight_shape[1] != g:
        return f"{g} channels a group (weight {list(weight_shape)}): the kernel takes {list(GROUP_CHANNELS)}"
    if c % 8:
        return f"{c} channels: whole vectors of 8 only"
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


def packed_weight(w: torch.Tensor, vectors: int) -> torch.Tensor:
    """w [C, G, KH, KW] -> [C / (8V), KH, KW, G, V, 8]: a block's V output vectors per tap and input channel."""
    c, g, kh, kw = w.shape
    blocked = w.detach().to(torch.float32).reshape(c // (8 * vectors), vectors, 8, g, kh, kw)
    return blocked.permute(0, 4, 5, 3, 1, 2).contiguous()


class GroupedConv(plan_member.ChannelsLastKernel):
    """y = act(grouped_conv(x, w) + b), x [N, C, H, W] channels-last float32, w [C, C / groups, KH, KW] (the groups
    read off the two);
    pads [top, left, bottom, right], strides [sh, sw]; activation one of ACTIVATIONS. `bind(src, dst)` reads and
    writes NHWC."""

    NO_RESIDUAL = "the grouped convolution kernel adds no residual"

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None, input_size: tuple[int, ...], strides: list[int],
                 pads: list[int], activation: str = "", alpha: float = 0.0, beta: float = 0.0,
                 dilations: list[int] | None = None):
        del alpha, beta  # no activation of grouped.c's takes them
        if not available():
            raise onednn.OneDNNError(f"kiln's grouped convolution kernel is not built for AVX2 here: {reason()}")
        library = load()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r}: the kernel applies {sorted(ACTIVATIONS)}")
        n, c, h, wd = (int(d) for d in input_size)
        groups = c // int(w.shape[1])  # the weight's [C, C / groups, KH, KW] says how many
        why = refusal(tuple(w.shape), (n, c, h, wd), groups, list(pads), list(strides), list(dilations or [1, 1]))
        if why is not None:
            raise ValueError(f"grouped convolution kernel: {why}")
        g, kh, kw = c // groups, int(w.shape[2]), int(w.shape[3])
        self._w = packed_weight(w, int(library.kiln_grouped_conv_vectors(None, None, g, None)))
        self._b = torch.zeros(c, dtype=torch.float32)
        if b is not None:
            if b.numel() != c:
                raise ValueError(f"a bias of {b.numel()} values for a layer of {c} channels")
            self._b[:] = b.detach().to(torch.float32).reshape(-1)
        pt, pl, pb, pr = (int(p) for p in pads)
        sh, sw = (int(s) for s in strides)
        oh, ow = (h + pt + pb - kh) // sh + 1, (wd + pl + pr - kw) // sw + 1
        self.input_size, self.output_size = (n, c, h, wd), (n, c, oh, ow)
        self.library = library
        self.implementation = f"kiln grouped.c ({g} channels a group)"
        self.what = f"grouped {kh}x{kw}/{sh} x{groups} {list(self.input_size)} -> {list(self.output_size)}"
        self.fields = dict(w=self._w.data_ptr(), b=self._b.data_ptr(), N=n, C=c, H=h, W=wd, OH=oh, OW=ow,
                           KH=kh, KW=kw, SH=sh, SW=sw, PT=pt, PL=pl, G=g, activation=ACTIVATIONS[activation])
        self._own_calls()


class _Bound(plan_member.PlanMember):
    """A GroupedConv's call for one segment (or its own per-call path): a parallel form over output rows on OpenMP's
    count, and a serial one where the layer is small enough for the segment's chooser to time both
    (onednn_primitives.thread_forms, as the oneDNN layers around it)."""

    FUNCTION = "kiln_grouped_conv"

    def __init__(self, layer: GroupedConv, src: int, dst: int):
        super().__init__(layer, src, dst)
        n, c, oh, ow = layer.output_size
        elements = n * c * oh * ow
        macs = elements * layer.fields["G"] * layer.fields["KH"] * layer.fields["KW"]
        threads, serial = plan_member.thread_counts(elements, macs)
        base = self.plan_base()
        self._plans(_Plan(**base, threads=threads, **layer.fields),
                    _Plan(**base, threads=1, **layer.fields) if serial else None)


GroupedConv.MEMBER = _Bound
