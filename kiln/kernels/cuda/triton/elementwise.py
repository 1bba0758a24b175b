"""A Triton code generator for kiln's fused elementwise chains (`kiln::Elementwise`).

The optimizer turns a chain of elementwise ONNX ops into a small program, one line per op
(`Add i0 i1`, `Gelu t0`: operands are inputs `i<k>` or earlier results `t<k>`, the last line
is the output; kiln/ops/fused.py: `elementwise`). Here the program becomes the body of one
Triton kernel that reads every input once, evaluates the chain in fp32 registers and writes
the output once — where torch makes one pass over memory per line.

Broadcasting is resolved on the host: each input gets a stride per output dimension (0 where
it broadcasts), dimensions that every input walks contiguously are merged, and the kernel
decomposes the flat output index over the remaining sizes. Each input is specialised to one
of three access kinds, part of the kernel's cache key:

    c   laid out like the output       load(x + offs)
    s   one element (scalar constant)  load(x), broadcast in registers
    g   anything else                  load(x + Σ idx_d · stride_d)

Triton's @jit needs real source text (it reads it with `inspect`), so each generated kernel is
written to `<cache>/triton/elementwise_<sha>.py` and imported from there.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import torch
import triton

from kiln.ops._util import merge_walked_dims
from kiln.ops.fused import quantization_scales, dequantized_inputs

BLOCK = 1024
NUM_WARPS = 4
MAX_RANK = 6  # after merging dims; beyond it the inputs are expanded and copied (rare)

UNARY = {
    "Neg": "-{0}", "Abs": "tl.abs({0})", "Exp": "tl.exp({0})", "Log": "tl.log({0})", "Sqrt": "dm.sqrt({0})",
    "Reciprocal": "dm.reciprocal({0})", "Relu": "dm.relu({0})", "Sigmoid": "dm.sigmoid({0})",
    "Tanh": "dm.tanh({0})", "Erf": "tl.math.erf({0})", "Sin": "tl.sin({0})", "Cos": "tl.cos({0})",
    "Floor": "tl.floor({0})", "Ceil": "tl.ceil({0})", "Gelu": "dm.gelu({0})", "GeluTanh": "dm.gelu_tanh({0})",
}
BINARY = {
    "Add": "{0} + {1}", "Sub": "{0} - {1}", "Mul": "{0} * {1}", "Div": "dm.div({0}, {1})",
    "Pow": "dm.pow({0}, {1})", "Max": "dm.maximum({0}, {1})", "Min": "dm.minimum({0}, {1})",
    # DequantizeLinear of an E4M3 tensor by its scale: the load widened it to fp32 exactly
    "Dequantize": "{0} * {1}",
    # QuantizeLinear to E4M3 (a program's last line): IEEE division, saturated, rounded onto the grid in fp32
    # arithmetic (qmath: the interpreter's own fp8 conversion rounds wrongly), so the fp8 store is exact
    "Quantize": "qm.round_to_e4m3(dm.div({0}, {1}))",
}
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8 = torch.float8_e4m3fn  # read only as a Dequantize line's first operand


def cache_dir() -> Path:
    """`$KILN_CACHE/triton` when KILN_CACHE is set, else `~/.cache/kiln/triton`."""
    root = os.environ.get("KILN_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "kiln") / "triton"


def parse_program(code: Sequence[str], n_inputs: int) -> list[str]:
    """The program's lines as Triton expressions (`t2 = dm.gelu(t1)`); errors name the line."""
    lines = []
    for k, line in enumerate(code):
        op, *args = line.split()
        table = UNARY if op in UNARY else BINARY if op in BINARY else None
        if table is None:
            raise ValueError(f"kiln::Elementwise line {k} {line!r}: op {op!r} has no Triton form "
                             f"(known: {sorted(UNARY) + sorted(BINARY)})")
        if op == "Quantize" and k != len(code) - 1:
            raise ValueError(f"kiln::Elementwise line {k} {line!r}: Quantize ends a program (its E4M3 is the output)")
        arity = 1 if table is UNARY else 2
        if len(args) != arity:
            raise ValueError(f"kiln::Elementwise line {k} {line!r}: {op} takes {arity} operand(s), got {len(args)}")
        for a in args:
            limit = n_inputs if a[:1] == "i" else k if a[:1] == "t" else -1
            if not a[1:].isdigit() or int(a[1:]) >= limit:
                raise ValueError(f"kiln::Elementwise line {k} {line!r}: operand {a!r} is not an input "
                                 f"i0..i{n_inputs - 1} or an earlier result t0..t{k - 1}")
        lines.append(f"t{k} = " + table[op].format(*args))
    if not lines:
        raise ValueError("kiln::Elementwise: empty program")
    return lines


