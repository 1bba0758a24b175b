"""oneDNN's C API through ctypes: the library, its memory objects, post-ops, reorders.

torch's oneDNN entry points (`_convolution_pointwise`, conv2d) build a primitive descriptor on
every call, 30-50 µs whatever the layer's size, as much as the convolution itself on
MobileNetV2's 14x14 and 7x7 layers. The C API separates the two: `dnnl_*_primitive_desc_create`
and `dnnl_primitive_create` pick and JIT-compile the kernel once (at engine load), and a call
is then `dnnl_memory_set_data_handle` on the activations plus `dnnl_primitive_execute`.

This module is the binding: the library and its engine and stream, memory descriptors and
objects, weights reordered once into the layout a kernel chose, the epilogue as post-ops,
`Bound` (a primitive's arguments at fixed addresses, what a native segment runs) and `Reorder`.
The layers built on it: onednn_primitives.py (Conv2d, Pool2d, InnerProduct), onednn_matmul.py (Matmul,
one primitive for every row count), winograd.py.

The library is the `onednn-cpu-gomp` wheel's libdnnl.so.3 (oneDNN 3.x built on GNU OpenMP),
loaded after torch: its libgomp dependency resolves by SONAME to the libgomp torch already
loaded, so oneDNN and torch share one OpenMP thread pool and `torch.set_num_threads` governs
both. The wheel has no headers: the enum values below were read from oneDNN 3.2's public
headers (include/oneapi/dnnl/dnnl_types.h, dnnl_common_types.h); they are part of the v3 ABI,
and `load()` refuses a library whose major version is not 3.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import os
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch  # first: libdnnl's libgomp.so.1 must resolve to the one torch loaded

from kiln.kernels.cpu import hugepages

# ---- enum values of the oneDNN v3 C API (dnnl_types.h, dnnl_common_types.h) -------------------
F32 = 3  # dnnl_f32
DATA_TYPES = {torch.float32: F32, torch.int32: 4, torch.int8: 5, torch.uint8: 6}  # dnnl_data_type_t (oneDNN 3)
TAG_ANY, TAG_A, TAG_AB, TAG_ABC, TAG_ABCD, TAG_ABCDE, TAG_BA, TAG_ACDB = 1, 2, 3, 4, 5, 6, 14, 22  # dnnl_format_tag_t
RUNTIME_DIM = -(1 << 63)  # DNNL_RUNTIME_DIM_VAL: a size given per execution by the memory objects (matmul only)
FORWARD_INFERENCE = 96  # dnnl_prop_kind_t
CONVOLUTION_DIRECT = 0x1  # dnnl_alg_kind_t
ELTWISE = {"relu": 0x20, "tanh": 0x21, "linear": 0x26, "hardsigmoid": 0x28, "logistic": 0x29,
           "gelu_tanh": 0x2b, "swish": 0x2c, "clip": 0x2e, "gelu_erf": 0x31, "hardswish": 0x34}
BINARY_ADD = 0x1fff0
POOLING = {"max": 0x1ff, "avg_include_padding": 0x2ff, "avg_exclude_padding": 0x3ff}
ENGINE_CPU = 1  # dnnl_cpu
STREAM_DEFAULT = 1  # dnnl_stream_default_flags
FPMATH_STRICT = 0  # dnnl_fpmath_mode_strict: no implicit bf16/tf32 down-conversion
QUERY_IMPL_INFO_STR, QUERY_WEIGHTS_MD = 8, 131
ARG_SRC, ARG_DST, ARG_WEIGHTS, ARG_BIAS, ARG_SRC_1 = 1, 17, 33, 41, 2
ARG_FROM, ARG_TO = 1, 17


def ARG_POST_OP(index: int) -> int:  # DNNL_ARG_ATTR_MULTIPLE_POST_OP(idx)
    return 32768 * (index + 1)


class _ExecArg(ctypes.Structure):  # dnnl_exec_arg_t
    _fields_ = [("arg", ctypes.c_int), ("memory", ctypes.c_void_p)]


class _Version(ctypes.Structure):  # dnnl_version_t
    _fields_ = [("major", ctypes.c_int), ("minor", ctypes.c_int), ("patch", ctypes.c_int),
                ("hash", ctypes.c_char_p), ("cpu_runtime", ctypes.c_uint), ("gpu_runtime", ctypes.c_uint)]


_Dims = ctypes.c_int64 * 12  # dnnl_dims_t: DNNL_MAX_NDIMS = 12
_P = ctypes.c_void_p
_PP = ctypes.POINTER(ctypes.c_void_p)
_S = ctypes.c_int  # dnnl_status_t

# name -> (restype, argtypes)
_SIGNATURES = {
    "dnnl_version": (ctypes.POINTER(_Version), []),
    "dnnl_engine_create": (_S, [_PP, ctypes.c_int, ctypes.c_size_t]),
    "dnnl_stream_create": (_S, [_PP, _P, ctypes.c_uint]),
    "dnnl_stream_wait": (_S, [_P]),
    "dnnl_memory_desc_create_with_tag": (_S, [_PP, ctypes.c_int, _Dims, ctypes.c_int, ctypes.c_int]),
    "dnnl_memory_desc_destroy": (_S, [_P]),
    "dnnl_memory_desc_get_size": (ctypes.c_size_t, [_P]),
    "dnnl_memory_desc_equal": (ctypes.c_int, [_P, _P]),
    "dnnl_convolution_forward_primitive_desc_create": (
        _S, [_PP, _P, ctypes.c_int, ctypes.c_int, _P, _P, _P, _P, _Dims, _Dims, _Dims, _Dims, _P]),
    "dnnl_pooling_forward_primitive_desc_create": (
        _S, [_PP, _P, ctypes.c_int, ctypes.c_int, _P, _P, _Dims, _Dims, _Dims, _Dims, _Dims, _P]),
    "dnnl_inner_product_forward_primitive_desc_create": (_S, [_PP, _P, ctypes.c_int, _P, _P, _P, _P, _P]),
    "dnnl_matmul_primitive_desc_create": (_S, [_PP, _P, _P, _P, _P, _P, _P]),
    "dnnl_memory_get_data_handle": (_S, [_P, _PP]),
    "dnnl_memory_get_memory_desc": (_S, [_P, _PP]),
    "dnnl_reorder_primitive_desc_create": (_S, [_PP, _P, _P, _P, _P, _P]),
    "dnnl_primitive_desc_query_md": (_P, [_P, ctypes.c_int, ctypes.c_int]),
    "dnnl_primitive_desc_query": (_S, [_P, ctypes.c_int, ctypes.c_int, _P]),
    "dnnl_primitive_desc_destroy": (_S, [_P]),
    "dnnl_primitive_desc_next_impl": (_S, [_P]),
    "dnnl_primitive_create": (_S, [_PP, _P]),
    "dnnl_primitive_get_primitive_desc": (_S, [_P, _PP]),
    "dnnl_primitive_destroy": (_S, [_P]),
    "dnnl_primitive_execute": (_S, [_P, _P, ctypes.c_int, _P]),
    "dnnl_memory_create": (_S, [_PP, _P, _P, _P]),
    "dnnl_memory_set_data_handle": (_S, [_P, _P]),
    "dnnl_memory_destroy": (_S, [_P]),
    "dnnl_post_ops_create": (_S, [_PP]),
    "dnnl_post_ops_destroy": (_S, [_P]),
    "dnnl_post_ops_append_eltwise": (_S, [_P, ctypes.c_int, ctypes.c_float, ctypes.c_float]),
    "dnnl_post_ops_append_binary": (_S, [_P, ctypes.c_int, _P]),
    "dnnl_post_ops_append_sum": (_S, [_P, ctypes.c_float, ctypes.c_int32, ctypes.c_int]),
    "dnnl_primitive_attr_create": (_S, [_PP]),
    "dnnl_primitive_attr_destroy": (_S, [_P]),
    "dnnl_primitive_attr_set_post_ops": (_S, [_P, _P]),
    "dnnl_primitive_attr_set_fpmath_mode": (_S, [_P, ctypes.c_int]),
}

_STATUS = {1: "out of memory", 2: "invalid arguments", 3: "unimplemented", 5: "runtime error",
           6: "not required", 7: "invalid graph", 8: "invalid graph op", 9: "invalid shape", 10: "invalid data type",
           # kiln's own kernels inside a segment (kiln/kernels/cpu/recurrent.c kiln_recurrent_member)
           1001: "sequence_lens holds a length outside [0, seq_length] (ONNX: no sequence is longer than X's time "
                 "axis, none negative)"}


class OneDNNError(RuntimeError):
    pass


@dataclass
class _Library:
    lib: ctypes.CDLL
    version: tuple[int, int, int]
    engine: ctypes.c_void_p
    stream: ctypes.c_void_p


_LIBRARY: _Library | None = None
_LOAD_ERROR: str | None = None


def _candidates() -> list[str]:
    found = [os.environ.get("KILN_DNNL_LIBRARY", "")]
    for prefix in dict.fromkeys([sys.prefix, sys.base_prefix]):
        found += [str(Path(prefix) / "lib" / name) for name in ("libdnnl.so.3", "libdnnl.so")]
    found.append(ctypes.util.find_library("dnnl") or "")
    return [f for f in found if f and (os.path.sep not in f or os.path.exists(f))]


def load() -> _Library:
    """The loaded library with one CPU engine and stream, or OneDNNError saying why not."""
    global _LIBRARY, _LOAD_ERROR
    if _LIBRARY is not None:
        return _LIBRARY
    if _LOAD_ERROR is not None:
        raise OneDNNError(_LOAD_ERROR)
    problems = []
    for path in _candidates():
        try:
            lib = ctypes.CDLL(path)
            for name, (restype, argtypes) in _SIGNATURES.items():
                fn = getattr(lib, name)
                fn.restype, fn.argtypes = restype, argtypes
        except (OSError, AttributeError) as e:
            problems.append(f"{path}: {e}")
            continue
        v = lib.dnnl_version().contents
        version = (v.major, v.minor, v.patch)
        if v.major != 3:
            problems.append(f"{path}: oneDNN {version}, the enum values here are oneDNN 3's")
            continue
        runtimes = _openmp_runtimes()
        if len(runtimes) > 1 and not _shares_torchs_openmp(lib):
            # torch's libgomp renamed (CUDA wheels vendor it as libgomp-<hash>.so.1): libdnnl brought
            # a second OpenMP pool whose spinning threads would fight torch's for the same cores.
            problems.append(f"{path}: its OpenMP runtime is not torch's ({', '.join(runtimes)})")
            continue
        engine, stream = ctypes.c_void_p(), ctypes.c_void_p()
        try:  # a build whose CPU engine is SYCL's (the `onednn` wheel) needs an OpenCL CPU device
            _check(lib.dnnl_engine_create(ctypes.byref(engine), ENGINE_CPU, 0), "dnnl_engine_create")
            _check(lib.dnnl_stream_create(ctypes.byref(stream), engine, STREAM_DEFAULT), "dnnl_stream_create")
        except OneDNNError as e:
            problems.append(f"{path}: {e}")
            continue
        _LIBRARY = _Library(lib, version, engine, stream)
        return _LIBRARY
    _LOAD_ERROR = "libdnnl.so.3 not found or not usable (pip install onednn-cpu-gomp)" + \
        (": " + "; ".join(problems) if problems else "")
    raise OneDNNError(_LOAD_ERROR)


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def _openmp_file(lib: ctypes.CDLL) -> str | None:
    """The file of the OpenMP runtime `lib` calls: dlsym on a library's handle searches it and then its
    dependencies, the order its own calls resolve in; dladdr names the file the symbol lives in."""
    try:
        address = ctypes.cast(lib.omp_get_max_threads, ctypes.c_void_p).value
        info = _DlInfo()
        if not ctypes.CDLL(None).dladdr(ctypes.c_void_p(address), ctypes.byref(info)) or not info.dli_fname:
            return None
        return os.path.realpath(info.dli_fname.decode())
    except (AttributeError, OSError, ValueError):
        return None


def _shares_torchs_openmp(lib: ctypes.CDLL) -> bool:
    """Whether libdnnl's OpenMP calls land in the runtime torch's own do, though other runtimes are mapped too
    (a library imported beside kiln, e.g. by transformers or onnxruntime, brought its own copy)."""
    try:
        torch_cpu = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
    except OSError:
        return False
    ours, torchs = _openmp_file(lib), _openmp_file(torch_cpu)
    return ours is not None and ours == torchs


def _openmp_runtimes() -> list[str]:
    """The distinct OpenMP runtime libraries mapped into this process (Linux; [] elsewhere)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    found = {line.split()[-1] for line in maps.splitlines() if "libgomp" in line or "libiomp" in line}
    return sorted(f for f in found if f.startswith("/"))  # full paths: two files may share a name


