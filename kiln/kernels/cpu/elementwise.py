"""kiln::Elementwise programs and Concat in kiln's C (elementwise.c, compiled with transformer.c): layers
at fixed sizes for native segments, and callable on tensors outside one.

The C kernel evaluates the program chunk by chunk along y's last axis; before that, the dims are merged
wherever every operand walks them contiguously, so same-shaped operands are one long row and a bias
broadcast over rows is a row of its own length (fewer, longer chunks). An explicitly quantized graph's chain
reads int8/uint8 inputs and writes an int8/uint8 output (`quantization`), and a chain of one 8-bit activation and
per-column constants runs as a lookup table (`lookup_table`).
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass, field

import torch

from kiln.kernels.cpu.transformer import MAX_DIMS, PARALLEL_ELEMENTS, NativeKernel, broadcast_strides
from kiln.ops._util import broadcast_sizes, merge_walked_dims

EW_INPUTS = 8   # EW_INPUTS in elementwise.c
EW_LINES = 32   # EW_LINES in elementwise.c
EC_PARTS = 64   # EC_PARTS in elementwise.c: parts of an EmbeddingConcat
CONCAT_INPUTS = 64  # CONCAT_INPUTS in elementwise.c: inputs of a Concat
# elements past which a streaming step between a segment's oneDNN layers (`stream`: cpu.concat.nhwc, an image's
# per-channel chain cpu.elementwise.nhwc) is shared among the threads: 256 KB, ~15-30 µs of one core's streaming; at
# PARALLEL_ELEMENTS (1M) a DenseNet's every BN-ReLU chain and Concat (25K-800K elements) ran on one thread at 2 threads
# (bench/results/zoo-new-2threads-zen4-2026-12-07c.md). Shared on OpenMP's team (elementwise.c team_items), which
# the oneDNN layer before left awake, not on gemm.c's pool, whose worker has gone to sleep by then: on the pool the
# caller still ran nearly every item (the calling thread's CPU time 1.03x less at 2 threads; on the team 1.78x for the
# chains, 2.28x for the Concats: bench/results/zoo-2threads-zen4-2026-12-07d.md).
STREAM_ELEMENTS = 1 << 16
ONE_THREAD = 1 << 62  # a grain no step reaches: its loop stays on the calling thread
# the program's op names (kiln/passes/fusion/elementwise.py) in elementwise.c's enum order
OPS = ("Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Neg", "Abs", "Exp", "Log", "Sqrt", "Reciprocal", "Relu",
       "Sigmoid", "Tanh", "Erf", "Sin", "Cos", "Floor", "Ceil", "Gelu", "GeluTanh")
UNARY = set(OPS[OPS.index("Neg"):])

_LONGD = ctypes.c_long * MAX_DIMS


class _ElementwisePlan(ctypes.Structure):  # elementwise_plan
    _fields_ = [("get_handle", ctypes.c_void_p), ("in_", ctypes.c_void_p * EW_INPUTS),
                ("constant", ctypes.c_void_p * EW_INPUTS), ("out", ctypes.c_void_p), ("dims", _LONGD),
                ("strides", _LONGD * EW_INPUTS), ("inputs", ctypes.c_int), ("lines", ctypes.c_int),
                ("code", (ctypes.c_int * 3) * EW_LINES), ("grain", ctypes.c_long),
                ("in_type", ctypes.c_int * EW_INPUTS), ("out_type", ctypes.c_int), ("quant", ctypes.c_void_p),
                ("table", ctypes.c_void_p), ("table_input", ctypes.c_int), ("team", ctypes.c_int)]


class _ConcatPlan(ctypes.Structure):  # concat_plan
    _fields_ = [("get_handle", ctypes.c_void_p), ("in_", ctypes.c_void_p * CONCAT_INPUTS), ("out", ctypes.c_void_p),
                ("widths", ctypes.c_long * CONCAT_INPUTS), ("outer", ctypes.c_long), ("inputs", ctypes.c_int),
                ("grain", ctypes.c_long), ("team", ctypes.c_int)]


def parse(code: list[str], inputs: int) -> list[tuple[int, int, int]] | str:
    """The program as (op, operand a, operand b) triples (operand k < EW_INPUTS: input k, else line
    k - EW_INPUTS), or why elementwise.c cannot run it."""
    if not code or len(code) > EW_LINES:
        return f"{len(code)} lines: 1 to {EW_LINES}"
    if inputs > EW_INPUTS:
        return f"{inputs} inputs: at most {EW_INPUTS}"
    lines = []
    for number, line in enumerate(code):
        op, *args = line.split()
        if op not in OPS:
            return f"line {number} {line!r}: {op} is not one of kiln's C ops"
        if len(args) != (1 if op in UNARY else 2):
            return f"line {number} {line!r}: {len(args)} operands"
        operands = []
        for a in args:
            k = int(a[1:])
            if (a[0] == "i" and not 0 <= k < inputs) or (a[0] == "t" and not 0 <= k < number) or a[0] not in "it":
                return f"line {number} {line!r}: operand {a} does not exist"
            operands.append(k if a[0] == "i" else EW_INPUTS + k)
        lines.append((OPS.index(op), operands[0], operands[-1]))
    return lines


EIGHT_BIT = {torch.uint8: 1, torch.int8: 2}  # elementwise.c's in_type / out_type
UNREAD = 3  # elementwise.c's in_type of an input no line reads (a scale or zero point, in `quant`)


@dataclass
class Quantization:
    """A program's Dequantize / Quantize lines (int8/uint8, kiln/passes/fusion/elementwise_dequantize.py) as
    elementwise.c runs them: the float32 program left, each dequantized input's 8-bit dtype, scale and zero point
    (read as (x - z)·s), and the output's (stored as saturate(round(r / s) + z)); `output` None: float32."""

    code: list[str]
    inputs: dict[int, tuple[torch.dtype, float, float]] = field(default_factory=dict)
    output: tuple[torch.dtype, float, float] | None = None
    parameters: set[int] = field(default_factory=set)  # the scales' and zero points' inputs: no line reads them

    def in_types(self) -> list[int]:
        """elementwise_plan.in_type: each input as the kernel reads it."""
        return [EIGHT_BIT[self.inputs[k][0]] if k in self.inputs else UNREAD if k in self.parameters else 0
                for k in range(EW_INPUTS)]

    def quant(self) -> list[float]:
        """elementwise_plan.quant: [EW_INPUTS][2] {s, z}, then the output's {s, z, qmin, qmax}."""
        values = [0.0] * (2 * EW_INPUTS + 4)
        for k, (_, scale, zero) in self.inputs.items():
            values[2 * k:2 * k + 2] = [scale, zero]
        if self.output is not None:
            dtype, scale, zero = self.output
            values[2 * EW_INPUTS:] = [scale, zero, torch.iinfo(dtype).min, torch.iinfo(dtype).max]
        return values