def generate_source(body: list[str], kinds: str, rank: int, index64: bool,
                    quantized: frozenset[int] = frozenset()) -> str:
    """Triton source of one kernel: `kinds[k]` is input k's access kind (c/s/g), `rank` the
    number of (merged) output dims the general inputs index over; `quantized` the inputs a Dequantize
    reads (maybe E4M3: their masked lanes load without a fill value, which float8 cannot take)."""
    n = len(kinds)
    general = [k for k, kind in enumerate(kinds) if kind == "g"]
    params = [f"in{k}" for k in range(n)] + ["out", "numel"]
    params += [f"size{d}" for d in range(rank)] if general else []
    params += [f"stride{k}_{d}" for k in general for d in range(rank)]
    src = [
        '"""Generated by kiln.kernels.cuda.triton.elementwise: do not edit."""',
        "import triton",
        "import triton.language as tl",
        "from kiln.kernels.cuda.triton import device_math as dm",
        "from kiln.kernels.cuda.triton import qmath as qm",
        "",
        "",
        "@triton.jit",
        f"def elementwise_kernel({', '.join(params)}, BLOCK: tl.constexpr):",
        "    pid = tl.program_id(0)" + (".to(tl.int64)" if index64 else ""),
        "    offs = pid * BLOCK + tl.arange(0, BLOCK)",
        "    mask = offs < numel",
    ]
    if general:  # idx_d = digit d of offs in the mixed radix of the output sizes
        src.append("    rest = offs")
        for d in range(rank - 1, 0, -1):
            src += [f"    idx{d} = rest % size{d}", f"    rest = rest // size{d}"]
        src.append("    idx0 = rest")
    for k, kind in enumerate(kinds):
        fill = "" if k in quantized else ", other=1"
        if kind == "c":
            src.append(f"    i{k} = tl.load(in{k} + offs, mask=mask{fill}).to(tl.float32)")
        elif kind == "s":
            src.append(f"    i{k} = tl.load(in{k}).to(tl.float32)")
        else:
            offset = " + ".join(f"idx{d} * stride{k}_{d}" for d in range(rank))
            src.append(f"    i{k} = tl.load(in{k} + {offset}, mask=mask{fill}).to(tl.float32)")
    src += ["    " + line for line in body]
    result = f"t{len(body) - 1}"
    if all(kind == "s" for kind in kinds):  # every operand a scalar: broadcast the result to the block
        src.append(f"    {result} = tl.broadcast_to({result}, [BLOCK])")
    src.append(f"    tl.store(out + offs, {result}.to(out.dtype.element_ty), mask=mask)")
    return "\n".join(src) + "\n"


def load_source(source: str, stem: str) -> ModuleType:
    """Import generated source through a file in the cache dir (written atomically, keyed by its hash)."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:20]
    name = f"kiln_generated_{stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    directory = cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{stem}_{digest}.py"
    if not path.exists() or path.read_text() != source:
        fd, tmp = tempfile.mkstemp(dir=directory, suffix=".py.tmp")
        with os.fdopen(fd, "w") as f:
            f.write(source)
        os.replace(tmp, path)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _contiguous_strides(shape: Sequence[int]) -> list[int]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return strides[::-1]


_merge_dims = merge_walked_dims  # kiln/ops/_util.py, shared with the CPU Elementwise kernel


def _output_layout(inputs: Sequence[torch.Tensor], shape: torch.Size) -> list[int] | None:
    """The dim order (outermost first) of the first full-size input when it is dense but not
    contiguous (channels-last): the output takes that layout, as torch's TensorIterator does."""
    for x in inputs:
        if x.shape == shape and not x.is_contiguous():
            order = sorted(range(len(shape)), key=lambda d: -x.stride(d))
            return order if x.permute(order).is_contiguous() else None
    return None


