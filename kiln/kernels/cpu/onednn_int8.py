"""oneDNN int8 primitives: kiln::QConv as a u8/s8 convolution, kiln::QGemm as an inner product.

What kiln/ops/quantized.py specifies, on oneDNN 3's quantization attributes (all fixed at build:
every scale and zero point of an explicitly quantized graph is a constant):

    src   u8 / s8, zero point (DNNL_ARG_ATTR_ZERO_POINTS | SRC, s32) only where it is not 0
    wei   s8, symmetric; scales x_scale·w_scale[o] (one per output channel, or one) as the
          weights' scales: oneDNN forms r = scale·acc + bias in f32, the bias as a real f32
    post  Relu / Clip as an eltwise post-op on r
    dst   u8 / s8 with scale y_scale and zero point y_zero_point (q = round(r / y_scale) + zp,
          saturated), or f32 r itself (the float-output form)

Activations are NHWC (channels-last) as for the float primitives; the weight is reordered once into
the blocked layout the kernel chose. On an AVX2 CPU without VNNI oneDNN multiplies u8·s8 pairs with
vpmaddubsw, whose int16 pair sums saturate when both products of a pair are large and of one sign
(255·127·2 > 32767): `pair_overflow_possible` says when a weight lets that happen.
"""

from __future__ import annotations

import ctypes
import threading

import torch

from kiln.kernels.cpu.onednn import (
    ARG_BIAS,
    ARG_DST,
    ARG_FROM,
    ARG_SRC,
    ARG_SRC_1,
    ARG_TO,
    ARG_WEIGHTS,
    BINARY_ADD,
    CONVOLUTION_DIRECT,
    DATA_TYPES,
    ELTWISE,
    FORWARD_INFERENCE,
    POOLING,
    QUERY_WEIGHTS_MD,
    TAG_A,
    TAG_AB,
    TAG_ABC,
    TAG_ABCD,
    TAG_ABCDE,
    TAG_ACDB,
    TAG_ANY,
    Bound,
    Eltwise,
    OneDNNError,
    _check,
    _dims,
    _Handle,
    _implementation,
    _memory,
    _primitive,
    _reorder,
    creating_with_threads,
    eltwise_for,
    load,
)
from kiln.kernels.cpu import onednn, onednn_primitives

# dnnl_data_type_t (oneDNN 3, dnnl_common_types.h)
F32, S32, S8, U8 = (DATA_TYPES[t] for t in (torch.float32, torch.int32, torch.int8, torch.uint8))
ARG_ATTR_SCALES, ARG_ATTR_ZERO_POINTS = 4096, 8192  # DNNL_ARG_ATTR_SCALES / _ZERO_POINTS (oneDNN 3)

_EXTRA_SIGNATURES = {
    "dnnl_primitive_attr_set_scales_mask": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]),
    "dnnl_primitive_attr_set_zero_points_mask": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]),
    "dnnl_binary_primitive_desc_create": (ctypes.c_int, [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_int,
                                                         ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                                         ctypes.c_void_p]),
}
_signed = threading.Lock()
_ready = False


def _lib():
    """The loaded library, with the quantization entry points' signatures declared (once)."""
    global _ready
    lib = load()
    if not _ready:
        with _signed:
            for name, (restype, argtypes) in _EXTRA_SIGNATURES.items():
                fn = getattr(lib.lib, name)
                fn.restype, fn.argtypes = restype, argtypes
            _ready = True
    return lib


def memory_desc(dims: list[int], dtype: torch.dtype, tag: int) -> _Handle:
    """onednn.memory_desc, the dtype first (as this module's callers give it)."""
    return onednn.memory_desc(dims, tag, dtype)


def pair_overflow_possible(w: torch.Tensor, x_dtype: torch.dtype, groups: int = 1) -> bool:
    """Whether vpmaddubsw (AVX2 without VNNI) can saturate on this weight: some output channel has
    two weights of one sign whose magnitudes times the largest activation sum past int16. Which two
    weights a kernel pairs depends on its blocking, so any two of a channel count (conservative).
    s8 activations are shifted to u8 by oneDNN (+128), so both cases use 255.

    A depthwise convolution (`groups` of one input and one output channel each) pairs no bytes: oneDNN's
    depthwise int8 kernel widens each product to int32 (vpmovzxbd, vpmulld), exact at any int8 weight
    (127 on all-255 sources, tests/unit/test_quant_kernels.py)."""
    if groups > 1 and tuple(w.shape[:2]) == (groups, 1):
        return False
    flat = w.reshape(w.shape[0], -1).to(torch.int32)
    worst = 0
    for sign in (1, -1):
        top = (flat * sign).clamp(min=0).topk(min(2, flat.shape[1]), dim=1).values
        worst = max(worst, int(top.sum(dim=1).max()))
    return 255 * worst > 32767


