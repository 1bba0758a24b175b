"""Transformer layers in kiln's own C (transformer.c, attention.c): LayerNorm, Add, embedding Gather, attention.

Why: inside an exported encoder every layer but the GEMMs ran through torch's dispatcher and kiln's
Python loop, ~20-50 µs a layer; at BERT's small shapes (batch 1 x 7 tokens) that was four times
onnxruntime's whole latency. As C kernels with the segment loop's signature they become members of a
native segment (kiln/runtime/native.py) and a whole encoder runs as one call.

A kernel object is one layer at fixed sizes (plan fields that every binding shares: sizes, weights);
`bind_reads(dst, {input index: address})` gives a segment its call on memory objects of its own, as
oneDNN primitives do (kiln/kernels/cpu/onednn.py Bound); `__call__` runs it on torch tensors, for the
layer run outside a segment. The operands' addresses travel as oneDNN memory objects so that the
segment loop points entries and exits per run the way it does for every other member.

Built by native_loop.build with the machine's C compiler; `load()` is None without one (the tactics
are then unavailable and the layers run their registered implementations).
"""

from __future__ import annotations

import array
import ctypes
import functools
import threading
import weakref
from pathlib import Path
from typing import Any

import torch

from kiln.kernels.cpu import gemm_native, native_loop, onednn
from kiln.ops._util import broadcast_sizes

# one compilation unit: attention.c uses transformer.c's helpers
SOURCE = "\n".join(Path(__file__).with_name(name).read_text()
                   for name in ("transformer.c", "attention.c", "elementwise.c", "tokens.c", "softmax.c"))
_FUNCTIONS = ("kiln_layer_norm", "kiln_layer_norm_quantize", "kiln_add", "kiln_gather_rows", "kiln_attention", "kiln_broadcast", "kiln_gather_nd",
              "kiln_rotary", "kiln_elementwise", "kiln_concat", "kiln_token_index", "kiln_pack_rows",
              "kiln_unpack_rows", "kiln_quantize", "kiln_embedding_concat", "kiln_padding_positions",
              "kiln_softmax")

_HANDLE_MD: Any = None  # the memory descriptor every operand's memory object is made with (only its address matters)

# elements below which LayerNorm and Add stay on one thread (~1 ms of work): a parallel region costs a few
# µs on a quiet machine, and on a loaded one its barrier waits out a descheduled thread's whole time slice
PARALLEL_ELEMENTS = 1 << 20


def set_narrow_norm(on: bool) -> None:
    """Whether LayerNorm / RMSNorm rows of at most 64 floats take the AVX-512 path that holds a row in registers
    (transformer.c ln_row_narrow; the default where the library was compiled with AVX-512), as a benchmark's other
    side or a test's."""
    lib = load()
    if lib is not None and hasattr(lib, "kiln_layer_norm_narrow"):
        ctypes.c_int.in_dll(lib, "kiln_layer_norm_narrow").value = int(on)


def set_attention_pair_work(work: int) -> int:
    """Each (query, key) pair's softmax of a quantized attention counted as `work` multiply-adds when attention.c
    decides whether its heads are worth a parallel loop (kiln_attention_pair_work; 0: the products only, as
    before), as a benchmark's other side or a test's. Returns the value it replaced."""
    return _swap_long("kiln_attention_pair_work", work)


def set_quantized_split(elements: int) -> int:
    """The elements past which a quantized transformer's 8-bit Elementwise chains and LayerNormQuantize layers share
    their rows among the threads (transformer.c kiln_quantized_split), as a benchmark's other side or a test's.
    Returns the value it replaced."""
    return _swap_long("kiln_quantized_split", elements)


def set_table_lookup(mode: int) -> int:
    """How the 8-bit Elementwise chains' lookup tables are read (elementwise.c kiln_table_lookup): 1 (the default)
    columns blocked and gathered 8 or 16 bytes at a time, 0 the kernel before (row by row; a byte at a time on
    AVX2), as a benchmark's other side or a test's. The same bytes either way. Returns the value it replaced."""
    return _swap_long("kiln_table_lookup", mode)


def parallel_loops() -> int:
    """How many loops of these kernels the calling thread has run on more than one thread (a layer that split its
    work: a test's count; other threads' loops are not in it)."""
    function = _loaded().kiln_parallel_loops
    function.restype = ctypes.c_long
    return function()


def _loaded() -> ctypes.CDLL:
    lib = load()
    if lib is None:
        raise RuntimeError(f"kiln's transformer kernels are unavailable: {reason()}")
    return lib


def _swap_long(name: str, value: int) -> int:
    """Set the library's C long `name` to `value`; returns the value it replaced."""
    variable = ctypes.c_long.in_dll(_loaded(), name)
    before, variable.value = variable.value, int(value)
    return before


