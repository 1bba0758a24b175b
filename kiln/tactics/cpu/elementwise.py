"""CPU tactics for kiln::Elementwise programs and Concat in kiln's C (kiln/kernels/cpu/elementwise.c),
native-segment members:

    cpu.elementwise.native  a fused chain of float32 elementwise ops (kiln/passes/fusion/elementwise.py),
                            inputs broadcast, constants baked into the plan; int8/uint8 inputs dequantized and
                            the output quantized in the loop (kiln/passes/fusion/elementwise_dequantize.py fuse_int8_*)
    cpu.elementwise.nhwc    the same chain over 4-D images as a segment lays them out (NHWC rows [N·H·W, C]), its
                            constants one value per channel (a BatchNormalization no layer absorbed, and its ReLU)
    cpu.concat.native       Concat of float32 tensors along any axis (up to CONCAT_INPUTS: a DenseNet block's)
    cpu.embedding_concat.native  a recommender's per-field embedding lookups and their Concat (kiln::EmbeddingConcat)
    cpu.add.nhwc            Add of two 4-D images of one size as a segment lays them out (ConvNeXt's residual)
    cpu.concat.nhwc         Concat of 4-D values along any axis as a segment lays them out (NHWC), between
                            convolutions (MobileViT's fusion of its input and its transformer's output) and
                            in Swin's shifted windows

Why: their default runs each program line as a torch call (an allocation and, past torch's grain, a
parallel region each) and splits the native segment around it; a DCN recommender's cross layers,
x0 * (W x + b) + x, and its Concat before the head took a third of its run on a shared 2-core VM.
cpu.elementwise.native runs a program over rank-4 inputs as a step of its own (a segment's 4-D values are NHWC in
memory), unless cpu.elementwise.nhwc takes it.
"""

from __future__ import annotations

from typing import Any

import torch

from kiln.kernels.cpu import elementwise as kernels
from kiln.kernels.cpu import transformer as transformer_kernels
from kiln.plan.spec import StepSpec
from kiln.tactics.cpu.broadcast import broadcast_input_shapes
from kiln.tactics.cpu.native_member import prepared_native, sizes_config
from kiln.tactics.registry import register
from kiln.tactics.tactic import InputMeta, NativeStep, Tactic, resizable, same_primitive
from kiln.tactics.tactic import attribute as _attr

_F32 = torch.float32
_CL = torch.channels_last


def _float_inputs(inputs: list[InputMeta]) -> str | None:
    if not transformer_kernels.available():
        return f"kiln's C kernels are not built: {transformer_kernels.reason()}"
    if any(m.shape is None or m.dtype != _F32 for m in inputs):
        return "only float32 tensors of known shapes"
    return None


def _computed_float_inputs(inputs: list[InputMeta], fewest: int, most: int = kernels.EW_INPUTS) -> str | None:
    """Why `inputs` are not `fewest` to `most` float32 tensors computed at run time (None: they are)."""
    if (why := _float_inputs(inputs)) is not None:
        return why
    if not fewest <= len(inputs) <= most:
        return f"{len(inputs)} inputs: {fewest} to {most}"
    if any(m.constant for m in inputs):
        return "a constant input (folded or left to the default)"
    return None


# ---- kiln::Elementwise -------------------------------------------------------------------------------

def _quantization(step: StepSpec, inputs: list[InputMeta]) -> kernels.Quantization | str:
    """The step's int8/uint8 Dequantize / Quantize lines as elementwise.c runs them (kernels.quantization; the
    constants' values are not needed to judge, their dtypes and sizes are)."""
    dtypes = {k: m.dtype for k, m in enumerate(inputs)}
    constants = {k: torch.zeros(m.shape, dtype=m.dtype) for k, m in enumerate(inputs)
                 if m.constant and m.shape is not None}
    return kernels.quantization(list(_attr(step, "code", [])), dtypes, constants)


def _elementwise_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    quantized = _quantization(step, inputs)
    if isinstance(quantized, str):
        return quantized
    zero_points = {int(line.split()[3][1:]) for line in _attr(step, "code", []) if len(line.split()) == 4}
    float_inputs = [m for k, m in enumerate(inputs) if k not in quantized.inputs and k not in zero_points]
    if (why := _float_inputs(float_inputs)) is not None:
        return why
    if any(inputs[k].shape is None for k in quantized.inputs):
        return "only tensors of known shapes"
    lines = kernels.parse(quantized.code, len(inputs))
    if isinstance(lines, str):
        return lines
    shapes = broadcast_input_shapes(inputs)
    if isinstance(shapes, str):
        return shapes
    if torch.broadcast_shapes(*shapes).numel() == 0:
        return "an empty output"
    return True