def quantization(code: list[str], dtypes: dict[int, torch.dtype],
                 constants: dict[int, torch.Tensor]) -> Quantization | str:
    """The program without its int8/uint8 Dequantize and Quantize lines (`Dequantize i<q> i<s> i<z>`, the first
    lines; `Quantize t<last> i<s> i<z>`, the last), or why elementwise.c cannot run them. `dtypes`: every input's
    dtype by index; `constants`: the constant inputs (the scales and zero points must be)."""
    result = Quantization(code=[])
    renamed: dict[int, str] = {}  # the old line's result -> its operand in the new program
    if not any(line.split()[0] in ("Dequantize", "Quantize") for line in code):
        result.code = list(code)
        return result

    def scalar(operand: str, what: str) -> float | str:
        k = int(operand[1:])
        result.parameters.add(k)
        if operand[0] != "i" or k not in constants or constants[k].numel() != 1:
            return f"the {what} {operand} is not a constant scalar"
        return float(constants[k].reshape(()).to(torch.float64))

    def operand_of(a: str) -> str:
        return renamed[int(a[1:])] if a[0] == "t" else a

    for number, line in enumerate(code):
        op, *args = line.split()
        if op == "Dequantize":
            if len(args) != 3:
                return f"line {number} {line!r}: an E4M3 Dequantize (no zero point): CUDA's kernels run it"
            q = args[0]
            k = int(q[1:])
            if q[0] != "i" or k in constants or dtypes.get(k) not in EIGHT_BIT:
                return f"line {number} {line!r}: {q} is not an 8-bit activation"
            if sum(other.split()[1:].count(q) for other in code) != 1:
                return f"line {number} {line!r}: {q} is read by other lines too"
            scale, zero = scalar(args[1], "scale"), scalar(args[2], "zero point")
            if isinstance(scale, str) or isinstance(zero, str):
                return f"line {number} {line!r}: " + (scale if isinstance(scale, str) else zero)
            result.inputs[k] = (dtypes[k], scale, zero)
            renamed[number] = q
        elif op == "Quantize":
            if len(args) != 3:
                return f"line {number} {line!r}: an E4M3 Quantize (no zero point): CUDA's kernels run it"
            if number != len(code) - 1 or not operand_of(args[0]).startswith("t"):
                return f"line {number} {line!r}: a Quantize only as the last line, of a computed line"
            zero_index = int(args[2][1:])
            scale, zero = scalar(args[1], "scale"), scalar(args[2], "zero point")
            if isinstance(scale, str) or isinstance(zero, str):
                return f"line {number} {line!r}: " + (scale if isinstance(scale, str) else zero)
            dtype = constants[zero_index].dtype
            if dtype not in EIGHT_BIT:
                return f"line {number} {line!r}: the zero point is {dtype}, not int8/uint8"
            result.output = (dtype, scale, zero)
            if operand_of(args[0]) != f"t{len(result.code) - 1}":
                return f"line {number} {line!r}: a Quantize of the line before it only"
        else:
            renamed[number] = f"t{len(result.code)}"
            result.code.append(" ".join([op, *(operand_of(a) for a in args)]))
    if not result.code:
        return "no float32 line between the Dequantize and the Quantize"
    result.parameters -= {int(a[1:]) for line in result.code for a in line.split()[1:] if a[0] == "i"}
    return result