def _share_the_pool(lib: ctypes.CDLL) -> None:
    """attention's and Elementwise's loops on the GEMM's pool (pool.c), else OpenMP's."""
    ctypes.c_void_p.in_dll(lib, "kiln_shared_parallel_for").value = gemm_native.parallel_for_address()


_LIBRARY = native_loop.KernelLibrary(
    "transformer", SOURCE, _FUNCTIONS, setup=_share_the_pool,
    requires=(onednn.available,
              lambda: f"the kernels' operands are oneDNN memory objects, and oneDNN is unavailable: {onednn.reason()}"))
load, available, reason = _LIBRARY.load, _LIBRARY.available, _LIBRARY.reason  # the kernels, built on first use


def _handle_md() -> Any:
    global _HANDLE_MD
    if _HANDLE_MD is None:
        _HANDLE_MD = onednn.memory_desc([1], onednn.TAG_A)
    return _HANDLE_MD


_LONG3, _LONG4 = ctypes.c_long * 3, ctypes.c_long * 4


class _LayerNormPlan(ctypes.Structure):  # ln_plan
    _fields_ = [("get_handle", ctypes.c_void_p), ("x", ctypes.c_void_p), ("residual", ctypes.c_void_p),
                ("y", ctypes.c_void_p), ("sum", ctypes.c_void_p), ("scale", ctypes.c_void_p),
                ("bias", ctypes.c_void_p), ("rows", ctypes.c_long), ("n", ctypes.c_long), ("residual_rows", ctypes.c_long),
                ("epsilon", ctypes.c_float), ("grain", ctypes.c_long), ("rms", ctypes.c_int),
                ("residual_8bit", ctypes.c_int), ("residual_q", ctypes.c_float * 2), ("out_8bit", ctypes.c_int),
                ("out_q", ctypes.c_float * 4)]


class _AddPlan(ctypes.Structure):  # add_plan
    _fields_ = [("get_handle", ctypes.c_void_p), ("a", ctypes.c_void_p), ("b", ctypes.c_void_p),
                ("y", ctypes.c_void_p), ("rows", ctypes.c_long), ("n", ctypes.c_long), ("b_rows", ctypes.c_long),
                ("grain", ctypes.c_long)]


class _GatherPlan(ctypes.Structure):  # gather_plan
    _fields_ = [("get_handle", ctypes.c_void_p), ("ids", ctypes.c_void_p), ("y", ctypes.c_void_p),
                ("table", ctypes.c_void_p), ("count", ctypes.c_long), ("vocab", ctypes.c_long), ("n", ctypes.c_long)]


_FLOAT2, _FLOAT4 = ctypes.c_float * 2, ctypes.c_float * 4


class _AttentionPlan(ctypes.Structure):  # attention_plan
    _fields_ = [("get_handle", ctypes.c_void_p), ("q", ctypes.c_void_p), ("k", ctypes.c_void_p),
                ("v", ctypes.c_void_p), ("mask", ctypes.c_void_p), ("out", ctypes.c_void_p),
                ("q_off", ctypes.c_long), ("k_off", ctypes.c_long), ("v_off", ctypes.c_long),
                ("B", ctypes.c_long), ("H", ctypes.c_long), ("Hkv", ctypes.c_long), ("S", ctypes.c_long),
                ("T", ctypes.c_long), ("D", ctypes.c_long), ("Dv", ctypes.c_long),
                ("qs", _LONG3), ("ks", _LONG3), ("vs", _LONG3), ("os", _LONG3), ("ms", _LONG4),
                ("mask_kind", ctypes.c_int), ("causal", ctypes.c_int), ("nan_to_zero", ctypes.c_int),
                ("scale", ctypes.c_float), ("cu", ctypes.c_void_p), ("rows", ctypes.c_long),
                ("quantized", ctypes.c_int), ("q_quant", _FLOAT2), ("k_quant", _FLOAT2), ("v_quant", _FLOAT2),
                ("score_quant", ctypes.c_int), ("prob_quant", ctypes.c_int), ("out_quant", ctypes.c_int),
                ("score_q", _FLOAT4), ("prob_q", _FLOAT4), ("out_q", _FLOAT4)]


class _RotaryPlan(ctypes.Structure):  # rotary_plan
    _fields_ = [("get_handle", ctypes.c_void_p), ("x", ctypes.c_void_p), ("cos", ctypes.c_void_p),
                ("sin", ctypes.c_void_p), ("y", ctypes.c_void_p), ("n0", ctypes.c_long), ("n1", ctypes.c_long),
                ("n2", ctypes.c_long), ("D", ctypes.c_long), ("rotate", ctypes.c_long), ("cs", _LONG3),
                ("ss", _LONG3)]


MAX_DIMS = 6  # MAXD in transformer.c
_LONGD = ctypes.c_long * MAX_DIMS