def available() -> bool:
    return reason() is None


def reason() -> str | None:
    """Why the library is unavailable (None when it loads)."""
    try:
        load()
    except OneDNNError as e:
        return str(e)
    return None


@contextlib.contextmanager
def creating_with_threads(threads: int | None) -> Iterator[None]:
    """oneDNN primitives created inside run on at most `threads` threads (None: OpenMP's count, unchanged).

    A oneDNN kernel fixes its thread count when its descriptor is created (the count is part of oneDNN's
    primitive-cache key) and then forks that many whatever the count at execution: one created at 1 runs
    in the calling thread, no parallel region. The count is OpenMP's per-thread setting, changed through
    libdnnl's own OpenMP symbols (torch's libgomp, load() checks) and restored on the way out: other
    threads, torch's included, never see it.
    """
    openmp = _openmp_threads(load().lib)
    if threads is None or openmp is None:  # a libdnnl without OpenMP (TBB, threadpool): its own count
        yield
        return
    get_max, set_count = openmp
    before = get_max()
    set_count(max(1, min(threads, before)))
    try:
        yield
    finally:
        set_count(before)


_OPENMP_COUNT: list = []  # [(omp_get_max_threads, omp_set_num_threads) or None], looked up once


class one_openmp_thread:  # named as the function it was: `with one_openmp_thread():`
    """What runs inside runs with OpenMP's count at 1 in the calling thread, restored on the way out: a native
    segment's serial form (kiln/runtime/native.py). A oneDNN kernel created at one thread runs in the caller
    anyway, but some read the count when they execute (depthwise convolutions, eltwise, reorders: parallel(0, ...)
    forks omp_get_max_threads() threads), and kiln's own kernels clamp their plan's count to it: with the count at
    1 the serial form enters no parallel region of two threads (EfficientNet-B0: 20 -> 0 a run, counted by
    bench/openmp_regions.py), so its time does not hang on how OpenMP's idle workers wait. The count is the
    calling thread's own: torch's and other threads' are untouched. A class, not a generator's context manager: it
    is entered at every run of a serial form (~0.9 µs less a call, bench/results/call-overhead-zen4-2026-12-07.md)."""

    __slots__ = ("_before",)

    def __enter__(self) -> None:
        if not _OPENMP_COUNT:
            _OPENMP_COUNT.append(_openmp_threads(load().lib))
        openmp = _OPENMP_COUNT[0]
        if openmp is None:  # a libdnnl without OpenMP: nothing to lower
            self._before = None
            return
        get_max, set_count = openmp
        self._before = get_max()
        set_count(1)

    def __exit__(self, *_exc: Any) -> None:
        if self._before is not None:
            _OPENMP_COUNT[0][1](self._before)