def _elementwise_prepare(step: StepSpec, constants: list[Any], device: torch.device):
    code = list(_attr(step, "code", []))
    baked = {k: c for k, c in enumerate(constants) if isinstance(c, torch.Tensor)}
    # the 8-bit activations a Dequantize line reads (the others float32): from the program and its zero points
    eight_bit = {int(line.split()[1][1:]): baked[int(line.split()[3][1:])].dtype for line in code
                 if line.split()[0] == "Dequantize" and len(line.split()) == 4 and int(line.split()[3][1:]) in baked}

    def reads(sizes: dict[int, tuple[int, ...]]) -> dict[int, torch.dtype]:
        return {k: eight_bit.get(k, _F32) for k in sizes if k not in baked}

    tables: dict = {}  # the layer's lookup tables by row width, shared by its kernels at every size

    return prepared_native(step, reads, lambda sizes: kernels.Elementwise(code, sizes, baked, eight_bit,
                                                                          tables=tables), max_rank=3)


register(Tactic(
    name="cpu.elementwise.native", op_type="Elementwise", domain="kiln", device="cpu",
    dtypes=(_F32, torch.uint8, torch.int8),
    supports=_elementwise_supports, configure=sizes_config, prepare=_elementwise_prepare,
    available=transformer_kernels.available, native=True,
    description="a chain of float32 elementwise ops, broadcast, in kiln's C, a native-segment member",
))


# ---- a lone activation ---------------------------------------------------------------------------------

# Activations the elementwise fusion leaves alone (it fuses chains of two ops or more): a model of one Relu, a scorer's
# Sigmoid after a Gemm it could not take. Their default is a torch call outside any native segment; as a
# one-line program in kiln's C a model of that one layer is one call of its loop (kiln/runtime/native_runs.py)
LONE_ACTIVATIONS = ("Relu", "Sigmoid", "Tanh")


def _lone_activation_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    if (why := _computed_float_inputs(inputs, 1)) is not None:
        return why
    if len(inputs) != 1:
        return f"{len(inputs)} inputs: one"
    if inputs[0].shape is None or 0 in inputs[0].shape:
        return "an empty or unknown shape"
    if len(inputs[0].shape) > 3:  # no segment member (a segment's 4-D values are NHWC): torch's, as before
        return f"rank {len(inputs[0].shape)}: 3 at most"
    return True


def _lone_activation_prepare(step: StepSpec, constants: list[Any], device: torch.device):
    code = [f"{step.op_type} i0"]

    def reads(sizes: dict[int, tuple[int, ...]]) -> dict[int, torch.dtype]:
        return {0: _F32}

    return prepared_native(step, reads, lambda sizes: kernels.Elementwise(code, sizes, {}), max_rank=3)


for _op in LONE_ACTIVATIONS:
    register(Tactic(
        name=f"cpu.{_op.lower()}.native", op_type=_op, domain="", device="cpu", dtypes=(_F32,),
        supports=_lone_activation_supports, configure=sizes_config, prepare=_lone_activation_prepare,
        available=transformer_kernels.available, native=True,
        description=f"a lone {_op} as a one-line elementwise program in kiln's C, a native-segment member",
    ))


# ---- Concat ------------------------------------------------------------------------------------------

def _concat_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    if (why := _computed_float_inputs(inputs, 1, kernels.CONCAT_INPUTS)) is not None:
        return why
    rank, axis = len(inputs[0].shape), int(_attr(step, "axis", 0))
    if rank == 0 or not -rank <= axis < rank:
        return f"axis {axis} of a rank-{rank} tensor"
    if rank == 4:  # timed as a member here it would take the credit of one, and it is not
        return "4-D values: cpu.concat.nhwc runs those inside a segment"
    try:
        kernels.Concat([m.shape for m in inputs], axis)
    except ValueError as e:
        return str(e)
    return True


def _concat_prepare(step: StepSpec, constants: list[Any], device: torch.device):
    axis = int(_attr(step, "axis", 0))

    def reads(sizes: dict[int, tuple[int, ...]]) -> dict[int, torch.dtype]:
        return {k: _F32 for k in sizes}

    return prepared_native(step, reads, lambda sizes: kernels.Concat([sizes[k] for k in sorted(sizes)], axis),
                           max_rank=3)