def merged_dims(out: tuple[int, ...], strides: list[tuple[int, ...]]) -> tuple[tuple[int, ...], list[tuple[int, ...]]]:
    """out's dims (and each operand's strides over them) merged where every operand walks them as one
    (merge_walked_dims); MAX_DIMS long again, 1s in front."""
    dims, walks = merge_walked_dims(list(out), [list(s) for s in strides])
    pad = MAX_DIMS - len(dims)
    return (1,) * pad + tuple(dims), [(0,) * pad + tuple(w) for w in walks]


class Elementwise(NativeKernel):
    """y = the program over its inputs broadcast together (float32, y row-major). `sizes`: every input's size
    by index; `constants`: the inputs that are weights of the engine (baked into the plan; the others are
    step inputs the segment binds). `tables`: the lookup tables this layer's kernels made at other sizes, by row width
    (a table depends on the columns only: a layer bound at a new batch or sequence length reuses its width's).
    `stream`: a streaming step between a segment's oneDNN layers, its chunks shared past STREAM_ELEMENTS on OpenMP's
    team (else past PARALLEL_ELEMENTS on gemm.c's pool; an 8-bit chain's past kiln_quantized_split)."""

    PLAN, FUNCTION = _ElementwisePlan, "kiln_elementwise"

    def __init__(self, code: list[str], sizes: dict[int, tuple[int, ...]], constants: dict[int, torch.Tensor],
                 dtypes: dict[int, torch.dtype] | None = None, lookup: bool = True,
                 tables: dict[tuple, torch.Tensor] | None = None, stream: bool = False):
        count = max([*sizes, *constants]) + 1
        super().__init__(f"elementwise {code} of {count} inputs")
        quantized = quantization(code, dtypes or {}, constants)
        if isinstance(quantized, str):
            raise ValueError(f"{self.what}: {quantized}")
        lines = parse(quantized.code, count)
        if isinstance(lines, str):
            raise ValueError(f"{self.what}: {lines}")
        if quantized.output is not None:
            self.output_dtype = quantized.output[0]
        self._quant = torch.tensor(quantized.quant(), dtype=torch.float32)
        self._constants = {k: c.detach().to(torch.float32).contiguous() for k, c in constants.items()}
        all_sizes = [tuple(sizes[k]) if k in sizes else tuple(self._constants[k].shape) for k in range(count)]
        out = broadcast_sizes(*all_sizes)
        if len(out) > MAX_DIMS:
            raise ValueError(f"{self.what}: {len(out)} dims, at most {MAX_DIMS}")
        self.output_size = tuple(out)
        padded = (1,) * (MAX_DIMS - len(out)) + tuple(out)
        dims, strides = merged_dims(padded, [broadcast_strides(s, padded) for s in all_sizes])
        strides += [(0,) * MAX_DIMS] * (EW_INPUTS - count)
        code_array = ((ctypes.c_int * 3) * EW_LINES)(*[(ctypes.c_int * 3)(*line) for line in lines])
        self.roles = {k: (f"in_{k}",) for k in sizes} | {"dst": ("out",)}
        self.fields = dict(
            constant=(ctypes.c_void_p * EW_INPUTS)(*[self._constants[k].data_ptr() if k in self._constants else None
                                                     for k in range(EW_INPUTS)]),
            dims=_LONGD(*dims), strides=(_LONGD * EW_INPUTS)(*[_LONGD(*s) for s in strides]), inputs=count,
            lines=len(lines), code=code_array, grain=STREAM_ELEMENTS if stream else PARALLEL_ELEMENTS, team=int(stream),
            in_type=(ctypes.c_int * EW_INPUTS)(*quantized.in_types()),
            out_type=EIGHT_BIT[quantized.output[0]] if quantized.output is not None else 0,
            quant=self._quant.data_ptr())
        self._table = lookup_table(code, sizes, constants, dtypes or {}, quantized, dims, strides,
                                   tables) if lookup else None
        if self._table is not None:
            self.fields.update(table=self._table.data_ptr(), table_input=next(iter(quantized.inputs)))


