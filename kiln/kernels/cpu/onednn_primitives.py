"""oneDNN primitives built once per layer and input shape: Conv2d, Pool2d, InnerProduct.

Each is built at engine load on the binding in onednn.py (the kernel chosen and JIT-compiled,
the weight reordered into its blocked layout once) and then run two ways: called per layer, a
few µs of `dnnl_memory_set_data_handle` plus `dnnl_primitive_execute`, or bound once to a
native segment's planned buffers (`bind` -> onednn.Bound).

Activations are NHWC (oneDNN's `acdb`, torch's channels_last), so the tensors a primitive
reads and writes are ordinary torch tensors: only the weights live in oneDNN's blocked layout
(format `any`: the kernel picks it). Per-layer outputs are views of a few pooled buffers
(_Arena below).
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from kiln.kernels.cpu import hugepages
from kiln.kernels.cpu.form_choice import PARALLEL, SERIAL, FormChooser
from kiln.kernels.cpu.onednn import (
    ARG_BIAS,
    ARG_DST,
    ARG_POST_OP,
    ARG_SRC,
    ARG_SRC_1,
    ARG_WEIGHTS,
    CONVOLUTION_DIRECT,
    FORWARD_INFERENCE,
    POOLING,
    QUERY_IMPL_INFO_STR,
    QUERY_WEIGHTS_MD,
    TAG_A,
    TAG_AB,
    TAG_ABCD,
    TAG_ABCDE,
    TAG_ACDB,
    TAG_ANY,
    Bound,
    Eltwise,
    OneDNNError,
    RoleArguments,
    _check,
    _dims,
    _epilogue_attr,
    _ExecArg,
    _Handle,
    _implementation,
    _memory,
    _primitive,
    creating_with_threads,
    load,
    memory_desc,
    one_openmp_thread,
    packed_weight,
    row_major_desc,
)

# ---- threads -----------------------------------------------------------------------------------

# A layer whose activations (input and output) hold fewer floats than SERIAL_ELEMENTS and whose work is
# under SERIAL_MACS multiply-adds is "small": bound twice, on OpenMP's count and on one thread. Every parallel
# region is a fork and a join, and where the cores run other work the join waits out the time slice of a
# descheduled thread: on a 2-vCPU Xeon at load ~4 each of EfficientNet-B0's ~65 layers took ~0.4 ms more at
# 2 threads than at 1, where most take 0.05-0.5 ms of work; on free cores the same layers are 25-55% faster
# on two threads (bench/results/efficientnet-cpu-2026-12-02.md). Which form a native segment runs is chosen
# per run from their measured times (kiln/kernels/cpu/form_choice.py), not from a load average that lags the
# moment. With these bounds every B0 layer is small, its three at 112x112 (1.2M floats) included (2026-12-04d:
# so its serial form forks no OpenMP thread at all; before, those three still waited on a worker's wake-up), and
# ResNet-50's convolutions (51M MACs and up) are not.
SERIAL_ELEMENTS = 1 << 21  # 8 MiB of float32 each side
SERIAL_MACS = 1 << 25  # ~34M multiply-adds: ~0.7 ms on one AVX-512 core
MEASURED = "measured"


def small_layers_mode(environ: dict[str, str] | None = None) -> str:
    """How small layers run: KILN_SERIAL_SMALL_LAYERS=1 on one thread, =0 on OpenMP's count, unset both
    forms bound and the faster measured per run (MEASURED)."""
    environ = os.environ if environ is None else environ
    if "KILN_SERIAL_SMALL_LAYERS" in environ:
        return SERIAL if environ["KILN_SERIAL_SMALL_LAYERS"] != "0" else PARALLEL
    return MEASURED


def small(elements: int, macs: int = 0) -> bool:
    """Whether a layer of `elements` floats per activation and `macs` multiply-adds is small enough to be worth
    a serial form."""
    return elements < SERIAL_ELEMENTS and macs < SERIAL_MACS


def thread_forms(elements: int, macs: int = 0, mode: str | None = None) -> tuple[int | None, ...]:
    """The thread counts a layer is built at, its per-call form first (None: OpenMP's count): (None, 1) for a
    small layer in MEASURED mode on more than one thread, (1,) for one forced serial, else (None,)."""
    mode = small_layers_mode() if mode is None else mode
    if not small(elements, macs) or mode == PARALLEL:
        return (None,)
    if mode == SERIAL:
        return (1,)
    return (None, 1) if torch.get_num_threads() > 1 else (None,)


# ---- activation memory -------------------------------------------------------------------------

class _Arena:
    """Output memory for the primitives: a few large buffers, each reused as soon as no tensor
    references it, the one handed out most recently first.

    Inside a network the cost of a convolution depends on whether its input and output are still
    in cache: onnxruntime plans its activations into an arena that reuses the same few buffers
    (measured: MobileNetV2's 52 convolutions take 4.4 ms over three ring buffers, 5.8 ms on fresh
    torch allocations, 7.3 ms on a buffer per layer). This does the same without a plan: an
    output is a view of a pooled 1-D buffer, and a buffer is free again when only the pool holds
    its storage (torch's storage use count: every tensor or view of it adds one). The buffer
    handed out most recently among the free ones is usually the one the previous layer just
    read: hot. Every buffer is as large as the largest output seen, so any can serve any layer.
    """

    _MAX_BYTES = 256 << 20  # the pool's size at most; past it, plain allocations (it never shrinks)

    def __init__(self):
        self._buffers: list[torch.Tensor] = []  # the most recently handed out last
        self._pointers: set[int] = set()  # their storages' addresses
        self._largest = 0
        self._lock = threading.Lock()

    def users(self, t: torch.Tensor) -> int:
        """Tensors sharing t's storage, t included, not counting the pool's own buffer."""
        storage = t.untyped_storage()
        return _storage_users(storage._cdata) - 1 - (storage.data_ptr() in self._pointers)

    def empty(self, shape: tuple[int, ...], strides: tuple[int, ...]) -> torch.Tensor:
        numel = shape[0] * strides[0]  # NHWC: the batch stride spans one image
        users = _storage_users
        with self._lock:
            buffers = self._buffers
            for i in range(len(buffers) - 1, -1, -1):
                buffer = buffers[i]
                if buffer.numel() >= numel and users(buffer.untyped_storage()._cdata) <= 2:  # pool + temporary
                    del buffers[i]
                    break
            else:
                largest = max(self._largest, numel)
                if (len(buffers) + 1) * largest * 4 > self._MAX_BYTES:
                    return torch.empty_strided(shape, strides, dtype=torch.float32)
                self._largest = largest
                buffer = hugepages.empty(largest, own=True)  # its storage its own: users() counts it
                self._pointers.add(buffer.untyped_storage().data_ptr())
            buffers.append(buffer)
            return buffer.as_strided(shape, strides)


_storage_users = torch._C._storage_Use_Count
_ARENA = _Arena()
storage_users = _ARENA.users  # what the residual-in-place check asks (kiln/tactics/cpu/onednn.py)


class _PerCallForms:
    """A small layer's per-call path (outside native segments: one layer at a time, the tuner's timings) runs its
    faster form by recent times, as a segment does: a layer timed alone on busy cores then costs what it will cost
    in a segment. The caller's lock (the tactic's, kiln/tactics/cpu/onednn.py) serializes calls."""

    __slots__ = ("serial", "chooser", "serial_args")

    def __init__(self, serial: tuple | None, serial_args: Any = None):
        """`serial_args`: the serial form's own execution arguments (a weight in another layout); None: the
        parallel form's."""
        self.serial = _value(serial)
        self.chooser = FormChooser() if serial is not None else None
        self.serial_args = serial_args