register(Tactic(
    name="cpu.concat.native", op_type="Concat", domain="", device="cpu", dtypes=(_F32,),
    supports=_concat_supports, configure=sizes_config, prepare=_concat_prepare,
    available=transformer_kernels.available, native=True,
    description="Concat of float32 tensors in kiln's C, a native-segment member",
))


# ---- Concat of NHWC images along channels ----------------------------------------------------------

def _nhwc_concat_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    if (why := _computed_float_inputs(inputs, 2, kernels.CONCAT_INPUTS)) is not None:
        return why
    shapes = [tuple(m.shape) for m in inputs]
    axis = int(_attr(step, "axis", 0))
    if any(len(s) != 4 for s in shapes) or not -4 <= axis < 4:
        return "only 4-D values"
    axis %= 4
    if any(s[:axis] != shapes[0][:axis] or s[axis + 1:] != shapes[0][axis + 1:] for s in shapes):
        return f"values {[list(s) for s in shapes]} differ off axis {axis}"
    return True


_IN_MEMORY = (0, 3, 1, 2)  # where each axis of [N, C, H, W] lies in its NHWC memory [N, H, W, C]


def _nhwc_concat_prepare(step: StepSpec, constants: list[Any], device: torch.device):
    sizes = [tuple(size) for _, size in sorted((int(k), size) for k, size in step.tactic_config["input_sizes"])]
    axis = int(_attr(step, "axis", 0)) % 4

    def nhwc_concat(at_sizes: list[tuple[int, ...]]) -> kernels.Concat:
        # NHWC memory: the concat of the row-major [N, H, W, C] views along the axis's place there (channels: rows)
        return kernels.Concat([(s[0], s[2], s[3], s[1]) for s in at_sizes], _IN_MEMORY[axis], stream=True)

    kernel = nhwc_concat(sizes)

    def launch(ctx, *xs, **_attributes):
        if [tuple(x.shape) for x in xs] != sizes:
            return torch.cat(xs, dim=axis)  # another size than the tuned one: torch's own
        y = kernel({k: x.contiguous(memory_format=_CL).permute(0, 2, 3, 1) for k, x in enumerate(xs)})
        return y.permute(0, 3, 1, 2)  # [N, C, H, W] channels-last

    def native_of(at_sizes: list[tuple[int, ...]], kernel: Any) -> NativeStep:
        out = tuple(sum(s[axis] for s in at_sizes) if d == axis else at_sizes[0][d] for d in range(4))
        return NativeStep(at_sizes[0], out, same_primitive(kernel),
                          reads={k: (size, _F32) for k, size in enumerate(at_sizes)}, channels_last=True)

    @resizable
    def native_at(read_sizes: dict[int, tuple[int, ...]]) -> NativeStep:
        # another batch of a concat off the first axis (Swin's shifted windows): the same concat of each image
        at_sizes = [tuple(read_sizes[k]) for k in range(len(sizes))]
        if at_sizes == sizes:
            return native_of(sizes, kernel)
        if axis == 0 or any(len(s) != 4 or s[0] != at_sizes[0][0] or s[1:] != t[1:] for s, t in zip(at_sizes, sizes)):
            raise ValueError(f"Concat {step.name!r}: sizes {at_sizes} are not another batch of {sizes}")
        return native_of(at_sizes, nhwc_concat(at_sizes))

    launch.native = native_at({k: size for k, size in enumerate(sizes)})
    return launch


register(Tactic(
    name="cpu.concat.nhwc", op_type="Concat", domain="", device="cpu", dtypes=(_F32,),
    supports=_nhwc_concat_supports, configure=sizes_config, prepare=_nhwc_concat_prepare, layout="channels_last",
    available=transformer_kernels.available, native=True,
    description="Concat of float32 4-D values along any axis as a segment lays them out (NHWC) in kiln's C, a "
                "native-segment member",
))


# ---- Add of two NHWC images of one size ----------------------------------------------------------------

def _nhwc_add_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    if (why := _float_inputs(inputs)) is not None:
        return why
    if len(inputs) != 2 or any(m.constant for m in inputs):
        return "two tensors computed at run time"
    a, b = (tuple(m.shape) for m in inputs)
    if len(a) != 4 or a != b:
        return f"only two 4-D images of one size (given {list(a)} and {list(b)}): no broadcast"
    return True


