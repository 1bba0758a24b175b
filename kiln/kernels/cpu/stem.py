"""A network's first convolution in kiln's C (stem.c): few input channels (C_in <= 4, an RGB image), its bias (a
folded BatchNorm) and ReLU / Clip in one pass, NCHW in (the image as
it arrives) and NHWC out (what the convolutions after it read), a native-segment member.

Why: ResNet-tiny's 7x7/2 and RegNetY-tiny's 3x3/2 stems were the gap to onnxruntime on the Zen 3
(bench/results/zoo-cpu-zen3-all-2026-12-07.md). stem.c reduces over every tap (C_in·KH·KW) into blocks of 6 output
pixels x 16 output channels held in registers, and reads NCHW: a segment's image entry needs no copy into NHWC, which
oneDNN's NHWC convolution needs. Which kernel a layer runs is the autotuner's pick between this and oneDNN, timed on
the machine (kiln/tactics/cpu/stem.py; bench/results/stem-avx2-2026-12-07.md).

A StemConv is one layer at one input size (weights packed at build); `bind(src, dst)` gives a segment its call on
memory objects of its own (plan_member.py), and `__call__` runs it on a contiguous (NCHW) tensor. Built by
native_loop.build with the machine's C compiler; `load()` is None without one.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kiln.kernels.cpu import native_loop, onednn, plan_member

SOURCE = Path(__file__).with_name("stem.c").read_text()

# stem.c's activation kinds (se.c's numbering; kiln/ops/fused.py names)
ACTIVATIONS = {"": 0, "Relu": 1, "Clip": 4}
MAX_CHANNELS = 4  # input channels: the reduction is over taps, not channels; wider layers are oneDNN's
MAX_KERNEL = 11  # stem.c's MAX_K
MAX_STRIDE = 4  # stem.c's MAX_SPAN
GROUP = 8  # output channels per vector (stem.c's v8)


class _Plan(ctypes.Structure):  # stem_plan in stem.c
    _fields_ = [("get_handle", ctypes.c_void_p), ("x", ctypes.c_void_p), ("y", ctypes.c_void_p),
                ("w", ctypes.c_void_p), ("b", ctypes.c_void_p),
                *((name, ctypes.c_long) for name in ("N", "C", "O", "Op", "H", "W", "OH", "OW")),
                *((name, ctypes.c_int) for name in ("KH", "KW", "SH", "SW", "PT", "PL")),
                ("activation", ctypes.c_int), ("alpha", ctypes.c_float), ("beta", ctypes.c_float),
                ("threads", ctypes.c_int)]


_LIBRARY = native_loop.KernelLibrary("stem", SOURCE, ["kiln_stem"],
                                    requires=(onednn.available, "libdnnl.so.3 cannot be loaded (the kernel's operands "
                                                                "are oneDNN memory objects)"))
load, available, reason = _LIBRARY.load, _LIBRARY.available, _LIBRARY.reason  # the library, built on first use


def refusal(weight_shape: tuple[int, ...], input_size: tuple[int, ...], groups: int, pads: list[int],
            strides: list[int], dilations: list[int]) -> str | None:
    """Why stem.c cannot run this convolution, or None."""
    if len(input_size) != 4 or len(weight_shape) != 4:
        return "only 2-D convolutions (4-D input and weight)"
    c = int(input_size[1])
    if c > MAX_CHANNELS:
        return f"{c} input channels: the stem kernel takes at most {MAX_CHANNELS} (oneDNN runs wider layers)"
    if groups != 1 or weight_shape[1] != c:
        return f"{groups} groups, weight {list(weight_shape)} on {c} channels (needs one group)"
    if any(d != 1 for d in dilations):
        return f"dilations {list(dilations)}"
    if any(not 1 <= k <= MAX_KERNEL for k in weight_shape[2:]):
        return f"kernel {list(weight_shape[2:])}: 1 to {MAX_KERNEL} taps a side"
    if any(p < 0 for p in pads) or any(not 1 <= s <= MAX_STRIDE for s in strides):
        return f"pads {list(pads)}, strides {list(strides)}"
    out = [(input_size[2 + i] + pads[i] + pads[2 + i] - weight_shape[2 + i]) // strides[i] + 1 for i in range(2)]
    if min(out) < 1:
        return f"an empty output {out}"
    return None


class StemConv(plan_member.PlanKernel):
    """y = act(conv(x, w) + b), x [N, C, H, W] contiguous (NCHW) float32 (C <= 4), w [O, C, KH, KW]; pads [top,
    left, bottom, right], strides [sh, sw]; activation one of ACTIVATIONS (Clip: alpha = min, beta = max).
    `bind(src, dst)` reads NCHW and writes NHWC."""

    NO_RESIDUAL = "the stem kernel adds no residual"

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None, input_size: tuple[int, ...], strides: list[int],
                 pads: list[int], activation: str = "", alpha: float = 0.0, beta: float = 0.0,
                 dilations: list[int] | None = None):
        library = load()
        if library is None:
            raise onednn.OneDNNError(f"kiln's stem kernel is not built: {reason()}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r}: the kernel applies {sorted(ACTIVATIONS)}")
        n, c, h, wd = (int(d) for d in input_size)
        why = refusal(tuple(w.shape), (n, c, h, wd), 1, list(pads), list(strides), list(dilations or [1, 1]))
        if why is not None:
            raise ValueError(f"stem kernel: {why}")
        o, kh, kw = int(w.shape[0]), int(w.shape[2]), int(w.shape[3])
        op = -(-o // GROUP) * GROUP
        # [Op/8, C, KH, KW, 8]: a tap's weights for 8 consecutive output channels are one vector; zeros past O
        packed = torch.zeros(op, c, kh, kw, dtype=torch.float32)
        packed[:o] = w.detach().to(torch.float32)
        self._w = packed.reshape(op // GROUP, GROUP, c, kh, kw).permute(0, 2, 3, 4, 1).contiguous()
        self._b = torch.zeros(op, dtype=torch.float32)
        if b is not None:
            if b.numel() != o:
                raise ValueError(f"a bias of {b.numel()} values for a layer of {o} output channels")
            self._b[:o] = b.detach().to(torch.float32).reshape(-1)
        pt, pl, pb, pr = (int(p) for p in pads)
        sh, sw = (int(s) for s in strides)
        oh, ow = (h + pt + pb - kh) // sh + 1, (wd + pl + pr - kw) // sw + 1
        self.input_size, self.output_size = (n, c, h, wd), (n, o, oh, ow)
        self.library = library
        self.implementation = "kiln stem.c (8 lanes)"
        self.what = f"stem conv {kh}x{kw}/{sh} {list(self.input_size)} -> {list(self.output_size)}"
        self.fields = dict(w=self._w.data_ptr(), b=self._b.data_ptr(), N=n, C=c, O=o, Op=op, H=h, W=wd, OH=oh, OW=ow,
                           KH=kh, KW=kw, SH=sh, SW=sw, PT=pt, PL=pl, activation=ACTIVATIONS[activation],
                           alpha=float(alpha), beta=float(beta))
        self._own_calls()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, C, H, W] contiguous (NCHW) float32 of the built size -> a new channels-last y."""
        if tuple(x.shape) != self.input_size or x.dtype != torch.float32 or not x.is_contiguous():
            raise ValueError(f"{self.what}: given {x.dtype} {list(x.shape)} (contiguous float32 of the built size)")
        n, o, h, w = self.output_size
        y = torch.empty_strided(self.output_size, (o * h * w, 1, w * o, o), dtype=torch.float32)
        self.run_into(x.data_ptr(), y.data_ptr())
        return y


class _Bound(plan_member.PlanMember):
    """A StemConv's call for one segment (or its own per-call path): a parallel form over output rows on OpenMP's
    count, and a serial one where the layer is small enough for the segment's chooser to time both
    (onednn_primitives.thread_forms, as the oneDNN layers around it)."""

    FUNCTION = "kiln_stem"

    def __init__(self, layer: StemConv, src: int, dst: int):
        super().__init__(layer, src, dst)
        n, o, oh, ow = layer.output_size
        elements = n * o * oh * ow
        taps = layer.fields["KH"] * layer.fields["KW"] * layer.fields["C"]
        threads, serial = plan_member.thread_counts(elements, elements * taps)
        base = self.plan_base()
        self._plans(_Plan(**base, threads=threads, **layer.fields),
                    _Plan(**base, threads=1, **layer.fields) if serial else None)


StemConv.MEMBER = _Bound