def _execute(forms: _PerCallForms, execute, prim: int, stream, nargs: int, args) -> int:
    """dnnl_primitive_execute of the layer's parallel form `prim` or its serial one, as its chooser says, timed."""
    chooser = forms.chooser
    if chooser is None:
        return execute(prim, stream, nargs, args)
    form = chooser.choose()
    start = time.perf_counter()
    if form == PARALLEL:
        status = execute(prim, stream, nargs, args)
    else:
        with one_openmp_thread():  # as a segment's serial form: no parallel region (onednn.one_openmp_thread)
            status = execute(forms.serial, stream, nargs, args if forms.serial_args is None else forms.serial_args)
    chooser.record(form, time.perf_counter() - start)
    return status


def _value(made: tuple | None) -> int | None:
    """The primitive handle of a (descriptor, primitive) pair, or None."""
    return None if made is None else made[1].value


def _out_size(size: int, kernel: int, stride: int, dilation: int, pad_l: int, pad_r: int) -> int:
    return (size + pad_l + pad_r - dilation * (kernel - 1) - 1) // stride + 1


class Conv2d:
    """One 2-D convolution primitive with its epilogue as post-ops, for one input shape.

    y = final(act(conv(x, W) + b [+ r]) [+ r]) on NHWC (channels-last) tensors, the residual r placed
    before or after the activation as kiln::FusedConv orders them, final its final_activation (or none):
    a binary-add post-op that reads r where it lies (__call__), or, built with residual_in_place, a sum
    post-op that accumulates into r's own memory (accumulate). The weight is reordered into the blocked
    layout the chosen kernel wants, once, here.
    """

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None, input_size: list[int], stride: list[int],
                 pads: list[int], dilation: list[int], groups: int, eltwise: Eltwise | None,
                 residual: bool, residual_after_activation: bool, residual_in_place: bool = False,
                 share_weight_with: Conv2d | None = None, prefer: str | None = None, final: Eltwise | None = None):
        """`prefer`: the first of oneDNN's kernels whose name starts so ("jit_dw:"), when it offers one."""
        lib = load()
        self._lib = lib
        n, c, h, wd = input_size
        o, i_per_group, kh, kw = w.shape
        if c != i_per_group * groups:
            raise OneDNNError(f"input channels {c} != weight's {i_per_group} x {groups} groups")
        oh = _out_size(h, kh, stride[0], dilation[0], pads[0], pads[2])
        ow = _out_size(wd, kw, stride[1], dilation[1], pads[1], pads[3])
        self.input_size = (n, c, h, wd)
        self.output_size = (n, o, oh, ow)
        self.residual = residual

        src_md = memory_desc([n, c, h, wd], TAG_ACDB)
        dst_md = memory_desc([n, o, oh, ow], TAG_ACDB)
        if groups == 1:
            w_dims, w_user_tag = [o, c, kh, kw], TAG_ABCD
        else:
            w_dims, w_user_tag = [groups, o // groups, i_per_group, kh, kw], TAG_ABCDE
        w_any = memory_desc(w_dims, TAG_ANY)
        b_md = memory_desc([o], TAG_A) if b is not None else None

        attr_h, self._residual_index = _epilogue_attr(eltwise, residual, residual_after_activation,
                                                      residual_in_place, dst_md, final)

        def descriptor() -> ctypes.c_void_p:
            pd = ctypes.c_void_p()
            _check(lib.lib.dnnl_convolution_forward_primitive_desc_create(
                ctypes.byref(pd), lib.engine, FORWARD_INFERENCE, CONVOLUTION_DIRECT, src_md.value, w_any.value,
                b_md.value if b_md is not None else None, dst_md.value, _dims(stride),
                _dims([d - 1 for d in dilation]), _dims(pads[:2]), _dims(pads[2:]), attr_h.value),
                f"convolution {list(input_size)} * {list(w.shape)} stride {stride} pads {pads} groups {groups}")
            return pd

        def created(threads: int | None) -> tuple:
            with creating_with_threads(threads):
                pd = descriptor()
                if prefer is not None:  # step through oneDNN's candidates to the preferred kernel, if it has it
                    while not _implementation(pd).startswith(prefer):
                        if lib.lib.dnnl_primitive_desc_next_impl(pd) != 0:
                            lib.lib.dnnl_primitive_desc_destroy(pd)
                            pd = descriptor()  # not there: oneDNN's own first choice
                            break
                return _primitive(pd, "convolution")

        macs = n * o * oh * ow * i_per_group * kh * kw
        forms = thread_forms(max(n * c * h * wd, n * o * oh * ow), macs)
        self.threads = forms[0]  # the per-call path's; None: OpenMP's count
        self._pd, self._prim = created(self.threads)
        pd = self._pd.value
        self.implementation = _implementation(pd)

        # the weight, once, in the layout the kernel chose (or another primitive's copy of it, when
        # that one chose the same layout: the in-place and the binary variant of one layer)
        w_md = lib.lib.dnnl_primitive_desc_query_md(pd, QUERY_WEIGHTS_MD, 0)
        w_user = memory_desc(w_dims, w_user_tag)
        other = share_weight_with
        if other is not None and lib.lib.dnnl_memory_desc_equal(w_md, other._w_md):
            self._weight = other._weight
        else:
            self._weight, _ = packed_weight(pd, w_user, w)  # kept alive: the primitive reads it
        self._w_md = w_md  # owned by the primitive descriptor, which this object keeps
        # the serial form (thread_forms), on the same arguments or, where its kernel wants the weight in another
        # layout, on a copy packed so (a small layer's: at most SERIAL_MACS / kernel taps floats). Without one, such a
        # layer ran its parallel kernel inside the segment's serial form: a fork whose partner thread sleeps there
        # (ResNet-tiny at 2 threads on the Zen 3: its two accumulating 1x1 convolutions, brgconv_1x1, 15-18 us each
        # in the serial form against 3-4 us on one thread; bench/results/cnn-2threads-zen3-2026-12-07.md)
        self._serial = created(1) if len(forms) > 1 else None
        self._serial_w_mem = None
        if self._serial is not None:
            serial_w_md = lib.lib.dnnl_primitive_desc_query_md(self._serial[0].value, QUERY_WEIGHTS_MD, 0)
            if not lib.lib.dnnl_memory_desc_equal(serial_w_md, w_md):
                self._serial_weight, _ = packed_weight(self._serial[0].value, w_user, w)
                self._serial_w_mem = _memory(serial_w_md, self._serial_weight.data_ptr())
        self._bias = None if b is None else b.detach().to(torch.float32).contiguous()

        # memory objects whose data handles are swapped per call
        self._src = _memory(src_md.value, None)
        self._dst = _memory(dst_md.value, None)
        self._w_mem = _memory(w_md, self._weight.data_ptr())
        args = [(ARG_SRC, self._src), (ARG_WEIGHTS, self._w_mem), (ARG_DST, self._dst)]
        if self._bias is not None:
            self._b_mem = _memory(b_md.value, self._bias.data_ptr())
            args.append((ARG_BIAS, self._b_mem))
        self.residual_in_place = residual and residual_in_place
        if residual and not residual_in_place:
            self._r_mem = _memory(dst_md.value, None)
            args.append((ARG_POST_OP(self._residual_index) | ARG_SRC_1, self._r_mem))
        self._mds = (src_md, dst_md, w_any, b_md, w_user)  # descriptors outlive the memories that use them
        self._nargs = len(args)
        self._args = (_ExecArg * len(args))(*[_ExecArg(a, m.value) for a, m in args])
        # the per-call path below touches only these locals' worth of state: a few µs in all
        self._out_shape = (n, o, oh, ow)
        self._out_strides = (oh * ow * o, 1, ow * o, o)  # NHWC in memory, NCHW in shape: channels-last
        self._call = (lib.lib.dnnl_memory_set_data_handle, lib.lib.dnnl_primitive_execute, self._prim.value,
                      lib.stream, self._src.value, self._dst.value,
                      self._r_mem.value if residual and not residual_in_place else None)
        serial_args = None
        if self._serial_w_mem is not None:  # the same arguments, its own weight
            serial_args = (_ExecArg * len(args))(*[_ExecArg(a, (self._serial_w_mem if a == ARG_WEIGHTS else m).value)
                                                   for a, m in args])
        self._serial_args = serial_args  # kept alive: the per-call path's serial form reads it
        self._forms = _PerCallForms(self._serial, serial_args)

    def bind(self, src: int, dst: int, residual: int | None = None) -> Bound:
        """Arguments at fixed addresses (Bound): built with residual_in_place, dst is the residual's
        memory and `residual` is not given; with a binary residual, it is."""
        src_md, dst_md = self._mds[0], self._mds[1]
        roles = {"src": (ARG_SRC, src_md.value, src), "dst": (ARG_DST, dst_md.value, dst)}
        if self.residual and not self.residual_in_place:
            roles["residual"] = (ARG_POST_OP(self._residual_index) | ARG_SRC_1, dst_md.value, residual)
        bias = [(ARG_BIAS, self._b_mem)] if self._bias is not None else []
        fixed = [(ARG_WEIGHTS, self._w_mem)] + bias
        serial_fixed = [(ARG_WEIGHTS, self._serial_w_mem)] + bias if self._serial_w_mem is not None else None
        what = f"convolution {list(self.input_size)} -> {list(self.output_size)}"
        return Bound(self._prim.value, roles, fixed, what, self, _value(self._serial), threads=self.threads,
                     serial_fixed=serial_fixed)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [N, C, H, W] channels-last float32 -> y [N, O, H', W'] channels-last, a view of a
        pooled buffer (_Arena).

        The caller guarantees x (and residual) are channels-last float32 of the sizes this
        primitive was built for: the primitive reads raw memory.
        """
        set_handle, execute, prim, stream, src, dst, res = self._call
        y = _ARENA.empty(self._out_shape, self._out_strides)
        set_handle(src, x.data_ptr())
        set_handle(dst, y.data_ptr())
        if res is not None:
            set_handle(res, residual.data_ptr())
        status = _execute(self._forms, execute, prim, stream, self._nargs, self._args)
        if status:
            _check(status, "convolution")
        return y

    def accumulate(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The epilogue's residual add done in place (built with residual_in_place): the result is
        written over `residual` and returned. Reading the residual then costs nothing beyond the
        output's own cache-line fills; the caller guarantees nothing else reads `residual` after."""
        set_handle, execute, prim, stream, src, dst, _ = self._call
        set_handle(src, x.data_ptr())
        set_handle(dst, residual.data_ptr())
        status = _execute(self._forms, execute, prim, stream, self._nargs, self._args)
        if status:
            _check(status, "convolution")
        return residual


# ---- pooling -----------------------------------------------------------------------------------

class Pool2d:
    """One 2-D pooling primitive (max, or average with or without the padding counted) on NHWC.

    ONNX MaxPool (ceil_mode's tail given as more end padding), AveragePool with ceil_mode=0 and
    GlobalAveragePool (a window of the whole image); oneDNN never reads padding for max, and counts
    it for average only when told to.
    """

    def __init__(self, input_size: list[int], kind: str, kernel: list[int], stride: list[int], pads: list[int],
                 dilation: list[int]):
        lib = load()
        self._lib = lib
        n, c, h, w = input_size
        oh = _out_size(h, kernel[0], stride[0], dilation[0], pads[0], pads[2])
        ow = _out_size(w, kernel[1], stride[1], dilation[1], pads[1], pads[3])
        self.input_size, self.output_size = (n, c, h, w), (n, c, oh, ow)
        src_md = memory_desc([n, c, h, w], TAG_ACDB)
        dst_md = memory_desc([n, c, oh, ow], TAG_ACDB)

        def created(threads: int | None) -> tuple:
            pd = ctypes.c_void_p()
            with creating_with_threads(threads):
                _check(lib.lib.dnnl_pooling_forward_primitive_desc_create(
                    ctypes.byref(pd), lib.engine, FORWARD_INFERENCE, POOLING[kind], src_md.value, dst_md.value,
                    _dims(stride), _dims(kernel), _dims([d - 1 for d in dilation]), _dims(pads[:2]),
                    _dims(pads[2:]), None), f"{kind} pooling {list(input_size)} kernel {kernel} stride {stride} pads {pads}")
                return _primitive(pd, "pooling")

        forms = thread_forms(n * c * h * w, n * c * oh * ow * kernel[0] * kernel[1])
        self.threads = forms[0]  # the per-call path's; None: OpenMP's count
        self._pd, self._prim = created(self.threads)
        self._serial = created(1) if len(forms) > 1 else None  # the serial form: same arguments, no weights
        pd = self._pd.value
        info = ctypes.c_char_p()
        lib.lib.dnnl_primitive_desc_query(pd, QUERY_IMPL_INFO_STR, 0, ctypes.byref(info))
        self.implementation = (info.value or b"?").decode()
        self._src, self._dst = _memory(src_md.value, None), _memory(dst_md.value, None)
        self._mds = (src_md, dst_md)
        self._args = (_ExecArg * 2)(_ExecArg(ARG_SRC, self._src.value), _ExecArg(ARG_DST, self._dst.value))
        self._out_shape = (n, c, oh, ow)
        self._out_strides = (oh * ow * c, 1, ow * c, c)
        self._call = (lib.lib.dnnl_memory_set_data_handle, lib.lib.dnnl_primitive_execute, self._prim.value,
                      lib.stream, self._src.value, self._dst.value)
        self._forms = _PerCallForms(self._serial)

    def bind(self, src: int, dst: int, residual: int | None = None) -> Bound:
        """Arguments at fixed addresses (Bound)."""
        roles = {"src": (ARG_SRC, self._mds[0].value, src), "dst": (ARG_DST, self._mds[1].value, dst)}
        return Bound(self._prim.value, roles, [], f"pooling {list(self.input_size)} -> {list(self.output_size)}", self,
                     _value(self._serial), threads=self.threads)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, C, H, W] channels-last float32 of the built size -> [N, C, H', W'] channels-last."""
        set_handle, execute, prim, stream, src, dst = self._call
        y = _ARENA.empty(self._out_shape, self._out_strides)
        set_handle(src, x.data_ptr())
        set_handle(dst, y.data_ptr())
        status = _execute(self._forms, execute, prim, stream, 2, self._args)
        if status:
            _check(status, "pooling")
        return y


# ---- linear layers -----------------------------------------------------------------------------

@dataclass
class _Made:
    """A created inner-product primitive and what every layer sharing it reads of it."""

    pd: _Handle
    primitive: _Handle
    residual_index: int  # the residual's post-op index (-1: none)
    implementation: str


class _PrimitiveCache:
    """Inner-product primitives by (rows, shapes, epilogue) and weight layout, least recently used out: a
    BERT-base at a new sequence length needs 4 new primitives, not one per each of its 48 GEMMs. A
    primitive holds no weights (they are execution arguments), so layers of one shape can share one."""

    def __init__(self, size: int):
        self.size = size
        self._entries: OrderedDict[tuple, list[tuple[Any, _Made]]] = OrderedDict()
        self._lock = threading.Lock()

    def find(self, key: tuple, weights_md) -> _Made | None:
        equal = load().lib.dnnl_memory_desc_equal
        with self._lock:
            for md, made in self._entries.get(key, ()):
                if equal(md, weights_md):
                    self._entries.move_to_end(key)
                    return made
        return None

    def add(self, key: tuple, made: _Made) -> None:
        # the descriptor is the primitive's own weights md: it lives as long as `made` does
        own = load().lib.dnnl_primitive_desc_query_md(made.pd.value, QUERY_WEIGHTS_MD, 0)
        with self._lock:
            self._entries.setdefault(key, []).append((own, made))
            self._entries.move_to_end(key)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)


_SHARED_PRIMITIVES = _PrimitiveCache(1024)  # 3 per row count for BERT-base: AHEAD_PRIMITIVES fit with room


def _inner_product(rows: int, n: int, k: int, eltwise: Eltwise | None, residual: bool, residual_after_activation: bool,
                   bias: bool, weights_md) -> _Made | None:
    """The inner product [rows, k] x [n, k]ᵀ created for weights laid out as weights_md (None when oneDNN has no
    kernel for that layout at these rows)."""
    lib = load()
    src_md, dst_md = row_major_desc((rows, k)), row_major_desc((rows, n))
    attr_h, residual_index = _epilogue_attr(eltwise, residual, residual_after_activation, False, dst_md)
    pd = ctypes.c_void_p()
    status = lib.lib.dnnl_inner_product_forward_primitive_desc_create(
        ctypes.byref(pd), lib.engine, FORWARD_INFERENCE, src_md.value, weights_md,
        row_major_desc((n,)).value if bias else None, dst_md.value, attr_h.value)
    if status != 0:
        return None
    pd_h, primitive = _primitive(pd, "inner product")
    return _Made(pd_h, primitive, residual_index, _implementation(pd))


def _shared_inner_product(rows: int, epilogue: tuple, weights_md) -> _Made | None:
    """The inner product at `rows` of a layer shape (`epilogue`: InnerProduct._epilogue) for weights laid out as
    weights_md, from the shared cache or created into it; None when oneDNN has no kernel for that layout there.
    The layers of a transformer share shapes: one primitive per (rows, shapes, epilogue, weight layout)."""
    key = (rows, *epilogue)
    made = _SHARED_PRIMITIVES.find(key, weights_md)
    if made is None:
        made = _inner_product(rows, *epilogue, weights_md)
        if made is not None:
            _SHARED_PRIMITIVES.add(key, made)
    return made


class InnerProduct:
    """y = act(x @ Wᵀ + b [+ r]) [+ r] for x [M, K] row-major: oneDNN's inner product, the weight
    [N, K] reordered once into the layout its kernel wants, the epilogue as post-ops."""

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None, rows: int, eltwise: Eltwise | None,
                 residual: bool, residual_after_activation: bool, weight_from: InnerProduct | None = None):
        """`weight_from`: the same layer at another row count; its packed weight (and bias, and their memory
        objects) are taken as they are when oneDNN has a kernel for that layout at these rows (no second copy, no
        reorder: a BERT-base at a new sequence length binds its 48 GEMMs in milliseconds instead of re-packing
        340 MB). Then a layer whose primitive another layer of its shape made costs a cache look-up and two
        memory objects: the descriptors are shared too (row_major_desc), and the per-call path's own arguments
        are made on its first call (a native segment binds its own)."""
        lib = load()
        self._lib = lib
        n, k = w.shape
        self.input_size, self.output_size = (rows, k), (rows, n)
        self.residual = residual
        self._epilogue = (n, k, eltwise, residual, residual_after_activation, b is not None)  # onednn_ahead's too
        shared = weight_from._weight_md if weight_from is not None else None
        made = _shared_inner_product(rows, self._epilogue, shared) if shared is not None else None
        if made is None:  # no other row count's weight to share, or a kernel wanting another layout
            shared = None
            w_any = memory_desc([n, k], TAG_ANY)
            made = _inner_product(rows, n, k, eltwise, residual, residual_after_activation, b is not None, w_any.value)
            if made is None:
                _check(3, f"inner product [{rows}, {k}] x [{n}, {k}]ᵀ")
        self._made = made
        self._residual_index = made.residual_index
        self.implementation = made.implementation
        if shared is not None:
            self._weight, self._weight_md, self._bias = weight_from._weight, shared, weight_from._bias
            self._w_mem, self._b_mem = weight_from._w_mem, weight_from._b_mem
            self._weight_owner = weight_from  # keeps the md's owner alive
        else:
            self._weight, self._weight_md = packed_weight(made.pd.value, memory_desc([n, k], TAG_AB), w)
            self._bias = None if b is None else b.detach().to(torch.float32).contiguous()
            self._w_mem = _memory(self._weight_md, self._weight.data_ptr())
            self._b_mem = _memory(row_major_desc((n,)).value, self._bias.data_ptr()) if b is not None else None
            self._weight_owner = None
        self._mds = (row_major_desc((rows, k)), row_major_desc((rows, n)))  # kept: the memories' descriptors
        self._per_call: Bound | None = None
        self._lock = threading.Lock()

    def bind(self, src: int, dst: int, residual: int | None = None) -> Bound:
        """Arguments at fixed addresses (Bound)."""
        return self._bound(self._made, self.input_size[0], self._mds, src, dst, residual, self)

    def arguments_at(self, rows: int) -> RoleArguments | None:
        """This layer at another row count as a segment's view binds it, with no InnerProduct or Bound of its own: the
        primitive its layer shape shares at `rows` (made ahead by kiln/kernels/cpu/onednn_ahead.py, else created
        here) for this layer's packed weight layout, and the descriptors of its roles there, in bind()'s order (src,
        dst, residual). Layers of one shape and weight layout get the same primitive (it holds no weights): a view
        works it out once per layer shape (BERT-base's 24 oneDNN layers, 2 shapes), each layer's weight and bias
        (fixed_arguments) after the roles. None where oneDNN wants another weight layout at `rows`: an InnerProduct
        of its own packs one."""
        made = self._made if rows == self.input_size[0] else _shared_inner_product(rows, self._epilogue,
                                                                                    self._weight_md)
        if made is None:
            return None
        n, k = self._epilogue[:2]
        mds = (row_major_desc((rows, k)), row_major_desc((rows, n)))
        src_md, dst_md = mds[0].value.value, mds[1].value.value
        roles = [("src", ARG_SRC, src_md), ("dst", ARG_DST, dst_md)]
        if self.residual:
            roles.append(("residual", ARG_POST_OP(made.residual_index) | ARG_SRC_1, dst_md))
        # the primitive's owner (the shared cache may drop it) and the descriptors that key the memory objects
        return RoleArguments(made.primitive.value.value, tuple(roles), (made, mds))

    @property
    def fixed_arguments(self) -> tuple[tuple[int, int], ...]:
        """(execution argument, memory object) of the weight and bias, as every Bound of this layer holds them after
        its roles (arguments_at's primitives take them: the same weight layout)."""
        fixed = [(ARG_WEIGHTS, self._w_mem.value.value)]
        return tuple(fixed + ([(ARG_BIAS, self._b_mem.value.value)] if self._b_mem is not None else []))

    def _bound(self, made: _Made, rows: int, mds: tuple[_Handle, _Handle], src: int, dst: int, residual: int | None,
               owner: object) -> Bound:
        """`made`'s arguments at fixed addresses: src and dst (and a residual) of `rows` rows, descriptors `mds`."""
        src_md, dst_md = mds
        roles = {"src": (ARG_SRC, src_md.value, src), "dst": (ARG_DST, dst_md.value, dst)}
        if self.residual:
            roles["residual"] = (ARG_POST_OP(made.residual_index) | ARG_SRC_1, dst_md.value, residual)
        fixed = [(ARG_WEIGHTS, self._w_mem)] + ([(ARG_BIAS, self._b_mem)] if self._b_mem is not None else [])
        n, k = self._epilogue[:2]
        return Bound(made.primitive.value, roles, fixed, f"inner product {[rows, k]} -> {[rows, n]}", owner)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] contiguous float32 of the built size -> y [M, N] (a new tensor)."""
        y = torch.empty(self.output_size, dtype=torch.float32)
        with self._lock:
            if self._per_call is None:
                self._per_call = self.bind(0, 0, 0 if self.residual else None)
                self._per_call._owner = None  # ours: its reference back to us would make every inner product a cycle
            bound = self._per_call
            bound.rebind("src", x.data_ptr())
            bound.rebind("dst", y.data_ptr())
            if residual is not None:
                bound.rebind("residual", residual.data_ptr())
            lib = self._lib
            _check(lib.lib.dnnl_primitive_execute(bound.primitive, lib.stream, bound.nargs, bound.args), "inner product")
        return y