def _nhwc_add_prepare(step: StepSpec, constants: list[Any], device: torch.device):
    size = tuple(step.tactic_config["input_sizes"][0][1])
    n, c, h, w = size
    # both operands and the sum laid out alike (NHWC in a segment): an add of rows [N*H*W, C]
    kernel = transformer_kernels.Add((n * h * w, c), (n * h * w, c))

    def launch(ctx, a, b, **_attributes):
        if tuple(a.shape) != size or tuple(b.shape) != size:
            return a + b  # another size than the tuned one: torch's own
        rows = {k: x.contiguous(memory_format=_CL).permute(0, 2, 3, 1).reshape(n * h * w, c) for k, x in enumerate((a, b))}
        return kernel(rows).reshape(n, h, w, c).permute(0, 3, 1, 2)  # [N, C, H, W] channels-last

    kernels_at = {size: kernel}  # the kernel at each size a segment bound (a dynamic batch's)

    @resizable
    def native_at(sizes: dict[int, tuple[int, ...]]) -> NativeStep:
        """The add at other sizes of both operands (one size, 4-D): a segment over a dynamic batch (ConvNeXt's
        residuals) binds it at each batch; without it the whole segment ran layer by layer there."""
        a, b = (tuple(sizes[k]) for k in (0, 1))
        if a != b or len(a) != 4:
            raise ValueError(f"{step.name}: two 4-D images of one size only, given {list(a)} and {list(b)}")
        found = kernels_at.get(a)
        if found is None:
            n_, c_, h_, w_ = a
            found = kernels_at.setdefault(a, transformer_kernels.Add((n_ * h_ * w_, c_), (n_ * h_ * w_, c_)))
        return NativeStep(a, a, same_primitive(found), reads={0: (a, _F32), 1: (a, _F32)}, channels_last=True)

    launch.native = native_at({0: size, 1: size})
    return launch


register(Tactic(
    name="cpu.add.nhwc", op_type="Add", domain="", device="cpu", dtypes=(_F32,),
    supports=_nhwc_add_supports, configure=sizes_config, prepare=_nhwc_add_prepare, layout="channels_last",
    available=transformer_kernels.available, native=True,
    description="Add of two float32 NHWC images of one size in kiln's C (a residual between convolutions), "
                "a native-segment member",
))


# ---- kiln::Elementwise over NHWC images, constants per channel ---------------------------------------------

# A chain over 4-D images between convolutions whose constants are one value per channel (or one in all): a
# BatchNormalization no layer absorbed and its ReLU (DenseNet's BN-ReLU-Conv after each Concat, made Mul/Add by
# kiln/passes/batchnorm.py batchnorm_as_affine). cpu.elementwise.native runs a 4-D program as a step of its own, so
# each split the segment and read and wrote NCHW copies of NHWC images: DenseNet-121's 62 BatchNormalization and 62
# Relu steps took 20 of its 86 ms (bench/results/zoo-new-zen4-2026-12-07c.md). In NHWC memory an image is the rows
# [N·H·W, C] and a per-channel constant a row of C: the same program, broadcast over rows.

def _channel_constant(shape: tuple[int, ...], channels: int) -> bool:
    """Whether a constant of `shape` broadcasts over [N, C, H, W] along the channels only (or is one value)."""
    padded = (1,) * (4 - len(shape)) + tuple(shape)
    return len(padded) == 4 and padded[0] == padded[2] == padded[3] == 1 and padded[1] in (1, channels)


def _nhwc_elementwise_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    if (why := _float_inputs(inputs)) is not None:
        return why
    computed = [tuple(m.shape) for m in inputs if not m.constant]
    if not computed or len(computed[0]) != 4 or any(s != computed[0] for s in computed):
        return f"computed inputs {[list(s) for s in computed]}: 4-D images of one size only"
    channels = computed[0][1]
    if not all(_channel_constant(tuple(m.shape), channels) for m in inputs if m.constant):
        return "a constant that is not one value per channel"
    lines = kernels.parse(list(_attr(step, "code", [])), len(inputs))
    return lines if isinstance(lines, str) else True