class _Quantized:
    """What QConv/QGemm primitives share: the attr (scales, zero points, post-op) and the
    constant memories (scales, zero points, weight, bias) an execution passes."""

    # a small layer's serial twin and its per-call chooser (_finish_forms, _per_call_forms); None: parallel only
    threads: int | None = None
    _serial: tuple | None = None
    _forms = onednn_primitives._PerCallForms(None)  # parallel only, until _per_call_forms

    def _attr(self, scales: torch.Tensor, weight_mask: int, x_zero: int, y: tuple | None,
              eltwise: Eltwise | None, accumulate: bool = False) -> _Handle:
        """accumulate: a sum post-op first (dst += the layer's result, before the eltwise): W8A16Conv2d's low byte."""
        lib = _lib()
        attr = ctypes.c_void_p()
        _check(lib.lib.dnnl_primitive_attr_create(ctypes.byref(attr)), "attr")
        attr_h = _Handle(attr, "dnnl_primitive_attr_destroy")
        _check(lib.lib.dnnl_primitive_attr_set_scales_mask(attr, ARG_WEIGHTS, weight_mask if scales.numel() > 1 else 0),
               "weight scales")
        self._constants: list[tuple[int, torch.Tensor, int]] = [(ARG_ATTR_SCALES | ARG_WEIGHTS, scales, F32)]
        if x_zero:
            _check(lib.lib.dnnl_primitive_attr_set_zero_points_mask(attr, ARG_SRC, 0), "src zero point")
            self._constants.append((ARG_ATTR_ZERO_POINTS | ARG_SRC, torch.tensor([x_zero], dtype=torch.int32), S32))
        if y is not None:
            y_scale, y_zero = y
            _check(lib.lib.dnnl_primitive_attr_set_scales_mask(attr, ARG_DST, 0), "dst scale")
            self._constants.append((ARG_ATTR_SCALES | ARG_DST, torch.tensor([y_scale], dtype=torch.float32), F32))
            if y_zero:
                _check(lib.lib.dnnl_primitive_attr_set_zero_points_mask(attr, ARG_DST, 0), "dst zero point")
                self._constants.append((ARG_ATTR_ZERO_POINTS | ARG_DST, torch.tensor([y_zero], dtype=torch.int32),
                                        S32))
        if eltwise is not None or accumulate:
            post = ctypes.c_void_p()
            _check(lib.lib.dnnl_post_ops_create(ctypes.byref(post)), "post ops")
            post_h = _Handle(post, "dnnl_post_ops_destroy")
            if accumulate:
                _check(lib.lib.dnnl_post_ops_append_sum(post, 1.0, 0, 0), "sum post-op")
            if eltwise is not None:
                _check(lib.lib.dnnl_post_ops_append_eltwise(post, ELTWISE[eltwise.alg], eltwise.alpha, eltwise.beta),
                       f"eltwise post-op {eltwise}")
            _check(lib.lib.dnnl_primitive_attr_set_post_ops(attr, post), "set post ops")
            del post_h
        return attr_h

    def _finish(self, pd: ctypes.c_void_p, what: str, w: torch.Tensor, w_user: _Handle,
                bias: torch.Tensor | None, b_md: _Handle | None) -> None:
        """Primitive, the weight reordered once into the kernel's layout, the constant memories."""
        lib = _lib()
        self._pd, self._prim = _primitive(pd, what)
        self.implementation = _implementation(pd)
        w_md = lib.lib.dnnl_primitive_desc_query_md(pd, QUERY_WEIGHTS_MD, 0)
        size = lib.lib.dnnl_memory_desc_get_size(w_md)
        self._weight = torch.zeros(size + 64, dtype=torch.int8)  # the kernel's layout may carry compensation
        src = w.detach().to(torch.int8).contiguous()
        _reorder(w_user.value, w_md, src, self._weight)
        fixed = [(ARG_WEIGHTS, _memory(w_md, self._weight.data_ptr()))]
        self._bias = None
        if bias is not None:
            self._bias = bias.detach().to(torch.float32).contiguous()
            fixed.append((ARG_BIAS, _memory(b_md.value, self._bias.data_ptr())))
        self._scalars = []
        for arg, value, dtype in self._constants:
            md = memory_desc([value.numel()], torch.float32 if dtype == F32 else torch.int32, TAG_A)
            value = value.contiguous()
            self._scalars.append((md, value))
            fixed.append((arg, _memory(md.value, value.data_ptr())))
        self._fixed = fixed
        self._lock = threading.Lock()

    def _finish_forms(self, descriptor, forms: tuple[int | None, ...], what: str, w: torch.Tensor,
                      w_user: _Handle, bias: torch.Tensor | None, b_md: _Handle | None) -> None:
        """_finish on the primitive `descriptor(threads)` makes at forms[0] (onednn_primitives.thread_forms), and,
        where forms has a second (1: a small layer on more than one thread), its serial twin, kept only where its
        kernel wants the same packed weight layout (it reads the same weight). A small layer bound twice gives a
        native segment a serial form, which runs all its members without a parallel region: at 2 threads on held
        cores every region's join waits out a descheduled thread (onnxruntime's QDQ BERT-tiny: 64 steps, 4.2x
        onnxruntime; bench/results/quant-cpu-2026-12-06.md, s26 h-q8thr)."""
        lib = _lib()
        self.threads = forms[0]
        with creating_with_threads(self.threads):  # the primitive at its descriptor's count (onednn.Bound)
            self._finish(descriptor(self.threads), what, w, w_user, bias, b_md)
        self._serial = None
        if len(forms) > 1:
            with creating_with_threads(1):
                serial = _primitive(descriptor(1), f"{what} (serial)")
            query = lib.lib.dnnl_primitive_desc_query_md
            if lib.lib.dnnl_memory_desc_equal(query(serial[0].value, QUERY_WEIGHTS_MD, 0),
                                              query(self._pd.value, QUERY_WEIGHTS_MD, 0)):
                self._serial = serial

    def _per_call_forms(self) -> None:
        """The per-call path's binding, and its chooser where the layer has a serial form."""
        self._per_call = self.bind(0, 0)
        self._forms = onednn_primitives._PerCallForms(self._serial)

    def bind(self, src: int, dst: int, residual: int | None = None) -> Bound:
        """Arguments at fixed addresses (onednn.Bound), as the float primitives offer them, with the serial form
        where the layer has one (`_serial`, made at one thread: what a segment's serial form runs)."""
        roles = {"src": (ARG_SRC, self._src_md.value, src), "dst": (ARG_DST, self._dst_md.value, dst)}
        return Bound(self._prim.value, roles, self._fixed, self.what, self,
                     onednn_primitives._value(self._serial), threads=self.threads)

    def _execute(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        lib = _lib()
        with self._lock:
            bound = self._per_call
            bound.rebind("src", x.data_ptr())
            bound.rebind("dst", y.data_ptr())
            # the per-call path (the tuner's timings) picks its form by recent times, as a segment does
            status = onednn_primitives._execute(self._forms, lib.lib.dnnl_primitive_execute, bound.primitive,
                                                lib.stream, bound.nargs, bound.args)
            _check(status, self.what)
        return y


def _eltwise(activation: str, alpha: float, beta: float) -> Eltwise | None:
    found = eltwise_for(activation, alpha, beta)  # the float primitives' table (onednn.py)
    if isinstance(found, str):
        raise OneDNNError(found)
    return found


def combined_scales(x_scale: float, w_scale: torch.Tensor) -> torch.Tensor:
    """x_scale·w_scale in float64, one per output channel (or one): what scales the accumulator."""
    return torch.as_tensor(w_scale, dtype=torch.float64).reshape(-1) * float(x_scale)


def _scales(x_scale: float, w_scale: torch.Tensor) -> torch.Tensor:
    return combined_scales(x_scale, w_scale).to(torch.float32)  # rounded once, as oneDNN takes them


class QConv2d(_Quantized):
    """One int8 2-D convolution (kiln::QConv) for one input size; NHWC activations in and out."""

    def __init__(self, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None, input_size: list[int],
                 stride: list[int], pads: list[int], dilation: list[int], groups: int, x_dtype: torch.dtype,
                 x_scale: float, x_zero: int, y: tuple[torch.dtype, float, int] | None,
                 activation: str = "", alpha: float = 0.0, beta: float = 0.0, accumulate: bool = False,
                 real_bias: torch.Tensor | None = None):
        """bias: int32 at x_scale·w_scale (the contract's), or None; real_bias instead: the bias as a real
        (float) value; y: (dtype, scale, zero point) of a quantized output, None for float32. accumulate (float32
        output): the result is added to what the output holds (`__call__(x, out)`), before the activation."""
        lib = _lib()
        if accumulate and y is not None:
            raise OneDNNError("an accumulating int8 convolution writes float32 (y None)")
        n, c, h, wd = input_size
        o, i_per_group, kh, kw = w.shape
        if c != i_per_group * groups:
            raise OneDNNError(f"input channels {c} != weight's {i_per_group} x {groups} groups")
        oh = (h + pads[0] + pads[2] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
        ow = (wd + pads[1] + pads[3] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
        self.input_size, self.output_size = (n, c, h, wd), (n, o, oh, ow)
        self.out_dtype = torch.float32 if y is None else y[0]
        self._src_md = memory_desc([n, c, h, wd], x_dtype, TAG_ACDB)
        self._dst_md = memory_desc([n, o, oh, ow], self.out_dtype, TAG_ACDB)
        if groups == 1:
            w_dims, w_tag, mask = [o, c, kh, kw], TAG_ABCD, 1 << 0
        else:
            w_dims, w_tag, mask = [groups, o // groups, i_per_group, kh, kw], TAG_ABCDE, (1 << 0) | (1 << 1)
        w_any = memory_desc(w_dims, torch.int8, TAG_ANY)
        w_user = memory_desc(w_dims, torch.int8, w_tag)
        scales = _scales(x_scale, w_scale)
        if real_bias is None and bias is not None:
            real_bias = bias.to(torch.float64) * scales.to(torch.float64)
        b_md = memory_desc([o], torch.float32, TAG_A) if real_bias is not None else None
        attr = self._attr(scales.expand(o).contiguous() if scales.numel() > 1 else scales, mask, x_zero,
                          None if y is None else (y[1], y[2]), _eltwise(activation, alpha, beta), accumulate)

        def descriptor(threads: int | None) -> ctypes.c_void_p:
            pd = ctypes.c_void_p()
            with creating_with_threads(threads):
                _check(lib.lib.dnnl_convolution_forward_primitive_desc_create(
                    ctypes.byref(pd), lib.engine, FORWARD_INFERENCE, CONVOLUTION_DIRECT, self._src_md.value,
                    w_any.value, b_md.value if b_md is not None else None, self._dst_md.value, _dims(stride),
                    _dims([d - 1 for d in dilation]), _dims(pads[:2]), _dims(pads[2:]), attr.value),
                    f"int8 convolution {list(input_size)} * {list(w.shape)} stride {stride} pads {pads} "
                    f"groups {groups}")
            return pd

        self.what = f"int8 convolution {list(self.input_size)} -> {list(self.output_size)}"
        # bound twice where small, as the float convolutions are; not the accumulating half of a W8A16Conv2d, whose
        # member runs its parallel calls only (w8a16.py)
        forms = (None,) if accumulate else onednn_primitives.thread_forms(
            max(n * c * h * wd, n * o * oh * ow), n * o * oh * ow * i_per_group * kh * kw)
        self._finish_forms(descriptor, forms, "int8 convolution", w, w_user, real_bias, b_md)
        self._mds = (w_any, w_user, b_md, attr)
        self._out_strides = (oh * ow * o, 1, ow * o, o)  # NHWC in memory, NCHW in shape
        self._per_call_forms()

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [N, C, H, W] channels-last of the built size and dtype -> y [N, O, H', W'] channels-last (`out`, when
        given: of that size, dtype and layout; an accumulating convolution adds to what it holds)."""
        y = torch.empty_strided(self.output_size, self._out_strides, dtype=self.out_dtype) if out is None else out
        return self._execute(x, y)


class W8A16Conv2d:
    """A convolution of a 16-bit activation with int8 weights, exact on int8 kernels: two int8 convolutions.

    q, the activation at 16 bits (x ≈ x_scale·(q - z)): uint16 with z = 0 (a ReLU6's output), or int16 stored as
    q + 32768 with z = 32768. q = 256·hi + lo (hi, lo its bytes, uint8), so

        Σ (q - z)·w = 256·Σ (hi - z/256)·w + Σ lo·w

    each sum an int8 convolution on VNNI's u8·s8 dot products, exact in its int32 accumulator (the 16-bit sum itself
    can pass 2^31: 960 channels x 65535 x 127), each scaled by oneDNN to float32 (hi at 256·x_scale with source zero
    point z/256, lo at x_scale with the bias), the second added to the first by a sum post-op and the activation
    applied after: act(r) to float32 rounding of the float64 result. The accuracy of a float input (2^-16 of the
    range per step where int8 has 2^-8) at about twice an int8 layer's time: what the accuracy target's weight-only
    layers would run on an int8 CPU (bench/w8a16_conv.py: per MobileNetV2 layer against fp32 and int8).
    Writes float32, NHWC. Both bytes are u8 sources like any QConv2d's: on a CPU without VNNI the same weight rule
    holds (pair_overflow_possible; kiln's 7-bit weights there)."""

    def __init__(self, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None, input_size: list[int],
                 stride: list[int], pads: list[int], dilation: list[int], groups: int, x_scale: float, signed: bool,
                 activation: str = "", alpha: float = 0.0, beta: float = 0.0):
        """w: int8 [O, C/groups, kh, kw], symmetric, w_scale one per output channel (or one); bias: float32 [O]
        (real values) or None; signed: the activation is int16 (stored as q + 32768), else uint16."""
        self.x_scale, self.signed = float(x_scale), signed
        common = dict(stride=stride, pads=pads, dilation=dilation, groups=groups, x_dtype=torch.uint8, y=None)
        self.hi = QConv2d(w, w_scale, None, input_size, x_scale=256.0 * self.x_scale, x_zero=128 if signed else 0,
                          **common)
        self.lo = QConv2d(w, w_scale, None, input_size, x_scale=self.x_scale, x_zero=0, activation=activation,
                          alpha=alpha, beta=beta, accumulate=True,
                          real_bias=None if bias is None else bias.detach().to(torch.float64).reshape(-1), **common)
        self.input_size, self.output_size = self.hi.input_size, self.hi.output_size

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float x [N, C, H, W] -> its high and low bytes (uint8, channels-last): q = round(x / x_scale) half to
        even, saturated to int16 / uint16 (ONNX QuantizeLinear's), + 32768 if signed. torch ops, several passes."""
        q = torch.round(x.float() / torch.tensor(self.x_scale, dtype=torch.float32))
        q = q.clamp(-32768, 32767).add_(32768) if self.signed else q.clamp(0, 65535)
        q = q.to(torch.int32).contiguous(memory_format=torch.channels_last)
        return (q >> 8).to(torch.uint8), (q & 255).to(torch.uint8)

    def __call__(self, hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
        """hi, lo [N, C, H, W] uint8 channels-last (split's) -> act(conv) [N, O, H', W'] float32 channels-last."""
        return self.lo(lo, out=self.hi(hi))


class QMatMul(_Quantized):
    """One int8 matmul (kiln::QGemm) for M rows: y [M, N] = x [M, K] @ w [N, K]ᵀ, quantized.

    oneDNN's matmul, not its inner product: the inner product takes no source zero point, and
    onnxruntime's uint8 activations have one."""

    def __init__(self, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None, rows: int,
                 x_dtype: torch.dtype, x_scale: float, x_zero: int, y: tuple[torch.dtype, float, int] | None,
                 activation: str = "", alpha: float = 0.0, beta: float = 0.0):
        lib = _lib()
        n, k = w.shape
        self.input_size, self.output_size = (rows, k), (rows, n)
        self.out_dtype = torch.float32 if y is None else y[0]
        self._src_md = memory_desc([rows, k], x_dtype, TAG_AB)
        self._dst_md = memory_desc([rows, n], self.out_dtype, TAG_AB)
        w_any, w_user = memory_desc([k, n], torch.int8, TAG_ANY), memory_desc([k, n], torch.int8, TAG_AB)
        scales = _scales(x_scale, w_scale)
        real_bias = None if bias is None else bias.to(torch.float64) * scales.to(torch.float64)
        b_md = memory_desc([1, n], torch.float32, TAG_AB) if bias is not None else None
        attr = self._attr(scales.expand(n).contiguous() if scales.numel() > 1 else scales, 1 << 1, x_zero,
                          None if y is None else (y[1], y[2]), _eltwise(activation, alpha, beta))

        def descriptor(threads: int | None) -> ctypes.c_void_p:
            pd = ctypes.c_void_p()
            with creating_with_threads(threads):  # the count is part of the descriptor (onednn.creating_with_threads)
                _check(lib.lib.dnnl_matmul_primitive_desc_create(
                    ctypes.byref(pd), lib.engine, self._src_md.value, w_any.value,
                    b_md.value if b_md is not None else None, self._dst_md.value, attr.value),
                    f"int8 matmul [{rows}, {k}] x [{n}, {k}]ᵀ")
            return pd

        # bound twice where small (BERT-tiny's [128, 128] x [128, 128]), as the float small layers are
        self.what = f"int8 matmul {list(self.input_size)} -> {list(self.output_size)}"
        self._finish_forms(descriptor, onednn_primitives.thread_forms(rows * max(k, n), rows * k * n), "int8 matmul",
                           w.t().contiguous(), w_user, real_bias, b_md)  # w: [K, N]
        self._mds = (w_any, w_user, b_md, attr)
        self._per_call_forms()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] contiguous of the built size and dtype -> y [M, N]."""
        return self._execute(x, torch.empty(self.output_size, dtype=self.out_dtype))


class MaxPool2d(_Quantized):
    """Max pooling on an 8-bit NHWC tensor (a MaxPool the Q/DQ propagation moved onto the quantized
    values): oneDNN's pooling on u8/s8, which never reads padding for max."""

    def __init__(self, input_size: list[int], dtype: torch.dtype, kernel: list[int], stride: list[int],
                 pads: list[int], dilation: list[int]):
        lib = _lib()
        n, c, h, w = input_size
        oh = (h + pads[0] + pads[2] - dilation[0] * (kernel[0] - 1) - 1) // stride[0] + 1
        ow = (w + pads[1] + pads[3] - dilation[1] * (kernel[1] - 1) - 1) // stride[1] + 1
        self.input_size, self.output_size, self.out_dtype = (n, c, h, w), (n, c, oh, ow), dtype
        self._src_md = memory_desc([n, c, h, w], dtype, TAG_ACDB)
        self._dst_md = memory_desc([n, c, oh, ow], dtype, TAG_ACDB)
        pd = ctypes.c_void_p()
        _check(lib.lib.dnnl_pooling_forward_primitive_desc_create(
            ctypes.byref(pd), lib.engine, FORWARD_INFERENCE, POOLING["max"], self._src_md.value, self._dst_md.value,
            _dims(stride), _dims(kernel), _dims([d - 1 for d in dilation]), _dims(pads[:2]), _dims(pads[2:]), None),
            f"8-bit max pooling {list(input_size)} kernel {kernel} stride {stride} pads {pads}")
        self._pd, self._prim = _primitive(pd, "8-bit max pooling")
        self.implementation = _implementation(pd)
        self.what = f"8-bit max pooling {list(self.input_size)} -> {list(self.output_size)}"
        self._fixed, self._lock = [], threading.Lock()
        self._out_strides = (oh * ow * c, 1, ow * c, c)
        self._per_call = self.bind(0, 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.empty_strided(self.output_size, self._out_strides, dtype=self.out_dtype)
        return self._execute(x, y)


class ScaledReorder(_Quantized):
    """QuantizeLinear (float32 -> u8/s8) or DequantizeLinear (u8/s8 -> float32), per tensor, as one oneDNN
    reorder with scale and zero point attributes: one pass on both threads, and the NCHW -> NHWC layout
    change of a network's input in the same pass. oneDNN rounds x·(1/scale) + zero point where ONNX rounds
    x/scale and then adds it: at an exact tie (an odd zero point, an inexact reciprocal) one step apart."""

    def __init__(self, size: list[int], src_dtype: torch.dtype, dst_dtype: torch.dtype,
                 scale: float | torch.Tensor, zero: int | torch.Tensor, src_channels_last: bool):
        lib = _lib()
        four_d = len(size) == 4
        tags = {1: TAG_A, 2: TAG_AB, 3: TAG_ABC, 4: TAG_ABCD}
        if len(size) not in tags:
            raise OneDNNError(f"reorder of rank {len(size)}")
        src_tag = TAG_ACDB if four_d and src_channels_last else tags[len(size)]
        dst_tag = TAG_ACDB if four_d else tags[len(size)]
        self.input_size = self.output_size = tuple(size)
        self.out_dtype = dst_dtype
        self._src_md = memory_desc(list(size), src_dtype, src_tag)
        self._dst_md = memory_desc(list(size), dst_dtype, dst_tag)
        quantize = dst_dtype in (torch.uint8, torch.int8)
        side = ARG_DST if quantize else ARG_SRC
        attr = ctypes.c_void_p()
        _check(lib.lib.dnnl_primitive_attr_create(ctypes.byref(attr)), "attr")
        self._attr = _Handle(attr, "dnnl_primitive_attr_destroy")
        # a tensor of scales / zero points: one per channel (axis 1), oneDNN's mask 1 << 1
        scales = torch.as_tensor(scale, dtype=torch.float32).reshape(-1).contiguous()
        zeros = torch.as_tensor(zero, dtype=torch.int32).reshape(-1).contiguous()
        per_channel = torch.is_tensor(scale) and scales.numel() > 1
        if per_channel and (len(size) < 2 or scales.numel() != size[1] or zeros.numel() not in (1, size[1])):
            raise OneDNNError(f"{scales.numel()} scales and {zeros.numel()} zero points for a reorder of {list(size)}: "
                              "one per channel (axis 1) expected")
        _check(lib.lib.dnnl_primitive_attr_set_scales_mask(attr, side, 2 if per_channel else 0), "reorder scale")
        self._constants = [(ARG_ATTR_SCALES | side, scales, F32)]
        if bool(zeros.any()):
            zero_mask = 2 if zeros.numel() > 1 else 0
            _check(lib.lib.dnnl_primitive_attr_set_zero_points_mask(attr, side, zero_mask), "reorder zero point")
            self._constants.append((ARG_ATTR_ZERO_POINTS | side, zeros, S32))
        pd = ctypes.c_void_p()
        _check(lib.lib.dnnl_reorder_primitive_desc_create(ctypes.byref(pd), self._src_md.value, lib.engine,
                                                          self._dst_md.value, lib.engine, attr),
               f"{'quantizing' if quantize else 'dequantizing'} reorder {list(size)}")
        self._pd, self._prim = _primitive(pd, "scaled reorder")
        self.implementation = _implementation(pd)
        self.what = f"{'quantize' if quantize else 'dequantize'} {list(size)}"
        self._scalars, fixed = [], []
        for arg, value, dtype in self._constants:
            md = memory_desc([value.numel()], torch.float32 if dtype == F32 else torch.int32, TAG_A)
            self._scalars.append((md, value))
            fixed.append((arg, _memory(md.value, value.data_ptr())))
        self._fixed, self._lock = fixed, threading.Lock()
        n = size
        self._out_strides = (n[1] * n[2] * n[3], 1, n[3] * n[1], n[1]) if four_d else None
        self._per_call = self.bind(0, 0)

    def bind(self, src: int, dst: int, residual: int | None = None) -> Bound:
        roles = {"src": (ARG_FROM, self._src_md.value, src), "dst": (ARG_TO, self._dst_md.value, dst)}
        return Bound(self._prim.value, roles, self._fixed, self.what, self)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._out_strides is not None:
            y = torch.empty_strided(self.output_size, self._out_strides, dtype=self.out_dtype)
        else:
            y = torch.empty(self.output_size, dtype=self.out_dtype)
        return self._execute(x, y)


class QAddBinary(_Quantized):
    """kiln::QAdd of two same-size 8-bit tensors as one oneDNN binary add: the operands' scales as the
    sources' scales, the zero points and the output's scale folded into a linear post-op, the
    activation as a clip in output units, rounded and saturated by the 8-bit destination:

        y = clip(k_a·a + k_b·b + c, lo, hi)    k_a = s_a/s_y, k_b = s_b/s_y, c = z_y − k_a·z_a − k_b·z_b
    """

    def __init__(self, size: list[int], a_dtype: torch.dtype, b_dtype: torch.dtype, y_dtype: torch.dtype,
                 ka: float, kb: float, offset: float, low: float | None, high: float | None):
        lib = _lib()
        if "dnnl_binary_primitive_desc_create" not in _EXTRA_SIGNATURES:
            raise OneDNNError("binary primitive not bound")
        tag = TAG_ACDB if len(size) == 4 else {1: TAG_A, 2: TAG_AB, 3: TAG_ABC}[len(size)]
        self.input_size = self.output_size = tuple(size)
        self.out_dtype = y_dtype
        self._src_md = memory_desc(list(size), a_dtype, tag)
        self._src1_md = memory_desc(list(size), b_dtype, tag)
        self._dst_md = memory_desc(list(size), y_dtype, tag)
        attr = ctypes.c_void_p()
        _check(lib.lib.dnnl_primitive_attr_create(ctypes.byref(attr)), "attr")
        self._attr = _Handle(attr, "dnnl_primitive_attr_destroy")
        self._constants = []
        for arg, k in ((ARG_SRC, ka), (ARG_SRC_1, kb)):
            _check(lib.lib.dnnl_primitive_attr_set_scales_mask(attr, arg, 0), "binary source scale")
            self._constants.append((ARG_ATTR_SCALES | arg, torch.tensor([k], dtype=torch.float32), F32))
        post = ctypes.c_void_p()
        _check(lib.lib.dnnl_post_ops_create(ctypes.byref(post)), "post ops")
        post_h = _Handle(post, "dnnl_post_ops_destroy")
        _check(lib.lib.dnnl_post_ops_append_eltwise(post, ELTWISE["linear"], 1.0, float(offset)), "offset post-op")
        info = torch.iinfo(y_dtype)
        lo = float(info.min) if low is None else max(float(info.min), low)
        hi = float(info.max) if high is None else min(float(info.max), high)
        _check(lib.lib.dnnl_post_ops_append_eltwise(post, ELTWISE["clip"], lo, hi), "clip post-op")
        _check(lib.lib.dnnl_primitive_attr_set_post_ops(attr, post), "set post ops")
        del post_h
        pd = ctypes.c_void_p()
        _check(lib.lib.dnnl_binary_primitive_desc_create(ctypes.byref(pd), lib.engine, BINARY_ADD,
                                                         self._src_md.value, self._src1_md.value, self._dst_md.value,
                                                         attr), f"8-bit binary add {list(size)}")
        self._pd, self._prim = _primitive(pd, "8-bit binary add")
        self.implementation = _implementation(pd)
        self.what = f"8-bit add {list(size)}"
        self._scalars, fixed = [], []
        for arg, value, _ in self._constants:
            md = memory_desc([1], torch.float32, TAG_A)
            self._scalars.append((md, value))
            fixed.append((arg, _memory(md.value, value.data_ptr())))
        self._fixed, self._lock = fixed, threading.Lock()
        n = size
        self._out_strides = (n[1] * n[2] * n[3], 1, n[3] * n[1], n[1]) if len(size) == 4 else None
        self._per_call = self.bind(0, 0, 0)

    def bind(self, src: int, dst: int, residual: int | None = None) -> Bound:
        roles = {"src": (ARG_SRC, self._src_md.value, src), "residual": (ARG_SRC_1, self._src1_md.value, residual or 0),
                 "dst": (ARG_DST, self._dst_md.value, dst)}
        return Bound(self._prim.value, roles, self._fixed, self.what, self)

    def __call__(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if self._out_strides is not None:
            y = torch.empty_strided(self.output_size, self._out_strides, dtype=self.out_dtype)
        else:
            y = torch.empty(self.output_size, dtype=self.out_dtype)
        lib = _lib()
        with self._lock:
            bound = self._per_call
            bound.rebind("src", a.data_ptr())
            bound.rebind("residual", b.data_ptr())
            bound.rebind("dst", y.data_ptr())
            _check(lib.lib.dnnl_primitive_execute(bound.primitive, lib.stream, bound.nargs, bound.args), self.what)
        return y