def _longs(array_type: type[ctypes.Array], values: Any) -> ctypes.Array:
    """A ctypes array of C longs (flat, or nested: `values` row after row) in one copy: a kernel's plan is
    rebuilt for every new input size a segment binds, and ctypes' element-wise constructor cost ~2.5 µs an
    array (a broadcast plan's 3 x 6 strides ~12 µs), from_buffer_copy of an array.array ~1."""
    return array_type.from_buffer_copy(array.array("l", values))


class _BroadcastPlan(ctypes.Structure):  # broadcast_plan
    _fields_ = [("get_handle", ctypes.c_void_p), ("in_", ctypes.c_void_p * 3), ("out", ctypes.c_void_p),
                ("dims", _LONGD), ("strides", _LONGD * 3), ("op", ctypes.c_int), ("src_type", ctypes.c_int)]


class _GatherNDPlan(ctypes.Structure):  # gather_nd_plan
    _fields_ = [("get_handle", ctypes.c_void_p), ("data", ctypes.c_void_p), ("indices", ctypes.c_void_p),
                ("out", ctypes.c_void_p), ("count", ctypes.c_long), ("m", ctypes.c_long), ("rest", ctypes.c_long),
                ("element", ctypes.c_long), ("dims", _LONGD)]


_ADDRESSES: dict[str, tuple[int, int]] = {}  # FUNCTION -> (dnnl_memory_get_data_handle, the kernel's function)


def _addresses(kernel: NativeKernel) -> tuple[int, int]:
    """The C addresses a plan of `kernel` is run with (looked up once: a new input size binds every layer)."""
    found = _ADDRESSES.get(kernel.FUNCTION)
    if found is None:
        found = _ADDRESSES[kernel.FUNCTION] = (
            ctypes.cast(onednn.load().lib.dnnl_memory_get_data_handle, ctypes.c_void_p).value,
            ctypes.cast(getattr(kernel.library, kernel.FUNCTION), ctypes.c_void_p).value)
    return found


@functools.cache
def _in_array(plan: type[ctypes.Structure]) -> type[ctypes.Array]:
    """The array type of a plan's `in_` field (looked up once per plan class: every replan of a segment member
    at a new input size builds one)."""
    return dict(plan._fields_)["in_"]


class KernelBound:
    """One layer's call on memory objects of its own (what a native segment runs); `rebind` points a
    role ("dst", or the index of the step input it reads) elsewhere for a call."""

    def __init__(self, kernel: NativeKernel, addresses: dict[Any, int], owned_by_kernel: bool = False):
        self.what = kernel.what
        # owns the weights the plan points at; the kernel's own per-call binding holds it weakly (a strong
        # reference back made every kernel a cycle, freed only by the garbage collector)
        self._kernel = weakref.proxy(kernel) if owned_by_kernel else kernel
        self._memories = {role: onednn._memory(_handle_md().value, address) for role, address in addresses.items()}
        self._roles = dict(kernel.roles)
        self._kernel_type = type(kernel)
        self._memory_fields = self._memory_fields_of(kernel)
        self._plan, self._function = self._plan_for(kernel)

    def _memory_fields_of(self, kernel: NativeKernel) -> dict[str, Any]:
        """The plan fields that point at this call's memory objects (the same at any size where the layer's
        roles name the same fields: an Add's larger operand may change sides)."""
        fields: dict[str, Any] = {}
        slots: dict[int, int] = {}  # in_[k] of a broadcast plan
        for role, names in kernel.roles.items():
            if role in self._memories:
                for name in names:
                    if name.startswith("in_"):
                        slots[int(name[3:])] = self._memories[role].value
                    else:
                        fields[name] = self._memories[role].value
        if slots:
            length = _in_array(kernel.PLAN)._length_  # 3 (broadcast), 8 (elementwise, concat)
            fields["in_"] = tuple(slots.get(k) for k in range(length))
        return fields

    def _plan_for(self, kernel: NativeKernel) -> tuple[ctypes.Structure, int]:
        """kernel's plan reading and writing this call's memory objects, and its function."""
        memory = self._memory_fields if kernel.roles == self._roles else self._memory_fields_of(kernel)
        fields = {**kernel.fields, **memory}
        if "in_" in fields:
            fields["in_"] = _in_array(kernel.PLAN)(*fields["in_"])
        get_handle, function = _addresses(kernel)
        return kernel.PLAN(get_handle=get_handle, **fields), function

    def replan(self, kernel: NativeKernel) -> native_loop.Replanned:
        """The same layer at other sizes (`kernel`, of the same class) on this call's memory objects:
        what a native segment resized over its template runs (kiln/runtime/native.py)."""
        if type(kernel) is not self._kernel_type or kernel.roles.keys() != self._roles.keys():
            raise ValueError(f"{kernel.what}: not the layer {self.what} at other sizes")
        plan, function = self._plan_for(kernel)
        return native_loop.Replanned(function, plan, self, kernel)

    @property
    def plan(self) -> ctypes.Structure:
        """The plan this call runs (a native segment's view at other sizes copies it)."""
        return self._plan

    def calls(self) -> list[tuple[int | None, int, int, int]]:
        return [(self._function, ctypes.addressof(self._plan), 0, 0)]

    def memory(self, role: Any) -> int:
        return self._memories[role].value

    def rebind(self, role: Any, address: int) -> None:
        onednn.load().lib.dnnl_memory_set_data_handle(self._memories[role].value, address)

    def run(self) -> None:
        self.run_plan(self._plan)

    def run_plan(self, plan: ctypes.Structure) -> None:
        """Run the layer's function on `plan`, a plan of its class (this call's plan with other size fields written
        into a copy: kiln/tactics/cpu/native_member.py's launch at a new size, on this call's memory objects)."""
        status = getattr(self._kernel.library, self._kernel.FUNCTION)(ctypes.addressof(plan), None, 0, None)
        if status:
            onednn._check(status, self.what)


