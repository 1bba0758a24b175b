"""CPU tactic for kiln::Relayout on kiln's C copy (kiln/kernels/cpu/relayout.py), a native-segment member.

    cpu.relayout.native   a chain of Reshapes/Transposes (kiln/passes/fusion/relayout.py) as one strided
                          copy of float32 values as a segment lays them out (4-D: NHWC)
    cpu.slice.native      a Slice of constant bounds, the same copy from another first element
    cpu.gather.slice      a Gather of an activation by constant indices that step evenly (a recurrent net's
                          last time step, x[:, -1]): the same copy
    cpu.resize.nearest    a nearest Resize (or Upsample) by constant scales or sizes whose output a strided walk gives
                          (an integer upsample: NHWC rows of channels repeated, stride 0): the same copy

Why: MobileViT-S's unfold and fold ran as 15 torch steps a run, each splitting the native segment around
its convolutions and transformer layers; here each is one call of the segment loop (rows of channels
copied whole on the NHWC side). A kernel is bound per input size; a size the kernel cannot walk (its
table not strided, or past TABLE_LIMIT elements) runs as a step of its own on torch. A relayout whose output, as a
segment lays values out, is its input's memory byte for byte (ConvNeXt's permute of an NHWC image to [N, H·W, C] rows
and back: 18 copies a run of convnext_tiny) offers an alias form (NativeStep.aliasing), which a segment takes where
the input dies at the relayout.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kiln.kernels.cpu import relayout
from kiln.ops.registry import OpContext, lookup
from kiln.ops.relayout import TABLE_LIMIT
from kiln.plan.spec import StepSpec
from kiln.tactics.registry import register
from kiln.tactics.tactic import InputMeta, NativeStep, PlanRule, SizedPlan, Tactic, resizable, same_primitive
from kiln.tactics.tactic import attribute as _attr

_F32 = torch.float32


def _attributes(step: StepSpec) -> tuple[list[int], list[int], tuple[int, ...]]:
    return ([int(d) for d in _attr(step, "dims", [])], [int(p) for p in _attr(step, "perm", [])],
            tuple(int(s) for s in _attr(step, "shape", [])))


def _resolved(sizes: Any, numel: int) -> list[int]:
    """dims or shape with its -1 (a dynamic batch's dim, kiln/passes/fusion/relayout.py) at `numel` elements."""
    sizes = [int(s) for s in sizes]
    if -1 in sizes:
        known = int(np.prod([s for s in sizes if s != -1]))
        sizes[sizes.index(-1)] = numel // known if known and numel % known == 0 else 0
    return sizes


def _supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    if not relayout.available():
        return f"kiln's relayout kernel is not built: {relayout.reason()}"
    x = inputs[0]
    if x.shape is None or x.dtype != _F32:
        return "only float32 inputs of known shapes"
    numel = int(np.prod(x.shape))
    if not 0 < numel <= TABLE_LIMIT:
        return f"{numel} elements: 1 to {TABLE_LIMIT}"
    dims, perm, shape = _attributes(step)
    dims, shape = _resolved(dims, numel), tuple(_resolved(shape, numel))
    if int(np.prod(dims)) != numel or int(np.prod(shape)) != numel or sorted(perm) != list(range(len(dims))):
        return f"dims {dims}, perm {perm} and shape {list(shape)} do not move the input's {numel} elements"
    try:
        relayout.memory_walk(tuple(x.shape), relayout.relayout_move(dims, perm, shape))
    except ValueError as e:
        return str(e)
    return True


def _configure(step: StepSpec, inputs: list[InputMeta]) -> dict[str, Any]:
    return {"input_size": list(inputs[0].shape)}


def _prepare(step: StepSpec, constants: list[Any], device: torch.device):
    dims, perm, shape = _attributes(step)
    tuned = tuple(step.tactic_config["input_size"])
    move = relayout.relayout_move(dims, perm, shape)  # a -1 (a dynamic batch's dim) is torch's at every size
    kernel = relayout.Relayout(tuned, move)  # at load
    # the attributes hold for the tuned size only (or, with a -1, at every size whose elements it divides): at
    # another, the op's own code says why not
    return _launch(tuned, kernel, lambda x: x.reshape(dims).permute(perm).reshape(shape), move,
                   resizes=-1 in dims or -1 in shape, dims=tuple(dims), perm=tuple(perm), shape=tuple(shape))


def _launch(tuned: tuple[int, ...], kernel: relayout.Relayout, other_sizes: Callable[[torch.Tensor], torch.Tensor],
            move: Callable[[torch.Tensor], torch.Tensor], resizes: bool = False,
            dims: tuple[int, ...] = (), perm: tuple[int, ...] = (), shape: tuple[int, ...] = (),
            plan_at: PlanRule | None = None):
    """The kernel at the tuned input size (and as a segment member), `other_sizes` at any other. A 4-D input whose
    NHWC order differs from row-major offers the walk of its row-major memory too (NativeStep.reading_rows: after a
    recurrent layer's Y [S, D, N, H], which kiln's loop writes row-major). `resizes`: `move` holds at every input
    size (a Relayout over a dynamic batch), so a segment binds the walk at new sizes (NativeStep.at) in either form.
    `plan_at`: the walk's plan fields at other sizes without finding it (_last_axis_slice_rule), where it has one."""
    def launch(ctx, x, *_inputs, **_attributes):
        return kernel(x) if tuple(x.shape) == tuned else other_sizes(x)

    def walk_at(size: tuple[int, ...], rows_input: bool) -> relayout.Relayout:
        if size == tuned and not rows_input:
            return kernel
        try:
            return relayout.Relayout(size, move, kernel.what.split(" ")[0], rows_input=rows_input)
        except RuntimeError as e:  # torch's reshape: the -1 does not divide this size's elements
            raise ValueError(f"{kernel.what.split(' ')[0]} at {list(size)}: {e}") from e

    def native_of(size: tuple[int, ...], rows_input: bool) -> NativeStep:
        walk = walk_at(size, rows_input)  # ValueError: no strided walk gives the output at this size
        four_d_order = len(size) == 4 and size[1] != 1 and size[2] * size[3] != 1
        return NativeStep(size, walk.output_size, same_primitive(walk), rows_input=rows_input, plan_at=plan_at,
                          reading_rows=(lambda: rows_at(size)) if four_d_order and not rows_input else None,
                          aliasing=(lambda: alias_at(size, rows_input)) if walk.moves_nothing else None)

    def alias_of(size: tuple[int, ...], rows_input: bool) -> NativeStep:
        """The relayout at `size` as an alias of its input's memory (NativeStep.aliasing); at another size of a
        dynamic profile where the walk does move bytes, a ValueError (there the layers run one by one, as for any
        layer a segment cannot bind at a size)."""
        rule = rule_for(rows_input)
        out = rule[1](size) if rule is not None else None
        if out is None:  # no batch-block answer: the walk at this size says (~25 ms at ConvNeXt's batch 32)
            walk = walk_at(size, rows_input)
            if not walk.moves_nothing:
                raise ValueError(f"{walk.what}: moves bytes at this size, not an alias")
            out = walk.output_size
        return NativeStep(size, out, None, alias=True, rows_input=rows_input,
                          plan_at=rule[0] if rule is not None else None)

    rules: dict[bool, tuple | None] = {}

    def rule_for(rows_input: bool) -> tuple | None:
        """The alias's size rule in this form and its batch-block answer (_alias_rule), made at its first alias
        (checked against the walk at the tuned size through alias_of, which asks here again: None meanwhile)."""
        if rows_input not in rules:
            rules[rows_input] = None
            rules[rows_input] = _alias_rule(tuned, dims, perm, shape, rows_input, alias_of)
        return rules[rows_input]

    def alias_at(size: tuple[int, ...], rows_input: bool) -> NativeStep:
        step = alias_of(size, rows_input)
        step.at = resizable(lambda other: alias_of(tuple(other), rows_input))
        return step

    plain_at = resizable(lambda size: native_of(tuple(size), False)) if resizes else None
    rows_at = resizable(lambda size: native_of(tuple(size), True)) if resizes \
        else (lambda size: native_of(tuple(size), True))
    launch.native = plain_at(tuned) if resizes else native_of(tuned, False)
    return launch


def _alias_rule(tuned: tuple[int, ...], dims: tuple[int, ...], perm: tuple[int, ...],
                shape: tuple[int, ...], rows_input: bool, alias_of: Callable[..., NativeStep]
                ) -> tuple[PlanRule, Callable[[tuple], tuple | None]] | None:
    """The alias form's output size at other batches as arithmetic on the input's (NativeStep.plan_at: no fields,
    an alias has no plan), or None where its answer could differ from alias_of's (the walk worked out at the size).

    Exact where the -1 is the batch's, the first of both dims and shape, and the permutation keeps axis 0 first: an
    input of the tuned size past its batch dim is then N blocks of one layout (a segment lays a value out batch
    first, row-major or NHWC), each row of dims and of shape inside one block (their other dims divide a block),
    each row permuted alike; so the walk moves nothing at any batch N >= 1 iff it does at the tuned one, and the
    output is [N·block / prod(shape[1:]), *shape[1:]] (an alias has no kernel: no TABLE_LIMIT). At other sizes the
    rule asks alias_of (the walk built there): such a rule is run, not traced. (the rule, that batch-block answer:
    the output size or None), which alias_of takes at every batch too: the walk it built at each new batch (an index
    table, strided_form) cost ~25 ms an alias at ConvNeXt-tiny's batch 32, bound member by member. Without the
    rule a segment's view with a relayout alias evaluated the member by making its NativeStep and was never traced
    (kiln/runtime/view_trace.py)."""
    block = math.prod(tuned[1:])
    rest_dims, rest_shape = math.prod(dims[1:]), math.prod(shape[1:])
    if not (len(tuned) >= 1 and dims and shape and dims[0] == -1 and shape[0] == -1 and perm and perm[0] == 0
            and -1 not in dims[1:] and -1 not in shape[1:] and rest_dims > 0 and rest_shape > 0
            and block % rest_dims == 0 and block % rest_shape == 0):
        return None
    inner, per_block = tuple(tuned[1:]), block // rest_shape

    def batch_block(in_size: tuple) -> tuple | None:
        if len(in_size) == len(tuned) and tuple(in_size[1:]) == inner and 1 <= in_size[0]:
            return (in_size[0] * per_block, *shape[1:])
        return None

    def sized(in_size: tuple) -> SizedPlan:
        out = batch_block(in_size)
        if out is None:
            out = tuple(alias_of(tuple(in_size), rows_input).output_size)  # ValueError as at's
        return SizedPlan((out,), {})

    try:
        if sized(tuned).output_sizes != (tuple(alias_of(tuned, rows_input).output_size),):
            return None
    except ValueError:  # not an alias at the tuned size in this form
        return None
    return PlanRule(sized, ("alias", "Relayout", dims, perm, shape, inner, rows_input), traceable=True), batch_block


register(Tactic(
    name="cpu.relayout.native", op_type="Relayout", domain="kiln", device="cpu", dtypes=(_F32,),
    supports=_supports, configure=_configure, prepare=_prepare, layout="channels_last",
    available=relayout.available, native=True,
    description="a Reshape/Transpose chain as one strided copy in kiln's C (4-D: NHWC), a native-segment member",
))


# ---- Slice -------------------------------------------------------------------------------------------

def _slice_move(step: StepSpec, constants: list[Any]) -> Callable[[torch.Tensor], torch.Tensor]:
    """The Slice (or Gather) as a function of its data (the op's own code, its constant bounds or indices)."""
    op = lookup(step.op_type, step.domain).fn
    ctx = OpContext(name=step.name, op_type=step.op_type, domain=step.domain, opset=step.opset,
                    num_inputs=len(step.inputs), num_outputs=1)
    attributes = dict(step.attributes)
    return lambda x: op(ctx, x, *constants[1:], **attributes)


def _slice_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    if not relayout.available():
        return f"kiln's relayout kernel is not built: {relayout.reason()}"
    x = inputs[0]
    if x.shape is None or x.dtype != _F32:
        return "only float32 inputs of known shapes"
    if any(m is not None and not m.constant for m in inputs[1:]):
        return "an input besides the data is computed at run time (a Slice's bounds, a Gather's indices)"
    numel = int(np.prod(x.shape))
    if not 0 < numel <= TABLE_LIMIT:
        return f"{numel} elements: 1 to {TABLE_LIMIT}"
    return True


def _prepare_slice(step: StepSpec, constants: list[Any], device: torch.device):
    """A Slice, Gather or nearest Resize as the walk of its data that its own code gives (at the tuned size)."""
    tuned = tuple(step.tactic_config["input_size"])
    move = _slice_move(step, constants)
    # at load; where no walk gives the op's output, this raises and the tactic fails its check
    kernel = relayout.Relayout(tuned, move, step.op_type.lower())
    # the walk is found from the op's own code at each size: a Gather of constant indices (a forecaster's last step
    # over a dynamic batch) binds at new sizes, and so does a Slice that leaves the first axis whole (Swin's shifted
    # windows at another batch); another Slice's walk is kept to the tuned size, as before
    resizes = step.op_type == "Gather" or _keeps_first_axis(step, constants, len(tuned)) \
        or _resize_keeps_batch(step, constants, len(tuned))
    return _launch(tuned, kernel, move, move, resizes=resizes,
                   plan_at=_last_axis_slice_rule(step, constants, tuned, kernel) if resizes else None)


def _last_axis_slice_rule(step: StepSpec, constants: list[Any], tuned: tuple[int, ...], kernel: relayout.Relayout
                          ) -> PlanRule | None:
    """The walk's plan fields (base, rank, sizes, strides) at other leading sizes of a Slice of one row-major
    input's last axis by constant bounds, step 1 (a packed q|k|v GEMM output's q, k and v: llama_tiny's layers), by
    arithmetic on the sizes, so a segment's view at new sizes is traced (without it memory_walk ran torch at each
    new shape and llama_tiny's two q|k|v segments walked at every call: bench/results/first-shape-2026-12-06.md).
    The walk is memory_walk's (strided_form's merge of a row-major slice): [(rows, width), (out, 1)], the rows' dim
    gone at one row, the columns' at one column. None where the slice is not of that form or the form does not give
    back the kernel's walk at the tuned size."""
    rank = len(tuned)
    if step.op_type != "Slice" or not 1 <= rank <= 3 or len(constants) < 4 or constants[3] is None:
        return None
    if [int(a) % rank for a in constants[3].tolist()] != [rank - 1]:
        return None
    if len(constants) > 4 and constants[4] is not None and [int(v) for v in constants[4].tolist()] != [1]:
        return None
    width, start, out = tuned[-1], kernel.base, kernel.output_size[-1]
    if tuple(kernel.output_size) != (*tuned[:-1], out) or not 0 < out < width:
        return None
    pad = relayout.MAX_DIMS

    def sized(size: tuple[int, ...]) -> SizedPlan:
        if len(size) != rank or size[-1] != width:
            raise ValueError(f"a slice of rows of {width}: given {list(size)}")
        rows = 1
        for d in size[:-1]:
            rows = rows * d
        if rows == 1:
            form = [(out, 1)] if out > 1 else [(1, 1)]
        else:
            form = [(rows, width), (out, 1)] if out > 1 else [(rows, width)]
        rest = (0,) * (pad - len(form))
        return SizedPlan(((*size[:-1], out),), dict(base=start, rank=len(form), size=(*(f[0] for f in form), *rest),
                                                    stride=(*(f[1] for f in form), *rest)))

    walk = [tuple(d) for d in kernel.walk]
    rest = (0,) * (pad - len(walk))
    if sized(tuned).fields != dict(base=kernel.base, rank=len(walk), size=(*(d[0] for d in walk), *rest),
                                   stride=(*(d[1] for d in walk), *rest)):
        return None
    return PlanRule(sized, ("last-axis slice", rank, width, start, out), traceable=True)


def _keeps_first_axis(step: StepSpec, constants: list[Any], rank: int) -> bool:
    """Whether a Slice's constant axes leave out axis 0: the same slice of every element of a batch, whatever
    its size."""
    if step.op_type != "Slice" or len(constants) < 2 or constants[1] is None:
        return False
    axes = constants[3] if len(constants) > 3 else None
    axes = range(len(constants[1])) if axes is None else [int(a) % rank for a in axes.tolist()]
    return 0 not in axes


def _resize_keeps_batch(step: StepSpec, constants: list[Any], rank: int) -> bool:
    """Whether a nearest Resize (or Upsample) leaves axis 0 as it is, so that its walk holds at every batch: its
    `axes` leave out 0, or its scales' first is 1 (a YOLO neck's [1, 1, 2, 2]). Sizes over every axis fix the batch,
    and are not taken."""
    if step.op_type not in ("Resize", "Upsample"):
        return False
    axes = _attr(step, "axes", None)
    if axes is not None:
        return 0 not in [int(a) % rank for a in axes]
    if step.op_type == "Upsample" or step.opset < 11:  # X, scales (Upsample-7: the scales attribute)
        scales = constants[1] if len(constants) > 1 and constants[1] is not None else _attr(step, "scales", None)
    else:  # X, roi, scales, sizes
        if len(constants) > 3 and constants[3] is not None and len(constants[3]):
            return False
        scales = constants[2] if len(constants) > 2 else None
    if scales is None or len(scales) != rank:
        return False
    return float(np.asarray(scales, dtype=np.float64).reshape(-1)[0]) == 1.0


# a Slice of constant bounds and a Gather by constant indices: one walk of the data either way
for _op, _name, _example in (("Slice", "cpu.slice.native", "Swin's shifted windows"),
                             ("Gather", "cpu.gather.slice", "a forecaster's last time step")):
    register(Tactic(
        name=_name, op_type=_op, domain="", device="cpu", dtypes=(_F32,),
        supports=_slice_supports, configure=_configure, prepare=_prepare_slice, layout="channels_last",
        available=relayout.available, native=True,
        description=f"{_op} by constants as one strided copy in kiln's C (4-D: NHWC), a native-segment member "
                    f"({_example})",
    ))


# ---- Resize, nearest -------------------------------------------------------------------------------------

# A nearest-neighbour Resize whose every output element is one input element at a strided place: an integer upsample
# (a YOLO neck's 2x nearest upsampling, a U-Net decoder's) repeats each NHWC row of channels, a walk with stride 0
# over the repeats; an integer downsample skips rows. Its default ran torch's interpolate outside the segment, NCHW
# copies around it (YOLOv5n at 416: 2 upsamples 1.1 ms against onnxruntime's 0.09). The walk is found from the op's
# own code on the offsets (memory_walk), so the tactic gives what the reference gives or refuses.

def _resize_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    if _attr(step, "mode", "nearest") != "nearest":
        return f"mode {_attr(step, 'mode', 'nearest')}: only nearest picks one input element per output element"
    if int(_attr(step, "antialias", 0)):
        return "antialias"
    if any(m.shape is not None and not m.constant for m in inputs[1:]):
        return "its roi, scales or sizes are computed at run time"
    return _slice_supports(step, [inputs[0]])


for _op in ("Resize", "Upsample"):
    register(Tactic(
        name=f"cpu.{_op.lower()}.nearest", op_type=_op, domain="", device="cpu", dtypes=(_F32,),
        supports=_resize_supports, configure=_configure, prepare=_prepare_slice, layout="channels_last",
        available=relayout.available, native=True,
        description=f"a nearest {_op} by constant scales or sizes as one strided copy in kiln's C (4-D: NHWC; an "
                    "integer upsample repeats rows of channels), a native-segment member",
    ))