def _openmp_threads(lib: ctypes.CDLL):
    """(omp_get_max_threads, omp_set_num_threads) as libdnnl's calls resolve them, or None without OpenMP."""
    try:
        get_max, set_count = lib.omp_get_max_threads, lib.omp_set_num_threads
    except AttributeError:
        return None
    get_max.restype, get_max.argtypes = ctypes.c_int, []
    set_count.restype = None  # no argtypes: a Python int is passed as the C int it takes (~0.1 µs a call less, twice in
    return get_max, set_count  # every serial run: one_openmp_thread)


def _check(status: int, what: str) -> None:
    if status != 0:
        raise OneDNNError(f"{what}: {_STATUS.get(status, f'status {status}')}")


def _dims(values: list[int] | tuple[int, ...]) -> ctypes.Array:
    return _Dims(*values)


class _Handle:
    """Owns one oneDNN object and destroys it with its destructor when collected."""

    def __init__(self, value: ctypes.c_void_p, destroy: str):
        self.value, self._destroy = value, destroy

    def __del__(self):
        if self.value and _LIBRARY is not None:
            getattr(_LIBRARY.lib, self._destroy)(self.value)
            self.value = None


def memory_desc(dims: list[int], tag: int, dtype: torch.dtype = torch.float32) -> _Handle:
    lib = load().lib
    md = ctypes.c_void_p()
    _check(lib.dnnl_memory_desc_create_with_tag(ctypes.byref(md), len(dims), _dims(dims), DATA_TYPES[dtype], tag),
           f"memory desc {dims} {dtype} tag {tag}")
    return _Handle(md, "dnnl_memory_desc_destroy")


