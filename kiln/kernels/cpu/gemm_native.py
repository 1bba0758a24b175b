"""kiln's own packed FP32 GEMM for linear layers (gemm.c): y = epilogue(x @ Wᵀ), W [N, K] constant.

W is packed once, when the engine loads, into the panels the microkernel reads (6x16 on AVX2+FMA,
8x48 on AVX-512, picked from cpuid at run time); any row count M runs on the same packed weight,
so one layer serves every input size a profile allows. kiln::FusedGemm's epilogue (bias, activation,
residual before or after it) is applied to each tile while it is in L1.

Why a GEMM of kiln's own: on an AVX2 EPYC, BERT-base's FFN GEMM (128 x 768 x 3072) ran at 64% of the
cores' FMA peak in MKL and oneDNN where onnxruntime's MLAS reaches 90%; the autotuner now times this
kernel against both, per layer (kiln/tactics/cpu/gemm_packed.py).

Built by native_loop.build() with the machine's C compiler (cached per source, CPU and flags);
`load()` returns None without one (or with KILN_NATIVE_GEMM=0), and says why in `reason()`.
"""

from __future__ import annotations

import ctypes
import math
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.kernels.cpu import hugepages, native_loop, onednn

SOURCE = "\n".join(Path(__file__).with_name(name).read_text() for name in ("pool.c", "gemm.c"))

# kiln::FusedGemm's activations (kiln/ops/fused.py) -> gemm.c's codes
ACTIVATIONS = {"": 0, "Relu": 1, "Clip": 2, "LeakyRelu": 3, "Gelu": 4, "GeluTanh": 5, "Tanh": 6, "Sigmoid": 7,
               "SiLU": 8, "HardSigmoid": 9, "HardSwish": 10, "SwiGLU": 11}

_LOADED: dict[bool, ctypes.CDLL] = {}
_REASON: dict[bool, str] = {}
_POOLED: list[ctypes.CDLL] = []  # every library open_library loaded: each has a pool.c of its own
_LOAD_LOCK = threading.Lock()


_NO_SCRATCH = torch.empty(0)  # a plan's scratch when its path needs none