class NativeKernel:
    """A layer at fixed sizes. Subclasses set PLAN, FUNCTION, `roles` ({role: plan fields}) and
    `fields` (the plan's other fields), and keep alive the tensors those point at. A layer of several
    outputs lists the ones past the first in `more_outputs` (size, dtype), bound as roles "dst1", "dst2"..."""

    PLAN: type[ctypes.Structure]
    FUNCTION: str
    output_size: tuple[int, ...]
    output_dtype: torch.dtype = torch.float32
    more_outputs: tuple[tuple[tuple[int, ...], torch.dtype], ...] = ()

    def __init__(self, what: str):
        library = load()
        if library is None:
            raise onednn.OneDNNError(f"kiln's transformer kernels are not built: {reason()}")
        self.library = library
        self.what = what
        self.roles: dict[Any, tuple[str, ...]] = {}
        self.fields: dict[str, Any] = {}
        self._alone: KernelBound | None = None
        self._lock = threading.Lock()

    def integer_fields(self) -> dict[str, int | tuple[int, ...]]:
        """`fields` as plain ints (None: 0; an array, nested or not, as one flat tuple) where every field of PLAN is an
        integer or an address: a native segment's view writes them into a copy of its template's plan
        (NativeStep.plan_at). ValueError for a plan with other fields (a float would not be rewritten)."""
        if not _integer_plan(self.PLAN):
            raise ValueError(f"{self.what}: the plan has fields that are not integers")
        return {name: tuple(_flat(value)) if isinstance(value, ctypes.Array) else (value or 0)
                for name, value in self.fields.items()}

    def bind_reads(self, dst: int, reads: dict[int, int]) -> KernelBound:
        """The layer's call writing dst and reading each step input (by index) at its address."""
        return KernelBound(self, {"dst": dst, **reads})

    def __call__(self, inputs: dict[int, torch.Tensor]) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Run on tensors (contiguous, of the built sizes, by step input index): new outputs (a tuple when
        the layer has several)."""
        ys = [torch.empty(size, dtype=dtype) for size, dtype in ((self.output_size, self.output_dtype),
                                                                  *self.more_outputs)]
        if all(y.numel() == 0 for y in ys):  # no rows (every token padding): nothing to write; oneDNN refuses S = 0
            return tuple(ys) if len(ys) > 1 else ys[0]
        roles = ["dst"] + [f"dst{j}" for j in range(1, len(ys))]
        with self._lock:
            if self._alone is None:
                self._alone = KernelBound(self, {"dst": 0, **{k: 0 for k in inputs}, **{role: 0 for role in roles[1:]}},
                                          owned_by_kernel=True)
            bound = self._alone
            for role, y in zip(roles, ys):
                bound.rebind(role, y.data_ptr())
            for k, v in inputs.items():
                bound.rebind(k, v.data_ptr())
            bound.run()
        return tuple(ys) if len(ys) > 1 else ys[0]


def _flat(array: ctypes.Array) -> list[int]:
    return [x for item in array for x in _flat(item)] if isinstance(array._type_, type) and \
        issubclass(array._type_, ctypes.Array) else list(array)


@functools.cache
def _integer_plan(plan: type[ctypes.Structure]) -> bool:
    """Whether every field of a plan is a C integer or address (arrays of them included)."""
    return all(native_loop.integer_field(kind) is not None for _, kind in plan._fields_)


def vector(w: torch.Tensor | None) -> torch.Tensor | None:
    """A weight as the kernels read it: float32, 1-D, contiguous (as it is, when it already is)."""
    if w is None or (w.dtype == torch.float32 and w.dim() == 1 and w.is_contiguous() and not w.requires_grad):
        return w
    return w.detach().to(torch.float32).reshape(-1).contiguous()


def _rows(size: tuple[int, ...]) -> int:
    n = 1
    for d in size[:-1]:
        n *= d
    return n


def repeats_over_rows(size: tuple[int, ...], of: tuple[int, ...]) -> bool:
    """A tensor of `size` broadcast to `of` is its rows repeated over `of`'s leading rows: its shape,
    after leading 1s, is a suffix of `of` (so flat row r of `of` reads its row r % its rows)."""
    trimmed = list(size)
    while len(trimmed) > 1 and trimmed[0] == 1:
        trimmed.pop(0)
    return len(trimmed) <= len(of) and tuple(of[len(of) - len(trimmed):]) == tuple(trimmed) and len(trimmed) >= 1


class LayerNorm(NativeKernel):
    """y = (s - mean) / sqrt(var + eps) * scale + bias over the last axis, s = x [+ residual]; with
    rms=True RMSNorm: y = s / sqrt(mean(s²) + eps) * scale (+ bias). keep_sum: s is a second output
    (a pre-LN block, where the sum is the residual stream the next block adds to)."""

    PLAN, FUNCTION = _LayerNormPlan, "kiln_layer_norm"

    def __init__(self, size: tuple[int, ...], scale: torch.Tensor | None, bias: torch.Tensor | None,
                 epsilon: float, residual_size: tuple[int, ...] | None = None, rms: bool = False,
                 keep_sum: bool = False):
        super().__init__(f"{'rms' if rms else 'layer'} norm {list(size)}")
        n, sized = int(size[-1]), self.size_fields(size, residual_size)
        self.input_size = self.output_size = tuple(size)
        self._scale, self._bias = vector(scale), vector(bias)
        for w in (self._scale, self._bias):
            if w is not None and w.numel() != n:
                raise ValueError(f"scale/bias of {w.numel()} elements for rows of {n}")
        self.roles = {0: ("x",), 3: ("residual",), "dst": ("y",), "dst1": ("sum",)}
        self.more_outputs = ((self.output_size, torch.float32),) if keep_sum else ()
        self.fields = dict(scale=self._scale.data_ptr() if self._scale is not None else None,
                           bias=self._bias.data_ptr() if self._bias is not None else None,
                           n=n, epsilon=float(epsilon), grain=max(1, PARALLEL_ELEMENTS // max(n, 1)), rms=int(rms),
                           **sized)

    @staticmethod
    def size_fields(size: tuple[int, ...], residual_size: tuple[int, ...] | None) -> dict[str, int]:
        """The plan fields that follow the input size (rows, residual rows), the residual checked against it."""
        if residual_size is not None and not repeats_over_rows(residual_size, size):
            raise ValueError(f"residual {list(residual_size)} does not repeat over the rows of {list(size)}")
        rows = _rows(size)
        return dict(rows=rows, residual_rows=_rows(residual_size) if residual_size is not None else rows)

    def check_width(self, size: tuple[int, ...]) -> None:
        """ValueError unless `size`'s rows are as wide as the norm's weights."""
        if not size or int(size[-1]) != self.fields["n"]:
            raise ValueError(f"{self.what}: rows of {size[-1] if size else 0}, built for {self.fields['n']}")

    def at_size(self, size: tuple[int, ...], residual_size: tuple[int, ...] | None = None) -> LayerNorm:
        """The same norm (weights, epsilon, residual or not) at another input size: a copy with its size fields
        anew, without the weights' checks and conversion (a segment binds every norm at each new input size)."""
        size = tuple(size)
        self.check_width(size)
        sized = self.size_fields(size, residual_size)
        other = object.__new__(type(self))
        other.__dict__.update(self.__dict__)
        other.what = f"{self.what.split(' [', 1)[0]} {list(size)}"
        other.input_size = other.output_size = size
        other.more_outputs = ((size, torch.float32),) if self.more_outputs else ()
        other.fields = {**self.fields, **sized}
        other._alone, other._lock = None, threading.Lock()
        return other