def _nhwc_elementwise_prepare(step: StepSpec, constants: list[Any], device: torch.device):
    code = list(_attr(step, "code", []))
    baked = {k: c.reshape(-1) for k, c in enumerate(constants) if isinstance(c, torch.Tensor)}  # [C] or [1]
    computed = [int(k) for k, _ in step.tactic_config["input_sizes"] if int(k) not in baked]
    size = tuple(dict((int(k), tuple(s)) for k, s in step.tactic_config["input_sizes"])[computed[0]])
    kernels_at: dict[tuple[int, ...], kernels.Elementwise] = {}  # the program at each image size a segment bound

    def kernel_at(at: tuple[int, ...]) -> kernels.Elementwise:
        found = kernels_at.get(at)
        if found is None:
            n, c, h, w = at
            rows = {k: (n * h * w, c) for k in computed}
            found = kernels_at.setdefault(at, kernels.Elementwise(code, rows, baked, stream=True))
        return found

    def launch(ctx, *xs, **_attributes):
        at = tuple(xs[computed[0]].shape)
        if any(tuple(xs[k].shape) != at for k in computed):
            raise ValueError(f"{step.name}: computed inputs of one size only, given {[list(x.shape) for x in xs]}")
        n, c, h, w = at
        rows = {k: xs[k].contiguous(memory_format=_CL).permute(0, 2, 3, 1).reshape(n * h * w, c) for k in computed}
        return kernel_at(at)(rows).reshape(n, h, w, c).permute(0, 3, 1, 2)  # [N, C, H, W] channels-last

    @resizable
    def native_at(sizes: dict[int, tuple[int, ...]]) -> NativeStep:
        """The program at another image size (a dynamic batch's), every computed input of that size."""
        at = tuple(sizes[computed[0]])
        if len(at) != 4 or any(tuple(sizes[k]) != at for k in computed):
            raise ValueError(f"{step.name}: 4-D computed inputs of one size only, given {sizes}")
        return NativeStep(at, at, same_primitive(kernel_at(at)), reads={k: (at, _F32) for k in computed},
                          channels_last=True)

    launch.native = native_at({k: size for k in computed})
    return launch


register(Tactic(
    name="cpu.elementwise.nhwc", op_type="Elementwise", domain="kiln", device="cpu", dtypes=(_F32,),
    supports=_nhwc_elementwise_supports, configure=sizes_config, prepare=_nhwc_elementwise_prepare,
    layout="channels_last", available=transformer_kernels.available, native=True,
    description="a chain of float32 elementwise ops over 4-D images, constants per channel, as a segment lays "
                "them out (NHWC) in kiln's C, a native-segment member",
))


# ---- kiln::EmbeddingConcat ----------------------------------------------------------------------------

def _embedding_concat_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    if not transformer_kernels.available():
        return f"kiln's C kernels are not built: {transformer_kernels.reason()}"
    fields = [int(f) for f in _attr(step, "fields", [])]
    ids, parts = inputs[0], inputs[1:]
    if ids.shape is None or len(ids.shape) != 2 or ids.dtype not in (torch.int64, torch.int32) or ids.constant:
        return "ids must be a computed [N, F] int64 or int32 tensor"
    if len(fields) != len(parts) or not 1 <= len(parts) <= kernels.EC_PARTS:
        return f"{len(parts)} parts and {len(fields)} fields: 1 to {kernels.EC_PARTS} parts, one field each"
    for k, (part, field) in enumerate(zip(parts, fields)):
        if part.shape is None or len(part.shape) != 2 or part.dtype != _F32:
            return f"part {k}: only 2-D float32 tensors of known shapes"
        if field >= 0 and not part.constant:
            return f"part {k}: a table looked up must be a weight of the engine"
        if field < 0 and (part.constant or part.shape[0] != ids.shape[0]):
            return f"part {k}: a part copied as it is must be computed, with the ids' {ids.shape[0]} rows"
    return True


def _embedding_concat_config(step: StepSpec, inputs: list[InputMeta]) -> dict[str, Any]:
    return {**sizes_config(step, inputs), "ids_dtype": str(inputs[0].dtype).removeprefix("torch.")}


def _embedding_concat_prepare(step: StepSpec, constants: list[Any], device: torch.device):
    fields = [int(f) for f in _attr(step, "fields", [])]
    tables = {k - 1: c for k, c in enumerate(constants) if k >= 1 and isinstance(c, torch.Tensor)}
    ids_dtype = torch.int32 if step.tactic_config.get("ids_dtype") == "int32" else torch.int64

    def reads(sizes: dict[int, tuple[int, ...]]) -> dict[int, torch.dtype]:
        return {0: ids_dtype} | {k: _F32 for k in sizes if k >= 1 and fields[k - 1] < 0}

    return prepared_native(step, reads, lambda sizes: kernels.EmbeddingConcat(sizes[0], ids_dtype, fields, sizes,
                                                                              tables), max_rank=2)


register(Tactic(
    name="cpu.embedding_concat.native", op_type="EmbeddingConcat", domain="kiln", device="cpu",
    dtypes=(torch.int64, torch.int32),
    supports=_embedding_concat_supports, configure=_embedding_concat_config, prepare=_embedding_concat_prepare,
    available=transformer_kernels.available, native=True,
    description="a recommender's per-field embedding lookups and their Concat in one C loop, a native-segment member",
))