class _Plan(ctypes.Structure):  # kiln_gemm_plan in gemm.c
    _fields_ = [("get_handle", ctypes.c_void_p), ("src", ctypes.c_void_p), ("dst", ctypes.c_void_p),
                ("residual", ctypes.c_void_p), ("packed_w", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("scratch", ctypes.c_void_p), ("M", ctypes.c_long), ("K", ctypes.c_long), ("N", ctypes.c_long),
                ("kernel", ctypes.c_int), ("threads", ctypes.c_int), ("activation", ctypes.c_int),
                ("alpha", ctypes.c_float), ("beta", ctypes.c_float), ("residual_after", ctypes.c_int),
                ("small_m", ctypes.c_long), ("pack_m", ctypes.c_long), ("out_n", ctypes.c_long),
                ("c_scratch", ctypes.c_void_p)]


@dataclass(frozen=True)
class Kernel:
    index: int
    name: str
    nr: int  # columns per packed panel
    mr: int  # rows of the register tile
    supported: bool  # this CPU runs it
    test_only: bool  # another ISA's tile shape on this one, in the tests' build only


def load(test_kernels: bool = False) -> ctypes.CDLL | None:
    """The compiled GEMM (built on first use, then reused from kiln's cache), or None.
    `test_kernels`: the build that adds the test-only kernels (a minute more to compile)."""
    with _LOAD_LOCK:
        if test_kernels in _LOADED or test_kernels in _REASON:
            return _LOADED.get(test_kernels)
        if os.environ.get("KILN_NATIVE_GEMM") == "0":  # kiln without its GEMM (the autotuner's other candidates)
            _REASON[test_kernels] = "KILN_NATIVE_GEMM=0"
            return None
        lib = open_library("gemm", SOURCE, test_kernels)
        if isinstance(lib, str):
            _REASON[test_kernels] = lib
            return None
        lib.kiln_gemm.restype = ctypes.c_int
        lib.kiln_gemm.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
        lib.kiln_gemm_kernel_name.restype = ctypes.c_char_p
        lib.kiln_gemm_scratch_floats.restype = ctypes.c_long
        lib.kiln_gemm_scratch_floats.argtypes = [ctypes.c_int, ctypes.c_long, ctypes.c_long]
        _LOADED[test_kernels] = lib
        return lib


def parallel_for_address() -> int | None:
    """The address of pool.c's kiln_pool_parallel_for in the GEMM library (None without it): kiln's other C
    kernels run their parallel loops through it, on the same workers as the GEMMs."""
    lib = load()
    return None if lib is None else ctypes.cast(lib.kiln_pool_parallel_for, ctypes.c_void_p).value


BUSY = 0.5  # load average per CPU from which the machine counts as busy (kiln/openmp.py's rule for the spin)


def kiln_pool_wanted(environ: dict[str, str] | None = None, load: float | None = None,
                     cpus: int | None = None) -> bool:
    """Whether kiln's C loops (GEMM, attention, Elementwise) run on kiln's own pool (pool.c) or on OpenMP's:
    KILN_POOL=1 / 0 decides; else the pool where the machine is busy as the kernels load (1-min load average
    at least half the CPUs; the same rule kiln/openmp.py applies to OpenMP's spin, which cannot import this
    module: it runs before torch loads). The pool does not wait for a worker that claimed no work, where
    OpenMP's barrier waits out a descheduled thread's time slice (a 256x845x1024 GEMM at load ~6 on 2 cores:
    16.0 -> 6.3 ms median); with nothing else running single GEMMs ran level, but end to end it cost 4-10%
    (BERT-base, T5-small's encoder: bench/results/zoo-cpu-2026-12-02.md)."""
    environ = os.environ if environ is None else environ
    if "KILN_POOL" in environ:
        return environ["KILN_POOL"] != "0"
    if load is None:
        try:
            load = os.getloadavg()[0]
        except OSError:
            return False
    return load >= BUSY * max(cpus if cpus is not None else (os.cpu_count() or 1), 1)


def open_library(stem: str, source: str, test_kernels: bool) -> ctypes.CDLL | str:
    """A library compiled with gemm.c's microkernels (this file's, or recurrent.py's, which includes them): built
    into kiln's cache as `stem` (`stem`-test with the test-only tiles), loaded, gemm.c's packing functions
    declared; or why not."""
    source = ("#define KILN_GEMM_TEST_KERNELS 1\n" if test_kernels else "") + source
    built = native_loop.build(f"{stem}-test" if test_kernels else stem, source)
    if isinstance(built, str):
        return built
    try:
        lib = ctypes.CDLL(str(built))
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    # pool.c's loops where the machine is busy, else OpenMP's (kiln_pool_wanted; KILN_POOL=1/0 decides)
    ctypes.c_int.in_dll(lib, "kiln_pool_enabled").value = int(kiln_pool_wanted())
    lib.kiln_pool_spin_window.restype = ctypes.c_long
    lib.kiln_pool_spin_window.argtypes = [ctypes.POINTER(ctypes.c_long), ctypes.c_int, ctypes.c_long]
    lib.kiln_pool_parks.restype = ctypes.c_long
    lib.kiln_pool_stats.restype = None
    lib.kiln_pool_stats.argtypes = [ctypes.POINTER(ctypes.c_long)]
    _POOLED.append(lib)
    lib.kiln_gemm_packed_floats.restype = ctypes.c_long
    lib.kiln_gemm_packed_floats.argtypes = [ctypes.c_int, ctypes.c_long, ctypes.c_long]
    lib.kiln_gemm_pack_w.restype = None
    lib.kiln_gemm_pack_w.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p]
    return lib