_EIGHT_BIT = {torch.uint8: 1, torch.int8: 2}


class LayerNormQuantize(LayerNorm):
    """kiln::LayerNormQuantize on the CPU: LayerNorm's y quantized per tensor as it is stored (y_q = saturate(
    round_half_even(y / scale) + zero), 8 bits), and, with `residual_quant` (scale, zero, dtype), an 8-bit residual
    dequantized, (r - zero)·scale, as it is read (transformer.c kiln_layer_norm_quantize): the unfused
    DequantizeLinear -> LayerNorm -> QuantizeLinear steps bit for bit, without their passes over memory."""

    FUNCTION = "kiln_layer_norm_quantize"

    def __init__(self, size: tuple[int, ...], scale: torch.Tensor | None, bias: torch.Tensor | None, epsilon: float,
                 residual_size: tuple[int, ...] | None, out_quant: tuple[float, int, torch.dtype] | None,
                 residual_quant: tuple[float, int, torch.dtype] | None = None):
        """out_quant (scale, zero, dtype) of y, or None: y float32 (the 8-bit residual's read alone, as a test's)."""
        super().__init__(size, scale, bias, epsilon, residual_size)
        y_scale, y_zero, y_dtype = out_quant or (1.0, 0, torch.float32)
        if (out_quant is not None and y_dtype not in _EIGHT_BIT) or \
                (residual_quant is not None and residual_quant[2] not in _EIGHT_BIT):
            raise ValueError(f"{self.what}: uint8/int8 only (y {y_dtype}, residual "
                             f"{residual_quant[2] if residual_quant else torch.float32})")
        if residual_quant is not None and residual_size is None:
            raise ValueError(f"{self.what}: a residual quantization without a residual")
        info = torch.iinfo(y_dtype) if out_quant is not None else torch.finfo(torch.float32)
        self.what = f"layer norm quantize {list(size)}"
        self.output_dtype = y_dtype
        self.roles = {0: ("x",), 3: ("residual",), "dst": ("y",)}
        self.fields.update(out_8bit=_EIGHT_BIT.get(y_dtype, 0),
                           out_q=(ctypes.c_float * 4)(y_scale, y_zero, info.min, info.max),
                           residual_8bit=_EIGHT_BIT[residual_quant[2]] if residual_quant else 0,
                           residual_q=(ctypes.c_float * 2)(*(residual_quant[:2] if residual_quant else (1.0, 0.0))))