TABLE_MIN_ROWS = 64  # rows of y below which a program is evaluated (the table is 256 rows' worth of work at build)
# a table of at most 1 MB (BERT-base's and BERT-large's FFN widths, 3072 and 4096): read in 64-column blocks by
# gathers (elementwise.c table_columns) it measured 0.55-0.65 ns an element from 128 to 3072 columns on a Zen 3
# (AVX2), against 1.9-2.3 for a DQ -> bias -> Gelu -> Q evaluated (bench/results/qdq-avx2-2026-12-07.md)
TABLE_MAX_COLUMNS = 4096
# a program of one such line between its Dequantize and Quantize (DQ -> bias -> Q) is evaluated from
# TABLE_CHEAP_COLUMNS columns on: there it measured 0.46-0.52 ns an element evaluated, the table 0.54-0.63
CHEAP = {"Add", "Sub", "Mul", "Neg", "Abs", "Relu", "Max", "Min"}
TABLE_CHEAP_COLUMNS = 256
# the ops whose C form (ew_line) may round by where an element sits in its chunk (ew_gelu: the vector loops or
# libm's erff for a chunk's last n % 8): a table of them is exact only where every chunk is a multiple of 8 long
POSITIONAL = {"Gelu"}


def lookup_table(code: list[str], sizes: dict[int, tuple[int, ...]], constants: dict[int, torch.Tensor],
                 dtypes: dict[int, torch.dtype], quantized: Quantization, dims: tuple[int, ...],
                 strides: list[tuple[int, ...]],
                 tables: dict[tuple, torch.Tensor] | None = None) -> torch.Tensor | None:
    """y[o][j] = table[j][x[o][j]] for a program of one 8-bit activation x of y's shape, its other operands constants
    that vary along y's last (merged) axis at most, and an 8-bit output; None where that is not the program or a
    table would not pay. The table is this kernel's own program on every byte value of every column (a [256, n]
    input through the same C loop), so it holds exactly what the evaluation computes. Why: onnxruntime's QDQ
    transformers end every quantized GEMM in DQ -> bias -> Gelu / scale -> Q, one 8-bit value in and out per element;
    the Gelu's polynomial and exp cost ~40 vector instructions per 16 elements, a gather one. `tables`: made at other
    sizes, by the row's width (taken after the checks, which depend on the sizes; put there when made)."""
    if quantized.output is None or len(quantized.inputs) != 1 or len(sizes) != 1:
        return None
    (k,) = quantized.inputs
    n, rows = dims[-1], math.prod(dims[:-1])
    contiguous = tuple(math.prod(dims[d + 1:]) if dims[d] > 1 else 0 for d in range(len(dims)))
    if k not in sizes or rows < TABLE_MIN_ROWS or n > TABLE_MAX_COLUMNS:
        return None
    if len(quantized.code) == 1 and quantized.code[0].split()[0] in CHEAP and n >= TABLE_CHEAP_COLUMNS:
        return None  # one cheap line: evaluating it costs less than a gather
    if tuple(s if dims[d] > 1 else 0 for d, s in enumerate(strides[k])) != contiguous:
        return None  # x broadcasts or is not y's layout
    used = {int(a[1:]) for line in quantized.code for a in line.split()[1:] if a[0] == "i"} - {k}
    if any(any(strides[c][d] for d in range(len(dims) - 1)) for c in used):
        return None  # an operand varies along y's rows
    if n % 8 and any(line.split()[0] in POSITIONAL for line in code):
        return None
    # past the checks every operand but x is a row of y's last axis: the table is the same at any count of rows
    key = (n, tuple(s[-1] for s in strides))
    if tables is not None and key in tables:
        return tables[key]
    out = broadcast_sizes(*[tuple(sizes[j]) if j in sizes else tuple(constants[j].shape) for j in range(len(strides))
                            if j in sizes or j in constants])
    rowed = {}
    for j, c in constants.items():  # each constant as one row of y's last axis, [n] (or as it is when unread)
        rowed[j] = c.broadcast_to(out).reshape(rows, n)[0].contiguous() if j in used else c
    values = torch.arange(256, dtype=torch.uint8).view(dtypes[k])  # every byte, read as x's type
    inner = Elementwise(code, {k: (256, n)}, rowed, {k: dtypes[k]}, lookup=False)
    y = inner({k: values[:, None].expand(256, n).contiguous()})  # [256 byte values, n columns]
    table = torch.cat([y.view(torch.uint8).t().reshape(-1), torch.zeros(3, dtype=torch.uint8)])
    if tables is not None:
        tables[key] = table
    return table