@functools.lru_cache(maxsize=1024)
def row_major_desc(dims: tuple[int, ...]) -> _Handle:
    """The float32 row-major descriptor of `dims` (1-D or 2-D), one per size for the process: every layer of a
    transformer at a row count reads the same few (making them is ~10 µs each of ctypes here), and oneDNN copies
    a descriptor into each memory object or primitive descriptor made from it."""
    return memory_desc(list(dims), TAG_A if len(dims) == 1 else TAG_AB)


def _memory(md: ctypes.c_void_p | int, handle: int | None) -> _Handle:
    lib = load()
    mem = ctypes.c_void_p()
    _check(lib.lib.dnnl_memory_create(ctypes.byref(mem), md, lib.engine, ctypes.c_void_p(handle or 0)),
           "dnnl_memory_create")
    return _Handle(mem, "dnnl_memory_destroy")


def _primitive(pd: ctypes.c_void_p, what: str) -> tuple[_Handle, _Handle]:
    """(owned primitive descriptor, owned primitive) for a created descriptor."""
    pd_h = _Handle(pd, "dnnl_primitive_desc_destroy")
    prim = ctypes.c_void_p()
    _check(load().lib.dnnl_primitive_create(ctypes.byref(prim), pd), f"{what} primitive")
    return pd_h, _Handle(prim, "dnnl_primitive_destroy")