# How long past a loop pool.c's workers may poll while an engine's calls come back to back, where its threads fit the
# free cores (kiln/kernels/cpu/omp_governor.py decides; pool.c's kiln_pool_follow_ns says why and what it costs)
POOL_FOLLOW_NS = 1_000_000


def set_pool_follow(ns: int) -> None:
    """How long past a loop pool.c's workers may poll while loops keep coming back to back (kiln_pool_follow_ns), in
    every library loaded with a pool: POOL_FOLLOW_NS, or 0 (a 30 us poll after every loop, the default)."""
    for lib in _POOLED:
        ctypes.c_long.in_dll(lib, "kiln_pool_follow_ns").value = ns


def reason(test_kernels: bool = False) -> str | None:
    """Why load() returned None (None when it did not)."""
    return _REASON.get(test_kernels)


def available() -> bool:
    return load() is not None


def kernels(test_kernels: bool = False) -> list[Kernel]:
    """Every microkernel of the build, in kiln's order of preference."""
    lib = load(test_kernels)
    if lib is None:
        return []
    return [Kernel(i, lib.kiln_gemm_kernel_name(i).decode(), lib.kiln_gemm_kernel_nr(i), lib.kiln_gemm_kernel_mr(i),
                   bool(lib.kiln_gemm_kernel_supported(i)), bool(lib.kiln_gemm_kernel_test_only(i)))
            for i in range(lib.kiln_gemm_kernel_count())]


def best_kernel() -> Kernel:
    """The first kernel this CPU runs (AVX-512 14x32, else AVX2, else the portable one): the recurrent kernels'
    tile (recurrent.py), whose gate blocks pad the hidden size to a multiple of its NR."""
    return next(k for k in kernels() if k.supported and not k.test_only)


# The AVX-512 tile of linear layers: 8x48 (24 zmm accumulators; 3 loads of W and 8 broadcasts of x per 24 FMAs
# where the 14x32 tile issues 2 + 14 per 28). T5-small's and BERT-base's GEMMs at 1-512 rows, one core, CPU
# time, interleaved: level with the 14x32 at 1-4 and 32 rows, 1-15% faster at 64-512 rows, 12-28% at 8-16
# (bench/results/gemm-2026-12-05d.md).
LINEAR_TILE = "avx512 8x48"


def linear_kernel() -> Kernel:
    """The kernel PackedLinear runs by default: LINEAR_TILE where this CPU runs it, else best_kernel()."""
    runs = [k for k in kernels() if k.supported and not k.test_only]
    return next((k for k in runs if k.name == LINEAR_TILE), runs[0])


IN_PLACE_BYTES = 4 << 20  # x up to this size is read in place over the whole K (kiln_gemm_plan.small_m)
# Past it, the K-blocked loop reads x in place too: packing A (GotoBLAS's way, kiln_gemm_plan.pack_m) costs
# two barriers per M block, and on a shared 2-core VM (load ~9) the packed loop ran at half the speed of
# the in-place ones, which ran level with oneDNN and MLAS (BERT-base shapes, M = 128 and 512, interleaved
# medians); alone on a core (CPU time) all three paths ran within the noise of each other.
NEVER = 1 << 62
# Up to this many multiply-adds (~0.1 ms on one core) a layer runs on one thread, as kiln's attention does
# (attention.c): the end of a parallel loop waits out any thread the OS has descheduled, which on a loaded
# machine costs more than small work gains. bert_tiny's layers at a few tokens are ~0.1-0.4 M.
PARALLEL_MACS = 4 << 20