class _QuantizePlan(ctypes.Structure):  # quantize_plan
    _fields_ = [("get_handle", ctypes.c_void_p), ("src", ctypes.c_void_p), ("dst", ctypes.c_void_p),
                ("n", ctypes.c_long), ("q", ctypes.c_float * 4), ("quantize", ctypes.c_int),
                ("is_signed", ctypes.c_int), ("grain", ctypes.c_long)]


class Quantize(NativeKernel):
    """QuantizeLinear (`quantize`: float32 -> 8-bit, saturate(round(x / scale) + zero), round half to even) or
    DequantizeLinear (8-bit -> float32, (x - zero)·scale) per tensor, of step input 0 (contiguous, any size)."""

    PLAN, FUNCTION = _QuantizePlan, "kiln_quantize"

    def __init__(self, size: tuple[int, ...], quantize: bool, scale: float, zero: int, dtype: torch.dtype):
        super().__init__(f"{'quantize' if quantize else 'dequantize'} {list(size)} ({dtype}, scale {scale:g}, "
                         f"zero {zero})")
        if dtype not in (torch.uint8, torch.int8):
            raise ValueError(f"{self.what}: 8-bit types only")
        info = torch.iinfo(dtype)
        self.output_size = tuple(size)
        self.output_dtype = dtype if quantize else torch.float32
        self.roles = {0: ("src",), "dst": ("dst",)}
        self.fields = dict(n=math.prod(size), q=(ctypes.c_float * 4)(scale, zero, info.min, info.max),
                           quantize=int(quantize), is_signed=int(dtype == torch.int8), grain=PARALLEL_ELEMENTS)