class ElementwiseKernel:
    """One compiled `kiln::Elementwise` program; call it on torch tensors (any device Triton runs on)."""

    def __init__(self, code: Sequence[str], n_inputs: int, output_dtype: torch.dtype | None = None):
        self.code = list(code)
        self.n_inputs = n_inputs
        self.output_dtype = output_dtype
        self.body = parse_program(self.code, n_inputs)
        self._kernels: dict[tuple, Callable] = {}
        self._launches: dict[tuple, _Launch] = {}  # per input signature

    def kernel(self, kinds: str, rank: int, index64: bool) -> Callable:
        key = (kinds, rank, index64)
        if key not in self._kernels:
            source = generate_source(self.body, kinds, rank, index64, frozenset(dequantized_inputs(self.code)))
            self._kernels[key] = load_source(source, "elementwise").elementwise_kernel
        return self._kernels[key]

    def __call__(self, *inputs: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if len(inputs) != self.n_inputs:
            raise TypeError(f"kiln::Elementwise {self.code}: expected {self.n_inputs} inputs, got {len(inputs)}")
        key = (tuple((x.shape, x.stride(), x.dtype, x.device) if isinstance(x, torch.Tensor) else type(x)
                     for x in inputs), out is None)
        launch = self._launches.get(key)
        if launch is None:
            launch = self._launches[key] = self._plan(inputs, out)
        if out is None:
            out = torch.empty_permuted(launch.shape, launch.order, dtype=launch.dtype, device=inputs[0].device)
        elif out.shape != launch.shape or not out.is_contiguous():
            raise ValueError(f"kiln::Elementwise out=: expected a contiguous tensor of shape {tuple(launch.shape)}, "
                             f"got {tuple(out.shape)} with strides {out.stride()}")
        if launch.kernel is None:  # empty output
            return out
        if launch.copy_inputs:  # too many independent dims: inputs copied to the output's layout
            inputs = [x.expand(launch.shape).permute(launch.order).contiguous() for x in inputs]
        launch.kernel[launch.grid](*inputs, out, *launch.args, BLOCK=BLOCK, num_warps=NUM_WARPS)
        return out

    def _plan(self, inputs: Sequence[torch.Tensor], out: torch.Tensor | None) -> _Launch:
        """Everything about a launch that depends only on the inputs' shapes, strides and dtypes."""
        quantized, scales = dequantized_inputs(self.code), quantization_scales(self.code)
        for k, x in enumerate(inputs):
            allowed = FLOAT_DTYPES + ((FP8,) if k in quantized else ())
            if not isinstance(x, torch.Tensor) or x.dtype not in allowed:
                raise TypeError(f"kiln::Elementwise input {k}: expected a float16/bfloat16/float32 tensor"
                                f"{' or float8_e4m3fn' if k in quantized else ''}, got "
                                f"{getattr(x, 'dtype', type(x).__name__)} (use the torch implementation)")
        shape = torch.broadcast_shapes(*(x.shape for x in inputs))
        # 0-d inputs do not decide the type (torch rule), nor E4M3 tensors and their float32 scales: a program
        # with Dequantize lines names its output dtype
        floats = [x for k, x in enumerate(inputs) if k not in quantized | scales]
        sized = [x for x in floats if x.dim() > 0] or floats
        dtype = sized[0].dtype if sized else torch.float32
        for x in sized[1:]:
            dtype = torch.promote_types(dtype, x.dtype)
        dtype = self.output_dtype or dtype
        order = (None if out is not None else _output_layout(inputs, shape)) or list(range(len(shape)))
        launch = _Launch(shape, dtype, order)
        numel = shape.numel()
        if numel == 0:
            return launch
        iter_shape = [shape[d] for d in order]  # the output's memory order: out is contiguous in it
        strides = [[x.expand(shape).stride(d) if shape[d] != 1 else 0 for d in order] for x in inputs]
        merged, strides = _merge_dims(iter_shape, strides)
        if len(merged) > MAX_RANK:
            launch.copy_inputs = True
            merged, strides = [numel], [[1] for _ in inputs]
        contiguous = _contiguous_strides(merged)
        kinds = "".join("s" if x.numel() == 1 else "c" if s == contiguous else "g" for x, s in zip(inputs, strides))
        reach = max([numel] + [sum((n - 1) * abs(st) for n, st in zip(merged, s)) + 1 for s in strides])
        launch.args = [numel]
        if "g" in kinds:
            launch.args += merged
            launch.args += [st for kind, s in zip(kinds, strides) if kind == "g" for st in s]
        launch.kernel = self.kernel(kinds, len(merged), index64=reach + BLOCK >= 2**31)
        launch.grid = (triton.cdiv(numel, BLOCK),)
        return launch


@dataclass
class _Launch:
    shape: torch.Size
    dtype: torch.dtype
    order: list[int]  # output dims outermost-first in memory
    kernel: Callable | None = None
    args: list[int] = field(default_factory=list)  # after the tensors: numel, sizes, strides
    grid: tuple[int] = (1,)
    copy_inputs: bool = False


_COMPILED: dict[tuple[tuple[str, ...], int, torch.dtype | None], ElementwiseKernel] = {}


def compile_elementwise(code: list[str], n_inputs: int,
                        output_dtype: torch.dtype | None = None) -> Callable[..., torch.Tensor]:
    """The kernel for a `kiln::Elementwise` program: `fn(*inputs, out=None) -> Tensor`.

    Inputs: `n_inputs` float16/bfloat16/float32 tensors on one device, broadcasting numpy-style;
    the output has the broadcast shape, torch's promoted dtype, and the layout of the first
    full-size input when that is dense (channels-last in, channels-last out). Math is fp32.
    Raises ValueError here for a program it cannot generate, TypeError at call for other dtypes.
    A program with Dequantize lines may read E4M3 tensors (their first operands); its output dtype is
    `output_dtype`, else promoted from the inputs other than those and their scales.
    """
    key = (tuple(code), n_inputs, output_dtype)
    if key not in _COMPILED:
        _COMPILED[key] = ElementwiseKernel(code, n_inputs, output_dtype)
    return _COMPILED[key]


__all__ = ["compile_elementwise", "ElementwiseKernel", "parse_program", "generate_source"]