# The whole-K path up to this many row blocks of the tile (AVX2 6x16: 48 rows); past it, the K-blocked loop.
WHOLE_K_ROW_BLOCKS = 8
# The AVX-512 8x48 tile's: 64 row blocks (512 rows). Its K-blocked loop revisits C per K block of 128 (6 times at
# K = 768) and on BERT-base's QKV (128 x 768 x 2304) ran at 86-89% of a Zen 4 core's FMA peak; whole K, each tile
# keeps its sums in registers over the K x 48 W panel (147 KB at K = 768: L2) and writes C once: 92-96% at 128-512
# rows of K = 768 and 3072, 4-8% faster at every one of BERT-base's shapes (one core, thread CPU time, interleaved;
# bench/results/packed-2026-12-06.md, section 7). Where x passes IN_PLACE_BYTES the K-blocked loop still takes over.
WHOLE_K_ROW_BLOCKS_OF = {"avx512 8x48": 64}


def whole_k_row_blocks(kernel: Kernel) -> int:
    """Row blocks of `kernel`'s tile up to which x is read in place over the whole K (at most; small_rows)."""
    return WHOLE_K_ROW_BLOCKS_OF.get(kernel.name, WHOLE_K_ROW_BLOCKS)


def small_rows(kernel: Kernel, k: int) -> int:
    """Up to this many rows x is read in place over the whole K, each W panel streamed once and the rows
    re-read from L2/L3 per panel: no packing, no K blocks, one fork/join (nothing for a thread that other
    work descheduled to hold up). Measured on an AVX2 EPYC at BERT-base's shapes (M = 8..512, K = 768 or
    3072, one thread, CPU time): as fast as the K-blocked paths, packed or not, within the noise (~85 GFLOP/s
    of a ~98 GFLOP/s core). Past a few MB of x, re-reading it per panel would leave the caches.

    The 6x16 and 14x32 tiles stop at WHOLE_K_ROW_BLOCKS row blocks: since the K-blocked loop prefetches the next W
    micro-panel and adds C after the K loop (gemm.c), it keeps its kc x NR micro-panel of W in L1 down the
    rows, where the whole-K panel (K x NR floats, 32-384 KB) comes from L2 for every tile. AVX2 6x16 (Xeon
    capped to AVX2, bench/results/avx2-gemm-2026-12-04d.md): crossover between 32 rows (whole K 81-85% of
    the peak, K-blocked 78-81%) and 64 (81-87% against 89%). AVX-512 14x32 (bench/results/gemm-2026-12-05d.md):
    at 128 rows the K-blocked loop ran BERT-base's FFN GEMMs 10-18% faster and T5-small's level or faster;
    at 56-96 rows the whole-K path was level or up to 10% faster. The 8x48 tile goes further (64 row blocks:
    WHOLE_K_ROW_BLOCKS_OF says why)."""
    rows = max(2 * kernel.mr, IN_PLACE_BYTES // max(4 * k, 1))
    return min(rows, whole_k_row_blocks(kernel) * kernel.mr)


def swiglu_panels(w: torch.Tensor, b: torch.Tensor | None, nr: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """W = [W_gate; W_up] [2H, K] (and b [2H]) with rows reordered for gemm.c's SwiGLU epilogue: panel q
    of NR rows holds gate rows [q·NR/2, (q+1)·NR/2) then the same up rows, zero rows past H; so one C
    tile holds both operands of NR/2 output columns and gates them in L1 (y = silu(gate) · up)."""
    if w.shape[0] % 2:
        raise ValueError(f"SwiGLU needs an even number of weight rows (gate and up), given {list(w.shape)}")
    h, half = w.shape[0] // 2, nr // 2
    panels = -(-h // half)
    j = torch.arange(panels * half).reshape(panels, 1, half)  # output column of each (panel, half, lane)
    rows = torch.cat([j, j + h], dim=1)  # [panels, 2, half]: gate row j, up row H + j
    rows = torch.where(j.expand_as(rows) < h, rows, torch.full_like(rows, 2 * h)).reshape(-1)  # 2H: a zero row
    w = torch.cat([w, w.new_zeros(1, w.shape[1])])[rows]  # [panels·NR, K]
    b = None if b is None else torch.cat([b.reshape(-1), b.new_zeros(1)])[rows]
    return w, b


def plan_threads(rows: int, gemm_n: int, k: int) -> int:
    """A plan's `threads`: 1 (the calling thread alone) for a product too small to share out, else 0 (all)."""
    return 1 if rows * gemm_n * k <= PARALLEL_MACS else 0


def row_fields(rows: int, k: int, gemm_n: int, small_m: int, pack_m: int, swiglu: bool,
               c_rows: int = 0) -> dict[str, int]:
    """PackedLinear.row_fields of a layer with these constants, without packing its weight: a size rule of a layer
    that runs some row counts on kiln's GEMM (kiln/tactics/cpu/onednn_gemm.py OtherRows) answers before that layer
    is packed. Arithmetic and comparisons of `rows` only (a traced rule follows it). `c_rows`: the rows of SwiGLU's
    C that the template plan's scratch holds (PackedLinear.c_rows): up to them its c_scratch is kept, not written."""
    if rows > max(small_m, pack_m) or (swiglu and rows > max(small_m, c_rows)):
        raise ValueError(f"kiln GEMM at {rows} rows needs scratch: plan() binds it")
    if c_rows:
        return {"M": rows, "threads": plan_threads(rows, gemm_n, k)}
    return {"M": rows, "threads": plan_threads(rows, gemm_n, k), "c_scratch": 0}


class PackedLinear:
    """One linear layer: W packed once; any row count; bind() gives a native segment its call.

    activation "SwiGLU" (kiln::FusedGemm's: W = [W_gate; W_up] [2H, K]) gives y = silu(gate) · up [..., H]:
    W's rows are interleaved per panel (swiglu_panels) and each C tile is gated while in L1."""

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None, activation: str = "", alpha: float = 0.0,
                 beta: float = 0.0, residual: bool = False, residual_after_activation: bool = True,
                 kernel: Kernel | None = None, small_m: int | None = None, pack_m: int | None = None):
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r} is not one kiln's GEMM applies ({sorted(ACTIVATIONS)})")
        test_kernels = kernel is not None and kernel.test_only
        lib = load(test_kernels)
        if lib is None:
            raise RuntimeError(f"kiln's GEMM is not built: {reason(test_kernels)}")
        self.kernel = kernel or linear_kernel()
        if not self.kernel.supported:
            raise ValueError(f"kernel {self.kernel.name!r} does not run on this CPU")
        self._lib = lib
        n, k = (int(d) for d in w.shape)
        w = w.detach().to(torch.float32)
        b = None if b is None else b.detach().to(torch.float32).reshape(n)
        self.swiglu = activation == "SwiGLU"
        if self.swiglu:
            w, b = swiglu_panels(w, b, self.kernel.nr)
            self.n, self.gemm_n = n // 2, int(w.shape[0])  # output width H; the GEMM's N (panels·NR)
        else:
            self.n = self.gemm_n = n
        self.k = k
        w = w.contiguous()
        self._w = hugepages.empty(lib.kiln_gemm_packed_floats(self.kernel.index, self.gemm_n, k))
        lib.kiln_gemm_pack_w(self.kernel.index, w.data_ptr(), self.gemm_n, k, self._w.data_ptr())
        self._bias = None if b is None else b.contiguous()
        self.residual = residual
        self._epilogue = dict(activation=ACTIVATIONS[activation], alpha=float(alpha), beta=float(beta),
                              residual_after=int(residual_after_activation))
        self.small_m = small_rows(self.kernel, k) if small_m is None else small_m
        self.pack_m = NEVER if pack_m is None else pack_m
        self.implementation = f"kiln packed GEMM, {self.kernel.name}"
        self._call_plans: dict[int, tuple[_Plan, torch.Tensor]] = {}
        self._plan_constants: dict | None = None
        self._lock = threading.Lock()

    def plan(self, rows: int, scratch: torch.Tensor | None = None) -> tuple[_Plan, torch.Tensor]:
        """A plan for `rows` rows with its own scratch (or `scratch` when large enough): packed A past
        pack_m rows, then SwiGLU's C before the gating past small_m rows (gemm.c's K-blocked paths)."""
        packed_a = self._lib.kiln_gemm_scratch_floats(self.kernel.index, rows, self.k) \
            if rows > max(self.small_m, self.pack_m) else 0
        packed_a = -(-packed_a // 16) * 16  # C starts 64-byte aligned
        c = rows * self.gemm_n if self.swiglu and rows > self.small_m else 0
        if scratch is None or scratch.numel() < packed_a + c:
            scratch = hugepages.empty(packed_a + c) if packed_a + c else _NO_SCRATCH
        constants = self._plan_constants
        if constants is None:  # the fields no row count changes, read once (a segment replans at every new size)
            constants = self._plan_constants = dict(
                packed_w=self._w.data_ptr(), bias=self._bias.data_ptr() if self._bias is not None else None,
                K=self.k, N=self.gemm_n, kernel=self.kernel.index, small_m=self.small_m, pack_m=self.pack_m,
                out_n=self.n, **self._epilogue)
        base = scratch.data_ptr() if scratch is not _NO_SCRATCH else 0
        # SwiGLU's C place wherever the scratch holds C past small_m rows, at any row count (gemm.c reads it past
        # small_m rows only): a replan at fewer rows over its call's scratch keeps it, as a view's plan does (c_rows)
        holds_c = self.swiglu and scratch.numel() - packed_a > self.small_m * self.gemm_n
        plan = _Plan(scratch=base, M=rows, threads=self._threads(rows),
                     c_scratch=base + 4 * packed_a if holds_c else None, **constants)
        return plan, scratch

    def c_rows(self, rows: int) -> int:
        """The rows of SwiGLU's C that plan(rows) makes a place for at the scratch's start (no A packed before it),
        or 0: a view at up to that many rows keeps the place (row_fields' c_rows); past them, or past the rows
        read in place, a view's rule refuses and the segment binds or grows."""
        return rows if self.swiglu and self.small_m < rows <= self.pack_m else 0

    def _threads(self, rows: int) -> int:
        """The plan's `threads`: 1 (the calling thread alone) for a product too small to share out, else 0 (all)."""
        return plan_threads(rows, self.gemm_n, self.k)

    def row_fields(self, rows: int, c_rows: int = 0) -> dict[str, int]:
        """The fields of plan(rows, scratch) that follow the row count, where that plan needs no scratch (A read in
        place, no SwiGLU staging) or, over a template call's scratch holding SwiGLU's C for `c_rows` rows (c_rows()),
        up to those rows: what a native segment's view writes into a copy of its template's plan.
        ValueError at row counts whose plan needs scratch (plan() makes those)."""
        return row_fields(rows, self.k, self.gemm_n, self.small_m, self.pack_m, self.swiglu, c_rows)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] float32 -> y [..., N] (a new tensor, or `out`: contiguous float32 [..., N]); residual
        [..., N] when the layer has one."""
        lead = tuple(x.shape[:-1])
        rows = math.prod(lead)
        x = x.reshape(rows, self.k).contiguous()  # x: [M, K]
        if out is not None and (out.dtype != torch.float32 or not out.is_contiguous() or out.numel() != rows * self.n):
            raise ValueError(f"out must be a contiguous float32 tensor of {rows} x {self.n} elements, "
                             f"given {out.dtype} {list(out.shape)}")
        y = torch.empty((rows, self.n), dtype=torch.float32) if out is None else out  # y: [M, N]
        r = None
        if self.residual:
            r = residual.reshape(rows, self.n).contiguous()
        with self._lock:
            found = self._call_plans.get(rows)
            if found is None:
                if len(self._call_plans) > 8:  # row counts of a dynamic profile: the oldest out
                    self._call_plans.pop(next(iter(self._call_plans)))
                found = self._call_plans[rows] = self.plan(rows)
            plan = found[0]
            plan.src, plan.dst = x.data_ptr(), y.data_ptr()
            plan.residual = r.data_ptr() if r is not None else None
            status = self._lib.kiln_gemm(ctypes.byref(plan), None, 0, None)
        if status:
            raise RuntimeError(f"kiln GEMM [{rows}, {self.k}] x [{self.n}, {self.k}]ᵀ failed ({status})")
        return y.reshape(*lead, self.n)

    def rows(self, input_size: tuple[int, ...]) -> BoundRows:
        """What a native segment binds for inputs of `input_size` ([..., K])."""
        return BoundRows(self, tuple(int(d) for d in input_size))


class BoundRows:
    """The layer at one input size, as kiln/runtime/native.py's NativeStep.primitive() returns it."""

    def __init__(self, gemm: PackedLinear, input_size: tuple[int, ...]):
        if input_size[-1] != gemm.k:
            raise ValueError(f"input {list(input_size)} does not end in K = {gemm.k}")
        self.gemm = gemm
        self.input_size, self.output_size = input_size, (*input_size[:-1], gemm.n)
        self.residual = gemm.residual
        self.rows = math.prod(input_size[:-1])

    def bind(self, src: int, dst: int, residual: int | None = None) -> GemmCall:
        return GemmCall(self, src, dst, residual if self.residual else None)


class GemmCall:
    """One bound call (kiln_gemm on a plan of its own, scratch included): src, dst and residual are
    oneDNN memory objects, so the segment loop points them at each run's addresses as it does a
    primitive's (kiln/kernels/cpu/segment_loop.c)."""

    def __init__(self, bound: BoundRows, src: int, dst: int, residual: int | None):
        lib = onednn.load()
        gemm = bound.gemm
        self.what = f"kiln GEMM {list(bound.input_size)} -> {list(bound.output_size)}"
        self._bound = bound
        self._md = onednn.memory_desc([1], onednn.TAG_A)  # only the handle matters to kiln_gemm
        self._memories = {"src": onednn._memory(self._md.value, src), "dst": onednn._memory(self._md.value, dst)}
        if residual is not None:
            self._memories["residual"] = onednn._memory(self._md.value, residual)
        self._plan, self._scratch = gemm.plan(bound.rows)
        self._plan.get_handle = ctypes.cast(lib.lib.dnnl_memory_get_data_handle, ctypes.c_void_p).value
        self._plan.src, self._plan.dst = self._memories["src"].value, self._memories["dst"].value
        self._plan.residual = self._memories["residual"].value if residual is not None else None
        self._function = ctypes.cast(gemm._lib.kiln_gemm, ctypes.c_void_p).value

    @property
    def plan(self) -> _Plan:
        """The plan this call runs (a native segment's view at other rows copies it)."""
        return self._plan

    def calls(self) -> list[tuple[int | None, int, int, int]]:
        return [(self._function, ctypes.addressof(self._plan), 0, 0)]

    def replan(self, bound: BoundRows) -> native_loop.Replanned:
        """The same layer at other rows (`bound`) on this call's memory objects and scratch (a larger
        one of its own when this is too small): what a native segment resized over its template runs."""
        if getattr(bound, "gemm", None) is not self._bound.gemm:  # another layer, or a oneDNN primitive
            raise ValueError(f"{type(bound).__name__}: not the layer of {self.what} at other rows")
        plan, scratch = bound.gemm.plan(bound.rows, self._scratch)
        plan.get_handle, plan.src, plan.dst, plan.residual = (self._plan.get_handle, self._plan.src, self._plan.dst,
                                                              self._plan.residual)
        return native_loop.Replanned(self._function, plan, self, scratch, bound)

    def memory(self, role: str) -> int:
        return self._memories[role].value

    def rebind(self, role: str, address: int) -> None:
        onednn.load().lib.dnnl_memory_set_data_handle(self._memories[role].value, address)