class Add(NativeKernel):
    """y = a + b, the smaller operand's rows repeating over the larger's (reads step inputs 0 and 1)."""

    PLAN, FUNCTION = _AddPlan, "kiln_add"

    def __init__(self, a_size: tuple[int, ...], b_size: tuple[int, ...]):
        super().__init__(f"add {list(a_size)} + {list(b_size)}")
        swapped, self.output_size, self.fields = self.size_fields(a_size, b_size)
        self.roles = {**({1: ("a",), 0: ("b",)} if swapped else {0: ("a",), 1: ("b",)}), "dst": ("y",)}

    @staticmethod
    def size_fields(a_size: tuple[int, ...], b_size: tuple[int, ...]) -> tuple[bool, tuple[int, ...], dict[str, int]]:
        """(whether step input 1 is the larger operand, the plan's "a"; the output size; the plan fields), without a
        kernel: a segment's view rewrites a template's plan with them (every field follows the sizes)."""
        swapped = _numel(a_size) < _numel(b_size)
        big, small = (b_size, a_size) if swapped else (a_size, b_size)
        if not repeats_over_rows(small, big):
            raise ValueError(f"{list(small)} does not repeat over the rows of {list(big)}")
        n = int(big[-1])
        return swapped, tuple(big), dict(rows=_rows(big), n=n, b_rows=_rows(small),
                                         grain=max(1, PARALLEL_ELEMENTS // max(n, 1)))


def _numel(size: tuple[int, ...]) -> int:
    return _rows(size) * (size[-1] if size else 1)


class GatherRows(NativeKernel):
    """y = table[ids] for a constant table [V, N] and int64 ids of any shape (step input 1)."""

    PLAN, FUNCTION = _GatherPlan, "kiln_gather_rows"

    def __init__(self, table: torch.Tensor, ids_size: tuple[int, ...]):
        super().__init__(f"gather rows of {list(table.shape)} by {list(ids_size)}")
        self._table = table.detach().to(torch.float32).contiguous()  # no copy of a table already so (the tactic's)
        vocab, n = self._table.shape
        self.output_size, sized = self.size_fields(ids_size, int(n))
        self.roles = {1: ("ids",), "dst": ("y",)}
        self.fields = dict(table=self._table.data_ptr(), vocab=int(vocab), n=int(n), **sized)

    @staticmethod
    def size_fields(ids_size: tuple[int, ...], n: int) -> tuple[tuple[int, ...], dict[str, int]]:
        """The output size and the plan fields that follow the ids' size, without a kernel (a segment's view)."""
        return (*ids_size, n), {"count": _numel(tuple(ids_size))}


class Attention(NativeKernel):
    """softmax(q kᵀ scale + mask) v for every (batch, head). q, k, v (and the output) are given as
    (step input, element offset, strides of batch, head, position) over [B, H, S, D] views with a
    contiguous last axis; q, k and v may be one input (a packed qkv). The mask: None, or (kind
    "add" | "bool" | "keys" (int64, nonzero: a real key), strides of batch, head, query, key; 0 where it
    broadcasts). `varlen`: (step input of cu_seqlens, the packed rows): sequence b is rows cu_seqlens[b] ..
    cu_seqlens[b + 1] of q/k/v/out (kiln/ops/tokens.py PackedAttention), S = T its longest."""

    PLAN, FUNCTION = _AttentionPlan, "kiln_attention"

    def __init__(self, dims: dict[str, int], q: tuple[int, int, tuple[int, ...]], k: tuple[int, int, tuple[int, ...]],
                 v: tuple[int, int, tuple[int, ...]], out_strides: tuple[int, ...], output_size: tuple[int, ...],
                 mask: tuple[str, tuple[int, ...]] | None, scale: float, causal: bool, nan_to_zero: bool,
                 mask_input: int = 3, varlen: tuple[int, int] | None = None, quant: dict[str, list[float]] | None = None):
        super().__init__(f"attention B={dims['B']} H={dims['H']} S={dims['S']} T={dims['T']} D={dims['D']}")
        self.output_size = tuple(output_size)
        roles: dict[Any, list[str]] = {"dst": ["out"]}
        for name, (index, _, _) in (("q", q), ("k", k), ("v", v)):
            roles.setdefault(index, []).append(name)
        if mask is not None:
            roles[mask_input] = ["mask"]
        if varlen is not None:
            roles[varlen[0]] = ["cu"]
        self.roles = {role: tuple(names) for role, names in roles.items()}
        sized = self.size_fields(dims, q, k, v, out_strides, mask, varlen)
        arrays = {"qs": _LONG3, "ks": _LONG3, "vs": _LONG3, "os": _LONG3, "ms": _LONG4}
        self.fields = dict({name: _longs(arrays[name], value) if name in arrays else value
                            for name, value in sized.items()},
                           mask_kind={None: 0, "add": 1, "bool": 2, "keys": 3}[mask[0] if mask is not None else None],
                           causal=int(bool(causal)), nan_to_zero=int(bool(nan_to_zero)), scale=float(scale),
                           **_quant_fields(quant or {}))
        if quant and "out_quant" in quant:
            self.output_dtype = torch.uint8

    @staticmethod
    def size_fields(dims: dict[str, int], q: tuple, k: tuple, v: tuple, out_strides: tuple[int, ...],
                    mask: tuple[str, tuple[int, ...]] | None, varlen: tuple[int, int] | None = None, **_others
                    ) -> dict[str, int | tuple[int, ...]]:
        """The plan fields that follow the input sizes (arrays as tuples; the others follow the layer's attributes
        alone), from the constructor's arguments: attention_plan's, with which a segment's view rewrites a template's
        plan without a kernel."""
        return dict(q_off=q[1], k_off=k[1], v_off=v[1],
                    **{d: dims[d] for d in ("B", "H", "Hkv", "S", "T", "D", "Dv")},
                    qs=tuple(q[2]), ks=tuple(k[2]), vs=tuple(v[2]), os=tuple(out_strides),
                    ms=tuple(mask[1]) if mask is not None else (0, 0, 0, 0),
                    rows=int(varlen[1]) if varlen is not None else 0)


def _quant_fields(quant: dict[str, list[float]]) -> dict[str, Any]:
    """attention_plan's quantization fields from kiln::Attention's attributes (kiln/ops/fused.py attention):
    q/k/v uint8 (all three or none), each of the scores, probabilities and output quantized or not."""
    fields: dict[str, Any] = {"quantized": int("q_quant" in quant)}
    for name in ("q_quant", "k_quant", "v_quant"):
        if name in quant:
            fields[name] = _FLOAT2(*quant[name][:2])
    for name, field in (("score_quant", "score_q"), ("prob_quant", "prob_q"), ("out_quant", "out_q")):
        fields[name] = int(name in quant)
        if name in quant:
            fields[field] = _FLOAT4(*quant[name][:4])
    return fields


# the dtypes broadcast_plan's casts read (src_type)
SOURCE_TYPES = {torch.int64: 0, torch.int32: 1, torch.float32: 2, torch.bool: 3}
_OPS = {"cast_bool": 0, "cast_float": 1, "and": 2, "or": 3, "where": 4}


def broadcast_strides(size: tuple[int, ...], to: tuple[int, ...]) -> tuple[int, ...]:
    """A row-major tensor of `size` broadcast to `to` (MAX_DIMS long, 1s in front): its element strides,
    0 where it repeats."""
    padded = (1,) * (len(to) - len(size)) + tuple(size)
    strides, step = [], 1
    for d, want in zip(reversed(padded), reversed(to)):
        strides.append(0 if d == 1 and want != 1 else step)
        step *= d
    return tuple(reversed(strides))


_BROADCAST_ROLES = {n: {k: (f"in_{k}",) for k in range(n)} | {"dst": ("out",)} for n in (1, 2, 3)}


class Broadcast(NativeKernel):
    """An elementwise op over broadcast operands, the output row-major: "cast_bool" (x != 0),
    "cast_float", "and", "or" (bool), "where" (bool condition, float32 branches). Reads step inputs
    0..arity-1 in their dtypes (`source`: the cast's input dtype)."""

    PLAN, FUNCTION = _BroadcastPlan, "kiln_broadcast"

    def __init__(self, op: str, sizes: list[tuple[int, ...]], source: torch.dtype = torch.bool):
        super().__init__(f"{op} of {[list(s) for s in sizes]}")
        self.output_size, sized = self.size_fields(sizes)
        self.output_dtype = torch.float32 if op in ("cast_float", "where") else torch.bool
        self.roles = _BROADCAST_ROLES[len(sizes)]
        self.fields = dict(dims=_longs(_LONGD, sized["dims"]), strides=_longs(_LONGD * 3, sized["strides"]),
                           op=_OPS[op], src_type=SOURCE_TYPES[source])

    @staticmethod
    def size_fields(sizes: list[tuple[int, ...]]) -> tuple[tuple[int, ...], dict[str, tuple[int, ...]]]:
        """The output size, and the plan fields that follow the operands' sizes (dims, every operand's strides:
        flat tuples), without a kernel: a segment's view rewrites a template's plan with them."""
        out = broadcast_sizes(*[tuple(s) for s in sizes])
        if len(out) > MAX_DIMS:
            raise ValueError(f"{len(out)} dims: at most {MAX_DIMS}")
        dims = (1,) * (MAX_DIMS - len(out)) + out
        strides = [d for s in sizes for d in broadcast_strides(s, dims)] + [0] * (MAX_DIMS * (3 - len(sizes)))
        return out, {"dims": dims, "strides": tuple(strides)}


class GatherND(NativeKernel):
    """ONNX GatherND with batch_dims 0: data (step input 0, any 1-, 4- or 8-byte dtype) by int64
    indices [..., m] (step input 1)."""

    PLAN, FUNCTION = _GatherNDPlan, "kiln_gather_nd"

    def __init__(self, data_size: tuple[int, ...], data_dtype: torch.dtype, indices_size: tuple[int, ...]):
        super().__init__(f"gather_nd of {list(data_size)} by {list(indices_size)}")
        self.output_size, sized = self.size_fields(data_size, indices_size)
        self.output_dtype = data_dtype
        self.roles = {0: ("data",), 1: ("indices",), "dst": ("out",)}
        self.fields = dict(sized, element=data_dtype.itemsize, dims=_longs(_LONGD, sized["dims"]))

    @staticmethod
    def size_fields(data_size: tuple[int, ...], indices_size: tuple[int, ...]
                    ) -> tuple[tuple[int, ...], dict[str, int | tuple[int, ...]]]:
        """The output size and the plan fields that follow the sizes (dims as a tuple), without a kernel (a
        segment's view)."""
        m = int(indices_size[-1])
        if not 1 <= m <= min(len(data_size), MAX_DIMS):
            raise ValueError(f"index tuples of {m} into a {len(data_size)}-D tensor")
        rest = tuple(data_size[m:])
        count = _numel(tuple(indices_size[:-1]) + (1,)) if len(indices_size) > 1 else 1
        return (*indices_size[:-1], *rest), dict(count=count, m=m, rest=_numel(rest + (1,)) if rest else 1,
                                                 dims=tuple(data_size[:m]) + (1,) * (MAX_DIMS - m))


class Rotary(NativeKernel):
    """kiln::Rotary, rotate-half form: x (step input 0, contiguous) viewed as [n0, n1, n2, D] (`view`),
    y = x·cos + rotate_half(x)·sin over the first `rotate` of the n2 heads, the others copied; cos and sin
    (step inputs 1 and 2) of sizes that broadcast to the view, their last axis D."""

    PLAN, FUNCTION = _RotaryPlan, "kiln_rotary"

    def __init__(self, view: tuple[int, int, int, int], output_size: tuple[int, ...], rotate: int,
                 cos_size: tuple[int, ...], sin_size: tuple[int, ...]):
        super().__init__(f"rotary {list(view)}, {rotate} heads rotated")
        n0, n1, n2, depth = (int(d) for d in view)
        if depth % 2 or not 0 <= rotate <= n2 or _numel(tuple(output_size)) != n0 * n1 * n2 * depth:
            raise ValueError(f"rotary over {list(view)} (rotating {rotate} heads) into {list(output_size)}")
        strides = []
        for size in (cos_size, sin_size):
            if len(size) > 4 or not size or size[-1] != depth:
                raise ValueError(f"a cos/sin table of {list(size)} for a rotary of depth {depth}")
            strides.append(torch.empty(size, device="meta").expand(view).stride()[:3])  # 0 where it repeats
        self.output_size = tuple(output_size)
        self.roles = {0: ("x",), 1: ("cos",), 2: ("sin",), "dst": ("y",)}
        self.fields = dict(n0=n0, n1=n1, n2=n2, D=depth, rotate=int(rotate), cs=_LONG3(*strides[0]),
                           ss=_LONG3(*strides[1]))