class Concat(NativeKernel):
    """y = Concat(inputs, axis) of float32 tensors (step inputs 0..k-1, row-major). `stream`: a step between a
    segment's oneDNN layers (cpu.concat.nhwc), its rows shared on OpenMP's team past STREAM_ELEMENTS; else one
    thread (a copy: no measurement here says a split pays elsewhere)."""

    PLAN, FUNCTION = _ConcatPlan, "kiln_concat"

    def __init__(self, sizes: list[tuple[int, ...]], axis: int, stream: bool = False):
        super().__init__(f"concat of {[list(s) for s in sizes]} on axis {axis}")
        if not 1 <= len(sizes) <= CONCAT_INPUTS:
            raise ValueError(f"{self.what}: 1 to {CONCAT_INPUTS} inputs")
        rank = len(sizes[0])
        axis = axis + rank if axis < 0 else axis
        if any(len(s) != rank or s[:axis] != sizes[0][:axis] or s[axis + 1:] != sizes[0][axis + 1:] for s in sizes):
            raise ValueError(f"{self.what}: the inputs differ off the axis")
        self.output_size = (*sizes[0][:axis], sum(s[axis] for s in sizes), *sizes[0][axis + 1:])
        widths = [math.prod(s[axis:]) for s in sizes]
        self.roles = {k: (f"in_{k}",) for k in range(len(sizes))} | {"dst": ("out",)}
        self.fields = dict(widths=(ctypes.c_long * CONCAT_INPUTS)(*widths), outer=math.prod(sizes[0][:axis]),
                           inputs=len(sizes), grain=STREAM_ELEMENTS if stream else ONE_THREAD, team=int(stream))


class _EmbeddingConcatPlan(ctypes.Structure):  # embedding_concat_plan
    _fields_ = [("get_handle", ctypes.c_void_p), ("ids", ctypes.c_void_p), ("in_", ctypes.c_void_p * EC_PARTS),
                ("table", ctypes.c_void_p * EC_PARTS), ("out", ctypes.c_void_p), ("width", ctypes.c_long * EC_PARTS),
                ("vocab", ctypes.c_long * EC_PARTS), ("field", ctypes.c_long * EC_PARTS), ("rows", ctypes.c_long),
                ("fields", ctypes.c_long), ("parts", ctypes.c_int), ("ids_int32", ctypes.c_int)]


class EmbeddingConcat(NativeKernel):
    """y = Concat(part_k if fields[k] < 0 else part_k[ids[:, fields[k]]], axis=1) (kiln::EmbeddingConcat,
    kiln/ops/fused.py): step input 0 the ids [N, F] (int64 or int32), step input k + 1 part k, a table [V, D] (in
    `tables`, by part: baked into the plan) or an activation [N, C] (float32, in `sizes` by step input)."""

    PLAN, FUNCTION = _EmbeddingConcatPlan, "kiln_embedding_concat"

    def __init__(self, ids_size: tuple[int, ...], ids_dtype: torch.dtype, fields: list[int],
                 sizes: dict[int, tuple[int, ...]], tables: dict[int, torch.Tensor]):
        super().__init__(f"embedding concat of {len(fields)} parts, ids {list(ids_size)}")
        if len(fields) > EC_PARTS:
            raise ValueError(f"{self.what}: {len(fields)} parts, at most {EC_PARTS}")
        if len(ids_size) != 2 or ids_dtype not in (torch.int64, torch.int32):
            raise ValueError(f"{self.what}: ids must be [N, F] int64 or int32, given {list(ids_size)} {ids_dtype}")
        rows, columns = ids_size
        self._tables = {k: t.detach().to(torch.float32).contiguous() for k, t in tables.items()}
        widths, vocabs = [], []
        for k, field in enumerate(fields):
            if field >= 0:
                table = self._tables.get(k)
                if table is None or table.dim() != 2 or field >= columns:
                    raise ValueError(f"{self.what}: part {k} looks up field {field} of {columns} in no 2-D table")
                vocabs.append(table.shape[0])
                widths.append(table.shape[1])
            else:
                size = sizes.get(k + 1)
                if size is None or len(size) != 2 or size[0] != rows:
                    raise ValueError(f"{self.what}: part {k} must be [{rows}, C], given {size}")
                vocabs.append(0)
                widths.append(size[1])
        self.output_size = (rows, sum(widths))
        longs = ctypes.c_long * EC_PARTS
        self.roles = {0: ("ids",)} | {k + 1: (f"in_{k}",) for k, field in enumerate(fields) if field < 0} | \
            {"dst": ("out",)}
        self.fields = dict(
            table=(ctypes.c_void_p * EC_PARTS)(*[self._tables[k].data_ptr() if k in self._tables and fields[k] >= 0
                                                 else None for k in range(len(fields))]),
            width=longs(*widths), vocab=longs(*vocabs), field=longs(*[max(f, 0) for f in fields]), rows=rows,
            fields=columns, parts=len(fields), ids_int32=int(ids_dtype == torch.int32))