def packed_weight(pd: ctypes.c_void_p, user_md: _Handle, w: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(buffer, its memory desc): w (laid out as user_md) reordered once into the layout the
    primitive's kernel chose, on huge pages; the buffer must outlive the primitive's calls."""
    lib = load().lib
    w_md = lib.dnnl_primitive_desc_query_md(pd, QUERY_WEIGHTS_MD, 0)
    buffer = hugepages.empty(lib.dnnl_memory_desc_get_size(w_md) // 4 + 16)
    _reorder(user_md.value, w_md, w.detach().to(torch.float32).contiguous(), buffer)
    return buffer, w_md


def _reorder(src_md, dst_md, src: torch.Tensor, dst: torch.Tensor) -> None:
    """dst (layout dst_md) <- src (layout src_md): oneDNN's reorder, once, at primitive build."""
    lib = load()
    pd = ctypes.c_void_p()
    _check(lib.lib.dnnl_reorder_primitive_desc_create(ctypes.byref(pd), src_md, lib.engine, dst_md, lib.engine, None),
           "reorder primitive desc")
    _pd_h, prim_h = _primitive(pd, "reorder")
    src_m, dst_m = _memory(src_md, src.data_ptr()), _memory(dst_md, dst.data_ptr())
    args = (_ExecArg * 2)(_ExecArg(ARG_FROM, src_m.value), _ExecArg(ARG_TO, dst_m.value))
    _check(lib.lib.dnnl_primitive_execute(prim_h.value, lib.stream, 2, args), "reorder")
    _check(lib.lib.dnnl_stream_wait(lib.stream), "stream wait")


_SHARING = threading.local()  # this thread's shared_memories() scope: {(descriptor, address): memory}


@contextlib.contextmanager
def shared_memories() -> Iterator[None]:
    """Inside, the Bounds this thread makes share one memory object per (descriptor, fixed address): a native
    segment's layers read and write a few arena places at a few sizes (BERT-base's 48 GEMMs: 96 memory objects,
    6 distinct), and making one is ~7 µs of ctypes. A role bound at address 0 (an entry or exit, pointed at per
    run) always gets its own: moving it must not move another layer's."""
    outer = getattr(_SHARING, "memories", None)
    _SHARING.memories = {} if outer is None else outer
    try:
        yield
    finally:
        _SHARING.memories = outer


def _bound_memory(md: ctypes.c_void_p | int, address: int | None, shared: dict | None) -> _Handle:
    if shared is None or not address:
        return _memory(md, address)
    key = (md.value if isinstance(md, ctypes.c_void_p) else md, address)
    found = shared.get(key)
    if found is None:
        found = shared[key] = _memory(md, address)
    return found


def shared_memory(md: int, address: int) -> _Handle:
    """A memory object of descriptor `md` at a fixed `address`: this thread's shared_memories() one, where a scope is
    open (a segment's view binding its layers' arguments, kiln/runtime/native.py), else a new one."""
    return _bound_memory(md, address, getattr(_SHARING, "memories", None))


@dataclass(frozen=True, slots=True)
class RoleArguments:
    """A layer shape's primitive at other sizes, as a segment's view binds its layers with no Bound of their own
    (kiln/runtime/native.py _PlanRewrite): the primitive, and each role a Bound of it binds at an address as (role,
    execution argument, memory descriptor) at those sizes, in a Bound's order; handles as ints. A layer's own
    arguments (its weights, bias) follow the roles. `keep`: what the calls need alive (the primitive's owner, the
    descriptors)."""

    primitive: int
    roles: tuple[tuple[str, int, int], ...]
    keep: Any


def own_primitive(primitive: int) -> _Handle:
    """A primitive handle of its own for `primitive`'s kernel: what one binding's calls run (Bound), never another's.

    A oneDNN primitive handle is not to be run from two threads at once: libdnnl's scratchpad (the library-managed
    one, private to each handle in this build) is written by every run of the handle, so two runs at once corrupt
    each other ("the same primitive cannot be run concurrently from two different threads", dnnl_scratchpad_mode_t).
    Handles are shared (the inner products of a layer shape at a row count, onednn_primitives._SHARED_PRIMITIVES; a
    layer's per-call path and a segment's binding of it; a runtime-M matmul), and the users of one handle run under
    locks of their own: two BERT-base contexts of one engine on two threads answered up to 4.4 off (issue 14,
    bench/results/race-2026-12-05c.md). A handle made from the primitive's descriptor finds the kernel in oneDNN's
    primitive cache (no second JIT; a kernel's thread count is its descriptor's): ~2 µs and the handle's own
    scratchpad (8 KiB for BERT-base's inner products)."""
    lib = load().lib
    pd = ctypes.c_void_p()
    _check(lib.dnnl_primitive_get_primitive_desc(primitive, ctypes.byref(pd)), "primitive's descriptor")
    handle = ctypes.c_void_p()
    _check(lib.dnnl_primitive_create(ctypes.byref(handle), pd), "primitive of its own")
    return _Handle(handle, "dnnl_primitive_destroy")


class Bound:
    """One primitive's execution arguments on memory objects of its own, their addresses fixed
    when bound: a native segment (kiln/runtime/native.py) binds every layer once, at load, to
    its planned buffer and then only calls `execute`. `rebind(role, address)` moves one role
    ("src", "dst", "residual") for a call: the segment's entry and exit values.

    The primitive object's own memory objects (its per-call path) are not touched, and its calls run a primitive
    handle of their own (own_primitive): a Bound runs under its user's lock (a segment's, a per-call path's), and
    no other lock's runs share its handle's scratchpad.
    """

    def __init__(self, primitive: ctypes.c_void_p, roles: dict[str, tuple[int, ctypes.c_void_p, int]],
                 fixed: list[tuple[int, _Handle]], what: str, owner: object, serial_primitive: int | None = None,
                 threads: int | None = None, serial_fixed: list[tuple[int, _Handle]] | None = None):
        """`serial_primitive`: the same layer created on one thread (its owner keeps it): the serial form a segment
        may run instead (serial_calls), on the same arguments, or, given `serial_fixed`, on the roles' memories and
        those fixed arguments of its own (a weight packed in the layout the one-thread kernel wants: `serial_args`,
        and `serial_args_own` says so). `threads`: the count `primitive` was created at
        (creating_with_threads; None: OpenMP's): its own handle is made at the same count, as the serial one is. A
        handle made at another count than its descriptor's is not the descriptor's kernel: with small layers forced
        serial (KILN_SERIAL_SMALL_LAYERS=1) MobileNetV2's build crashed in dnnl_primitive_create."""
        self.what = what
        self._owner = owner  # the primitive object: it owns the primitive and the fixed memories
        shared = getattr(_SHARING, "memories", None)
        self._memories = {role: _bound_memory(md, address, shared) for role, (_, md, address) in roles.items()}
        # (role, execution argument, descriptor) of each role, in the args array's order: the roles come first
        self.roles = tuple((role, arg, md.value if isinstance(md, ctypes.c_void_p) else md)
                           for role, (arg, md, _) in roles.items())
        args = [(arg, self._memories[role]) for role, (arg, _, _) in roles.items()] + fixed
        self.nargs = len(args)
        self.args = (_ExecArg * len(args))(*[_ExecArg(a, m.value) for a, m in args])
        self.serial_args_own = serial_fixed is not None and serial_primitive is not None
        self.serial_args = self.args
        if self.serial_args_own:
            own = [(arg, self._memories[role]) for role, (arg, _, _) in roles.items()] + serial_fixed
            self.serial_args = (_ExecArg * len(own))(*[_ExecArg(a, m.value) for a, m in own])
        self.serial_nargs = len(self.serial_args)
        self.made_from = primitive.value if isinstance(primitive, ctypes.c_void_p) else primitive  # the shared one
        with creating_with_threads(threads):
            self._handles = [own_primitive(self.made_from)]
        if serial_primitive is not None:
            with creating_with_threads(1):  # as the serial form was made (its descriptor holds the count)
                self._handles.append(own_primitive(serial_primitive))
        self.primitive = self._handles[0].value.value
        self.serial_primitive = self._handles[1].value.value if serial_primitive is not None else None

    def rebind(self, role: str, address: int) -> None:
        _LIBRARY.lib.dnnl_memory_set_data_handle(self._memories[role].value, address)

    def calls(self) -> list[tuple[int | None, int, int, int]]:
        """What a run makes of it: [(function, object, nargs, args)], function None meaning
        dnnl_primitive_execute on this primitive (kiln/kernels/cpu/segment_loop.c)."""
        return [(None, self.primitive, self.nargs, ctypes.addressof(self.args))]

    def serial_calls(self) -> list[tuple[int | None, int, int, int]] | None:
        """calls() of the serial form on the same memory objects, or None without one."""
        if self.serial_primitive is None:
            return None
        return [(None, self.serial_primitive, self.serial_nargs, ctypes.addressof(self.serial_args))]

    def memory(self, role: str) -> int:
        """The dnnl_memory_t of a role (its address is what a run points elsewhere)."""
        return self._memories[role].value


# ---- post-ops ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Eltwise:
    """One oneDNN eltwise post-op: alg(x; alpha, beta)."""

    alg: str
    alpha: float = 0.0
    beta: float = 0.0


def eltwise_for(activation: str, alpha: float, beta: float) -> Eltwise | None | str:
    """kiln's epilogue activation (kiln/ops/fused.py) as an eltwise post-op: None for none, a reason
    string when oneDNN has no post-op with the same maths."""
    table = {
        "Relu": Eltwise("relu"), "LeakyRelu": Eltwise("relu", float(alpha)),
        "Clip": Eltwise("clip", float(alpha), float(beta)),
        "Sigmoid": Eltwise("logistic"), "Tanh": Eltwise("tanh"), "SiLU": Eltwise("swish", 1.0),
        "HardSwish": Eltwise("hardswish", 1.0 / 6.0, 0.5),
        "HardSigmoid": Eltwise("hardsigmoid", float(alpha), float(beta)),
        "Gelu": Eltwise("gelu_erf"), "GeluTanh": Eltwise("gelu_tanh"),
    }
    if activation == "":
        return None
    return table.get(activation, f"activation {activation!r} has no oneDNN eltwise post-op")


def _epilogue_attr(eltwise: Eltwise | None, residual: bool, residual_after_activation: bool, residual_in_place: bool,
                   dst_md: _Handle, final: Eltwise | None = None) -> tuple[_Handle, int]:
    """(primitive attr with the epilogue as post-ops, the residual's post-op index or -1).

    y = act(op(x) + r) or act(op(x)) + r, as kiln::FusedConv / FusedGemm order them, then final(y) (FusedConv's
    final_activation): the residual is a binary-add post-op reading r where it lies or, residual_in_place, a sum
    post-op accumulating into dst's own memory (which holds r). fpmath strict: no implicit bf16/tf32
    down-conversion."""
    lib = load()
    attr = ctypes.c_void_p()
    _check(lib.lib.dnnl_primitive_attr_create(ctypes.byref(attr)), "attr")
    attr_h = _Handle(attr, "dnnl_primitive_attr_destroy")
    _check(lib.lib.dnnl_primitive_attr_set_fpmath_mode(attr, FPMATH_STRICT), "fpmath mode")
    post = ctypes.c_void_p()
    _check(lib.lib.dnnl_post_ops_create(ctypes.byref(post)), "post ops")
    post_h = _Handle(post, "dnnl_post_ops_destroy")
    order: list[Eltwise | str] = []  # eltwise post-ops and "residual", in the order they apply
    if residual and not residual_after_activation:
        order.append("residual")
    if eltwise is not None:
        order.append(eltwise)
    if residual and residual_after_activation:
        order.append("residual")
    if final is not None:
        order.append(final)
    residual_index = -1
    for index, op in enumerate(order):
        if isinstance(op, Eltwise):
            _check(lib.lib.dnnl_post_ops_append_eltwise(post, ELTWISE[op.alg], op.alpha, op.beta),
                   f"eltwise post-op {op}")
        elif residual_in_place:  # dst += residual: the residual is already in dst's memory
            _check(lib.lib.dnnl_post_ops_append_sum(post, 1.0, 0, 0), "sum post-op")
        else:
            _check(lib.lib.dnnl_post_ops_append_binary(post, BINARY_ADD, dst_md.value), "binary add post-op")
            residual_index = index
    _check(lib.lib.dnnl_primitive_attr_set_post_ops(attr, post), "set post ops")
    del post_h  # the attr keeps its own copy
    return attr_h, residual_index


def _implementation(pd: ctypes.c_void_p) -> str:
    """The name of the kernel a primitive descriptor stands for ("brgconv:avx512_core")."""
    info = ctypes.c_char_p()
    load().lib.dnnl_primitive_desc_query(pd, QUERY_IMPL_INFO_STR, 0, ctypes.byref(info))
    return (info.value or b"?").decode()


# ---- layout changes ----------------------------------------------------------------------------

class Reorder:
    """One layout change of a fixed size, e.g. an NCHW image into the NHWC a segment runs in: oneDNN's
    jitted reorder, both threads (torch's copy runs on one)."""

    def __init__(self, size: list[int] | tuple[int, ...], src_tag: int, dst_tag: int, serial: bool = False,
                 dtype: torch.dtype = torch.float32):
        """`serial`: a second primitive created on one thread, the serial form a segment may run (Bound). `dtype`:
        the elements' (an int8 engine's segment may read a uint8 NCHW activation)."""
        lib = load()
        self.size = tuple(size)
        self.input_size = self.output_size = self.size  # as a layer's (onednn_chunks.BatchChunks runs it over images)
        src_md, dst_md = memory_desc(list(size), src_tag, dtype), memory_desc(list(size), dst_tag, dtype)

        def created() -> tuple:
            pd = ctypes.c_void_p()
            _check(lib.lib.dnnl_reorder_primitive_desc_create(ctypes.byref(pd), src_md.value, lib.engine, dst_md.value,
                                                              lib.engine, None), f"reorder {list(size)}")
            return pd, *_primitive(pd, "reorder")

        pd, self._pd, self._prim = created()
        self.implementation = _implementation(pd)
        self._serial = None
        if serial:
            with creating_with_threads(1):
                self._serial = created()[1:]
        self._mds = (src_md, dst_md)

    def bind(self, src: int, dst: int, residual: int | None = None) -> Bound:
        """Arguments at fixed addresses (Bound)."""
        roles = {"src": (ARG_FROM, self._mds[0].value, src), "dst": (ARG_TO, self._mds[1].value, dst)}
        return Bound(self._prim.value, roles, [], f"reorder {list(self.size)}", self,
                     None if self._serial is None else self._serial[1].value)
